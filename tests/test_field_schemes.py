"""What is specific to the field's schemes (turboquant, float, kivi): codebooks, QJL, formats, per-channel K, bytes.

The shared properties (chunking, trim, save/load, copies, batches, bad input, mlx-lm's patterns) are in
tests/test_properties.py, which draws these schemes beside the others.
"""

import math

import mlx.core as mx
import numpy as np
import pytest
from conftest import random_kv, tiny_llama

import gmlx_lab
from gmlx_lab.cache.affine.cache import AffineRotCache
from gmlx_lab.cache.float import FORMATS
from gmlx_lab.cache.rotation import rotation_problem
from gmlx_lab.cache.turboquant import codebook, gaussian_codebook, lookup_codes, pack_bits, unpack_bits
from gmlx_lab.registry import SCHEMES, get_scheme
from gmlx_lab.specs import parse_scheme_spec, scheme_label
from gmlx_lab.viz.style import scheme_color, trace_styles

FIELD = ("turboquant", "float", "kivi")


# -- turboquant's codebook -----------------------------------------------------------------------------------

def gaussian_mean_between(a: float, b: float) -> float:
    """E[X | a < X < b] for X ~ N(0, 1), by the trapezoid rule on a fine grid (independent of the erfc form)."""
    lo, hi = max(a, -12.0), min(b, 12.0)
    x = np.linspace(lo, hi, 200001)
    w = np.exp(-x * x / 2)
    return float(np.trapezoid(x * w, x) / np.trapezoid(w, x))


@pytest.mark.parametrize("bits", range(1, 9))
def test_codebook_centroids_are_the_conditional_means_of_their_cells(bits):
    """Lloyd-Max's two conditions: thresholds halfway between centroids, each centroid its cell's mean."""
    c, t = gaussian_codebook(bits)
    assert len(c) == 2**bits and np.all(np.diff(c) > 0) and np.allclose(c, -c[::-1], atol=1e-12)
    assert np.allclose(t, (c[1:] + c[:-1]) / 2)
    edges = np.concatenate([[-np.inf], t, [np.inf]])
    for i in range(0, len(c), max(1, len(c) // 16)):  # 16 cells of each width, the outermost among them
        assert abs(c[i] - gaussian_mean_between(edges[i], edges[i + 1])) < 1e-6, (i, c[i])


def test_codebook_matches_the_published_lloyd_max_values():
    """Max (1960), Table I: 1 bit +-0.7979; 2 bits +-0.4528, +-1.510; 3 bits 0.2451, 0.7560, 1.344, 2.152."""
    assert np.allclose(gaussian_codebook(1)[0][1:], [0.7979], atol=1e-4)
    assert np.allclose(gaussian_codebook(2)[0][2:], [0.4528, 1.5104], atol=1e-4)
    assert np.allclose(gaussian_codebook(3)[0][4:], [0.2451, 0.7560, 1.3440, 2.1520], atol=1e-4)
    with pytest.raises(ValueError, match="accepted: an int from 1 to 8"):
        gaussian_codebook(9)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_codebook_error_is_below_the_best_uniform_quantizer_at_the_same_width(bits):
    """On Gaussian samples, the codebook's squared error beats every uniform grid of 2**bits levels (steps
    scanned), and sits at Lloyd-Max's distortion (Max 1960: 0.1175, 0.03454, 0.009497)."""
    x = np.random.default_rng(0).standard_normal(50_000)
    c, t = gaussian_codebook(bits)
    mse = float(np.mean((x - c[np.searchsorted(t, x)]) ** 2))
    assert abs(mse - {2: 0.1175, 3: 0.03454, 4: 0.009497}[bits]) < 0.03 * mse
    n = 2**bits
    uniform = min(float(np.mean((x - step * (np.clip(np.floor(x / step), -n // 2, n // 2 - 1) + 0.5)) ** 2))
                  for step in np.linspace(0.05, 2.0, 100))
    assert mse < uniform, (mse, uniform)


@pytest.mark.parametrize("bits", range(1, 9))
def test_codes_pack_to_their_width_and_back(bits):
    codes = mx.random.randint(0, 2**bits, (3, 2, 80)).astype(mx.uint32)
    words = pack_bits(codes, bits)
    assert words.dtype == mx.uint32 and words.shape == (3, 2, math.ceil(80 * bits / 32))
    assert mx.array_equal(unpack_bits(words, bits, 80), codes).item()


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("d", [64, 80, 128])
def test_codes_are_looked_up_a_field_at_a_time_as_one_at_a_time(bits, d):
    """lookup_codes reads several codes a table lookup: the codebook values of the codes, one by one."""
    codes = mx.random.randint(0, 2**bits, (3, 2, d), key=mx.random.key(bits)).astype(mx.uint32)
    expected = mx.take(codebook(bits, d), codes)
    assert mx.array_equal(lookup_codes(pack_bits(codes, bits), bits, d), expected).item()


def test_turboquant_rotation_is_orthogonal_and_differs_by_head_and_seed():
    cache = get_scheme("turboquant").make_cache(get_scheme("turboquant").resolve())
    x = mx.random.normal((1, 3, 8, 64))
    y = cache.rotate(x)
    assert mx.allclose(cache.unrotate(y), x, atol=1e-5).item()
    assert mx.allclose(mx.linalg.norm(y, axis=-1), mx.linalg.norm(x, axis=-1), rtol=1e-5).item()
    same = mx.broadcast_to(x[:, :1], x.shape)
    rotated = cache.rotate(same)
    assert not mx.allclose(rotated[:, 0], rotated[:, 1]).item()  # one rotation per head
    other = get_scheme("turboquant").make_cache(get_scheme("turboquant").resolve(seed=1))
    assert not mx.allclose(other.rotate(x), y).item()


# -- QJL --------------------------------------------------------------------------------------------------------

def score_errors(options: dict, seeds: int, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """For each seed (rotation and projection), sum over the block's vectors of q . k_hat - q . k."""
    scheme = get_scheme("turboquant")
    stored = x.astype(np.float16).astype(np.float32)  # what the cache keeps before it encodes
    truth = np.sum(y * stored, axis=-1)
    out = []
    for seed in range(seeds):
        k_hat = scheme.roundtrip(x, "k", scheme.resolve(**options, seed=seed))
        out.append(float(np.sum(np.sum(y * k_hat, axis=-1) - truth)))
    return np.array(out)


def test_qjl_makes_the_score_estimate_unbiased_and_the_mse_codebook_alone_does_not():
    """Over 300 seeds, q . k_hat - q . k averages to zero with the QJL residual (2-bit K: a 1-bit codebook and
    the 1-bit sign sketch), within 4 standard errors; the 2-bit codebook alone shrinks k, a bias of many
    standard errors (queries along the keys, where the shrinkage shows most)."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((32, 128)).astype(np.float32) * np.where(np.arange(128) % 37 == 3, 8.0, 1.0)
    y = (x + 0.5 * rng.standard_normal(x.shape)).astype(np.float32)
    unbiased = score_errors({"k_bits": 2, "v_bits": 2, "qjl": 1}, 300, x, y)
    sem = unbiased.std(ddof=1) / math.sqrt(len(unbiased))
    assert abs(unbiased.mean()) < 4 * sem, (unbiased.mean(), sem)
    biased = score_errors({"k_bits": 2, "v_bits": 2, "qjl": 0}, 60, x, y)
    assert biased.mean() < -10 * biased.std(ddof=1) / math.sqrt(len(biased)), (biased.mean(), biased.std())


def test_qjl_stores_signs_and_the_residual_norm_beside_k_bits_minus_one_codes():
    scheme = get_scheme("turboquant")
    options = scheme.resolve(k_bits=3, v_bits=4, qjl=1)
    cache = scheme.make_cache(options)
    k, v = random_kv(65)
    cache.update_and_fetch(k, v)
    cache.update_and_fetch(k[:, :, :1], v[:, :, :1])
    codes, norm, signs, gamma = cache.body.k
    assert (codes.dtype, codes.shape[-1]) == (mx.uint32, 128 * 2 // 32)  # 2-bit codebook for K
    assert (signs.dtype, signs.shape[-1]) == (mx.uint32, 128 // 32) and norm.dtype == gamma.dtype == mx.float16
    assert [p.shape[-1] for p in cache.body.v] == [128 * 4 // 32, 1]  # V: 4-bit codes and its norm, no QJL


# -- float formats ----------------------------------------------------------------------------------------------

def test_the_formats_are_exactly_what_mx_quantize_accepts():
    """MLX 0.32.4: mxfp4 and mxfp8 take groups of 32 only, nvfp4 groups of 16 only, each one width."""
    x = mx.random.normal((2, 64))
    accepted = set()
    for mode in ("mxfp4", "nvfp4", "mxfp8"):
        for bits in (4, 8):
            for group in (16, 32, 64):
                try:
                    mx.eval(mx.quantize(x, group_size=group, bits=bits, mode=mode))
                    accepted.add((bits, group, mode))
                except ValueError:
                    pass
    assert accepted == {(b, g, mode) for (b, g), mode in FORMATS.items()}


@pytest.mark.parametrize("spec", ["mxfp4", "nvfp4", "mxfp8", "nvfp4_rot"])
def test_float_codes_and_scales_are_packed_to_their_format(spec):
    """Codes bits/8 bytes a value in uint32 words, one uint8 scale a group: no floats written back."""
    name, options = parse_scheme_spec(spec)
    scheme = get_scheme(name)
    values = scheme.resolve(**options)
    cache = scheme.make_cache(values)
    k, v = random_kv(64)
    cache.update_and_fetch(k, v)
    cache.update_and_fetch(k[:, :, :1], v[:, :, :1])
    codes, scales = cache.body.k
    assert codes.dtype == mx.uint32 and codes.shape[-1] == 128 * values["bits"] // 32
    assert scales.dtype == mx.uint8 and scales.shape[-1] == 128 // values["group_size"]
    assert closed_form(name, 128, 128, values) == 256 * (values["bits"] / 8 + 1 / values["group_size"])
    back = cache.fetch()[0][:, :, :64]
    assert float(mx.abs(back - k).max() / mx.abs(k).max()) < (0.05 if values["bits"] == 8 else 0.3)


def test_float_spec_words_labels_and_colours():
    assert parse_scheme_spec("nvfp4_rot") == ("float", {"bits": 4, "group_size": 16, "rotation": 1})
    assert parse_scheme_spec("float4:g=16,rot=1")[1] == {"bits": 4, "group_size": 16, "rotation": 1}
    for spec in ("mxfp4", "nvfp4", "mxfp8", "mxfp4_rot", "mxfp8_rot:tail=128,sink=4"):
        label = scheme_label(*parse_scheme_spec(spec))
        assert label == spec.replace(":tail=", " tail=").replace(",sink=", " sink=")
        assert scheme_color(label) == SCHEMES["float"].color
    styles = trace_styles(["mxfp4", "nvfp4", "mxfp8_rot"])
    assert len({(s["color"], s["symbol"]) for s in styles.values()}) == 3  # variants of float: shades, markers


# -- kivi -------------------------------------------------------------------------------------------------------

def test_kivi_k_scales_are_per_channel_so_an_outlier_channel_spoils_no_other():
    """Every K channel has its own scale and offset over the block's tokens: the other channels' errors are
    bit-identical with and without a 100x outlier channel. Per token (affine), the outlier's groups lose."""
    scheme = get_scheme("kivi")
    options = scheme.resolve(bits=2)
    x = np.random.default_rng(1).standard_normal((64, 128)).astype(np.float32)
    spiked = x.copy()
    spiked[:, 5] *= 100
    plain, spoiled = (scheme.roundtrip(a, "k", options) - a for a in (x, spiked))
    others = np.arange(128) != 5
    assert np.array_equal(plain[:, others], spoiled[:, others])
    affine = get_scheme("affine")
    group = affine.resolve(bits=2, group_size=32)
    a_plain, a_spoiled = (affine.roundtrip(a, "k", group) - a for a in (x, spiked))
    same_group = (np.arange(128) // 32 == 0) & others
    assert np.abs(a_spoiled[:, same_group]).mean() > 2 * np.abs(a_plain[:, same_group]).mean()


def test_kivi_v_is_per_token_in_groups_of_32_channels():
    scheme = get_scheme("kivi")
    options = scheme.resolve(bits=3)
    cache = scheme.make_cache(options)
    k, v = random_kv(32 + 128 + 1)
    cache.update_and_fetch(k[:, :, :-1], v[:, :, :-1])
    cache.update_and_fetch(k[:, :, -1:], v[:, :, -1:])
    assert cache.region_tokens() == {"sink": 0, "body": 32, "live": 1, "tail": 128}  # HF's residual_length
    (kc, ks, kb), (vc, vs, vb) = cache.body
    assert ks.shape[-2:] == (128, 1) and kc.shape[-1] == 32 * 3 // 32  # K: per channel, over the block's tokens
    assert vs.shape[-2:] == (32, 128 // 32) and vc.shape[-1] == 128 * 3 // 32  # V: per token, 4 groups
    assert ks.dtype == kb.dtype == vs.dtype == mx.float16


# -- every field scheme -----------------------------------------------------------------------------------------

SPECS = ["turboquant4", "turboquant:k3v4", "turboquant:k8v4,qjl=1,tail=64,sink=4", "turboquant2:qjl=1",
         "mxfp4", "nvfp4_rot:tail=128", "mxfp8:sink=4", "kivi2", "kivi:k4v2,tail=0,sink=4"]


def closed_form(name: str, k_dim: int, v_dim: int, values: dict) -> float:
    """Bytes per encoded token and head as docs/field.md states them, written out independently of the block
    base (which derives them by encoding a block of zeros)."""
    if name == "float":  # codes bits / 8 bytes a value, one uint8 scale a group
        return (k_dim + v_dim) * (values["bits"] / 8 + 1 / values["group_size"])
    if name == "kivi":  # K per channel over 32 tokens, V per token over 32 channels: codes + fp16 scale and offset
        return k_dim * (values["k_bits"] / 8 + 4 / 32) + v_dim * (values["v_bits"] / 8 + 4 / 32)
    # turboquant: uint32 words of codes and an fp16 norm each; QJL: K's codes one bit narrower, plus sign words
    qjl, k_bits = values["qjl"], values["k_bits"] - values["qjl"]
    out = 4 * math.ceil(k_dim * k_bits / 32) + 2 + 4 * math.ceil(v_dim * values["v_bits"] / 32) + 2
    return out + qjl * (4 * math.ceil(k_dim / 32) + 2)


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("tokens", [1, 33, 200, 300])
def test_nbytes_equals_the_byte_formula_and_its_closed_form(spec, tokens):
    """After `tokens` tokens (the last one alone, as decode sends it): resident bytes = layer_bytes (the block
    base's formula), = the scheme's closed form per encoded token plus fp16 for the rest; regions add up."""
    name, options = parse_scheme_spec(spec)
    scheme = get_scheme(name)
    values = scheme.resolve(**options)
    cache = scheme.make_cache(values)
    k, v = random_kv(tokens)
    if tokens > 1:
        cache.update_and_fetch(k[:, :, :-1], v[:, :, :-1])
    cache.update_and_fetch(k[:, :, -1:], v[:, :, -1:])
    regions = cache.regions()
    resident = cache.nbytes - regions["reserve"]
    assert resident == scheme.layer_bytes(tokens, 2, 128, 128, values)
    body = cache.region_tokens()["body"]
    assert resident == 2 * (body * closed_form(name, 128, 128, values) + (tokens - body) * 256 * 2)
    assert regions["body"] == (0 if cache.body is None else sum(p.nbytes for p in (*cache.body.k, *cache.body.v)))


@pytest.mark.parametrize("text, message", [
    ("turboquant5", "turboquant: bits=5 is not supported; accepted: 2, 3, 4, 8"),
    ("turboquant:k4v6", "turboquant: v_bits=6 is not supported; accepted: 2, 3, 4, 8"),
    ("turboquant4:qjl=2", "turboquant: qjl=2 is not supported; accepted: 0, 1"),
    ("turboquant4:seed=-1", "turboquant: seed=-1 is not supported; accepted: an int >= 0"),
    ("float8:g=16", "float: bits=8, group_size=16 is no format; accepted: mxfp4 .*nvfp4 .*mxfp8"),
    ("float:g=64", "float: group_size=64 is not supported; accepted: 16, 32"),
    ("kivi7", "kivi: bits=7 is not supported; accepted: 2, 3, 4, 5, 6, 8"),
    ("kivi2:group_size=64", r"kivi: unknown option\(s\) \['group_size'\]"),
])
def test_bad_options_are_clear_errors(text, message):
    with pytest.raises(ValueError, match=message):
        parse_scheme_spec(text)


def test_caches_built_by_hand_check_their_options_and_fill_defaults():
    cls = get_scheme("float").cache_class
    with pytest.raises(ValueError, match="layer 3: float: bits=8, group_size=16 is no format"):
        cls(layer=3, bits=8, group_size=16)
    cache = get_scheme("kivi").cache_class(layer=1, bits=3)
    assert (cache.k_bits, cache.v_bits, cache.kv_tail_tokens) == (3, 3, 128)


def test_head_dims_a_scheme_cannot_encode_stay_fp16_with_the_reason():
    """head_dim 80: no groups of 32 (float, kivi), and a Hadamard transform that is not its own inverse
    (gmlx_lab/cache/rotation.py: turboquant, and float with its rotation, whose groups of 16 would fit)."""
    model = tiny_llama(layers=2, head_dim=80)
    for spec, why in (("turboquant4", "cannot rotate K heads: head_dim 80 = 20 x 4: MLX's Hadamard transform at "
                                      "this size is not its own inverse"),
                      ("nvfp4_rot", "cannot rotate K heads: head_dim 80"),
                      ("mxfp4", "cannot encode K blocks of head_dim 80"),
                      ("kivi2", "cannot encode V blocks of head_dim 80")):
        name, options = parse_scheme_spec(spec)
        p = gmlx_lab.policy(model, name, name="hd80", **options)
        assert not p.quantized and why in str(p), str(p)
    assert gmlx_lab.policy(model, "float", name="hd80", group_size=16).quantized  # nvfp4 unrotated: 16 | 80


def test_the_kv_line_says_which_schemes_decode_by_the_reference_path():
    """Schemes without a fused GPU kernel say so (GmlxCache.decode_path: a plug-in's, by default); every built-in
    scheme has one."""
    model = tiny_llama(layers=2)
    for name in SCHEMES:
        p = gmlx_lab.policy(model, name)
        kernels = getattr(get_scheme(name).cache_class, "KERNELS", ())
        said = "reference decode path (dequantize, then SDPA" in str(p)
        assert said == (bool(p.quantized) and not kernels), str(p)
    assert all(get_scheme(n).cache_class.KERNELS for n in FIELD)  # every built-in scheme decodes fused on a GPU


def test_every_scheme_has_its_own_colour_and_affine_rot_names_llama_cpp():
    colours = [s.color for s in SCHEMES.values()]
    assert len(set(colours)) == len(colours)
    assert "PR 21038" in SCHEMES["affine_rot"].summary


@pytest.mark.parametrize("head_dim", [32, 40, 48, 56, 64, 80, 96, 128, 160, 192, 224, 256])
def test_rotation_rule_matches_mlx_hadamard(head_dim: int) -> None:
    """gmlx_lab/cache/rotation.py's rule is what mx.hadamard_transform does: accepted sizes undo themselves, the others
    do not (sizes MLX has no transform for are not probed: they can crash the process)."""
    eye = mx.eye(head_dim)
    twice = mx.hadamard_transform(mx.hadamard_transform(eye))
    assert (rotation_problem(head_dim) is None) == mx.allclose(twice, eye, atol=1e-4).item()


def test_rotated_schemes_refuse_head_dims_they_cannot_undo() -> None:
    """affine_rot at head_dim 160 (20 x 8) would hand back K/V that are not the model's: refused with the reason."""
    keys = mx.zeros((1, 1, 4, 160))
    with pytest.raises(ValueError, match="not its own inverse"):
        AffineRotCache(4, 32).update_and_fetch(keys, keys)
    assert "not its own inverse" in get_scheme("affine_rot").declines("k", 160, 160, {"group_size": 32, "bits": 4})
    assert get_scheme("affine").declines("k", 160, 160, {"group_size": 32, "bits": 4}) is None
    assert rotation_problem(288) == "head_dim 288 has no Hadamard transform in MLX (accepted: 2^k or 12 x 2^k)"


@pytest.mark.parametrize("spec", ["turboquant4", "turboquant:k3v4,sink=4,tail=64", "turboquant:bits=3,qjl=1",
                                  "mxfp8_rot"])
def test_a_decode_step_on_the_cpu_attends_in_the_blocks_rotated_space(spec):
    """On the CPU a decode step of rotated blocks that mx.quantized_matmul cannot read (TurboQuant, mxfp8_rot) turns
    the queries into the blocks' space and the output back, a kv head's rows at a time, and no decoded token: the
    reference attention's output, and every array turned back has no more rows than the queries."""
    name, options = parse_scheme_spec(spec)
    cache = get_scheme(name).make_cache(get_scheme(name).resolve(**options), layer=0)
    cache.update_and_fetch(*(mx.random.normal((1, 8, 1000, 128), key=mx.random.key(i)) for i in (0, 1)))
    keys, values = cache.update_and_fetch(*(mx.random.normal((1, 8, 1, 128), key=mx.random.key(s)) for s in (2, 3)))
    q = mx.random.normal((1, 32, 1, 128), key=mx.random.key(7))
    assert cache.quantized_matmul_step(q, values, "causal") and cache.matmul_codes() is None and cache.rotated_step()
    cache.attention_path = "reference"
    ref = cache.attend(q, keys, values, scale=0.088, mask="causal")
    cache.attention_path = "auto"
    turned_back = []
    unrotate = cache.unrotate
    cache.unrotate = lambda x: turned_back.append(x.shape[-2]) or unrotate(x)
    out = cache.attend(q, keys, values, scale=0.088, mask="causal")
    assert float(mx.abs(out - ref).max() / mx.abs(ref).max()) < 1e-5
    assert turned_back and max(turned_back) <= 4, turned_back  # a kv head's 4 query rows


@pytest.mark.parametrize("spec", ["mxfp4", "nvfp4:tail=64,sink=4", "mxfp4_rot", "kivi4", "kivi:k2v4,sink=4"])
def test_a_decode_step_on_the_cpu_attends_from_the_codes(spec):
    """On the CPU a decode step of mxfp4, nvfp4 or KIVI scores the blocks' codes with mx.quantized_matmul, the fp16
    sink and recent tokens in the same softmax: the reference attention's output, without the float32 copy of every
    block that decoding holds (mxfp8, slower that way, keeps the reference)."""
    name, options = parse_scheme_spec(spec)
    cache = get_scheme(name).make_cache(get_scheme(name).resolve(**options), layer=0)
    for seed in range(2):  # 8192 tokens of 8 KV heads of 128
        cache.update_and_fetch(*(mx.random.normal((1, 8, 4096, 128), key=mx.random.key(seed + i)) for i in (0, 10)))
        mx.eval(cache.state)
    keys, values = cache.update_and_fetch(*(mx.random.normal((1, 8, 1, 128), key=mx.random.key(s)) for s in (8, 9)))
    q = mx.random.normal((1, 32, 1, 128), key=mx.random.key(7))
    mx.eval(q, cache.state)
    assert cache.quantized_matmul_step(q, values, "causal") and cache.matmul_codes() is not None

    def attend(path: str) -> tuple[mx.array, int]:
        cache.attention_path = path
        k, v = cache.fetch(mx.float32)  # lazy, as mlx-lm's attention hands them over
        mx.clear_cache()
        mx.reset_peak_memory()
        start = mx.get_active_memory()
        out = cache.attend(q, k, v, scale=0.088, mask="causal")
        mx.eval(out)
        return out, mx.get_peak_memory() - start

    out, peak = attend("auto")
    ref, ref_peak = attend("reference")
    assert float(mx.abs(out - ref).max() / mx.abs(ref).max()) < 1e-5
    decoded = 2 * 4 * 8 * 8192 * 128  # the blocks' K and V in float32
    assert peak < decoded / 4 < ref_peak, (peak, ref_peak)
    mxfp8 = get_scheme("float").make_cache(get_scheme("float").resolve(bits=8), layer=0)
    mxfp8.update_and_fetch(*(mx.random.normal((1, 8, 64, 128)) for _ in range(2)))
    assert mxfp8.matmul_codes() is None
