"""What the first use of a cache scheme costs in a fresh process: kernel compiles (and self-checks) before the
first tokens, measured with the compiled-kernel folders empty and then filled.

Usage (a GPU machine): python benchmarks/first_use.py --out benchmarks/results/first_use-h200.json

For each scheme a child process builds an mlx-lm `llama` with Llama-3-8B's layer shapes but `--layers` layers
(random float16 weights), makes the scheme's cache (which self-checks the fused kernels it uses, once per
process), prefills `--context` random tokens in 2048-token chunks and decodes `--tokens` greedy tokens; it times
each part (seconds, evaluation included). Each scheme runs twice, each time in a new process: `cold` with an empty
MLX_PTX_CACHE_DIR (where MLX keeps the CUDA kernels of its own it compiled) and an empty GMLX_LAB_CACHE
(whose `kernels` folder keeps gmlx's kernels' NVRTC builds, kernels/precompiled.py), `warm` with both folders
again, as a machine's later processes find them. With `--kernel-cache off` (the setting kernel_cache) gmlx's
kernels go through mx.fast.cuda_kernel, which MLX 0.32 compiles in each process: `warm` then still compiles
every gmlx kernel.
`adds_s` (`adds_warm_s`) is a scheme's cold (warm) total minus gmlx fp16's in the same run: what choosing the
scheme adds to a machine's first process (to every later one). `kernel_cache_problems`: the kernels that did not
use the folder, and why (none when it worked).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent


def child(scheme: str, layers: int, context: int, tokens: int) -> dict[str, Any]:
    """One fresh process's timings of `scheme` (seconds)."""
    t0 = time.perf_counter()
    import mlx.core as mx
    from mlx_lm.models import llama
    from model_decode import SHAPES, new_cache

    from gmlx_lab.kernels import precompiled, selfcheck

    args = llama.ModelArgs(model_type="llama", **{**SHAPES["llama3-8b"], "num_hidden_layers": layers})
    mx.random.seed(0)
    model = llama.Model(args)
    model.set_dtype(mx.float16)
    mx.eval(model.parameters())
    ids = mx.random.randint(0, args.vocab_size, (context,)).astype(mx.uint32)
    mx.eval(ids)
    out: dict[str, Any] = {"import_and_model_s": time.perf_counter() - t0}
    t = time.perf_counter()
    cache = new_cache(model, scheme)[0]
    out["make_cache_s"] = time.perf_counter() - t
    t = time.perf_counter()
    for start in range(0, context, 2048):
        logits = model(ids[None, start:start + 2048], cache=cache)
        mx.eval([c.state for c in cache], logits)
    out["prefill_s"] = time.perf_counter() - t
    y = mx.argmax(logits[:, -1:], axis=-1)
    steps = []
    for _ in range(tokens):
        t = time.perf_counter()
        y = mx.argmax(model(y, cache=cache)[:, -1:], axis=-1)
        mx.eval(y)
        steps.append(time.perf_counter() - t)
    out["first_token_s"] = steps[0]
    out["later_token_s"] = statistics.median(steps[1:])
    out["total_s"] = out["make_cache_s"] + out["prefill_s"] + sum(steps)
    out["self_checks"] = {r.kernel: round(r.seconds, 3) for r in selfcheck.results().values()}
    out["kernel_cache_problems"] = precompiled.problems()
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in out.items()}


def write(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    """The JSON, after every scheme (a call's time limit loses only the schemes after it)."""
    import mlx.core as mx
    base = next((r["cold"].get("total_s") for r in rows if r["scheme"] == "fp16"), None)
    for r in rows:
        if base is not None and "total_s" in r["cold"]:
            r["adds_s"] = round(r["cold"]["total_s"] - base, 3)
    warm = next((r["warm"].get("total_s") for r in rows if r["scheme"] == "fp16"), None)
    for r in rows:
        if warm is not None and "total_s" in r["warm"]:
            r["adds_warm_s"] = round(r["warm"]["total_s"] - warm, 3)
    result = {"mlx": mx.__version__, "commit": os.environ.get("GMLX_COMMIT", "unknown"),
              "device": str(mx.device_info().get("device_name", "")) if hasattr(mx, "device_info") else "",
              "layers": args.layers, "context": args.context, "tokens": args.tokens, "note": args.note,
              "kernel_cache": args.kernel_cache,
              "method": " ".join(__doc__.split("\n\n")[1].split()), "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--schemes", default="fp16,kvarn6,kvarn4,affine4")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--tokens", type=int, default=9)
    ap.add_argument("--out", default="benchmarks/results/first_use-h200.json")
    ap.add_argument("--note", default="")
    ap.add_argument("--kernel-cache", choices=("on", "off"), default="on",
                    help="gmlx's kernel disk cache (setting kernel_cache); off: mx.fast.cuda_kernel in each process")
    args = ap.parse_args()
    if args.child:
        if args.kernel_cache == "off":
            from gmlx_lab.kernels import config

            config.set_config(kernel_cache=False)
        print(json.dumps(child(args.child, args.layers, args.context, args.tokens)))
        return
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
    rows = []
    for scheme in args.schemes.split(","):
        folder = tempfile.mkdtemp(prefix=f"ptx-{scheme}-")
        row: dict[str, Any] = {"scheme": scheme}
        for run in ("cold", "warm"):
            res = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", scheme, "--layers",
                                  str(args.layers), "--context", str(args.context), "--tokens", str(args.tokens),
                                  "--kernel-cache", args.kernel_cache],
                                 capture_output=True, text=True,
                                 env={**env, "MLX_PTX_CACHE_DIR": folder, "GMLX_LAB_CACHE": f"{folder}/gmlx"})
            try:
                row[run] = json.loads(res.stdout.strip().splitlines()[-1])
            except (IndexError, json.JSONDecodeError):
                row[run] = {"error": (res.stdout[-500:] + res.stderr[-1500:]).strip()}
        row["compile_s"] = round(row["cold"].get("total_s", 0) - row["warm"].get("total_s", 0), 3)
        rows.append(row)
        print(scheme, json.dumps(row), flush=True)
        write(args, rows)
    write(args, rows)
    for r in rows:
        print(f"{r['scheme']:8s} cold {r['cold'].get('total_s', '-')} s, warm {r['warm'].get('total_s', '-')} s, "
              f"compile {r['compile_s']} s, adds {r.get('adds_s', '-')} s")


if __name__ == "__main__":
    main()
