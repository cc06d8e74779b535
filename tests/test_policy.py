"""The per-layer policy on real mlx-lm model classes (tiny random-weight specimens), and running them."""

import re

import mlx.core as mx
import pytest

import gmlx_lab
from gmlx_lab.models import specimen

# family -> (kvarn decisions, affine decisions), one letter per cache entry: k kvarn, a affine, . fp16
EXPECTED = {
    "llama": ("kkk.", "aaa."),
    "qwen3_5": ("...k....", "...a...."),
    "qwen3_next": ("...k....", "...a...."),
    "gemma3": (".....k......", ".....a......"),
    "gemma4": ("....k.....", "....a....."),
    "gpt_oss": ("....", ".a.."),
    "deepseek_v3": ("....", "aaa."),
    "kimi_linear": ("........", "...a...."),
    # gmlx keeps Kimi K2 fp16 under affine too; its cache has DeepSeek-V3's shape, and our policy reads only
    # shapes, so here it packs like DeepSeek-V3 (documented in gmlx_lab/policy.py).
    "kimi_k2": ("....", "aaa."),
}
LETTER = {"kvarn": "k", "affine": "a", "fp16": "."}


@pytest.mark.parametrize("family", sorted(EXPECTED))
def test_decisions_per_family(family):
    model = specimen(family)
    for scheme, expected in zip(("kvarn", "affine"), EXPECTED[family]):
        p = gmlx_lab.policy(model, scheme)
        assert "".join(LETTER[d.decision] for d in p.layers) == expected, (scheme, str(p))
        report = p.as_dict()
        assert report["scheme"] == scheme and len(report["layers"]) == len(expected)
        assert all(set(d) >= {"index", "kind", "decision", "reason"} for d in report["layers"])


def test_reasons_come_from_cache_shapes():
    reasons = {d.kind: d.reason for d in gmlx_lab.policy(specimen("qwen3_5"), "kvarn").layers}
    assert reasons["recurrent"] == "recurrent state"
    gemma = gmlx_lab.policy(specimen("gemma3"), "kvarn")
    assert {d.reason for d in gemma.layers if d.kind == "sliding-window"} == {"sliding window"}
    gpt = gmlx_lab.policy(specimen("gpt_oss"), "kvarn")
    assert str(gpt).startswith("[kv] gpt_oss-specimen: kvarn6 tail=1024 -> no layer can use kvarn (layer 1 fp16: "
                               "head_dim 64: kvarn needs 128/256/512")
    assert str(gpt).endswith("-> running fp16")
    mla = gmlx_lab.policy(specimen("deepseek_v3"), "kvarn")
    assert [d.kind for d in mla.layers] == ["latent-attention"] * 4
    assert "MLA latent cache: kvarn declines" in str(mla) and "running fp16" in str(mla)
    assert "affine" not in str(mla)  # never a silent fallback to affine


@pytest.mark.parametrize("family", sorted(EXPECTED))
@pytest.mark.parametrize("scheme", ["affine", "kvarn"])
def test_specimens_generate_with_policy_caches(family, scheme):
    """Every family runs prefill + decode on the caches the policy built, with finite logits."""
    model = specimen(family)
    extra = {"kv_tail_tokens": 0} if scheme == "kvarn" else {}
    cache = gmlx_lab.make_cache(model, scheme, quiet=True, bits=4, **extra)
    mx.random.seed(0)
    prompt = mx.random.randint(0, 200, (1, 300))
    logits = model(prompt, cache=cache)
    for _ in range(3):
        logits = model(mx.argmax(logits[:, -1:], axis=-1), cache=cache)
    assert mx.all(mx.isfinite(logits)).item()
    for d, c in zip(cache.policy.layers, cache):
        assert type(c).__name__ == {"kvarn": "KvarnCache", "affine": "AffineCache"}.get(d.decision, type(c).__name__)
    kvarn_layers = [c for c in cache if type(c).__name__ == "KvarnCache"]
    assert all(c.n_records == 1 for c in kvarn_layers)  # 303 tokens, tail 0: sink + one record + live


FIELD = {"turboquant": {"k_bits": 3, "v_bits": 4, "qjl": 1}, "float": {"bits": 4, "group_size": 16, "rotation": 1},
         "kivi": {"bits": 2, "kv_tail_tokens": 32}}


@pytest.mark.parametrize("family", sorted(EXPECTED))
def test_field_schemes_take_what_affine_takes_unless_the_head_dims_refuse(family):
    """turboquant, float and kivi under the same rule: a subset of affine's layers, each layer left out with the
    class's reason, and prefill + decode run on the caches with finite logits, blocks encoded."""
    model = specimen(family)
    affine = gmlx_lab.policy(model, "affine")
    for scheme, options in FIELD.items():
        cache = gmlx_lab.make_cache(model, scheme, quiet=True, **options)
        p = cache.policy
        for mine, theirs in zip(p.layers, affine.layers):
            assert mine.decision in (scheme, "fp16") and (mine.decision == "fp16" or theirs.decision == "affine")
            if mine.decision == "fp16" and theirs.decision == "affine" and theirs.grows:
                assert "cannot encode" in mine.reason or "cannot rotate" in mine.reason, mine.reason
        mx.random.seed(0)
        logits = model(mx.random.randint(0, 200, (1, 100)), cache=cache)
        for _ in range(2):
            logits = model(mx.argmax(logits[:, -1:], axis=-1), cache=cache)
        assert mx.all(mx.isfinite(logits)).item(), scheme
        mine = [c for d, c in zip(p.layers, cache) if d.decision == scheme]
        assert all(c.n_blocks > 0 for c in mine), scheme
        # TurboQuant's QJL is the one built-in layout without a fused kernel, and the [kv] line says so
        assert (f"{scheme}: reference decode path" in str(p)) == (bool(mine) and bool(options.get("qjl"))), str(p)


# -- overrides (exploration beyond gmlx's rule) ------------------------------------------------------


def _letters(p):
    return "".join(LETTER[d.decision] for d in p.layers)


def test_overrides_choose_layers_last_and_sliding():
    model = specimen("gemma3")  # 12 entries: sliding windows, global layers 5 and 11
    assert _letters(gmlx_lab.policy(model, "kvarn", quantize_last=True)) == ".....k.....k"
    assert _letters(gmlx_lab.policy(model, "kvarn", quantize_sliding=True)) == "kkkkkkkkkkk."
    assert _letters(gmlx_lab.policy(model, "affine", layers=[1, 11])) == ".a.........a"
    assert _letters(gmlx_lab.policy(model, "affine", layers=[5], quantize_last=True)) == ".....a.....a"
    assert _letters(gmlx_lab.policy(model, "kvarn", quantize_sliding=True, fp16_layers=[0, 5])) == ".kkkk.kkkkk."
    assert _letters(gmlx_lab.policy(model, "fp16", quantize_sliding=True)) == "." * 12  # the baseline stays fp16


def test_every_override_is_named_in_the_kv_line_and_as_dict():
    model = specimen("gemma3")
    p = gmlx_lab.policy(model, "kvarn", bits=4, kv_tail_tokens=128, layers=[1, 5], quantize_last=True,
                        fp16_layers=[3])
    line = str(p)
    assert line.startswith("[kv] gemma3-specimen: kvarn4 tail=128 +layers 1,5 +last -fp16 3 -> quantized 2/2 attn "
                           "layers, 1/10 sliding-window quantized")
    assert "layer 1 override: quantized by request (layers=[1, 5]) (the model's 128-token sliding mask" in line
    assert "layer 5 override: quantized by request (layers=[1, 5])" in line
    assert "layer 11 override: last of deep stack, quantized by request" in line
    assert "layer 3 override: kept fp16 by request (fp16_layers)" in line
    report = p.as_dict()
    assert report["overrides"] == {"layers": [1, 5], "fp16_layers": [3], "quantize_last": True,
                                   "quantize_sliding": False}
    assert report["quantized_layers"] == 3 and report["quantized_sliding_layers"] == 1
    reasons = {d["index"]: d["reason"] for d in report["layers"]}
    assert reasons[0] == "sliding window" and reasons[11].startswith("override: last of deep stack")
    assert report["layers"][1]["window"] == 128 and report["layers"][5]["window"] is None
    dropped = gmlx_lab.policy(model, "affine", layers=[1])
    assert "layer 5 fp16: override: fp16, not in layers=[1]" in str(dropped)


@pytest.mark.parametrize("kwargs, message", [
    ({"layers": [12]}, "layers has 12; accepted: layer indices 0..11 (the model has 12 cache entries)"),
    ({"layers": [-1]}, "layers has -1; accepted: layer indices 0..11"),
    ({"fp16_layers": ["3"]}, "fp16_layers has '3'; accepted: layer indices 0..11"),
    ({"layers": [True]}, "layers has True; accepted: layer indices 0..11"),
    ({"layers": []}, "layers=[] quantizes nothing"),
    ({"layers": 3.5}, "layers=3.5; accepted: a list of layer indices 0..11"),
    ({"layers": [5], "fp16_layers": [5]}, "layers [5] are both in layers (quantize) and fp16_layers (keep fp16)"),
    ({"quantize_last": "yes"}, "quantize_last='yes'; accepted: True or False"),
])
def test_bad_overrides_name_what_is_accepted(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        gmlx_lab.policy(specimen("gemma3"), "kvarn", **kwargs)


def test_override_of_a_recurrent_layer_is_refused_and_declines_keep_reasons():
    with pytest.raises(ValueError, match=re.escape("layer 0 is recurrent state, no K/V cache to quantize; "
                                                   "accepted: the attention layers 3,7")):
        gmlx_lab.policy(specimen("qwen3_5"), "kvarn", layers=[0])
    gpt = gmlx_lab.policy(specimen("gpt_oss"), "kvarn", quantize_sliding=True)  # head_dim 64: kvarn declines
    assert not gpt.quantized
    assert {d.reason for d in gpt.layers if d.kind == "sliding-window"} == {
        "head_dim 64: kvarn needs 128/256/512 (head_dim_ext=1 takes 64/96) (override: sliding window, quantized by "
        "request: kvarn declines)"}


def _logits(model, cache, tokens, steps):
    return mx.concatenate([model(tokens[:, a:b], cache=cache)[0] for a, b in steps], axis=0)


def test_quantized_sliding_layers_at_fp16_storage_give_the_stock_logits():
    """Sliding layers served by our caches (fp16-equivalent storage: affine before quantized_kv_start, kvarn's
    fp16 tail) give the logits of the same model whose sliding layers are plain fp16 caches: prefill chunks
    and decode steps past the model's window, with the rolling windows dropping, mixed with native layers."""
    from gmlx_lab.cache import FP16Cache

    model = specimen("gemma3")  # sliding window 128: the affine windows hold 384 tokens and drop
    mx.random.seed(1)
    tokens = mx.random.randint(0, 200, (1, 640))
    steps = [(0, 300), (300, 600)] + [(i, i + 1) for i in range(600, 640)]
    base = gmlx_lab.policy(model, "fp16")
    stock = _logits(model, [FP16Cache(layer=i) if d.kind != "other" else None for i, d in enumerate(base.layers)],
                    tokens, steps)  # fp16 storage everywhere, no rolling: the reference mask spans every token
    for scheme, options in [("affine", {"quantized_kv_start": 10**6}), ("kvarn", {"kv_tail_tokens": 10**6})]:
        cache = gmlx_lab.make_cache(model, scheme, quiet=True, quantize_sliding=True, **options)
        out = _logits(model, cache, tokens, steps)
        assert mx.abs(out - stock).max().item() < 0.05, scheme  # random weights amplify float noise to ~0.01
    cache = gmlx_lab.make_cache(model, "affine", quiet=True, quantize_sliding=True, quantized_kv_start=10**6)
    _logits(model, cache, tokens, steps)
    assert cache[0].held < 640 and cache[0].dropped > 0  # the window rolled
    quantized = _logits(model, gmlx_lab.make_cache(model, "affine", quiet=True, bits=2, quantize_sliding=True),
                        tokens, steps)
    assert mx.abs(quantized - stock).max().item() > 1.0  # the comparison can tell a quantized window apart


def test_a_sliding_cache_hands_back_what_rotating_kv_cache_does():
    """Same key count and the same masks as mlx-lm's RotatingKVCache, update after update, while it rolls."""
    from mlx_lm.models.cache import RotatingKVCache

    from gmlx_lab.cache import FP16Cache, window

    ours, native = FP16Cache(layer=0), RotatingKVCache(max_size=128)
    ours.set_window(window.sliding_hold(128))
    ours.set_sliding(128)
    for n in (100, 1, 200, 1, 1, 300, 1, 64, 1):
        for request in (128, None):
            a, b = ours.make_mask(n, window_size=request), native.make_mask(n, window_size=request)
            assert (a is None and b is None) or (isinstance(a, str) and a == b) or mx.array_equal(a, b).item()
        kv = mx.random.normal((1, 1, n, 8))
        mine, theirs = ours.update_and_fetch(kv, kv)[0], native.update_and_fetch(kv, kv)[0]
        assert mine.shape == theirs.shape, n
        assert mx.array_equal(mx.sort(mine[0, 0, :, 0]), mx.sort(theirs[0, 0, :, 0].astype(mx.float16))).item()
    assert ours.dropped > 0 and ours.held <= window.sliding_hold(128)
    with pytest.raises(ValueError, match="cannot serve a sliding window of 128; accepted: max_kv_size >= 384"):
        small = FP16Cache(layer=1)
        small.set_window(256)
        small.set_sliding(128)


@pytest.mark.parametrize("scheme, options", [("affine", {"bits": 4}), ("kvarn", {"bits": 4, "kv_tail_tokens": 128})])
def test_quantized_sliding_layers_survive_save_and_load(tmp_path, scheme, options):
    """A saved and loaded overridden cache keeps its sliding layers sliding: it continues like the original."""
    from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

    model = specimen("gemma3")
    mx.random.seed(2)
    tokens = mx.random.randint(0, 200, (1, 460))
    cache = gmlx_lab.make_cache(model, scheme, quiet=True, quantize_sliding=True, **options)
    _logits(model, cache, tokens, [(0, 300), (300, 400)])
    sliding = [i for i, c in enumerate(cache) if getattr(c, "sliding_window", None)]
    path = str(tmp_path / "cache.safetensors")
    save_prompt_cache(path, cache)
    loaded = load_prompt_cache(path)
    assert sliding and [i for i, c in enumerate(loaded) if getattr(c, "sliding_window", None)] == sliding
    steps = [(400, 430)] + [(i, i + 1) for i in range(430, 460)]
    assert mx.array_equal(_logits(model, cache, tokens, steps), _logits(model, loaded, tokens, steps)).item()
