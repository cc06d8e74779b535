"""kvarn: a block cache (cache/block.py) whose blocks are Hadamard-rotated, variance-normalized records, and its
registry entry.

A layer's tokens live in the block base's three stores, oldest first (`records.region_tokens` is the geometry):
  sink    the first 128 tokens, fp16, never quantized (attention sinks);
  body    sealed records (see `records.py`), 128 tokens each, in rotated space: the base's blocks;
  recent  fp16 tokens after the body: the live group and the newest `kv_tail_tokens` (the tail).
Attention is one softmax over all three. Since the Hadamard rotation H is orthogonal, q . k is the same in
either space: the fp16 stores keep the model's own K/V (an update is a plain write, as in mlx-lm's KVCache)
and only records are rotated; their part of the output is rotated back (`kernels/kvarn.py`).

The base seals (encodes) a complete group of 128 recent tokens once it had left the tail before the latest
update, so a prompt chunk attends to its own tokens exactly and to the stored form of what came before it, and
the tokens of the latest update can always be trimmed (speculative decoding). kvarn keeps the newest record's
fp16 source until the next seal (`keep_newest_block`, `rollback`): a draft model's cache under mlx-lm's
speculative decoding is trimmed by up to num_draft - 1 tokens, which at a short tail reaches into the newest
record. The base also rolls kvarn's window (its blocks are the window's groups) and keeps trim, `state` and
`regions`. What kvarn adds: `encode`/`decode` (records), the rotation, the head-dim rule (`records.py`), and the
fused GPU kernels as `attend` and `fetch` overrides; on the CPU a decode step reads the records' codes through
`mx.quantized_matmul` (`records.records_attention`).

Choices where the spec is silent: records seal on the GPU with the `kvarn_seal` kernel and on the CPU with
`records.encode_tokens` (the same steps); K/V are checked for non-finite values when they arrive (base.py).

The registry entry (`KvarnScheme`, below the cache) says what the registry, the policy, the figures and the audit
need to know about it; the record format and the region geometry are `records.py` beside this module.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from ...kernels import (
    MAX_QUERY_TOKENS,
    KvarnCall,
    SplitCounter,
    active_backend,
    kvarn_attend,
    kvarn_supported,
    kvarn_tokens,
    seal_records,
    unpack_records,
)
from ...mlx_lm_hooks import register_cache_class
from ...registry import Option, register_scheme
from ..attention import grouped_attention, merge_partials
from ..block import BlockCache, BlockScheme
from ..buffers import KV, STORE_DTYPE, array_bytes
from ..kernel_route import KernelRoute
from ..options import width_options
from . import records
from .records import (
    KVARN_BITS,
    KVARN_EXT_HEAD_DIMS,
    KVARN_HEAD_DIMS,
    SINK_TOKENS,
    TILE,
    KvarnParts,
    Records,
    decode_tokens,
    encode_tokens,
    head_dim_problem,
    records_attention,
    slice_width,
)

__all__ = ["KvarnCache", "SINK_TOKENS"]


class KvarnCache(KernelRoute, BlockCache):
    """kvarn: fp16 sink and recent tokens around a body of bit-packed, variance-normalized records."""

    scheme = "kvarn"
    block_tokens = TILE  # a record's tokens
    sink_tokens = SINK_TOKENS
    keep_newest_block = True
    tail_before_update = True
    KERNELS = ("kvarn_decode", "kvarn_seal", "kvarn_unpack")
    OPTIONS = (
        *width_options(6, KVARN_BITS),
        Option("kv_tail_tokens", 1024, "newest tokens kept in fp16"),
        Option("norm_iters", 16, "variance-normalization rounds per record", minimum=0),
        Option("head_dim_ext", 0, "1: also head dims 64 and 96, records of 128 tokens by the whole head (outside "
               "gmlx's format; gmlx declines such layers)", (0, 1)),
    )

    @classmethod
    def complete(cls, values: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
        """Each of the K and V widths: `k_bits`/`v_bits` if given, else `bits` if given, else GMLX_KVARN_BITS if
        set, else the default `bits`. An explicit width always beats the environment (`KvarnScheme.environment`
        says when the environment chose)."""
        env = environment_widths()
        widths = []
        for i, name in enumerate(("k_bits", "v_bits")):
            if given.get(name) is not None:
                widths.append(given[name])
            elif given.get("bits") is not None or env is None:
                widths.append(values["bits"])
            else:
                widths.append(env[i])
        return {**values, "k_bits": widths[0], "v_bits": widths[1]}

    def __init__(
        self,
        k_bits: int | None = None,
        v_bits: int | None = None,
        kv_tail_tokens: int | None = None,
        norm_iters: int | None = None,
        layer: int | None = None,
        head_dim_ext: int | None = None,
        bits: int | None = None,
    ):
        # None: the option's default (OPTIONS); checked and set as self.k_bits, ... (BlockCache)
        super().__init__(layer, bits=bits, k_bits=k_bits, v_bits=v_bits, kv_tail_tokens=kv_tail_tokens,
                         norm_iters=norm_iters, head_dim_ext=head_dim_ext)
        self._counter = SplitCounter()  # the fused decode kernel's merge counter

    # -- what a block scheme writes: records -----------------------------------------------------
    def rotate(self, x: mx.array) -> mx.array:
        """The Hadamard rotation of the stored fp16 tokens, in fp16 (as the records are sealed)."""
        return mx.hadamard_transform(x.astype(STORE_DTYPE))

    def unrotate(self, x: mx.array) -> mx.array:
        return mx.hadamard_transform(x)

    def scale_group(self, kind: str) -> tuple[int, int]:
        """A record, 128 tokens by 128 channels: each value is scaled by its channel's and its token's factor (the
        variance normalization), in K and V."""
        return TILE, TILE

    def encode(self, x: mx.array, kind: str) -> tuple[mx.array, ...]:
        """Rotated blocks (B, H, 128, D) as one record each: codes and three axis vectors, fields (B, H, S, ...)."""
        bits = self.k_bits if kind == "k" else self.v_bits
        if x.shape[-1] in KVARN_HEAD_DIMS and self.uses_kernel("kvarn_seal"):  # the kernel's 128-wide tiles
            r = seal_records(x, bits, kind, self.norm_iters)
        else:
            r = encode_tokens(x, bits, kind, self.norm_iters)
        return tuple(a[:, :, 0] for a in r.arrays)  # one record per block: no record axis

    def decode(self, parts: tuple[mx.array, ...], kind: str) -> mx.array:
        return decode_tokens(self._as_records(tuple(p[:, :, None] for p in parts), kind))

    def check_head_dims(self, k_dim: int, v_dim: int) -> None:
        """kvarn's head-dim rule (`records.head_dim_problem`), naming the layer."""
        for name, d in (("keys", k_dim), ("values", v_dim)):
            problem = head_dim_problem(d, self.head_dim_ext)
            if problem:
                raise ValueError(f"{self.where()}: {name} {problem}")

    # -- records ------------------------------------------------------------------------------------
    def _as_records(self, arrays: tuple[mx.array, ...], kind: str) -> Records:
        return Records(*arrays, bits=self.k_bits if kind == "k" else self.v_bits, kind=kind)

    @property
    def records(self) -> KV | None:
        """The body as K and V `Records` with fields (B, H, R, S, ...), or None."""
        if self.body is None:
            return None
        return KV(*(self._as_records(parts, kind) for parts, kind in zip(self.body, "kv")))

    @property
    def n_records(self) -> int:
        """Sealed records per (head, 128-channel slice): the base's blocks."""
        return self.n_blocks

    def parts(self) -> KvarnParts:
        """The arrays the kernels read."""
        recent = KV(self.recent.k.data, self.recent.v.data) if self.recent_count else None
        return KvarnParts(self.sink, self.records, recent, self.recent_count)

    # -- reading -------------------------------------------------------------------------
    def decoded_body(self, dtype: mx.Dtype = mx.float32) -> KV | None:
        """The body's K and V decoded to (B, H, tokens, D) in the model's space (rotated back)."""
        if self.body is None:
            return None
        decode = unpack_records if self._unpacks() else decode_tokens
        return KV(*(mx.hadamard_transform(decode(r, dtype)) for r in self.records))

    def fetch(self, dtype: mx.Dtype = mx.float32, decode_step: bool | None = None) -> KV:
        """All tokens' K and V in the model's space: sink, decoded body, recent tokens.

        On a GPU each is one `kvarn_unpack` launch (decode, rotate back and surround with the fp16 tokens in
        one pass). For decode steps (default: an update of at most MAX_QUERY_TOKENS) the fused kernels never
        read these: the decoded sink + body are then built as a graph once per seal and reused (evaluated only
        if the model reads the K/V itself, and then kept until the body changes, which spares a decode per step).
        """
        if decode_step is None:
            decode_step = self.arrived <= MAX_QUERY_TOKENS
        n = self.recent_count
        if decode_step and self.kernel_route(True, "kvarn_decode") == "fused":
            pk, pv = self.kept_prefix(dtype, self._decoded_prefix)
        elif self.body is not None and self._unpacks():
            return KV(*(kvarn_tokens(s, r, buf.data if n else None, n, dtype)
                        for s, r, buf in zip(self.sink, self.records, self.recent)))
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
            return KV(*(kvarn_tokens(s, r, None, 0, dtype) for s, r in zip(self.sink, self.records)))
        return KV(*(mx.concatenate([s.astype(dtype), b], axis=2) for s, b in zip(self.sink, self.decoded_body(dtype))))

    def attend(self, queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any) -> mx.array:
        """Attention over every region: the fused kernels on a GPU, else softmax over the fetched K/V."""
        call = self._fused_call(queries, scale, mask)
        if call is not None:
            return call(queries, self.recent_count, self._counter)
        parts = self.parts()
        route = self.kernel_route(kvarn_supported(parts, queries, mask), "kvarn_decode")
        if route is not None:
            return kvarn_attend(queries, scale, mask, parts, emulate=route == "emulated", counter=self._counter)
        if self.codes_step(queries, values, mask):
            return self._attend_by_region(queries, scale, mask, from_codes=True)
        out = self.sliced(queries, keys, values, scale, mask)  # a cache longer than a slice of scratch
        if out is not None:
            return out
        if self.body is None or self._unpacks():  # the fetched K/V: fp16 only, or one kvarn_unpack pass (GPU)
            return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)
        return self._attend_by_region(queries, scale, mask)

    def _fused_call(self, queries: mx.array, scale: float, mask: Any) -> KvarnCall | None:
        """The fused kernel's call for this step, or None where `attend` takes another route, kept while the arrays
        read and the recent tokens' 128-token tiles stay (`kept_call`)."""
        if self.body is None:
            return None
        n = self.recent_count
        objects = (self.body, self.sink, self.recent.k.data, self.recent.v.data)

        def make() -> KvarnCall | None:
            parts = self.parts()
            fused = self.kernel_route(kvarn_supported(parts, queries, mask), "kvarn_decode") == "fused"
            return KvarnCall(queries.shape, scale, isinstance(mask, str) and queries.shape[2] > 1, parts) if fused \
                else None
        return self.kept_call(queries, scale, mask, objects, (-(-n // 128), n >= queries.shape[2]), make)

    def codes_step(self, queries: mx.array, values: mx.array, mask: Any) -> bool:
        """Whether a decode step reads the records' codes through `mx.quantized_matmul` (`records_attention`):
        "auto" on the CPU, where no kernel runs, one query token, no array mask, K and V of the queries' width, and
        a record's rows of 64 or 128 channels (a V row is one of mx.quantize's groups)."""
        return (self.attention_path == "auto" and active_backend() == "cpu" and self.body is not None
                and queries.shape[2] == 1 and not isinstance(mask, mx.array)
                and values.shape[-1] == queries.shape[-1] and slice_width(queries.shape[-1]) in (64, TILE))

    def _attend_by_region(self, queries: mx.array, scale: float, mask: Any, from_codes: bool = False) -> mx.array:
        """The reference attention, as the fused kernel computes it: the records in rotated space with rotated
        queries, the fp16 sink and recent tokens with the queries as they are, one softmax over both
        (`merge_partials`), and only the records' share of the output rotated back. Rotating the decoded body
        back instead costs a Hadamard transform of every token at every step (1.5x the CPU decode step of a
        4096-token cache, measured on this lab's CPU). `from_codes`: the records' share from their codes
        (`records.records_attention`), none decoded."""
        dtype = queries.dtype
        n, ns = self.recent_count, self.sink_count
        fp16 = KV(*(mx.concatenate([s.astype(dtype), buf.data[:, :, :n].astype(dtype)], axis=2)
                    for s, buf in zip(self.sink, self.recent)))
        if from_codes:  # a decode step with no array mask: every record precedes the query
            out_body, lse_body = records_attention(mx.hadamard_transform(queries), scale, *self.records)
            out_fp16, lse_fp16 = grouped_attention(queries, *fp16, scale, mask)
            return merge_partials([(mx.hadamard_transform(out_body), lse_body), (out_fp16, lse_fp16)]).astype(dtype)
        body = KV(*(decode_tokens(r, dtype) for r in self.records))
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
        return getattr(self.records, kind).take((batch, head, index, slice_))

    def memory_regions(self) -> tuple[dict[str, int], dict[str, int] | None]:
        """The records' codes and scales as one region, "body", beside the fp16 sink, live group and tail (the
        regions whose tokens `region_tokens` counts)."""
        r = self.regions()
        regions = {"sink": r["sink"], "body": r["record_codes"] + r["record_scales"], "live": r["live"],
                   "tail": r["tail"]}
        return regions, self.region_tokens()

    def regions(self) -> dict[str, int]:
        """The base's regions, the body split into the records' codes and their scales (the axis vectors)."""
        r = super().regions()
        body = r.pop("body")
        codes = 0 if self.body is None else array_bytes(self.body.k[0], self.body.v[0])
        return {"sink": r["sink"], "record_codes": codes, "record_scales": body - codes, "live": r["live"],
                "tail": r["tail"], "reserve": r["reserve"]}


KVARN_BITS_ENV = "GMLX_KVARN_BITS"  # K and V widths, "6" or "k6v5", where no width is given

def parse_kvarn_bits(text: str) -> tuple[int, int]:
    """Parse a GMLX_KVARN_BITS value: "6" (both) or "k6v5" (K then V)."""
    match = re.fullmatch(r"\s*(?:(\d+)|k(\d+)v(\d+))\s*", text or "")
    if not match:
        raise ValueError(
            f"{KVARN_BITS_ENV}={text!r} is malformed; expected a width such as '6' "
            f"or K and V widths such as 'k6v5' (widths: {', '.join(map(str, KVARN_BITS))})"
        )
    if match.group(1):
        kb = vb = int(match.group(1))
    else:
        kb, vb = int(match.group(2)), int(match.group(3))
    for which, b in (("K", kb), ("V", vb)):
        if b not in KVARN_BITS:
            raise ValueError(
                f"{KVARN_BITS_ENV}={text!r}: {which} width {b} is not supported; "
                f"accepted: {', '.join(map(str, KVARN_BITS))}"
            )
    return kb, vb


def environment_widths() -> tuple[int, int] | None:
    """The K and V widths GMLX_KVARN_BITS sets, or None when it is unset or empty."""
    text = os.environ.get(KVARN_BITS_ENV, "")
    return parse_kvarn_bits(text) if text.strip() else None


@dataclass(frozen=True)
class KvarnScheme(BlockScheme):
    """Records of 128 tokens x 128 channels per KV head; needs head dims of whole 128-channel slices. The byte
    formula, the audit and the roundtrip come from the class (BlockScheme), as for a plug-in."""

    def environment(self, given: dict[str, Any]) -> str:
        """Which widths GMLX_KVARN_BITS chose for these options ('' when explicit widths or defaults did)."""
        if environment_widths() is None or given.get("bits") is not None:
            return ""
        chose = [kind for kind in ("K", "V") if given.get(f"{kind.lower()}_bits") is None]
        if not chose:
            return ""
        return f"{' and '.join(chose)} width{'s' if len(chose) > 1 else ''} from " \
               f"{KVARN_BITS_ENV}={os.environ[KVARN_BITS_ENV].strip()}"

    def label(self, values: dict[str, Any]) -> str:
        """`kvarn6 tail=1024`, `kvarn k6v5 tail=128`; " ext" with the head-dim extension (64/96)."""
        return super().label(values) + (" ext" if values.get("head_dim_ext") else "")

    def declines(self, kind: str, k_dim: int, v_dim: int, options: dict[str, Any]) -> str | None:
        """Latent (MLA) caches, and head dims the format has no records for (`records.head_dim_problem`)."""
        if kind == "latent-attention":
            return "MLA latent cache: kvarn declines"
        ext = options.get("head_dim_ext", 0)
        return next((p for p in (records.head_dim_problem(d, ext) for d in sorted({k_dim, v_dim})) if p), None)

    def reason_taken(self, kind: str, k_dim: int, v_dim: int, options: dict[str, Any]) -> str:
        for d in sorted({k_dim, v_dim}):
            if d in KVARN_EXT_HEAD_DIMS and options.get("head_dim_ext", 0):
                return (f"growing attention, head_dim {d} by the head-dim extension (records of 128 tokens x "
                        f"{d} channels: outside gmlx's format)")
        return "growing attention"

    def token_region(self, position: int, tokens: int, newest: int, options: dict[str, Any]) -> str:
        """The fp16 sink, the records, the live group or the fp16 tail, in that order along the context."""
        regions = records.region_tokens(tokens, options["kv_tail_tokens"], newest=newest)
        end = 0
        for region, name in (("sink", "sink"), ("body", "records"), ("live", "live"), ("tail", "tail")):
            end += regions[region]
            if position < end:
                return name
        raise ValueError(f"position {position} is outside a cache of {tokens} tokens")


SCHEME = register_scheme(KvarnScheme(
    "kvarn", "Hadamard rotation + variance-normalized 128x128 records, fp16 sink and tail (KVarN)",
    cache_class=KvarnCache, color="#ff7f0e",
    examples=({"bits": 6, "kv_tail_tokens": 0}, {"k_bits": 8, "v_bits": 4, "kv_tail_tokens": 64},
              {"bits": 4, "kv_tail_tokens": 0})))
register_cache_class(KvarnCache, "KVarNCache")  # prompt caches saved before the class took its scheme's spelling
