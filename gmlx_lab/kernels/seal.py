"""Sealing kvarn records on the GPU (`kvarn_seal.body`): the kernel twin of `records.encode_tiles`."""

from __future__ import annotations

import mlx.core as mx

from ..records import AXIS_DTYPE, TILE, Records, check_bits, check_kind
from .build import launch


def seal_records(chunk: mx.array, bits: int, kind: str, iters: int = 16) -> Records:
    """Encode rotated tokens (B, H, n*128, D) into records with fields (B, H, n, D/128, ...).

    Same steps as `records.encode_tokens(chunk, ...)`; float sums run in another
    order, so a few codes may differ by one step (tests/test_kernels.py measures how many).
    """
    check_bits(bits)
    check_kind(kind)
    b, h, t, d = chunk.shape
    if t % TILE or d % TILE:
        raise ValueError(f"seal_records: tokens ({t}) and head_dim ({d}) must be multiples of {TILE}")
    n, s = t // TILE, d // TILE
    lead = (b, h, n, s)
    codes, scale_axis, zp_axis, other_axis, imb = launch(
        "kvarn_seal",
        {"x": chunk.astype(mx.float16), "params": mx.array([t], mx.int32)},
        {"codes": ((*lead, TILE, 4 * bits), mx.uint32), "scale_axis": ((*lead, TILE), AXIS_DTYPE),
         "zp_axis": ((*lead, TILE), AXIS_DTYPE), "other_axis": ((*lead, TILE), AXIS_DTYPE),
         "imbalance": ((*lead, 2), mx.float32)},
        grid=(128, n * s, b * h), threadgroup=(128, 1, 1),
        template={"B": bits, "KIND_K": int(kind == "k"), "ITERS": iters, "D": d},
    )
    return Records(codes=codes, scale_axis=scale_axis, zp_axis=zp_axis, other_axis=other_axis, bits=bits,
                   kind=kind, imbalance_before=imb[..., 0], imbalance_after=imb[..., 1])
