"""The live compare (gmlx_lab.live, notebook 06): streamed columns, per-token KL against fp16, cache holdings."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import gmlx_lab
from gmlx_lab import kv_inspect, widgets
from gmlx_lab.live import LiveCompare, quantized_tokens, quick_model, shared_draw
from gmlx_lab.measure.fidelity import fidelity


@pytest.fixture(scope="module")
def bundled():
    return gmlx_lab.load("teaching-llama")


@pytest.fixture(scope="module")
def prompt(bundled):
    return kv_inspect.eval_tokens(bundled[1], 300)


def test_columns_stream_in_lock_step_with_kl_against_fp16(bundled, prompt) -> None:
    model, tokenizer = bundled
    live = LiveCompare(model, tokenizer, prompt, ["affine2", "kvarn4:tail=0"], max_tokens=6, temperature=0)
    seen = [[len(c.tokens) for c in live.columns] for _ in live.stream()]
    assert seen == [[n] * 3 for n in range(1, 7)]  # every column one token further per step
    fp16, affine, kvarn = live.columns
    assert [c.label for c in live.columns] == ["fp16", "affine2 g64", "kvarn4 tail=0"]
    assert fp16.kl == [0.0] * 6 and fp16.tokens == kv_inspect.generate(model, tokenizer, prompt, "fp16", 6).tokens
    assert affine.tokens == kv_inspect.generate(model, tokenizer, prompt, "affine", 6, bits=2).tokens
    assert "".join(affine.pieces) == tokenizer.decode(affine.tokens)
    for col in (affine, kvarn):
        # the same KL teacher-forced along the column's own text, chunked as mlx-lm's generate_step prefills
        res = fidelity(model, tokenizer, prompt + col.tokens, [(col.scheme, col.options)], prefill=len(prompt),
                       decode=len(col.tokens) - 1, prefill_step=len(prompt) - 1).schemes[0]
        np.testing.assert_allclose(col.kl, [res.prefill_kl[-1], *res.decode_kl], rtol=0.05, atol=1e-7)
    assert np.mean(affine.kl) > 10 * np.mean(kvarn.kl) > 0  # 2-bit affine is far from fp16, 4-bit kvarn close


def test_shared_draw_samples_the_distribution_and_couples_close_ones() -> None:
    """Gumbel-max with one noise vector per step: an exact sample, and nearly the same token for nearly the same
    distribution (two columns part only where a cache moved the distribution)."""
    p = mx.array([0.5, 0.3, 0.15, 0.05])
    logp = mx.log(p)[None]
    near = mx.log(mx.array([0.49, 0.31, 0.15, 0.05]))[None]
    keys = mx.random.split(mx.random.key(1), 4000)
    draws, same = [], 0
    for key in keys:
        noise = mx.random.gumbel((4,), key=key)
        a, b = shared_draw(logp, noise, 1.0), shared_draw(near, noise, 1.0)
        draws.append(int(a.item()))
        same += int(a.item() == b.item())
    np.testing.assert_allclose(np.bincount(draws, minlength=4) / len(draws), np.array(p), atol=0.03)
    assert same / len(keys) > 0.97  # total variation 0.01: the coupled draws differ about 1% of the time
    at_half = [int(shared_draw(logp, mx.random.gumbel((4,), key=k), 0.5).item()) for k in keys[:2000]]
    assert np.mean(np.array(at_half) == 0) > 0.6  # a lower temperature favours the likeliest token
    assert int(shared_draw(logp, None, 0).item()) == 0  # temperature 0: greedy


def test_sampled_columns_share_one_random_stream(bundled, prompt) -> None:
    model, tokenizer = bundled
    specs = ["kvarn4:tail=1024", "affine2"]  # a tail over the whole context: nothing quantized, fp16's distribution
    a = LiveCompare(model, tokenizer, prompt, specs, max_tokens=12, seed=3).run()
    fp16, whole_tail, affine = a.columns
    assert whole_tail.tokens == fp16.tokens and max(whole_tail.kl) < 1e-6  # same distribution, same draws
    again = LiveCompare(model, tokenizer, prompt, [], max_tokens=12, seed=3).run()
    assert again.columns[0].tokens == fp16.tokens  # the same seed, the same draws
    other = LiveCompare(model, tokenizer, prompt, ["affine2"], max_tokens=12, seed=4).run()
    greedy = LiveCompare(model, tokenizer, prompt, ["affine2"], max_tokens=12, temperature=0).run()
    assert other.columns[0].tokens != fp16.tokens and greedy.columns[0].tokens != fp16.tokens
    assert "same random numbers" in a.sampling and "greedy" in greedy.sampling
    assert affine.shadow is not None and affine.tokens != fp16.tokens  # 2-bit affine parts from fp16's text
    # after it parts, its KL is against fp16 fed the column's own tokens (the shadow), as teacher forcing gives
    res = fidelity(model, tokenizer, prompt + affine.tokens, [(affine.scheme, affine.options)], prefill=len(prompt),
                   decode=len(affine.tokens) - 1, prefill_step=len(prompt) - 1).schemes[0]
    np.testing.assert_allclose(affine.kl, [res.prefill_kl[-1], *res.decode_kl], rtol=0.05, atol=1e-7)


def test_holdings_name_what_each_cache_keeps(bundled) -> None:
    model, tokenizer = bundled
    ids = kv_inspect.eval_tokens(tokenizer, 448)
    live = LiveCompare(model, tokenizer, ids, ["fp16", "affine4", "kvarn4:tail=128", "kvarn4:tail=1024"],
                       max_tokens=4).run()
    fp16, affine, kvarn, whole_tail = live.columns
    assert live.context == 448 + 4  # mlx-lm feeds each token back as soon as it is drawn
    assert fp16.holdings() == {"fp16": 452} and fp16.quantized_layers == "0/8"
    assert affine.holdings() == {"quantized": 452} and affine.quantized_layers == "7/8"
    held = kvarn.holdings()
    assert held == {"sink": 128, "records": 128, "live group": 68, "tail": 128}  # 452 = 128 + 128 + 68 + 128
    assert quantized_tokens(held) == 128 and kvarn.audit().resident < fp16.audit().resident
    # a tail longer than the context: nothing is quantized, the text and distributions are fp16's
    assert quantized_tokens(whole_tail.holdings()) == 0 and whole_tail.holdings()["tail"] == 452 - 128
    assert whole_tail.tokens == fp16.tokens and max(whole_tail.kl) < 1e-6


def test_points_place_each_column_by_bytes_per_token(bundled, prompt) -> None:
    model, tokenizer = bundled
    live = LiveCompare(model, tokenizer, prompt, ["affine4", "kvarn:k8v4,tail=0"], max_tokens=3).run()
    fp16, affine, kvarn = live.points()
    assert (fp16.kl, fp16.bits, fp16.share_of_fp16) == (0.0, None, 1.0)
    assert fp16.bytes_per_token == 4096  # 8 layers x 1 KV head x (128 + 128) values x 2 bytes
    assert affine.bits == affine.v_bits == 4 and affine.bytes_per_token == pytest.approx(
        7 / 8 * 4096 * (0.5 + 4 / 64) / 2 + 4096 / 8)  # 7 layers of codes + scales, the last fp16
    assert (kvarn.bits, kvarn.v_bits, kvarn.tail, kvarn.family, kvarn.width) == (8, 4, 0, "kvarn tail=0", "k8v4")
    assert kvarn.split and not affine.split and affine.width == "4"
    assert kvarn.kl == pytest.approx(float(np.median(live.columns[2].kl)))


def test_bad_input_is_refused_with_what_is_accepted(bundled, prompt) -> None:
    model, tokenizer = bundled
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        LiveCompare(model, tokenizer, prompt, ["affine4"], max_tokens=0)
    with pytest.raises(ValueError, match="the prompt is empty"):
        LiveCompare(model, tokenizer, [], ["affine4"])
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        LiveCompare(model, tokenizer, prompt, ["affine4"], temperature=-1)
    with pytest.raises(ValueError, match="accepted: 2, 3, 4, 6, 8"):
        LiveCompare(model, tokenizer, prompt, ["affine5"])
    with pytest.raises(ValueError, match="at least one scheme besides fp16"):
        widgets.compare(model, tokenizer, schemes=["fp16"], autorun=False)


def test_app_streams_every_column_and_enables_only_the_controls_that_apply(bundled) -> None:
    model, tokenizer = bundled
    every = widgets.compare(model, tokenizer, autorun=False)  # a box for every registered scheme (plug-ins too)
    assert sorted(every.schemes) == sorted(n for n in gmlx_lab.SCHEMES if n != "fp16") and every.live is None
    assert every.chosen() == list(widgets.COMPARE_DEFAULT)  # ticked: the lab's three; the rest one click away
    app = widgets.compare(model, tokenizer, context_tokens=160, max_tokens=5, tail=1024,
                          schemes=["affine", "affine_rot", "kvarn"])
    assert [len(c.tokens) for c in app.live.columns] == [5] * (1 + len(app.chosen()))
    assert len(app.columns.children) == len(app.live.columns) and not app.run.disabled
    assert "done: 5+ tokens per column" in app.status.value and "context 170 tokens" in app.status.value
    kvarn_box = app.columns.children[[c.scheme for c in app.live.columns].index("kvarn")].value
    assert "nothing quantized yet" in kvarn_box and "sink 128" in kvarn_box  # tail 1024 covers 170 tokens
    assert "title='token 0: KL" in kvarn_box and len(app.figure.data) >= 2  # shaded tokens, the equal-memory figure
    assert not (app.tail.disabled or app.v_bits.disabled or app.k_bits.disabled)
    assert "cache: 170 tokens, all fp16" in app.columns.children[0].value
    app.schemes["kvarn"].value = False  # only affine schemes left: one width, no tail
    assert app.tail.disabled and app.v_bits.disabled and not app.k_bits.disabled
    assert "fp16 tail: no chosen scheme" in app.applies.value
    app.generate()
    assert [c.scheme for c in app.live.columns] == ["fp16", "affine", "affine_rot"]


def test_app_links_k_and_v_and_clears_the_previous_run(bundled) -> None:
    model, tokenizer = bundled
    app = widgets.compare(model, tokenizer, context_tokens=0, max_tokens=3, schemes=["affine", "kvarn"])
    assert app.linked.value and app.k_bits.value == app.v_bits.value == 4
    app.k_bits.value = 2  # linked: V follows K, and K follows V
    assert app.v_bits.value == 2
    app.v_bits.value = 8
    assert app.k_bits.value == 8 and "different widths" not in app.applies.value
    app.linked.value = False  # unlinked: each moves alone, and the controls say the comparison is not equal-width
    app.k_bits.value = 2
    assert (app.k_bits.value, app.v_bits.value, app.linked.description) == (2, 8, "K ≠ V")
    assert "K and V at different widths" in app.applies.value and "K2 V8" in app.applies.value
    app.linked.value = True
    assert app.v_bits.value == 2
    assert "<th style='padding:0 12px'>tokens/s" not in app.stats.value and "median KL" in app.stats.value
    seen = []  # what the stats and the figure show while the next run streams, at each step of its progress bar
    app.progress.observe(lambda _: seen.append((app.stats.value, app.figure)), "value")
    app.generate()
    assert len(seen) >= 3 and all("appear when this run ends" in text and fig is None for text, fig in seen)
    assert app.figure is not None and "median KL" in app.stats.value


def test_quick_model_is_gemma_on_a_gpu_and_the_bundled_model_on_a_cpu() -> None:
    name, why = quick_model()
    on_gpu = mx.default_device() == mx.gpu
    assert (name == "gemma3-270m") is on_gpu and ("GPU" if on_gpu else "CPU") in why


def test_a_run_replays_without_a_kernel(bundled) -> None:
    """`replay` holds every column's token spans (shaded, numbered for the player), all shown at first, with a play
    button and a slider over the longest column; before any run it says what to do."""
    model, tokenizer = bundled
    idle = widgets.compare(model, tokenizer, autorun=False)
    with pytest.raises(ValueError, match="no run to replay"):
        idle.replay()
    app = widgets.compare(model, tokenizer, context_tokens=0, max_tokens=4, schemes=["affine", "kvarn"])
    page = app.replay().data
    assert page.count("data-i='3'") == 3 and "data-i='4'" not in page  # fp16, affine, kvarn: 4 tokens each
    assert "<button" in page and "type='range' min='0' max='4' value='4'" in page and "4 of 4 tokens" in page
    assert page.count("<script>") == 1 and "KL(fp16" in page  # the player and the shade's key
