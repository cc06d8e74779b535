"""benchmarks/decode_attention.py's cold mode: each call reads the next of enough cache copies to outgrow L2."""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import pytest

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


@pytest.mark.gpu
def test_a_fused_affine_row_without_its_mlx_lm_row_has_no_speedup() -> None:
    """--impls fused_affine8 alone: the speed-up over mlx-lm's path needs mlx_lm_affine8 beside it, so the row
    has none (it once ended in StopIteration)."""
    rows = decode_attention.bench_context(256, 1, 1, ("fused_affine8",))
    assert [r["impl"] for r in rows] == ["fp16_sdpa", "fused_affine8"]
    assert "speedup_vs_mlx_lm" not in rows[1]
    both = decode_attention.bench_context(256, 1, 1, ("mlx_lm_affine8", "fused_affine8"))
    assert "speedup_vs_mlx_lm" in both[-1]


def test_chained_calls_read_the_output_of_the_call_before() -> None:
    """--chain: each call's queries are the previous call's output, so the GPU cannot run calls side by side."""
    seen = []
    box = [mx.zeros((2,))]

    def fn():
        seen.append(box[0])
        return box[0] + 1
    decode_attention.timed(fn, 3, 2, chain=box)
    assert [int(x[0].item()) for x in seen] == list(range(len(seen)))  # 1 + 3 + 2 * 3 calls, each the last's + 1
    assert len(seen) == 10
    rows = decode_attention.bench_context(256, 2, 1, ("fp16_sdpa",), chain=True)
    assert rows[0]["impl"] == "fp16_sdpa" and rows[0]["us"] > 0


@pytest.mark.gpu
def test_block_rows_attend_through_the_fused_kernel_over_fewer_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """--impls fused_kivi4 ... fused_mxfp8: each block cache, filled and one decode token on, attends through its
    fused kernel (an affine_decode launch) as its reference path does, reading fewer bytes than fp16's K/V."""
    from gmlx_lab.kernels import affine

    q, k, v = decode_attention.random_qkv(1024)
    scale = decode_attention.D**-0.5
    launched = []
    real = affine.launch
    monkeypatch.setattr(affine, "launch", lambda name, *args, **kwargs: launched.append(name) or real(name, *args,
                                                                                                         **kwargs))
    for spec in decode_attention.BLOCK_SCHEMES:
        fn, read, _ = decode_attention.fused_block_state([q], k, v, scale, spec)
        launched.clear()
        fused = fn()
        mx.eval(fused)
        assert launched == ["affine_decode"], (spec, launched)
        cache = decode_attention.block_cache(spec, k, v)
        cache.attention_path = "reference"
        ref = cache.attend(q, *cache.fetch(q.dtype), scale, None)
        err = float(mx.abs(fused.astype(mx.float32) - ref.astype(mx.float32)).max() / mx.abs(ref).max())
        assert err < 1e-2, (spec, err)
        assert read < k.nbytes + v.nbytes, spec
