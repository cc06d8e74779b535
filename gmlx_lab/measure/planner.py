"""Your model's plan: per-layer K and V widths under a memory budget, from each layer's measured sensitivity.

    sens = sensitivity(model, tokenizer, "kvarn", context=4096, quantize_last=True)   # the probes (minutes)
    plan = choose(sens, budget=0.5)           # the widths with the least predicted KL in 50% of fp16's bytes
    cache = make_cache(model, plan=plan)      # or plan.save("plan.json"); make_cache(model, plan="plan.json")

Sensitivity: for each layer the policy quantizes and each width the scheme accepts, the mean KL(fp16 || probe)
over the calibration windows when only that layer is stored at that width, every other layer fp16. A scheme that
stores K and V at separate widths is probed for each apart: K at the width with V at the widest, then V likewise.
The probes store the fp16 prefix (`stored_prefix`) and read it back with a block of decode tokens fed as one update
(`banded.policy_metrics(block=True)`): they rank layers, the evaluation measures.

Search: exact, not greedy. Each layer's choices (every width pair, or fp16) have a byte count (the scheme's
formula at the context) and a predicted KL (the sum of the layer's K and V parts above the widest pair's, plus
that); the plan's predicted KL is the sum over layers. The Pareto frontier of (bytes, predicted KL) is merged layer
by layer, keeping only points no other point beats on both: a few layers with a few dozen choices keep it small,
it is exact under the additive model (greedy on KL per byte can stop short where a width's gain is not convex),
and it gives the plan for every budget at once (the notebook's slider).

Calibration and evaluation read different text: the calibration windows are every fourth of the model's eight
passage windows (`passages.windows`), the evaluation (`benchmarks/plan.py`) the other six.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..paths import RESULTS_DIR
from ..plans import Plan, width_choices, width_names, widths_label
from ..policy import Policy, model_name, policy
from ..registry import BASELINE, get_scheme
from .banded import Row, policy_metrics
from .fidelity import only_layer
from .intervals import Comparison, Interval, bootstrap, compare
from .passages import Window, windows
from .sizes import layer_bytes, layer_shapes, policy_bytes

WINDOWS = 8  # the model's passage windows; every CALIBRATION_STEP-th calibrates, the others evaluate
CALIBRATION_STEP = 4
PROBE_DECODE = 32  # tokens a probe reads back a window: enough to rank layers, short enough for 2 minutes on Gemma
METHOD = ("sensitivity: mean KL(fp16 || probe) over the calibration windows, one layer stored at one width (K and V "
          "apart where the scheme stores them apart, the other at the widest), every other layer fp16; the fp16 "
          "prefix stored (stored_prefix), then {decode} tokens fed as one block. Search: the exact Pareto frontier "
          "of (bytes, predicted KL), predicted KL additive over layers and over K and V.")


def split_windows(model: str, tokenizer: Any, length: int) -> tuple[list[Window], list[Window]]:
    """(calibration, evaluation) windows of `length` tokens: every fourth of the model's eight, and the rest."""
    found = windows(model, tokenizer, length, WINDOWS)
    return found[::CALIBRATION_STEP], [w for i, w in enumerate(found) if i % CALIBRATION_STEP]


def width_pairs(names: tuple[str, ...], widths: tuple[int, ...], tied: bool = False) -> list[dict[str, int]]:
    """Every widths setting of one layer: each width for `bits`, or each K and V pair (`tied`: K = V only)."""
    if names == ("bits",):
        return [{"bits": b} for b in widths]
    return [{"k_bits": k, "v_bits": v} for k in widths for v in widths if k == v or not tied]


@dataclass(frozen=True)
class Choice:
    """One way to store one layer: its widths (None: fp16), its bytes at the context and its predicted KL."""

    widths: dict[str, int] | None
    bytes: float
    kl: float

    @property
    def label(self) -> str:
        return widths_label(self.widths)


@dataclass
class Sensitivity:
    """Each planned layer's probes, with the bytes of every choice: enough to plan any budget without the model."""

    model: str
    scheme: str
    options: dict[str, Any]  # the scheme's options as given, widths excluded (the tail, ...)
    overrides: dict[str, Any]
    context: int
    decode: int
    calibration: list[str]  # the windows' names
    layers: list[int]
    probes: dict[str, dict[str, dict[str, list[float]]]]  # "K"/"V"/"KV" -> layer -> width -> KL per window
    bytes: dict[str, dict[str, float]]  # layer -> choice label -> bytes at the context
    fixed_bytes: float  # the layers the plan does not decide (the policy's fp16 ones, recurrent state, ...)
    fp16_bytes: float  # the whole cache in fp16 at the context
    seconds: float = 0.0
    method: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def names(self) -> tuple[str, ...]:
        return width_names(get_scheme(self.scheme))

    @property
    def widths(self) -> tuple[int, ...]:
        return width_choices(get_scheme(self.scheme))

    def kl(self, part: str, layer: int, width: int) -> float:
        """Mean KL over the calibration windows of one probe: `part` "K", "V" (split widths) or "KV" (one width)."""
        values = self.probes[part][str(layer)][str(width)]
        return sum(values) / len(values)

    def predicted(self, layer: int, widths: dict[str, int] | None) -> float:
        """A layer's predicted KL at these widths: 0 in fp16; with split widths, the widest pair's KL plus what K
        and V each add above it (a part measured below the widest pair's counts as adding nothing)."""
        if widths is None:
            return 0.0
        if self.names == ("bits",):
            return self.kl("KV", layer, widths["bits"])
        base = self.kl("K", layer, self.widths[-1])
        return base + sum(max(0.0, self.kl(part, layer, widths[name]) - base)
                          for part, name in (("K", "k_bits"), ("V", "v_bits")))

    def at_width(self, width: int) -> dict[int, float]:
        """Each probed layer's predicted KL with K and V both at `width` (the layers' fragility, side by side)."""
        names = {name: width for name in self.names}
        return {layer: self.predicted(layer, names) for layer in self.layers}

    def choices(self, layer: int, tied: bool = False) -> list[Choice]:
        """Every way to store the layer, fp16 first (`tied`: K and V at one width, where the scheme splits them)."""
        out = [Choice(None, self.bytes[str(layer)]["fp16"], 0.0)]
        return out + [Choice(w, self.bytes[str(layer)][widths_label(w)], self.predicted(layer, w))
                      for w in width_pairs(self.names, self.widths, tied)]

    def frontier(self, tied: bool = False) -> list[tuple[float, float, tuple[Choice, ...]]]:
        """The plans no other plan beats on both bytes and predicted KL, as (bytes, predicted KL, choices), fewest
        bytes first (exact under the additive model; `tied`: one width for K and V a layer)."""
        points: list[tuple[float, float, tuple[Choice, ...]]] = [(self.fixed_bytes, 0.0, ())]
        for layer in self.layers:
            merged = sorted(((b + c.bytes, k + c.kl, picked + (c,)) for b, k, picked in points
                             for c in self.choices(layer, tied)), key=lambda p: (p[0], p[1]))
            points, best = [], float("inf")
            for point in merged:
                if point[1] < best:
                    points.append(point)
                    best = point[1]
        return points

    def smallest_share(self) -> float:
        return self.frontier()[0][0] / self.fp16_bytes

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "scheme": self.scheme, "options": self.options, "overrides": self.overrides,
                "context": self.context, "decode": self.decode, "calibration": self.calibration,
                "layers": self.layers, "probes": self.probes, "bytes": self.bytes, "fixed_bytes": self.fixed_bytes,
                "fp16_bytes": self.fp16_bytes, "seconds": round(self.seconds, 1), "method": self.method,
                **self.extra}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Sensitivity:
        known = ("model", "scheme", "options", "overrides", "context", "decode", "calibration", "layers", "probes",
                 "bytes", "fixed_bytes", "fp16_bytes", "seconds", "method")
        return cls(**{k: data[k] for k in known if k in data},
                   extra={k: v for k, v in data.items() if k not in known})


def choose(sens: Sensitivity, budget: float, tied: bool = False) -> Plan:
    """The plan with the least predicted KL whose bytes are at most `budget` (a share of fp16's at the context);
    `tied`: K and V at one width a layer, for a scheme that stores them apart (what the split itself buys)."""
    if not 0 < budget <= 1:
        raise ValueError(f"budget is a share of fp16's bytes in (0, 1], got {budget}")
    tied = tied and sens.names != ("bits",)
    frontier = sens.frontier(tied)
    fits = [p for p in frontier if p[0] <= budget * sens.fp16_bytes]
    if not fits:
        raise ValueError(f"no {sens.scheme} plan fits {100 * budget:.1f}% of fp16's bytes at {sens.context} tokens "
                         f"on {sens.model}; the smallest is {100 * sens.smallest_share():.1f}%")
    stored, predicted, picked = fits[-1]
    report = {"search": "exact Pareto frontier", "predicted_kl": predicted, "bytes": stored,
              "fp16_bytes": sens.fp16_bytes, "share": stored / sens.fp16_bytes, "method": sens.method,
              "calibration": sens.calibration, "tied": tied}
    return Plan(sens.model, sens.scheme, dict(sens.options), {layer: c.widths for layer, c in zip(sens.layers, picked)},
                sens.context, budget, dict(sens.overrides), report)


def sensitivity(model: nn.Module, tokenizer: Any, scheme: str = "kvarn", context: int = 4096, *,
                decode: int = PROBE_DECODE, name: str | None = None, quantize_last: bool = False,
                quantize_sliding: bool = False, progress: bool = False, **options: Any) -> Sensitivity:
    """Probe every layer the policy quantizes at every width (see the module docstring); minutes on a CPU."""
    spec = get_scheme(scheme)
    names = width_names(spec)
    given = sorted(set(options) & {"bits", "k_bits", "v_bits"})
    if given:
        raise ValueError(f"{', '.join(given)}: a plan chooses the widths; give the scheme's other options only")
    overrides = {"quantize_last": quantize_last, "quantize_sliding": quantize_sliding}
    display = name or model_name(model)
    base = policy(model, scheme, name=display, **overrides, **options)
    planned = [d.index for d in base.quantized]
    if not planned:
        raise ValueError(f"{base}: no layer to plan")
    calibration, _ = split_windows(display, tokenizer, context + decode + 1)
    tokens = mx.array([w.tokens for w in calibration], dtype=mx.int32)
    widths = width_choices(spec)
    probes: dict[str, dict[str, dict[str, list[float]]]] = {}
    runs: list[tuple[str, int, int, Policy]] = []
    for layer in planned:
        for w in widths:
            if names == ("bits",):
                runs.append(("KV", layer, w, only_layer(base, layer, {"bits": w})))
            else:
                runs.append(("K", layer, w, only_layer(base, layer, {"k_bits": w, "v_bits": widths[-1]})))
                if w != widths[-1]:  # V at the widest is the K probe at the widest
                    runs.append(("V", layer, w, only_layer(base, layer, {"k_bits": widths[-1], "v_bits": w})))
    start = time.perf_counter()

    def keep(i: int, metrics: dict[str, list[float]]) -> None:
        part, layer, w, _ = runs[i]
        probes.setdefault(part, {}).setdefault(str(layer), {})[str(w)] = metrics["mean_kl"]
        if part == "K" and w == widths[-1] and names != ("bits",):
            probes.setdefault("V", {}).setdefault(str(layer), {})[str(w)] = metrics["mean_kl"]
        if progress:
            mean = sum(metrics["mean_kl"]) / len(metrics["mean_kl"])
            print(f"probe {i + 1}/{len(runs)}: layer {layer} {part} {w}-bit, KL {mean:.3g}", flush=True)

    policy_metrics(model, tokens, context, decode, [r[3] for r in runs], block=True, on_policy=keep)
    shapes = layer_shapes(base)
    byte_table: dict[str, dict[str, float]] = {}
    for layer in planned:
        row = {"fp16": layer_bytes(shapes[layer], BASELINE, context, {})}
        for w in width_pairs(names, widths):
            row[widths_label(w)] = layer_bytes(shapes[layer], scheme, context, {**base.options, **w})
        byte_table[str(layer)] = row
    fixed = sum(layer_bytes(s, d.decision, context, base.options) for s, d in zip(shapes, base.layers)
                if d.index not in planned)
    fp16 = sum(layer_bytes(s, BASELINE, context, {}) for s in shapes)
    kept = {k: v for k, v in base.options.items() if k not in ("bits", "k_bits", "v_bits")}
    return Sensitivity(display, scheme, kept, overrides, context, decode, [w.name for w in calibration], planned,
                       probes, byte_table, fixed, fp16, time.perf_counter() - start, METHOD.format(decode=decode))


def plan(model: nn.Module, tokenizer: Any, scheme: str = "kvarn", budget: float = 0.5, context: int = 4096, *,
         measure: bool = False, **kwargs: Any) -> Plan:
    """Per-layer widths of `scheme` with the least predicted KL in `budget` of fp16's bytes at `context`, from this
    model's measured sensitivity (`sensitivity` takes the other arguments: the tail, quantize_last, ...). With
    `measure`, the plan is also measured against the widest uniform width that fits the budget (`measure_plan`)."""
    if not 0 < budget <= 1:
        raise ValueError(f"budget is a share of fp16's bytes in (0, 1], got {budget}")
    sens = sensitivity(model, tokenizer, scheme, context, **kwargs)
    chosen = choose(sens, budget)
    chosen.report["sensitivity_seconds"] = round(sens.seconds, 1)
    if measure:
        chosen.report["measured"] = measure_plan(model, tokenizer, sens, chosen)
    return chosen


# -- the evaluation: plans against uniform widths at equal memory, on the windows the probes did not read ----------

EVAL_DECODE = 128
EVAL_WIDEST = 4  # uniform widths up to this many bits are evaluated: where memory is tight and KL largest


def uniform_policy(sens: Sensitivity, model: nn.Module, width: int) -> Policy:
    """The scheme at one width on every layer the plan decides (the same options and overrides)."""
    widths = {name: width for name in sens.names}
    return policy(model, sens.scheme, name=sens.model, **sens.overrides, **sens.options, **widths)


def evaluate(model: nn.Module, tokenizer: Any, sens: Sensitivity, *, decode: int = EVAL_DECODE,
             widest: int = EVAL_WIDEST, progress: bool = False) -> tuple[list[Row], list[Plan]]:
    """Each uniform width up to `widest` bits and, at its bytes, the plan (`choose`; for a scheme that stores K and
    V apart also the plan with one width a layer), measured on the evaluation windows by the verdict's method
    (`banded.policy_metrics`: tokens decoded one at a time). Returns the rows (fp16 first, then per width the
    uniform row and each plan's where it differs from the uniform) and the plans, each naming in
    `report["against"]` the uniform width whose bytes it fits."""
    _, held = split_windows(sens.model, tokenizer, sens.context + decode + 1)
    tokens = mx.array([w.tokens for w in held], dtype=mx.int32)
    entries: list[tuple[str, Policy]] = [("fp16", policy(model, BASELINE, name=sens.model))]
    shapes = layer_shapes(entries[0][1])
    plans: list[Plan] = []
    for width in (w for w in sens.widths if w <= widest):
        uniform = uniform_policy(sens, model, width)
        share = policy_bytes(uniform, sens.context, shapes) / sens.fp16_bytes
        if share < sens.smallest_share():
            continue  # rules kept some layers fp16 that the plan decides: no plan fits here
        entries.append((uniform.label, uniform))
        for tied in (False, True) if sens.names != ("bits",) else (False,):
            chosen = choose(sens, share, tied)
            chosen.report["against"] = uniform.label
            plans.append(chosen)
            if any(w != {name: width for name in sens.names} for w in chosen.widths.values()):
                entries.append((chosen.label, policy(model, plan=chosen, name=sens.model)))  # else: the uniform
    start = time.perf_counter()
    rows: list[Row] = []

    def keep(i: int, metrics: dict[str, list[float]]) -> None:
        spec, chosen_policy = entries[i]
        quantized = chosen_policy.as_dict()["quantized_layers"]
        rows.append(Row(spec, chosen_policy.label, chosen_policy.scheme, sens.context,
                        f"{quantized}/{len(chosen_policy.layers)}", policy_bytes(chosen_policy, sens.context, shapes),
                        sens.fp16_bytes, metrics, time.perf_counter() - start))
        if progress:
            print(f"{chosen_policy.label}: mean KL {rows[-1].interval('mean_kl').text()}", flush=True)

    policy_metrics(model, tokens, sens.context, decode, [p for _, p in entries], on_policy=keep)
    return rows, plans


def measure_plan(model: nn.Module, tokenizer: Any, sens: Sensitivity, chosen: Plan, *,
                 decode: int = EVAL_DECODE) -> dict[str, Any]:
    """The plan and the widest uniform width whose bytes fit its budget, measured on the evaluation windows by the
    verdict's method: each one's mean KL with its interval, their bytes, and `intervals.compare`'s sentence."""
    uniform, shapes = None, None
    for width in sens.widths:  # the widest that fits, as a user without a plan would choose
        candidate = uniform_policy(sens, model, width)
        shapes = shapes or layer_shapes(candidate)
        if policy_bytes(candidate, sens.context, shapes) <= chosen.budget * sens.fp16_bytes:
            uniform = candidate
    _, held = split_windows(sens.model, tokenizer, sens.context + decode + 1)
    entries = [("plan", policy(model, plan=chosen, name=sens.model))] + ([("uniform", uniform)] if uniform else [])
    tokens = mx.array([w.tokens for w in held], dtype=mx.int32)
    found = policy_metrics(model, tokens, sens.context, decode, [p for _, p in entries])
    out: dict[str, Any] = {"windows": [w.name for w in held], "decode": decode}
    for (name, chosen_policy), metrics in zip(entries, found):
        out[name] = {"label": chosen_policy.label, "bytes": policy_bytes(chosen_policy, sens.context, shapes),
                     "mean_kl": bootstrap(metrics["mean_kl"]).to_dict()}
    if uniform is None:
        out["sentence"] = f"no uniform {sens.scheme} width fits {100 * chosen.budget:.0f}% of fp16's bytes"
    else:
        out["sentence"] = compare(out["plan"]["label"], Interval.from_dict(out["plan"]["mean_kl"]),
                                  out["uniform"]["label"], Interval.from_dict(out["uniform"]["mean_kl"])).sentence()
    return out


def plan_markdown(sens: Sensitivity, chosen: Plan) -> str:
    """The plan layer by layer (widths, bytes, predicted KL) and its total against fp16, as a markdown table."""
    lines = ["| layer | widths | KiB | predicted KL |", "|---|---|---|---|"]
    for layer in sens.layers:
        widths = chosen.widths[layer]
        lines.append(f"| {layer} | {widths_label(widths)} | {sens.bytes[str(layer)][widths_label(widths)] / 1024:.0f} "
                     f"| {sens.predicted(layer, widths):.2e} |")
    report = chosen.report
    lines.append(f"\n{chosen.label} on {sens.model} at {sens.context} tokens: {report['bytes'] / 1024:.0f} KiB, "
                 f"{100 * report['share']:.1f}% of fp16's {sens.fp16_bytes / 1024:.0f} KiB (the budget "
                 f"{100 * chosen.budget:.0f}%); predicted KL {report['predicted_kl']:.2e} nats (the sum of the "
                 f"layers' probes on {len(sens.calibration)} calibration windows)")
    if "measured" in report:
        measured = report["measured"]
        lines.append(f"Measured on {len(measured['windows'])} other windows: {measured['sentence']}")
    return "\n".join(lines)


# -- the committed results (benchmarks/plan.py) ------------------------------------------------------------------


@dataclass
class PlanResults:
    """One scheme spec's committed plan run on one model: the probes, the evaluation rows and the plans."""

    spec: str
    sensitivity: Sensitivity
    rows: list[Row]
    plans: list[Plan]  # each names the uniform width whose bytes it fits: report["against"]
    run: dict[str, Any]

    def row(self, label: str) -> Row:
        return next(r for r in self.rows if r.label == label)

    def measured(self, chosen: Plan) -> bool:
        return any(r.label == chosen.label for r in self.rows)

    def pairs(self, tied: bool = False) -> list[tuple[Row, Row, Plan]]:
        """(uniform row, the plan's row at its bytes, the plan) wherever the plan differs from the uniform width
        (`tied`: the plans with one width for K and V a layer)."""
        return [(self.row(p.report["against"]), self.row(p.label), p) for p in self.plans
                if bool(p.report.get("tied")) == tied and self.measured(p)]

    def comparisons(self, tied: bool = False) -> list[Comparison]:
        """The plan against the uniform width at each budget, through `intervals.compare` (mean KL)."""
        return [compare(p.label, p.interval("mean_kl"), u.label, u.interval("mean_kl"), "mean KL")
                for u, p, _ in self.pairs(tied)]

    def split_against_tied(self) -> list[Comparison]:
        """At each budget, the plan that sets K and V apart against the plan with one width a layer (both measured)."""
        tied = {p.report["against"]: row for _, row, p in self.pairs(tied=True)}
        return [compare(row.label, row.interval("mean_kl"), tied[p.report["against"]].label,
                        tied[p.report["against"]].interval("mean_kl"), "mean KL")
                for _, row, p in self.pairs() if p.report["against"] in tied]

    def same_as_uniform(self, tied: bool = False) -> list[str]:
        """The uniform widths at whose bytes the plan (`tied`: with one width for K and V a layer) is that uniform
        width itself, so it was not measured twice."""
        return [p.report["against"] for p in self.plans
                if bool(p.report.get("tied")) == tied and not self.measured(p)]


def plan_results_path(model: str, machine: str = "cpu") -> Path:
    return RESULTS_DIR / f"plan-{model}-{machine}.json"


def load_plan_results(model: str = "gemma3-270m", machine: str = "cpu") -> dict[str, PlanResults]:
    """The committed runs of `benchmarks/plan.py` for one model, by scheme spec ("kvarn:tail=128", "affine")."""
    path = plan_results_path(model, machine)
    if not path.is_file():
        found = sorted(p.name for p in RESULTS_DIR.glob("plan-*.json"))
        raise FileNotFoundError(f"no results file {path.name}; run benchmarks/plan.py --model {model}. "
                                f"Committed: {', '.join(found) or 'none'}")
    data = json.loads(path.read_text())
    return {spec: PlanResults(spec, Sensitivity.from_dict(entry["sensitivity"]),
                              [Row.from_dict(r) for r in entry["rows"]],
                              [Plan.from_dict(p) for p in entry["plans"]],
                              {k: v for k, v in entry.items() if k not in ("sensitivity", "rows", "plans")})
            for spec, entry in data["schemes"].items()}


def markdown_table(results: dict[str, PlanResults]) -> str:
    """Each plan against the uniform width whose bytes it fits: both mean KLs with their intervals, the plan's
    widths and whether the intervals are apart (the README's and docs/results.md's table, checked by the tests)."""
    lines = ["| plan | bytes (% of fp16's): uniform / plan | uniform width: mean KL | plan: mean KL | plan's widths by "
             "layer | 95% intervals |", "|---|---|---|---|---|---|"]
    for spec, res in results.items():
        for uniform, planned, chosen in res.pairs() + res.pairs(tied=True):
            said = compare(planned.label, planned.interval("mean_kl"), uniform.label, uniform.interval("mean_kl"))
            widths = ", ".join(f"{layer}: {widths_label(w)}" for layer, w in sorted(chosen.widths.items()))
            verdict = ("apart: the plan is lower" if said.winner == planned.label else
                       "apart: the uniform width is lower" if said.winner else "overlap")
            kind = f"{spec}, one width for K and V a layer" if chosen.report.get("tied") else spec
            lines.append(f"| {kind} | {100 * uniform.share:.1f} / {100 * planned.share:.1f} | {uniform.label}: "
                         f"{uniform.interval('mean_kl').text()} | {planned.interval('mean_kl').text()} | {widths} | "
                         f"{verdict} |")
    return "\n".join(lines)
