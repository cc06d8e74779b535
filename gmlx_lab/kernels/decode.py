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

from ..cache.records import unpack_rows
from .build import kernel_backend, launch

QB_MAX = 4  # query vectors (GQA group x query tokens) per affine_decode threadgroup
TARGET_GROUPS = 2112  # about 16 threadgroups of 128 threads per multiprocessor of a 132-SM H200
MAX_QUERY_TOKENS = 4
NEG_INF = float("-inf")
DTYPE_IDS = {mx.float32: 0, mx.float16: 1, mx.bfloat16: 2}  # names the compiled variant per dtype


def group_queries(q: mx.array, hkv: int) -> mx.array:
    """(B, Hq, L, D) to (B*Hkv, G*L, D): vector j = g*L + l of each kv head (a free reshape)."""
    b, hq, length, d = q.shape
    return q.reshape(b * hkv, (hq // hkv) * length, d)


def ungroup(x: mx.array, b: int, hq: int, length: int) -> mx.array:
    """Inverse of `group_queries` for outputs (..., D) or log-sum-exps (B*Hkv, G*L)."""
    return x.reshape(b, hq, length, *x.shape[2:])


@cache
def int_params(*values: int) -> mx.array:
    """A small int32 parameter array, kept so decode steps do not build and upload a new one each call. It has
    at least 8 entries (zeros after the values), so that build.launch need not pad it for Metal each call."""
    return mx.array(values + (0,) * (8 - len(values)), mx.int32)


@cache
def float_params(*values: float) -> mx.array:
    """A small float32 parameter array (the softmax scale), kept and padded like `int_params`."""
    return mx.array(values + (0.0,) * (8 - len(values)), mx.float32)


def affine_qb_max(d: int) -> int:
    """Query vectors per affine_decode threadgroup: QB_MAX, but 3 past head_dim 512 on Metal, where a threadgroup
    has 32 KB of memory and each query vector takes 4 D bytes + 4.6 KB of it (itself, its softmax weights and
    the token lanes' outputs): 35 KB for four at head_dim 1024."""
    return 3 if d > 512 and kernel_backend() == "metal" else QB_MAX


def _chunks(nq: int, qb_max: int) -> tuple[int, int]:
    qb = max(1, min(nq, qb_max))
    return qb, (nq + qb - 1) // qb


def split_size(units: int, groups_per_split: int) -> int:
    """Units (records or 128-token tiles) per split so that about TARGET_GROUPS groups run."""
    nsplit = max(1, min(units, -(-TARGET_GROUPS // max(groups_per_split, 1))))
    return -(-units // nsplit)


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


# -- merge --------------------------------------------------------------------------------
def merge_splits(part_o: mx.array, part_lse: mx.array, rotate: bool = False, dtype: mx.Dtype = mx.float32,
                 emulate: bool = False) -> tuple[mx.array, mx.array]:
    """Merge split partials (BH, NSPLIT, NQ, D) / (BH, NSPLIT, NQ) into one softmax: out (BH, NQ, D), lse.

    rotate=True also applies the normalized Hadamard transform to the merged output (kvarn and rotated
    affine caches attend in rotated space); the output has `dtype`.
    """
    bh, nsplit, nq, d = part_o.shape
    if emulate:
        big = part_lse.max(axis=1, keepdims=True)
        w = mx.where(part_lse == NEG_INF, 0.0, mx.exp(part_lse - big))
        den = w.sum(axis=1)
        out = (w[..., None] * part_o).sum(axis=1) / mx.maximum(den, 1e-38)[..., None]
        lse = mx.where(den > 0, big[:, 0] + mx.log(den), NEG_INF)
        out = mx.hadamard_transform(out) if rotate else out
        return out.astype(dtype), lse
    fused_rotation = rotate and _is_pow2(d)
    out, lse = launch(
        "split_merge",
        {"part_o": part_o, "part_lse": part_lse, "params": int_params(nsplit)},
        {"out": ((bh, nq, d), dtype), "lse": ((bh, nq), mx.float32)},
        grid=(d, nq, bh), threadgroup=(d, 1, 1),
        template={"D": d, "NQ": nq, "ROTATE": int(fused_rotation), "ODT": DTYPE_IDS[dtype]},
    )
    if rotate and not fused_rotation:
        out = mx.hadamard_transform(out)
    return out, lse


# -- kvarn ----------------------------------------------------------------------------------
KVARN_WARPS = 4  # warps per kvarn_decode threadgroup; each walks its own run of units
METAL_MAX_HEAD_DIM = 512  # kvarn_decode on Metal: past it the queries and one slice's outputs fill 32 KB
KVARN_QN = 8  # query vectors per kvarn_decode threadgroup: the n of its 16x8x16 tensor-core products
# One wave of warps on an H200: 132 multiprocessors x 3 threadgroups of 4 warps (the kernel's 158 registers
# per thread allow 3); more would leave a second, mostly idle wave.
TARGET_WARPS = 132 * 12


def _fp16_parts(cache: Any) -> tuple[mx.array, mx.array, mx.array | None, mx.array | None]:
    """The sink's and the recent tokens' K, V (B, H, n, D) float16 (recent may be None)."""
    return cache.sink[0], cache.sink[1], cache.recent[0], cache.recent[1]


def kvarn_warps(d: int) -> int:
    """Warps per kvarn_decode threadgroup: KVARN_WARPS, but 2 past head_dim 256 on Metal, where a threadgroup
    has 32 KB of memory: the queries (8 x D floats) and four warps' softmax weights (16.5 KB) do not fit."""
    return 2 if d > 256 and kernel_backend() == "metal" else KVARN_WARPS


def kvarn_units(records: int, recent: int) -> int:
    """Units of kvarn decode work: the body records, the fp16 sink, one per 128 recent tokens."""
    return records + 1 + -(-recent // 128)


def kvarn_partials(qg: mx.array, scale: float, cache: Any, length: int, causal: bool, per_warp: int | None = None,
                   emulate: bool = False) -> tuple[mx.array, mx.array]:
    """Per-split partial attention of grouped queries qg (BH, NQ, D) over a whole kvarn cache, which holds
    rotated K/V: the queries are rotated first (inside the kernel when D is a power of two).

    Units run in the order records, sink, recent tiles; each warp takes `per_warp` of them and a split
    is one threadgroup's `kvarn_warps(D)` runs. Returns part_o (BH, NSPLIT, NQ, D), part_lse (BH, NSPLIT, NQ).
    """
    bh, nq, d = qg.shape
    kbody, vbody = cache.body
    r, s = kbody["codes"].shape[2:4]
    nchunk = -(-nq // KVARN_QN)
    sk, sv, rk, rv = _fp16_parts(cache)
    ns = sk.shape[2]
    nr = 0 if rk is None else rk.shape[2]
    units = kvarn_units(r, nr)
    per = per_warp or -(-units // -(-TARGET_WARPS // (bh * nchunk)))
    warps = kvarn_warps(d)
    nsplit = -(-units // (per * warps))
    if emulate:
        return _kvarn_emulated(mx.hadamard_transform(qg) * scale, cache, length, causal, per * warps)
    rotate_here = _is_pow2(d)
    if not rotate_here:
        qg = mx.hadamard_transform(qg)
    if nr == 0:  # no recent tokens: a placeholder input the kernel never reads
        rk = rv = mx.zeros((1,), mx.float16)
    inputs = {"q": qg, "kc": kbody["codes"], "ks": kbody["scale_axis"], "kz": kbody["zp_axis"],
              "ko": kbody["other_axis"], "vc": vbody["codes"], "vs": vbody["scale_axis"], "vz": vbody["zp_axis"],
              "vo": vbody["other_axis"], "sk": sk, "sv": sv, "rk": rk, "rv": rv,
              "params": int_params(r, per, ns, nr, int(causal), nsplit), "fparams": float_params(scale)}
    return tuple(launch(
        "kvarn_decode", inputs,
        {"part_o": ((bh, nsplit, nq, d), mx.float32), "part_lse": ((bh, nsplit, nq), mx.float32)},
        grid=(32 * warps, nsplit, bh * nchunk), threadgroup=(32 * warps, 1, 1),
        template={"KB": cache.k_bits, "VB": cache.v_bits, "S": s, "NQ": nq, "NCHUNK": nchunk, "L": length,
                  "WARPS": warps, "ROTATE": int(rotate_here), "QDT": DTYPE_IDS[qg.dtype]},
    ))


def _flat(field: mx.array) -> mx.array:
    """(B, H, R, ...) to (B*H, R, ...)."""
    return field.reshape(-1, *field.shape[2:])


def _kvarn_emulated(qg: mx.array, cache: Any, length: int, causal: bool, run: int) -> tuple[mx.array, mx.array]:
    """The kvarn_decode algorithm in MLX (float32): units in kernel order (records, sink, recent tiles), an
    online softmax over each split's `run` units. A record's scores and values use the factored algebra
    (qs = q * k_scale, qz = q * k_zero, ps = p * v_scale, pz = p * v_zero) on its codes."""
    bh, nq, d = qg.shape
    kbody, vbody = cache.body
    kc, ks, kz, ko = (_flat(kbody[f]) for f in ("codes", "scale_axis", "zp_axis", "other_axis"))
    vc, vs, vz, vo = (_flat(vbody[f]) for f in ("codes", "scale_axis", "zp_axis", "other_axis"))
    ks, kz, ko, vs, vz, vo = (x.astype(mx.float32) for x in (ks, kz, ko, vs, vz, vo))
    r, s = kc.shape[1:3]
    qsl = qg.astype(mx.float32).reshape(bh, nq, s, 128)
    q32 = qg.astype(mx.float32)
    # recent tokens may be absent (None) or empty (a seal took them all and the tail is 0)
    sk, sv, rk, rv = (None if x is None or x.shape[2] == 0 else _flat(x).astype(mx.float32)
                      for x in _fp16_parts(cache))
    nr = 0 if rk is None else rk.shape[1]
    qtok = mx.arange(nq) % length

    def record(rec: int) -> tuple[mx.array, Any]:
        kq = unpack_rows(kc[:, rec], cache.k_bits).astype(mx.float32)  # (BH, S, 128 ch r, 128 tok c)
        qs = qsl * ks[:, rec][:, None]  # q[r] * k_scale[r]
        qz = (qsl * kz[:, rec][:, None]).sum(axis=-1)  # sum_r q[r] * k_zero[r], per slice
        dot = mx.einsum("bjsr,bsrc->bjsc", qs, kq) + qz[..., None]
        score = (ko[:, rec][:, None] * dot).sum(axis=2)  # (BH, NQ, 128 tokens)

        def values(p: mx.array) -> mx.array:
            vq = unpack_rows(vc[:, rec], cache.v_bits).astype(mx.float32)  # (BH, S, 128 tok t, 128 ch c)
            ps = p[:, :, None, :] * vs[:, rec][:, None]  # p[t] * v_scale[t], per slice
            pz = (p[:, :, None, :] * vz[:, rec][:, None]).sum(axis=-1)
            vdot = mx.einsum("bjst,bstc->bjsc", ps, vq) + pz[..., None]
            return (vo[:, rec][:, None] * vdot).reshape(bh, nq, d)
        return score, values

    def fp16_tile(k: mx.array, v: mx.array, t0: int | None) -> tuple[mx.array, Any]:
        score = q32 @ k.swapaxes(-1, -2)
        if causal and t0 is not None:
            hidden = (t0 + mx.arange(k.shape[1]))[None, :] > (nr - length + qtok)[:, None]
            score = mx.where(hidden[None], NEG_INF, score)
        return score, lambda p: p @ v

    units = [lambda i=i: record(i) for i in range(r)] + [lambda: fp16_tile(sk, sv, None)]
    units += [lambda t0=t0: fp16_tile(rk[:, t0:t0 + 128], rv[:, t0:t0 + 128], t0) for t0 in range(0, nr, 128)]
    outs, lses = [], []
    for first in range(0, len(units), run):
        m = mx.full((bh, nq), NEG_INF)
        den = mx.zeros((bh, nq))
        acc = mx.zeros((bh, nq, d))
        for unit in units[first:first + run]:
            score, values = unit()
            m_new = mx.maximum(m, score.max(axis=-1))
            alpha = mx.where(m == NEG_INF, 0.0, mx.exp(m - m_new))
            p = mx.where(score == NEG_INF, 0.0, mx.exp(score - mx.where(m_new == NEG_INF, 0.0, m_new)[..., None]))
            den = den * alpha + p.sum(axis=-1)
            acc = acc * alpha[..., None] + values(p)
            m = m_new
        outs.append(mx.where(den[..., None] > 0, acc / mx.maximum(den, 1e-38)[..., None], 0.0))
        lses.append(mx.where(den > 0, m + mx.log(den), NEG_INF))
    return mx.stack(outs, axis=1), mx.stack(lses, axis=1)


def kvarn_attend(cache: Any, queries: mx.array, scale: float, mask: Any, emulate: bool = False) -> mx.array:
    """Decode attention of a KVarNCache in two launches: one split-K kernel that rotates q and attends over
    records, sink and recent tokens, and one merge kernel that also rotates the output back."""
    q = queries
    b, hq, length, d = q.shape
    hkv = cache.sink[0].shape[1]
    causal = isinstance(mask, str) and length > 1
    part_o, part_lse = kvarn_partials(group_queries(q, hkv), scale, cache, length, causal, emulate=emulate)
    out, _ = merge_splits(part_o, part_lse, rotate=True, dtype=queries.dtype, emulate=emulate)
    return ungroup(out, b, hq, length)


def kvarn_supported(cache: Any, queries: mx.array, mask: Any) -> bool:
    """Whether the fused path applies: sealed records, 1..4 query tokens, no array mask, queries after the body
    (and on Metal a head_dim of at most 512)."""
    if cache.body[0] is None or cache.body[1] is None or not 1 <= queries.shape[2] <= MAX_QUERY_TOKENS:
        return False
    if queries.dtype not in DTYPE_IDS:
        return False
    if queries.shape[-1] > METAL_MAX_HEAD_DIM and kernel_backend() == "metal":
        return False
    if mask is None:
        return True
    recent = 0 if cache.recent[0] is None else cache.recent[0].shape[2]
    # a causal mask must not reach into the body: every query token has to sit in the recent part
    return isinstance(mask, str) and mask == "causal" and recent >= queries.shape[2]


# -- affine ---------------------------------------------------------------------------------
def affine_partials(qg: mx.array, scale: float, kparts: list[mx.array], vparts: list[mx.array], tokens: int,
                    bits: int, group_size: int, length: int, causal: bool, per_split: int | None = None,
                    emulate: bool = False) -> tuple[mx.array, mx.array]:
    """Per-split partial attention over the first `tokens` rows of affine buffers (B, Hkv, CAP, ...)."""
    bh, nq, d = qg.shape
    cap = kparts[0].shape[2]
    qb, nchunk = _chunks(nq, affine_qb_max(d))
    tiles = -(-tokens // 128)
    per = 128 * (per_split or split_size(tiles, bh * nchunk))
    nsplit = -(-tokens // per)
    if emulate:
        return _affine_emulated(qg.astype(mx.float32) * scale, kparts, vparts, tokens, bits, group_size, length,
                                causal, per)
    inputs = {"q": qg, "kw": kparts[0], "ksc": kparts[1], "kbi": kparts[2], "vw": vparts[0], "vsc": vparts[1],
              "vbi": vparts[2], "params": int_params(tokens, cap, per, int(causal)), "fparams": float_params(scale)}
    return tuple(launch(
        "affine_decode", inputs,
        {"part_o": ((bh, nsplit, nq, d), mx.float32), "part_lse": ((bh, nsplit, nq), mx.float32)},
        grid=(128, nsplit, bh * nchunk), threadgroup=(128, 1, 1),
        template={"BITS": bits, "GS": group_size, "D": d, "QB": qb, "NQ": nq, "NCHUNK": nchunk, "L": length,
                  "QDT": DTYPE_IDS[qg.dtype]},
    ))


def _affine_emulated(qg: mx.array, kparts: list[mx.array], vparts: list[mx.array], tokens: int, bits: int,
                     gs: int, length: int, causal: bool, per: int) -> tuple[mx.array, mx.array]:
    """The affine_decode threadgroup algorithm in MLX: per 128-token tile, scale * (q . codes) + bias * sum(q);
    values as (p * scale) . codes + sum(p * bias) per group."""
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
        acc = mx.zeros((bh, nq, ng, gs))
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
            ps = p[..., None] * vsc[:, None, t0:t1].astype(mx.float32)  # (BH, NQ, T, G): p * scale
            pb = (p[..., None] * vbi[:, None, t0:t1].astype(mx.float32)).sum(axis=2)  # sum_t p * bias, per group
            acc = acc * alpha[..., None, None] + mx.einsum("bjtg,btge->bjge", ps, vq) + pb[..., None]
            m = m_new
        outs.append((acc / den[..., None, None]).reshape(bh, nq, d))
        lses.append(m + mx.log(den))
    return mx.stack(outs, axis=1), mx.stack(lses, axis=1)


def _unpack_affine(words: mx.array, bits: int, d: int) -> mx.array:
    """Codes (..., D) float32 from mx.quantize words (..., D*bits/32): one plain LSB-first bit stream."""
    stream = (words[..., None] >> mx.arange(32, dtype=mx.uint32)) & 1
    stream = stream.reshape(*words.shape[:-1], d, bits)
    return (stream << mx.arange(bits, dtype=mx.uint32)).sum(axis=-1).astype(mx.float32)


def affine_attend(cache: Any, queries: mx.array, scale: float, mask: Any, emulate: bool = False) -> mx.array:
    """Decode attention of a quantized AffineCache: one split-K kernel over the codes, one merge kernel
    (which also rotates the output back for a rotated cache); no dequantized copy."""
    q = mx.hadamard_transform(queries) if cache.rotate else queries
    b, hq, length, d = q.shape
    kparts, vparts = ([buf.data for buf in bufs] for bufs in cache.packed)
    hkv = kparts[0].shape[1]
    causal = isinstance(mask, str) and length > 1
    part_o, part_lse = affine_partials(group_queries(q, hkv), scale, kparts, vparts, cache.offset, cache.k_bits,
                                       cache.group_size, length, causal, emulate=emulate)
    out, _ = merge_splits(part_o, part_lse, rotate=cache.rotate, dtype=queries.dtype, emulate=emulate)
    return ungroup(out, b, hq, length)


def affine_supported(cache: Any, queries: mx.array, mask: Any) -> bool:
    """Whether the fused affine path applies: quantized, 1..4 query tokens, mask None or 'causal', and a head
    dim whose 8-channel groups tile the 128 threads (32, 64, ..., 1024)."""
    if not cache.quantized or not 1 <= queries.shape[2] <= MAX_QUERY_TOKENS or queries.dtype not in DTYPE_IDS:
        return False
    d = queries.shape[-1]
    if d % 32 or d > 1024 or 128 % (d // 8):
        return False
    return mask is None or (isinstance(mask, str) and mask == "causal")
