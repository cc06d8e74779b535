"""Whole-model decode speed per KV-cache scheme: prefill a context, then greedy decode with mlx-lm.

Usage: python benchmarks/model_decode.py --out benchmarks/results/model_decode-cpu.json

For each scheme (default fp16, affine8 g64, affine4 g64, kvarn6, kvarn4; registry defaults otherwise,
so kvarn keeps a 1024-token fp16 tail and a 128-token fp16 sink), on the bundled teaching-llama:
  1. prefill: the first `--context` tokens of gmlx_lab/data/eval_text.txt, encoded with the model's own
     tokenizer (`--tokens random`: ids drawn uniformly from the vocabulary with `--seed`), run through
     `model(...)` in chunks of `--prefill-step` into a fresh `make_cache` cache, then `mx.eval` of the
     cache state; `cache_bytes` is the prompt cache's `.nbytes` then (resident, reserve included);
  2. decode: `mlx_lm.generate_step` (greedy, async-eval pipelining) from the greedy next token, for
     `--decode` tokens; the wall-clock interval between consecutive yielded tokens is one token's time,
     so the first token (pipeline start) is left out; median and mean ms/token, tokens/s = 1000 / mean.
A short warm-up run per scheme (256-token context, 8 tokens) comes first and is not reported.

Sealing (kvarn moves each complete group of 128 tokens that left the tail into records) is timed two ways:
  - `seal.direct`: the cache's own `KVarNCache._seal()` on copies of every kvarn layer's cache as left by
    the prefill, with the model's own 128 newest (rotated) K/V tokens appended so exactly one record group
    per layer is due; one seal event = every kvarn layer, evaluated together (that is what one decode step
    does); median of `--seal-repeats`. `encode_tiles_ms` is the encoding alone (no finiteness check, body
    concatenation or contiguous copies). `per_token_ms` spreads one event over the 128 tokens between seals.
  - `seal_in_decode` (per kvarn row): the decode step that seals is found from the cache's geometry; the
    intervals around it (the step's graph building, where the CPU path reads the finiteness flag with
    `.item()`, and its evaluation) minus the median interval of the other steps, when it lies inside the
    decode window. With the defaults (4096 = 128 sink + 23 records + 1024 tail) it falls on the 128th step.
On the CPU the model computes in float32 (gmlx_lab.load's "auto"), the caches store float16/codes, and
attention runs the caches' pure-MLX reference paths (no fused kernels). Contexts past the model's 4096
trained positions only matter for what is generated, not for speed. With the defaults the whole run takes
about 2.5 minutes on a 2-core x86 CPU with OpenBLAS preloaded (as the Makefile does), most of it the two
affine prefills (AffineCache attends a 2048-token chunk with `mx.quantized_matmul`, not BLAS).
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from fidelity_sweep import machine
from mlx_lm.generate import generate_step

from gmlx_lab import make_cache
from gmlx_lab.cache.kvarn import SINK_TOKENS, KVarNCache
from gmlx_lab.cache.records import TILE, encode_tiles
from gmlx_lab.cli import EVAL_TEXT, _specs, encode, load_model
from gmlx_lab.fidelity import parse_scheme_spec, scheme_label
from gmlx_lab.kernels import active_backend
from gmlx_lab.policy import PromptCache, model_name

DEFAULT_SCHEMES = "fp16,affine8:g=64,affine4:g=64,kvarn6,kvarn4"


def device_name() -> str:
    """The GPU's name from mx.device_info(), or the processor plus "cpu"."""
    if active_backend() != "cpu" and hasattr(mx, "device_info"):
        return str(mx.device_info().get("device_name", platform.node()))
    return f"{platform.processor() or platform.machine()} cpu"


def context_tokens(tokenizer: Any, model: nn.Module, n: int, source: str, seed: int) -> mx.array:
    """n token ids: the start of the lab's eval text (repeated if short), or uniform random ids."""
    if source == "random":
        mx.random.seed(seed)
        return mx.random.randint(0, model.args.vocab_size, (n,)).astype(mx.uint32)
    ids = encode(tokenizer, model, EVAL_TEXT.read_text(encoding="utf-8"))
    return mx.array((ids * (n // len(ids) + 1))[:n], dtype=mx.uint32)


def prefill(model: nn.Module, cache: PromptCache, tokens: mx.array, step: int) -> tuple[int, float]:
    """Run tokens into the cache in chunks, evaluating the cache state; (greedy next token, seconds)."""
    t0 = time.perf_counter()
    for start in range(0, tokens.size, step):
        logits = model(tokens[None, start:start + step], cache=cache)
        mx.eval([c.state for c in cache], logits)
    nxt = int(mx.argmax(logits[0, -1]).item())
    return nxt, time.perf_counter() - t0


def decode(model: nn.Module, cache: PromptCache, first: int, n: int) -> tuple[list[float], list[int]]:
    """Greedy decode of n tokens with generate_step; (ms between consecutive yields, tokens)."""
    stamps, out = [], []
    for tok, _ in generate_step(mx.array([first], dtype=mx.uint32), model, prompt_cache=cache, max_tokens=n):
        stamps.append(time.perf_counter())
        out.append(tok)
    return [(b - a) * 1e3 for a, b in zip(stamps, stamps[1:])], out


def seal_step(cache: PromptCache) -> int | None:
    """Which decode forward pass (1 = the first token written after the prefill) seals the next group."""
    kv = next((c for c in cache if isinstance(c, KVarNCache)), None)
    if kv is None:
        return None
    regions = kv.region_tokens()
    recent = regions["live"] + regions["tail"]
    return (SINK_TOKENS - regions["sink"]) + kv.kv_tail_tokens + TILE - recent


def seal_in_decode(intervals: list[float], step: int) -> dict[str, Any] | None:
    """Excess wall time of the intervals around the sealing forward pass over the median of the others.

    intervals[j - 1] ends at yield j (0-based yields); forward pass `step` is built while yield step - 2 is
    awaited and finishes by yield step - 1, so yields step - 2 .. step carry its cost.
    """
    window = [j for j in range(step - 2, step + 1) if 1 <= j <= len(intervals)]
    if not window:
        return None
    inside = [intervals[j - 1] for j in window]
    others = [t for j, t in enumerate(intervals, start=1) if j not in window]
    base = statistics.median(others)
    return {"forward_pass": step, "yields": window, "intervals_ms": [round(t, 2) for t in inside],
            "median_other_ms": round(base, 2), "excess_ms": round(sum(inside) - base * len(inside), 2)}


def clone_due(c: KVarNCache) -> KVarNCache:
    """A copy of a kvarn layer cache with its 128 newest tokens appended again, so one group is due to seal."""
    d = KVarNCache(c.k_bits, c.v_bits, c.kv_tail_tokens, c.norm_iters, c.layer)
    d.state = c.state
    for i in range(2):
        need = c.kv_tail_tokens + TILE - d.recent[i].shape[2]
        d.recent[i] = mx.concatenate([d.recent[i], c.recent[i][..., -need:, :]], axis=2)
    mx.eval(d.recent)
    return d


def seal_direct(cache: PromptCache, repeats: int) -> dict[str, Any]:
    """Median ms of one seal event (every kvarn layer) via `_seal()`, and of `encode_tiles` alone."""
    layers = [c for c in cache if isinstance(c, KVarNCache)]
    calls, encodes = [], []
    for _ in range(repeats + 1):  # the first round warms up
        clones = [clone_due(c) for c in layers]
        t0 = time.perf_counter()
        for d in clones:
            d._seal()
        mx.eval([(d.body, d.recent, d.sink) for d in clones])
        calls.append((time.perf_counter() - t0) * 1e3)
        chunks = [(c.recent[i][..., :TILE, :], bits, kind, c.norm_iters) for c in layers
                  for i, (bits, kind) in enumerate(((c.k_bits, "k"), (c.v_bits, "v")))]
        mx.eval([x for x, *_ in chunks])
        t0 = time.perf_counter()
        recs = [encode_tiles(KVarNCache._to_tiles(x, kind), bits, kind, iters) for x, bits, kind, iters in chunks]
        mx.eval([(r.codes, r.scale_axis, r.zp_axis, r.other_axis) for r in recs])
        encodes.append((time.perf_counter() - t0) * 1e3)
    event = statistics.median(calls[1:])
    heads = layers[0].recent[0].shape[1]
    return {"layers": len(layers), "records_per_event": 2 * heads * len(layers),
            "records_before": layers[0].n_records, "event_ms": round(event, 2),
            "encode_tiles_ms": round(statistics.median(encodes[1:]), 2),
            "per_record_ms": round(event / (2 * heads * len(layers)), 3), "per_token_ms": round(event / TILE, 3),
            "event_ms_all": [round(t, 2) for t in calls[1:]]}


def run_scheme(model: nn.Module, spec: str, tokens: mx.array, n_decode: int, step: int,
               seal_repeats: int) -> dict[str, Any]:
    """Prefill, cache bytes, decode timings (and the seal for kvarn) of one scheme."""
    scheme, options = parse_scheme_spec(spec)
    cache = make_cache(model, scheme, quiet=True, **options)
    first, prefill_s = prefill(model, cache, tokens, step)
    cache_bytes = cache.nbytes
    sealing = seal_step(cache)
    seal = seal_direct(cache, seal_repeats) if sealing is not None and seal_repeats > 0 else None
    intervals, out = decode(model, cache, first, n_decode)
    mean, median = statistics.mean(intervals), statistics.median(intervals)
    row = {"scheme": spec.split(":")[0], "label": scheme_label(scheme, options), "policy": str(cache.policy),
           "tokens_per_s": round(1e3 / mean, 2), "ms_per_token_median": round(median, 3),
           "ms_per_token_mean": round(mean, 3), "ms_per_token_min": round(min(intervals), 3),
           "ms_per_token_max": round(max(intervals), 3), "cache_bytes": cache_bytes,
           "cache_bytes_after_decode": cache.nbytes, "prefill_s": round(prefill_s, 3),
           "prefill_tokens_per_s": round(tokens.size / prefill_s, 1), "timed_tokens": len(intervals),
           "generated": out[:16], "ms_per_token": [round(t, 3) for t in intervals]}
    if sealing is not None:
        row["seal_in_decode"] = seal_in_decode(intervals, sealing)
        row["seal_direct"] = seal
    del cache
    gc.collect()
    mx.clear_cache()
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="default: the bundled teaching-llama")
    parser.add_argument("--schemes", default=DEFAULT_SCHEMES)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--decode", type=int, default=128)
    parser.add_argument("--prefill-step", type=int, default=2048)
    parser.add_argument("--tokens", choices=("text", "random"), default="text")
    parser.add_argument("--seed", type=int, default=0, help="for --tokens random")
    parser.add_argument("--seal-repeats", type=int, default=5, help="0 skips the direct seal timing")
    parser.add_argument("--out", default="benchmarks/results/model_decode-cpu.json")
    args = parser.parse_args(argv)
    if args.decode < 3:
        parser.error("--decode needs at least 3 tokens (the first is not timed)")
    t0 = time.perf_counter()
    model, tokenizer = load_model(args.model)
    specs = _specs(args.schemes)
    tokens = context_tokens(tokenizer, model, args.context, args.tokens, args.seed)
    warm = tokens[:256]
    rows = []
    for spec in specs:
        run_scheme(model, spec, warm, 8, args.prefill_step, 0)  # warm-up, not reported
        rows.append(run_scheme(model, spec, tokens, args.decode, args.prefill_step, args.seal_repeats))
        r = rows[-1]
        print(f"{r['scheme']:8s} {r['ms_per_token_median']:8.2f} ms/token  {r['tokens_per_s']:7.1f} tok/s  "
              f"cache {r['cache_bytes'] / 2**20:6.2f} MiB  prefill {r['prefill_s']:.1f} s", file=sys.stderr, flush=True)
    base = next((r for r in rows if r["scheme"] == "fp16"), None)
    for r in rows:
        if base:
            r["speed_vs_fp16"] = round(r["tokens_per_s"] / base["tokens_per_s"], 3)
            r["cache_vs_fp16"] = round(r["cache_bytes"] / base["cache_bytes"], 3)
    seals = {r["scheme"]: {**r["seal_direct"], "share_of_decode_token": round(
        r["seal_direct"]["per_token_ms"] / r["ms_per_token_median"], 4)} for r in rows if r.get("seal_direct")}
    seconds = time.perf_counter() - t0
    result = {
        "device": device_name(), "backend": active_backend(), "mlx": mx.__version__, "mlx_lm": version("mlx-lm"),
        "model": model_name(model), "context": args.context, "decode": args.decode,
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "machine": machine(), "seconds": round(seconds, 1),
        "tokens": "eval_text.txt, model tokenizer" if args.tokens == "text" else f"random ids, seed {args.seed}",
        "method": f"prefill {args.context} tokens in chunks of {args.prefill_step} into a fresh cache, eval; "
                  f"greedy mlx_lm.generate_step of {args.decode} tokens; ms/token = wall-clock between "
                  f"consecutive yields (first token left out); tokens_per_s = 1000 / mean; one warm-up run "
                  f"per scheme first; seal.direct = KVarNCache._seal() on prefilled copies with one group due, "
                  f"all kvarn layers in one eval, median of {args.seal_repeats}",
        "rows": rows, "seal": seals,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"\n{result['model']}, context {args.context}, decode {args.decode}, {result['device']} "
          f"({result['backend']})")
    print("| scheme | ms/token median | ms/token mean | tokens/s | vs fp16 | cache MiB | cache vs fp16 | prefill s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['label']} | {r['ms_per_token_median']:.2f} | {r['ms_per_token_mean']:.2f} | "
              f"{r['tokens_per_s']:.1f} | {r.get('speed_vs_fp16', 1):.2f}x | {r['cache_bytes'] / 2**20:.2f} | "
              f"{r.get('cache_vs_fp16', 1):.3f} | {r['prefill_s']:.1f} |")
    for name, s in seals.items():
        d = next(r["seal_in_decode"] for r in rows if r["scheme"] == name)
        inside = f"{d['excess_ms']:.1f} ms over the median at forward pass {d['forward_pass']}" if d else "outside"
        print(f"seal {name}: {s['event_ms']:.1f} ms per event ({s['records_per_event']} records, "
              f"encode_tiles alone {s['encode_tiles_ms']:.1f} ms) = {s['per_token_ms']:.3f} ms/token amortized "
              f"({100 * s['share_of_decode_token']:.1f}% of a decode token); in decode: {inside}")
    print(f"wrote {args.out} ({seconds:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
