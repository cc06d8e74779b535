"""The fp16 baseline: K and V stored as float16, whatever dtype the model computes in."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from ..records import KV
from ..window import GROUP, SINK_TOKENS, groups_to_drop
from .base import GmlxCache, array_bytes

STORE_DTYPE = mx.float16


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

    @property
    def state(self) -> tuple[Any, ...]:
        meta = (self.offset, self.layer, self.max_kv_size, self.dropped, *self.sliding_state())
        if self.offset == 0:
            return (None, None, *meta)
        return (self.keys.view(self.held), self.values.view(self.held), *meta)

    @state.setter
    def state(self, v: tuple[Any, ...]) -> None:
        keys, values, offset, layer, max_kv_size, dropped, *sliding = v
        self.__init__(layer)
        self.offset, self.max_kv_size, self.dropped = offset, max_kv_size, dropped
        self.restore_sliding(sliding)
        self.keys.data, self.values.data = keys, values
        if keys is not None:
            self._shape = (keys.shape[0], keys.shape[1], keys.shape[3], values.shape[3])
