"""What the decode kernels' warps wait on: program-counter sampling with stall reasons, per SASS instruction.

Usage (a CUDA machine with Nsight Compute's `ncu`, which samples the warps' program counters through CUPTI):
  python benchmarks/stall_sample.py --impls fused_kvarn6,fused_kvarn4,fp16_sdpa --contexts 32768,131072 \\
      --out benchmarks/results/decode_stalls-h200.json

For each implementation and context (decode_attention.py's shapes: 1 query token, 32 q / 8 kv heads, head dim
128) a child process builds the state, warms up (compiles), then runs one call between cuProfilerStart and
cuProfilerStop; `ncu --profile-from-start off` profiles the kernels of that call alone with its sections
WarpStateStats and SourceCounters (PC sampling at ncu's automatic interval),
leaving the clocks as they are. The report is read with ncu's Python interface (or, failing that, its CSV pages):
per kernel the duration, the samples by stall reason, and the instructions with the most samples, each with its
SASS text and its samples by reason; `by_opcode` sums them per opcode (LOP3, SHF, HMMA, LDS, ...).
Every sampled instruction (address, SASS text, samples) also goes to <reports>/<impl>-<context>-<kernel>.pcs.json:
MLX 0.32 compiles custom kernels without line info and keeps them in memory only, so the lines come from
`stall_lines.py`, which maps these addresses onto a build of the same kernel text with line info.
A sample names what kept its warp from issuing in that cycle ("selected": it issued). The reasons, briefly:
long_scoreboard (waits on a global/local memory result), short_scoreboard (shared memory, MUFU, shuffles),
wait (a fixed-latency dependency), math_pipe_throttle (the pipe is busy), mio_throttle / lg_throttle
(the memory instruction queues are full), barrier / membar (a __syncthreads / fence), not_selected (another
warp issued), no_instructions, dispatch_stall, branch_resolving, drain, sleeping, misc.
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import glob
import io
import json
import os
import re
import subprocess
import sys
import time
from collections import defaultdict
from importlib.metadata import version
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
PCSAMP = "smsp__pcsamp_warps_issue_stalled_"


def child(impl: str, tokens: int, warm: int) -> None:
    """Build impl's state at `tokens`, warm it, then one call inside the profiler's range."""
    import mlx.core as mx
    from decode_attention import (
        BLOCK_SCHEMES,
        D,
        fused_affine_state,
        fused_block_state,
        fused_kvarn_state,
        random_qkv,
        sdpa_state,
    )

    from gmlx_lab.kernels import config

    q, k, v = random_qkv(tokens)
    qs = [q]  # the state functions take the queries as a list (decode_attention.py chains calls through it)
    scale = D**-0.5
    settings: dict[str, Any] = {}
    name = impl
    for suffix, value in (("_ring_on", "on"), ("_ring_off", "off")):
        if name.endswith(suffix):
            name, settings["ring"] = name.removesuffix(suffix), value
    with config.configured(**settings):
        if name == "fp16_sdpa":
            fn = sdpa_state(qs, k, v, scale)[0]
        elif name.startswith("fused_kvarn"):
            fn = fused_kvarn_state(qs, k, v, scale, int(name.removeprefix("fused_kvarn")))[0]
        elif name.startswith("fused_affine"):
            fn = fused_affine_state(qs, k, v, scale, int(name.removeprefix("fused_affine")))[0]
        elif name.removeprefix("fused_") in BLOCK_SCHEMES:
            fn = fused_block_state(qs, k, v, scale, name.removeprefix("fused_"))[0]
        else:
            raise SystemExit(f"unknown impl {impl!r}")
        for _ in range(warm):
            mx.eval(fn())
        mx.synchronize()
        cuda = ctypes.CDLL("libcuda.so.1")
        cuda.cuProfilerStart()
        mx.eval(fn())
        mx.synchronize()
        cuda.cuProfilerStop()


def ncu_binary() -> str:
    found = [p for p in ("ncu", *sorted(glob.glob("/opt/nvidia/nsight-compute/*/ncu"))) if
             subprocess.run(["which", p], capture_output=True).returncode == 0 or Path(p).exists()]
    if not found:
        raise SystemExit("stall_sample.py needs Nsight Compute's ncu")
    return found[0]


def report_module(ncu: str) -> Any:
    """ncu's Python report interface (extras/python/ncu_report.py beside the ncu binary), or None."""
    real = Path(subprocess.run(["readlink", "-f", subprocess.run(["which", ncu], capture_output=True, text=True)
                                .stdout.strip() or ncu], capture_output=True, text=True).stdout.strip())
    for base in [real.parent, *map(Path, sorted(glob.glob("/opt/nvidia/nsight-compute/*")))]:
        extras = base / "extras" / "python"
        if (extras / "ncu_report.py").exists():
            sys.path.insert(0, str(extras))
            try:
                import ncu_report  # type: ignore[import-not-found]
                return ncu_report
            except Exception as err:  # noqa: BLE001
                print(f"ncu_report at {extras} did not load: {err}", file=sys.stderr)
    return None


def opcode(sass: str) -> str:
    """The opcode of a SASS line ("@!P0 LOP3.LUT R1, ..." -> "LOP3")."""
    words = [w for w in sass.replace(";", " ").split() if not w.startswith("@")]
    return words[0].split(".")[0] if words else "?"


def read_report(module: Any, path: Path, top: int) -> list[dict[str, Any]]:
    """Per kernel of the report: duration, samples by reason, the top instructions, samples by opcode, and every
    sampled instruction (`all_instructions`)."""
    ctx = module.load_report(str(path))
    kernels = []
    for r in range(ctx.num_ranges()):
        rng = ctx.range_by_idx(r)
        for a in range(rng.num_actions()):
            act = rng.action_by_idx(a)
            names = [n for n in act.metric_names() if n.startswith(PCSAMP)]
            row: dict[str, Any] = {"kernel": act.name(), "reasons": {}, "reasons_not_issued": {}}
            for m in ("gpu__time_duration.sum", "launch__registers_per_thread", "sm__warps_active.avg.pct_of_peak_"
                      "sustained_active", "dram__throughput.avg.pct_of_peak_sustained_elapsed",
                      "smsp__inst_executed.sum", "launch__occupancy_limit_registers", "smsp__pcsamp_sample_count"):
                metric = act.metric_by_name(m)
                if metric is not None:
                    row[m] = metric.as_double()
            per_pc: dict[int, dict[str, float]] = defaultdict(dict)
            for n in names:
                metric = act.metric_by_name(n)
                reason = n.removeprefix(PCSAMP)
                key = "reasons_not_issued" if reason.endswith("_not_issued") else "reasons"
                reason = reason.removesuffix("_not_issued")
                if metric.num_instances() and metric.has_correlation_ids():
                    pcs = metric.correlation_ids()
                    total = 0.0
                    for i in range(metric.num_instances()):
                        value = metric.as_double(i)
                        total += value
                        if key == "reasons" and value:
                            per_pc[pcs.as_uint64(i)][reason] = value
                    row[key][reason] = total
                else:
                    row[key][reason] = metric.as_double()
            rows = []
            for pc, reasons in per_pc.items():
                try:
                    sass = act.sass_by_pc(pc)
                except Exception:  # noqa: BLE001
                    sass = "?"
                rows.append({"pc": pc, "sass": sass, "samples": sum(reasons.values()),
                             "reasons": dict(sorted(reasons.items(), key=lambda kv: -kv[1]))})
            rows.sort(key=lambda x: -x["samples"])
            by_op: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
            for x in rows:
                for reason, value in x["reasons"].items():
                    by_op[opcode(x["sass"])][reason] += value
            row["by_opcode"] = dict(sorted(((op, dict(v)) for op, v in by_op.items()),
                                           key=lambda kv: -sum(kv[1].values())))
            row["instructions"] = rows[:top]
            row["all_instructions"] = [{"pc": x["pc"], "sass": x["sass"], "samples": x["samples"]} for x in rows]
            row["instructions_sampled"] = len(rows)
            row["reasons"] = dict(sorted(row["reasons"].items(), key=lambda kv: -kv[1]))
            kernels.append(row)
    return kernels


def csv_pages(ncu: str, path: Path) -> dict[str, str]:
    """The report's source page (SASS with its sampling columns) and raw page as CSV text (the fallback reading)."""
    pages = {}
    for page, extra in (("source", ["--print-source", "sass"]), ("raw", [])):
        res = subprocess.run([ncu, "--import", str(path), "--page", page, "--csv", *extra],
                             capture_output=True, text=True)
        pages[page] = res.stdout if res.returncode == 0 else f"error {res.returncode}: {res.stderr[-2000:]}"
    return pages


def csv_summary(text: str, top: int) -> list[dict[str, str]]:
    """The rows of a source-page CSV with the most stall samples (its column names as ncu writes them)."""
    rows = list(csv.DictReader(io.StringIO(text)))
    col = next((c for c in (rows[0] if rows else {}) if "Sampling (All" in c), None)
    if col is None:
        return rows[:top]

    def count(r: dict[str, str]) -> float:
        try:
            return float(r[col] or 0)
        except ValueError:
            return 0.0
    return sorted(rows, key=count, reverse=True)[:top]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", nargs=2, metavar=("IMPL", "TOKENS"), help=argparse.SUPPRESS)
    ap.add_argument("--read", nargs=2, metavar=("REPORT", "JSON"), help=argparse.SUPPRESS)
    ap.add_argument("--impls", default="fused_kvarn6,fused_kvarn4,fp16_sdpa")
    ap.add_argument("--contexts", default="32768,131072")
    ap.add_argument("--warm", type=int, default=5)
    ap.add_argument("--top", type=int, default=60, help="instructions kept per kernel")
    ap.add_argument("--reports", default="/tmp/stall_reports", help="where the .ncu-rep files go")
    ap.add_argument("--note", default="")
    ap.add_argument("--out", default="benchmarks/results/decode_stalls-h200.json")
    args = ap.parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]), args.warm)
        return
    ncu = ncu_binary()
    module = report_module(ncu)
    if args.read:
        report, out = args.read
        Path(out).write_text(json.dumps(read_report(module, Path(report), args.top)))
        return
    Path(args.reports).mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
    me = [sys.executable, str(Path(__file__).resolve())]
    cases = []
    for tokens in map(int, args.contexts.split(",")):
        for impl in args.impls.split(","):
            rep = Path(args.reports) / f"{impl}-{tokens}"
            case: dict[str, Any] = {"impl": impl, "context": tokens}
            cmd = [ncu, "--profile-from-start", "off", "--clock-control", "none",
                   "--section", "WarpStateStats",
                   "--section", "SourceCounters", "--section", "LaunchStats", "--section", "Occupancy",
                   "--section", "SpeedOfLight", "-f", "-o", str(rep),
                   *me, "--child", impl, str(tokens), "--warm", str(args.warm)]
            t0 = time.perf_counter()
            res = subprocess.run(cmd, capture_output=True, text=True, env=env)
            case["seconds"] = round(time.perf_counter() - t0, 1)
            path = rep.with_suffix(".ncu-rep")
            if res.returncode or not path.exists():
                case["error"] = (res.stdout[-1500:] + res.stderr[-2500:]).strip()
            else:
                try:  # read in a process of its own: a crash of the reader loses one case, not the run
                    if module is None:
                        raise RuntimeError("no ncu_report module")
                    out = rep.with_suffix(".json")
                    rd = subprocess.run([*me, "--read", str(path), str(out), "--top", str(args.top)],
                                        capture_output=True, text=True, env=env)
                    if rd.returncode or not out.exists():
                        raise RuntimeError(f"reader exit {rd.returncode}: {rd.stderr[-1500:]}")
                    case["kernels"] = json.loads(out.read_text())
                    for k in case["kernels"]:  # every sampled instruction, for a reading by offset elsewhere
                        (Path(args.reports) / f"{impl}-{tokens}-{k['kernel'][:60]}.pcs.json").write_text(
                            json.dumps(k.pop("all_instructions")))
                except Exception as err:  # noqa: BLE001
                    case["report_error"] = f"{type(err).__name__}: {err}"
                    pages = csv_pages(ncu, path)
                    case["source_top"] = csv_summary(pages["source"], args.top)
                    case["raw"] = list(csv.DictReader(io.StringIO(pages["raw"])))[:8]
            cases.append(case)
            brief = case.get("error", "")[-300:] or "; ".join(
                f"{k['kernel'][:40]} {k.get('gpu__time_duration.sum', 0) / 1e3:.1f} us "
                + ", ".join(f"{r} {v:.0f}" for r, v in list(k["reasons"].items())[:5]) for k in case.get("kernels", []))
            print(f"{impl} {tokens}: {brief or case.get('report_error')}", flush=True)
            write(args, cases)
    write(args, cases)


def write(args: argparse.Namespace, cases: list[dict[str, Any]]) -> None:
    """The JSON, after every case. This process does not import MLX: on the H200 at a8933d7 the process ended
    without a message after reading its first case, before writing; importing MLX after ncu's report module had
    loaded is the suspected cause (not confirmed)."""
    commit = os.environ.get("GMLX_COMMIT", "unknown")
    result = {"mlx": version("mlx"), "commit": commit, "kernel_settings": "the defaults (kernels/config.py), "
              "except the _ring_on / _ring_off rows",
              "shape": {"q_heads": 32, "kv_heads": 8, "head_dim": 128, "query_tokens": 1},
              "method": re.sub(r"\s+", " ", __doc__.split("\n\n")[2]), "note": args.note, "cases": cases}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
