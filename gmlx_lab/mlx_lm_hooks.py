"""Everything gmlx_lab changes in mlx-lm, in one place; `install()` runs once, from gmlx_lab/__init__.py.

1. The attention seam. mlx-lm models call `mlx_lm.models.base.scaled_dot_product_attention(q, k, v, cache=...,
   ...)` with the K/V that `cache.update_and_fetch` just returned. Our caches return plain, decoded K/V there,
   so any model code is correct with them. `install()` wraps that function: when the K/V passed in are exactly
   the ones the cache fetched, the call goes to `cache.attend(...)` instead, which attends over the stored form
   (codes, rotation) without a decoded copy. That is where the fused GPU kernels plug in. A prompt chunk's
   attention through a cache is evaluated before the next layer is built (`settled`).
2. Cache class names. mlx-lm's `load_prompt_cache` finds a saved cache's class by name in
   `mlx_lm.models.cache`; `register_cache_class` puts a scheme's class there (`register_scheme` calls it, for
   the built-in schemes and plug-ins alike) and refuses a name another class holds.
"""

from __future__ import annotations

import sys
from typing import Any

import mlx.core as mx
import mlx_lm.models.base as mlx_base
import mlx_lm.models.cache as mlx_cache

__all__ = ["install", "register_cache_class", "scaled_dot_product_attention"]

MLX_LM_ATTENTION = mlx_base.scaled_dot_product_attention  # mlx-lm's own, before install()
PROMPT_QUERIES: int  # a call with more queries than this is a prompt chunk: set by install()


def scaled_dot_product_attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    cache: Any,
    scale: float,
    mask: Any,
    sinks: mx.array | None = None,
) -> mx.array:
    """mlx-lm's attention entry point, routed to the cache's own `attend` when it can."""
    attend = getattr(cache, "attend", None)
    if attend is not None and sinks is None and cache.fetched(keys, values):
        return settled(attend(queries, keys, values, scale=scale, mask=mask), queries)
    # Our caches hand back decoded float K/V, so never mlx-lm's quantized path, which it takes for any cache with
    # a `bits` attribute (a block scheme's options become attributes: kivi's, float's, a plug-in's `bits`).
    native = None if attend is not None else cache
    return MLX_LM_ATTENTION(queries, keys, values, cache=native, scale=scale, mask=mask, sinks=sinks)


def settled(out: mx.array, queries: mx.array) -> mx.array:
    """A prompt chunk's attention output (more queries than the fused decode kernels take), evaluated now.

    Such a chunk attends over its layer's stored K/V decoded (or a slice at a time). MLX's GPU backends keep every
    array a queued kernel reads until that kernel has run, and the host queues a chunk's layers far faster than
    the GPU runs them, so left lazy, every layer's decoded K/V and scratch would be held at once: the fp16-sized
    copy a quantized cache exists to avoid. Evaluated layer by layer, one layer's is, at the cost of the GPU
    waiting while the host builds the next layer (docs/gpu-performance.md measures both). Decode steps stay lazy."""
    if queries.shape[2] > PROMPT_QUERIES:
        mx.eval(out)
    return out


def install(prompt_queries: int) -> None:
    """Point mlx-lm's base module, and the model modules already imported, at our attention entry point;
    `prompt_queries`: the most queries a decode step has (the fused decode kernels' MAX_QUERY_TOKENS), above which
    a call is a prompt chunk. Passed in, so this module, which the caches' registry imports, imports no kernels."""
    global PROMPT_QUERIES
    PROMPT_QUERIES = prompt_queries
    mlx_base.scaled_dot_product_attention = scaled_dot_product_attention
    for name, module in list(sys.modules.items()):
        if name.startswith("mlx_lm.models.") and getattr(module, "scaled_dot_product_attention", None) is \
                MLX_LM_ATTENTION:
            module.scaled_dot_product_attention = scaled_dot_product_attention


def register_cache_class(cls: type, name: str | None = None) -> None:
    """Make `cls` findable by `load_prompt_cache` under its name (or `name`: the name files saved before a rename
    carry), or raise a ValueError if another class holds it."""
    name = name or cls.__name__
    taken = getattr(mlx_cache, name, None)
    if taken is not None and taken is not cls and not same_class(taken, cls):
        raise ValueError(f"cache class name {name!r} is taken in mlx_lm.models.cache (by "
                         f"{taken.__module__}.{taken.__qualname__}); load_prompt_cache finds classes by name "
                         "there: name your cache class differently")
    setattr(mlx_cache, name, cls)


def same_class(a: type, b: type) -> bool:
    """The same class definition (module and name), e.g. a notebook cell run again."""
    return (a.__module__, a.__qualname__) == (b.__module__, b.__qualname__)
