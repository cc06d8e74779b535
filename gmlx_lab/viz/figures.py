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

from .. import records, window
from ..policy import Policy
from ..records import region_tokens
from ..registry import BASELINE, SCHEMES
from .quant import AffineRow, hadamard

REGION_COLORS = {"sink": "#6a3d9a", "body": "#ff7f0e", "live": "#b2df8a", "tail": "#33a02c"}
_LAYOUT = {"template": "plotly_white", "margin": {"l": 60, "r": 20, "t": 50, "b": 50}}


def _fig(**layout: Any) -> go.Figure:
    fig = go.Figure()
    fig.update_layout(**{**_LAYOUT, **layout})
    return fig


def scheme_colors() -> dict[str, str]:
    """Each registered scheme's colour (its registry entry's `color`), in registration order."""
    return {name: scheme.color for name, scheme in SCHEMES.items()}


def scheme_color(label: str) -> str:
    """The colour of the scheme a label starts with ("affine K", "kvarn4 tail=0"); grey for anything else."""
    colors = scheme_colors()
    name = next((n for n in sorted(colors, key=len, reverse=True) if str(label).startswith(n)), None)
    return colors.get(name, "#444444")


def bytes_label(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n}"


def growth_figure(curves: dict[str, tuple[list[int], list[float]]],
                  title: str = "KV cache size vs context") -> go.Figure:
    """Lines of cache bytes against context, one per name: {name: (contexts, bytes)}."""
    fig = _fig(title=title, xaxis_title="context (tokens)", yaxis_title="cache (MiB)", height=420)
    for name, (ctx, size) in curves.items():
        fig.add_scatter(x=ctx, y=np.asarray(size) / 2**20, mode="lines+markers", name=name,
                        hovertemplate="%{x} tokens: %{y:.2f} MiB<extra>" + html.escape(name) + "</extra>")
    return fig


def affine_row_figure(q: AffineRow) -> go.Figure:
    """A row's values, its affine reconstruction, and each group's scale and offset."""
    x = np.arange(q.values.size)
    fig = _fig(title=f"affine {q.bits}-bit, group {q.group_size}: one K row "
                     f"(rel. error {np.linalg.norm(q.values - q.recon) / np.linalg.norm(q.values):.3f})",
               xaxis_title="channel", yaxis_title="value", height=380)
    fig.add_scatter(x=x, y=q.values, mode="lines", name="original", line={"color": "#444"})
    fig.add_scatter(x=x, y=q.recon, mode="lines", name="reconstructed", line={"color": "#d62728", "shape": "hv"},
                    customdata=q.codes, hovertemplate="ch %{x}: %{y:.3f} (code %{customdata})<extra></extra>")
    for g, (s, o) in enumerate(zip(q.scales, q.offsets)):
        x0 = g * q.group_size
        fig.add_vrect(x0=x0 - 0.5, x1=x0 + q.group_size - 0.5, fillcolor="#1f77b4" if g % 2 else "#aec7e8",
                      opacity=0.12, line_width=0,
                      annotation_text=f"scale {s:.3g}<br>offset {o:.3g}", annotation_position="top left")
    return fig


def error_figure(rows: list[dict[str, Any]], title: str = "reconstruction error vs bits") -> go.Figure:
    """Lines of relative error against bits, one per method: rows of {method, bits, error}."""
    fig = _fig(title=title, xaxis_title="bits per code", yaxis_title="relative error ||x - x̂|| / ||x||",
               yaxis_type="log", height=380)
    for method in dict.fromkeys(r["method"] for r in rows):
        pts = sorted((r["bits"], r["error"]) for r in rows if r["method"] == method)
        fig.add_scatter(x=[p[0] for p in pts], y=[p[1] for p in pts], mode="lines+markers", name=method,
                        line={"color": scheme_color(method)})
    return fig


def channel_figure(k: np.ndarray, title: str = "per-channel magnitude of K") -> go.Figure:
    """Max |K| per channel over the tokens, before and after the Hadamard rotation."""
    before, after = np.abs(k).max(0), np.abs(hadamard(k)).max(0)
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.12,
                        subplot_titles=(f"before rotation: max/median {before.max() / np.median(before):.1f}x",
                                        f"after rotation: max/median {after.max() / np.median(after):.1f}x"))
    fig.add_bar(x=np.arange(before.size), y=before, row=1, col=1, marker_color="#d62728", name="before")
    fig.add_bar(x=np.arange(after.size), y=after, row=2, col=1, marker_color="#2ca02c", name="after")
    fig.update_layout(**_LAYOUT, title=title, height=460, showlegend=False)
    fig.update_xaxes(title_text="channel", row=2, col=1)
    fig.update_yaxes(title_text="max |value|")
    return fig


def record_figure(rec: records.Records, title: str = "") -> go.Figure:
    """A kvarn record: its decoded tile as a heatmap, with the row and column scales beside it."""
    q = np.array(records.unpack_rows(rec.codes, rec.bits))
    rows_name, cols_name = ("channel", "token") if rec.kind == "k" else ("token", "channel")
    fig = make_subplots(rows=2, cols=2, column_widths=[0.8, 0.2], row_heights=[0.2, 0.8],
                        shared_xaxes="columns", shared_yaxes="rows", horizontal_spacing=0.03,
                        vertical_spacing=0.03)
    fig.add_heatmap(z=q, row=2, col=1, colorscale="Viridis", colorbar={"title": "code", "x": 1.02},
                    hovertemplate=f"{rows_name} %{{y}}, {cols_name} %{{x}}: code %{{z}}<extra></extra>")
    fig.add_scatter(y=np.arange(128), x=np.array(rec.scale_axis).astype(np.float32), row=2, col=2,
                    mode="lines", name=f"row step ({rows_name})", line={"color": "#d62728"})
    fig.add_scatter(x=np.arange(128), y=np.array(rec.other_axis).astype(np.float32), row=1, col=1, mode="lines",
                    name=f"column scale ({cols_name})", line={"color": "#1f77b4"})
    fig.update_yaxes(autorange="reversed", row=2, col=1, title_text=f"row = {rows_name}")
    fig.update_xaxes(title_text=f"column = {cols_name}", row=2, col=1)
    fig.update_layout(**_LAYOUT, height=560, title=title or f"{rec.kind.upper()} record, {rec.bits}-bit codes",
                      legend={"orientation": "h", "y": -0.12})
    return fig


def imbalance_figure(history: list[float], best: int) -> go.Figure:
    """Imbalance of the tile after each normalization round, the kept round marked."""
    fig = _fig(title=f"variance normalization: imbalance {history[0]:.1f} -> {history[best]:.2f} "
                     f"(round {best} kept; 2 is perfect balance)",
               xaxis_title="round", yaxis_title="imbalance", yaxis_type="log", height=340)
    fig.add_scatter(x=list(range(len(history))), y=history, mode="lines+markers", name="imbalance")
    fig.add_scatter(x=[best], y=[history[best]], mode="markers", marker={"size": 14, "symbol": "star"},
                    name="kept")
    return fig


def code_histogram(rec: records.Records) -> go.Figure:
    """How often each code value occurs in a record."""
    q = np.array(records.unpack_rows(rec.codes, rec.bits)).ravel()
    counts = np.bincount(q, minlength=2**rec.bits)
    fig = _fig(title=f"code histogram ({rec.bits} bits: {2**rec.bits} levels)", xaxis_title="code",
               yaxis_title="count", height=300, bargap=0.05)
    fig.add_bar(x=np.arange(counts.size), y=counts, marker_color="#ff7f0e")
    return fig


def regions_bar(context: int, tail: int, title: str | None = None) -> go.Figure:
    """The kvarn cache as one bar of regions (sink | records | live | tail) after `context` tokens."""
    r = region_tokens(context, tail)
    fig = _fig(title=title or f"kvarn cache at {context} tokens, kv_tail_tokens={tail}: {r['body'] // 128} records",
               xaxis_title="token position", height=220, barmode="stack", showlegend=True,
               yaxis={"showticklabels": False})
    for name in ("sink", "body", "live", "tail"):
        label = "records (quantized)" if name == "body" else f"{name} (fp16)"
        fig.add_bar(y=["cache"], x=[r[name]], orientation="h", name=label, marker_color=REGION_COLORS[name],
                    hovertemplate=f"{label}: %{{x}} tokens<extra></extra>")
    return fig


def regions_stream(max_context: int, tail: int, step: int = 16) -> go.Figure:
    """Tokens per kvarn region as the context streams in, one token at a time (stacked areas)."""
    ctx = np.arange(0, max_context + 1, step)
    rows = [region_tokens(int(c), tail) for c in ctx]
    fig = _fig(title=f"regions as tokens stream in (kv_tail_tokens={tail})", xaxis_title="tokens so far",
               yaxis_title="tokens in region", height=340)
    for name in ("sink", "body", "live", "tail"):
        fig.add_scatter(x=ctx, y=[r[name] for r in rows], stackgroup="one", name=name,
                        line={"color": REGION_COLORS[name], "width": 0.5})
    return fig


def window_stream(max_context: int, tail: int, max_kv_size: int, step: int = 16) -> go.Figure:
    """A rolling window as tokens stream in: the regions held (stacked) stop at the window while records leave."""
    ctx = np.arange(0, max_context + 1, step)
    rows = [window.kvarn_regions(int(c), tail, max_kv_size) for c in ctx]
    fig = _fig(title=f"a rolling window of {max_kv_size} tokens (kv_tail_tokens={tail}): the sink stays, "
                     "records leave oldest first", xaxis_title="tokens so far", yaxis_title="tokens held", height=340)
    for name in ("sink", "body", "live", "tail"):
        fig.add_scatter(x=ctx, y=[r[name] for r in rows], stackgroup="one", name="records" if name == "body" else name,
                        line={"color": REGION_COLORS[name], "width": 0.5})
    fig.add_scatter(x=ctx, y=[r["dropped"] for r in rows], name="dropped (not held)", mode="lines",
                    line={"color": "#555555", "dash": "dot"})
    fig.add_hline(y=max_kv_size, line={"color": "#999999", "dash": "dash"}, annotation_text="max_kv_size")
    return fig


def sink_mass_figure(mass: np.ndarray, sink: int = 128) -> go.Figure:
    """Heatmap of the attention share on the first `sink` tokens, per layer and query head."""
    fig = _fig(title=f"share of attention on the first {sink} tokens (queries after them)",
               xaxis_title="query head", yaxis_title="layer", height=360)
    fig.add_heatmap(z=mass, colorscale="Purples", zmin=0, zmax=1, text=np.round(mass, 2), texttemplate="%{text}",
                    y=[str(i) for i in range(mass.shape[0])])
    return fig


def policy_strip(policies: list[Policy]) -> go.Figure:
    """One row per model, one cell per cache entry, coloured by decision; hover shows the reason."""
    colors = scheme_colors()
    order = list(colors)
    n = max(len(p.layers) for p in policies)
    z, text, names = [], [], []
    for p in policies:
        z.append([order.index(d.decision) for d in p.layers] + [None] * (n - len(p.layers)))
        pad = [""] * (n - len(p.layers))
        text.append([f"layer {d.index}: {d.kind}, {d.decision} ({d.reason})" for d in p.layers] + pad)
        names.append(f"{p.name} ({len(p.quantized)}/{sum(d.grows for d in p.layers)})")
    scale = []
    for i, name in enumerate(order):
        scale += [[i / len(order), colors[name]], [(i + 1) / len(order), colors[name]]]
    fig = _fig(title=f"per-layer decisions under {policies[0].label}", xaxis_title="cache entry (layer)",
               height=120 + 36 * len(policies))
    fig.add_heatmap(z=z, text=text, hoverinfo="text", y=names, colorscale=scale, zmin=-0.5,
                    zmax=len(order) - 0.5, xgap=2, ygap=2,
                    colorbar={"tickvals": list(range(len(order))), "ticktext": order, "title": "decision"})
    fig.update_yaxes(autorange="reversed")
    return fig


def kl_strip(kl: np.ndarray, labels: list[str] | None = None, title: str = "KL per token vs fp16") -> go.Figure:
    """Per-token KL (nats) as bars; hover shows the token."""
    fig = _fig(title=title, xaxis_title="generated token", yaxis_title="KL (nats)", height=260)
    fig.add_bar(x=np.arange(len(kl)), y=kl, marker_color="#ff7f0e", customdata=labels or [""] * len(kl),
                hovertemplate="token %{x} %{customdata}: KL %{y:.2e}<extra></extra>")
    return fig


def bars_figure(rows: list[dict[str, Any]], x: str, y: str, color: str, title: str, log: bool = False,
                ytitle: str | None = None) -> go.Figure:
    """Grouped bars from rows of dicts: one trace per `color` value."""
    fig = _fig(title=title, xaxis_title=x, yaxis_title=ytitle or y, barmode="group", height=380,
               yaxis_type="log" if log else "linear")
    for key in dict.fromkeys(r[color] for r in rows):
        pts = [r for r in rows if r[color] == key]
        fig.add_bar(x=[str(r[x]) for r in pts], y=[r[y] for r in pts], name=str(key),
                    marker_color=scheme_color(key))
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


def passkey_heatmaps(result: Any, title: str | None = None) -> go.Figure:
    """One heatmap per scheme: passkey accuracy by needle depth (rows) and prompt length (columns)."""
    data = experiment_data(result)
    labels, lengths, depths = data["labels"], data["lengths"], data["depths"]
    names = [f"{label}{' (baseline)' if label == BASELINE else ''}: {100 * data['accuracy'][label]:.0f}%"
             for label in labels]
    fig = make_subplots(rows=1, cols=len(labels), shared_yaxes=True, horizontal_spacing=0.02,
                        subplot_titles=names)
    for i, label in enumerate(labels):
        z = np.array(data["grids"][label], dtype=float)
        fig.add_heatmap(z=z, x=[str(n) for n in lengths], y=[f"{100 * d:.0f}%" for d in depths], row=1, col=i + 1,
                        zmin=0, zmax=1, colorscale=ACCURACY_SCALE, showscale=i == len(labels) - 1,
                        colorbar={"title": "recalled", "tickformat": ".0%"}, text=np.round(100 * z).astype(int),
                        texttemplate="%{text}%", xgap=2, ygap=2,
                        hovertemplate=f"{label}<br>%{{x}} tokens, needle at %{{y}}: %{{z:.0%}}<extra></extra>")
        fig.update_xaxes(title_text="prompt length (tokens)", type="category", row=1, col=i + 1)
    fig.update_yaxes(title_text="needle depth (% of context)", type="category", autorange="reversed", row=1, col=1)
    fig.update_layout(**_LAYOUT, height=340, width=max(520, 230 * len(labels)),
                      title=title or f"passkey retrieval, {data['model']} (greedy answer holds the key)")
    return fig


def draft_figure(result: Any, title: str | None = None) -> go.Figure:
    """Acceptance rate and tokens per verify step for each target cache, fp16's as a dashed baseline."""
    data = experiment_data(result)
    runs = data["runs"]
    labels = [r["label"] for r in runs]
    colors = [scheme_color(label) for label in labels]
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
    for r in rows:
        fig.add_scatter(y=[max(v, 1e-9) for v in r["decode_kl"]], mode="lines", name=f"{weights} + {r['kv']}",
                        line={"color": scheme_color(r["kv"]), "dash": "solid" if r["kv"] == BASELINE else "dot"})
    return fig
