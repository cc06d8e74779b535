"""The attention helpers: GQA scores, log-sum-exp partials and their merge into one softmax."""

import mlx.core as mx
import pytest

from gmlx_lab.cache import attention
from gmlx_lab.cache.attention import (
    KeySlice,
    apply_mask,
    fits_scratch,
    grouped_attention,
    merge_partials,
    slice_mask,
    slice_tokens,
    sliced_attention,
)


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


def test_slice_masks_are_the_columns_of_the_whole_mask():
    causal = apply_mask(mx.zeros((3, 10)), "causal") == 0  # 3 queries, the last aligned with key 9
    for start, stop in ((0, 4), (4, 8), (8, 10)):
        part = slice_mask("causal", start, stop, queries=3, total=10)
        want = causal[:, start:stop]
        assert (part is None and bool(want.all())) or bool(mx.array_equal(part, want))
    array = mx.arange(30).reshape(1, 3, 10) % 2 == 0
    assert mx.array_equal(slice_mask(array, 2, 5, 3, 10), array[..., 2:5])
    assert slice_mask(None, 0, 4, 3, 10) is None
    with pytest.raises(ValueError, match="unknown mask"):
        slice_mask("window", 0, 4, 3, 10)


def test_a_slice_holds_whole_blocks_within_the_scratch(monkeypatch):
    queries = mx.zeros((2, 8, 512, 128))
    tokens = slice_tokens(queries, kv_heads=2, head_dim=128, step=128)
    per_key = 4 * 2 * (6 * 8 * 512 + 2 * 2 * 128)
    assert tokens % 128 == 0 and tokens * per_key <= attention.SCRATCH_BYTES < (tokens + 128) * per_key
    monkeypatch.setattr(attention, "SCRATCH_BYTES", 1)
    assert slice_tokens(queries, 2, 128, step=128) == 128  # never less than one block


@pytest.fixture
def on_cpu():
    """The CPU as default device for one test, on any machine: on a GPU, queued kernels hold every array they read
    until they have run, so memory peaks and the backend's routes differ there."""
    device = mx.default_device()
    mx.set_default_device(mx.cpu)
    yield
    mx.set_default_device(device)


def test_sliced_attention_holds_one_slice_of_scores_not_the_whole(monkeypatch, on_cpu):
    """A 1024-token prompt chunk over 8192 keys with 32 MiB of scratch: peak memory stays near the scratch, far below
    one copy of the whole chunk's float32 scores (128 MiB)."""
    monkeypatch.setattr(attention, "SCRATCH_BYTES", 32 * 2**20)
    mx.random.seed(2)
    q, k, v = (mx.random.normal((1, 4, n, 128)) for n in (1024, 8192, 8192))
    mx.eval(q, k, v)
    tokens = slice_tokens(q, 4, 128)

    def load(a):  # a copy of keys [a, a + tokens), as a decode makes one, read once `done` is computed
        def read(done):
            kv = [k[:, :, a:a + tokens], v[:, :, a:a + tokens]]
            return tuple(x * 1 for x in (mx.depends(kv, done) if done else kv))
        return read

    slices = [KeySlice(a, min(a + tokens, 8192), load(a)) for a in range(0, 8192, tokens)]
    mx.clear_cache()
    mx.reset_peak_memory()
    start = mx.get_active_memory()
    out = sliced_attention(q, 0.088, "causal", slices)
    mx.eval(out)
    peak = mx.get_peak_memory() - start
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.088, mask="causal")
    assert len(slices) >= 4 and float(mx.abs(out - ref).max()) < 1e-4
    assert peak < 48 * 2**20, f"peak {peak / 2**20:.0f} MiB above the start"


def test_sdpa_over_the_whole_fetch_is_kept_while_it_fits_the_scratch(monkeypatch, on_cpu):
    """One query over 1024 keys fits; 512 queries over them do not on the CPU, where SDPA computes every score."""
    keys = values = mx.zeros((1, 2, 1024, 64))
    one, chunk = mx.zeros((1, 8, 1, 64)), mx.zeros((1, 8, 512, 64))
    monkeypatch.setattr(attention, "SCRATCH_BYTES", 2**20 + 4 * 6 * 8 * 1024)  # K/V and one query's scores
    assert fits_scratch(one, keys, values)
    assert not fits_scratch(chunk, keys, values)
    monkeypatch.setattr(attention, "SCRATCH_BYTES", 2**20 - 1)  # not even the decoded K/V
    assert not fits_scratch(one, keys, values)


def test_on_a_gpu_a_chunk_attends_over_one_layers_decoded_kv_up_to_its_bound(monkeypatch):
    """A GPU's SDPA holds no scores, so a prompt chunk fits while the decoded K/V do (GPU_DECODED_BYTES, one layer
    at a time: mlx_lm_hooks.settled), however many queries it has."""
    keys = values = mx.zeros((1, 2, 1024, 64))
    chunk = mx.zeros((1, 8, 512, 64))
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.gpu))
    monkeypatch.setattr(attention, "SCRATCH_BYTES", 1)  # the CPU's bound plays no part
    monkeypatch.setattr(attention, "GPU_DECODED_BYTES", 2**20)  # K and V: 2 x 1024 x 2 x 64 float32 values
    assert fits_scratch(chunk, keys, values)
    monkeypatch.setattr(attention, "GPU_DECODED_BYTES", 2**20 - 1)
    assert not fits_scratch(chunk, keys, values)


def test_on_metal_an_affine_prompt_chunk_attends_over_decoded_slices_not_quantized_matmul_scores(monkeypatch, on_cpu):
    """quantized_matmul's scores of a prompt chunk hold every query over every key (16 GiB a layer for 2048
    queries over 128K keys); on Metal a chunk attends over the decoded codes (a slice at a time past the scratch),
    while a decode step keeps mlx-lm's quantized_matmul path there."""
    from gmlx_lab.cache.affine import cache as affine_module

    monkeypatch.setattr(affine_module, "active_backend", lambda: "metal")
    products = []
    real = mx.quantized_matmul
    monkeypatch.setattr(mx, "quantized_matmul", lambda *a, **k: products.append(a[0].shape) or real(*a, **k))
    cache = affine_module.AffineCache(bits=4, group_size=64)
    mx.random.seed(1)
    keys, values = (mx.random.normal((1, 2, 256, 64)) for _ in range(2))
    k, v = cache.update_and_fetch(keys, values)
    chunk = mx.random.normal((1, 4, 8, 64))
    out = cache.attend(chunk, k, v, scale=0.125, mask=None)
    assert products == [] and out.shape == (1, 4, 8, 64)
    k, v = cache.update_and_fetch(keys[:, :, :1], values[:, :, :1])
    cache.attend(chunk[:, :, :1], k, v, scale=0.125, mask=None)
    assert len(products) == 2  # the decode step's scores and output


@pytest.mark.parametrize("spec", ["turboquant4", "kivi4", "mxfp4"])
def test_a_prompt_chunk_decodes_the_cache_a_slice_at_a_time(monkeypatch, on_cpu, spec):
    """Where SDPA takes the whole decoded K/V (a GPU's rule: they fit), a prompt chunk reads them gathered a slice
    at a time: the same output as SDPA over the fetch, at a peak well below the fetch's decode, whose float32
    intermediates (codes unpacked, codebook values, rotations) would all be held at once."""
    from gmlx_lab.cache import block
    from gmlx_lab.registry import get_scheme
    from gmlx_lab.specs import parse_scheme_spec

    monkeypatch.setattr(block, "fits_scratch", lambda *_: True)
    name, options = parse_scheme_spec(spec)
    cache = get_scheme(name).make_cache(options)
    for seed in range(2):  # 8192 tokens of 8 KV heads of 128 (stored fp16, read float32)
        cache.update_and_fetch(*(mx.random.normal((1, 8, 4096, 128), key=mx.random.key(seed + i)) for i in (0, 10)))
        mx.eval(cache.state)
    q = mx.random.normal((1, 16, 64, 128), key=mx.random.key(7))
    cache.update_and_fetch(*(mx.random.normal((1, 8, 64, 128), key=mx.random.key(s)) for s in (8, 9)))
    mx.eval(q, cache.state)
    monkeypatch.setattr(attention, "SCRATCH_BYTES", 4 * 2**20)  # several slices

    def peak(attend) -> tuple[mx.array, int]:  # over a fresh lazy fetch, as the seam hands one over
        keys, values = cache.fetch(mx.float32)
        mx.clear_cache()
        mx.reset_peak_memory()
        start = mx.get_active_memory()
        out = attend(q, keys, values, scale=0.088, mask="causal")
        mx.eval(out)
        return out, mx.get_peak_memory() - start

    out, sliced_peak = peak(cache.attend)
    ref, whole_peak = peak(mx.fast.scaled_dot_product_attention)  # the fetch decoded in one graph
    assert float(mx.abs(out - ref).max()) < 1e-4
    decoded = 2 * 4 * 8 * (8192 + 64) * 128  # the float32 K/V, held either way; what the decode holds beside:
    assert sliced_peak - decoded < 0.4 * (whole_peak - decoded), (sliced_peak / 2**20, whole_peak / 2**20)
