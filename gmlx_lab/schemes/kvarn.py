"""The kvarn scheme: Hadamard rotation and variance-normalized 128-token records, fp16 sink and tail.

The cache is `cache/kvarn.py`, the record format and the region geometry `records.py`; this module says
what the registry, the policy, the figures and the audit need to know about it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from .. import records
from ..cache.kvarn import KVarNCache
from ..registry import KVARN_BITS, KVARN_BITS_ENV, KVARN_HEAD_DIMS, Option, Scheme, register_scheme

OPTIONS = (
    Option("bits", 6, "code width for K and V", KVARN_BITS),
    Option("k_bits", None, "code width for K (default: bits)", KVARN_BITS),
    Option("v_bits", None, "code width for V (default: bits)", KVARN_BITS),
    Option("kv_tail_tokens", 1024, "newest tokens kept in fp16"),
    Option("norm_iters", 16, "variance-normalization rounds per record", minimum=0),
)


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


@dataclass(frozen=True)
class KvarnScheme(Scheme):
    """Records of 128 tokens x 128 channels per KV head; needs head dims of whole 128-channel slices."""

    def adjust(self, values: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
        """K/V widths: explicit k_bits/v_bits, else bits; GMLX_KVARN_BITS overrides both."""
        env = os.environ.get(KVARN_BITS_ENV)
        if env is not None and env.strip() != "":
            kb, vb = parse_kvarn_bits(env)
        else:
            kb = values["k_bits"] if values["k_bits"] is not None else values["bits"]
            vb = values["v_bits"] if values["v_bits"] is not None else values["bits"]
        return {**values, "k_bits": kb, "v_bits": vb}

    def make_cache(self, options: dict[str, Any], layer: int | None = None) -> KVarNCache:
        return KVarNCache(options["k_bits"], options["v_bits"], options["kv_tail_tokens"], options["norm_iters"],
                          layer=layer)

    def declines(self, kind: str, k_dim: int, v_dim: int, options: dict[str, Any]) -> str | None:
        if kind == "latent-attention":
            return "MLA latent cache: kvarn declines"
        for d in sorted({k_dim, v_dim}):
            if d not in KVARN_HEAD_DIMS:
                return f"head_dim {d}: kvarn needs {'/'.join(map(str, KVARN_HEAD_DIMS))}"
        return None

    def layer_bytes(self, tokens: int, kv_heads: int, k_dim: int, v_dim: int, options: dict[str, Any]) -> float:
        """Sealed tokens: (dk + dv) / 128 records of (2048 * bits + 768) bytes per 128 tokens; the rest fp16."""
        regions = records.region_tokens(tokens, options["kv_tail_tokens"])
        n_rec = regions["body"] // records.TILE
        body = n_rec * (k_dim // records.TILE * records.record_bytes(options["k_bits"]) +
                        v_dim // records.TILE * records.record_bytes(options["v_bits"]))
        fp16_tokens = tokens - regions["body"]
        return kv_heads * (body + fp16_tokens * (k_dim + v_dim) * 2.0)

    def audit(self, cache: KVarNCache, options: dict[str, Any]) -> tuple[str, bool]:
        widths = (options["k_bits"], options["v_bits"])
        if (cache.k_bits, cache.v_bits) != widths:
            return f"widths k{cache.k_bits}v{cache.v_bits}, policy says k{widths[0]}v{widths[1]}", False
        due = records.region_tokens(cache.offset, cache.kv_tail_tokens, cache.newest)["body"] // records.TILE
        if due and (cache.n_records < due or cache.regions()["record_codes"] == 0):
            return f"{due} records should be sealed at {cache.offset} tokens, found {cache.n_records}", True
        return "", due > 0

    def memory_regions(self, cache: KVarNCache) -> tuple[dict[str, int], dict[str, int] | None]:
        """The records' codes and scales as one region, "body", beside the fp16 sink, live group and tail."""
        r = cache.regions()
        regions = {"sink": r["sink"], "body": r["record_codes"] + r["record_scales"], "live": r["live"],
                   "tail": r["tail"]}
        return regions, cache.region_tokens()

    def roundtrip(self, x: np.ndarray, kind: str, options: dict[str, Any]) -> np.ndarray:
        """Rotation, then records of 128 x 128 (tokens and head_dim multiples of 128), rotated back."""
        x = np.asarray(x, np.float32)
        if x.shape[0] % records.TILE or x.shape[1] % records.TILE:
            raise ValueError(f"kvarn error needs tokens and head_dim multiples of 128, got {x.shape}")
        bits = options["k_bits" if kind == "k" else "v_bits"]
        rot = _hadamard(x)
        out = np.empty_like(rot)
        t, d = x.shape
        for i in range(0, t, records.TILE):
            for j in range(0, d, records.TILE):
                rec = records.encode_record(mx.array(rot[i:i + 128, j:j + 128]), bits, kind)
                out[i:i + 128, j:j + 128] = np.array(records.decode_record(rec))
        return _hadamard(out)


def _hadamard(x: np.ndarray) -> np.ndarray:
    return np.array(mx.hadamard_transform(mx.array(x, dtype=mx.float32)))


SCHEME = register_scheme(KvarnScheme(
    "kvarn", "Hadamard rotation + variance-normalized 128x128 records, fp16 sink and tail (KVarN)", OPTIONS,
    cache_class=KVarNCache, color="#ff7f0e"))
