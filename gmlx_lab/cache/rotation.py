"""Which head dims the per-head Hadamard rotation can take: the one home of that rule.

The rotated schemes (affine_rot, the rotated float formats, turboquant, kvarn) turn each head with
`mx.hadamard_transform` and turn it back by applying the transform again. Checked on MLX 0.32.4: the transform
takes sizes m * 2^k with m in 1, 12, 20, 28; it is orthogonal at all of them, but it is its own inverse only for
m = 1 and 12 (the matrix is symmetric there). At 20 * 2^k and 28 * 2^k (40, 56, 80, 160, 224, ...) applying it
twice does not give the input back, with no error; sizes outside m * 2^k are refused, or crash the process, so
they must never reach it. tests/test_field_schemes.py checks the rule against the transform itself.
"""

from __future__ import annotations

SELF_INVERSE_FACTORS = (1, 12)  # m of m * 2^k where the transform undoes itself
OTHER_FACTORS = (20, 28)  # m where MLX has a transform, but not its own inverse


def odd_factor(head_dim: int) -> int:
    """The m of `head_dim` = m * 2^k that MLX's transform reads: 12, 20 or 28 where `head_dim` is a multiple of one
    of them by a power of two, else `head_dim`'s odd part."""
    m = head_dim
    while m % 2 == 0 and m not in (12, 20, 28):
        m //= 2
    return m


def rotation_problem(head_dim: int) -> str | None:
    """Why heads of `head_dim` cannot be rotated and rotated back by the Hadamard transform, or None if they can."""
    if head_dim < 1:
        return f"head_dim {head_dim} is not a positive size"
    m = odd_factor(head_dim)
    if m in SELF_INVERSE_FACTORS:
        return None
    if m in OTHER_FACTORS:
        return (f"head_dim {head_dim} = {m} x {head_dim // m}: MLX's Hadamard transform at this size is not its own "
                "inverse, so the rotation could not be undone (accepted: 2^k or 12 x 2^k)")
    return f"head_dim {head_dim} has no Hadamard transform in MLX (accepted: 2^k or 12 x 2^k)"
