"""What the gmlx_lab caches share: mlx-lm's cache contract, the checks on what arrives, and a region breakdown.

Each cache duck-types mlx-lm's `KVCache`: `offset`, `update_and_fetch`, `state` (arrays plus
scalars, so `save_prompt_cache`/`load_prompt_cache` round-trip it), `nbytes`, `is_trimmable`/`trim`,
`make_mask`, `empty`, `size`; `copy.deepcopy` gives an independent cache. The rolling window and a model's
sliding layers are `RollingWindow`'s (window.py); the routing of schemes with fused kernels is `KernelRoute`'s
(kernel_route.py), which only those schemes inherit.

Every update is checked when it arrives: 4-d float K/V, at least one token, the batch, head count and head dims
of the first update. Non-finite K/V (inf, nan) are one policy for every scheme: the arriving K/V are checked in
batches of at least FINITE_BATCH tokens (a prompt chunk at once, decode tokens 32 at a time), computed with the
step that completes the batch (`mx.depends` ties the flag to the stored data) and read when the batch after the
next one forms (by then its step has surely run, so reading never waits on the GPU: an error comes at most about
3 x 32 decode tokens late), or at once by `check_finite()`; the error names the layer and the tokens. Trimmed
tokens leave the queue of tokens still to check. `check_finite()` also scans every region the cache holds now
(what a saved file brought in too). Batching keeps the check to a few operations per 32 decode tokens: checked one
by one it costs several kernel launches per layer and token. `check_finite_on = False` (or GMLX_CHECK_FINITE=0 in
the environment) skips it for speed runs; benchmarks/model_decode.py measures what it costs.
"""

from __future__ import annotations

import copy
import os
import weakref
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import _BaseCache

from . import saved
from .window import RollingWindow

FLOAT_DTYPES = (mx.float16, mx.bfloat16, mx.float32)
CHECK_FINITE_ENV = "GMLX_CHECK_FINITE"
FINITE_BATCH = 32  # tokens whose finiteness is checked together


class ArrivalChecks:
    """The checks on arriving K/V (the module docstring), for a cache with `where()`, `offset` and, when it serves
    a sliding layer, `sliding_hold`."""

    check_finite_on = os.environ.get(CHECK_FINITE_ENV, "1") != "0"
    arrived = 0  # tokens of the update in progress

    def reset_checks(self) -> None:
        """No update seen yet: no shape, dtype or queued tokens."""
        self._shape: tuple[int, int, int, int] | None = None  # batch, kv heads, k dim, v dim
        self._dtype: mx.Dtype | None = None  # of the first update's K/V (None: they differ)
        self._unchecked: list[tuple[mx.array, mx.array]] = []  # arrived K/V not yet in a finiteness batch
        self._unchecked_tokens = 0
        self._flags: list[tuple[int, int, mx.array]] = []  # (first token, end, all finite) not yet read

    def copy_checks(self, new: ArrivalChecks) -> None:
        """Hand a copy of this cache the checks still pending (a deep copy checks what the original would)."""
        new._flags, new._unchecked = list(self._flags), list(self._unchecked)
        new._unchecked_tokens, new._dtype = self._unchecked_tokens, self._dtype

    @property
    def kv_shape(self) -> tuple[int, int, int, int] | None:
        """(batch, kv heads, key head_dim, value head_dim) of the K/V held; None before the first update."""
        return self._shape

    def arrive(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Check one update's K/V (B, heads, tokens, dim) and start its finiteness check.

        Returns keys and values to store (the same values, tied to the check when it is on).
        """
        if self._like_first(keys, values):  # every check was made on the first update
            keys, values = self._finite(keys, values)
        else:
            keys, values = self._first_checks(keys, values)
        self.arrived = keys.shape[2]
        if self.sliding_hold is not None:  # the update's first queries need the window before it: keep it
            self.max_kv_size = self.sliding_hold + self.arrived
        return keys, values

    def _like_first(self, keys: Any, values: Any) -> bool:
        """True for K/V with the first update's batch, heads, head dims and dtype (and >= 1 token)."""
        if self._dtype is None or not isinstance(keys, mx.array) or not isinstance(values, mx.array):
            return False
        ks, vs = keys.shape, values.shape
        return (len(ks) == len(vs) == 4 and ks[2] > 0 and ks[:3] == vs[:3]
                and (ks[0], ks[1], ks[3], vs[3]) == self._shape
                and keys.dtype == self._dtype and values.dtype == self._dtype)

    def _first_checks(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """`arrive` for an update unlike the last one: every check, with its message."""
        if not isinstance(keys, mx.array) or not isinstance(values, mx.array):
            raise TypeError(f"{self.where()}: keys and values must be mx.array, got "
                            f"{type(keys).__name__} and {type(values).__name__}")
        if keys.ndim != 4 or values.ndim != 4 or keys.shape[:3] != values.shape[:3]:
            raise ValueError(
                f"{self.where()}: keys/values must be (batch, kv_heads, tokens, head_dim) with matching first "
                f"three axes; got {tuple(keys.shape)} and {tuple(values.shape)}"
            )
        for name, x in (("keys", keys), ("values", values)):
            if x.dtype not in FLOAT_DTYPES:
                raise TypeError(f"{self.where()}: {name} have dtype {x.dtype}; accepted: float16, bfloat16, "
                                "float32 (a K/V cache stores attention keys and values)")
        if keys.shape[2] == 0:
            raise ValueError(f"{self.where()}: an update with 0 tokens; update_and_fetch needs at least one")
        shape = (keys.shape[0], keys.shape[1], keys.shape[3], values.shape[3])
        if self._shape is None:
            self._shape = shape
        elif shape != self._shape:
            names = ("batch", "kv heads", "key head_dim", "value head_dim")
            diff = ", ".join(f"{n} {a} -> {b}" for n, a, b in zip(names, self._shape, shape) if a != b)
            raise ValueError(f"{self.where()}: K/V shape changed between updates ({diff}); a cache holds one "
                             "request's K/V: make a new cache for another shape")
        self._dtype = keys.dtype if keys.dtype == values.dtype else None
        return self._finite(keys, values)

    def _finite(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Queue this update for the finiteness check; every FINITE_BATCH tokens, check the queue."""
        if not self.check_finite_on:
            return keys, values
        if self._unchecked_tokens + keys.shape[2] < FINITE_BATCH:
            self._unchecked.append((keys, values))
            self._unchecked_tokens += keys.shape[2]
            return keys, values
        self._read_flags(keep_last=1)  # the batch before the previous one (raises before this one is queued)
        self._unchecked.append((keys, values))
        self._unchecked_tokens += keys.shape[2]
        # the flag joins this step's graph, so it is computed with the step and reading it never waits
        return mx.depends(keys, self._batch_flag(self.offset + keys.shape[2])), values

    def _batch_flag(self, end: int) -> mx.array:
        """One flag for the K/V that arrived since the last batch, tokens up to `end`."""
        ks, vs = zip(*self._unchecked)
        self._unchecked, self._unchecked_tokens = [], 0
        k, v = (mx.concatenate(xs, axis=2) if len(xs) > 1 else xs[0] for xs in (ks, vs))
        finite = mx.logical_and(mx.all(mx.isfinite(k)), mx.all(mx.isfinite(v)))
        self._flags.append((end - k.shape[2], end, finite))
        return finite

    def check_finite(self) -> None:
        """Raise if K/V that arrived held inf or nan, or if any region the cache holds now does (a loaded cache's
        sink, blocks and their scales, live tokens and tail, whatever arrived or was loaded)."""
        self._read_flags(keep_last=0)
        self.check_stored_finite()

    def check_stored_finite(self) -> None:
        """Raise a ValueError naming the region, K or V and the tokens if what the cache holds is not finite."""
        for region, kind, x in self.stored_tokens():
            ok = mx.all(mx.isfinite(x), axis=(0, 1, 3))
            if not mx.all(ok).item():
                first = int(mx.argmin(ok.astype(mx.int32)).item())
                raise ValueError(f"{self.where()}: {kind} in the {region} holds inf or nan (token {first} of "
                                 f"{x.shape[2]} there); accepted: finite K/V")

    def stored_tokens(self) -> list[tuple[str, str, mx.array]]:
        """(region, "K" or "V", its tokens (B, H, n, D) as the cache would read them) for every region held."""
        raise NotImplementedError

    def _read_flags(self, keep_last: int) -> None:
        """Raise if K/V that arrived held inf or nan; the newest `keep_last` batches are left for later."""
        if keep_last == 0 and self._unchecked:
            self._batch_flag(self.offset)
        ready = self._flags[: max(0, len(self._flags) - keep_last)]
        self._flags = self._flags[len(ready):]
        for first, end, finite in ready:
            if not finite.item():
                self._flags = []
                raise ValueError(
                    f"{self.where()}: non-finite keys or values (inf or nan) arrived in tokens {first}..{end - 1}; "
                    "accepted: finite K/V (check the model's inputs and dtype)"
                )

    def forget_unchecked(self, n: int) -> None:
        """Drop the newest n tokens from the finiteness queue (they are being trimmed)."""
        while n and self._unchecked:
            k, v = self._unchecked[-1]
            take = min(n, k.shape[2])
            if take == k.shape[2]:
                self._unchecked.pop()
            else:
                self._unchecked[-1] = (k[:, :, : k.shape[2] - take], v[:, :, : v.shape[2] - take])
            self._unchecked_tokens -= take
            n -= take


class GmlxCache(ArrivalChecks, RollingWindow, _BaseCache):
    """Base of the gmlx_lab caches: the parts of the contract that do not depend on storage."""

    scheme = "?"
    KERNELS: tuple[str, ...] = ()  # fused GPU kernels (a scheme with kernels inherits KernelRoute too)
    # "auto": fused GPU kernels on a GPU backend, the pure-MLX reference on the CPU; "reference" forces the
    # reference; "fused" demands the kernels (an error on the CPU); "emulated" runs their algorithm in pure MLX.
    attention_path = "auto"
    ATTENTION_PATHS = ("auto", "reference", "fused", "emulated")

    def __init__(self, layer: int | None = None):
        self.offset = 0  # tokens that arrived (positions keep counting in a rolling window)
        self.layer = layer
        self.max_kv_size: int | None = None  # a rolling window (window.py), or None
        self.dropped = 0  # tokens the window dropped
        self._fetched: tuple[weakref.ref, weakref.ref] | None = None
        self.reset_checks()

    def where(self) -> str:
        """A prefix for error messages naming the layer."""
        return f"layer {self.layer}" if self.layer is not None else "cache"

    def stored_tokens(self) -> list[tuple[str, str, mx.array]]:
        """(region, "K" or "V", its tokens (B, H, n, D) as the cache would read them) for every region held."""
        raise NotImplementedError

    # -- the attention seam -----------------------------------------------------------------------
    def fetched(self, keys: Any, values: Any) -> bool:
        """True when keys/values are the very arrays the last update_and_fetch returned."""
        if self._fetched is None:
            return False
        return keys is self._fetched[0]() and values is self._fetched[1]()

    def _return(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if self.sliding_window is not None:  # a sliding layer: what RotatingKVCache hands back (set_sliding)
            self._fetched = None  # mlx's attention with the model's sliding mask, not `attend` over every region
            return self.sliding_fetch(keys, values)
        # weak references: the cache must not keep a (possibly evaluated, decoded) copy alive
        self._fetched = (weakref.ref(keys), weakref.ref(values))
        return keys, values

    @classmethod
    def decode_path(cls, options: dict[str, Any] | None = None) -> str:
        """How a quantized layer of this class with these options attends at decode, for the [kv] line: '' when
        it has a fused GPU kernel (`KERNELS`), else that it takes the reference path. A plug-in without kernels says
        so by default."""
        return "" if cls.KERNELS else "reference decode path (dequantize, then SDPA; no fused kernel)"

    def attention_route(self) -> str:
        """How this cache attends on this machine, in words (KernelRoute says more for a scheme with kernels)."""
        return "mlx.fast.scaled_dot_product_attention"

    def scale_group(self, kind: str) -> tuple[int, int] | None:
        """Which stored values of K ("k") or V ("v") share one scale, as (tokens, channels) (0 channels: the whole
        row); None where values are stored as they are (fp16). Notebook 11's storage diagram draws it."""
        return None

    # -- contract ---------------------------------------------------------------------------------
    def size(self) -> int:
        return self.offset

    def empty(self) -> bool:
        return self.offset == 0

    def is_trimmable(self) -> bool:
        return True

    def regions(self) -> dict[str, int]:
        """Resident bytes by region; the values add up to `nbytes`."""
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        return sum(self.regions().values())

    def memory_regions(self) -> tuple[dict[str, int], dict[str, int] | None]:
        """For the memory report: (resident bytes by region, reserve excluded; tokens by region, or None when every
        region spans every token, e.g. codes and their scales)."""
        regions = dict(self.regions())
        regions.pop("reserve", None)
        return regions, None

    def check_trim(self, n: int, limit: int, why: str) -> int:
        """Validate a trim request of n tokens against what can be rolled back; the trimmed tokens leave the
        finiteness queue (a rejected draft's K/V are never checked, nor blamed)."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"{self.where()}: trim(n) needs an int n >= 0, got {n!r}")
        n = min(n, self.offset)
        if n > limit:
            raise ValueError(f"{self.where()}: cannot trim {n} tokens, only {limit} can be rolled back ({why})")
        self.forget_unchecked(n)
        return n

    def __deepcopy__(self, memo: dict) -> GmlxCache:
        """An independent copy. The copy shares the arrays' data but not the array objects: a write into a
        buffer with room (`buf[..., i, :] = x`) updates that array object in place, which the copy must not see."""
        with saved.trusted():  # a live cache's own state: checked when it arrived
            new = type(self).from_state(_new_objects(self.state))
        switches = ("attention_path", "check_finite_on", "sliding_window", "sliding_hold")  # set on the instance
        for name in switches:
            if name in self.__dict__:
                setattr(new, name, self.__dict__[name])
        self.copy_checks(new)
        return new


def _new_objects(tree: Any) -> Any:
    """`tree` (tuples, lists, arrays, scalars) with every mx.array replaced by a new object over the same data."""
    if isinstance(tree, (tuple, list)):
        return type(tree)(_new_objects(x) for x in tree)
    return copy.copy(tree) if isinstance(tree, mx.array) else tree
