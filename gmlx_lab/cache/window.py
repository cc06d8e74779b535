"""The rolling window (`max_kv_size`): which tokens a cache still holds once the context outgrows the window.

One rule for every scheme, so that fp16, affine and kvarn windows of the same size hold the same tokens:
the first 128 tokens stay (the sink: what keeps a rolling window stable), and after them tokens leave
oldest first in groups of 128 (kvarn's records, 128 tokens each) whenever the cache holds more than
`max_kv_size` tokens. The tokens of the latest update never leave before the next update (kvarn: only
sealed records leave), so a prompt chunk's queries see the whole chunk and the window as it stands after
it, and token by token each query sees its own window. Token positions (RoPE) keep counting every token.

A model's own sliding-window layers (Gemma 3: 512 tokens, mlx-lm's RotatingKVCache) are another thing: each
query sees exactly the newest `window_size` tokens, no sink. A layer of ours that serves one (the policy
override `quantize_sliding`) holds a rolling window of `sliding_hold` tokens under the rule above, always
enough for the model's window, and hands the model the K/V and masks RotatingKVCache would (`sliding_keys`,
`sliding_mask`), so the model's own sliding mask applies unchanged.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask

from .kvarn.records import SINK_TOKENS, TILE, region_tokens

GROUP = TILE  # tokens that leave together


def minimum(kv_tail_tokens: int | None = None) -> int:
    """The smallest window: the sink and one group; for kvarn also its fp16 tail and room for a sealed record
    beside the live group, so that whole records can leave."""
    if kv_tail_tokens is None:
        return SINK_TOKENS + GROUP
    return SINK_TOKENS + kv_tail_tokens + 2 * GROUP


def check(max_kv_size: int | None, kv_tail_tokens: int | None = None, where: str = "cache") -> None:
    """Refuse a window that cannot hold the sink, the tail and whole groups, saying what is accepted."""
    if max_kv_size is None:
        return
    low = minimum(kv_tail_tokens)
    if isinstance(max_kv_size, bool) or not isinstance(max_kv_size, int) or max_kv_size < low:
        needs = "the 128-token sink and one 128-token group" if kv_tail_tokens is None else \
            f"the 128-token sink, the {kv_tail_tokens}-token fp16 tail and two 128-token groups (a record and the " \
            "live group)"
        raise ValueError(f"{where}: max_kv_size={max_kv_size!r} cannot hold {needs}; accepted: an int >= {low} "
                         "(or None for no window)")


def groups_to_drop(held: int, max_kv_size: int | None, newest: int) -> int:
    """Groups of 128 to drop (oldest first, after the sink) so that at most `max_kv_size` tokens stay held,
    leaving the `newest` tokens (the latest update) in place."""
    if max_kv_size is None or held <= max_kv_size:
        return 0
    return min(-(-(held - max_kv_size) // GROUP), max(0, held - SINK_TOKENS - newest) // GROUP)


def held_positions(context: int, dropped: int) -> list[tuple[int, int]]:
    """The token positions a windowed cache holds as [start, end) ranges, after `dropped` tokens left."""
    if not dropped:
        return [(0, context)]
    return [(0, SINK_TOKENS), (SINK_TOKENS + dropped, context)]


def dropped_tokens(context: int, max_kv_size: int | None) -> int:
    """Tokens a window has dropped after `context` tokens arrived one at a time: a group of 128 each time it
    would hold more than `max_kv_size` (so it holds between max_kv_size - 127 and max_kv_size once full)."""
    if max_kv_size is None or context <= max_kv_size:
        return 0
    return -(-(context - max_kv_size) // GROUP) * GROUP


def kvarn_regions(context: int, kv_tail_tokens: int, max_kv_size: int | None) -> dict[str, int]:
    """Tokens in each region of a windowed kvarn layer after `context` tokens one at a time, with "dropped"."""
    regions = region_tokens(context, kv_tail_tokens)
    dropped = dropped_tokens(context, max_kv_size)
    return {**regions, "body": regions["body"] - dropped, "dropped": dropped}


def sliding_hold(window_size: int, kv_tail_tokens: int | None = None) -> int:
    """The rolling window a layer serving a model's sliding window of `window_size` tokens holds: once it drops,
    it keeps >= max_kv_size - 255 tokens after the sink, which must cover the window_size - 1 newest before an
    update; and a kvarn window needs its sink, tail and two groups (`minimum`)."""
    return max(window_size + 2 * GROUP, minimum(kv_tail_tokens))


def sliding_keys(offset: int, arrived: int, window_size: int) -> int:
    """Tokens mlx-lm's RotatingKVCache(window_size) hands back after an update of `arrived` tokens (`offset`
    counts them): the window_size - 1 newest before the update, and the update."""
    return min(window_size - 1, offset - arrived) + arrived


def sliding_mask(n: int, offset: int, max_size: int, window_size: int | None = None,
                 return_array: bool = False) -> Any:
    """The mask mlx-lm's RotatingKVCache(max_size) makes for an update of `n` tokens at `offset` (its keys in
    temporal order, as `sliding_keys` counts them)."""
    if n > 1:
        window_size = window_size or max_size
        start = min(max_size - 1, offset)
        if start + n > window_size or return_array:
            return create_causal_mask(n, start, window_size=window_size)
        return "causal"
    if window_size is None or window_size >= max_size or offset < window_size:
        return None
    keys = min(offset + 1, max_size)
    return mx.arange(keys) >= keys - window_size
