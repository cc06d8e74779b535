"""Fused decode attention for kvarn and affine caches: split-K kernels, their merge, and emulations.

The kernels (`kvarn_decode.body`, `affine_decode.body`, then `split_merge.body`) run on a GPU
backend. `emulate=True` runs the same per-threadgroup algorithm written in pure MLX (per split:
online softmax over record/tile blocks with the same factored dequantization; then the same
log-sum-exp merge), so the CPU can check the kernels' math against the reference attention.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import mlx.core as mx

from ..cache.attention import grouped_attention
from ..cache.records import unpack_rows
from .build import launch

QB_MAX = 8  # query vectors (GQA group x query tokens) handled by one threadgroup
TARGET_GROUPS = 2112  # about 16 threadgroups of 128 threads per multiprocessor of a 132-SM H200
MAX_QUERY_TOKENS = 4
NEG_INF = float("-inf")


def group_queries(q: mx.array, hkv: int) -> mx.array:
    """(B, Hq, L, D) to (B*Hkv, G*L, D) float32: vector j = g*L + l of each kv head."""
    b, hq, length, d = q.shape
    return q.astype(mx.float32).reshape(b * hkv, (hq // hkv) * length, d)


def ungroup(x: mx.array, b: int, hq: int, length: int) -> mx.array:
    """Inverse of `group_queries` for outputs (..., D) or log-sum-exps (B*Hkv, G*L)."""
    return x.reshape(b, hq, length, *x.shape[2:])


@cache
def int_params(*values: int) -> mx.array:
    """A small int32 parameter array, kept so decode steps do not build and upload a new one each call."""
    return mx.array(values, mx.int32)


def _chunks(nq: int) -> tuple[int, int]:
    qb = min(nq, QB_MAX)
    return qb, (nq + qb - 1) // qb


def split_size(units: int, groups_per_split: int) -> int:
    """Units (records or 128-token tiles) per split so that about TARGET_GROUPS groups run."""
    nsplit = max(1, min(units, -(-TARGET_GROUPS // max(groups_per_split, 1))))
    return -(-units // nsplit)


# -- merge --------------------------------------------------------------------------------
def merge_splits(part_o: mx.array, part_lse: mx.array, extra: tuple[mx.array, mx.array] | None = None,
                 emulate: bool = False) -> tuple[mx.array, mx.array]:
    """Merge split partials (BH, NSPLIT, NQ, D) / (BH, NSPLIT, NQ) and an optional extra part into one softmax."""
    bh, nsplit, nq, d = part_o.shape
    if emulate:
        los = [part_lse] + ([] if extra is None else [extra[1][:, None]])
        os_ = [part_o] + ([] if extra is None else [extra[0][:, None]])
        lse_all, o_all = mx.concatenate(los, axis=1), mx.concatenate(os_, axis=1)
        big = lse_all.max(axis=1, keepdims=True)
        w = mx.where(lse_all == NEG_INF, 0.0, mx.exp(lse_all - big))
        den = w.sum(axis=1)
        out = (w[..., None] * o_all).sum(axis=1) / mx.maximum(den, 1e-38)[..., None]
        lse = mx.where(den > 0, big[:, 0] + mx.log(den), NEG_INF)
        return out, lse
    has_extra = extra is not None
    eo, el = extra if has_extra else (mx.zeros((1,), mx.float32), mx.zeros((1,), mx.float32))
    out, lse = launch(
        "split_merge",
        {"part_o": part_o, "part_lse": part_lse, "extra_o": eo, "extra_lse": el,
         "params": int_params(nsplit)},
        {"out": ((bh, nq, d), mx.float32), "lse": ((bh, nq), mx.float32)},
        grid=(d, nq, bh), threadgroup=(min(d, 128), 1, 1),
        template={"D": d, "NQ": nq, "HAS_EXTRA": int(has_extra)},
    )
    return out, lse


# -- kvarn ----------------------------------------------------------------------------------
def kvarn_partials(qg: mx.array, kbody: dict[str, mx.array], vbody: dict[str, mx.array], k_bits: int,
                   v_bits: int, per_split: int | None = None, emulate: bool = False) -> tuple[mx.array, mx.array]:
    """Per-split partial attention of grouped queries qg (BH, NQ, D) over kvarn body records."""
    bh, nq, d = qg.shape
    r, s = kbody["codes"].shape[2:4]
    qb, nchunk = _chunks(nq)
    per = per_split or split_size(r, bh * nchunk)
    nsplit = -(-r // per)
    if emulate:
        return _kvarn_emulated(qg, kbody, vbody, k_bits, v_bits, per)
    inputs = {"q": qg, "kc": kbody["codes"], "ks": kbody["scale_axis"], "kz": kbody["zp_axis"],
              "ko": kbody["other_axis"], "vc": vbody["codes"], "vs": vbody["scale_axis"], "vz": vbody["zp_axis"],
              "vo": vbody["other_axis"], "params": int_params(r, per)}
    return tuple(launch(
        "kvarn_decode", inputs,
        {"part_o": ((bh, nsplit, nq, d), mx.float32), "part_lse": ((bh, nsplit, nq), mx.float32)},
        grid=(128, nsplit, bh * nchunk), threadgroup=(128, 1, 1),
        template={"KB": k_bits, "VB": v_bits, "S": s, "QB": qb, "NQ": nq, "NCHUNK": nchunk},
    ))


def _flat(field: mx.array) -> mx.array:
    """(B, H, R, ...) to (B*H, R, ...)."""
    return field.reshape(-1, *field.shape[2:])


def _kvarn_emulated(qg: mx.array, kbody: dict[str, mx.array], vbody: dict[str, mx.array], k_bits: int,
                    v_bits: int, per: int) -> tuple[mx.array, mx.array]:
    """The kvarn_decode threadgroup algorithm in MLX: factored dequantization, online softmax per record."""
    bh, nq, d = qg.shape
    kc, ks, kz, ko = (_flat(kbody[f]).astype(mx.float32) if f != "codes" else _flat(kbody[f])
                      for f in ("codes", "scale_axis", "zp_axis", "other_axis"))
    vc, vs, vz, vo = (_flat(vbody[f]).astype(mx.float32) if f != "codes" else _flat(vbody[f])
                      for f in ("codes", "scale_axis", "zp_axis", "other_axis"))
    r, s = kc.shape[1:3]
    qs = qg.reshape(bh, nq, s, 128)
    outs, lses = [], []
    for r0 in range(0, r, per):
        m = mx.full((bh, nq), NEG_INF)
        den = mx.zeros((bh, nq))
        acc = mx.zeros((bh, nq, s, 128))
        for rec in range(r0, min(r, r0 + per)):
            kq = unpack_rows(kc[:, rec], k_bits).astype(mx.float32)  # (BH, S, 128 ch, 128 tok)
            kval = kq * ks[:, rec, :, :, None] + kz[:, rec, :, :, None]  # code * scale[c] + zero[c]
            dot = mx.einsum("bjsc,bsct->bjst", qs, kval)
            score = (ko[:, rec][:, None] * dot).sum(axis=2)  # (BH, NQ, 128 tokens)
            m_new = mx.maximum(m, score.max(axis=-1))
            alpha = mx.where(m == NEG_INF, 0.0, mx.exp(m - m_new))
            p = mx.exp(score - m_new[..., None])
            den = den * alpha + p.sum(axis=-1)
            acc = acc * alpha[..., None, None]
            vq = unpack_rows(vc[:, rec], v_bits).astype(mx.float32)  # (BH, S, 128 tok, 128 ch)
            vval = vq * vs[:, rec, :, :, None] + vz[:, rec, :, :, None]
            acc = acc + vo[:, rec][:, None] * mx.einsum("bjt,bstc->bjsc", p, vval)
            m = m_new
        outs.append((acc / den[..., None, None]).reshape(bh, nq, d))
        lses.append(m + mx.log(den))
    return mx.stack(outs, axis=1), mx.stack(lses, axis=1)


def kvarn_attend(cache: Any, queries: mx.array, scale: float, mask: Any, emulate: bool = False) -> mx.array:
    """Decode attention of a KVarNCache: fused body kernel + fp16 sink/recent part, merged by log-sum-exp."""
    q = mx.hadamard_transform(queries)
    b, hq, length, d = q.shape
    hkv = cache.sink[0].shape[1]
    qs = q.astype(mx.float32) * scale
    # fp16 part: sink + live + tail (the queries are the newest tokens, so a causal mask aligns at the end)
    parts = [[p for p in (cache.sink[i], cache.recent[i]) if p is not None] for i in range(2)]
    keys, values = (mx.concatenate(p, axis=2) if len(p) > 1 else p[0] for p in parts)
    o16, lse16 = grouped_attention(qs, keys, values.astype(mx.float32), 1.0, mask)  # float32 scores and weights
    extra = (group_queries(o16, hkv), lse16.reshape(b * hkv, -1))
    part_o, part_lse = kvarn_partials(group_queries(qs, hkv), cache.body[0], cache.body[1], cache.k_bits,
                                      cache.v_bits, emulate=emulate)
    out, _ = merge_splits(part_o, part_lse, extra, emulate=emulate)
    return mx.hadamard_transform(ungroup(out, b, hq, length).astype(queries.dtype))


def kvarn_supported(cache: Any, queries: mx.array, mask: Any) -> bool:
    """Whether the fused path applies: sealed records, 1..4 query tokens, no array mask, queries after the body."""
    if cache.body[0] is None or cache.body[1] is None or not 1 <= queries.shape[2] <= MAX_QUERY_TOKENS:
        return False
    if mask is None:
        return True
    recent = 0 if cache.recent[0] is None else cache.recent[0].shape[2]
    # a causal mask must not reach into the body: every query token has to sit in the recent part
    return isinstance(mask, str) and mask == "causal" and recent >= queries.shape[2]


# -- affine ---------------------------------------------------------------------------------
def affine_partials(qg: mx.array, kparts: list[mx.array], vparts: list[mx.array], tokens: int, bits: int,
                    group_size: int, length: int, causal: bool, per_split: int | None = None,
                    emulate: bool = False) -> tuple[mx.array, mx.array]:
    """Per-split partial attention over the first `tokens` rows of affine buffers (B, Hkv, CAP, ...)."""
    bh, nq, d = qg.shape
    cap = kparts[0].shape[2]
    qb, nchunk = _chunks(nq)
    tiles = -(-tokens // 128)
    per = 128 * (per_split or split_size(tiles, bh * nchunk))
    nsplit = -(-tokens // per)
    if emulate:
        return _affine_emulated(qg, kparts, vparts, tokens, bits, group_size, length, causal, per)
    inputs = {"q": qg, "kw": kparts[0], "ksc": kparts[1], "kbi": kparts[2], "vw": vparts[0], "vsc": vparts[1],
              "vbi": vparts[2], "params": int_params(tokens, cap, per, int(causal))}
    return tuple(launch(
        "affine_decode", inputs,
        {"part_o": ((bh, nsplit, nq, d), mx.float32), "part_lse": ((bh, nsplit, nq), mx.float32)},
        grid=(128, nsplit, bh * nchunk), threadgroup=(128, 1, 1),
        template={"BITS": bits, "GS": group_size, "D": d, "QB": qb, "NQ": nq, "NCHUNK": nchunk, "L": length},
    ))


def _affine_emulated(qg: mx.array, kparts: list[mx.array], vparts: list[mx.array], tokens: int, bits: int,
                     gs: int, length: int, causal: bool, per: int) -> tuple[mx.array, mx.array]:
    """The affine_decode threadgroup algorithm in MLX: per 128-token tile, scale * (q . codes) + bias * sum(q)."""
    bh, nq, d = qg.shape
    ng = d // gs
    kw, ksc, kbi = (_flat(p)[:, :tokens] for p in kparts)
    vw, vsc, vbi = (_flat(p)[:, :tokens] for p in vparts)
    kcode = _unpack_affine(kw, bits, d)  # (BH, T, D)
    vcode = _unpack_affine(vw, bits, d)
    qgrp = qg.reshape(bh, nq, ng, gs)
    qsum = qgrp.sum(axis=-1)
    qtok = mx.arange(nq) % length
    outs, lses = [], []
    for t_begin in range(0, tokens, per):
        m = mx.full((bh, nq), NEG_INF)
        den = mx.zeros((bh, nq))
        acc = mx.zeros((bh, nq, d))
        for t0 in range(t_begin, min(tokens, t_begin + per), 128):
            t1 = min(tokens, t_begin + per, t0 + 128)
            kq = kcode[:, t0:t1].reshape(bh, t1 - t0, ng, gs)
            dq = mx.einsum("bjge,btge->bjtg", qgrp, kq)
            score = (ksc[:, None, t0:t1].astype(mx.float32) * dq
                     + kbi[:, None, t0:t1].astype(mx.float32) * qsum[:, :, None]).sum(axis=-1)
            if causal:
                hidden = mx.arange(t0, t1)[None, :] > (tokens - length + qtok)[:, None]
                score = mx.where(hidden[None], NEG_INF, score)
            m_new = mx.maximum(m, score.max(axis=-1))
            alpha = mx.where(m == NEG_INF, 0.0, mx.exp(m - m_new))
            p = mx.where(score == NEG_INF, 0.0, mx.exp(score - m_new[..., None]))
            den = den * alpha + p.sum(axis=-1)
            vq = vcode[:, t0:t1].reshape(bh, t1 - t0, ng, gs)
            vval = vq * vsc[:, t0:t1, :, None].astype(mx.float32) + vbi[:, t0:t1, :, None].astype(mx.float32)
            acc = acc * alpha[..., None] + mx.einsum("bjt,btd->bjd", p, vval.reshape(bh, t1 - t0, d))
            m = m_new
        outs.append(acc / den[..., None])
        lses.append(m + mx.log(den))
    return mx.stack(outs, axis=1), mx.stack(lses, axis=1)


def _unpack_affine(words: mx.array, bits: int, d: int) -> mx.array:
    """Codes (..., D) float32 from mx.quantize words (..., D*bits/32): one plain LSB-first bit stream."""
    stream = (words[..., None] >> mx.arange(32, dtype=mx.uint32)) & 1
    stream = stream.reshape(*words.shape[:-1], d, bits)
    return (stream << mx.arange(bits, dtype=mx.uint32)).sum(axis=-1).astype(mx.float32)


def affine_attend(cache: Any, queries: mx.array, scale: float, mask: Any, emulate: bool = False) -> mx.array:
    """Decode attention of a quantized AffineCache with the fused split-K kernel (no dequantized copy)."""
    q = mx.hadamard_transform(queries) if cache.rotate else queries
    b, hq, length, d = q.shape
    kparts, vparts = ([buf.data for buf in bufs] for bufs in cache.packed)
    hkv = kparts[0].shape[1]
    qg = group_queries(q.astype(mx.float32) * scale, hkv)
    causal = isinstance(mask, str) and length > 1
    part_o, part_lse = affine_partials(qg, kparts, vparts, cache.offset, cache.k_bits, cache.group_size, length,
                                       causal, emulate=emulate)
    out, _ = merge_splits(part_o, part_lse, emulate=emulate)
    out = ungroup(out, b, hq, length).astype(queries.dtype)
    return mx.hadamard_transform(out) if cache.rotate else out


def affine_supported(cache: Any, queries: mx.array, mask: Any) -> bool:
    """Whether the fused affine path applies: quantized, 1..4 query tokens, mask None or 'causal'."""
    if not cache.quantized or not 1 <= queries.shape[2] <= MAX_QUERY_TOKENS:
        return False
    return mask is None or (isinstance(mask, str) and mask == "causal")
