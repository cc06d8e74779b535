"""How the fused decode kernels' split size moves their speed on a GPU, beside fp16 SDPA, in one run.

The split-K kernels share a context's tokens among threadgroups (affine_decode: splits of 128-token tiles;
kvarn_decode: units per warp), then merge the splits (split_merge, the default second launch). Too few splits
leave the GPU idle; too many spend each threadgroup's fixed work (queries in, partials out) and the merge's on
little. For each context (one query token, 32 q / 8 kv heads, head_dim 128, random K/V): fp16 SDPA, then
affine4/affine8 at several tiles per split and kvarn6/kvarn4 at several units per warp, each timed as
decode_attention.py times (median of `--repeats` batches of `--iters` calls, each batch in one mx.eval), with
`default` marking the split the plan picks now (affine.affine_plan, kvarn.kvarn_plan).
Usage: python benchmarks/split_sweep.py --out benchmarks/results/split_sweep-h200.json
"""

from __future__ import annotations

import argparse
import json
from importlib.metadata import version

import mlx.core as mx
from decode_attention import HKV, HQ, D, timed
from model_decode import device_name, git_commit

from gmlx_lab.cache.affine.cache import AffineCache
from gmlx_lab.cache.kvarn.cache import KvarnCache
from gmlx_lab.kernels import active_backend, config
from gmlx_lab.kernels.affine import affine_partials, affine_plan
from gmlx_lab.kernels.kvarn import kvarn_partials, kvarn_plan
from gmlx_lab.kernels.splits import group_queries, merge_splits

AFFINE_TILES = (1, 2, 4, 8, 16, 32)
KVARN_PER_WARP = (1, 2, 3, 4, 6, 8)


def sweep_context(tokens: int, iters: int, repeats: int) -> list[dict]:
    """Every split size of every scheme at one context, and fp16 SDPA."""
    mx.random.seed(0)
    k, v = (mx.random.normal((1, HKV, tokens, D)).astype(mx.float16) for _ in range(2))
    q = mx.random.normal((1, HQ, 1, D)).astype(mx.float16)
    mx.eval(k, v, q)
    scale = D**-0.5
    qg = group_queries(q, HKV)
    rows = []

    def add(scheme: str, split: int, fn: object, default: bool) -> None:
        us, _ = timed(fn, iters, repeats)
        rows.append({"scheme": scheme, "context": tokens, "split": split, "us": round(us, 2), "default": default})
        print(f"{scheme:8s} {tokens:7d} split {split:3d} {us:8.1f} us{'  (default)' if default else ''}", flush=True)

    add("fp16_sdpa", 0, lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale), True)
    for bits in (4, 8):
        c = AffineCache(bits, 64)
        c.update_and_fetch(k, v)
        mx.eval(c.state[:2])
        kp, vp = ([b.data for b in bufs] for bufs in c.packed)
        chosen = affine_plan(qg.shape[1], D, HKV, tokens, bits, 64, 1, False).per // 128
        for tiles in sorted({*AFFINE_TILES, chosen}):
            add(f"affine{bits}", tiles, lambda tiles=tiles, kp=kp, vp=vp, bits=bits: merge_splits(
                *affine_partials(qg, scale, kp, vp, tokens, bits, 64, 1, False, per_split=tiles), dtype=q.dtype),
                tiles == chosen)
    for bits in (6, 4):
        c = KvarnCache(bits, bits, kv_tail_tokens=1024)
        c.update_and_fetch(k, v)
        c.seal()
        mx.eval([a for a in c.state if isinstance(a, mx.array)], [r.arrays for r in c.records])
        parts = c.parts()
        chosen = kvarn_plan(qg.shape[1], D, HKV, parts, 1, False).per

        def kvarn_call(per: int, parts: object = parts) -> mx.array:
            o, lse, nrot = kvarn_partials(qg, scale, parts, 1, False, per_warp=per)
            return merge_splits(o, lse, rotate=True, dtype=q.dtype, rotated_splits=nrot)

        for per in sorted({*KVARN_PER_WARP, chosen}):
            add(f"kvarn{bits}", per, lambda per=per: kvarn_call(per), per == chosen)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768, 131072])
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results/split_sweep-h200.json")
    args = ap.parse_args()
    if active_backend() == "cpu":
        raise SystemExit("split_sweep.py times the GPU kernels; MLX runs on the CPU here")
    rows = [r for t in args.contexts for r in sweep_context(t, args.iters, args.repeats)]
    result = {"device": device_name(), "backend": active_backend(), "mlx": mx.__version__,
              "mlx_lm": version("mlx-lm"), "commit": git_commit(),
              "kernel_settings": config.as_dict(), "method": __doc__.split("\n\n")[1].strip(),
              "rows": rows}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
