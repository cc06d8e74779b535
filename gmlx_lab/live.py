"""Live comparison: generation under several schemes at once, streamed token by token.

Each scheme's text comes from `mlx_lm.stream_generate` with that scheme's cache; the streams advance in
lock step, one token per scheme per step. By default every column *samples* (temperature 0.6) from one shared
random stream: at step n every column adds the same Gumbel noise to its log-probabilities and takes the argmax
(the Gumbel-max trick, an exact sample). Two columns whose distributions agree draw the same token, so a column
parts from fp16's text only where its cache moved the distribution, and the fp16 text does not loop as greedy
text from a small model does. `temperature=0` is greedy decoding.

Every generated token carries KL(fp16 || scheme) of the distribution it was drawn from, against fp16's
distribution after the same tokens: while a column's text equals fp16's, that is the fp16 column's own
distribution; once it diverges, an fp16 "shadow" cache (a copy of fp16's prompt cache) is fed the column's
tokens, so both distributions keep seeing the same context.

    live = LiveCompare(model, tokenizer, prompt_ids, ["fp16", "affine4", "kvarn4:tail=128"], max_tokens=64)
    for step in live.stream():      # after each step every column holds one more token
        print(step, [c.text for c in live.columns])
    live.columns[2].kl              # nats, one per generated token
    live.columns[2].holdings()      # tokens per region of a quantized layer: sink, records, live, tail
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np

from .kv_inspect import first_divergence
from .measure.audit import AuditReport, audit, fp16_equivalent
from .measure.experiments import prefill
from .measure.tradeoff import TradeoffPoint
from .models import BUNDLED_NAME, available_models
from .models.gemma3 import NAME as GEMMA_NAME
from .policy import PromptCache, policy
from .registry import BASELINE, get_scheme
from .specs import spec_policy

__all__ = ["GEMMA", "TEMPERATURE", "LiveColumn", "LiveCompare", "holdings", "quantized_tokens", "quick_model",
           "shared_draw"]

TEMPERATURE = 0.6  # the live compare's default sampling temperature (0: greedy)
GEMMA = GEMMA_NAME  # the model the live compare prefers on a GPU

# memory_regions' token counts, as the live compare names them ("body" is what kvarn has sealed into records)
REGION_NAMES = {"sink": "sink", "body": "records", "live": "live group", "tail": "tail"}


def holdings(cache: PromptCache) -> dict[str, int]:
    """Tokens in each region of the first layer the policy quantizes: e.g. {"sink": 128, "records": 256,
    "live group": 3, "tail": 128} for kvarn, {"quantized": 400} for affine, {"fp16": 400} when no layer is
    quantized. Every quantized layer of a policy holds the same split (they see the same tokens)."""
    chosen = cache.policy
    for c, d in zip(cache, chosen.layers):
        if d.decision != BASELINE:
            regions, counts = c.memory_regions()
            if counts is not None:
                return {REGION_NAMES.get(k, k): int(v) for k, v in counts.items()}
            resident = sum(regions.values())  # every region spans every token: all codes, or all still fp16
            return {"quantized" if resident < fp16_equivalent(c, d) else "fp16": int(getattr(c, "offset", 0))}
    return {"fp16": int(max((getattr(c, "offset", 0) for c in cache), default=0))}


def quantized_tokens(regions: dict[str, int]) -> int:
    """Tokens a cache holds as codes, from `holdings`: kvarn's records, or all of a quantized affine layer."""
    return regions.get("records", regions.get("quantized", 0))


def quick_model() -> tuple[str, str]:
    """The live compare's model on this machine, and why: Gemma 3 270M where MLX computes on a GPU (it has outlier
    channels and attention sinks, and streams quickly there), the bundled teaching model on a CPU."""
    names = {m.name for m in available_models()}
    if mx.default_device() == mx.gpu and GEMMA in names:
        return GEMMA, "MLX runs on this machine's GPU, where Gemma 3 270M streams quickly"
    if mx.default_device() == mx.gpu:
        return BUNDLED_NAME, f"{GEMMA} is not installed here, so the bundled teaching model"
    return BUNDLED_NAME, (f"MLX runs on the CPU here, where the bundled teaching model streams quickly; "
                          f"{GEMMA} streams too, but far more slowly")


def shared_draw(logprobs: mx.array, noise: mx.array, temperature: float) -> mx.array:
    """One token from `logprobs` (1, vocab): the argmax of logprobs / temperature + `noise`, a Gumbel sample per
    vocabulary entry (the Gumbel-max trick: an exact sample of the distribution at `temperature`). Columns that
    share the noise draw the same token wherever their distributions agree, and differ with a probability that
    shrinks with the distance between them. `temperature` 0: the most likely token (greedy)."""
    if temperature <= 0:
        return mx.argmax(logprobs, axis=-1)
    return mx.argmax(logprobs.astype(mx.float32) / temperature + noise, axis=-1)


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
    """`max_tokens` tokens after `prompt` under each scheme spec, fp16 first, in lock step.

    `specs`: scheme specs as `fidelity` reads them ("affine4", "kvarn4:tail=128", ("kvarn", {...})); fp16 is
    added first if missing. Every column draws its n-th token with the same random noise (`seed`), at
    `temperature` (0: greedy). Generation stops at `max_tokens` or at the tokenizer's end-of-sequence token.
    """

    def __init__(self, model: Any, tokenizer: Any, prompt: Sequence[int], specs: Sequence[Any],
                 max_tokens: int = 64, temperature: float = TEMPERATURE, seed: int = 0):
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        if not temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0: greedy), got {temperature}")
        self.prompt = [int(t) for t in prompt]
        if not self.prompt:
            raise ValueError("the prompt is empty: give at least one token id")
        self.model, self.tokenizer, self.max_tokens = model, tokenizer, max_tokens
        self.temperature, self.seed = float(temperature), seed
        # one random key per step, shared by every column (mlx-lm samples one token past the last it yields)
        self.keys = mx.random.split(mx.random.key(seed), max_tokens + 1)
        chosen = [spec_policy(model, s) for s in specs]  # every spec checked before anything runs
        if not any(p.scheme == BASELINE for _, p in chosen):
            chosen.insert(0, (BASELINE, policy(model, BASELINE)))
        chosen.sort(key=lambda sp: sp[1].scheme != BASELINE)  # fp16 first: its step comes before the others
        self.columns = [LiveColumn(p.label, p.scheme, dict(p.options), p.make_cache(), i == 0)
                        for i, (_, p) in enumerate(chosen)]
        self.prompt_cache: PromptCache | None = None  # fp16's cache after the prompt: the shadows start from it
        self.prefilled = 0  # columns whose cache holds the prompt

    @property
    def context(self) -> int:
        """Tokens in the longest cache: the prompt plus the tokens generated so far."""
        return max(c.context for c in self.columns)

    @property
    def sampling(self) -> str:
        """How the columns draw their tokens, in words."""
        if self.temperature == 0:
            return "greedy: every column takes its most likely token"
        return (f"sampled at temperature {self.temperature:g}: at each step every column draws with the same "
                f"random numbers (seed {self.seed}), so columns part only where a cache moved the distribution")

    def prefill(self) -> Iterator[LiveColumn]:
        """Run the prompt (all but its last token, as mlx-lm does) into each column's cache, yielding each column
        when done; fp16's cache is then copied for the shadows. `stream` calls it first if it has not run."""
        for col in self.columns[self.prefilled:]:
            prefill(self.model, self.prompt[:-1], col.cache)
            if col.reference:
                self.prompt_cache = copy.deepcopy(col.cache)
            self.prefilled += 1
            yield col

    def _sampler(self) -> Any:
        """A column's sampler: its n-th call draws with the n-th step's noise, the same for every column."""
        calls = 0

        def sample(logprobs: mx.array) -> mx.array:
            nonlocal calls
            key, calls = self.keys[calls], calls + 1
            noise = mx.random.gumbel(logprobs.shape[-1:], key=key) if self.temperature > 0 else None
            return shared_draw(logprobs, noise, self.temperature)

        return sample

    def stream(self) -> Iterator[int]:
        """Advance every column by one token per step; yields the number of steps done so far."""
        from mlx_lm import stream_generate

        for _ in self.prefill():
            pass
        streams = [stream_generate(self.model, self.tokenizer, self.prompt[-1:], max_tokens=self.max_tokens,
                                   prompt_cache=c.cache, sampler=self._sampler()) for c in self.columns]
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
                col.finished = response.finish_reason is not None
            yield step
            if all(c.finished for c in self.columns):
                return

    def _shadow(self, col: LiveColumn) -> mx.array:
        """fp16's next-token log-probabilities after the prompt and `col`'s tokens (its shadow cache, a copy of
        fp16's prompt cache fed the column's tokens; only the last token's logits are computed)."""
        if col.shadow is None:
            col.shadow, col.shadow_fed = copy.deepcopy(self.prompt_cache), len(self.prompt) - 1
        ids = (self.prompt + col.tokens)[col.shadow_fed:]
        if len(ids) > 1:
            prefill(self.model, ids[:-1], col.shadow)
        out = _log_softmax(self.model(mx.array(ids[-1:])[None], cache=col.shadow)[0, -1])
        mx.eval(out)
        col.shadow_fed += len(ids)
        return out

    def run(self) -> LiveCompare:
        """Generate to the end without stopping in between."""
        for _ in self.stream():
            pass
        return self

    def parted_at(self, col: LiveColumn) -> int | None:
        """The first token where `col`'s text differs from fp16's (None: the same all along)."""
        return first_divergence(self.columns[0].tokens, col.tokens)

    def summary(self) -> str:
        """What the run shows, in Markdown built from its values: which column kept fp16's text longest, which
        is closest to fp16 in distribution, and which cache is the largest (the verdicts computed, not assumed)."""
        others = [c for c in self.columns if not c.reference]
        if not others or not self.columns[0].kl:
            raise ValueError("summary needs a run (call run()) with at least one scheme besides fp16")
        by_label = {p.label: p for p in self.points()}
        model = by_label[self.columns[0].label].model
        kept = sorted(others, key=lambda c: len(c.tokens) if self.parted_at(c) is None else self.parted_at(c),
                      reverse=True)
        lines = [f"**What this run shows** ({len(self.columns[0].tokens)} tokens after a {len(self.prompt)}-token "
                 f"prompt, {model}; {self.sampling}):", ""]
        parts = [f"{c.label} " + ("all along" if self.parted_at(c) is None else f"until token {self.parted_at(c)}")
                 for c in kept]
        lines.append(f"- fp16's text is kept longest by **{kept[0].label}**: " + "; ".join(parts) + ".")
        fp16_still = [c for c in others if quantized_tokens(c.holdings()) == 0]
        if fp16_still:
            which = "that cache is" if len(fp16_still) == 1 else "those caches are"
            lines.append(f"- {', '.join(c.label for c in fp16_still)} quantized nothing yet: the fp16 sink and tail "
                         f"cover the whole {self.context}-token context, so {which} fp16, at fp16's size (a longer "
                         "`text before` or a shorter tail changes that).")
        others = [c for c in others if c not in fp16_still]
        if not others:
            return "\n".join(lines)
        mean = {c.label: float(np.mean(c.kl)) if c.kl else 0.0 for c in others}
        close, far = min(others, key=lambda c: mean[c.label]), max(others, key=lambda c: mean[c.label])
        if close is not far:
            lines.append(f"- Closest to fp16's distribution: **{close.label}**, mean KL {mean[close.label]:.1e} nats "
                         f"per token, {mean[far.label] / max(mean[close.label], 1e-30):.3g} times below "
                         f"{far.label}'s {mean[far.label]:.1e}.")
        share = {c.label: by_label[c.label].share_of_fp16 for c in others}
        big, small = max(others, key=lambda c: share[c.label]), min(others, key=lambda c: share[c.label])
        lines.append(f"- The largest quantized cache is **{big.label}** ({100 * share[big.label]:.0f}% of fp16's"
                     + (f"), the smallest {small.label} ({100 * share[small.label]:.0f}%)." if big is not small
                        else ")."))
        if close is big and big is not small:
            lines.append(f"- So the column closest to fp16 is also the largest cache: at equal width {close.label} "
                         "spends more memory, and the figure under the columns places every cache at its bytes "
                         "per token, where schemes compare at equal memory.")
        elif close is not big:
            lines.append(f"- The column closest to fp16 is not the largest cache: {close.label} is closer with "
                         f"{'less' if share[close.label] < share[big.label] else 'as much'} memory than {big.label}.")
        return "\n".join(lines)

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
