"""The turboquant scheme: randomized Hadamard rotation, Lloyd-Max codes per coordinate, fp16 norms, optional QJL
residual for K (Zandieh et al., arXiv 2504.19874). The cache is `cache.py` beside this module, on the block base.

vLLM's presets in this lab's spec grammar: turboquant_k8v4 -> `turboquant:k8v4`, turboquant_4bit_nc ->
`turboquant4`, turboquant_k3v4_nc (3.5 bits a value) -> `turboquant:k3v4`, turboquant_3bit_nc -> `turboquant3`.
What it rotates, scales and keeps fp16, and its bytes per token: docs/field.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...registry import Option, register_scheme
from ..block import BlockScheme
from ..options import split_widths, with_sink
from .cache import TURBOQUANT_BITS, TurboQuantCache

OPTIONS = (
    Option("bits", 4, "code width for K and V", TURBOQUANT_BITS),
    Option("k_bits", None, "code width for K (default: bits)", TURBOQUANT_BITS),
    Option("v_bits", None, "code width for V (default: bits)", TURBOQUANT_BITS),
    Option("qjl", 0, "1: K spends one bit on the QJL sign sketch of its residual (unbiased q.k)", (0, 1)),
    Option("kv_tail_tokens", 0, "newest tokens kept fp16"),
    Option("sink_tokens", 0, "first tokens kept fp16"),
    Option("seed", 0, "seed of the rotation's signs and of the QJL projection"),
)


@dataclass(frozen=True)
class TurboQuantScheme(BlockScheme):
    """K and V widths apart, as vLLM's presets (`turboquant:k3v4` is 3.5 bits a value)."""

    def adjust(self, values: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
        return split_widths(values, given)

    def label(self, values: dict[str, Any]) -> str:
        """`turboquant4`, `turboquant k3v4 qjl tail=128 sink=4` (the tail only when there is one)."""
        label = self.name + (f"{values['k_bits']}" if values["k_bits"] == values["v_bits"]
                             else f" k{values['k_bits']}v{values['v_bits']}")
        label += " qjl" if values["qjl"] else ""
        label += f" tail={values['kv_tail_tokens']}" if values["kv_tail_tokens"] else ""
        return with_sink(label, values)


SCHEME = register_scheme(TurboQuantScheme(
    "turboquant", "TurboQuant: randomized Hadamard rotation, Lloyd-Max codes per coordinate, fp16 norms, "
    "optional QJL residual for K", OPTIONS, cache_class=TurboQuantCache, color="#d62728"))
