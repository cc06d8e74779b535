"""kvarn's kernels: decode attention from its records (`kvarn_decode.body`), sealing records (`kvarn_seal.body`)
and unpacking them to tokens (`kvarn_unpack.body`); the launch code and the pure-MLX emulation of each.

The record layout is `gmlx_lab/cache/kvarn/records.py`'s; the split-K machinery shared with affine's kernel is
`splits.py`.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, NamedTuple

import mlx.core as mx

from ..cache.kvarn.records import (
    AXIS_DTYPE,
    KVARN_HEAD_DIMS,
    TILE,
    KvarnParts,
    Records,
    check_bits,
    check_kind,
    unpack_rows,
)
from . import config
from .build import graph_function, kernel_backend, launch
from .sources import CUDA_DEFINES
from .splits import (
    DTYPE_IDS,
    MAX_QUERY_TOKENS,
    NEG_INF,
    SplitCounter,
    flat,
    float_params,
    group_queries,
    int_params,
    kernel_merges,
    merge_splits,
    step_params,
    ungroup,
)

# kvarn_decode's ring (template RING): each warp stages its records' code words and scale / zero factors
# through slots in threadgroup memory by asynchronous copies (CUDA's cp.async), NST - 1 chunks ahead, instead of
# loading each chunk's words just before its tensor-core products; ring_stages says how deep, and where no ring
# fits it is off. It runs from RING_MIN_RECORDS records a head on: below, staging costs more than it hides
# (docs/history/gpu-rounds.md has the chained measurements); the setting `ring` (config.py) forces it for tests.
RING_MIN_RECORDS = 192


def ring_for(records: int, setting: str) -> bool:
    """Whether kvarn_decode runs its ring over `records` records a head under the setting "on", "off" or "auto"."""
    return setting == "on" or (setting == "auto" and records >= RING_MIN_RECORDS)


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


def _kvarn_emulated(qg: mx.array, parts: KvarnParts, length: int, causal: bool, run: int, run16: int
                    ) -> tuple[mx.array, mx.array]:
    """The kvarn_decode algorithm in MLX (float32): record splits of `run` records, then fp16 splits of `run16`
    units, an
    online softmax per split. A record's scores and values use the factored algebra on its codes
    (qs = q * k_scale, qz = q * k_zero, ps = p * v_scale, pz = p * v_zero) with the rotated queries."""
    bh, nq, d = qg.shape
    kbody, vbody = parts.body
    kc, ks, kz, ko = (flat(a) for a in kbody.arrays)
    vc, vs, vz, vo = (flat(a) for a in vbody.arrays)
    ks, kz, ko, vs, vz, vo = (x.astype(mx.float32) for x in (ks, kz, ko, vs, vz, vo))
    r, s = kc.shape[1:3]
    q32 = qg.astype(mx.float32)
    qsl = mx.hadamard_transform(q32).reshape(bh, nq, s, 128)
    nr = parts.recent_tokens
    sk, sv = (flat(x).astype(mx.float32) for x in parts.sink)
    rk, rv = (flat(x[..., :nr, :]).astype(mx.float32) for x in parts.recent) if nr else (None, None)
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
    KvarnCache keeps one while nothing it was made from changed (its arrays stay the same objects: a write into
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


def seal_records(chunk: mx.array, bits: int, kind: str, iters: int = 16) -> Records:
    """Encode rotated tokens (B, H, n*128, D) into records with fields (B, H, n, D/128, ...).

    Same steps as `records.encode_tokens(chunk, ...)`; float sums run in another
    order, so a few codes may differ by one step (tests/test_kernels.py measures how many).
    """
    check_bits(bits)
    check_kind(kind)
    b, h, t, d = chunk.shape
    if t % TILE or d % TILE:
        raise ValueError(f"seal_records: tokens ({t}) and head_dim ({d}) must be multiples of {TILE}")
    n, s = t // TILE, d // TILE
    lead = (b, h, n, s)
    codes, scale_axis, zp_axis, other_axis, imb = launch(
        "kvarn_seal",
        {"x": chunk.astype(mx.float16), "params": mx.array([t], mx.int32)},
        {"codes": ((*lead, TILE, 4 * bits), mx.uint32), "scale_axis": ((*lead, TILE), AXIS_DTYPE),
         "zp_axis": ((*lead, TILE), AXIS_DTYPE), "other_axis": ((*lead, TILE), AXIS_DTYPE),
         "imbalance": ((*lead, 2), mx.float32)},
        grid=(128, n * s, b * h), threadgroup=(128, 1, 1),
        template={"B": bits, "KIND_K": int(kind == "k"), "ITERS": iters, "D": d},
    )
    return Records(codes=codes, scale_axis=scale_axis, zp_axis=zp_axis, other_axis=other_axis, bits=bits,
                   kind=kind, imbalance_before=imb[..., 0], imbalance_after=imb[..., 1])
