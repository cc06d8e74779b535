"""Per-layer plans against uniform widths at equal memory (issue 46; gmlx_lab.measure.planner).

    python benchmarks/plan.py --model gemma3-270m --context 4096 --schemes kvarn:tail=128,affine
    python benchmarks/plan.py --model teaching-llama --context 2048 --schemes kvarn:tail=128,affine

For each scheme: the sensitivity probes on the calibration windows (every fourth of the model's eight passage
windows), then on the six others, by the verdict's method (tokens decoded one at a time): fp16, each uniform width,
and at each uniform width's bytes the plan with the least predicted KL (for kvarn also the plan with one width for
K and V a layer: what the split itself buys). Every layer the scheme can take is in play
(`quantize_last`: the policy's last-of-stack rule is the plan's to make). Writes
benchmarks/results/plan-<model>-<machine>.json, one entry a scheme spec (its options but the widths:
"kvarn:tail=128"; a run replaces its specs' entries only).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

from verdict import commit, machine

from gmlx_lab.cli import load_model, scheme_list
from gmlx_lab.doctor import machine_tag
from gmlx_lab.measure.planner import EVAL_DECODE, PROBE_DECODE, evaluate, sensitivity, split_windows
from gmlx_lab.specs import read_scheme_spec

RESULTS = Path(__file__).resolve().parent / "results"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--schemes", default="kvarn:tail=128,affine")
    parser.add_argument("--probe-decode", type=int, default=PROBE_DECODE)
    parser.add_argument("--decode", type=int, default=EVAL_DECODE)
    args = parser.parse_args(argv)
    model, tokenizer = load_model(args.model)
    name = getattr(model, "gmlx_name", None) or args.model
    out = RESULTS / f"plan-{name}-{machine_tag()}.json"
    data = json.loads(out.read_text()) if out.exists() else {"model": name, "schemes": {}}
    ran = commit()  # the tree that runs, read before the run (files may change while it runs)
    for spec in scheme_list(args.schemes):
        scheme, options = read_scheme_spec(spec)
        start = time.perf_counter()
        sens = sensitivity(model, tokenizer, scheme, args.context, decode=args.probe_decode, name=name,
                           quantize_last=True, progress=True, **options)
        print(f"{spec}: sensitivity in {sens.seconds:.0f} s", flush=True)
        rows, plans = evaluate(model, tokenizer, sens, decode=args.decode, progress=True)
        data["schemes"][spec] = {
            "command": "python benchmarks/" + " ".join([Path(__file__).name, *sys.argv[1:]]), "commit": ran,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": machine(), "seconds": round(time.perf_counter() - start, 1),
            "evaluation": {"decode": args.decode, "windows": len(rows[0].per_passage["mean_kl"]),
                           "names": [w.name for w in split_windows(name, tokenizer, args.context + args.decode + 1)[1]],
                           "method": "banded_fidelity's method at one context on the windows the probes did not "
                                     "read: tokens decoded one at a time, teacher-forced; per window mean KL; 95% "
                                     "percentile-bootstrap intervals over windows"},
            "sensitivity": sens.to_dict(),
            "rows": [r.to_dict() for r in rows],
            "plans": [p.to_dict() for p in plans],
        }
        out.write_text(json.dumps(data, indent=1) + "\n")
        print(f"wrote {out}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
