"""The affine schemes: mlx-lm's grouped N-bit quantization of each token's K/V row, and the same after a
per-head Hadamard rotation (affine_rot, llama.cpp's attention rotation: llama.cpp Hadamard-rotates Q/K/V for
every quantized KV cache type by default since April 2026, PR 21038, so affine_rot is that baseline). The cache
is `cache/affine.py`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from ..cache.affine import AffineCache
from ..registry import AFFINE_BITS, GROUP_SIZES, Option, Scheme, register_scheme

OPTIONS = (
    Option("bits", 8, "code width in bits", AFFINE_BITS),
    Option("group_size", 64, "values per group sharing one fp16 scale and offset", GROUP_SIZES),
    Option("quantized_kv_start", 0, "keep fp16 until the context reaches this many tokens"),
)


@dataclass(frozen=True)
class AffineScheme(Scheme):
    """Per-token groups of `group_size` values, each with an fp16 scale and offset; optionally rotated first."""

    rotate: bool = False

    def make_cache(self, options: dict[str, Any], layer: int | None = None) -> AffineCache:
        return AffineCache(options["bits"], options["group_size"], options["quantized_kv_start"],
                           rotate=self.rotate, layer=layer)

    def label(self, values: dict[str, Any]) -> str:
        return f"{self.name}{values['bits']} g{values['group_size']}"

    def declines(self, kind: str, k_dim: int, v_dim: int, options: dict[str, Any]) -> str | None:
        """A row must split into whole groups."""
        g = options["group_size"]
        for d in sorted({k_dim, v_dim}):
            if d % g:
                return f"head_dim {d} is not a multiple of group_size {g}"
        return None

    def layer_bytes(self, tokens: int, kv_heads: int, k_dim: int, v_dim: int, options: dict[str, Any]) -> float:
        """bits/8 bytes per value plus an fp16 scale and offset (4 bytes) per group."""
        return kv_heads * tokens * (k_dim + v_dim) * (options["bits"] / 8 + 4 / options["group_size"])

    def audit(self, cache: AffineCache, options: dict[str, Any]) -> tuple[str, bool]:
        if cache.k_bits != options["bits"]:
            return f"bits {cache.k_bits}, policy says {options['bits']}", False
        quantized_now = cache.offset > 0 and cache.offset >= cache.quantized_kv_start
        if quantized_now and cache.regions().get("codes", 0) == 0:
            return f"{cache.offset} tokens past quantized_kv_start but no codes stored", True
        return "", quantized_now

    def roundtrip(self, x: np.ndarray, kind: str, options: dict[str, Any]) -> np.ndarray:
        """mx.quantize and mx.dequantize of fp16 rows, between two rotations for affine_rot."""
        x = _hadamard(x) if self.rotate else np.asarray(x, np.float32)
        a = mx.array(x, dtype=mx.float32).astype(mx.float16)
        bits, group_size = options["bits"], options["group_size"]
        w, s, b = mx.quantize(a, group_size=group_size, bits=bits)
        out = np.array(mx.dequantize(w, s, b, group_size=group_size, bits=bits).astype(mx.float32))
        return _hadamard(out) if self.rotate else out


def _hadamard(x: np.ndarray) -> np.ndarray:
    return np.array(mx.hadamard_transform(mx.array(x, dtype=mx.float32)))


AFFINE = register_scheme(AffineScheme(
    "affine", "mlx-lm's grouped affine quantization of each token's K/V row (--kv-bits)", OPTIONS,
    cache_class=AffineCache, color="#1f77b4"))
AFFINE_ROT = register_scheme(AffineScheme(
    "affine_rot", "affine after a per-head Hadamard rotation (llama.cpp's default for quantized KV since "
    "April 2026, PR 21038)", OPTIONS,
    cache_class=AffineCache, color="#17becf", rotate=True))
