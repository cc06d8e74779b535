"""The affine schemes: mlx-lm's grouped N-bit quantization of each token's K/V row, and the same after a per-head
Hadamard rotation (affine_rot, llama.cpp's attention rotation: llama.cpp Hadamard-rotates Q/K/V for every quantized KV
cache type by default since April 2026, PR 21038, so affine_rot is that baseline). The caches are in `cache.py` beside
this module, on the block base: the byte formula, the roundtrip and the audit come from the class (BlockScheme), as for
a plug-in, and the options are the cache's (AffineCache.OPTIONS); this module names the label and the policy rule."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...registry import register_scheme
from ..block import BlockScheme
from .cache import AffineCache, AffineRotCache


@dataclass(frozen=True)
class AffineScheme(BlockScheme):
    """Per-token groups of `group_size` values, each with an fp16 scale and offset; affine_rot rotates first."""

    def label(self, values: dict[str, Any]) -> str:
        return f"{self.name}{values['bits']} g{values['group_size']}"

    def declines(self, kind: str, k_dim: int, v_dim: int, options: dict[str, Any]) -> str | None:
        """A row must split into whole groups; affine_rot's rotation must be undoable at the head dims (the
        class's `head_dim_problem`)."""
        cache = self.cache_class(**self.cache_options(options))
        return next((p for d in sorted({k_dim, v_dim}) if (p := cache.head_dim_problem(d))), None)

    def encoded_tokens(self, cache: AffineCache) -> int:
        """None before `quantized_kv_start` tokens have arrived (fp16 until then), else every token held."""
        return super().encoded_tokens(cache) if cache.offset >= cache.quantized_kv_start else 0


AFFINE = register_scheme(AffineScheme(
    "affine", "mlx-lm's grouped affine quantization of each token's K/V row (--kv-bits)",
    cache_class=AffineCache, color="#1f77b4"))
AFFINE_ROT = register_scheme(AffineScheme(
    "affine_rot", "affine after a per-head Hadamard rotation (llama.cpp's default for quantized KV since "
    "April 2026, PR 21038)",
    cache_class=AffineRotCache, color="#17becf"))
