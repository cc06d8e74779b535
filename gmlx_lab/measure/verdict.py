"""Which scheme when: the committed banded-fidelity results read as a recommendation per memory budget and context.

    results = load_verdict("smollm2-135m")
    for rec in recommendations(results):
        print(rec.text())            # what to use, what it is measured against, and why

The rule (`recommend`), in three steps:
1. **Fit**: the rows whose stored bytes are at most the budget's share of fp16's.
2. **Keep the model**: a row whose mean KL is above `KEEP_KL` or whose top-1 agreement is below `KEEP_TOP1` moves
   the model's answers; it is reported as "fits, but breaks: raise the budget", never recommended. The two levels
   sit in the gap `floor_evidence` finds on the lab's own runs: below it every measured row retrieved passkeys as
   fp16 does, above it rows began to lose them (docs/results.md gives the numbers, `tests/test_verdict.py` holds
   the levels inside the gap).
3. **As good, then smaller, then faster**: a row that no other fitting row beats (`intervals.compare`: intervals
   apart) is as good as the best at this sample; of those the recommendation stores the fewest bytes, and among
   rows within `BYTES_TIE` of that it takes one whose decode is faster (`speed`), if any is.
The runner-up is the best row of another scheme that fits and keeps the model; the speed of both comes from the
committed whole-model runs (`speed.committed_speeds`), or says why it is unmeasured.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..paths import RESULTS_DIR
from ..registry import BASELINE
from .banded import Row
from .intervals import Comparison, Interval, compare, wilson
from .speed import BASELINE_LABEL, Speed, SpeedTable

BUDGETS = (0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2)
METRIC = "mean_kl"
# Mean KL under which rows computed in fp16 (on a GPU) tell no scheme from another: fp16 arithmetic alone lifts
# the 8-bit rows to about this level, where the CPU's float32 rows of the same cases sit several times lower
# (notebook 12 and docs/results.md show the cross-check; tests/test_verdict.py reads it from the files).
FP16_KL_FLOOR = 1e-4
# The quality floor: a row keeps the model where its mean KL is at most KEEP_KL and its top-1 agreement with fp16 at
# least KEEP_TOP1 (estimates over the passages); each sits in the middle of the gap `floor_evidence` finds.
KEEP_KL = 0.01
KEEP_TOP1 = 0.93
# Rows whose shares differ by less than this (of fp16's bytes) are equally small: the faster decode decides.
BYTES_TIE = 0.01


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

    def run_summary(self) -> str:
        """The runs behind the rows, one clause a machine: how many, their commits and dates, one command."""
        by_machine: dict[str, list[dict[str, Any]]] = {}
        for run in self.runs:
            by_machine.setdefault(run.get("machine", {}).get("tag", "unknown"), []).append(run)
        parts = []
        for machine, runs in by_machine.items():
            commits = ", ".join(sorted({str(r.get("commit", "?")) for r in runs}))
            dates = ", ".join(sorted({str(r.get("date", "?"))[:10] for r in runs}))
            command = runs[0].get("command", "").split(" --schemes")[0]
            parts.append(f"{len(runs)} run{'s' if len(runs) > 1 else ''} on the {machine} (commit {commits}, {dates}; "
                         f"e.g. `{command}`)")
        return "; ".join(parts)

    @property
    def method(self) -> str:
        return self.runs[-1]["method"] if self.runs else ""

    @property
    def passages(self) -> int:
        return len(next(iter(self.rows[0].per_passage.values()))) if self.rows else 0


def context_label(context: int) -> str:
    """A context as people say it: 512, 1K, 7.5K, 8K."""
    return f"{context / 1024:g}K" if context >= 1024 and context % 512 == 0 else str(context)


def verdict_path(model: str, machine: str = "cpu") -> Path:
    return RESULTS_DIR / f"verdict-{model}-{machine}.json"


def verdict_machines(model: str) -> list[str]:
    """The machines with a committed verdict file for `model` ("cpu", "h200", ...)."""
    prefix = f"verdict-{model}-"
    return sorted(p.name[len(prefix):-len(".json")] for p in RESULTS_DIR.glob(f"{prefix}*.json"))


def load_verdict(model: str = "gemma3-270m", machine: str | None = None) -> VerdictResults:
    """The committed rows of `benchmarks/verdict.py` for one model and machine; without a machine, the file
    that holds the most complete contexts (a sweep reads best from one machine), then the most rows, then the
    CPU's."""
    if machine is None:
        found = [_read(verdict_path(model, m)) for m in verdict_machines(model)]
        if found:
            return max(found, key=lambda r: (len(r.contexts), len(r.rows), r.path.name.endswith("-cpu.json")))
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




# -- the quality floor ----------------------------------------------------------------------------------------


def keeps_model(row: Row) -> bool:
    """True where the row's mean KL is at most KEEP_KL and its top-1 agreement at least KEEP_TOP1."""
    return row.interval(METRIC).estimate <= KEEP_KL and row.interval("top1").estimate >= KEEP_TOP1


def floor_text() -> str:
    """The floor in words, as the tables and sentences name it."""
    return f"mean KL <= {KEEP_KL:g} and top-1 >= {100 * KEEP_TOP1:.0f}%"


@dataclass(frozen=True)
class Evidence:
    """One verdict row beside the passkey retrieval of the same scheme, model and context (`benchmarks/field.py`)."""

    row: Row
    retrieval: Interval  # keys found of those asked, with the Wilson interval
    fp16: Interval  # fp16's retrieval in the same case

    @property
    def kept_retrieval(self) -> bool:
        """Retrieval as fp16's: the two Wilson intervals overlap."""
        return self.retrieval.overlaps(self.fp16)


def floor_evidence(results: VerdictResults, field_file: str = "field-h200.json",
                   policy: str = "default") -> list[Evidence]:
    """Every verdict row whose scheme, context and model the field run also asked for passkeys (under the model's
    `policy`, as the verdict measures it), by mean KL: the lab's own evidence for where a cache starts to break."""
    from .field import field_rows

    report = json.loads((RESULTS_DIR / field_file).read_text())
    keys = [r for r in field_rows([report]) if (r["model"], r["policy"], r["kind"]) == (results.model, policy,
                                                                                        "passkey")]
    out = []
    for length in sorted({r["length"] for r in keys} & set(results.contexts)):
        here = {r["label"]: r for r in keys if r["length"] == length}
        fp16 = here.get(BASELINE)
        if fp16 is None:
            continue
        for label, found in here.items():
            row = next((r for r in results.at(length) if r.label == label), None)
            if row is not None and row.scheme != BASELINE:
                out.append(Evidence(row, wilson(found["hits"], found["asked"]), wilson(fp16["hits"], fp16["asked"])))
    return sorted(out, key=lambda e: e.row.interval(METRIC).estimate)


def floor_gap(evidence: list[Evidence]) -> tuple[Evidence, Evidence]:
    """(the highest-KL row whose mean KL interval lies wholly below the first lost row's, that first row): the
    lowest-KL row that lost fp16's retrieval, and the last row clearly below it. Rows whose intervals overlap the
    first loss sit where retrieval is already a coin toss; a floor belongs in the gap between the two returned."""
    lost = next((e for e in evidence if not e.kept_retrieval), None)
    if lost is None:
        raise ValueError("no row of the evidence lost fp16's retrieval: it sets no floor")
    band = lost.row.interval(METRIC)
    below = [e for e in evidence if e.row.interval(METRIC).high < band.low]
    if not below:
        raise ValueError(f"no row lies clearly below the first loss ({lost.row.label}): the evidence sets no floor")
    return below[-1], lost


# -- the recommendation -----------------------------------------------------------------------------------------


def _beats(a: Row, b: Row, kl_floor: float) -> bool:
    """True where a's mean KL is lower than b's with the intervals apart (and not both under the KL floor)."""
    return compare("a", a.interval(METRIC), "b", b.interval(METRIC), floor=kl_floor).winner == "a"


@dataclass(frozen=True)
class Recommendation:
    """Under `budget` (a share of fp16's bytes) at `context`: what to use (`pick`), the best row of another scheme
    (`runner_up`), the rows as good as the best at this sample (`tied`), or, where every row that fits breaks the
    model, the best of those (`broken`)."""

    budget: float
    context: int
    pick: Row | None
    runner_up: Row | None
    tied: tuple[Row, ...]
    broken: Row | None
    smallest: float  # the smallest share any measured row reaches at this context
    smallest_kept: float | None  # the smallest share of a row that keeps the model at this context
    kl_floor: float = 0.0
    speeds: SpeedTable | None = None

    @property
    def comparison(self) -> Comparison | None:
        if self.pick is None or self.runner_up is None:
            return None
        return compare(self.pick.label, self.pick.interval(METRIC), self.runner_up.label,
                       self.runner_up.interval(METRIC), "mean KL", floor=self.kl_floor)

    def speed(self, row: Row) -> Speed | None:
        """The row's decode speed in the first setting that measured it (GPU before CPU), where speeds were given."""
        return self.speeds.first(row.label) if self.speeds is not None else None

    @property
    def why(self) -> str:
        """Why the pick and not the lowest-KL row: the words of the rule that chose it."""
        if self.pick is None:
            return ""
        if len(self.tied) == 1:
            return "the lowest mean KL"
        smaller = [r for r in self.tied if r.share < self.pick.share]
        if smaller:
            return f"the faster decode of {len(smaller) + 1} rows equally small"
        return f"the fewest bytes of the {len(self.tied)} rows as good at this sample"

    @property
    def faster(self) -> Row | None:
        """A row as good as the pick at this sample whose decode is faster (GPU, batch 1), at more bytes."""
        if self.pick is None or self.speeds is None:
            return None
        quicker = [r for r in self.tied if self.speeds.faster(r.label, self.pick.label)]
        return min(quicker, key=lambda r: r.share) if quicker else None

    @property
    def raise_to(self) -> str:
        """The budget that first keeps the model here, in words."""
        if self.smallest_kept is None:
            return "only fp16 keeps the model at this context"
        return f"raise the budget to {math.ceil(100 * self.smallest_kept - 1e-9):.0f}%"

    def cells(self) -> list[tuple[str, ...]]:
        """Table lines as cells (budget, row (share), mean KL, top-1, speed, note): the recommended row (or the best
        of those that fit but break the model), then the runner-up and how the two compare."""
        budget = f"{100 * self.budget:.0f}% at {context_label(self.context)}"
        if self.pick is None and self.broken is None:
            return [(budget, "none fits", "", "", "", f"smallest share {100 * self.smallest:.0f}%")]
        if self.pick is None:
            return [(budget, *self._row_cells(self.broken, speed=False),
                     "fits, but breaks: " + self.raise_to.replace("raise the budget to", "raise to"))]
        if self.runner_up is None:
            return [(budget, *self._row_cells(self.pick), "the only one that keeps it")]
        said = self.comparison
        floor = f"{self.kl_floor:.0e}".replace("e-0", "e-")
        word = ("ahead" if said.distinguishable else f"both < {floor}" if said.below_floor else "overlap")
        if not said.distinguishable and len(self.tied) > 1:
            smaller = any(r.share < self.pick.share for r in self.tied)
            word += f": {'the faster' if smaller else 'fewest bytes'} of {len(self.tied)}"
        return [(budget, *self._row_cells(self.pick), ""), ("", *self._row_cells(self.runner_up), word)]

    def _row_cells(self, row: Row, speed: bool = True) -> tuple[str, ...]:
        found = self.speed(row) if speed else None
        top1 = row.interval("top1")
        return (f"{row.label} ({100 * row.share:.0f}%)", row.interval(METRIC).text(),
                f"{100 * top1.estimate:.0f}% [{100 * top1.low:.0f}, {100 * top1.high:.0f}]",
                found.short() if found else "")

    def text(self) -> str:
        """The answer in a few sentences: what to use and why, or why nothing fits or keeps the model."""
        where = f"Under {100 * self.budget:.0f}% of fp16's bytes at {context_label(self.context)} tokens"
        if self.pick is None and self.broken is None:
            return f"{where} no measured row fits (the smallest share is {100 * self.smallest:.0f}%)."
        if self.pick is None:
            row = self.broken
            return (f"{where} every row that fits breaks the model: the best, {row.label} at {100 * row.share:.0f}%, "
                    f"has mean KL {row.interval(METRIC).text(3)} and top-1 {row.interval('top1').text(3)}, outside "
                    f"the floor ({floor_text()}). Fits, but breaks: {self.raise_to}.")
        row = self.pick
        speed = self.speed(row)
        out = (f"{where}: use {row.label} ({100 * row.share:.0f}% of fp16's bytes, mean KL "
               f"{row.interval(METRIC).text()}, top-1 {row.interval('top1').text()}"
               + (f"; decode {speed.short()} against fp16" if speed else "") + f"), {self.why}.")
        if self.runner_up is not None:
            out += " " + self.comparison.sentence()
        if self.faster is not None:
            fast, mine = self.speeds.pair(self.faster.label, row.label)
            out += (f" {self.faster.label} is as good at this sample and decodes faster ({fast.setting}: "
                    f"{fast.ratio:.2f}x fp16's tokens/s against {mine.ratio:.2f}x, step bands apart) for "
                    f"{100 * (self.faster.share - row.share):.0f} more points of fp16's bytes: the buy where speed "
                    "counts more than those bytes.")
        return out


def recommend(results: VerdictResults, budget: float, context: int, speeds: SpeedTable | None = None
              ) -> Recommendation:
    """What to use under `budget` at `context`: fit, keep the model, then as good / fewest bytes / faster (the
    module's docstring). The runner-up is the best row of another scheme that fits and keeps the model."""
    if not 0 < budget <= 1:
        raise ValueError(f"budget is a share of fp16's bytes in (0, 1], got {budget}")
    rows = [r for r in results.at(context) if r.scheme != BASELINE]
    fits = sorted((r for r in rows if r.share <= budget), key=lambda r: r.interval(METRIC).estimate)
    kept = [r for r in fits if keeps_model(r)]
    smallest = min((r.share for r in rows), default=1.0)
    smallest_kept = min((r.share for r in rows if keeps_model(r)), default=None)
    if not kept:
        return Recommendation(budget, context, None, None, (), fits[0] if fits else None, smallest, smallest_kept,
                              results.kl_floor, speeds)
    tied = tuple(r for r in kept if not any(_beats(x, r, results.kl_floor) for x in kept))
    least = min(r.share for r in tied)
    near = sorted((r for r in tied if r.share < least + BYTES_TIE), key=lambda r: r.share)
    pick = near[0]
    if speeds is not None:
        quicker = [r for r in near[1:] if speeds.faster(r.label, pick.label)]
        pick = max(quicker, key=lambda r: speeds.first(r.label).ratio) if quicker else pick
    runner_up = next((r for r in kept if r.scheme != pick.scheme), None)
    return Recommendation(budget, context, pick, runner_up, tied, None, smallest, smallest_kept, results.kl_floor,
                          speeds)


def recommendations(results: VerdictResults, budgets: tuple[float, ...] = BUDGETS,
                    contexts: list[int] | None = None, speeds: SpeedTable | None = None) -> list[Recommendation]:
    """`recommend` for every budget at every context (the committed ones by default)."""
    return [recommend(results, b, c, speeds) for c in (contexts or results.contexts) for b in budgets]


def _standing_case(results: VerdictResults, scheme: str, budget: float, context: int
                   ) -> tuple[str, Recommendation, list[Row], list[Row]]:
    """Which case of `standing` a scheme is in under a budget ("none fits", "breaks", "recommended", "tied",
    "behind"), with the recommendation, its rows that fit (lowest KL first) and those of them that keep the model."""
    rec = recommend(results, budget, context)
    own = [r for r in results.at(context) if r.scheme == scheme]
    if not own:
        raise ValueError(f"{results.model} has no {scheme} rows at {context}")
    fits = sorted((r for r in own if r.share <= budget), key=lambda r: r.interval(METRIC).estimate)
    kept = [r for r in fits if keeps_model(r)]
    case = ("none fits" if not fits else "breaks" if not kept else "recommended" if rec.pick.scheme == scheme
            else "tied" if kept[0] in rec.tied else "behind")
    return case, rec, fits, kept


def standing(results: VerdictResults, scheme: str, budget: float, context: int) -> str:
    """Where one scheme stands under a budget: the recommendation, or its best row that fits and keeps the model
    against the recommendation (through `compare`), or why none of its rows qualifies."""
    case, rec, fits, kept = _standing_case(results, scheme, budget, context)
    where = f"under {100 * budget:.0f}% at {context_label(context)}"
    if case == "none fits":
        smallest = min(r.share for r in results.at(context) if r.scheme == scheme)
        return f"{where}: no {scheme} row fits (its smallest share is {100 * smallest:.0f}%)"
    if case == "breaks":
        return (f"{where}: every {scheme} row that fits breaks the model (its best, {fits[0].label}, has mean KL "
                f"{fits[0].interval(METRIC).text()})")
    if case == "recommended":
        return f"{where}: {scheme} is the recommendation ({rec.pick.label}, {rec.why})"
    if case == "tied":
        return (f"{where}: {kept[0].label} ({100 * kept[0].share:.0f}%) is as good as the best at this sample; "
                f"{rec.pick.label} ({100 * rec.pick.share:.0f}%) is recommended for {rec.why}")
    return f"{where}: " + compare(rec.pick.label, rec.pick.interval(METRIC), kept[0].label,
                                  kept[0].interval(METRIC), "mean KL", floor=results.kl_floor).sentence()


def standing_cell(results: VerdictResults, scheme: str, budget: float, context: int) -> str:
    """`standing` in a few words, for a grid of budgets and contexts: "picked: X", "Y as good; X picked (N% of
    fp16)", "Y behind X (intervals apart)", "every row that fits breaks the model", "no row fits"."""
    case, rec, _, kept = _standing_case(results, scheme, budget, context)
    if case == "none fits":
        return "no row fits"
    if case == "breaks":
        return "every row that fits breaks the model"
    if case == "recommended":
        return f"picked: {rec.pick.label}"
    if case == "tied":
        return f"{kept[0].label} as good; {rec.pick.label} picked ({100 * rec.pick.share:.0f}% of fp16)"
    return f"{kept[0].label} behind {rec.pick.label} (intervals apart)"


# -- tables -------------------------------------------------------------------------------------------------------

TABLE_HEAD = ("budget", "recommended, runner-up", "mean KL [95%]", "top-1 [95%]", "speed", "runner-up")


def recommendation_table(recs: list[Recommendation]) -> str:
    """The recommendations as a plain-text table, two lines a budget (the recommended row with its share of fp16's
    bytes, then the runner-up and how it compares): what notebook 12 keeps and nbval checks."""
    cells = [TABLE_HEAD] + [line for r in recs for line in r.cells()]
    widths = [max(len(row[i]) for row in cells) for i in range(len(TABLE_HEAD))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells)


def markdown_table(results: VerdictResults, budgets: tuple[float, ...] = BUDGETS,
                   speeds: SpeedTable | None = None) -> str:
    """Budgets down, contexts across: the recommended row with its share, mean KL and top-1, and how it stands to
    the runner-up (docs/results.md's table, checked against the committed file by the tests)."""
    head = " | ".join(f"{context_label(c)} tokens" for c in results.contexts)
    lines = [f"| budget (of fp16's bytes) | {head} |", "|---|" + "---|" * len(results.contexts)]
    for budget in budgets:
        cells = []
        for context in results.contexts:
            rec = recommend(results, budget, context, speeds)
            if rec.pick is None and rec.broken is None:
                cells.append(f"none fits (smallest {100 * rec.smallest:.0f}%)")
                continue
            if rec.pick is None:
                cells.append(f"fits, but breaks ({rec.broken.label}, KL {rec.broken.interval(METRIC).estimate:.2g})"
                             f": {rec.raise_to}")
                continue
            row = rec.pick
            cell = (f"**{row.label}** {100 * row.share:.0f}%, KL {row.interval(METRIC).text()}, top-1 "
                    f"{row.interval('top1').estimate:.2f}")
            speed = rec.speed(row)
            if speed is not None:
                cell += f", decode {speed.short()}"
            if rec.runner_up is not None:
                said = rec.comparison
                word = ("ahead of" if said.distinguishable else
                        f"below {rec.kl_floor:g} with" if said.below_floor else "as good as")
                cell += (f"; {word} {rec.runner_up.label} ({100 * rec.runner_up.share:.0f}%, "
                         f"{rec.runner_up.interval(METRIC).text()})")
            cells.append(cell)
        lines.append(f"| {100 * budget:.0f}% | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def speed_rows(recs: list[Recommendation], speeds: SpeedTable) -> list[dict[str, str]]:
    """Each row recommended or named runner-up, once, with its decode speed in every committed setting."""
    labels = list(dict.fromkeys(r.label for rec in recs for r in (rec.pick, rec.runner_up) if r is not None))
    return [{"row": label, **{s.setting: s.short() for s in speeds.of(label)}} for label in labels]


# -- the verdict in five sentences ------------------------------------------------------------------------------

LEAD_MODEL = "smollm2-135m"  # every layer grows, as in Llama or Qwen: the verdict's first answer
SECOND_MODEL = "gemma3-270m"  # sliding windows: most layers stay fp16, so its shares stay high
SECOND_BUDGETS = (0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6)  # its smallest shares are high: finer steps above them


def against_baseline(rows: list[Speed], speeds: SpeedTable) -> str:
    """Which rows' step-time bands lie apart from `KVCache`'s in their own run, faster or slower, and how many
    overlap it: what the medians' range alone cannot say."""
    base = {run.file: run.of(BASELINE_LABEL) for f in speeds.files for run in f.runs()}
    rows = list({(s.file, s.measured_as): s for s in rows}.values())  # each measured row once
    faster = [s.measured_as for s in rows if s.faster_than(base[s.file])]
    slower = [s.measured_as for s in rows if base[s.file].faster_than(s)]
    said = ([f"faster than `KVCache` with the step-time bands (10th-90th percentile) apart: {', '.join(faster)}"]
            if faster else []) + ([f"slower with the bands apart: {', '.join(slower)}"] if slower else [])
    rest = len(rows) - len(faster) - len(slower)
    if rest:
        said.append(f"{'the other' if said else 'all'} {rest} overlap{'s' if rest == 1 else ''} `KVCache`'s band")
    return "; ".join(said)


def summary(speeds: SpeedTable) -> list[str]:
    """The README's verdict: five plain sentences read from the committed files, each naming where it comes from."""
    lead, second = load_verdict(LEAD_MODEL), load_verdict(SECOND_MODEL)
    safe, lost = floor_gap(floor_evidence(second))
    safe_kl, lost_kl = safe.row.interval(METRIC).estimate, lost.row.interval(METRIC).estimate
    out = [f"**Keep the model first.** A cache is recommended only where its mean KL against fp16 is at most "
           f"{KEEP_KL:g} and its top-1 agreement at least {100 * KEEP_TOP1:.0f}%: on {second.model} every row inside "
           f"that floor retrieved passkeys as fp16 does, and the first row to lose them ({lost.row.label} at "
           f"{context_label(lost.row.context)}, {lost.retrieval.estimate * lost.retrieval.n:.0f} of "
           f"{lost.retrieval.n} keys) sits {lost_kl / safe_kl:.0f}x above the last row clearly below it "
           f"(`field-h200.json`, `{second.path.name}`)."]
    context = lead.contexts[-1]
    half, third = recommend(lead, 0.5, context, speeds), recommend(lead, 0.3, context, speeds)
    text = f"**A model whose every layer grows.** On {lead.model} at {context_label(context)} tokens, "
    text += (f"{half.pick.label} keeps the model in {100 * half.pick.share:.0f}% of fp16's bytes (mean KL "
             f"{half.pick.interval(METRIC).estimate:.2g})" if half.pick else "nothing under half of fp16's bytes "
             "keeps the model")
    text += ("; under 30% " + (f"{third.pick.label} does ({100 * third.pick.share:.0f}%)" if third.pick else
                               f"every row that fits breaks it ({third.raise_to})"))
    out.append(text + f" (`{lead.path.name}`, eight passages, 95% intervals).")
    smallest = [(c, recommend(lead, 1.0, c).smallest_kept) for c in lead.contexts]
    shares = " and ".join(f"{100 * s:.0f}% of fp16's bytes at {context_label(c)}" for c, s in smallest if s)
    falls = len(smallest) > 1 and smallest[-1][1] < smallest[0][1]
    out.append(("**Longer contexts reach smaller caches.** " if falls else "**The smallest cache that keeps it.** ")
               + f"The smallest row that keeps {lead.model} stores {shares}"
               + (": the fp16 sinks and tails are a fixed cost a longer context spreads thinner." if falls else "."))
    at = second.contexts[-1]
    rows = [r for r in second.at(at) if r.scheme != BASELINE]
    out.append(f"**A model of sliding windows saves less.** {second.model}'s policy keeps its sliding windows and "
               f"last layer fp16 and quantizes {rows[0].quantized_layers} layers, so at {context_label(at)} no row "
               f"stores less than {100 * min(r.share for r in rows):.0f}% of fp16's bytes "
               f"(`{second.path.name}`).")
    cpu = [s for f in speeds.files if f.source.setting.startswith("CPU") for s in
           (f.of(r.label) for r in lead.at(lead.contexts[0]) if r.scheme != BASELINE) if s.measured]
    gpu = [s for f in speeds.files if f.source.setting == "GPU, batch 1" for s in
           (f.of(r.label) for r in lead.at(lead.contexts[0]) if r.scheme != BASELINE) if s.measured]
    text = "**Speed at batch 1.** By median step the quantized caches decode at "
    if cpu:
        text += (f"{min(s.ratio for s in cpu):.2f}-{max(s.ratio for s in cpu):.2f}x fp16's tokens a second on this "
                 f"project's CPU (`{cpu[0].file}`; no fused kernel runs on the CPU, and a cache whose codes "
                 "`mx.quantized_matmul` cannot read is decoded each step)")
    if gpu:
        text += (f"; on the GPU, through their fused kernels, {min(s.ratio for s in gpu):.2f}-"
                 f"{max(s.ratio for s in gpu):.2f}x (" + " and ".join(f"`{name}`" for name in dict.fromkeys(
                     s.file for s in gpu)) + f", {gpu[0].device}; {against_baseline(gpu, speeds)})")
    out.append(text + ". docs/gpu-performance.md says where the memory they save buys speed: more sequences at once.")
    return out
