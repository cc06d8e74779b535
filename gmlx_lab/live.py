"""Live comparison: greedy generation under several schemes at once, streamed token by token.

Each scheme's text comes from `mlx_lm.stream_generate` with that scheme's cache; the streams advance in
lock step, one token per scheme per step. Every generated token carries KL(fp16 || scheme) of the
distribution it was drawn from, against fp16's distribution after the same tokens: while a column's text
equals fp16's, that is the fp16 column's own distribution; once it diverges, an fp16 "shadow" cache is fed
the column's tokens, so both distributions keep seeing the same context.

    live = LiveCompare(model, tokenizer, prompt_ids, ["fp16", "affine4", "kvarn4:tail=128"], max_tokens=64)
    for step in live.stream():      # after each step every column holds one more token
        print(step, [c.text for c in live.columns])
    live.columns[2].kl              # nats, one per generated token
    live.columns[2].holdings()      # tokens per region of a quantized layer: sink, records, live, tail
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np

from .measure.audit import AuditReport, audit, fp16_equivalent
from .measure.tradeoff import TradeoffPoint
from .policy import PromptCache, policy
from .registry import BASELINE, get_scheme
from .specs import spec_policy

__all__ = ["LiveColumn", "LiveCompare", "holdings", "quantized_tokens"]

# memory_regions' token counts, as the live compare names them ("body" is what kvarn has sealed into records)
REGION_NAMES = {"sink": "sink", "body": "records", "live": "live group", "tail": "tail"}


def holdings(cache: PromptCache) -> dict[str, int]:
    """Tokens in each region of the first layer the policy quantizes: e.g. {"sink": 128, "records": 256,
    "live group": 3, "tail": 128} for kvarn, {"quantized": 400} for affine, {"fp16": 400} when no layer is
    quantized. Every quantized layer of a policy holds the same split (they see the same tokens)."""
    chosen = cache.policy
    for c, d in zip(cache, chosen.layers):
        if d.decision != BASELINE:
            regions, counts = get_scheme(d.decision).memory_regions(c)
            if counts is not None:
                return {REGION_NAMES.get(k, k): int(v) for k, v in counts.items()}
            resident = sum(regions.values())  # every region spans every token: all codes, or all still fp16
            return {"quantized" if resident < fp16_equivalent(c, d) else "fp16": int(getattr(c, "offset", 0))}
    return {"fp16": int(max((getattr(c, "offset", 0) for c in cache), default=0))}


def quantized_tokens(regions: dict[str, int]) -> int:
    """Tokens a cache holds as codes, from `holdings`: kvarn's records, or all of a quantized affine layer."""
    return regions.get("records", regions.get("quantized", 0))


@dataclass
class LiveColumn:
    """One scheme's stream: its tokens, their text pieces and KL against fp16, and its cache."""

    label: str
    scheme: str
    options: dict[str, Any]  # the policy's options, resolved (defaults filled)
    cache: PromptCache
    reference: bool  # the fp16 column, which every KL is measured against
    tokens: list[int] = field(default_factory=list)
    pieces: list[str] = field(default_factory=list)
    kl: list[float] = field(default_factory=list)  # nats, KL(fp16 || scheme) at each generated token
    finished: bool = False
    tokens_per_s: float = float("nan")
    shadow: PromptCache | None = None  # fp16 cache fed this column's tokens, made when its text diverges
    shadow_fed: int = 0  # tokens the shadow holds

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    @property
    def context(self) -> int:
        """Tokens the cache holds now (prompt + generated tokens already fed back)."""
        return max((int(getattr(c, "offset", 0)) for c in self.cache), default=0)

    def holdings(self) -> dict[str, int]:
        return holdings(self.cache)

    def audit(self) -> AuditReport:
        """The cache's resident bytes by layer (growth reserve excluded) and fp16's for the same tokens."""
        return audit(self.cache, strict=False)

    @property
    def quantized_layers(self) -> str:
        d = self.cache.policy.as_dict()
        return f"{d['quantized_layers']}/{len(d['layers'])}"


def _log_softmax(logits: mx.array) -> mx.array:
    logits = logits.astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


class LiveCompare:
    """Greedy generation of `max_tokens` after `prompt` under each scheme spec, fp16 first, in lock step.

    `specs`: scheme specs as `fidelity` reads them ("affine4", "kvarn4:tail=128", ("kvarn", {...})); fp16 is
    added first if missing. Generation stops at `max_tokens` or at the tokenizer's end-of-sequence token.
    """

    def __init__(self, model: Any, tokenizer: Any, prompt: Sequence[int], specs: Sequence[Any],
                 max_tokens: int = 64):
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.prompt = [int(t) for t in prompt]
        if not self.prompt:
            raise ValueError("the prompt is empty: give at least one token id")
        self.model, self.tokenizer, self.max_tokens = model, tokenizer, max_tokens
        chosen = [spec_policy(model, s) for s in specs]  # every spec checked before anything runs
        if not any(p.scheme == BASELINE for _, p in chosen):
            chosen.insert(0, (BASELINE, policy(model, BASELINE)))
        chosen.sort(key=lambda sp: sp[1].scheme != BASELINE)  # fp16 first: its step comes before the others
        self.columns = [LiveColumn(p.label, p.scheme, dict(p.options), p.make_cache(), i == 0)
                        for i, (_, p) in enumerate(chosen)]

    @property
    def context(self) -> int:
        """Tokens in the longest cache: the prompt plus the tokens generated so far."""
        return max(c.context for c in self.columns)

    def stream(self) -> Iterator[int]:
        """Advance every column by one token per step; yields the number of steps done so far."""
        from mlx_lm import stream_generate

        streams = [stream_generate(self.model, self.tokenizer, self.prompt, max_tokens=self.max_tokens,
                                   prompt_cache=c.cache) for c in self.columns]
        ref = self.columns[0]
        for step in range(1, self.max_tokens + 1):
            ref_logp = None  # fp16's distribution after ref.tokens[:step - 1], once its column has stepped
            for col, gen in zip(self.columns, streams):
                if col.finished:
                    continue
                response = next(gen, None)
                if response is None or response.finish_reason == "stop":  # end of sequence: not shown
                    col.finished = True
                    continue
                logp = _log_softmax(response.logprobs)
                if col.reference:
                    ref_logp, kl = logp, 0.0
                else:
                    same = ref_logp is not None and col.tokens == ref.tokens[:len(col.tokens)]
                    p = ref_logp if same else self._shadow(col)
                    kl = float(mx.maximum(mx.sum(mx.exp(p) * (p - logp)), 0.0))
                col.kl.append(kl)
                col.tokens.append(int(response.token))
                col.pieces.append(response.text)
                col.tokens_per_s = response.generation_tps
                col.finished = response.finish_reason is not None
            yield step
            if all(c.finished for c in self.columns):
                return

    def _shadow(self, col: LiveColumn) -> mx.array:
        """fp16's next-token log-probabilities after the prompt and `col`'s tokens (its shadow cache)."""
        if col.shadow is None:
            col.shadow, col.shadow_fed = policy(self.model, BASELINE).make_cache(), 0
        ids = (self.prompt + col.tokens)[col.shadow_fed:]
        out = _log_softmax(self.model(mx.array(ids)[None], cache=col.shadow)[0, -1])
        mx.eval(out)
        col.shadow_fed += len(ids)
        return out

    def run(self) -> LiveCompare:
        """Generate to the end without stopping in between."""
        for _ in self.stream():
            pass
        return self

    def kl_summary(self) -> dict[str, float]:
        """Mean KL per generated token of each column, by label (fp16: 0)."""
        return {c.label: float(np.mean(c.kl)) if c.kl else 0.0 for c in self.columns}

    def points(self) -> list[TradeoffPoint]:
        """Each column as an equal-memory point: resident cache bytes per token of context at the end, and the
        median KL per generated token (fp16: 0)."""
        out = []
        name = getattr(self.model, "gmlx_name", None) or self.columns[0].cache.policy.name
        for c in self.columns:
            report, bits = c.audit(), get_scheme(c.scheme).bits(c.options)
            k, v = (bits["k"], bits["v"]) if isinstance(bits, dict) else (bits, bits)
            out.append(TradeoffPoint(name, c.label, c.scheme, k, v, c.options.get("kv_tail_tokens"), c.context,
                                     report.resident / c.context, report.fp16_bytes / c.context,
                                     float(np.median(c.kl)) if c.kl else 0.0))
        return out
