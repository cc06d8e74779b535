"""gmlx_lab: learn, see and measure KV-cache quantization (fp16, affine, kvarn) on MLX."""

__version__ = "0.1.0"

from .cache import AffineCache, FP16Cache, KVarNCache
from .fidelity import audit, fidelity, parse_scheme_spec
from .models import available_models, load
from .policy import Policy, PromptCache, make_cache, policy
from .registry import SCHEMES, get_scheme

__all__ = [
    "SCHEMES", "AffineCache", "FP16Cache", "KVarNCache", "Policy", "PromptCache",
    "audit", "available_models", "fidelity", "get_scheme", "load", "make_cache", "parse_scheme_spec", "policy",
]
