"""The turboquant scheme: randomized Hadamard rotation, Lloyd-Max codes per coordinate, fp16 norms, optional QJL
residual for K (Zandieh et al., arXiv 2504.19874). The cache is `cache.py` beside this module, on the block base.

vLLM's presets in this lab's spec grammar: turboquant_k8v4 -> `turboquant:k8v4`, turboquant_4bit_nc ->
`turboquant4`, turboquant_k3v4_nc (3.5 bits a value) -> `turboquant:k3v4`, turboquant_3bit_nc -> `turboquant3`.
What it rotates, scales and keeps fp16, and its bytes per token: docs/field.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...registry import register_scheme
from ..block import BlockScheme
from ..options import with_sink
from .cache import TurboQuantCache


@dataclass(frozen=True)
class TurboQuantScheme(BlockScheme):
    """K and V widths apart, as vLLM's presets (`turboquant:k3v4` is 3.5 bits a value); the options are the
    class's (TurboQuantCache.OPTIONS)."""

    def label(self, values: dict[str, Any]) -> str:
        """`turboquant4`, `turboquant k3v4 qjl tail=128 sink=4` (the tail only when there is one)."""
        label = self.name + (f"{values['k_bits']}" if values["k_bits"] == values["v_bits"]
                             else f" k{values['k_bits']}v{values['v_bits']}")
        label += " qjl" if values["qjl"] else ""
        label += f" tail={values['kv_tail_tokens']}" if values["kv_tail_tokens"] else ""
        return with_sink(label, values)


SCHEME = register_scheme(TurboQuantScheme(
    "turboquant", "TurboQuant: randomized Hadamard rotation, Lloyd-Max codes per coordinate, fp16 norms, "
    "optional QJL residual for K", cache_class=TurboQuantCache, color="#d62728"))
