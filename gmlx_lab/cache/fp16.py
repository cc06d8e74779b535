"""The fp16 baseline: K and V stored as float16, whatever dtype the model computes in."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from .base import GmlxCache, array_bytes

STORE_DTYPE = mx.float16


class GrowingBuffer:
    """A (batch, heads, tokens, dim) buffer that grows in steps of 256 tokens, like mlx-lm's KVCache.

    Growing in steps keeps decode from copying the whole cache every token; the
    unused capacity is resident memory too, and `regions()` reports it as "reserve".
    """

    step = 256

    def __init__(self, dtype: mx.Dtype):
        self.data: mx.array | None = None
        self.dtype = dtype

    def write(self, start: int, x: mx.array) -> None:
        """Store x at token positions [start, start + len)."""
        end = start + x.shape[2]
        if self.data is None or end > self.data.shape[2]:
            grow = (x.shape[2] + self.step - 1) // self.step * self.step
            fresh = mx.zeros((*x.shape[:2], grow, x.shape[3]), self.dtype)
            kept = None if self.data is None else self.data[..., :start, :]
            self.data = fresh if kept is None else mx.concatenate([kept, fresh], axis=2)
        self.data[..., start:end, :] = x.astype(self.dtype)

    def view(self, end: int) -> mx.array:
        return self.data if end == self.data.shape[2] else self.data[..., :end, :]

    def capacity(self) -> int:
        return 0 if self.data is None else self.data.shape[2]


class FP16Cache(GmlxCache):
    """K/V stored as float16 and returned in the model's compute dtype (float32 on the CPU)."""

    scheme = "fp16"

    def __init__(self, layer: int | None = None):
        super().__init__(layer)
        self.keys = GrowingBuffer(STORE_DTYPE)
        self.values = GrowingBuffer(STORE_DTYPE)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.check_input(keys, values)
        self.keys.write(self.offset, keys)
        self.values.write(self.offset, values)
        self.offset += keys.shape[2]
        k, v = self.keys.view(self.offset), self.values.view(self.offset)
        return self._return(k.astype(keys.dtype), v.astype(values.dtype))

    def trim(self, n: int) -> int:
        n = self.check_trim(n, self.offset, "")
        self.offset -= n
        return n

    def regions(self) -> dict[str, int]:
        used = 0
        if self.keys.data is not None:
            per_token = (self.keys.data.nbytes + self.values.data.nbytes) // self.keys.capacity()
            used = per_token * self.offset
        total = array_bytes(self.keys.data, self.values.data)
        return {"tokens": used, "reserve": total - used}

    @property
    def state(self) -> tuple[Any, ...]:
        if self.offset == 0:
            return (None, None, 0, self.layer)
        return (self.keys.view(self.offset), self.values.view(self.offset), self.offset, self.layer)

    @state.setter
    def state(self, v: tuple[Any, ...]) -> None:
        keys, values, self.offset, self.layer = v
        self._fetched = (None, None)
        self.keys, self.values = GrowingBuffer(STORE_DTYPE), GrowingBuffer(STORE_DTYPE)
        self.keys.data, self.values.data = keys, values
