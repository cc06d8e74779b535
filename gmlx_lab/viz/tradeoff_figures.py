"""Equal-memory figures: fidelity against cache bytes per token, cache size against context, gmlx's published
KL beside ours, and the fixed KL colour scale of the live compare.

Colours are the schemes' registry colours; schemes that appear with several tails differ by dash.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import plotly.graph_objects as go
from plotly.colors import sample_colorscale
from plotly.subplots import make_subplots

from ..measure.tradeoff import TradeoffPoint
from ..registry import BASELINE
from .field_figures import place_labels
from .figures import LABEL_BACKGROUND, scheme_color
from .style import context_ticks, log_ticks, num, shade, trace_styles

__all__ = ["KL_SCALE", "kl_color", "kl_legend_html", "published_vs_ours_figure", "size_figure", "tradeoff_figure"]

LAYOUT = {"template": "plotly_white", "margin": {"l": 70, "r": 20, "t": 60, "b": 55}}
DASHES = ("solid", "dash", "dot", "dashdot", "longdash")
KL_SCALE = (1e-5, 1.0)  # nats: the live compare's fixed log colour scale (below: unshaded, above: darkest)
KL_COLORSCALE = "YlOrRd"


def _dashes(families: Sequence[str], scheme_of: dict[str, str], first: int = 0) -> dict[str, str]:
    """A dash per family, in order within each scheme: the first family of a scheme DASHES[first], the next
    DASHES[first + 1], ... (cycling over DASHES[first:])."""
    seen: dict[str, int] = {}
    out = {}
    for fam in families:
        n = seen.get(scheme_of[fam], 0)
        seen[scheme_of[fam]] = n + 1
        out[fam] = DASHES[first + n % (len(DASHES) - first)]
    return out


# A scheme's tails look the same in every figure: (shade towards white, marker, dash) by kv_tail_tokens.
TAIL_STYLES = {0: (-0.45, "circle", "solid"), 128: (0.0, "square", "dash"), 256: (0.2, "triangle-up", "dashdot"),
               1024: (0.45, "diamond", "dot")}
OTHER_TAIL = (0.3, "x", "longdash")


def _family_styles(points: Sequence[TradeoffPoint]) -> dict[str, dict[str, str]]:
    """{family: {color, dash, symbol}}: the scheme's colour; a family with a tail takes its tail's shade, marker and
    dash (TAIL_STYLES, the same in every figure), the others `trace_styles`' with a dash per family."""
    families = list(dict.fromkeys(p.family for p in points))
    tails = {p.family: p.tail for p in points}
    styles = trace_styles(families)
    dash = _dashes(families, {p.family: p.scheme for p in points})
    out = {}
    for fam in families:
        if tails[fam] is None:
            out[fam] = {**styles[fam], "dash": dash[fam]}
            continue
        amount, symbol, tail_dash = TAIL_STYLES.get(tails[fam], OTHER_TAIL)
        out[fam] = {"color": shade(scheme_color(fam), amount), "symbol": symbol, "dash": tail_dash}
    return out


def tradeoff_figure(points: Sequence[TradeoffPoint], title: str | None = None, height: int = 420) -> go.Figure:
    """Decode median KL against cache KiB per token, one line per scheme family (scheme + tail), one marker per
    width (labelled with its bits); fp16 is the dotted vertical line (KL 0). Points of one model and context.

    Down and to the left is better; a point to the right of another family's line costs more memory for that
    family's fidelity. K and V at different widths (kvarn k8v4) are markers of their family's colour and marker,
    unjoined, labelled k8v4, at their true bytes per token. The x axis starts at 0, so a cache at 90% of fp16 looks
    it; where every point sits within a sixth of the axis (a model whose policy quantizes few layers), the axis
    starts just below the points instead and its title says where, so the points do not pile up in one column.
    Points with KL exactly 0 other than fp16 (nothing quantized) cannot sit on a log axis: the title lists them.
    """
    if not points:
        raise ValueError("tradeoff_figure needs at least one TradeoffPoint (from gmlx_lab.tradeoff.tradeoff_points)")
    models = {(p.model, p.context) for p in points}
    if len(models) > 1:
        raise ValueError(f"tradeoff_figure draws one model at one context, got {sorted(models)}: "
                         "filter the points first")
    model, context = models.pop()
    fp16 = [p for p in points if p.scheme == BASELINE]
    zero = [p.label for p in points if p.scheme != BASELINE and p.kl <= 0]
    rest = [p for p in points if p.scheme != BASELINE and p.kl > 0]
    ref = fp16[0].bytes_per_token if fp16 else points[0].fp16_bytes_per_token
    widest = max([ref, *(p.bytes_per_token for p in rest)]) / 1024
    fig = go.Figure()
    kls = [p.kl for p in rest] or [1e-3]
    decades = [math.floor(math.log10(min(kls))) - 0.15, math.ceil(math.log10(max(kls))) + 0.4]  # a label each end
    xs = [p.bytes_per_token / 1024 for p in rest]
    crowded = bool(xs) and max(xs) - min(xs) < 0.15 * 1.1 * widest  # near-vertical lines: labels beside, not above
    start = 0.0
    if crowded:  # zoom to the points and fp16's line; the title says the axis does not start at 0
        pad = max(0.1 * (widest - min(xs)), 0.02 * widest)
        start = float(f"{min(xs) - pad:.2g}")
    x_title = "cache per token of context (KiB)" + (f"; the axis starts at {num(start)} KiB, not 0" if start else "")
    fig.update_layout(**LAYOUT, height=height, xaxis={"range": [start, widest + (widest - start) * 0.1]},
                      yaxis={"type": "log", "dtick": 1, "exponentformat": "e", "range": decades},
                      xaxis_title=x_title, yaxis_title="decode median KL vs fp16 (nats)",
                      legend_title_text="scheme (width in bits)")
    style = _family_styles(rest)
    x_range = [start, widest + (widest - start) * 0.1]
    # each width's label beside its marker where it covers nothing, else on an arrow to a free place (hover: none)
    placed = place_labels([(p.bytes_per_token / 1024, p.kl, str(p.width)) for p in rest], x_range,
                          width_px=620, height_px=height - 150)
    places = {id(p): placed[i] for i, p in enumerate(rest) if i in placed}
    for fam in style:
        for split in (False, True):
            pts = sorted((p for p in rest if p.family == fam and p.split == split),
                         key=lambda p: (p.bytes_per_token, -p.kl))
            if not pts:
                continue
            color = style[fam]["color"]
            fig.add_scatter(
                x=[p.bytes_per_token / 1024 for p in pts], y=[p.kl for p in pts],
                name=f"{fam}, K and V widths differ" if split else fam,
                mode="markers+text" if split else "lines+markers+text",
                text=[p.width if id(p) in places and places[id(p)] is None else "" for p in pts],
                textposition="middle right", textfont={"color": color},
                marker={"size": 10 if split else 8, "symbol": "diamond-open" if split else style[fam]["symbol"],
                        "color": color},
                line={"color": color, "dash": style[fam]["dash"]}, customdata=[p.label for p in pts],
                hovertemplate="%{customdata}: %{x:.2f} KiB/token, KL %{y:.2e} nats<extra></extra>")
            for p in pts:
                place = places.get(id(p))
                if place is not None:
                    fig.add_annotation(x=p.bytes_per_token / 1024, y=math.log10(p.kl), text=str(p.width),
                                       ax=place[0], ay=-place[1], showarrow=True, arrowhead=0, arrowwidth=1,
                                       arrowcolor=color, font={"size": 11, "color": color}, bgcolor=LABEL_BACKGROUND)
    fig.add_vline(x=ref / 1024, line_dash="dot", line_color=scheme_color(BASELINE))
    fig.add_annotation(x=ref / 1024, y=1, yref="paper", yanchor="bottom", xanchor="right", showarrow=False,
                       text=f"fp16 {ref / 1024:.3g} KiB/token", font={"size": 11})  # above the points
    note = f"<br><sup>KL 0 (nothing quantized), not drawn: {', '.join(zero)}</sup>" if zero else ""
    fig.update_layout(title=(title or f"{model} at {context} tokens: fidelity against memory") + note)
    if zero:
        fig.update_layout(margin={**LAYOUT["margin"], "t": 85})
    return fig


def size_figure(curves: dict[str, Sequence[float]], contexts: Sequence[int],
                crossings: dict[str, int | None] | None = None, title: str = "cache per token against context",
                height: int = 380) -> go.Figure:
    """Cache KiB per token against context (log x), one line per scheme label ({label: bytes per token at each
    context}, as `gmlx_lab.tradeoff.size_curves` returns); `crossings` marks named contexts ({text: tokens})
    with vertical lines, e.g. where kvarn becomes smaller than affine (labelled 35.7K above 9999 tokens)."""
    if not curves:
        raise ValueError("size_figure needs at least one curve: {label: [bytes per token, ...]}")
    for label, ys in curves.items():
        if len(ys) != len(contexts):
            raise ValueError(f"curve {label!r} has {len(ys)} values for {len(contexts)} contexts")
    fig = go.Figure()
    span = [math.log10(min(contexts)), math.log10(max(contexts))]
    fig.update_layout(**LAYOUT, height=height, title=title,
                      xaxis={"type": "log", "range": span, **context_ticks(contexts)},
                      xaxis_title="context (tokens)", yaxis_title="cache per token of context (KiB)",
                      yaxis_rangemode="tozero")
    dash = _dashes(list(curves), {label: label.split()[0].rstrip("0123456789") for label in curves})
    for label, ys in curves.items():
        fig.add_scatter(x=list(contexts), y=np.asarray(ys, float) / 1024, name=label, mode="lines",
                        line={"color": scheme_color(label), "dash": "dot" if label == BASELINE else dash[label]},
                        hovertemplate="%{x} tokens: %{y:.3g} KiB/token<extra>" + html.escape(label) + "</extra>")
    for i, (text, at) in enumerate((crossings or {}).items()):
        if at is not None:
            fig.add_vline(x=at, line_dash="dash", line_color="#555555", line_width=1)
            tokens = f"{at}" if at < 10000 else f"{at / 1000:.1f}K"  # 4 significant digits at most
            right_half = math.log10(at) > sum(span) / 2  # there the label reads leftwards, inside the plot
            fig.add_annotation(x=math.log10(at), y=1 - 0.1 * i, yref="paper", text=f"{text}: {tokens} tokens",
                               showarrow=False, xanchor="right" if right_half else "left",
                               bgcolor="rgba(255,255,255,0.8)")  # log axis: log10
    return fig


def published_vs_ours_figure(published: Sequence[dict[str, Any]], ours: Sequence[TradeoffPoint],
                             published_title: str = "gmlx (published)", ours_title: str | None = None,
                             height: int = 400) -> go.Figure:
    """gmlx's published decode median KL per width (rows {"bits": b, scheme: KL, ...}) and ours (points of one
    run) side by side, on one shared log KL axis. Published lines are solid; ours dashed (dotted for a second
    family of the same scheme, e.g. another tail)."""
    if not published or not ours:
        raise ValueError("published_vs_ours_figure needs published rows and our points")
    schemes = [k for k in published[0] if k != "bits"]
    model = ours[0].model
    fig = make_subplots(rows=1, cols=2, shared_yaxes=True, horizontal_spacing=0.1,
                        subplot_titles=(published_title, ours_title or f"ours: {model}, {ours[0].context} tokens"))
    for s in schemes:
        rows = sorted(published, key=lambda r: r["bits"])
        fig.add_scatter(x=[r["bits"] for r in rows], y=[r[s] for r in rows], name=f"{s} (gmlx)",
                        mode="lines+markers", line={"color": scheme_color(s), "dash": "solid"}, row=1, col=1,
                        hovertemplate=f"{s} %{{x}}-bit: KL %{{y:.2e}} nats<extra>gmlx</extra>")
    rest = [p for p in ours if p.scheme != BASELINE and p.kl > 0]
    style = _family_styles(rest)
    order = _dashes(list(style), {p.family: p.scheme for p in rest}, first=1)
    for fam in style:
        for split in (False, True):
            pts = sorted((p for p in rest if p.family == fam and p.split == split), key=lambda p: p.bits + p.v_bits)
            if not pts:
                continue
            fig.add_scatter(x=[(p.bits + p.v_bits) / 2 for p in pts], y=[p.kl for p in pts],
                            name=f"{fam}, K and V widths differ (ours)" if split else f"{fam} (ours)",
                            mode="markers+text" if split else "lines+markers", text=[p.width for p in pts],
                            textposition="middle right",
                            marker={"symbol": "diamond-open" if split else style[fam]["symbol"],
                                    "size": 9 if split else 6, "color": style[fam]["color"]},
                            line={"color": style[fam]["color"], "dash": order[fam]}, row=1, col=2,
                            customdata=[p.label for p in pts],
                            hovertemplate="%{customdata}: KL %{y:.2e} nats<extra>ours</extra>")
    fig.update_yaxes(type="log", title_text="decode median KL vs fp16 (nats)",
                     **log_ticks([r[s] for r in published for s in schemes] + [p.kl for p in rest]))
    fig.update_yaxes(showticklabels=True, row=1, col=2)
    fig.update_xaxes(title_text="code width (bits)", dtick=1, row=1, col=1)
    fig.update_xaxes(title_text="code width (bits; K and V differ: their mean)", dtick=1, row=1, col=2)
    fig.update_layout(**LAYOUT, height=height, title="decode median KL per width: gmlx's model and ours")
    return fig


def kl_color(kl: float) -> str | None:
    """The live compare's shade for a token's KL (nats) on the fixed log scale KL_SCALE; None below it."""
    lo, hi = KL_SCALE
    if not kl >= lo:  # also NaN
        return None
    t = min(1.0, (math.log10(kl) - math.log10(lo)) / (math.log10(hi) - math.log10(lo)))
    return sample_colorscale(KL_COLORSCALE, [t])[0]


def kl_legend_html() -> str:
    """A colour bar for `kl_color`: the fixed log scale with a tick per decade, in nats."""
    lo, hi = (round(math.log10(v)) for v in KL_SCALE)
    cells = "".join(
        f"<span style='display:inline-block;width:48px;text-align:center;background:{kl_color(10.0 ** e)};"
        f"color:{'#fff' if e >= hi - 1 else '#000'}'>1e{e}</span>" for e in range(lo, hi + 1))
    return (f"<div style='font-size:12px;line-height:1.4'><b>token shade</b>: KL(fp16 ‖ scheme) in nats {cells}"
            f"<br><span style='color:#666'>one fixed log scale for every column; below 1e{lo}: unshaded; hover a "
            "token for its value; the first token that differs from fp16's text is outlined in red</span></div>")
