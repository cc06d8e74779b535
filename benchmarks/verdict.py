"""Fidelity with noise bands for notebook 12 ("which scheme when"): every built-in scheme, several contexts.

    python benchmarks/verdict.py --model gemma3-270m --contexts 1024,4096,8192
    python benchmarks/verdict.py --model gemma3-270m --contexts 2048          # adds to the same file
    python benchmarks/verdict.py --model teaching-llama --contexts 512,2048 --schemes affine4,kvarn4
    python benchmarks/verdict.py --model gemma3-270m --contexts 4096,8192 --missing   # go on after a stop

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
import subprocess
import sys
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


def commit() -> str:
    """The tree that ran: HEAD's short hash, with "-dirty" where tracked files other than results differed from it."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=Path(__file__).parent,
                              check=True).stdout.strip()

    try:
        dirty = git("status", "--porcelain", "--untracked-files=no", "--", ":/", ":(exclude,top)benchmarks/results")
        return git("rev-parse", "--short", "HEAD") + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--contexts", default="1024,4096,8192")
    parser.add_argument("--decode", type=int, default=256)
    parser.add_argument("--count", type=int, default=8)
    parser.add_argument("--schemes", default=",".join(VERDICT_SPECS))
    parser.add_argument("--missing", action="store_true",
                        help="measure only the (context, scheme) rows the results file lacks (to go on after a stop)")
    args = parser.parse_args(argv)
    model, tokenizer = load_model(args.model)
    name = getattr(model, "gmlx_name", None) or args.model
    out = RESULTS / f"verdict-{name}-{machine_tag()}.json"
    data = json.loads(out.read_text()) if out.exists() else {"model": name, "rows": []}
    run = {"command": "python benchmarks/" + " ".join([Path(__file__).name, *sys.argv[1:]]), "commit": commit(),
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

    specs, contexts = scheme_list(args.schemes), [int(c) for c in args.contexts.split(",")]
    if not args.missing:
        banded_fidelity(model, tokenizer, name, specs, contexts, args.decode, args.count, on_row=keep)
    for context in contexts if args.missing else []:  # one context at a time: each has its own missing rows
        have = {r["spec"] for r in data["rows"] if r["context"] == context}
        todo = [s for s in specs if s not in have]
        if todo:
            banded_fidelity(model, tokenizer, name, todo, [context], args.decode, args.count, on_row=keep)
    print(f"wrote {out}" if len(runs) > index else f"{out} already holds every row asked for; nothing measured")
    return 0


if __name__ == "__main__":
    sys.exit(main())
