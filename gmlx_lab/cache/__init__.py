"""gmlx_lab's KV caches: fp16, affine, kvarn and the block base, each a drop-in for mlx-lm's cache contract.

Which scheme builds which cache is the registry's business (`gmlx_lab/schemes/`), not this package's; how
mlx-lm models reach a cache's own `attend`, and how `load_prompt_cache` finds the classes, is
gmlx_lab/mlx_lm_hooks.py.
"""

from __future__ import annotations

from .affine import AffineCache, AffineRotCache
from .base import GmlxCache
from .block import BlockCache, BlockScheme
from .fp16 import FP16Cache
from .kvarn import KVarNCache

__all__ = ["AffineCache", "AffineRotCache", "BlockCache", "BlockScheme", "FP16Cache", "GmlxCache", "KVarNCache"]
