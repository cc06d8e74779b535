"""The attention helpers: GQA scores, log-sum-exp partials and their merge into one softmax."""

import mlx.core as mx
import pytest

from gmlx_lab.cache.attention import apply_mask, grouped_attention, merge_partials


@pytest.mark.parametrize("q_len, mask", [(1, None), (3, "causal")])
def test_grouped_attention_equals_fast_sdpa(q_len, mask):
    mx.random.seed(0)
    q, k, v = mx.random.normal((1, 8, q_len, 64)), mx.random.normal((1, 2, 50, 64)), mx.random.normal((1, 2, 50, 64))
    out, lse = grouped_attention(q, k, v, scale=0.125, mask=mask)
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)
    assert out.shape == ref.shape and lse.shape == (1, 8, q_len)
    assert float(mx.abs(out - ref).max()) < 1e-5


def test_partials_over_disjoint_keys_merge_into_one_softmax():
    mx.random.seed(1)
    q, k, v = mx.random.normal((2, 4, 1, 32)), mx.random.normal((2, 4, 90, 32)), mx.random.normal((2, 4, 90, 32))
    parts = [grouped_attention(q, k[:, :, a:b], v[:, :, a:b], 0.2, None) for a, b in ((0, 10), (10, 73), (73, 90))]
    whole, lse = grouped_attention(q, k, v, 0.2, None)
    assert float(mx.abs(merge_partials(parts) - whole).max()) < 1e-5


def test_mask_forms():
    scores = mx.zeros((2, 3))
    causal = apply_mask(scores, "causal")
    assert causal[0, 2].item() < -1e30 and causal[1, 2].item() == 0
    assert apply_mask(scores, mx.array([[True, False, True]] * 2))[0, 1].item() < -1e30
    assert apply_mask(scores, mx.ones((2, 3)))[0, 0].item() == 1
    with pytest.raises(ValueError, match="unknown mask"):
        apply_mask(scores, "window")
