"""Decode attention speed: fp16 SDPA, mlx-lm's affine path, and the fused kernels (affine, kvarn, block caches).

One query token, 32 q heads / 8 kv heads, head_dim 128, contexts 4K/32K/128K, all in one run.
Each timing builds `--iters` independent calls, then evaluates them in one `mx.eval` (the eval round
trip is ~42 us on the H200) and divides; "us" is the evaluation (launches + GPU work), "build_us" the
graph building in Python before it; the median of `--repeats` timings is reported, with the
effective GB/s of cache bytes read and the ratio to fp16 SDPA. Also times sealing one record
group (K and V of 128 tokens for all kv heads) with the GPU kernel and with `encode_tiles`.
Usage: python benchmarks/decode_attention.py --out benchmarks/results/decode_attention-h200.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx_lm.models.base import quantized_scaled_dot_product_attention

from gmlx_lab.cache.affine.cache import AffineCache
from gmlx_lab.cache.kvarn.cache import KvarnCache
from gmlx_lab.cache.kvarn.records import encode_tokens
from gmlx_lab.kernels import active_backend, config, precompiled, seal_records
from gmlx_lab.registry import get_scheme
from gmlx_lab.specs import parse_scheme_spec

HQ, HKV, D = 32, 8, 128


def timed(fn: Callable[[], mx.array], iters: int, repeats: int, chain: list[mx.array] | None = None
          ) -> tuple[float, float]:
    """Median microseconds per call of fn over `repeats` batches of `iters` calls: (eval, build).

    MLX is lazy: `fn()` only builds the graph (Python, CPU) and `mx.eval` runs it (kernel launches and
    GPU work). The two are timed apart; in a decode loop with `mx.async_eval` the CPU builds the next
    step's graph while the GPU runs this one, so the eval time is the attention's cost on the GPU.
    `chain`: the queries fn reads, replaced by each call's output, so that each call waits for the one
    before as a model's layers do (independent calls of one eval may run side by side on the GPU).
    """
    def call() -> mx.array:
        out = fn()
        if chain is not None:
            chain[0] = out
        return out

    mx.eval(call())
    mx.eval([call() for _ in range(3)])
    evals, builds = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        outs = [call() for _ in range(iters)]
        t1 = time.perf_counter()
        mx.eval(outs)
        t2 = time.perf_counter()
        builds.append((t1 - t0) / iters * 1e6)
        evals.append((t2 - t1) / iters * 1e6)
    return statistics.median(evals), statistics.median(builds)


def nbytes(*arrays: mx.array | None) -> int:
    return sum(a.nbytes for a in arrays if a is not None)


# rows that run a fused kernel under given settings whatever the process's (side by side in one run)
SETTING_IMPLS = {**{f"fused_kvarn{b}_ring_{ring}": ("kvarn", b, {"ring": ring})
                    for b in (6, 4) for ring in ("on", "off")},
                 **{f"fused_{kind}{b}_{name}": (kind, b, {"merge_in_kernel": merge}) for kind, b in
                    (("kvarn", 6), ("kvarn", 4), ("affine", 4)) for name, merge in (("merged", True),
                                                                                    ("twolaunch", False))}}
BLOCK_SCHEMES = ("kivi4", "turboquant4", "mxfp4", "nvfp4", "mxfp8")  # block caches that affine_decode reads
IMPLS = ("fp16_sdpa", "mlx_lm_affine8", "mlx_lm_affine4", "fused_affine8", "fused_affine4", "fused_kvarn6",
         "fused_kvarn4", *SETTING_IMPLS, *(f"fused_{s}" for s in BLOCK_SCHEMES))
DEFAULT_IMPLS = IMPLS[:7]


def copies_for(read: int, cold_bytes: int) -> int:
    """How many copies of one call's state to cycle through so that together they hold at least `cold_bytes`
    (1 when cold_bytes is 0): one layer's cache smaller than the GPU's L2 is otherwise read from L2 call after
    call, where a model's layers each come from DRAM."""
    return max(1, -(-cold_bytes // read)) if cold_bytes else 1


def cycling(calls: list[Callable[[], mx.array]]) -> Callable[[], mx.array]:
    """One call that runs calls[0], calls[1], ... in turn, one per call."""
    turn = [0]

    def call() -> mx.array:
        turn[0] += 1
        return calls[turn[0] % len(calls)]()
    return call


Call = tuple[Callable[[], mx.array], int, dict]


def sdpa_state(qs: list[mx.array], k: mx.array, v: mx.array, scale: float) -> Call:
    """fp16 SDPA over its own copy of k, v: (call, bytes read a call, extra row fields)."""
    kc, vc = k + 0, v + 0  # buffers of their own
    mx.eval(kc, vc)
    return lambda: mx.fast.scaled_dot_product_attention(qs[0], kc, vc, scale=scale), nbytes(kc, vc), {}


def mlx_lm_affine_state(qs: list[mx.array], k: mx.array, v: mx.array, scale: float, bits: int) -> Call:
    """mlx-lm's quantized attention (two quantized_matmul) at `bits`, group 64."""
    qk = mx.quantize(k, group_size=64, bits=bits)
    qv = mx.quantize(v, group_size=64, bits=bits)
    mx.eval(qk, qv)
    return (lambda: quantized_scaled_dot_product_attention(qs[0], qk, qv, scale=scale, mask=None, group_size=64,
                                                           bits=bits), nbytes(*qk, *qv), {})


def fused_affine_state(qs: list[mx.array], k: mx.array, v: mx.array, scale: float, bits: int) -> Call:
    """gmlx's AffineCache on its fused decode path."""
    c = AffineCache(bits, 64)
    kk, vv = c.update_and_fetch(k, v)
    c.attention_path = "fused"
    mx.eval(c.state[:2])
    return lambda: c.attend(qs[0], kk, vv, scale, None), c.nbytes - c.regions()["reserve"], {}


def fused_kvarn_state(qs: list[mx.array], k: mx.array, v: mx.array, scale: float, bits: int) -> Call:
    """gmlx's KvarnCache (tail 1024) on its fused decode path, in the steady state of a decode step."""
    c = KvarnCache(bits, bits, kv_tail_tokens=1024)
    c.update_and_fetch(k, v)
    c.seal()  # what the next token would seal: the steady state of a decode step
    c.attention_path = "fused"
    kk, vv = c.fetch(qs[0].dtype, decode_step=True)  # (a graph the fused path never evaluates)
    mx.eval([a for a in c.state if isinstance(a, mx.array)], [r.arrays for r in c.records])
    return (lambda: c.attend(qs[0], kk, vv, scale, None), c.nbytes - c.regions()["reserve"],
            {"records": c.n_records})


def block_cache(spec: str, k: mx.array, v: mx.array) -> Any:
    """A block cache of the registry (KIVI, TurboQuant, the floats) filled with k, v (1, HKV, tokens, D) in
    2048-token chunks but the last token, then that one token as a decode step (which encodes the last chunk's due
    blocks): a decode step's steady state, on its fused decode path."""
    scheme, options = parse_scheme_spec(spec)
    c = get_scheme(scheme).make_cache(get_scheme(scheme).resolve(**options), layer=0)
    for start in range(0, k.shape[2] - 1, 2048):
        end = min(start + 2048, k.shape[2] - 1)
        c.update_and_fetch(k[:, :, start:end], v[:, :, start:end])
        mx.eval([a for a in c.state if isinstance(a, mx.array)])
    c.update_and_fetch(k[:, :, -1:], v[:, :, -1:])
    c.attention_path = "fused"
    mx.eval([a for a in c.state if isinstance(a, mx.array)])
    return c


def fused_block_state(qs: list[mx.array], k: mx.array, v: mx.array, scale: float, spec: str) -> Call:
    """`block_cache`'s decode attention (the K/V it fetched are never read on the fused path)."""
    c = block_cache(spec, k, v)
    kk, vv = c.fetch(qs[0].dtype)
    return lambda: c.attend(qs[0], kk, vv, scale, None), c.nbytes - c.regions()["reserve"], {}


def random_qkv(tokens: int) -> tuple[mx.array, mx.array, mx.array]:
    """Queries (1, HQ, 1, D) and a context's K, V (1, HKV, tokens, D), float16, seeded by the context."""
    mx.random.seed(tokens)
    k = mx.random.normal((1, HKV, tokens, D)).astype(mx.float16)
    v = mx.random.normal((1, HKV, tokens, D)).astype(mx.float16)
    q = mx.random.normal((1, HQ, 1, D)).astype(mx.float16)
    mx.eval(k, v, q)
    return q, k, v


def bench_context(tokens: int, iters: int, repeats: int, impls: tuple[str, ...] = IMPLS, cold_bytes: int = 0,
                  chain: bool = False) -> list[dict]:
    """The chosen implementations (fp16 SDPA always: the ratios need it) at one context length. With
    `cold_bytes`, each one cycles through copies of its cache that together hold that many bytes (copies_for);
    with `chain`, each call's queries are the call before's output (timed)."""
    q, k, v = random_qkv(tokens)
    scale = D**-0.5
    rows = []

    def add(impl: str, make: Callable[[], tuple[Callable[[], mx.array], int, dict]]) -> None:
        """Time `impl`: make() builds one copy of its state and returns (call, bytes read a call, extra fields)."""
        if impl not in impls and impl != "fp16_sdpa":
            return
        qs[0] = q
        fn, read, extra = make()
        n = copies_for(read, cold_bytes)
        if n > 1:
            fn = cycling([fn] + [make()[0] for _ in range(n - 1)])
        us, build = timed(fn, iters, repeats, qs if chain else None)
        rows.append({"impl": impl, "context": tokens, "us": round(us, 2), "build_us": round(build, 2),
                     "cache_bytes": read, "gb_per_s": round(read / us / 1e3, 1), "copies": n, **extra})
        print(f"{impl:16s} {tokens:7d} {us:9.1f} us (+{build:5.1f} us graph)  {read / us / 1e3:7.1f} GB/s"
              f"  ({n} {'copies' if n > 1 else 'copy'})", flush=True)

    qs = [q]
    add("fp16_sdpa", lambda: sdpa_state(qs, k, v, scale))
    for bits in (8, 4):
        add(f"mlx_lm_affine{bits}", lambda bits=bits: mlx_lm_affine_state(qs, k, v, scale, bits))
    for bits in (8, 4):
        add(f"fused_affine{bits}", lambda bits=bits: fused_affine_state(qs, k, v, scale, bits))
    for bits in (6, 4):
        add(f"fused_kvarn{bits}", lambda bits=bits: fused_kvarn_state(qs, k, v, scale, bits))
    states = {"kvarn": fused_kvarn_state, "affine": fused_affine_state}
    for impl, (kind, bits, settings) in SETTING_IMPLS.items():
        with config.configured(**settings):  # the plan (the compiled graph's key) carries them
            add(impl, lambda kind=kind, bits=bits: states[kind](qs, k, v, scale, bits))
    for spec in BLOCK_SCHEMES:
        add(f"fused_{spec}", lambda spec=spec: fused_block_state(qs, k, v, scale, spec))
    base = next(r["us"] for r in rows if r["impl"] == "fp16_sdpa")
    for r in rows:
        r["ratio_to_fp16"] = round(r["us"] / base, 3)
        if r["impl"].startswith("fused_affine"):  # speed-up over mlx-lm's path at the same width, if it ran
            ref = next((x["us"] for x in rows if x["impl"] == "mlx_lm_" + r["impl"].removeprefix("fused_")), None)
            if ref is not None:
                r["speedup_vs_mlx_lm"] = round(ref / r["us"], 3)
    return rows


def bench_seal(iters: int, repeats: int) -> dict:
    """Sealing one 128-token group: K and V records of all kv heads, GPU kernel against encode_tiles."""
    k = mx.hadamard_transform(mx.random.normal((1, HKV, 128, D))).astype(mx.float16)
    v = mx.hadamard_transform(mx.random.normal((1, HKV, 128, D))).astype(mx.float16)
    mx.eval(k, v)

    def kernel() -> list[mx.array]:
        return [f for r in (seal_records(k, 6, "k"), seal_records(v, 6, "v")) for f in (r.codes, r.scale_axis)]

    def reference() -> list[mx.array]:
        out = []
        for x, kind in ((k, "k"), (v, "v")):
            r = encode_tokens(x, 6, kind)
            out += [r.codes, r.scale_axis]
        return out

    def timed_list(fn: Callable[[], list[mx.array]], n: int) -> float:
        mx.eval(fn())
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            mx.eval([fn() for _ in range(n)])
            ts.append((time.perf_counter() - t0) / n * 1e6)
        return statistics.median(ts)

    return {"records_per_seal": 2 * HKV, "kernel_us": round(timed_list(kernel, iters), 1),
            "encode_tiles_us": round(timed_list(reference, max(iters // 10, 2)), 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768, 131072])
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--impls", nargs="+", choices=IMPLS, default=list(DEFAULT_IMPLS), help="fp16_sdpa always runs")
    ap.add_argument("--skip-seal", action="store_true", help="do not time sealing")
    ap.add_argument("--cold-mb", type=int, default=0,
                    help="cycle through copies of each cache holding this many MB in all (more than the GPU's L2, "
                         "e.g. 200 on an H200: 50 MB), as a model's layers come from DRAM; 0: one copy")
    ap.add_argument("--chain", action="store_true",
                    help="each call's queries are the output of the call before: calls run one after another, as "
                         "a model's layers do (else the calls of one eval are independent and may overlap)")
    ap.add_argument("--note", default="", help="stored in the JSON (e.g. which kernel version ran)")
    ap.add_argument("--out", default="benchmarks/results/decode_attention-h200.json")
    args = ap.parse_args()
    if active_backend() == "cpu":
        raise SystemExit("decode_attention.py measures the GPU kernels; MLX runs on the CPU here")
    rows = [r for t in args.contexts
            for r in bench_context(t, args.iters, args.repeats, tuple(args.impls), args.cold_mb * 10**6, args.chain)]
    seal = None if args.skip_seal else bench_seal(args.iters, args.repeats)
    kv6 = [r["us"] for r in rows if r["impl"] == "fused_kvarn6"]
    if seal and kv6:
        seal["per_token_us"] = round(seal["kernel_us"] / 128, 3)
        seal["share_of_decode_step_kvarn6_last_context"] = round(seal["kernel_us"] / 128 / kv6[-1], 4)
        seal["seal_event_over_decode_step"] = round(seal["kernel_us"] / kv6[-1], 3)
    print("seal", seal)
    device = mx.device_info() if hasattr(mx, "device_info") else {}
    result = {"device": str(device.get("device_name", platform.node())), "backend": active_backend(),
              "mlx": mx.__version__, "shape": {"q_heads": HQ, "kv_heads": HKV, "head_dim": D, "query_tokens": 1},
              "method": f"median of {args.repeats} timings, each {args.iters} calls built, then run in one mx.eval, "
                        "after warm-up; us = the eval, build_us = graph building before it; each call reads the "
                        "next of `copies` copies of its cache (--cold-mb); chained: each call's queries are the "
                        "output of the call before (--chain)",
              "cold_mb": args.cold_mb, "chained": args.chain,
              "kernel_settings": config.as_dict(), "kernel_launch_problems": precompiled.problems(),
              "note": args.note, "rows": rows, "seal": seal}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"\n{'impl':16s} " + " ".join(f"{t:>14d}" for t in args.contexts))
    for impl in dict.fromkeys(r["impl"] for r in rows):
        cells = [f"{r['us']:7.1f} ({r['ratio_to_fp16']:.2f}x)" for r in rows if r["impl"] == impl]
        print(f"{impl:16s} " + " ".join(f"{c:>14s}" for c in cells))


if __name__ == "__main__":
    main()
