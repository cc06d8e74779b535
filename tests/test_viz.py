"""The notebook library: region geometry, byte formulas, normalization history, captures, figures, widgets."""


import mlx.core as mx
import numpy as np
import pytest
from conftest import random_kv

import gmlx_lab
from gmlx_lab import kv_inspect, viz
from gmlx_lab.cache import KvarnCache
from gmlx_lab.cache.kvarn import records
from gmlx_lab.models import specimen


@pytest.mark.parametrize("context,tail", [(0, 0), (100, 0), (128, 0), (300, 0), (700, 128), (700, 256), (1300, 1024)])
def test_region_geometry_matches_the_cache(context: int, tail: int) -> None:
    cache = KvarnCache(4, 4, kv_tail_tokens=tail)
    if context:
        k, v = random_kv(context, heads=1)
        for s in range(0, context, 250):  # the last chunk's tokens wait for the next update to be sealed
            cache.update_and_fetch(k[:, :, s : s + 250], v[:, :, s : s + 250])
    newest = (context - 1) % 250 + 1 if context else 0
    assert records.region_tokens(context, tail, newest) == cache.region_tokens()
    cache.seal()
    assert records.region_tokens(context, tail) == cache.region_tokens()


def test_kvarn_layer_bytes_match_the_cache() -> None:
    context, tail = 700, 128
    cache = KvarnCache(4, 6, kv_tail_tokens=tail)
    k, v = random_kv(context, heads=1)
    cache.update_and_fetch(k, v)
    cache.seal()
    shape = viz.LayerShape("attention", 1, 128, 128)
    options = {"k_bits": 4, "v_bits": 6, "kv_tail_tokens": tail}
    assert viz.layer_bytes(shape, "kvarn", context, options) == cache.nbytes - cache.regions()["reserve"]


def test_fp16_and_affine_formulas() -> None:
    shape = viz.LayerShape("attention", 2, 128, 128)
    assert viz.layer_bytes(shape, "fp16", 10, {}) == 2 * 10 * 256 * 2
    assert viz.layer_bytes(shape, "affine", 10, {"bits": 8, "group_size": 64}) == 2 * 10 * 256 * (1 + 4 / 64)
    window = viz.LayerShape("sliding-window", 1, 128, 128, window=128)
    assert viz.layer_bytes(window, "fp16", 1000, {}) == viz.layer_bytes(window, "fp16", 128, {})


def test_normalize_history_keeps_the_round_records_keeps() -> None:
    k, _ = random_kv(128, heads=1)
    tile = np.array(mx.hadamard_transform(k[0, 0]).T)
    history, best = viz.normalize_history(tile, iters=16)
    _, _, before, after = records.normalize(mx.array(tile), 16)
    assert len(history) == 17
    assert history[0] == pytest.approx(before.item(), rel=1e-5)
    assert history[best] == pytest.approx(after.item(), rel=1e-5)
    assert history[best] == min(history)


def test_quant_error_orders() -> None:
    k, _ = random_kv(128, heads=1)
    x = np.array(k[0, 0])
    errs = [viz.quant_error(x, "affine", b) for b in (2, 4, 8)]
    assert errs[0] > errs[1] > errs[2] > 0
    assert viz.quant_error(x, "affine_rot", 4) < viz.quant_error(x, "affine", 4)  # K has outlier channels
    assert viz.quant_error(x, "kvarn", 4) < errs[0]
    with pytest.raises(ValueError, match="needs a multiple of 128 tokens"):
        viz.quant_error(x[:100], "kvarn", 4)


def test_capture_reads_kv_and_attention(model) -> None:
    cap = kv_inspect.capture(model, list(range(1, 161)), attention=True)
    assert cap.layers == [0, 1, 2, 3]
    assert cap.k(0).shape == (160, 128) and cap.v(3, 1).shape == (160, 128)
    p = cap.probs[0]
    assert np.allclose(p.sum(-1), 1, atol=1e-4)
    assert np.allclose(np.triu(p[0], 1), 0)  # causal
    mass = cap.sink_mass(sink=128)
    assert mass.shape == (4, 4) and np.all((mass >= 0) & (mass <= 1 + 1e-5))
    assert "160 tokens" in cap._repr_html_()


def test_greedy_generation_and_divergence(model) -> None:
    class Ids:  # a tokenizer stand-in: token ids are their own text
        eos_token_ids: list[int] = []

        def decode(self, ids: list[int]) -> str:
            return " ".join(map(str, ids))

    gen = kv_inspect.generate(model, Ids(), list(range(1, 200)), "kvarn", max_tokens=5, kv_tail_tokens=0)
    assert len(gen.tokens) == 5 and gen.label == "kvarn6 tail=0" and gen.cache_bytes > 0
    assert kv_inspect.first_divergence([1, 2, 3], [1, 2, 4]) == 2
    assert kv_inspect.first_divergence([1, 2], [1, 2, 3]) is None


def test_table_renders_rows_as_html() -> None:
    """The figure builders are walked in tests/test_figures.py; the table is the one non-plotly display."""
    html = viz.Table([{"a": 1, "b": 0.5199999809265137}], "cap")._repr_html_()
    assert "<table>" in html and "<caption>cap</caption>" in html and "0.52" in html and "0.5199" not in html


def test_policy_bytes_family_savings() -> None:
    curves = viz.family_curves([0, 4096], "fp16")
    assert set(curves) == set(gmlx_lab.models.FAMILIES)
    llama = curves["llama"]
    assert llama["bytes"][0] == 0 and llama["bytes"][1] > 0
    pol = gmlx_lab.policy(specimen("llama"), "kvarn")
    assert 0.5 < viz.policy_bytes(pol, 32768) / (llama["bytes"][1] * 8) < 0.6  # 3 of 4 layers at ~40%


def test_smollm2_has_attention_sinks_where_the_teaching_model_has_none() -> None:
    """Backs notebook 04: a real pretrained model parks attention on token 0; the bundled one does not."""
    smol, smol_tok = gmlx_lab.load("smollm2-135m")
    cap = kv_inspect.capture(smol, kv_inspect.eval_tokens(smol_tok, 256), attention=True)
    on_first = cap.sink_mass(sink=1, after=128).mean(axis=1)  # per layer, mean over query heads
    assert on_first[12:].mean() > 0.2 and on_first[12:].min() > 0.1  # even spread: about 1/256
    model, tok = gmlx_lab.load()
    bundled = kv_inspect.capture(model, kv_inspect.eval_tokens(tok, 256), attention=True)
    assert bundled.sink_mass(sink=1, after=128).mean(axis=1).max() < 0.05


def test_kv_explorer_opens_on_the_strongest_outlier_layer() -> None:
    from gmlx_lab import widgets

    k, v = random_kv(64, heads=1)  # channels 3, 40, 77, 114 are 20x: the outlier layer
    calm = np.random.default_rng(0).normal(size=(1, 64, 128)).astype(np.float32)
    cap = kv_inspect.Capture("toy", list(range(64)), {0: calm, 1: np.array(k[0]), 2: calm},
                             {i: calm for i in range(3)})
    layer = widgets.kv_explorer(cap).children[0].children[0]
    assert layer.value == 1
    assert widgets.kv_explorer(cap, layer=2).children[0].children[0].value == 2


def test_say_renders_markdown_from_values_and_refuses_empty_text() -> None:
    kl = 0.0137
    out = viz.say(f"kvarn2's KL is {viz.num(kl)}.", "Second paragraph.")
    assert out._repr_markdown_() == "kvarn2's KL is 0.0137.\n\nSecond paragraph."
    with pytest.raises(ValueError, match="non-empty"):
        viz.say("  ")


def test_assembled_lists_flags_templated_bullets_and_sentences_but_not_prose() -> None:
    from gmlx_lab.viz.say import assembled_lists

    bullets = "\n".join(f"- kvarn{b} tail=0 ({s}% of fp16, KL {k}) beside affine{b} g64: ratio {r}"
                        for b, s, k, r in ((2, 37.6, 0.002, 0.43), (3, 47.9, 0.0002, 0.55), (4, 46.7, 7e-05, 0.25)))
    assert len(assembled_lists(bullets)) == 1
    assert assembled_lists("\n".join(bullets.splitlines()[:2])) == []  # two bullets are a contrast, not a log
    inline = "Rotation multiplies K's error by 0.96x at 2, 0.83x at 3, 0.73x at 4, 0.64x at 6 and 0.64x at 8 bits."
    assert "4 parts" in assembled_lists(inline)[0]
    prose = ("At 4 bits kvarn's error is 0.0595, affine's after rotation 0.0866 and affine's 0.117: the records "
             "win on K, where the outlier channel is. Compare affine4 g64, affine2 g64, kvarn2 tail=128 and kivi4.")
    assert assembled_lists(prose) == []
