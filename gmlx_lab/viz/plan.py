"""Notebook 05's plan figures: each layer's sensitivity, the plan a budget buys, and the plan against uniform widths."""

from __future__ import annotations

import math

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ..measure.planner import PlanResults, Sensitivity, choose
from ..registry import BASELINE
from .figures import slider_figure
from .style import log_ticks, num, scheme_color, wrapped

FP16_WIDTH = 16  # where a layer kept fp16 stands on the widths axis
PARTS = {"K": "K (V at the widest)", "V": "V (K at the widest)", "KV": "K and V at one width"}


def sensitivity_figure(sens: Sensitivity) -> go.Figure:
    """KL of each probe: a layer (row) stored at a width (column), every other layer fp16; one panel for K and one
    for V where the scheme stores them apart. Colour: log10 of the mean KL over the calibration windows."""
    parts = [p for p in ("K", "V", "KV") if p in sens.probes]
    fig = make_subplots(rows=1, cols=len(parts), subplot_titles=[PARTS[p] for p in parts], horizontal_spacing=0.04,
                        shared_yaxes=True)
    values = [sens.kl(p, layer, w) for p in parts for layer in sens.layers for w in sens.widths]
    low, high = (math.log10(max(v, 1e-12)) for v in (min(values), max(values)))
    for col, part in enumerate(parts, start=1):
        z = [[math.log10(max(sens.kl(part, layer, w), 1e-12)) for w in sens.widths] for layer in sens.layers]
        text = [[num(sens.kl(part, layer, w), 2) for w in sens.widths] for layer in sens.layers]
        fig.add_trace(go.Heatmap(
            z=z, x=[f"{w}-bit" for w in sens.widths], y=[f"layer {layer}" for layer in sens.layers], text=text,
            texttemplate="%{text}", textfont={"size": 10}, coloraxis="coloraxis", name=part,
            hovertemplate="%{y}, " + part + " at %{x}: mean KL %{text}<extra></extra>"), row=1, col=col)
    fig.update_layout(
        template="plotly_white", height=max(260, 70 + 45 * len(sens.layers)),
        title=wrapped(f"{sens.model} at {sens.context} tokens, {sens.scheme}: KL when one layer is stored at one "
                      "width, every other layer fp16"),
        coloraxis={"colorscale": "OrRd", "cmin": low, "cmax": high,
                   "colorbar": {"title": {"text": "log10 KL"}, "thickness": 14}},
        margin={"l": 80, "r": 20, "t": 90, "b": 50})
    fig.update_yaxes(autorange="reversed")
    fig.update_yaxes(title_text="layer", row=1, col=1)
    fig.update_xaxes(title_text="code width")
    return fig


def plan_figure(sens: Sensitivity, budget: float) -> go.Figure:
    """The widths the plan gives each layer under `budget` (K and V bars; fp16 at the top), its bytes and its
    predicted KL in the title."""
    chosen = choose(sens, budget)
    names = [f"layer {layer}" for layer in sens.layers]
    fig = go.Figure()
    parts = (("K", "k_bits"), ("V", "v_bits")) if "k_bits" in sens.names else (("K and V", "bits"),)
    for (part, key), color in zip(parts, ("#1f77b4", "#ff7f0e")):
        widths = [chosen.widths[layer][key] if chosen.widths[layer] else FP16_WIDTH for layer in sens.layers]
        fig.add_bar(x=names, y=widths, name=part, marker_color=color,
                    text=["fp16" if w == FP16_WIDTH else str(w) for w in widths], textposition="outside",
                    hovertemplate="%{x}: " + part + " %{text}<extra></extra>")
    report = chosen.report
    fig.update_layout(
        template="plotly_white", barmode="group", height=380, bargap=0.35,
        title=f"{100 * budget:.0f}% of fp16's bytes: the plan stores {100 * report['share']:.1f}%, "
              f"predicted KL {num(report['predicted_kl'], 2)}",
        yaxis={"title": "bits a value", "range": [0, FP16_WIDTH + 2.5],
               "tickvals": [*sens.widths, FP16_WIDTH], "ticktext": [*map(str, sens.widths), "fp16"]},
        xaxis_title="layer", legend={"orientation": "h", "y": 1.02, "x": 1, "xanchor": "right", "yanchor": "bottom"},
        margin={"l": 60, "r": 20, "t": 80, "b": 50})
    return fig


def plan_slider(sens: Sensitivity, step: float = 0.05) -> go.Figure:
    """`plan_figure` at every budget from the smallest the scheme reaches to fp16's, `step` apart: a slider."""
    first = math.ceil(sens.smallest_share() / step - 1e-9) * step
    budgets = [round(first + i * step, 6) for i in range(int(round((1 - first) / step)) + 1)]
    budgets = [b for b in budgets if b <= 1]
    middle = min(range(len(budgets)), key=lambda i: abs(budgets[i] - 0.5))
    return slider_figure([plan_figure(sens, b) for b in budgets], [f"{100 * b:.0f}%" for b in budgets],
                         "budget: ", active=middle)


def plan_versus_uniform(results: dict[str, PlanResults]) -> go.Figure:
    """Measured mean KL with its 95% interval against bytes: each scheme's uniform widths (a line through them) and
    its plans at each of their bytes (open markers; for kvarn also with one width for K and V a layer), on the
    windows the probes did not read."""
    fig = go.Figure()
    for spec, res in results.items():
        color = scheme_color(res.sensitivity.scheme)
        against = {p.report["against"] for p in res.plans}
        uniform = [r for r in res.rows if r.label in against]
        kinds = [(uniform, f"{spec}: uniform width", "circle", "solid"),
                 ([p for _, p, _ in res.pairs()], f"{spec}: plan at the same bytes", "diamond-open", "dot")]
        if res.pairs(tied=True):
            kinds.append(([p for _, p, _ in res.pairs(tied=True)], f"{spec}: plan, one width for K and V a layer",
                          "square-open", "dash"))
        for rows, name, symbol, dash in kinds:
            band = [r.interval("mean_kl") for r in rows]
            text = [r.label.split(" ")[0] if "plan" not in r.label else "" for r in rows]
            fig.add_scatter(
                x=[100 * r.share for r in rows], y=[b.estimate for b in band], name=name, mode="lines+markers+text",
                text=text, textposition="top right", textfont={"size": 9, "color": color},
                line={"color": color, "dash": dash}, marker={"symbol": symbol, "size": 9, "color": color},
                error_y={"type": "data", "symmetric": False, "array": [b.high - b.estimate for b in band],
                         "arrayminus": [b.estimate - b.low for b in band], "thickness": 1.2, "width": 4},
                customdata=[[r.label, num(b.low), num(b.high)] for r, b in zip(rows, band)],
                hovertemplate="%{customdata[0]}<br>%{x:.1f}% of fp16's bytes<br>mean KL %{y:.3g} "
                              "[%{customdata[1]}, %{customdata[2]}]<extra></extra>")
    values = [r.interval("mean_kl").estimate for res in results.values() for r in res.rows if r.scheme != BASELINE]
    first = next(iter(results.values())).sensitivity
    windows = len(next(iter(results.values())).rows[0].per_passage["mean_kl"])
    fig.update_layout(
        template="plotly_white", height=440,
        title=wrapped(f"{first.model} at {first.context} tokens: plans against uniform widths at equal bytes "
                      f"(mean KL, 95% intervals over {windows} windows the probes did not read)"),
        xaxis_title="stored bytes, % of fp16's", yaxis={"title": "mean KL (nats)", "type": "log",
                                                        **log_ticks([v for v in values if v > 0])},
        legend={"orientation": "h", "y": -0.2}, margin={"l": 70, "r": 20, "t": 90, "b": 110})
    return fig

