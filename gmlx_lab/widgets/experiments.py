"""ipywidgets apps for notebook 10, "When does it break?": passkey, draft acceptance, KV on quantized weights.

Each app runs once with its defaults when built (so a notebook runs top to bottom unattended), then
again on Run with the chosen scheme, width, kvarn tail and context. The measurements are
gmlx_lab.experiments; the figures gmlx_lab.viz.
"""

from __future__ import annotations

import time
from typing import Any

import ipywidgets as W
from IPython.display import display

from ..kv_inspect import eval_tokens
from ..measure import experiments
from ..registry import SCHEMES, get_scheme
from ..viz import figures
from ..viz.say import Say

__all__ = ["DraftApp", "PasskeyApp", "SchemePicker", "WeightsApp", "draft_app", "passkey_app", "weights_app"]

WIDTHS = [2, 3, 4, 6, 8]  # accepted by affine, affine_rot and kvarn alike; the picker offers schemes that take them


class SchemePicker:
    """Scheme, width and tail controls over the registered schemes that take a width; `spec` is the scheme spec
    they make, e.g. "kvarn2:tail=0". The tail control is enabled only for a scheme that keeps an fp16 tail."""

    def __init__(self, scheme: str = "kvarn", width: int = 2, tail: int = 0):
        names = [name for name, s in SCHEMES.items()
                 if any(o.name == "bits" and set(WIDTHS) <= set(o.choices or WIDTHS) for o in s.options)]
        self.scheme = W.ToggleButtons(options=names, value=scheme, description="scheme")
        self.width = W.Dropdown(options=WIDTHS, value=width, description="width", layout={"width": "160px"})
        self.tail = W.ToggleButtons(options=[0, 128, 1024], value=tail, description="fp16 tail")
        self.scheme.observe(lambda _: self._enable(), names="value")
        self._enable()

    def _has_tail(self) -> bool:
        return any(o.name == "kv_tail_tokens" for o in get_scheme(self.scheme.value).options)

    def _enable(self) -> None:
        self.tail.disabled = not self._has_tail()

    @property
    def spec(self) -> str:
        return f"{self.scheme.value}{self.width.value}" + (f":tail={self.tail.value}" if self._has_tail() else "")

    def widgets(self) -> list[W.Widget]:
        return [self.scheme, W.HBox([self.width, self.tail])]


class _App:
    """Controls, a Run button and an output area; `run()` draws into the output."""

    def __init__(self, controls: list[W.Widget]):
        self.button = W.Button(description="Run", button_style="primary")
        self.status = W.HTML()
        self.out = W.Output()
        self.controls = controls
        self.button.on_click(lambda _: self.update())
        self.update()

    def update(self) -> None:
        self.status.value = "<i>running ...</i>"
        start = time.perf_counter()
        with self.out:
            self.out.clear_output(wait=True)
            self.run()
        self.status.value = f"<small>ran in {time.perf_counter() - start:.0f} s</small>"

    def run(self) -> None:
        raise NotImplementedError

    def widget(self) -> W.Widget:
        return W.VBox([*self.controls, W.HBox([self.button, self.status]), self.out])

    def _ipython_display_(self) -> None:
        display(self.widget())


class PasskeyApp(_App):
    """A passkey at a chosen depth of a prompt of chosen length: fp16's greedy answer beside the scheme's."""

    def __init__(self, model: Any, tokenizer: Any, context: int = 704, depth: float = 0.2, scheme: str = "kvarn",
                 width: int = 2, tail: int = 0):
        self.model, self.tokenizer = model, tokenizer
        self.picker = SchemePicker(scheme, width, tail)
        self.context = W.IntSlider(value=context, min=320, max=2048, step=64, description="context",
                                   continuous_update=False)
        self.depth = W.FloatSlider(value=depth, min=0.0, max=1.0, step=0.1, description="needle depth",
                                   continuous_update=False)
        self.result: experiments.PasskeyResult | None = None
        super().__init__([*self.picker.widgets(), W.HBox([self.context, self.depth])])

    def run(self) -> None:
        self.result = experiments.passkey(self.model, self.tokenizer, ["fp16", self.picker.spec],
                                          lengths=[self.context.value], depths=[self.depth.value])
        rows = [{"cache": t.label, "greedy answer": t.answer.strip().replace("\n", " ⏎ "), "key": t.key,
                 "recalled": "yes" if t.correct else "NO", "key held in": t.needle_stored} for t in self.result.trials]
        first = self.result.trials[0]
        window = self.result.window
        where = (f"The key is {first.distance} tokens before the end of the prompt"
                 + (f": {'beyond' if first.distance > window else 'within'} the {window}-token sliding window, so "
                    f"{'only the global layers' if first.distance > window else 'the sliding-window layers too'} "
                    "can attend to it." if window else "."))
        display(figures.Table(rows, f"{self.result.model}, {first.tokens}-token prompt"))
        display(Say(where))  # not a widget: the book draws an output widget's displays as their text


class DraftApp(_App):
    """Speculative decoding with a layer-skipping draft: acceptance under fp16 and under the chosen target cache."""

    def __init__(self, model: Any, tokenizer: Any, context: int = 256, draft_layers: int | None = None,
                 max_tokens: int = 32, scheme: str = "affine", width: int = 2, tail: int = 0):
        self.model, self.tokenizer, self.max_tokens = model, tokenizer, max_tokens
        self.picker = SchemePicker(scheme, width, tail)
        self.context = W.IntSlider(value=context, min=64, max=2048, step=64, description="context",
                                   continuous_update=False)
        self.layers = W.IntSlider(value=draft_layers or len(model.layers), min=1, max=len(model.layers),
                                  description="draft layers", continuous_update=False)
        self.result: experiments.DraftResult | None = None
        super().__init__([*self.picker.widgets(), W.HBox([self.context, self.layers])])

    def run(self) -> None:
        draft = experiments.layer_skip_draft(self.model, self.layers.value)
        prompt = eval_tokens(self.tokenizer, self.context.value)
        self.result = experiments.draft_acceptance(self.model, self.tokenizer, draft, ["fp16", self.picker.spec],
                                                   [prompt], max_tokens=self.max_tokens)
        display(figures.draft_figure(self.result))
        display(Say(draft_sentence(self.result, self.layers.value, len(self.model.layers))))


def draft_sentence(result: experiments.DraftResult, draft_layers: int, layers: int) -> str:
    """What a draft run shows, from its numbers: the quantized target's acceptance against fp16's, and whether
    the cache or the draft decides it (all layers: the draft is the target itself with an fp16 cache)."""
    fp16, other = result.runs[0], result.runs[-1]
    verdict = ("fewer" if other.acceptance < fp16.acceptance else "more" if other.acceptance > fp16.acceptance
               else "as many")
    text = (f"{other.label} accepted {verdict} drafted tokens than fp16: {100 * other.acceptance:.0f}% against "
            f"{100 * fp16.acceptance:.0f}% ({other.tokens_per_step:.2f} against {fp16.tokens_per_step:.2f} tokens per "
            "target pass). ")
    if draft_layers == layers:
        return text + ("With all layers the draft is the target itself with an fp16 cache, so every rejection is "
                       "the quantized cache's doing.")
    return text + (f"A {draft_layers}-layer draft is often wrong on its own, so acceptance here says how the cache "
                   "changed the target's text as much as how close it stays to fp16; slide to all layers to see the "
                   "cache alone.")


class WeightsApp(_App):
    """Quantized weights, a quantized cache, and both: decode KL against fp16 weights with an fp16 cache."""

    def __init__(self, model: Any, tokenizer: Any, context: int = 320, decode: int = 16, weight_bits: int = 4,
                 scheme: str = "kvarn", width: int = 4, tail: int = 0):
        self.model, self.tokenizer, self.decode = model, tokenizer, decode
        self.picker = SchemePicker(scheme, width, tail)
        self.bits = W.Dropdown(options=[8, 4, 3], value=weight_bits, description="weight bits",
                               layout={"width": "180px"})
        self.context = W.IntSlider(value=context, min=64, max=2048, step=64, description="context",
                                   continuous_update=False)
        self.result: experiments.WeightsKVResult | None = None
        super().__init__([self.bits, *self.picker.widgets(), self.context])

    def run(self) -> None:
        tokens = eval_tokens(self.tokenizer, self.context.value + self.decode)
        self.result = experiments.weights_and_kv(self.model, tokens, (None, self.bits.value),
                                                 ["fp16", self.picker.spec], prefill=self.context.value,
                                                 decode=self.decode)
        display(self.result)
        display(figures.weights_kv_positions(self.result, f"{self.bits.value}-bit"))


def passkey_app(model: Any, tokenizer: Any, **kwargs: Any) -> PasskeyApp:
    """The passkey app (display it as a cell's last expression)."""
    return PasskeyApp(model, tokenizer, **kwargs)


def draft_app(model: Any, tokenizer: Any, **kwargs: Any) -> DraftApp:
    """The draft-acceptance app."""
    return DraftApp(model, tokenizer, **kwargs)


def weights_app(model: Any, tokenizer: Any, **kwargs: Any) -> WeightsApp:
    """The weights x KV app."""
    return WeightsApp(model, tokenizer, **kwargs)
