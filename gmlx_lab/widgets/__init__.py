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
from collections.abc import Sequence
from typing import Any

import ipywidgets as W
import numpy as np
import plotly.graph_objects as go
from IPython.display import display

from .. import kv_inspect
from ..fidelity import fidelity
from ..models import BUNDLED_NAME, available_models, load
from ..registry import BASELINE, SCHEMES, get_scheme
from ..viz import figures
from ..viz.quant import outlier_ratio
from .experiments import DraftApp, PasskeyApp, SchemePicker, WeightsApp, draft_app, passkey_app, weights_app

__all__ = ["CompareApp", "DraftApp", "ModelPicker", "PasskeyApp", "SchemePicker", "WeightsApp", "compare",
           "draft_app", "kv_explorer", "model_picker", "passkey_app", "region_explorer", "weights_app"]


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


def _tokens_html(pieces: list[str], diverge: int | None, color: str) -> str:
    out = []
    for i, p in enumerate(pieces):
        text = html.escape(p).replace("\n", "⏎")
        if diverge is not None and i >= diverge:
            style = f"background:{color};" + ("outline:2px solid #c00;" if i == diverge else "")
            out.append(f"<span style='{style}'>{text}</span>")
        else:
            out.append(text)
    return "".join(out)


class CompareApp:
    """Live comparison of one scheme against fp16 on the same prompt (the toggles: every registered scheme,
    or `schemes`; the controls map to each scheme's options through `Scheme.widget_options`).

    The prompt follows `context_tokens` tokens of the bundled evaluation text, so
    the cache is long enough for kvarn to seal records (its first 128 tokens are
    an fp16 sink). Both generations are greedy; the first token where they differ
    is outlined. The KL strip is teacher-forced along the fp16 generation: at each
    generated position, KL(fp16 || scheme) of the next-token distributions.
    """

    def __init__(self, model: Any, tokenizer: Any, prompt: str = "Once upon a time", context_tokens: int = 320,
                 max_tokens: int = 20, scheme: str = "kvarn", schemes: Sequence[str] | None = None):
        self.model, self.tokenizer = model, tokenizer
        self.context = kv_inspect.eval_tokens(tokenizer, context_tokens) if context_tokens else []
        self.max_tokens = max_tokens
        self.prompt = W.Textarea(value=prompt, description="prompt", layout={"width": "60%"})
        choices = list(SCHEMES) if schemes is None else [get_scheme(s).name for s in schemes]
        self.scheme = W.ToggleButtons(options=choices, value=get_scheme(scheme).name, description="scheme")
        self.k_bits = W.Dropdown(options=[2, 3, 4, 6, 8], value=4, description="K bits", layout={"width": "160px"})
        self.v_bits = W.Dropdown(options=[2, 3, 4, 6, 8], value=4, description="V bits", layout={"width": "160px"})
        self.tail = W.ToggleButtons(options=[0, 128, 1024], value=0, description="fp16 tail",
                                    tooltips=["newest tokens kept fp16 (schemes with kv_tail_tokens)"] * 3)
        self.run = W.Button(description="Generate", button_style="primary")
        self.texts = W.HTML()
        self.stats = W.HTML()
        self.kl_fig = go.FigureWidget(figures.kl_strip(np.zeros(max_tokens), title="KL per token vs fp16"))
        self._memo: dict[Any, Any] = {}
        for w in (self.scheme, self.k_bits, self.v_bits, self.tail):
            w.observe(lambda _: self.update(), "value")
        self.run.on_click(lambda _: self.update())
        self.update()

    def options(self) -> dict[str, Any]:
        """The chosen scheme's options from the controls (`Scheme.widget_options`: one width uses the K width)."""
        return get_scheme(self.scheme.value).widget_options(self.k_bits.value, self.v_bits.value, self.tail.value)

    def _cached(self, key: Any, fn: Any) -> Any:
        if key not in self._memo:
            self._memo[key] = fn()
        return self._memo[key]

    def update(self) -> None:
        """Generate under fp16 and the chosen scheme, then redraw texts, KL strip and stats."""
        ids = self.context + list(self.tokenizer.encode(self.prompt.value, add_special_tokens=False))
        try:
            opts = self.options()
            get_scheme(self.scheme.value).resolve(**opts)
        except ValueError as exc:  # a width this scheme does not take: say so in the app
            self.texts.value = f"<span style='color:#c00'>{html.escape(str(exc))}</span>"
            return
        key = (tuple(ids), self.scheme.value, tuple(sorted(opts.items())))
        baseline = self.scheme.value == BASELINE
        ref = self._cached((tuple(ids), BASELINE), lambda: kv_inspect.generate(
            self.model, self.tokenizer, ids, BASELINE, self.max_tokens))
        gen = ref if baseline else self._cached(key, lambda: kv_inspect.generate(
            self.model, self.tokenizer, ids, self.scheme.value, self.max_tokens, **opts))
        kl = np.zeros(len(ref.tokens)) if baseline else self._cached(
            ("kl", key), lambda: self._decode_kl(ids, ref.tokens, opts))
        div = kv_inspect.first_divergence(ref.tokens, gen.tokens)
        where = "identical" if div is None else f"first divergence at generated token {div}"
        self.texts.value = (
            "<div style='display:flex;gap:16px'>"
            f"<div style='flex:1'><b>fp16</b><br>{_tokens_html(ref.pieces, div, '#ffe0b2')}</div>"
            f"<div style='flex:1'><b>{html.escape(gen.label)}</b><br>{_tokens_html(gen.pieces, div, '#ffcdd2')}</div>"
            f"</div><p><i>{where}</i></p>")
        with self.kl_fig.batch_update():
            self.kl_fig.data[0].x = list(range(len(kl)))
            self.kl_fig.data[0].y = [float(v) for v in kl]
            self.kl_fig.data[0].customdata = ref.pieces
            self.kl_fig.layout.title.text = (f"KL per token: {gen.label} vs fp16 (mean {float(np.mean(kl)):.2e} nats)")
        cell = "<td style='padding:0 12px'>{}</td>"
        rows = [("", BASELINE, gen.label),
                ("cache", figures.bytes_label(ref.cache_bytes), figures.bytes_label(gen.cache_bytes)),
                ("tokens/s", f"{ref.tokens_per_s:.1f}", f"{gen.tokens_per_s:.1f}")]
        self.stats.value = "<table>" + "".join(
            "<tr>" + "".join(cell.format(html.escape(c)) for c in r) + "</tr>" for r in rows) + "</table>"

    def _decode_kl(self, ids: list[int], generated: list[int], opts: dict[str, Any]) -> np.ndarray:
        """KL(fp16 || scheme) at each generated position, teacher-forced along the fp16 tokens, decoded one by one."""
        res = fidelity(self.model, self.tokenizer, ids + generated, [(self.scheme.value, opts)], prefill=len(ids),
                       decode=len(generated) - 1)
        one = res.schemes[0]
        return np.array([one.prefill_kl[-1], *one.decode_kl])

    def widget(self) -> W.Widget:
        return W.VBox([self.prompt, self.scheme, W.HBox([self.k_bits, self.v_bits]), self.tail, self.run,
                       self.texts, self.kl_fig, self.stats])

    def _ipython_display_(self) -> None:
        display(self.widget())


def compare(model: Any, tokenizer: Any, **kwargs: Any) -> CompareApp:
    """The live comparison app (display it as a cell's last expression)."""
    return CompareApp(model, tokenizer, **kwargs)
