"""ipywidgets apps for the notebooks: a model picker, explorers, and the live scheme comparison.

    picker = model_picker()            # bundled teaching model by default
    compare(picker.model, picker.tokenizer)
    passkey_app(model, tokenizer)      # notebook 10: passkey, draft_app, weights_app (widgets/experiments.py)

Every app keeps its logic in gmlx_lab (kv_inspect, viz); the widgets only wire
controls to it. Figures that change in place are `go.FigureWidget`s (plotly 7
draws them through anywidget, offline).
"""

from __future__ import annotations

import html
import time
from collections.abc import Sequence
from typing import Any

import ipywidgets as W
import numpy as np
import plotly.graph_objects as go
from IPython.display import HTML, display

from .. import kv_inspect
from ..live import TEMPERATURE, LiveColumn, LiveCompare, quantized_tokens
from ..models import BUNDLED_NAME, available_models, load
from ..registry import BASELINE, SCHEMES, get_scheme
from ..viz import figures
from ..viz import tradeoff_figures as tradeoff_viz
from ..viz.figures import scheme_color
from ..viz.quant import outlier_ratio
from ..viz.say import Say
from .experiments import WIDTHS, DraftApp, PasskeyApp, SchemePicker, WeightsApp, draft_app, passkey_app, weights_app

__all__ = ["CompareApp", "DraftApp", "ModelPicker", "PasskeyApp", "SchemePicker", "WeightsApp", "compare",
           "draft_app", "kv_explorer", "model_picker", "passkey_app", "region_explorer", "replay_html", "weights_app"]


class ModelPicker:
    """Choose a model: the bundled one (default), SmolLM2 or Gemma 3 270M when installed, or an mlx-lm folder / repo id.

    The default model is loaded at once, so a notebook runs top to bottom unattended;
    pick another and press Load, then re-run the cells below.
    """

    def __init__(self, default: str | None = None):
        names = [m.name for m in available_models()]
        self.choice = W.Dropdown(options=[*names, "other (path or repo id)"], description="model",
                                 value=default or (BUNDLED_NAME if BUNDLED_NAME in names else names[0]))
        self.path = W.Text(placeholder="an mlx-lm folder or Hugging Face repo id", layout={"width": "340px"})
        self.button = W.Button(description="Load", button_style="primary")
        self.status = W.HTML()
        self.button.on_click(lambda _: self.load())
        self.model: Any = None
        self.tokenizer: Any = None
        self.load()

    @property
    def name(self) -> str:
        return self.path.value.strip() if self.choice.value.startswith("other") else self.choice.value

    def load(self) -> None:
        """Load the chosen model (float32 compute on the CPU)."""
        self.status.value = f"loading <code>{html.escape(self.name)}</code> ..."
        try:
            self.model, self.tokenizer = load(self.name or None)
            cfg = getattr(self.model, "args", None)
            extra = f", {cfg.num_hidden_layers} layers, head_dim {getattr(cfg, 'head_dim', '?')}" if cfg else ""
            self.status.value = f"loaded <code>{html.escape(self.model.gmlx_name)}</code>{extra}"
        except Exception as exc:  # shown in the widget: a notebook should not die on a bad path
            self.status.value = f"<span style='color:#c00'>{html.escape(str(exc))}</span>"

    def widget(self) -> W.Widget:
        return W.VBox([W.HBox([self.choice, self.path, self.button]), self.status])

    def _ipython_display_(self) -> None:
        display(self.widget())


def model_picker(default: str | None = None) -> ModelPicker:
    """A `ModelPicker` with the default model already loaded."""
    return ModelPicker(default)


def kv_explorer(cap: kv_inspect.Capture, layer: int | None = None) -> W.Widget:
    """Layer / head / token-range pickers over a capture, drawing per-channel |K| before and after rotation.

    It opens on `layer`, by default the layer whose K has the strongest outlier channel (`viz.outlier_ratio`).
    """
    if layer is None:
        layer = max(cap.layers, key=lambda i: max(outlier_ratio(k) for k in cap.keys[i]))
    layer = W.Dropdown(options=cap.layers, value=layer, description="layer")
    head = W.Dropdown(options=list(range(cap.keys[cap.layers[0]].shape[0])), description="KV head")
    n = len(cap.tokens)
    tokens = W.IntRangeSlider(value=(0, n), min=0, max=n, step=1, description="tokens")
    out = W.Output()

    def draw(*_: Any) -> None:
        lo, hi = tokens.value
        k = cap.k(layer.value, head.value)[lo:max(hi, lo + 1)]
        with out:
            out.clear_output(wait=True)
            display(figures.channel_figure(k, f"|K| per channel, layer {layer.value}, head {head.value}, "
                                              f"tokens {lo}-{hi}"))

    for w in (layer, head, tokens):
        w.observe(draw, "value")
    draw()
    return W.VBox([W.HBox([layer, head, tokens]), out])


def region_explorer(context: int = 1500, tail: int = 1024) -> W.Widget:
    """Sliders for context and kv_tail_tokens; the kvarn regions drawn as a bar and as a stream."""
    ctx = W.IntSlider(value=context, min=0, max=4096, step=1, description="context", continuous_update=False)
    tl = W.SelectionSlider(options=[0, 128, 256, 512, 1024, 2048], value=tail, description="tail")
    bar = go.FigureWidget(figures.regions_bar(ctx.value, tl.value, max_context=4096))
    stream = go.FigureWidget(figures.regions_stream(4096, tl.value))

    def redraw(*_: Any) -> None:
        new_bar = figures.regions_bar(ctx.value, tl.value, max_context=4096)
        new_stream = figures.regions_stream(4096, tl.value)
        with bar.batch_update():
            for trace, fresh in zip(bar.data, new_bar.data):
                trace.x = fresh.x
            bar.layout.title.text = new_bar.layout.title.text
            bar.layout.shapes = new_bar.layout.shapes  # the record boundaries
        with stream.batch_update():
            for trace, fresh in zip(stream.data, new_stream.data):
                trace.y = fresh.y
            stream.layout.title.text = new_stream.layout.title.text
            stream.layout.shapes = [{"type": "line", "x0": ctx.value, "x1": ctx.value, "y0": 0, "y1": 1,
                                     "xref": "x", "yref": "paper", "line": {"dash": "dot"}}]

    ctx.observe(redraw, "value")
    tl.observe(redraw, "value")
    redraw()
    return W.VBox([W.HBox([ctx, tl]), bar, stream])


def _column_html(col: LiveColumn, reference: LiveColumn) -> str:
    """One column's text, each token shaded by its KL against fp16 (fixed log scale), the first token that
    differs from fp16's text outlined."""
    diverge = None if col.reference else kv_inspect.first_divergence(reference.tokens, col.tokens)
    out = []
    for i, (piece, kl) in enumerate(zip(col.pieces, col.kl)):
        shade = tradeoff_viz.kl_color(kl)
        style = (f"background:{shade};" if shade else "") + ("outline:2px solid #c00;" if i == diverge else "")
        text = html.escape(piece).replace("\n", "⏎<br>")
        out.append(f"<span data-i='{i}' style='{style}' title='token {i}: KL {kl:.2e} nats'>{text}</span>")
    return "".join(out)


REPLAY_SCRIPT = """(function () {
  const root = document.getElementById("%(id)s"), n = %(n)d;
  const button = root.querySelector("button"), slider = root.querySelector("input");
  const count = root.querySelector(".count");
  const spans = root.querySelectorAll("span[data-i]");
  let timer = null;
  function show(k) {
    spans.forEach(s => { s.style.display = (+s.dataset.i < k) ? "" : "none"; });
    count.textContent = k + " of " + n + " tokens";
  }
  function stop() { clearInterval(timer); timer = null; button.textContent = "\u25b6 play"; }
  slider.addEventListener("input", () => { if (timer) stop(); show(+slider.value); });
  button.addEventListener("click", () => {
    if (timer) { stop(); return; }
    if (+slider.value >= n) slider.value = 0;
    button.textContent = "\u275a\u275a pause";
    timer = setInterval(() => {
      slider.value = +slider.value + 1; show(+slider.value);
      if (+slider.value >= n) stop();
    }, 150);
  });
  show(+slider.value);
})();"""


def replay_html(columns: list[tuple[str, str]], tokens: int, key: str) -> str:
    """A run's columns (label, the column's token spans from `_column_html`) as a page that plays them back without
    a kernel: a play button and a slider over tokens; every token shows at first, so a page without scripts reads
    the whole run. `key` makes the element's id unique on its page."""
    boxes = "".join(
        f"<div style='flex:1 1 0;min-width:0;padding:0 6px;border-left:3px solid {scheme_color(label)}'>"
        f"<b style='color:{scheme_color(label)}'>{html.escape(label)}</b><div style='font-family:monospace;"
        f"font-size:12px;line-height:1.5;margin-top:4px'>{spans}</div></div>" for label, spans in columns)
    element = f"gmlx-replay-{key}"
    return (f"<div id='{element}' class='gmlx-replay' style='font-family:sans-serif'>"
            f"<div style='margin:4px 0'><button style='min-width:90px'>\u25b6 play</button> "
            f"<input type='range' min='0' max='{tokens}' value='{tokens}' style='width:50%;vertical-align:middle'> "
            f"<span class='count'>{tokens} of {tokens} tokens</span></div>"
            f"<div style='display:flex;width:100%'>{boxes}</div></div>"
            f"<script>{REPLAY_SCRIPT % {'id': element, 'n': tokens}}</script>")


def _holds_html(col: LiveColumn) -> str:
    """What the column's cache holds: tokens per region of a quantized layer, and which layers are quantized."""
    regions = col.holdings()
    if len(regions) == 1:
        (name, n), = regions.items()
        line = f"cache: {n} tokens, all {name}"
    else:
        line = f"cache: {col.context} tokens = " + " + ".join(f"{name} {n}" for name, n in regions.items())
    line += f" <span style='color:#666'>({col.quantized_layers} layers quantized)</span>"
    if not col.reference and quantized_tokens(regions) == 0:
        line += ("<br><b style='color:#b35900'>nothing quantized yet: the fp16 sink and tail cover the whole "
                 f"{col.context}-token context, so this cache is fp16</b>")
    return line


# The columns compare opens with: the lab's own three; the field's schemes (notebook 11) are one tick away.
COMPARE_DEFAULT = ("affine", "affine_rot", "kvarn")


class CompareApp:
    """Live comparison: fp16 and each chosen scheme side by side, streamed token by token.

    The prompt follows `context_tokens` tokens of the bundled evaluation text, so the cache is long enough for
    kvarn to seal records (its first 128 tokens are an fp16 sink). Every column is text from
    `mlx_lm.stream_generate` with that scheme's cache (gmlx_lab.live.LiveCompare), sampled from one random stream
    shared by all columns (or greedy at temperature 0); each token is shaded by KL(fp16 || scheme) of the
    distribution it was drawn from, on one fixed log scale for all columns. K and V widths move together until
    the link is switched off; the controls map to each scheme's options through `Scheme.widget_options`, and a
    control no chosen scheme has is disabled. Below: what each cache holds (sink, records, live group, tail),
    its bytes, and its KL against its bytes per token (the equal-memory view). No speed is shown: the columns
    run in turn on one machine, so their tokens/s would not be a fair comparison.
    """

    def __init__(self, model: Any, tokenizer: Any, prompt: str = "Once upon a time", context_tokens: int = 448,
                 max_tokens: int = 64, schemes: Sequence[str] | None = None, bits: int = 4, tail: int = 128,
                 temperature: float = TEMPERATURE, seed: int = 0, autorun: bool = True):
        self.model, self.tokenizer = model, tokenizer
        chosen = COMPARE_DEFAULT if schemes is None else tuple(get_scheme(s).name for s in schemes)
        names = [n for n in chosen if n != BASELINE]  # fp16 is always the first column: the reference
        if not names:
            raise ValueError(f"compare needs at least one scheme besides fp16; registered: {', '.join(SCHEMES)}")
        self.prompt = W.Textarea(value=prompt, description="prompt", layout={"width": "60%"})
        contexts = sorted({0, 448, 1024, 2048, context_tokens})
        self.context = W.Dropdown(options=contexts, value=context_tokens, description="text before",
                                  tooltip="tokens of the bundled text placed before the prompt",
                                  layout={"width": "220px"})
        self.max_tokens = W.BoundedIntText(value=max_tokens, min=1, max=512, description="new tokens",
                                           layout={"width": "200px"})
        temperatures = sorted({0.0, 0.3, 0.6, 0.8, 1.0, float(temperature)})
        self.temperature = W.Dropdown(options=[("greedy" if t == 0 else f"{t:g}", t) for t in temperatures],
                                      value=float(temperature), description="temperature",
                                      tooltip="0: greedy; otherwise every column samples with the same random "
                                              "numbers", layout={"width": "220px"},
                                      style={"description_width": "initial"})
        self.seed = W.BoundedIntText(value=seed, min=0, max=2**31 - 1, description="seed", layout={"width": "160px"})
        # every registered scheme gets a box; the chosen ones start ticked (each column costs a generation)
        self.schemes = {n: W.Checkbox(value=n in names, description=n, indent=False, tooltip=get_scheme(n).summary,
                                      layout={"width": "auto", "margin": "0 16px 0 0"})
                        for n in [*names, *(n for n in SCHEMES if n != BASELINE and n not in names)]}
        self.k_bits = W.Dropdown(options=WIDTHS, value=bits, description="K bits", layout={"width": "160px"})
        self.v_bits = W.Dropdown(options=WIDTHS, value=bits, description="V bits", layout={"width": "160px"})
        self.linked = W.ToggleButton(value=True, description="K = V", icon="link", layout={"width": "90px"},
                                     tooltip="K and V widths move together; switch off to set them apart")
        self.tail = W.Dropdown(options=[0, 128, 256, 1024], value=tail, description="fp16 tail",
                               layout={"width": "180px"})
        self.applies = W.HTML()
        self.run = W.Button(description="Generate", button_style="primary", icon="play")
        self.progress = W.IntProgress(value=0, min=0, max=max_tokens, layout={"width": "200px"})
        self.status = W.HTML()
        self.legend = W.HTML(tradeoff_viz.kl_legend_html())
        self.columns = W.HBox(layout={"width": "100%", "align_items": "stretch"})
        self.stats = W.HTML()
        self.summary = W.Output()  # what the run shows, in sentences built from its values (LiveCompare.summary)
        self.strip = W.Output()  # the equal-memory figure, drawn when a generation ends
        self.live: LiveCompare | None = None
        self.figure: go.Figure | None = None  # the last run's equal-memory figure
        self.k_bits.observe(lambda change: self._follow(self.v_bits, change["new"]), "value")
        self.v_bits.observe(lambda change: self._follow(self.k_bits, change["new"]), "value")
        self.linked.observe(lambda change: self._relink(change["new"]), "value")
        for w in (*self.schemes.values(), self.k_bits, self.v_bits, self.tail):
            w.observe(lambda _: self.update_controls(), "value")
        self.run.on_click(lambda _: self.generate())
        self.update_controls()
        if autorun:
            self.generate()

    def _follow(self, other: W.Dropdown, value: int) -> None:
        """While linked, a width set on K or V is set on the other too."""
        if self.linked.value and other.value != value:
            other.value = value

    def _relink(self, linked: bool) -> None:
        self.linked.icon, self.linked.description = ("link", "K = V") if linked else ("unlink", "K ≠ V")
        if linked:
            self.v_bits.value = self.k_bits.value
        self.update_controls()

    def chosen(self) -> list[str]:
        """The schemes toggled on (fp16 comes first on its own)."""
        return [n for n, t in self.schemes.items() if t.value]

    def options(self, name: str) -> dict[str, Any]:
        """A scheme's options from the controls, for the options it has: K and V widths, or one width (the K
        width's), and the tail."""
        names = {opt.name for opt in get_scheme(name).options}
        out: dict[str, Any] = {}
        if {"k_bits", "v_bits"} <= names:
            out.update(k_bits=self.k_bits.value, v_bits=self.v_bits.value)
        elif "bits" in names:
            out["bits"] = self.k_bits.value
        if "kv_tail_tokens" in names:
            out["kv_tail_tokens"] = self.tail.value
        return out

    def update_controls(self) -> None:
        """Enable each control only where a chosen scheme has the option it sets; say which schemes it sets."""
        has = {n: {o.name for o in get_scheme(n).options} for n in self.chosen()}
        users = {
            self.k_bits: [n for n, o in has.items() if o & {"bits", "k_bits"}],
            self.v_bits: [n for n, o in has.items() if {"k_bits", "v_bits"} <= o],
            self.tail: [n for n, o in has.items() if "kv_tail_tokens" in o],
        }
        for control, names in users.items():
            control.disabled = not names
        self.linked.disabled = not users[self.v_bits]
        one_width = [n for n in users[self.k_bits] if n not in users[self.v_bits]]
        split = self.k_bits.value != self.v_bits.value and users[self.v_bits]
        self.applies.value = (
            "<small>"
            f"K bits: {', '.join(users[self.k_bits]) or 'no chosen scheme'}"
            + (f" ({', '.join(one_width)}: one width for K and V)" if one_width else "")
            + f" · V bits: {', '.join(users[self.v_bits]) or 'no chosen scheme'}"
            + f" · fp16 tail: {', '.join(users[self.tail]) or 'no chosen scheme'}</small>"
            + ("<br><small style='color:#b35900'><b>K and V at different widths</b>: "
               f"{', '.join(users[self.v_bits])} store K{self.k_bits.value} V{self.v_bits.value}, "
               f"{', '.join(one_width) or 'no other scheme'} K and V at {self.k_bits.value} bits: not an equal-width "
               "comparison; the figure below places every cache at its bytes per token</small>"
               if split else ""))

    def prompt_ids(self) -> list[int]:
        """The bundled text's first `context` tokens, then the prompt."""
        text = kv_inspect.eval_tokens(self.tokenizer, self.context.value) if self.context.value else []
        return text + list(self.tokenizer.encode(self.prompt.value, add_special_tokens=False))

    def generate(self) -> None:
        """Stream every chosen scheme and fp16, redrawing the columns after each token."""
        specs, problems = [], []
        for n in self.chosen():
            try:
                get_scheme(n).resolve(**self.options(n))
                specs.append((n, self.options(n)))
            except ValueError as exc:  # a width this scheme does not take: say so, run the others
                problems.append(html.escape(str(exc)))
        ids = self.prompt_ids()
        self.live = LiveCompare(self.model, self.tokenizer, ids, specs, max_tokens=self.max_tokens.value,
                                temperature=self.temperature.value, seed=self.seed.value)
        boxes = [W.HTML(layout={"flex": "1 1 0", "min_width": "0", "padding": "0 6px",
                                "border_left": "3px solid " + scheme_color(c.label)}) for c in self.live.columns]
        for box in boxes:
            box.add_class("gmlx-column")  # for the browser test
        self.columns.children = boxes
        self.stats.value = "<small><i>the table and the equal-memory figure appear when this run ends</i></small>"
        self.summary.clear_output()  # nothing of the previous run stays on screen
        self.strip.clear_output()
        self.figure = None
        self.run.disabled, self.run.description, self.run.icon = True, "Generating…", "spinner"
        self.progress.max, self.progress.value = self.live.max_tokens, 0
        skipped = f"<br><span style='color:#c00'>skipped: {'; '.join(problems)}</span>" if problems else ""
        how = f"<br><small>{html.escape(self.live.sampling)}</small>"
        model = html.escape(getattr(self.model, "gmlx_name", "the model"))
        start = time.perf_counter()
        try:
            for col in self.live.prefill():
                self.status.value = (f"<b>reading the prompt</b> ({len(ids)} tokens, {model}) into each cache: "
                                     f"{html.escape(col.label)} done{skipped}")
            for step in self.live.stream():
                self.progress.value = step
                self.status.value = (f"<b>generating</b> token {step} of {self.live.max_tokens} · context "
                                     f"{self.live.context} tokens ({len(ids)} prompt + generated) · "
                                     f"{model}{how}{skipped}")
                self._draw_columns(boxes)
        finally:
            self.run.disabled, self.run.description, self.run.icon = False, "Generate", "play"
        seconds = time.perf_counter() - start
        self.status.value = (f"done: {min(len(c.tokens) for c in self.live.columns)}+ tokens per column in "
                             f"{seconds:.0f} s (prompt included) · context {self.live.context} tokens = {len(ids)} "
                             f"prompt ({self.context.value} of the bundled text + your prompt) + the generated ones · "
                             f"{model}{how}{skipped}")
        self._draw_columns(boxes)
        self._draw_stats()
        with self.summary:
            display(Say(self.live.summary()))

    def _draw_columns(self, boxes: list[W.HTML]) -> None:
        ref = self.live.columns[0]
        for box, col in zip(boxes, self.live.columns):
            kl = f"mean KL {np.mean(col.kl):.1e} nats" if col.kl and not col.reference else "the reference"
            box.value = (f"<div style='font-family:sans-serif;line-height:1.35'><b style='color:"
                         f"{scheme_color(col.label)}'>{html.escape(col.label)}</b> <small>({len(col.tokens)} tokens, "
                         f"{kl})</small><div style='font-size:11px;margin-top:2px'>{_holds_html(col)}</div>"
                         f"<div style='font-family:monospace;font-size:12px;line-height:1.5;margin-top:4px'>"
                         f"{_column_html(col, ref)}</div></div>")

    def _draw_stats(self) -> None:
        points = self.live.points()
        ref = self.live.columns[0]
        head = ("scheme", "cache", "% of fp16", "KiB / token", "median KL (nats)", "text as fp16's until token")
        rows = []
        for c, p in sorted(zip(self.live.columns, points), key=lambda cp: cp[1].bytes_per_token):
            parted = kv_inspect.first_divergence(ref.tokens, c.tokens)
            rows.append((c.label, figures.bytes_label(p.bytes_per_token * p.context), f"{100 * p.share_of_fp16:.0f}%",
                         f"{p.bytes_per_token / 1024:.2f}", "0 (reference)" if c.reference else f"{p.kl:.1e}",
                         "-" if c.reference else ("the end" if parted is None else str(parted))))
        cell = "<td style='padding:0 12px'>{}</td>"
        self.stats.value = ("<table><tr>" + "".join(f"<th style='padding:0 12px'>{h}</th>" for h in head) + "</tr>"
                            + "".join("<tr>" + "".join(cell.format(html.escape(str(x))) for x in r) + "</tr>"
                                      for r in rows) + "</table>"
                            "<small>sorted by memory; cache: resident bytes of the whole cache at the end (growth "
                            "reserve excluded). At equal width the caches differ in size: the figure places each "
                            "at its bytes per token, so compare schemes at equal memory across it. No speed is shown: "
                            "the columns take turns on one machine, so their tokens/s would not compare fairly."
                            "</small>")
        self.figure = tradeoff_viz.tradeoff_figure(points, height=320, title=(
            f"equal memory at {points[0].context} tokens: KL against cache size"))
        with self.strip:
            display(self.figure)

    def replay(self) -> HTML:
        """The last run's columns as a player that needs no kernel (`replay_html`): the book shows it where the app
        itself is frozen, and it plays in JupyterLab too."""
        if self.live is None:
            raise ValueError("compare: no run to replay yet; press Generate (or make the app with autorun=True)")
        ref = self.live.columns[0]
        columns = [(col.label, _column_html(col, ref)) for col in self.live.columns]
        key = f"{id(self):x}-{sum(len(c.tokens) for c in self.live.columns)}"
        return HTML(replay_html(columns, max(len(c.tokens) for c in self.live.columns), key)
                    + tradeoff_viz.kl_legend_html())

    def widget(self) -> W.Widget:
        box = W.VBox([self.prompt, W.HBox([self.context, self.max_tokens, self.temperature, self.seed]),
                      W.HBox([W.Label("schemes beside fp16:", layout={"margin": "0 12px 0 0"}),
                              *self.schemes.values()]),
                      W.HBox([self.k_bits, self.linked, self.v_bits, self.tail]), self.applies,
                      W.HBox([self.run, self.progress]), self.status, self.legend, self.columns, self.summary,
                      self.stats, self.strip])
        box.add_class("gmlx-compare")
        return box

    def _ipython_display_(self) -> None:
        display(self.widget())


def compare(model: Any, tokenizer: Any, **kwargs: Any) -> CompareApp:
    """The live comparison app (display it as a cell's last expression)."""
    return CompareApp(model, tokenizer, **kwargs)
