"""Kernel routing, mixins only the schemes with fused GPU kernels inherit: which path `attend` takes (the fused
kernel, its emulation or the pure-MLX reference), whether a kernel passed its self-check, and the fused call a
decode step keeps (`KernelRoute`: kvarn, affine); and the attention of block caches whose blocks affine's kernel
reads (`BlockKernelRoute`: KIVI, TurboQuant, the floats), and on the CPU, where no kernel runs, their decode steps
through `mx.quantized_matmul` where their codes are mx.quantize's (KIVI, the 4-bit floats), else in the blocks'
rotated space where they are rotated (TurboQuant, mxfp8_rot). A pure-MLX scheme never imports this module, so it
never loads the kernel layer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import mlx.core as mx

from ..kernels import (
    MAX_QUERY_TOKENS,
    BlockCall,
    BlockLayout,
    Fp16Tokens,
    SplitCounter,
    active_backend,
    affine_supported,
    block_attend,
    precompiled,
    selfcheck,
)
from .attention import quantized_attention, slice_tokens, sliced_attention
from .block import joined
from .buffers import KV


class KernelRoute:
    """For a cache with `attention_path`, `ATTENTION_PATHS` and `where()` (the cache base)."""

    KERNELS: tuple[str, ...] = ()  # the fused kernels this cache uses on a GPU (each self-checked on first use)
    _call: tuple[tuple[Any, ...], tuple[Any, ...], Any] | None = None  # what kept_call keeps
    _prefix: tuple[Any, Any, KV] | None = None  # what kept_prefix keeps: (body, sink, their decoded graph)

    def kernel_route(self, supported: bool, kernel: str) -> str | None:
        """How `attend` runs: "fused" or "emulated" kernel algorithm, or None for the reference path.

        The fused route needs `kernel` to have passed its self-check on this GPU (kernels/selfcheck.py);
        if it failed, "auto" takes the reference path (the check warned) and "fused" is an error."""
        path = self.attention_path
        if path not in self.ATTENTION_PATHS:
            raise ValueError(f"{self.where()}: attention_path={path!r}; accepted: {', '.join(self.ATTENTION_PATHS)}")
        if path == "reference" or not supported:
            return None
        if path == "emulated":
            return "emulated"
        if not self.may_fuse():  # "auto" on the CPU
            return None
        if not selfcheck.passed(kernel):
            if path == "fused":
                raise RuntimeError(f"{self.where()}: kernel {kernel} failed its self-check on this GPU "
                                   f"({selfcheck.failure(kernel)}); use attention_path='auto' or 'reference'")
            return None
        return "fused"

    def may_fuse(self) -> bool:
        """Whether `kernel_route` can answer "fused" at all (the "fused" path, or "auto" on a GPU backend): a
        cheap test first, so the CPU's reference path does not prepare a fused call at every step."""
        path = self.attention_path
        return path == "fused" or (path == "auto" and active_backend() != "cpu")

    def uses_kernel(self, kernel: str) -> bool:
        """Whether this cache runs `kernel` (sealing, decoding) rather than its pure-MLX twin: a GPU backend, not
        the reference path, and a passed self-check."""
        return self.attention_path != "reference" and active_backend() != "cpu" and selfcheck.passed(kernel)

    def attention_route(self) -> str:
        """How this cache attends and stores on this machine, in words (the fused kernels, or why not)."""
        if self.attention_path == "reference" or not self.KERNELS:
            return "reference (pure MLX)" if self.KERNELS else "mlx.fast.scaled_dot_product_attention"
        if active_backend() == "cpu":
            return "reference (pure MLX: no GPU backend)"
        failed = [f"{k}: {selfcheck.failure(k)}" for k in self.KERNELS if not selfcheck.passed(k)]
        if failed:
            return "reference for " + "; ".join(failed) + " (failed self-check)"
        note = precompiled.note()
        return "fused kernels: " + ", ".join(self.KERNELS) + (f" ({note})" if note else "")

    def kept_prefix(self, dtype: mx.Dtype, make: Callable[[mx.Dtype], KV]) -> KV:
        """The decoded sink and body a decode step's fetch joins the recent tokens to (`make(dtype)`), built as a
        graph once and kept while the body and the sink are the same objects and `dtype` the same: the fused
        kernels never read it, so it is evaluated only if the model reads the K/V itself."""
        kept = self._prefix
        if kept is None or kept[0] is not self.body or kept[1] is not self.sink or kept[2][0].dtype != dtype:
            kept = self._prefix = (self.body, self.sink, make(dtype))
        return kept[2]

    def kept_call(self, queries: mx.array, scale: float, mask: Any, objects: tuple[Any, ...], values: tuple[Any, ...],
                  make: Callable[[], Any]) -> Any:
        """A decode step's fused call (`make()`, or None where attention takes another route; None at once where no
        fused route can apply: `may_fuse`, or an array mask), kept from the last step while what it was made from
        is the same: `objects` (the arrays it reads) the very same objects, and the route's inputs (the path,
        `selfcheck.context`), the queries' geometry and the scheme's `values` equal. Asking it all again every
        step costs more host time than the launch itself (docs/history/gpu-rounds.md). A cache that replaces an
        array sets `_call` to None."""
        if not self.may_fuse() or not (mask is None or isinstance(mask, str)):
            return None
        values = (queries.shape, queries.dtype, scale, mask, self.attention_path, selfcheck.context(), *values)
        kept = self._call
        if kept is not None and kept[1] == values and all(a is b for a, b in zip(kept[0], objects)):
            return kept[2]
        call = make()
        self._call = (objects, values, call)
        return call


class MatmulCodes(NamedTuple):
    """How `mx.quantized_matmul` reads a block cache's codes (`BlockKernelRoute.matmul_codes`): mx.quantize's options
    for K and V, the self-inverse rotation the blocks live in (or None), and whether K's blocks hold channels as rows
    (quantized along the block's tokens: KIVI) rather than tokens."""

    options: tuple[dict[str, Any], dict[str, Any]]
    turn: Callable[[mx.array], mx.array] | None = None
    k_channels: bool = False


class BlockKernelRoute(KernelRoute):
    """For a block cache whose blocks affine_decode reads in place (KIVI, TurboQuant, the floats: kernels/blocks.py):
    `attend` in one launch over the codes and the fp16 sink and recent tokens, where `kernel_layout` gives the
    blocks' layout; elsewhere (the CPU, no block yet, V rows wider or narrower than K's, a layout the kernel lacks)
    the base's reference path. The kernel reads the fp16 tokens in the model's space, so a cache that rotates
    them on arrival (`rotate_on_arrival`, a plug-in's choice) takes the reference path too."""

    KERNELS = ("affine_decode",)
    _counter: SplitCounter | None = None  # the merging kernel's counter, one per cache

    def kernel_layout(self) -> BlockLayout | None:
        """What the kernel reads of the blocks, or None where it cannot read them."""
        raise NotImplementedError

    def attend(self, queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any) -> mx.array:
        ready = (self.n_blocks and not self.rotate_on_arrival and self.recent.k.data is not None
                 and values.shape[-1] == queries.shape[-1])
        layout = self.kernel_layout() if ready else None
        route = self.kernel_route(layout is not None and affine_supported(queries, mask), "affine_decode")
        if route is None:
            if self.quantized_matmul_step(queries, values, mask):
                codes = self.matmul_codes()
                if codes is not None:
                    return self.codes_attention(queries, scale, mask, codes)
                if self.rotated_step():
                    return self.rotated_attention(queries, scale, mask)
            return super().attend(queries, keys, values, scale, mask)
        fp16 = Fp16Tokens(self.sink, KV(self.recent.k.data, self.recent.v.data), self.recent_count)
        causal = isinstance(mask, str) and queries.shape[2] > 1
        if route == "emulated":
            return block_attend(queries, scale, layout, self.n_blocks, fp16, causal)
        objects = (*(x for parts in layout.body for x in parts), *(fp16.sink or ()), *fp16.recent)
        call = self.kept_call(queries, scale, mask, objects, (-(-self.n_blocks // 4),),
                              lambda: BlockCall(queries.shape, scale, layout, self.n_blocks, causal, fp16))
        if self._counter is None:
            self._counter = SplitCounter()
        return call(queries, self.n_blocks, self.recent_count, self._counter)

    def matmul_codes(self) -> MatmulCodes | None:
        """How `mx.quantized_matmul` reads the blocks, for a decode step on the CPU; None (the reference path) where
        they are not mx.quantize's codes or that is slower than decoding them."""
        return None

    def quantized_matmul_step(self, queries: mx.array, values: mx.array, mask: Any) -> bool:
        """Whether a decode step may attend from the codes by two `mx.quantized_matmul` calls: "auto" on the CPU
        (where no fused kernel runs), one query token (past it, decoding won for affine's codes, AffineCache),
        blocks held, K and V of the queries' width, no array mask, and nothing rotated on arrival. Decoding every
        block each step cost most of a CPU step (benchmarks/cpu_attention.py)."""
        return (self.attention_path == "auto" and active_backend() == "cpu" and self.n_blocks > 0
                and queries.shape[2] == 1 and (mask is None or isinstance(mask, str)) and not self.rotate_on_arrival
                and values.shape[-1] == queries.shape[-1])

    def rotated_step(self) -> bool:
        """Whether a CPU decode step that cannot read the codes through `mx.quantized_matmul` attends in the blocks'
        rotated space (`rotated_attention`): a cache whose blocks are rotated. None are by default."""
        return False

    def rotated_attention(self, queries: mx.array, scale: float, mask: Any) -> mx.array:
        """Attention a slice of the cache at a time (attention.sliced_attention) in the blocks' rotated space: the
        queries turned into it once and the output turned back once, so no decoded token is turned back (a
        Hadamard transform of every token of K and V each step, otherwise)."""
        b, hq, length, d = queries.shape
        hkv = self.body.k[0].shape[1]

        def turned(x: mx.array, turn: Callable[[mx.array], mx.array]) -> mx.array:  # a kv head's queries as one
            return turn(x.reshape(b, hkv, -1, d)).reshape(b, hq, length, d)       # matrix: its rotation's rows

        tokens = slice_tokens(queries, hkv, d, self.block_tokens)
        out = sliced_attention(turned(queries, self.rotate), scale, mask,
                               self.key_slices(queries.dtype, tokens, rotated=True))
        return turned(out, self.unrotate)

    def codes_attention(self, queries: mx.array, scale: float, mask: Any, codes: MatmulCodes) -> mx.array:
        """Attention over the blocks' codes by `mx.quantized_matmul` and the fp16 sink and recent tokens, in one
        softmax (attention.quantized_attention); the blocks' buffers are read whole, their spare rows unweighted."""
        n = self.recent_count
        pieces = ([self.sink] if self.sink is not None else []) + ([KV(self.recent.k.view(n), self.recent.v.view(n))]
                                                                   if n else [])
        fp16 = joined(pieces, queries.dtype) if pieces else None
        k_parts, v_parts = ([b.data for b in bufs] for bufs in self.body_buffers)
        if not codes.k_channels:  # blocks of token rows read as one token axis: a free reshape
            k_parts = [x.reshape(*x.shape[:2], -1, x.shape[-1]) for x in k_parts]
        v_parts = [x.reshape(*x.shape[:2], -1, x.shape[-1]) for x in v_parts]
        return quantized_attention(queries, scale, mask, (k_parts, v_parts), codes.options,
                                   self.n_blocks * self.block_tokens, fp16, codes.turn, codes.k_channels)

    def fetch(self, dtype: mx.Dtype = mx.float32) -> KV:
        """Every token's K and V, as the block base fetches them. For a decode step that may take the fused route,
        which never reads them, the decoded sink and body are built as a graph once per change of the blocks and
        reused (evaluated only if the model reads the K/V itself, then kept until the next block is sealed): a
        step builds a concatenation with the recent tokens, not a decode of every block."""
        if not (self.body is not None and self.arrived <= MAX_QUERY_TOKENS and self.may_fuse()):
            return super().fetch(dtype)
        return self.with_recent(self.kept_prefix(dtype, self.decoded_prefix), dtype)
