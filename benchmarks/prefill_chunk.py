"""Where one prefill chunk's time goes, per KV-cache scheme: one attention layer at a given context.

Usage: python benchmarks/prefill_chunk.py --out benchmarks/results/prefill_chunk-h200.json

One layer with Llama-3-8B's attention shapes (32 query / 8 KV heads of 128), its cache already holding
`context` tokens; then one more chunk of `--chunk` tokens arrives. Timed, each the median of `--repeats`
evaluated runs on copies of that cache (so every run sees the same state):
  chunk     the cache's whole step: update_and_fetch (kvarn seals the groups that left the tail) and the
            attention of the chunk's queries over what it returned (mlx-lm's SDPA seam), evaluated;
and its pieces, on arrays of the same sizes:
  seal      kvarn: rotating and sealing one chunk's worth of groups, K and V (the kvarn_seal kernel on a GPU);
  decode    kvarn: the K/V a chunk's attention reads (`fetch`): the sink, the body decoded and rotated back,
            the recent tokens (on a GPU one kvarn_unpack launch each for K and V);
  sdpa      fp16 attention of the chunk's queries over context + chunk tokens (causal), the same for every
            scheme: what the fp16 baseline's chunk costs beside its cache write.
Ratios are to fp16's `chunk` at the same context, measured in the same run.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
from fidelity_sweep import machine
from model_decode import device_name, git_commit

from gmlx_lab import mlx_lm_hooks
from gmlx_lab.cache import AffineCache, FP16Cache, KvarnCache
from gmlx_lab.cache.kvarn.records import TILE, encode_tokens
from gmlx_lab.kernels import active_backend, seal_records

HQ, HKV, D = 32, 8, 128
SCHEMES: dict[str, Callable[[], Any]] = {
    "fp16": FP16Cache,
    "affine4": lambda: AffineCache(bits=4),
    "kvarn6": lambda: KvarnCache(6, 6),
    "kvarn4": lambda: KvarnCache(4, 4),
}


def leaves(tree: Any) -> list[mx.array]:
    """The arrays in a cache's state."""
    if isinstance(tree, (list, tuple)):
        return [a for x in tree for a in leaves(x)]
    return [tree] if isinstance(tree, mx.array) else []


def median_ms(run: Callable[[], list[mx.array]], repeats: int) -> float:
    """Median milliseconds of `run()` built and evaluated, after one warm-up run."""
    mx.eval(run())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mx.eval(run())
        times.append((time.perf_counter() - t0) * 1e3)
    return round(statistics.median(times), 3)


def filled(make: Callable[[], Any], context: int, chunk: int, dtype: mx.Dtype) -> Any:
    """A cache of one layer holding `context` tokens, written in chunks as a prefill would."""
    cache = make()
    for start in range(0, context, chunk):
        n = min(chunk, context - start)
        kv = mx.random.normal((1, HKV, n, D)).astype(dtype)
        cache.update_and_fetch(kv, kv)
        mx.eval(leaves(cache.state))
    return cache


def kvarn_pieces(cache: KvarnCache, chunk: int, repeats: int, dtype: mx.Dtype) -> dict[str, Any]:
    """kvarn's share of a chunk: sealing a chunk's worth of groups (K and V), and fetching the decoded K/V."""
    seal = seal_records if active_backend() != "cpu" else encode_tokens
    groups = mx.random.normal((1, HKV, chunk // TILE * TILE, D)).astype(mx.float16)
    mx.eval(groups)
    kinds = ((cache.k_bits, "k"), (cache.v_bits, "v"))
    out = {"records": cache.n_records,
           "seal_ms": median_ms(lambda: [a for bits, kind in kinds
                                         for a in seal(mx.hadamard_transform(groups), bits, kind).arrays], repeats)}
    if cache.n_records:
        out["decode_ms"] = median_ms(lambda: list(cache.fetch(dtype)), repeats)
    return out


def measure(context: int, chunk: int, repeats: int, dtype: mx.Dtype) -> list[dict[str, Any]]:
    """One row per scheme at one context: the chunk's whole step and, for kvarn, its pieces."""
    q = mx.random.normal((1, HQ, chunk, D)).astype(dtype)
    k, v = (mx.random.normal((1, HKV, chunk, D)).astype(dtype) for _ in range(2))
    full = mx.random.normal((1, HKV, context + chunk, D)).astype(dtype)
    mx.eval(q, k, v, full)
    scale = D**-0.5
    sdpa = median_ms(lambda: [mx.fast.scaled_dot_product_attention(q, full, full, scale=scale, mask="causal")],
                     repeats)
    rows = []
    for name, make in SCHEMES.items():
        cache = filled(make, context, chunk, dtype)

        def step(cache: Any = cache) -> list[mx.array]:
            c = copy.deepcopy(cache)
            keys, values = c.update_and_fetch(k, v)
            out = mlx_lm_hooks.scaled_dot_product_attention(q, keys, values, cache=c, scale=scale, mask="causal")
            return [out, *leaves(c.state)]
        row = {"scheme": name, "context": context, "chunk": chunk, "chunk_ms": median_ms(step, repeats),
               "sdpa_ms": sdpa}
        if isinstance(cache, KvarnCache):
            row.update(kvarn_pieces(cache, chunk, repeats, dtype))
        rows.append(row)
        del cache
        mx.clear_cache()
    base = next(r["chunk_ms"] for r in rows if r["scheme"] == "fp16")
    for r in rows:
        r["chunk_vs_fp16"] = round(r["chunk_ms"] / base, 3)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--contexts", default="32768,131072", help="comma-separated tokens already in the cache")
    parser.add_argument("--chunk", type=int, default=2048, help="tokens of the arriving chunk (a multiple of 128)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results/prefill_chunk-cpu.json")
    args = parser.parse_args(argv)
    if args.chunk < TILE or args.chunk % TILE:
        parser.error(f"--chunk must be a positive multiple of {TILE}, got {args.chunk}")
    contexts = [int(c) for c in args.contexts.split(",")]
    dtype = mx.float32 if active_backend() == "cpu" else mx.float16
    t0 = time.perf_counter()
    rows = []
    for context in contexts:
        rows += measure(context, args.chunk, args.repeats, dtype)
        for r in rows[-len(SCHEMES):]:
            parts = "  ".join(f"{k} {r[k]:.2f}" for k in ("seal_ms", "decode_ms") if k in r)
            print(f"{context:7d} {r['scheme']:8s} chunk {r['chunk_ms']:8.2f} ms ({r['chunk_vs_fp16']:.2f}x fp16)  "
                  f"sdpa {r['sdpa_ms']:.2f}  {parts}", file=sys.stderr, flush=True)
    result = {"device": device_name(), "backend": active_backend(), "mlx": mx.__version__, "commit": git_commit(),
              "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
              "machine": machine(), "seconds": round(time.perf_counter() - t0, 1),
              "method": __doc__.split("\n\n", 1)[1].strip(), "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
