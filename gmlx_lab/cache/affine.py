"""Affine quantization, as mlx-lm's `--kv-bits`: each token's K/V row in groups of N-bit codes.

Every `group_size` values of a row share an fp16 scale and offset
(`mx.quantize`, affine mode). Unlike mlx-lm 0.32.2's QuantizedKVCache, the packed
width is `head_dim * bits / 32` words, so 3- and 6-bit caches work for every head
dim. With `rotate=True` each head is first turned by the normalized Hadamard
transform (llama.cpp's attention rotation): the query is rotated the same way and
the output rotated back, which leaves attention unchanged but spreads outliers.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from ..kernels import SplitCounter, active_backend, affine_attend, affine_supported
from ..registry import GROUP_SIZES, get_scheme
from ..rotation import rotation_problem
from ..window import GROUP, SINK_TOKENS, groups_to_drop
from .attention import apply_mask
from .base import GmlxCache, array_bytes
from .fp16 import STORE_DTYPE, GrowingBuffer


def group_problem(head_dim: int, group_size: int) -> str | None:
    """Why rows of `head_dim` values cannot be stored in groups of `group_size`, or None: the one home of affine's
    head-dim rule (the cache and the scheme's `declines` ask it)."""
    return f"head_dim {head_dim} is not a multiple of group_size {group_size}" if head_dim % group_size else None


class AffineCache(GmlxCache):
    """K/V quantized per token in groups; fp16 until `quantized_kv_start` tokens have arrived."""

    KERNELS = ("affine_decode",)

    def __init__(
        self,
        bits: int = 8,
        group_size: int = 64,
        quantized_kv_start: int = 0,
        rotate: bool = False,
        layer: int | None = None,
    ):
        super().__init__(layer)
        get_scheme("affine_rot" if rotate else "affine").check(
            self.where(), bits=bits, group_size=group_size, quantized_kv_start=quantized_kv_start)
        self.k_bits = bits
        self.group_size = group_size
        self.quantized_kv_start = quantized_kv_start
        self.rotate = rotate
        self.scheme = "affine_rot" if rotate else "affine"
        self.fp16: tuple[GrowingBuffer, GrowingBuffer] | None = (GrowingBuffer(STORE_DTYPE), GrowingBuffer(STORE_DTYPE))
        self.packed: list[list[GrowingBuffer]] | None = None  # [keys, values] x [codes, scales, biases]
        self._counter = SplitCounter()  # the fused decode kernel's merge counter

    @property
    def quantized(self) -> bool:
        return self.packed is not None

    def _quantize(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        return mx.quantize(x.astype(STORE_DTYPE), group_size=self.group_size, bits=self.k_bits)

    def _dequantize(self, parts: list[mx.array], dtype: mx.Dtype) -> mx.array:
        codes, scales, biases = parts
        if scales.dtype != dtype:
            scales, biases = scales.astype(dtype), biases.astype(dtype)
        return mx.dequantize(codes, scales, biases, group_size=self.group_size, bits=self.k_bits)

    def _check_dims(self, keys: mx.array, values: mx.array) -> None:
        """The first update's head dims must split into groups (later ones must match it: GmlxCache.arrive)."""
        for name, x in (("keys", keys), ("values", values)):
            problem = group_problem(x.shape[-1], self.group_size) if getattr(x, "ndim", 0) == 4 else None
            if problem is None and self.rotate and getattr(x, "ndim", 0) == 4:
                problem = rotation_problem(x.shape[-1])
            if problem:
                raise ValueError(f"{self.where()}: {name} {problem}; use a group size dividing it "
                                 f"({', '.join(map(str, GROUP_SIZES))})")

    def _write_packed(self, start: int, keys: mx.array, values: mx.array) -> None:
        if self.packed is None:
            self.packed = [[GrowingBuffer(mx.uint32), GrowingBuffer(STORE_DTYPE), GrowingBuffer(STORE_DTYPE)]
                           for _ in range(2)]
        for buffers, x in zip(self.packed, (keys, values)):
            for buf, part in zip(buffers, self._quantize(x)):
                buf.write(start, part)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if self._shape is None:
            self._check_dims(keys, values)
        keys, values = self.arrive(keys, values)
        dtype = keys.dtype
        if self.rotate:
            keys, values = mx.hadamard_transform(keys), mx.hadamard_transform(values)
        start = self.held
        self.offset += keys.shape[2]
        if self.quantized:
            self._write_packed(start, keys, values)
        else:
            self.fp16[0].write(start, keys)
            self.fp16[1].write(start, values)
            if self.offset >= self.quantized_kv_start:
                self._write_packed(0, self.fp16[0].view(self.held), self.fp16[1].view(self.held))
                self.fp16 = None
        if self.max_kv_size is not None:
            self._roll(keys.shape[2])
        k, v = self.stored(self.held, dtype)
        if self.rotate:  # hand back K/V in the model's own (unrotated) space
            k, v = mx.hadamard_transform(k), mx.hadamard_transform(v)
        if k.dtype != dtype:
            k, v = k.astype(dtype), v.astype(dtype)
        return self._return(k, v)

    def _roll(self, newest: int) -> None:
        """The rolling window: the oldest groups of tokens after the sink leave (gmlx_lab/window.py)."""
        drop = groups_to_drop(self.held, self.max_kv_size, newest) * GROUP
        if drop:
            buffers = [b for bufs in self.packed for b in bufs] if self.quantized else list(self.fp16)
            for buf in buffers:
                buf.remove(SINK_TOKENS, SINK_TOKENS + drop, self.held)
            self.dropped += drop

    def stored(self, end: int, dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
        """Stored K/V (rotated if `rotate`) as arrays of `dtype`, decoded if quantized.

        The whole buffers are decoded and the result cut to `end` tokens: two graph nodes per array rather than
        four (a decode step builds this graph every token, though the fused path never evaluates it).
        """
        if self.quantized:
            out = (self._dequantize([b.data for b in bufs], dtype) for bufs in self.packed)
            return tuple(x if x.shape[2] == end else x[:, :, :end] for x in out)
        return self.fp16[0].view(end), self.fp16[1].view(end)

    def attend(self, queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any) -> mx.array:
        """Attention from the codes: the fused split-K kernel on a GPU, else two `mx.quantized_matmul` (or, for a
        block of query tokens where that is slow or missing, SDPA over the dequantized codes: `_decoded_block`).

        keys/values are what update_and_fetch returned (the decoded codes); the fused path does not read them.
        """
        route = self.kernel_route(self.quantized and affine_supported(queries, mask), "affine_decode")
        if route is not None:
            parts = [[b.data for b in bufs] for bufs in self.packed]
            return affine_attend(queries, scale, mask, parts, self.held, self.k_bits, self.group_size,
                                 self.rotate, emulate=route == "emulated", counter=self._counter)
        q = mx.hadamard_transform(queries) if self.rotate else queries
        if not self.quantized or self._decoded_block(queries):
            # fp16 rows; or a query block better served by the decoded codes, the very values quantized_matmul
            # would use (see _decoded_block)
            k, v = self.stored(self.held, q.dtype)
            out = mx.fast.scaled_dot_product_attention(q, k.astype(q.dtype), v.astype(q.dtype), scale=scale, mask=mask)
        else:
            qk, qv = ([b.view(self.held) for b in bufs] for bufs in self.packed)
            out = self._quantized_attention(q, qk, qv, scale, mask)
        return mx.hadamard_transform(out) if self.rotate else out

    @staticmethod
    def _decoded_block(queries: mx.array) -> bool:
        """Whether a block of query tokens attends over the dequantized codes rather than two quantized_matmul
        calls (mlx-lm's path, kept on Metal): on CUDA past 4 tokens, where MLX 0.32.4 has no quantized_matmul
        kernel ("No implementation for problem shape"); on the CPU past 1 token, where dequantizing and SDPA
        were 1.9x faster at 4 query tokens and 8x at 512 (one layer, 4096 tokens, head_dim 128, this lab's CPU)."""
        backend = active_backend()
        return queries.shape[2] > {"cuda": 4, "cpu": 1}.get(backend, queries.shape[2])

    def _quantized_attention(self, q: mx.array, qk: list[mx.array], qv: list[mx.array], scale: float,
                             mask: Any) -> mx.array:
        """Scores and output with two `mx.quantized_matmul` calls; K/V are never decoded."""
        b, hq, length, d = q.shape
        hkv = qk[0].shape[1]
        out_dtype = q.dtype
        # The CPU computes in the query's dtype (float32 there); MLX's CUDA quantized_matmul has no float32
        # kernel, so on a GPU the matmuls run in the stored scales' float16, as mlx-lm's own path does.
        dtype = q.dtype if mx.default_device() == mx.cpu else STORE_DTYPE
        q = (q * scale).astype(dtype).reshape(b, hkv, hq // hkv, length, d)
        # broadcast the codes and scales over the GQA group
        qk, qv = ([mx.expand_dims(x if x.dtype == mx.uint32 else x.astype(dtype), 2) for x in parts]
                  for parts in (qk, qv))
        opts = {"group_size": self.group_size, "bits": self.k_bits}
        scores = mx.quantized_matmul(q, *qk, transpose=True, **opts)
        if mask is not None and not isinstance(mask, str) and mask.ndim == 4:
            mask = mx.expand_dims(mask, 2)
        probs = mx.softmax(apply_mask(scores, mask), axis=-1, precise=True)
        out = mx.quantized_matmul(probs, *qv, transpose=False, **opts)
        return out.reshape(b, hq, length, -1).astype(out_dtype)

    def trim(self, n: int) -> int:
        n = self.check_trim(n, self.held, "")
        self.offset -= n
        return n

    def regions(self) -> dict[str, int]:
        if self.quantized:
            codes = array_bytes(*(bufs[0].data for bufs in self.packed))
            scales = array_bytes(*(b.data for bufs in self.packed for b in bufs[1:]))
            cap = self.packed[0][0].capacity()
            used = (codes + scales) * self.held // cap if cap else 0
            return {"codes": codes * self.held // cap, "scales": scales * self.held // cap,
                    "reserve": codes + scales - used}
        total = array_bytes(*(b.data for b in self.fp16))
        cap = self.fp16[0].capacity()
        used = total * self.held // cap if cap else 0
        return {"fp16": used, "reserve": total - used}

    @property
    def state(self) -> tuple[Any, ...]:
        meta = (self.offset, self.k_bits, self.group_size, self.quantized_kv_start, int(self.rotate), self.layer,
                self.max_kv_size, self.dropped, *self.sliding_state())
        if self.offset == 0:
            return (None, None, *meta)
        if self.quantized:
            k, v = ([b.view(self.held) for b in bufs] for bufs in self.packed)
            return (k, v, *meta)
        return (self.fp16[0].view(self.held), self.fp16[1].view(self.held), *meta)

    @state.setter
    def state(self, v: tuple[Any, ...]) -> None:
        keys, values, offset, bits, group_size, start, rotate, layer, max_kv_size, dropped, *sliding = v
        self.__init__(bits, group_size, start, bool(rotate), layer)
        self.offset, self.max_kv_size, self.dropped = offset, max_kv_size, dropped
        self.restore_sliding(sliding)
        if keys is None:
            return
        packed = isinstance(keys, (list, tuple))  # codes as uint32 words of 32 / bits values each
        first_k, first_v = (x[0] if packed else x for x in (keys, values))
        dk, dv = (x.shape[3] * 32 // bits if packed else x.shape[3] for x in (first_k, first_v))
        self._shape = (first_k.shape[0], first_k.shape[1], dk, dv)
        if isinstance(keys, (list, tuple)):
            self.packed = [[GrowingBuffer(p.dtype) for p in keys] for _ in range(2)]
            for bufs, parts in zip(self.packed, (keys, values)):
                for buf, part in zip(bufs, parts):
                    buf.data = part
            self.fp16 = None
        else:
            self.fp16[0].data, self.fp16[1].data = keys, values
