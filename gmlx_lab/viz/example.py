"""The book's running example: one model, one layer, one KV head and one 128-token tile, followed from 01 to 07.

Gemma 3 270M where it is installed (it has attention sinks and outlier channels, as large models do), else the
bundled teaching model. The layer is the one whose K has the strongest outlier channel over the first
`EXAMPLE_TOKENS` tokens of the bundled evaluation text, KV head 0 (Gemma 3 270M has one), and the tile is tokens
128-255: the first kvarn record, right after the 128-token fp16 sink. Every page finds the same layer by the same
rule, so the pages agree without naming a number that their own run does not show.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..cache.kvarn.records import SINK_TOKENS, TILE
from ..kv_inspect import Capture
from ..models import BUNDLED_NAME, available_models
from ..models.gemma3 import NAME as EXAMPLE_MODEL
from ..policy import Policy
from ..registry import BASELINE
from .quant import outlier_ratio

EXAMPLE_TOKENS = 256  # tokens of the evaluation text each page captures
EXAMPLE_HEAD = 0


def example_model() -> str:
    """The running example's model on this machine: Gemma 3 270M where installed, else the bundled model."""
    return EXAMPLE_MODEL if any(m.name == EXAMPLE_MODEL for m in available_models()) else BUNDLED_NAME


@dataclass(frozen=True)
class RunningExample:
    """One layer, KV head and 128-token tile of a captured model, and how far its K's largest channel sticks out."""

    model: str
    layer: int
    head: int
    tile: tuple[int, int]  # [start, end) token positions of the first kvarn record
    outlier: float  # the K outlier ratio of the layer over the captured tokens (`outlier_ratio`)

    def k(self, cap: Capture) -> Any:
        """The tile's keys (128, head_dim) from a capture of this model."""
        return cap.k(self.layer, self.head)[self.tile[0]:self.tile[1]]

    def v(self, cap: Capture) -> Any:
        """The tile's values (128, head_dim)."""
        return cap.v(self.layer, self.head)[self.tile[0]:self.tile[1]]

    def banner(self) -> str:
        """One line for the top of a page: which model, layer, head and tile the page follows."""
        fallback = "" if self.model == EXAMPLE_MODEL else (
            f" (the book follows {EXAMPLE_MODEL}; this run follows the model loaded above, by the same rule)")
        return (f"**Running example** (pages 01-07): **{self.model}**{fallback}, layer **{self.layer}** (its K has the "
                f"strongest outlier channel, {self.outlier:.0f}x the median channel), KV head {self.head}, tokens "
                f"{self.tile[0]}-{self.tile[1] - 1} (the first record after the fp16 sink).")

    def fate(self, pol: Policy) -> str:
        """What a policy does with the example's layer, in words."""
        d = pol.layers[self.layer]
        kept = "is stored as " + pol.label if d.decision != BASELINE else f"stays fp16 ({d.reason})"
        return f"Under {pol.label}, the running example's layer {self.layer} {kept}."


def running_example(cap: Capture) -> RunningExample:
    """The running example of a capture: the layer whose KV head 0 has the strongest K outlier channel."""
    if len(cap.tokens) < SINK_TOKENS + TILE:
        raise ValueError(f"the running example needs a capture of at least {SINK_TOKENS + TILE} tokens, got "
                         f"{len(cap.tokens)}; accepted: kv_inspect.capture(model, eval_tokens(tokenizer, "
                         f"{EXAMPLE_TOKENS}))")
    ratios = {i: outlier_ratio(cap.k(i, EXAMPLE_HEAD)) for i in cap.layers}
    layer = max(ratios, key=ratios.get)
    return RunningExample(cap.model, layer, EXAMPLE_HEAD, (SINK_TOKENS, SINK_TOKENS + TILE), ratios[layer])
