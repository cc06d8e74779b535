"""benchmarks/decode_attention.py's cold mode: each call reads the next of enough cache copies to outgrow L2."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import decode_attention  # noqa: E402


def test_copies_outgrow_the_requested_bytes() -> None:
    assert decode_attention.copies_for(100, 0) == 1  # off: one copy
    assert decode_attention.copies_for(100, 250) == 3  # 300 bytes in all
    assert decode_attention.copies_for(300, 250) == 1  # one layer is already larger


def test_cycling_takes_each_call_in_turn() -> None:
    call = decode_attention.cycling([lambda i=i: i for i in range(3)])
    assert [call() for _ in range(7)] == [1, 2, 0, 1, 2, 0, 1]


def test_cold_rows_record_their_copies() -> None:
    """A row says how many copies it cycled through; each copy holds one call's bytes, as one copy does."""
    warm = decode_attention.bench_context(256, 2, 1, ("fp16_sdpa",))
    cold = decode_attention.bench_context(256, 2, 1, ("fp16_sdpa",), cold_bytes=3 * warm[0]["cache_bytes"])
    assert [r["copies"] for r in warm + cold] == [1, 3]
    assert cold[0]["cache_bytes"] == warm[0]["cache_bytes"]
