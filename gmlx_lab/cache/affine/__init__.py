"""mlx-lm's grouped affine quantization, and the same after a Hadamard rotation (affine_rot): the caches (cache.py)
and their registry entries (scheme.py)."""

from .cache import AffineCache, AffineRotCache, group_problem
from .scheme import AFFINE, AFFINE_ROT

__all__ = ["AFFINE", "AFFINE_ROT", "AffineCache", "AffineRotCache", "group_problem"]
