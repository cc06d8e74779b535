"""The field side by side (gmlx_lab.measure.field, benchmarks/field.py): the plan, one piece run small, the rows."""

from __future__ import annotations

import numpy as np
import pytest

from gmlx_lab import viz
from gmlx_lab.measure import field
from gmlx_lab.measure.tradeoff import versus
from gmlx_lab.models import specimen
from gmlx_lab.registry import SCHEMES
from gmlx_lab.viz.field_figures import place_labels


def test_the_plan_covers_every_registered_scheme_and_case() -> None:
    pieces, missing = field.pieces()
    assert missing == [], "every spec of FIELD_SPECS names a registered scheme"
    names = [p.name for p in pieces]
    assert len(names) == len(set(names))
    families = {p.family for p in pieces}
    assert families <= set(SCHEMES)
    assert {"fp16", "affine", "affine_rot", "kvarn", "turboquant", "float", "kivi"} <= families
    assert {(c.model, c.policy, c.length) for c in field.CASES} >= {
        ("teaching-llama", "default", 1024), ("teaching-llama", "default", 4096), ("gemma3-270m", "all", 4096)}
    assert len(field.PASSKEY_DEPTHS) * field.PASSKEY_KEYS >= 48
    assert sum(len(p.specs) for p in pieces if p.case == field.CASES[0] and p.kind == "fidelity") == len(
        field.FIELD_SPECS)


def test_a_spec_no_scheme_reads_is_listed_not_run() -> None:
    pieces, missing = field.pieces(["fp16", "nosuchscheme4"], field.CASES[:1], ["fidelity"])
    assert missing == ["nosuchscheme4"] and [p.family for p in pieces] == ["fp16"]


def test_one_fidelity_piece_on_a_specimen() -> None:
    model = specimen("llama")
    case = field.Case("llama", "default", field.DECODE + 128)
    piece = field.Piece(case, "fidelity", "affine", ("affine4", "affine2"))
    tokens = np.random.default_rng(0).integers(0, 200, case.length + 1).tolist()
    body = field.run_piece(piece, model, None, tokens)
    rows = {r["spec"]: r for r in body["rows"]}
    assert set(rows) == {"affine4", "affine2"}
    assert rows["affine2"]["bytes_per_token"] < rows["affine4"]["bytes_per_token"] < rows["affine4"][
        "fp16_bytes_per_token"]
    assert rows["affine2"]["decode_median_kl"] > rows["affine4"]["decode_median_kl"] > 0
    assert body["result"]["decode"] == field.DECODE and body["result"]["prefill"] == 128


def _row(spec: str, label: str, scheme: str, share: float, kl: float, machine: str = "cpu") -> dict:
    return {"model": "m", "policy": "default", "length": 4096, "kind": "fidelity", "machine": machine, "spec": spec,
            "label": label, "scheme": scheme, "bytes_per_token": 4096 * share, "fp16_bytes_per_token": 4096.0,
            "decode_median_kl": kl, "top1": 1.0}


def test_case_rows_keep_one_machine_and_the_plan_order() -> None:
    rows = [_row("kvarn4", "kvarn4 tail=1024", "kvarn", 0.56, 1e-3), _row("fp16", "fp16", "fp16", 1, 0),
            _row("fp16", "fp16", "fp16", 1, 0, machine="h200")]
    chosen = field.case_rows(rows, "m", "default", 4096, "fidelity")
    assert [r["spec"] for r in chosen] == ["fp16", "kvarn4"] and {r["machine"] for r in chosen} == {"cpu"}
    assert field.case_rows(rows, "m", "all", 4096, "fidelity") == []


def test_matchups_pair_equal_memory_only() -> None:
    rows = [_row("kvarn2:tail=128", "kvarn2 tail=128", "kvarn", 0.30, 4e-3),
            _row("kivi2", "kivi2 tail=128", "kivi", 0.31, 2e-3),
            _row("mxfp8", "mxfp8", "float", 0.58, 1e-4),
            _row("kvarn4", "kvarn4 tail=1024", "kvarn", 0.56, 0.0)]  # KL 0: never paired
    pairs = field.matchups(field.field_points(rows), "kvarn", within=0.05)
    assert [(a.label, b.label) for a, b in pairs] == [("kvarn2 tail=128", "kivi2 tail=128")]
    assert "beside kivi2 tail=128" in versus(*pairs[0]) and versus(*pairs[0]).endswith("KL ratio 2")


def test_an_unknown_kind_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown kind"):
        field.run_piece(field.Piece(field.CASES[0], "speed", "fp16", ("fp16",)), specimen("llama"), None, [1, 2])


def test_a_shared_prefill_is_refused_where_a_rolling_window_dropped_tokens() -> None:
    """Gemma-like layers with a 128-token window, prefilled in two chunks: the fp16 rolling window holds fewer tokens
    than it has seen, so storing its K/V as one update would misplace them; stored_prefix says so, and the field
    prefills through each scheme's own cache in such a case."""
    from gmlx_lab.measure.experiments import prefill, stored_prefix
    from gmlx_lab.policy import policy

    model = specimen("gemma3")
    reference = policy(model, "fp16").make_cache()
    prefill(model, list(range(1, 301)), reference, step=150)
    with pytest.raises(ValueError, match="share_prefill=False"):
        stored_prefix(reference, policy(model, "affine", bits=4, **field.POLICIES["all"]))
    assert not field.shares_prefill(field.Case("gemma3-270m", "all", 4096))
    assert field.shares_prefill(field.Case("gemma3-270m", "all", 1024))
    assert field.shares_prefill(field.Case("gemma3-270m", "default", 4096))


def test_crowded_labels_move_onto_arrows_and_free_ones_stay_beside() -> None:
    crowded = [(50.0, 1e-2, "affine4 g64"), (50.2, 1.05e-2, "affine_rot4 g64"), (50.1, 0.98e-2, "mxfp4")]
    places = place_labels(crowded, [0, 108])
    assert places[2] is None  # the lowest KL is placed first, beside its marker
    assert places[0] is not None and places[1] is not None and places[0] != places[1]  # the others on arrows
    apart = [(10.0, 1e-3, "kvarn4 tail=128"), (80.0, 1e-1, "affine2 g64")]
    assert place_labels(apart, [0, 108]) == {0: None, 1: None}
    rows = field.field_rows(viz.benchmark_results("field-h200.json"))
    fig = viz.field_kl_figure(field.case_rows(rows, "gemma3-270m", "default", 4096, "fidelity"))
    labels = [text for t in fig.data for text in t.text]
    arrows = [a for a in fig.layout.annotations if a.showarrow]
    assert 0 < sum(bool(x) for x in labels) < len(labels)  # some labels beside their points
    assert arrows and sum(bool(x) for x in labels) + len(arrows) <= len(labels)  # the others on arrows or hover
    assert fig.layout.showlegend and len(fig.data) == len({r["scheme"] for r in field.case_rows(
        rows, "gemma3-270m", "default", 4096, "fidelity") if r["scheme"] != "fp16"})  # one legend entry a scheme


def test_rows_at_one_place_get_one_name() -> None:
    from gmlx_lab.viz.field_figures import joined_label

    assert joined_label(["kvarn2 tail=1024", "kvarn4 tail=1024", "kvarn6 tail=1024"]) == "kvarn2/4/6 tail=1024"
    assert joined_label(["mxfp4", "nvfp4"]) == "mxfp4, nvfp4"  # not only the width differs
    assert joined_label(["kvarn4 tail=128"]) == "kvarn4 tail=128"
