"""A block cache whose options its registry entry checks and completes: the base of the field's schemes.

`BlockCache` takes options as given; the built-in block schemes (turboquant, float, kivi) also want a cache
built by hand (`KiviCache(bits=2)`) to refuse what the registry refuses, naming the layer, and to fill the
registry's defaults, so a cache and its scheme never disagree about an option. It also refuses head dims its
rotation does not invert: MLX 0.32.4's `mx.hadamard_transform` returns non-orthogonal output, with no error,
for sizes such as 40 and 80.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from ..registry import get_scheme
from .block import GEOMETRY, BlockCache


class CheckedBlockCache(BlockCache):
    """Options checked by `Scheme.check` and `Scheme.resolve` (its rules between options too), defaults filled."""

    def __init__(self, layer: int | None = None, **options: Any):
        super().__init__(layer, **options)
        scheme = get_scheme(self.scheme)
        known = {opt.name for opt in scheme.options}
        # the geometry a saved state passes back (block_tokens) is BlockCache's to check, not an option
        given = {name: value for name, value in options.items() if name in known or name not in GEOMETRY}
        scheme.check(self.where(), **given)
        try:
            values = scheme.resolve(**given)
        except ValueError as err:
            raise ValueError(f"{self.where()}: {err}") from None
        for name, value in values.items():
            setattr(self, name, value)
        self.options = values

    def check_head_dims(self, k_dim: int, v_dim: int) -> None:
        """BlockCache's check, and the rotation undone by `unrotate` at these head dims (see the module docstring)."""
        super().check_head_dims(k_dim, v_dim)
        for kind, d in (("k", k_dim), ("v", v_dim)):
            x = mx.random.normal((1, 2, 4, d), key=mx.random.key(d))
            if not mx.allclose(self.unrotate(self.rotate(x)), x, atol=1e-3).item():
                raise ValueError(f"{self.where()}: {type(self).__name__} cannot rotate {kind.upper()} blocks of "
                                 f"head_dim {d} (mx.hadamard_transform is not orthogonal at this size)")
