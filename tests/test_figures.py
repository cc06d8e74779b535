"""Every figure builder in gmlx_lab.viz follows the lab's figure rules (`viz.figure_problems`), and the checker
itself catches what it is meant to catch.

The walker finds every public callable in every gmlx_lab.viz submodule whose return annotation is a plotly
Figure. Each needs an entry in EXAMPLES: its name -> a function returning a list of example figures (one per
interesting input). A builder added without an example fails `test_every_builder_has_an_example`.

To add one: write `"my_figure": lambda: [viz.my_figure(...)],` below, with inputs as small as possible (random
data from `random_kv`, specimen policies, the committed files in benchmarks/results/ through `RESULT`).
"""

from __future__ import annotations

import importlib
import inspect
import json
import pkgutil
from collections.abc import Callable

import mlx.core as mx
import numpy as np
import plotly.graph_objects as go
import pytest
from conftest import random_kv

import gmlx_lab
from gmlx_lab import viz
from gmlx_lab.cache.kvarn import records
from gmlx_lab.measure import tradeoff
from gmlx_lab.measure.capacity import batch_rows
from gmlx_lab.measure.planner import load_plan_results
from gmlx_lab.measure.verdict import floor_evidence, load_verdict
from gmlx_lab.models import specimen

RESULT = viz.benchmark_results


def _k() -> np.ndarray:
    k, _ = random_kv(256, heads=1)
    return np.array(k[0, 0])


def _record(kind: str = "k") -> records.Records:
    return viz.record_of(_k()[128:], 4, kind)


def _fidelity_dict() -> dict:
    decode = [1e-3, 2e-3, 1e-3, 3e-3]
    return {"model": "toy", "schemes": [
        {"label": "kvarn4 tail=0", "prefill_kl": [0.0, 0.0, 1e-4, 2e-4, 3e-4, 2e-4], "decode_kl": decode},
        {"label": "kvarn4 tail=128", "prefill_kl": [0.0, 0.0, 0.0, 1e-4, 2e-4, 2e-4], "decode_kl": decode},
        {"label": "kvarn4 tail=1024", "prefill_kl": [0.0] * 6, "decode_kl": [0.0] * 4}]}


def _beyond(section: str) -> dict:
    runs = RESULT("beyond-kl-teaching-llama-cpu.json")["beyond-kl-teaching-llama-cpu.json"]["sections"]
    return runs[section]["drafts"][0]["result"] if section == "draft" else runs[section]["result"]


def _field_rows(kind: str) -> list[dict]:
    """Rows of one field case (measure.field.field_rows' shape), one of them with KL 0."""
    base = {"model": "toy", "policy": "default", "length": 1024, "kind": kind, "machine": "cpu",
            "fp16_bytes_per_token": 4096.0}
    rows = []
    for i, (spec, label, scheme, share, kl) in enumerate([
            ("fp16", "fp16", "fp16", 1.0, 0.0), ("affine4", "affine4 g64", "affine", 0.37, 4e-3),
            ("kvarn4", "kvarn4 tail=1024", "kvarn", 1.0, 0.0), ("kivi2", "kivi2 tail=128", "kivi", 0.31, 2e-2),
            ("turboquant4", "turboquant4", "turboquant", 0.36, 3e-3)]):
        hits = 24 - 3 * i
        low, high = gmlx_lab.measure.metrics.wilson_interval(hits, 24)
        rows.append({**base, "spec": spec, "label": label, "scheme": scheme, "bytes_per_token": 4096 * share,
                     "decode_median_kl": kl, "top1": 1 - kl, "hits": hits, "asked": 24, "accuracy": hits / 24,
                     "wilson_low": low, "wilson_high": high})
    return rows


def _policies() -> list:
    return [gmlx_lab.policy(specimen(f), "kvarn") for f in ("llama", "gemma3", "deepseek_v3")]


def _shapes() -> dict:
    return {"attention": viz.LayerShape("attention", 1, 128, 128),
            "sliding window 128": viz.LayerShape("sliding-window", 1, 128, 128, window=128),
            "recurrent": viz.LayerShape("recurrent", 0, 0, 0, fixed_bytes=300_000)}


def _normalize_slider() -> go.Figure:
    tile = np.random.default_rng(0).normal(size=(8, 8)) * np.where(np.arange(8) == 2, 6.0, 1.0)[:, None]
    return viz.normalize_slider(tile, viz.normalize_rounds(tile, 3))


def _toy_normalize() -> go.Figure:
    tile = np.random.default_rng(0).normal(0, 1, (8, 8)) * np.array([1, 1, 6, 1, 1, 1, 1, 1])[:, None]
    scaled, score = viz.normalize_rounds(tile, 2)[2]
    return viz.normalize_toy_figure(tile, scaled, 2, score)


def _errors() -> list[dict]:
    return [{"method": f"affine g{g} {kv}", "bits": b, "error": 0.51999998 / b / g * (1.3 if kv == "V" else 1)}
            for g in (32, 64, 128) for kv in "KV" for b in (2, 4, 8)]


SIZE_CONTEXTS = [128, 1024, 8192]


def _tradeoff_points() -> list:
    return tradeoff.tradeoff_points(RESULT("fidelity-teaching-llama-cpu.json")["fidelity-teaching-llama-cpu.json"])


def _size_curves() -> dict:
    model = gmlx_lab.load("teaching-llama")[0]
    return tradeoff.size_curves(model, ["fp16", "affine4", "kvarn4:tail=128", "kvarn4:tail=0"], SIZE_CONTEXTS)


EXAMPLES: dict[str, Callable[[], list[go.Figure]]] = {
    "affine_row_figure": lambda: [viz.affine_row_figure(viz.affine_row(_k()[0]))],
    "group_error_figure": lambda: [viz.group_error_figure(viz.affine_row(viz.outlier_row(12.0), 4, 32))],
    "error_figure": lambda: [viz.error_figure(_errors())],
    "channel_figure": lambda: [viz.channel_figure(_k())],
    "butterfly_figure": lambda: [viz.butterfly_figure(viz.butterfly_stages(np.eye(8)[2] * 8 + 0.1), s)
                                 for s in range(4)],
    "record_figure": lambda: [viz.record_figure(_record("k")), viz.record_figure(_record("v"))],
    "imbalance_figure": lambda: [viz.imbalance_figure(*viz.normalize_history(viz.hadamard(_k()[128:]).T))],
    "normalize_toy_figure": lambda: [_toy_normalize()],
    "code_histogram": lambda: [viz.code_histogram(_record())],
    "butterfly_slider": lambda: [viz.butterfly_slider(viz.butterfly_stages(np.eye(8)[2] * 8 + 0.1))],
    "normalize_slider": lambda: [_normalize_slider()],
    "regions_slider": lambda: [viz.regions_slider(128), viz.regions_slider(1024, start=2048, max_context=2048)],
    "slider_figure": lambda: [viz.slider_figure([viz.regions_bar(c, 128, max_context=512) for c in (256, 512)],
                                                ["256", "512"], "context: ", active=1)],
    "regions_bar": lambda: [viz.regions_bar(1500, 1024), viz.regions_bar(900, 0, max_context=2048)],
    "regions_stream": lambda: [viz.regions_stream(2048, 128)],
    "window_stream": lambda: [viz.window_stream(3072, 128, 768)],
    "sink_mass_figure": lambda: [viz.sink_mass_figure(np.random.default_rng(0).random((4, 3)).astype(np.float32),
                                                      even=viz.even_share(384, 128))],
    "sink_layers_figure": lambda: [viz.sink_layers_figure(np.random.default_rng(0).random((18, 4)),
                                                          even=viz.even_share(384, 1)),
                                   viz.sink_layers_figure(np.random.default_rng(0).random((3, 4)), layers=[5, 11, 17])],
    "policy_strip": lambda: [viz.policy_strip(_policies())],
    "kl_strip": lambda: [viz.kl_strip(np.random.default_rng(0).random(8))],
    "position_kl_figure": lambda: [viz.position_kl_figure(_fidelity_dict())],
    "kernel_times_figure": lambda: [viz.kernel_times_figure(data)
                                    for data in RESULT("decode_attention-*.json").values()],
    "stall_figure": lambda: [viz.stall_figure(data) for data in RESULT("decode_stalls-round*.json").values()],
    "bars_figure": lambda: [viz.bars_figure([{"family": f, "scheme": s, "saved %": v, "note": n}
                                             for f in ("llama", "deepseek_v3")
                                             for s, v, n in (("affine8", 46.9, ""), ("kvarn6", 0.0, "declined: MLA"),
                                                             ("kvarn4", 12.5, ""))],
                                            x="family", y="saved %", color="scheme", title="t", text="note")],
    "growth_figure": lambda: [viz.growth_figure({"llama": ([0, 128], [0.0, 2.0**20]),
                                                 "gemma3": ([0, 128], [0.0, 2.0**19]),
                                                 "llama twin": ([0, 128], [0.0, 2.0**20])})],
    "layer_kind_figure": lambda: [viz.layer_kind_figure(_shapes(), [0, 64, 128, 256, 512])],
    "passkey_heatmaps": lambda: [viz.passkey_heatmaps(_beyond("passkey"))],
    "draft_figure": lambda: [viz.draft_figure(_beyond("draft"))],
    "weights_kv_figure": lambda: [viz.weights_kv_figure(_beyond("weights_kv"))],
    "capacity_figure": lambda: [viz.capacity_figure(
        batch_rows("batch_capacity-w16-128k-h200.json") + batch_rows("batch_capacity-w16-32k-h200.json"), "capacity")],
    "floor_figure": lambda: [viz.floor_figure(floor_evidence(load_verdict("gemma3-270m")))],
    "verdict_figure": lambda: [viz.verdict_figure(load_verdict("gemma3-270m")),
                               viz.verdict_figure(load_verdict("teaching-llama"), (0.8, 0.6, 0.4))],
    "weights_kv_positions": lambda: [viz.weights_kv_positions(_beyond("weights_kv"), "8-bit")],
    "tradeoff_figure": lambda: [viz.tradeoff_figure(_tradeoff_points())],
    "idea_figure": lambda: [viz.idea_figure(viz.scheme_idea(_k(), _k()[::-1], spec))
                            for spec in ("affine4", "kvarn4:tail=0", "kivi2")],
    "field_kl_figure": lambda: [viz.field_kl_figure(_field_rows("fidelity"))],
    "field_passkey_figure": lambda: [viz.field_passkey_figure(_field_rows("passkey"))],
    "size_figure": lambda: [viz.size_figure(_size_curves(), SIZE_CONTEXTS,
                                            {"kvarn4 tail=128 < affine8": 1025, "kvarn4 tail=128 < affine4": 35713})],
    "published_vs_ours_figure": lambda: [viz.published_vs_ours_figure(viz.GMLX_KL_TABLE["rows"], _tradeoff_points())],
    "sensitivity_figure": lambda: [viz.sensitivity_figure(r.sensitivity) for r in _plans("teaching-llama").values()],
    "plan_figure": lambda: [viz.plan_figure(r.sensitivity, 0.5) for r in _plans("teaching-llama").values()],
    "plan_slider": lambda: [viz.plan_slider(r.sensitivity) for r in _plans("gemma3-270m").values()],
    "plan_versus_uniform": lambda: [viz.plan_versus_uniform(_plans(m)) for m in ("gemma3-270m", "teaching-llama")],
    "kv_growth_figure": lambda: [viz.kv_growth_figure(list("abcdef"), _causal(6))],
    "fused_step_figure": lambda: [viz.fused_step_figure(s, 32768) for s in ("kvarn4:tail=128", "kivi2", "nvfp4")],
    "storage_figure": lambda: [viz.storage_figure(["fp16", "affine4", "nvfp4", "turboquant4", "kivi4", "kvarn4"], "v")],
    "record_layout_figure": lambda: [viz.record_layout_figure("k"), viz.record_layout_figure("v", 2)],
}


def _causal(n: int) -> np.ndarray:
    """Causal attention weights spread evenly: row t over tokens 0..t."""
    return np.tril(np.ones((n, n))) / np.arange(1, n + 1)[:, None]


def _plans(model: str) -> dict:
    return load_plan_results(model)


def figure_builders() -> dict[str, Callable]:
    """Every public function of every gmlx_lab.viz submodule annotated to return a plotly Figure."""
    found = {}
    for info in pkgutil.iter_modules(viz.__path__):
        module = importlib.import_module(f"gmlx_lab.viz.{info.name}")
        for name, obj in vars(module).items():
            if name.startswith("_") or not inspect.isfunction(obj) or obj.__module__ != module.__name__:
                continue
            returns = inspect.signature(obj).return_annotation
            if returns is go.Figure or str(returns) in ("go.Figure", "Figure", "plotly.graph_objects.Figure"):
                found[name] = obj
    return found


def test_the_walker_finds_the_builders() -> None:
    found = figure_builders()
    assert {"error_figure", "channel_figure", "sink_mass_figure", "passkey_heatmaps"} <= set(found)
    assert "figure_problems" not in found and "num" not in found  # not builders


def test_every_builder_has_an_example() -> None:
    missing = sorted(set(figure_builders()) - set(EXAMPLES))
    assert not missing, f"add an example to EXAMPLES in tests/test_figures.py for: {missing}"
    stale = sorted(set(EXAMPLES) - set(figure_builders()))
    assert not stale, f"EXAMPLES names builders that no longer exist: {stale}"


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_builder_follows_the_figure_rules(name: str) -> None:
    figures = EXAMPLES[name]()
    assert figures, f"{name}: the example built no figure"
    for fig in figures:
        assert isinstance(fig, go.Figure)
        json.loads(fig.to_json())
        assert viz.figure_problems(fig) == [], name


# -- the checker catches what it should --------------------------------------------------------------------


def test_checker_flags_twins_missing_titles_and_long_numbers() -> None:
    fig = go.Figure()
    fig.add_scatter(x=[1, 2], y=[1, 2], name="affine", line={"color": "#1f77b4"})
    fig.add_scatter(x=[1, 2], y=[2, 3], name="affine", line={"color": "#1f77b4"})
    fig.add_heatmap(z=[[0.5199999809265137]], text=[[0.5199999809265137]], texttemplate="%{text}", xaxis="x2",
                    yaxis="y2")
    fig.update_layout(xaxis_title="bits", title="error 0.123456", xaxis2={"title": {"text": "head"}},
                      yaxis2={"title": {"text": "layer"}})
    found = "\n".join(viz.figure_problems(fig))
    assert "repeats the legend name" in found
    assert "colour, dash and marker" in found
    assert "yaxis shows data but has no title" in found
    assert "0.5199999809265137" in found and "0.123456" in found
    assert "xaxis shows" not in found and "xaxis2" not in found


def test_checker_reads_unformatted_hover_fields_and_passes_formatted_ones() -> None:
    fig = go.Figure(go.Scatter(x=[0, 1], y=np.array([0.1, 0.3], np.float32), hovertemplate="%{y}"))
    fig.update_layout(xaxis_title="x", yaxis_title="y")
    assert any("hovertemplate %{y}" in p for p in viz.figure_problems(fig))
    fig.data[0].hovertemplate = "%{y:.3g}"
    assert viz.figure_problems(fig) == []


def test_checker_passes_integers_and_short_decimals() -> None:
    fig = go.Figure(go.Bar(x=["a"], y=[1], text=["131072 tokens, 0.52, 1.5e-05"], name="one"))
    fig.update_layout(xaxis_title="x", yaxis_title="y", title="context 32768: ratio 1.235")
    assert viz.figure_problems(fig) == []


def test_error_figure_tells_group_sizes_and_k_from_v_apart() -> None:
    fig = viz.error_figure(_errors())
    styles = {(t.line.color, t.line.dash, t.marker.symbol) for t in fig.data}
    assert len(styles) == len(fig.data) == 6
    k32, v32 = (next(t for t in fig.data if t.name == f"affine g32 {kv}") for kv in "KV")
    assert k32.line.color == v32.line.color and (k32.line.dash, v32.line.dash) == ("solid", "dash")
    assert viz.scheme_colors()["affine"] in {t.line.color for t in fig.data}  # the middle shade is the scheme's


def test_trace_styles_shades_variants_of_the_registry_colour() -> None:
    styles = viz.trace_styles(["kvarn4 tail=0", "kvarn4 tail=128", "fp16", "llama", "gemma3"])
    assert styles["fp16"]["color"] == gmlx_lab.registry.SCHEMES["fp16"].color
    assert styles["kvarn4 tail=0"]["color"] != styles["kvarn4 tail=128"]["color"]
    assert len({styles[n]["color"] for n in ("llama", "gemma3", "fp16")}) == 3


def test_channel_figure_shares_the_y_axis() -> None:
    fig = viz.channel_figure(_k())
    assert fig.layout.yaxis.range == fig.layout.yaxis2.range


def test_butterfly_stages_end_at_the_hadamard_transform() -> None:
    x = np.random.default_rng(1).normal(size=8)
    stages = viz.butterfly_stages(x)
    assert len(stages) == 4
    np.testing.assert_allclose(stages[-1], viz.hadamard(x), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="power-of-two"):
        viz.butterfly_stages(np.ones(6))
    with pytest.raises(ValueError, match="out of range"):
        viz.butterfly_figure(stages, 4)


def test_normalize_rounds_balance_a_tile() -> None:
    tile = np.random.default_rng(0).normal(0, 1, (8, 8)) * np.array([1, 1, 8, 1, 1, 1, 1, 1])[:, None]
    rounds = viz.normalize_rounds(tile, 3)
    assert rounds[0][1] > 2 * rounds[1][1] > 2 * 2
    np.testing.assert_allclose(rounds[0][0], tile, rtol=1e-6)
    _, _, _, after = records.normalize(mx.array(tile.astype(np.float32)), 3)
    assert rounds[3][1] == pytest.approx(after.item(), rel=1e-5)


def test_even_share_matches_a_uniform_attention() -> None:
    context, sink = 384, 128
    probs = np.tril(np.ones((context, context)))
    probs /= probs.sum(-1, keepdims=True)
    assert viz.even_share(context, sink) == pytest.approx(probs[sink:, :sink].sum(-1).mean())
    assert viz.even_share(384, 1) < 0.02  # token 0 alone: about ln(384) / 383
    with pytest.raises(ValueError, match="after < context"):
        viz.even_share(100, 128)


def test_imbalance_figure_stops_once_converged() -> None:
    history = [40.0, 2.5, 2.2, 2.2, 2.2, 2.2, 2.2]
    fig = viz.imbalance_figure(history, best=6)
    assert len(fig.data[0].x) == 7  # the kept round is the last, so all are drawn
    fig = viz.imbalance_figure(history, best=2)
    assert list(fig.data[0].x) == [0, 1, 2] and "not drawn" in fig.layout.title.text


def test_policy_strip_rows_are_distinct() -> None:
    model = specimen("llama")
    fig = viz.policy_strip([gmlx_lab.policy(model, "kvarn"), gmlx_lab.policy(model, "affine")])
    names = list(fig.data[0].y)
    assert len(set(names)) == 2 and "kvarn" in names[0] and "affine" in names[1]


def test_policy_strip_colour_bar_lists_only_what_is_drawn() -> None:
    """Each colour of the bar is a decision some cell shows; the policy's own fp16 says why it is fp16."""
    model = specimen("llama")
    fig = viz.policy_strip([gmlx_lab.policy(model, "kvarn"), gmlx_lab.policy(model, "affine")])
    heat = fig.data[0]
    shown = {v for row in heat.z for v in row if v is not None}
    assert shown == set(range(len(heat.colorbar.ticktext)))
    assert set(heat.colorbar.ticktext) == {"kvarn", "affine", "fp16: the policy keeps it"}  # the last layer


def test_checker_flags_automatic_and_too_sparse_log_ticks() -> None:
    fig = go.Figure(go.Scatter(x=[1, 2, 3], y=[0.03, 0.05, 0.4]))
    fig.update_layout(xaxis_title="x", yaxis_title="y", yaxis_type="log")
    assert any("automatic ticks" in p for p in viz.figure_problems(fig))
    fig.update_yaxes(dtick=1)  # one decade mark (0.1) in 0.03-0.4: a single label
    assert any("holds 1 of them" in p for p in viz.figure_problems(fig))
    fig.update_yaxes(dtick="D1")
    assert any("automatic ticks" in p for p in viz.figure_problems(fig))
    fig.update_yaxes(**viz.log_ticks([0.03, 0.05, 0.4]))
    assert viz.figure_problems(fig) == []
    fig = go.Figure(go.Scatter(x=[1, 2], y=[1e-6, 1e-2]))
    fig.update_layout(xaxis_title="x", yaxis_title="y", yaxis_type="log", yaxis_dtick=1)
    assert viz.figure_problems(fig) == []  # five decades, each labelled


def test_log_ticks_label_one_two_five_or_whole_decades() -> None:
    assert viz.log_ticks([0.03, 0.4]) == {"tickvals": [0.05, 0.1, 0.2], "ticktext": ["0.05", "0.1", "0.2"]}
    assert viz.log_ticks([2.6, 3.1])["ticktext"] == ["2.6", "3.1"]  # less than a factor 2: the ends
    wide = viz.log_ticks([1e-9, 0.5, 0.0, float("nan")])  # zero and NaN cannot sit on a log axis: ignored
    assert wide["tickvals"] is None and wide["dtick"] == 2
    with pytest.raises(ValueError, match="positive"):
        viz.log_ticks([0.0, -1.0])
    assert viz.context_ticks([1024, 512, 32768])["ticktext"] == ["512", "1K", "32K"]


def test_checker_flags_a_line_hidden_under_another_and_growth_figure_merges_twins() -> None:
    fig = go.Figure()
    fig.add_scatter(x=[0, 1], y=[1, 2], name="deepseek_v3", line={"color": "#8c564b"})
    fig.add_scatter(x=[0, 1], y=[1, 2], name="kimi_k2", line={"color": "#1f77b4"})
    fig.update_layout(xaxis_title="x", yaxis_title="y")
    assert any("draws exactly the line of trace 0" in p for p in viz.figure_problems(fig))
    fig.data[1].line.width = 4  # drawn wider underneath: both visible
    assert viz.figure_problems(fig) == []
    merged = viz.growth_figure({"deepseek_v3": ([0, 1], [1, 2]), "llama": ([0, 1], [1, 3]),
                                "kimi_k2": ([0, 1], [1, 2])})
    assert [t.name for t in merged.data] == ["deepseek_v3 & kimi_k2 (same sizes)", "llama"]


def test_position_kl_figure_leaves_kl_zero_as_gaps_not_a_cliff() -> None:
    fig = viz.position_kl_figure(_fidelity_dict())
    assert [t.name for t in fig.data] == ["kvarn4 tail=0", "kvarn4 tail=128"]  # tail=1024 is KL 0 everywhere
    assert all(y is None or y > 1e-6 for t in fig.data for y in t.y)  # no point pulled down to a floor
    assert any("nothing quantized): kvarn4 tail=1024" in (a.text or "") for a in fig.layout.annotations)


def test_a_slider_figure_carries_every_state_as_a_frame() -> None:
    """The slider's steps name the frames one to one, each frame holds the traces of its state, and the figure
    opens on the active step: it moves in a static page, without a kernel."""
    figs = [viz.regions_bar(c, 128, max_context=1024) for c in (0, 512, 1024)]
    fig = viz.slider_figure(figs, ["0", "512", "1024"], "context: ", active=1)
    (slider,) = fig.layout.sliders
    assert [list(step.args[0]) for step in slider.steps] == [[f.name] for f in fig.frames] == [["0"], ["512"], ["1024"]]
    assert slider.active == 1 and fig.data[0].x == figs[1].data[0].x
    assert [f.data[0].x for f in fig.frames] == [f.data[0].x for f in figs]
    assert fig.frames[2].layout.title.text == figs[2].layout.title.text
    with pytest.raises(ValueError, match="one label a figure"):
        viz.slider_figure(figs, ["0"], "context: ")


def test_more_names_than_free_colours_still_look_apart() -> None:
    """Nine model families (notebook 00) on six free category colours: the colours come round with another dash."""
    from gmlx_lab.models import FAMILIES

    styles = viz.trace_styles(list(FAMILIES))
    looks = [(s["color"], s["dash"]) for s in styles.values()]
    assert len(FAMILIES) > 6 and len(set(looks)) == len(looks)
    assert styles["llama"]["dash"] == "solid"


def test_checker_flags_a_slider_that_cannot_move() -> None:
    figs = [viz.regions_bar(c, 128, max_context=512) for c in (256, 512)]
    fig = viz.slider_figure(figs, ["256", "512"], "context: ")
    assert viz.figure_problems(fig) == []
    fig.frames = fig.frames[:1]  # a step whose frame is missing
    assert any("cannot move" in p for p in viz.figure_problems(fig))
    one = viz.slider_figure(figs[:1], ["256"], "context: ")
    assert any("1 step(s)" in p for p in viz.figure_problems(one))


def test_checker_flags_an_annotation_over_the_legend() -> None:
    def figure(**legend) -> go.Figure:
        fig = go.Figure([go.Scatter(x=[0, 1], y=[0, i], name=f"line {i}") for i in range(3)])
        fig.update_layout(xaxis_title="x", yaxis_title="y", legend=legend)
        return fig

    beside = figure()  # plotly's vertical legend, right of the plot from its top
    beside.add_annotation(x=1.05, y=0.95, xref="paper", yref="paper", text="a note", showarrow=False)
    assert any("lies where the legend is drawn" in p for p in viz.figure_problems(beside))
    below = figure(orientation="h", y=-0.2)
    below.add_annotation(x=0.5, y=-0.22, xref="paper", yref="paper", text="a note", showarrow=False)
    assert any("lies where the legend is drawn" in p for p in viz.figure_problems(below))
    clear = figure(orientation="h", y=-0.2)
    clear.add_annotation(x=0.5, y=1.05, xref="paper", yref="paper", text="a note", showarrow=False)
    clear.add_annotation(x=1.05, y=0.95, xref="paper", yref="paper", text="a note", showarrow=False)
    assert viz.figure_problems(clear) == []


def test_the_storage_diagram_draws_each_caches_own_scale_group() -> None:
    """A patch of one shade is what a cache's `scale_group` says shares a scale: affine's 64 channels of one token,
    KIVI's K channel across 32 tokens, TurboQuant's whole row; fp16 is grey throughout."""
    from gmlx_lab.viz.diagrams import group_grid

    affine = group_grid((1, 64))
    assert (affine[:64, 0] == affine[0, 0]).all() and affine[64, 0] != affine[0, 0] and affine[0, 1] != affine[0, 0]
    kivi_k = group_grid((32, 1))  # the window starts at token 128, a block boundary
    assert (kivi_k[0, :32] == kivi_k[0, 0]).all() and kivi_k[0, 32] != kivi_k[0, 0] and kivi_k[1, 0] != kivi_k[0, 0]
    whole = group_grid((1, 0))
    assert (whole[:, 0] == whole[0, 0]).all() and whole[0, 1] != whole[0, 0]
    assert (group_grid(None) == -1).all()
    fig = viz.storage_figure(["kivi4", "affine4"], "kv")
    titles = [a.text for a in fig.layout.annotations]
    assert len(fig.data) == 3 and "32 tokens x 1 channel" in titles[0] and "1 token x 32 channels" in titles[1]


def test_the_growth_diagram_refuses_weights_that_see_the_future() -> None:
    with pytest.raises(ValueError, match="causal weights"):
        viz.kv_growth_figure(list("abc"), np.full((3, 3), 1 / 3))
    fig = viz.kv_growth_figure(list("abcd"), _causal(4))
    assert [len(f.data[1].x) for f in fig.frames] == [1, 2, 3, 4]  # one more K row a step


def test_the_record_diagram_draws_the_record_bytes_of_every_width() -> None:
    from gmlx_lab.cache.kvarn import records

    fig = viz.record_layout_figure("v", 8)
    assert [f.name for f in fig.frames] == [str(b) for b in records.KVARN_BITS]
    for frame, bits in zip(fig.frames, records.KVARN_BITS):
        texts = " ".join(a.text for a in frame.layout.annotations)
        assert f"record: {records.record_bytes(bits, kind='v')} B" in texts
        assert "rows = tokens" in texts
    with pytest.raises(ValueError, match="code widths"):
        viz.record_layout_figure("k", 7)
    with pytest.raises(ValueError, match="kind 'k' or 'v'"):
        viz.record_layout_figure("kv")


def test_checker_flags_a_label_over_a_marker_but_not_one_beside_it_or_on_an_arrow() -> None:
    fig = go.Figure(go.Scatter(x=[1, 2, 3], y=[10, 100, 1000], mode="markers", name="points"))
    fig.update_layout(xaxis_title="x", yaxis={"title": "y", "type": "log", **viz.log_ticks([10, 1000])})
    fig.add_annotation(x=2, y=2, text="a label", showarrow=False)  # on a log axis: log10 of 100
    assert any("covers a marker of trace 0" in p for p in viz.figure_problems(fig))
    fig.layout.annotations = []
    fig.add_annotation(x=2, y=3, text="a label", showarrow=False)  # a decade above the point
    fig.add_annotation(x=2, y=2, text="a label", showarrow=True, ax=40, ay=-30)  # on an arrow, away from it
    assert viz.figure_problems(fig) == []


def test_checker_flags_a_percentage_printed_without_its_count() -> None:
    fig = go.Figure(go.Bar(x=["fp16", "kvarn4"], y=[1, 0.5], text=["100%", "50%"], name="found"))
    fig.update_layout(xaxis_title="cache", yaxis_title="share found")
    assert any("without its count" in p for p in viz.figure_problems(fig))
    fig.data[0].hovertemplate = "%{x}: %{customdata} of 2 keys<extra></extra>"
    fig.data[0].customdata = [2, 1]
    assert viz.figure_problems(fig) == []
    fig = go.Figure(go.Bar(x=["a"], y=[1], text=["1 of 1 (100%)"], name="n"))
    fig.update_layout(xaxis_title="cache", yaxis_title="share")
    assert viz.figure_problems(fig) == []
