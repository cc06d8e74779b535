"""The kivi scheme: K per channel, V per token, an fp16 recent window (Liu et al., arXiv 2402.02750).

The cache is `cache.py` beside this module, on the block base, which derives the byte formula, the policy rule and
the audit, and holds the options; this module names the label. Notebook 09 builds its own `my_kivi` to teach the
block base.
What it rotates, scales and keeps fp16, and its bytes per token: docs/field.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...registry import register_scheme
from ..block import BlockScheme
from ..options import with_sink
from .cache import KiviCache


@dataclass(frozen=True)
class KiviScheme(BlockScheme):
    """K and V widths apart (`kivi:k2v4`), like kvarn's; the options are the class's (KiviCache.OPTIONS)."""

    def label(self, values: dict[str, Any]) -> str:
        """`kivi2 tail=128`, `kivi k2v4 tail=128 sink=4`."""
        return with_sink(super().label(values), values)


SCHEME = register_scheme(KiviScheme(
    "kivi", "KIVI: K per channel over blocks of 32 tokens, V per token in groups of 32 channels, fp16 recent window",
    cache_class=KiviCache, color="#8c564b"))
