"""The lab's one visual language: a colour per scheme, K solid and V dashed, shades for variants, short numbers.

    styles = trace_styles(["affine4 g32 K", "affine4 g64 K", "kvarn4 V"])   # {label: {color, dash, symbol}}
    num(0.5199999809265137)                                                 # '0.52'
    figure_problems(fig)                                                    # [] when the figure follows the rules

A scheme's colour lives in its registry entry (`SCHEMES[name].color`). Variants of one scheme (group sizes,
tails, widths) get shades of that colour, darkest first, and a marker each; a trace about V is dashed.
`figure_problems` lists what breaks the rules, and tests/test_figures.py runs it on every figure builder.
"""

from __future__ import annotations

import html
import re
from collections.abc import Iterable
from typing import Any

import numpy as np
import plotly.graph_objects as go

from ..registry import SCHEMES, spec_prefixes

__all__ = ["MAX_DIGITS", "context_ticks", "figure_problems", "log_ticks", "num", "scheme_color", "scheme_colors",
           "frame_slider", "scheme_of", "shade", "significant_digits", "trace_styles", "wrapped"]

MAX_DIGITS = 4  # at most this many significant digits in any number a figure prints
MAX_TITLE_CHARS = 100  # a title line's characters that fit a notebook's page at plotly's title size
MAX_SUBTITLE_CHARS = 150  # the same for a <sup> line under it
MAX_LEGEND = 12  # at most this many legend entries: beyond it, shades are told apart by hovering only
OTHER_COLOR = "#444444"  # a label that names no registered scheme, where it stands alone
# Labels that name no scheme (model families, layer kinds) take these in order, skipping the schemes' colours.
# After the schemes' seven, seven remain: one hue each (a single green), so seven names never repeat a colour.
CATEGORY_COLORS = ("#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#bcbd22", "#1f77b4", "#ff7f0e",
                   "#17becf", "#7f7f7f", "#393b79", "#222222", "#e7ba52")
REPEAT_DASHES = ("solid", "dot", "dashdot")  # a category colour's first, second and third use
SYMBOLS = ("circle", "square", "diamond", "triangle-up", "x", "star", "cross", "pentagon")
_KV_WORDS = {"k": "solid", "v": "dash"}


def scheme_colors() -> dict[str, str]:
    """Each registered scheme's colour (its registry entry's `color`), in registration order."""
    return {name: scheme.color for name, scheme in SCHEMES.items()}


def scheme_of(label: str) -> str | None:
    """The registered scheme a label starts with ("affine_rot K" -> "affine_rot", "nvfp4_rot" -> "float"), or None."""
    return next((s for w, s, _ in spec_prefixes() if str(label).startswith(w)), None)


def scheme_color(label: str) -> str:
    """The colour of the scheme a label starts with ("affine K", "kvarn4 tail=0"); dark grey for anything else."""
    name = scheme_of(label)
    return SCHEMES[name].color if name else OTHER_COLOR


def shade(color: str, amount: float) -> str:
    """`color` ("#rrggbb") mixed towards black (amount < 0) or white (amount > 0), |amount| <= 1."""
    rgb = np.array([int(color[i : i + 2], 16) for i in (1, 3, 5)], float)
    target = 255.0 if amount > 0 else 0.0
    mixed = rgb + (target - rgb) * min(abs(amount), 1.0)
    return "#" + "".join(f"{int(round(c)):02x}" for c in mixed)


def _split(label: str) -> tuple[str, str, str]:
    """(scheme or label, variant, dash) of a trace label: "affine4 g32 V" -> ("affine", "4 g32", "dash")."""
    word, name = next(((w, s) for w, s, _ in spec_prefixes() if str(label).startswith(w)), ("", ""))
    words = ([] if word == name else [word]) + str(label)[len(word):].split()  # "nvfp4_rot": a variant of float
    dash = "solid"
    if words and words[-1].lower() in _KV_WORDS:
        dash = _KV_WORDS[words.pop().lower()]
    return name or str(label), " ".join(words), dash


def trace_styles(labels: Iterable[str]) -> dict[str, dict[str, str]]:
    """A distinct {color, dash, symbol} for each label, in the lab's language.

    Colour: the scheme's (registry); a label naming no scheme gets a colour of its own. Variants of one scheme
    ("affine4 g32", "affine4 g64"): shades of it from dark to light, and a marker each, in order of appearance.
    Dash: solid for K (or no K/V word), dashed for V.
    """
    labels = list(dict.fromkeys(labels))
    parts = {label: _split(label) for label in labels}
    variants: dict[str, list[str]] = {}
    for name, variant, _ in parts.values():
        variants.setdefault(name, [])
        if variant not in variants[name]:
            variants[name].append(variant)
    taken = {s.color for s in SCHEMES.values()}
    free = [c for c in CATEGORY_COLORS if c not in taken]
    others = [name for name in variants if name not in SCHEMES]
    # more names than free colours: the colours come round again with another dash, so no two lines look alike
    bases = {name: (SCHEMES[name].color, "solid") for name in variants if name in SCHEMES}
    bases.update({name: (free[k % len(free)], REPEAT_DASHES[(k // len(free)) % len(REPEAT_DASHES)])
                  for k, name in enumerate(others)})
    out = {}
    for label, (name, variant, dash) in parts.items():
        i, n = variants[name].index(variant), len(variants[name])
        amount = 0.0 if n == 1 else -0.4 + 0.8 * i / (n - 1)  # darker ... lighter (the middle one: the colour)
        base, repeat_dash = bases[name]
        out[label] = {"color": shade(base, amount), "dash": repeat_dash if dash == "solid" else dash,
                      "symbol": SYMBOLS[i % len(SYMBOLS)]}
    return out


def num(x: float, digits: int = 3) -> str:
    """A number for a label, with `digits` significant digits: 0.5199999809265137 -> '0.52', 1234567 -> '1.23e+06'."""
    x = float(x)
    if x == 0 or not np.isfinite(x):
        return f"{x:g}"
    return f"{x:.{digits}g}"


def log_ticks(values: Iterable[float], most: int = 8) -> dict[str, Any]:
    """Tick settings for a log axis over `values` (positive; others ignored) whose labels read at a glance.

    Up to `most` ticks at 1, 2 and 5 times a power of ten inside the values' span (over a narrow span also 1.5, 3,
    4 and 7), each labelled with `num` (0.02, 0.05, 0.1, ...); over a wider span, whole decades only (10^-4,
    10^-3, ..., every second one past `most`). Never plotly's automatic log ticks, whose minor labels read
    "9, 100, 2, 3".
    `fig.update_yaxes(type="log", **log_ticks(errors))`.
    """
    v = np.asarray([x for x in np.ravel(np.asarray(list(values), dtype=float)) if np.isfinite(x) and x > 0])
    if v.size == 0:
        raise ValueError("log_ticks needs at least one positive finite value")
    lo, hi = float(v.min()), float(v.max())
    first, last = int(np.floor(np.log10(lo))), int(np.ceil(np.log10(hi)))

    def inside(steps: tuple[float, ...]) -> list[float]:
        return [float(num(m * 10.0**k)) for k in range(first, last + 1) for m in steps
                if lo <= m * 10.0**k * (1 + 1e-9) and m * 10.0**k <= hi * (1 + 1e-9)]

    nice = inside((1, 2, 5))
    if len(nice) < 3:  # a narrow span (less than a decade or so): finer steps
        nice = inside((1, 1.5, 2, 3, 4, 5, 7))
    if len(nice) < 2:  # less than a factor 1.5 between the ends: the ends themselves
        nice = sorted({float(num(lo, 2)), float(num(hi, 2))})
    if len(nice) <= most:
        return {"tickvals": nice, "ticktext": [num(t) for t in nice]}
    decades = last - first + 1
    return {"tickvals": None, "dtick": max(1, int(np.ceil(decades / most))), "exponentformat": "power"}


def context_ticks(contexts: Iterable[int]) -> dict[str, Any]:
    """Ticks at the given token counts, labelled as people say them: 512, 1K, 32K, 128K."""
    ticks = sorted(set(int(c) for c in contexts))
    return {"tickvals": ticks, "ticktext": [f"{c // 1024}K" if c >= 1024 and c % 1024 == 0 else str(c)
                                            for c in ticks]}


# -- the checks --------------------------------------------------------------------------------------------

_NUMBER = re.compile(r"(?<![\w.])[-+]?(\d+\.\d+|\d+(?:\.\d+)?[eE][-+]?\d+)(?![\w.])")
_FIELD = re.compile(r"%\{(x|y|z|text)\}")  # a hover or text field printed without a format


def significant_digits(token: str) -> int:
    """Significant digits of a printed decimal ("0.000450" -> 3, "12.3456" -> 6, "1.5e-05" -> 2)."""
    mantissa = re.split("[eE]", token.lstrip("+-"))[0]
    return len(mantissa.replace(".", "").lstrip("0")) or 1


def _long_numbers(text: Any) -> list[str]:
    """Decimals in `text` printed with more than MAX_DIGITS significant digits (integers are exact counts)."""
    if text is None:
        return []
    return [m.group(0) for m in _NUMBER.finditer(str(text)) if significant_digits(m.group(0)) > MAX_DIGITS]


def _values(data: Any) -> list[Any]:
    """A trace attribute (number, string, list, nested list, numpy array) as a flat list."""
    if data is None:
        return []
    arr = np.asarray(data, dtype=object)
    return list(arr.ravel()) if arr.ndim else [arr.item()]


def _printed(value: Any) -> str:
    """How plotly.js prints an unformatted value: a float's shortest round-trip form, float32 widened first."""
    if isinstance(value, (float, np.floating)):
        return repr(float(value))
    return str(value)


def _text_problems(where: str, texts: Iterable[Any]) -> list[str]:
    found = sorted({n for t in texts for n in _long_numbers(_printed(t))})
    return [f"{where} prints {len(found)} number(s) with more than {MAX_DIGITS} significant digits, "
            f"e.g. {found[0]}"] if found else []


def _axis_key(ref: str) -> str:
    """'x2' -> 'xaxis2', 'y' -> 'yaxis'."""
    return f"{ref[0]}axis{ref[1:]}"


def _has_title(layout: go.Layout, key: str, seen: frozenset[str] = frozenset()) -> bool:
    """An axis has a title, or is drawn without tick labels against an axis it matches that has one."""
    axis = layout[key]
    if axis.visible is False or (axis.title is not None and axis.title.text):
        return True
    if axis.matches and axis.showticklabels is False and key not in seen:
        return _has_title(layout, _axis_key(axis.matches), seen | {key})
    return False


def _style_key(trace: Any) -> tuple[Any, ...] | None:
    """What tells a line, marker or bar trace apart from another drawn on the same axes."""
    if trace.type not in ("scatter", "scattergl", "bar"):
        return None
    line, marker = getattr(trace, "line", None), trace.marker
    color = (line.color if line is not None and line.color else None) or (marker.color if marker else None)
    if color is None or getattr(trace, "fillcolor", None) or getattr(trace, "stackgroup", None):
        return None  # plotly's colorway picks a fresh colour; a filled area shows its fill
    color = tuple(np.asarray(color).ravel()) if not isinstance(color, str) else color
    dash = line.dash if line is not None else None
    symbol = marker.symbol if marker is not None and "markers" in (getattr(trace, "mode", None) or "") else None
    return trace.type, color, dash or "solid", symbol


def _axis_values(fig: go.Figure, key: str) -> list[float]:
    """The values the traces place on axis `key` ('xaxis2', 'yaxis')."""
    letter, ref = key[0], key[0] + key[5:]
    out: list[float] = []
    for tr in fig.data:
        if (getattr(tr, f"{letter}axis", None) or letter) == ref:
            try:
                out += [float(x) for x in _values(getattr(tr, letter, None))]
            except (TypeError, ValueError):
                continue
    return out


def _drawn_key(trace: Any) -> tuple[Any, ...] | None:
    """What a line or marker trace puts on the page: its axes, points and line width (colour aside)."""
    if trace.type not in ("scatter", "scattergl") or trace.visible is False:
        return None
    try:
        x, y = (tuple(float(v) for v in _values(getattr(trace, a))) for a in ("x", "y"))
    except (TypeError, ValueError):
        return None
    if not y:
        return None
    width = trace.line.width if getattr(trace, "line", None) is not None else None
    return trace.xaxis, trace.yaxis, x or tuple(range(len(y))), y, width


def _log_axis_problem(fig: go.Figure, key: str) -> str | None:
    """A log axis left to plotly's automatic ticks, or whose whole-decade ticks label fewer than two decades."""
    axis = fig.layout[key]
    if axis.type != "log" or axis.tickvals is not None:
        return None
    dtick = axis.dtick
    whole = isinstance(dtick, (int, float)) and not isinstance(dtick, bool) and float(dtick) >= 1 \
        and float(dtick).is_integer()
    if not whole:
        return (f"{key} is logarithmic with plotly's automatic ticks (minor labels like '9, 100, 2, 3'): "
                "set its ticks with style.log_ticks(values)")
    if axis.range is not None:
        lo, hi = sorted(float(r) for r in axis.range)
    else:
        v = [x for x in _axis_values(fig, key) if np.isfinite(x) and x > 0]
        if not v:
            return None
        lo, hi = np.log10(min(v)), np.log10(max(v))
    labels = int(np.floor(hi + 1e-9)) - int(np.ceil(lo - 1e-9)) + 1
    if labels < 2:
        return (f"{key} ticks whole decades but its span holds {max(labels, 0)} of them: "
                "set its ticks with style.log_ticks(values)")
    return None


def frame_slider(labels: list[str], prefix: str, active: int = 0) -> dict[str, Any]:
    """A plotly slider whose step i shows the frame named labels[i] at once (no transition): a figure's own control,
    which moves in a static page as well as in JupyterLab."""
    steps = [{"method": "animate", "label": label,
              "args": [[label], {"mode": "immediate", "frame": {"duration": 0, "redraw": True},
                                 "transition": {"duration": 0}}]} for label in labels]
    return {"active": active, "steps": steps, "currentvalue": {"prefix": prefix}, "pad": {"t": 40}}


def wrapped(text: str, width: int = MAX_TITLE_CHARS) -> str:
    """Plain text broken into lines of at most `width` characters at spaces, joined by <br> (for a plotly title)."""
    lines: list[str] = []
    for word in text.split():
        if lines and len(lines[-1]) + 1 + len(word) <= width:
            lines[-1] += " " + word
        else:
            lines.append(word)
    return "<br>".join(lines)


def _long_title_lines(title: str | None) -> list[str]:
    """Title lines (split at <br>, tags removed) too long for a notebook's page: plotly clips them."""
    problems = []
    for line in re.split(r"<br\s*/?>", title or ""):
        limit = MAX_SUBTITLE_CHARS if "<sup>" in line else MAX_TITLE_CHARS
        text = html.unescape(re.sub(r"<[^>]+>", "", line))
        if len(text) > limit:
            problems.append(f"a title line of {len(text)} characters (at most {limit}; break it with <br>): "
                            f"{text[:40]}...")
    return problems


def _coloraxis_shown(layout: go.Layout, name: str) -> bool:
    """Whether a shared colour axis (coloraxis, coloraxis2, ...) draws its scale."""
    axis = layout[name] if name in layout else None
    return axis is not None and axis.showscale is not False


LEGEND_ROW = 0.06  # the share of a plot's height one legend row takes, about (for `_legend_box`)


def _legend_box(layout: go.Layout, entries: int) -> tuple[float, float, float, float] | None:
    """Where the legend lies in paper coordinates, about: (x0, x1, y0, y1); None where none is drawn. Plotly
    draws one for two or more entries unless told otherwise; a vertical legend stands right of the plot from its
    top, a horizontal one spans the width at its `y` (one row per four entries)."""
    if layout.showlegend is False or (entries < 2 and layout.showlegend is not True) or entries == 0:
        return None
    legend = layout.legend
    if legend.orientation == "h":
        y = 1.02 if legend.y is None else legend.y
        rows = -(-entries // 4)
        top = y + rows * LEGEND_ROW if legend.yanchor == "bottom" else y
        return (0.0 if legend.x is None else legend.x - (1 if legend.xanchor == "right" else 0), 1.0,
                top - rows * LEGEND_ROW, top)
    x = 1.02 if legend.x is None else legend.x
    y = 1.0 if legend.y is None else legend.y
    top = y + entries * LEGEND_ROW if legend.yanchor == "bottom" else y
    left = x - 0.25 if legend.xanchor == "right" else x
    return left, left + 0.25, top - entries * LEGEND_ROW, top


CHAR_EM, LINE_EM = 0.6, 1.3  # a label's character width and line height, in units of its font size, about


def _plot_px(layout: go.Layout) -> tuple[float, float]:
    """The plotting area's width and height in pixels, about (plotly's defaults where the layout sets none)."""
    m = layout.margin
    width = (layout.width or 700) - (80 if m.l is None else m.l) - (80 if m.r is None else m.r)
    height = (layout.height or 450) - (100 if m.t is None else m.t) - (80 if m.b is None else m.b)
    return max(width, 1.0), max(height, 1.0)


def _axis_span(fig: go.Figure, key: str) -> tuple[float, float] | None:
    """An axis's drawn range in its own units (log10 on a log axis): its set range, else its data's extent."""
    axis = fig.layout[key]
    log = axis.type == "log"
    if axis.range is not None:
        lo, hi = (float(r) for r in axis.range)
    else:
        v = [x for x in _axis_values(fig, key) if np.isfinite(x) and (x > 0 or not log)]
        if not v:
            return None
        lo, hi = (np.log10(min(v)), np.log10(max(v))) if log else (min(v), max(v))
        pad = 0.05 * (hi - lo or 1.0)
        lo, hi = lo - pad, hi + pad
    return (min(lo, hi), max(lo, hi)) if hi != lo else None


def _fraction(fig: go.Figure, key: str, value: Any, span: tuple[float, float], ref: str = "",
              logged: bool = False) -> float | None:
    """Where `value` falls along axis `key` as a fraction of its drawn span; a "domain" reference is one already.
    On a log axis a data value is taken to log10 first, unless `logged` (plotly places annotations by log10)."""
    if ref.endswith("domain"):
        return float(value)
    try:
        v = float(value)
    except (TypeError, ValueError):
        return None
    if fig.layout[key].type == "log" and not logged:
        if v <= 0:
            return None
        v = float(np.log10(v))
    return (v - span[0]) / (span[1] - span[0])


_PERCENT = re.compile(r"\d%|%\{[^}]*\}%")  # a printed share: "75%", or a template field printed as one
_COUNT = re.compile(r"\bof\s+(?:\d|%\{)")  # its count beside it: "3 of 4", "of %{customdata[1]}"


def _shares_without_counts(fig: go.Figure) -> list[str]:
    """Traces that print a percentage on the plot (text, texttemplate) without the count it is a share of ("k of
    n") in their text or hover: 100% of one trial reads like 100% of a hundred."""
    problems = []
    for i, tr in enumerate(fig.data):
        printed = [str(v) for v in _values(getattr(tr, "text", None))] + [str(getattr(tr, "texttemplate", None) or "")]
        if not any(_PERCENT.search(t) for t in printed):
            continue
        if not any(_COUNT.search(t) for t in printed + [str(getattr(tr, "hovertemplate", None) or "")]):
            problems.append(f"trace {i} ({tr.name or tr.type}) prints a percentage without its count: say 'k of n' "
                            "in its text or hover")
    return problems


def _labels_over_markers(fig: go.Figure) -> list[str]:
    """Annotations whose text, placed on the axes without an arrow, covers a marker drawn on the same axes (its
    box estimated from the characters and lines of the text)."""
    problems = []
    width_px, height_px = _plot_px(fig.layout)
    for a in fig.layout.annotations:
        if a.showarrow is not False or not a.text or a.x is None or a.y is None or "paper" in (a.xref, a.yref):
            continue
        xref, yref = a.xref or "x", a.yref or "y"
        xkey, ykey = _axis_key(xref.split()[0]), _axis_key(yref.split()[0])
        if xkey not in fig.layout or ykey not in fig.layout:
            continue
        spans = _axis_span(fig, xkey), _axis_span(fig, ykey)
        if None in spans:
            continue
        x, y = (_fraction(fig, xkey, a.x, spans[0], xref, True), _fraction(fig, ykey, a.y, spans[1], yref, True))
        if x is None or y is None:
            continue
        lines = re.split(r"<br\s*/?>", str(a.text))
        size = a.font.size or 12
        w = max(len(re.sub(r"<[^>]+>", "", line)) for line in lines) * CHAR_EM * size / width_px
        h = len(lines) * LINE_EM * size / height_px
        x0 = {"left": x, "right": x - w}.get(a.xanchor, x - w / 2)
        y0 = {"bottom": y, "top": y - h}.get(a.yanchor, y - h / 2)
        for i, tr in enumerate(fig.data):
            if tr.type not in ("scatter", "scattergl") or "markers" not in (tr.mode or "") or tr.visible is False \
                    or (_axis_key(tr.xaxis or "x"), _axis_key(tr.yaxis or "y")) != (xkey, ykey):
                continue
            for px, py in zip(_values(tr.x), _values(tr.y)):
                fx, fy = _fraction(fig, xkey, px, spans[0]), _fraction(fig, ykey, py, spans[1])
                if fx is not None and fy is not None and x0 <= fx <= x0 + w and y0 <= fy <= y0 + h:
                    text = re.sub(r"<[^>]+>", " ", str(a.text))[:40]
                    problems.append(f"the label {text!r} covers a marker of trace {i} ({tr.name or tr.type}) at "
                                    f"({px}, {py}): move it or draw it on an arrow")
                    break
    return problems


def figure_problems(fig: go.Figure) -> list[str]:
    """What in `fig` breaks the lab's figure rules, one sentence each (an empty list: none).

    - two legend entries with the same name, or two traces on the same axes with the same colour, dash and marker;
    - two line/marker traces on the same axes with the same points and line width (one hides the other);
    - an axis that shows data (every xaxis*/yaxis* a trace uses) without a title, unless it is hidden or shares
      the title of an axis it matches;
    - a log axis that shows data with plotly's automatic ticks, or with whole-decade ticks of which fewer than two
      fall in its span (`log_ticks` sets readable ones);
    - a printed number with more than MAX_DIGITS significant digits: trace text (after its texttemplate), hover
      fields printed without a format, trace names, annotations (subplot titles too), the title, axis titles.
      Integers are exact counts (tokens, bytes) and pass;
    - a legend of more than MAX_LEGEND entries (group or facet beyond that: similar shades cannot be told apart);
    - a heatmap without its colour scale (a colour that means a number needs its key);
    - a slider with fewer than two steps, or one whose steps name frames the figure lacks (it cannot move);
    - a title line longer than MAX_TITLE_CHARS (MAX_SUBTITLE_CHARS in <sup>): a notebook's page clips it;
    - an annotation placed (in paper coordinates) where the legend is drawn (`_legend_box`): it covers entries;
    - a label placed on the axes without an arrow whose text covers a marker (`_labels_over_markers`);
    - a percentage printed on the plot without the count it is a share of (`_shares_without_counts`).
    """
    problems: list[str] = []
    layout = fig.layout
    legend_names: dict[str, int] = {}
    styles: dict[tuple[Any, ...], int] = {}
    drawn: dict[tuple[Any, ...], int] = {}
    used_axes: set[str] = set()
    for i, tr in enumerate(fig.data):
        who = f"trace {i} ({tr.name or tr.type})"
        if hasattr(tr, "xaxis") and tr.type not in ("pie", "table"):
            used_axes.update({_axis_key(tr.xaxis or "x"), _axis_key(tr.yaxis or "y")})
        in_legend = getattr(tr, "showlegend", False) is not False and tr.type not in ("heatmap", "contour", "table")
        if in_legend and tr.name:
            if tr.name in legend_names:
                problems.append(f"{who} repeats the legend name of trace {legend_names[tr.name]}")
            legend_names.setdefault(tr.name, i)
        key = _style_key(tr)
        if key is not None:
            key = (tr.xaxis, tr.yaxis, *key)
            if key in styles:
                problems.append(f"{who} has the colour, dash and marker of trace {styles[key]} on the same axes")
            styles.setdefault(key, i)
        same = _drawn_key(tr)
        if same is not None:
            if same in drawn:
                problems.append(f"{who} draws exactly the line of trace {drawn[same]}, which hides one of them: "
                                "draw them as one trace named for both, or tell them apart (e.g. line width)")
            drawn.setdefault(same, i)
        problems += _text_problems(f"{who} name", [tr.name])
        text = getattr(tr, "text", None)
        template = getattr(tr, "texttemplate", None)
        if text is not None and (template is None or "%{text}" in template):
            problems += _text_problems(f"{who} text", _values(text))
        for template_name in ("texttemplate", "hovertemplate"):
            tpl = getattr(tr, template_name, None)
            for field in set(_FIELD.findall(str(tpl or ""))) - {"text"}:
                problems += _text_problems(f"{who} {template_name} %{{{field}}}", _values(getattr(tr, field)))
        colorbar = getattr(tr, "colorbar", None)
        if colorbar is not None and colorbar.ticktext is not None:
            problems += _text_problems(f"{who} colorbar ticks", colorbar.ticktext)
    if len(legend_names) > MAX_LEGEND and layout.showlegend is not False:
        problems.append(f"the legend lists {len(legend_names)} entries; at most {MAX_LEGEND} (group or facet)")
    frames = {f.name for f in fig.frames or ()}
    for slider in layout.sliders or ():
        names = [name for step in slider.steps if step.method == "animate" for name in step.args[0]]
        if len(slider.steps) < 2 or set(names) - frames:
            problems.append(f"a slider of {len(slider.steps)} step(s) that cannot move (frames named: "
                            f"{sorted(set(names) & frames)} of {sorted(set(names))})")
    scales: dict[tuple[Any, ...], list[bool]] = {}  # heatmaps sharing one colour mapping: is any scale drawn?
    for tr in fig.data:
        if tr.type == "heatmap":
            shown = _coloraxis_shown(layout, tr.coloraxis) if tr.coloraxis else tr.showscale is not False
            key = (tr.coloraxis, str(tr.colorscale), tr.zmin, tr.zmax, tr.zmid)
            scales.setdefault(key, []).append(shown)
    for (axis, *_), shown in scales.items():
        if not any(shown):
            problems.append(f"{len(shown)} heatmap(s) without a colour scale" + (f" ({axis})" if axis else ""))
    for key in sorted(used_axes):
        if key in layout and not _has_title(layout, key):
            problems.append(f"{key} shows data but has no title")
        if key in layout and (problem := _log_axis_problem(fig, key)):
            problems.append(problem)
    problems += _text_problems("the title", [layout.title.text])
    problems += _long_title_lines(layout.title.text)
    problems += _text_problems("an annotation", [a.text for a in layout.annotations])
    box = _legend_box(layout, len(legend_names))
    for a in layout.annotations if box is not None else ():
        if a.xref == "paper" and a.yref == "paper" and a.x is not None and a.y is not None \
                and box[0] <= a.x <= box[1] and box[2] <= a.y <= box[3]:
            problems.append(f"the annotation {str(a.text)[:40]!r} lies where the legend is drawn")
    problems += _labels_over_markers(fig)
    problems += _shares_without_counts(fig)
    for key in sorted(used_axes):
        if key in layout and layout[key].title is not None:
            problems += _text_problems(f"{key} title", [layout[key].title.text])
    return problems
