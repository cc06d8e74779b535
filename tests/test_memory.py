"""Memory truth: resident bytes per scheme, layer and region, and peak memory during prefill."""

import mlx.core as mx
import pytest

import gmlx_lab
from gmlx_lab.measure.memory import memory_report, prefill_peak
from gmlx_lab.models import specimen


@pytest.fixture(scope="module")
def llama():
    return specimen("llama")


@pytest.fixture(scope="module")
def report(llama):
    return memory_report(llama, ["fp16", "affine8", "affine4", "kvarn6:tail=0", "kvarn4:tail=128"], context=1024)


def test_ratios(report):
    assert report["fp16"].ratio == 1.0
    body, fp16 = report["kvarn6 tail=0"].by_region()["body"]
    assert body / fp16 == pytest.approx(0.398, abs=0.001)  # (2048*6 + 768) / 32768 per record
    body, fp16 = report["kvarn4 tail=128"].by_region()["body"]
    assert body / fp16 == pytest.approx(0.273, abs=0.001)
    codes, fp16 = report["affine8 g64"].by_region()["codes"]
    assert codes / fp16 == pytest.approx(0.5)
    assert report["affine4 g64"].resident < report["affine8 g64"].resident < report["fp16"].resident
    # the last layer stays fp16 under every scheme
    assert all(s.layers[-1].decision == "fp16" for s in report.schemes)


def test_replayed_bytes_match_a_real_run(llama, report):
    cache = gmlx_lab.make_cache(llama, "kvarn", quiet=True, bits=6, kv_tail_tokens=0)
    ids = mx.random.randint(0, 512, (1024,), key=mx.random.key(1))
    mx.eval(llama(ids[None], cache=cache))
    gmlx_lab.audit(cache)  # the prompt's groups wait for the next token to be sealed
    records = cache[0].n_records
    cache.settle()
    assert cache[0].n_records > records
    real = gmlx_lab.audit(cache)
    assert real.resident == report["kvarn6 tail=0"].resident


def test_views(report):
    assert "kvarn6 tail=0" in report.to_markdown()
    assert "| 3 | fp16 |" in report.layers_markdown("kvarn6 tail=0")
    assert report.to_dict()["schemes"][0]["ratio"] == 1.0


def test_prefill_peak(llama):
    rows = prefill_peak(llama, "kvarn6", context=512, steps=(128, 512))
    assert [r["step"] for r in rows] == [128, 512]
    assert all(r["peak"] > 0 for r in rows)
    assert rows[0]["above_start"] < rows[1]["above_start"]  # bigger chunks, bigger attention scores


def test_a_quantized_prefill_holds_one_slice_of_attention_not_the_whole(monkeypatch):
    """The bundled model, every layer quantized, 4096 tokens (its trained context) prefilled in chunks of 2048, with
    32 MiB of attention scratch: every built-in quantized scheme at 4 bits (kvarn and affine through their own
    `attend`, KIVI, TurboQuant and mxfp4 through the block base's) peaks well below the fp16 cache, whose SDPA on
    the CPU holds every score of a chunk over every key, and no copy of the cache is decoded whole."""
    from gmlx_lab.cache import attention
    from gmlx_lab.cli import load_model
    from gmlx_lab.policy import policy
    from gmlx_lab.specs import parse_scheme_spec

    monkeypatch.setattr(attention, "SCRATCH_BYTES", 32 * 2**20)
    model, _ = load_model(None)

    def peak(scheme: str, **options) -> dict:
        return prefill_peak(model, policy(model, scheme, quantize_last=True, **options), context=4096,
                            steps=(2048,))[0]

    fp16 = peak("fp16")
    for spec in ("kvarn4", "kivi4", "turboquant4", "mxfp4", "affine4"):
        name, options = parse_scheme_spec(spec)
        row = peak(name, **options)
        assert row["above_start"] < 0.6 * fp16["above_start"], (spec, row["above_start"], fp16["above_start"])
