"""The float scheme: K/V rows as microscaling floats (mxfp4, nvfp4, mxfp8), optionally Hadamard-rotated first.

The format is the pair (bits, group_size) that `mx.quantize` accepts for it (cache.py beside this module); specs may
name it ("mxfp4", "nvfp4_rot", "mxfp8") or spell it out ("float4:g=16,rot=1"). The block base derives the byte formula,
the policy rule and the audit. What it rotates, scales and keeps fp16, and its bytes per token: docs/field.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...registry import Option, register_scheme
from ..block import BlockScheme
from ..options import with_sink
from .cache import FORMATS, FloatCache, float_format

OPTIONS = (
    Option("bits", 4, "value width: 4 (E2M1) or 8 (E4M3)", (4, 8)),
    Option("group_size", 32, "values sharing one 8-bit scale: 32 (mxfp4, mxfp8) or 16 (nvfp4)", (16, 32)),
    Option("rotation", 0, "1: a per-head Hadamard rotation first (as affine_rot)", (0, 1)),
    Option("kv_tail_tokens", 0, "newest tokens kept fp16"),
    Option("sink_tokens", 0, "first tokens kept fp16"),
)


@dataclass(frozen=True)
class FloatScheme(BlockScheme):
    """One scheme, three formats: the label names the format."""

    def adjust(self, values: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
        """nvfp4 is named by its group size alone: `float:g=16` means 4-bit values."""
        if given.get("group_size") == 16 and given.get("bits") is None:
            values = {**values, "bits": 4}
        if values["bits"] in (4, 8) and values["group_size"] in (16, 32):  # (else the option's own check says)
            float_format(values["bits"], values["group_size"])  # a pair that is no format: say which are
        return values

    def label(self, values: dict[str, Any]) -> str:
        """`mxfp4`, `nvfp4_rot`, `mxfp8 tail=128 sink=4`."""
        label = float_format(values["bits"], values["group_size"]) + ("_rot" if values["rotation"] else "")
        label += f" tail={values['kv_tail_tokens']}" if values["kv_tail_tokens"] else ""
        return with_sink(label, values)

    def spec_words(self) -> dict[str, dict[str, Any]]:
        """mxfp4, nvfp4, mxfp8 and their _rot twins."""
        return {name + rot: {"bits": b, "group_size": g, "rotation": int(bool(rot))}
                for (b, g), name in FORMATS.items() for rot in ("", "_rot")}


SCHEME = register_scheme(FloatScheme(
    "float", "microscaling floats per token (mxfp4, nvfp4, mxfp8 via mx.quantize), Hadamard rotation optional",
    OPTIONS, cache_class=FloatCache, color="#e377c2"))
