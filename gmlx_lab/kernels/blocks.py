"""Decode attention over a block cache's encoded blocks through affine_decode (KIVI's, TurboQuant's and the
microscaling floats' layouts), merged by log-sum-exp (`split_merge`) with the attention the cache computed over
its fp16 sink and recent tokens.

KIVI's blocks: K (B, Hkv, NB, D, ...) with one scale and offset per channel of a 32-token block (`kchan`), V
(B, Hkv, NB, 32, ...) per token in groups of 32 channels. TurboQuant's: K and V (B, Hkv, NB, 32, ...) per token,
codes indexing a codebook (`tables`) times the token's norm, in a rotated space (`rotation`: the queries turn in,
the blocks' share of the output turns back). The floats' (mxfp4, nvfp4, mxfp8): per token, E2M1 or E4M3 codes in
groups of 32 or 16 sharing a byte scale, both looked up in `tables`. Reading the block and token axes as one token
axis is a free reshape, which makes each of them affine's row layout. Every block is older than the queries' own
tokens (those are still fp16), so the blocks need no causal mask; the fp16 tokens' attention takes it.
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx

from .affine import AffinePlan, affine_params, affine_partials, affine_plan, affine_split_kernel, value_tables
from .build import graph_function
from .splits import float_params, group_queries, merge_splits, ungroup, unused_counter

__all__ = ["BLOCK_TOKENS", "BlockCall", "BlockLayout", "block_attend", "block_partials", "merge_fp16", "value_tables"]

BLOCK_TOKENS = 32  # tokens a KIVI, TurboQuant or float block holds


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


def turn_out(part_o: mx.array, layout: BlockLayout, b: int) -> mx.array:
    """The blocks' partial outputs (B*Hkv, NSPLIT, NQ, D) back in the model's space."""
    if layout.rotation == "none":
        return part_o
    out = mx.hadamard_transform(part_o)
    if layout.rotation == "signed":
        bh, _, _, d = part_o.shape
        out = (out.reshape(b, bh // b, -1, d) * layout.signs).reshape(part_o.shape)
    return out


def block_partials(queries: mx.array, scale: float, layout: BlockLayout, blocks: int, emulate: bool = False
                   ) -> tuple[mx.array, mx.array]:
    """Split partials (B*Hkv, NSPLIT, G*L, D), in the model's space, and their log-sum-exps over the first `blocks`
    blocks for queries (B, Hq, L, D), without a decoded copy. `emulate`: the kernel's algorithm in pure MLX (the
    CPU's check); else one kernel launch."""
    b, _, length, _ = queries.shape
    kparts, vparts = rows(layout)
    hkv = vparts[0].shape[1]
    part_o, part_lse = affine_partials(group_queries(turn_in(queries, layout, hkv), hkv), scale, kparts, vparts,
                                       blocks * BLOCK_TOKENS, layout.bits[0], layout.group_size, length, False,
                                       emulate=emulate, vbits=layout.bits[1], kchan=layout.kchan,
                                       tables=layout.tables)
    return turn_out(part_o, layout, b), part_lse


def merge_fp16(part_o: mx.array, part_lse: mx.array, fp16: tuple[mx.array, mx.array] | None, shape: tuple[int, ...],
               dtype: mx.Dtype, emulate: bool = False) -> mx.array:
    """The blocks' partials merged with `fp16`, the queries' attention over the fp16 tokens (B, Hq, L, D) and its
    log-sum-exp (B, Hq, L), or None: the attention output (B, Hq, L, D) of `shape`, in `dtype`."""
    b, hq, length, _ = shape
    if fp16 is not None:
        out, lse = fp16
        hkv = part_o.shape[0] // b
        part_o = mx.concatenate([part_o, group_queries(out, hkv)[:, None].astype(mx.float32)], axis=1)
        part_lse = mx.concatenate([part_lse, lse.reshape(b * hkv, 1, -1)], axis=1)
    out, _ = merge_splits(part_o, part_lse, dtype=dtype, emulate=emulate)
    return ungroup(out, b, hq, length)


def block_attend(queries: mx.array, scale: float, layout: BlockLayout, blocks: int,
                 fp16: tuple[mx.array, mx.array] | None, emulate: bool = False) -> mx.array:
    """Attention over the blocks and the fp16 tokens (`merge_fp16`), in the queries' dtype, built op by op (the
    emulation, and a first step); a decode step on a GPU keeps a `BlockCall` instead."""
    part_o, part_lse = block_partials(queries, scale, layout, blocks, emulate)
    return merge_fp16(part_o, part_lse, fp16, queries.shape, queries.dtype, emulate)


class BlockCall:
    """A block cache's decode attention prepared for decode steps, as `AffineCall`: its plan and compiled graph
    (`build.graph_function`). A step passes the queries, the block count and the fp16 tokens' attention. It holds
    while the blocks stay in one 128-token tile, the buffers are the same objects and the fp16 tokens are (or are
    not) there; the cache keeps it that long (`KernelRoute.kept_call`)."""

    def __init__(self, shape: tuple[int, ...], scale: float, layout: BlockLayout, blocks: int, fp16: bool):
        b, hq, length, d = shape
        kparts, vparts = layout.body
        hkv = vparts[0].shape[1]
        self.plan = affine_plan((hq // hkv) * length, d, b * hkv, blocks * BLOCK_TOKENS, layout.bits[0],
                                layout.group_size, length, False, vbits=layout.bits[1], kchan=layout.kchan,
                                lut=layout.tables is not None, slut=vparts[1].dtype == mx.uint8, merge=False)
        self.cap, self.scale = vparts[0].shape[2] * BLOCK_TOKENS, scale
        unused = float_params(0.0)  # stands in for the tables and signs a layout has not
        extra = [unused if x is None else x for x in (layout.tables, layout.signs)]
        # the buffers themselves (a step writes blocks into them in place), read as rows inside the graph
        self.arrays = (*kparts, *vparts, *extra, unused_counter(b * hkv * self.plan.nchunk))
        self.graph = graph_function(_block_graph, (self.plan, hkv, layout.rotation, fp16))

    def __call__(self, queries: mx.array, blocks: int, fp16: tuple[mx.array, mx.array] | None) -> mx.array:
        params = affine_params(self.plan, blocks * BLOCK_TOKENS, self.cap, self.scale)
        return self.graph(queries, *self.arrays, *params, *(fp16 or ()))


def _block_graph(key: tuple[AffinePlan, int, str, bool], queries: mx.array, *arrays: mx.array) -> mx.array:
    """The block attention as a graph of arrays: queries turned into the blocks' space, the split kernel, its
    partials turned back and merged with the fp16 tokens' attention (when `key` says there is one)."""
    plan, hkv, rotation, has_fp16 = key
    kw, ksc, kbi, vw, vsc, vbi, tables, signs, counter, params, fparams, *fp16 = arrays
    layout = BlockLayout([[kw, ksc, kbi], [vw, vsc, vbi]], (plan.bits, plan.vbits), plan.group_size, plan.kchan,
                         tables if plan.lut else None, rotation, signs)
    b = queries.shape[0]
    qg = group_queries(turn_in(queries, layout, hkv), hkv)
    part_o, part_lse, *_ = affine_split_kernel(plan, qg, *rows(layout), params, fparams, counter, layout.tables)
    return merge_fp16(turn_out(part_o, layout, b), part_lse, tuple(fp16) if has_fp16 else None, queries.shape,
                      queries.dtype)
