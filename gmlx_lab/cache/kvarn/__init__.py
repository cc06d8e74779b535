"""kvarn: Hadamard rotation and variance-normalized 128-token records with an fp16 sink and tail: the cache (cache.py)
and its registry entry (scheme.py); the record format is gmlx_lab/records.py."""

from .cache import KVarNCache
from .scheme import KVARN_BITS_ENV, SCHEME, parse_kvarn_bits

__all__ = ["KVARN_BITS_ENV", "KVarNCache", "SCHEME", "parse_kvarn_bits"]
