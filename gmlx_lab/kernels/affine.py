"""affine's kernel: decode attention straight from mx.quantize codes (`affine_decode.body`), its launch code and
its pure-MLX emulation; the split-K machinery it shares with kvarn's kernel is `splits.py`.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, NamedTuple

import mlx.core as mx

from .build import graph_function, kernel_backend, launch
from .splits import (
    DTYPE_IDS,
    MAX_QUERY_TOKENS,
    NEG_INF,
    SplitCounter,
    chunks,
    flat,
    float_params,
    group_queries,
    kernel_merges,
    merge_splits,
    split_size,
    step_params,
    ungroup,
    unused_counter,
)

ROTATIONS = ("none", "hadamard", "signed")  # the codes' space, by affine_decode's ROTATE: see its header
QB_MAX = 4  # query vectors (GQA group x query tokens) per affine_decode threadgroup
# affine_decode's threadgroups a call: one wave of four a multiprocessor (its register count allows four) on a
# 132-SM H100 or H200. Each thread waits on its own loads, so a call needs every warp slot it can get; more
# groups than one wave only add splits to merge (docs/gpu-performance.md, "Where issue 56's targets stand")
AFFINE_GROUPS = 528


def affine_qb_max(d: int, kchan: bool = False) -> int:
    """Query vectors per affine_decode threadgroup: QB_MAX, or on Metal, whose threadgroup has 32 KB of memory, as
    many as fit there. Each takes 4 D bytes for itself, at most D / 4 for its group sums, 528 for its softmax
    weights and maxima, and 4 D for each of the token lanes' output rows (128 / (D / 8)); with KIVI's K (`kchan`)
    each also takes 512 for its folded queries, after 4 KB for the four warps' code words (at 8 bits, the widest).
    Three fit at head_dim 1024 (four take 35 KB), with or without kchan."""
    if kernel_backend() != "metal":
        return QB_MAX
    lanes = 128 // (d // 8)
    per_vector = 4 * d + d // 4 + 528 + 4 * lanes * d + (512 if kchan else 0)
    return max(1, min(QB_MAX, (32768 - (4096 if kchan else 0)) // per_vector))


class AffinePlan(NamedTuple):
    """The launch geometry of one affine_decode call: plain ints, the key of its compiled graph
    (build.graph_function)."""

    per: int  # tokens per split
    nsplit: int
    qb: int  # query vectors per threadgroup
    nchunk: int
    bits: int  # K's code width
    vbits: int  # V's
    kchan: bool  # K per channel over blocks of 32 tokens (KIVI), not per token
    lut: bool  # codes index value tables, no offsets (TurboQuant, the microscaling floats), not affine codes
    slut: bool  # the scales are bytes whose values are looked up (the microscaling floats)
    group_size: int  # V's values a scale (and K's, per token)
    length: int  # query tokens
    causal: bool  # with f16, the fp16 split's mask alone (the codes are older than the queries)
    rotate: int  # the codes' space (ROTATIONS): the kernel turns the queries in and the merged output back
    merge: bool  # the kernel merges its own splits (kernel_merges)
    f16: bool  # a last split over a block cache's fp16 tokens (`Fp16Tokens`)


def affine_plan(nq: int, d: int, bh: int, tokens: int, bits: int, group_size: int, length: int, causal: bool,
                per_split: int | None = None, rotate: int = 0, vbits: int | None = None, kchan: bool = False,
                lut: bool = False, slut: bool = False, merge: bool | None = None, f16: bool = False) -> AffinePlan:
    """How an affine_decode call over `tokens` rows splits its work, for nq grouped query vectors of bh kv heads: splits
    of `per_split` tiles, else as many splits as make about AFFINE_GROUPS threadgroups. `bits` is K's width (and
    V's, unless `vbits`); `kchan`: KIVI's K layout; `lut`: codes index value tables, `slut` and so do the scale
    bytes (`value_tables`); `rotate`: the codes' space (an index of ROTATIONS);
    `merge`: whether the kernel merges its splits (by default where it can, `kernel_merges`); `f16`: one more split
    over a block cache's fp16 tokens."""
    merge = kernel_merges() if merge is None else merge
    return _affine_plan(nq, bh, -(-tokens // 128), bits, vbits or bits, kchan, lut, slut, group_size, length, causal,
                        per_split, rotate, affine_qb_max(d, kchan), merge, f16)


@lru_cache(maxsize=256)
def _affine_plan(nq: int, bh: int, tiles: int, bits: int, vbits: int, kchan: bool, lut: bool, slut: bool,
                 group_size: int, length: int, causal: bool, per_split: int | None, rotate: int, qb_max: int,
                 merge: bool, f16: bool) -> AffinePlan:
    """affine_plan's arithmetic, once per geometry (the layers of a decode step repeat it; it moves every 128
    tokens)."""
    qb, nchunk = chunks(nq, qb_max)
    per_tiles = per_split or split_size(tiles, bh * nchunk, AFFINE_GROUPS)
    return AffinePlan(128 * per_tiles, -(-tiles // per_tiles) + f16, qb, nchunk, bits, vbits, kchan, lut, slut,
                      group_size, length, causal, rotate, merge, f16)


def affine_params(plan: AffinePlan, tokens: int, cap: int, scale: float, fp16: tuple[int, int, int] = (0, 0, 0),
                  hkv: int = 1) -> tuple[mx.array, mx.array]:
    """affine_decode's int and float parameter arrays. `fp16`: the sink's tokens, the recent tokens and the recent
    buffer's capacity (plan.f16); `hkv`: kv heads (the signs' rows). The count that moves every step is the
    recent tokens' with plan.f16 (the codes grow a block at a time), else the codes' own."""
    values = (tokens, cap, plan.per, int(plan.causal), *fp16, hkv)
    return step_params(values, 5 if plan.f16 else 0), float_params(scale)


@lru_cache(maxsize=1)
def half_placeholder() -> mx.array:
    """The float16 array affine_decode takes for fp16 stores it does not read (no F16, or no sink)."""
    return mx.zeros((8,), mx.float16)


def affine_split_kernel(plan: AffinePlan, qg: mx.array, kparts: list[mx.array], vparts: list[mx.array],
                        params: mx.array, fparams: mx.array, counter: mx.array, tables: mx.array | None = None,
                        fp16: tuple[mx.array, ...] | None = None, signs: mx.array | None = None
                        ) -> tuple[mx.array, ...]:
    """One affine_decode launch: partials (BH, NSPLIT, NQ, D) and (BH, NSPLIT, NQ) of grouped queries qg (in the
    model's space; the partials in the codes'); with plan.merge their merge (BH, NQ, D) in qg's dtype and the
    model's space, and the counter for the next launch (else placeholders). `counter`: BH * NCHUNK zeros
    (SplitCounter); `tables`: `value_tables` (plan.lut); `fp16`: the sink's K and V and the recent buffers
    (plan.f16, `Fp16Tokens`); `signs`: (Hkv, 1, D), ROTATIONS' "signed"."""
    bh, nq, d = qg.shape
    if plan.merge and counter.size != bh * plan.nchunk:
        raise ValueError(f"affine_decode: a counter of {counter.size} for {bh * plan.nchunk} (kv head, query chunk)s")
    half = half_placeholder()
    sk, sv, rk, rv = fp16 if plan.f16 else (half,) * 4
    inputs = {"q": qg, "kw": kparts[0], "ksc": kparts[1], "kbi": kparts[2], "vw": vparts[0], "vsc": vparts[1],
              "vbi": vparts[2], "params": params, "fparams": fparams, "counter": counter,
              "tables": tables if plan.lut else fparams, "sk": sk, "sv": sv, "rk": rk, "rv": rv,
              "signs": signs if ROTATIONS[plan.rotate] == "signed" else fparams}
    return tuple(launch(
        "affine_decode", inputs,
        {"part_o": ((bh, plan.nsplit, nq, d), mx.float32), "part_lse": ((bh, plan.nsplit, nq), mx.float32),
         "out": ((bh, nq, d) if plan.merge else (1,), qg.dtype),
         "counter_out": ((counter.size,) if plan.merge else (1,), mx.uint32)},
        grid=(128, plan.nsplit, bh * plan.nchunk), threadgroup=(128, 1, 1),
        template={"KBITS": plan.bits, "VBITS": plan.vbits, "KCHAN": int(plan.kchan), "LUT": int(plan.lut),
                  "SLUT": int(plan.slut), "GS": plan.group_size, "D": d,
                  "QB": plan.qb, "NQ": nq, "NCHUNK": plan.nchunk, "L": plan.length, "F16": int(plan.f16),
                  "MERGE": int(plan.merge), "ROTATE": plan.rotate, "QDT": DTYPE_IDS[qg.dtype]},
    ))


def affine_partials(qg: mx.array, scale: float, kparts: list[mx.array], vparts: list[mx.array], tokens: int,
                    bits: int, group_size: int, length: int, causal: bool, per_split: int | None = None,
                    emulate: bool = False, vbits: int | None = None, kchan: bool = False,
                    tables: mx.array | None = None) -> tuple[mx.array, mx.array]:
    """Per-split partial attention over the first `tokens` rows of affine buffers (B, Hkv, CAP, ...); with `kchan`,
    K in KIVI's blocks (B, Hkv, CAP/32, D, ...); with `tables` (`value_tables`), codes that index values, with
    fp16 scales (TurboQuant's norms) or byte scales that index values too (microscaling floats), and no offsets
    ([codes, scales, any] each)."""
    bh, nq, d = qg.shape
    plan = affine_plan(nq, d, bh, tokens, bits, group_size, length, causal, per_split, vbits=vbits, kchan=kchan,
                       lut=tables is not None, slut=vparts[1].dtype == mx.uint8, merge=False)
    if emulate:
        return _affine_emulated(qg.astype(mx.float32) * scale, kparts, vparts, tokens, plan, d, tables)
    part_o, part_lse, *_ = affine_split_kernel(plan, qg, kparts, vparts,
                                               *affine_params(plan, tokens, vparts[0].shape[2], scale),
                                               unused_counter(bh * plan.nchunk), tables)
    return part_o, part_lse


def _affine_emulated(qg: mx.array, kparts: list[mx.array], vparts: list[mx.array], tokens: int, plan: AffinePlan,
                     d: int, tables: mx.array | None = None) -> tuple[mx.array, mx.array]:
    """The affine_decode threadgroup algorithm in MLX: per 128-token tile, scale * (q . codes) + bias * sum(q) (KIVI's
    K: q . (code * scale + bias), channel by channel); values as (p * scale) . codes + sum(p * bias) per group.
    With `tables` a code (and with plan.slut a scale byte) stands for its table's value and the bias is 0."""
    bh, nq, _ = qg.shape
    gs, length, per = plan.group_size, plan.length, plan.per
    ng = d // gs
    vw, vsc, vbi = (flat(p)[:, :tokens] for p in vparts)
    vcode = _unpack_affine(vw, plan.vbits, d)
    if tables is not None:
        vcode, vsc, vbi = _looked_up(tables, 256, vcode, vsc, plan.slut)
    qgrp = qg.reshape(bh, nq, ng, gs)
    qsum = qgrp.sum(axis=-1)
    if plan.kchan:  # KIVI: each block's (D, 32) codes, scaled per channel, as (BH, T, D) key values
        kw, ksc, kbi = (flat(p) for p in kparts)
        blocks = -(-tokens // 32)
        codes = _unpack_affine(kw[:, :blocks], plan.bits, 32)  # (BH, blocks, D, 32)
        keys = codes * ksc[:, :blocks].astype(mx.float32) + kbi[:, :blocks].astype(mx.float32)
        keys = keys.swapaxes(-1, -2).reshape(bh, blocks * 32, d)[:, :tokens]
    else:
        kw, ksc, kbi = (flat(p)[:, :tokens] for p in kparts)
        kcode = _unpack_affine(kw, plan.bits, d)  # (BH, T, D)
        if tables is not None:
            kcode, ksc, kbi = _looked_up(tables, 0, kcode, ksc, plan.slut)
    qtok = mx.arange(nq) % length
    outs, lses = [], []
    for t_begin in range(0, tokens, per):
        m = mx.full((bh, nq), NEG_INF)
        den = mx.zeros((bh, nq))
        acc = mx.zeros((bh, nq, ng, gs))
        for t0 in range(t_begin, min(tokens, t_begin + per), 128):
            t1 = min(tokens, t_begin + per, t0 + 128)
            if plan.kchan:
                score = mx.einsum("bjd,btd->bjt", qg, keys[:, t0:t1])
            else:
                kq = kcode[:, t0:t1].reshape(bh, t1 - t0, ng, gs)
                dq = mx.einsum("bjge,btge->bjtg", qgrp, kq)
                score = (ksc[:, None, t0:t1].astype(mx.float32) * dq
                         + kbi[:, None, t0:t1].astype(mx.float32) * qsum[:, :, None]).sum(axis=-1)
            if plan.causal:
                hidden = mx.arange(t0, t1)[None, :] > (tokens - length + qtok)[:, None]
                score = mx.where(hidden[None], NEG_INF, score)
            m_new = mx.maximum(m, score.max(axis=-1))
            alpha = mx.where(m == NEG_INF, 0.0, mx.exp(m - m_new))
            p = mx.where(score == NEG_INF, 0.0, mx.exp(score - m_new[..., None]))
            den = den * alpha + p.sum(axis=-1)
            vq = vcode[:, t0:t1].reshape(bh, t1 - t0, ng, gs)
            ps = p[..., None] * vsc[:, None, t0:t1].astype(mx.float32)  # (BH, NQ, T, G): p * scale
            pb = (p[..., None] * vbi[:, None, t0:t1].astype(mx.float32)).sum(axis=2)  # sum_t p * bias, per group
            acc = acc * alpha[..., None, None] + mx.einsum("bjtg,btge->bjge", ps, vq) + pb[..., None]
            m = m_new
        outs.append((acc / den[..., None, None]).reshape(bh, nq, d))
        lses.append(m + mx.log(den))
    return mx.stack(outs, axis=1), mx.stack(lses, axis=1)


def _looked_up(tables: mx.array, at: int, codes: mx.array, scales: mx.array, slut: bool
               ) -> tuple[mx.array, mx.array, mx.array]:
    """Codes as their values (the table from `at`), the scales as floats (bytes looked up from 512 with `slut`), and
    zero offsets: what the kernel reads with LUT."""
    values = mx.take(tables[at:at + 256], codes.astype(mx.uint32))
    scales = mx.take(tables[512:], scales.astype(mx.uint32)) if slut else scales.astype(mx.float32)
    return values, scales, mx.zeros_like(scales)


def value_tables(k_values: mx.array, v_values: mx.array, scale_values: mx.array | None = None) -> mx.array:
    """affine_decode's `tables`: what each K code, each V code and (for byte scales) each scale byte stands for,
    float32, at 0, 256 and 512 (at most 256 entries each)."""
    pieces = [mx.pad(x.astype(mx.float32), (0, 256 - x.size)) for x in (k_values, v_values)]
    pieces.append(mx.zeros((256,)) if scale_values is None else mx.pad(scale_values.astype(mx.float32),
                                                                          (0, 256 - scale_values.size)))
    return mx.concatenate(pieces)


def _unpack_affine(words: mx.array, bits: int, d: int) -> mx.array:
    """Codes (..., D) float32 from mx.quantize words (..., D*bits/32): one plain LSB-first bit stream."""
    stream = (words[..., None] >> mx.arange(32, dtype=mx.uint32)) & 1
    stream = stream.reshape(*words.shape[:-1], d, bits)
    return (stream << mx.arange(bits, dtype=mx.uint32)).sum(axis=-1).astype(mx.float32)


def affine_attend(queries: mx.array, scale: float, mask: Any, parts: list[list[mx.array]], tokens: int, bits: int,
                  group_size: int, rotate: bool, emulate: bool = False, counter: SplitCounter | None = None
                  ) -> mx.array:
    """Decode attention over affine codes: one split-K kernel whose last threadgroup per kv head merges the splits
    and, for a rotated cache, rotates the output back (CUDA; elsewhere a second launch, split_merge); no
    dequantized copy. parts: K and V buffers [codes, scales, biases] of (B, Hkv, CAP, ...) whose first `tokens`
    rows hold tokens; `counter`: the cache's SplitCounter (a fresh one each call without it). On a GPU the
    whole is one compiled graph per launch geometry (`build.graph_function`), as for kvarn."""
    b, hq, length, d = queries.shape
    kparts, vparts = parts
    hkv = kparts[0].shape[1]
    causal = isinstance(mask, str) and length > 1
    if emulate:
        q = mx.hadamard_transform(queries) if rotate else queries
        part_o, part_lse = affine_partials(group_queries(q, hkv), scale, kparts, vparts, tokens, bits, group_size,
                                           length, causal, emulate=True)
        out, _ = merge_splits(part_o, part_lse, rotate=rotate, dtype=queries.dtype, emulate=True)
        return ungroup(out, b, hq, length)
    call = AffineCall(queries.shape, scale, causal, parts, tokens, bits, group_size, rotate)
    return call(queries, tokens, counter or SplitCounter())


class AffineCall:
    """An affine_decode call prepared for decode steps, as `KvarnCall`: its plan, compiled graph and the inputs that
    stay (the code buffers, the scale). A step passes the queries, the token count and the counter. The plan
    holds while the tokens stay in one 128-token tile and the buffers are the same objects (AffineCache keeps
    it that long)."""

    def __init__(self, shape: tuple[int, ...], scale: float, causal: bool, parts: list[list[mx.array]], tokens: int,
                 bits: int, group_size: int, rotate: bool):
        b, hq, length, d = shape
        kparts, vparts = parts
        hkv = kparts[0].shape[1]
        self.plan = affine_plan((hq // hkv) * length, d, b * hkv, tokens, bits, group_size, length, causal,
                                rotate=int(rotate))
        self.arrays = (*kparts, *vparts)
        self.cap, self.scale = kparts[0].shape[2], scale
        self.counter_size = b * hkv * self.plan.nchunk
        self.graph = graph_function(_affine_graph, (self.plan, hkv))

    def __call__(self, queries: mx.array, tokens: int, counter: SplitCounter) -> mx.array:
        params = affine_params(self.plan, tokens, self.cap, self.scale)
        out, after = self.graph(queries, *self.arrays, *params, counter.take(self.counter_size))
        counter.put(after)
        return out


def _affine_graph(key: tuple[AffinePlan, int], queries: mx.array, *arrays: mx.array) -> tuple[mx.array, mx.array]:
    """affine decode attention as a graph of arrays: the split kernel (turning the queries in for affine_rot, and
    merging its splits, or then split_merge); returns the output and the counter for the next launch."""
    plan, hkv = key
    b, hq, length, _ = queries.shape
    kw, ksc, kbi, vw, vsc, vbi, params, fparams, counter = arrays
    part_o, part_lse, out, after = affine_split_kernel(plan, group_queries(queries, hkv), [kw, ksc, kbi],
                                                       [vw, vsc, vbi], params, fparams, counter)
    if not plan.merge:
        out, _ = merge_splits(part_o, part_lse, rotate=plan.rotate != 0, dtype=queries.dtype)
        after = counter
    return ungroup(out, b, hq, length), after


def affine_supported(queries: mx.array, mask: Any) -> bool:
    """Whether the fused affine path applies: 1..4 query tokens, mask None or 'causal', and a head dim whose
    8-channel groups tile the 128 threads (32, 64, ..., 1024)."""
    if not 1 <= queries.shape[2] <= MAX_QUERY_TOKENS or queries.dtype not in DTYPE_IDS:
        return False
    d = queries.shape[-1]
    if d % 32 or d > 1024 or 128 % (d // 8):
        return False
    return mask is None or (isinstance(mask, str) and mask == "causal")
