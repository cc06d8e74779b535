"""A block cache that completes its options as its scheme does: the base of the built-in block schemes.

`BlockCache` checks the options it is given against its `OPTIONS`; a built-in cache built by hand
(`KiviCache(bits=2)`, `KVarNCache(4, 4)`) also fills the defaults and applies the rules between options
(`complete`), as the registry resolves a scheme's options, so a cache and its scheme never disagree about an
option and neither asks the other. A cache whose rotation turns its heads also refuses the head dims where that
rotation cannot be undone (`gmlx_lab/rotation.py`).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from ..registry import resolve_options
from ..rotation import rotation_problem
from .block import GEOMETRY, BlockCache


class CheckedBlockCache(BlockCache):
    """Options checked against `OPTIONS`, defaults filled and `complete` applied (`registry.resolve_options`)."""

    def __init__(self, layer: int | None = None, **options: Any):
        options = {name: value for name, value in options.items() if value is not None}  # None: the default
        super().__init__(layer, **options)
        known = {opt.name for opt in self.OPTIONS}
        # the geometry a saved state passes back (block_tokens) is BlockCache's to check, not an option
        given = {name: value for name, value in options.items() if name in known or name not in GEOMETRY}
        try:
            values = resolve_options(self.OPTIONS, given, self.scheme, self.complete)
        except ValueError as err:
            raise ValueError(f"{self.where()}: {err}") from None
        for name, value in values.items():
            setattr(self, name, value)
        self.options = values

    def check_head_dims(self, k_dim: int, v_dim: int) -> None:
        """BlockCache's check, and, if this cache rotates, the rotation rule (gmlx_lab/rotation.py) at these dims."""
        super().check_head_dims(k_dim, v_dim)
        probe = mx.random.normal((1, 1, 1, 64), key=mx.random.key(0))  # 64: a size every rotation takes
        if mx.array_equal(self.rotate(probe), probe).item():
            return  # no rotation: any head dim the format takes
        for kind, d in (("k", k_dim), ("v", v_dim)):
            problem = rotation_problem(d)
            if problem:
                raise ValueError(f"{self.where()}: {type(self).__name__} cannot rotate {kind.upper()} heads: {problem}")
