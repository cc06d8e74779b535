"""gmlx_lab: learn, see and measure KV-cache quantization (fp16, affine, kvarn) on MLX."""

__version__ = "0.1.0"

from . import schemes  # noqa: F401  (registers the built-in schemes)
from .cache import AffineCache, BlockCache, BlockScheme, FP16Cache, KVarNCache
from .fidelity import audit, fidelity, parse_scheme_spec
from .models import available_models, load
from .policy import Policy, PromptCache, make_cache, policy
from .registry import SCHEMES, Option, Scheme, get_scheme, register_scheme

__all__ = [
    "SCHEMES", "AffineCache", "BlockCache", "BlockScheme", "FP16Cache", "KVarNCache", "Option", "Policy",
    "PromptCache", "Scheme", "audit", "available_models", "fidelity", "get_scheme", "load", "make_cache",
    "parse_scheme_spec", "policy", "register_scheme",
]
