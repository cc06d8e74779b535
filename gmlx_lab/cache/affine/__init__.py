"""mlx-lm's grouped affine quantization, and the same after a Hadamard rotation (affine_rot): the caches (cache.py)
and their registry entries (scheme.py)."""

from .cache import AFFINE_BITS, GROUP_SIZES, AffineCache, AffineRotCache, group_problem
from .scheme import AFFINE, AFFINE_ROT

__all__ = ["AFFINE", "AFFINE_BITS", "AFFINE_ROT", "GROUP_SIZES", "AffineCache", "AffineRotCache", "group_problem"]
