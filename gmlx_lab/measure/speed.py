"""Decode speed beside fidelity: a scheme's whole-model decode speed against mlx-lm's fp16 `KVCache`, read from
the committed benchmark files, or "unmeasured" with the reason.

    speeds = committed_speeds()
    for s in speeds.of("kivi4 tail=128"):
        print(s.setting, s.text())            # GPU, batch 1  0.15x (66 steps; model_decode-....json)

Each setting is one file or a few (`SOURCES`), every ratio measured beside the baseline in one run (a row is read
from the first of a setting's files that has it; rows of two files are never compared):
- GPU, batch 1: `benchmarks/model_decode.py --shape llama3-8b --contexts 131072` (Llama-3-8B shapes, random fp16
  weights; at 128K `KVCache` steps at one speed, where at 32K its steps swing between two);
- GPU, batch 8: `benchmarks/batch_capacity.py --grid 8x32768 --fill prefill` (a scheme and `KVCache` prefilled
  through the model and decoding in turns, one scheme a run: an 80 GB card holds the pair, not all of them);
- CPU, batch 1: `benchmarks/model_decode.py` on the bundled model (float32 on this project's CPU).
A verdict row finds its speed by its scheme and widths (`speed_key`): its fp16 tail and the head-dim extension
are left out, since the tail is a small part of a long context's step, and the row read is named
("kvarn4 tail=128" is read from "kvarn4 tail=1024"). Fidelity comes from a small model and speed from these
shapes: decode speed depends on the cache's layout and kernels, not on the weights' values.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from ..paths import RESULTS_DIR
from .intervals import Interval, compare, step_spread

BASELINE_LABEL = "mlx-lm KVCache"


@dataclass(frozen=True)
class Source:
    """One committed speed file and the rows of it to read: one context, one weight width."""

    setting: str
    file: str
    context: int
    weight_bits: int = 16
    more: tuple[str, ...] = ()  # further runs of the setting, each beside its own baseline: a row `file` lacks

    @property
    def files(self) -> tuple[str, ...]:
        """Every run of the setting, in the order a row is looked for."""
        return (self.file, *self.more)


# The current code's runs: a newer run of the same setting replaces its file here (and the old file goes to
# docs/history with the text that cited it).
SOURCES: tuple[Source, ...] = (
    Source("GPU, batch 1", "model_decode-128k-field-072bc49-h100-80gb-hbm3.json", 131072,
           more=("model_decode-128k-rest-072bc49-h100-80gb-hbm3.json",)),
    Source("GPU, batch 8", "batch_capacity-w16-8x32k-prefill-kvarn4-072bc49-h100-80gb-hbm3.json", 32768,
           more=tuple(f"batch_capacity-w16-8x32k-prefill-{s}-072bc49-h100-80gb-hbm3.json"
                      for s in ("kivi4", "turboquant4", "affine4"))),
    Source("CPU, batch 1", "model_decode-71ce1b5-cpu.json", 4096),
)

_NOT_SPEED = re.compile(r" tail=\d+| ext")


def speed_key(label: str) -> str:
    """What sets a cache's decode speed in its label: the scheme and widths ("kvarn4 tail=128 ext" -> "kvarn4")."""
    return _NOT_SPEED.sub("", label).strip()


@dataclass(frozen=True)
class Speed:
    """One row's decode speed in one setting: its step time with its spread, over the baseline's in the same run;
    `steps` None where the row was not measured (`reason` says why)."""

    setting: str
    label: str  # the row asked for
    measured_as: str = ""  # the file's row that was read
    step_ms: Interval | None = None
    baseline_ms: float = 0.0
    file: str = ""
    commit: str = ""
    device: str = ""
    reason: str = ""

    @property
    def measured(self) -> bool:
        return self.step_ms is not None

    @property
    def ratio(self) -> float | None:
        """Tokens per second over the baseline's: the baseline's median step over this row's (above 1: faster)."""
        return self.baseline_ms / self.step_ms.estimate if self.step_ms is not None else None

    def short(self) -> str:
        """'0.87x GPU b1' or 'unmeasured'."""
        return f"{self.ratio:.2f}x {self.tag}" if self.measured else "unmeasured"

    @property
    def tag(self) -> str:
        """The setting in short: 'GPU, batch 1' -> 'GPU b1'."""
        return self.setting.replace(", batch ", " b")

    def text(self) -> str:
        """The ratio with where it comes from, or why there is none."""
        if not self.measured:
            return f"unmeasured: {self.reason}"
        read = "" if self.measured_as == self.label else f"read from {self.measured_as}, "
        return (f"{self.short()} fp16's tokens/s ({read}median of {self.step_ms.n} steps; {self.device}, "
                f"benchmarks/results/{self.file}, commit {self.commit})")

    def faster_than(self, other: Speed) -> bool:
        """True where this row's step-time band lies wholly below `other`'s in the same run (`intervals.compare`)."""
        if not (self.measured and other.measured) or self.file != other.file:
            return False
        if self.step_ms.low == self.step_ms.high or other.step_ms.low == other.step_ms.high:
            return False  # a file without the steps' spread: no band to compare
        said = compare(self.label, self.step_ms, other.label, other.step_ms, "ms a step")
        return said.winner == self.label


@dataclass(frozen=True)
class SpeedFile:
    """The rows of one `Source`, by label and by `speed_key`."""

    source: Source
    rows: dict[str, dict]
    baseline_ms: float
    commit: str
    device: str
    file: str  # which of the source's runs this is
    then: SpeedFile | None  # the source's next run, asked for a row this one lacks

    def runs(self) -> tuple[SpeedFile, ...]:
        """This run and the source's later ones, each with its own file, commit and device."""
        return (self,) + (self.then.runs() if self.then is not None else ())

    def of(self, label: str) -> Speed:
        setting, file = self.source.setting, self.file
        row = self.rows.get(label) or self.rows.get(speed_key(label))
        if row is None and self.then is not None:
            return self.then.of(label)
        if row is None:
            files = ", ".join(self.source.files)
            return Speed(setting, label, file=file, reason=f"{speed_key(label)} has no row in {files} (commit "
                                                            f"{self.commit})")
        if "decode_ms_median" in row:  # model_decode
            median, p10, p90, steps = (row["decode_ms_median"], row["decode_ms_p10"],
                                       row.get("decode_ms_p90", row["decode_ms_median"]), row["timed_tokens"])
        else:  # batch_capacity
            median, p10, p90, steps = row["step_ms_median"], row["step_ms_p10"], row["step_ms_p90"], row["timed_steps"]
        return Speed(setting, label, row["label"], step_spread(median, min(p10, median), max(p90, median), steps),
                     self.baseline_ms, file, self.commit, self.device)


def read_source(source: Source, folder: Path | None = None, run: int = 0) -> SpeedFile:
    """The rows of a source's committed speed files at its context and weight width, from its `run`-th file on (each
    row's ratio against its own file's baseline)."""
    name = source.files[run]
    path = (folder or RESULTS_DIR) / name
    if not path.is_file():
        raise FileNotFoundError(f"no speed file {path.name}; run benchmarks/model_decode.py or batch_capacity.py")
    data = json.loads(path.read_text())
    rows = data.get("rows") or data.get("grid") or []
    rows = [r for r in rows if r.get("context") == source.context
            and r.get("weight_bits", data.get("weight_bits", 16)) == source.weight_bits and "error" not in r]
    base = next((r for r in rows if r["label"] == BASELINE_LABEL), None)
    if base is None:
        raise ValueError(f"{name} has no {BASELINE_LABEL} row at {source.context} tokens and "
                         f"{source.weight_bits}-bit weights: nothing to take a ratio to")
    mine = [r for r in rows if r["label"] != BASELINE_LABEL and ", " not in r["label"]]  # ", ": probes, paths
    by_key = {**{speed_key(r["label"]): r for r in mine}, **{r["label"]: r for r in mine}, BASELINE_LABEL: base}
    median = base.get("decode_ms_median", base.get("step_ms_median"))
    then = read_source(source, folder, run + 1) if run + 1 < len(source.files) else None
    return SpeedFile(source, by_key, float(median), str(data.get("commit", "unknown"))[:7],
                     str(data.get("device", "unknown device")), name, then)


@dataclass(frozen=True)
class SpeedTable:
    """Every setting's speed file, asked per verdict row."""

    files: tuple[SpeedFile, ...]

    def of(self, label: str) -> list[Speed]:
        """The row's speed in every setting, in `SOURCES` order."""
        return [f.of(label) for f in self.files]

    def first(self, label: str) -> Speed:
        """The row's speed in the first setting that measured it (GPU before CPU), else why the first did not."""
        found = self.of(label)
        if any(s.measured for s in found):
            return next(s for s in found if s.measured)
        files = ", ".join(name for f in self.files for name in f.source.files)
        return Speed(found[0].setting, label, reason=f"{speed_key(label)} has no row in {files}")

    def pair(self, a: str, b: str) -> tuple[Speed, Speed] | None:
        """Two rows' speeds from the first setting that measured both (one run: a fair comparison), or None."""
        for f in self.files:
            sa, sb = f.of(a), f.of(b)
            if sa.measured and sb.measured:
                return sa, sb
        return None

    def faster(self, a: str, b: str) -> bool:
        """True where row a decodes faster than row b in the first setting that measured both (`Speed.faster_than`)."""
        found = self.pair(a, b)
        return found is not None and found[0].faster_than(found[1])


def committed_speeds(sources: tuple[Source, ...] = SOURCES) -> SpeedTable:
    """The committed speed files of the current code (`SOURCES`)."""
    return SpeedTable(tuple(read_source(s) for s in sources))
