"""gmlx_lab's KV caches: fp16, affine, kvarn and the block base, each a drop-in for mlx-lm's cache contract.

Importing this package (1) routes mlx-lm's attention to a cache's own `attend`
when it has one (see `attention.py`) and (2) registers the classes with
`mlx_lm.models.cache`, whose `load_prompt_cache` finds cache classes by name there
(`gmlx_lab.register_scheme` does the same for a plug-in's class). Which scheme builds which
cache is the registry's business (`gmlx_lab/schemes/`), not this package's.
"""

from __future__ import annotations

import mlx_lm.models.cache as mlx_cache

from . import attention
from .affine import AffineCache
from .base import GmlxCache
from .block import BlockCache, BlockScheme
from .fp16 import FP16Cache
from .kvarn import KVarNCache

__all__ = ["AffineCache", "BlockCache", "BlockScheme", "FP16Cache", "GmlxCache", "KVarNCache"]

for _cls in (FP16Cache, AffineCache, KVarNCache):
    setattr(mlx_cache, _cls.__name__, _cls)
attention.install()

