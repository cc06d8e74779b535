"""Figures of the field side by side (notebook 11): each scheme's idea on one live K tile, then the measured verdict
from the committed field reports (benchmarks/field.py).

    idea = scheme_idea(k, v, "kivi4")                      # a K/V tile through a real cache of the scheme
    idea_figure(idea)                                      # |error| per token and channel, and per channel
    field_kl_figure(case_rows(rows, "gemma3-270m", "all", 4096, "fidelity"))
    field_passkey_figure(case_rows(rows, "gemma3-270m", "all", 4096, "passkey"))
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ..registry import BASELINE, get_scheme
from ..specs import parse_scheme_spec, scheme_label
from .figures import BASELINE_LINE, LABEL_BACKGROUND
from .style import SYMBOLS, log_ticks, num, scheme_color, trace_styles, wrapped

__all__ = ["SchemeIdea", "field_kl_figure", "place_labels", "field_passkey_figure", "idea_figure", "scheme_idea"]

_LAYOUT = {"template": "plotly_white", "margin": {"l": 60, "r": 20, "t": 70, "b": 50}}


@dataclass
class SchemeIdea:
    """One K/V tile stored by one scheme's real cache and read back: where the error lands, what stayed fp16."""

    spec: str
    label: str
    summary: str  # the registry's one-line description of the scheme
    k: np.ndarray  # (tokens, head_dim) as stored in fp16
    error: np.ndarray  # |K read back - K|, (tokens, head_dim)
    regions: dict[str, int] | None  # tokens by region, as the scheme's memory report names them (None: all alike)
    bytes_per_token: float  # the cache's resident bytes per token of this tile (K and V, one head)

    @property
    def exact_tokens(self) -> int:
        """Tokens read back exactly (kept in fp16)."""
        return int(np.sum(np.all(self.error == 0, axis=1)))

    @property
    def channel_error(self) -> np.ndarray:
        """Mean |error| per channel over the tokens that were quantized."""
        rows = self.error[~np.all(self.error == 0, axis=1)]
        return rows.mean(axis=0) if rows.size else np.zeros(self.error.shape[1])


def scheme_idea(k: np.ndarray, v: np.ndarray, spec: str) -> SchemeIdea:
    """Store a (tokens, head_dim) K/V tile in one layer's cache of `spec`, add one more token (so whatever waits
    for a later update is sealed, as in a decode), and read back what attention would see."""
    if k.ndim != 2 or k.shape != v.shape:
        raise ValueError(f"scheme_idea needs K and V tiles of one shape (tokens, head_dim), got {k.shape}, {v.shape}")
    name, options = parse_scheme_spec(spec)
    scheme = get_scheme(name)
    cache = scheme.make_cache(scheme.resolve(**options), layer=0)
    tokens = k.shape[0]
    kx = mx.array(np.ascontiguousarray(k, np.float32)).astype(mx.float16)[None, None]
    vx = mx.array(np.ascontiguousarray(v, np.float32)).astype(mx.float16)[None, None]
    cache.update_and_fetch(kx[:, :, :-1], vx[:, :, :-1])
    keys, _ = cache.update_and_fetch(kx[:, :, -1:], vx[:, :, -1:])
    stored = np.array(kx[0, 0].astype(mx.float32))
    back = np.array(keys[0, 0, :tokens].astype(mx.float32))
    resident, regions = cache.memory_regions()  # growth reserve excluded
    return SchemeIdea(spec, scheme_label(name, options), scheme.summary, stored, np.abs(back - stored), regions,
                      sum(resident.values()) / tokens)


def idea_figure(idea: SchemeIdea, height: int = 300) -> go.Figure:
    """|error| of the K read back per token and channel (left; white rows: kept fp16) and per channel, beside the
    tile's own mean |K| per channel (right, log): where a scheme's scales meet outlier channels."""
    fig = make_subplots(rows=1, cols=2, column_widths=[0.62, 0.38], horizontal_spacing=0.18,
                        subplot_titles=("|K read back - K| per token and channel",
                                        "per channel: mean |K| and mean |error|"))
    color = scheme_color(idea.label)
    fig.add_heatmap(z=idea.error.T, colorscale=[[0, "#ffffff"], [1, color]], zmin=0,
                    zmax=float(np.percentile(idea.error, 99.5)) or 1.0, row=1, col=1,
                    colorbar={"title": {"text": "|error|", "side": "right"}, "x": 0.52, "len": 0.85,
                              "thickness": 10},
                    hovertemplate="token %{x}, channel %{y}: |error| %{z:.3g}<extra></extra>")
    channels = np.arange(idea.k.shape[1])
    mean_k = np.abs(idea.k).mean(axis=0)
    fig.add_scatter(x=channels, y=mean_k, mode="lines", name="mean |K| (fp16 tile)", row=1, col=2,
                    line={"color": BASELINE_LINE["color"], "width": 1},
                    hovertemplate="channel %{x}: mean |K| %{y:.3g}<extra></extra>")
    err = idea.channel_error
    if np.any(err > 0):
        fig.add_scatter(x=channels, y=err, mode="lines", name=f"{idea.label}: mean |error|", row=1, col=2,
                        line={"color": color, "width": 1.5},
                        hovertemplate="channel %{x}: mean |error| %{y:.3g}<extra></extra>")
    positive = [x for x in np.concatenate([mean_k, err]) if x > 0]
    fig.update_yaxes(type="log", row=1, col=2, title_text="|value|", **log_ticks(positive))
    fig.update_xaxes(title_text="token", row=1, col=1)
    fig.update_yaxes(title_text="channel", row=1, col=1)
    fig.update_xaxes(title_text="channel", row=1, col=2)
    regions = ", ".join(f"{name} {n}" for name, n in (idea.regions or {}).items() if n) or "every token alike"
    head = "<br>".join(html.escape(line) for line in wrapped(f"{idea.label}: {idea.summary}").split("<br>"))
    head = head.replace(f"{html.escape(idea.label)}:", f"<b>{html.escape(idea.label)}</b>:", 1)
    lines = head.count("<br>")
    fig.update_layout(**{**_LAYOUT, "margin": {**_LAYOUT["margin"], "t": 110 + 24 * lines}}, height=height + 24 * lines,
                      showlegend=False, title=f"{head}<br><sup>tokens read back "
                            f"exactly (fp16): {idea.exact_tokens} of {idea.k.shape[0]} · regions: {regions} · "
                            f"{num(idea.bytes_per_token)} bytes per token (K and V, one head)</sup>")
    return fig


def place_labels(points: list[tuple[float, float, str]], x_range: list[float], width_px: float = 760,
                 height_px: float = 360) -> dict[int, tuple[float, float] | None]:
    """Where each point's (share %, KL, label) label goes, lowest KL first: None beside its marker, where it covers
    no marker or label placed before; else an offset in pixels (right, up) to a free place, reached by an arrow;
    a point missing from the answer has no free place within reach (its label is on hover). Plot size estimated."""
    if not points:
        return {}
    logs = np.log10([kl for _, kl, _ in points])
    span = max(float(logs.max() - logs.min()), 1.0)
    x0, x1 = x_range

    def at(x: float, log_kl: float) -> tuple[float, float]:
        return (x - x0) / (x1 - x0) * width_px, (log_kl - logs.min()) / span * height_px * 0.9

    def free(box: tuple[float, float, float, float], others: list[tuple[float, float, float, float]]) -> bool:
        inside = 0 <= box[0] and box[2] <= width_px and -10 <= box[1] and box[3] <= height_px
        return inside and all(box[2] <= t[0] or t[2] <= box[0] or box[3] <= t[1] or t[3] <= box[1] for t in others)

    centres = [at(x, lk) for (x, _, _), lk in zip(points, logs)]
    taken = [(cx - 6, cy - 6, cx + 6, cy + 6) for cx, cy in centres]  # the markers
    places: dict[int, tuple[float, float] | None] = {}
    order = sorted(range(len(points)), key=lambda i: points[i][1])
    for i in order:  # beside the marker
        cx, cy = centres[i]
        box = (cx + 8, cy - 7, cx + 8 + 6.2 * len(points[i][2]), cy + 7)
        if free(box, [t for j, t in enumerate(taken) if j != i]):
            places[i] = None
            taken.append(box)
    for i in order:  # the rest: the nearest free place, centred on the arrow's end
        if i in places:
            continue
        cx, cy = centres[i]
        half = 3.1 * len(points[i][2])
        tries = [(side * (half + reach), rise) for reach in (14, 40, 70) for rise in (0, 22, -22, 44, -44, 66, -66)
                 for side in (1, -1)]
        for dx, dy in tries:
            box = (cx + dx - half, cy + dy - 7, cx + dx + half, cy + dy + 7)
            if free(box, taken):
                places[i] = (dx, dy)
                taken.append(box)
                break
    return places


def joined_label(labels: list[str]) -> str:
    """One name for rows drawn at one place: "kvarn2/4/6 tail=1024" where only the width differs, else a list."""
    heads = [label.split(" ", 1) for label in labels]
    rests = {h[1] if len(h) > 1 else "" for h in heads}
    stems = {h[0].rstrip("0123456789") for h in heads}
    if len(labels) > 1 and len(rests) == 1 and len(stems) == 1 and all(h[0] != h[0].rstrip("0123456789")
                                                                        for h in heads):
        stem = stems.pop()
        return f"{stem}{'/'.join(h[0][len(stem):] for h in heads)} {rests.pop()}".strip()
    return ", ".join(labels)


def field_kl_figure(rows: list[dict[str, Any]], title: str | None = None, height: int = 600) -> go.Figure:
    """Decode median KL against cache bytes per token (share of fp16), one marker per scheme of one case; fp16 the
    dotted vertical line. Schemes with KL exactly 0 (nothing quantized at this length) are listed in the title."""
    if not rows or any(r["kind"] != "fidelity" for r in rows):
        raise ValueError("field_kl_figure needs the fidelity rows of one case (measure.field.case_rows)")
    cases = {(r["model"], r["policy"], r["length"]) for r in rows}
    if len(cases) > 1:
        raise ValueError(f"field_kl_figure draws one case, got {sorted(cases)}")
    model, policy, length = cases.pop()
    drawn = [r for r in rows if r["scheme"] != BASELINE and r["decode_median_kl"] > 0]
    zero = [r["label"] for r in rows if r["scheme"] != BASELINE and r["decode_median_kl"] <= 0]
    points: dict[tuple[float, float], list[dict[str, Any]]] = {}  # rows at one place are one point, named for all
    for r in drawn:
        points.setdefault((round(100 * r["bytes_per_token"] / r["fp16_bytes_per_token"], 2),
                           r["decode_median_kl"]), []).append(r)
    shares = [x for x, _ in points]
    x_range = [max(0.0, 10 * np.floor(min(shares, default=0) / 10) - 10), 108]
    labels = {key: joined_label([r["label"] for r in same]) for key, same in points.items()}
    keys = list(points)
    placed = place_labels([(x, y, labels[(x, y)]) for x, y in keys], x_range)
    places = {keys[i]: place for i, place in placed.items()}  # by point; a point missing has its label on hover
    fig = go.Figure()
    for i, family in enumerate(dict.fromkeys(r["scheme"] for r in drawn)):  # one legend entry a scheme
        mine = [key for key, same in points.items() if same[0]["scheme"] == family]
        color = scheme_color(points[mine[0]][0]["label"])
        fig.add_scatter(
            x=[x for x, _ in mine], y=[y for _, y in mine], mode="markers+text", name=family,
            text=[labels[key] if key in places and places[key] is None else "" for key in mine],
            textposition=["middle left" if x > x_range[1] - 15 else "middle right" for x, _ in mine],  # the edge
            textfont={"size": 10, "color": color},
            marker={"size": 10, "symbol": SYMBOLS[i % len(SYMBOLS)], "color": color},
            customdata=[[html.escape(labels[key]), num(points[key][0]["bytes_per_token"]),
                         f"{100 * points[key][0]['top1']:.1f}"] for key in mine],
            hovertemplate="%{customdata[0]}: %{x:.1f}% of fp16 (%{customdata[1]} B/token), KL %{y:.2e} nats, "
                          "top-1 %{customdata[2]}%<extra></extra>")
        for key in mine:  # labels moved off a crowd, each on an arrow to its marker
            place = places.get(key)
            if place is not None:
                fig.add_annotation(x=key[0], y=float(np.log10(key[1])), text=html.escape(labels[key]),
                                   ax=place[0], ay=-place[1], showarrow=True, arrowhead=0, arrowwidth=1,
                                   arrowcolor=color, font={"size": 10, "color": color}, bgcolor=LABEL_BACKGROUND)
    fig.add_vline(x=100, line=BASELINE_LINE)
    fig.add_annotation(x=100, y=1, yref="paper", yanchor="bottom", xanchor="right", showarrow=False,
                       text="fp16 (KL 0)", font={"size": 11, "color": BASELINE_LINE["color"]},
                       bgcolor=LABEL_BACKGROUND)
    if drawn:
        fig.update_yaxes(type="log", **log_ticks(r["decode_median_kl"] for r in drawn))
    note = f"<br><sup>KL 0 (nothing quantized at {length} tokens), not drawn: {', '.join(zero)}</sup>" if zero else ""
    fig.update_layout(**{**_LAYOUT, "margin": {**_LAYOUT["margin"], "t": 95 if zero else 70}}, height=height,
                      xaxis={"range": x_range, "title": "cache per token (% of fp16's bytes, sink and tail included)"},
                      yaxis_title="decode median KL vs fp16 (nats)", showlegend=True,
                      legend={"font": {"size": 10}, "tracegroupgap": 0},
                      title=(title or f"{model}, {policy} policy, {length} tokens: fidelity against memory") + note)
    return fig


def field_passkey_figure(rows: list[dict[str, Any]], title: str | None = None, height: int = 420) -> go.Figure:
    """Share of passkeys retrieved per scheme with its Wilson 95% interval, one case; fp16's share the baseline."""
    if not rows or any(r["kind"] != "passkey" for r in rows):
        raise ValueError("field_passkey_figure needs the passkey rows of one case (measure.field.case_rows)")
    cases = {(r["model"], r["policy"], r["length"]) for r in rows}
    if len(cases) > 1:
        raise ValueError(f"field_passkey_figure draws one case, got {sorted(cases)}")
    model, policy, length = cases.pop()
    styles = trace_styles(r["label"] for r in rows)
    fig = go.Figure()
    for r in rows:
        style = styles[r["label"]]
        fig.add_scatter(x=[r["label"]], y=[r["accuracy"]], mode="markers", name=r["label"],
                        marker={"size": 10, "symbol": style["symbol"], "color": style["color"]},
                        error_y={"type": "data", "symmetric": False, "array": [r["wilson_high"] - r["accuracy"]],
                                 "arrayminus": [r["accuracy"] - r["wilson_low"]], "color": style["color"]},
                        hovertemplate=(f"{html.escape(r['label'])}: {r['hits']} of {r['asked']} keys "
                                       f"(95% interval {100 * r['wilson_low']:.0f}-{100 * r['wilson_high']:.0f}%)"
                                       "<extra></extra>"))
    fp16 = [r for r in rows if r["scheme"] == BASELINE]
    if fp16:
        fig.add_hline(y=fp16[0]["accuracy"], line=BASELINE_LINE, annotation_position="top right",
                      annotation_text=f"fp16 baseline: {fp16[0]['hits']} of {fp16[0]['asked']}",
                      annotation_font={"color": BASELINE_LINE["color"], "size": 11},
                      annotation_bgcolor=LABEL_BACKGROUND)
    asked = sorted({r["asked"] for r in rows})
    fig.update_layout(**_LAYOUT, height=height, showlegend=False,
                      yaxis={"range": [-0.03, 1.08], "tickformat": ".0%", "title": "keys retrieved (Wilson 95%)"},
                      xaxis={"type": "category", "tickangle": -40, "title": "scheme"},
                      title=title or f"{model}, {policy} policy: passkey at {length} tokens "
                                     f"({' / '.join(map(str, asked))} keys per scheme)")
    return fig
