"""A plan: one scheme's code widths chosen layer by layer (K and V apart where the scheme stores them apart).

`gmlx_lab.measure.planner.plan` makes one from measured sensitivities under a memory budget; `make_cache(model,
plan=...)` builds its caches; `Plan.save`/`load_plan` keep it as JSON (what `gmlx-lab plan --out` writes). A layer
the plan keeps fp16 has no widths. The widths a scheme offers are its width options' accepted values: `k_bits` and
`v_bits` where it has both (kvarn, turboquant, kivi), else `bits` (affine: its kernel reads K and V at one width).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .registry import Scheme, get_scheme

PLAN_VERSION = 1


def width_names(scheme: Scheme) -> tuple[str, ...]:
    """The options a plan sets per layer: ("k_bits", "v_bits") where the scheme has both, else ("bits",)."""
    names = {opt.name for opt in scheme.options}
    if {"k_bits", "v_bits"} <= names:
        return ("k_bits", "v_bits")
    if "bits" in names and scheme.option("bits").choices:
        return ("bits",)
    raise ValueError(f"{scheme.name} has no width option to plan (a plan sets k_bits/v_bits or bits per layer)")


def width_choices(scheme: Scheme) -> tuple[int, ...]:
    """The widths a plan may give one of the scheme's width options, narrowest first."""
    return tuple(sorted(scheme.option(width_names(scheme)[0]).choices))


def widths_label(widths: dict[str, int] | None) -> str:
    """'K4 V3', '4-bit' or 'fp16': one layer's widths as the figures and the [kv] line write them."""
    if widths is None:
        return "fp16"
    if "bits" in widths:
        return f"{widths['bits']}-bit"
    return f"K{widths['k_bits']} V{widths['v_bits']}"


@dataclass(frozen=True)
class Plan:
    """Per-layer widths of `scheme` for one model, with the memory budget and context they were chosen for.

    `widths` maps every layer the plan decides to its widths ({"k_bits": 4, "v_bits": 3} or {"bits": 4}), or
    None where it keeps the layer fp16; `options` are the scheme's other options (the tail, ...), `overrides`
    the policy overrides it was made under (`quantize_last`, ...); `report` says how it was chosen and measured.
    """

    model: str
    scheme: str
    options: dict[str, Any]
    widths: dict[int, dict[str, int] | None]
    context: int
    budget: float
    overrides: dict[str, Any] = field(default_factory=dict)
    report: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        """e.g. 'kvarn plan 50% tail=1024': the scheme, the budget as a share of fp16's bytes, the fp16 tail; ' K=V'
        where the plan kept one width for K and V a layer though the scheme stores them apart."""
        tail = self.options.get("kv_tail_tokens")
        return (f"{self.scheme} plan {100 * self.budget:.0f}%" + ("" if tail is None else f" tail={tail}")
                + (" K=V" if self.report.get("tied") else ""))

    def to_dict(self) -> dict[str, Any]:
        return {"version": PLAN_VERSION, "model": self.model, "scheme": self.scheme, "options": self.options,
                "widths": {str(k): v for k, v in sorted(self.widths.items())}, "context": self.context,
                "budget": self.budget, "overrides": self.overrides, "report": self.report}

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        return path

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "plan") -> Plan:
        """A plan from its JSON form, checked: the version, the scheme, and every layer's widths."""
        if not isinstance(data, dict) or data.get("version") != PLAN_VERSION:
            found = data.get("version") if isinstance(data, dict) else type(data).__name__
            raise ValueError(f"{where}: not a gmlx_lab plan of version {PLAN_VERSION} (found {found!r}); "
                             "make one with gmlx_lab.plan(...) or `gmlx-lab plan`")
        missing = [k for k in ("model", "scheme", "options", "widths", "context", "budget") if k not in data]
        if missing:
            raise ValueError(f"{where}: the plan lacks {', '.join(missing)}")
        scheme = get_scheme(data["scheme"])
        names = width_names(scheme)
        widths: dict[int, dict[str, int] | None] = {}
        for key, value in data["widths"].items():
            if not str(key).isdigit():
                raise ValueError(f"{where}: layer {key!r} is not a layer index")
            if value is not None and (not isinstance(value, dict) or set(value) != set(names)):
                raise ValueError(f"{where}: layer {key} has widths {value!r}; accepted: null (fp16) or "
                                 f"{{{', '.join(repr(n) + ': width' for n in names)}}}")
            widths[int(key)] = None if value is None else {n: int(value[n]) for n in names}
        return cls(str(data["model"]), scheme.name, dict(data["options"]), widths, int(data["context"]),
                   float(data["budget"]), dict(data.get("overrides", {})), dict(data.get("report", {})))


def load_plan(source: Plan | dict[str, Any] | str | Path) -> Plan:
    """A Plan from a Plan, its dict, or the path of its JSON file."""
    if isinstance(source, Plan):
        return source
    if isinstance(source, dict):
        return Plan.from_dict(source)
    if isinstance(source, (str, Path)):
        path = Path(source)
        if not path.is_file():
            raise FileNotFoundError(f"no plan file {path}; make one with `gmlx-lab plan --out {path.name}`")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: not JSON ({err})") from None
        return Plan.from_dict(data, str(path))
    raise TypeError(f"a plan is a Plan, its dict or a JSON file's path, got {type(source).__name__}")
