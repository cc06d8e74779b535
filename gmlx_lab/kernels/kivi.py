"""KIVI's decode attention from its codes: affine_decode in its per-channel K layout (`KCHAN = 1`) over the blocks,
merged by log-sum-exp (`split_merge`) with the attention the cache computed over its fp16 sink and recent tokens.

The blocks are KiviCache's body buffers: K (B, Hkv, NB, D, ...) with one scale and offset per channel of a
32-token block, V (B, Hkv, NB, 32, ...) per token in groups of 32 channels, which is affine's row layout once the
block and token axes are read as one (a free reshape). Every block is older than the queries' own tokens (those
are still fp16), so the blocks need no causal mask; the fp16 tokens' attention takes it.
"""

from __future__ import annotations

import mlx.core as mx

from .affine import affine_partials
from .splits import group_queries, merge_splits, ungroup

KIVI_BLOCK = 32  # tokens a K channel's scale and offset span; V's group of channels is as wide


def kivi_attend(queries: mx.array, scale: float, body: list[list[mx.array]], blocks: int,
                fp16: tuple[mx.array, mx.array] | None, bits: tuple[int, int], emulate: bool = False) -> mx.array:
    """Attention of queries (B, Hq, L, D) over `blocks` KIVI blocks (body: K and V buffers [codes, scales, biases])
    and the fp16 tokens after them, without a decoded copy of the blocks. `fp16`: the queries' attention over those
    tokens (B, Hq, L, D) and its log-sum-exp (B, Hq, L), or None; `bits`: K's and V's code widths; `emulate`: the
    kernel's algorithm in pure MLX (the CPU's check)."""
    b, hq, length, d = queries.shape
    (kw, ksc, kbi), (vw, vsc, vbi) = body
    hkv = kw.shape[1]
    rows = vw.shape[2] * KIVI_BLOCK  # V's capacity in token rows
    vparts = [x.reshape(b, hkv, rows, x.shape[-1]) for x in (vw, vsc, vbi)]
    qg = group_queries(queries, hkv)
    part_o, part_lse = affine_partials(qg, scale, [kw, ksc, kbi], vparts, blocks * KIVI_BLOCK, bits[0], KIVI_BLOCK,
                                       length, False, emulate=emulate, vbits=bits[1], kchan=True)
    if fp16 is not None:
        out, lse = fp16
        part_o = mx.concatenate([part_o, group_queries(out, hkv)[:, None].astype(mx.float32)], axis=1)
        part_lse = mx.concatenate([part_lse, lse.reshape(b * hkv, 1, -1)], axis=1)
    out, _ = merge_splits(part_o, part_lse, dtype=queries.dtype, emulate=emulate)
    return ungroup(out, b, hq, length)
