"""Equal-memory comparisons (gmlx_lab.measure.tradeoff, notebooks 06, 07) and their figures (viz/tradeoff_figures)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

import gmlx_lab
from gmlx_lab import kv_inspect, viz
from gmlx_lab.measure import tradeoff
from gmlx_lab.measure.fidelity import fidelity
from gmlx_lab.measure.memory import memory_report

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


@pytest.fixture(scope="module")
def model():
    return gmlx_lab.load("teaching-llama")[0]


def test_kvarn_is_fp16_until_its_first_record_is_sealed(model) -> None:
    """Notebook 06: sink 128 + tail 128 + a full live group + the newest token, so kvarn2 = kvarn4 = fp16 below."""
    assert tradeoff.first_quantized_context(model, "kvarn4:tail=128") == 385
    assert tradeoff.first_quantized_context(model, "kvarn2:tail=0") == 257
    assert tradeoff.first_quantized_context(model, "affine4") == 1
    assert tradeoff.first_quantized_context(model, "fp16") is None
    at = {s: tradeoff.bytes_per_token(model, s, 384) for s in ("fp16", "kvarn2:tail=128", "kvarn4:tail=128")}
    assert len(set(at.values())) == 1
    assert tradeoff.bytes_per_token(model, "kvarn2:tail=128", 385) < tradeoff.bytes_per_token(
        model, "kvarn4:tail=128", 385) < tradeoff.bytes_per_token(model, "fp16", 385)


def test_crossover_is_where_the_real_caches_cross(model) -> None:
    """Notebook 06/07's numbers: kvarn4 tail=128 is smaller than affine8 from 1025 tokens, than affine4 from 35713."""
    assert tradeoff.crossover(model, "kvarn4:tail=128", "affine8") == 1025
    assert tradeoff.crossover(model, "kvarn4:tail=128", "affine4") == 35713
    assert tradeoff.crossover(model, "affine2", "affine4", max_context=64) == 1  # always smaller
    assert tradeoff.crossover(model, "affine4", "affine2", max_context=64) is None  # never
    for context, smaller in ((1000, False), (1025, True)):  # the caches themselves, not the formulas
        report = memory_report(model, ["affine8", "kvarn4:tail=128"], context=context)
        assert (report["kvarn4 tail=128"].resident < report["affine8 g64"].resident) is smaller
        formula = tradeoff.bytes_per_token(model, "kvarn4:tail=128", context) * context
        assert report["kvarn4 tail=128"].resident == formula
    with pytest.raises(ValueError, match="max_context must be >= 1"):
        tradeoff.crossover(model, "kvarn4", "affine4", max_context=0)


def test_gemma_crosses_at_the_same_contexts(gemma: dict) -> None:
    """Notebook 06's Gemma claim: its quantized global layers follow the same per-value arithmetic."""
    gemma = gemma["model"]  # the session's Gemma (tests/conftest.py): loading it again costs a minute on CI
    assert tradeoff.crossover(gemma, "kvarn4:tail=128", "affine8") == 1025
    assert tradeoff.crossover(gemma, "kvarn4:tail=128", "affine4") == 35713


def test_size_curves_and_bytes_per_token(model) -> None:
    curves = tradeoff.size_curves(model, ["fp16", "affine4", "kvarn4:tail=0"], [128, 1024, 65536])
    assert curves["fp16"] == [4096.0] * 3 and len(set(curves["affine4 g64"])) == 1  # affine: flat per token
    kvarn = curves["kvarn4 tail=0"]
    assert kvarn[0] == 4096.0 and kvarn[0] > kvarn[1] > kvarn[2] > curves["affine4 g64"][0] * 0.9
    with pytest.raises(ValueError, match="context must be >= 1"):
        tradeoff.bytes_per_token(model, "fp16", 0)
    with pytest.raises(ValueError, match="contexts must be a non-empty list"):
        tradeoff.size_curves(model, ["fp16"], [])


def test_points_from_committed_results_and_from_a_live_run(model) -> None:
    data = json.loads((RESULTS / "fidelity-teaching-llama-cpu.json").read_text())
    points = tradeoff.tradeoff_points(data)
    labels = [p.label for p in points]
    assert "fp16" in labels and "kvarn k8v4 tail=128" in labels and not any("layer" in x for x in labels)
    by = {p.label: p for p in points}
    row = next(s for s in data["result"]["schemes"] if s["label"] == "kvarn4 tail=128")
    assert by["kvarn4 tail=128"].bytes_per_token * 1528 == row["cache_bytes"]  # 1400 prefill + 128 decode
    assert (by["kvarn4 tail=128"].family, by["affine4 g64"].family) == ("kvarn tail=128", "affine")
    tokens = kv_inspect.eval_tokens(gmlx_lab.load("teaching-llama")[1], 300)
    result = fidelity(model, None, tokens, ["fp16", "affine4", "kvarn4:tail=0"], prefill=280, decode=8)
    live = tradeoff.tradeoff_points(result)
    assert [p.label for p in live] == ["fp16", "affine4 g64", "kvarn4 tail=0"]
    assert live == tradeoff.tradeoff_points(result.to_dict())
    assert live[2].kl == result["kvarn4:tail=0"].decode_median_kl and live[2].context == 288
    with pytest.raises(ValueError, match="not a fidelity result: no 'prefill'"):
        tradeoff.tradeoff_points({"model": "x", "schemes": []})


# -- figures: the lab's figure rules (each trace distinguishable, every axis titled, short numbers) -------------


def _points():
    return tradeoff.tradeoff_points(json.loads((RESULTS / "fidelity-teaching-llama-cpu.json").read_text()))


def test_figures_follow_the_lab_rules(model) -> None:
    points = _points()
    contexts = [128, 1024, 8192]
    figs = {
        "tradeoff": viz.tradeoff_figure(points),
        "size": viz.size_figure(tradeoff.size_curves(model, ["fp16", "affine4", "kvarn4:tail=128", "kvarn4:tail=0"],
                                                     contexts), contexts,
                                {"kvarn4 tail=128 < affine8": 1025, "kvarn4 tail=128 < affine4": 35713}),
        "published": viz.published_vs_ours_figure(viz.GMLX_KL_TABLE["rows"], points),
    }
    for name, fig in figs.items():
        assert viz.figure_problems(fig) == [], name
    trade = figs["tradeoff"]
    names = [t.name for t in trade.data]
    assert names == ["affine", "kvarn tail=0", "kvarn tail=128", "kvarn tail=128, K and V widths differ",
                     "affine_rot"]  # every scheme drawn, whatever its widths
    def labels(trace) -> list[str]:  # each width's label: beside its marker, or on an arrow in the trace's colour
        moved = {(a.x, a.y): a.text for a in trade.layout.annotations if a.arrowcolor == trace.marker.color}
        return [t or moved.get((x, math.log10(y)), "") for t, x, y in zip(trace.text, trace.x, trace.y)]

    assert trade.layout.yaxis.type == "log" and labels(trade.data[0]) == ["2", "3", "4", "6", "8"]
    split = trade.data[3]
    by = {p.label: p for p in points}
    assert labels(split) == ["k8v4", "k4v8"] and split.x[0] == by["kvarn k8v4 tail=128"].bytes_per_token / 1024
    assert split.mode == "markers+text" and split.marker.color == trade.data[2].marker.color  # its family's colour
    tails = trade.data[1], trade.data[2]  # two tails of one scheme: told apart by shade, marker and dash
    assert len({(t.line.color, t.marker.symbol, t.line.dash) for t in tails}) == 2
    assert tails[0].line.color != tails[1].line.color and tails[0].line.dash != tails[1].line.dash
    assert trade.layout.xaxis.range[0] == 0  # no axis that magnifies a small difference in memory
    assert trade.layout.shapes[0].x0 == 4.0  # fp16's 4 KiB per token: the baseline
    assert "35.7K tokens" in figs["size"].layout.annotations[1].text
    pub = figs["published"]
    assert [t.name for t in pub.data][:2] == ["affine (gmlx)", "kvarn (gmlx)"]
    assert "kvarn tail=128, K and V widths differ (ours)" in [t.name for t in pub.data]
    assert {t.xaxis for t in pub.data} == {"x", "x2"} and pub.layout.yaxis2.matches == "y"  # one KL axis


def test_figures_refuse_what_they_cannot_draw(model) -> None:
    points = _points()
    other = [tradeoff.TradeoffPoint("other", "fp16", "fp16", None, None, None, 10, 1.0, 1.0, 0.0)]
    with pytest.raises(ValueError, match="one model at one context"):
        viz.tradeoff_figure(points + other)
    with pytest.raises(ValueError, match="at least one TradeoffPoint"):
        viz.tradeoff_figure([])
    with pytest.raises(ValueError, match="has 1 values for 2 contexts"):
        viz.size_figure({"fp16": [1.0]}, [1, 2])


def test_kl_shades_one_fixed_log_scale() -> None:
    lo, hi = viz.KL_SCALE
    assert viz.kl_color(0.0) is None and viz.kl_color(lo / 2) is None and viz.kl_color(float("nan")) is None
    assert viz.kl_color(hi) == viz.kl_color(10 * hi) != viz.kl_color(lo)  # clipped above, shaded from lo up
    legend = viz.kl_legend_html()
    assert "1e-5" in legend and "1e0" in legend and "fixed log scale" in legend


def test_pairs_compare_at_equal_width_and_at_equal_memory() -> None:
    """Notebook 07's sentences: kvarn against affine at the same width, and against the affine caches of about its
    size; the verdict word follows the numbers."""
    points = _points()
    width = tradeoff.pairs(points, by="width")
    labels = {(a.label, b.label) for a, b in width}
    assert labels >= {("kvarn4 tail=0", "affine4 g64"), ("kvarn4 tail=128", "affine4 g64")}
    assert all(a.bits == b.bits and not a.split for a, b in width)
    memory = tradeoff.pairs(points, by="memory")
    assert [(a.label, b.label) for a, b in memory][:1] == [("kvarn2 tail=0", "affine4 g64")]
    assert all(abs(a.share_of_fp16 - b.share_of_fp16) < 0.02 for a, b in memory)
    by = {p.label: p for p in points}
    assert tradeoff.versus(by["kvarn2 tail=0"], by["affine4 g64"]).startswith(
        "kvarn2 tail=0 (37.6% of fp16, KL 2.1e-03) beside affine4 g64 (37.1%")
    assert tradeoff.versus(by["affine4 g64"], by["kvarn2 tail=0"]).endswith("KL ratio 2.3")
    assert tradeoff.versus(by["affine4 g64"], by["affine4 g64"]).endswith("KL ratio 1")
    with pytest.raises(ValueError, match="accepted: 'width', 'memory'"):
        tradeoff.pairs(points, by="bits")
    with pytest.raises(ValueError, match="two points with KL > 0"):
        tradeoff.versus(by["fp16"], by["affine4 g64"])
