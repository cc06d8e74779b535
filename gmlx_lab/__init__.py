"""gmlx_lab: learn, see and measure KV-cache quantization (fp16, affine, kvarn) on MLX.

Tiers, lowest first (a module imports only from its own tier or below; tests/test_layout.py finds circles):
  records, window            kvarn's format and the rolling window's rule (no cache class)
  kernels                    the fused GPU kernels: arrays in, arrays out
  registry, cache            the Scheme interface; the caches (mlx-lm's cache contract), one folder a built-in scheme
                             (cache/<name>/: its cache and its registry entry; importing gmlx_lab.cache registers them)
  policy, specs, plans       which layers a scheme takes; the spec grammar ("kvarn6:tail=128"); per-layer widths
  measure                    fidelity, audit, memory, sizes, tradeoff, experiments, the verdict, the planner
  viz, widgets, live, cli    figures, notebook widgets, the command line
"""

__version__ = "0.1.0"

from . import mlx_lm_hooks
from .cache import AffineCache, AffineRotCache, BlockCache, BlockScheme, FP16Cache, KVarNCache
from .cache.saved import SavedCacheError, load_prompt_cache
from .measure import experiments, memory, metrics, tradeoff  # noqa: F401  (gmlx_lab.tradeoff.versus, ...)
from .measure.audit import audit
from .measure.fidelity import fidelity
from .measure.planner import plan
from .models import available_models, load
from .plans import Plan, load_plan
from .policy import Policy, PromptCache, make_cache, policy
from .registry import SCHEMES, Option, Scheme, get_scheme, register_scheme
from .specs import parse_scheme_spec

mlx_lm_hooks.install()  # mlx-lm's attention routes to a cache's own `attend` (the one change gmlx_lab makes there)

__all__ = [
    "SCHEMES", "AffineCache", "AffineRotCache", "BlockCache", "BlockScheme", "FP16Cache", "KVarNCache", "Option",
    "Plan", "Policy", "PromptCache", "Scheme", "audit", "available_models", "fidelity", "get_scheme", "load",
    "load_plan", "make_cache", "plan",
    "SavedCacheError", "load_prompt_cache", "parse_scheme_spec", "policy", "register_scheme",
]
