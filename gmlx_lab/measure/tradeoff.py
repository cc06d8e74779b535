"""Equal-memory comparisons: what a scheme's fidelity costs in cache bytes per token.

Comparing schemes at equal bit width hides what a user pays for: memory. kvarn keeps a 128-token sink,
its `kv_tail_tokens` newest tokens and the group being filled in fp16, a fixed cost that its codes must
earn back; affine pays a scale and offset per group of every token instead. Here each scheme's cache is
measured in bytes per token of context (the registry's byte formulas, through the policy: layers a scheme
does not take count as fp16), and its fidelity (decode median KL against fp16, from `fidelity`) is
placed against that.

    bytes_per_token(model, "kvarn4:tail=128", 1024)       # whole cache / context
    crossover(model, "kvarn4:tail=128", "affine8")        # first context from which kvarn stays smaller
    points = tradeoff_points(fidelity_result)             # KL against bytes per token, one point per scheme
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..registry import BASELINE, SCHEMES, get_scheme
from ..specs import SchemeLike, scheme_label, spec_policy
from .fidelity import FidelityResult
from .sizes import layer_bytes, layer_shapes, policy_bytes

__all__ = ["TradeoffPoint", "bytes_per_token", "crossover", "first_quantized_context", "pairs", "size_curves",
           "tradeoff_points", "versus", "versus_row"]


@dataclass(frozen=True)
class TradeoffPoint:
    """One scheme on one model at one context: cache bytes per token and decode median KL against fp16."""

    model: str
    label: str
    scheme: str
    bits: int | None  # the code width, the K width where K and V differ (None for fp16)
    v_bits: int | None  # the V width (None for fp16)
    tail: int | None  # kv_tail_tokens, for schemes that have one
    context: int  # tokens the cache held at the end of the run
    bytes_per_token: float  # resident cache bytes / context, growth reserve excluded
    fp16_bytes_per_token: float
    kl: float  # decode median KL(fp16 || scheme), nats

    @property
    def family(self) -> str:
        """The scheme and its tail: a family's points differ only in their widths."""
        return self.scheme + ("" if self.tail is None else f" tail={self.tail}")

    @property
    def split(self) -> bool:
        """K and V stored at different widths (kvarn k8v4)."""
        return self.bits != self.v_bits

    @property
    def width(self) -> str:
        """The widths as a figure labels them: "4", or "k8v4" where K and V differ ("" for fp16)."""
        if self.bits is None:
            return ""
        return f"k{self.bits}v{self.v_bits}" if self.split else f"{self.bits}"

    @property
    def share_of_fp16(self) -> float:
        return self.bytes_per_token / self.fp16_bytes_per_token


def bytes_per_token(model: Any, spec: SchemeLike, context: int) -> float:
    """Stored cache bytes of the whole model after `context` tokens under `spec`, divided by `context`."""
    if context < 1:
        raise ValueError(f"context must be >= 1 token, got {context}")
    _, chosen = spec_policy(model, spec)
    return policy_bytes(chosen, context) / context


def size_curves(model: Any, specs: Iterable[SchemeLike], contexts: Sequence[int]) -> dict[str, list[float]]:
    """Cache bytes per token at each context, per scheme label (the model is probed once per spec)."""
    if not contexts or min(contexts) < 1:
        raise ValueError(f"contexts must be a non-empty list of token counts >= 1, got {list(contexts)!r}")
    out = {}
    for spec in specs:
        _, chosen = spec_policy(model, spec)
        shapes = layer_shapes(chosen)
        out[chosen.label] = [policy_bytes(chosen, c, shapes) / c for c in contexts]
    return out


def crossover(model: Any, spec: SchemeLike, other: SchemeLike, max_context: int = 65536) -> int | None:
    """The first context from which `spec`'s cache stays smaller than `other`'s up to `max_context` tokens, or
    None if it is not smaller there. Exact to the token: kvarn's size drops at every sealed record, so the sizes
    are compared at every context (only the layers whose storage differs between the two are summed). Sizes are
    the byte formulas': the cache right after its latest token arrived, token by token (kvarn seals a group one
    token after it leaves the tail)."""
    if max_context < 1:
        raise ValueError(f"max_context must be >= 1, got {max_context}")
    (_, a), (_, b) = spec_policy(model, spec), spec_policy(model, other)
    contexts = range(1, max_context + 1)
    groups = Counter((shape, da.decision, db.decision) for shape, da, db in zip(layer_shapes(a), a.layers, b.layers)
                     if not da.decision == db.decision == BASELINE)  # fp16 in both: the same bytes
    diff = np.zeros(max_context)
    for (shape, da, db), count in groups.items():
        diff += count * (np.array([layer_bytes(shape, da, c, a.options) for c in contexts])
                         - np.array([layer_bytes(shape, db, c, b.options) for c in contexts]))
    if diff[-1] >= 0:
        return None
    not_smaller = np.flatnonzero(diff >= 0)
    return 1 if not_smaller.size == 0 else int(not_smaller[-1]) + 2


def first_quantized_context(model: Any, spec: SchemeLike, max_context: int = 1 << 16) -> int | None:
    """The smallest context at which a layer the scheme takes stores fewer bytes than fp16 (from its byte
    formula): below it everything is still fp16 (kvarn: sink, live group and tail; affine: 1). None if the
    policy takes no layer or nothing is quantized up to `max_context`."""
    _, chosen = spec_policy(model, spec)
    taken = [(s, d) for s, d in zip(layer_shapes(chosen), chosen.layers) if d.decision != BASELINE]
    if not taken:
        return None
    shape, d = taken[0]
    return next((c for c in range(1, max_context + 1) if layer_bytes(shape, d.decision, c, chosen.options)
                 < layer_bytes(shape, BASELINE, c, {})), None)


def _widths(scheme: str, values: dict[str, Any]) -> tuple[int | None, int | None]:
    """(K width, V width) for the report; (None, None) for fp16."""
    bits = get_scheme(scheme).bits(values)
    return (bits["k"], bits["v"]) if isinstance(bits, dict) else (bits, bits)


def tradeoff_points(result: FidelityResult | dict[str, Any]) -> list[TradeoffPoint]:
    """One point per scheme of a fidelity run (a `FidelityResult`, or its `to_dict()` as the benchmark JSON
    files under benchmarks/results/ store it, with or without the surrounding file): the cache's resident
    bytes at the end of the run per token, and its decode median KL."""
    if isinstance(result, FidelityResult):
        result = result.to_dict(per_position=False)
    data = result.get("result", result)
    for key in ("model", "prefill", "decode", "schemes"):
        if key not in data:
            raise ValueError(f"not a fidelity result: no {key!r} (expected FidelityResult.to_dict() or a "
                             "benchmarks/results/fidelity-*.json file)")
    context = data["prefill"] + data["decode"]
    points = []
    for s in data["schemes"]:
        scheme, options = s["scheme"], s.get("options") or {}
        if scheme not in SCHEMES or s["label"] != scheme_label(scheme, options):
            continue  # a scheme not registered here, or a probe such as layer_sensitivity's "... layer 3"
        values = get_scheme(scheme).resolve(**options)
        points.append(TradeoffPoint(data["model"], s["label"], scheme, *_widths(scheme, values),
                                    values.get("kv_tail_tokens"), context, s["cache_bytes"] / context,
                                    s["fp16_bytes"] / context, float(s["decode_median_kl"])))
    return points


def pairs(points: Sequence[TradeoffPoint], first: str = "kvarn", second: str = "affine", by: str = "memory",
          within: float = 0.02) -> list[tuple[TradeoffPoint, TradeoffPoint]]:
    """(first, second) pairs of one run's points to compare, sorted by the second's bytes per token.

    by="width": every `first` point with the width of a `second` point (K and V equal), one pair per width and
    tail. by="memory": for each `second` point, every `first` point with equal K and V widths within `within` x
    fp16's bytes per token of it, nearest first. Points with KL 0 (nothing quantized) are left out.
    """
    if by not in ("width", "memory"):
        raise ValueError(f"by={by!r} is not accepted; accepted: 'width', 'memory'")
    ours = [p for p in points if p.scheme == first and p.kl > 0 and not p.split]
    theirs = sorted((p for p in points if p.scheme == second and p.kl > 0 and not p.split),
                    key=lambda p: p.bytes_per_token)
    out = []
    for b in theirs:
        if by == "width":
            out += [(a, b) for a in ours if a.bits == b.bits]
            continue
        gap = {a.label: abs(a.bytes_per_token - b.bytes_per_token) for a in ours}
        near = sorted((a for a in ours if gap[a.label] < within * b.fp16_bytes_per_token), key=lambda a: gap[a.label])
        out += [(a, b) for a in near]
    return out


def versus_row(a: TradeoffPoint, b: TradeoffPoint) -> dict[str, str]:
    """`versus` as a table row (for `viz.Table`): each point's share of fp16's bytes and KL, and their KL ratio."""
    versus(a, b)  # the same refusal of a point with KL 0
    return {"scheme": a.label, "% of fp16": f"{100 * a.share_of_fp16:.1f}", "KL": f"{a.kl:.1e}", "beside": b.label,
            "its % of fp16": f"{100 * b.share_of_fp16:.1f}", "its KL": f"{b.kl:.1e}", "KL ratio": f"{a.kl / b.kl:.2g}"}


def versus(a: TradeoffPoint, b: TradeoffPoint) -> str:
    """Two points side by side with their KL ratio: "kvarn2 tail=0 (37.6% of fp16, KL 2.1e-03) beside affine4 g64
    (37.1%, KL 4.8e-03): KL ratio 0.43". One run has no interval, so this names no winner
    (`intervals.compare` does, over passages)."""
    if a.kl <= 0 or b.kl <= 0:
        raise ValueError(f"versus compares two points with KL > 0, got {a.label} ({a.kl}) and {b.label} ({b.kl})")
    return (f"{a.label} ({100 * a.share_of_fp16:.1f}% of fp16, KL {a.kl:.1e}) beside {b.label} "
            f"({100 * b.share_of_fp16:.1f}%, KL {b.kl:.1e}): KL ratio {a.kl / b.kl:.2g}")
