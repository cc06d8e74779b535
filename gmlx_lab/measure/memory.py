"""Memory truth: the bytes each scheme's cache really holds, by layer and region, against fp16.

`memory_report` runs the model once over `context` tokens with the fp16 cache and
then replays every layer's real K/V into each scheme's cache (bytes depend only on
shapes, so this gives the exact resident bytes of a real run without one model pass
per scheme). `prefill_peak` measures MLX's peak memory during prefill at several
prefill step sizes (mx.get_peak_memory works on the CPU backend too).

A model's own sliding-window layers (mlx-lm's RotatingKVCache) count their steady state at fp16: the window's
tokens (right after a prefill chunk RotatingKVCache briefly holds window - 1 + chunk tokens, in the model's
dtype: float32 on this CPU; the next token trims it). Sliding layers a policy override quantizes are our
caches and count what they hold, like any other.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import RotatingKVCache

from ..cache import FP16Cache, GmlxCache
from ..policy import PromptCache, policy
from ..registry import BASELINE
from ..specs import SchemeLike, spec_policy
from .audit import fp16_equivalent

__all__ = ["LayerMemory", "MemoryReport", "SchemeMemory", "memory_report", "prefill_peak"]


@dataclass
class LayerMemory:
    """One layer: resident bytes by region, and fp16's bytes for the same tokens in each region."""

    index: int
    decision: str
    tokens: int
    regions: dict[str, int]  # bytes, growth reserve excluded
    region_tokens: dict[str, int]
    fp16_regions: dict[str, int]  # what fp16 holds for each region's tokens
    reserve: int

    @property
    def resident(self) -> int:
        return sum(self.regions.values())

    @property
    def fp16_bytes(self) -> int:
        return sum(self.fp16_regions.values())


@dataclass
class SchemeMemory:
    """One scheme's cache at the report's context."""

    label: str
    layers: list[LayerMemory]

    @property
    def resident(self) -> int:
        return sum(m.resident for m in self.layers)

    @property
    def fp16_bytes(self) -> int:
        return sum(m.fp16_bytes for m in self.layers)

    @property
    def ratio(self) -> float:
        return self.resident / max(self.fp16_bytes, 1)

    def by_region(self) -> dict[str, tuple[int, int]]:
        """Region -> (resident bytes, fp16 bytes for the same tokens), over all layers."""
        out: dict[str, tuple[int, int]] = {}
        for m in self.layers:
            for name, nbytes in m.regions.items():
                have, fp16 = out.get(name, (0, 0))
                out[name] = (have + nbytes, fp16 + m.fp16_regions.get(name, 0))
        return out


@dataclass
class MemoryReport:
    """Resident cache bytes of several schemes at one context; a table in Jupyter."""

    model: str
    context: int
    schemes: list[SchemeMemory] = field(default_factory=list)

    def __getitem__(self, label: str) -> SchemeMemory:
        for s in self.schemes:
            if s.label == label:
                return s
        raise KeyError(label)

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "context": self.context, "schemes": [
            {"label": s.label, "resident": s.resident, "fp16_bytes": s.fp16_bytes, "ratio": s.ratio,
             "by_region": {k: {"bytes": a, "fp16_bytes": b} for k, (a, b) in s.by_region().items()},
             "layers": [{**asdict(m), "resident": m.resident, "fp16_bytes": m.fp16_bytes} for m in s.layers]}
            for s in self.schemes]}

    def to_markdown(self) -> str:
        """Per scheme: total KiB, % of fp16, and each region's KiB and % of fp16 for its tokens."""
        rows = ["| scheme | cache KiB | fp16 KiB | ratio | regions (KiB, % of fp16 for those tokens) |",
                "|---|---|---|---|---|"]
        for s in self.schemes:
            parts = ", ".join(f"{k} {a / 1024:.0f}" + (f" ({100 * a / b:.1f}%)" if b else "")
                              for k, (a, b) in s.by_region().items() if a)
            rows.append(f"| {s.label} | {s.resident / 1024:.0f} | {s.fp16_bytes / 1024:.0f} "
                        f"| {100 * s.ratio:.1f}% | {parts} |")
        return "\n".join(rows) + f"\n\n{self.model} at {self.context} tokens (growth reserve excluded)"

    def layers_markdown(self, label: str) -> str:
        """One scheme, one row per layer."""
        s = self[label]
        rows = ["| layer | decision | tokens | KiB | fp16 KiB | ratio | regions (bytes) |",
                "|---|---|---|---|---|---|---|"]
        for m in s.layers:
            rows.append(f"| {m.index} | {m.decision} | {m.tokens} | {m.resident / 1024:.1f} | "
                        f"{m.fp16_bytes / 1024:.1f} | {100 * m.resident / max(m.fp16_bytes, 1):.1f}% | "
                        f"{', '.join(f'{k}={v}' for k, v in m.regions.items())} |")
        return "\n".join(rows)

    def _repr_markdown_(self) -> str:
        return self.to_markdown()


def _layer_memory(cache: Any, d: Any) -> LayerMemory:
    """Bytes by region for one cache entry, with fp16's bytes for the same tokens per region."""
    tokens = getattr(cache, "offset", 0)
    fp16_total = fp16_equivalent(cache, d)
    kept = getattr(cache, "held", tokens)  # a rolling window holds fewer tokens than arrived
    per_token = fp16_total / kept if kept else 0
    if isinstance(cache, RotatingKVCache) and d.kv_heads is not None:  # the model's window, steady, at fp16
        held = min(tokens, cache.max_size)
        nbytes = d.kv_heads * held * (d.k_head_dim + d.v_head_dim) * 2
        return LayerMemory(d.index, d.decision, tokens, {"window": nbytes}, {"window": held}, {"window": nbytes}, 0)
    if not isinstance(cache, GmlxCache):
        return LayerMemory(d.index, d.decision, tokens, {"native": cache.nbytes}, {"native": tokens},
                           {"native": cache.nbytes}, 0)
    reserve = cache.regions().get("reserve", 0)
    regions, counts = cache.memory_regions()
    spans_all = counts is None  # every region spans every token (codes and their scales)
    if spans_all:
        counts = {name: kept for name in regions}
    fp16 = {name: round(per_token * counts[name]) for name in regions}
    if spans_all and len(regions) > 1:  # the fp16 bytes of those tokens, counted once
        fp16 = {name: fp16_total if i == 0 else 0 for i, name in enumerate(regions)}
    return LayerMemory(d.index, d.decision, tokens, regions, counts, fp16, reserve)


def stream_cache(model: nn.Module) -> PromptCache:
    """fp16 caches that hold every token of every attention layer, sliding ones too: the K/V stream a memory
    report replays into each scheme's caches. (The model builds its sliding mask from the first sliding layer's
    cache; all of them are FP16Caches here, so the mask spans every token and keeps the model's window.)"""
    chosen = policy(model, BASELINE)
    out = chosen.make_cache()
    for i, d in enumerate(chosen.layers):
        if d.kind == "sliding-window":
            out[i] = FP16Cache(layer=d.index)
    return out


def memory_report(model: nn.Module, schemes: Iterable[SchemeLike] = ("fp16", "affine4", "affine8", "kvarn4",
                                                                     "kvarn6"),
                  context: int = 4096, tokens: Sequence[int] | mx.array | None = None,
                  chunk: int = 2048, max_kv_size: int | None = None) -> MemoryReport:
    """Exact resident cache bytes per scheme, layer and region at `context` tokens, with fp16's for the same.

    `tokens` default: random ids (the bytes do not depend on the values). The fp16 run's K/V
    are replayed into each scheme's caches in chunks of `chunk` tokens. `max_kv_size`: the growing
    attention layers are rolling windows of that many tokens (the bytes stop growing at the window).
    """
    if context < 1:
        raise ValueError(f"context must be >= 1, got {context}")
    candidates = [spec_policy(model, s) for s in schemes]
    if tokens is None:
        vocab = model.args.vocab_size if hasattr(model, "args") and hasattr(model.args, "vocab_size") else 256
        ids = mx.random.randint(0, vocab, (context,), key=mx.random.key(0))
    else:
        ids = mx.array(tokens, dtype=mx.int32).reshape(-1)[:context]
        if ids.size < context:
            raise ValueError(f"context {context} needs {context} tokens, got {ids.size}")
    ref = stream_cache(model)
    for start in range(0, context, chunk):
        mx.eval(model(ids[None, start:start + chunk], cache=ref))
    report = MemoryReport(getattr(model, "gmlx_name", None) or ref.policy.name, context)
    for _, chosen in candidates:
        cache = chosen.windowed(max_kv_size).make_cache()
        for i, (entry, source) in enumerate(zip(cache, ref)):
            if isinstance(entry, (GmlxCache, RotatingKVCache)) and isinstance(source, FP16Cache):
                keys, values = source.state[:2]
                for start in range(0, context, chunk):
                    k, v = entry.update_and_fetch(keys[..., start:start + chunk, :].astype(mx.float32),
                                                  values[..., start:start + chunk, :].astype(mx.float32))
                    mx.eval(k, v)
                if isinstance(entry, GmlxCache):
                    entry.settle()  # what the next token would do first: seal due records, roll a window
            else:
                cache[i] = source  # the model's own entry (window, recurrent): the same under every scheme
        report.schemes.append(SchemeMemory(chosen.label, [_layer_memory(c, d) for c, d in
                                                          zip(cache, chosen.layers)]))
    return report


def prefill_peak(model: nn.Module, scheme: SchemeLike = "kvarn6", context: int = 2048,
                 steps: Sequence[int] = (256, 512, 1024, 2048), tokens: Sequence[int] | mx.array | None = None
                 ) -> list[dict[str, Any]]:
    """MLX peak memory (bytes) during a `context`-token prefill at each prefill step size.

    Each entry: step, peak (mx.get_peak_memory after a reset), above_start (peak minus memory
    active before the prefill: weights excluded), cache_bytes at the end, seconds.
    """
    _, chosen = spec_policy(model, scheme)
    ids = (mx.random.randint(0, 256, (context,), key=mx.random.key(0)) if tokens is None
           else mx.array(tokens, dtype=mx.int32).reshape(-1)[:context])
    out = []
    for step in steps:
        cache = chosen.make_cache()
        mx.clear_cache()
        start_bytes = mx.get_active_memory()
        mx.reset_peak_memory()
        t0 = time.perf_counter()
        for start in range(0, context, step):
            mx.eval(model(ids[None, start:start + step], cache=cache))
        seconds = time.perf_counter() - t0
        peak = mx.get_peak_memory()
        out.append({"scheme": chosen.label, "context": context, "step": step, "peak": peak,
                    "above_start": peak - start_bytes, "cache_bytes": cache.nbytes, "seconds": round(seconds, 2)})
        del cache
    return out
