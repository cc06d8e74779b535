"""The rolling window (max_kv_size) under every scheme: flat memory, the same tokens held, mlx-lm compatibility."""

import mlx.core as mx
import pytest
from conftest import tiny_llama
from mlx_lm.generate import generate_step, stream_generate
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache
from schemes import WINDOW, example_id, examples

import gmlx_lab
from gmlx_lab import kv_inspect
from gmlx_lab.cache import window

SCHEMES = [(s, o) for s, o in examples(windowed=True) if s != "fp16"]  # every scheme that rolls (tests/schemes.py)
N = WINDOW  # kvarn with tail 0 needs sink 128 + two groups of 128
PROBE = (N, 2 * N, 4 * N)


@pytest.fixture(scope="module")
def model():
    return tiny_llama(layers=2)  # two layers: both quantize (no last-of-deep-stack fp16 layer)


def run(model, cache, probe: tuple[int, ...] = PROBE) -> tuple[dict[int, tuple], mx.array]:
    """A 100-token prompt, then greedy tokens one at a time until the cache holds max(probe) tokens;
    at each probe: (bytes, held positions, tokens held)."""
    seen = {}
    logits = model(mx.array([[i % 300 for i in range(100)]]), cache=cache)
    while cache[0].offset < max(probe):
        logits = model(mx.argmax(logits[:, -1:], axis=-1), cache=cache)
        mx.eval(logits)
        if cache[0].offset in probe:
            seen[cache[0].offset] = (cache.nbytes, cache[0].held_positions(), cache[0].held)
    return seen, logits


@pytest.fixture(scope="module")
def fp16_window(model):
    return run(model, gmlx_lab.make_cache(model, "fp16", max_kv_size=N, quiet=True))[0]


@pytest.mark.parametrize(("scheme", "options"), [("fp16", {}), *SCHEMES], ids=example_id)
def test_four_windows_stay_flat_and_hold_what_fp16_holds(model, fp16_window, scheme, options):
    seen, logprobs = run(model, gmlx_lab.make_cache(model, scheme, max_kv_size=N, quiet=True, **options))
    (b1, _, h1), (b2, _, h2), (b4, pos4, h4) = (seen[t] for t in PROBE)
    assert b2 == b4 and b1 <= b2, (b1, b2, b4)  # nothing grows once the window is full
    assert h1 == N and h2 <= N and h4 <= N
    assert pos4[0] == (0, 128) and pos4[-1][1] == 4 * N  # the sink and the newest tokens
    assert [seen[t][1] for t in PROBE] == [fp16_window[t][1] for t in PROBE]  # the same tokens as an fp16 window
    assert mx.all(mx.isfinite(logprobs)).item()


def test_generate_step_runs_a_window_several_times_over(model):
    """Unmodified mlx-lm generation (generate_step's pipelining) through windowed kvarn caches with a tail."""
    cache = gmlx_lab.make_cache(model, "kvarn", bits=6, kv_tail_tokens=128, max_kv_size=512, quiet=True)
    prompt = mx.array([i % 300 for i in range(500)])
    out = [tok for tok, _ in generate_step(prompt, model, prompt_cache=cache, max_tokens=300)]
    assert len(out) == 300 and cache[0].dropped >= 256 and cache[0].held <= 512 + 1


def test_windowed_cache_saves_loads_and_trims(model, tmp_path):
    cache = gmlx_lab.make_cache(model, "kvarn", bits=4, kv_tail_tokens=0, max_kv_size=384, quiet=True)
    prompt = mx.array([[i % 300 for i in range(700)]])
    mx.eval(model(prompt[:, :690], cache=cache))
    for t in range(690, 700):
        mx.eval(model(prompt[:, t:t + 1], cache=cache))
    assert cache[0].dropped > 0 and cache[0].held <= 384
    save_prompt_cache(str(tmp_path / "c.safetensors"), cache)
    loaded = load_prompt_cache(str(tmp_path / "c.safetensors"))
    assert [c.held_positions() for c in loaded] == [c.held_positions() for c in cache]
    nxt = mx.array([[7]])
    assert mx.array_equal(model(nxt, cache=cache), model(nxt, cache=loaded)).item()
    assert cache.trim(1) == 1 if hasattr(cache, "trim") else [c.trim(1) for c in cache] == [1] * len(cache)


def test_stream_generate_on_the_bundled_model_past_the_window():
    model, tokenizer = gmlx_lab.load()
    cache = gmlx_lab.make_cache(model, "kvarn", bits=6, kv_tail_tokens=0, max_kv_size=384, quiet=True)
    prompt = tokenizer.decode(kv_inspect.eval_tokens(tokenizer, 300))
    text = "".join(r.text for r in stream_generate(model, tokenizer, prompt, max_tokens=200, prompt_cache=cache))
    assert text and cache[0].offset > 384 >= cache[0].held and cache[0].dropped > 0


def test_windows_that_cannot_work_are_refused(model):
    with pytest.raises(ValueError, match="max_kv_size=300 cannot hold the 128-token sink, the 128-token fp16 tail"):
        gmlx_lab.make_cache(model, "kvarn", kv_tail_tokens=128, max_kv_size=300)
    with pytest.raises(ValueError, match="accepted: an int >= 256"):
        gmlx_lab.make_cache(model, "fp16", max_kv_size=200)
    with pytest.raises(ValueError, match="accepted: an int >= 256"):
        gmlx_lab.make_cache(model, "affine", max_kv_size="512")
    assert window.minimum() == 256 and window.minimum(1024) == 128 + 1024 + 256


def test_the_kv_line_and_report_name_the_window(model):
    chosen = gmlx_lab.policy(model, "kvarn", bits=4, kv_tail_tokens=0, max_kv_size=512)
    assert "rolling window of 512 tokens (quantized" in str(chosen)
    assert chosen.as_dict()["max_kv_size"] == 512
    assert gmlx_lab.policy(model, "kvarn").as_dict()["max_kv_size"] is None
