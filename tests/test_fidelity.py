"""Fidelity: KL against the fp16 cache, the cache audit and the scheme-spec parser (on the llama specimen)."""

import json

import mlx.core as mx
import pytest

import gmlx_lab
from gmlx_lab.cache import FP16Cache
from gmlx_lab.measure.audit import AuditError, audit
from gmlx_lab.measure.fidelity import fidelity, layer_sensitivity
from gmlx_lab.models import specimen
from gmlx_lab.specs import parse_scheme_spec

PREFILL, DECODE = 400, 24


@pytest.fixture(scope="module")
def llama():
    return specimen("llama")


@pytest.fixture(scope="module")
def tokens():
    return mx.random.randint(0, 512, (PREFILL + DECODE + 1,), key=mx.random.key(3)).tolist()


@pytest.fixture(scope="module")
def result(llama, tokens):
    schemes = ["fp16", "affine2", "affine4", "affine8", "kvarn4:tail=0"]
    return fidelity(llama, None, tokens, schemes, prefill=PREFILL, decode=DECODE)


@pytest.mark.parametrize("text, expected", [
    ("fp16", ("fp16", {})),
    ("affine4", ("affine", {"bits": 4})),
    ("affine_rot4:g=32", ("affine_rot", {"bits": 4, "group_size": 32})),
    ("kvarn6:tail=128", ("kvarn", {"bits": 6, "kv_tail_tokens": 128})),
    ("kvarn:k8v4", ("kvarn", {"k_bits": 8, "v_bits": 4})),
    ("kvarn:k4v8,tail=0", ("kvarn", {"k_bits": 4, "v_bits": 8, "kv_tail_tokens": 0})),
    (("affine", {"bits": 8}), ("affine", {"bits": 8})),
])
def test_parse_scheme_spec(text, expected):
    assert parse_scheme_spec(text) == expected


@pytest.mark.parametrize("text, message", [
    ("kvarn7", "bits=7 is not supported"),
    ("affine5", "bits=5 is not supported"),
    ("affine:k8v4", "only kivi, kvarn"),
    ("bogus4", "unknown scheme"),
    ("", "non-empty"),
    ("kvarn6:tail=lots", "must be an integer"),
    ("kvarn6:colour=3", "unknown option"),
    ("fp16:3", "fp16 takes no width"),
    ("kvarn6:??", "cannot read"),
])
def test_parse_scheme_spec_errors(text, message):
    with pytest.raises(ValueError, match=message):
        parse_scheme_spec(text)


def test_fp16_against_fp16_is_exactly_zero(llama, tokens):
    r = fidelity(llama, None, tokens, ["fp16"], prefill=PREFILL, decode=8, reuse_reference=False)
    s = r.schemes[0]
    assert max(s.prefill_kl) == 0.0 and max(s.decode_kl) == 0.0
    assert s.top1 == 1.0 and s.perplexity == pytest.approx(r.reference_perplexity)


def test_kl_grows_as_widths_shrink(result):
    kl = {b: result[f"affine{b}"].decode_mean_kl for b in (2, 4, 8)}
    assert kl[8] < kl[4] < kl[2]
    assert result["fp16"].decode_median_kl == 0.0


def test_kvarn_with_sealed_records_beats_affine_at_4_bits(result):
    kvarn, affine = result["kvarn4:tail=0"], result["affine4"]
    assert kvarn.audit.layers[0].regions["record_codes"] > 0  # records really sealed
    assert kvarn.decode_median_kl < affine.decode_median_kl / 3


def test_result_views(result):
    table = result.to_markdown()
    assert "decode median KL" in table and "kvarn4 tail=0" in table
    assert result._repr_html_().startswith("<table>")
    data = json.loads(json.dumps(result.to_dict()))
    assert len(data["schemes"]) == 5 and len(data["schemes"][1]["decode_kl"]) == DECODE
    assert len(result["affine4"].prefill_kl) == PREFILL


def test_figures(result):
    assert len(result.figure_kl().data) == 5
    assert len(result.figure_summary().data[0].x) == 5


def test_audit_passes_on_real_caches(result):
    for s in result.schemes:
        assert s.audit.ok
    kvarn = result["kvarn4:tail=0"].audit
    assert kvarn.resident < kvarn.fp16_bytes
    assert [a.decision for a in kvarn.layers] == ["kvarn", "kvarn", "kvarn", "fp16"]


def _filled(model, scheme, tokens=300, **options):
    cache = gmlx_lab.make_cache(model, scheme, quiet=True, **options)
    mx.eval(model(mx.arange(tokens)[None], cache=cache))
    return cache


def test_audit_fails_loudly_on_a_doctored_cache(llama):
    cache = _filled(llama, "kvarn", bits=4, kv_tail_tokens=0)
    audit(cache)
    fake = FP16Cache(layer=1)
    k, v = cache[1].fetch()
    fake.update_and_fetch(k, v)
    cache[1] = fake  # the policy still says layer 1 is kvarn
    with pytest.raises(AuditError, match="layer 1: policy says kvarn but the cache is FP16Cache"):
        audit(cache)
    assert not audit(cache, strict=False).ok


def test_audit_catches_wrong_widths_and_missing_policy(llama):
    cache = _filled(llama, "affine", bits=4)
    cache[0] = _filled(llama, "affine", bits=8)[0]
    with pytest.raises(AssertionError, match="bits 8, policy says 4"):
        audit(cache)
    with pytest.raises(ValueError, match="PromptCache"):
        audit(list(cache))


def test_layer_sensitivity_quantizes_one_layer_at_a_time(llama, tokens):
    r = layer_sensitivity(llama, None, tokens, "affine2", prefill=200, decode=4)
    assert [s.label for s in r.schemes] == [f"affine2 g64 layer {i}" for i in range(4)]
    for i, s in enumerate(r.schemes):
        assert [a.index for a in s.audit.layers if a.decision != "fp16"] == [i]  # even the last layer
        assert s.decode_mean_kl > 0


def test_bad_lengths(llama, tokens):
    with pytest.raises(ValueError, match="needs 1001 tokens"):
        fidelity(llama, None, tokens, ["affine4"], prefill=900, decode=100)
    with pytest.raises(ValueError, match="tokenizer"):
        fidelity(llama, None, "some text", ["affine4"])


def test_bundled_model_kvarn_beats_affine_at_4_bits():
    """On the trained teaching model too, at a short context where records are sealed (tail 0)."""
    from gmlx_lab.models import BUNDLED_MODEL_DIR, load

    model, tokenizer = load()
    text = (BUNDLED_MODEL_DIR.parents[1] / "data" / "eval_text.txt").read_text()
    r = fidelity(model, tokenizer, text, ["affine4", "kvarn4:tail=0"], prefill=512, decode=32)
    assert r["kvarn4:tail=0"].decode_median_kl < r["affine4"].decode_median_kl / 3
    assert all(s.audit.ok for s in r.schemes)
