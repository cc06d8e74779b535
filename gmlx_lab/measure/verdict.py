"""Which scheme when: the committed banded-fidelity results read as a recommendation per memory budget and context.

    results = load_verdict("gemma3-270m")                 # the model's file with the most contexts (the H200's)
    for rec in recommendations(results):
        print(rec.text())                                 # best, runner-up, and whether the two differ

The best scheme under a budget is the one with the lowest mean KL (its estimate) among the rows whose stored
bytes are at most that share of fp16's; whether it is really better than the runner-up is `intervals.compare`'s
to say. The cost in speed comes from the committed whole-model decode files (`decode_speed`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..registry import BASELINE
from .banded import Row
from .intervals import Comparison, compare

# The committed results: benchmarks/results/ in a checkout (gmlx_lab/data/results links to it), package data in an
# installed gmlx_lab (pyproject.toml), so the notebooks find them either way.
RESULTS_DIR = Path(__file__).resolve().parents[1] / "data" / "results"
BUDGETS = (0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6)
METRIC = "mean_kl"
# Mean KL under which rows computed in fp16 (on a GPU) tell no scheme from another: fp16 arithmetic alone lifts
# the 8-bit rows to about this level, where the CPU's float32 rows of the same cases sit several times lower
# (notebook 12 and docs/results.md show the cross-check; tests/test_verdict.py reads it from the files).
FP16_KL_FLOOR = 1e-4


@dataclass
class VerdictResults:
    """One model's banded-fidelity rows (every scheme, every context) and how they were made."""

    model: str
    rows: list[Row]
    runs: list[dict[str, Any]]
    path: Path | None = None

    @property
    def contexts(self) -> list[int]:
        """The contexts at which every measured scheme has a row (a run stopped midway leaves one incomplete)."""
        specs = {r.spec for r in self.rows}
        found = {c: {r.spec for r in self.rows if r.context == c} for c in {r.context for r in self.rows}}
        return sorted(c for c, have in found.items() if have == specs)

    @property
    def incomplete(self) -> list[int]:
        """Contexts some scheme has no row at: left out of every figure and recommendation."""
        return sorted({r.context for r in self.rows} - set(self.contexts))

    def at(self, context: int) -> list[Row]:
        """The rows at one context, fp16 first, then by stored bytes."""
        if context not in self.contexts:
            raise ValueError(f"{self.model} has no rows at context {context}; it has {self.contexts}")
        return sorted((r for r in self.rows if r.context == context), key=lambda r: (r.scheme != BASELINE, r.bytes))

    def row(self, context: int, spec: str) -> Row:
        for r in self.at(context):
            if spec in (r.spec, r.label):
                return r
        raise KeyError(f"{self.model} has no row {spec!r} at context {context}")

    def table(self, context: int) -> list[dict[str, str]]:
        """Every row at one context with each metric and its interval, as table cells (fp16 first, then by bytes)."""
        return [{"scheme": r.label, "layers quantized": r.quantized_layers, "% of fp16's bytes": f"{100 * r.share:.1f}",
                 **{name: r.interval(metric).text() for name, metric in (
                     ("mean KL", "mean_kl"), ("median KL", "median_kl"), ("top-1", "top1"),
                     ("perplexity", "perplexity"))}} for r in self.at(context)]

    @property
    def machines(self) -> list[str]:
        return sorted({run.get("machine", {}).get("tag", "unknown") for run in self.runs})

    @property
    def kl_floor(self) -> float:
        """The mean KL below which two rows are not told apart: FP16_KL_FLOOR where any row was computed in fp16
        (any machine but the CPU, where gmlx_lab computes in float32), else 0."""
        return 0.0 if self.machines == ["cpu"] else FP16_KL_FLOOR

    @property
    def method(self) -> str:
        return self.runs[-1]["method"] if self.runs else ""

    @property
    def passages(self) -> int:
        return len(next(iter(self.rows[0].per_passage.values()))) if self.rows else 0


def context_label(context: int) -> str:
    """A context as people say it: 512, 1K, 8K."""
    return f"{context // 1024}K" if context >= 1024 and context % 1024 == 0 else str(context)


def verdict_path(model: str, machine: str = "cpu") -> Path:
    return RESULTS_DIR / f"verdict-{model}-{machine}.json"


def verdict_machines(model: str) -> list[str]:
    """The machines with a committed verdict file for `model` ("cpu", "h200", ...)."""
    prefix = f"verdict-{model}-"
    return sorted(p.name[len(prefix):-len(".json")] for p in RESULTS_DIR.glob(f"{prefix}*.json"))


def load_verdict(model: str = "gemma3-270m", machine: str | None = None) -> VerdictResults:
    """The committed rows of `benchmarks/verdict.py` for one model and machine; without a machine, the file
    that holds the most complete contexts (a sweep reads best from one machine), the CPU's on a tie."""
    if machine is None:
        found = [_read(verdict_path(model, m)) for m in verdict_machines(model)]
        if found:
            return max(found, key=lambda r: (len(r.contexts), r.path.name.endswith("-cpu.json")))
        machine = "cpu"
    return _read(verdict_path(model, machine))


def _read(path: Path) -> VerdictResults:
    if not path.is_file():
        found = sorted(p.name for p in RESULTS_DIR.glob("verdict-*.json"))
        model = path.name.removeprefix("verdict-").rsplit("-", 1)[0]
        raise FileNotFoundError(f"no results file {path.name}; run benchmarks/verdict.py --model {model}. "
                                f"Committed: {', '.join(found) or 'none'}")
    data = json.loads(path.read_text())
    return VerdictResults(data["model"], [Row.from_dict(r) for r in data["rows"]], data.get("runs", []), path)


@dataclass(frozen=True)
class Agreement:
    """Two machines' rows for the same (context, scheme) pairs: how far their mean KL lies apart."""

    first: str
    second: str
    pairs: tuple[tuple[Row, Row], ...]

    def ratios(self, above: float = 0.0, below: float = float("inf")) -> list[float]:
        """second's mean KL over first's, for the pairs where first's lies in [above, below)."""
        return [b.interval(METRIC).estimate / a.interval(METRIC).estimate for a, b in self.pairs
                if 0 < a.interval(METRIC).estimate and above <= a.interval(METRIC).estimate < below]

    def overlapping(self) -> int:
        """How many pairs have overlapping 95% intervals."""
        return sum(a.interval(METRIC).overlaps(b.interval(METRIC)) for a, b in self.pairs)

    def text(self, above: float = 0.0, below: float = float("inf")) -> str:
        r = self.ratios(above, below)
        if not r:
            return f"no pairs with the {self.first} file's mean KL in [{above:g}, {below:g})"
        where = (f"where the {self.first} file's mean KL is " +
                 (f"at least {above:g}" if below == float("inf") else f"below {below:g}"))
        return f"{where}, the {self.second} file's is {min(r):.2f}-{max(r):.2f}x it ({len(r)} pairs)"


def agreement(first: VerdictResults, second: VerdictResults) -> Agreement:
    """Pair the rows two files share (same context and spec), for a cross-check of machines."""
    common = sorted(set(first.contexts) & set(second.contexts))
    pairs = tuple((a, second.row(c, a.spec)) for c in common for a in first.at(c)
                  if a.scheme != BASELINE and any(b.spec == a.spec for b in second.at(c)))
    return Agreement(first.path.name if first.path else "first", second.path.name if second.path else "second",
                     pairs)


@dataclass(frozen=True)
class Recommendation:
    """Under `budget` (a share of fp16's bytes) at `context`: the best row, the best of another scheme (runner-up)
    and their comparison."""

    budget: float
    context: int
    best: Row | None
    runner_up: Row | None
    floor: float  # the smallest share any measured scheme reaches at this context
    kl_floor: float = 0.0  # VerdictResults.kl_floor

    @property
    def comparison(self) -> Comparison | None:
        if self.best is None or self.runner_up is None:
            return None
        return compare(self.best.label, self.best.interval(METRIC), self.runner_up.label,
                       self.runner_up.interval(METRIC), "mean KL", floor=self.kl_floor)

    def cells(self) -> tuple[str, str, str, str]:
        """(budget, best, runner-up, verdict) as short table cells."""
        budget = f"{100 * self.budget:.0f}% at {context_label(self.context)}"
        if self.best is None:
            return budget, "none fits", "", f"the smallest measured share is {100 * self.floor:.0f}%"
        best = f"{self.best.label} ({100 * self.best.share:.0f}%)"
        if self.runner_up is None:
            return budget, best, "", "the only scheme that fits"
        runner = f"{self.runner_up.label} ({100 * self.runner_up.share:.0f}%)"
        if self.comparison.below_floor:
            return budget, best, runner, f"both below {self.kl_floor:g}"
        return budget, best, runner, "ahead" if self.comparison.distinguishable else "indistinguishable"

    def text(self) -> str:
        """One sentence: the recommendation, or why there is none."""
        where = f"Under {100 * self.budget:.0f}% of fp16's bytes at {self.context} tokens"
        if self.best is None:
            return f"{where} no measured scheme fits (the smallest share is {100 * self.floor:.0f}%)."
        if self.runner_up is None:
            return f"{where} only {self.best.label} fits: mean KL {self.best.interval(METRIC).text()}."
        return f"{where}: {self.comparison.sentence()}"


def _rank(row: Row, kl_floor: float) -> tuple[int, float]:
    """Lowest mean KL first; rows wholly below the KL floor come before all others and, being alike, by bytes."""
    kl = row.interval(METRIC)
    return (0, row.share) if kl.high < kl_floor else (1, kl.estimate)


def recommend(results: VerdictResults, budget: float, context: int) -> Recommendation:
    """The lowest-mean-KL row whose bytes fit the budget at this context, and the runner-up: the best row of
    another scheme (the same scheme at another width or tail answers a different question: which width). Rows
    below the results' KL floor are alike in KL, so the smallest of them comes first."""
    if not 0 < budget <= 1:
        raise ValueError(f"budget is a share of fp16's bytes in (0, 1], got {budget}")
    rows = [r for r in results.at(context) if r.scheme != BASELINE]
    fits = sorted((r for r in rows if r.share <= budget), key=lambda r: _rank(r, results.kl_floor))
    floor = min(r.share for r in rows) if rows else 1.0
    best = fits[0] if fits else None
    runner_up = next((r for r in fits if best is not None and r.scheme != best.scheme), None)
    return Recommendation(budget, context, best, runner_up, floor, results.kl_floor)


def standing(results: VerdictResults, scheme: str, budget: float, context: int) -> str:
    """Where one scheme stands under a budget: whether it leads, or its best fitting row against the leader
    (through `compare`), or that none of its rows fits."""
    rec = recommend(results, budget, context)
    where = f"under {100 * budget:.0f}% at {context_label(context)}"
    own = [r for r in results.at(context) if r.scheme == scheme]
    if not own:
        raise ValueError(f"{results.model} has no {scheme} rows at {context}")
    fits = sorted((r for r in own if r.share <= budget), key=lambda r: _rank(r, results.kl_floor))
    if not fits:
        return f"{where}: no {scheme} row fits (its smallest share is {100 * min(r.share for r in own):.0f}%)"
    if rec.best is fits[0]:
        return f"{where}: {scheme} has the lowest mean KL ({fits[0].label})"
    return f"{where}: " + compare(rec.best.label, rec.best.interval(METRIC), fits[0].label,
                                  fits[0].interval(METRIC), "mean KL", floor=results.kl_floor).sentence()


def recommendations(results: VerdictResults, budgets: tuple[float, ...] = BUDGETS,
                    contexts: list[int] | None = None) -> list[Recommendation]:
    """`recommend` for every budget at every context (the committed ones by default)."""
    return [recommend(results, b, c) for c in (contexts or results.contexts) for b in budgets]


def recommendation_table(recs: list[Recommendation]) -> str:
    """The recommendations as a plain-text table (what notebook 12 keeps and nbval checks)."""
    head = ("budget", "recommended (share)", "best other scheme (share)", "95% intervals")
    cells = [head] + [r.cells() for r in recs]
    widths = [max(len(row[i]) for row in cells) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells)


def markdown_table(results: VerdictResults, budgets: tuple[float, ...] = BUDGETS) -> str:
    """Budgets down, contexts across: the lowest-KL scheme, its share and interval, and how it stands to the
    runner-up (the README's and docs/results.md's table, checked against the committed file by the tests)."""
    head = " | ".join(f"{context_label(c)} tokens" for c in results.contexts)
    lines = [f"| budget (of fp16's bytes) | {head} |", "|---|" + "---|" * len(results.contexts)]
    for budget in budgets:
        cells = []
        for context in results.contexts:
            rec = recommend(results, budget, context)
            if rec.best is None:
                cells.append(f"none fits (smallest {100 * rec.floor:.0f}%)")
                continue
            cell = f"**{rec.best.label}** {100 * rec.best.share:.0f}%, KL {rec.best.interval(METRIC).text()}"
            if rec.runner_up is not None:
                word = ("ahead of" if rec.comparison.distinguishable else
                        f"below {rec.kl_floor:g} with" if rec.comparison.below_floor else "indistinguishable from")
                cell += (f"; {word} {rec.runner_up.label} ({100 * rec.runner_up.share:.0f}%, "
                         f"{rec.runner_up.interval(METRIC).text()})")
            cells.append(cell)
        lines.append(f"| {100 * budget:.0f}% | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# -- the cost in speed ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SpeedRatio:
    """A scheme's whole-model decode speed against mlx-lm's fp16 KVCache, over the contexts of one results file."""

    label: str
    file: str
    machine: str
    low: float
    high: float
    contexts: tuple[int, ...]
    tokens: int
    commit: str
    model: str

    def text(self) -> str:
        low, high = f"{self.low:.2f}", f"{self.high:.2f}"
        span = f"{low}x" if low == high else f"{low}-{high}x"
        where = ", ".join(context_label(c) for c in sorted(set(self.contexts)))
        name = "gmlx's fp16 cache" if self.label == BASELINE else self.label
        return (f"{name}: {span} the decode speed of mlx-lm's fp16 KVCache, {self.model} on the {self.machine} "
                f"at {where} (medians of {self.tokens} timed tokens; benchmarks/results/{self.file}, "
                f"commit {self.commit})")


def decode_speed(file: str, labels: tuple[str, ...] = ("fp16", "affine4 g64", "kvarn4 tail=1024",
                                                       "kvarn6 tail=1024"),
                 weight_bits: int = 16) -> list[SpeedRatio]:
    """Each label's median decode speed as a share of mlx-lm KVCache's, from a committed model_decode file."""
    data = json.loads((RESULTS_DIR / file).read_text())
    machine = data.get("device", "unknown device")
    commit = str(data.get("commit", "unknown"))[:7]
    out = []
    for label in labels:
        rows = [r for r in data["rows"] if r["label"] == label and r.get("weight_bits", 16) == weight_bits]
        if not rows:
            raise ValueError(f"{file} has no row {label!r} with {weight_bits}-bit weights")
        ratios = [r["decode_median_vs_mlx_lm_fp16"] for r in rows]
        out.append(SpeedRatio(label, file, machine, min(ratios), max(ratios), tuple(r["context"] for r in rows),
                              min(r["timed_tokens"] for r in rows), commit, str(data.get("model", "a model"))))
    return out
