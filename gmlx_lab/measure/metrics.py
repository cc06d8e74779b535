"""Small, dependency-light quality metrics for MLX language models."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn


def perplexity(
    model: Any,
    tokens: Sequence[int] | mx.array,
    window: int = 1024,
    max_tokens: int = 8192,
    *,
    bos_id: int | None = None,
) -> float:
    """Perplexity of ``model`` on the first ``max_tokens`` of ``tokens``, in non-overlapping windows.

    Each window is scored on its own (no cache carried over) in float32; with ``bos_id`` every
    window is fed as ``[bos_id] + window`` so all of its tokens are predicted, otherwise the first
    token of each window is only context. The teaching model's logged figure uses
    ``window=512, max_tokens=2048, bos_id=tokenizer.bos_token_id`` on ``data/eval_text.txt``.
    """
    ids = mx.array(tokens).reshape(-1)[:max_tokens].astype(mx.int32)
    n = ids.shape[0]
    if n < 2:
        raise ValueError("perplexity needs at least two tokens")
    nll = 0.0
    count = 0
    for start in range(0, n, window):
        chunk = ids[start : start + window]
        if bos_id is not None:
            chunk = mx.concatenate([mx.array([bos_id], dtype=mx.int32), chunk])
        if chunk.shape[0] < 2:
            continue
        logits = model(chunk[None, :-1]).astype(mx.float32)
        losses = nn.losses.cross_entropy(logits[0], chunk[1:], reduction="sum")
        nll += losses.item()
        count += chunk.shape[0] - 1
    return math.exp(nll / count)


def kl_from_logprobs(ref_logp: mx.array, logp: mx.array) -> mx.array:
    """KL(p_ref || p) in nats over the last axis, from two float32 log-softmax arrays."""
    return mx.maximum(mx.sum(mx.exp(ref_logp) * (ref_logp - logp), axis=-1), 0.0)


def perplexity_from_nll(nll: Sequence[float]) -> float:
    """Perplexity from per-token negative log-likelihoods (nats): exp of their mean."""
    values = list(nll)
    if not values:
        raise ValueError("perplexity needs at least one token")
    return math.exp(sum(values) / len(values))


def wilson_interval(hits: int, trials: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval (95% for z=1.96) of a success rate `hits / trials`: (low, high).

    Unlike the normal approximation it stays inside [0, 1] and is not empty at 0 or `trials` hits, which is
    where a passkey run of a few dozen keys often lands (E. B. Wilson, JASA 1927).
    """
    if isinstance(hits, bool) or isinstance(trials, bool) or not all(isinstance(v, int) for v in (hits, trials)):
        raise ValueError(f"wilson_interval needs integer counts, got hits={hits!r}, trials={trials!r}")
    if trials < 1 or not 0 <= hits <= trials:
        raise ValueError(f"wilson_interval needs 0 <= hits <= trials and trials >= 1, got {hits} of {trials}")
    if z <= 0:
        raise ValueError(f"z must be > 0, got {z}")
    p, n, z2 = hits / trials, trials, z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return max(0.0, centre - half), min(1.0, centre + half)
