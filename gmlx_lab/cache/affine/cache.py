"""Affine quantization, as mlx-lm's `--kv-bits`: each token's K/V row in groups of N-bit codes.

A block scheme (cache/block.py) whose blocks are single tokens, encoded as they arrive: every `group_size`
values of a row share an fp16 scale and offset (`mx.quantize`, affine mode). Unlike mlx-lm 0.32.2's
QuantizedKVCache, the packed width is `head_dim * bits / 32` words, so 3- and 6-bit caches work for every head
dim. `quantized_kv_start` keeps the tokens fp16 until that many have arrived (`due_blocks`). `AffineRotCache`
(affine_rot) first turns each head by the normalized Hadamard transform (llama.cpp's attention rotation), as
the tokens arrive: the query is rotated the same way and the output rotated back, which leaves attention
unchanged but spreads outliers. What the base does not: attention from the codes (the fused GPU kernel or
`mx.quantized_matmul`, an `attend` override), decoding straight to the model's dtype (`fetch`), the head-dim
rule (`group_problem`) and the window rule of fp16 caches (one-token blocks leave in any whole group).

Two registry entries close the module: affine, and affine_rot (llama.cpp Hadamard-rotates Q/K/V for every quantized
KV cache type by default since April 2026, PR 21038, so affine_rot is that baseline). The byte formula, the roundtrip
and the audit come from the class (BlockScheme), as for a plug-in; the entries name the label and the policy rule.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from ...kernels import MAX_QUERY_TOKENS, AffineCall, SplitCounter, active_backend, affine_attend, affine_supported
from ...registry import Option, register_scheme
from .. import window
from ..attention import quantized_attention
from ..block import BlockCache, BlockScheme
from ..buffers import KV, STORE_DTYPE, GrowingBuffer, array_bytes
from ..kernel_route import KernelRoute
from ..rotation import rotation_problem

AFFINE_BITS = (2, 3, 4, 6, 8)  # the widths mx.quantize's affine mode packs
GROUP_SIZES = (32, 64, 128)  # the group sizes it takes


def group_problem(head_dim: int, group_size: int) -> str | None:
    """Why rows of `head_dim` values cannot be stored in groups of `group_size`, or None: the one home of affine's
    head-dim rule (the cache and the scheme's `declines` ask it)."""
    return f"head_dim {head_dim} is not a multiple of group_size {group_size}" if head_dim % group_size else None


class AffineCache(KernelRoute, BlockCache):
    """K/V quantized per token in groups; fp16 until `quantized_kv_start` tokens have arrived."""

    scheme = "affine"
    block_tokens = 1  # each token's row is quantized on its own
    encode_on_arrival = True
    body_step = GrowingBuffer.STEP  # codes grow in steps of 256 tokens, as in mlx-lm
    KERNELS = ("affine_decode",)
    OPTIONS = (
        Option("bits", 8, "code width in bits", AFFINE_BITS),
        Option("group_size", 64, "values per group sharing one fp16 scale and offset", GROUP_SIZES),
        Option("quantized_kv_start", 0, "keep fp16 until the context reaches this many tokens"),
    )

    def __init__(self, bits: int | None = None, group_size: int | None = None, quantized_kv_start: int | None = None,
                 layer: int | None = None):
        # None: the option's default (OPTIONS); checked and set as self.bits, ... (BlockCache)
        super().__init__(layer, bits=bits, group_size=group_size, quantized_kv_start=quantized_kv_start)
        self._counter = SplitCounter()  # the fused decode kernel's merge counter

    # -- what a block scheme writes ------------------------------------------------------------------------
    def encode(self, x: mx.array, kind: str) -> tuple[mx.array, mx.array, mx.array]:
        """Tokens (B, H, 1, D) -> codes, scales, biases (B, H, ...): mx.quantize in groups of `group_size`."""
        return tuple(p[:, :, 0] for p in self._encode_blocks(x, kind))

    def decode(self, parts: tuple[mx.array, ...], kind: str) -> mx.array:
        return self._decode_blocks(tuple(p[:, :, None] for p in parts), kind)

    def _encode_blocks(self, x: mx.array, kind: str) -> tuple[mx.array, ...]:
        """Rows (B, H, t, D) -> codes, scales, biases (B, H, t, ...) in one `mx.quantize` of the fp16 values: with
        one-token blocks the base's reshapes around `encode` are no-ops, and a decode step would build them anyway."""
        return tuple(mx.quantize(x if x.dtype == STORE_DTYPE else x.astype(STORE_DTYPE), group_size=self.group_size,
                                 bits=self.bits))

    def _decode_blocks(self, parts: tuple[mx.array, ...], kind: str) -> mx.array:
        return self.dequantize(list(parts), mx.float32)

    def _to_encode(self, stored: mx.array) -> mx.array:
        """The stored fp16 tokens as they are (rotated on arrival for affine_rot): mx.quantize reads fp16 values,
        so the base's float32 copy would only be cast back."""
        return stored

    def dequantize(self, parts: list[mx.array], dtype: mx.Dtype) -> mx.array:
        """Codes, scales, biases back to values of `dtype` (the scales cast to it first, as mlx-lm does)."""
        codes, scales, biases = parts
        if scales.dtype != dtype:
            scales, biases = scales.astype(dtype), biases.astype(dtype)
        return mx.dequantize(codes, scales, biases, group_size=self.group_size, bits=self.bits)

    def due_blocks(self, newest: int | None = None) -> int:
        """Every token, once `quantized_kv_start` tokens have arrived; none before (fp16 until then)."""
        return super().due_blocks(newest) if self.offset >= self.quantized_kv_start else 0

    def check_head_dims(self, k_dim: int, v_dim: int) -> None:
        """Rows must split into whole groups (`group_problem`), naming the layer."""
        for name, d in (("keys", k_dim), ("values", v_dim)):
            problem = self.head_dim_problem(d)
            if problem:
                raise ValueError(f"{self.where()}: {name} {problem}; use a group size dividing it "
                                 f"({', '.join(map(str, GROUP_SIZES))})")

    def head_dim_problem(self, head_dim: int) -> str | None:
        """Why this cache cannot store rows of `head_dim` values, or None."""
        return group_problem(head_dim, self.group_size)

    def scale_group(self, kind: str) -> tuple[int, int]:
        """One token's `group_size` channels share a scale and an offset, in K and V."""
        return 1, self.group_size

    def window_check(self, max_kv_size: int | None, where: str | None = None) -> None:
        """The shared rule of gmlx_lab/cache/window.py for fp16 tokens (the sink and one group): one-token blocks leave
        in whole groups whatever the tail."""
        window.check(max_kv_size, None, where or self.where())

    # -- reading ---------------------------------------------------------------------------------------------
    @property
    def quantized(self) -> bool:
        """Whether the tokens are codes yet (False before `quantized_kv_start`)."""
        return self.n_blocks > 0

    def stored(self, end: int, dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
        """Stored K/V (rotated for affine_rot) as arrays of `dtype`, decoded if quantized: the tokens are all codes
        or all fp16 (they become codes together at `quantized_kv_start`).

        The whole buffers are decoded and the result cut to `end` tokens: two graph nodes per array rather than
        four (a decode step builds this graph every token, though the fused path never evaluates it).
        """
        if self.quantized:
            out = (self.dequantize([b.data for b in bufs], dtype) for bufs in self.body_buffers)
            return tuple(x if x.shape[2] == end else x[:, :, :end] for x in out)
        return self.recent.k.view(end), self.recent.v.view(end)

    def fetch(self, dtype: mx.Dtype = mx.float32) -> KV:
        """Every token's K and V in the model's space, decoded straight to `dtype` (BlockCache's fetch decodes to
        float32 first)."""
        k, v = self.stored(self.held, dtype)
        if self.rotate_on_arrival:  # hand back K/V in the model's own (unrotated) space
            k, v = self.unrotate(k), self.unrotate(v)
        if k.dtype != dtype:
            k, v = k.astype(dtype), v.astype(dtype)
        return KV(k, v)

    def attend(self, queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any) -> mx.array:
        """Attention from the codes: the fused split-K kernel on a GPU, else two `mx.quantized_matmul` (or, where
        that is slow or missing, SDPA over the dequantized codes: `_decoded_block`).

        keys/values are what update_and_fetch returned (the decoded codes); the fused path does not read them.
        """
        call = self._fused_call(queries, scale, mask)
        if call is not None:
            return call(queries, self.held, self._counter)
        route = self.kernel_route(self.quantized and affine_supported(queries, mask), "affine_decode")
        if route is not None:
            return affine_attend(queries, scale, mask, self._buffers(), self.held, self.bits, self.group_size,
                                 self.rotate_on_arrival, emulate=route == "emulated", counter=self._counter)
        decoded = not self.quantized or self._decoded_block(queries)
        if decoded:
            out = self.sliced(queries, keys, values, scale, mask)  # a cache longer than a slice of scratch
            if out is not None:
                return out
        q = self.rotate(queries) if self.rotate_on_arrival else queries
        if decoded:
            # fp16 rows; or a query block better served by the decoded codes, the very values quantized_matmul
            # would use (see _decoded_block)
            k, v = self.stored(self.held, q.dtype)
            out = mx.fast.scaled_dot_product_attention(q, k.astype(q.dtype), v.astype(q.dtype), scale=scale, mask=mask)
        else:
            out = self._quantized_attention(q, list(self.body.k), list(self.body.v), scale, mask)
        return self.unrotate(out) if self.rotate_on_arrival else out

    def _buffers(self) -> list[list[mx.array]]:
        """K and V's code, scale and bias buffers, whole (the kernel reads the first `held` rows)."""
        return [[b.data for b in bufs] for bufs in self.body_buffers]

    def _fused_call(self, queries: mx.array, scale: float, mask: Any) -> AffineCall | None:
        """The fused kernel's call for this step, or None where `attend` takes another route, kept while the buffers
        (the same objects until they grow) and the tokens' 128-token tile stay (`kept_call`)."""
        if not self.quantized:
            return None
        buffers = self._buffers()

        def make() -> AffineCall | None:
            if self.kernel_route(affine_supported(queries, mask), "affine_decode") != "fused":
                return None
            return AffineCall(queries.shape, scale, isinstance(mask, str) and queries.shape[2] > 1, buffers,
                              self.held, self.bits, self.group_size, self.rotate_on_arrival)
        return self.kept_call(queries, scale, mask, tuple(buffers[0] + buffers[1]), (-(-self.held // 128),), make)

    @staticmethod
    def _decoded_block(queries: mx.array) -> bool:
        """Whether the queries attend over the dequantized codes rather than two quantized_matmul calls (mlx-lm's
        path, kept on Metal): always on CUDA, where MLX 0.32.4 has no quantized_matmul kernel for a cache's
        shapes, one query token included ("No implementation for problem shape: 1x32769x128x128",
        benchmarks/results/model_decode-paths-w16-h100-80gb-hbm3.json); on the CPU past 1 token, where
        dequantizing and SDPA were 1.9x faster at 4 query tokens and 8x at 512 (one layer, 4096 tokens, head_dim
        128, this lab's CPU); on Metal for a prompt chunk, whose quantized_matmul scores of every query over every
        key would take 16 GiB a layer for 2048 queries over 128K keys, where the decoded codes go a slice at a time
        past the scratch (`sliced`)."""
        backend = active_backend()
        return backend == "cuda" or queries.shape[2] > (1 if backend == "cpu" else MAX_QUERY_TOKENS)

    def _quantized_attention(self, q: mx.array, qk: list[mx.array], qv: list[mx.array], scale: float,
                             mask: Any) -> mx.array:
        """Scores and output with two `mx.quantized_matmul` calls; K/V are never decoded."""
        options = {"group_size": self.group_size, "bits": self.bits}
        return quantized_attention(q, scale, mask, (qk, qv), (options, options), qk[0].shape[2])

    def regions(self) -> dict[str, int]:
        """Codes and scales (with offsets) once quantized, else the fp16 tokens; and the buffers' growth room."""
        r = super().regions()
        if not self.quantized:
            return {"fp16": r["live"] + r["tail"], "reserve": r["reserve"]}
        codes = array_bytes(self.body.k[0], self.body.v[0])
        return {"codes": codes, "scales": r["body"] - codes, "reserve": r["reserve"]}

    def memory_regions(self) -> tuple[dict[str, int], dict[str, int] | None]:
        """Codes and scales (or the fp16 tokens), reserve excluded; each spans every token."""
        return super().memory_regions()[0], None


class AffineRotCache(AffineCache):
    """affine after a per-head Hadamard rotation, applied as the tokens arrive (llama.cpp's attention rotation)."""

    scheme = "affine_rot"
    rotate_on_arrival = True
    rotate = unrotate = staticmethod(mx.hadamard_transform)  # normalized: its own inverse at the accepted dims

    def head_dim_problem(self, head_dim: int) -> str | None:
        """Whole groups, and a rotation that undoes itself at this head dim (gmlx_lab/cache/rotation.py)."""
        return group_problem(head_dim, self.group_size) or rotation_problem(head_dim)


class AffineScheme(BlockScheme):
    """Per-token groups of `group_size` values, each with an fp16 scale and offset; affine_rot rotates first."""

    def label(self, values: dict[str, Any]) -> str:
        return f"{self.name}{values['bits']} g{values['group_size']}"

    def declines(self, kind: str, k_dim: int, v_dim: int, options: dict[str, Any]) -> str | None:
        """A row must split into whole groups; affine_rot's rotation must be undoable at the head dims (the
        class's `head_dim_problem`)."""
        cache = self.cache_class(**options)
        return next((p for d in sorted({k_dim, v_dim}) if (p := cache.head_dim_problem(d))), None)

    def encoded_tokens(self, cache: AffineCache) -> int:
        """None before `quantized_kv_start` tokens have arrived (fp16 until then), else every token held."""
        return super().encoded_tokens(cache) if cache.offset >= cache.quantized_kv_start else 0


AFFINE = register_scheme(AffineScheme(
    "affine", "mlx-lm's grouped affine quantization of each token's K/V row (--kv-bits)",
    cache_class=AffineCache, color="#1f77b4",
    examples=({"bits": 8}, {"bits": 3, "group_size": 32, "quantized_kv_start": 100}, {"bits": 4})))
AFFINE_ROT = register_scheme(AffineScheme(
    "affine_rot", "affine after a per-head Hadamard rotation (llama.cpp's default for quantized KV since "
    "April 2026, PR 21038)",
    cache_class=AffineRotCache, color="#17becf", examples=({"bits": 4}, {"bits": 3})))
