"""The rolling window (`max_kv_size`): which tokens a cache still holds once the context outgrows the window.

One rule for every scheme, so that fp16, affine and kvarn windows of the same size hold the same tokens:
the first 128 tokens stay (the sink: what keeps a rolling window stable), and after them tokens leave
oldest first in groups of 128 (kvarn's records, 128 tokens each) whenever the cache holds more than
`max_kv_size` tokens. The tokens of the latest update never leave before the next update (kvarn: only
sealed records leave), so a prompt chunk's queries see the whole chunk and the window as it stands after
it, and token by token each query sees its own window. Token positions (RoPE) keep counting every token.
"""

from __future__ import annotations

from .records import SINK_TOKENS, TILE, region_tokens

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
