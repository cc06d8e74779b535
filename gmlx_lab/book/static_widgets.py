"""ipywidgets as static HTML: each control drawn disabled, in the state it had when the notebook ran.

A page of the book has no kernel, so a slider cannot recompute anything; what it can show is what the run
showed: the controls with their values, the text of HTML widgets, what each Output widget held (plotly figures
stay live: hover, zoom) and plotly FigureWidgets as figures. The state comes from the notebook's widget
metadata, which nbclient writes (`gmlx_lab.book.run`). A widget kind not drawn here is named, never dropped.
"""

from __future__ import annotations

import base64
import html
from collections.abc import Callable
from typing import Any

import numpy as np

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
REF = "IPY_MODEL_"

_BOXES = {"BoxModel": "row", "HBoxModel": "row", "VBoxModel": "column", "GridBoxModel": "grid"}
_PAGES = {"AccordionModel", "TabModel", "StackModel"}
_SLIDERS = {"IntSliderModel", "FloatSliderModel", "FloatLogSliderModel", "IntRangeSliderModel",
            "FloatRangeSliderModel", "SelectionSliderModel", "SelectionRangeSliderModel"}
_CHOICES = {"DropdownModel", "SelectModel", "RadioButtonsModel", "ToggleButtonsModel", "SelectMultipleModel"}
_TEXTS = {"TextModel", "TextareaModel", "IntTextModel", "FloatTextModel", "BoundedIntTextModel",
          "BoundedFloatTextModel", "PasswordModel", "ComboboxModel"}
_LAYOUT_KEYS = ("width", "min_width", "max_width", "height", "min_height", "max_height", "flex", "flex_flow",
                "display", "justify_content", "align_items", "grid_template_columns", "grid_gap", "margin",
                "padding", "border", "overflow")


def widget_state(nb: Any) -> dict[str, dict[str, Any]]:
    """model id -> {"model_name", "model_module", "state"} from a notebook's metadata (empty if none)."""
    return dict(nb.metadata.get("widgets", {}).get(WIDGET_STATE, {}).get("state", {}))


class StaticWidgets:
    """Draws widget views from one notebook's saved state; `outputs` turns a list of outputs into HTML."""

    def __init__(self, state: dict[str, dict[str, Any]], outputs: Callable[[list[dict]], str]):
        self.models = {key: _with_buffers(model) for key, model in state.items()}
        self.outputs = outputs

    def view(self, model_id: str) -> str:
        """One top-level widget view: its static drawing inside a frame that says it needs a kernel."""
        return (f'<div class="book-widget">{self.draw(model_id)}<div class="book-widget-note">Interactive in a '
                "running notebook: here the controls keep the state they had when the book was built.</div></div>")

    def draw(self, model_id: str) -> str:
        model = self.models.get(model_id.removeprefix(REF))
        if model is None:
            return f'<div class="book-widget-missing">a widget with no saved state ({html.escape(model_id)})</div>'
        name, state = model["model_name"], model["state"]
        inner = self._inner(name, state)
        classes = " ".join(["book-w", f"book-{name.removesuffix('Model').lower()}", *state.get("_dom_classes", [])])
        return f'<div class="{html.escape(classes)}" style="{self._style(state)}">{inner}</div>'

    def _inner(self, name: str, state: dict[str, Any]) -> str:
        label = _label(state)
        if name in _BOXES:
            return f'<div class="book-box book-{_BOXES[name]}">{self._children(state)}</div>'
        if name in _PAGES:
            titles = state.get("titles") or state.get("_titles", {})
            titles = titles if isinstance(titles, list) else [titles.get(str(i), "") for i in range(99)]
            kids = [ref for ref in state.get("children", [])]
            return "".join(f'<div class="book-page-title">{html.escape(str(titles[i]) if i < len(titles) else "")}'
                           f"</div>{self.draw(ref)}" for i, ref in enumerate(kids))
        if name == "OutputModel":
            return self.outputs(state.get("outputs", []))
        if name in ("HTMLModel", "HTMLMathModel"):
            return label + str(state.get("value", ""))
        if name == "LabelModel":
            return html.escape(str(state.get("value", "")))
        if name in _SLIDERS:
            return label + _slider(name, state)
        if name in _CHOICES:
            return label + _choice(name, state)
        if name in _TEXTS:
            return label + f'<input type="text" disabled value="{html.escape(str(state.get("value", "")))}">'
        if name in ("ButtonModel", "ToggleButtonModel"):
            active = " book-active" if state.get("value") else ""
            return f'<button disabled class="book-button{active}">{html.escape(state.get("description", ""))}</button>'
        if name == "CheckboxModel":
            checked = " checked" if state.get("value") else ""
            text = html.escape(state.get("description", ""))
            return f'<label><input type="checkbox" disabled{checked}> {text}</label>'
        if name in ("IntProgressModel", "FloatProgressModel"):
            return label + (f'<progress max="{state.get("max", 100) - state.get("min", 0)}" '
                            f'value="{state.get("value", 0) - state.get("min", 0)}"></progress>')
        if name == "AnyModel" and "_widget_data" in state:  # plotly's FigureWidget (an anywidget)
            return self.outputs([{"output_type": "display_data", "data": {
                "application/vnd.plotly.v1+json": {"data": state["_widget_data"], "layout": state["_widget_layout"]}}}])
        kind = html.escape(name.removesuffix("Model"))
        return f'<div class="book-widget-missing">{kind} (drawn only in a running notebook)</div>'

    def _children(self, state: dict[str, Any]) -> str:
        return "".join(self.draw(ref) for ref in state.get("children", []))

    def _style(self, state: dict[str, Any]) -> str:
        layout = self.models.get(str(state.get("layout", "")).removeprefix(REF), {}).get("state", {})
        rules = [f"{key.replace('_', '-')}: {layout[key]}" for key in _LAYOUT_KEYS if layout.get(key)]
        if layout.get("visibility") == "hidden":
            rules.append("visibility: hidden")
        return html.escape("; ".join(rules))


def _label(state: dict[str, Any]) -> str:
    text = state.get("description", "")
    return f'<span class="book-label">{html.escape(text)}</span>' if text else ""


def _slider(name: str, state: dict[str, Any]) -> str:
    """A disabled range input at the value (the lower end of a range) and the value as text."""
    if name.startswith("Selection"):
        options = state.get("_options_labels", [])
        index = state.get("index", 0)
        lo, hi = (index, index) if isinstance(index, int) else tuple(index)
        text = options[lo] if lo == hi else f"{options[lo]} – {options[hi]}"
        low, high, step, at = 0, max(len(options) - 1, 0), 1, lo
    else:
        value = state.get("value", 0)
        lo, hi = (value, value) if not isinstance(value, list) else tuple(value)
        text = _number(lo) if lo == hi else f"{_number(lo)} – {_number(hi)}"
        low, high, step, at = state.get("min", 0), state.get("max", 100), state.get("step", 1), lo
        if name == "FloatLogSliderModel":
            text = _number(state.get("base", 10) ** value)
    return (f'<input type="range" disabled min="{low}" max="{high}" step="{step or "any"}" value="{at}">'
            f'<span class="book-readout">{html.escape(str(text))}</span>')


def _choice(name: str, state: dict[str, Any]) -> str:
    """Dropdowns as a disabled select; toggle and radio buttons as a row with the chosen one marked."""
    options = state.get("_options_labels", [])
    index = state.get("index")
    chosen = set(index) if isinstance(index, list) else {index}
    if name in ("ToggleButtonsModel", "RadioButtonsModel"):
        return "".join(f'<button disabled class="book-button{" book-active" if i in chosen else ""}">'
                       f"{html.escape(str(o))}</button>" for i, o in enumerate(options))
    items = "".join(f'<option{" selected" if i in chosen else ""}>{html.escape(str(o))}</option>'
                    for i, o in enumerate(options))
    return f"<select disabled>{items}</select>"


def _number(x: Any) -> str:
    return f"{x:.4g}" if isinstance(x, float) else str(x)


def _with_buffers(model: dict[str, Any]) -> dict[str, Any]:
    """Put a model's binary buffers (saved apart, base64) back into its state.

    plotly's FigureWidget sends numpy arrays as {"dtype": "float64", "shape": [...], "buffer": bytes}; they
    become plotly.js typed arrays, {"dtype": "f8", "bdata": base64, "shape": "rows, cols"}.
    """
    buffers = model.get("buffers") or []
    if not buffers:
        return model
    state = _copy(model["state"])
    for buf in buffers:
        *path, last = buf["path"]
        parent = state
        for key in path:
            parent = parent[key]
        data = buf["data"] if buf.get("encoding") == "base64" else base64.b64encode(buf["data"].encode()).decode()
        if isinstance(parent, dict) and {"dtype", "shape"} <= parent.keys():
            shape = parent.pop("shape")
            parent.pop(last, None)
            parent["dtype"] = np.dtype(parent["dtype"]).str[1:]
            parent["bdata"] = data
            if len(shape) > 1:
                parent["shape"] = ", ".join(str(n) for n in shape)
        else:
            parent[last] = data
    return {**model, "state": state}


def _copy(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _copy(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_copy(v) for v in x]
    return x
