"""The geometry of a block cache's regions (cache/block.py): how many tokens the sink, the encoded body, the
live block and the fp16 tail hold. One home for the block base, its byte formula and audit, and kvarn's
region figures (`records.region_tokens` is kvarn's case); nothing here knows a cache class.
"""

from __future__ import annotations


def due_tokens(recent: int, newest: int, kv_tail_tokens: int, tail_before_update: bool) -> int:
    """Recent tokens old enough to encode: older than the latest update (`newest` tokens) and out of the tail,
    the tail counted after the update, or before it (`tail_before_update`, kvarn's rule)."""
    if tail_before_update:
        return recent - newest - kv_tail_tokens
    return min(recent - newest, recent - kv_tail_tokens)


def block_regions(context: int, block_tokens: int, sink_tokens: int = 0, kv_tail_tokens: int = 0,
                  newest: int = 0, tail_before_update: bool = False) -> dict[str, int]:
    """Tokens in each region of a block cache after `context` tokens, the last `newest` of them in one update
    (not yet encoded unless the class encodes on arrival: then pass 0); `tail_before_update`: the class's rule
    of that name (BlockCache)."""
    sink = min(context, sink_tokens)
    recent = context - sink
    body = max(0, due_tokens(recent, newest, kv_tail_tokens, tail_before_update)) // block_tokens * block_tokens
    recent -= body
    tail = min(recent, kv_tail_tokens)
    return {"sink": sink, "body": body, "live": recent - tail, "tail": tail}
