"""Option rules and label pieces the field's schemes (turboquant, float, kivi) share; registers nothing."""

from __future__ import annotations

from typing import Any


def split_widths(values: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    """K and V widths: `k_bits`/`v_bits` where given, else `bits`."""
    return {**values, **{name: given.get(name) if given.get(name) is not None else values["bits"]
                         for name in ("k_bits", "v_bits")}}


def with_sink(label: str, values: dict[str, Any]) -> str:
    """A label with the fp16 sink named when there is one."""
    return label + (f" sink={values['sink_tokens']}" if values.get("sink_tokens") else "")
