"""Notebook 08's capacity figure: how many sequences each cache holds in one budget, and the tokens/s they make."""

from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ..measure.capacity import BatchRow
from .style import SYMBOLS, scheme_color

BASELINE_LABEL = "mlx-lm KVCache"  # the baseline every row is read against (mlx-lm's own fp16 cache)


def capacity_figure(rows: list[BatchRow], title: str) -> go.Figure:
    """Left: sequences each cache holds at a context within the budget; right: tokens/s there, with the band of
    the step times; mlx-lm's fp16 cache is the dashed line at each context. One marker shape a context."""
    contexts = sorted({r.context for r in rows})
    labels = list(dict.fromkeys(r.label for r in sorted(rows, key=lambda r: r.label != BASELINE_LABEL)))
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.12,
                        subplot_titles=("sequences held in the budget",
                                        "tokens/s decoding them all (bars: 10th-90th pct of steps)"))
    for i, context in enumerate(contexts):
        mine = sorted((r for r in rows if r.context == context), key=lambda r: labels.index(r.label))
        name = f"{context // 1024}K tokens a sequence"
        colors = [scheme_color(r.label) for r in mine]
        marker = {"symbol": SYMBOLS[i % len(SYMBOLS)], "size": 11, "color": colors, "line": {"width": 1,
                                                                                           "color": "#333"}}
        fig.add_trace(go.Scatter(x=[r.label for r in mine], y=[r.batch for r in mine], mode="markers", name=name,
                                 legendgroup=name, marker=marker,
                                 hovertemplate="%{x}: %{y} sequences<extra>" + name + "</extra>"), row=1, col=1)
        speed = [r.tokens_per_s for r in mine]
        fig.add_trace(go.Scatter(
            x=[r.label for r in mine], y=[s.estimate for s in speed], mode="markers", name=name, legendgroup=name,
            showlegend=False, marker=marker,
            error_y={"type": "data", "symmetric": False, "array": [s.high - s.estimate for s in speed],
                     "arrayminus": [s.estimate - s.low for s in speed], "thickness": 1.2, "width": 5},
            hovertemplate="%{x}: %{y:.0f} tokens/s<extra>" + name + "</extra>"), row=1, col=2)
        base = next((s for r, s in zip(mine, speed) if r.label == BASELINE_LABEL), None)
        if base is not None:
            fig.add_hline(y=base.estimate, line={"dash": "dash", "color": "#888", "width": 1}, row=1, col=2,
                          annotation_text=f"fp16, {context // 1024}K", annotation_position="top right",
                          annotation_font={"size": 10, "color": "#666"})
    fig.update_yaxes(title_text="sequences", rangemode="tozero", row=1, col=1)
    fig.update_yaxes(title_text="tokens a second", rangemode="tozero", row=1, col=2)
    fig.update_xaxes(title_text="cache", row=1, col=1)
    fig.update_xaxes(title_text="cache", row=1, col=2)
    fig.update_layout(template="plotly_white", title=title, height=500, margin={"l": 60, "r": 20, "t": 110, "b": 120},
                      legend={"orientation": "h", "y": -0.42})
    return fig
