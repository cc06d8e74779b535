"""Whole-model prefill and decode speed per KV-cache scheme, measured side by side in one run.

Usage:
  python benchmarks/model_decode.py                     # CPU: the bundled model, 4096 tokens of its eval text
  python benchmarks/model_decode.py --shape llama3-8b --contexts 8192,32768,131072 \\
      --out benchmarks/results/model_decode-h200.json   # GPU: Llama-3-8B shapes, random weights

For each context, every scheme side by side, each with a fresh cache (all kept until the context is done):
  1. prefill: `context` tokens through `model(...)` in chunks of `--prefill-step`, then `mx.eval` of the
     cache state; prefill_tokens_per_s = context / seconds; `cache_bytes` is the cache's resident bytes then
     (mlx-lm's `nbytes` for its own caches, ours `.nbytes`); `peak_memory` is `mx.get_peak_memory()` over
     the prefill, the weights included and the other schemes' caches left out; `weights_memory` is what was
     allocated before any cache (the weights), so `peak_memory - weights_memory` is the prefill's peak above
     the weights: the cache plus the prefill's scratch;
  2. decode, in `--rounds` rounds: in each, every scheme in turn decodes its share of `--decode` tokens with
     `mlx_lm.generate_step` (greedy, async-eval pipelining) from where its last round stopped, so a slow
     spell of the machine falls on every scheme alike; the wall-clock interval between consecutive yielded
     tokens is one token's time, each round's first token (pipeline start) left out; each row reports the
     median, the 10th and 90th percentiles and the count of its timed tokens; decode_tokens_per_s = 1000 / mean ms
     (with async-eval pipelining an interval can shrink after a long one, so the 10th percentile need not be a
     step's time: on the H200 mlx-lm's fell below its median by up to 60%; read the median);
     `decode_scratch_memory` is the most any of its rounds allocated above what was resident when it began
     (every cache and the weights): a decode step's transient memory;
  3. graph building: `--build-steps` more decode steps run one at a time, timing the Python call that builds
     the step's graph (`model(...)` plus the argmax) apart from its evaluation; `build_us_per_layer` spreads
     it over the layers; `encode_us_per_step` times `mx.async_eval`, where MLX hands the step's kernels to the
     GPU (on CUDA: adds them to CUDA graphs and launches those), the host's other share of a step. Where build +
     encode is close to the decode interval, the step is bound by the host.
Schemes: `mlx_lm_fp16` (mlx-lm's `KVCache`), `mlx_lm_affine8`/`mlx_lm_affine4` (mlx-lm's `QuantizedKVCache`,
group 64; a failure, e.g. its CUDA prefill, is recorded in the row), and any gmlx_lab scheme spec (`fp16`,
`affine8`, `kvarn6`, `kvarn4:tail=128`, ...; registry defaults otherwise). Ratios are to `mlx_lm_fp16` of the
same context and weights. A short warm-up per scheme (compiles the kernels) is not reported. `--unchecked` adds
rows (scheme name + "_unchecked") with the caches' finiteness check of arriving K/V switched off, so its cost is
measured side by side; `--reference` adds rows (+ "_reference") that attend on the reference path (decode the
cache, then MLX's SDPA) instead of the fused kernel, so the two paths run side by side. `--probes kvarn6/lean-
fetch,kvarn6/all,...` (GPU only) adds what-if rows: each probe removes one piece of a fused decode step's host
work (PROBES), so its row bounds what removing that piece for real would gain; a probe's attention output is
wrong, only its timing is read (except `one-launch` / `two-launch`, the split kernels merging their own splits on
CUDA or not, and `ring-on` / `ring-off`, kvarn_decode's ring whatever the record count says: the kernel settings
of kernels/config.py, whose outputs are right).
`--shape llama3-8b`: an mlx-lm `llama` with Llama-3-8B's shapes (32 layers, hidden 4096, 32 query / 8 KV
heads of 128, FFN 14336, vocab 128256) and random float16 weights; `--weights 4` quantizes them with
`nn.quantize` (group 64); `--shape two-layers` keeps 8 query and 8 KV heads of 128 in two narrow layers, so a
prompt chunk's attention is the real size while the CPU runs the rest quickly. Tokens are random ids; on the CPU the
shaped model computes in float32. Without `--shape`, `--model` (the bundled model by default)
runs on the text of gmlx_lab/data/eval_text.txt; on the CPU the model computes in float32.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import io
import json
import os
import platform
import pstats
import statistics
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from fidelity_sweep import machine
from mlx_lm.generate import generate_step
from mlx_lm.models import llama
from mlx_lm.models.cache import QuantizedKVCache, make_prompt_cache

from gmlx_lab import make_cache
from gmlx_lab.cache import AffineCache, GmlxCache, KvarnCache
from gmlx_lab.cli import EVAL_TEXT, encode, load_model, scheme_list
from gmlx_lab.kernels import active_backend, config, precompiled
from gmlx_lab.measure.fidelity import parse_scheme_spec, scheme_label
from gmlx_lab.policy import model_name

MLX_LM_SCHEMES = {"mlx_lm_fp16": None, "mlx_lm_affine8": 8, "mlx_lm_affine4": 4}
DEFAULT_SCHEMES = {"cpu": "mlx_lm_fp16,fp16,affine8,affine4,kvarn6,kvarn4",
                   "gpu": "mlx_lm_fp16,mlx_lm_affine8,fp16,affine8,affine4,kvarn6,kvarn4"}
SHAPES = {"llama3-8b": dict(hidden_size=4096, num_hidden_layers=32, intermediate_size=14336,
                            num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
                            rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False),
          "tiny": dict(hidden_size=256, num_hidden_layers=2, intermediate_size=512, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=128, vocab_size=1024, rope_theta=10000.0, rms_norm_eps=1e-5,
                       tie_word_embeddings=False),  # the same code paths at a size the CPU runs in seconds
          # two layers of Llama-3-8B's attention heads in a narrow model: a prompt chunk's scores as large as the
          # real model's a layer, so prefill memory shows on the CPU
          "two-layers": dict(hidden_size=1024, num_hidden_layers=2, intermediate_size=2048, num_attention_heads=8,
                             num_key_value_heads=8, head_dim=128, vocab_size=1024, rope_theta=10000.0,
                             rms_norm_eps=1e-5, tie_word_embeddings=False)}


def git_commit() -> str:
    """The checkout's commit (what code the numbers come from): GMLX_COMMIT when set (a copy of the tree without
    its .git, as on the GPU machine), else git's, or "unknown"."""
    if os.environ.get("GMLX_COMMIT"):
        return os.environ["GMLX_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def device_name() -> str:
    """The GPU's name from mx.device_info(), or the processor plus "cpu"."""
    if active_backend() != "cpu" and hasattr(mx, "device_info"):
        return str(mx.device_info().get("device_name", platform.node()))
    return f"{platform.processor() or platform.machine()} cpu"


def shaped_model(shape: str, weight_bits: int, seed: int = 0) -> nn.Module:
    """An mlx-lm llama with a named model's shapes and random float16 weights (float32 on the CPU; quantized if
    weight_bits < 16)."""
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs(model_type="llama", **SHAPES[shape]))
    model.set_dtype(mx.float32 if active_backend() == "cpu" else mx.float16)
    if weight_bits < 16:
        nn.quantize(model, group_size=64, bits=weight_bits)
    mx.eval(model.parameters())
    model.gmlx_name = f"{shape} (random weights)"
    return model


def context_tokens(tokenizer: Any, model: nn.Module, n: int, source: str, seed: int) -> mx.array:
    """n token ids: the start of the lab's eval text (repeated if short), or uniform random ids."""
    if source == "random":
        mx.random.seed(seed)
        return mx.random.randint(0, model.args.vocab_size, (n,)).astype(mx.uint32)
    ids = encode(tokenizer, model, EVAL_TEXT.read_text(encoding="utf-8"))
    return mx.array((ids * (n // len(ids) + 1))[:n], dtype=mx.uint32)


# spec suffixes that set one switch on every gmlx_lab cache: (attribute, value, what the label adds)
SWITCHES = {"_unchecked": ("check_finite_on", False, ", finiteness check off"),
            "_reference": ("attention_path", "reference", ", reference path (dequantize, then SDPA)")}


def new_cache(model: nn.Module, spec: str) -> tuple[Any, str]:
    """(prompt cache, label) for an mlx-lm scheme name or a gmlx_lab scheme spec (+ a suffix of SWITCHES)."""
    for suffix, (name, value, words) in SWITCHES.items():
        if spec.endswith(suffix):
            cache, label = new_cache(model, spec.removesuffix(suffix))
            for c in cache:
                if isinstance(c, GmlxCache):
                    setattr(c, name, value)
            return cache, label + words
    if spec in MLX_LM_SCHEMES:
        bits = MLX_LM_SCHEMES[spec]
        if bits is None:
            return make_prompt_cache(model), "mlx-lm KVCache"
        return [QuantizedKVCache(group_size=64, bits=bits) for _ in model.layers], f"mlx-lm QuantizedKVCache{bits}"
    scheme, options = parse_scheme_spec(spec)
    return make_cache(model, scheme, quiet=True, **options), scheme_label(scheme, options)


@contextlib.contextmanager
def lean_fetch() -> Any:
    """Probe: update_and_fetch builds no decoded K/V to hand back (it returns stored arrays, so attention still
    takes the fused path): what the graph of the returned K/V costs."""
    kvarn_fetch, affine_stored = KvarnCache.fetch, AffineCache.stored
    KvarnCache.fetch = lambda self, dtype=None, decode_step=False: (self.recent.k.data, self.recent.v.data)
    AffineCache.stored = lambda self, end, dtype: tuple(bufs[0].data for bufs in self.body_buffers)
    try:
        yield
    finally:
        KvarnCache.fetch, AffineCache.stored = kvarn_fetch, affine_stored


def setting(**settings: Any) -> Any:
    """Probe: decode steps under these kernel settings (kernels/config.py; the plans and compiled graphs carry
    them): `one-launch` / `two-launch`, the split kernels merging their own splits on CUDA or in split_merge;
    `ring-on` / `ring-off`, kvarn_decode's cp.async ring. Their outputs are right."""
    return lambda: config.configured(**settings)


PROBES = {"lean-fetch": lean_fetch, "one-launch": setting(merge_in_kernel=True),
          "two-launch": setting(merge_in_kernel=False), "ring-on": setting(ring="on"), "ring-off": setting(ring="off")}


def parse_probes(text: str) -> list[tuple[str, list[str]]]:
    """"kvarn6/lean-fetch,kvarn6/all" -> [("kvarn6", ["lean-fetch"]), ("kvarn6", [every probe])]."""
    out = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        spec, _, names = item.partition("/")
        probes = list(PROBES) if names == "all" else names.split("+")
        bad = [p for p in probes if p not in PROBES]
        if not spec or bad or not names:
            raise ValueError(f"probe {item!r}: expected SCHEME/PROBE[+PROBE...] or SCHEME/all with probes "
                             f"{', '.join(PROBES)}")
        out.append((spec, probes))
    return out


class PeakAbove:
    """`with PeakAbove() as peak: ...`, then `peak.bytes`: the most MLX allocated inside the block above what was
    allocated when it began (`mx.get_peak_memory`, reset on entry)."""

    def __enter__(self) -> PeakAbove:
        self.start = mx.get_active_memory()
        mx.reset_peak_memory()
        return self

    def __exit__(self, *exc: object) -> None:
        self.bytes = mx.get_peak_memory() - self.start


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile of values, interpolated between the two nearest ranks (numpy's default)."""
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    return xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (pos - lo)


def cache_bytes(cache: Any) -> int:
    return sum(c.nbytes for c in cache)


def prefill(model: nn.Module, cache: Any, tokens: mx.array, step: int) -> tuple[int, float]:
    """Run tokens into the cache in chunks, evaluating the cache state; (greedy next token, seconds)."""
    t0 = time.perf_counter()
    for start in range(0, tokens.size, step):
        logits = model(tokens[None, start:start + step], cache=cache)
        mx.eval([c.state for c in cache], logits)
    nxt = int(mx.argmax(logits[0, -1]).item())
    return nxt, time.perf_counter() - t0


def decode(model: nn.Module, cache: Any, first: int, n: int) -> tuple[list[float], list[int]]:
    """Greedy decode of n tokens with generate_step; (ms between consecutive yields, tokens)."""
    stamps, out = [], []
    for tok, _ in generate_step(mx.array([first], dtype=mx.uint32), model, prompt_cache=cache, max_tokens=n):
        stamps.append(time.perf_counter())
        out.append(tok)
    return [(b - a) * 1e3 for a, b in zip(stamps, stamps[1:])], out


def build_times(model: nn.Module, cache: Any, first: int, n: int) -> tuple[list[float], list[float], list[float]]:
    """n decode steps one at a time: µs to build each step's graph in Python, µs to encode it (`mx.async_eval`
    returns once MLX has handed every kernel to the GPU: the host's other share of a step), µs to evaluate it
    (encode and wait for the GPU)."""
    y = mx.array([[first]], dtype=mx.uint32)
    builds, encodes, evals = [], [], []
    for _ in range(n + 1):
        t0 = time.perf_counter()
        y = mx.argmax(model(y, cache=cache)[:, -1:], axis=-1)
        t1 = time.perf_counter()
        mx.async_eval(y)
        t2 = time.perf_counter()
        mx.eval(y)
        t3 = time.perf_counter()
        builds.append((t1 - t0) * 1e6)
        encodes.append((t2 - t1) * 1e6)
        evals.append((t3 - t1) * 1e6)
    return builds[1:], encodes[1:], evals[1:]


def profile_decode(model: nn.Module, cache: Any, first: int, n: int, top: int = 25) -> list[dict[str, Any]]:
    """cProfile of n generate_step tokens: the functions with the most own time."""
    prof = cProfile.Profile()
    prof.enable()
    decode(model, cache, first, n)
    prof.disable()
    stats = pstats.Stats(prof, stream=io.StringIO())
    rows = []
    for (file, line, fn), (_, calls, tottime, cumtime, _) in stats.stats.items():  # type: ignore[attr-defined]
        rows.append({"function": f"{Path(file).name}:{line}:{fn}", "calls": calls,
                     "own_ms": round(tottime * 1e3, 2), "cumulative_ms": round(cumtime * 1e3, 2)})
    return sorted(rows, key=lambda r: -r["own_ms"])[:top]


class Run:
    """One scheme (or "scheme/probes") at one context: its cache, its row, and what its decode rounds gathered."""

    def __init__(self, model: nn.Module, name: str, args: argparse.Namespace):
        spec, _, probe_text = name.partition("/")
        self.probes = parse_probes(name)[0][1] if probe_text else []
        self.cache, label = new_cache(model, spec)
        self.row: dict[str, Any] = {"scheme": name, "label": label + "".join(f", probe {p}" for p in self.probes),
                                    "weight_bits": args.weights}
        self.intervals: list[float] = []
        self.out: list[int] = []
        self.next = 0  # the greedy token the next round starts from
        self.scratch = 0  # the most a decode round allocated above what was resident at its start

    @property
    def failed(self) -> bool:
        return "error" in self.row

    def probed(self) -> contextlib.ExitStack:
        """The probes' changes to decode steps (the prefill runs as it is)."""
        stack = contextlib.ExitStack()
        for probe in self.probes:
            stack.enter_context(PROBES[probe]())
        return stack

    def prefill(self, model: nn.Module, tokens: mx.array, args: argparse.Namespace, resident: int) -> None:
        """Prefill the cache; `resident`: bytes the other runs' caches hold (left out of this one's peak)."""
        self.row["context"] = int(tokens.size)
        gc.collect()
        mx.clear_cache()
        mx.reset_peak_memory()
        try:
            self.next, seconds = prefill(model, self.cache, tokens, args.prefill_step)
        except Exception as err:  # noqa: BLE001  (mlx-lm's own caches may not run here: recorded, not hidden)
            self.row["error"] = f"prefill: {type(err).__name__}: {err}"[:400]
            return
        self.row.update({"cache_bytes": cache_bytes(self.cache), "prefill_s": round(seconds, 3),
                         "prefill_tokens_per_s": round(tokens.size / seconds, 1),
                         "peak_memory": mx.get_peak_memory() - resident})

    def decode_round(self, model: nn.Module, n: int) -> None:
        """n more greedy tokens from where the last round stopped; their intervals join the row's."""
        with self.probed(), PeakAbove() as peak:
            try:
                intervals, out = decode(model, self.cache, self.next, n)
            except Exception as err:  # noqa: BLE001
                self.row["error"] = f"decode: {type(err).__name__}: {err}"[:400]
                return
        self.scratch = max(self.scratch, peak.bytes)
        self.intervals += intervals
        self.out += out
        self.next = out[-1]

    def finish(self, model: nn.Module, args: argparse.Namespace) -> dict[str, Any]:
        """Graph-building times and the profile, then the row's statistics."""
        if self.failed:
            return self.row
        with self.probed():
            builds, encodes, evals = build_times(model, self.cache, self.next, args.build_steps)
            profile = profile_decode(model, self.cache, self.next, args.profile) if args.profile else None
        mean, median = statistics.mean(self.intervals), statistics.median(self.intervals)
        build = statistics.median(builds)
        self.row.update({
            "decode_tokens_per_s": round(1e3 / mean, 2), "decode_ms_median": round(median, 3),
            "decode_ms_mean": round(mean, 3), "decode_ms_p10": round(percentile(self.intervals, 10), 3),
            "decode_ms_p90": round(percentile(self.intervals, 90), 3),
            "decode_ms_min": round(min(self.intervals), 3),
            "decode_ms_max": round(max(self.intervals), 3), "timed_tokens": len(self.intervals),
            "build_us_per_step": round(build, 1), "build_us_per_layer": round(build / len(model.layers), 2),
            "encode_us_per_step": round(statistics.median(encodes), 1),
            "eval_us_per_step": round(statistics.median(evals), 1), "generated": self.out[:8],
            "decode_scratch_memory": self.scratch,
        })
        if getattr(self.cache, "policy", None) is not None:
            self.row["policy"] = str(self.cache.policy)
        if profile is not None:
            self.row["profile"] = profile
        return self.row


def run_context(model: nn.Module, specs: list[str], tokens: mx.array, args: argparse.Namespace,
                rounds: int, per_round: int) -> list[dict[str, Any]]:
    """Every scheme at one context, side by side: each prefills its own cache (all kept), then `rounds` rounds
    in which each decodes `per_round` tokens in turn, so a slow spell of the machine is shared by all."""
    runs = [Run(model, spec, args) for spec in specs]
    base = mx.get_active_memory()
    for run in runs:
        run.row["weights_memory"] = base
        run.prefill(model, tokens, args, mx.get_active_memory() - base)
    for _ in range(rounds):
        for run in runs:
            if not run.failed:
                run.decode_round(model, per_round)
    return [run.finish(model, args) for run in runs]


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Each row's speeds and bytes as ratios to mlx_lm_fp16 at the same context and weights."""
    for r in rows:
        base = next((b for b in rows if b["scheme"] == "mlx_lm_fp16" and b["context"] == r["context"]
                     and b["weight_bits"] == r["weight_bits"] and "error" not in b), None)
        if base is None or "error" in r:
            continue
        r["decode_vs_mlx_lm_fp16"] = round(r["decode_tokens_per_s"] / base["decode_tokens_per_s"], 3)
        # from the median token: a few slow tokens (a compile, a collection) move the mean of 64 tokens a lot
        r["decode_median_vs_mlx_lm_fp16"] = round(base["decode_ms_median"] / r["decode_ms_median"], 3)
        r["decode_p10_vs_mlx_lm_fp16"] = round(base["decode_ms_p10"] / r["decode_ms_p10"], 3)
        r["prefill_vs_mlx_lm_fp16"] = round(r["prefill_tokens_per_s"] / base["prefill_tokens_per_s"], 3)
        r["cache_vs_mlx_lm_fp16"] = round(r["cache_bytes"] / base["cache_bytes"], 3)


def print_table(rows: list[dict[str, Any]]) -> None:
    print("| context | scheme | decode ms/token (median) | vs mlx-lm fp16 | 10th pct ms | vs mlx-lm fp16 | tokens | "
          "tokens/s (mean) | vs mlx-lm fp16 | prefill tokens/s | vs mlx-lm fp16 | cache GiB | build µs/layer | "
          "encode µs/step |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['context']} | {r['scheme']} | {r['error'][:60]} |")
            continue
        ratio = {k: f"{r[k]:.2f}x" if k in r else "–" for k in  # "–" where mlx-lm's KVCache did not run
                 ("decode_median_vs_mlx_lm_fp16", "decode_p10_vs_mlx_lm_fp16", "decode_vs_mlx_lm_fp16",
                  "prefill_vs_mlx_lm_fp16")}
        print(f"| {r['context']} | {r['scheme']} | {r['decode_ms_median']:.2f} | "
              f"{ratio['decode_median_vs_mlx_lm_fp16']} | {r['decode_ms_p10']:.2f} | "
              f"{ratio['decode_p10_vs_mlx_lm_fp16']} | {r['timed_tokens']} | {r['decode_tokens_per_s']:.1f} | "
              f"{ratio['decode_vs_mlx_lm_fp16']} | {r['prefill_tokens_per_s']:.0f} | "
              f"{ratio['prefill_vs_mlx_lm_fp16']} | {r['cache_bytes'] / 2**30:.3f} | "
              f"{r['build_us_per_layer']:.1f} | {r['encode_us_per_step']:.0f} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="default: the bundled teaching-llama (ignored with --shape)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default=None, help="random-weight model of these shapes")
    parser.add_argument("--weights", type=int, choices=(16, 8, 4), default=16, help="weight bits (with --shape)")
    parser.add_argument("--schemes", default=None, help="default: " + "; ".join(f"{k}: {v}" for k, v in
                                                                                 DEFAULT_SCHEMES.items()))
    parser.add_argument("--contexts", default="4096", help="comma-separated context lengths")
    parser.add_argument("--decode", type=int, default=128, help="timed tokens per scheme, over all rounds")
    parser.add_argument("--rounds", type=int, default=4, help="decode rounds; each scheme decodes in turn in each")
    parser.add_argument("--build-steps", type=int, default=16)
    parser.add_argument("--prefill-step", type=int, default=2048)
    parser.add_argument("--profile", type=int, default=0, help="cProfile this many decode tokens per row")
    parser.add_argument("--reference", default="", help="schemes to run again on the reference attention path")
    parser.add_argument("--unchecked", default="", help="schemes to run again with the finiteness check off")
    parser.add_argument("--probes", default="", help="what-if rows on a GPU: SCHEME/PROBE[+PROBE] or SCHEME/all, "
                        f"comma-separated; probes: {', '.join(PROBES)}")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/results/model_decode-cpu.json")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.decode < 2 * args.rounds:
        parser.error("--decode needs at least 2 timed tokens per round (--rounds >= 1)")
    contexts = [int(c) for c in args.contexts.split(",")]
    if any(c < 1 for c in contexts):
        parser.error(f"--contexts must be positive ints, got {args.contexts!r}")
    t0 = time.perf_counter()
    if args.shape:
        model, tokenizer, source = shaped_model(args.shape, args.weights, args.seed), None, "random"
    else:
        model, tokenizer = load_model(args.model)
        source = "text"
    specs = scheme_list(args.schemes or DEFAULT_SCHEMES["cpu" if active_backend() == "cpu" else "gpu"],
                        extra=tuple(MLX_LM_SCHEMES))
    for suffix, given in (("_unchecked", args.unchecked), ("_reference", args.reference)):
        specs += [f"{s}{suffix}" for s in (scheme_list(given) if given else [])]
    if args.probes:
        if active_backend() == "cpu":
            parser.error("--probes change the fused GPU path; MLX runs on the CPU here")
        try:
            probes = parse_probes(args.probes)
        except ValueError as err:
            parser.error(str(err))
        scheme_list(",".join(spec for spec, _ in probes))  # every probed scheme is a known one
        specs += [f"{spec}/{'+'.join(names)}" for spec, names in probes]
    rows: list[dict[str, Any]] = []
    warm = context_tokens(tokenizer, model, 2048 + 1024 + 256, source, args.seed + 1)
    warm_args = argparse.Namespace(**{**vars(args), "build_steps": 2, "profile": 0})
    run_context(model, specs, warm, warm_args, 1, 4)  # compiles kernels; not reported
    per_round = -(-args.decode // args.rounds) + 1  # each round's first token is not timed
    for n in contexts:
        gc.collect()
        mx.clear_cache()
        tokens = context_tokens(tokenizer, model, n, source, args.seed)
        for r in run_context(model, specs, tokens, args, args.rounds, per_round):
            rows.append(r)
            msg = r.get("error") or (f"{r['decode_ms_median']:7.2f} ms/token  prefill {r['prefill_s']:6.2f} s  "
                                     f"build {r['build_us_per_layer']:6.1f} us/layer")
            print(f"{n:7d} {r['scheme']:16s} {msg}", file=sys.stderr, flush=True)
        write_result(args, argv, model, source, rows, time.perf_counter() - t0, final=False)
    add_ratios(rows)
    write_result(args, argv, model, source, rows, time.perf_counter() - t0, final=True)
    print(f"\n{model_name(model)}, {device_name()} ({active_backend()}), weights {args.weights}-bit")
    print_table(rows)
    print(f"wrote {args.out} ({time.perf_counter() - t0:.0f} s)")
    return 0


def write_result(args: argparse.Namespace, argv: list[str] | None, model: nn.Module, source: str,
                 rows: list[dict[str, Any]], seconds: float, final: bool) -> None:
    """Write the JSON; after every row too (marked unfinished), so a run cut by a time limit keeps its rows."""
    result = {
        "device": device_name(), "backend": active_backend(), "mlx": mx.__version__, "mlx_lm": version("mlx-lm"),
        "commit": git_commit(),
        "model": model_name(model), "layers": len(model.layers), "weight_bits": args.weights,
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "machine": machine(), "seconds": round(seconds, 1),
        "kernel_settings": config.as_dict(), "kernel_launch_problems": precompiled.problems(),
        "tokens": "eval_text.txt, model tokenizer" if source == "text" else f"random ids, seed {args.seed}",
        "method": __doc__.split("\n\n", 2)[2].split("\nSchemes:")[0].strip(),
        "rows": rows,
    }
    if not final:
        result["unfinished"] = "written after each row; the run had not ended (ratios are added at the end)"
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
