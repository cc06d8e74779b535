"""The kvarn cache: an fp16 sink and tail around a body of Hadamard-rotated, variance-normalized records.

A layer's tokens live in three stores, oldest first (`records.region_tokens` is the geometry):
  sink    the first 128 tokens, fp16, never quantized (attention sinks);
  body    sealed records (see `records.py`), 128 tokens each, in rotated space;
  recent  fp16 tokens after the body: the live group and the newest `kv_tail_tokens` (the tail).
Attention is one softmax over all three. Since the Hadamard rotation H is orthogonal, q . k is the same in
either space: the fp16 stores keep the model's own K/V (an update is a plain write, as in mlx-lm's KVCache)
and only records are rotated; their part of the output is rotated back (`kernels/decode.py`).

Sealing: when tokens arrive, every complete group of 128 recent tokens that had left the tail before this
update is rotated and encoded into records (K and V together, so they never disagree). So a prompt chunk
attends to its own tokens exactly and to the stored form of what came before it (causal), and the tokens of
the latest update can always be trimmed (speculative decoding) whatever the tail: nothing sealed depended on
them, so trimming them gives back the cache that never saw them. A draft model's cache under mlx-lm's
speculative decoding takes one token per update and is then trimmed by up to num_draft - 1 tokens, which at a
short tail reaches into the newest record: so the fp16 source of the newest record is kept (`rollback`) until
the next seal, and a trim into that record unseals it exactly. The copy (128 tokens fp16 per layer) counts in
`regions()["reserve"]`, with the buffers' growth room: memory held beyond the tokens the cache serves.
`seal()` and `settle()` seal what is due now and drop the copy (memory reports use them); trimming past
the fp16 tokens is then refused.

Choices where the spec is silent: records seal on the GPU with the `kvarn_seal` kernel and on the CPU with
`records.encode_tokens` (the same steps); K/V are checked for non-finite values when they arrive (base.py).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from .. import window
from ..kernels import (
    MAX_QUERY_TOKENS,
    SplitCounter,
    kvarn_attend,
    kvarn_supported,
    kvarn_tokens,
    seal_records,
    unpack_records,
)
from ..records import (
    KV,
    KVARN_EXT_HEAD_DIMS,
    KVARN_HEAD_DIMS,
    SINK_TOKENS,
    TILE,
    KvarnParts,
    Records,
    decode_tokens,
    encode_tokens,
)
from ..registry import get_scheme
from ..window import groups_to_drop
from .attention import grouped_attention, merge_partials
from .base import GmlxCache, array_bytes
from .fp16 import STORE_DTYPE, GrowingBuffer, fill_sink, keep_sink

__all__ = ["KVarNCache", "SINK_TOKENS"]


class KVarNCache(GmlxCache):
    """kvarn: fp16 sink and recent tokens around a body of bit-packed, variance-normalized records."""

    scheme = "kvarn"
    KERNELS = ("kvarn_decode", "kvarn_seal", "kvarn_unpack")

    def __init__(
        self,
        k_bits: int = 6,
        v_bits: int = 6,
        kv_tail_tokens: int = 1024,
        norm_iters: int = 16,
        layer: int | None = None,
        head_dim_ext: int = 0,
    ):
        super().__init__(layer)
        get_scheme("kvarn").check(self.where(), k_bits=k_bits, v_bits=v_bits, kv_tail_tokens=kv_tail_tokens,
                                  norm_iters=norm_iters, head_dim_ext=head_dim_ext)
        self.head_dim_ext = head_dim_ext  # 1: also head dims 64 and 96 (records outside gmlx's format)
        self.k_bits, self.v_bits = k_bits, v_bits
        self.kv_tail_tokens = kv_tail_tokens
        self.norm_iters = norm_iters
        self.sink: KV | None = None  # K, V (B, H, <=128, D) fp16
        self.body: KV | None = None  # K, V Records, fields (B, H, R, S, ...)
        self.recent = KV(GrowingBuffer(STORE_DTYPE), GrowingBuffer(STORE_DTYPE))
        self.recent_tokens = 0
        self.sink_tokens = 0
        self.newest = 0  # tokens of the latest update: never sealed before the next one arrives
        self.rollback: KV | None = None  # the fp16 K, V of the newest record's tokens, until the next seal
        self._prefix: KV | None = None  # the decoded sink + body for decode steps on a GPU (a graph)
        self._counter = SplitCounter()  # the fused decode kernel's merge counter

    # -- geometry -------------------------------------------------------------------------
    @property
    def n_records(self) -> int:
        """Sealed records per (head, 128-channel slice)."""
        return 0 if self.body is None else self.body.k.count

    def region_tokens(self) -> dict[str, int]:
        """How many tokens each region holds now."""
        tail = min(self.recent_tokens, self.kv_tail_tokens)
        return {"sink": self.sink_tokens, "body": self.n_records * TILE, "live": self.recent_tokens - tail,
                "tail": tail}

    def parts(self) -> KvarnParts:
        """The arrays the kernels read."""
        recent = KV(self.recent.k.data, self.recent.v.data) if self.recent_tokens else None
        return KvarnParts(self.sink, self.body, recent, self.recent_tokens)

    # -- storing --------------------------------------------------------------------------
    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if self._shape is None:  # later updates must have the first one's shape (GmlxCache.arrive)
            accepted = KVARN_HEAD_DIMS + (KVARN_EXT_HEAD_DIMS if self.head_dim_ext else ())
            for name, x in (("keys", keys), ("values", values)):
                if getattr(x, "ndim", 0) == 4 and x.shape[-1] not in accepted:
                    ext = "" if self.head_dim_ext else f" ({'/'.join(map(str, KVARN_EXT_HEAD_DIMS))} with the " \
                                                         "head-dim extension: head_dim_ext=1)"
                    raise ValueError(f"{self.where()}: kvarn does not accept {name} head_dim {x.shape[-1]}; "
                                     f"accepted head dims: {', '.join(map(str, accepted))}{ext}")
        keys, values = self.arrive(keys, values)
        n = keys.shape[2]
        room = SINK_TOKENS - self.sink_tokens
        if room > 0:  # the first 128 tokens fill the sink
            self.sink, keys, values = fill_sink(self.sink, keys, values, room)
            self.sink_tokens = self.sink.k.shape[2]
        if keys.shape[2]:
            self.recent.k.write(self.recent_tokens, keys)
            self.recent.v.write(self.recent_tokens, values)
            self.recent_tokens += keys.shape[2]
        self.offset += n
        self.newest = n
        due = self.due_groups()
        if due:
            self._seal(due)
        if self.max_kv_size is not None:
            self._roll(n)
        return self._return(*self.fetch(keys.dtype, decode_step=n <= MAX_QUERY_TOKENS))

    def due_groups(self) -> int:
        """Complete groups of 128 recent tokens that had left the tail before the latest update arrived."""
        return max(0, self.recent_tokens - self.newest - self.kv_tail_tokens) // TILE

    def seal(self) -> int:
        """Seal every complete group that has left the tail now, the latest update's tokens too; returns how many.

        Updates seal on their own; this is for reports of the resident bytes (the tokens it seals can no
        longer be trimmed).
        """
        n = max(0, self.recent_tokens - self.kv_tail_tokens) // TILE
        self._seal(n)
        self.newest = 0
        self.rollback = None
        return n

    def _seal(self, groups: int) -> None:
        """Rotate and encode the oldest `groups` groups of recent tokens into records (K and V both, or neither)."""
        if groups <= 0:
            return
        tokens = groups * TILE
        new = []
        for buf, bits, kind in ((self.recent.k, self.k_bits, "k"), (self.recent.v, self.v_bits, "v")):
            chunk = mx.hadamard_transform(buf.data[:, :, :tokens])
            if self._shape[2] in KVARN_HEAD_DIMS and self.uses_kernel("kvarn_seal"):  # the kernel's 128-wide tiles
                new.append(seal_records(chunk, bits, kind, self.norm_iters))
            else:
                new.append(encode_tokens(chunk, bits, kind, self.norm_iters))
        new = [Records(*r.arrays, bits=r.bits, kind=r.kind) for r in new]  # the imbalances are not stored
        self.rollback = KV(*(mx.contiguous(buf.data[:, :, tokens - TILE:tokens]) for buf in self.recent))
        self.body = KV(*new) if self.body is None else KV(*(old.concat(r) for old, r in zip(self.body, new)))
        for buf in self.recent:
            buf.remove(0, tokens, self.recent_tokens)
        self.recent_tokens -= tokens
        self._prefix = None

    def settle(self) -> None:
        """Seal what is due and roll the window, as the next update would (see GmlxCache.settle)."""
        self.seal()
        super().settle()

    def _roll(self, newest: int) -> None:
        """The rolling window: the oldest whole records leave (gmlx_lab/window.py); the sink and tail stay."""
        drop = min(groups_to_drop(self.held, self.max_kv_size, newest), self.n_records)
        if drop:
            if drop < self.n_records:
                self.body = KV(*(r.drop_first(drop) for r in self.body))
            else:
                self.body = self.rollback = None
            self.dropped += drop * TILE
            self._prefix = None

    def window_check(self, max_kv_size: int | None) -> None:
        """A kvarn window must hold the sink, the fp16 tail and whole records beside the live group."""
        window.check(max_kv_size, self.kv_tail_tokens, self.where())

    # -- reading -------------------------------------------------------------------------
    def decoded_body(self, dtype: mx.Dtype = mx.float32) -> KV | None:
        """The body's K and V decoded to (B, H, tokens, D) in the model's space (rotated back)."""
        if self.body is None:
            return None
        decode = unpack_records if self._unpacks() else decode_tokens
        return KV(*(mx.hadamard_transform(decode(r, dtype)) for r in self.body))

    def fetch(self, dtype: mx.Dtype = mx.float32, decode_step: bool = False) -> KV:
        """All tokens' K and V in the model's space: sink, decoded body, recent tokens.

        On a GPU each is one `kvarn_unpack` launch (decode, rotate back and surround with the fp16 tokens in
        one pass). For decode steps the fused kernels never read these: the decoded sink + body are then
        built as a graph once per seal and reused (evaluated only if the model reads the K/V itself, and
        then kept until the next seal, which spares it a decode per step).
        """
        n = self.recent_tokens
        if decode_step and self.kernel_route(True, "kvarn_decode") == "fused":
            if self._prefix is None:
                self._prefix = self._decoded_prefix(dtype)
            pk, pv = self._prefix
        elif self.body is not None and self._unpacks():
            return KV(*(kvarn_tokens(s, r, buf.data if n else None, n, dtype)
                        for s, r, buf in zip(self.sink, self.body, self.recent)))
        else:
            pk, pv = self._decoded_prefix(dtype)
        if pk.dtype != dtype:
            pk, pv = pk.astype(dtype), pv.astype(dtype)
        if not n:
            return KV(pk, pv)
        rk, rv = self.recent.k.data[:, :, :n], self.recent.v.data[:, :, :n]
        if rk.dtype != dtype:
            rk, rv = rk.astype(dtype), rv.astype(dtype)
        return KV(mx.concatenate([pk, rk], axis=2), mx.concatenate([pv, rv], axis=2))

    def _unpacks(self) -> bool:
        """Whether the body decodes with the `kvarn_unpack` kernel (a GPU, and its 128-wide tiles)."""
        return self._shape[2] in KVARN_HEAD_DIMS and self._shape[3] in KVARN_HEAD_DIMS and \
            self.uses_kernel("kvarn_unpack")

    def _decoded_prefix(self, dtype: mx.Dtype) -> KV:
        if self.body is None:
            return self.sink
        if self._unpacks():
            return KV(*(kvarn_tokens(s, r, None, 0, dtype) for s, r in zip(self.sink, self.body)))
        return KV(*(mx.concatenate([s.astype(dtype), b], axis=2) for s, b in zip(self.sink, self.decoded_body(dtype))))

    def attend(self, queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any) -> mx.array:
        """Attention over every region: the fused kernels on a GPU, else softmax over the fetched K/V."""
        parts = self.parts()
        route = self.kernel_route(kvarn_supported(parts, queries, mask), "kvarn_decode")
        if route is not None:
            return kvarn_attend(queries, scale, mask, parts, emulate=route == "emulated", counter=self._counter)
        if self.body is None or self._unpacks():  # the fetched K/V: fp16 only, or one kvarn_unpack pass (GPU)
            return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)
        return self._attend_by_region(queries, scale, mask)

    def _attend_by_region(self, queries: mx.array, scale: float, mask: Any) -> mx.array:
        """The reference attention, as the fused kernel computes it: the records in rotated space with rotated
        queries, the fp16 sink and recent tokens with the queries as they are, one softmax over both
        (`merge_partials`), and only the records' share of the output rotated back. Rotating the decoded body
        back instead costs a Hadamard transform of every token at every step (1.5x the CPU decode step of a
        4096-token cache, measured on this lab's CPU)."""
        dtype = queries.dtype
        n, ns = self.recent_tokens, self.sink_tokens
        body = KV(*(decode_tokens(r, dtype) for r in self.body))
        fp16 = KV(*(mx.concatenate([s.astype(dtype), buf.data[:, :, :n].astype(dtype)], axis=2)
                    for s, buf in zip(self.sink, self.recent)))
        if isinstance(mask, mx.array):  # columns in fetch's order: sink, body, recent
            nb = body.k.shape[2]
            fp16_mask, body_mask = mx.concatenate([mask[..., :ns], mask[..., ns + nb:]], axis=-1), mask[..., ns:ns + nb]
        else:  # None or "causal": every record precedes every query (the latest update is never sealed)
            fp16_mask, body_mask = mask, None
        out_body, lse_body = grouped_attention(mx.hadamard_transform(queries), *body, scale, body_mask)
        out_fp16, lse_fp16 = grouped_attention(queries, *fp16, scale, fp16_mask)
        out = merge_partials([(mx.hadamard_transform(out_body), lse_body), (out_fp16, lse_fp16)])
        return out.astype(dtype)

    def record(self, kind: str, batch: int, head: int, index: int, slice_: int = 0) -> Records:
        """One sealed record as a `Records` (for notebooks and tests)."""
        if kind not in ("k", "v"):
            raise ValueError(f"{self.where()}: record kind={kind!r}; accepted: 'k' or 'v'")
        if self.body is None or not 0 <= index < self.n_records:
            raise IndexError(f"{self.where()}: record {index} does not exist ({self.n_records} sealed)")
        return getattr(self.body, kind).take((batch, head, index, slice_))

    # -- contract ------------------------------------------------------------------------
    def trim(self, n: int) -> int:
        """Roll back the newest n tokens (speculative decoding): the recent tokens, and the sink before any record.

        The latest update's tokens are never sealed yet, so they can always go; so can the newest record's, from
        its fp16 copy (`rollback`, see the module docstring). Older records cannot be restored exactly and a trim
        into them is refused.
        """
        unsealable = TILE if self.rollback is not None else 0
        records_left = self.n_records - (1 if unsealable else 0)
        fp16_tokens = self.recent_tokens + unsealable + (0 if records_left else self.sink_tokens)
        n = self.check_trim(n, fp16_tokens, "tokens already sealed into records cannot be restored exactly")
        if unsealable and n > self.recent_tokens:
            self._unseal_newest()
        from_recent = min(n, self.recent_tokens)
        self.recent_tokens -= from_recent
        if n > from_recent:
            keep = self.sink_tokens - (n - from_recent)
            self.sink = keep_sink(self.sink, keep)
            self.sink_tokens = keep
        self.offset -= n
        self.newest = max(0, self.newest - n)
        self._fetched = None
        self._prefix = None
        return n

    def _unseal_newest(self) -> None:
        """Put the newest record's tokens back in front of the recent ones, from their fp16 copy (`rollback`)."""
        n = self.recent_tokens
        back = KV(*(mx.concatenate([r, buf.data[:, :, :n]], axis=2) if n else r
                    for r, buf in zip(self.rollback, self.recent)))
        self.recent = KV(GrowingBuffer(STORE_DTYPE), GrowingBuffer(STORE_DTYPE))
        for buf, x in zip(self.recent, back):
            buf.write(0, x)
        self.recent_tokens = n + TILE
        self.body = KV(*(r.drop_last(1) for r in self.body)) if self.n_records > 1 else None
        self.rollback = None

    def regions(self) -> dict[str, int]:
        """Resident bytes by region; "reserve" is what is held beyond the tokens served: the recent buffers'
        growth room and the newest record's fp16 copy (`rollback`)."""
        tokens = self.region_tokens()
        recent_bytes = array_bytes(self.recent.k.data, self.recent.v.data)
        per_token = recent_bytes // max(self.recent.k.capacity(), 1)
        bodies = () if self.body is None else tuple(self.body)
        used = per_token * self.recent_tokens
        kept = 0 if self.rollback is None else array_bytes(*self.rollback)
        return {
            "sink": 0 if self.sink is None else array_bytes(*self.sink),
            "record_codes": array_bytes(*(b.codes for b in bodies)),
            "record_scales": array_bytes(*(a for b in bodies for a in b.arrays[1:])),
            "live": per_token * tokens["live"],
            "tail": per_token * tokens["tail"],
            "reserve": recent_bytes - used + kept,
        }

    def __deepcopy__(self, memo: dict) -> KVarNCache:
        """An independent copy (GmlxCache.__deepcopy__) that can still unseal its newest record."""
        new = super().__deepcopy__(memo)
        new.rollback = self.rollback
        return new

    @property
    def state(self) -> tuple[Any, ...]:
        body = (None, None) if self.body is None else tuple(r.arrays for r in self.body)
        sink = (None, None) if self.sink is None else tuple(self.sink)
        recent = (None, None)
        if self.recent_tokens:
            recent = (self.recent.k.view(self.recent_tokens), self.recent.v.view(self.recent_tokens))
        meta = (self.offset, self.k_bits, self.v_bits, self.kv_tail_tokens, self.norm_iters, self.layer, self.newest,
                self.max_kv_size, self.dropped, self.head_dim_ext, *self.sliding_state())
        return (*sink, *body, *recent, *meta)

    @state.setter
    def state(self, v: tuple[Any, ...]) -> None:
        sk, sv, bk, bv, rk, rv, offset, k_bits, v_bits, tail, iters, layer, newest, max_kv_size, dropped, ext, *rest = v
        self.__init__(k_bits, v_bits, tail, iters, layer, ext)
        self.offset, self.newest, self.max_kv_size, self.dropped = offset, newest, max_kv_size, dropped
        self.restore_sliding(rest)  # sliding_state()
        if sk is not None:
            self.sink, self.sink_tokens = KV(sk, sv), sk.shape[2]
            self._shape = (sk.shape[0], sk.shape[1], sk.shape[3], sv.shape[3])
        if bk is not None:
            self.body = KV(Records(*bk, bits=k_bits, kind="k"), Records(*bv, bits=v_bits, kind="v"))
        if rk is not None:
            self.recent = KV(GrowingBuffer(STORE_DTYPE, rk), GrowingBuffer(STORE_DTYPE, rv))
            self.recent_tokens = rk.shape[2]
