"""KIVI (Liu et al., arXiv 2402.02750): K per channel, V per token, an fp16 recent window: the cache (cache.py) and its
registry entry (scheme.py)."""

from .cache import KIVI_BITS, KiviCache
from .scheme import SCHEME

__all__ = ["KIVI_BITS", "KiviCache", "SCHEME"]
