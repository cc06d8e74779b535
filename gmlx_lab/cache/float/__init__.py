"""Microscaling floats (mxfp4, nvfp4, mxfp8), optionally rotated: the cache (cache.py) and its registry entry
(scheme.py)."""

from .cache import FORMATS, FloatCache, float_format
from .scheme import SCHEME

__all__ = ["FORMATS", "FloatCache", "SCHEME", "float_format"]
