"""Host cost of one graph node on a GPU backend: MLX ops, fast SDPA, and custom kernels by source length.

Usage: python benchmarks/launch_cost.py --out benchmarks/results/launch_cost-h200.json

A decode step of a 32-layer model builds and encodes a few hundred nodes; when that host work takes longer
than the GPU's, the step is bound by the host. For each kind of node, `--calls` independent calls on tiny
inputs are built (timed: `build_us` per node, Python and MLX's graph building) and evaluated in one
`mx.eval` (timed: `eval_us` per node, the encoding and launch of each node plus the GPU's tiny work; one
eval round trip is spread over all calls). Custom kernels are timed with the same one-line body padded by
comment lines to several source lengths: MLX copies a custom kernel's source into every node and hashes
it when the node is encoded.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
from model_decode import device_name

from gmlx_lab.kernels import active_backend


def timed(make: Callable[[], mx.array], calls: int, repeats: int) -> dict[str, float]:
    """Median µs per node to build, and to evaluate, `calls` independent nodes."""
    mx.eval([make() for _ in range(8)])
    builds, evals = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        outs = [make() for _ in range(calls)]
        t1 = time.perf_counter()
        mx.eval(outs)
        t2 = time.perf_counter()
        builds.append((t1 - t0) / calls * 1e6)
        evals.append((t2 - t1) / calls * 1e6)
    return {"build_us": round(statistics.median(builds), 2), "eval_us": round(statistics.median(evals), 2)}


def custom_kernel(source_bytes: int) -> Callable[[mx.array], mx.array]:
    """A kernel that adds 1 to 256 floats, its source padded with comment lines to about `source_bytes`."""
    body = "out[threadIdx.x] = x[threadIdx.x] + 1.0f;\n" if active_backend() == "cuda" else \
        "out[thread_position_in_grid.x] = x[thread_position_in_grid.x] + 1.0f;\n"
    pad = "// a comment line of padding, as long kernels carry documentation\n"
    source = pad * max(0, (source_bytes - len(body)) // len(pad)) + body
    api = mx.fast.cuda_kernel if active_backend() == "cuda" else mx.fast.metal_kernel
    kernel = api(name=f"pad{source_bytes}", input_names=["x"], output_names=["out"], source=source)
    return lambda x: kernel(inputs=[x], grid=(256, 1, 1), threadgroup=(256, 1, 1), output_shapes=[(256,)],
                            output_dtypes=[mx.float32])[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sizes", default="512,4096,16384,32768", help="custom kernel source bytes")
    parser.add_argument("--out", default="benchmarks/results/launch_cost.json")
    args = parser.parse_args(argv)
    if active_backend() == "cpu":
        parser.error("needs an MLX GPU backend (CUDA or Metal): custom kernels do not run on the CPU")
    x = mx.random.normal((256,))
    q = mx.random.normal((1, 32, 1, 128)).astype(mx.float16)
    kv = mx.random.normal((1, 8, 1024, 128)).astype(mx.float16)
    mx.eval(x, q, kv)
    rows = {"add": timed(lambda: x + 1.0, args.calls, args.repeats),
            "isfinite+all": timed(lambda: mx.all(mx.isfinite(x)), args.calls, args.repeats),
            "slice": timed(lambda: kv[..., :1000, :], args.calls, args.repeats),
            "sdpa_1k": timed(lambda: mx.fast.scaled_dot_product_attention(q, kv, kv, scale=0.1), args.calls,
                             args.repeats)}
    for size in (int(s) for s in args.sizes.split(",")):
        kernel = custom_kernel(size)
        rows[f"custom_kernel_{size}B"] = timed(lambda k=kernel: k(x), args.calls, args.repeats)
    for name, r in rows.items():
        print(f"{name:24s} build {r['build_us']:7.2f} µs   eval {r['eval_us']:7.2f} µs per node", file=sys.stderr)
    result = {"device": device_name(), "backend": active_backend(), "mlx": mx.__version__, "calls": args.calls,
              "method": __doc__.split("\n\n")[1].replace("\n", " "), "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
