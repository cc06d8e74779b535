"""The fp16 baseline: K and V stored as float16, whatever dtype the model computes in."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from ..records import KV
from ..window import GROUP, SINK_TOKENS, groups_to_drop
from . import saved
from .base import GmlxCache, array_bytes

STORE_DTYPE = mx.float16
LAYOUT = "gmlx_lab.FP16Cache/1"  # the last item of `state`: a saved state of another layout is refused
STATE_ITEMS = 12  # K, V, offset, layer, window size, dropped, sliding window and hold, the K/V shape


def fill_sink(sink: KV | None, keys: mx.array, values: mx.array, room: int) -> tuple[KV, mx.array, mx.array]:
    """Move an update's first `room` tokens into an fp16 sink; returns the sink and the update's other tokens.

    The sink gets a copy, not a view: a slice would keep the update's whole buffer alive (a 2048-token prompt
    chunk behind a 128-token sink) and a kernel that reads it would copy it again at every launch."""
    head = KV(*(mx.contiguous(x[:, :, :room].astype(STORE_DTYPE)) for x in (keys, values)))
    if sink is not None:
        head = KV(*(mx.concatenate([a, b], axis=2) for a, b in zip(sink, head)))
    return head, keys[:, :, room:], values[:, :, room:]


def keep_sink(sink: KV, keep: int) -> KV | None:
    """A sink's first `keep` tokens (a copy, as in `fill_sink`), or None for none."""
    return KV(*(mx.contiguous(x[:, :, :keep]) for x in sink)) if keep else None


class GrowingBuffer:
    """A (batch, heads, tokens, ...) buffer that grows along its third axis in steps (256, like mlx-lm's KVCache).

    Growing in steps keeps decode from copying the whole cache every token (a write is an in-place
    slice update); the unused capacity is resident memory too, and `regions()` reports it as "reserve".
    A step of 1 grows it exactly (the block base's body of large blocks).
    """

    STEP = 256

    def __init__(self, dtype: mx.Dtype, data: mx.array | None = None, step: int = STEP):
        self.data = data
        self.dtype = dtype
        self.step = step

    def write(self, start: int, x: mx.array) -> None:
        """Store x at token positions [start, start + len)."""
        end = start + x.shape[2]
        if self.data is None or end > self.data.shape[2]:
            grow = (x.shape[2] + self.step - 1) // self.step * self.step
            fresh = mx.zeros((*x.shape[:2], grow, *x.shape[3:]), self.dtype)
            self.data = fresh if self.data is None else mx.concatenate([self.data[:, :, :start], fresh], axis=2)
        self.data[:, :, start:end] = x if x.dtype == self.dtype else x.astype(self.dtype)

    def view(self, end: int) -> mx.array:
        """The first `end` tokens."""
        return self.data if end == self.data.shape[2] else self.data[:, :, :end]

    def remove(self, start: int, stop: int, end: int) -> None:
        """Forget tokens [start, stop) of the `end` held: the later ones move down (one copy) into a buffer
        of whole growth steps, so the size depends only on the tokens held (a rolling window stays flat).
        The buffer stays row-contiguous, also where one part is left (MLX's concatenate of one array is a
        view): a kernel launch copies an input that is not, at every launch (two copies a kvarn_decode call
        when a whole number of growth steps is left)."""
        kept = end - (stop - start)
        parts = [self.data[:, :, :start]] if start else []
        parts += [self.data[:, :, stop:end]] if end > stop else []
        spare = -(-max(kept, 1) // self.step) * self.step - kept
        if spare:
            parts.append(mx.zeros((*self.data.shape[:2], spare, *self.data.shape[3:]), self.dtype))
        self.data = mx.concatenate(parts, axis=2) if len(parts) > 1 else mx.contiguous(parts[0])

    def capacity(self) -> int:
        return 0 if self.data is None else self.data.shape[2]

    def __deepcopy__(self, memo: dict) -> GrowingBuffer:
        return GrowingBuffer(self.dtype, self.data, self.step)


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
        """The rolling window: drop the oldest groups after the sink (gmlx_lab/window.py)."""
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
