"""What the three gmlx_lab caches share: mlx-lm's cache contract and a region breakdown.

Each cache duck-types mlx-lm's `KVCache`: `offset`, `update_and_fetch`,
`state` (arrays plus scalars, so `save_prompt_cache`/`load_prompt_cache`
round-trip it), `nbytes`, `is_trimmable`/`trim`, `make_mask`, `empty`, `size`.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import _BaseCache, create_attention_mask


def array_bytes(*arrays: Any) -> int:
    """Bytes held by the given arrays (None counts as 0)."""
    return sum(a.nbytes for a in arrays if a is not None)


class GmlxCache(_BaseCache):
    """Base of the gmlx_lab caches: the parts of the contract that do not depend on storage."""

    scheme = "?"

    def __init__(self, layer: int | None = None):
        self.offset = 0
        self.layer = layer
        self._fetched: tuple[Any, Any] = (None, None)

    def where(self) -> str:
        """A prefix for error messages naming the layer."""
        return f"layer {self.layer}" if self.layer is not None else "cache"

    def fetched(self, keys: Any, values: Any) -> bool:
        """True when keys/values are the very arrays the last update_and_fetch returned."""
        return keys is self._fetched[0] and values is self._fetched[1]

    def _return(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self._fetched = (keys, values)
        return keys, values

    def check_input(self, keys: mx.array, values: mx.array) -> None:
        """Reject K/V whose shapes cannot belong to this cache."""
        if keys.ndim != 4 or values.ndim != 4 or keys.shape[:3] != values.shape[:3]:
            raise ValueError(
                f"{self.where()}: keys/values must be (batch, kv_heads, tokens, head_dim) with "
                f"matching first three axes; got {tuple(keys.shape)} and {tuple(values.shape)}"
            )

    # "auto": fused GPU kernels on a GPU backend, the pure-MLX reference on the CPU; "reference" forces the
    # reference; "fused" demands the kernels (an error on the CPU); "emulated" runs their algorithm in pure MLX.
    attention_path = "auto"
    ATTENTION_PATHS = ("auto", "reference", "fused", "emulated")

    def kernel_route(self, supported: bool) -> str | None:
        """How `attend` runs: "fused" or "emulated" kernel algorithm, or None for the reference path."""
        from ..kernels import active_backend

        path = self.attention_path
        if path not in self.ATTENTION_PATHS:
            raise ValueError(f"{self.where()}: attention_path={path!r}; accepted: {', '.join(self.ATTENTION_PATHS)}")
        if path == "reference" or not supported:
            return None
        if path == "emulated":
            return "emulated"
        return "fused" if path == "fused" or active_backend() != "cpu" else None

    def size(self) -> int:
        return self.offset

    def empty(self) -> bool:
        return self.offset == 0

    def is_trimmable(self) -> bool:
        return True

    def make_mask(self, *args: Any, **kwargs: Any) -> Any:
        return create_attention_mask(*args, offset=self.offset, **kwargs)

    def regions(self) -> dict[str, int]:
        """Resident bytes by region; the values add up to `nbytes`."""
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        return sum(self.regions().values())

    def check_trim(self, n: int, limit: int, why: str) -> int:
        """Validate a trim request of n tokens against what can be rolled back."""
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"{self.where()}: trim(n) needs an int n >= 0, got {n!r}")
        n = min(n, self.offset)
        if n > limit:
            raise ValueError(f"{self.where()}: cannot trim {n} tokens, only {limit} can be rolled back ({why})")
        return n
