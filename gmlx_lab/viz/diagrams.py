"""Drawn ideas: pictures of how a scheme stores a head's K or V, made from the caches' own geometry.

    storage_figure(["fp16", "affine4", "kivi4", "kvarn4:tail=128"])   # which values share a scale, per scheme
    kv_growth_figure(pieces, probs)                                   # decoding writes one K and V row a step
    fused_step_figure("kvarn4", 32768)                                # the reference path against the fused kernel
    record_layout_figure("k")                                         # what one kvarn record stores, bits on a slider

In `storage_figure` each panel is a window of one head's stored values, channels down and tokens across, one pixel
a value; values that share a scale take one shade of the scheme's colour and the next group the other, so the
shape of a group is the shape of a patch. Values stored as they are (fp16) are grey. The group comes from the cache
itself (`scale_group`), so the picture follows the scheme's code, not a description of it. `kv_growth_figure`
steps through a decode: the cache gains a K and a V row a token, and the newest token's query weighs every row.
"""

from __future__ import annotations

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ..cache.kvarn import records
from ..registry import get_scheme
from ..specs import parse_scheme_spec, scheme_label
from .figures import slider_figure
from .style import scheme_color, shade

__all__ = ["DRAWN_IDEAS", "FP16_GREY", "NO_DIAGRAM", "fused_step_figure", "group_grid", "kv_growth_figure",
           "record_layout_figure", "scale_group_words", "storage_figure"]

# The builders that draw an idea rather than plot a measurement: every notebook calls one or says why it needs
# none (tests/test_notebooks.py). The first four live here; the others draw from the lab's own arithmetic in figures.py.
DRAWN_IDEAS = ("kv_growth_figure", "storage_figure", "fused_step_figure", "record_layout_figure", "affine_row_figure",
               "butterfly_slider", "regions_slider", "policy_strip")
NO_DIAGRAM = "**No diagram here.**"  # how a page that draws no idea opens the sentence saying why
FP16_GREY = "#c7c7c7"  # values stored as they are
WINDOW = (128, 192)  # tokens drawn: past kvarn's 128-token fp16 sink, so every scheme shows its codes
CHANNELS = 128  # one head's channels (the head dim the lab's kernels and figures take)


def group_grid(group: tuple[int, int] | None, channels: int = CHANNELS, window: tuple[int, int] = WINDOW
               ) -> np.ndarray:
    """Which patch each value of the window belongs to, (channels, tokens) of 0 and 1 alternating from group to
    group (a chequer of groups), or -1 everywhere for values stored as they are."""
    tokens = np.arange(*window)
    if group is None:
        return np.full((channels, tokens.size), -1)
    t, c = group
    ch = np.arange(channels)[:, None]
    return (ch // (c or channels) + tokens[None] // t) % 2


def scale_group_words(group: tuple[int, int] | None) -> str:
    """The group in words: "1 token x 64 channels", "32 tokens x 1 channel", "each value alone"."""
    if group is None:
        return "no scale: each value stored as fp16"
    t, c = group
    if (t, c) == (128, 128):
        return "a 128 x 128 record, normalized together (a factor per channel and per token)"
    channels = "the whole row" if c == 0 else f"{c} channel{'s' if c > 1 else ''}"
    return f"{t} token{'s' if t > 1 else ''} x {channels}"


def _image(grid: np.ndarray, color: str) -> np.ndarray:
    """RGB pixels of a group grid: the scheme's colour and a lighter shade, grey for -1."""
    def rgb(hex_color: str) -> np.ndarray:
        return np.array([int(hex_color[i:i + 2], 16) for i in (1, 3, 5)], np.uint8)
    palette = np.stack([rgb(shade(color, 0.1)), rgb(shade(color, 0.6)), rgb(FP16_GREY)])
    return palette[grid]


def storage_figure(specs: list[str], kinds: str = "k") -> go.Figure:
    """One panel per scheme spec (and per kind, "k", "v" or "kv"; V drawn only where its group differs from K's):
    a window of a head's stored values, a shade per group that shares a scale."""
    panels = []
    for spec in specs:
        name, options = parse_scheme_spec(spec)
        cache = get_scheme(name).make_cache(options)
        label = scheme_label(name, options)
        groups = {kind: cache.scale_group(kind) for kind in kinds}
        for kind, group in groups.items():
            if kind == "v" and "k" in groups and group == groups["k"]:
                continue
            panels.append((f"{label} {kind.upper()}", group, scheme_color(label)))
    fig = make_subplots(rows=len(panels), cols=1, shared_xaxes=True, vertical_spacing=0.35 / len(panels),
                        subplot_titles=[f"<b>{title}</b>: {scale_group_words(g)}" for title, g, _ in panels])
    for row, (title, group, color) in enumerate(panels, start=1):
        fig.add_trace(go.Image(z=_image(group_grid(group), color), x0=WINDOW[0], dx=1, y0=0, dy=1,
                               hoverinfo="skip", name=title), row=row, col=1)
        # stretch the pixels to the panel (an image keeps them square by default)
        fig.update_yaxes(title_text="channel", tickvals=[0, 64, 127], scaleanchor=False, row=row, col=1)
    fig.update_xaxes(title_text=f"token (tokens {WINDOW[0]}-{WINDOW[1] - 1} of a long context)", row=len(panels),
                     col=1)
    fig.update_layout(height=130 * len(panels) + 120, margin={"t": 80, "l": 70, "r": 20, "b": 60},
                      title="Which stored values share one scale (a patch of one shade); grey: stored as fp16")
    return fig


K_COLOR, V_COLOR, NEW_COLOR = "#1f77b4", "#ff7f0e", "#d62728"  # K rows, V rows, the row this step wrote


def _growth_step(pieces: list[str], probs: np.ndarray, t: int) -> go.Figure:
    """Step t of a decode: tokens 0..t cached as K and V rows (the newest marked), and the attention weights of
    token t's query over them."""
    n = len(pieces)
    cached = np.arange(t + 1)
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, row_heights=[0.62, 0.38], vertical_spacing=0.08)
    fig.add_bar(x=cached, y=probs[t, :t + 1], marker_color=[NEW_COLOR if i == t else "#7f7f7f" for i in cached],
                name="attention weight", hovertemplate="token %{x}: weight %{y:.3f}<extra></extra>", row=1, col=1)
    for y, name, color in ((1, "K rows", K_COLOR), (0, "V rows", V_COLOR)):
        fig.add_scatter(x=cached, y=[y] * (t + 1), mode="markers", name=name, row=2, col=1,
                        marker={"symbol": "square", "size": 16, "color": color,
                                "line": {"color": [NEW_COLOR if i == t else color for i in cached], "width": 3}},
                        hovertemplate=f"{name[0]} row of token %{{x}}<extra></extra>")
    fig.update_xaxes(range=[-0.6, n - 0.4], row=1, col=1)
    fig.update_xaxes(range=[-0.6, n - 0.4], tickvals=list(range(n)), ticktext=[repr(p)[1:-1] or " " for p in pieces],
                     tickangle=-45, title_text="token (the text so far; red: this step's)", row=2, col=1)
    fig.update_yaxes(title_text="weight", range=[0, 1], row=1, col=1)
    fig.update_yaxes(title_text="cache", tickvals=[0, 1], ticktext=["V", "K"], range=[-0.6, 1.6], row=2, col=1)
    fig.update_layout(height=460, margin={"t": 70, "b": 90},
                      title=f"Step {t + 1}: the cache holds {t + 1} K and V rows; token {t}'s query weighs them all",
                      legend={"orientation": "h", "y": 1.02, "x": 1, "xanchor": "right", "yanchor": "bottom"})
    return fig


def kv_growth_figure(pieces: list[str], probs: np.ndarray) -> go.Figure:
    """A decode step by step (its slider): each step appends the new token's K and V rows to the cache, and its
    query's softmax weights over every cached row are drawn above them. `pieces`: the tokens as text; `probs`:
    (tokens, tokens) attention weights of one head, row t over keys 0..t (a causal softmax)."""
    probs = np.asarray(probs, dtype=float)
    n = len(pieces)
    if probs.shape != (n, n) or np.any(np.triu(probs, 1) != 0):
        raise ValueError(f"kv_growth_figure needs causal weights of shape ({n}, {n}) (one row a token, nothing above "
                         f"the diagonal); got {probs.shape}")
    steps = [_growth_step(pieces, probs, t) for t in range(n)]
    return slider_figure(steps, [str(t + 1) for t in range(n)], "tokens cached: ", active=n // 2)


def _box(fig: go.Figure, x0: float, x1: float, y0: float, y1: float, text: str, color: str) -> None:
    fig.add_shape(type="rect", x0=x0, x1=x1, y0=y0, y1=y1, fillcolor=shade(color, 0.75), line={"color": color})
    fig.add_annotation(x=(x0 + x1) / 2, y=(y0 + y1) / 2, text=text, showarrow=False, font={"size": 12})


def _arrow(fig: go.Figure, x0: float, x1: float, y: float, text: str) -> None:
    fig.add_annotation(x=x1, y=y, ax=x0, ay=y, xref="x", yref="y", axref="x", ayref="y", showarrow=True,
                       arrowhead=3, arrowsize=1.2, arrowwidth=1.5, text="")
    fig.add_annotation(x=(x0 + x1) / 2, y=y + 0.09, text=text, showarrow=False, font={"size": 11})


def fused_step_figure(spec: str, context: int, kv_heads: int = 8, head_dim: int = 128) -> go.Figure:
    """One layer's decode attention two ways, with the bytes each moves at `context` tokens (the byte formulas):
    the reference path decodes the whole cache to an fp16 copy, then attention reads that copy; the fused kernel
    splits the tokens over threadgroups, each reading its slice of codes once, and merges their partial softmaxes."""
    name, options = parse_scheme_spec(spec)
    scheme = get_scheme(name)
    label = scheme_label(name, options)
    stored = scheme.layer_bytes(context, kv_heads, head_dim, head_dim, scheme.resolve(**options))
    fp16 = get_scheme("fp16").layer_bytes(context, kv_heads, head_dim, head_dim, {})
    mib = 2.0 ** 20
    color, grey = scheme_color(label), "#7f7f7f"
    fig = go.Figure()
    for y, title in ((1.55, "reference path"), (0.45, "fused kernel")):
        fig.add_annotation(x=0.0, y=y + 0.42, text=f"<b>{title}</b>", showarrow=False, xanchor="left",
                           font={"size": 13})
    # reference: codes -> decode -> fp16 copy -> attention
    _box(fig, 0.0, 1.6, 1.3, 1.8, f"{label} cache<br>{stored / mib:.1f} MiB", color)
    _arrow(fig, 1.6, 2.6, 1.55, "decode all")
    _box(fig, 2.6, 4.2, 1.3, 1.8, f"fp16 copy<br>{fp16 / mib:.1f} MiB written", grey)
    _arrow(fig, 4.2, 5.2, 1.55, "read it all")
    _box(fig, 5.2, 6.6, 1.3, 1.8, "attention<br>(SDPA)", grey)
    _arrow(fig, 6.6, 7.3, 1.55, "")
    _box(fig, 7.3, 8.3, 1.3, 1.8, "output", grey)
    # fused: codes -> slices in parallel -> partials -> merge -> output
    _box(fig, 0.0, 1.6, 0.2, 0.7, f"{label} cache<br>{stored / mib:.1f} MiB", color)
    for i, y in enumerate((0.72, 0.45, 0.18)):
        fig.add_annotation(x=2.6, y=y, ax=1.6, ay=0.45, xref="x", yref="y", axref="x", ayref="y", showarrow=True,
                           arrowhead=3, arrowwidth=1.2, text="")
        _box(fig, 2.6, 4.8, y - 0.11, y + 0.11, "slice " + ("1", "2", "… N")[i] + ": scores, softmax, × V", color)
        fig.add_annotation(x=5.6, y=0.45, ax=4.8, ay=y, xref="x", yref="y", axref="x", ayref="y", showarrow=True,
                           arrowhead=3, arrowwidth=1.2, text="")
    fig.add_annotation(x=3.7, y=0.93, text="each threadgroup reads its tokens' codes once", showarrow=False,
                       font={"size": 11})
    _box(fig, 5.6, 6.6, 0.2, 0.7, "merge<br>by log-sum-exp", grey)
    _arrow(fig, 6.6, 7.3, 0.45, "")
    _box(fig, 7.3, 8.3, 0.2, 0.7, "output", grey)
    fig.update_xaxes(visible=False, range=[-0.1, 8.4])
    fig.update_yaxes(visible=False, range=[0.0, 2.1])
    fig.update_layout(height=380, margin={"t": 60, "l": 10, "r": 10, "b": 10}, plot_bgcolor="white",
                      title=f"One layer's decode attention at {context} tokens ({kv_heads} KV heads of {head_dim}):"
                            f"<br>the fused kernel never writes the {fp16 / mib:.0f} MiB fp16 copy")
    return fig


def _record_layout(bits: int, kind: str) -> go.Figure:
    """One record at `bits`: the code tile with its three fp16 axis vectors where they act, and its bytes against
    the same values in fp16 (`records.record_bytes`)."""
    rows, cols = ("channel", "token") if kind == "k" else ("token", "channel")
    total = records.record_bytes(bits, kind=kind)
    codes = records.TILE * records.TILE * bits // 8
    fp16 = records.TILE * records.TILE * 2
    color, grey = scheme_color(f"kvarn{bits}"), "#7f7f7f"
    fig = go.Figure()
    _box(fig, 0.0, 4.0, 0.0, 4.0, f"codes<br>128 {rows}s x 128 {cols}s<br>at {bits} bits: {codes} B", color)
    _box(fig, 0.0, 4.0, 4.25, 4.65, f"{cols} scale: 128 fp16", grey)
    for x0, text in ((4.25, f"{rows} step"), (4.85, "zero point")):
        fig.add_shape(type="rect", x0=x0, x1=x0 + 0.45, y0=0.0, y1=4.0, fillcolor=shade(grey, 0.75),
                      line={"color": grey})
        fig.add_annotation(x=x0 + 0.225, y=2.0, text=f"{text}: 128 fp16", textangle=-90, showarrow=False,
                           font={"size": 12})
    fig.add_annotation(x=-0.15, y=2.0, text=f"rows = {rows}s", textangle=-90, showarrow=False, font={"size": 12})
    fig.add_annotation(x=5.55, y=3.2, xanchor="left", showarrow=False, align="left", font={"size": 12},
                       text="a stored value comes back as<br>(code x step + zero point)<br>x scale of its column")
    # the bytes, drawn to scale against the same 128 x 128 values in fp16
    width = 9.5 / fp16
    fig.add_shape(type="rect", x0=0.0, x1=fp16 * width, y0=-1.45, y1=-1.05, line={"color": grey, "dash": "dot"})
    fig.add_annotation(x=fp16 * width, y=-1.25, xanchor="right", showarrow=False, font={"size": 11},
                       text=f"fp16: {fp16} B")
    for name, x0, x1, c in (("codes", 0, codes, color), ("fp16 vectors", codes, total, grey)):  # traces: they move
        fig.add_bar(x=[(x1 - x0) * width], base=[x0 * width], y=[-0.65], width=[0.4], orientation="h", name=name,
                    marker={"color": shade(c, 0.75), "line": {"color": c, "width": 1}}, showlegend=False,
                    hovertemplate=f"{name}: {x1 - x0} B<extra></extra>")
    fig.add_annotation(x=total * width + 0.1, y=-0.65, xanchor="left", showarrow=False, font={"size": 11},
                       text=f"record: {total} B (codes {codes} + fp16 vectors {total - codes}), "
                            f"{8 * total / records.TILE ** 2:.2f} bits a value")
    fig.update_xaxes(visible=False, range=[-0.4, 9.7])
    fig.update_yaxes(visible=False, range=[-1.6, 4.8])
    fig.update_layout(height=430, margin={"t": 60, "l": 10, "r": 10, "b": 10}, plot_bgcolor="white", barmode="overlay",
                      title=f"A {kind.upper()} record at {bits} bits stores {100 * total / fp16:.0f}% of fp16's "
                            f"bytes for its 16384 values")
    return fig


def record_layout_figure(kind: str = "k", active_bits: int = 4) -> go.Figure:
    """What one kvarn record stores (K: rows are channels; V: rows are tokens), with a slider over the code widths:
    the code tile, the three fp16 vectors that scale it, and its bytes drawn to scale against fp16."""
    if kind not in ("k", "v"):
        raise ValueError(f"record_layout_figure draws a K or a V record: kind 'k' or 'v', got {kind!r}")
    if active_bits not in records.KVARN_BITS:
        raise ValueError(f"kvarn's code widths are {records.KVARN_BITS}; got active_bits={active_bits}")
    return slider_figure([_record_layout(b, kind) for b in records.KVARN_BITS], [str(b) for b in records.KVARN_BITS],
                         "bits: ", active=records.KVARN_BITS.index(active_bits))
