"""Run the real CUDA source of kvarn_decode on the CPU and compare it with its pure-MLX emulation.

The kernel text is assembled as `gmlx_lab.kernels.build.assemble("kvarn_decode", "cuda")` assembles it,
with tools/prelude_cpu.h in place of prelude_cuda.h: one OS thread per GPU lane, warp operations
(shuffles, mma.m16n8k16, __syncwarp) synchronized per warp, __syncthreads per block, blocks in turn.
The inputs and the launch are those of `gmlx_lab.kernels.decode.kvarn_partials`; for each test case this
prints each split's relative error of part_o against `kvarn_partials(..., emulate=True)` and the largest
difference of part_lse. Exit code 0 only when every case is within TOL.
Usage: .venv/bin/python tools/cpu_kernel.py [--case N ...]
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))
from compile_cuda import SIGNATURES  # noqa: E402

from gmlx_lab.cache.kvarn import KVarNCache  # noqa: E402
from gmlx_lab.kernels import build  # noqa: E402
from gmlx_lab.kernels.decode import (  # noqa: E402
    DTYPE_IDS,
    KVARN_QN,
    KVARN_WARPS,
    TARGET_WARPS,
    _is_pow2,
    group_queries,
    kvarn_partials,
    kvarn_units,
    merge_splits,
)

NAME = "kvarn_decode"
PRELUDE = ROOT / "tools" / "prelude_cpu.h"
CACHE_DIR = Path("/tmp/gmlx_cpu_kernel")
CXX = ["g++", "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", "-fno-strict-aliasing"]
TOL = 2e-2
CTYPES = {"__half": "HALF", "uint32_t": "uint32_t", "int32_t": "int32_t", "float": "float"}
NP_DTYPES = {"HALF": np.float16, "uint32_t": np.uint32, "int32_t": np.int32, "float": np.float32}

# (d, hq, hkv, query tokens L, k bits, v bits, tokens, kv tail tokens)
CASES = [
    (128, 4, 2, 1, 6, 6, 128 + 3 * 128 + 77, 128),
    (128, 16, 2, 1, 4, 4, 128 + 2 * 128 + 5, 128),  # NQ = 8: exactly one chunk
    (128, 8, 2, 4, 6, 6, 128 + 2 * 128 + 77, 128),  # causal, L = 4: the mask reaches only recent tokens
    (256, 8, 2, 1, 3, 5, 128 + 2 * 128 + 70, 128),  # two slices, odd widths
    (128, 20, 2, 1, 5, 8, 128 + 2 * 128 + 10, 0),   # NQ = 10: two chunks, the second partly empty (7 bits: no)
    (128, 4, 2, 1, 2, 6, 128 + 2 * 128, 0),         # no recent tokens (NR = 0: placeholder rk, rv)
    (128, 4, 2, 1, 6, 6, 128 + 9 * 128 + 200, 256),  # 8 records, 3 recent tiles (the last partial)
]
PER_WARPS = (1, 2, 3)  # 3: runs of a warp that go from records on to the sink and recent tiles


def signature(template: dict[str, int]) -> list[tuple[str, str, bool]]:
    """(name, C type, is output) of the kernel's arguments, q typed after QDT."""
    inputs, outputs = SIGNATURES[NAME]
    q_type = {0: "float", 1: "HALF"}[template["QDT"]]
    args = [(n, q_type if n == "q" else CTYPES[t], False) for n, t in inputs]
    return args + [(n, CTYPES[t], True) for n, t in outputs]


def cpp_source(template: dict[str, int]) -> str:
    """prelude_cpu.h + common.h + kvarn_decode.h, the body as one block's function, and the launcher."""
    header, body = build.assemble(NAME, "cuda")
    cuda_prelude = build.read("prelude_cuda.h")
    assert header.startswith(cuda_prelude)
    header = f'#include "{PRELUDE}"\n' + header[len(cuda_prelude):]
    args = signature(template)
    params = ",\n    ".join(f"{'' if out else 'const '}{t}* {n}" for n, t, out in args)
    consts = "".join(f"  constexpr int {k} = {v};\n" for k, v in template.items())
    run_params = ", ".join(f"void* {n}_" for n, _, _ in args)
    casts = ", ".join(f"static_cast<{'' if out else 'const '}{t}*>({n}_)" for n, t, out in args)
    return (f"{header}\n"
            f"static void kernel_block(\n    {params}) {{\n{consts}{body}\n}}\n\n"
            f'extern "C" void run({run_params}, u32 grid_y, u32 grid_z, u32 threads) {{\n'
            f"  gmlx_launch(grid_y, grid_z, threads, [&] {{ kernel_block({casts}); }});\n}}\n")


def compiled(template: dict[str, int]) -> ctypes.CDLL:
    """The kernel for these template constants as a shared library, cached in CACHE_DIR by a hash of its text."""
    text = cpp_source(template)
    key = hashlib.sha256((text + PRELUDE.read_text() + " ".join(CXX)).encode()).hexdigest()[:16]
    so = CACHE_DIR / f"{NAME}_{key}.so"
    if not so.exists():
        CACHE_DIR.mkdir(parents=True, exist_ok=True)
        cpp = so.with_suffix(".cpp")
        cpp.write_text(text)
        res = subprocess.run([*CXX, str(cpp), "-o", str(so)], capture_output=True, text=True)
        if res.returncode:
            raise SystemExit(f"g++ failed on {cpp}:\n{res.stderr[-6000:]}")
    return ctypes.CDLL(str(so))


def run_kernel(qg: mx.array, scale: float, cache: KVarNCache, length: int, causal: bool,
               per_warp: int) -> tuple[np.ndarray, np.ndarray]:
    """kvarn_partials' kernel launch, run through the CPU harness: part_o, part_lse."""
    bh, nq, d = qg.shape
    kbody, vbody = cache.body
    r, s = kbody["codes"].shape[2:4]
    nchunk = -(-nq // KVARN_QN)
    sk, sv, rk, rv = cache.sink[0], cache.sink[1], cache.recent[0], cache.recent[1]
    ns = sk.shape[2]
    nr = 0 if rk is None else rk.shape[2]
    units = kvarn_units(r, nr)
    per = per_warp or -(-units // -(-TARGET_WARPS // (bh * nchunk)))
    nsplit = -(-units // (per * KVARN_WARPS))
    rotate_here = _is_pow2(d)
    if not rotate_here:
        qg = mx.hadamard_transform(qg)
    if nr == 0:
        rk = rv = mx.zeros((1,), mx.float16)
    template = {"KB": cache.k_bits, "VB": cache.v_bits, "S": s, "NQ": nq, "NCHUNK": nchunk, "L": length,
                "WARPS": KVARN_WARPS, "ROTATE": int(rotate_here), "QDT": DTYPE_IDS[qg.dtype]}
    values = {"q": qg, "kc": kbody["codes"], "ks": kbody["scale_axis"], "kz": kbody["zp_axis"],
              "ko": kbody["other_axis"], "vc": vbody["codes"], "vs": vbody["scale_axis"], "vz": vbody["zp_axis"],
              "vo": vbody["other_axis"], "sk": sk, "sv": sv, "rk": rk, "rv": rv,
              "params": mx.array([r, per, ns, nr, int(causal), nsplit], mx.int32),
              "fparams": mx.array([scale], mx.float32)}
    shapes = {"part_o": (bh, nsplit, nq, d), "part_lse": (bh, nsplit, nq)}
    arrays = []
    for name, ctype, out in signature(template):
        if out:
            arrays.append(np.full(shapes[name], np.nan, np.float32))   # unwritten elements show up as nan
        else:
            a = np.ascontiguousarray(np.array(values[name]))
            assert a.dtype == NP_DTYPES[ctype], (name, a.dtype, ctype)
            arrays.append(a)
    lib = compiled(template)
    lib.run(*(a.ctypes.data_as(ctypes.c_void_p) for a in arrays),
            ctypes.c_uint(nsplit), ctypes.c_uint(bh * nchunk), ctypes.c_uint(32 * KVARN_WARPS))
    return arrays[-2], arrays[-1]


def make_cache(d: int, hkv: int, kb: int, vb: int, tokens: int, tail: int, seed: int) -> KVarNCache:
    """A kvarn cache of random K/V (a few outlier channels in K, as tests/conftest.py random_kv)."""
    mx.random.seed(seed)
    k = mx.random.normal((1, hkv, tokens, d)) * mx.where(mx.arange(d) % 37 == 3, 20.0, 1.0)
    v = mx.random.normal((1, hkv, tokens, d))
    cache = KVarNCache(kb, vb, kv_tail_tokens=tail)
    for i in range(0, tokens, 333):
        cache.update_and_fetch(k[:, :, i:i + 333], v[:, :, i:i + 333])
    return cache


def lse_diff(a: np.ndarray, b: np.ndarray) -> float:
    """Largest |a - b| of log-sum-exps; -inf against -inf counts as equal, against a finite value as inf."""
    both_inf = np.isneginf(a) & np.isneginf(b)
    return float(np.max(np.where(both_inf, 0.0, np.abs(a - b)), initial=0.0))


def fmt(x: np.ndarray) -> str:
    return "[" + " ".join(f"{v:.4f}" for v in x) + "]"


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm((a - b).ravel()) / max(np.linalg.norm(b.ravel()), 1e-30))


def check_case(index: int, case: tuple[int, ...], per_warp: int) -> bool:
    d, hq, hkv, length, kb, vb, tokens, tail = case
    cache = make_cache(d, hkv, kb, vb, tokens, tail, seed=index)
    mx.random.seed(100 + index)
    qg = group_queries(mx.random.normal((1, hq, length, d)), hkv)
    scale, causal = d**-0.5, length > 1
    nr = 0 if cache.recent[0] is None else cache.recent[0].shape[2]
    t0 = time.perf_counter()
    ko, kl = run_kernel(qg, scale, cache, length, causal, per_warp)
    seconds = time.perf_counter() - t0
    eo, el = (np.array(x) for x in kvarn_partials(qg, scale, cache, length, causal, per_warp=per_warp,
                                                   emulate=True))
    merged = [np.array(merge_splits(mx.array(o), mx.array(lse), rotate=True, emulate=True)[0])
              for o, lse in ((ko, kl), (eo, el))]
    print(f"case {index}: d={d} hq={hq} hkv={hkv} L={length} bits={kb}/{vb} tokens={tokens} tail={tail} "
          f"records={cache.n_records} NR={nr} NQ={qg.shape[1]} per_warp={per_warp} "
          f"nsplit={ko.shape[1]} (kernel {seconds:.1f} s)")
    if ko.shape != eo.shape or kl.shape != el.shape:
        print(f"  FAIL shapes: kernel {ko.shape} {kl.shape}, emulation {eo.shape} {el.shape}")
        return False
    worst_o = worst_l = 0.0
    for sp in range(ko.shape[1]):
        r_o, d_l = rel(ko[:, sp], eo[:, sp]), lse_diff(kl[:, sp], el[:, sp])
        worst_o, worst_l = max(worst_o, r_o), max(worst_l, d_l)
        nans = int(np.isnan(ko[:, sp]).sum() + np.isnan(kl[:, sp]).sum())
        flag = "" if r_o < TOL and d_l < TOL and not nans else "   <-- FAIL"
        print(f"  split {sp}: part_o rel {r_o:.2e}  part_lse max|diff| {d_l:.2e}"
              f"{f'  nan {nans}' if nans else ''}  lse[0, :4] kernel {fmt(kl[0, sp, :4])} "
              f"emul {fmt(el[0, sp, :4])}{flag}")
    ok = worst_o < TOL and worst_l < TOL and not np.isnan(ko).any() and not np.isnan(kl).any()
    print(f"  max part_o rel {worst_o:.2e}, max part_lse diff {worst_l:.2e}, merged output rel "
          f"{rel(*merged):.2e}: {'ok' if ok else 'FAIL'}")
    return ok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", type=int, nargs="*", help="indices into CASES (default: all)")
    ap.add_argument("--per-warp", type=int, nargs="*", default=list(PER_WARPS))
    args = ap.parse_args()
    mx.set_default_device(mx.cpu)
    start = time.perf_counter()
    results = [check_case(i, CASES[i], pw) for i in (args.case if args.case is not None else range(len(CASES)))
               for pw in args.per_warp]
    print(f"{sum(results)}/{len(results)} runs within {TOL:g} ({time.perf_counter() - start:.0f} s in all)")
    sys.exit(0 if all(results) else 1)


if __name__ == "__main__":
    main()
