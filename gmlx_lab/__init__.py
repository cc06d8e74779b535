"""gmlx_lab: learn, see and measure KV-cache quantization (fp16, affine, kvarn, TurboQuant, mxfp4/nvfp4/mxfp8,
KIVI) on MLX.

The package's tiers (which module imports which) are drawn once, in CONTRIBUTING.md ("The house in one picture");
tests/test_layout.py holds them.
"""

__version__ = "0.1.0"

from . import mlx_lm_hooks
from .cache import AffineCache, AffineRotCache, BlockCache, BlockScheme, FP16Cache, KvarnCache
from .cache.saved import SavedCacheError, load_prompt_cache
from .kernels import MAX_QUERY_TOKENS
from .measure import experiments, memory, metrics, tradeoff  # noqa: F401  (gmlx_lab.tradeoff.versus, ...)
from .measure.audit import audit
from .measure.fidelity import fidelity
from .measure.planner import plan
from .models import available_models, load
from .plans import Plan, load_plan
from .policy import Policy, PromptCache, make_cache, policy
from .registry import SCHEMES, Option, Scheme, get_scheme, register_scheme
from .specs import parse_scheme_spec

# mlx-lm's attention routes to a cache's own `attend` (the one change gmlx_lab makes there)
mlx_lm_hooks.install(prompt_queries=MAX_QUERY_TOKENS)

__all__ = [
    "SCHEMES", "AffineCache", "AffineRotCache", "BlockCache", "BlockScheme", "FP16Cache", "KvarnCache", "Option",
    "Plan", "Policy", "PromptCache", "Scheme", "audit", "available_models", "fidelity", "get_scheme", "load",
    "load_plan", "make_cache", "plan",
    "SavedCacheError", "load_prompt_cache", "parse_scheme_spec", "policy", "register_scheme",
]
