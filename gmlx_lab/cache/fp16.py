"""The fp16 baseline: K and V stored as float16, whatever dtype the model computes in; the scheme every other is
measured against.

Its cache is not a block cache: it stores tokens as they come (the fp16 store the block base keeps its sink and
tail in) and encodes nothing; `Scheme.make_cache` builds it from the class, as for a plug-in.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from ..registry import BASELINE, Scheme, register_scheme
from . import saved
from .base import GmlxCache
from .buffers import STORE_DTYPE, GrowingBuffer, array_bytes
from .window import GROUP, SINK_TOKENS, groups_to_drop

LAYOUT = "gmlx_lab.FP16Cache/1"  # the last item of `state`: a saved state of another layout is refused
STATE_ITEMS = 12  # K, V, offset, layer, window size, dropped, sliding window and hold, the K/V shape


class FP16Cache(GmlxCache):
    """K/V stored as float16 and returned in the model's compute dtype (float32 on the CPU)."""

    scheme = "fp16"

    def __init__(self, layer: int | None = None):
        super().__init__(layer)
        self.keys = GrowingBuffer(STORE_DTYPE)
        self.values = GrowingBuffer(STORE_DTYPE)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        keys, values = self.arrive(keys, values)
        n = keys.shape[2]
        held = self.held
        self.keys.write(held, keys)
        self.values.write(held, values)
        self.offset += n
        if self.max_kv_size is not None:
            self._roll(n)
        k, v = self.keys.view(self.held), self.values.view(self.held)
        if k.dtype != keys.dtype:
            k, v = k.astype(keys.dtype), v.astype(values.dtype)
        return self._return(k, v)

    def _roll(self, newest: int) -> None:
        """The rolling window: drop the oldest groups after the sink (cache/window.py)."""
        drop = groups_to_drop(self.held, self.max_kv_size, newest) * GROUP
        if drop:
            for buf in (self.keys, self.values):
                buf.remove(SINK_TOKENS, SINK_TOKENS + drop, self.held)
            self.dropped += drop

    def trim(self, n: int) -> int:
        n = self.check_trim(n, self.held, "")
        self.offset -= n
        return n

    def regions(self) -> dict[str, int]:
        total = array_bytes(self.keys.data, self.values.data)
        cap = self.keys.capacity()
        used = total * self.held // cap if cap else 0
        return {"tokens": used, "reserve": total - used}

    def memory_regions(self) -> tuple[dict[str, int], dict[str, int] | None]:
        """Every token fp16: one region."""
        return {"fp16": self.regions()["tokens"]}, None

    def stored_tokens(self) -> list[tuple[str, str, mx.array]]:
        if not self.held:
            return []
        return [("tokens", "K", self.keys.view(self.held)), ("tokens", "V", self.values.view(self.held))]

    @property
    def state(self) -> tuple[Any, ...]:
        """K and V as held, then offset, layer, the rolling window (size, tokens dropped), the sliding-window
        setting, the K/V shape (batch, kv heads, head dims) and the layout tag (`saved.py` checks a loaded
        state against them)."""
        meta = (self.offset, self.layer, self.max_kv_size, self.dropped, *self.sliding_state(),
                *(self._shape or (None,) * 4), LAYOUT)
        if self.offset == 0:
            return (None, None, *meta)
        return (self.keys.view(self.held), self.values.view(self.held), *meta)

    @state.setter
    def state(self, v: tuple[Any, ...]) -> None:
        reader = None if saved.is_trusted() else saved.StateReader(v, type(self), LAYOUT, fixed=STATE_ITEMS)
        keys, values, offset, layer, max_kv_size, dropped, *sliding = v[:8]
        shape = tuple(v[8:12])
        if reader is not None:
            self._check_scalars(reader, v[:-1])
        self.__init__(layer)
        self.offset, self.max_kv_size, self.dropped = offset, max_kv_size, dropped
        self.restore_sliding(sliding)
        self.keys.data, self.values.data = keys, values
        self._shape = None if None in shape else shape
        if reader is not None:
            self._check_loaded(reader, keys, values)

    def _check_scalars(self, r: saved.StateReader, items: list[Any]) -> None:
        """A saved state's scalars: in range, before anything is built from them (saved.py)."""
        if len(items) != STATE_ITEMS:
            raise r.fail(f"the saved state has {len(items)} items before its layout tag; {LAYOUT} has {STATE_ITEMS}")
        r.common({"layer": items[3], "offset": items[2], "max_kv_size": items[4], "dropped": items[5],
                  "sliding_window": items[6], "sliding_hold": items[7], "shape": items[8:12]})

    def _check_loaded(self, r: saved.StateReader, keys: Any, values: Any) -> None:
        """The loaded K/V against the scalars: the tokens held, the saved shape, fp16; then finite (saved.py)."""
        if not r.pair(keys, values, "tokens"):
            if self.held:
                raise r.fail(f"holds no K/V, but offset {self.offset} and dropped {self.dropped} say it holds "
                             f"{self.held} tokens")
            r.held_state(self)
            return
        if self._shape is None:
            raise r.fail(f"holds K/V {saved.describe(keys)} but no K/V shape")
        b, h, dk, dv = self._shape
        r.array(keys, "K", (b, h, self.held, dk), STORE_DTYPE)
        r.array(values, "V", (b, h, self.held, dv), STORE_DTYPE)
        r.held_state(self)


class FP16Scheme(Scheme):
    """No options; every layer it is asked about stays fp16; the cache is its class (`Scheme.make_cache`)."""

    def declines(self, kind: str, k_dim: int, v_dim: int, options: dict[str, Any]) -> str | None:
        return "fp16 scheme"

    def layer_bytes(self, tokens: int, kv_heads: int, k_dim: int, v_dim: int, options: dict[str, Any]) -> float:
        """2 bytes per value: kv_heads * tokens * (dk + dv) * 2."""
        return kv_heads * tokens * (k_dim + v_dim) * 2.0

    def roundtrip(self, x: np.ndarray, kind: str, options: dict[str, Any]) -> np.ndarray:
        return np.asarray(x, np.float32).astype(np.float16).astype(np.float32)


SCHEME = register_scheme(FP16Scheme(BASELINE, "K and V stored as float16 (the baseline)", cache_class=FP16Cache,
                                    color="#9e9e9e"))
