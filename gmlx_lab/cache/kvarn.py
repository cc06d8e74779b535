"""The kvarn cache: Hadamard-rotated heads, an fp16 sink and tail, and variance-normalized records.

A layer's tokens live in four regions, oldest first:
  sink   the first 128 tokens, fp16, never quantized (attention sinks);
  body   sealed records (see `records.py`), 128 tokens each;
  live   fp16 tokens that have left the tail but whose group of 128 is not yet complete;
  tail   the newest `kv_tail_tokens` tokens, fp16.
A token is sealed once it has left the tail and its group of 128 is complete.
Everything is stored rotated (K and V of each head times the normalized
Walsh-Hadamard matrix H), so attention runs in rotated space: rotate the query,
attend over sink + body + live + tail in one softmax, rotate the output back.

Choices where the spec is silent: the sink and tail are stored rotated too
(one space for all regions); a prompt chunk is stored, and sealed, before its
own queries attend (as mlx-lm's and llama.cpp's quantized caches do), so a long
prefill chunk sees its own sealed tokens quantized while decode sees exactly the
state one token at a time would produce; K/V are checked for non-finite values
when a record is sealed (checking every step would stall the pipeline); on a GPU
the check of one seal is read at the next seal, so it never waits on the GPU.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from ..registry import KVARN_HEAD_DIMS
from .base import GmlxCache, array_bytes
from .fp16 import STORE_DTYPE
from .records import TILE, Records, check_bits, decode_record, decode_tiles, encode_record, encode_tiles

__all__ = ["KVarNCache", "Records", "encode_record", "decode_record", "SINK_TOKENS"]

SINK_TOKENS = 128
_FIELDS = ("codes", "scale_axis", "zp_axis", "other_axis")


def _cat(a: mx.array | None, b: mx.array, axis: int) -> mx.array:
    return b if a is None else mx.concatenate([a, b], axis=axis)


def _tokens(x: mx.array | None) -> int:
    return 0 if x is None else x.shape[2]


class KVarNCache(GmlxCache):
    """kvarn: fp16 sink and tail around a body of bit-packed, variance-normalized records."""

    scheme = "kvarn"

    def __init__(
        self,
        k_bits: int = 6,
        v_bits: int = 6,
        kv_tail_tokens: int = 1024,
        norm_iters: int = 16,
        layer: int | None = None,
    ):
        super().__init__(layer)
        for b in (k_bits, v_bits):
            check_bits(b)
        if not isinstance(kv_tail_tokens, int) or kv_tail_tokens < 0:
            raise ValueError(f"{self.where()}: kv_tail_tokens={kv_tail_tokens!r}; accepted: an int >= 0")
        self.k_bits, self.v_bits = k_bits, v_bits
        self.kv_tail_tokens = kv_tail_tokens
        self.norm_iters = norm_iters
        self.sink: list[mx.array | None] = [None, None]  # K, V: (B, H, <=128, D) fp16, rotated
        self.body: list[dict[str, mx.array] | None] = [None, None]  # K, V record fields (B, H, R, S, ...)
        self.recent: list[mx.array | None] = [None, None]  # K, V: live + tail, (B, H, n, D) fp16, rotated
        self._unchecked: list[tuple[str, mx.array]] = []  # finiteness flags of sealed chunks not yet read

    # -- geometry -------------------------------------------------------------------------
    @property
    def n_records(self) -> int:
        """Sealed records per (head, 128-channel slice)."""
        return 0 if self.body[0] is None else self.body[0]["codes"].shape[2]

    def region_tokens(self) -> dict[str, int]:
        """How many tokens each region holds now."""
        recent = _tokens(self.recent[0])
        tail = min(recent, self.kv_tail_tokens)
        return {"sink": _tokens(self.sink[0]), "body": self.n_records * TILE, "live": recent - tail, "tail": tail}

    # -- storing ------------------------------------------------------------------------
    def _check_head_dims(self, keys: mx.array, values: mx.array) -> None:
        for name, x in (("keys", keys), ("values", values)):
            if x.shape[-1] not in KVARN_HEAD_DIMS:
                raise ValueError(
                    f"{self.where()}: kvarn does not accept {name} head_dim {x.shape[-1]}; "
                    f"accepted head dims: {', '.join(map(str, KVARN_HEAD_DIMS))}"
                )

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.check_input(keys, values)
        self._check_head_dims(keys, values)
        dtype = keys.dtype
        for i, x in enumerate((keys, values)):
            x = mx.hadamard_transform(x).astype(STORE_DTYPE)
            room = SINK_TOKENS - _tokens(self.sink[i])
            if room > 0:
                self.sink[i] = _cat(self.sink[i], x[..., :room, :], axis=2)
                x = x[..., room:, :]
            if x.shape[2]:
                self.recent[i] = _cat(self.recent[i], x, axis=2)
        self.offset += keys.shape[2]
        self._seal()
        k, v = (mx.hadamard_transform(x) for x in self.rotated_kv(dtype))
        return self._return(k, v)

    def _seal(self) -> None:
        """Move every complete group of 128 that has left the tail into records.

        On a GPU backend (and attention_path != "reference") the `kvarn_seal` kernel encodes the records
        in the same launch queue as decode, so sealing never waits on the CPU. On the CPU, `encode_tiles`.
        """
        n = (_tokens(self.recent[0]) - self.kv_tail_tokens) // TILE
        if n <= 0:
            return
        from ..kernels import active_backend, seal_records

        on_gpu = self.attention_path != "reference" and active_backend() != "cpu"
        self.check_finite()  # the previous seal's flags: computed by now, reading them does not stall
        for i, (bits, kind) in enumerate(((self.k_bits, "k"), (self.v_bits, "v"))):
            chunk = self.recent[i][..., : n * TILE, :]
            self._unchecked.append((kind, mx.all(mx.isfinite(chunk))))
            if on_gpu:
                new = seal_records(chunk, bits, kind, self.norm_iters)
            else:
                self.check_finite()
                new = encode_tiles(self._to_tiles(chunk, kind), bits, kind, self.norm_iters)
            fields = {f: getattr(new, f) for f in _FIELDS}
            old = self.body[i]
            self.body[i] = fields if old is None else {f: mx.concatenate([old[f], fields[f]], axis=2) for f in _FIELDS}
            # contiguous copies once per seal, so the fused kernels read them without a copy per decode step
            self.recent[i] = mx.contiguous(self.recent[i][..., n * TILE :, :])
            self.sink[i] = mx.contiguous(self.sink[i])

    def check_finite(self) -> None:
        """Raise if K/V sealed since the last check held inf or nan (records would be garbage)."""
        pending, self._unchecked = self._unchecked, []
        for kind, finite in pending:
            if not finite.item():
                raise ValueError(
                    f"{self.where()}: non-finite {'keys' if kind == 'k' else 'values'} (inf or nan) "
                    f"in tokens being sealed; kvarn needs finite K/V"
                )

    @staticmethod
    def _to_tiles(x: mx.array, kind: str) -> mx.array:
        """(B, H, n*128, D) tokens to record tiles (B, H, n, D/128, rows, cols)."""
        b, h, t, d = x.shape
        tiles = x.reshape(b, h, t // TILE, TILE, d // TILE, TILE).transpose(0, 1, 2, 4, 3, 5)
        return tiles.swapaxes(-1, -2) if kind == "k" else tiles

    @staticmethod
    def _from_tiles(tiles: mx.array, kind: str) -> mx.array:
        """Inverse of `_to_tiles`."""
        if kind == "k":
            tiles = tiles.swapaxes(-1, -2)
        b, h, n, s = tiles.shape[:4]
        return tiles.transpose(0, 1, 2, 4, 3, 5).reshape(b, h, n * TILE, s * TILE)

    # -- reading -------------------------------------------------------------------------
    def decoded_body(self, dtype: mx.Dtype = mx.float32) -> tuple[mx.array | None, mx.array | None]:
        """The body's K and V decoded to (B, H, tokens, D), still rotated."""
        out = []
        for i, (bits, kind) in enumerate(((self.k_bits, "k"), (self.v_bits, "v"))):
            body = self.body[i]
            tiles = None if body is None else decode_tiles(*(body[f] for f in _FIELDS), bits, dtype)
            out.append(None if tiles is None else self._from_tiles(tiles, kind))
        return out[0], out[1]

    def rotated_kv(self, dtype: mx.Dtype = mx.float32) -> tuple[mx.array, mx.array]:
        """All tokens' K and V in rotated space: sink, decoded body, then live and tail."""
        body = self.decoded_body(dtype)
        out = []
        for i in range(2):
            parts = [p.astype(dtype) for p in (self.sink[i], body[i], self.recent[i]) if p is not None]
            out.append(mx.concatenate(parts, axis=2) if len(parts) > 1 else parts[0])
        return out[0], out[1]

    def attend(self, queries: mx.array, scale: float, mask: Any) -> mx.array:
        """Rotate q, one softmax over every region, rotate the output back (fused kernels or reference)."""
        from ..kernels import kvarn_attend, kvarn_supported

        route = self.kernel_route(kvarn_supported(self, queries, mask))
        if route is not None:
            return kvarn_attend(self, queries, scale, mask, emulate=route == "emulated")
        q = mx.hadamard_transform(queries)
        k, v = self.rotated_kv(q.dtype)
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
        return mx.hadamard_transform(out)

    def record(self, kind: str, batch: int, head: int, index: int, slice_: int = 0) -> Records:
        """One sealed record as a `Records` (for notebooks and tests)."""
        i = {"k": 0, "v": 1}[kind]
        body = self.body[i]
        if body is None or not 0 <= index < self.n_records:
            raise IndexError(f"{self.where()}: record {index} does not exist ({self.n_records} sealed)")
        fields = {f: body[f][batch, head, index, slice_] for f in _FIELDS}
        return Records(**fields, bits=(self.k_bits, self.v_bits)[i], kind=kind)

    # -- contract ------------------------------------------------------------------------
    def trim(self, n: int) -> int:
        """Roll back the newest n tokens (speculative decoding); only fp16 tokens can go.

        Sealed records stay sealed: right after a trim the newest `kv_tail_tokens`
        may include sealed tokens, until new tokens push the tail forward again.
        """
        recent = _tokens(self.recent[0])
        fp16_tokens = recent if self.n_records else recent + _tokens(self.sink[0])
        n = self.check_trim(n, fp16_tokens, "tokens already sealed into records cannot be restored exactly")
        from_recent = min(n, recent)
        for i in range(2):
            if from_recent:
                self.recent[i] = self.recent[i][..., : recent - from_recent, :] if recent > from_recent else None
            if n > from_recent:
                keep = _tokens(self.sink[i]) - (n - from_recent)
                self.sink[i] = self.sink[i][..., :keep, :] if keep else None
        self.offset -= n
        self._fetched = (None, None)
        return n

    def regions(self) -> dict[str, int]:
        tokens = self.region_tokens()
        recent_bytes = array_bytes(*self.recent)
        per_token = recent_bytes // max(_tokens(self.recent[0]), 1)
        bodies = [b for b in self.body if b is not None]
        return {
            "sink": array_bytes(*self.sink),
            "record_codes": array_bytes(*(b["codes"] for b in bodies)),
            "record_scales": array_bytes(*(b[f] for b in bodies for f in _FIELDS[1:])),
            "live": per_token * tokens["live"],
            "tail": per_token * tokens["tail"],
        }

    @property
    def state(self) -> tuple[Any, ...]:
        body = [None if b is None else tuple(b[f] for f in _FIELDS) for b in self.body]
        meta = (self.offset, self.k_bits, self.v_bits, self.kv_tail_tokens, self.norm_iters, self.layer)
        return (*self.sink, *body, *self.recent, *meta)

    @state.setter
    def state(self, v: tuple[Any, ...]) -> None:
        sk, sv, bk, bv, rk, rv, offset, k_bits, v_bits, tail, iters, layer = v
        self.__init__(k_bits, v_bits, tail, iters, layer)
        self.offset = offset
        self.sink, self.recent = [sk, sv], [rk, rv]
        self.body = [None if b is None else dict(zip(_FIELDS, b)) for b in (bk, bv)]
