"""A decode step's attention on the CPU, one layer: each cache's own path against the reference path, side by side.

Usage: python benchmarks/cpu_attention.py --out benchmarks/results/cpu_attention-cpu.json

For each scheme a cache of one layer (8 KV heads of 128, batch 1) is filled to `--context` tokens and takes one
decode token; then 32 query heads attend, as mlx-lm's attention hands a step over: over the cache's lazy fetch,
through the cache's `attend` with attention_path "auto" (on the CPU: two mx.quantized_matmul calls for KIVI, the
4-bit floats and kvarn's records; TurboQuant and mxfp8_rot in their blocks' rotated space; the reference for mxfp8)
and with "reference" (the fetch decoded, then SDPA; affine's reference is its two mx.quantized_matmul calls already,
so its rows would time one path twice). The two paths take turns, `--rounds` rounds of one call each; the JSON keeps
every time, the medians, their ratio and the largest relative difference of the outputs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
from model_decode import git_commit

from gmlx_lab.registry import get_scheme
from gmlx_lab.specs import parse_scheme_spec

PATHS = ("auto", "reference")


def filled(spec: str, context: int) -> Any:
    """A one-layer cache of `spec` filled to `context` tokens in 2048-token chunks, then one decode token."""
    name, options = parse_scheme_spec(spec)
    cache = get_scheme(name).make_cache(get_scheme(name).resolve(**options), layer=0)
    for start in range(0, context, 2048):
        n = min(2048, context - start)
        cache.update_and_fetch(*(mx.random.normal((1, 8, n, 128), key=mx.random.key(start + i)) for i in (0, 1)))
        mx.eval(cache.state)
    cache.update_and_fetch(*(mx.random.normal((1, 8, 1, 128), key=mx.random.key(i)) for i in (2, 3)))
    mx.eval(cache.state)
    return cache


def measure(spec: str, context: int, rounds: int) -> dict[str, Any]:
    cache = filled(spec, context)
    q = mx.random.normal((1, 32, 1, 128), key=mx.random.key(7))
    mx.eval(q)
    times: dict[str, list[float]] = {p: [] for p in PATHS}
    outs = {}
    for _ in range(rounds + 1):  # the first round warms up
        for path in PATHS:
            cache.attention_path = path
            keys, values = cache.fetch(mx.float32)
            t0 = time.perf_counter()
            outs[path] = cache.attend(q, keys, values, scale=128**-0.5, mask=None)
            mx.eval(outs[path])
            times[path].append((time.perf_counter() - t0) * 1e3)
    ms = {p: statistics.median(t[1:]) for p, t in times.items()}
    diff = float(mx.abs(outs["auto"] - outs["reference"]).max() / mx.abs(outs["reference"]).max())
    return {"scheme": spec, "context": context, "ms": {p: [round(x, 3) for x in t[1:]] for p, t in times.items()},
            "median_ms": {p: round(m, 3) for p, m in ms.items()}, "reference_over_auto": round(ms["reference"] /
            ms["auto"], 2), "max_relative_difference": diff}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--schemes", default="mxfp4,nvfp4,mxfp8,mxfp8_rot,kivi4,kivi2,turboquant4,turboquant3,"
                                             "kvarn4:tail=128,kvarn3:tail=128")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--out", default="benchmarks/results/cpu_attention-cpu.json")
    args = parser.parse_args(argv)
    mx.set_default_device(mx.cpu)
    rows = []
    for spec in args.schemes.split(","):
        rows.append(measure(spec, args.context, args.rounds))
        r = rows[-1]
        print(f"{spec:12s} auto {r['median_ms']['auto']:8.2f} ms  reference {r['median_ms']['reference']:8.2f} ms  "
              f"({r['reference_over_auto']:.2f}x)  max rel diff {r['max_relative_difference']:.1e}", file=sys.stderr)
    result = {"device": "cpu", "mlx": mx.__version__, "commit": git_commit(),
              "command": " ".join(["cpu_attention.py", *(argv if argv is not None else sys.argv[1:])]),
              "method": __doc__.split("\n\n")[2].replace("\n", " "), "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
