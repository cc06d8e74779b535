"""gmlx_lab's KV caches: fp16, affine and kvarn, each a drop-in for mlx-lm's cache contract.

Importing this package (1) routes mlx-lm's attention to a cache's own `attend`
when it has one (see `attention.py`) and (2) registers the classes with
`mlx_lm.models.cache`, whose `load_prompt_cache` finds cache classes by name there.
"""

from __future__ import annotations

from typing import Any

import mlx_lm.models.cache as mlx_cache

from . import attention
from .affine import AffineCache
from .base import GmlxCache
from .fp16 import FP16Cache
from .kvarn import KVarNCache

__all__ = ["AffineCache", "FP16Cache", "GmlxCache", "KVarNCache", "layer_cache"]

for _cls in (FP16Cache, AffineCache, KVarNCache):
    setattr(mlx_cache, _cls.__name__, _cls)
attention.install()


def layer_cache(scheme: str, options: dict[str, Any], layer: int | None = None) -> GmlxCache:
    """One layer's cache for a scheme, from options already resolved by the registry."""
    if scheme == "fp16":
        return FP16Cache(layer=layer)
    if scheme in ("affine", "affine_rot"):
        return AffineCache(
            options["bits"], options["group_size"], options["quantized_kv_start"],
            rotate=scheme == "affine_rot", layer=layer,
        )
    if scheme == "kvarn":
        return KVarNCache(options["k_bits"], options["v_bits"], options["kv_tail_tokens"], options["norm_iters"],
                          layer=layer, head_dim_ext=options.get("head_dim_ext", 0))
    raise ValueError(f"unknown scheme {scheme!r}; accepted: fp16, affine, affine_rot, kvarn")
