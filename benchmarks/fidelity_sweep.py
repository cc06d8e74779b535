"""Fidelity sweeps on one model, written to benchmarks/results/*.json (with a markdown table).

    python benchmarks/fidelity_sweep.py                                   # teaching-llama, all sweeps
    python benchmarks/fidelity_sweep.py --prefill 4000 --sweeps none \\
        --schemes affine2,affine4,affine8,kvarn2,kvarn4,kvarn6 --out fidelity-teaching-llama-4k-cpu.json
    python benchmarks/fidelity_sweep.py --model smollm2-135m --sweeps none \\
        --schemes fp16,affine2,affine3,affine4,affine6,affine8 --layer-schemes "" --out fidelity-smollm2-135m-cpu.json
    python benchmarks/fidelity_sweep.py --model gemma3-270m --sweeps none --layer-schemes "" --prefill 1024 \\
        --decode 64 --schemes affine4,kvarn4:tail=128 --policies "default;last;last+sliding"

Sweeps (gmlx_lab.measure.fidelity.SWEEPS): widths (fp16, affine 2-8, kvarn 2-8 at tails 0 and
128), tails, split (kvarn k8v4 vs k4v8), ladder (affine -> affine_rot -> kvarn at equal
width); --layer-schemes adds one-layer-at-a-time sensitivity runs. Every run shares
one fp16 reference. --policies runs every scheme under each listed policy: "default" (gmlx's rule) or
overrides joined by "+": last (quantize the last of a deep stack), sliding (sliding-window layers too),
layers=5/11 (only these layers), fp16=3/4 (keep these fp16); see gmlx_lab.policy.Overrides.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

from gmlx_lab.cli import EVAL_TEXT, encode, load_model, scheme_list
from gmlx_lab.doctor import machine_tag
from gmlx_lab.measure.fidelity import SWEEPS, FidelityResult, fidelity, single_layer_policy
from gmlx_lab.policy import policy
from gmlx_lab.registry import BASELINE
from gmlx_lab.specs import parse_scheme_spec as parse
from gmlx_lab.specs import scheme_label

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> dict[str, Any]:
    """Where the numbers were measured."""
    return {"platform": platform.platform(), "machine": platform.machine(), "cpu_count": os.cpu_count(),
            "python": platform.python_version(), "mlx": version("mlx"), "mlx_lm": version("mlx-lm"),
            "blas_preload": os.environ.get("LD_PRELOAD", "")}


def expected_checks(result: FidelityResult) -> list[dict[str, Any]]:
    """The issue's expected results: kvarn vs affine at equal width, kvarn6 vs affine8, kvarn6 top-1."""
    rows = {s.label: s for s in result.schemes}
    checks = []
    for tail in (0, 128, 1024):
        for b in (2, 3, 4):
            k, a = rows.get(f"kvarn{b} tail={tail}"), rows.get(f"affine{b} g64")
            if k and a:
                checks.append({"check": f"kvarn{b} tail={tail} decode median KL <= 1/3 of affine{b}",
                               "kvarn": k.decode_median_kl, "affine": a.decode_median_kl,
                               "ratio": k.decode_median_kl / max(a.decode_median_kl, 1e-12),
                               "pass": k.decode_median_kl <= a.decode_median_kl / 3})
        k6, a8 = rows.get(f"kvarn6 tail={tail}"), rows.get("affine8 g64")
        if k6 and a8:
            checks.append({"check": f"kvarn6 tail={tail} decode median KL <= affine8",
                           "kvarn": k6.decode_median_kl, "affine": a8.decode_median_kl,
                           "pass": k6.decode_median_kl <= a8.decode_median_kl})
        if k6:
            checks.append({"check": f"kvarn6 tail={tail} decode top-1 >= 98%", "top1": k6.top1,
                           "pass": k6.top1 >= 0.98})
    return checks


def parse_policy(text: str) -> dict[str, Any]:
    """One --policies entry as `policy()` override arguments: "default", or "last+sliding+layers=5/11+fp16=3"."""
    text = text.strip()
    if text == "default":
        return {}
    out: dict[str, Any] = {}
    for part in (p.strip() for p in text.split("+")):
        key, _, value = part.partition("=")
        if part == "last":
            out["quantize_last"] = True
        elif part == "sliding":
            out["quantize_sliding"] = True
        elif key in ("layers", "fp16") and value:
            try:
                out["layers" if key == "layers" else "fp16_layers"] = [int(v) for v in value.split("/")]
            except ValueError:
                raise ValueError(f"--policies: {part!r} needs layer indices such as {key}=5/11") from None
        else:
            raise ValueError(f"--policies: cannot read {part!r} in {text!r}; accepted: default, or last, sliding, "
                             "layers=5/11, fp16=3 joined by '+'")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="default: the bundled teaching-llama")
    parser.add_argument("--text-file", default=str(EVAL_TEXT))
    parser.add_argument("--prefill", type=int, default=1400)
    parser.add_argument("--decode", type=int, default=128)
    parser.add_argument("--prefill-step", type=int, default=2048)
    parser.add_argument("--sweeps", default="widths,ladder,split", help="comma-separated names or 'none'")
    parser.add_argument("--schemes", default="", help="extra comma-separated specs")
    parser.add_argument("--layer-schemes", default="kvarn4:tail=0,affine4",
                        help="specs for one-layer-at-a-time sensitivity runs ('' for none)")
    parser.add_argument("--out", default=None, help="file under benchmarks/results/ (default: model and machine)")
    parser.add_argument("--note", default="", help="a caveat stored with the results")
    parser.add_argument("--policies", default="default",
                        help="';'-separated policies each scheme runs under: default, or overrides such as "
                             "last+sliding, layers=5/11, fp16=3 (default: default)")
    args = parser.parse_args(argv)

    specs: list[str] = []
    sections: dict[str, list[str]] = {}
    for name in [s for s in args.sweeps.split(",") if s and s != "none"]:
        if name not in SWEEPS:
            parser.error(f"unknown sweep {name!r}; accepted: {', '.join(SWEEPS)}")
        sections[name] = [scheme_label(*parse(s)) for s in SWEEPS[name]]
        specs += SWEEPS[name]
    extra = scheme_list(args.schemes) if args.schemes.strip() else []
    if extra:
        sections["schemes"] = [scheme_label(*parse(s)) for s in extra]
    specs += extra
    unique, seen = [], set()
    for spec in specs:  # one run per distinct scheme, whatever sweeps list it
        label = scheme_label(*parse(spec))
        if label not in seen:
            seen.add(label)
            unique.append(spec)
    variants = [(v.strip(), parse_policy(v)) for v in args.policies.split(";") if v.strip()]
    model, tokenizer = load_model(args.model)
    runs: list[Any] = []  # spec strings (the default policy) and Policy objects (overridden)
    labels: dict[str, list[str]] = {}
    for variant, overrides in variants:
        for spec in unique:
            scheme, options = parse(spec)
            chosen = policy(model, scheme, **overrides, **options)
            if chosen.scheme == BASELINE and overrides:
                continue  # overrides do not apply to the baseline
            runs.append(spec if not overrides else chosen)
            labels.setdefault(variant, []).append(chosen.label)
    if len(variants) > 1 or variants[0][1]:
        sections.update({f"policy {v}": ls for v, ls in labels.items()})
    layer_specs = scheme_list(args.layer_schemes) if args.layer_schemes.strip() else []
    probes, probe_labels = [], []
    for spec in layer_specs:
        scheme, options = parse(spec)
        base = scheme_label(scheme, options)
        layers = [d.index for d in policy(model, scheme, **options).layers if d.grows]
        labels = [f"{base} only layer {i}" for i in layers]
        probes += [single_layer_policy(model, spec, i) for i in layers]
        probe_labels += labels
        sections[f"layers {base}"] = labels

    tokens = encode(tokenizer, model, Path(args.text_file).read_text(encoding="utf-8"))
    t0 = time.perf_counter()
    result = fidelity(model, tokenizer, tokens, runs + probes, prefill=args.prefill, decode=args.decode,
                      prefill_step=args.prefill_step, progress=True)
    for s, label in zip(result.schemes[len(runs):], probe_labels):
        s.label = label
    seconds = time.perf_counter() - t0
    checks = expected_checks(result)
    name = args.out or f"fidelity-{result.model}-{machine_tag()}.json"
    out = {
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(), "seconds": round(seconds, 1), "text_file": Path(args.text_file).name,
        "note": args.note, "policies": {v: o for v, o in variants},
        "sections": sections, "expected_checks": checks, "markdown": result.to_markdown(),
        "schemes": [s.summary() for s in result.schemes],  # one flat row per scheme
        "result": result.to_dict(per_position=False),
    }
    for s, d in zip(result.schemes, out["result"]["schemes"]):
        d["decode_kl"] = s.decode_kl  # per-position decode KL for plots (prefill KL left out: too long)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / name).write_text(json.dumps(out, indent=1) + "\n")
    print(result.to_markdown())
    for c in checks:
        print(("PASS " if c["pass"] else "FAIL ") + c["check"], {k: v for k, v in c.items() if k not in ("check",
                                                                                                         "pass")})
    print(f"wrote {RESULTS / name} ({seconds:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
