"""Attention math the caches share: masks, grouped-query scores and outputs, and merging partial softmaxes.

How mlx-lm models reach a cache's own `attend` is gmlx_lab/mlx_lm_hooks.py.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx


def apply_mask(scores: mx.array, mask: Any) -> mx.array:
    """Apply an mlx-lm mask (None, "causal", boolean or additive) to scores (..., L, T)."""
    if mask is None:
        return scores
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unknown mask {mask!r}; accepted: None, 'causal' or an array")
        q_len, k_len = scores.shape[-2:]
        mask = mx.arange(k_len - q_len, k_len)[:, None] >= mx.arange(k_len)[None]
    if mask.dtype == mx.bool_:
        return mx.where(mask, scores, mx.finfo(scores.dtype).min)
    return scores + mask


def grouped_scores(queries: mx.array, keys: mx.array, scale: float, mask: Any) -> mx.array:
    """Masked float32 attention scores (B, Hkv, G, L, T) of queries (B, Hq, L, D) over keys (B, Hkv, T, D).

    The Hq query heads are viewed as Hkv groups of G = Hq / Hkv, so each group shares
    its KV head (grouped-query attention) without copying K.
    """
    b, hq, length, d = queries.shape
    hkv = keys.shape[1]
    q = (queries * scale).reshape(b, hkv, hq // hkv, length, d)
    scores = q @ mx.expand_dims(keys, 2).swapaxes(-1, -2)
    if mask is not None and not isinstance(mask, str) and mask.ndim == 4:
        mask = mx.expand_dims(mask, 2)
    return apply_mask(scores, mask).astype(mx.float32)


def grouped_output(probs: mx.array, values: mx.array) -> mx.array:
    """Weights (B, Hkv, G, L, T) times values (B, Hkv, T, D), back to (B, Hq, L, D)."""
    b, hkv, g, length, _ = probs.shape
    out = probs.astype(values.dtype) @ mx.expand_dims(values, 2)
    return out.reshape(b, hkv * g, length, values.shape[-1])


def grouped_attention(
    queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any
) -> tuple[mx.array, mx.array]:
    """Softmax attention with GQA that also returns the log-sum-exp of each query's scores.

    Returns the output (B, Hq, L, D) and lse (B, Hq, L), so partial results over
    disjoint key sets can be merged into one softmax with `merge_partials`.
    """
    scores = grouped_scores(queries, keys, scale, mask)
    lse = mx.logsumexp(scores, axis=-1)
    out = grouped_output(mx.exp(scores - lse[..., None]), values)
    return out, lse.reshape(queries.shape[:3])


def merge_partials(parts: list[tuple[mx.array, mx.array]]) -> mx.array:
    """Merge attention outputs over disjoint key sets, weighting each by its softmax mass."""
    lses = mx.stack([lse for _, lse in parts])
    total = mx.logsumexp(lses, axis=0)
    out = 0
    for o, lse in parts:
        out = out + o * mx.exp(lse - total)[..., None].astype(o.dtype)
    return out
