"""Noise bands: a measured value with its 95% interval, and the one function that says which of two is better.

Fidelity is measured on several passages, and a passage is the unit of noise: the interval of a statistic is
a percentile bootstrap over passages (resample the passages with replacement, recompute the statistic,
take the 2.5th and 97.5th percentiles of 10,000 draws, seeded so a result file reads the same every time).
Counts (passkey keys found) take the Wilson score interval.

`compare` is how the lab states a winner: only where the two intervals do not overlap; otherwise it says the
two are indistinguishable at this sample. Overlap is a conservative rule (two intervals can overlap while a
paired test would separate them), chosen because a learner can check it by eye on every figure.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from .metrics import wilson_interval

CONFIDENCE = 0.95
DRAWS = 10_000

# Words that name a winner outright. No notebook text or output uses them: a winner is named by `compare`'s
# sentence, which does so only where the intervals are apart (tests/test_verdict.py, tests/test_browser.py).
WINNER_WORDS = re.compile(r"\b(wins?|won|winning|winners?|beats?|beaten|loses|outperforms?|better than|worse than|"
                          r"more sensitive|less sensitive)\b", re.IGNORECASE)


@dataclass(frozen=True)
class Interval:
    """An estimate with its 95% interval, the sample size behind it and how the interval was made."""

    estimate: float
    low: float
    high: float
    n: int
    method: str

    def __post_init__(self) -> None:
        if not self.low <= self.estimate <= self.high:
            raise ValueError(f"an interval needs low <= estimate <= high, got {self.low}, {self.estimate}, "
                             f"{self.high}")

    def overlaps(self, other: Interval) -> bool:
        return self.low <= other.high and other.low <= self.high

    def text(self, digits: int = 2) -> str:
        """'0.012 [0.0091, 0.016]': the estimate and its interval, each to `digits` significant digits."""
        return f"{_g(self.estimate, digits)} [{_g(self.low, digits)}, {_g(self.high, digits)}]"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Interval:
        return cls(float(data["estimate"]), float(data["low"]), float(data["high"]), int(data["n"]),
                   str(data["method"]))


def _g(x: float, digits: int) -> str:
    """`digits` significant digits; a whole number too long for them below 100,000 whole (558, not 5.6e+02)."""
    return f"{x:.0f}" if 10**digits <= abs(x) < 1e5 else f"{x:.{digits}g}"


def bootstrap(values: Sequence[float], statistic: Callable[[np.ndarray], float] = np.mean,
              seed: int = 0) -> Interval:
    """The statistic of `values` (one per passage) with its 95% percentile-bootstrap interval over them."""
    x = np.asarray(values, dtype=np.float64)
    if x.ndim != 1 or x.size < 2:
        raise ValueError(f"a bootstrap interval needs at least 2 values in a flat list, got shape {x.shape}")
    if not np.all(np.isfinite(x)):
        raise ValueError("a bootstrap interval needs finite values; got NaN or inf")
    rng = np.random.default_rng(seed)
    draws = x[rng.integers(0, x.size, size=(DRAWS, x.size))]
    stats = np.apply_along_axis(statistic, 1, draws) if statistic not in (np.mean, np.median) else \
        statistic(draws, axis=1)
    tail = 100 * (1 - CONFIDENCE) / 2
    low, high = np.percentile(stats, [tail, 100 - tail])
    estimate = float(statistic(x))
    return Interval(estimate, float(min(low, estimate)), float(max(high, estimate)), int(x.size),
                    f"percentile bootstrap over {x.size} passages, {DRAWS} draws")


STEP_SPREAD = "10th-90th percentile of timed steps"


def step_spread(median: float, p10: float, p90: float, steps: int) -> Interval:
    """A timing: the median of `steps` timed steps with their 10th-90th percentile as the band (a spread of the
    steps themselves, wider than an interval of the median; benchmarks keep these three numbers)."""
    return Interval(median, p10, p90, steps, STEP_SPREAD)


def wilson(hits: int, trials: int) -> Interval:
    """A success rate with its Wilson score 95% interval."""
    low, high = wilson_interval(hits, trials)
    rate = hits / trials  # the bounds' arithmetic can land a rounding step inside 0 or 1 at 0 or all hits
    return Interval(rate, min(low, rate), max(high, rate), trials, f"Wilson score over {trials} trials")


@dataclass(frozen=True)
class Comparison:
    """Two named measurements of one metric, and what may be said of them."""

    a: str
    b: str
    metric: str
    a_value: Interval
    b_value: Interval
    lower_is_better: bool = True
    floor: float = 0.0  # values whose whole interval lies below it are the measurement's noise, not a difference

    @property
    def below_floor(self) -> bool:
        return max(self.a_value.high, self.b_value.high) < self.floor

    @property
    def distinguishable(self) -> bool:
        return not self.a_value.overlaps(self.b_value) and not self.below_floor

    @property
    def winner(self) -> str | None:
        """The better of the two, or None where their intervals overlap."""
        if not self.distinguishable:
            return None
        a_better = (self.a_value.estimate < self.b_value.estimate) == self.lower_is_better
        return self.a if a_better else self.b

    def sentence(self) -> str:
        """One sentence a notebook or the CLI may print: a winner only where the intervals do not overlap."""
        values = f"{self.a_value.text()} against {self.b_value.text()}"
        n = self.a_value.n if self.a_value.n == self.b_value.n else f"{self.a_value.n}/{self.b_value.n}"
        bands = (f"10th-90th percentile ranges of {n} steps" if STEP_SPREAD in (self.a_value.method,
                                                                                 self.b_value.method)
                 else f"95% intervals over {n}")
        if self.below_floor:
            return (f"{self.a} and {self.b} are indistinguishable: {self.metric} {values}, both below {self.floor:g}, "
                    "the floor of this measurement's arithmetic.")
        if self.winner is None:
            return (f"{self.a} and {self.b} are indistinguishable at this sample: {self.metric} {values}, "
                    f"{bands} overlap.")
        winner, loser = (self.a_value, self.b_value) if self.winner == self.a else (self.b_value, self.a_value)
        other = self.b if self.winner == self.a else self.a
        word = "lower" if self.lower_is_better else "higher"
        return (f"{self.winner} has {word} {self.metric} than {other}: {winner.text()} against {loser.text()}, "
                f"{bands} apart.")

    def row(self) -> dict[str, str]:
        """The comparison as a table row (for `viz.Table`): both values with their bands, and what may be said, a
        winner only where the bands are apart (as `sentence` says it)."""
        word = "lower" if self.lower_is_better else "higher"
        said = ("both below the floor" if self.below_floor else "bands overlap: neither" if self.winner is None
                else f"{self.winner}: {word}")
        return {"measured": self.a, self.metric: self.a_value.text(), "against": self.b,
                f"its {self.metric}": self.b_value.text(), "what it shows": said}

    def to_dict(self) -> dict[str, Any]:
        return {"a": self.a, "b": self.b, "metric": self.metric, "a_value": self.a_value.to_dict(),
                "b_value": self.b_value.to_dict(), "lower_is_better": self.lower_is_better, "floor": self.floor,
                "winner": self.winner, "sentence": self.sentence()}


def compare(a: str, a_value: Interval, b: str, b_value: Interval, metric: str = "mean KL",
            lower_is_better: bool = True, floor: float = 0.0) -> Comparison:
    """Compare two measurements: the lab's only way to name the better one (None where intervals overlap, or
    where both lie wholly below `floor`, the level the measurement's own arithmetic reaches)."""
    if not isinstance(a_value, Interval) or not isinstance(b_value, Interval):
        raise TypeError("compare needs two Interval values (gmlx_lab.measure.intervals.bootstrap or wilson); a bare "
                        "number carries no noise band")
    if floor < 0:
        raise ValueError(f"floor is a level of the metric, >= 0; got {floor}")
    return Comparison(a, b, metric, a_value, b_value, lower_is_better, floor)
