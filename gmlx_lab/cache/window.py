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
from mlx_lm.models.cache import create_attention_mask

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


class RollingWindow:
    """A cache's side of the window rules above: a rolling window (`set_window`) and serving a model's sliding layer
    (`set_sliding`), for a cache with `where()`, `offset`, `dropped`, `max_kv_size` and its own `_roll`."""

    sliding_window: int | None = None  # serving a model's sliding-window layer (set_sliding), or None
    sliding_hold: int | None = None  # its rolling window between updates (set_sliding), or None

    @property
    def held(self) -> int:
        """Tokens the cache holds now: all that arrived, less what a rolling window dropped."""
        return self.offset - self.dropped

    def window_check(self, max_kv_size: int | None, where: str | None = None) -> None:
        """Refuse a window this cache cannot roll, naming `where` (default: the layer): the one home of a scheme's
        window rule (`Scheme.check_window` asks it). By default the shared rule of gmlx_lab/cache/window.py."""
        check(max_kv_size, None, where or self.where())

    def set_window(self, max_kv_size: int | None) -> None:
        """Make this (empty) cache a rolling window of `max_kv_size` tokens; None: no window."""
        if self.offset:
            raise ValueError(f"{self.where()}: set the window of an empty cache (this one holds {self.offset} tokens)")
        self.window_check(max_kv_size)
        self.max_kv_size = max_kv_size

    def settle(self) -> None:
        """Do now what the next update would do first: roll the window (kvarn also seals its due records), so
        `nbytes` shows the steady state; the tokens dropped or sealed can no longer be trimmed."""
        if self.sliding_hold is not None:
            self.max_kv_size = self.sliding_hold
        if self.max_kv_size is not None:
            self._roll(0)

    def _roll(self, newest: int) -> None:
        """Drop what the rolling window no longer holds (each cache, for its storage)."""
        raise NotImplementedError

    def sliding_state(self) -> tuple[int | None, int | None]:
        """The sliding-window setting (set_sliding) as `state` scalars, so save/load and from_state keep it."""
        return (self.sliding_window, self.sliding_hold)

    def restore_sliding(self, values: tuple[Any, ...] | list[Any]) -> None:
        """Set what `sliding_state` stored; none stored (a file saved before it was) leaves a global layer."""
        if values:
            self.sliding_window, self.sliding_hold = values

    def set_sliding(self, window_size: int) -> None:
        """Serve a model's sliding-window layer of `window_size` tokens in place of mlx-lm's RotatingKVCache: hand
        back the K/V it would (the newest window_size - 1 tokens before the update, then the update) and make the
        masks it makes, so the model's own sliding mask fits every sliding layer. What the cache holds beyond
        them (a rolling window's sink) is not attended. A rolling window set before (`set_window`, at least
        window.sliding_hold) bounds what it holds between updates; during an update of n tokens it holds n
        more, as RotatingKVCache does, since the update's first queries still see the window before it. Kept in
        `state` (sliding_state), so save/load, from_state and deep copies keep it."""
        if self.offset:
            raise ValueError(f"{self.where()}: set_sliding on an empty cache (this one holds {self.offset} tokens)")
        if isinstance(window_size, bool) or not isinstance(window_size, int) or window_size < 1:
            raise ValueError(f"{self.where()}: sliding window {window_size!r}; accepted: an int >= 1")
        if self.max_kv_size is not None and self.max_kv_size < sliding_hold(window_size):
            raise ValueError(f"{self.where()}: a rolling window of {self.max_kv_size} tokens cannot serve a sliding "
                             f"window of {window_size}; accepted: max_kv_size >= {sliding_hold(window_size)}")
        self.sliding_window, self.sliding_hold = window_size, self.max_kv_size

    def held_positions(self) -> list[tuple[int, int]]:
        """The token positions held, as [start, end) ranges (one range without a window)."""
        return held_positions(self.offset, self.dropped)

    def sliding_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """What a sliding layer hands the model after an update (set_sliding): the K/V RotatingKVCache would."""
        keep = sliding_keys(self.offset, self.arrived, self.sliding_window)
        if keys.shape[2] < keep:
            raise RuntimeError(f"{self.where()}: holds {keys.shape[2]} tokens, the sliding window needs {keep}")
        return keys[..., keys.shape[2] - keep:, :], values[..., values.shape[2] - keep:, :]

    def make_mask(self, *args: Any, **kwargs: Any) -> Any:
        if self.sliding_window is not None:  # the mask RotatingKVCache makes (set_sliding)
            return sliding_mask(*args, offset=self.offset, max_size=self.sliding_window, **kwargs)
        return create_attention_mask(*args, offset=self.offset, **kwargs)


class BlockWindow:
    """The rolling window of a block cache (cache/block.py) whose blocks are the window's groups: drop whole blocks
    after the sink, or, before any block lies past it, groups of recent fp16 tokens."""

    def window_check(self, max_kv_size: int | None, where: str | None = None) -> None:
        """The shared window rule (cache/window.py: the sink, the tail and whole groups) where the blocks are its
        groups (128 tokens after a 128-token sink, kvarn's records); other block caches have no rolling window."""
        if max_kv_size is not None and (self.block_tokens, self.sink_tokens) != (GROUP, SINK_TOKENS):
            raise ValueError(f"{where or self.where()}: {type(self).__name__} has no rolling window (max_kv_size); "
                             "accepted: None")
        check(max_kv_size, self.kv_tail_tokens, where or self.where())

    def _roll(self, newest: int) -> None:
        """The rolling window (cache/window.py): after the window's 128-token sink (the fp16 sink, then the first
        blocks if the class keeps fewer tokens fp16) the oldest whole groups leave, from the blocks, or from the
        recent fp16 tokens while no block lies past the sink (affine before quantized_kv_start); the tail and the
        latest update stay."""
        groups = groups_to_drop(self.held, self.max_kv_size, newest)
        skip = SINK_TOKENS - self.sink_count  # tokens of the window's sink held after the fp16 sink
        body = self.n_blocks * self.block_tokens
        if body > skip:
            drop = min(groups, (body - skip) // GROUP) * GROUP
            first, blocks = skip // self.block_tokens, drop // self.block_tokens
            if blocks == self.n_blocks:
                self._hold_blocks(0)
                self.rollback = None
            elif blocks:
                for buf in (b for bufs in self.body_buffers for b in bufs):
                    buf.remove(first, first + blocks, self.n_blocks)
                self._hold_blocks(self.n_blocks - blocks)
        else:
            start = skip - body
            room = self.recent_count - start - self.kv_tail_tokens - newest
            drop = min(groups, max(0, room) // GROUP) * GROUP
            if drop:
                for buf in self.recent:
                    buf.remove(start, start + drop, self.recent_count)
                self.recent_count -= drop
        self.dropped += drop
