"""Cache sizes from a policy: bytes per layer at a given context, for every scheme, without running the model.

Each scheme's formula is its registry entry's `layer_bytes` (per KV head, per token, head dims dk and dv):
  fp16    2 * (dk + dv) bytes
  affine  (dk + dv) * (bits / 8 + 4 / group_size) bytes (codes + an fp16 scale and offset per group)
  kvarn   sealed tokens: (dk + dv) / 128 records of (2048 * bits + 768) bytes per 128 tokens;
          sink, live and tail tokens: as fp16
Sliding windows stop growing at the window; recurrent state has a fixed size (the rules here, for every scheme).
These are the sizes of the stored data; the caches' `.nbytes` also counts
fp16 growth reserve (mlx-lm allocates in steps of 256 tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..policy import Policy, probe_layers
from ..registry import get_scheme


@dataclass(frozen=True)
class LayerShape:
    """What sizes one cache entry: its kind, KV heads, head dims, window and fixed bytes."""

    kind: str
    kv_heads: int
    k_dim: int
    v_dim: int
    window: int | None = None
    fixed_bytes: int = 0


def layer_shapes(policy: Policy) -> list[LayerShape]:
    """One `LayerShape` per cache entry of the policy's model (probes the model once)."""
    shapes = []
    for cache, kind, kshape, vshape in probe_layers(policy.model):
        if kshape is None:
            shapes.append(LayerShape(kind, 0, 0, 0, fixed_bytes=int(getattr(cache, "nbytes", 0))))
        else:
            shapes.append(LayerShape(kind, kshape[1], kshape[-1], vshape[-1], getattr(cache, "max_size", None)))
    return shapes


def layer_bytes(shape: LayerShape, decision: str, context: int, options: dict[str, Any]) -> float:
    """Stored bytes of one layer's cache after `context` tokens under `decision`."""
    if shape.kind in ("recurrent", "other"):
        return float(shape.fixed_bytes)
    tokens = min(context, shape.window) if shape.window else context
    return float(get_scheme(decision).layer_bytes(tokens, shape.kv_heads, shape.k_dim, shape.v_dim, options))


def policy_bytes(policy: Policy, context: int, shapes: list[LayerShape] | None = None) -> float:
    """Stored bytes of the whole cache after `context` tokens, as the policy decided layer by layer."""
    shapes = shapes or layer_shapes(policy)
    return sum(layer_bytes(s, d.decision, context, policy.layer_options(d.index))
               for s, d in zip(shapes, policy.layers))
