"""Batch and capacity: how many sequences each cache holds in a fixed memory budget, and how fast they decode there.

Reads the committed runs of benchmarks/batch_capacity.py (`benchmarks/results/batch_capacity-*.json`): a whole
model decoding a batch of sequences, every sequence's cache filled to the same context. A row's speed is the
median of its timed decode steps, its band the 10th-90th percentile of those steps (`intervals.step_spread`); a
batch of B sequences makes B tokens a step, so tokens/s = B x 1000 / ms a step, with the band carried over.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ..paths import RESULTS_DIR
from .intervals import Comparison, Interval, compare, step_spread

__all__ = ["BatchRow", "batch_rows", "compare_throughput", "markdown_table"]


@dataclass(frozen=True)
class BatchRow:
    """One scheme decoding `batch` sequences of `context` tokens: its cache's bytes and its speed with the band."""

    scheme: str  # the spec the benchmark ran ("mlx_lm_fp16", "kvarn4", ...)
    label: str
    batch: int
    context: int
    cache_bytes: int
    step_ms: Interval
    budget_bytes: int | None  # the capacity run's cache budget; None for a grid row (a batch chosen by hand)
    note: str  # what the file says limits this row, or ""

    @property
    def tokens_per_s(self) -> Interval:
        """Tokens a second with the band of the step times (a slower step makes fewer tokens)."""
        b = 1e3 * self.batch
        return Interval(b / self.step_ms.estimate, b / self.step_ms.high, b / self.step_ms.low, self.step_ms.n,
                        self.step_ms.method)


def batch_rows(file: str, part: str = "capacity") -> list[BatchRow]:
    """The rows of one committed batch_capacity file: `part` "capacity" (each scheme at the largest batch its cache
    holds within the budget) or "grid" (batches chosen by hand, every cache resident at once); failed rows left out."""
    if part not in ("capacity", "grid"):
        raise ValueError(f"part must be 'capacity' or 'grid', got {part!r}")
    data = json.loads((RESULTS_DIR / file).read_text())
    notes: dict[str, Any] = data.get("notes", {})
    out = []
    for r in data.get(part, []):
        if "error" in r or "step_ms_median" not in r:
            continue
        out.append(BatchRow(r["scheme"], r["label"], r["batch"], r["context"], r["cache_bytes"],
                            step_spread(r["step_ms_median"], r["step_ms_p10"], r["step_ms_p90"], r["timed_steps"]),
                            r.get("budget_bytes"), notes.get(r["scheme"], "")))
    return out


def compare_throughput(a: BatchRow, b: BatchRow) -> Comparison:
    """Tokens a second of two rows, named as `compare` names them (a winner only where the bands are apart)."""
    return compare(f"{a.label} ({a.batch} x {a.context // 1024}K)", a.tokens_per_s,
                   f"{b.label} ({b.batch} x {b.context // 1024}K)", b.tokens_per_s, "tokens/s", lower_is_better=False)


def markdown_table(rows: list[BatchRow]) -> str:
    """One line a row: sequences, cache GB, ms a step and tokens/s with their bands."""
    lines = ["| cache | sequences x context | cache GB | ms a step (p10-p90) | tokens/s (band) |",
             "|---|---|---|---|---|"]
    for r in rows:
        t = r.tokens_per_s
        lines.append(f"| {r.label} | {r.batch} x {r.context // 1024}K | {r.cache_bytes / 1e9:.1f} | "
                     f"{r.step_ms.estimate:.1f} ({r.step_ms.low:.1f}-{r.step_ms.high:.1f}) | "
                     f"{t.estimate:.0f} ({t.low:.0f}-{t.high:.0f}) |")
    return "\n".join(lines)
