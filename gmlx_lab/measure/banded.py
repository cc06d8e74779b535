"""Fidelity with noise bands: every scheme on several passages and contexts, each number with its interval.

For each context C, every passage window runs once through the fp16 cache: C tokens of prefill, then `decode`
tokens one at a time (teacher-forced). Each scheme's cache then stores what the fp16 cache held after those
C tokens (`experiments.stored_prefix`: the same K/V for every scheme) and decodes the same `decode` tokens
one at a time. Per passage: mean and median KL(fp16 || scheme) in nats over the decode window, top-1
agreement with fp16, and the negative log-likelihood of the text; across passages each takes a bootstrap
interval (`intervals.bootstrap`). Perplexity is measured against the text and KL against fp16, so a
quantized cache can score a lower perplexity than fp16 by chance on a passage; KL is the fidelity measure
and perplexity is reported beside it, never used for a verdict.

The passages run as one batch. Where the model is an mlx-lm model with its vocabulary head on top
(`lm_head`, or tied embeddings), the decode steps run the transformer alone and the head runs once over a
window's hidden states, which gives the same logits at a fraction of the cost (checked on the first window).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..policy import Policy, PromptCache, policy
from ..registry import BASELINE
from ..specs import spec_policy
from .experiments import stored_prefix
from .intervals import Interval, bootstrap
from .passages import windows
from .sizes import layer_shapes, policy_bytes

METRICS = ("mean_kl", "median_kl", "top1", "nll")
PREFILL_STEP = 2048
WIDTHS = (2, 3, 4, 8)

# Every built-in scheme at 2/3/4/8 bits where it has them, at its default tail; kvarn also at the short tail
# (128 tokens, KIVI's default) so its fp16 tail does not hide its records at short contexts, and with K and V at
# different widths (which of the two needs the bits).
VERDICT_SPECS: tuple[str, ...] = (
    *(f"affine{b}" for b in WIDTHS), *(f"affine_rot{b}" for b in WIDTHS),
    *(f"kvarn{b}" for b in WIDTHS), *(f"kvarn{b}:tail=128" for b in WIDTHS),
    *(f"turboquant{b}" for b in WIDTHS), "mxfp4", "nvfp4", "mxfp8", *(f"kivi{b}" for b in WIDTHS),
    *(f"kvarn:{split},tail=128" for split in ("k8v4", "k4v8", "k4v2", "k2v4")),
)


def split_head(model: nn.Module) -> tuple[Callable[..., mx.array], Callable[[mx.array], mx.array]] | None:
    """(transformer, head) of an mlx-lm model whose logits are its head applied to `model.model`'s output."""
    inner = getattr(model, "model", None)
    if inner is None or not callable(inner):
        return None
    lm_head = getattr(model, "lm_head", None)
    if lm_head is not None:
        return inner, lm_head
    embed = getattr(inner, "embed_tokens", None)
    if embed is not None and hasattr(embed, "as_linear"):
        return inner, embed.as_linear
    return None


class _Runner:
    """Steps a batch of windows through a cache: prefill without the vocabulary head, decode to logits."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.parts = split_head(model)
        self.checked = False

    def prefill(self, tokens: mx.array, cache: PromptCache) -> None:
        run = self.parts[0] if self.parts else self.model
        for a in range(0, tokens.shape[1], PREFILL_STEP):
            mx.eval(run(tokens[:, a:a + PREFILL_STEP], cache=cache))

    def decode(self, tokens: mx.array, cache: PromptCache, block: bool = False) -> mx.array:
        """(batch, steps, vocab) logits, feeding `tokens` one column at a time (`block`: all as one update)."""
        if block:
            return self.model(tokens, cache=cache)
        outs = []
        before = copy.deepcopy(cache) if self.parts and not self.checked else None
        for i in range(tokens.shape[1]):
            step = tokens[:, i:i + 1]
            out = self.parts[0](step, cache=cache) if self.parts else self.model(step, cache=cache)
            mx.eval(out)
            outs.append(out)
        hidden = mx.concatenate(outs, axis=1)
        if not self.parts:
            return hidden
        logits = self.parts[1](hidden)
        if before is not None:  # the split must give the model's own logits
            full = self.model(tokens[:, :1], cache=before).astype(mx.float32)
            # the head's matmul over one row or many rounds differently; a softcap or scale moves logits by far more
            # than a rounding step of the compute type (float16: about 1e-3 of the largest logit)
            tolerance = 1e-4 if logits.dtype == mx.float32 else 1e-2
            error = mx.abs(full - logits[:, :1].astype(mx.float32)).max() / mx.abs(full).max()
            if error.item() > tolerance:
                raise RuntimeError(f"{type(self.model).__name__}: its head applied to model.model's output does not "
                                   "give its logits (a final softcap or scale?); banded_fidelity cannot split it")
            self.checked = True
        return logits


@dataclass
class Row:
    """One scheme at one context: bytes, and each metric per passage with its interval."""

    spec: str
    label: str
    scheme: str
    context: int
    quantized_layers: str
    bytes: float
    fp16_bytes: float
    per_passage: dict[str, list[float]]
    seconds: float = 0.0
    _intervals: dict[str, Interval] = field(default_factory=dict, repr=False, compare=False)

    @property
    def share(self) -> float:
        """Stored bytes as a share of fp16's at this context (the byte formulas, layers kept fp16 included)."""
        return self.bytes / self.fp16_bytes

    def interval(self, metric: str) -> Interval:
        """The metric's mean over passages with its bootstrap interval (perplexity: exp of the mean NLL); each is
        drawn once and kept, since figures and tables ask for the same ones many times."""
        if metric not in self._intervals:
            self._intervals[metric] = self._bootstrap(metric)
        return self._intervals[metric]

    def _bootstrap(self, metric: str) -> Interval:
        if metric == "perplexity":
            nll = bootstrap(self.per_passage["nll"])
            return Interval(float(np.exp(nll.estimate)), float(np.exp(nll.low)), float(np.exp(nll.high)), nll.n,
                            nll.method + ", of the mean NLL")
        if metric not in self.per_passage:
            raise ValueError(f"unknown metric {metric!r}; accepted: {', '.join(METRICS)}, perplexity")
        return bootstrap(self.per_passage[metric])

    def to_dict(self) -> dict[str, Any]:
        out = {"spec": self.spec, "label": self.label, "scheme": self.scheme, "context": self.context,
               "quantized_layers": self.quantized_layers, "bytes": self.bytes, "fp16_bytes": self.fp16_bytes,
               "share": self.share, "seconds": round(self.seconds, 2), "per_passage": self.per_passage}
        out["intervals"] = {m: self.interval(m).to_dict() for m in ("mean_kl", "median_kl", "top1", "perplexity")}
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Row:
        return cls(data["spec"], data["label"], data["scheme"], int(data["context"]), data["quantized_layers"],
                   float(data["bytes"]), float(data["fp16_bytes"]),
                   {k: [float(v) for v in vs] for k, vs in data["per_passage"].items()}, float(data.get("seconds", 0)))


class Reference:
    """The fp16 decode window of each passage, kept as what every scheme's KL needs: logits, p, log-normalizer."""

    def __init__(self, logits: mx.array):
        self.logits = [np.array(logits[i], dtype=np.float32) for i in range(logits.shape[0])]
        self.lse = [_logsumexp(z) for z in self.logits]
        self.p = [np.exp(z - lse[:, None].astype(np.float32)) for z, lse in zip(self.logits, self.lse)]
        self.top1 = [z.argmax(axis=-1) for z in self.logits]

    def metrics(self, logits: mx.array | None, targets: mx.array) -> dict[str, list[float]]:
        """Per passage: mean and median KL(fp16 || scheme) over the window, top-1 agreement, mean NLL (None: fp16).

        KL = sum_v p(v) (z_ref(v) - z(v)) + lse(z) - lse(z_ref), with z the logits: the two terms are small where
        the scheme is close, so float32 logits keep their precision (NumPy: MLX's CPU exp is several times slower).
        """
        out: dict[str, list[float]] = {m: [] for m in METRICS}
        goal = np.array(targets)
        for i in range(len(self.logits)):
            z = self.logits[i] if logits is None else np.array(logits[i], dtype=np.float32)
            lse = _logsumexp(z)
            kl = np.einsum("tv,tv->t", self.p[i], self.logits[i] - z, dtype=np.float64) + lse - self.lse[i]
            kl = np.maximum(kl, 0.0)
            out["mean_kl"].append(float(kl.mean()))
            out["median_kl"].append(float(np.median(kl)))
            out["top1"].append(float((z.argmax(axis=-1) == self.top1[i]).mean()))
            out["nll"].append(float((lse - np.take_along_axis(z, goal[i][:, None], axis=-1)[:, 0]).mean()))
        return out


def _logsumexp(z: np.ndarray) -> np.ndarray:
    """Row-wise log-sum-exp of float32 logits, summed in float64."""
    m = z.max(axis=-1, keepdims=True)
    return m[:, 0].astype(np.float64) + np.log(np.exp(z - m).sum(axis=-1, dtype=np.float64))


def banded_fidelity(model: nn.Module, tokenizer: Any, model_name: str, schemes: Iterable[str],
                    contexts: Sequence[int] = (1024,), decode: int = 256, count: int = 8,
                    on_row: Callable[[Row], None] | None = None) -> list[Row]:
    """Every scheme at every context on `count` passage windows (`passages.windows`), fp16 as the reference.

    Returns one Row per (context, scheme), fp16's own row first at each context; `on_row` sees each as it
    is made (a benchmark writes it out, so a long run can be stopped and kept).
    """
    contexts = sorted(int(c) for c in contexts)
    if not contexts or contexts[0] < 1 or decode < 1:
        raise ValueError(f"contexts must be >= 1 and decode >= 1, got contexts={contexts}, decode={decode}")
    if any(b - a < decode for a, b in zip(contexts, contexts[1:])):
        raise ValueError(f"contexts {contexts} must lie at least decode={decode} tokens apart: each decode window "
                         "runs through the fp16 cache before the next context's prefill")
    chosen = [spec_policy(model, s) for s in schemes]  # every spec checked before the long run
    batch = windows(model_name, tokenizer, contexts[-1] + decode + 1, count)
    tokens = mx.array([w.tokens for w in batch], dtype=mx.int32)
    runner = _Runner(model)
    reference = policy(model, BASELINE)
    shapes = layer_shapes(reference)
    ref_cache, done, rows = reference.make_cache(), 0, []
    for context in contexts:
        runner.prefill(tokens[:, done:context], ref_cache)
        snapshot = copy.deepcopy(ref_cache)
        window, targets = tokens[:, context:context + decode], tokens[:, context + 1:context + decode + 1]
        ref = Reference(runner.decode(window, ref_cache))
        done = context + decode
        fp16_bytes = policy_bytes(reference, context, shapes)
        found = [("fp16", reference)] + [(s, p) for s, p in chosen if p.scheme != BASELINE]
        for spec, chosen_policy in found:
            start = time.perf_counter()
            quantized = chosen_policy.as_dict()["quantized_layers"]
            # a policy that quantizes no layer builds fp16's caches: its outputs are the reference's
            logits = None if quantized == 0 else runner.decode(window, stored_prefix(snapshot, chosen_policy))
            row = Row(spec, chosen_policy.label, chosen_policy.scheme, context,
                      f"{quantized}/{len(chosen_policy.layers)}",
                      policy_bytes(chosen_policy, context, shapes), fp16_bytes, ref.metrics(logits, targets),
                      time.perf_counter() - start)
            rows.append(row)
            if on_row is not None:
                on_row(row)
        del snapshot, ref  # the fp16 copy and its logits (gigabytes at Gemma's vocabulary) go before the next prefill
    return rows


def policy_metrics(model: nn.Module, tokens: mx.array, context: int, decode: int, policies: Sequence[Policy], *,
                   block: bool = False, on_policy: Callable[[int, dict[str, list[float]]], None] | None = None,
                   ) -> list[dict[str, list[float]]]:
    """Per-passage metrics (`Reference.metrics`) of each policy at one context, on a batch of token windows.

    The method of `banded_fidelity` at one context: the fp16 cache prefills `context` tokens, each policy's cache
    stores what it held (`stored_prefix`), then the next `decode` tokens are fed, teacher-forced, one at a time;
    with `block`, as one update (reference too): the same stored K/V read back by every query, at a fraction of
    the cost, for probes that rank layers rather than report a fidelity."""
    if context < 1 or decode < 1 or tokens.shape[1] < context + decode + 1:
        raise ValueError(f"windows of {tokens.shape[1]} tokens cannot hold context {context} + decode {decode} + 1")
    runner = _Runner(model)
    ref_cache = policy(model, BASELINE).make_cache()
    runner.prefill(tokens[:, :context], ref_cache)
    snapshot = copy.deepcopy(ref_cache)
    window, targets = tokens[:, context:context + decode], tokens[:, context + 1:context + decode + 1]
    ref = Reference(runner.decode(window, ref_cache, block))
    out = []
    for i, chosen in enumerate(policies):
        quantized = chosen.as_dict()["quantized_layers"]
        logits = None if quantized == 0 else runner.decode(window, stored_prefix(snapshot, chosen), block)
        out.append(ref.metrics(logits, targets))
        if on_policy is not None:
            on_policy(i, out[-1])
    return out
