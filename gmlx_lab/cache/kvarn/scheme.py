"""The kvarn scheme: Hadamard rotation and variance-normalized 128-token records, fp16 sink and tail.

The cache is `cache.py` beside this module, the record format and the region geometry `records.py`; this module says
what the registry, the policy, the figures and the audit need to know about it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

from ... import records
from ...records import KVARN_BITS, KVARN_EXT_HEAD_DIMS
from ...registry import register_scheme
from ..block import BlockScheme
from ..options import width_options
from .cache import KVarNCache

KVARN_BITS_ENV = "GMLX_KVARN_BITS"  # K and V widths, "6" or "k6v5", where no width is given

CACHE_OPTIONS = {opt.name: opt for opt in KVarNCache.OPTIONS}  # the cache's: their defaults are the scheme's
OPTIONS = (
    *width_options(CACHE_OPTIONS["k_bits"].default, KVARN_BITS),
    CACHE_OPTIONS["kv_tail_tokens"], CACHE_OPTIONS["norm_iters"], CACHE_OPTIONS["head_dim_ext"],
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


def environment_widths() -> tuple[int, int] | None:
    """The K and V widths GMLX_KVARN_BITS sets, or None when it is unset or empty."""
    text = os.environ.get(KVARN_BITS_ENV, "")
    return parse_kvarn_bits(text) if text.strip() else None


@dataclass(frozen=True)
class KvarnScheme(BlockScheme):
    """Records of 128 tokens x 128 channels per KV head; needs head dims of whole 128-channel slices. The byte
    formula, the audit and the roundtrip come from the class (BlockScheme), as for a plug-in."""

    def adjust(self, values: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
        """Each of the K and V widths: `k_bits`/`v_bits` if given, else `bits` if given, else GMLX_KVARN_BITS if
        set, else the default `bits`. An explicit width always beats the environment (`environment` says when
        the environment chose)."""
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

    def environment(self, given: dict[str, Any]) -> str:
        """Which widths GMLX_KVARN_BITS chose for these options ('' when explicit widths or defaults did)."""
        if environment_widths() is None or given.get("bits") is not None:
            return ""
        chose = [kind for kind in ("K", "V") if given.get(f"{kind.lower()}_bits") is None]
        if not chose:
            return ""
        return f"{' and '.join(chose)} width{'s' if len(chose) > 1 else ''} from " \
               f"{KVARN_BITS_ENV}={os.environ[KVARN_BITS_ENV].strip()}"

    def cache_options(self, options: dict[str, Any]) -> dict[str, Any]:
        """The class takes the K and V widths (`adjust` derived them from `bits`)."""
        return {name: value for name, value in options.items() if name != "bits"}

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
    "kvarn", "Hadamard rotation + variance-normalized 128x128 records, fp16 sink and tail (KVarN)", OPTIONS,
    cache_class=KVarNCache, color="#ff7f0e"))
