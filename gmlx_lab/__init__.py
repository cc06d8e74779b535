"""gmlx_lab: learn, see and measure KV-cache quantization (fp16, affine, kvarn) on MLX."""

__version__ = "0.1.0"

from .cache import AffineCache, FP16Cache, KVarNCache
from .policy import Policy, PromptCache, make_cache, policy
from .registry import SCHEMES, get_scheme

__all__ = [
    "SCHEMES", "AffineCache", "FP16Cache", "KVarNCache", "Policy", "PromptCache",
    "get_scheme", "make_cache", "policy",
]
