"""The fused kernels: sources per backend, their algorithm emulated in MLX, and (on a GPU) the kernels.

Tests marked `gpu` run on an MLX GPU backend (CUDA or Metal). On a CPU-only machine conftest.py runs each of
them twice on CPU threads, from the kernels' CUDA sources and from their Metal sources, and the run's summary
says so: the kernels' logic is tested there, not a GPU.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx
import pytest
from conftest import random_kv

from gmlx_lab.cache import kernel_route
from gmlx_lab.cache.affine.cache import AffineCache, AffineRotCache
from gmlx_lab.cache.attention import grouped_attention
from gmlx_lab.cache.kvarn.cache import KvarnCache
from gmlx_lab.cache.kvarn.records import decode_tiles, decode_tokens, encode_tokens, unpack_rows
from gmlx_lab.kernels import (
    KERNELS,
    active_backend,
    affine,
    assemble,
    build,
    config,
    kvarn,
    kvarn_tokens,
    seal_records,
    selfcheck,
    sources,
    splits,
    threads,
    unpack_records,
)
from gmlx_lab.kernels.affine import affine_partials
from gmlx_lab.kernels.kvarn import kvarn_partials
from gmlx_lab.kernels.splits import group_queries, merge_splits
from gmlx_lab.registry import get_scheme
from gmlx_lab.specs import parse_scheme_spec

ON_GPU = active_backend() != "cpu"
# float32 on the CPU; on a GPU the reference's own matmuls may use tf32, so 1e-5 becomes 2e-3
EMU_TOL = 1e-2 if ON_GPU else 1e-5  # the H200 log shows the emulation's CUDA matmuls at 2.3e-3 to 7.7e-3
# kvarn_decode against its float32 emulation: the tensor cores take float16 operands (q * k_scale, p * v_scale),
# on a GPU and on CPU threads alike (1.3e-3 at most in the H200 run)
KERNEL_TOL = 1e-2
gpu = pytest.mark.gpu

CUDA_ONLY = ("__shared__", "__syncthreads", "threadIdx", "blockIdx", "blockDim", "__half", "__shfl", "__device__")
METAL_ONLY = ("threadgroup_barrier", "thread_position_in", "threadgroup_position_in", "simdgroup", "simd_sum(",
              "simd_max(", "device float", "const device", "[[")


def _words(text: str, names: tuple[str, ...]) -> list[str]:
    return [n for n in names if n in text]


@contextmanager
def _on_cpu() -> Iterator[None]:
    """The default device set to the CPU for a block, so that kernels take the CPU-thread runner."""
    before = mx.default_device()
    mx.set_default_device(mx.cpu)
    try:
        yield
    finally:
        mx.set_default_device(before)


# -- sources (CPU) -------------------------------------------------------------------------
@pytest.mark.parametrize("name", KERNELS)
def test_sources_assemble_per_backend(name: str) -> None:
    cuda_h, cuda_s = assemble(name, "cuda")
    metal_h, metal_s = assemble(name, "metal")
    body = open(f"gmlx_lab/kernels/{name}.body").read()
    assert cuda_s.endswith(body) and metal_s.endswith(body), "the body is shared verbatim"
    assert not _words(body, CUDA_ONLY) and not _words(body, METAL_ONLY), "the body speaks only the common dialect"
    assert not _words(metal_h + metal_s, CUDA_ONLY), _words(metal_h + metal_s, CUDA_ONLY)
    assert not _words(cuda_h + cuda_s, METAL_ONLY), _words(cuda_h + cuda_s, METAL_ONLY)
    assert "GMLX_CUDA" in cuda_h and "GMLX_METAL" in metal_h
    # a kernel's own helper header joins both headers and, like the body, speaks only the common dialect
    helpers = Path(f"gmlx_lab/kernels/{name}.h")
    own = helpers.read_text() if helpers.exists() else ""
    assert own in cuda_h and own in metal_h
    assert not _words(own, CUDA_ONLY) and not _words(own, METAL_ONLY)
    # every macro the body and its helpers use is defined by both preludes
    macros = (r"\b(SHARED|SHARED_PTR|THREAD|BARRIER|WARP_BARRIER|GLOBAL_CONST|GLOBAL|UNROLL|HALF|TO_FLOAT|TO_HALF"
              r"|NEG_INF)\b")
    for macro in set(re.findall(macros, body + own)):
        assert f"#define {macro}" in cuda_h and f"#define {macro}" in metal_h, macro
    # and every prelude function they call
    functions = r"\b(mma16816|pack_half2|half_bits_to_float|simd_shuffle_f|simd_shuffle_xor_f|simd_sum_f|simd_max_f)\("
    for fn in set(re.findall(functions, body + own)):
        assert f" {fn}(" in cuda_h and f" {fn}(" in metal_h, fn


def test_kvarn_decode_uses_the_tensor_core_fragments() -> None:
    """CUDA's mma16816 is the PTX instruction; Metal's computes the same fragments by SIMD shuffles."""
    cuda_h, _ = assemble("kvarn_decode", "cuda")
    metal_h, _ = assemble("kvarn_decode", "metal")
    assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in cuda_h
    assert "mma.sync" not in metal_h and metal_h.count("simd_shuffle(") >= 4
    body = open("gmlx_lab/kernels/kvarn_decode.body").read()
    assert body.count("mma16816(") == 4  # scores and values, from codes and from fp16 tokens


def test_step_params_are_rows_of_one_table() -> None:
    """A decode step's parameters (the token count moving by one a step) are rows of a table made once per
    PARAM_ROWS counts, equal to the array int_params would make, across a table's edge too."""
    from gmlx_lab.kernels.splits import PARAM_ROWS, int_params, step_params

    for count in (0, 1, PARAM_ROWS - 1, PARAM_ROWS, 3 * PARAM_ROWS + 7):
        values = (9, 2, 128, count, 1, 5, 3, 1024)
        assert step_params(values, 3).tolist() == int_params(*values).tolist()
        assert step_params(values[3:7], 0).tolist() == int_params(*values[3:7]).tolist()


def test_unknown_backend_is_refused() -> None:
    with pytest.raises(ValueError, match="accepted: cuda, metal"):
        assemble("kvarn_decode", "vulkan")


def test_cpu_defaults_to_reference() -> None:
    """On the CPU (the default device set to it, so this runs on GPU machines too) "auto" is pure MLX and "fused"
    refuses clearly: no kernel runs there outside the tests' CPU-thread runner. A decode step's "auto" reads the
    records' codes through mx.quantized_matmul, the reference's output within float32 rounding."""
    with _on_cpu():
        c = KvarnCache(6, 6, kv_tail_tokens=128)
        k, v = c.update_and_fetch(*random_kv(600))
        c.seal()
        q = mx.random.normal((1, 2, 1, 128))
        c.attention_path = "fused"
        with pytest.raises(RuntimeError, match="no GPU backend"):
            c.attend(q, k, v, 0.1, None)
        c.attention_path = "auto"
        auto = c.attend(q, k, v, 0.1, None)
        c.attention_path = "reference"
        ref = c.attend(q, k, v, 0.1, None)
        assert float(mx.abs(auto - ref).max()) <= 1e-5 * float(mx.abs(ref).max())


# -- shared cases -----------------------------------------------------------------------------
# (head_dim, q heads, kv heads, query tokens, k bits, v bits, tokens, tail): contexts end mid-record and mid-tail
KVARN_CASES = [
    (128, 4, 2, 1, 6, 6, 128 + 9 * 128 + 200, 256),
    (128, 8, 2, 4, 4, 4, 128 + 5 * 128 + 77, 128),
    (256, 8, 2, 3, 3, 5, 128 + 3 * 128 + 70, 128),
    (512, 2, 1, 2, 8, 2, 128 + 2 * 128 + 5, 64),
    (128, 32, 4, 1, 2, 8, 128 + 6 * 128 + 1, 300),
    (256, 4, 4, 1, 5, 6, 128 + 4 * 128 + 129, 100),
    (128, 4, 2, 1, 2, 6, 128 + 2 * 128, 0),  # records end exactly, tail 0: no recent tokens at all
    (128, 20, 2, 1, 5, 8, 128 + 2 * 128 + 10, 0),  # 10 query vectors: a second, partly empty group of 8
]
AFFINE_CASES = [(b, gs, d, lq) for b, gs, d, lq in [
    (2, 32, 128, 1), (3, 32, 128, 2), (4, 64, 128, 1), (6, 64, 256, 4), (8, 128, 128, 3), (8, 64, 512, 1),
    (4, 32, 64, 1), (6, 128, 128, 1), (3, 64, 256, 1)]]


def _kvarn_cache(d: int, hkv: int, kb: int, vb: int, tokens: int, tail: int, seed: int,
                 seal: bool = True) -> KvarnCache:
    """A kvarn cache fed in chunks of 200; `seal` also seals the groups the last chunk made due."""
    c = KvarnCache(kb, vb, kv_tail_tokens=tail)
    k, v = random_kv(tokens, hkv, d, seed=seed)
    for i in range(0, tokens, 200):
        c.update_and_fetch(k[:, :, i:i + 200], v[:, :, i:i + 200])
    if seal:
        c.seal()
    return c


def _affine_stored(c: AffineCache, dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
    """An affine cache's stored (rotated if it rotates) K/V decoded, as its own update_and_fetch decodes them."""
    return c.stored(c.offset, dtype)


def _attend(c, q: mx.array, mask) -> mx.array:
    """The cache's attention as mlx-lm's seam calls it: with the K/V that fetching returns."""
    k, v = c.fetch(q.dtype) if isinstance(c, KvarnCache) else _affine_stored(c, q.dtype)
    if isinstance(c, AffineCache) and c.rotate_on_arrival:
        k, v = mx.hadamard_transform(k), mx.hadamard_transform(v)
    return c.attend(q, k, v, q.shape[-1] ** -0.5, mask)


def _affine_cache(bits: int, gs: int, d: int, tokens: int, seed: int, rotate: bool = False) -> AffineCache:
    c = (AffineRotCache if rotate else AffineCache)(bits, gs)
    k, v = random_kv(tokens, 2, d, seed=seed)
    c.update_and_fetch(k[:, :, :tokens - 3], v[:, :, :tokens - 3])
    c.update_and_fetch(k[:, :, tokens - 3:], v[:, :, tokens - 3:])
    return c


def _rel(a: mx.array, b: mx.array) -> float:
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    return (mx.linalg.norm((a - b).flatten()) / mx.linalg.norm(b.flatten())).item()


def _attend_both(c, q: mx.array, mask, path: str) -> tuple[mx.array, mx.array]:
    c.attention_path = "reference"
    ref = _attend(c, q, mask)
    c.attention_path = path
    out = _attend(c, q, mask)
    assert not mx.any(mx.isnan(out)).item()
    return out, ref


# -- emulation of the kernels' algorithm (CPU and GPU) --------------------------------------------
@pytest.mark.parametrize("case", KVARN_CASES)
def test_kvarn_emulated_matches_reference(case: tuple[int, ...]) -> None:
    d, hq, hkv, lq, kb, vb, tokens, tail = case
    c = _kvarn_cache(d, hkv, kb, vb, tokens, tail, seed=d + kb)
    assert c.n_records > 0 and c.region_tokens()["tail"] == tail
    q = mx.random.normal((1, hq, lq, d))
    out, ref = _attend_both(c, q, "causal" if lq > 1 else None, "emulated")
    assert _rel(out, ref) < EMU_TOL


@pytest.mark.parametrize("per_split", [1, 2, 3, 100])
def test_kvarn_split_merge_is_one_softmax(per_split: int) -> None:
    c = _kvarn_cache(128, 2, 6, 6, 128 + 7 * 128 + 50, 0, seed=per_split, seal=False)
    qg = group_queries(mx.random.normal((1, 4, 1, 128)), 2)

    def merged(per: int) -> tuple[mx.array, mx.array]:
        o, lse, nrot = kvarn_partials(qg, 0.3, c.parts(), 1, False, per_warp=per, emulate=True)
        return merge_splits(o, lse, rotate=True, emulate=True, rotated_splits=nrot)
    one_o, one_l = merged(10**6)
    o, lse = merged(per_split)
    assert _rel(o, one_o) < EMU_TOL and mx.allclose(lse, one_l, atol=EMU_TOL).item()


@pytest.mark.parametrize("case", AFFINE_CASES)
def test_affine_emulated_matches_reference(case: tuple[int, ...]) -> None:
    bits, gs, d, lq = case
    c = _affine_cache(bits, gs, d, 128 * 5 + 37, seed=bits * gs)
    q = mx.random.normal((1, 4, lq, d))
    c.attention_path = "emulated"
    out = _attend(c, q, "causal" if lq > 1 else None)
    assert _rel(out, _affine_dequantized_reference(c, q, "causal" if lq > 1 else None)) < EMU_TOL


def test_mx_quantize_packs_a_plain_bit_stream() -> None:
    """mx.quantize's 3- and 6-bit codes cross words as one LSB-first stream (what affine_decode reads)."""
    for bits in (2, 3, 4, 5, 6, 8):
        x = mx.random.normal((3, 128))
        w, s, b = mx.quantize(x, group_size=32, bits=bits)
        codes = unpack_rows(w, bits).reshape(3, 4, 32).astype(mx.float32)
        deq = (codes * s[..., None] + b[..., None]).reshape(3, 128)
        assert mx.allclose(deq, mx.dequantize(w, s, b, group_size=32, bits=bits), atol=1e-5).item()


# -- the kernels themselves (GPU only) -----------------------------------------------------------
@gpu
@pytest.mark.parametrize("case", KVARN_CASES)
def test_kvarn_fused_matches_reference(case: tuple[int, ...]) -> None:
    d, hq, hkv, lq, kb, vb, tokens, tail = case
    c = _kvarn_cache(d, hkv, kb, vb, tokens, tail, seed=d * kb)
    q = mx.random.normal((1, hq, lq, d))
    out, ref = _attend_both(c, q, "causal" if lq > 1 else None, "fused")
    # the tensor cores take float16 operands (q * k_scale, p * v_scale): up to 2.3e-3 in the H200 log
    assert _rel(out, ref) < 5e-3


@pytest.fixture
def merging_in_kernel() -> Iterator[None]:
    """The setting merge_in_kernel on for one test, through config.configured (explicit: it beats the environment)."""
    with config.configured(merge_in_kernel=True):
        yield


@gpu
@pytest.mark.parametrize("scheme", ["kvarn", "affine_rot"])
def test_merging_kernels_hand_their_counter_on(scheme: str, merging_in_kernel: None) -> None:
    """With CUDA's source and merge_in_kernel the decode kernels merge their own splits, counting them in a counter
    each launch hands to the next (splits.SplitCounter): ten decode steps through one cache, each against the
    reference, then eight calls built before any is evaluated (on a GPU, calls that shared one counter could run
    side by side and mix their tickets)."""
    kvarn = scheme == "kvarn"
    c = _kvarn_cache(128, 2, 6, 6, 128 + 4 * 128 + 60, 128, seed=3) if kvarn else \
        _affine_cache(4, 64, 128, 128 * 9 + 61, seed=3, rotate=True)
    c.attention_path = "fused"

    def reference(q: mx.array, keys: mx.array, values: mx.array) -> mx.array:
        if not kvarn:  # (mlx 0.32.4 CUDA has no float32 quantized_matmul for the affine reference path)
            return _affine_dequantized_reference(c, q, None)
        with mx.stream(mx.cpu):
            return mx.fast.scaled_dot_product_attention(q, keys, values, scale=128**-0.5, mask=None)

    for step in range(10):
        k, v = random_kv(1, 2, 128, seed=100 + step)
        keys, values = c.update_and_fetch(k, v)
        q = mx.random.normal((1, 8, 1, 128))
        assert _rel(c.attend(q, keys, values, 128**-0.5, None), reference(q, keys, values)) < 5e-3, step
    qs = [mx.random.normal((1, 8, 1, 128)) for _ in range(8)]
    outs = [c.attend(q, keys, values, 128**-0.5, None) for q in qs]
    mx.eval(outs)
    assert max(_rel(o, reference(q, keys, values)) for o, q in zip(outs, qs)) < 5e-3


@gpu
def test_a_decode_call_is_kept_while_its_inputs_are(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kvarn cache prepares its fused call once and makes it again while nothing it was made from changed
    (KvarnCache._fused_call): decode steps into a new 128-token tile of recent tokens, after a seal, a trim, a
    changed setting and a changed path each match the reference; the tile, the seal and the setting prepare a new
    call, while a step on the reference path leaves the kept one for when the fused path comes back."""
    import gmlx_lab.cache.kvarn.cache as kvarn_module

    made = []

    class Counted(kvarn.KvarnCall):
        def __init__(self, *args, **kwargs) -> None:
            made.append(args[3].recent_tokens)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(kvarn_module, "KvarnCall", Counted)
    c = _kvarn_cache(128, 2, 4, 4, 128 + 3 * 128 + 250, 300, seed=8)  # 378 recent tokens: the third tile
    c.attention_path = "fused"

    def step(seed: int, tokens: int = 1) -> None:
        k, v = random_kv(tokens, 2, 128, seed=seed)
        keys, values = c.update_and_fetch(k, v)
        q = mx.random.normal((1, 4, 1, 128))
        with mx.stream(mx.cpu):
            want = mx.fast.scaled_dot_product_attention(q, keys, values, scale=0.1, mask=None)
        assert _rel(c.attend(q, keys, values, 0.1, None), want) < 5e-3, (seed, c.recent_count)

    for seed in range(10):  # 379..388 recent tokens: a fourth tile from 385
        step(seed)
    assert made == [379, 385], made
    records = c.n_records
    step(10, tokens=40)  # 428: the same tile
    step(11, tokens=128)  # a record sealed as 128 tokens arrive: 428 again, in the same tile, over a new body
    assert c.n_records == records + 1 and made == [379, 385, 428], made
    step(12)  # 301: sealed again
    c.trim(2)
    step(13)  # 300, the same tile and arrays after a trim: the call kept
    assert made == [379, 385, 428, 301], made
    with config.configured(ring="off" if kvarn.ring_for(c.n_records, config.current().ring) else "on"):
        step(14)
    step(15)
    assert made == [379, 385, 428, 301, 301, 302], made  # the setting, then back
    c.attention_path = "reference"
    step(16)
    c.attention_path = "fused"
    step(17)
    assert made == [379, 385, 428, 301, 301, 302], made  # the reference path left the kept call, which still fits


@gpu
def test_merge_in_kernel_switch() -> None:
    """The setting merge_in_kernel (config.py; the model_decode probes `one-launch` / `two-launch`) merges the splits
    inside the CUDA kernel, else split_merge does on every backend; both give the reference's attention."""
    c = _kvarn_cache(128, 2, 6, 6, 128 + 4 * 128 + 60, 128, seed=5)
    q = mx.random.normal((1, 8, 1, 128))
    outs = []
    for merge in (True, False):
        with config.configured(merge_in_kernel=merge):
            assert splits.kernel_merges() == (merge and build.kernel_backend() == "cuda")
            out, ref = _attend_both(c, q, None, "fused")
        assert _rel(out, ref) < 5e-3
        outs.append(out)
    assert _rel(outs[0], outs[1]) < 1e-5  # the same partials, merged in float32 either way

@gpu
@pytest.mark.parametrize("case", KVARN_CASES[:3])
def test_kvarn_kernel_equals_emulation(case: tuple[int, ...]) -> None:
    d, hq, hkv, lq, kb, vb, tokens, tail = case
    c = _kvarn_cache(d, hkv, kb, vb, tokens, tail, seed=7, seal=False)
    qg = group_queries(mx.random.normal((1, hq, lq, d)), hkv)
    for per in (1, 2, 5):
        ko, kl, kn = kvarn_partials(qg, d**-0.5, c.parts(), lq, lq > 1, per_warp=per)
        eo, el, en = kvarn_partials(qg, d**-0.5, c.parts(), lq, lq > 1, per_warp=per, emulate=True)
        assert ko.shape == eo.shape and kl.shape == el.shape and kn == en
        assert _rel(ko, eo) < KERNEL_TOL and mx.allclose(kl, el, rtol=KERNEL_TOL, atol=KERNEL_TOL).item()
        for rotated in (0, kn, ko.shape[1]):  # none, the records' splits, all
            mo, ml = merge_splits(ko, kl, rotate=rotated > 0, rotated_splits=rotated)
            xo, xl = merge_splits(eo, el, rotate=rotated > 0, emulate=True, rotated_splits=rotated)
            assert _rel(mo, xo) < KERNEL_TOL and mx.allclose(ml, xl, rtol=KERNEL_TOL, atol=KERNEL_TOL).item()


@gpu
@pytest.mark.parametrize("per, per16", [(3, 1), (1, 2)])
def test_kvarn_kernel_walks_records_and_fp16_units_at_their_own_counts(per: int, per16: int) -> None:
    """A warp walks `per` records or `per16` fp16 units (the plan gives fp16 units fewer): kernel = emulation."""
    d, hq, hkv, lq, kb, vb, tokens, tail = KVARN_CASES[0]
    c = _kvarn_cache(d, hkv, kb, vb, tokens, tail, seed=11, seal=False)
    qg = group_queries(mx.random.normal((1, hq, lq, d)), hkv)
    ko, kl, kn = kvarn_partials(qg, d**-0.5, c.parts(), lq, False, per_warp=per, per_fp16=per16)
    eo, el, en = kvarn_partials(qg, d**-0.5, c.parts(), lq, False, per_warp=per, per_fp16=per16, emulate=True)
    assert ko.shape == eo.shape and kn == en
    assert _rel(ko, eo) < KERNEL_TOL and mx.allclose(kl, el, rtol=KERNEL_TOL, atol=KERNEL_TOL).item()


def test_kvarn_splits_give_fp16_units_a_warp_each() -> None:
    """At 128K tokens (1015 records, a 1024-token tail, 8 kv heads) the records share the wave's warps left after
    the fp16 units' 9 (one a warp, whole threadgroups); `per_warp` sets both kinds unless `per_fp16` is given."""
    w = kvarn.KVARN_WARPS
    per, per16, nsr, nsf = kvarn.kvarn_splits(1015, 1024, 8, w)
    assert per16 == kvarn.FP16_UNITS_PER_WARP == 1 and nsf == -(-9 // w)
    assert per == -(-1015 // (-(-kvarn.TARGET_WARPS // 8) - nsf * w)) and nsr == -(-1015 // (per * w))
    assert (nsr + nsf) * w <= kvarn.TARGET_WARPS // 8 + w
    assert kvarn.kvarn_splits(1015, 1024, 8, w, per_warp=5) == (5, 5, -(-1015 // (5 * w)), 1)
    assert kvarn.kvarn_splits(1015, 1024, 8, w, per_warp=5, per_fp16=2) == (5, 2, -(-1015 // (5 * w)), 2)
    parts = _kvarn_cache(128, 2, 4, 4, 128 + 6 * 128 + 300, 256, seed=1).parts()
    assert kvarn.kvarn_plan(4, 128, 2, parts, 1, False, per_warp=2).per16 == 2
    assert kvarn.kvarn_plan(4, 128, 2, parts, 1, False, per_warp=2, per_fp16=1).per16 == 1


def test_kernels_merge_more_splits_than_they_load_at_once(merging_in_kernel: None) -> None:
    """The merging threadgroup loads 16 splits at a time in kvarn_decode, 12 in affine_decode (common.h
    merge_partials): with one record a warp, 19 kvarn splits (the records' 18 rotated, the fp16 one not), and with
    one tile a split, 21 affine ones, each kernel's own merge equals split_merge over the partials of the same
    launch. The CUDA source only (Metal's merges in split_merge): on CPU threads here."""
    with threads.on_cpu_threads("cuda"):
        if build.kernel_backend() != "cuda":
            pytest.skip("an Apple GPU runs the Metal source, which never merges inside the kernel")
        _merges_more_splits_than_they_load_at_once()


def _merges_more_splits_than_they_load_at_once() -> None:
    c = _kvarn_cache(128, 2, 4, 4, 128 + 70 * 128 + 90, 128, seed=12)
    qg = group_queries(mx.random.normal((1, 8, 1, 128)), 2)
    plan = kvarn.kvarn_plan(4, 128, 2, c.parts(), 1, False, per_warp=1)
    assert plan.merge and plan.nsr == 18 and plan.nsr + plan.nsf == 19
    arrays, cap = kvarn.kvarn_inputs(c.parts())
    part_o, part_lse, out, _ = kvarn.kvarn_split_kernel(plan, qg, arrays,
                                                         *kvarn.kvarn_params(plan, c.parts().recent_tokens, cap, 0.1),
                                                         mx.zeros((2,), mx.uint32))
    ref, _ = merge_splits(part_o, part_lse, rotate=True, rotated_splits=plan.nsr)
    assert _rel(out, ref) < 1e-5
    a = _affine_cache(4, 64, 128, 128 * 20 + 3, seed=1)
    kp, vp = ([b.data for b in bufs] for bufs in a.body_buffers)
    aplan = affine.affine_plan(4, 128, 2, a.offset, 4, 64, 1, False, per_split=1)
    assert aplan.merge and aplan.nsplit == 21
    part_o, part_lse, out, _ = affine.affine_split_kernel(aplan, qg, kp, vp,
                                                          *affine.affine_params(aplan, a.offset, kp[0].shape[2], 0.1),
                                                          mx.zeros((2,), mx.uint32))
    ref, _ = merge_splits(part_o, part_lse)
    assert _rel(out, ref) < 1e-5


@gpu
@pytest.mark.parametrize("ring", ["on", "off"])
@pytest.mark.parametrize("case", [KVARN_CASES[0], KVARN_CASES[2]])
def test_kvarn_kernel_equals_emulation_with_and_without_its_ring(case: tuple[int, ...], ring: str) -> None:
    """Whether kvarn_decode stages its code words through the ring (setting `ring`) changes when, never what."""
    d, hq, hkv, lq, kb, vb, tokens, tail = case
    c = _kvarn_cache(d, hkv, kb, vb, tokens, tail, seed=9, seal=False)
    qg = group_queries(mx.random.normal((1, hq, lq, d)), hkv)
    with config.configured(ring=ring):
        ko, kl, _ = kvarn_partials(qg, d**-0.5, c.parts(), lq, lq > 1, per_warp=2)
    eo, el, _ = kvarn_partials(qg, d**-0.5, c.parts(), lq, lq > 1, per_warp=2, emulate=True)
    assert _rel(ko, eo) < KERNEL_TOL and mx.allclose(kl, el, rtol=KERNEL_TOL, atol=KERNEL_TOL).item()


def test_auto_ring_runs_from_long_contexts_on() -> None:
    """"auto": no ring below RING_MIN_RECORDS records a head, the ring from there; "on" / "off" everywhere."""
    n = kvarn.RING_MIN_RECORDS
    assert [kvarn.ring_for(r, "auto") for r in (1, n - 1, n, 4 * n)] == [False, False, True, True]
    assert [kvarn.ring_for(r, s) for r in (1, 4 * n) for s in ("on", "off")] == [True, False, True, False]


def test_launch_bounds_reach_the_cuda_header_only_and_the_name_follows_the_text() -> None:
    """kvarn_decode's CUDA header defines its launch bounds; the Metal header and the other kernels know nothing of
    them. MLX keeps compiled CUDA kernels by name (on disk too), so the name carries a hash of the whole text."""
    assert sources.CUDA_DEFINES["kvarn_decode"] == {"KVARN_THREADS": 32 * kvarn.KVARN_WARPS, "KVARN_MIN_BLOCKS": 3}
    header, _ = assemble("kvarn_decode", "cuda")
    assert header.startswith("#define KVARN_THREADS 128\n#define KVARN_MIN_BLOCKS 3\n")
    assert "__launch_bounds__(KVARN_THREADS, KVARN_MIN_BLOCKS)" in header
    assert "#define KVARN_MIN_BLOCKS" not in assemble("kvarn_decode", "metal")[0]
    assert not assemble("affine_decode", "cuda")[0].startswith("#define")
    assert kvarn.TARGET_WARPS == 132 * kvarn.KVARN_WARPS * kvarn.KVARN_MIN_BLOCKS
    name = sources.cuda_name("kvarn_decode")
    assert re.fullmatch(r"gmlx_kvarn_decode_[0-9a-f]{12}", name) and name != sources.cuda_name("affine_decode")
    real = sources.read
    try:
        sources.read = lambda n: real(n).replace("KNW", "KNW ")
        assert sources.cuda_name("kvarn_decode") != name
    finally:
        sources.read = real
    assert sources.cuda_name("kvarn_decode") == name


def test_kernel_settings_are_explicit_and_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    """config.py: settings come only from configured / set_config (the environment sets none), innermost first;
    a bad value or an unknown setting is refused with what is accepted."""
    monkeypatch.setattr(config, "_explicit", [{}])
    monkeypatch.setattr(config, "_resolved", None)
    monkeypatch.setenv("GMLX_KVARN_RING", "off")  # a retired variable: no longer read
    assert config.current() == config.KernelConfig()
    with config.configured(ring="on") as chosen:
        assert chosen.ring == "on"
        with config.configured(ring="off"):
            assert config.current().ring == "off"
        assert config.current().ring == "on"
    config.set_config(merge_in_kernel=False)
    assert config.as_dict() == {"ring": "auto", "merge_in_kernel": False, "kernel_cache": True}
    with pytest.raises(ValueError, match="ring='sometimes'; accepted: auto, on, off"):
        config.configured(ring="sometimes").__enter__()
    with pytest.raises(ValueError, match="accepted: True or False"):
        config.configured(merge_in_kernel="yes").__enter__()
    with pytest.raises(ValueError, match="no kernel setting fp16_per_warp"):
        config.set_config(fp16_per_warp="one")
    monkeypatch.setattr(config, "_resolved", None)


@pytest.mark.parametrize("d, kb, vb, backend, stages", [
    (128, 6, 6, "cuda", 3), (128, 4, 4, "cuda", 4), (128, 8, 8, "cuda", 2), (256, 6, 6, "cuda", 2),
    (512, 8, 2, "cuda", 0), (128, 4, 4, "metal", 0)])
def test_ring_stages_fill_the_threadgroup_memory(d: int, kb: int, vb: int, backend: str, stages: int) -> None:
    """The ring gets the slots that fit beside the rest of a threadgroup's memory, and none below two."""
    assert kvarn.ring_stages(d, kb, vb, kvarn.KVARN_WARPS, backend) == stages
    limit = kvarn.THREADGROUP_BYTES[backend]
    slot = 4 * kvarn.KVARN_WARPS * kvarn.ring_slot_words(kb, vb)
    rest = kvarn.kvarn_threadgroup_bytes(d, kvarn.KVARN_WARPS, 0)
    if stages:
        assert rest + stages * slot <= limit
        assert stages == kvarn.RING_STAGES_MAX or rest + (stages + 1) * slot > limit
    else:
        assert rest + 2 * slot > limit


def test_ring_is_off_where_it_does_not_fit() -> None:
    """Where no ring fits (head_dim 512 with 8-bit codes) the plan says the ring is off, even when it is asked for."""
    d, hq, hkv, lq, kb, vb, tokens, tail = KVARN_CASES[3]
    parts = _kvarn_cache(d, hkv, kb, vb, tokens, tail, seed=3).parts()
    with config.configured(ring="on"):
        assert not kvarn.kvarn_plan(hq // hkv, d, hkv, parts, lq, False).ring
        d, hq, hkv, lq, kb, vb, tokens, tail = KVARN_CASES[0]
        parts = _kvarn_cache(d, hkv, kb, vb, tokens, tail, seed=3).parts()
        with threads.on_cpu_threads("cuda"):
            plan = kvarn.kvarn_plan(hq // hkv, d, hkv, parts, lq, False)
    assert (plan.ring, plan.stages) == (True, 3)


@gpu
@pytest.mark.parametrize("case", AFFINE_CASES)
def test_affine_fused_matches_reference(case: tuple[int, ...]) -> None:
    bits, gs, d, lq = case
    c = _affine_cache(bits, gs, d, 128 * 9 + 61, seed=bits + gs)
    q = mx.random.normal((1, 4, lq, d))
    c.attention_path = "fused"
    out = _attend(c, q, "causal" if lq > 1 else None)
    assert _rel(out, _affine_dequantized_reference(c, q, "causal" if lq > 1 else None)) < 2e-3


def _affine_dequantized_reference(c: AffineCache, q: mx.array, mask) -> mx.array:
    """Float32 attention over mx.dequantize'd K/V (mlx 0.32.4 CUDA has no float32 quantized_matmul for these)."""
    k, v = _affine_stored(c, mx.float32)
    qr = mx.hadamard_transform(q) if c.rotate_on_arrival else q
    out, _ = grouped_attention(qr.astype(mx.float32), k, v, q.shape[-1] ** -0.5, mask)
    return mx.hadamard_transform(out) if c.rotate_on_arrival else out


@gpu
def test_affine_fused_rotated_and_split_counts() -> None:
    c = _affine_cache(4, 64, 128, 128 * 20 + 3, seed=1, rotate=True)
    q = mx.random.normal((1, 8, 1, 128))
    c.attention_path = "fused"
    assert _rel(_attend(c, q, None), _affine_dequantized_reference(c, q, None)) < 2e-3
    qg = group_queries(q, 2)
    kp, vp = ([b.data for b in bufs] for bufs in c.body_buffers)  # the buffers the fused path reads
    for per in (1, 3, 7):
        ko, kl = affine_partials(qg, 128**-0.5, kp, vp, c.offset, 4, 64, 1, False, per_split=per)
        eo, el = affine_partials(qg, 128**-0.5, kp, vp, c.offset, 4, 64, 1, False, per_split=per, emulate=True)
        assert _rel(ko, eo) < EMU_TOL and mx.allclose(kl, el, rtol=EMU_TOL, atol=EMU_TOL).item()


# Block caches attending through affine_decode: KIVI (K per channel over 32-token blocks), TurboQuant (codebook
# codes and norms in rotated space) and the microscaling floats (codes and byte scales looked up; nvfp4's groups of
# 16). (spec, head dim, query tokens, tokens before them)
BLOCK_CASES = [("kivi:bits=4", 128, 1, 1000), ("kivi:k2v3,sink_tokens=4", 64, 1, 700),
               ("kivi:k3v5,kv_tail_tokens=0", 128, 3, 600), ("kivi:k8v2,sink_tokens=4,kv_tail_tokens=32", 128, 2, 333),
               ("kivi:k6v8", 256, 4, 2100), ("turboquant4", 128, 1, 700), ("turboquant:k3v2,kv_tail_tokens=128,"
               "sink_tokens=4", 128, 2, 900), ("turboquant:k8v3", 64, 1, 500), ("turboquant:k2v8,kv_tail_tokens=32",
               256, 4, 1300), ("mxfp4", 128, 1, 700), ("nvfp4_rot:kv_tail_tokens=128,sink_tokens=4", 128, 2, 900),
               ("mxfp8", 64, 1, 500), ("nvfp4:kv_tail_tokens=32", 256, 4, 1300)]


def _block_cache(spec: str, d: int, tokens: int, lq: int, seed: int):
    """A cache of `spec` holding `tokens` tokens, then `lq` more: the cache and the K/V that update returned."""
    name, options = parse_scheme_spec(spec)
    c = get_scheme(name).make_cache(options)
    c.update_and_fetch(*random_kv(tokens, 2, d, seed=seed))
    keys, values = c.update_and_fetch(*random_kv(lq, 2, d, seed=seed + 50))
    assert c.n_blocks > 0
    return c, keys, values


@pytest.mark.parametrize("case", BLOCK_CASES)
def test_block_kernel_emulated_matches_reference(case: tuple) -> None:
    """The kernel's algorithm in MLX (codes read in place, the fp16 tokens merged by log-sum-exp) gives the
    reference attention over the fetched K/V (which rounds KIVI's decoded values to fp16)."""
    spec, d, lq, tokens = case
    c, keys, values = _block_cache(spec, d, tokens, lq, seed=len(spec))
    q = mx.random.normal((1, 4, lq, d))
    mask = "causal" if lq > 1 else None
    c.attention_path = "reference"
    ref = c.attend(q, keys, values, d**-0.5, mask)
    c.attention_path = "emulated"
    assert _rel(c.attend(q, keys, values, d**-0.5, mask), ref) < 5e-3


@gpu
@pytest.mark.parametrize("case", BLOCK_CASES)
def test_block_kernel_fused_matches_emulation(case: tuple) -> None:
    spec, d, lq, tokens = case
    c, keys, values = _block_cache(spec, d, tokens, lq, seed=len(spec) + 1)
    q = mx.random.normal((1, 8, lq, d)).astype(mx.float16)
    mask = "causal" if lq > 1 else None
    c.attention_path = "emulated"
    want = c.attend(q, keys, values, d**-0.5, mask)
    c.attention_path = "fused"
    got = c.attend(q, keys, values, d**-0.5, mask)
    assert got.dtype == q.dtype and _rel(got, want) < KERNEL_TOL


@gpu
@pytest.mark.parametrize("spec", ["kivi4", "turboquant:k3v4", "mxfp8"])
def test_a_block_call_is_kept_across_decode_steps_and_stays_right(spec: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode steps through blocks being sealed and buffers growing: each step's fused output matches the reference
    path's, and a prepared call is made again only when the blocks reach a new 128-token tile or the buffers grow."""
    made = []
    real = kernel_route.BlockCall

    def counting(*args, **kwargs):
        made.append(args[3])  # the block count it was made for
        return real(*args, **kwargs)

    monkeypatch.setattr(kernel_route, "BlockCall", counting)
    name, options = parse_scheme_spec(spec)
    c = get_scheme(name).make_cache(options)
    c.update_and_fetch(*random_kv(500, 2, 128, seed=5))
    for step in range(80):
        keys, values = c.update_and_fetch(*random_kv(1, 2, 128, seed=100 + step))
        q = mx.random.normal((1, 4, 1, 128))
        c.attention_path = "fused"
        out = c.attend(q, keys, values, 128**-0.5, None)
        c.attention_path = "reference"
        assert _rel(out, c.attend(q, keys, values, 128**-0.5, None)) < 5e-3, step
    assert 1 < len(made) <= 4, made  # 15 to 18 blocks: one or two tiles, one buffer growth


@gpu
@pytest.mark.parametrize("spec", ["kivi:bits=4,sink_tokens=4", "turboquant4", "nvfp4_rot"])
def test_a_block_decode_step_is_one_launch_that_reads_the_fp16_tokens(spec: str, monkeypatch: pytest.MonkeyPatch
                                                                      ) -> None:
    """A block cache's decode attention launches affine_decode once, over the codes and the fp16 sink and recent
    tokens together, and nothing else where the kernel merges its splits (CUDA); Metal's merge is one split_merge
    after it."""
    c, keys, values = _block_cache(spec, 128, 600, 2, seed=9)
    q = mx.random.normal((1, 4, 2, 128))
    c.attention_path = "fused"
    assert selfcheck.passed("affine_decode")
    build.forget_kernels()  # a GPU replays a graph compiled earlier without calling launch: trace it afresh
    launched = []
    for module in (affine, splits):
        real = module.launch
        monkeypatch.setattr(module, "launch",
                            lambda name, *a, real=real, **k: launched.append(name) or real(name, *a, **k))
    out = c.attend(q, keys, values, 128**-0.5, "causal")
    merged_here = build.kernel_backend() == "cuda"
    assert launched == (["affine_decode"] if merged_here else ["affine_decode", "split_merge"])
    c.attention_path = "emulated"
    monkeypatch.undo()
    assert _rel(out, c.attend(q, keys, values, 128**-0.5, "causal")) < KERNEL_TOL


@pytest.mark.parametrize("spec", ["kivi4", "nvfp4_rot", "turboquant:bits=4,kv_tail_tokens=64,sink_tokens=4"])
def test_a_decode_steps_fetch_on_the_fused_route_is_the_full_fetch(spec: str) -> None:
    """Where a decode step may take the fused route, the K/V it returns reuse the decoded blocks until the next
    seal; they equal what a cache on the reference path returns for the same tokens, step after step."""
    name, options = parse_scheme_spec(spec)
    fused, plain = (get_scheme(name).make_cache(options) for _ in range(2))
    fused.attention_path, plain.attention_path = "fused", "reference"
    for c in (fused, plain):
        c.update_and_fetch(*random_kv(300, 2, 128, seed=7))
    for step in range(70):  # two blocks sealed on the way
        token = random_kv(1, 2, 128, seed=200 + step)
        got, want = fused.update_and_fetch(*token), plain.update_and_fetch(*token)
        assert all(mx.array_equal(a, b).item() for a, b in zip(got, want)), step


def test_a_block_cache_that_rotates_on_arrival_takes_the_reference_path() -> None:
    """The kernel reads a block cache's fp16 tokens in the model's space; a subclass that rotates every token on
    arrival (its sink and recent tokens stored rotated) attends through the reference path, so the "emulated"
    route gives the reference output, and the rotation is undone."""
    from gmlx_lab.cache.kivi import KiviCache

    class RotatedKivi(KiviCache):
        rotate_on_arrival = True

        def rotate(self, x: mx.array) -> mx.array:
            return mx.hadamard_transform(x)

        unrotate = rotate  # the normalized transform is its own inverse

    c = RotatedKivi(sink_tokens=4)
    c.update_and_fetch(*random_kv(300, 2, 128, seed=1))
    keys, values = c.update_and_fetch(*random_kv(1, 2, 128, seed=2))
    q = mx.random.normal((1, 4, 1, 128))
    c.attention_path = "emulated"
    out = c.attend(q, keys, values, 128**-0.5, None)
    c.attention_path = "reference"
    assert c.n_blocks and mx.array_equal(out, c.attend(q, keys, values, 128**-0.5, None)).item()
    plain = mx.fast.scaled_dot_product_attention(q, keys, values, scale=128**-0.5, mask=None)
    assert _rel(out, plain) < 1e-5  # the fetched K/V are in the model's space


@pytest.mark.parametrize("spec", ["kivi4", "turboquant4", "turboquant:bits=4,qjl=1", "nvfp4"])
def test_a_block_cache_takes_the_reference_path_where_the_kernel_does_not_apply(spec: str) -> None:
    """Before its first block a cache is all fp16, and TurboQuant's QJL has no fused form: the "emulated" route
    steps aside for the reference path there (the same output), and takes the kernel's path once it applies."""
    name, options = parse_scheme_spec(spec)
    c = get_scheme(name).make_cache(options)
    q = mx.random.normal((1, 4, 1, 128))
    for tokens in (20, 400):
        keys, values = c.update_and_fetch(*random_kv(tokens, 2, 128, seed=tokens))
        c.attention_path = "emulated"
        out = c.attend(q, keys, values, 128**-0.5, None)
        c.attention_path = "reference"
        same = mx.array_equal(out, c.attend(q, keys, values, 128**-0.5, None)).item()
        assert same == (c.n_blocks == 0 or bool(getattr(c, "qjl", 0))), (tokens, c.n_blocks)


@gpu
@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("kind", ["k", "v"])
def test_seal_matches_encode_tiles(bits: int, kind: str) -> None:
    k, v = random_kv(128 * 3, 2, 256, seed=bits)
    x = mx.hadamard_transform(k if kind == "k" else v).astype(mx.float16)
    got = seal_records(x, bits, kind)
    want = encode_tokens(x, bits, kind)
    qa, qb = unpack_rows(got.codes, bits).astype(mx.int32), unpack_rows(want.codes, bits).astype(mx.int32)
    diff = mx.abs(qa - qb)
    frac = mx.mean(diff > 0).item()
    print(f"seal k/v={kind} bits={bits}: {frac:.2e} of codes differ, max step {diff.max().item()}")
    assert frac <= 2e-3 and diff.max().item() <= 1  # summation order flips at most a few roundings by one step
    # axis vectors are fp16 and may differ by an ulp; compare what they decode to
    assert _rel(decode_tiles(*got.arrays, bits), decode_tiles(*want.arrays, bits)) < 5e-3
    assert mx.allclose(got.imbalance_after, want.imbalance_after, rtol=1e-3).item()


@gpu
@pytest.mark.parametrize(("bits", "kind", "dim", "dtype"), [(6, "k", 128, mx.float16), (3, "v", 256, mx.float16),
                                                           (5, "k", 512, mx.float32), (2, "v", 128, mx.float16)])
def test_unpack_kernel_decodes_records(bits: int, kind: str, dim: int, dtype: mx.Dtype) -> None:
    """kvarn_unpack gives back the tokens that records.decode_tokens computes (prefill attention reads them)."""
    k, v = random_kv(128 * 3, 2, dim, seed=bits)
    records = encode_tokens(mx.hadamard_transform(k if kind == "k" else v), bits, kind)
    got = unpack_records(records, dtype)
    assert got.dtype == dtype and got.shape == (1, 2, 384, dim)
    assert _rel(got, decode_tokens(records)) < (1e-3 if dtype == mx.float16 else 1e-6)



@gpu
@pytest.mark.parametrize("case", [0, 2, 3, 6], ids=["d128", "d256", "d512", "no-recent"])
@pytest.mark.parametrize("dtype", [mx.float16, mx.float32])
def test_unpack_kernel_gives_the_fetched_kv(case: int, dtype: mx.Dtype) -> None:
    """kvarn_tokens (kvarn_unpack with ROTATE) is the reference fetch in one launch: the fp16 sink, the body
    decoded and rotated back, the recent tokens; with the recent tokens left out, the sink and body alone."""
    d, _, hkv, _, kb, vb, tokens, tail = KVARN_CASES[case]
    c = _kvarn_cache(d, hkv, kb, vb, tokens, tail, seed=case)
    c.attention_path = "reference"  # the pure-MLX fetch, also on a GPU
    want = c.fetch(dtype)
    n = c.recent_count
    assert (n == 0) == (case == 6)
    for i, (sink, body, buf) in enumerate(zip(c.sink, c.records, c.recent)):
        got = kvarn_tokens(sink, body, buf.data if n else None, n, dtype)
        assert got.dtype == dtype and got.shape == want[i].shape
        assert _rel(got, want[i]) < (1e-3 if dtype == mx.float16 else 1e-5)
        prefix = kvarn_tokens(sink, body, None, 0, dtype)
        assert prefix.shape[2] == want[i].shape[2] - n and mx.array_equal(prefix, got[:, :, :prefix.shape[2]]).item()


# -- the CPU-thread runner itself (tests/conftest.py routes the `gpu` tests through it on a CPU) ------------
def test_cpu_threads_catch_a_one_lane_slip(monkeypatch: pytest.MonkeyPatch) -> None:
    """kvarn_decode with the zero-point shuffle reading the wrong lane must fail against the emulation: the
    CPU-thread runs of the `gpu` tests are not vacuous."""
    c = _kvarn_cache(128, 2, 6, 6, 128 + 3 * 128 + 77, 128, seed=0)
    qg = group_queries(mx.random.normal((1, 4, 1, 128)), 2)
    eo, _, _ = kvarn_partials(qg, 0.1, c.parts(), 1, False, per_warp=1, emulate=True)
    real = sources.read
    with _on_cpu(), threads.on_cpu_threads():
        good, _, _ = kvarn_partials(qg, 0.1, c.parts(), 1, False, per_warp=1)
        slip = lambda name: real(name).replace("simd_shuffle_f(zq, 8u * t + 4u)", "simd_shuffle_f(zq, 8u * t)")  # noqa: E731
        monkeypatch.setattr(sources, "read", slip)
        bad, _, _ = kvarn_partials(qg, 0.1, c.parts(), 1, False, per_warp=1)
    assert _rel(good, eo) < KERNEL_TOL and _rel(bad, eo) > 0.1


def test_cpu_threads_refuse_what_they_cannot_run() -> None:
    x = mx.zeros((4,), mx.bfloat16)
    with pytest.raises(ValueError, match="accept"):
        threads.launch("split_merge", {"x": x}, {"o": ((4,), mx.float32)}, (32, 1, 1), (32, 1, 1), {})
    with pytest.raises(ValueError, match="threadgroup"):
        threads.launch("split_merge", {}, {"o": ((4,), mx.float32)}, (32, 1, 1), (48, 1, 1), {})


# -- the Metal sources on CPU threads: the text MLX compiles, the shim's meaning of Metal, slips caught ------------
# (the `gpu` tests above run every kernel from its Metal source too; these check what makes those runs faithful)
def _launches(monkeypatch: pytest.MonkeyPatch) -> dict[str, tuple]:
    """The first launch of each kernel in small real uses (kvarn and affine decode, merge, seal), as
    build.launch hands it to the Metal runner."""
    seen: dict[str, tuple] = {}
    real = threads.launch

    def record(name, inputs, outputs, grid, threadgroup, template, source="cuda"):
        seen.setdefault(name, (inputs, outputs, grid, threadgroup, template))
        return real(name, inputs, outputs, grid, threadgroup, template, source=source)

    monkeypatch.setattr(threads, "launch", record)
    with _on_cpu(), threads.on_cpu_threads("metal"):
        c = _kvarn_cache(128, 2, 4, 4, 128 + 2 * 128 + 5, 0, seed=1)
        c.attention_path = "fused"
        _attend(c, mx.random.normal((1, 4, 1, 128)), None)
        a = _affine_cache(4, 64, 128, 128 + 7, seed=1)
        a.attention_path = "fused"
        _attend(a, mx.random.normal((1, 4, 1, 128)), None)
        k, _ = random_kv(128, 1, 128)
        unpack_records(seal_records(mx.hadamard_transform(k).astype(mx.float16), 4, "k", iters=1))
    assert set(seen) == set(KERNELS)
    return seen


def _mlx_source(name: str, inputs: dict, outputs: dict, grid: tuple, threadgroup: tuple, template: dict,
                tmp_path, capfd: pytest.CaptureFixture) -> str:
    """The source mx.fast.metal_kernel itself generates: exporting a function traces the kernel without running
    it (no Metal needed), and verbose=True prints the source."""
    header, source = (sources.compact(text) for text in assemble(name, "metal"))  # what build.launch gives MLX
    kernel = mx.fast.metal_kernel(name=f"gmlx_{name}", input_names=list(inputs), output_names=list(outputs),
                                  source=source, header=header, ensure_row_contiguous=True)

    def f(*arrays):
        return kernel(inputs=list(arrays), template=list(template.items()), grid=grid, threadgroup=threadgroup,
                      output_shapes=[s for s, _ in outputs.values()], output_dtypes=[d for _, d in outputs.values()],
                      verbose=True)

    capfd.readouterr()
    mx.export_function(os.fspath(tmp_path / f"{name}.mlxfn"), f, *inputs.values())
    printed = capfd.readouterr().out
    return re.search(r"```\n(.*)\n```", printed, re.S).group(1)


def test_metal_source_is_what_mlx_generates(monkeypatch: pytest.MonkeyPatch, tmp_path,
                                            capfd: pytest.CaptureFixture) -> None:
    """build.metal_source writes, character for character, the text MLX 0.32.4 compiles for each kernel; with
    small inputs too (the `constant` address space and a `c` in the kernel's name)."""
    for name, (inputs, outputs, grid, threadgroup, template) in _launches(monkeypatch).items():
        want = _mlx_source(name, inputs, outputs, grid, threadgroup, template, tmp_path, capfd)
        assert sources.metal_source(name, inputs, outputs, template)[1] == want, name
    small = {"part_o": mx.zeros((1, 1, 4, 128)), "part_lse": mx.zeros((1, 1, 4)), "params": mx.array([1], mx.int32)}
    outputs = {"out": ((1, 4, 128), mx.float16), "lse": ((1, 4), mx.float32)}
    template = {"D": 128, "NQ": 4, "ROTATE": 1, "ODT": 1}
    kname, text = sources.metal_source("split_merge", small, outputs, template)
    assert text == _mlx_source("split_merge", small, outputs, (128, 4, 1), (128, 1, 1), template, tmp_path, capfd)
    assert "const constant float* part_lse [[buffer(1)]]" in text and kname.endswith("_floatc_int32_tc_float16_t_float")


def test_threadgroup_variables_become_static() -> None:
    """Threadgroup storage is one copy per threadgroup: `static` (threadgroups run in turn); a `threadgroup`
    qualifying a pointer or a cast stays, for the shim to define as nothing."""
    text = ("threadgroup float q_sh[8 * D];\nthreadgroup float m_sh[4], l_sh[4];\nthreadgroup float4 q4[QB * D / 4];\n"
            "threadgroup float* pw = p_sh + 4;\nconst float2 pa = *(threadgroup float2*)(pw + 2);\n"
            "void f(threadgroup const float* x);\n")
    assert threads.threadgroup_storage_static(text) == text.replace("threadgroup float q_sh", "static float q_sh") \
        .replace("threadgroup float m_sh", "static float m_sh").replace("threadgroup float4", "static float4")


def test_metal_address_spaces_are_kept_apart() -> None:
    """MLX passes an input of fewer than 8 elements in the `constant` address space; split_merge points a
    `const device` pointer into part_lse, which Metal refuses for such a small one, and so does the shim.
    build.launch pads small inputs for Metal, so the merge runs and matches its emulation."""
    po, pl = mx.random.normal((1, 1, 4, 128)), mx.random.normal((1, 1, 4))
    with pytest.raises(RuntimeError, match=r"invalid conversion from .const volatile float\*. to .const float\*."):
        threads.launch("split_merge", {"part_o": po, "part_lse": pl, "params": mx.array([1], mx.int32)},
                       {"out": ((1, 4, 128), mx.float32), "lse": ((1, 4), mx.float32)}, (128, 4, 1), (128, 1, 1),
                       {"D": 128, "NQ": 4, "ROTATE": 0, "ODT": 0}, source="metal")
    with _on_cpu(), threads.on_cpu_threads("metal"):
        o, lse = merge_splits(po, pl)
    eo, el = merge_splits(po, pl, emulate=True)
    assert _rel(o, eo) < 1e-5 and mx.allclose(lse, el).item()


@pytest.mark.skipif(sys.platform != "linux", reason="the runner reads symbol sizes from ELF libraries (nm -S)")
def test_metal_threadgroup_memory_fits_apple_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """Apple GPUs give a threadgroup 32 KB. The runner refuses a Metal kernel that declares more (affine_decode
    with 4 query vectors of head_dim 1024: 35 KB), and kernels/affine.py picks 3 there (kernels/kvarn.py two warps
    past 256). KIVI's K stages its code words and folded queries beside them: three vectors fit at head_dim 512
    and 1024, and a KIVI cache at 512 runs from Metal's source and matches the emulation."""
    c = _affine_cache(4, 128, 1024, 128 + 5, seed=0)
    q = mx.random.normal((1, 4, 2, 1024))
    c.attention_path = "fused"
    with _on_cpu(), threads.on_cpu_threads("metal"):
        assert affine.affine_qb_max(1024) == 3 and kvarn.kvarn_warps(512) == 2 and kvarn.kvarn_warps(256) == 4
        assert [affine.affine_qb_max(d, kchan=True) for d in (128, 256, 512, 1024)] == [4, 4, 3, 3]
        out = _attend(c, q, "causal")
        kivi, keys, values = _block_cache("kivi4", 512, 300, 1, seed=3)
        qk = mx.random.normal((1, 8, 1, 512))
        kivi.attention_path = "fused"
        fused = kivi.attend(qk, keys, values, 512**-0.5, None)
        monkeypatch.setattr(affine, "affine_qb_max", lambda d, kchan=False: 4)
        fresh = _affine_cache(4, 128, 1024, 128 + 5, seed=0)  # c keeps its call while its inputs stay
        fresh.attention_path = "fused"
        with pytest.raises(RuntimeError, match="35008 bytes of threadgroup memory; Apple GPUs allow 32768"):
            _attend(fresh, q, "causal")
    assert _rel(out, _affine_dequantized_reference(c, q, "causal")) < 2e-3
    kivi.attention_path = "emulated"
    assert _rel(fused, kivi.attend(qk, keys, values, 512**-0.5, None)) < KERNEL_TOL


def test_metal_mma_slip_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Metal prelude's mma16816 runs as written: with one SIMD shuffle reading the wrong lane (column 2t's
    B values fetched for column 2t+1), kvarn_decode from its Metal source fails against the emulation."""
    c = _kvarn_cache(128, 2, 6, 6, 128 + 3 * 128 + 77, 128, seed=0)
    qg = group_queries(mx.random.normal((1, 4, 1, 128)), 2)
    eo, _, _ = kvarn_partials(qg, 0.1, c.parts(), 1, False, per_warp=1, emulate=True)
    real = sources.read
    right, wrong = "simd_shuffle(b[h], ushort(8 * t + 4 + src))", "simd_shuffle(b[h], ushort(8 * t + src))"
    assert right in real("prelude_metal.h")
    with _on_cpu(), threads.on_cpu_threads("metal"):
        good, _, _ = kvarn_partials(qg, 0.1, c.parts(), 1, False, per_warp=1)
        monkeypatch.setattr(sources, "read", lambda name: real(name).replace(right, wrong))
        bad, _, _ = kvarn_partials(qg, 0.1, c.parts(), 1, False, per_warp=1)
    assert _rel(good, eo) < KERNEL_TOL and _rel(bad, eo) > 0.1


@pytest.mark.parametrize("source", threads.SOURCES)
def test_cpu_threads_report_a_deadlock(monkeypatch: pytest.MonkeyPatch, source: str) -> None:
    """A barrier that only some lanes reach (here lane 0 of each SIMD group, in split_merge) stops the launch
    with an error instead of hanging: no lane arrives anywhere during a whole turn of the waiting lanes."""
    real = sources.read
    slip = lambda name: real(name).replace("BARRIER();\nbig = red[0];", "if (LANE == 0) BARRIER();\nbig = red[0];")  # noqa: E731
    monkeypatch.setattr(sources, "read", slip)
    with _on_cpu(), threads.on_cpu_threads(source), pytest.raises(RuntimeError, match="deadlocked"):
        merge_splits(mx.random.normal((1, 2, 4, 128)), mx.random.normal((1, 2, 4)))


@pytest.mark.parametrize("source", threads.SOURCES)
def test_cpu_lanes_on_ucontext(monkeypatch: pytest.MonkeyPatch, source: str) -> None:
    """cpu_lanes.h switches fibers by ucontext where it has no x86-64 switch; -DGMLX_UCONTEXT builds that here."""
    monkeypatch.setattr(threads, "CXX", [*threads.CXX, "-DGMLX_UCONTEXT"])
    po, pl = mx.random.normal((2, 5, 4, 128)), mx.random.normal((2, 5, 4))
    with _on_cpu(), threads.on_cpu_threads(source):
        o, lse = merge_splits(po, pl, rotate=True)
    eo, el = merge_splits(po, pl, rotate=True, emulate=True)
    assert _rel(o, eo) < 1e-5 and mx.allclose(lse, el).item()


def test_cpu_threads_refuse_an_unknown_source() -> None:
    with pytest.raises(ValueError, match="cuda or metal"):
        with threads.on_cpu_threads("vulkan"):
            pass
    with pytest.raises(RuntimeError, match="on_cpu_threads"):
        threads.current_source()


@gpu
def test_an_affine_decode_call_is_kept_while_its_inputs_are(monkeypatch: pytest.MonkeyPatch) -> None:
    """An affine cache prepares its fused call once and makes it again while nothing it was made from changed
    (AffineCache._fused_call): each step matches SDPA over the fetched K/V; a new 128-token tile of tokens (with
    the buffers' growth at 257 tokens) and a trim prepare a new call."""
    import gmlx_lab.cache.affine.cache as affine_module

    made = []

    class Counted(affine.AffineCall):
        def __init__(self, *args, **kwargs) -> None:
            made.append(args[4])
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(affine_module, "AffineCall", Counted)
    c = AffineCache(4, 64)
    c.attention_path = "fused"
    c.update_and_fetch(*random_kv(249, 2, 128, seed=1))

    def step(seed: int) -> None:
        k, v = random_kv(1, 2, 128, seed=seed)
        keys, values = c.update_and_fetch(k, v)
        q = mx.random.normal((1, 4, 1, 128))
        with mx.stream(mx.cpu):
            want = mx.fast.scaled_dot_product_attention(q, keys, values, scale=0.1, mask=None)
        assert _rel(c.attend(q, keys, values, 0.1, None), want) < 5e-3, (seed, c.offset)

    step(20)  # 250: the kernel's self-check runs at its first use, which changes the route's inputs once
    step(21)
    made.clear()
    for seed in range(9):  # 252..260 tokens: a third tile and larger buffers from 257
        step(seed)
    assert made == [257], made
    c.trim(2)
    step(22)  # 259 again, after dropping two rows
    assert made == [257, 259], made


def test_a_kept_call_is_made_again_when_what_it_read_changes() -> None:
    """BlockCache.kept_call: the call is kept while its arrays are the same objects and its values equal; another
    array object, another value or dropped blocks (a trim) make it again; appended blocks alone do not drop it."""
    c = AffineCache(4, 64)
    c.attention_path = "fused"  # a route that can be fused (on the CPU's "auto" kept_call answers None at once)
    c.update_and_fetch(*random_kv(8, 2, 128))
    made = []
    q = mx.zeros((1, 4, 1, 128))

    def make() -> int:
        made.append(len(made))
        return made[-1]

    a = mx.zeros((1,))
    assert [c.kept_call(q, 0.1, None, (a,), (1,), make) for _ in range(2)] == [0, 0]
    assert c.kept_call(q, 0.1, None, (mx.zeros((1,)),), (1,), make) == 1
    assert c.kept_call(q, 0.1, None, (a,), (2,), make) == 2
    c.update_and_fetch(*random_kv(1, 2, 128, seed=1))
    assert c.kept_call(q, 0.1, None, (a,), (2,), make) == 2
    c.trim(1)
    assert c.kept_call(q, 0.1, None, (a,), (2,), make) == 3


def test_a_graph_function_compiles_once_per_key_and_reads_every_array_at_each_call(monkeypatch):
    """On a GPU, decode attention is one compiled graph per launch geometry (build.graph_function). What changes
    between steps (the kernels' parameter arrays: the token count) is an input, read anew at each call, never
    baked into the trace; another key is another graph; the CPU calls the graph as it is."""
    monkeypatch.setattr(build, "active_backend", lambda: "cuda")  # compile as on a GPU (this graph is pure MLX)
    traced = []

    def graph(key: float, x: mx.array, params: mx.array) -> mx.array:
        traced.append(key)
        return x * key + params

    x = mx.ones((4,))
    for step in range(3):
        assert build.graph_function(graph, 2.0)(x, mx.array([float(step)])).tolist() == [2.0 + step] * 4
    assert traced == [2.0]  # traced once, replayed twice
    assert build.graph_function(graph, 3.0)(x, mx.array([1.0])).tolist() == [4.0] * 4
    assert traced == [2.0, 3.0]
    monkeypatch.setattr(build, "active_backend", lambda: "cpu")
    assert build.graph_function(graph, 2.0)(x, mx.array([5.0])).tolist() == [7.0] * 4
    assert traced == [2.0, 3.0, 2.0]
