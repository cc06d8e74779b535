"""gmlx_lab's KV caches, each a drop-in for mlx-lm's cache contract.

The shared tier is this folder's modules: the cache base (base.py), the block base every quantized scheme builds
on (block.py, checked.py), the attention math (attention.py), the fp16 stores (buffers.py), the options the field's
schemes share (options.py) and the saved-state checks (saved.py). Each built-in scheme is a folder beside them,
`<name>/` with its cache (cache.py) and its registry entry (scheme.py). Registering is importing the folders:
this package imports every one, fp16 (the baseline) first and the others by name, and that order is the registry's.
How mlx-lm models reach a cache's own `attend`, and how `load_prompt_cache` finds the classes, is
gmlx_lab/mlx_lm_hooks.py.
"""

from __future__ import annotations

from importlib import import_module
from pathlib import Path

from ..registry import BASELINE
from .base import GmlxCache
from .block import BlockCache, BlockScheme


def scheme_folders() -> list[str]:
    """The built-in schemes' folders in registration order: the baseline, then by name."""
    found = sorted(p.name for p in Path(__file__).parent.iterdir() if (p / "scheme.py").is_file())
    return sorted(found, key=lambda name: name != BASELINE)


for _folder in scheme_folders():
    import_module(f"{__name__}.{_folder}")

from .affine import AffineCache, AffineRotCache  # noqa: E402  (after the loop: importing them registers in order)
from .fp16 import FP16Cache  # noqa: E402
from .kvarn import KVarNCache  # noqa: E402

__all__ = ["AffineCache", "AffineRotCache", "BlockCache", "BlockScheme", "FP16Cache", "GmlxCache", "KVarNCache",
           "scheme_folders"]
