"""The kivi scheme: K per channel, V per token, an fp16 recent window (Liu et al., arXiv 2402.02750).

The cache is `cache.py` beside this module, on the block base, which derives the byte formula, the policy rule and
the audit; this module names the options and the label. Notebook 09 builds its own `my_kivi` to teach the block base.
What it rotates, scales and keeps fp16, and its bytes per token: docs/field.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...registry import Option, register_scheme
from ..block import BlockScheme
from ..options import split_widths, with_sink
from .cache import KIVI_BITS, KiviCache

OPTIONS = (
    Option("bits", 2, "code width for K and V", KIVI_BITS),
    Option("k_bits", None, "code width for K (default: bits)", KIVI_BITS),
    Option("v_bits", None, "code width for V (default: bits)", KIVI_BITS),
    Option("kv_tail_tokens", 128, "newest tokens kept fp16 (HF's residual_length)"),
    Option("sink_tokens", 0, "first tokens kept fp16"),
)


@dataclass(frozen=True)
class KiviScheme(BlockScheme):
    """K and V widths apart (`kivi:k2v4`), like kvarn's."""

    def adjust(self, values: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
        return split_widths(values, given)

    def label(self, values: dict[str, Any]) -> str:
        """`kivi2 tail=128`, `kivi k2v4 tail=128 sink=4`."""
        return with_sink(super().label(values), values)


SCHEME = register_scheme(KiviScheme(
    "kivi", "KIVI: K per channel over blocks of 32 tokens, V per token in groups of 32 channels, fp16 recent window",
    OPTIONS, cache_class=KiviCache, color="#8c564b"))
