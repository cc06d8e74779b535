"""Quantize real K/V rows and blocks the way each scheme does, and measure the error.

These helpers call the same MLX ops and record functions as the caches
(`mx.quantize`, `mx.hadamard_transform`, `records.encode_record`; `quant_error` asks
the scheme's registry entry), on numpy input, so a notebook can look at one row or
one record in isolation.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ..cache.kvarn import records
from ..registry import get_scheme

__all__ = ["AffineRow", "affine_row", "butterfly_stages", "even_share", "hadamard", "normalize_history",
           "normalize_rounds", "outlier_ratio", "outlier_row", "quant_error", "record_of"]


def hadamard(x: np.ndarray) -> np.ndarray:
    """The normalized Walsh-Hadamard transform of the last axis (its own inverse)."""
    return np.array(mx.hadamard_transform(mx.array(x, dtype=mx.float32)))


@dataclass
class AffineRow:
    """One row quantized affinely: its codes, each group's scale and offset, and the reconstruction."""

    values: np.ndarray
    codes: np.ndarray
    scales: np.ndarray
    offsets: np.ndarray
    recon: np.ndarray
    bits: int
    group_size: int


def affine_row(row: np.ndarray, bits: int = 4, group_size: int = 64) -> AffineRow:
    """Quantize one row with `mx.quantize` (affine mode, fp16 scales) and unpack its codes for display."""
    x = mx.array(np.asarray(row, np.float32)[None]).astype(mx.float16)
    w, s, b = mx.quantize(x, group_size=group_size, bits=bits)
    recon = mx.dequantize(w, s, b, group_size=group_size, bits=bits).astype(mx.float32)
    scales = np.array(s.astype(mx.float32))[0]
    offsets = np.array(b.astype(mx.float32))[0]
    recon_np = np.array(recon)[0]
    codes = np.rint((recon_np - np.repeat(offsets, group_size)) / np.repeat(np.where(scales == 0, 1, scales),
                                                                            group_size)).astype(int)
    return AffineRow(np.asarray(row, np.float32), codes, scales, offsets, recon_np, bits, group_size)


def record_of(block: np.ndarray, bits: int, kind: str, iters: int = 16, part: int = 0) -> records.Records:
    """Encode a (128 tokens, head_dim) block as the kvarn cache does: rotate over the whole head, then record the
    128-channel slice number `part` (head_dim 128: the only one)."""
    rotated = hadamard(block)[:, 128 * part : 128 * (part + 1)]
    if rotated.shape != (128, 128):
        raise ValueError(f"need 128 tokens and channel slice {part} of 128 channels; the block is {block.shape}")
    return records.encode_record(mx.array(rotated), bits, kind, iters)


def quant_error(x: np.ndarray, method: str, bits: int, group_size: int = 64, kind: str = "k") -> float:
    """Relative error ||x - x_hat|| / ||x|| of storing (tokens, head_dim) the way scheme `method` does.

    method: a registered scheme, e.g. "affine", "affine_rot" (Hadamard, affine, Hadamard back) or "kvarn"
    (rotation + records; tokens must be a multiple of 128, head_dim of 128); `bits` and `group_size` go to
    the schemes that have those options. The scheme's `roundtrip` does the storing.
    """
    scheme = get_scheme(method)
    names = {opt.name for opt in scheme.options}
    given = {k: v for k, v in (("bits", bits), ("group_size", group_size)) if k in names}
    x = np.asarray(x, np.float32)
    xh = scheme.roundtrip(x, kind, scheme.resolve(**given))
    return float(np.linalg.norm(x - xh) / max(np.linalg.norm(x), 1e-12))


def normalize_history(tile: np.ndarray, iters: int = 16) -> tuple[list[float], int]:
    """Imbalance of a (rows, cols) tile after each normalization round (round 0: unscaled) and the round kept."""
    rounds: list[mx.array] = []
    records.normalize(mx.array(np.asarray(tile, np.float32)), iters, history=rounds)
    history = [float(r.item()) for r in rounds]
    best = max(i for i, h in enumerate(history) if h <= min(history))  # ties go to the later round
    return history, best


def normalize_rounds(tile: np.ndarray, rounds: int) -> list[tuple[np.ndarray, float]]:
    """The tile as `records.normalize` leaves it after 0, 1, ..., `rounds` rounds: (scaled tile, imbalance) each.

    Each entry calls `records.normalize(tile, iters=r)` and applies the scales it keeps, so what is shown is
    what the cache does when it stops after r rounds.
    """
    t = mx.array(np.asarray(tile, np.float32))
    out = []
    for r in range(rounds + 1):
        s_row, s_col, _, score = records.normalize(t, r)
        scaled = t / (s_row[:, None] * s_col[None, :])
        out.append((np.array(scaled), float(score.item())))
    return out


def butterfly_stages(x: np.ndarray) -> list[np.ndarray]:
    """The vector after each butterfly stage of the normalized Walsh-Hadamard transform (stage 0: the input).

    Stage s pairs entries 2^(s-1) apart, (a, b) -> ((a + b), (a - b)) / sqrt(2); after log2(n) stages the
    result is `hadamard(x)`.
    """
    y = np.asarray(x, np.float64).copy()
    n = y.size
    if n < 2 or n & (n - 1):
        raise ValueError(f"a Hadamard transform needs a power-of-two length >= 2, got {n}")
    stages = [y.copy()]
    span = 1
    while span < n:
        for start in range(0, n, 2 * span):
            a, b = y[start : start + span].copy(), y[start + span : start + 2 * span].copy()
            y[start : start + span], y[start + span : start + 2 * span] = (a + b) / np.sqrt(2), (a - b) / np.sqrt(2)
        stages.append(y.copy())
        span *= 2
    return stages


def outlier_row(outlier: float, channel: int = 40, size: int = 128, seed: int = 0) -> np.ndarray:
    """A small random row (std 1) with one channel set to `outlier`: the toy of notebook 01."""
    row = np.random.default_rng(seed).normal(0, 1, size).astype(np.float32)
    row[channel] = outlier
    return row


def even_share(context: int, sink: int, after: int | None = None) -> float:
    """The attention share the first `sink` tokens would get if every query spread attention evenly.

    A query at position t attends to t + 1 tokens, so `sink` of them get sink / (t + 1); averaged over the
    queries at positions `after` (default: `sink`) to `context` - 1, as `Capture.sink_mass` averages.
    """
    after = sink if after is None else after
    if not 0 <= after < context:
        raise ValueError(f"need 0 <= after < context, got after={after}, context={context}")
    t = np.arange(after, context)
    return float(np.mean(np.minimum(sink, t + 1) / (t + 1)))


def outlier_ratio(x: np.ndarray) -> float:
    """How far the largest channel sticks out: max over channels of max |x| over tokens, over the median channel's."""
    peak = np.abs(np.asarray(x, np.float32)).max(0)
    return float(peak.max() / max(float(np.median(peak)), 1e-12))


def scale_spans(x: np.ndarray, block: int = 32, group: int = 64) -> dict[str, float]:
    """The mean range (max - min) a shared scale must cover, for the two ways of grouping a (tokens, channels) tile.

    "per token": each token's `group` neighbouring channels share a scale (affine, the float formats, KIVI's V);
    "per channel": each channel's `block` consecutive tokens share one (KIVI's K). A scale's step is its range over
    2^bits - 1, so the smaller range is the finer step at the same width. Both before and after a Hadamard rotation.
    """
    x = np.asarray(x, np.float32)
    tokens, channels = x.shape
    if tokens < block or channels % group:
        raise ValueError(f"scale_spans needs at least {block} tokens and channels in groups of {group}, got {x.shape}")
    out = {}
    for name, tile in (("", x), (" after rotation", hadamard(x))):
        t = tile[: tokens - tokens % block]
        per_token = t.reshape(len(t), channels // group, group)
        per_channel = t.reshape(len(t) // block, block, channels)
        out["per token" + name] = float(np.ptp(per_token, axis=2).mean())
        out["per channel" + name] = float(np.ptp(per_channel, axis=1).mean())
    return out
