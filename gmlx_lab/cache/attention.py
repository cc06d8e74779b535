"""Attention math the caches share: masks, grouped-query scores and outputs, merging partial softmaxes, and
attention a slice of keys at a time, so a long cache is never decoded whole.

How mlx-lm models reach a cache's own `attend` is gmlx_lab/mlx_lm_hooks.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from .buffers import STORE_DTYPE

# What attention may hold beside the cache: a cache whose decoded K/V (and, on the CPU, where SDPA is not fused, its
# scores) would take more is decoded and attended a slice at a time, each slice's scores and decoded K/V within this
# size, so a prompt chunk's transient memory stays near it whatever the context.
SCRATCH_BYTES = 512 * 2**20
# On a GPU, SDPA holds no scores, and a prompt chunk's attention is evaluated before the next layer is built
# (mlx_lm_hooks.settled), so a chunk holds one layer's decoded K/V at a time: allowed up to this size (8 sequences
# of 32K tokens of Llama-3-8B's K/V are 1 GiB a layer), where slices would compute every score outside SDPA.
GPU_DECODED_BYTES = 2 * 2**30


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


def group_queries(queries: mx.array, kv_heads: int, scale: float) -> mx.array:
    """Queries (B, Hq, L, D) scaled and viewed as (B, Hkv, G, L, D): G = Hq / Hkv query heads share each KV head
    (grouped-query attention), so K is never copied."""
    b, hq, length, d = queries.shape
    return (queries * scale).reshape(b, kv_heads, hq // kv_heads, length, d)


def masked_scores(grouped: mx.array, keys: mx.array, mask: Any) -> mx.array:
    """Masked float32 scores (B, Hkv, G, L, T) of grouped queries (`group_queries`) over keys (B, Hkv, T, D)."""
    scores = grouped @ mx.expand_dims(keys, 2).swapaxes(-1, -2)
    if mask is not None and not isinstance(mask, str) and mask.ndim == 4:
        mask = mx.expand_dims(mask, 2)
    return apply_mask(scores, mask).astype(mx.float32)


def grouped_scores(queries: mx.array, keys: mx.array, scale: float, mask: Any) -> mx.array:
    """Masked float32 attention scores (B, Hkv, G, L, T) of queries (B, Hq, L, D) over keys (B, Hkv, T, D)."""
    return masked_scores(group_queries(queries, keys.shape[1], scale), keys, mask)


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


def quantized_attention(queries: mx.array, scale: float, mask: Any, codes: tuple[list[mx.array], list[mx.array]],
                        options: tuple[dict[str, Any], dict[str, Any]], tokens: int,
                        fp16: tuple[mx.array, mx.array] | None = None,
                        turn: Callable[[mx.array], mx.array] | None = None, k_channels: bool = False) -> mx.array:
    """Attention of queries (B, Hq, L, D) over the first `tokens` tokens of K and V stored as `mx.quantize` codes
    (`codes`: the K and V arrays it returns, rows (B, Hkv, rows, ...)) by two `mx.quantized_matmul` calls, so the
    codes are never decoded; `options`: mx.quantize's (group_size, bits, mode) for K and for V. `k_channels`: K is
    stored a block at a time with its channels as rows (B, Hkv, blocks, D, ...), quantized along the block's tokens
    (KIVI). `fp16`: further K and V tokens (B, Hkv, n, D) stored as they are, scored after the codes in one softmax
    (the mask, if any, covers codes then fp16 tokens). `turn`: a self-inverse rotation the codes live in (the
    normalized Hadamard transform): the queries turn into it for the codes' scores and the codes' share of the output
    turns back. The CPU computes in the queries' dtype (float32 there); a GPU in the stored scales' float16, as
    mlx-lm's quantized attention does."""
    b, hq, length, d = queries.shape
    hkv = codes[1][0].shape[1]
    g = hq // hkv
    dtype = queries.dtype if mx.default_device() == mx.cpu else STORE_DTYPE
    # a kv head's G x L queries as one matrix, so the codes are read once, not copied for each query head
    q = (queries * scale).astype(dtype).reshape(b, hkv, g * length, d)
    kc, vc = ([x.astype(dtype) if mx.issubdtype(x.dtype, mx.floating) else x for x in parts] for parts in codes)
    qc = turn(q) if turn else q
    if k_channels:  # each block's (D x block tokens) matrix times the queries: (B, Hkv, blocks, G L, block tokens)
        scores = mx.quantized_matmul(mx.expand_dims(qc, 2), *kc, transpose=False, **options[0])
        scores = scores.swapaxes(2, 3).reshape(b, hkv, g * length, -1)
    else:
        scores = mx.quantized_matmul(qc, *kc, transpose=True, **options[0])
    scores = scores.reshape(b, hkv, g, length, -1)
    if scores.shape[-1] != tokens:  # rows past `tokens` (a buffer's spare room) are not tokens
        scores = scores[..., :tokens]
    if fp16 is not None:
        q5 = q.reshape(b, hkv, g, length, d)
        scores = mx.concatenate([scores, q5 @ mx.expand_dims(fp16[0].astype(dtype), 2).swapaxes(-1, -2)], axis=-1)
    if mask is not None and not isinstance(mask, str) and mask.ndim == 4:
        mask = mx.expand_dims(mask, 2)
    probs = mx.softmax(apply_mask(scores, mask), axis=-1, precise=True)
    coded = probs[..., :tokens].reshape(b, hkv, g * length, tokens)
    rows = vc[0].shape[-2]
    if rows != tokens:  # zero weight for the spare rows
        coded = mx.pad(coded, [(0, 0)] * 3 + [(0, rows - tokens)])
    out = mx.quantized_matmul(coded, *vc, transpose=False, **options[1])
    out = (turn(out) if turn else out).reshape(b, hkv, g, length, -1)
    if fp16 is not None:
        out = out + probs[..., tokens:] @ mx.expand_dims(fp16[1].astype(dtype), 2)
    return out.reshape(b, hq, length, -1).astype(queries.dtype)


def merge_partials(parts: list[tuple[mx.array, mx.array]]) -> mx.array:
    """Merge attention outputs over disjoint key sets, weighting each by its softmax mass."""
    lses = mx.stack([lse for _, lse in parts])
    total = mx.logsumexp(lses, axis=0)
    out = 0
    for o, lse in parts:
        out = out + o * mx.exp(lse - total)[..., None].astype(o.dtype)
    return out


@dataclass(frozen=True)
class KeySlice:
    """Keys [start, stop) of a cache in the order its `fetch` returns them, and how to read them: `load(after)`
    gives their K and V (B, Hkv, stop - start, D) in the model's space, read from the stored arrays only once the
    arrays `after` are computed (`mx.depends`), so MLX decodes one slice at a time, not every slice up front."""

    start: int
    stop: int
    load: Callable[[list[mx.array]], tuple[mx.array, mx.array]]


def fits_scratch(queries: mx.array, keys: mx.array, values: mx.array) -> bool:
    """Whether SDPA over the whole fetched K/V fits its scratch: on a GPU, the decoded K/V within
    GPU_DECODED_BYTES; on the CPU (whose SDPA computes every score), the decoded K/V plus the float32 scores of
    every query over every key (up to six copies) within SCRATCH_BYTES."""
    b, hq, length, _ = queries.shape
    _, kv_heads, total, _ = keys.shape
    need = keys.dtype.size * b * kv_heads * total * (keys.shape[-1] + values.shape[-1])
    if mx.default_device().type != mx.DeviceType.cpu:
        return need <= GPU_DECODED_BYTES
    return need + 4 * 6 * b * hq * length * total <= SCRATCH_BYTES


def slice_tokens(queries: mx.array, kv_heads: int, head_dim: int, step: int = 1) -> int:
    """How many keys one slice may hold within SCRATCH_BYTES for these queries (B, Hq, L, D): a multiple of `step`
    (the cache's block), at least one step."""
    b, hq, length, _ = queries.shape
    # a key's share, float32: its scores (the product, the masked copy, the shift by the log-sum-exp, its exponent:
    # up to six arrays of scores at once, measured with mx.get_peak_memory) and its decoded K and V
    per_key = 4 * b * (6 * hq * length + 2 * kv_heads * head_dim)
    return max(step, SCRATCH_BYTES // per_key // step * step)


def decode_tokens(batch: int, kv_heads: int, dims: int, step: int = 1) -> int:
    """How many keys one slice may decode within SCRATCH_BYTES, `dims` the K and V head dims together: a decode
    holds a few float32 copies of its slice at once (codes unpacked, codebook values, a rotation: up to six,
    measured with mx.get_peak_memory). A multiple of `step` (the cache's block), at least one step."""
    per_key = 4 * 6 * batch * kv_heads * dims
    return max(step, SCRATCH_BYTES // per_key // step * step)


def gathered(slices: list[KeySlice]) -> tuple[mx.array, mx.array]:
    """Every slice's K and V in one array each, written in place a slice at a time, each slice decoded and evaluated
    before the next is read: a decode's intermediates exist for one slice at a time. Left to one graph, a backend
    that holds every array a queued kernel reads until the kernel has run (MLX's, on the GPU and the CPU) holds
    the whole cache's intermediates at once, several float32 copies of it."""
    total = slices[-1].stop
    keys = values = None
    for piece in slices:
        k, v = piece.load([])
        if keys is None:
            keys = mx.zeros((*k.shape[:2], total, k.shape[-1]), k.dtype)
            values = mx.zeros((*v.shape[:2], total, v.shape[-1]), v.dtype)
        keys[:, :, piece.start:piece.stop] = k
        values[:, :, piece.start:piece.stop] = v
        mx.eval(keys, values)
    return keys, values


def slice_mask(mask: Any, start: int, stop: int, queries: int, total: int) -> Any:
    """The columns [start, stop) of an mlx-lm mask over `total` keys for `queries` queries (None, "causal" aligned
    to the last key as mlx's SDPA aligns it, or an array)."""
    if mask is None:
        return None
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unknown mask {mask!r}; accepted: None, 'causal' or an array")
        first = total - queries  # the first query's position
        if stop <= first + 1:  # every key of the slice precedes every query
            return None
        return mx.arange(first, total)[:, None] >= mx.arange(start, stop)[None]
    return mask[..., start:stop]


def sliced_attention(queries: mx.array, scale: float, mask: Any, slices: list[KeySlice]) -> mx.array:
    """Softmax attention over every slice's keys as one softmax, a slice at a time, each slice's share merged into a
    running output by its log-sum-exp (as `merge_partials`): the result of SDPA over the keys concatenated, while
    only one slice's decoded K/V and scores exist at once."""
    b, hq, length, _ = queries.shape
    total, dtype = slices[-1].stop, queries.dtype
    grouped = out = lse = None
    for piece in slices:
        keys, values = piece.load([] if out is None else [out, lse])
        keys, values = keys.astype(dtype), values.astype(dtype)
        if grouped is None:
            grouped = group_queries(queries, keys.shape[1], scale)  # once: every slice reads the same
        scores = masked_scores(grouped, keys, slice_mask(mask, piece.start, piece.stop, length, total))
        part_lse = mx.logsumexp(scores, axis=-1)
        part = grouped_output(mx.exp(scores - part_lse[..., None]), values)
        part_lse = part_lse.reshape(b, hq, length)
        if out is None:
            out, lse = part, part_lse
        else:
            out, lse = merge_partials([(out, lse), (part, part_lse)]), mx.logaddexp(lse, part_lse)
    return out.astype(dtype)
