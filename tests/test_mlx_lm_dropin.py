"""Our caches inside unmodified mlx-lm models: forward passes, generation, the attention seam, save/load."""

import mlx.core as mx
import pytest
from conftest import tiny_llama
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import load_prompt_cache, make_prompt_cache, save_prompt_cache
from schemes import example_id, examples

import gmlx_lab

SCHEMES = examples()  # every registered scheme with the examples its entry declares (tests/schemes.py)


@pytest.fixture(scope="module")
def tokens():
    mx.random.seed(7)
    return mx.random.randint(0, 300, (1, 420))


def run_chunks(model, cache, tokens, chunks):
    start, logits = 0, None
    for n in chunks:
        logits = model(tokens[:, start : start + n], cache=cache)
        start += n
    return logits


@pytest.mark.parametrize("scheme, options", SCHEMES, ids=example_id)
def test_forward_close_to_mlx_lm_kvcache_and_uses_attend(model, tokens, scheme, options, monkeypatch):
    calls = []
    cache = gmlx_lab.make_cache(model, scheme, quiet=True, **options)
    with_attend = [c for c in cache if hasattr(c, "attend")]
    for cls in {type(c) for c in with_attend}:
        attend = cls.attend
        monkeypatch.setattr(cls, "attend", lambda self, *a, _f=attend, **k: calls.append(1) or _f(self, *a, **k))
    ref = run_chunks(model, make_prompt_cache(model), tokens, [300, 60, 60])
    out = run_chunks(model, cache, tokens, [300, 60, 60])
    assert len(calls) == 3 * len(with_attend)  # those layers attended through the cache, once per chunk
    err = float(mx.abs(out - ref).max())
    width = min(options.get(k, 8) for k in ("bits", "k_bits", "v_bits"))
    tolerance = 0.01 if scheme == "fp16" else {2: 2.0, 3: 1.5, 4: 0.8}.get(width, 0.6)  # logits of a random model
    assert err < tolerance, err


@pytest.mark.parametrize("scheme, options", [(s, o) for s, o in SCHEMES if s != "fp16"],  # fp16: no attend
                         ids=example_id)
def test_a_model_reading_the_returned_kv_itself_gets_what_the_cache_attention_gives(model, tokens, scheme, options,
                                                                                   monkeypatch):
    """Model code that attends over what update_and_fetch returned (mlx's own SDPA, as mlx-lm does for a cache
    without `bits`) gets what the cache's own `attend` gives (the fused kernels on a GPU, the reference path on
    the CPU), at every call: prefill chunks and decode steps, every layer.

    Compared call by call on the same inputs, the model carrying on with the model-side result: compared as
    logits of two whole runs, a float rounding in one layer can move a value across a quantizer's rounding
    edge in the next layer's K/V, and one flipped 3-bit code is a step far larger than any rounding."""
    cache = gmlx_lab.make_cache(model, scheme, quiet=True, **options)
    attending = [c for c in cache if hasattr(c, "attend")]
    errors = []
    for cls in {type(c) for c in attending}:
        def both(self, queries, keys, values, scale, mask, _attend=cls.attend):
            routed = _attend(self, queries, keys, values, scale=scale, mask=mask)
            direct = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)
            errors.append((queries.shape[2], float(mx.abs(routed - direct).max() / mx.abs(direct).max())))
            return direct
        monkeypatch.setattr(cls, "attend", both)
    run_chunks(model, cache, tokens, [300, 60, 1, 1, 1])
    assert [n for n, _ in errors] == [n for n in (300, 60, 1, 1, 1) for _ in attending]  # every such layer and call
    tol = 1e-5 if mx.default_device() == mx.cpu else 6e-3  # float16 tensor-core products in the fused kernels
    assert max(e for _, e in errors) < tol, errors


def test_a_prompt_chunks_attention_is_evaluated_layer_by_layer_and_a_decode_step_stays_lazy(model, tokens,
                                                                                           monkeypatch):
    """Through the seam, a prompt chunk's attention output is evaluated as its layer is built (on a GPU, queued
    kernels hold every array they read, so a lazy chunk would hold every layer's decoded K/V at once); a decode
    step's is left to the model's own evaluation, so steps still pipeline."""
    from gmlx_lab import mlx_lm_hooks

    heads, dim = model.layers[0].self_attn.n_heads, model.layers[0].self_attn.head_dim
    outputs = []  # the attention outputs (B, heads, L, dim) evaluated on their own (caches evaluate other arrays)
    real_eval = mx.eval
    monkeypatch.setattr(mx, "eval", lambda *a: outputs.extend(x.shape for x in a if isinstance(x, mx.array) and
                                                              x.shape[1::2] == (heads, dim)) or real_eval(*a))
    cache = gmlx_lab.make_cache(model, "kivi", quiet=True, bits=4)
    attending = [c for c in cache if hasattr(c, "attend")]
    assert attending
    run_chunks(model, cache, tokens, [300])
    assert outputs == [(1, heads, 300, dim)] * len(attending)
    outputs.clear()
    run_chunks(model, cache, tokens[:, 300:], [mlx_lm_hooks.PROMPT_QUERIES, 1])
    assert outputs == []


@pytest.mark.parametrize("scheme, options", SCHEMES, ids=example_id)
def test_generate_step_and_save_load_roundtrip(model, tokens, scheme, options, tmp_path):
    cache = gmlx_lab.make_cache(model, scheme, quiet=True, **options)
    generated = [t for t, _ in generate_step(tokens[0, :250], model, max_tokens=12, prompt_cache=cache)]
    assert len(generated) == 12 and cache[0].offset == 250 + 12  # generate_step runs one step ahead
    path = str(tmp_path / "cache.safetensors")
    save_prompt_cache(path, cache)
    loaded = load_prompt_cache(path)
    assert [type(c) for c in loaded] == [type(c) for c in cache]
    for a, b in zip(cache, loaded):
        flat_a, flat_b = list(_leaves(a.state)), list(_leaves(b.state))
        assert len(flat_a) == len(flat_b)
        for x, y in zip(flat_a, flat_b):
            if isinstance(x, mx.array):
                assert x.dtype == y.dtype and mx.array_equal(x, y)
            else:
                assert x == y
    nxt = tokens[:, 262:264]
    assert mx.array_equal(model(nxt, cache=cache), model(nxt, cache=loaded))


def _leaves(tree):
    if isinstance(tree, (list, tuple)):
        for t in tree:
            yield from _leaves(t)
    else:
        yield tree


def test_kv_line_and_report(model, capsys):
    cache = gmlx_lab.make_cache(model, "kvarn", name="tiny-llama")
    line = capsys.readouterr().out.strip()
    assert line == "[kv] tiny-llama: kvarn6 tail=1024 -> quantized 3/4 attn layers (layer 3 fp16: last of deep stack)"
    assert [type(c).__name__ for c in cache] == ["KvarnCache"] * 3 + ["FP16Cache"]
    report = cache.policy.as_dict()
    assert report["scheme"] == "kvarn" and report["bits"] == 6
    assert [d["decision"] for d in report["layers"]] == ["kvarn"] * 3 + ["fp16"]
    gmlx_lab.make_cache(model, "affine", quiet=True)
    assert capsys.readouterr().out == ""


def test_two_layer_stack_quantizes_every_layer():
    p = gmlx_lab.policy(tiny_llama(layers=2), "affine", bits=4)
    assert [d.decision for d in p.layers] == ["affine", "affine"]
    assert str(p).endswith("-> quantized 2/2 attn layers")


def test_head_dim_64_declined_by_kvarn_not_affine(capsys):
    small = tiny_llama(layers=3, head_dim=64)
    p = gmlx_lab.policy(small, "kvarn", name="hd64")
    assert [d.decision for d in p.layers] == ["fp16"] * 3
    assert str(p) == ("[kv] hd64: kvarn6 tail=1024 -> no layer can use kvarn (layers 0,1 fp16: head_dim 64: kvarn "
                      "needs 128/256/512 (head_dim_ext=1 takes 64/96); layer 2 fp16: last of deep stack) -> "
                      "running fp16")
    assert [d.decision for d in gmlx_lab.policy(small, "affine").layers] == ["affine", "affine", "fp16"]


def test_speculative_decoding_trims_the_kvarn_tail(model, tokens):
    """mlx-lm's speculative generation rolls rejected drafts back with trim()."""
    draft = tiny_llama(layers=2, seed=1)
    cache = gmlx_lab.make_cache(model, "kvarn", quiet=True, kv_tail_tokens=32)
    cache += gmlx_lab.make_cache(draft, "kvarn", quiet=True, kv_tail_tokens=32)
    from mlx_lm.generate import speculative_generate_step

    out = [t for t, *_ in speculative_generate_step(tokens[0, :200], model, draft, num_draft_tokens=3,
                                                     max_tokens=20, prompt_cache=cache)]
    plain = [t for t, _ in generate_step(tokens[0, :200], model, max_tokens=20,
                                          prompt_cache=gmlx_lab.make_cache(model, "kvarn", quiet=True,
                                                                           kv_tail_tokens=32))]
    assert out == plain  # greedy: speculation must not change the tokens


def test_speculative_decoding_with_a_kvarn_draft_cache_at_tail_0(model, tokens):
    """The draft cache takes one token per update and is trimmed by up to num_draft - 1 tokens: with no tail the
    trim reaches into the record the last update sealed (a 255-token prompt: the second draft token completes a
    group of 128), which the cache unseals from its fp16 copy."""
    from mlx_lm.generate import speculative_generate_step

    draft = tiny_llama(layers=2, seed=2)
    prompt = tokens[0, :255]
    cache = gmlx_lab.make_cache(model, "fp16", quiet=True)
    draft_cache = gmlx_lab.make_cache(draft, "kvarn", quiet=True, kv_tail_tokens=0)
    out = [(int(t), accepted) for t, _, accepted in speculative_generate_step(
        prompt, model, draft, num_draft_tokens=3, max_tokens=12, prompt_cache=cache + draft_cache)]
    assert not all(accepted for _, accepted in out)  # some drafts were rejected, so the draft cache was trimmed
    plain = [int(t) for t, _ in generate_step(prompt, model, max_tokens=12,
                                              prompt_cache=gmlx_lab.make_cache(model, "fp16", quiet=True))]
    assert [t for t, _ in out] == plain
    assert all(c.n_records >= 1 for c in draft_cache)


@pytest.mark.parametrize(
    "scheme, options, message",
    [
        ("int4", {}, "unknown scheme 'int4'; accepted: fp16, affine, affine_rot, float, kivi, kvarn, turboquant"),
        ("affine", {"bits": 5}, "affine: bits=5 is not supported; accepted: 2, 3, 4, 6, 8"),
        ("affine", {"group_size": 16}, "group_size=16 is not supported; accepted: 32, 64, 128"),
        ("kvarn", {"bits": 7}, "kvarn: bits=7 is not supported; accepted: 2, 3, 4, 5, 6, 8"),
        ("kvarn", {"v_bits": 1}, "v_bits=1 is not supported"),
        ("kvarn", {"kv_tail_tokens": -5}, "kv_tail_tokens=-5 is not supported; accepted: an int >= 0"),
        ("kvarn", {"group_size": 64}, r"unknown option\(s\) \['group_size'\]"),
        ("fp16", {"bits": 8}, r"unknown option\(s\) \['bits'\]"),
        ("affine", {"bits": "8"}, "must be an int"),
    ],
)
def test_bad_options_are_clear_errors(model, scheme, options, message):
    with pytest.raises(ValueError, match=message):
        gmlx_lab.make_cache(model, scheme, quiet=True, **options)


@pytest.fixture(scope="module")
def bundled():
    return gmlx_lab.load()


@pytest.mark.parametrize("scheme, options", [("fp16", {}), ("affine", {"bits": 4}), ("kvarn", {"kv_tail_tokens": 0})])
def test_mlx_lm_generate_and_stream_generate_on_bundled_model(bundled, scheme, options):
    """The public mlx-lm entry points, unchanged, on the bundled model with each scheme's caches."""
    import mlx_lm

    model, tokenizer = bundled
    prompt = "ROMEO:\n" + "But soft, what light through yonder window breaks? " * 30
    cache = gmlx_lab.make_cache(model, scheme, quiet=True, **options)
    text = mlx_lm.generate(model, tokenizer, prompt, max_tokens=16, prompt_cache=cache)
    assert len(text.strip()) > 0
    prompt_len = len(tokenizer.encode(prompt))
    assert cache[0].offset >= prompt_len + 15
    if scheme == "kvarn":
        assert cache[0].n_records >= 1  # the prompt is long enough to seal a record at tail 0
    cache = gmlx_lab.make_cache(model, scheme, quiet=True, **options)
    pieces = [r.text for r in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=16, prompt_cache=cache)]
    assert "".join(pieces).strip() == text.strip()  # greedy: same text through both entry points
