"""Decode attention over a block cache's encoded blocks through affine_decode (KIVI's, TurboQuant's and the
microscaling floats' layouts), merged by log-sum-exp (`split_merge`) with the attention the cache computed over
its fp16 sink and recent tokens.

KIVI's blocks: K (B, Hkv, NB, D, ...) with one scale and offset per channel of a 32-token block (`kchan`), V
(B, Hkv, NB, 32, ...) per token in groups of 32 channels. TurboQuant's: K and V (B, Hkv, NB, 32, ...) per token,
codes indexing a codebook (`tables`) times the token's norm, in the cache's rotated space (the cache rotates the
queries in and the partial outputs back). The floats' (mxfp4, nvfp4, mxfp8): per token, E2M1 or E4M3 codes in
groups of 32 or 16 sharing a byte scale, both looked up in `tables`. Reading the block and token axes as one
token axis is a free reshape, which makes each of them affine's row layout. Every block is older than the
queries' own tokens (those are still fp16), so the blocks need no causal mask; the fp16 tokens' attention
takes it.
"""

from __future__ import annotations

import mlx.core as mx

from .affine import affine_partials, value_tables
from .splits import group_queries, merge_splits, ungroup

BLOCK_TOKENS = 32  # tokens a KIVI, TurboQuant or float block holds

__all__ = ["BLOCK_TOKENS", "block_partials", "merge_fp16", "value_tables"]


def block_partials(queries: mx.array, scale: float, body: list[list[mx.array]], blocks: int, bits: tuple[int, int],
                   group_size: int, kchan: bool = False, tables: mx.array | None = None,
                   emulate: bool = False) -> tuple[mx.array, mx.array]:
    """Split partials (B*Hkv, NSPLIT, G*L, D) and their log-sum-exps over `blocks` blocks of `body` (K and V buffers
    [codes, scales, biases] of (B, Hkv, NB, ...)) for queries (B, Hq, L, D), without a decoded copy. `bits`: K's and V's
    code widths; `kchan`: KIVI's K layout; `tables`: what codes stand for (`affine.value_tables`); `emulate`: the
    kernel's algorithm in pure MLX (the CPU's check)."""
    b, _, length, _ = queries.shape
    kparts, vparts = body
    hkv = vparts[0].shape[1]
    rows = vparts[0].shape[2] * BLOCK_TOKENS  # capacity in token rows
    vparts = [x.reshape(b, hkv, rows, x.shape[-1]) for x in vparts]
    if not kchan:
        kparts = [x.reshape(b, hkv, rows, x.shape[-1]) for x in kparts]
    return affine_partials(group_queries(queries, hkv), scale, kparts, vparts, blocks * BLOCK_TOKENS, bits[0],
                           group_size, length, False, emulate=emulate, vbits=bits[1], kchan=kchan, tables=tables)


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
