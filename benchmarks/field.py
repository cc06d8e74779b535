"""The field side by side (issue 29), in restartable pieces: one JSON per piece under benchmarks/results/field/.

    python benchmarks/field.py --plan                       # every piece, and where each one is done
    python benchmarks/field.py --piece teaching-llama.default.1k.fidelity.kvarn
    python benchmarks/field.py --all --models teaching-llama --kinds fidelity
    python benchmarks/field.py --all --seconds 480          # start no piece after 480 s
    python benchmarks/field.py --report                     # -> results/field-<machine>.json, a Markdown table

A piece is one model, one layer policy (default, all), one length (1K, 4K), one kind (fidelity, passkey) and one
scheme family (gmlx_lab.measure.field). A piece done on any machine is skipped (--force runs it again); its file
is named by the machine that made it (`<piece>-<machine>.json`). Specs whose scheme is not registered yet are
listed by --plan and run once they are. --report writes one file per machine that made pieces, with the device,
the versions and a Markdown table of every scheme.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
import traceback
from importlib.metadata import version
from pathlib import Path
from typing import Any

from mlx.utils import tree_flatten

from gmlx_lab.cli import EVAL_TEXT, encode, load_model
from gmlx_lab.doctor import machine_tag
from gmlx_lab.measure.field import (
    CASES,
    DECODE,
    FIELD_SPECS,
    KINDS,
    PASSKEY_DEPTHS,
    PASSKEY_KEYS,
    field_rows,
    pieces,
    run_piece,
)

RESULTS = Path(__file__).resolve().parent / "results"
PIECES = RESULTS / "field"

METHOD = (f"fidelity: the bundled evaluation text, prefill length - {DECODE} tokens (chunks of 2048) through the "
          f"scheme's cache, then {DECODE} tokens one at a time; decode median KL(fp16 || scheme) in nats, top-1 "
          "agreement with fp16 and decode perplexity against the same fp16 run. passkey: a 5-digit key in filler "
          f"text at {len(PASSKEY_DEPTHS)} depths x {PASSKEY_KEYS} keys = {len(PASSKEY_DEPTHS) * PASSKEY_KEYS} "
          "prompts of the case's length, the context prefilled once in fp16 and stored by each scheme "
          "(experiments.stored_prefix), the question fed and 7 tokens decoded greedily; Wilson 95% intervals. "
          "bytes per token: the scheme's byte formula at the case's length (sink and tail included; layers the "
          "policy keeps fp16 count as fp16).")


def machine() -> dict[str, Any]:
    """Where a piece was measured: the backend's device and the versions."""
    import mlx.core as mx

    info = mx.device_info() if hasattr(mx, "device_info") else {}
    return {"tag": machine_tag(), "device": str(mx.default_device()), "device_name": info.get("device_name", ""),
            "platform": platform.platform(), "cpu_count": os.cpu_count(), "python": platform.python_version(),
            "mlx": version("mlx"), "mlx_lm": version("mlx-lm"), "load_average": os.getloadavg()}


def done() -> dict[str, dict[str, Path]]:
    """The piece files written so far: {piece name: {machine tag: file}}."""
    out: dict[str, dict[str, Path]] = {}
    for path in sorted(PIECES.glob("*.json")):
        piece = json.loads(path.read_text())
        out.setdefault(piece["piece"], {})[piece["machine"]["tag"]] = path
    return out


def current(path: Path) -> bool:
    """Whether a piece file is as the plan now asks: a passkey piece with fewer keys per cell is not."""
    piece = json.loads(path.read_text())
    return piece["kind"] != "passkey" or piece["result"]["keys_per_cell"] >= PASSKEY_KEYS


def plan() -> str:
    """Every piece of the plan with the machines that made it, and the specs still unregistered."""
    todo, missing = pieces()
    made = done()
    lines = [f"{'piece':58s} done on"]
    for p in todo:
        where = ", ".join(tag if current(path) else f"{tag} (fewer keys)"
                          for tag, path in made.get(p.name, {}).items()) or "-"
        lines.append(f"{p.name:58s} {where}")
    finished = sum(any(current(path) for path in made.get(p.name, {}).values()) for p in todo)
    lines.append(f"{finished} of {len(todo)} pieces done")
    if missing:
        lines.append("not registered here yet (no piece): " + ", ".join(missing))
    return "\n".join(lines)


def run(names: list[str], force: bool, seconds: float | None, argv: list[str]) -> int:
    """Run the named pieces (grouped by model: each model loads once); skip the done ones unless forced."""
    todo, _ = pieces()
    by_name = {p.name: p for p in todo}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise SystemExit(f"unknown piece(s) {unknown}; see --plan")
    made = {name for name, paths in done().items() if any(current(path) for path in paths.values())}
    chosen = [by_name[n] for n in names if force or n not in made]
    start = time.perf_counter()
    PIECES.mkdir(parents=True, exist_ok=True)
    loaded: dict[str, Any] = {}
    failed: list[str] = []
    for piece in chosen:
        if seconds is not None and time.perf_counter() - start > seconds:
            print(f"stopping: {seconds:.0f} s spent; {piece.name} and later pieces not started", flush=True)
            break
        model_name = piece.case.model
        if model_name not in loaded:
            loaded.clear()  # one model in memory at a time
            model, tokenizer = load_model(model_name)
            loaded[model_name] = (model, tokenizer, encode(tokenizer, model, EVAL_TEXT.read_text(encoding="utf-8")))
        model, tokenizer, tokens = loaded[model_name]
        t0 = time.perf_counter()
        try:
            body = run_piece(piece, model, tokenizer, tokens)
        except Exception:  # one scheme failing on this machine leaves its piece undone, the others still run
            traceback.print_exc()
            print(f"{piece.name}: FAILED, not written (--plan shows it undone)", flush=True)
            failed.append(piece.name)
            continue
        tag = machine_tag()
        dtype = str(next(iter(dict(tree_flatten(model.parameters())).values())).dtype)
        out = {"command": " ".join(["field.py", *argv]), "method": METHOD,
               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "machine": {**machine(), "compute_dtype": dtype}, **body}
        path = PIECES / f"{piece.name}-{tag}.json"
        path.write_text(json.dumps(out, indent=1) + "\n")
        print(f"{piece.name}: {time.perf_counter() - t0:.0f} s -> {path.name}", flush=True)
    if failed:
        print(f"{len(failed)} piece(s) failed: {', '.join(failed)}", flush=True)
    return 1 if failed else 0


def _kl(x: float) -> str:
    return "0" if x == 0 else f"{x:.2g}"


def markdown(rows: list[dict[str, Any]]) -> str:
    """One table: a row per scheme, a column per case (decode median KL, top-1, passkey hits of those asked)."""
    cases = sorted({(r["model"], r["policy"], r["length"]) for r in rows}, key=lambda c: (c[0] != "gemma3-270m", c))
    specs = [s for s in FIELD_SPECS if any(r["spec"] == s for r in rows)]
    head = "| scheme | " + " | ".join(f"{m} {p} {n // 1024}K" for m, p, n in cases) + " |"
    lines = [head, "|---|" + "---|" * len(cases)]
    for spec in specs:
        cells = []
        for case in cases:
            got = {r["kind"]: r for r in rows if (r["model"], r["policy"], r["length"]) == case and r["spec"] == spec}
            parts = []
            if "fidelity" in got:
                f = got["fidelity"]
                parts.append(f"{f['bytes_per_token'] / f['fp16_bytes_per_token']:.0%} · KL {_kl(f['decode_median_kl'])}"
                             f" · top-1 {f['top1']:.0%}")
            if "passkey" in got:
                parts.append(f"key {got['passkey']['hits']}/{got['passkey']['asked']}")
            cells.append(" · ".join(parts) or "-")
        label = next(r["label"] for r in rows if r["spec"] == spec)
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + ("\n\nEach cell: cache bytes per token as a share of fp16's (the scheme's byte formula "
                               "at that length) · decode median KL(fp16 || scheme) in nats · top-1 agreement with fp16 "
                               "· passkey keys retrieved.")


def report() -> int:
    """Assemble every piece into one file per machine that made pieces, and print the table of all of them."""
    by_machine: dict[str, dict[str, Any]] = {}
    for name, paths in done().items():
        for tag, path in paths.items():
            piece = json.loads(path.read_text())
            piece.pop("result")  # the full measurement stays in the piece's own file; the report keeps the rows
            by_machine.setdefault(tag, {})[name] = piece
    if not by_machine:
        raise SystemExit(f"no pieces under {PIECES}; run some first (--plan lists them)")
    reports = {}
    for tag, found in sorted(by_machine.items()):
        rows = field_rows([{"pieces": found}])
        machines = {json.dumps(p["machine"]["device_name"] or p["machine"]["device"]) for p in found.values()}
        reports[tag] = {"machine": tag, "devices": sorted(json.loads(m) for m in machines),
                        "versions": sorted({f"mlx {p['machine']['mlx']}, mlx-lm {p['machine']['mlx_lm']}"
                                            for p in found.values()}),
                        "method": METHOD, "pieces": found, "markdown": markdown(rows)}
        path = RESULTS / f"field-{tag}.json"
        path.write_text(json.dumps(reports[tag], indent=1) + "\n")
        print(f"wrote {path} ({len(found)} pieces)")
    print(markdown(field_rows(reports.values())))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--plan", action="store_true", help="list the pieces and which are done")
    what.add_argument("--piece", action="append", help="run this piece (repeatable)")
    what.add_argument("--all", action="store_true", help="run every piece not done yet")
    what.add_argument("--report", action="store_true", help="assemble results/field-<machine>.json")
    parser.add_argument("--models", default="", help="with --all: only these models (comma-separated)")
    parser.add_argument("--kinds", default="", help=f"with --all: only these kinds ({', '.join(KINDS)})")
    parser.add_argument("--policies", default="", help="with --all: only these layer policies (default,all)")
    parser.add_argument("--lengths", default="", help="with --all: only these lengths in tokens (1024,4096)")
    parser.add_argument("--force", action="store_true", help="run pieces already done again")
    parser.add_argument("--seconds", type=float, default=None, help="start no piece after this many seconds")
    args = parser.parse_args(argv)
    if args.plan:
        print(plan())
        return 0
    if args.report:
        return report()
    if args.piece:
        return run(args.piece, args.force, args.seconds, argv)
    models = {m for m in args.models.split(",") if m} or {c.model for c in CASES}
    kinds = {k for k in args.kinds.split(",") if k} or set(KINDS)
    policies = {p for p in args.policies.split(",") if p} or {c.policy for c in CASES}
    lengths = {int(n) for n in args.lengths.split(",") if n} or {c.length for c in CASES}
    todo, _ = pieces()
    names = [p.name for p in todo if p.case.model in models and p.kind in kinds and p.case.length in lengths
             and p.case.policy in policies]
    return run(names, args.force, args.seconds, argv)


if __name__ == "__main__":
    sys.exit(main())
