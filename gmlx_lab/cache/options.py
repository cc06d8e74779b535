"""Option rules and label pieces the block schemes share (K and V widths apart, an fp16 sink); registers nothing."""

from __future__ import annotations

from typing import Any

from ..registry import Option


def width_options(default: int, accepted: tuple[int, ...]) -> tuple[Option, Option, Option]:
    """`bits` for K and V, and `k_bits`/`v_bits` that override it one at a time (`split_widths` joins them)."""
    return (Option("bits", default, "code width for K and V", accepted),
            Option("k_bits", None, "code width for K (default: bits)", accepted),
            Option("v_bits", None, "code width for V (default: bits)", accepted))


def split_widths(values: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    """K and V widths: `k_bits`/`v_bits` where given, else `bits`."""
    return {**values, **{name: given.get(name) if given.get(name) is not None else values["bits"]
                         for name in ("k_bits", "v_bits")}}


def with_sink(label: str, values: dict[str, Any]) -> str:
    """A label with the fp16 sink named when there is one."""
    return label + (f" sink={values['sink_tokens']}" if values.get("sink_tokens") else "")
