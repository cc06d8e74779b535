"""The per-layer policy on real mlx-lm model classes (tiny random-weight specimens), and running them."""

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
        assert type(c).__name__ == {"kvarn": "KVarNCache", "affine": "AffineCache"}.get(d.decision, type(c).__name__)
    kvarn_layers = [c for c in cache if type(c).__name__ == "KVarNCache"]
    assert all(c.n_records == 1 for c in kvarn_layers)  # 303 tokens, tail 0: sink + one record + live
