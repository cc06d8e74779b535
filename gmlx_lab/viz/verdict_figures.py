"""Notebook 12's figures: KL with its band against memory share (a slider over contexts), and the quality floor's
evidence (passkey retrieval against KL)."""

from __future__ import annotations

import math

import plotly.graph_objects as go

from ..measure.banded import Row
from ..measure.verdict import BUDGETS, KEEP_KL, METRIC, Evidence, VerdictResults, context_label
from ..registry import BASELINE
from .style import frame_slider, log_ticks, num, trace_styles


def _family(row: Row) -> str:
    """The line a row belongs to: its scheme and tail without the width ("kvarn4 tail=128" -> "kvarn tail=128")."""
    if row.scheme == "float":  # mxfp4, nvfp4, mxfp8: one family of microscaling floats
        return "float (mxfp, nvfp)"
    head, _, rest = row.label.partition(" ")
    return f"{head.rstrip('0123456789')} {rest}".strip()


def _width(row: Row) -> str:
    """A point's label beside its marker: the width in bits ("4"), or the format's name for the float family."""
    head = row.label.split(" ")[0]
    return head if row.scheme == "float" else head[len(head.rstrip("0123456789")):]


def _traces(results: VerdictResults, context: int, families: list[str], styles: dict[str, dict[str, str]]
            ) -> list[go.Scatter]:
    """One trace a family at one context: its widths by share, mean KL with the interval as error bars (KL 0 left out:
    a row that stored nothing quantized has no place on a log axis)."""
    rows = [r for r in results.at(context) if r.scheme != BASELINE and r.interval(METRIC).estimate > 0]
    traces = []
    for family in families:
        mine = sorted((r for r in rows if _family(r) == family), key=lambda r: r.share)
        band = [r.interval(METRIC) for r in mine]
        style = styles[family]
        traces.append(go.Scatter(
            x=[100 * r.share for r in mine], y=[b.estimate for b in band], name=family, legendgroup=family,
            mode="lines+markers+text", text=[_width(r) for r in mine], textposition="top center",
            textfont={"size": 9, "color": style["color"]}, line={"color": style["color"], "dash": style["dash"]},
            marker={"symbol": style["symbol"], "size": 8, "color": style["color"]},
            error_y={"type": "data", "symmetric": False, "array": [b.high - b.estimate for b in band],
                     "arrayminus": [b.estimate - b.low for b in band], "thickness": 1.2, "width": 4},
            customdata=[[num(b.low), num(b.high), r.quantized_layers] for r, b in zip(mine, band)],
            hovertemplate=family + ", %{text} bits<br>%{x:.1f}% of fp16's bytes<br>mean KL %{y:.3g} "
                          "[%{customdata[0]}, %{customdata[1]}]<br>layers quantized %{customdata[2]}<extra></extra>"))
    return traces


def verdict_figure(results: VerdictResults, budgets: tuple[float, ...] = BUDGETS) -> go.Figure:
    """Mean KL(fp16 || scheme) with its 95% band against stored bytes as a share of fp16's; a slider picks the context.

    One line a scheme (and tail), through its widths; fp16 is the dashed line at 100% (its KL is 0); dotted lines
    mark the budgets of the recommendation table; a red dashed line the quality floor (`verdict.KEEP_KL`); a grey
    band marks the KL floor of rows computed in fp16 (`VerdictResults.kl_floor`). Each context is a frame, so the
    figure moves without a kernel.
    """
    contexts = results.contexts
    families = list(dict.fromkeys(_family(r) for r in results.rows if r.scheme != BASELINE))
    styles = trace_styles(families)
    values = [v for r in results.rows if r.scheme != BASELINE
              for v in (r.interval(METRIC).low, r.interval(METRIC).high) if v > 0]

    def title(context: int) -> str:
        # the quality floor's line is named here: a label on the line would cover markers near it in some frame
        return (f"{results.model} at {context} tokens: mean KL against memory, 95% intervals over "
                f"{results.passages} passages<br><sup>red dashed line: the quality floor, mean KL {KEEP_KL:g}; rows "
                "above it are not recommended</sup>")

    fig = go.Figure(data=_traces(results, contexts[0], families, styles),
                    frames=[go.Frame(data=_traces(results, c, families, styles), name=context_label(c),
                                     layout={"title": {"text": title(c)}}) for c in contexts]
                    if len(contexts) > 1 else [])
    fig.add_vline(x=100, line={"color": "#444444", "dash": "dash"}, annotation_text="fp16 (KL 0)",
                  annotation_position="bottom left")
    for b in budgets:
        fig.add_vline(x=100 * b, line={"color": "#999999", "dash": "dot", "width": 1},
                      annotation_text=f"budget {100 * b:.0f}%", annotation_position="top left",
                      annotation_font_size=9)
    fig.add_hline(y=KEEP_KL, line={"color": "#d62728", "dash": "dash", "width": 1})
    if results.kl_floor:  # computed in fp16: below this KL the arithmetic, not the cache, moves the output
        fig.add_hrect(y0=min(values + [results.kl_floor]) / 2, y1=results.kl_floor, line_width=0,
                      fillcolor="#999999", opacity=0.15)
        # an annotation on a log axis takes log10 of its position (a shape takes the value itself)
        fig.add_annotation(xref="paper", x=0.01, y=math.log10(results.kl_floor), yanchor="top", xanchor="left",
                           showarrow=False, font={"size": 10, "color": "#555555"},
                           text=f"below {results.kl_floor:g}: fp16 arithmetic's floor, not ranked")
    lowest = min([100 * r.share for r in results.rows] + [100 * b for b in budgets])
    fig.update_layout(
        title=title(contexts[0]), height=560, margin={"t": 70, "b": 110},
        xaxis={"title": "stored bytes, % of fp16's at that context (layers kept fp16 included)",
               "range": [5 * (lowest // 5) - 3, 103]},
        yaxis={"title": "mean KL(fp16 || scheme), nats (log)", "type": "log", **log_ticks(values)},
        sliders=[frame_slider([context_label(c) for c in contexts], "context: ")]
        if len(contexts) > 1 else [],  # one context: nothing to slide to
        legend={"font": {"size": 11}, "title": {"text": "scheme (labels: bits)"}})
    return fig


def floor_figure(evidence: list[Evidence]) -> go.Figure:
    """Passkey keys retrieved against mean KL, one point a (scheme, context) the field and the verdict both ran;
    the quality floor's mean KL as a line, rows that lost fp16's retrieval (Wilson intervals apart) in red."""
    kept = [e for e in evidence if e.kept_retrieval]
    lost = [e for e in evidence if not e.kept_retrieval]

    def trace(items: list[Evidence], name: str, color: str, symbol: str) -> go.Scatter:
        return go.Scatter(
            x=[e.row.interval(METRIC).estimate for e in items], y=[100 * e.retrieval.estimate for e in items],
            mode="markers", name=name, marker={"color": color, "size": 9, "symbol": symbol},
            error_y={"type": "data", "symmetric": False, "thickness": 1,
                     "array": [100 * (e.retrieval.high - e.retrieval.estimate) for e in items],
                     "arrayminus": [100 * (e.retrieval.estimate - e.retrieval.low) for e in items]},
            customdata=[[e.row.label, context_label(e.row.context), num(e.row.interval("top1").estimate)]
                        for e in items],
            hovertemplate="%{customdata[0]} at %{customdata[1]}<br>mean KL %{x:.3g}, top-1 %{customdata[2]}<br>"
                          "keys found %{y:.0f}%<extra></extra>")

    fig = go.Figure([trace(kept, "retrieval as fp16's (intervals overlap)", "#2ca02c", "circle"),
                     trace(lost, "lost keys (Wilson intervals apart from fp16's)", "#d62728", "x")])
    fig.add_vline(x=KEEP_KL, line={"color": "#444444", "dash": "dash"})
    # an annotation on a log axis takes log10 of its position (a shape takes the value itself)
    fig.add_annotation(x=math.log10(KEEP_KL), y=50, xanchor="right", showarrow=False, font={"size": 11},
                       text=f"quality floor: mean KL {KEEP_KL:g} ")
    values = [e.row.interval(METRIC).estimate for e in evidence if e.row.interval(METRIC).estimate > 0]
    fig.update_layout(
        title="Where a cache starts to break: passkey retrieval against mean KL, one point a scheme and context",
        height=460, xaxis={"title": "mean KL(fp16 || scheme), nats (log; rows of KL 0 left out)", "type": "log",
                           **log_ticks(values)},
        yaxis={"title": "passkey keys found, % of 48 (Wilson 95% interval)", "range": [-5, 105]},
        legend={"orientation": "h", "y": -0.25})
    return fig
