"""Decode attention over a block cache through affine_decode (KIVI's, TurboQuant's and the microscaling floats'
layouts): one launch reads the encoded blocks in place and the cache's fp16 sink and recent tokens as they are
(`Fp16Tokens`), and on CUDA merges it all; no decoded copy, no second attention.

KIVI's blocks: K (B, Hkv, NB, D, ...) with one scale and offset per channel of a 32-token block (`kchan`), V
(B, Hkv, NB, 32, ...) per token in groups of 32 channels. TurboQuant's: K and V (B, Hkv, NB, 32, ...) per token,
codes indexing a codebook (`tables`) times the token's norm, in a rotated space (`rotation`: the kernel turns the
queries in and the blocks' share of the output back). The floats' (mxfp4, nvfp4, mxfp8): per token, E2M1 or E4M3
codes in groups of 32 or 16 sharing a byte scale, both looked up in `tables`. Reading the block and token axes as
one token axis is a free reshape, which makes each of them affine's row layout. Every block is older than the
queries' own tokens (those are still fp16), so only the fp16 tokens take the causal mask.

`block_attend` is the same algorithm in pure MLX (the CPU's check).
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx

from .affine import (
    ROTATIONS,
    AffinePlan,
    affine_params,
    affine_partials,
    affine_plan,
    affine_split_kernel,
    half_placeholder,
    value_tables,
)
from .build import graph_function
from .splits import NEG_INF, SplitCounter, flat, float_params, group_queries, merge_splits, ungroup

__all__ = ["BLOCK_TOKENS", "BlockCall", "BlockLayout", "Fp16Tokens", "block_attend", "value_tables"]

BLOCK_TOKENS = 32  # tokens a KIVI, TurboQuant or float block holds


class Fp16Tokens(NamedTuple):
    """A block cache's fp16 tokens as the kernel reads them, in the model's space: the sink's K and V (B, Hkv, NS, D)
    or None, and the recent tokens' K and V buffers (B, Hkv, RCAP, D), whose first `count` rows hold tokens."""

    sink: tuple[mx.array, mx.array] | None
    recent: tuple[mx.array, mx.array]
    count: int


class BlockLayout(NamedTuple):
    """What affine_decode reads of a block cache: K and V buffers [codes, scales, biases] (B, Hkv, NB, ...); the
    code widths; values a scale (V's, and K's per token); KIVI's per-channel K; what codes (and byte scales) stand
    for (`value_tables`); the blocks' rotation: "none", "hadamard" (normalized Hadamard transform) or "signed"
    (random signs per kv head `signs` (Hkv, 1, D), then the transform: TurboQuant's)."""

    body: list[list[mx.array]]
    bits: tuple[int, int]
    group_size: int
    kchan: bool = False
    tables: mx.array | None = None
    rotation: str = "none"
    signs: mx.array | None = None


def rows(layout: BlockLayout) -> tuple[list[mx.array], list[mx.array]]:
    """K and V buffers with the block and token axes read as one (KIVI's K keeps its blocks)."""
    def flat(x: mx.array) -> mx.array:
        return x.reshape(x.shape[0], x.shape[1], -1, x.shape[-1])
    kparts, vparts = layout.body
    return (list(kparts) if layout.kchan else [flat(x) for x in kparts]), [flat(x) for x in vparts]


def turn_in(queries: mx.array, layout: BlockLayout, hkv: int) -> mx.array:
    """Queries (B, Hq, L, D) in the blocks' space (float32 when turned)."""
    if layout.rotation == "none":
        return queries
    q = queries.astype(mx.float32)
    if layout.rotation == "signed":
        b, hq, length, d = q.shape
        q = (q.reshape(b, hkv, -1, d) * layout.signs).reshape(q.shape)
    return mx.hadamard_transform(q)


def turn_out(x: mx.array, layout: BlockLayout, b: int) -> mx.array:
    """Outputs (B*Hkv, ..., D) in the blocks' space back in the model's."""
    if layout.rotation == "none":
        return x
    out = mx.hadamard_transform(x)
    if layout.rotation == "signed":
        out = (out.reshape(b, x.shape[0] // b, -1, x.shape[-1]) * layout.signs).reshape(x.shape)
    return out


def fp16_split(queries: mx.array, scale: float, fp16: Fp16Tokens, causal: bool) -> tuple[mx.array, mx.array] | None:
    """The kernel's fp16 split in pure MLX: float32 attention of queries (B, Hq, L, D) over the sink and recent
    tokens, the newest L of them the queries' own under the causal mask, as one partial (B*Hkv, 1, G*L, D) and its
    log-sum-exp (B*Hkv, 1, G*L); None where there are no fp16 tokens."""
    pieces = [x for x in (fp16.sink, tuple(r[:, :, :fp16.count] for r in fp16.recent)) if x and x[0].shape[2]]
    if not pieces:
        return None
    k, v = (flat(mx.concatenate(xs, axis=2)).astype(mx.float32) for xs in zip(*pieces))
    b, hq, length, _ = queries.shape
    qg = group_queries(queries.astype(mx.float32), k.shape[0] // b) * scale
    scores = qg @ k.swapaxes(-1, -2)  # (B*Hkv, G*L, T)
    if causal:
        tokens = k.shape[1]
        newest = tokens - length + mx.arange(qg.shape[1]) % length  # the last token query vector j may see
        scores = mx.where(mx.arange(tokens)[None] > newest[:, None], NEG_INF, scores)
    lse = mx.logsumexp(scores, axis=-1)
    return (mx.exp(scores - lse[..., None]) @ v)[:, None], lse[:, None]


def block_attend(queries: mx.array, scale: float, layout: BlockLayout, blocks: int, fp16: Fp16Tokens,
                 causal: bool) -> mx.array:
    """The kernel's algorithm in pure MLX: split partials over the first `blocks` blocks for queries (B, Hq, L, D),
    turned back to the model's space, and the fp16 tokens' split (`fp16_split`), merged by log-sum-exp; the output in
    the queries' dtype."""
    b, hq, length, _ = queries.shape
    kparts, vparts = rows(layout)
    hkv = vparts[0].shape[1]
    part_o, part_lse = affine_partials(group_queries(turn_in(queries, layout, hkv), hkv), scale, kparts, vparts,
                                       blocks * BLOCK_TOKENS, layout.bits[0], layout.group_size, length, False,
                                       emulate=True, vbits=layout.bits[1], kchan=layout.kchan, tables=layout.tables)
    part_o = turn_out(part_o, layout, b)
    split = fp16_split(queries, scale, fp16, causal)
    if split is not None:
        part_o, part_lse = (mx.concatenate([a, c], axis=1) for a, c in zip((part_o, part_lse), split))
    out, _ = merge_splits(part_o, part_lse, dtype=queries.dtype, emulate=True)
    return ungroup(out, b, hq, length)


class BlockCall:
    """A block cache's decode attention prepared for decode steps, as `AffineCall`: its plan, compiled graph
    (`build.graph_function`) and the arrays it reads (the blocks' and the fp16 tokens' buffers, written in place by
    later steps). A step passes the queries, the block count, the recent tokens' count and the cache's counter. It
    holds while the blocks stay in one 128-token tile and the buffers are the same objects; the cache keeps it
    that long (`KernelRoute.kept_call`)."""

    def __init__(self, shape: tuple[int, ...], scale: float, layout: BlockLayout, blocks: int, causal: bool,
                 fp16: Fp16Tokens):
        b, hq, length, d = shape
        kparts, vparts = layout.body
        hkv = vparts[0].shape[1]
        self.plan = affine_plan((hq // hkv) * length, d, b * hkv, blocks * BLOCK_TOKENS, layout.bits[0],
                                layout.group_size, length, causal, vbits=layout.bits[1], kchan=layout.kchan,
                                lut=layout.tables is not None, slut=vparts[1].dtype == mx.uint8,
                                rotate=ROTATIONS.index(layout.rotation), f16=True)
        self.cap, self.scale, self.hkv = vparts[0].shape[2] * BLOCK_TOKENS, scale, hkv
        self.sink = 0 if fp16.sink is None else fp16.sink[0].shape[2]
        self.rcap = fp16.recent[0].shape[2]
        unused = float_params(0.0)  # stands in for the tables and signs a layout has not
        extra = [unused if x is None else x for x in (layout.tables, layout.signs)]
        sink = fp16.sink or (half_placeholder(),) * 2
        self.arrays = (*kparts, *vparts, *extra, *sink, *fp16.recent)
        self.counter_size = b * hkv * self.plan.nchunk
        self.graph = graph_function(_block_graph, (self.plan, hkv))

    def __call__(self, queries: mx.array, blocks: int, recent: int, counter: SplitCounter) -> mx.array:
        params = affine_params(self.plan, blocks * BLOCK_TOKENS, self.cap, self.scale, (self.sink, recent, self.rcap),
                               self.hkv)
        out, after = self.graph(queries, *self.arrays, *params, counter.take(self.counter_size))
        counter.put(after)
        return out


def _block_graph(key: tuple[AffinePlan, int], queries: mx.array, *arrays: mx.array) -> tuple[mx.array, mx.array]:
    """The block attention as a graph of arrays: one kernel launch over the blocks (read as rows) and the fp16
    tokens, which on CUDA also merges its splits and turns the output back; elsewhere split_merge and `turn_out`
    do. Returns the output and the counter for the next launch."""
    plan, hkv = key
    kw, ksc, kbi, vw, vsc, vbi, tables, signs, sk, sv, rk, rv, params, fparams, counter = arrays
    layout = BlockLayout([[kw, ksc, kbi], [vw, vsc, vbi]], (plan.bits, plan.vbits), plan.group_size, plan.kchan,
                         tables if plan.lut else None, ROTATIONS[plan.rotate], signs)
    b, hq, length, _ = queries.shape
    part_o, part_lse, out, after = affine_split_kernel(plan, group_queries(queries, hkv), *rows(layout), params,
                                                       fparams, counter, layout.tables, (sk, sv, rk, rv), signs)
    if not plan.merge:
        out, _ = merge_splits(part_o, part_lse)
        out, after = turn_out(out, layout, b).astype(queries.dtype), counter
    return ungroup(out, b, hq, length), after
