"""The float scheme: K/V rows as microscaling floats (mxfp4, nvfp4, mxfp8), optionally Hadamard-rotated first.

The format is the pair (bits, group_size) that `mx.quantize` accepts for it (cache.py beside this module); specs may
name it ("mxfp4", "nvfp4_rot", "mxfp8") or spell it out ("float4:g=16,rot=1"). The block base derives the byte formula,
the policy rule and the audit. What it rotates, scales and keeps fp16, and its bytes per token: docs/field.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...registry import register_scheme
from ..block import BlockScheme
from ..options import with_sink
from .cache import FORMATS, FloatCache, float_format


@dataclass(frozen=True)
class FloatScheme(BlockScheme):
    """One scheme, three formats: the label names the format; the options are the class's (FloatCache.OPTIONS)."""

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
    cache_class=FloatCache, color="#e377c2"))
