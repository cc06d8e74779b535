"""The live compare (gmlx_lab.live, notebook 06): streamed columns, per-token KL against fp16, cache holdings."""

from __future__ import annotations

import numpy as np
import pytest

import gmlx_lab
from gmlx_lab import kv_inspect, widgets
from gmlx_lab.live import LiveCompare, quantized_tokens
from gmlx_lab.measure.fidelity import fidelity


@pytest.fixture(scope="module")
def bundled():
    return gmlx_lab.load("teaching-llama")


@pytest.fixture(scope="module")
def prompt(bundled):
    return kv_inspect.eval_tokens(bundled[1], 300)


def test_columns_stream_in_lock_step_with_kl_against_fp16(bundled, prompt) -> None:
    model, tokenizer = bundled
    live = LiveCompare(model, tokenizer, prompt, ["affine2", "kvarn4:tail=0"], max_tokens=6)
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
    assert (kvarn.bits, kvarn.v_bits, kvarn.tail, kvarn.family) == (8, 4, 0, "kvarn k8v4 tail=0")
    assert kvarn.kl == pytest.approx(float(np.median(live.columns[2].kl)))


def test_bad_input_is_refused_with_what_is_accepted(bundled, prompt) -> None:
    model, tokenizer = bundled
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        LiveCompare(model, tokenizer, prompt, ["affine4"], max_tokens=0)
    with pytest.raises(ValueError, match="the prompt is empty"):
        LiveCompare(model, tokenizer, [], ["affine4"])
    with pytest.raises(ValueError, match="accepted: 2, 3, 4, 6, 8"):
        LiveCompare(model, tokenizer, prompt, ["affine5"])
    with pytest.raises(ValueError, match="at least one scheme besides fp16"):
        widgets.compare(model, tokenizer, schemes=["fp16"], autorun=False)


def test_app_streams_every_column_and_enables_only_the_controls_that_apply(bundled) -> None:
    model, tokenizer = bundled
    every = widgets.compare(model, tokenizer, autorun=False)  # by default every registered scheme (plug-ins too)
    assert list(every.schemes) == [n for n in gmlx_lab.SCHEMES if n != "fp16"] and every.live is None
    app = widgets.compare(model, tokenizer, context_tokens=160, max_tokens=5, tail=1024,
                          schemes=["affine", "affine_rot", "kvarn"])
    assert [len(c.tokens) for c in app.live.columns] == [5] * (1 + len(app.schemes))
    assert len(app.columns.children) == len(app.live.columns) and not app.run.disabled
    assert "done: 5+ tokens per column" in app.status.value and "context 170 tokens" in app.status.value
    kvarn_box = app.columns.children[[c.scheme for c in app.live.columns].index("kvarn")].value
    assert "nothing quantized yet" in kvarn_box and "sink 128" in kvarn_box  # tail 1024 covers 170 tokens
    assert "title='token 0: KL" in kvarn_box and len(app.strip.data) >= 2  # shaded tokens, the equal-memory strip
    assert not (app.tail.disabled or app.v_bits.disabled or app.k_bits.disabled)
    assert "cache: 170 tokens, all fp16" in app.columns.children[0].value
    app.schemes["kvarn"].value = False  # only affine schemes left: one width, no tail
    assert app.tail.disabled and app.v_bits.disabled and not app.k_bits.disabled
    assert "fp16 tail: no chosen scheme" in app.applies.value
    app.generate()
    assert [c.scheme for c in app.live.columns] == ["fp16"] + [n for n in app.schemes if n != "kvarn"]
