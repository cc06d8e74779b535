"""kvarn records: format, sizes, accuracy and the variance normalization against a numpy reading of the spec."""

import mlx.core as mx
import numpy as np
import pytest

from gmlx_lab.cache.kvarn.records import decode_record, encode_record, imbalance, normalize, pack_rows, unpack_rows

BITS = (2, 3, 4, 5, 6, 8)


def outlier_tile(seed: int = 0) -> mx.array:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(128, 128)).astype(np.float32)
    x[:, [3, 40]] *= 25.0  # two outlier channels
    x[7] *= 10.0  # one loud token
    return mx.array(x)


@pytest.mark.parametrize("bits", BITS)
def test_pack_roundtrip_and_size(bits):
    codes = mx.random.randint(0, 2**bits, (5, 128)).astype(mx.uint32)
    words = pack_rows(codes, bits)
    assert words.shape == (5, 4 * bits) and words.dtype == mx.uint32
    back = unpack_rows(words, bits)
    assert back.dtype == mx.uint32 and mx.array_equal(back, codes)
    top = mx.full((2, 128), 2**bits - 1, mx.uint32)  # every bit set: masks and word-crossing codes
    assert mx.array_equal(unpack_rows(pack_rows(top, bits), bits), top)


def test_pack_layout_is_lsb_first_stream():
    codes = mx.zeros((128,), mx.uint32)
    codes[1] = 5  # 3-bit code 0b101 at stream bits 3..5
    codes[10] = 7  # bits 30, 31, 32: crosses into word 1
    words = np.array(pack_rows(codes, 3))
    assert words[0] == (5 << 3) | (1 << 30) | (1 << 31)
    assert words[1] == 1


@pytest.mark.parametrize("bits", BITS)
def test_record_fields_and_nbytes(bits):
    rec = encode_record(outlier_tile(), bits, "k")
    assert rec.nbytes == 2048 * bits + 768
    assert rec.codes.shape == (128, 4 * bits)
    for axis in (rec.scale_axis, rec.zp_axis, rec.other_axis):
        assert axis.shape == (128,) and axis.dtype == mx.float16
    assert rec.bits == bits and rec.kind == "k"


def test_error_shrinks_with_width_for_k_and_v():
    block = outlier_tile(1)
    for kind in ("k", "v"):
        errors = [float(mx.sqrt(mx.mean((decode_record(encode_record(block, b, kind)) - block) ** 2))) for b in BITS]
        assert all(a > b for a, b in zip(errors, errors[1:])), (kind, errors)
        rel = errors[BITS.index(6)] / float(mx.sqrt(mx.mean(block**2)))
        assert rel < 0.04, rel


def test_normalization_lowers_imbalance_on_outlier_tile():
    rec = encode_record(outlier_tile(2), 4, "k")
    before, after = float(rec.imbalance_before), float(rec.imbalance_after)
    assert before > 20 and after < before / 5, (before, after)
    assert after >= 2.0  # max/min of each axis is at least 1


def test_normalization_beats_plain_per_row_rounding():
    """The point of the scales: at 4 bits the normalized record is more accurate than no normalization."""
    block = outlier_tile(3)
    plain = encode_record(block, 4, "v", iters=0)
    normed = encode_record(block, 4, "v")
    err = lambda r: float(mx.mean((decode_record(r) - block) ** 2))  # noqa: E731
    assert err(normed) < err(plain)


def _numpy_normalize(t: np.ndarray, iters: int = 16):
    """The spec's normalization written independently in float64 numpy."""
    def imb(x):
        c, r = x.std(axis=0, ddof=1), x.std(axis=1, ddof=1)
        return c.max() / (c.min() + 1e-8) + r.max() / (r.min() + 1e-8)

    lr, lc = np.zeros(128), np.zeros(128)
    best = (imb(t), lr.copy(), lc.copy())
    for _ in range(iters):
        x = t / np.exp(lr)[:, None] / np.exp(lc)[None, :]
        lc = np.clip(lc + np.log(np.clip(x.std(axis=0, ddof=1), 1e-3, 1e3)), -0.3, 10)
        x = t / np.exp(lr)[:, None] / np.exp(lc)[None, :]
        lr = np.clip(lr + np.log(np.clip(x.std(axis=1, ddof=1), 1e-3, 1e3)), -0.3, 10)
        x = t / np.exp(lr)[:, None] / np.exp(lc)[None, :]
        score = imb(x)
        if score <= best[0]:
            best = (score, lr.copy(), lc.copy())
    return np.exp(best[1]), np.exp(best[2]), best[0]


def test_normalization_matches_numpy_reading_of_spec():
    t = np.array(outlier_tile(4).T)
    s_row, s_col, before, after = normalize(mx.array(t))
    ref_row, ref_col, ref_after = _numpy_normalize(t.astype(np.float64))
    np.testing.assert_allclose(np.array(s_row), ref_row, rtol=2e-3)
    np.testing.assert_allclose(np.array(s_col), ref_col, rtol=2e-3)
    assert abs(float(after) - ref_after) / ref_after < 1e-3
    assert abs(float(imbalance(mx.array(t))) - float(before)) < 1e-3


def test_rounding_is_half_away_from_zero_per_row():
    """A V row holding exactly 0, 0.5 and 1.0 of its range at 1 step per unit rounds 0.5 up."""
    block = np.tile(np.linspace(0, 3, 128, dtype=np.float32), (128, 1))  # each row identical
    rec = encode_record(mx.array(block), 2, "v", iters=0)
    codes = np.array(unpack_rows(rec.codes, 2))
    n = block[0] / 1.0  # no normalization, s = 1
    expected = np.clip(np.floor((n - n.min()) / ((n.max() - n.min()) / 3) + 0.5), 0, 3)
    np.testing.assert_array_equal(codes[0], expected)


@pytest.mark.parametrize("value", [0.0, 3.25, -7.5])
def test_constant_tiles_decode_exactly(value):
    block = mx.full((128, 128), value)
    for kind in ("k", "v"):
        out = decode_record(encode_record(block, 4, kind))
        assert mx.all(mx.isfinite(out)).item()
        assert float(mx.abs(out - block).max()) <= abs(value) * 1e-3 + 1e-6


def test_tiny_variance_tile_stays_finite_and_close():
    rng = np.random.default_rng(5)
    block = mx.array((1.0 + 1e-6 * rng.normal(size=(128, 128))).astype(np.float32))
    out = decode_record(encode_record(block, 6, "k"))
    assert mx.all(mx.isfinite(out)).item()
    assert float(mx.abs(out - block).max()) < 2e-3  # within fp16 resolution of 1.0


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: encode_record(mx.zeros((128, 64)), 4, "k"), "block must be"),
        (lambda: encode_record(mx.zeros((128, 128)), 7, "k"), "accepted: 2, 3, 4, 5, 6, 8"),
        (lambda: encode_record(mx.zeros((128, 128)), 4, "q"), "accepted: 'k' or 'v'"),
        (lambda: encode_record(mx.full((128, 128), float("nan")), 4, "v"), "non-finite"),
    ],
)
def test_record_errors(call, message):
    with pytest.raises(ValueError, match=message):
        call()
