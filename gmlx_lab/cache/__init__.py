"""gmlx_lab's KV caches, each a drop-in for mlx-lm's cache contract.

The shared tier is the modules named in SHARED: the cache base and its checks on what arrives (base.py), the block
base every quantized scheme builds on (block.py), the kernel routing only schemes with kernels inherit
(kernel_route.py), the attention math (attention.py), the fp16 stores (buffers.py), the options the schemes share
(options.py), the block geometry (regions.py), the rolling window (window.py), the rotation rule (rotation.py) and
the saved-state checks (saved.py). Every other module here is one built-in scheme (`kivi.py`: its cache, options and
registry entry), and a folder is a scheme with kernels (`kvarn/`, `affine/`: `cache.py`, and kvarn's record format).
Registering is importing them: this package imports every one, fp16 (the baseline) first and the others by name,
and that order is the registry's; adding a scheme is adding its module, no list to edit. How mlx-lm models reach a
cache's own `attend`, and how `load_prompt_cache` finds the classes, is gmlx_lab/mlx_lm_hooks.py.
"""

from __future__ import annotations

from importlib import import_module
from pathlib import Path

from ..registry import BASELINE
from .base import GmlxCache
from .block import BlockCache, BlockScheme

SHARED = ("attention", "base", "block", "buffers", "kernel_route", "options", "regions", "rotation", "saved", "window")


def scheme_modules(folder: Path | None = None) -> list[str]:
    """The built-in schemes' modules (relative to this package, or found in `folder`) in registration order: the
    baseline, then by name; a folder's scheme module is its `cache.py`."""
    here = folder or Path(__file__).parent
    found = [p.stem for p in here.glob("*.py") if p.stem not in SHARED and p.stem != "__init__"]
    found += [f"{p.name}.cache" for p in here.iterdir() if (p / "cache.py").is_file()]
    return sorted(found, key=lambda name: (name != BASELINE, name))


for _module in scheme_modules():
    import_module(f"{__name__}.{_module}")

from .affine.cache import AffineCache, AffineRotCache  # noqa: E402  (after the loop: importing them registers in order)
from .fp16 import FP16Cache  # noqa: E402
from .kvarn.cache import KvarnCache  # noqa: E402

__all__ = ["SHARED", "AffineCache", "AffineRotCache", "BlockCache", "BlockScheme", "FP16Cache", "GmlxCache",
           "KvarnCache", "scheme_modules"]
