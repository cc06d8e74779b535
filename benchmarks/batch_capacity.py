"""Whole-model decode at batch > 1, and how many sequences each cache holds in a fixed memory budget.

Usage (GPU; on the CPU use a small --shape grid to check that it runs):
  python benchmarks/batch_capacity.py --shape llama3-8b --weights 4 \\
      --grid 1x8192,1x32768,1x131072,4x8192,4x32768,8x8192,8x16384,16x8192 \\
      --capacity-context 32768 --budget-gb 80 --out benchmarks/results/batch_capacity-h200.json

Batch grid: for each batch x context, every scheme's cache is filled and kept resident at once, then decoded in
`--rounds` rounds in which every scheme in turn decodes `--per-round` steps (so a slow spell of the machine falls
on all alike); a step's time is the wall-clock interval between consecutive greedy tokens with async-eval
pipelining as mlx-lm's generate_step does (each round's first step left out); rows give the median, the 10th
percentile and the count, and tokens/s = batch x 1000 / median ms. `cache_bytes` is the caches' resident bytes
after the decode rounds: right after a fill a block cache still holds the last chunk's due blocks in fp16 (they
are encoded when the next token arrives), which `cache_bytes_after_fill` shows. A grid point whose caches would
not fit in `--resident-gb` together is skipped and listed.
Capacity: at `--capacity-context`, each scheme alone (one at a time: caches of this size cannot sit side by side)
is given the largest batch whose cache fits in `--budget-gb` (from its bytes per token measured in the grid), is
filled, and decodes `--rounds` x `--per-round` steps; the row has the batch, the cache's bytes and tokens/s.
Fill (`--fill update`, the default): the caches are not prefilled through the model (an 8B model's prefill of
16 x 32K tokens would take most of a call): every layer's cache receives random normal float16 K/V in chunks of
`--chunk` tokens through its own `update_and_fetch`, so each scheme encodes and stores what it would from a
prefill; every sequence of the batch holds the same values. Decode time does not depend on the values (no kernel
branches on them). `--fill prefill` runs random token ids through the model's layers instead (`model.model`: the
output head's logits of a whole chunk are not a cache's cost), `--chunk` tokens a sequence at a time, so a
chunk's attention runs as in a real prefill. Either way `fill_peak_memory` is the most the fill allocated above
what was resident when it began (the weights and the caches filled before it): the cache plus the fill's
scratch, which is what decides whether a prefill fits beside the others; `decode_scratch_memory` is the most a
decode round allocated above what was resident at its start. Decode feeds random token ids; the model is an
mlx-lm `llama` with random weights (`model_decode.shaped_model`).
Schemes: `mlx_lm_fp16` (mlx-lm's `KVCache`, the baseline of every ratio), `mlx_lm_affine4`/`mlx_lm_affine8`
(mlx-lm's `QuantizedKVCache`, group 64, the peer) and any gmlx_lab scheme spec; the capacity run sizes the schemes
named in `--capacity-schemes` (CAPACITY_SCHEMES by default).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from fidelity_sweep import machine
from model_decode import (
    MLX_LM_SCHEMES,
    SHAPES,
    PeakAbove,
    cache_bytes,
    device_name,
    git_commit,
    new_cache,
    percentile,
    shaped_model,
)

from gmlx_lab.cli import scheme_list
from gmlx_lab.kernels import active_backend

GRID_SCHEMES = ("mlx_lm_fp16,mlx_lm_affine4,fp16,affine8,affine4,kvarn6,kvarn4,turboquant4,mxfp4,kivi4")
CAPACITY_SCHEMES = "mlx_lm_fp16,mlx_lm_affine4,fp16,affine8,affine4,kvarn6,kvarn4"


def parse_grid(text: str) -> list[tuple[int, int]]:
    """"1x8192,4x32768" -> [(1, 8192), (4, 32768)] (batch, context)."""
    out = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        batch, _, context = item.partition("x")
        if not (batch.isdigit() and context.isdigit()) or int(batch) < 1 or int(context) < 1:
            raise ValueError(f"grid point {item!r}: expected BATCHxCONTEXT with positive ints, e.g. 4x32768")
        out.append((int(batch), int(context)))
    return out


def fill(model: nn.Module, cache: list[Any], batch: int, context: int, chunk: int, seed: int) -> float:
    """Store `context` tokens of random float16 K/V (the same for every sequence) in every layer; seconds."""
    attn = model.layers[0].self_attn
    heads, dim = attn.n_kv_heads, attn.head_dim
    mx.random.seed(seed)
    pool = [mx.random.normal((2, 1, heads, chunk, dim)).astype(mx.float16) for _ in range(2)]
    mx.eval(pool)
    t0 = time.perf_counter()
    for start in range(0, context, chunk):
        n = min(chunk, context - start)
        kv = pool[(start // chunk) % len(pool)][:, :, :, :n]
        keys, values = (mx.broadcast_to(x, (batch, heads, n, dim)) for x in kv)
        for c in cache:  # one layer at a time, as a prefill runs them: their temporaries never coexist
            c.update_and_fetch(keys, values)
            mx.eval(c.state)
    return time.perf_counter() - t0


def prefill_fill(model: nn.Module, cache: list[Any], batch: int, context: int, chunk: int, seed: int) -> float:
    """Run `context` random token ids a sequence through the model's layers, `chunk` at a time; seconds."""
    mx.random.seed(seed)
    t0 = time.perf_counter()
    for start in range(0, context, chunk):
        tokens = mx.random.randint(0, model.args.vocab_size, (batch, min(chunk, context - start)))
        hidden = model.model(tokens, cache=cache)
        mx.eval(hidden, [c.state for c in cache])
    return time.perf_counter() - t0


FILLS = {"update": fill, "prefill": prefill_fill}


def step_times(model: nn.Module, cache: list[Any], batch: int, steps: int, seed: int) -> list[float]:
    """`steps` + 1 greedy decode steps pipelined as mlx-lm's generate_step; ms between consecutive tokens."""
    mx.random.seed(seed)
    y = mx.random.randint(0, model.args.vocab_size, (batch, 1)).astype(mx.uint32)

    def step(tokens: mx.array) -> mx.array:
        return mx.argmax(model(tokens, cache=cache)[:, -1:], axis=-1).astype(mx.uint32)

    y = step(y)
    mx.async_eval(y)
    stamps = []
    for _ in range(steps + 1):
        nxt = step(y)
        mx.async_eval(nxt)
        y.tolist()  # waits for this step's token, as generate_step's y.item() does
        stamps.append(time.perf_counter())
        y = nxt
    mx.eval(y)
    return [(b - a) * 1e3 for a, b in zip(stamps, stamps[1:])]


def summary(intervals: list[float], batch: int) -> dict[str, Any]:
    median = statistics.median(intervals)
    return {"step_ms_median": round(median, 3), "step_ms_p10": round(percentile(intervals, 10), 3),
            "step_ms_p90": round(percentile(intervals, 90), 3), "timed_steps": len(intervals),
            "tokens_per_s": round(batch * 1e3 / median, 1)}


class Resident:
    """One scheme's filled cache at one batch x context and the step times its rounds gathered."""

    def __init__(self, model: nn.Module, spec: str, batch: int, context: int, args: argparse.Namespace):
        self.cache, label = new_cache(model, spec)
        self.row: dict[str, Any] = {"scheme": spec, "label": label, "batch": batch, "context": context}
        self.intervals: list[float] = []
        self.scratch = 0
        free()
        try:
            with PeakAbove() as peak:
                seconds = FILLS[args.fill](model, self.cache, batch, context, args.chunk, args.seed)
            self.row.update({"fill": args.fill, "fill_s": round(seconds, 2),
                             "cache_bytes_after_fill": cache_bytes(self.cache), "fill_peak_memory": peak.bytes})
        except Exception as err:  # noqa: BLE001  (a scheme that cannot run here is recorded, not hidden)
            self.row["error"] = f"fill: {type(err).__name__}: {err}"[:400]

    def decode_round(self, model: nn.Module, steps: int, seed: int) -> None:
        if "error" in self.row:
            return
        with PeakAbove() as peak:
            try:
                self.intervals += step_times(model, self.cache, self.row["batch"], steps, seed)
            except Exception as err:  # noqa: BLE001
                self.row["error"] = f"decode: {type(err).__name__}: {err}"[:400]
        self.scratch = max(self.scratch, peak.bytes)

    def finish(self) -> dict[str, Any]:
        if "error" not in self.row and self.intervals:
            self.row.update(summary(self.intervals, self.row["batch"]))
            self.row["cache_bytes"] = cache_bytes(self.cache)
            self.row["decode_scratch_memory"] = self.scratch
        return self.row


def free() -> None:
    gc.collect()
    mx.clear_cache()


def grid_point(model: nn.Module, specs: list[str], batch: int, context: int,
               args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every scheme resident at once at batch x context, decoded in interleaved rounds."""
    runs = [Resident(model, spec, batch, context, args) for spec in specs]
    for r in range(args.rounds):
        for run in runs:
            run.decode_round(model, args.per_round, args.seed + r)
    rows = [run.finish() for run in runs]
    del runs
    free()
    return rows


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Each grid row's tokens/s and bytes as ratios to mlx_lm_fp16 at the same batch and context."""
    for r in rows:
        base = next((b for b in rows if b["scheme"] == "mlx_lm_fp16" and b["batch"] == r["batch"]
                     and b["context"] == r["context"] and "tokens_per_s" in b), None)
        if base is not None and "tokens_per_s" in r:
            r["tokens_per_s_vs_mlx_lm_fp16"] = round(r["tokens_per_s"] / base["tokens_per_s"], 3)
            r["cache_vs_mlx_lm_fp16"] = round(r["cache_bytes"] / base["cache_bytes"], 3)


def bytes_per_token(rows: list[dict[str, Any]], context: int | None = None) -> dict[str, float]:
    """Each scheme's cache bytes per (sequence x token), from its largest grid row (at `context` where it has
    one: the fp16 sink and tail make bytes per token depend on the context)."""
    out: dict[str, tuple[tuple[bool, int], float]] = {}
    for r in rows:
        if "cache_bytes" in r:
            rank = (r["context"] == context, r["batch"] * r["context"])
            if r["scheme"] not in out or rank > out[r["scheme"]][0]:
                out[r["scheme"]] = (rank, r["cache_bytes"] / (r["batch"] * r["context"]))
    return {k: v for k, (_, v) in out.items()}


def capacity(model: nn.Module, specs: list[str], per_token: dict[str, float],
             args: argparse.Namespace) -> list[dict[str, Any]]:
    """Each scheme alone at the largest batch its cache holds within the budget at the capacity context."""
    rows = []
    for spec in specs:
        if spec not in per_token:
            rows.append({"scheme": spec, "error": "no grid row measured its bytes per token"})
            continue
        batch = int(args.budget_gb * 1e9 // (per_token[spec] * args.capacity_context))
        mx.reset_peak_memory()
        run = Resident(model, spec, batch, args.capacity_context, args)
        for r in range(args.rounds):
            run.decode_round(model, args.per_round, args.seed + r)
        row = run.finish()
        row["budget_bytes"] = int(args.budget_gb * 1e9)
        row["peak_memory"] = mx.get_peak_memory()
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
        del run
        free()
    return rows


def write(args: argparse.Namespace, argv: list[str], model: nn.Module, result: dict[str, Any],
          seconds: float) -> None:
    """Write the JSON (after every grid point too, so a run cut by a time limit keeps its rows)."""
    out = {"device": device_name(), "backend": active_backend(), "mlx": mx.__version__,
           "mlx_lm": version("mlx-lm"), "commit": git_commit(), "machine": machine(),
           "model": model.gmlx_name, "layers": len(model.layers), "weight_bits": args.weights,
           "command": " ".join(["batch_capacity.py", *argv]), "seconds": round(seconds, 1),
           "method": __doc__.split("\n\n", 2)[2].strip(), **result}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), required=True)
    parser.add_argument("--weights", type=int, choices=(16, 8, 4), default=4)
    parser.add_argument("--grid", default="1x8192,1x32768,4x8192,4x32768,16x8192")
    parser.add_argument("--schemes", default=GRID_SCHEMES)
    parser.add_argument("--reference", default="", help="grid schemes to run again on the reference attention path "
                        "(decode the cache, then MLX's SDPA), side by side with their fused rows")
    parser.add_argument("--capacity-schemes", default=CAPACITY_SCHEMES, help="'' for no capacity run")
    parser.add_argument("--capacity-context", type=int, default=32768)
    parser.add_argument("--budget-gb", type=float, default=80.0, help="cache bytes allowed in the capacity run")
    parser.add_argument("--resident-gb", type=float, default=100.0, help="cache bytes a grid point may hold")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--per-round", type=int, default=8, help="timed steps per scheme and round")
    parser.add_argument("--fill", choices=sorted(FILLS), default="update",
                        help="how caches are filled: K/V straight into each layer's cache, or a prefill through the "
                             "model's layers")
    parser.add_argument("--chunk", type=int, default=4096, help="tokens a sequence per fill update or prefill chunk")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/results/batch_capacity-cpu.json")
    args = parser.parse_args(argv)
    try:
        grid = parse_grid(args.grid)
    except ValueError as err:
        parser.error(str(err))
    extra = tuple(MLX_LM_SCHEMES)
    specs = scheme_list(args.schemes, extra=extra)
    specs += [f"{s}_reference" for s in (scheme_list(args.reference) if args.reference else [])]
    cap_specs = scheme_list(args.capacity_schemes, extra=extra) if args.capacity_schemes else []
    t0 = time.perf_counter()
    model = shaped_model(args.shape, args.weights, args.seed)
    grid_point(model, specs, 1, 2 * args.chunk, argparse.Namespace(**{**vars(args), "rounds": 1,
                                                                       "per_round": 2}))  # compiles; not kept
    rows: list[dict[str, Any]] = []
    skipped = []
    for batch, context in sorted(grid, key=lambda p: p[0] * p[1]):
        per_token = bytes_per_token(rows)
        need = sum(per_token.get(s, 0.0) for s in specs) * batch * context
        if need > args.resident_gb * 1e9:
            skipped.append({"batch": batch, "context": context, "cache_bytes_needed": int(need)})
            continue
        for row in grid_point(model, specs, batch, context, args):
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
        write(args, argv, model, {"grid": rows, "skipped": skipped, "unfinished": "grid"}, time.perf_counter() - t0)
    add_ratios(rows)
    result: dict[str, Any] = {"grid": rows, "skipped": skipped}
    if cap_specs:
        write(args, argv, model, {**result, "unfinished": "capacity"}, time.perf_counter() - t0)
        result["capacity"] = capacity(model, cap_specs, bytes_per_token(rows, args.capacity_context), args)
    write(args, argv, model, result, time.perf_counter() - t0)
    print(f"wrote {args.out} ({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
