"""What the split-K decode kernels share: grouped queries, parameter arrays, how work splits, and the merge.

A decode kernel (kvarn's in `kvarn.py`, affine's in `affine.py`) splits a kv head's tokens over threadgroups, each
writing a partial output and its log-sum-exp; `merge_splits` (`split_merge.body`) merges them, unless the kernel
merges its own splits (`kernel_merges`, CUDA). `emulate=True` paths run the same per-threadgroup algorithm in
pure MLX, so the CPU can check the kernels' math against the reference attention.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

from . import config
from .build import kernel_backend, launch

TARGET_GROUPS = 2112  # about 16 threadgroups of 128 threads per multiprocessor of a 132-SM H200
MAX_QUERY_TOKENS = 4
NEG_INF = float("-inf")
DTYPE_IDS = {mx.float32: 0, mx.float16: 1, mx.bfloat16: 2}  # names the compiled variant per dtype


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


@lru_cache(maxsize=64)
def unused_counter(size: int) -> mx.array:
    """The zeros a split kernel that does not merge (MERGE = 0) takes as its counter and never reads: kept, so a
    decode step does not make and upload a new array for it."""
    return mx.zeros((size,), mx.uint32)


def chunks(nq: int, qb_max: int) -> tuple[int, int]:
    qb = max(1, min(nq, qb_max))
    return qb, (nq + qb - 1) // qb


def split_size(units: int, groups_per_split: int, target: int = TARGET_GROUPS) -> int:
    """Units (records or 128-token tiles) per split so that about `target` groups run."""
    nsplit = max(1, min(units, -(-target // max(groups_per_split, 1))))
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


def flat(field: mx.array) -> mx.array:
    """(B, H, R, ...) to (B*H, R, ...)."""
    return field.reshape(-1, *field.shape[2:])
