"""The fp16 scheme: K and V stored as float16, the baseline every other scheme is measured against.

Its cache (`cache.py` beside this module) is not a block cache: it stores tokens as they come, the fp16 store the
block base keeps its sink and tail in, and encodes nothing; `Scheme.make_cache` builds it from the class, as for a
plug-in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ...registry import BASELINE, Scheme, register_scheme
from .cache import FP16Cache


@dataclass(frozen=True)
class FP16Scheme(Scheme):
    """No options; every layer it is asked about stays fp16; the cache is its class (`Scheme.make_cache`)."""

    def declines(self, kind: str, k_dim: int, v_dim: int, options: dict[str, Any]) -> str | None:
        return "fp16 scheme"

    def layer_bytes(self, tokens: int, kv_heads: int, k_dim: int, v_dim: int, options: dict[str, Any]) -> float:
        """2 bytes per value: kv_heads * tokens * (dk + dv) * 2."""
        return kv_heads * tokens * (k_dim + v_dim) * 2.0

    def roundtrip(self, x: np.ndarray, kind: str, options: dict[str, Any]) -> np.ndarray:
        return np.asarray(x, np.float32).astype(np.float16).astype(np.float32)


SCHEME = register_scheme(FP16Scheme(BASELINE, "K and V stored as float16 (the baseline)", cache_class=FP16Cache,
                                    color="#9e9e9e"))
