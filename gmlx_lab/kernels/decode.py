"""Fused decode attention for kvarn and affine caches: split-K kernels, their merge, and emulations.

The kernels (`kvarn_decode.body`, `affine_decode.body`, then `split_merge.body`, unless the split kernels
merge their own splits: config.py) run on a GPU backend. `emulate=True` runs the same per-threadgroup
algorithm written in pure MLX (per split: online softmax over record/tile blocks with the same factored
dequantization; then the same log-sum-exp merge), so the CPU can check the kernels' math against the
reference attention.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, NamedTuple

import mlx.core as mx

from ..records import KVARN_HEAD_DIMS, KvarnParts, Records, unpack_rows
from . import config
from .build import graph_function, kernel_backend, launch
from .sources import CUDA_DEFINES

QB_MAX = 4  # query vectors (GQA group x query tokens) per affine_decode threadgroup
TARGET_GROUPS = 2112  # about 16 threadgroups of 128 threads per multiprocessor of a 132-SM H200
# affine_decode splits hold at least this many 128-token tiles: a threadgroup's fixed work (queries in, partials
# out, merged later) costs more than tiles do (the sweep: benchmarks/results/split_sweep-h200.json)
AFFINE_MIN_TILES = 16
MAX_QUERY_TOKENS = 4
NEG_INF = float("-inf")
DTYPE_IDS = {mx.float32: 0, mx.float16: 1, mx.bfloat16: 2}  # names the compiled variant per dtype
# kvarn_decode's ring (template RING): each warp stages its records' code words and scale / zero factors
# through slots in threadgroup memory by asynchronous copies (CUDA's cp.async), NST - 1 chunks ahead, instead of
# loading each chunk's words just before its tensor-core products; ring_stages says how deep, and where no ring
# fits it is off. It runs from RING_MIN_RECORDS records a head on: below, staging costs more than it hides
# (docs/history/gpu-rounds.md has the chained measurements); the setting `ring` (config.py) forces it for tests.
RING_MIN_RECORDS = 192


def ring_for(records: int, setting: str) -> bool:
    """Whether kvarn_decode runs its ring over `records` records a head under the setting "on", "off" or "auto"."""
    return setting == "on" or (setting == "auto" and records >= RING_MIN_RECORDS)


PARAM_ROWS = 256  # parameter rows made at once for a count that moves every step (step_params)


def group_queries(q: mx.array, hkv: int) -> mx.array:
    """(B, Hq, L, D) to (B*Hkv, G*L, D): vector j = g*L + l of each kv head (a free reshape)."""
    b, hq, length, d = q.shape
    return q.reshape(b * hkv, (hq // hkv) * length, d)


def ungroup(x: mx.array, b: int, hq: int, length: int) -> mx.array:
    """Inverse of `group_queries` for outputs (..., D) or log-sum-exps (B*Hkv, G*L)."""
    return x.reshape(b, hq, length, *x.shape[2:])


@lru_cache(maxsize=4096)
def int_params(*values: int) -> mx.array:
    """A small int32 parameter array, kept so decode steps do not build and upload a new one each call. It has
    at least 8 entries (zeros after the values), so that build.launch need not pad it for Metal each call."""
    return mx.array(values + (0,) * (8 - len(values)), mx.int32)


@lru_cache(maxsize=64)
def _param_rows(values: tuple[int, ...], moving: int, base: int) -> mx.array:
    """PARAM_ROWS parameter rows of 8 entries: `values` (zeros after them), entry `moving` counting base, base + 1..."""
    pad = (0,) * (8 - len(values))
    return mx.array([values[:moving] + (base + i,) + values[moving + 1:] + pad for i in range(PARAM_ROWS)], mx.int32)


@lru_cache(maxsize=4096)
def step_params(values: tuple[int, ...], moving: int) -> mx.array:
    """`int_params(*values)` for a decode step, where entry `moving` (the token count) grows by one every step: a row
    of a table made once per PARAM_ROWS counts. A row is a view, so a step uploads nothing (a new small array
    every step is one more host-to-device copy a layer; docs/history/gpu-rounds.md)."""
    base = values[moving] // PARAM_ROWS * PARAM_ROWS
    fixed = values[:moving] + (0,) + values[moving + 1:]
    return _param_rows(fixed, moving, base)[values[moving] - base]


@lru_cache(maxsize=64)
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
                 emulate: bool = False, rotated_splits: int | None = None) -> tuple[mx.array, mx.array]:
    """Merge split partials (BH, NSPLIT, NQ, D) / (BH, NSPLIT, NQ) into one softmax: out (BH, NQ, D), lse.

    rotate=True applies the normalized Hadamard transform to the part of the output that comes from the first
    `rotated_splits` splits (all by default): kvarn's records and rotated affine caches attend in rotated
    space, kvarn's fp16 tokens in the model's own. The output has `dtype`.
    """
    bh, nsplit, nq, d = part_o.shape
    nrot = nsplit if rotated_splits is None else rotated_splits
    if emulate:
        big = part_lse.max(axis=1, keepdims=True)
        w = mx.where(part_lse == NEG_INF, 0.0, mx.exp(part_lse - big))
        den = w.sum(axis=1)
        num = w[..., None] * part_o / mx.maximum(den, 1e-38)[:, None, :, None]
        out = num.sum(axis=1)
        if rotate:
            out = mx.hadamard_transform(num[:, :nrot].sum(axis=1)) + num[:, nrot:].sum(axis=1)
        lse = mx.where(den > 0, big[:, 0] + mx.log(den), NEG_INF)
        return out.astype(dtype), lse
    fused_rotation = rotate and _is_pow2(d)
    if rotate and not fused_rotation and nrot != nsplit:
        raise ValueError(f"merge_splits: a head dim of {d} (not a power of two) can only rotate all splits")
    out, lse = launch(
        "split_merge",
        {"part_o": part_o, "part_lse": part_lse, "params": int_params(nsplit, nrot)},
        {"out": ((bh, nq, d), dtype), "lse": ((bh, nq), mx.float32)},
        grid=(d, nq, bh), threadgroup=(d, 1, 1),
        template={"D": d, "NQ": nq, "ROTATE": int(fused_rotation), "ODT": DTYPE_IDS[dtype]},
    )
    if rotate and not fused_rotation:
        out = mx.hadamard_transform(out)
    return out, lse


# -- kvarn ----------------------------------------------------------------------------------
KVARN_WARPS = 4  # warps per kvarn_decode threadgroup; each walks its own run of units
KVARN_QN = 8  # query vectors per kvarn_decode threadgroup: the n of its 16x8x16 tensor-core products
KVARN_PROW = 132  # floats per row of kvarn_decode's weights and outputs tiles (128 and 4 against bank conflicts)
# The fused kernel takes gmlx's head dims (records.KVARN_HEAD_DIMS): whole 128-channel slices, a power of two
# (512 is also Metal's limit: past it the queries and one slice's outputs fill a threadgroup's 32 KB)
# CUDA: kvarn_decode's launch bounds, at most KVARN_THREADS threads and at least KVARN_MIN_BLOCKS threadgroups a
# multiprocessor, so ptxas keeps a thread's registers to 65536 / (128 x 3): 168, no spills (4 threadgroups leave
# too few registers and spill; docs/history/gpu-rounds.md).
KVARN_MIN_BLOCKS = 3
CUDA_DEFINES["kvarn_decode"] = {"KVARN_THREADS": 32 * KVARN_WARPS, "KVARN_MIN_BLOCKS": KVARN_MIN_BLOCKS}
# One wave of warps on an H200: 132 multiprocessors x KVARN_MIN_BLOCKS threadgroups of 4 warps; more would leave
# a second, mostly idle wave.
TARGET_WARPS = 132 * KVARN_WARPS * KVARN_MIN_BLOCKS


def kvarn_warps(d: int) -> int:
    """Warps per kvarn_decode threadgroup: KVARN_WARPS, but 2 past head_dim 256 on Metal, where a threadgroup
    has 32 KB of memory: the queries (8 x D floats) and four warps' softmax weights (16.5 KB) do not fit."""
    return 2 if d > 256 and kernel_backend() == "metal" else KVARN_WARPS


# Threadgroup memory a threadgroup may declare statically: 48 KB on CUDA, 32 KB on Apple GPUs.
THREADGROUP_BYTES = {"cuda": 48 * 1024, "metal": 32 * 1024}
RING_STAGES_MAX = 4  # the ring: at most this many slots a warp (three chunks in flight while one is multiplied)


def ring_slot_words(kbits: int, vbits: int) -> int:
    """Words of one ring slot: a chunk's 8 two-row segments at the wider of the two widths (each with 4 spare words
    against bank conflicts) and 16 factor words (kvarn_decode.h)."""
    return 8 * (8 * max(kbits, vbits) + 4) + 16


def kvarn_threadgroup_bytes(d: int, warps: int, ring_words: int) -> int:
    """Threadgroup memory of one kvarn_decode threadgroup: queries, per-warp weights, one slice's outputs, the
    softmax statistics, the ticket and `ring_words` of ring slots (as the body declares them)."""
    qn = KVARN_QN
    return 4 * (qn * d + warps * qn * KVARN_PROW + qn * KVARN_PROW + 2 * warps * qn + 2 * qn + 1 + ring_words)


def ring_stages(d: int, kbits: int, vbits: int, warps: int, backend: str) -> int:
    """Slots a warp of the ring gets: as many as fit beside the rest of a threadgroup's memory, at most
    RING_STAGES_MAX; 0 where fewer than two fit (no ring: at head_dim 512, and on Apple GPUs' 32 KB)."""
    slot = ring_slot_words(kbits, vbits)
    limit = THREADGROUP_BYTES.get(backend, THREADGROUP_BYTES["cuda"])  # "cpu": the reference runs no kernel
    stages = (limit - kvarn_threadgroup_bytes(d, warps, 0)) // (4 * warps * slot)
    return min(RING_STAGES_MAX, stages) if stages >= 2 else 0


def kvarn_units(records: int, recent: int) -> tuple[int, int]:
    """Units of kvarn decode work: (records, fp16 units = the sink and one per 128 recent tokens)."""
    return records, 1 + -(-recent // 128)


# fp16 units a warp walks: an fp16 unit (128 tokens of fp16 K and V) reads several times a record's bytes, so a
# warp takes one; with as many as a warp's records the fp16 split's warps finish a call last, which a decode step,
# whose layers wait for each other, pays (docs/history/gpu-rounds.md).
FP16_UNITS_PER_WARP = 1


def kvarn_splits(records: int, recent: int, groups: int, warps: int, per_warp: int | None = None,
                 per_fp16: int | None = None) -> tuple[int, int, int, int]:
    """(records per warp, fp16 units per warp, record splits, fp16 splits): a split (threadgroup) holds units of
    one kind only, so its partial output is in one space (records rotated, fp16 tokens not). About TARGET_WARPS
    warps run: fp16 units take FP16_UNITS_PER_WARP a warp and the records share the rest. Tests and sweeps set
    `per_warp` (records, and fp16 units unless `per_fp16` is given too)."""
    r, f = kvarn_units(records, recent)
    wave = -(-TARGET_WARPS // groups)  # warps of one (kv head, query chunk)
    per16 = per_fp16 or per_warp or FP16_UNITS_PER_WARP
    per = per_warp or -(-r // max(1, wave - -(-f // (per16 * warps)) * warps))
    return per, per16, -(-r // (per * warps)), -(-f // (per16 * warps))


class KvarnPlan(NamedTuple):
    """The launch geometry of one kvarn_decode call: plain ints, the key of its compiled graph
    (build.graph_function)."""

    records: int  # R: sealed records per (head, slice)
    slices: int  # S: 128-channel slices of the head dim
    sink: int  # fp16 sink tokens
    per: int  # records per warp
    per16: int  # fp16 units per warp
    nsr: int  # record splits (rotated), then
    nsf: int  # fp16 splits
    warps: int
    nchunk: int  # groups of KVARN_QN query vectors
    length: int  # query tokens
    causal: bool
    kbits: int
    vbits: int
    merge: bool  # the kernel merges its own splits (kernel_merges)
    ring: bool  # the kernel stages its code words through the ring (ring_for, ring_stages)
    stages: int  # slots a warp of the ring (ring_stages); 1 without it


def kernel_merges() -> bool:
    """Whether kvarn_decode and affine_decode merge their splits themselves (MERGE = 1, one launch a step): on
    CUDA, whose fences make one threadgroup's writes visible to the others (Metal's do not), unless the setting
    `merge_in_kernel` (config.py) is off for a test. One launch a layer is less host work for the same kernel time
    (docs/history/gpu-rounds.md)."""
    return config.current().merge_in_kernel and kernel_backend() == "cuda"


class SplitCounter:
    """The zeros a merging decode kernel counts its finished splits in, one per (kv head, query chunk), kept by a
    cache. Each launch takes the counter and hands the next one a fresh copy (its `counter_out`), so launches
    that share it are ordered in MLX's graph and never count in one buffer at once (two independent calls
    would otherwise run side by side and mix their tickets)."""

    def __init__(self) -> None:
        self.arrays: dict[int, mx.array] = {}  # by size: the query-token count moves the number of chunks

    def take(self, size: int) -> mx.array:
        """The counter of `size` entries for the next launch."""
        if size not in self.arrays:
            self.arrays[size] = mx.zeros((size,), mx.uint32)
        return self.arrays[size]

    def put(self, counter: mx.array) -> None:
        """The counter the launch just built hands on."""
        self.arrays[counter.size] = counter


def kvarn_plan(nq: int, d: int, bh: int, parts: KvarnParts, length: int, causal: bool,
               per_warp: int | None = None, per_fp16: int | None = None) -> KvarnPlan:
    """How a kvarn_decode call over `parts` splits its work, for nq grouped query vectors of bh kv heads."""
    kbody, vbody = parts.body
    r, s = kbody.codes.shape[2:4]
    fp16_units = kvarn_units(r, parts.recent_tokens)[1]
    return _kvarn_plan(nq, bh, r, s, parts.sink.k.shape[2], fp16_units, length, causal, kbody.bits, vbody.bits,
                       per_warp, per_fp16, kvarn_warps(d), kernel_merges(), ring_for(r, config.current().ring),
                       kernel_backend())


@lru_cache(maxsize=256)
def _kvarn_plan(nq: int, bh: int, r: int, s: int, sink: int, fp16_units: int, length: int, causal: bool,
                kbits: int, vbits: int, per_warp: int | None, per_fp16: int | None, warps: int, merge: bool,
                ring: bool, backend: str
                ) -> KvarnPlan:
    """kvarn_plan's arithmetic, once per geometry: the layers of a decode step repeat it, and it moves every 128
    tokens. The ring is off where it does not fit (ring_stages 0); the plan says whether it runs."""
    nchunk = -(-nq // KVARN_QN)
    per, per16, nsr, nsf = kvarn_splits(r, (fp16_units - 1) * 128, bh * nchunk, warps, per_warp, per_fp16)
    stages = ring_stages(s * 128, kbits, vbits, warps, backend) if ring else 1
    if stages == 0:
        ring, stages = False, 1
    return KvarnPlan(r, s, sink, per, per16, nsr, nsf, warps, nchunk, length, causal, kbits, vbits, merge, ring, stages)


def kvarn_inputs(parts: KvarnParts) -> tuple[list[mx.array], int]:
    """The arrays kvarn_decode reads, in its input order after the queries, and the recent buffers' capacity."""
    kbody, vbody = parts.body
    rk, rv = parts.recent if parts.recent_tokens else (mx.zeros((1,), mx.float16),) * 2  # never read then
    cap = rk.shape[2] if parts.recent_tokens else 0
    return [*kbody.arrays, *vbody.arrays, *parts.sink, rk, rv], cap


def kvarn_params(plan: KvarnPlan, recent_tokens: int, cap: int, scale: float) -> tuple[mx.array, mx.array]:
    """kvarn_decode's int and float parameter arrays."""
    return kvarn_step_params(plan, recent_tokens, cap), float_params(scale)


def kvarn_step_params(plan: KvarnPlan, recent_tokens: int, cap: int) -> mx.array:
    """kvarn_decode's int parameters, whose recent-token count moves every step (a row of `step_params`' table)."""
    values = (plan.records, plan.per, plan.sink, recent_tokens, int(plan.causal), plan.nsr + plan.nsf, plan.nsr, cap,
              plan.per16)
    return step_params(values, 3)


def kvarn_split_kernel(plan: KvarnPlan, qg: mx.array, arrays: list[mx.array], params: mx.array,
                       fparams: mx.array, counter: mx.array) -> tuple[mx.array, ...]:
    """One kvarn_decode launch: partials (BH, NSPLIT, NQ, D) and (BH, NSPLIT, NQ) of grouped queries qg; with
    plan.merge their merge (BH, NQ, D) in qg's dtype and the counter for the next launch (else placeholders).
    `counter`: BH * NCHUNK zeros (SplitCounter)."""
    bh, nq, d = qg.shape
    names = ("kc", "ks", "kz", "ko", "vc", "vs", "vz", "vo", "sk", "sv", "rk", "rv")
    nsplit = plan.nsr + plan.nsf
    if plan.merge and counter.size != bh * plan.nchunk:
        raise ValueError(f"kvarn_decode: a counter of {counter.size} for {bh * plan.nchunk} (kv head, query chunk)s")
    return tuple(launch(
        "kvarn_decode",
        {"q": qg, **dict(zip(names, arrays)), "params": params, "fparams": fparams, "counter": counter},
        {"part_o": ((bh, nsplit, nq, d), mx.float32), "part_lse": ((bh, nsplit, nq), mx.float32),
         "out": ((bh, nq, d) if plan.merge else (1,), qg.dtype),
         "counter_out": ((counter.size,) if plan.merge else (1,), mx.uint32)},
        grid=(32 * plan.warps, nsplit, bh * plan.nchunk), threadgroup=(32 * plan.warps, 1, 1),
        template={"KB": plan.kbits, "VB": plan.vbits, "S": plan.slices, "NQ": nq, "NCHUNK": plan.nchunk,
                  "L": plan.length, "WARPS": plan.warps, "MERGE": int(plan.merge), "QDT": DTYPE_IDS[qg.dtype],
                  "RING": int(plan.ring), "NST": plan.stages, "PROW": KVARN_PROW},
    ))


def kvarn_partials(qg: mx.array, scale: float, parts: KvarnParts, length: int, causal: bool,
                   per_warp: int | None = None, emulate: bool = False, per_fp16: int | None = None
                   ) -> tuple[mx.array, mx.array, int]:
    """Per-split partial attention of grouped queries qg (BH, NQ, D) over a kvarn layer's parts.

    Record splits come first and attend with the rotated queries (rotated inside the kernel), the fp16 splits
    (sink, then 128-token tiles of recent tokens) with the queries as they are. Returns part_o
    (BH, NSPLIT, NQ, D), part_lse (BH, NSPLIT, NQ) and the number of record (rotated) splits.
    """
    bh, nq, d = qg.shape
    plan = kvarn_plan(nq, d, bh, parts, length, causal, per_warp, per_fp16)
    if emulate:
        return (*_kvarn_emulated(qg * scale, parts, length, causal, plan.per * plan.warps, plan.per16 * plan.warps),
                plan.nsr)
    arrays, cap = kvarn_inputs(parts)
    part_o, part_lse, *_ = kvarn_split_kernel(plan, qg, arrays, *kvarn_params(plan, parts.recent_tokens, cap, scale),
                                              mx.zeros((bh * plan.nchunk,), mx.uint32))
    return part_o, part_lse, plan.nsr


def _flat(field: mx.array) -> mx.array:
    """(B, H, R, ...) to (B*H, R, ...)."""
    return field.reshape(-1, *field.shape[2:])


def _kvarn_emulated(qg: mx.array, parts: KvarnParts, length: int, causal: bool, run: int, run16: int
                    ) -> tuple[mx.array, mx.array]:
    """The kvarn_decode algorithm in MLX (float32): record splits of `run` records, then fp16 splits of `run16`
    units, an
    online softmax per split. A record's scores and values use the factored algebra on its codes
    (qs = q * k_scale, qz = q * k_zero, ps = p * v_scale, pz = p * v_zero) with the rotated queries."""
    bh, nq, d = qg.shape
    kbody, vbody = parts.body
    kc, ks, kz, ko = (_flat(a) for a in kbody.arrays)
    vc, vs, vz, vo = (_flat(a) for a in vbody.arrays)
    ks, kz, ko, vs, vz, vo = (x.astype(mx.float32) for x in (ks, kz, ko, vs, vz, vo))
    r, s = kc.shape[1:3]
    q32 = qg.astype(mx.float32)
    qsl = mx.hadamard_transform(q32).reshape(bh, nq, s, 128)
    nr = parts.recent_tokens
    sk, sv = (_flat(x).astype(mx.float32) for x in parts.sink)
    rk, rv = (_flat(x[..., :nr, :]).astype(mx.float32) for x in parts.recent) if nr else (None, None)
    qtok = mx.arange(nq) % length

    def record(rec: int) -> tuple[mx.array, Any]:
        kq = unpack_rows(kc[:, rec], kbody.bits).astype(mx.float32)  # (BH, S, 128 ch r, 128 tok c)
        qs = qsl * ks[:, rec][:, None]  # q[r] * k_scale[r]
        qz = (qsl * kz[:, rec][:, None]).sum(axis=-1)  # sum_r q[r] * k_zero[r], per slice
        dot = mx.einsum("bjsr,bsrc->bjsc", qs, kq) + qz[..., None]
        score = (ko[:, rec][:, None] * dot).sum(axis=2)  # (BH, NQ, 128 tokens)

        def values(p: mx.array) -> mx.array:
            vq = unpack_rows(vc[:, rec], vbody.bits).astype(mx.float32)  # (BH, S, 128 tok t, 128 ch c)
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

    record_units = [lambda i=i: record(i) for i in range(r)]
    fp16_units = [lambda: fp16_tile(sk, sv, None)]
    fp16_units += [lambda t0=t0: fp16_tile(rk[:, t0:t0 + 128], rv[:, t0:t0 + 128], t0) for t0 in range(0, nr, 128)]
    runs = [record_units[i:i + run] for i in range(0, r, run)] + [fp16_units[i:i + run16]
                                                                  for i in range(0, len(fp16_units), run16)]
    outs, lses = [], []
    for units in runs:
        m = mx.full((bh, nq), NEG_INF)
        den = mx.zeros((bh, nq))
        acc = mx.zeros((bh, nq, d))
        for unit in units:
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


def kvarn_attend(queries: mx.array, scale: float, mask: Any, parts: KvarnParts, emulate: bool = False,
                 counter: SplitCounter | None = None) -> mx.array:
    """Decode attention over a kvarn layer: one split-K kernel over records (rotated queries), sink and recent
    tokens, whose last threadgroup per kv head merges the splits and rotates the records' share of the output
    back (CUDA; on Metal a second launch, split_merge, does that). `counter`: the cache's SplitCounter (a
    fresh one each call without it).

    On a GPU the launches are one compiled graph per launch geometry (`build.graph_function`): a decode step
    replays it instead of building the kernel calls again in Python."""
    b, hq, length, d = queries.shape
    hkv = parts.sink.k.shape[1]
    causal = isinstance(mask, str) and length > 1
    if emulate:
        part_o, part_lse, nrot = kvarn_partials(group_queries(queries, hkv), scale, parts, length, causal,
                                                emulate=True)
        out, _ = merge_splits(part_o, part_lse, rotate=True, dtype=queries.dtype, emulate=True, rotated_splits=nrot)
        return ungroup(out, b, hq, length)
    return KvarnCall(queries.shape, scale, causal, parts)(queries, parts.recent_tokens, counter or SplitCounter())


class KvarnCall:
    """A kvarn_decode call prepared for decode steps: its plan, compiled graph and the inputs that stay (records,
    sink, recent buffers, scale). A step passes what moves: the queries, the recent-token count and the counter.
    KVarNCache keeps one while nothing it was made from changed (its arrays stay the same objects: a write into
    the recent buffers updates them in place), so a step does not plan its launch again: host time a layer."""

    def __init__(self, shape: tuple[int, ...], scale: float, causal: bool, parts: KvarnParts):
        b, hq, length, d = shape
        hkv = parts.sink.k.shape[1]
        self.plan = kvarn_plan((hq // hkv) * length, d, b * hkv, parts, length, causal)
        self.arrays, self.cap = kvarn_inputs(parts)
        self.fparams = float_params(scale)
        self.counter_size = b * hkv * self.plan.nchunk
        self.graph = graph_function(_kvarn_graph, (self.plan, hkv))

    def __call__(self, queries: mx.array, recent_tokens: int, counter: SplitCounter) -> mx.array:
        params = kvarn_step_params(self.plan, recent_tokens, self.cap)
        out, after = self.graph(queries, *self.arrays, params, self.fparams, counter.take(self.counter_size))
        counter.put(after)
        return out


def _kvarn_graph(key: tuple[KvarnPlan, int], queries: mx.array, *arrays: mx.array) -> tuple[mx.array, mx.array]:
    """kvarn decode attention as a graph of arrays: the split kernel (merging its splits, or then split_merge);
    returns the output and the counter for the next launch."""
    plan, hkv = key
    b, hq, length, _ = queries.shape
    *inputs, params, fparams, counter = arrays
    part_o, part_lse, out, after = kvarn_split_kernel(plan, group_queries(queries, hkv), inputs, params, fparams,
                                                      counter)
    if not plan.merge:
        out, _ = merge_splits(part_o, part_lse, rotate=True, dtype=queries.dtype, rotated_splits=plan.nsr)
        after = counter
    return ungroup(out, b, hq, length), after


def kvarn_supported(parts: KvarnParts, queries: mx.array, mask: Any) -> bool:
    """Whether the fused path applies: sealed records, 1..4 query tokens, a head dim of 128/256/512, no array mask,
    and every query token among the recent tokens."""
    if parts.body is None or not 1 <= queries.shape[2] <= MAX_QUERY_TOKENS or queries.dtype not in DTYPE_IDS:
        return False
    if queries.shape[-1] not in KVARN_HEAD_DIMS:
        return False
    if mask is None:
        return True
    # a causal mask must not reach into the body: every query token has to sit in the recent part
    return isinstance(mask, str) and mask == "causal" and parts.recent_tokens >= queries.shape[2]


def unpack_records(records: Records, dtype: mx.Dtype = mx.float16) -> mx.array:
    """Records with fields (B, H, R, S, ...) decoded to rotated tokens (B, H, R*128, S*128) by the `kvarn_unpack`
    kernel: what `records.decode_tokens` computes, in one launch."""
    return _unpack(records, None, None, 0, dtype, rotate=False)


def kvarn_tokens(sink: mx.array, records: Records, recent: mx.array | None, recent_tokens: int,
                 dtype: mx.Dtype = mx.float16) -> mx.array:
    """A kvarn layer's K (or V) in the model's space, (B, H, sink + R*128 + recent_tokens, D), in one
    `kvarn_unpack` launch: the fp16 sink (B, H, NS, D), the records decoded and rotated back, then the first
    `recent_tokens` rows of the recent buffer (B, H, CAP, D). What a prefill chunk's attention reads."""
    return _unpack(records, sink, recent, recent_tokens, dtype, rotate=True)


def _unpack(records: Records, sink: mx.array | None, recent: mx.array | None, recent_tokens: int,
            dtype: mx.Dtype, rotate: bool) -> mx.array:
    b, h, r, s = records.codes.shape[:4]
    d = s * 128
    ns = 0 if sink is None else sink.shape[2]
    nr = recent_tokens if recent is not None else 0
    absent = mx.zeros((1,), mx.float16)  # never read (no sink, or no recent tokens)
    sk = sink if ns else absent
    rk = recent if nr else absent
    units = (1 if ns else 0) + r + -(-nr // 128)
    (out,) = launch(
        "kvarn_unpack",
        {"c": records.codes, "sa": records.scale_axis, "za": records.zp_axis, "oa": records.other_axis,
         "sk": sk, "rk": rk, "params": int_params(r, ns, nr, rk.shape[2] if nr else 0)},
        {"out": ((b, h, ns + r * 128 + nr, d), dtype)},
        grid=(128, units, b * h), threadgroup=(128, 1, 1),
        template={"B": records.bits, "KIND_K": int(records.kind == "k"), "S": s, "ROTATE": int(rotate),
                  "ODT": DTYPE_IDS[dtype]},
    )
    return out


# -- affine ---------------------------------------------------------------------------------
class AffinePlan(NamedTuple):
    """The launch geometry of one affine_decode call: plain ints, the key of its compiled graph
    (build.graph_function)."""

    per: int  # tokens per split
    nsplit: int
    qb: int  # query vectors per threadgroup
    nchunk: int
    bits: int
    group_size: int
    length: int  # query tokens
    causal: bool
    rotate: bool  # a rotated cache: the merged output is rotated back
    merge: bool  # the kernel merges its own splits (kernel_merges)


def affine_plan(nq: int, d: int, bh: int, tokens: int, bits: int, group_size: int, length: int, causal: bool,
                per_split: int | None = None, rotate: bool = False) -> AffinePlan:
    """How an affine_decode call over `tokens` rows splits its work, for nq grouped query vectors of bh kv heads:
    splits of `per_split` tiles, else of at least AFFINE_MIN_TILES tiles, more where that still leaves
    TARGET_GROUPS threadgroups."""
    return _affine_plan(nq, bh, -(-tokens // 128), bits, group_size, length, causal, per_split, rotate,
                        affine_qb_max(d), kernel_merges())


@lru_cache(maxsize=256)
def _affine_plan(nq: int, bh: int, tiles: int, bits: int, group_size: int, length: int, causal: bool,
                 per_split: int | None, rotate: bool, qb_max: int, merge: bool) -> AffinePlan:
    """affine_plan's arithmetic, once per geometry (the layers of a decode step repeat it; it moves every 128
    tokens)."""
    qb, nchunk = _chunks(nq, qb_max)
    per_tiles = per_split or min(tiles, max(AFFINE_MIN_TILES, split_size(tiles, bh * nchunk)))
    return AffinePlan(128 * per_tiles, -(-tiles // per_tiles), qb, nchunk, bits, group_size, length, causal, rotate,
                      merge)


def affine_params(plan: AffinePlan, tokens: int, cap: int, scale: float) -> tuple[mx.array, mx.array]:
    """affine_decode's int and float parameter arrays (the token count moves every step)."""
    return step_params((tokens, cap, plan.per, int(plan.causal)), 0), float_params(scale)


def affine_split_kernel(plan: AffinePlan, qg: mx.array, kparts: list[mx.array], vparts: list[mx.array],
                        params: mx.array, fparams: mx.array, counter: mx.array) -> tuple[mx.array, ...]:
    """One affine_decode launch: partials (BH, NSPLIT, NQ, D) and (BH, NSPLIT, NQ) of grouped queries qg; with
    plan.merge their merge (BH, NQ, D) in qg's dtype, rotated back if plan.rotate, and the counter for the next
    launch (else placeholders). `counter`: BH * NCHUNK zeros (SplitCounter)."""
    bh, nq, d = qg.shape
    if plan.merge and counter.size != bh * plan.nchunk:
        raise ValueError(f"affine_decode: a counter of {counter.size} for {bh * plan.nchunk} (kv head, query chunk)s")
    inputs = {"q": qg, "kw": kparts[0], "ksc": kparts[1], "kbi": kparts[2], "vw": vparts[0], "vsc": vparts[1],
              "vbi": vparts[2], "params": params, "fparams": fparams, "counter": counter}
    return tuple(launch(
        "affine_decode", inputs,
        {"part_o": ((bh, plan.nsplit, nq, d), mx.float32), "part_lse": ((bh, plan.nsplit, nq), mx.float32),
         "out": ((bh, nq, d) if plan.merge else (1,), qg.dtype),
         "counter_out": ((counter.size,) if plan.merge else (1,), mx.uint32)},
        grid=(128, plan.nsplit, bh * plan.nchunk), threadgroup=(128, 1, 1),
        template={"BITS": plan.bits, "GS": plan.group_size, "D": d, "QB": plan.qb, "NQ": nq, "NCHUNK": plan.nchunk,
                  "L": plan.length, "MERGE": int(plan.merge), "ROTATE": int(plan.rotate), "QDT": DTYPE_IDS[qg.dtype]},
    ))


def affine_partials(qg: mx.array, scale: float, kparts: list[mx.array], vparts: list[mx.array], tokens: int,
                    bits: int, group_size: int, length: int, causal: bool, per_split: int | None = None,
                    emulate: bool = False) -> tuple[mx.array, mx.array]:
    """Per-split partial attention over the first `tokens` rows of affine buffers (B, Hkv, CAP, ...)."""
    bh, nq, d = qg.shape
    plan = affine_plan(nq, d, bh, tokens, bits, group_size, length, causal, per_split)
    if emulate:
        return _affine_emulated(qg.astype(mx.float32) * scale, kparts, vparts, tokens, bits, group_size, length,
                                causal, plan.per)
    part_o, part_lse, *_ = affine_split_kernel(plan, qg, kparts, vparts,
                                               *affine_params(plan, tokens, kparts[0].shape[2], scale),
                                               mx.zeros((bh * plan.nchunk,), mx.uint32))
    return part_o, part_lse


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
                                rotate=rotate)
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
    """affine decode attention as a graph of arrays: rotate the queries (affine_rot), split kernel (merging its
    splits, or then split_merge); returns the output and the counter for the next launch."""
    plan, hkv = key
    b, hq, length, _ = queries.shape
    kw, ksc, kbi, vw, vsc, vbi, params, fparams, counter = arrays
    q = mx.hadamard_transform(queries) if plan.rotate else queries
    part_o, part_lse, out, after = affine_split_kernel(plan, group_queries(q, hkv), [kw, ksc, kbi], [vw, vsc, vbi],
                                                       params, fparams, counter)
    if not plan.merge:
        out, _ = merge_splits(part_o, part_lse, rotate=plan.rotate, dtype=queries.dtype)
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
