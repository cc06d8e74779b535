"""fp16 stores every cache shares: the stored dtype, a K/V pair, the sink's fill, and a buffer that grows along the
tokens."""

from __future__ import annotations

from typing import Any, NamedTuple

import mlx.core as mx


class KV(NamedTuple):
    """A key and a value of anything (arrays, records, buffers): named fields instead of [K, V] lists."""

    k: Any
    v: Any


STORE_DTYPE = mx.float16


def array_bytes(*arrays: Any) -> int:
    """Bytes held by the given arrays (None counts as 0)."""
    return sum(a.nbytes for a in arrays if a is not None)


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
