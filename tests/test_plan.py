"""Per-layer plans: the JSON form, make_cache(plan=...), the exact search, the probes and `gmlx-lab plan`."""

import itertools
import json
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import save_prompt_cache

from gmlx_lab import audit, cli, load, load_prompt_cache, make_cache, policy
from gmlx_lab.measure.planner import (
    Sensitivity,
    choose,
    load_plan_results,
    markdown_table,
    measure_plan,
    plan_markdown,
    sensitivity,
    split_windows,
)
from gmlx_lab.measure.sizes import policy_bytes
from gmlx_lab.plans import Plan, load_plan, width_names, widths_label
from gmlx_lab.registry import get_scheme


@pytest.fixture(scope="module")
def teaching():
    return load("teaching-llama")


@pytest.fixture(scope="module")
def probed(teaching):
    """kvarn's probes on the bundled model at 1024 tokens (128-token tail), 16 tokens read back a window."""
    model, tokenizer = teaching
    return sensitivity(model, tokenizer, "kvarn", 1024, decode=16, kv_tail_tokens=128)


def mixed_plan() -> Plan:
    """kvarn on layers 0-6 of the bundled model: K4 with V at 2, 3 or 4 bits; layer 3 fp16."""
    widths = {i: {"k_bits": 4, "v_bits": 2 + i % 3} for i in range(7)} | {3: None}
    return Plan("teaching-llama", "kvarn", {"kv_tail_tokens": 128}, widths, 2048, 0.4)


def test_plan_json_roundtrip_and_bad_files(tmp_path):
    p = mixed_plan()
    path = p.save(tmp_path / "plan.json")
    again = load_plan(path)
    assert again == p and load_plan(str(path)) == p and load_plan(p.to_dict()) == p
    assert again.label == "kvarn plan 40% tail=128"
    bad = p.to_dict() | {"version": 0}
    with pytest.raises(ValueError, match="not a gmlx_lab plan of version 1"):
        load_plan(bad)
    with pytest.raises(ValueError, match="accepted: null \\(fp16\\) or \\{'k_bits': width, 'v_bits': width\\}"):
        load_plan(p.to_dict() | {"widths": {"0": {"bits": 4}}})
    with pytest.raises(ValueError, match="lacks context"):
        load_plan({k: v for k, v in p.to_dict().items() if k != "context"})
    with pytest.raises(FileNotFoundError, match="gmlx-lab plan --out"):
        load_plan(tmp_path / "missing.json")
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ValueError, match="not JSON"):
        load_plan(tmp_path / "broken.json")


def test_width_names_follow_the_scheme():
    assert width_names(get_scheme("kvarn")) == ("k_bits", "v_bits")
    assert width_names(get_scheme("affine")) == ("bits",)
    assert widths_label({"k_bits": 4, "v_bits": 3}) == "K4 V3" and widths_label({"bits": 3}) == "3-bit"
    with pytest.raises(ValueError, match="no width option"):
        width_names(get_scheme("fp16"))


def test_make_cache_takes_a_plan_layer_by_layer(teaching, tmp_path, capsys):
    model, tokenizer = teaching
    p = mixed_plan()
    cache = make_cache(model, plan=p)
    line = capsys.readouterr().out
    assert "kvarn plan 40% tail=128" in line and "layer 3 fp16: kept fp16 by the plan" in line
    assert "widths by the plan: layers 0,6 K4 V2, layers 1,4 K4 V3, layers 2,5 K4 V4, layer 3 fp16" in line
    assert [getattr(c, "v_bits", None) for c in cache] == [2, 3, 4, None, 3, 4, 2, None]
    assert {getattr(c, "k_bits", None) for c in cache} == {4, None}
    chosen = cache.policy
    # the byte formula reads each layer's own widths: between uniform V2 and V4, and the fp16 layer counts as fp16
    low, high = (policy_bytes(policy(model, "kvarn", k_bits=4, v_bits=v, kv_tail_tokens=128), 2048) for v in (2, 4))
    assert low < policy_bytes(chosen, 2048) < policy_bytes(policy(model, "kvarn", bits=4, kv_tail_tokens=128,
                                                                  fp16_layers=[3]), 2048) < high + 1e9
    ids = mx.array([tokenizer.encode("ROMEO: " * 300)[:600]])
    mx.eval(model(ids, cache=cache))
    cache.settle()
    assert audit(cache).ok
    path = str(tmp_path / "planned.safetensors")
    save_prompt_cache(path, cache)
    loaded = load_prompt_cache(path)
    assert [getattr(c, "v_bits", None) for c in loaded] == [2, 3, 4, None, 3, 4, 2, None]
    assert chosen.as_dict()["plan"]["widths"]["6"] == {"k_bits": 4, "v_bits": 2}
    assert chosen.as_dict()["bits"] is None and chosen.as_dict()["layers"][6]["options"] == {"k_bits": 4, "v_bits": 2}


def test_a_plan_that_does_not_fit_is_refused(teaching):
    model, _ = teaching
    p = mixed_plan()
    with pytest.raises(ValueError, match="bits cannot go with a plan"):
        policy(model, plan=p, bits=3)
    with pytest.raises(ValueError, match="the plan is for kvarn, not affine"):
        policy(model, "affine", plan=p)
    with pytest.raises(ValueError, match="quantizes layer 7, which the policy keeps fp16 \\(last of deep stack\\)"):
        policy(model, plan=Plan(**{**vars(p), "widths": p.widths | {7: {"k_bits": 4, "v_bits": 4}}}))
    with pytest.raises(ValueError, match="no widths for it"):
        policy(model, plan=Plan(**{**vars(p), "widths": {i: w for i, w in p.widths.items() if i != 0}}))
    with pytest.raises(ValueError, match="layer 0: kvarn: k_bits=7 is not supported; accepted: 2, 3, 4, 5, 6, 8"):
        policy(model, plan=Plan(**{**vars(p), "widths": p.widths | {0: {"k_bits": 7, "v_bits": 4}}}))


def synthetic(names: tuple[str, ...]) -> Sensitivity:
    """Three layers with made-up probes (non-convex in width on purpose) and made-up bytes."""
    widths = (2, 3, 4, 5, 6, 8) if names != ("bits",) else (2, 3, 4, 6, 8)
    parts = ("K", "V") if names != ("bits",) else ("KV",)
    probes = {part: {str(layer): {str(w): [((layer + 1.3) * (i + 2)) ** -3 * (1 + (w == 4)), 0.0]
                                  for i, w in enumerate(widths)} for layer in range(3)} for part in parts}
    pairs = [{"bits": b} for b in widths] if names == ("bits",) else \
        [{"k_bits": k, "v_bits": v} for k in widths for v in widths]
    table = {str(layer): {"fp16": 1000.0 * (layer + 1)} | {widths_label(w): (layer + 1) * 60.0 * sum(w.values())
                                                            for w in pairs} for layer in range(3)}
    scheme = "kvarn" if names != ("bits",) else "affine"
    return Sensitivity("toy", scheme, {}, {}, 100, 8, ["a", "b"], [0, 1, 2], probes, table, 500.0, 6500.0)


@pytest.mark.parametrize("names", [("k_bits", "v_bits"), ("bits",)])
def test_the_search_is_exact(names):
    sens = synthetic(names)
    every = list(itertools.product(*(sens.choices(layer) for layer in sens.layers)))
    for budget in (0.2, 0.25, 0.3, 0.4, 0.55, 0.8, 1.0):
        fits = [c for c in every if sens.fixed_bytes + sum(x.bytes for x in c) <= budget * sens.fp16_bytes]
        if not fits:
            with pytest.raises(ValueError, match="the smallest is"):
                choose(sens, budget)
            continue
        best = min(sum(x.kl for x in c) for c in fits)
        chosen = choose(sens, budget)
        assert chosen.report["predicted_kl"] == pytest.approx(best, rel=1e-12, abs=1e-15)
        assert chosen.report["bytes"] <= budget * sens.fp16_bytes
    assert choose(sens, 1.0).widths == {0: None, 1: None, 2: None}  # fp16 everywhere fits and has no KL
    if names != ("bits",):  # one width for K and V a layer: never better than the split, each layer tied
        for budget in (0.3, 0.4, 0.55):
            tied = choose(sens, budget, tied=True)
            assert all(w is None or w["k_bits"] == w["v_bits"] for w in tied.widths.values())
            assert tied.report["predicted_kl"] >= choose(sens, budget).report["predicted_kl"]
            assert tied.label.endswith(" K=V")
    with pytest.raises(ValueError, match="in \\(0, 1\\]"):
        choose(sens, 1.5)


def test_sensitivity_on_the_bundled_model(teaching, probed):
    model, tokenizer = teaching
    sens = probed
    assert sens.layers == list(range(7)) and set(sens.probes) == {"K", "V"}
    assert all(len(sens.probes["K"][str(layer)]) == 6 and len(sens.probes["V"][str(layer)]) == 6
               for layer in sens.layers)
    two = sum(sens.kl("K", layer, 2) for layer in sens.layers)
    eight = sum(sens.kl("K", layer, 8) for layer in sens.layers)
    assert two > 10 * eight > 0
    assert sens.calibration == ["macbeth", "julius_caesar"]
    tight = choose(sens, sens.smallest_share() + 0.05)
    assert tight.report["share"] <= tight.budget and tight.report["predicted_kl"] > 0
    assert policy_bytes(policy(model, plan=tight), 1024) == pytest.approx(tight.report["bytes"])
    text = plan_markdown(sens, tight)
    assert "| layer | widths | KiB | predicted KL |" in text and "calibration windows" in text
    again = Sensitivity.from_dict(json.loads(json.dumps(sens.to_dict())))
    assert choose(again, tight.budget) == tight
    with pytest.raises(ValueError, match="a plan chooses the widths"):
        sensitivity(model, tokenizer, "kvarn", 256, bits=4)


def test_a_plan_measured_against_the_widest_uniform_width_that_fits(teaching, probed):
    model, tokenizer = teaching
    sens = probed
    chosen = choose(sens, 0.58)
    measured = measure_plan(model, tokenizer, sens, chosen, decode=8)
    assert measured["uniform"]["label"] == "kvarn3 tail=128"  # kvarn4's bytes are above 58% here, kvarn3's below
    assert measured["plan"]["bytes"] <= 0.58 * sens.fp16_bytes and len(measured["windows"]) == 6
    assert measured["plan"]["mean_kl"]["n"] == 6 and "mean KL" in measured["sentence"]
    chosen.report["measured"] = measured
    assert "Measured on 6 other windows:" in plan_markdown(sens, chosen)
    assert json.loads(json.dumps(chosen.to_dict()))["report"]["measured"]["uniform"]["label"] == "kvarn3 tail=128"


def test_calibration_and_evaluation_read_different_windows(teaching):
    _, tokenizer = teaching
    calibration, held = split_windows("teaching-llama", tokenizer, 300)
    assert len(calibration) == 2 and len(held) == 6
    assert not {w.name for w in calibration} & {w.name for w in held}


def test_cli_plan_then_policy_with_it(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert cli.main(["plan", "--model", "teaching-llama", "--context", "1024", "--budget", "60%", "--out", str(out),
                     "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "kvarn plan 60% tail=128" in printed and f"wrote {out}" in printed
    assert load_plan(out).budget == 0.6
    assert cli.main(["policy", "--plan", str(out)]) == 0
    assert "widths by the plan" in capsys.readouterr().out
    assert cli.main(["compare", "--schemes", "fp16", "--plan", str(out), "--prompt", "ROMEO: " * 40,
                     "--max-tokens", "4"]) == 0
    printed = capsys.readouterr().out
    assert "== fp16:" in printed and "== kvarn plan 60% tail=128:" in printed
    with pytest.raises(SystemExit) as exc:
        cli.main(["plan", "--model", "teaching-llama", "--budget", "1.5"])
    assert exc.value.code == 2 and "outside (0, 1]" in capsys.readouterr().err


# -- the committed results (benchmarks/plan.py) ------------------------------------------------------------------

COMMITTED = ("gemma3-270m", "teaching-llama")


@pytest.mark.parametrize("model", COMMITTED)
def test_committed_plans_fit_their_uniform_widths_bytes(model):
    results = load_plan_results(model)
    assert {"kvarn:tail=128", "affine"} <= set(results)
    for spec, res in results.items():
        sens = res.sensitivity
        assert res.run["machine"]["tag"] == "cpu" and res.run["evaluation"]["windows"] == 6
        held = res.run["evaluation"]["names"]
        assert len(held) == 6 and not set(sens.calibration) & set(held)
        for chosen in res.plans:
            uniform = res.row(chosen.report["against"])
            assert chosen.report["bytes"] <= uniform.bytes + 1e-6, (spec, chosen.label)
            again = choose(sens, chosen.budget, chosen.report["tied"])
            assert again.widths == chosen.widths and again.label == chosen.label
        assert any(chosen.report["tied"] for chosen in res.plans) == (sens.names == ("k_bits", "v_bits"))
        for uniform, planned, chosen in res.pairs() + res.pairs(tied=True):
            assert planned.share <= uniform.share + 1e-9 and len(planned.per_passage["mean_kl"]) == 6
            assert planned.bytes == pytest.approx(chosen.report["bytes"])  # the formula the plan was chosen by


def test_no_sentence_names_a_winner_where_intervals_overlap():
    for model in COMMITTED:
        for res in load_plan_results(model).values():
            for said in res.comparisons():
                assert (said.winner is None) == said.a_value.overlaps(said.b_value)
                assert ("lower mean KL than" in said.sentence()) == (said.winner is not None)


def test_results_doc_shows_the_committed_plan_tables():
    readme = (Path(__file__).resolve().parents[1] / "docs" / "results.md").read_text()
    for model in COMMITTED:
        assert markdown_table(load_plan_results(model)) in readme, (
            f"docs/results.md: paste gmlx_lab.measure.planner.markdown_table(load_plan_results({model!r}))")
