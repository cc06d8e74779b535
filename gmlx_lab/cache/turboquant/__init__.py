"""TurboQuant (Zandieh et al., arXiv 2504.19874): the cache and its codebooks (cache.py), its registry entry
(scheme.py)."""

from .cache import TURBOQUANT_BITS, TurboQuantCache, gaussian_codebook, pack_bits, unpack_bits
from .scheme import SCHEME

__all__ = ["SCHEME", "TURBOQUANT_BITS", "TurboQuantCache", "gaussian_codebook", "pack_bits", "unpack_bits"]
