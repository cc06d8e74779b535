"""Host cost of a decode step's cache work, without a model: each layer's `update_and_fetch` and attention call.

Usage: python benchmarks/cache_step.py --context 32768 --out benchmarks/results/cache_step-h200.json

A decode step of a 32-layer model calls each layer's cache twice: `update_and_fetch` with the new token's K/V,
then mlx-lm's attention entry point (routed to the cache's own `attend` where it has one). When a step is bound
by the host (model_decode.py), the Python building of those calls and MLX's encoding of their nodes are what a
cache adds to the model's own host work. For each scheme, `--layers` caches of Llama-3-8B's attention geometry
are filled to `--context` tokens, then `--steps` decode steps are run: per step, the graphs of all layers are
built (timed: `build_us_per_layer`), then evaluated with `mx.async_eval` (timed: `encode_us_per_layer`, MLX
encoding the nodes; on CUDA adding them to graphs and launching) and waited for. `--profile` adds the functions
with the most own time under cProfile (its overhead inflates short functions).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm.models.base as mlx_base
from mlx_lm.models.cache import KVCache, QuantizedKVCache
from model_decode import MLX_LM_SCHEMES, device_name, git_commit

from gmlx_lab.kernels import active_backend, precompiled
from gmlx_lab.registry import get_scheme
from gmlx_lab.specs import parse_scheme_spec

CHUNK = 2048  # prefill chunk, as model_decode.py


def caches(spec: str, layers: int) -> list[Any]:
    """`layers` fresh caches of an mlx-lm scheme name or a gmlx_lab scheme spec."""
    if spec in MLX_LM_SCHEMES:
        bits = MLX_LM_SCHEMES[spec]
        return [KVCache() if bits is None else QuantizedKVCache(group_size=64, bits=bits) for _ in range(layers)]
    scheme, options = parse_scheme_spec(spec)
    resolved = get_scheme(scheme).resolve(**options)
    return [get_scheme(scheme).make_cache(resolved, layer=i) for i in range(layers)]


def arrays(tree: Any) -> list[mx.array]:
    """The arrays in a cache's `state` (nested tuples of arrays, None and numbers)."""
    if isinstance(tree, mx.array):
        return [tree]
    if isinstance(tree, (tuple, list)):
        return [a for x in tree for a in arrays(x)]
    return []


def steps(layer_caches: list[Any], q: mx.array, k: mx.array, n: int) -> tuple[list[float], list[float]]:
    """n decode steps over all layers: µs to build each step's graphs, µs to encode them (mx.async_eval)."""
    builds, encodes = [], []
    attend = mlx_base.scaled_dot_product_attention  # routed to a cache's `attend`: importing gmlx_lab did that
    for _ in range(n):
        t0 = time.perf_counter()
        outs = []
        for c in layer_caches:
            kk, vv = c.update_and_fetch(k, k)
            outs.append(attend(q, kk, vv, cache=c, scale=q.shape[-1] ** -0.5, mask=None))
        t1 = time.perf_counter()
        mx.async_eval(outs)
        t2 = time.perf_counter()
        mx.eval(outs)
        builds.append((t1 - t0) * 1e6)
        encodes.append((t2 - t1) * 1e6)
    return builds, encodes


def profiled(layer_caches: list[Any], q: mx.array, k: mx.array, n: int, top: int) -> list[dict[str, Any]]:
    """cProfile of n steps' graph building: the functions with the most own time."""
    prof = cProfile.Profile()
    prof.enable()
    steps(layer_caches, q, k, n)
    prof.disable()
    rows = []
    for (file, line, fn), (_, calls, tottime, cumtime, _) in pstats.Stats(prof, stream=io.StringIO()).stats.items():
        rows.append({"function": f"{Path(file).name}:{line}:{fn}", "calls": calls,
                     "own_ms": round(tottime * 1e3, 2), "cumulative_ms": round(cumtime * 1e3, 2)})
    return sorted(rows, key=lambda r: -r["own_ms"])[:top]


def measure(spec: str, args: argparse.Namespace) -> dict[str, Any]:
    layer_caches = caches(spec, args.layers)
    mx.random.seed(0)
    kv_chunk = mx.random.normal((1, args.kv_heads, CHUNK, args.head_dim)).astype(mx.float16)
    q = mx.random.normal((1, args.q_heads, 1, args.head_dim)).astype(mx.float16)
    k = mx.random.normal((1, args.kv_heads, 1, args.head_dim)).astype(mx.float16)
    for c in layer_caches:
        for _ in range(args.context // CHUNK):
            c.update_and_fetch(kv_chunk, kv_chunk)
        mx.eval(arrays(c.state))
    steps(layer_caches, q, k, 4)  # warm: compiled graphs, kernels
    builds, encodes = steps(layer_caches, q, k, args.steps)
    row = {"scheme": spec, "context": args.context, "layers": args.layers,
           "build_us_per_layer": round(statistics.median(builds) / args.layers, 2),
           "encode_us_per_layer": round(statistics.median(encodes) / args.layers, 2)}
    if args.profile:
        row["profile"] = profiled(layer_caches, q, k, args.profile, args.top)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--schemes", default="mlx_lm_fp16,fp16,affine8,affine4,kvarn6,kvarn4")
    parser.add_argument("--context", type=int, default=8192, help="tokens in each cache before the steps")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--q-heads", type=int, default=32)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--profile", type=int, default=0, help="cProfile this many more steps per scheme")
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--out", default="benchmarks/results/cache_step.json")
    args = parser.parse_args(argv)
    if args.context < CHUNK or args.context % CHUNK:
        parser.error(f"--context {args.context}: a multiple of the {CHUNK}-token prefill chunk")
    rows = []
    for spec in args.schemes.split(","):
        rows.append(measure(spec, args))
        r = rows[-1]
        print(f"{spec:14s} build {r['build_us_per_layer']:7.1f} µs/layer   encode {r['encode_us_per_layer']:7.1f}"
              " µs/layer", file=sys.stderr)
    result = {"device": device_name(), "backend": active_backend(), "mlx": mx.__version__, "commit": git_commit(),
              "command": " ".join(["cache_step.py", *(argv if argv is not None else sys.argv[1:])]),
              "method": __doc__.split("\n\n")[1].replace("\n", " "),
              "kernel_launch_problems": precompiled.problems(), "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
