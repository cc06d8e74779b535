"""Memory truth on one model: resident cache bytes by scheme and region, and peak memory during prefill.

    python benchmarks/prefill_memory.py                  # teaching-llama, 4096 tokens
    python benchmarks/prefill_memory.py --context 8192 --steps 256,512,1024,2048,4096
    python benchmarks/prefill_memory.py --model gemma3-270m --context 1024 --peak-schemes "" \\
        --schemes fp16,affine4,kvarn4:tail=128 --policies "default;last;last+sliding"

Peak memory is MLX's own counter (mx.reset_peak_memory / mx.get_peak_memory), which
the CPU backend keeps too; `above_start` leaves out what was allocated before the
prefill (the weights). Writes benchmarks/results/memory-<model>-<machine>.json. --policies: as in fidelity_sweep.py
(each scheme under gmlx's rule and under overrides such as last+sliding).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

from fidelity_sweep import RESULTS, machine, parse_policy

from gmlx_lab.cli import MEMORY_SCHEMES, load_model, scheme_list
from gmlx_lab.doctor import machine_tag
from gmlx_lab.measure.memory import memory_report, prefill_peak
from gmlx_lab.policy import policy
from gmlx_lab.registry import BASELINE
from gmlx_lab.specs import parse_scheme_spec


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="default: the bundled teaching-llama")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--schemes", default=MEMORY_SCHEMES)
    parser.add_argument("--peak-schemes", default="fp16,affine4,kvarn6", help="'' for no peak measurement")
    parser.add_argument("--policies", default="default", help="';'-separated: default, or overrides such as "
                                                                "last+sliding (see fidelity_sweep.py)")
    parser.add_argument("--steps", default="256,512,1024,2048,4096", help="prefill step sizes")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    steps = [int(s) for s in args.steps.split(",")]
    model, _ = load_model(args.model)

    runs = []
    for variant in (v for v in args.policies.split(";") if v.strip()):
        overrides = parse_policy(variant)
        for spec in scheme_list(args.schemes):
            scheme, options = parse_scheme_spec(spec)
            if overrides and scheme == BASELINE:
                continue  # overrides do not apply to the baseline
            runs.append(policy(model, scheme, **overrides, **options) if overrides else spec)
    report = memory_report(model, runs, context=args.context)
    print(report.to_markdown())
    peaks = []
    from tqdm import tqdm

    peak_specs = scheme_list(args.peak_schemes) if args.peak_schemes.strip() else []
    for spec in tqdm(peak_specs, desc="prefill peak", file=sys.stderr):
        peaks += prefill_peak(model, spec, context=args.context, steps=steps)
    print("\n| scheme | step | peak MiB | above start MiB | cache MiB | s |\n|---|---|---|---|---|---|")
    for p in peaks:
        print(f"| {p['scheme']} | {p['step']} | {p['peak'] / 2**20:.1f} | {p['above_start'] / 2**20:.1f} "
              f"| {p['cache_bytes'] / 2**20:.2f} | {p['seconds']} |")
    name = args.out or f"memory-{report.model}-{machine_tag()}.json"
    out = {"command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "machine": machine(), "policies": args.policies, "markdown": report.to_markdown(),
           "resident": report.to_dict(),
           "prefill_peak": peaks}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / name).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {RESULTS / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
