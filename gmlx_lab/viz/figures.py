"""Plotly figure builders for the notebooks: each takes data (numpy, a capture, a policy) and returns a Figure.

The figures use only plotly's bundled JavaScript, so they render offline in
JupyterLab (the default `plotly_mimetype` renderer) and in HTML exports.
"""

from __future__ import annotations

import html
from typing import Any

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ..cache import window
from ..cache.kvarn import records
from ..cache.kvarn.records import region_tokens
from ..measure.experiments import recall_counts
from ..measure.sizes import LayerShape, layer_bytes
from ..policy import Policy
from ..registry import BASELINE, SCHEMES, get_scheme
from .quant import AffineRow, hadamard, outlier_ratio
from .style import (  # noqa: F401  (scheme_color: imported from here too)
    CATEGORY_COLORS,
    OTHER_COLOR,
    context_ticks,
    frame_slider,
    log_ticks,
    num,
    scheme_color,
    scheme_colors,
    shade,
    trace_styles,
)

REGION_COLORS = {"sink": "#6a3d9a", "body": "#ff7f0e", "live": "#b2df8a", "tail": "#33a02c"}
REGION_NAMES = {"sink": "sink (fp16)", "body": "records (quantized)", "live": "live group (fp16)",
                "tail": "tail (fp16)"}
BASELINE_LINE = {"color": "#555555", "dash": "dot", "width": 1.5}  # every drawn baseline
LABEL_BACKGROUND = "rgba(255,255,255,0.85)"  # behind a baseline's label, so bars under it do not hide it
_LAYOUT = {"template": "plotly_white", "margin": {"l": 60, "r": 20, "t": 60, "b": 50}}


def _fig(**layout: Any) -> go.Figure:
    fig = go.Figure()
    fig.update_layout(**{**_LAYOUT, **layout})
    return fig


def _baseline(fig: go.Figure, y: float, text: str, log: bool = False, left: bool = False, **where: Any) -> None:
    """A dotted horizontal baseline with its meaning written on it, at the right end (`left`: at the left end, where
    the right holds marks of its own; `log`: the y axis is logarithmic)."""
    font = {"color": BASELINE_LINE["color"], "size": 11}
    side = "left" if left else "right"
    if log:  # plotly places a log axis's annotations in log10 units
        fig.add_hline(y=y, line=BASELINE_LINE, **where)
        fig.add_annotation(text=text, x=0 if left else 1, xref="paper", y=np.log10(y), yanchor="bottom",
                           xanchor=side, showarrow=False, font=font, bgcolor=LABEL_BACKGROUND)
        return
    fig.add_hline(y=y, line=BASELINE_LINE, annotation_text=text, annotation_position=f"top {side}",
                  annotation_font=font, annotation_bgcolor=LABEL_BACKGROUND, **where)


def bytes_label(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n}"


def growth_figure(curves: dict[str, tuple[list[int], list[float]]],
                  title: str = "KV cache size vs context") -> go.Figure:
    """Lines of cache bytes against context, one per name: {name: (contexts, bytes)}, on log-log axes.

    Log-log, so a cache that grows with every token is a straight line and a fixed state or a window bends it:
    on linear axes the families whose long contexts cost alike lie on one line. Names with exactly the same sizes
    share one line, named for all of them ("deepseek_v3 & kimi_k2 (same sizes)"), so no line hides another.
    Points of zero tokens or zero bytes have no place on log axes and are left out.
    """
    fig = _fig(title=title, xaxis_title="context (tokens, log scale)", yaxis_title="cache (MiB, log scale)",
               height=420)
    groups: dict[tuple[tuple[float, ...], tuple[float, ...]], list[str]] = {}
    for name, (ctx, size) in curves.items():
        groups.setdefault((tuple(map(float, ctx)), tuple(map(float, size))), []).append(name)
    lines = {names[0] if len(names) == 1 else f"{' & '.join(names)} (same sizes)": curves[names[0]]
             for names in groups.values()}
    styles = trace_styles(lines)
    drawn_x, drawn_y = [], []
    for name, (ctx, size) in lines.items():
        st = styles[name]
        kept = [(c, b / 2**20) for c, b in zip(ctx, size) if c > 0 and b > 0]
        x, y = [c for c, _ in kept], [m for _, m in kept]
        drawn_x += x
        drawn_y += y
        fig.add_scatter(x=x, y=y, mode="lines+markers", name=name,
                        line={"color": st["color"], "dash": st["dash"]}, marker={"symbol": st["symbol"]},
                        hovertemplate="%{x} tokens: %{y:.3g} MiB<extra>" + html.escape(name) + "</extra>")
    if drawn_y:
        fig.update_xaxes(type="log", **context_ticks(drawn_x))
        fig.update_yaxes(type="log", **log_ticks(drawn_y))
    return fig


def layer_kind_figure(shapes: dict[str, LayerShape], contexts: list[int],
                      title: str = "one layer's fp16 cache vs context, by kind of layer") -> go.Figure:
    """Bytes of one layer of each kind against context: full attention grows, windows and recurrent state stop."""
    fig = _fig(title=title, xaxis_title="context (tokens)", yaxis_title="one layer's cache (KiB)", height=400)
    styles = trace_styles(shapes)
    for name, shape in shapes.items():
        size = [layer_bytes(shape, BASELINE, c, {}) / 1024 for c in contexts]
        fig.add_scatter(x=contexts, y=size, mode="lines+markers", name=name,
                        line={"color": styles[name]["color"]}, marker={"symbol": styles[name]["symbol"]},
                        hovertemplate="%{x} tokens: %{y:.3g} KiB<extra>" + html.escape(name) + "</extra>")
        if shape.window:
            fig.add_vline(x=shape.window, line=BASELINE_LINE, annotation_text=f"window {shape.window}",
                          annotation_position="bottom right")
    return fig


def affine_row_figure(q: AffineRow, title: str | None = None) -> go.Figure:
    """A row's values, its affine reconstruction, and each group's step (scale) and offset."""
    x = np.arange(q.values.size)
    err = np.linalg.norm(q.values - q.recon) / max(np.linalg.norm(q.values), 1e-12)
    fig = _fig(title=title or f"affine {q.bits}-bit, group {q.group_size}: one K row (rel. error {num(err)})",
               xaxis_title="channel", yaxis_title="value", height=400, margin={"l": 60, "r": 20, "t": 110, "b": 50})
    fig.add_scatter(x=x, y=q.values, mode="lines", name="original", line={"color": "#444444"},
                    hovertemplate="ch %{x}: %{y:.3g}<extra>original</extra>")
    fig.add_scatter(x=x, y=q.recon, mode="lines", name="reconstructed", line={"color": "#d62728", "shape": "hv"},
                    customdata=q.codes, hovertemplate="ch %{x}: %{y:.3g} (code %{customdata})<extra></extra>")
    for g, (s, o) in enumerate(zip(q.scales, q.offsets)):
        x0 = g * q.group_size
        fig.add_vrect(x0=x0 - 0.5, x1=x0 + q.group_size - 0.5, fillcolor="#1f77b4" if g % 2 else "#aec7e8",
                      opacity=0.12, line_width=0)
        # above the plot, centred on its group: clear of the data and of the axis's tick labels
        fig.add_annotation(x=x0 + (q.group_size - 1) / 2, y=1, yref="paper", yanchor="bottom", showarrow=False,
                           text=f"scale {num(s)}<br>offset {num(o)}", font={"size": 10})
    return fig


def group_error_figure(q: AffineRow, title: str | None = None) -> go.Figure:
    """Per group of an affine row: its step (scale) and its RMS error, on one shared x of groups."""
    groups = np.arange(q.scales.size)
    err = np.sqrt(((q.values - q.recon) ** 2).reshape(-1, q.group_size).mean(1))
    names = [f"{g * q.group_size}-{(g + 1) * q.group_size - 1}" for g in groups]
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.14,
                        subplot_titles=("step size |scale| = (max − min) / (levels − 1)", "RMS error of the group"))
    fig.add_bar(x=names, y=np.abs(q.scales), marker_color="#1f77b4", name="step", row=1, col=1,
                hovertemplate="channels %{x}: step %{y:.3g}<extra></extra>")
    fig.add_bar(x=names, y=err, marker_color="#d62728", name="RMS error", row=1, col=2,
                hovertemplate="channels %{x}: RMS error %{y:.3g}<extra></extra>")
    for col in (1, 2):
        fig.update_xaxes(title_text="group (channels)", type="category", row=1, col=col)
    fig.update_yaxes(title_text="step (value units)", row=1, col=1)
    fig.update_yaxes(title_text="RMS error (value units)", row=1, col=2)
    fig.update_layout(**{**_LAYOUT, "margin": {**_LAYOUT["margin"], "t": 90}}, height=340, showlegend=False,
                      title=title or f"{q.bits}-bit, groups of {q.group_size}: each group pays for its own range")
    return fig


def error_figure(rows: list[dict[str, Any]], title: str = "reconstruction error vs bits") -> go.Figure:
    """Lines of relative error against bits, one per method: rows of {method, bits, error}.

    Colour is the scheme's, a shade per variant (g32 dark ... g128 light), dashed for V.
    """
    fig = _fig(title=title, xaxis_title="bits per code", yaxis_title="relative error ‖x − x̂‖ / ‖x‖ (log)",
               yaxis_type="log", height=400)
    methods = list(dict.fromkeys(r["method"] for r in rows))
    styles = trace_styles(methods)
    for method in methods:
        pts = sorted((r["bits"], r["error"]) for r in rows if r["method"] == method)
        st = styles[method]
        fig.add_scatter(x=[p[0] for p in pts], y=[p[1] for p in pts], mode="lines+markers", name=method,
                        line={"color": st["color"], "dash": st["dash"]}, marker={"symbol": st["symbol"], "size": 8},
                        hovertemplate="%{x} bits: error %{y:.3g}<extra>" + html.escape(method) + "</extra>")
    fig.update_xaxes(dtick=1)
    fig.update_yaxes(**log_ticks(r["error"] for r in rows))
    return fig


def channel_figure(k: np.ndarray, title: str = "per-channel magnitude of K") -> go.Figure:
    """Max |K| per channel over the tokens, before and after the Hadamard rotation, on one shared y axis.

    The dotted line in each panel is the median channel: the outlier ratio in the panel title is max over it.
    """
    before, after = np.abs(k).max(0), np.abs(hadamard(k)).max(0)
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.12,
                        subplot_titles=(f"before rotation: largest channel {num(outlier_ratio(k), 2)}x the median",
                                        f"after rotation: largest channel {num(outlier_ratio(hadamard(k)), 2)}x "
                                        "the median"))
    fig.add_bar(x=np.arange(before.size), y=before, row=1, col=1, marker_color="#d62728", name="before",
                hovertemplate="channel %{x}: %{y:.3g}<extra>before</extra>")
    fig.add_bar(x=np.arange(after.size), y=after, row=2, col=1, marker_color="#2ca02c", name="after",
                hovertemplate="channel %{x}: %{y:.3g}<extra>after</extra>")
    for row, values in ((1, before), (2, after)):
        _baseline(fig, float(np.median(values)), f"median {num(np.median(values))}", row=row, col=1)
    top = 1.08 * float(max(before.max(), after.max()))
    fig.update_layout(**_LAYOUT, title=title, height=480, showlegend=False)
    fig.update_xaxes(title_text="channel", row=2, col=1)
    fig.update_yaxes(title_text="max |K| over tokens", range=[0, top])
    return fig


def slider_figure(figures: list[go.Figure], labels: list[str], prefix: str, active: int = 0) -> go.Figure:
    """One figure whose slider steps through `figures` (the same traces on the same axes), all computed now as
    plotly frames: it moves in a static page too, where no kernel answers a widget. Each step carries its figure's
    traces, title, shapes and annotations."""
    if not figures or len(figures) != len(labels) or not 0 <= active < len(figures):
        raise ValueError(f"slider_figure needs one label a figure and an active step among them; got "
                         f"{len(figures)} figures, {len(labels)} labels, active {active}")
    fig = go.Figure(figures[active])
    fig.frames = [go.Frame(data=f.data, name=label, layout={"title": f.layout.title, "shapes": f.layout.shapes,
                                                             "annotations": f.layout.annotations})
                  for f, label in zip(figures, labels)]
    margin = fig.layout.margin.b or 50
    fig.update_layout(sliders=[frame_slider(labels, prefix, active)], margin={"b": margin + 70},
                      height=(fig.layout.height or 450) + 70)
    return fig


def butterfly_slider(stages: list[np.ndarray]) -> go.Figure:
    """`butterfly_figure` at every stage, a slider between them."""
    return slider_figure([butterfly_figure(stages, s) for s in range(len(stages))],
                         [str(s) for s in range(len(stages))], "stage: ")


def butterfly_figure(stages: list[np.ndarray], stage: int) -> go.Figure:
    """An 8-point Hadamard, one butterfly stage at a time: the vector after `stage` stages (0: the input).

    Stage s pairs entries 2^(s-1) apart and replaces (a, b) by ((a + b), (a - b)) / sqrt(2); the y axis is fixed
    across stages so the outlier visibly spreads out.
    """
    if not 0 <= stage < len(stages):
        raise ValueError(f"stage {stage} is out of range: 0 (the input) to {len(stages) - 1}")
    x, first = stages[stage], stages[0]
    idx = np.arange(x.size)
    top = 1.1 * float(np.abs(first).max())
    span = 2 ** (stage - 1) if stage else 0
    what = (f"stage {stage}: entries {span} apart are mixed, (a+b)/√2 and (a−b)/√2" if stage
            else "the input: one outlier")
    fig = _fig(title=f"{what} · largest |value| {num(np.abs(x).max())}", xaxis_title="entry",
               yaxis_title="value", height=340, yaxis_range=[-top, top], bargap=0.3)
    fig.add_scatter(x=idx, y=first, mode="markers", name="input", marker={"color": "#999999", "symbol": "line-ew-open",
                                                                          "size": 26, "line": {"width": 2}},
                    hovertemplate="entry %{x}: input %{y:.3g}<extra></extra>")
    fig.add_bar(x=idx, y=x, name=f"after stage {stage}", marker_color="#17becf",
                hovertemplate="entry %{x}: %{y:.3g}<extra></extra>")
    if span:
        for i in idx[(idx // span) % 2 == 0]:  # each mixed pair as a bracket under the bars
            y = -top * (0.96 - 0.08 * (i % span))
            fig.add_shape(type="line", x0=i, x1=i + span, y0=y, y1=y, line={"color": "#555555", "width": 2})
    fig.update_xaxes(dtick=1)
    return fig


def record_figure(rec: records.Records, title: str = "") -> go.Figure:
    """A kvarn record: its codes as a heatmap, with the row steps and column scales beside it."""
    q = np.array(records.unpack_rows(rec.codes, rec.bits))
    rows_name, cols_name = ("channel", "token") if rec.kind == "k" else ("token", "channel")
    fig = make_subplots(rows=2, cols=2, column_widths=[0.8, 0.2], row_heights=[0.2, 0.8],
                        shared_xaxes="columns", shared_yaxes="rows", horizontal_spacing=0.03,
                        vertical_spacing=0.03)
    fig.add_heatmap(z=q, row=2, col=1, colorscale="Viridis", colorbar={"title": "code", "x": 1.02},
                    hovertemplate=f"{rows_name} %{{y}}, {cols_name} %{{x}}: code %{{z}}<extra></extra>")
    fig.add_scatter(y=np.arange(128), x=np.array(rec.scale_axis).astype(np.float32), row=2, col=2,
                    mode="lines", name=f"row step ({rows_name})", line={"color": "#d62728"},
                    hovertemplate=f"{rows_name} %{{y}}: step %{{x:.3g}}<extra></extra>")
    fig.add_scatter(x=np.arange(128), y=np.array(rec.other_axis).astype(np.float32), row=1, col=1, mode="lines",
                    name=f"column scale ({cols_name})", line={"color": "#1f77b4"},
                    hovertemplate=f"{cols_name} %{{x}}: scale %{{y:.3g}}<extra></extra>")
    fig.update_yaxes(autorange="reversed", row=2, col=1, title_text=f"row = {rows_name}")
    fig.update_xaxes(title_text=f"column = {cols_name}", row=2, col=1)
    fig.update_yaxes(title_text="column scale", row=1, col=1)
    fig.update_xaxes(title_text="row step", row=2, col=2)
    fig.update_layout(**_LAYOUT, height=580, title=title or f"{rec.kind.upper()} record, {rec.bits}-bit codes",
                      legend={"orientation": "h", "y": -0.12})
    return fig


def imbalance_figure(history: list[float], best: int, tol: float = 1e-3) -> go.Figure:
    """Imbalance of the tile after each normalization round, drawn until it stops changing, the kept round marked.

    Rounds after convergence (relative change below `tol`) are summarised in the title rather than drawn.
    """
    h = np.asarray(history, float)
    change = np.abs(np.diff(h)) / np.maximum(np.abs(h[:-1]), 1e-12)
    moving = np.nonzero(change > tol)[0]
    last = int(moving[-1]) + 1 if moving.size else 0  # the last round that still changed the imbalance
    shown = max(last, best) + 1
    rest = len(h) - shown
    fig = _fig(title=f"variance normalization: imbalance {num(h[0])} → {num(h[best])}, round {best} kept"
                     + (f"<br><sup>rounds {shown}-{len(h) - 1} change nothing and are not drawn</sup>" if rest else ""),
               xaxis_title="normalization round (0 = unscaled)", yaxis_title="imbalance (log)", yaxis_type="log",
               yaxis_range=[np.log10(1.8), np.log10(1.3 * float(h[:shown].max()))], height=340)
    fig.update_yaxes(**log_ticks([1.8, 1.3 * float(h[:shown].max())]))
    fig.add_scatter(x=list(range(shown)), y=h[:shown], mode="lines+markers", name="imbalance",
                    line={"color": "#ff7f0e"}, hovertemplate="round %{x}: %{y:.3g}<extra></extra>")
    fig.add_scatter(x=[best], y=[h[best]], mode="markers", marker={"size": 14, "symbol": "star", "color": "#6a3d9a"},
                    name="kept", hovertemplate="kept: round %{x}, %{y:.3g}<extra></extra>")
    _baseline(fig, 2.0, "2 = perfectly balanced", log=True, left=best > 0)  # not under the kept star
    fig.update_xaxes(dtick=1)
    return fig


def normalize_toy_figure(tile: np.ndarray, scaled: np.ndarray, round_: int, imbalance: float) -> go.Figure:
    """A small tile after `round_` normalization rounds: its values (heatmap) and each row's and column's spread."""
    row_std, col_std = scaled.std(1, ddof=1), scaled.std(0, ddof=1)
    fig = make_subplots(rows=1, cols=3, column_widths=[0.4, 0.3, 0.3], horizontal_spacing=0.2,
                        subplot_titles=("scaled tile (red +, blue −)", "spread of each row", "spread of each column"))
    lim = float(np.abs(scaled).max()) or 1.0  # each round on its own colour scale: values shrink as rounds divide
    fig.add_heatmap(z=scaled, row=1, col=1, colorscale="RdBu_r", zmid=0, zmin=-lim, zmax=lim,
                    colorbar={"title": {"text": "value", "side": "right"}, "x": 0.25, "len": 0.85, "thickness": 10},
                    hovertemplate="row %{y}, col %{x}: %{z:.3g}<extra></extra>")
    fig.add_bar(x=np.arange(row_std.size), y=row_std, row=1, col=2, marker_color="#d62728", name="row std",
                hovertemplate="row %{x}: std %{y:.3g}<extra></extra>")
    fig.add_bar(x=np.arange(col_std.size), y=col_std, row=1, col=3, marker_color="#1f77b4", name="column std",
                hovertemplate="column %{x}: std %{y:.3g}<extra></extra>")
    top = 1.1 * float(max(tile.std(1, ddof=1).max(), tile.std(0, ddof=1).max()))
    fig.update_yaxes(autorange="reversed", title_text="row", row=1, col=1)
    fig.update_xaxes(title_text="column", row=1, col=1)
    fig.update_xaxes(title_text="row", dtick=1, row=1, col=2)
    fig.update_xaxes(title_text="column", dtick=1, row=1, col=3)
    fig.update_yaxes(title_text="std (value units)", range=[0, top], row=1, col=2)
    fig.update_yaxes(title_text="std (value units)", range=[0, top], row=1, col=3)
    fig.update_layout(**{**_LAYOUT, "margin": {**_LAYOUT["margin"], "t": 90}}, height=360, showlegend=False,
                      title=f"after {round_} round(s): imbalance {num(imbalance)} (2 = every row and column alike)")
    return fig


def code_histogram(rec: records.Records) -> go.Figure:
    """How often each code value occurs in a record, against an even spread over the levels."""
    q = np.array(records.unpack_rows(rec.codes, rec.bits)).ravel()
    levels = 2**rec.bits
    counts = np.bincount(q, minlength=levels)
    fig = _fig(title=f"code histogram ({rec.bits} bits: {levels} levels)", xaxis_title="code",
               yaxis_title="count (codes in the record)", height=300, bargap=0.05)
    fig.add_bar(x=np.arange(counts.size), y=counts, marker_color="#ff7f0e", name="codes",
                hovertemplate="code %{x}: %{y} times<extra></extra>")
    _baseline(fig, q.size / levels, f"even spread: {num(q.size / levels, 4)} each")
    return fig


def normalize_slider(tile: np.ndarray, rounds: list[tuple[np.ndarray, float]]) -> go.Figure:
    """`normalize_toy_figure` after 0, 1, ... rounds (`quant.normalize_rounds`), a slider between them."""
    return slider_figure([normalize_toy_figure(tile, scaled, r, imbalance) for r, (scaled, imbalance)
                          in enumerate(rounds)], [str(r) for r in range(len(rounds))], "rounds: ")


def regions_bar(context: int, tail: int, title: str | None = None, max_context: int | None = None) -> go.Figure:
    """The kvarn cache as one bar of regions (sink | records | live | tail) after `context` tokens.

    Each sealed record is its own box. With `max_context` the axis is fixed, so the bar grows as tokens arrive.
    """
    r = region_tokens(context, tail)
    fig = _fig(title=title or f"kvarn cache at {context} tokens, kv_tail_tokens={tail}: {r['body'] // 128} records",
               xaxis_title="token position (oldest first)", height=230, barmode="stack", showlegend=True,
               yaxis={"visible": False}, legend={"orientation": "h", "y": -0.45, "traceorder": "normal"})
    for name in ("sink", "body", "live", "tail"):
        label = REGION_NAMES[name]
        fig.add_bar(y=["cache"], x=[r[name]], orientation="h", name=label, marker_color=REGION_COLORS[name],
                    marker_line={"color": "white", "width": 1}, hovertemplate=f"{label}: %{{x}} tokens<extra></extra>")
    for edge in range(r["sink"] + 128, r["sink"] + r["body"], 128):  # the boundaries between records
        fig.add_vline(x=edge, line={"color": "white", "width": 2})
    if max_context:
        fig.update_xaxes(range=[0, max_context])
    return fig


def regions_slider(tail: int, start: int = 960, max_context: int = 4096, step: int = 64) -> go.Figure:
    """`regions_bar` every `step` tokens up to `max_context`, a context slider between them (the axis fixed),
    opening at `start` tokens (a context where every region holds tokens)."""
    contexts = list(range(0, max_context + 1, step))
    fig = slider_figure([regions_bar(c, tail, max_context=max_context) for c in contexts],
                        [str(c) for c in contexts], "context: ", active=min(start // step, len(contexts) - 1))
    return fig.update_layout(legend={"orientation": "h", "y": 1.02, "yanchor": "bottom", "x": 0},
                             margin={"t": 95})  # the legend above the bar, the slider below it


def regions_stream(max_context: int, tail: int, step: int = 16) -> go.Figure:
    """Tokens per kvarn region as the context streams in, one token at a time (stacked areas)."""
    ctx = np.arange(0, max_context + 1, step)
    rows = [region_tokens(int(c), tail) for c in ctx]
    fig = _fig(title=f"regions as tokens stream in (kv_tail_tokens={tail})", xaxis_title="tokens so far",
               yaxis_title="tokens in region (stacked)", height=340)
    for name in ("sink", "body", "live", "tail"):
        fig.add_scatter(x=ctx, y=[r[name] for r in rows], stackgroup="one", name=REGION_NAMES[name],
                        line={"color": REGION_COLORS[name], "width": 0.5})
    return fig


def window_stream(max_context: int, tail: int, max_kv_size: int, step: int = 16) -> go.Figure:
    """A rolling window as tokens stream in: above, the regions held (stacked) stop at the window; below, on its own
    axis, the tokens dropped so far (they are not held), records leaving oldest first."""
    ctx = np.arange(0, max_context + 1, step)
    rows = [window.kvarn_regions(int(c), tail, max_kv_size) for c in ctx]
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, row_heights=[0.72, 0.28], vertical_spacing=0.06)
    fig.update_layout(**{**_LAYOUT, "height": 400, "title": f"a rolling window of {max_kv_size} tokens "
                                                             f"(kv_tail_tokens={tail}): the sink stays, records "
                                                             "leave oldest first"})
    for name in ("sink", "body", "live", "tail"):
        fig.add_scatter(x=ctx, y=[r[name] for r in rows], stackgroup="one", name=REGION_NAMES[name],
                        line={"color": REGION_COLORS[name], "width": 0.5}, row=1, col=1)
    _baseline(fig, max_kv_size, "max_kv_size", row=1, col=1)
    fig.add_scatter(x=ctx, y=[r["dropped"] for r in rows], name="dropped (not held)", mode="lines",
                    line={"color": "#555555"}, row=2, col=1)
    fig.update_yaxes(title_text="tokens held", row=1, col=1)
    fig.update_yaxes(title_text="dropped", rangemode="tozero", row=2, col=1)
    fig.update_xaxes(title_text="tokens so far", row=2, col=1)
    return fig


def sink_mass_figure(mass: np.ndarray, sink: int = 128, even: float | None = None) -> go.Figure:
    """Heatmap of the attention share on the first `sink` tokens, per layer and query head.

    `even` is the share an even spread of attention would give (`even_share`): the colour scale is white there,
    so only cells above it (purple) draw more attention to the first tokens than their number alone explains.
    """
    layers, heads = mass.shape
    mid = 0.5 if even is None else even
    fig = _fig(title=f"share of attention on the first {sink} token(s)"
                     + (f" · an even spread gives {num(even)}" if even is not None else ""),
               xaxis_title="query head", yaxis_title="layer", height=140 + 40 * layers)
    fig.add_heatmap(z=mass, x=list(range(heads)), y=list(range(layers)), zmin=0, zmax=1, zmid=mid,
                    colorscale=[[0, "#8c8c8c"], [mid, "#ffffff"], [1, "#3f007d"]],
                    text=[[num(v, 2) for v in row] for row in mass], texttemplate="%{text}",
                    colorbar={"title": "share"}, xgap=1, ygap=1,
                    hovertemplate="layer %{y}, head %{x}: %{text}<extra></extra>")
    fig.update_xaxes(dtick=1)
    fig.update_yaxes(dtick=1, autorange="reversed")
    return fig


def sink_layers_figure(mass: np.ndarray, sink: int = 1, even: float | None = None, layers: list[int] | None = None,
                       title: str | None = None) -> go.Figure:
    """The attention share on the first `sink` tokens, one point per query head and a line (head mean) per layer.

    Readable for deep models; `even` (the share of an even spread) is drawn as the baseline; `layers` names
    the rows of `mass` (a capture's `cap.layers`; default 0, 1, ...).
    """
    n, heads = mass.shape
    x = np.asarray(layers if layers is not None else range(n))
    if x.size != n:
        raise ValueError(f"{x.size} layer names for {n} rows of mass")
    first = "token 0" if sink == 1 else f"the first {sink} tokens"
    fig = _fig(title=title or f"share of attention on {first}, per layer", xaxis_title="layer",
               yaxis_title=f"attention share on {first}", height=380, yaxis_range=[0, 1.02])
    fig.add_scatter(x=np.repeat(x, heads), y=mass.ravel(), mode="markers", name="one query head",
                    marker={"color": "#9e9ac8", "size": 7}, customdata=np.tile(np.arange(heads), n),
                    hovertemplate="layer %{x}, head %{customdata}: %{y:.2f}<extra></extra>")
    fig.add_scatter(x=x, y=mass.mean(1), mode="lines+markers", name="mean over heads",
                    line={"color": "#3f007d"}, hovertemplate="layer %{x}: mean %{y:.2f}<extra></extra>")
    if even is not None:
        _baseline(fig, even, f"even spread: {num(even, 2)}")
    fig.update_xaxes(tickvals=x if n <= 40 else None)
    return fig


# fp16 cells of a policy strip, told apart: the scheme's layers, the rule's fp16 layers and these two
STILL_LAYER = ("fp16: does not grow", "#e3e3e3")  # recurrent state, a sliding window: nothing to quantize
DECLINED_LAYER = ("fp16: the scheme declines", "#3d3d3d")  # grows, but the scheme cannot store it (MLA, head dim)
KEPT_LAYER = "fp16: the policy keeps it"  # grows, and the scheme could store it: the policy's rule or an override


def _strip_category(p: Policy, d: Any) -> str:
    """What a policy strip's cell shows: the scheme that took the layer, or why it is fp16."""
    if d.decision != BASELINE:
        return d.decision
    if not d.grows:
        return STILL_LAYER[0]
    why = p.scheme != BASELINE and get_scheme(p.scheme).declines(d.kind, d.k_head_dim, d.v_head_dim, p.options)
    if why and why in d.reason:  # the scheme's own reason, not the policy's (the last of a deep stack)
        return DECLINED_LAYER[0]
    return BASELINE  # kept fp16 by the policy's rule (the last of a deep stack) or by an override


def policy_strip(policies: list[Policy], title: str | None = None) -> go.Figure:
    """One row per policy (model and scheme), one cell per cache entry, coloured by decision; hover shows why.

    fp16 cells come in three shades: a layer that does not grow (light), one the policy keeps fp16 (fp16's grey),
    one the scheme declines (dark).
    """
    colors = {**scheme_colors(), STILL_LAYER[0]: STILL_LAYER[1], DECLINED_LAYER[0]: DECLINED_LAYER[1]}
    drawn = {_strip_category(p, d) for p in policies for d in p.layers}
    order = [name for name in colors if name in drawn]  # the colour bar lists only what the strip shows
    ticks = [KEPT_LAYER if name == BASELINE else name for name in order]
    n = max(len(p.layers) for p in policies)
    z, text, names = [], [], []
    for p in policies:
        z.append([order.index(_strip_category(p, d)) for d in p.layers] + [None] * (n - len(p.layers)))
        pad = [""] * (n - len(p.layers))
        text.append([f"layer {d.index}: {d.kind}, {d.decision} ({d.reason})" for d in p.layers] + pad)
        names.append(f"{p.name} · {p.label} ({len(p.quantized)}/{sum(d.grows for d in p.layers)})")
    if len(set(names)) < len(names):
        raise ValueError(f"two rows would share a name: {names}; pass policies that differ in model or scheme")
    scale = []
    for i, name in enumerate(order):
        scale += [[i / len(order), colors[name]], [(i + 1) / len(order), colors[name]]]
    labels = list(dict.fromkeys(p.label for p in policies))
    fig = _fig(title=title or f"per-layer decisions under {', '.join(labels)} (quantized / growing layers)",
               xaxis_title="cache entry (layer)", yaxis_title="model · scheme",
               height=max(300, 140 + 36 * len(policies)))  # room for the colour bar's six labels
    fig.add_heatmap(z=z, text=text, hoverinfo="text", y=names, colorscale=scale, zmin=-0.5,
                    zmax=len(order) - 0.5, xgap=2, ygap=2,
                    colorbar={"tickvals": list(range(len(order))), "ticktext": ticks, "title": "decision"})
    fig.update_yaxes(autorange="reversed")
    fig.update_xaxes(dtick=1 if n <= 40 else None)
    return fig


def kl_strip(kl: np.ndarray, labels: list[str] | None = None, title: str = "KL per token vs fp16") -> go.Figure:
    """Per-token KL (nats) as bars; hover shows the token."""
    fig = _fig(title=title, xaxis_title="generated token", yaxis_title="KL (nats)", height=260)
    fig.add_bar(x=np.arange(len(kl)), y=kl, marker_color="#ff7f0e", customdata=labels or [""] * len(kl),
                hovertemplate="token %{x} %{customdata}: KL %{y:.2e}<extra></extra>")
    return fig


def position_kl_figure(result: Any, title: str | None = None) -> go.Figure:
    """KL(fp16 || scheme) per position for each scheme of a `fidelity` result (prefill, then decode).

    Variants of a scheme get shades and decreasing widths, so a line lying on another stays visible. A log axis
    cannot show KL 0: such positions are gaps in their line (no false cliff down to a floor), and a scheme with KL 0
    everywhere (it stored nothing quantized) is named in a note instead of drawn.
    """
    data = experiment_data(result)
    schemes = data["schemes"]
    styles = trace_styles(s["label"] for s in schemes)
    fig = _fig(title=title or f"KL(fp16 || scheme) per position, {data['model']}", xaxis_title="position (token)",
               yaxis_title="KL (nats, log)", height=400)
    kls = {s["label"]: [*s["prefill_kl"], *s["decode_kl"]] for s in schemes}
    zero = [label for label, kl in kls.items() if max(kl, default=0) <= 0]
    for i, (label, kl) in enumerate(kls.items()):
        if label not in zero:
            fig.add_scatter(x=list(range(len(kl))), y=[v if v > 0 else None for v in kl], mode="lines", name=label,
                            line={"color": styles[label]["color"], "width": max(4.5 - 1.5 * i, 1.2)},
                            connectgaps=False,
                            hovertemplate="position %{x}: KL %{y:.3g}<extra>" + html.escape(label) + "</extra>")
    if schemes:
        fig.add_vline(x=len(schemes[0]["prefill_kl"]) - 0.5, line=BASELINE_LINE, annotation_text="decode starts")
    notes = []
    nonzero = [i for kl in kls.values() for i, v in enumerate(kl) if v > 0]
    if nonzero and min(nonzero) > 32:  # a long stretch of KL 0 (tokens attended in fp16): start the view near its end
        fig.update_xaxes(range=[min(nonzero) - 24, max(len(kl) for kl in kls.values())])
        notes.append(f"KL is 0 before position {min(nonzero)} (zoom out to see it)")
    if zero:
        notes.append(f"KL 0 at every position (nothing quantized): {', '.join(zero)}")
    if notes:
        fig.add_annotation(text="<br>".join(notes), showarrow=False, xref="paper", yref="paper", x=0, y=1.02,
                           xanchor="left", yanchor="bottom", align="left", font={"size": 11})
        fig.update_layout(margin={**_LAYOUT["margin"], "t": 60 + 16 * len(notes)})
    positive = [v for kl in kls.values() for v in kl if v > 0]
    if positive:
        fig.update_yaxes(type="log", **log_ticks(positive))
    return fig


def kernel_times_figure(data: dict[str, Any], title: str | None = None) -> go.Figure:
    """Decode attention time against context, one line per implementation (benchmarks/results/decode_attention-*).

    Colour: the scheme (shade per width); solid: the fused kernel, dashed: mlx-lm's path; fp16 SDPA is the baseline,
    drawn first as a wide pale band so a kernel as fast as it lies on it without hiding it.
    """
    rows = data["rows"]
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    scheme_names = {impl: next((n for n in sorted(SCHEMES, key=len, reverse=True) if n in impl), BASELINE)
                    for impl in impls}
    widths = {impl: impl.rsplit(scheme_names[impl], 1)[-1] for impl in impls}
    styles = trace_styles(f"{scheme_names[i]}{widths[i]}" for i in impls)
    fig = _fig(title=title or f"decode attention per step on {data.get('device', '?')}: time vs context",
               xaxis_title="context (tokens, log)", yaxis_title="time per decode step (µs, log)",
               xaxis_type="log", yaxis_type="log", height=440)
    for impl in impls:
        pts = sorted((r["context"], r["us"]) for r in rows if r["impl"] == impl)
        st = styles[f"{scheme_names[impl]}{widths[impl]}"]
        dash = "solid" if impl.startswith("fused") or scheme_names[impl] == BASELINE else "dash"
        base = scheme_names[impl] == BASELINE  # a wide pale band under the others: a kernel on it leaves it seen
        fig.add_scatter(x=[p[0] for p in pts], y=[p[1] for p in pts], mode="lines+markers", name=impl,
                        line={"color": st["color"], "dash": dash, "width": 8 if base else 2},
                        opacity=0.5 if base else 1.0, marker={"symbol": st["symbol"], "size": 12 if base else 8},
                        hovertemplate="%{x} tokens: %{y:.3g} µs<extra>" + html.escape(impl) + "</extra>")
    fig.update_xaxes(**context_ticks(r["context"] for r in rows))
    fig.update_yaxes(**log_ticks(r["us"] for r in rows))
    return fig


def stall_shares(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The sampled calls of a stall file (benchmarks/results/decode_stalls-*, `stall_sample.py`), longest context
    first and fp16 SDPA (the baseline) first within one: per call its main kernel (the most samples), µs under the
    profiler, warp instructions executed, the share of warp slots active, and the share of its program-counter
    samples by stall reason ("selected": the warp issued)."""
    rows = []
    for case in data["cases"]:
        if not case.get("kernels"):
            continue
        kernel = max(case["kernels"], key=lambda k: sum(k["reasons"].values()))
        total = sum(kernel["reasons"].values())
        rows.append({"impl": case["impl"], "context": case["context"], "kernel": kernel["kernel"],
                     "us": kernel["gpu__time_duration.sum"] / 1e3, "instructions": kernel["smsp__inst_executed.sum"],
                     "active": kernel["sm__warps_active.avg.pct_of_peak_sustained_active"] / 100,
                     "shares": {reason: n / total for reason, n in kernel["reasons"].items()}})
    return sorted(rows, key=lambda r: (-r["context"], r["impl"] != "fp16_sdpa"))


def stall_figure(data: dict[str, Any], title: str | None = None, top: int = 6) -> go.Figure:
    """What each sampled call's warps wait on: one stacked bar per call (fp16 SDPA first), its samples' shares by
    reason on one shared axis, the `top` reasons over all bars by name and the rest as "other"."""
    rows = stall_shares(data)
    summed: dict[str, float] = {}
    for r in rows:
        for reason, share in r["shares"].items():
            summed[reason] = summed.get(reason, 0.0) + share
    reasons = sorted(summed, key=summed.get, reverse=True)[:top]
    # stall reasons are no schemes: the category colours in order, whatever schemes are registered
    colors = {**dict(zip(reasons, CATEGORY_COLORS)), "other": shade(OTHER_COLOR, 0.7)}
    names = [f"{r['impl']} at {r['context'] // 1024}K tokens" for r in rows]
    fig = _fig(title=title or f"what the warps wait on, one decode call each on {data.get('device', '?')}",
               xaxis_title="share of the call's sampled warp cycles (%)", yaxis_title="decode attention call",
               barmode="stack", height=160 + 56 * max(len(rows), 1), legend={"traceorder": "normal"})
    for label in [*reasons, "other"]:
        shares = [r["shares"].get(label, 0.0) if label != "other" else
                  sum(v for k, v in r["shares"].items() if k not in reasons) for r in rows]
        fig.add_bar(y=names, x=[100 * v for v in shares], name=label, orientation="h", marker_color=colors[label],
                    hovertemplate="%{y}: %{x:.3g}% " + html.escape(label) + "<extra></extra>")
    fig.update_yaxes(autorange="reversed")
    fig.update_xaxes(range=[0, 100])
    return fig


def bars_figure(rows: list[dict[str, Any]], x: str, y: str, color: str, title: str, log: bool = False,
                ytitle: str | None = None, text: str | None = None, xtitle: str | None = None) -> go.Figure:
    """Grouped bars from rows of dicts: one trace per `color` value; `text`: a key whose value labels a bar."""
    fig = _fig(title=title, xaxis_title=xtitle or x, yaxis_title=ytitle or y, barmode="group", height=400,
               yaxis_type="log" if log else "linear")
    keys = list(dict.fromkeys(str(r[color]) for r in rows))
    styles = trace_styles(keys)
    for key in keys:
        pts = [r for r in rows if str(r[color]) == key]
        labels = [str(r.get(text) or "") for r in pts] if text else None
        fig.add_bar(x=[str(r[x]) for r in pts], y=[r[y] for r in pts], name=key,
                    marker_color=styles[key]["color"], text=labels, textposition="outside" if text else None,
                    textangle=-90 if text else None, cliponaxis=False, constraintext="none",
                    textfont={"size": 11, "color": styles[key]["color"]} if text else None,
                    hovertemplate=f"%{{x}}, {html.escape(key)}: %{{y:.3g}}<extra></extra>")
    if log:
        fig.update_yaxes(**log_ticks(r[y] for r in rows))
    return fig


def table_html(rows: list[dict[str, Any]], caption: str = "") -> str:
    """A small HTML table from rows of dicts (the keys of the first row are the columns)."""
    if not rows:
        return "<i>(no rows)</i>"
    cols = list(rows[0])
    fmt = lambda v: f"{v:.3g}" if isinstance(v, float) else html.escape(str(v))  # noqa: E731
    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    body = "".join("<tr>" + "".join(f"<td>{fmt(r.get(c, ''))}</td>" for c in cols) + "</tr>" for r in rows)
    cap = f"<caption>{html.escape(caption)}</caption>" if caption else ""
    return f"<table>{cap}<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


class Table:
    """Rows of dicts that display as an HTML table in Jupyter."""

    def __init__(self, rows: list[dict[str, Any]], caption: str = ""):
        self.rows, self.caption = rows, caption

    def _repr_html_(self) -> str:
        return table_html(self.rows, self.caption)

    def __repr__(self) -> str:
        return "\n".join(str(r) for r in self.rows)


# -- the beyond-KL experiments (gmlx_lab.experiments) ------------------------------------------------
# Each builder takes a result object or its `to_dict()` (as stored in benchmarks/results/*.json), so the
# same figure draws a live run and a committed one; where a share is shown, fp16 is drawn as the baseline.

ACCURACY_SCALE = "Greens"  # every passkey heatmap: 0% white, 100% dark green
KL_SCALE = "Oranges"


def experiment_data(result: Any) -> dict[str, Any]:
    """A result of gmlx_lab.experiments as its dict (a dict, e.g. read from benchmarks/results, passes as is)."""
    return result.to_dict() if hasattr(result, "to_dict") else result


def passkey_heatmaps(result: Any, title: str | None = None, per_row: int = 4) -> go.Figure:
    """One heatmap per scheme: keys recalled by needle depth (rows) and prompt length (columns), each cell as a count
    (1/1, 0/1: a cell of one key is no percentage), each title the scheme's total count; at most `per_row` schemes
    side by side, so the figure fits a notebook's width (it takes the width it is given)."""
    data = experiment_data(result)
    labels, lengths, depths = data["labels"], data["lengths"], data["depths"]
    per_cell = int(data.get("keys_per_cell", 1))
    counts = recall_counts(data)  # counts, not shares: a cell of one key is found or not
    names = [f"{label}{' (baseline)' if label == BASELINE else ''}: {counts[label][0]} of {counts[label][1]} keys"
             for label in labels]
    rows, cols = -(-len(labels) // per_row), min(len(labels), per_row)
    fig = make_subplots(rows=rows, cols=cols, shared_yaxes=True, horizontal_spacing=0.03,
                        vertical_spacing=0.45 / rows, subplot_titles=names)
    for i, label in enumerate(labels):
        row, col = i // cols + 1, i % cols + 1
        z = np.array(data["grids"][label], dtype=float)
        fig.add_heatmap(z=z, x=[str(n) for n in lengths], y=[f"{100 * d:.0f}%" for d in depths], row=row, col=col,
                        zmin=0, zmax=1, colorscale=ACCURACY_SCALE, showscale=i == len(labels) - 1,
                        colorbar={"title": "recalled", "tickformat": ".0%"},
                        text=[[f"{round(v * per_cell)}/{per_cell}" for v in line] for line in z],
                        texttemplate="%{text}", xgap=2, ygap=2,
                        hovertemplate=f"{label}<br>%{{x}} tokens, needle at %{{y}}: %{{z:.0%}}<extra></extra>")
        fig.update_xaxes(title_text="prompt length (tokens)", type="category", row=row, col=col)
    for row in range(1, rows + 1):
        fig.update_yaxes(title_text="needle depth (% of context)", type="category", autorange="reversed", row=row,
                         col=1)
    fig.update_yaxes(type="category", autorange="reversed")
    fig.update_layout(**{**_LAYOUT, "margin": {**_LAYOUT["margin"], "t": 90}}, height=140 + 260 * rows,
                      title=title or f"passkey retrieval, {data['model']} (greedy answer holds the key)")
    return fig


def draft_figure(result: Any, title: str | None = None) -> go.Figure:
    """Acceptance rate and tokens per verify step for each target cache, fp16's as a dashed baseline."""
    data = experiment_data(result)
    runs = data["runs"]
    labels = [r["label"] for r in runs]
    styles = trace_styles(labels)
    colors = [styles[label]["color"] for label in labels]
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.12,
                        subplot_titles=("drafted tokens accepted", "tokens per target forward pass"))
    fig.add_bar(x=labels, y=[100 * r["acceptance"] for r in runs], marker_color=colors, row=1, col=1,
                hovertemplate="%{x}: %{y:.1f}% accepted<extra></extra>", showlegend=False)
    fig.add_bar(x=labels, y=[r["tokens_per_step"] for r in runs], marker_color=colors, row=1, col=2,
                hovertemplate="%{x}: %{y:.2f} tokens per step<extra></extra>", showlegend=False)
    base = next((r for r in runs if r["label"] == BASELINE), None)
    if base is not None:
        fig.add_hline(y=100 * base["acceptance"], line_dash="dash", row=1, col=1,
                      annotation_text="fp16 baseline", annotation_position="top left")
        fig.add_hline(y=base["tokens_per_step"], line_dash="dash", row=1, col=2,
                      annotation_text="fp16 baseline", annotation_position="top left")
    fig.add_hline(y=1, line_dash="dot", line_color="#9e9e9e", row=1, col=2, annotation_text="no speculation",
                  annotation_position="bottom right")
    fig.update_yaxes(title_text="accepted (% of drafted)", range=[0, 105], row=1, col=1)
    fig.update_yaxes(title_text="tokens per step", range=[0, data["num_draft_tokens"] + 1.1], row=1, col=2)
    fig.update_xaxes(title_text="target cache", row=1, col=1)
    fig.update_xaxes(title_text="target cache", row=1, col=2)
    fig.update_layout(**_LAYOUT, height=380, title=title or f"speculative decoding, {data['model']} verifying "
                      f"{data['draft']} ({data['num_draft_tokens']} draft tokens per step)")
    return fig


def weights_kv_figure(result: Any, title: str | None = None) -> go.Figure:
    """Heatmap of decode median KL (log colour) by weight width (rows) and KV scheme (columns).

    Each cell's text gives the KL, and for pairs of two quantized parts how it compares with the sum
    of its parts (1.00x: the errors just add up).
    """
    data = experiment_data(result)
    rows = data["rows"]
    weights = list(dict.fromkeys(r["weights"] for r in rows))
    kvs = list(dict.fromkeys(r["kv"] for r in rows))
    cell = {(r["weights"], r["kv"]): r for r in rows}

    def label(w: str, kv: str) -> str:
        ratio = cell[w, kv].get("compounding")
        both = ratio is not None  # two quantized parts (compounding is None otherwise)
        return f"{cell[w, kv]['median_kl']:.2g}" + (f"<br>{ratio:.2f}x sum" if both else "")

    z = np.array([[np.log10(max(cell[w, kv]["median_kl"], 1e-9)) for kv in kvs] for w in weights])
    text = [[label(w, kv) for kv in kvs] for w in weights]
    fig = _fig(title=title or f"decode median KL vs fp16 weights + fp16 KV, {data['model']} "
                              f"({data['prefill']}-token prefill, {data['decode']} scored tokens)",
               xaxis_title="KV cache", yaxis_title="weights (nn.quantize width, group "
                                                  f"{data['group_size']})", height=120 + 70 * len(weights))
    fig.add_heatmap(z=z, x=kvs, y=weights, text=text, texttemplate="%{text}", colorscale=KL_SCALE, xgap=2, ygap=2,
                    colorbar={"title": "log10 KL (nats)"}, hovertemplate="%{y} weights, %{x} cache: %{text}"
                                                                          "<extra></extra>")
    fig.update_yaxes(autorange="reversed", type="category")
    fig.update_xaxes(type="category")
    return fig


def weights_kv_positions(result: Any, weights: str, title: str | None = None) -> go.Figure:
    """KL per decoded token for one weight width under each KV scheme (does the error grow with position?)."""
    data = experiment_data(result)
    rows = [r for r in data["rows"] if r["weights"] == weights]
    if not rows:
        raise ValueError(f"no rows for weights {weights!r}; have {sorted({r['weights'] for r in data['rows']})}")
    fig = _fig(title=title or f"KL per decoded token, {weights} weights, {data['model']}",
               xaxis_title=f"decoded token (after {data['prefill']} prefill tokens)", yaxis_title="KL (nats)",
               yaxis_type="log", height=360)
    styles = trace_styles(r["kv"] for r in rows)
    for r in rows:
        st = styles[r["kv"]]
        fig.add_scatter(y=[max(v, 1e-9) for v in r["decode_kl"]], mode="lines", name=f"{weights} + {r['kv']}",
                        line={"color": st["color"], "dash": "solid" if r["kv"] == BASELINE else "dot"},
                        hovertemplate="token %{x}: KL %{y:.3g}<extra>" + html.escape(r["kv"]) + "</extra>")
    fig.update_yaxes(**log_ticks(max(v, 1e-9) for r in rows for v in r["decode_kl"]))
    return fig
