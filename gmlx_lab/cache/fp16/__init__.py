"""The fp16 baseline: its cache (cache.py) and its registry entry (scheme.py)."""

from .cache import FP16Cache
from .scheme import SCHEME

__all__ = ["FP16Cache", "SCHEME"]
