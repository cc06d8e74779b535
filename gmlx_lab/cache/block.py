"""A base for block schemes: write how one group of tokens is stored and read back, get a whole cache.

A subclass writes two methods (and, if it wants one, a rotation):

    class MyCache(BlockCache):
        scheme = "mine"          # its name in the registry
        block_tokens = 32        # tokens per block
        OPTIONS = (Option("bits", 4, "code width", (2, 4, 8)),)   # its options, their defaults and checks

        def encode(self, x, kind):        # x: (B, H, 32, D) float32, kind "k" or "v" -> a tuple of arrays
            ...
        def decode(self, parts, kind):    # that tuple -> (B, H, 32, D)
            ...

    gmlx_lab.register_scheme(BlockScheme("mine", "what it does", cache_class=MyCache))

and the base supplies the rest: mlx-lm's cache contract (`update_and_fetch`, `offset`, `state` that
`save_prompt_cache`/`load_prompt_cache` round-trip, `trim`, `make_mask`), `nbytes` and `regions()`, an fp16
sink and tail if asked, the checks of `GmlxCache` (shapes, finiteness, deepcopy) and a reference attention
(softmax over the fetched K/V). `BlockScheme` derives the registry's byte formula, policy rule and audit from
the class. The class's options (`OPTIONS`, e.g. `bits`) become attributes (`self.bits`). `load_prompt_cache`
finds the class by name once the scheme is registered (in another process: import the plug-in first).

A layer's tokens live in three stores, oldest first (`block_regions` is the geometry):
  sink    the first `sink_tokens` tokens, fp16 (none unless the scheme asks);
  body    encoded blocks of `block_tokens` tokens, K and V apart, in rotated space if the scheme rotates;
  recent  fp16 tokens after the body: the live (incomplete) block and the newest `kv_tail_tokens` (the tail).
A block is encoded once it is complete, has left the tail and a later update has arrived: an update attends
to its own tokens exactly, and its tokens can always be trimmed (speculative decoding). `encode_on_arrival =
True` encodes complete blocks at once instead, the latest update's too (mlx-lm's affine cache does that, in
blocks of one token: cache/affine/); an update due whole goes straight into blocks, and a trim drops whole
blocks (a cache that never saw them would hold the blocks before them no differently).
The body's buffers grow by `body_step` blocks at once: 1 (the default) sizes them exactly; one-token blocks
grow by 256, as mlx-lm's caches do, so a decode step writes in place instead of copying the body (the room
counts in `regions()["reserve"]`). `body` holds the blocks as arrays (views of `body_buffers`).
`keep_newest_block = True` keeps the fp16 source of the newest block (`rollback`) until the next encode, so a
trim into that block restores it exactly: a draft model's cache under mlx-lm's speculative decoding takes one
token per update and is trimmed by up to num_draft - 1 tokens, which at tail 0 reaches into the newest block
(kvarn does this; the copy counts in `regions()["reserve"]`).
A cache whose blocks are the shared rolling window's groups (128 tokens after a 128-token sink, kvarn's
records) can be a rolling window (`set_window`, gmlx_lab/cache/window.py): the oldest blocks leave whole (affine's
one-token blocks leave a group at a time, its own `window_check`).

`encode` sees float32 blocks of the stored fp16 values, or what `rotate` makes of them (kvarn rotates in fp16,
as its records were always sealed). With `rotate_on_arrival = True` tokens are rotated as they arrive, before
any store, so the fp16 sink and recent tokens are rotated too and `fetch` turns everything back (affine_rot,
as llama.cpp rotates K/V before its cache); by default only blocks are rotated, when they are encoded.
`encode` must treat the first two axes as batch: the base hands it several blocks at once as extra heads, and
the shapes of what it returns must depend only on the block's shape (the byte formula encodes a block of zeros
to count them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import mlx.core as mx
import numpy as np

from ..kernels.splits import MAX_QUERY_TOKENS
from ..registry import Option, Scheme, resolve_options
from . import saved
from .attention import KeySlice, decode_tokens, fits_scratch, gathered, slice_tokens, sliced_attention
from .base import GmlxCache
from .buffers import KV, STORE_DTYPE, GrowingBuffer, array_bytes, fill_sink, keep_sink
from .regions import block_regions, due_tokens
from .rotation import rotation_problem
from .window import BlockWindow

__all__ = ["BlockCache", "BlockScheme", "block_regions", "clashes"]

GEOMETRY = ("block_tokens", "sink_tokens", "kv_tail_tokens")  # options a scheme may set, or class attributes
LAYOUT = "gmlx_lab.BlockCache/1"  # the last item of `state`: a saved state of another layout is refused
STATE_ITEMS = 20  # six arrays, then offset, newest, layer, the geometry, the K/V shape, window and sliding scalars
STATE = ("offset", "layer", "options", "sink", "body", "body_buffers", "n_blocks", "recent", "sink_count",
         "recent_count", "newest", "max_kv_size", "dropped")


def clashes(name: str) -> bool:
    """True for an option name that would overwrite the cache's own attributes (options become attributes)."""
    return name not in GEOMETRY and (name.startswith("_") or name in STATE or hasattr(BlockCache, name))


def check_geometry(name: str, value: Any, where: str) -> None:
    """A block geometry value (GEOMETRY) that no Option checks: an int >= 1 for block_tokens, >= 0 otherwise."""
    low = 1 if name == "block_tokens" else 0
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{where}: {name}={value!r}; accepted: an int >= {low}")


def joined(pieces: list[KV], dtype: mx.Dtype) -> KV:
    """K/V pieces (B, H, n, D) cast to `dtype` and joined along the tokens."""
    k, v = ([p[i] if p[i].dtype == dtype else p[i].astype(dtype) for p in pieces] for i in (0, 1))
    return KV(*(xs[0] if len(xs) == 1 else mx.concatenate(xs, axis=2) for xs in (k, v)))


class BlockRegions:
    """What a block cache reports and reads of its regions, for `BlockCache` (its sink, body, recent stores and
    rollback): their bytes and tokens, and attention over them a slice at a time."""

    def region_tokens(self) -> dict[str, int]:
        """How many tokens each region holds now."""
        tail = min(self.recent_count, self.kv_tail_tokens)
        return {"sink": self.sink_count, "body": self.n_blocks * self.block_tokens,
                "live": self.recent_count - tail, "tail": tail}

    def block_bytes(self, k_dim: int, v_dim: int) -> int:
        """Bytes of one encoded block of one head, K and V (from encoding a block of zeros)."""
        return sum(p.nbytes for kind, d in (("k", k_dim), ("v", v_dim)) for p in self.trial_block(kind, d))

    def regions(self) -> dict[str, int]:
        """Resident bytes by region; "reserve" is what is held beyond the tokens served: the recent and body buffers'
        growth room and the newest block's fp16 copy (`rollback`)."""
        tokens = self.region_tokens()
        recent_bytes = array_bytes(self.recent.k.data, self.recent.v.data)
        per_token = recent_bytes // max(self.recent.k.capacity(), 1)
        body = 0 if self.body is None else array_bytes(*self.body.k, *self.body.v)
        buffers = 0 if self.body_buffers is None else array_bytes(*(b.data for bufs in self.body_buffers for b in bufs))
        return {
            "sink": 0 if self.sink is None else array_bytes(*self.sink),
            "body": body,
            "live": per_token * tokens["live"],
            "tail": per_token * tokens["tail"],
            "reserve": recent_bytes - per_token * self.recent_count + buffers - body
            + (0 if self.rollback is None else array_bytes(*self.rollback)),
        }

    def memory_regions(self) -> tuple[dict[str, int], dict[str, int] | None]:
        """The regions without the reserve, and the tokens each holds (`region_tokens`)."""
        return super().memory_regions()[0], self.region_tokens()

    def stored_tokens(self) -> list[tuple[str, str, mx.array]]:
        """Each region's K and V as the cache reads them: the sink, the blocks decoded (their codes and scales),
        the live tokens, the tail, and the newest block's fp16 copy where one is kept."""
        out = []
        if self.sink is not None:
            out += [("sink", "K", self.sink.k), ("sink", "V", self.sink.v)]
        if self.body is not None:
            out += [("blocks", kind.upper(), self._decode_blocks(parts, kind)) for parts, kind in zip(self.body, "kv")]
        tokens = self.region_tokens()
        for region, start, n in (("live tokens", 0, tokens["live"]), ("tail", tokens["live"], tokens["tail"])):
            if n:
                out += [(region, kind, buf.view(start + n)[:, :, start:]) for kind, buf in zip("KV", self.recent)]
        if self.rollback is not None:
            out += [("newest block's fp16 copy", kind, x) for kind, x in zip("KV", self.rollback)]
        return out

    def decoded_prefix(self, dtype: mx.Dtype) -> KV | None:
        """The sink and the decoded body in `dtype`: every token before the recent ones, in the space the recent tokens
        are stored in (rotated for a cache that rotates on arrival; `with_recent` turns the whole back). None where
        neither is held."""
        pieces = [self.sink] if self.sink is not None else []
        if self.body is not None:
            body = KV(*(self._decode_blocks(parts, kind) for parts, kind in zip(self.body, "kv")))
            pieces.append(body if self.rotate_on_arrival else KV(*(self.unrotate(x) for x in body)))
        return joined(pieces, dtype) if pieces else None

    def with_recent(self, prefix: KV | None, dtype: mx.Dtype) -> KV:
        """Every token's K and V in the model's space: `prefix` (`decoded_prefix`), then the recent tokens."""
        pieces = [prefix] if prefix is not None else []
        if self.recent_count:
            pieces.append(KV(self.recent.k.view(self.recent_count), self.recent.v.view(self.recent_count)))
        out = joined(pieces, dtype)
        return KV(*(self.unrotate(x) for x in out)) if self.rotate_on_arrival else out

    def key_slices(self, dtype: mx.Dtype, tokens: int, rotated: bool = False) -> list[KeySlice]:
        """The keys `fetch` returns, in its order, as slices of at most `tokens` decoded only when read: the fp16 sink
        and recent tokens `tokens` at a time, the body in whole blocks. `rotated`: every slice in the blocks' space
        (`rotate`), the decoded blocks as they are and the fp16 tokens turned, rather than in the model's."""
        def read(x: mx.array, turned: bool) -> mx.array:  # x in the blocks' space or not; cast, then turn if asked
            if turned == rotated:
                return x.astype(dtype)
            if rotated:
                return self.rotate(x.astype(dtype))
            return self.unrotate(x.astype(dtype)) if self.rotate_on_arrival else self.unrotate(x).astype(dtype)

        def after(arrays: list[mx.array], done: list[mx.array]) -> list[mx.array]:
            return list(mx.depends(arrays, done)) if done else arrays

        def plain(kv: KV, a: int, b: int) -> Callable[[list[mx.array]], KV]:
            return lambda done: KV(*(read(x, self.rotate_on_arrival) for x in after([y[:, :, a:b] for y in kv], done)))

        def blocks(i: int, j: int) -> Callable[[list[mx.array]], KV]:
            def load(done: list[mx.array]) -> KV:
                return KV(*(read(self._decode_blocks(tuple(after([p[:, :, i:j] for p in parts], done)), kind), True)
                            for parts, kind in zip(self.body, "kv")))
            return load

        out, at = [], 0

        def fp16_tokens(kv: KV, n: int) -> None:  # an fp16 region, `tokens` at a time
            nonlocal at
            for a in range(0, n, tokens):
                b = min(a + tokens, n)
                out.append(KeySlice(at, at + b - a, plain(kv, a, b)))
                at += b - a

        if self.sink is not None:
            fp16_tokens(self.sink, self.sink_count)
        per = max(1, tokens // self.block_tokens)
        for i in range(0, self.n_blocks, per):
            j = min(i + per, self.n_blocks)
            out.append(KeySlice(at, at + (j - i) * self.block_tokens, blocks(i, j)))
            at += (j - i) * self.block_tokens
        fp16_tokens(KV(self.recent.k.data, self.recent.v.data), self.recent_count)
        return out

    def sliced(self, queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any) -> mx.array | None:
        """Attention a slice of the cache at a time (`sliced_attention`) where SDPA over the fetched K/V (lazy, never
        read here) would not fit the scratch (`fits_scratch`), so no decoded copy of the whole cache is made; else
        None."""
        if fits_scratch(queries, keys, values):
            return None
        tokens = slice_tokens(queries, keys.shape[1], max(keys.shape[-1], values.shape[-1]), self.block_tokens)
        return sliced_attention(queries, scale, mask, self.key_slices(queries.dtype, tokens))


class BlockCache(BlockWindow, BlockRegions, GmlxCache):
    """A cache that stores K/V as encoded blocks of `block_tokens` tokens, with an fp16 sink and tail if asked."""

    scheme = "block"  # the registered name: set it in the subclass
    block_tokens = 32
    sink_tokens = 0
    kv_tail_tokens = 0
    encode_on_arrival = False
    rotate_on_arrival = False  # rotate tokens before any store, the fp16 ones too (see the docstring)
    body_step = 1  # blocks the body's buffers grow by at once (see the docstring)
    keep_newest_block = False  # keep the newest block's fp16 source until the next encode (see the docstring)
    # True: a block is encoded once it had left the tail before the latest update arrived (kvarn: token by token,
    # one token after it leaves the tail); False: once it has left the tail and is older than the latest update
    tail_before_update = False
    # The options this class takes: their defaults and accepted values, the one home of both (its BlockScheme
    # offers them by name)
    OPTIONS: tuple[Option, ...] = ()

    @classmethod
    def complete(cls, values: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
        """Rules between options (e.g. K and V widths from `bits`), applied after the defaults; none by default."""
        return values

    # -- what a scheme writes ------------------------------------------------------------------------
    def encode(self, x: mx.array, kind: str) -> tuple[mx.array, ...]:
        """Store one block x (B, H, block_tokens, D), float32, of K (kind "k") or V ("v") as a tuple of arrays."""
        raise NotImplementedError(f"{type(self).__name__} must define encode(x, kind)")

    def decode(self, parts: tuple[mx.array, ...], kind: str) -> mx.array:
        """What `encode` returned, read back as a (B, H, block_tokens, D) array."""
        raise NotImplementedError(f"{type(self).__name__} must define decode(parts, kind)")

    def rotate(self, x: mx.array) -> mx.array:
        """Applied to tokens (..., D) before encoding; none by default (e.g. `mx.hadamard_transform`)."""
        return x

    def unrotate(self, x: mx.array) -> mx.array:
        """The inverse of `rotate`, applied to decoded tokens."""
        return x

    # -- construction -----------------------------------------------------------------------------------
    def __init__(self, layer: int | None = None, **options: Any):
        """Options by name (None: the default): checked against `OPTIONS`, the defaults filled and `complete`
        applied (`registry.resolve_options`, as the registry resolves a scheme's), then set as attributes
        (`self.bits`), so a cache built by hand and one its scheme builds never disagree."""
        super().__init__(layer)
        options = {name: value for name, value in options.items() if value is not None}
        for name in options:
            if clashes(name):
                raise ValueError(f"{type(self).__name__}: option name {name!r} clashes with a BlockCache attribute")
        known = {opt.name for opt in self.OPTIONS}
        try:  # the geometry a saved state passes back (block_tokens) is checked below, not as an option
            values = resolve_options(self.OPTIONS, {n: v for n, v in options.items() if n in known or n not in
                                                    GEOMETRY}, self.scheme, self.complete)
        except ValueError as err:
            raise ValueError(f"{self.where()}: {err}") from None
        for name, value in {**options, **values}.items():
            setattr(self, name, value)
        for name in GEOMETRY:  # geometry no Option covers: class attributes
            if name not in known:
                check_geometry(name, getattr(self, name), self.where())
        self.options = values
        self.sink: KV | None = None  # K, V (B, H, <= sink_tokens, D) fp16
        self.body_buffers: KV | None = None  # K, V tuples of GrowingBuffer, one per part `encode` returns
        self.n_blocks = 0  # encoded blocks per head: the blocks of body_buffers the cache holds
        self._body: KV | None = None  # their views (`body`), made when first read
        self.recent = KV(GrowingBuffer(STORE_DTYPE), GrowingBuffer(STORE_DTYPE))
        self.sink_count = 0
        self.recent_count = 0
        self.newest = 0  # tokens of the latest update: not encoded before the next one arrives
        self.rollback: KV | None = None  # the newest block's fp16 K, V (keep_newest_block), until the next encode

    # -- geometry -------------------------------------------------------------------------------------------
    @property
    def body(self) -> KV | None:
        """K, V tuples of arrays (B, H, blocks, ...): the held blocks of `body_buffers`, or None. The views are
        made when first read after a change, so a decode step that attends from the buffers builds none."""
        if self._body is None and self.n_blocks:
            self._body = KV(*(tuple(buf.view(self.n_blocks) for buf in bufs) for bufs in self.body_buffers))
        return self._body

    def check_head_dims(self, k_dim: int, v_dim: int) -> None:
        """Raise a ValueError naming the layer if this scheme cannot encode and decode blocks of these head dims, or
        if it rotates and its rotation cannot be undone there (cache/rotation.py)."""
        probe = mx.random.normal((1, 1, 1, 64), key=mx.random.key(0))  # 64: a size every rotation takes
        if not mx.array_equal(self.rotate(probe), probe).item():
            for kind, d in (("k", k_dim), ("v", v_dim)):
                problem = rotation_problem(d)
                if problem:
                    raise ValueError(f"{self.where()}: {type(self).__name__} cannot rotate {kind.upper()} heads: "
                                     f"{problem}")
        for kind, d in (("k", k_dim), ("v", v_dim)):
            try:
                parts = self.trial_block(kind, d)
                back = self.unrotate(self._decode_blocks(parts, kind))
                mx.eval(back)
            except Exception as exc:  # whatever the scheme's code raises: say which block it could not take
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise ValueError(f"{self.where()}: {type(self).__name__} cannot encode {kind.upper()} blocks of "
                                 f"head_dim {d} ({first})") from exc
            want = (1, 1, self.block_tokens, d)
            if tuple(back.shape) != want:
                raise ValueError(f"{self.where()}: {type(self).__name__}.decode returned shape {tuple(back.shape)} "
                                 f"for a block of shape {want}")

    def trial_block(self, kind: str, dim: int) -> tuple[mx.array, ...]:
        return self._encode_blocks(self.rotate(mx.zeros((1, 1, self.block_tokens, dim))), kind)

    # -- storing -----------------------------------------------------------------------------------------------
    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if self._shape is None and getattr(keys, "ndim", 0) == 4 and getattr(values, "ndim", 0) == 4:
            self.check_head_dims(keys.shape[-1], values.shape[-1])
        keys, values = self.arrive(keys, values)
        dtype, n = keys.dtype, keys.shape[2]
        if self.rotate_on_arrival:
            keys, values = self.rotate(keys), self.rotate(values)
        room = self.sink_tokens - self.sink_count
        if room > 0:  # the first sink_tokens tokens fill the sink
            self.sink, keys, values = fill_sink(self.sink, keys, values, room)
            self.sink_count = self.sink.k.shape[2]
        self.offset += n
        self.newest = 0 if self.encode_on_arrival else n
        if keys.shape[2]:
            self._store(keys, values)
        if self.max_kv_size is not None:
            self._roll(n)
        return self._return(*self.fetch(dtype))

    def _store(self, keys: mx.array, values: mx.array) -> None:
        """Put an update's tokens after the recent ones and encode the blocks now due. An update due whole with
        nothing waiting before it (a class that encodes on arrival) goes straight into blocks, no stop in fp16."""
        waiting = self.recent_count
        self.recent_count += keys.shape[2]
        due = self.due_blocks()
        if not waiting and due * self.block_tokens == keys.shape[2]:
            self.recent_count = 0
            self._append_blocks(KV(keys, values))
            return
        self.recent.k.write(waiting, keys)
        self.recent.v.write(waiting, values)
        self._encode(due)

    def due_blocks(self, newest: int | None = None) -> int:
        """Complete blocks of recent tokens that have left the tail and are older than the latest update (`newest`
        tokens: by default the latest update's, not encoded yet; 0 for every complete block out of the tail)."""
        newest = self.newest if newest is None else newest
        due = due_tokens(self.recent_count, newest, self.kv_tail_tokens, self.tail_before_update)
        return max(0, due) // self.block_tokens

    def seal(self) -> int:
        """Encode every complete block that has left the tail now, the latest update's too; returns how many.

        Updates encode on their own; this is for reports of resident bytes (the tokens it encodes can no
        longer be trimmed).
        """
        n = self.due_blocks(newest=0)
        self._encode(n)
        self.newest = 0
        self.rollback = None
        return n

    def settle(self) -> None:
        """Encode what is due now, as the next update would (see GmlxCache.settle)."""
        self.seal()
        super().settle()

    def _encode(self, blocks: int) -> None:
        """Encode the oldest `blocks` blocks of recent tokens into the body (K and V both)."""
        if blocks <= 0:
            return
        tokens = blocks * self.block_tokens
        self._append_blocks(KV(*(buf.data[:, :, :tokens] for buf in self.recent)))
        if self.recent_count > tokens or not self.encode_on_arrival:
            for buf in self.recent:
                buf.remove(0, tokens, self.recent_count)
        else:  # encoding on arrival, an empty fp16 store holds nothing (as mlx-lm's QuantizedKVCache)
            self.recent = KV(GrowingBuffer(STORE_DTYPE), GrowingBuffer(STORE_DTYPE))
        self.recent_count -= tokens

    def _append_blocks(self, tokens: KV) -> None:
        """Encode tokens (B, H, whole blocks, D), fp16 as stored, onto the end of the body."""
        stored = KV(*(x if x.dtype == STORE_DTYPE else x.astype(STORE_DTYPE) for x in tokens))
        # what `encode` sees of stored fp16 tokens: float32, rotated unless they were on arrival
        seen = KV(*(x.astype(mx.float32) if self.rotate_on_arrival else self.rotate(x.astype(mx.float32))
                    for x in stored))
        new = KV(*(self._encode_blocks(x, kind) for x, kind in zip(seen, "kv")))
        if self.keep_newest_block:
            self.rollback = KV(*(mx.contiguous(x[:, :, x.shape[2] - self.block_tokens:]) for x in stored))
            # the copy is computed with the body: left lazy, it would keep alive the whole fp16 buffer it is cut
            # from (every layer's previous recent tokens) until the next encode
            new = KV(*(tuple(mx.depends(list(parts), list(self.rollback))) for parts in new))
        start, end = self.n_blocks, self.n_blocks + new.k[0].shape[2]
        in_place = self.body_buffers is not None and self.body_buffers.k[0].capacity() >= end
        if self.body_buffers is None:
            self.body_buffers = KV(*(tuple(GrowingBuffer(p.dtype, step=self.body_step) for p in parts)
                                     for parts in new))
        for bufs, parts in zip(self.body_buffers, new):
            for buf, part in zip(bufs, parts):
                buf.write(start, part)
        self._hold_blocks(end, in_place)

    def _hold_blocks(self, n: int, in_place: bool = False) -> None:
        """Make `body` the first n blocks of the body's buffers (none: no body, no buffers). Unless blocks were only
        written into the buffers in place, the kept fused call goes too (`kept_call`): it must not keep replaced
        arrays alive until the next attention (a seal that grows the buffers, a trim, a rolled window)."""
        if not in_place:
            self._call = None  # a kept fused call (KernelRoute.kept_call) must not keep replaced arrays alive
        if n == 0:
            self.body_buffers = None
        self.n_blocks, self._body = n, None

    def _encode_blocks(self, x: mx.array, kind: str) -> tuple[mx.array, ...]:
        """Tokens (B, H, m * block, D) as m blocks: `encode` sees (B, H * m, block, D); parts return (B, H, m, ...)."""
        b, h, t, d = x.shape
        m = t // self.block_tokens
        parts = self.encode(x.reshape(b, h * m, self.block_tokens, d), kind)
        if isinstance(parts, mx.array) or not all(isinstance(p, mx.array) for p in parts):
            raise TypeError(f"{type(self).__name__}.encode must return a tuple of mx.array")
        return tuple(p.reshape(b, h, m, *p.shape[2:]) for p in parts)

    def _decode_blocks(self, parts: tuple[mx.array, ...], kind: str) -> mx.array:
        """Parts (B, H, m, ...) back to rotated tokens (B, H, m * block, D)."""
        b, h, m = parts[0].shape[:3]
        x = self.decode(tuple(p.reshape(b, h * m, *p.shape[3:]) for p in parts), kind)
        return x.reshape(b, h, m * self.block_tokens, x.shape[-1])

    # -- reading -------------------------------------------------------------------------------------------------
    def fetch(self, dtype: mx.Dtype = mx.float32) -> KV:
        """All tokens' K and V in the model's space: sink, decoded body, recent tokens."""
        return self.with_recent(self.decoded_prefix(dtype), dtype)

    def roundtrip(self, x: mx.array, kind: str) -> mx.array:
        """Tokens (B, H, T, D), T a multiple of block_tokens, stored as this cache stores them and read back."""
        if x.shape[2] % self.block_tokens:
            raise ValueError(f"{type(self).__name__}: roundtrip needs a multiple of {self.block_tokens} tokens, "
                             f"got {x.shape[2]}")
        stored = (self.rotate(x) if self.rotate_on_arrival else x).astype(STORE_DTYPE).astype(mx.float32)
        seen = stored if self.rotate_on_arrival else self.rotate(stored)  # as `_append_blocks` hands `encode`
        return self.unrotate(self._decode_blocks(self._encode_blocks(seen, kind), kind))

    def attend(self, queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any) -> mx.array:
        """The reference attention: softmax over the fetched K/V while they fit one slice of scratch, else a slice
        at a time (`sliced`). A prompt chunk, evaluated now (mlx_lm_hooks.settled), reads the K/V decoded a slice
        at a time (`gathered`) rather than the lazy fetch, whose decode would hold every slice's intermediates at
        once. A scheme may attend from its codes instead."""
        out = self.sliced(queries, keys, values, scale, mask)
        if out is not None:
            return out
        if queries.shape[2] > MAX_QUERY_TOKENS and self.n_blocks:
            tokens = decode_tokens(keys.shape[0], keys.shape[1], keys.shape[-1] + values.shape[-1], self.block_tokens)
            keys, values = gathered(self.key_slices(keys.dtype, tokens))
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)

    # -- contract ---------------------------------------------------------------------------------------------------
    def trim(self, n: int) -> int:
        """Roll back the newest n tokens: the recent fp16 tokens; then whole blocks if the class encodes on arrival,
        else the newest block from its fp16 copy if the class keeps one (`rollback`); then the sink, once no
        block is left. Other blocks cannot be restored exactly, so a trim into them is refused."""
        bt = self.block_tokens
        droppable = self.n_blocks if self.encode_on_arrival else (1 if self.rollback is not None else 0)
        limit = self.recent_count + droppable * bt + (self.sink_count if droppable == self.n_blocks else 0)
        into_blocks = n - self.recent_count if isinstance(n, int) and not isinstance(n, bool) else 0
        if self.encode_on_arrival and 0 < into_blocks <= droppable * bt and into_blocks % bt:
            raise ValueError(f"{self.where()}: cannot trim {n} tokens: encoded blocks of {bt} tokens leave whole")
        n = self.check_trim(n, limit, "tokens already encoded into blocks cannot be restored exactly")
        if self.rollback is not None and n > self.recent_count:  # the newest block back from its fp16 copy
            waiting = self.recent_count
            back = KV(*(mx.concatenate([r, buf.data[:, :, :waiting]], axis=2) if waiting else r
                        for r, buf in zip(self.rollback, self.recent)))
            self.recent = KV(GrowingBuffer(STORE_DTYPE), GrowingBuffer(STORE_DTYPE))
            for buf, x in zip(self.recent, back):
                buf.write(0, x)
            self.recent_count = waiting + self.block_tokens
            self._hold_blocks(self.n_blocks - 1)
            self.rollback = None
        from_recent = min(n, self.recent_count)
        self.recent_count -= from_recent
        blocks = min((n - from_recent) // bt, self.n_blocks) if self.encode_on_arrival else 0
        if blocks:
            self._hold_blocks(self.n_blocks - blocks)
            from_recent += blocks * bt
        if n > from_recent:
            keep = self.sink_count - (n - from_recent)
            self.sink = keep_sink(self.sink, keep)
            self.sink_count = keep
        self.offset -= n
        self.newest = max(0, self.newest - n)
        self._fetched = None
        return n

    def __deepcopy__(self, memo: dict) -> BlockCache:
        """An independent copy (GmlxCache.__deepcopy__) that can still restore its newest block."""
        new = super().__deepcopy__(memo)
        new.rollback = self.rollback
        return new

    @property
    def state(self) -> tuple[Any, ...]:
        """Arrays, then scalars: offset, newest, layer, the geometry, the K/V shape, the rolling window (size,
        tokens dropped) and the sliding-window setting, the scheme's options as name, value pairs (mlx-lm
        0.32.2's save_prompt_cache stores the scalars it finds in `state`), and the layout tag last."""
        sink = (None, None) if self.sink is None else tuple(self.sink)
        body = (None, None) if self.body is None else tuple(self.body)
        recent = (None, None)
        if self.recent_count:
            recent = (self.recent.k.view(self.recent_count), self.recent.v.view(self.recent_count))
        meta = (self.offset, self.newest, self.layer, *(getattr(self, name) for name in GEOMETRY),
                *(self._shape or (None,) * 4), self.max_kv_size, self.dropped, *self.sliding_state())
        return (*sink, *body, *recent, *meta, *(x for item in self.options.items() for x in item), LAYOUT)

    @state.setter
    def state(self, v: tuple[Any, ...]) -> None:
        reader = None if saved.is_trusted() else saved.StateReader(v, type(self), LAYOUT, fixed=STATE_ITEMS)
        items = list(v[:-1]) if reader is None else saved.block_items(reader, STATE_ITEMS, GEOMETRY)
        sk, sv, bk, bv, rk, rv, offset, newest, layer, *rest = items
        geometry, shape, (max_kv_size, dropped, *sliding), pairs = rest[:3], rest[3:7], rest[7:11], rest[11:]
        options = dict(zip(pairs[0::2], pairs[1::2]))
        try:
            self.__init__(layer=layer, **options)
        except (ValueError, TypeError) as exc:
            if reader is None:
                raise
            raise reader.fail(f"the saved options {options} do not build a {type(self).__name__}: {exc}") from None
        for name, value in zip(GEOMETRY, geometry):
            if reader is not None and getattr(self, name) != value:
                raise reader.fail(f"{name} is {value} in the file; {type(self).__name__} with these options has "
                                  f"{getattr(self, name)}")
            setattr(self, name, value)
        self.offset, self.newest, self.max_kv_size, self.dropped = offset, newest, max_kv_size, dropped
        self.restore_sliding(sliding)
        self._shape = None if None in shape else tuple(shape)
        if sk is not None:
            self.sink, self.sink_count = KV(sk, sv), sk.shape[2]
        if bk is not None:
            self.body_buffers = KV(*(tuple(GrowingBuffer(p.dtype, p, self.body_step) for p in parts)
                                     for parts in (bk, bv)))
            self._hold_blocks(bk[0].shape[2])
        if rk is not None:
            self.recent = KV(GrowingBuffer(STORE_DTYPE, rk), GrowingBuffer(STORE_DTYPE, rv))
            self.recent_count = rk.shape[2]
        if reader is not None:
            saved.block_loaded(self, reader, STORE_DTYPE)

@lru_cache(maxsize=1024)
def encoded_block_bytes(cls: type[BlockCache], options: tuple[tuple[str, Any], ...], k_dim: int, v_dim: int) -> int:
    """`block_bytes` of a cache of class `cls` with these options, remembered: the byte formula asks it for every
    point of a figure, and encoding a block (kvarn: 16 normalization rounds) takes milliseconds."""
    return cls(**dict(options)).block_bytes(k_dim, v_dim)


@dataclass(frozen=True)
class BlockScheme(Scheme):
    """The registry entry of a `BlockCache` subclass: its options are passed to the class, whose methods give
    the byte formula (encoding a block of zeros), the policy rule (can it encode these head dims?) and the audit."""

    def __post_init__(self) -> None:
        """Check the class; the scheme offers the class's options (`OPTIONS`: the class is their one home, read
        here, never written)."""
        cls = self.cache_class
        if not (isinstance(cls, type) and issubclass(cls, BlockCache)):
            raise TypeError(f"BlockScheme {self.name!r}: cache_class must be a BlockCache subclass, got {cls!r}")
        if cls.scheme != self.name:
            raise ValueError(f"BlockScheme {self.name!r}: {cls.__name__}.scheme is {cls.scheme!r}; "
                             "set `scheme = ...` in the class to the registered name")
        if self.options and tuple(self.options) != tuple(cls.OPTIONS):
            raise ValueError(f"BlockScheme {self.name!r}: options are declared on the class, not the scheme; set "
                             f"`OPTIONS = (...)` in {cls.__name__} and leave BlockScheme's options out")
        object.__setattr__(self, "options", cls.OPTIONS)
        for opt in self.options:
            if clashes(opt.name):
                raise ValueError(f"BlockScheme {self.name!r}: option name {opt.name!r} clashes with a "
                                 "BlockCache attribute")

    def adjust(self, values: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
        """The class's rules between options (`BlockCache.complete`)."""
        return self.cache_class.complete(values, given)

    def make_cache(self, options: dict[str, Any], layer: int | None = None) -> BlockCache:
        return self.cache_class(layer=layer, **options)

    def declines(self, kind: str, k_dim: int, v_dim: int, options: dict[str, Any]) -> str | None:
        """A layer whose head dims the class cannot encode stays fp16, with the class's reason."""
        try:
            self.cache_class(**options).check_head_dims(k_dim, v_dim)
        except ValueError as exc:
            return str(exc).split(": ", 1)[-1]
        return None

    def layer_bytes(self, tokens: int, kv_heads: int, k_dim: int, v_dim: int, options: dict[str, Any]) -> float:
        """Encoded blocks at the bytes of one block of zeros; sink, live and tail tokens as fp16 (token by token:
        the newest token not yet encoded unless the class encodes on arrival)."""
        cache = self.cache_class(**options)
        newest = 0 if cache.encode_on_arrival else 1
        r = block_regions(tokens, cache.block_tokens, cache.sink_tokens, cache.kv_tail_tokens, newest,
                          cache.tail_before_update)
        blocks = r["body"] // cache.block_tokens
        fp16_tokens = tokens - r["body"]
        block = encoded_block_bytes(self.cache_class, tuple(options.items()), k_dim, v_dim)
        return kv_heads * (blocks * block + fp16_tokens * (k_dim + v_dim) * 2.0)

    def audit(self, cache: BlockCache, options: dict[str, Any]) -> tuple[str, bool]:
        """The options the policy gave, and every block that is due encoded (less those a rolling window dropped)."""
        for name, value in options.items():
            if getattr(cache, name, None) != value:
                return f"{name} {getattr(cache, name, None)}, policy says {value}", False
        due = self.encoded_tokens(cache)
        if cache.n_blocks * cache.block_tokens < due:
            return f"{due} tokens should be encoded at {cache.offset} tokens, found {cache.n_blocks} blocks", True
        return "", due > 0

    def encoded_tokens(self, cache: BlockCache) -> int:
        """Tokens the cache should hold encoded by now: the geometry's body, less what a rolling window dropped."""
        return block_regions(cache.offset, cache.block_tokens, cache.sink_tokens, cache.kv_tail_tokens,
                             cache.newest, cache.tail_before_update)["body"] - cache.dropped

    def roundtrip(self, x: np.ndarray, kind: str, options: dict[str, Any]) -> np.ndarray:
        """(tokens, D) through the class's encode and decode (tokens a multiple of block_tokens)."""
        cache = self.cache_class(**options)
        out = cache.roundtrip(mx.array(np.asarray(x, np.float32))[None, None], kind)
        return np.array(out[0, 0].astype(mx.float32))
