"""Where a whole-model decode step's time goes on a CUDA GPU: every kernel of a few steps, seen by CUPTI.

Usage (a CUDA machine with PyTorch, whose profiler reads CUPTI for the whole process, MLX's kernels too):
  python benchmarks/gpu_timeline.py --shape llama3-8b --contexts 32768,131072 \\
      --schemes mlx_lm_fp16,fp16,kvarn6,kvarn4,affine4,kvarn6/two-launch --out benchmarks/results/gpu_timeline-h200.json

For each context and scheme (`model_decode.py`'s names and probes): a fresh cache is prefilled, a few tokens
decoded to warm up, then `--steps` tokens decoded with `mlx_lm.generate_step` (as users run it) under
`torch.profiler`. Per step: `wall_us` (the interval between yielded tokens), `gpu_busy_us` (the union of
the kernels' intervals: the time some kernel ran) and `gpu_idle_us` = wall - busy (the GPU waited on the
host), the kernels launched, and each kind of kernel's time (`kernels`, by name with template arguments cut,
largest first). A step whose idle time is large is bound by the host (Python graph building and MLX's
encoding); one whose busy time is large, by its kernels.
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import sys
import tempfile
import time
from collections import defaultdict
from importlib.metadata import version
from pathlib import Path
from typing import Any

import mlx.core as mx
from model_decode import Run, context_tokens, device_name, git_commit, parse_probes, shaped_model

from gmlx_lab.cli import scheme_list
from gmlx_lab.kernels import active_backend


def kernel_kind(name: str) -> str:
    """A kernel's name without template arguments and parameter lists (one kind per source)."""
    name = re.sub(r"<.*", "", name)
    name = re.sub(r"\(.*", "", name)
    return name.removeprefix("void ").strip()[:80]


def kernel_events(trace_path: Path) -> list[tuple[float, float, str]]:
    """(start µs, end µs, name) of every GPU kernel in a chrome trace written by torch.profiler."""
    events = json.loads(trace_path.read_text())["traceEvents"]
    out = [(e["ts"], e["ts"] + e.get("dur", 0), e["name"]) for e in events
           if e.get("ph") == "X" and e.get("cat") == "kernel"]
    return sorted(out)


def busy_time(intervals: list[tuple[float, float, str]]) -> float:
    """µs during which at least one kernel ran (overlapping kernels counted once)."""
    total, end = 0.0, float("-inf")
    for s, e, _ in intervals:
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def summarize(kernels: list[tuple[float, float, str]], steps: int, wall_us: float) -> dict[str, Any]:
    """Per-step figures of the kernels seen while `steps` tokens were decoded in `wall_us`."""
    by_kind: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for s, e, name in kernels:
        k = by_kind[kernel_kind(name)]
        k[0] += e - s
        k[1] += 1
    busy = busy_time(kernels)
    top = sorted(by_kind.items(), key=lambda kv: -kv[1][0])
    return {
        "wall_us": round(wall_us / steps, 1),
        "gpu_busy_us": round(busy / steps, 1),
        "gpu_idle_us": round((wall_us - busy) / steps, 1),
        "kernel_sum_us": round(sum(e - s for s, e, _ in kernels) / steps, 1),
        "kernels_per_step": round(len(kernels) / steps, 1),
        "kernels": [{"kind": kind, "us_per_step": round(t / steps, 1), "per_step": round(n / steps, 2)}
                    for kind, (t, n) in top[:16]],
    }


def profile_run(run: Run, model: Any, steps: int) -> dict[str, Any]:
    """Decode `steps` tokens of `run` under torch.profiler; the per-step summary of its kernels."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    run.decode_round(model, 6)  # warm: compiled graphs of this geometry, pipeline started
    with run.probed(), tempfile.TemporaryDirectory() as tmp:
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            from model_decode import decode

            intervals, out = decode(model, run.cache, run.next, steps + 1)
            mx.synchronize()
            t1 = time.perf_counter()
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        kernels = kernel_events(path)
    if not kernels:
        return {"error": "the profiler saw no GPU kernels (CUPTI does not see this process's MLX work)"}
    # the window of the timed steps: from the first kernel to the last, spread over steps + 1 tokens
    span = kernels[-1][1] - kernels[0][0]
    row = summarize(kernels, steps + 1, span)
    row["yield_interval_us"] = round(sum(intervals) / len(intervals) * 1e3, 1)
    row["host_window_us"] = round((t1 - t0) * 1e6 / (steps + 1), 1)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="llama3-8b")
    parser.add_argument("--weights", type=int, choices=(16, 8, 4), default=16)
    parser.add_argument("--contexts", default="32768")
    parser.add_argument("--schemes", default="mlx_lm_fp16,fp16,kvarn6,kvarn4,affine4")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--prefill-step", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/results/gpu_timeline-h200.json")
    args = parser.parse_args(argv)
    if active_backend() != "cuda":
        parser.error("gpu_timeline.py reads CUPTI through torch.profiler: it needs MLX on a CUDA GPU")
    names = [s.strip() for s in args.schemes.split(",") if s.strip()]
    scheme_list(",".join(n.partition("/")[0] for n in names), extra=("mlx_lm_fp16", "mlx_lm_affine8"))
    for n in names:
        if "/" in n:
            parse_probes(n)
    t0 = time.perf_counter()
    model = shaped_model(args.shape, args.weights, args.seed)
    result: dict[str, Any] = {
        "device": device_name(), "backend": active_backend(), "mlx": mx.__version__, "mlx_lm": version("mlx-lm"),
        "commit": git_commit(), "model": f"{args.shape} (random weights)", "weight_bits": args.weights,
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "method": __doc__.split("\n\n", 2)[2].strip(), "rows": [],
    }
    for context in (int(c) for c in args.contexts.split(",")):
        tokens = context_tokens(None, model, context, "random", args.seed)
        for name in names:
            gc.collect()
            mx.clear_cache()
            run = Run(model, name, args)
            run.prefill(model, tokens, args, 0)
            row = {"context": context, "scheme": name}
            row.update(run.row if run.failed else profile_run(run, model, args.steps))
            result["rows"].append(row)
            print(f"{context:7d} {name:20s} wall {row.get('wall_us', 0):8.1f} busy {row.get('gpu_busy_us', 0):8.1f} "
                  f"kernels {row.get('kernels_per_step', 0):6.1f}  {row.get('error', '')}", file=sys.stderr, flush=True)
            for k in row.get("kernels", [])[:8]:
                print(f"        {k['us_per_step']:8.1f} us  x{k['per_step']:5.1f}  {k['kind']}", file=sys.stderr)
            del run
            result["seconds"] = round(time.perf_counter() - t0, 1)
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
