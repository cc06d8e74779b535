"""Fidelity with noise bands for notebook 12 ("which scheme when"): every built-in scheme, several contexts.

    python benchmarks/verdict.py --model gemma3-270m --contexts 1024,4096,8192
    python benchmarks/verdict.py --model gemma3-270m --contexts 2048          # adds to the same file
    python benchmarks/verdict.py --model teaching-llama --contexts 512,2048 --schemes affine4,kvarn4
    python benchmarks/verdict.py --model gemma3-270m --contexts 4096,8192 --missing   # go on after a stop
    python benchmarks/verdict.py --model smollm2-135m --contexts 1024,2048,4096,7680 --kvarn-ext --jobs 8   # a GPU

`--jobs N` splits the rows over N processes (a context's schemes in slices; each process prefills its own fp16
reference), which is how a GPU that one process leaves mostly idle (small models are bound by Python and kernel
launches) measures a sweep in a fraction of the time. Each process writes its own part file beside the results
file; the parent merges them into it every few seconds and when it stops (also on SIGTERM), so a run cut off by
a time limit keeps every finished row. The rows do not depend on how they were split.

Method (gmlx_lab.measure.banded): 8 passage windows (gmlx_lab.measure.passages) run as one batch; at each
context the fp16 cache prefills the window, each scheme stores what it held (the same K/V for every scheme),
then 256 tokens are decoded one at a time, teacher-forced. Per passage: mean and median KL(fp16 || scheme),
top-1 agreement, NLL; 95% percentile-bootstrap intervals over passages. Rows are written as they are made
to benchmarks/results/verdict-<model>-<machine>.json, keyed by (context, spec): a run adds to or replaces
rows of the file, never others.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

from gmlx_lab.cli import load_model, scheme_list
from gmlx_lab.doctor import machine_tag
from gmlx_lab.measure.banded import VERDICT_SPECS, Row, banded_fidelity

RESULTS = Path(__file__).resolve().parent / "results"
METHOD = ("banded_fidelity: {count} passage windows as one batch; at each context the fp16 cache prefills "
          "(chunks of 2048), each scheme's cache stores what it held (experiments.stored_prefix), then {decode} "
          "tokens are decoded one at a time, teacher-forced, through each cache; per passage mean and median "
          "KL(fp16 || scheme) in nats, top-1 agreement with fp16 and mean NLL of the text; 95% percentile-bootstrap "
          "intervals over passages (10,000 draws, seed 0). bytes: the byte formulas at the context, layers the "
          "policy keeps fp16 counted as fp16.")


def machine() -> dict[str, Any]:
    """Where the rows were measured."""
    return {"tag": machine_tag(), "platform": platform.platform(), "cpu_count": os.cpu_count(),
            "python": platform.python_version(), "mlx": version("mlx"), "mlx_lm": version("mlx-lm"),
            "blas_preload": os.environ.get("LD_PRELOAD", "")}


def command(argv: list[str]) -> str:
    """The command a run records: the one a person typed (a `--jobs` process records its parent's), its `--out`
    written relative to the repository, so no results file names a path outside it."""
    if os.environ.get("GMLX_RUN_COMMAND"):
        return os.environ["GMLX_RUN_COMMAND"]
    words = list(argv)
    for i, word in enumerate(words[:-1]):
        if word == "--out":
            path = Path(words[i + 1]).resolve()
            root = RESULTS.parent.parent
            words[i + 1] = str(path.relative_to(root)) if path.is_relative_to(root) else path.name
    return "python benchmarks/" + " ".join([Path(__file__).name, *words])


def commit() -> str:
    """The tree that ran: GMLX_COMMIT where set (a copy of the tree without its .git, as on a GPU machine), else
    HEAD's short hash, with "-dirty" where tracked files other than results differed from it."""
    if os.environ.get("GMLX_COMMIT"):
        return os.environ["GMLX_COMMIT"]
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=Path(__file__).parent,
                              check=True).stdout.strip()

    try:
        dirty = git("status", "--porcelain", "--untracked-files=no", "--", ":/", ":(exclude,top)benchmarks/results")
        return git("rev-parse", "--short", "HEAD") + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def with_ext(spec: str) -> str:
    """A kvarn spec with the head-dim extension on (models whose heads are 64 or 96 wide, e.g. SmolLM2)."""
    if not spec.startswith("kvarn") or "ext=" in spec:
        return spec
    return spec + ("," if ":" in spec else ":") + "ext=1"


def todo(data: dict[str, Any], specs: list[str], contexts: list[int], missing: bool) -> dict[int, list[str]]:
    """The (context -> specs) still to measure: all asked for, or with `missing` those the file lacks."""
    have = {(r["context"], r["spec"]) for r in data["rows"]} if missing else set()
    return {c: [s for s in specs if (c, s) not in have] for c in contexts}


def slices(work: dict[int, list[str]], jobs: int) -> list[tuple[int, list[str]]]:
    """Split the work into about `jobs` (context, specs) slices, more slices for the longer contexts (the cost of
    a row grows with its context), each slice of one context."""
    work = {c: s for c, s in work.items() if s}
    if not work:
        return []
    weight = {c: c * len(s) for c, s in work.items()}
    total = sum(weight.values())
    out = []
    for c, specs in work.items():
        n = max(1, min(len(specs), round(jobs * weight[c] / total)))
        out += [(c, specs[i::n]) for i in range(n)]
    return out


def merge(out: Path, base: dict[str, Any], parts: list[Path]) -> dict[str, Any]:
    """`base` (the results file as it was) with every part file's runs and rows, a row replacing one of the same
    (context, spec); written to `out`."""
    data = {**base, "rows": list(base["rows"]), "runs": list(base.get("runs", []))}
    for part in parts:
        if not part.is_file():
            continue
        try:
            found = json.loads(part.read_text())
        except json.JSONDecodeError:  # being written right now: the next merge reads it
            continue
        shift = len(data["runs"])
        data["runs"] += found.get("runs", [])
        new = {(r["context"], r["spec"]): {**r, "run": r["run"] + shift} for r in found["rows"]}
        data["rows"] = [r for r in data["rows"] if (r["context"], r["spec"]) not in new] + list(new.values())
    out.write_text(json.dumps(data, indent=1) + "\n")
    return data


def run_jobs(args: argparse.Namespace, out: Path, data: dict[str, Any], work: dict[int, list[str]]) -> int:
    """Measure `work` in `args.jobs` processes, merging their part files into `out` as they go."""
    pieces = slices(work, args.jobs)
    if not pieces:
        print(f"{out} already holds every row asked for; nothing measured")
        return 0
    parts = [out.with_name(f"{out.stem}.part{i}.json") for i in range(len(pieces))]
    for part in parts:
        part.unlink(missing_ok=True)
    procs = [subprocess.Popen([sys.executable, __file__, "--model", args.model, "--contexts", str(c),
                               "--decode", str(args.decode), "--count", str(args.count), "--schemes", ",".join(s),
                               "--out", str(part)] + (["--memory-gb", str(args.memory_gb)] if args.memory_gb else []),
                              env={**os.environ, "GMLX_RUN_COMMAND": command(sys.argv[1:])})
             for (c, s), part in zip(pieces, parts)]
    print(f"{len(procs)} processes: " + "; ".join(f"{c} tokens x {len(s)} schemes" for c, s in pieces), flush=True)

    def stop(signum: int, frame: Any) -> None:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:  # a process stuck in the GPU runtime does not answer SIGTERM
                p.kill()
        merge(out, data, parts)
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    while any(p.poll() is None for p in procs):
        time.sleep(10)
        merge(out, data, parts)
    merge(out, data, parts)
    for part in parts:
        part.unlink()
    failed = [i for i, p in enumerate(procs) if p.returncode]
    print(f"wrote {out}" + (f"; processes {failed} failed" if failed else ""))
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--contexts", default="1024,4096,8192")
    parser.add_argument("--decode", type=int, default=256)
    parser.add_argument("--count", type=int, default=8)
    parser.add_argument("--schemes", default=",".join(VERDICT_SPECS))
    parser.add_argument("--kvarn-ext", action="store_true",
                        help="kvarn specs with the head-dim extension (ext=1), for heads of 64 or 96 channels")
    parser.add_argument("--missing", action="store_true",
                        help="measure only the (context, scheme) rows the results file lacks (to go on after a stop)")
    parser.add_argument("--jobs", type=int, default=1, help="processes to split the rows over (see above)")
    parser.add_argument("--out", default=None, help="results file (default: verdict-<model>-<machine>.json)")
    parser.add_argument("--memory-gb", type=float, default=None,
                        help="MLX memory limit of each process (with --jobs, processes sharing one GPU must split it)")
    args = parser.parse_args(argv)
    if args.memory_gb:
        import mlx.core as mx

        mx.set_memory_limit(int(args.memory_gb * 2**30))
        mx.set_cache_limit(int(args.memory_gb * 2**28))
    specs = scheme_list(args.schemes)
    if args.kvarn_ext:
        specs = [with_ext(s) for s in specs]
        args.schemes = ",".join(specs)
    contexts = [int(c) for c in args.contexts.split(",")]
    if args.jobs < 1:
        raise SystemExit(f"--jobs is a number of processes, at least 1; got {args.jobs}")
    if args.jobs > 1:
        from gmlx_lab.models import load
        name = getattr(load(args.model)[0], "gmlx_name", None) or args.model  # converts the model once, here
        out = Path(args.out) if args.out else RESULTS / f"verdict-{name}-{machine_tag()}.json"
        data = json.loads(out.read_text()) if out.exists() else {"model": name, "rows": [], "runs": []}
        return run_jobs(args, out, data, todo(data, specs, contexts, args.missing))
    model, tokenizer = load_model(args.model)
    name = getattr(model, "gmlx_name", None) or args.model
    out = Path(args.out) if args.out else RESULTS / f"verdict-{name}-{machine_tag()}.json"
    data = json.loads(out.read_text()) if out.exists() else {"model": name, "rows": []}
    run = {"command": command(sys.argv[1:]), "commit": commit(),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "machine": machine(), "method": METHOD.format(count=args.count, decode=args.decode),
           "decode": args.decode, "count": args.count}
    runs = data.setdefault("runs", [])
    index = len(runs)  # this run's place in the list, once it has measured a row

    def keep(row: Row) -> None:
        if len(runs) == index:  # a run that measures nothing leaves the file as it was
            runs.append(run)
        item = {**row.to_dict(), "run": index}
        data["rows"] = [r for r in data["rows"] if (r["context"], r["spec"]) != (row.context, row.spec)] + [item]
        out.write_text(json.dumps(data, indent=1) + "\n")
        print(f"{row.context:>6} {row.label:<22} share {row.share:.3f} mean KL {row.interval('mean_kl').text()} "
              f"top-1 {row.interval('top1').text()} {row.seconds:.1f} s", flush=True)

    if not args.missing:  # one pass over the contexts: each prefill goes on from the last
        banded_fidelity(model, tokenizer, name, specs, contexts, args.decode, args.count, on_row=keep)
    for context, todo_specs in todo(data, specs, contexts, True).items() if args.missing else ():
        if todo_specs:  # one context at a time: each has its own missing rows
            banded_fidelity(model, tokenizer, name, todo_specs, [context], args.decode, args.count, on_row=keep)
    print(f"wrote {out}" if len(runs) > index else f"{out} already holds every row asked for; nothing measured")
    return 0


if __name__ == "__main__":
    sys.exit(main())
