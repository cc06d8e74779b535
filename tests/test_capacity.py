"""Batch and capacity: benchmarks/batch_capacity.py on a tiny model; gmlx_lab.measure.capacity on the committed runs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from gmlx_lab.measure import capacity
from gmlx_lab.measure.intervals import STEP_SPREAD, WINNER_WORDS

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import batch_capacity  # noqa: E402


def test_grid_points_are_batch_x_context() -> None:
    assert batch_capacity.parse_grid("1x8192, 16x512") == [(1, 8192), (16, 512)]
    for bad in ("8192", "0x512", "4x", "ax512"):
        with pytest.raises(ValueError, match="BATCHxCONTEXT"):
            batch_capacity.parse_grid(bad)


def test_a_tiny_run_fills_decodes_and_sizes_capacity_within_the_budget(tmp_path: Path) -> None:
    """Every row decodes; the capacity batch is the most that fits the budget at the bytes measured after
    decoding; a kvarn cache holds fewer bytes once its last fill chunk is sealed than right after the fill."""
    out = tmp_path / "bc.json"
    budget = 0.008  # one float32 fp16 sequence of the tiny shape on the CPU (5.2 MB), several kvarn4 ones
    assert batch_capacity.main(["--shape", "tiny", "--weights", "16", "--schemes", "mlx_lm_fp16,kvarn4:tail=128",
                                "--grid", "1x1024", "--capacity-schemes", "mlx_lm_fp16,kvarn4:tail=128",
                                "--capacity-context", "1024", "--budget-gb", str(budget), "--chunk", "512",
                                "--rounds", "2", "--per-round", "2", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert not [r for r in data["grid"] + data["capacity"] if "error" in r]
    grid = {r["scheme"]: r for r in data["grid"]}
    assert grid["kvarn4:tail=128"]["cache_bytes"] < grid["kvarn4:tail=128"]["cache_bytes_after_fill"]
    for r in data["capacity"]:
        per_sequence = grid[r["scheme"]]["cache_bytes"]
        assert r["batch"] == int(budget * 1e9 // per_sequence)
        assert r["timed_steps"] == 2 * 2
    held = {r["scheme"]: r["batch"] for r in data["capacity"]}
    assert held["kvarn4:tail=128"] > held["mlx_lm_fp16"]


def test_committed_capacity_rows_carry_their_band() -> None:
    rows = capacity.batch_rows("batch_capacity-w16-32k-h200.json")
    assert {r.scheme for r in rows} >= {"mlx_lm_fp16", "affine4", "kvarn4"}
    for r in rows:
        t = r.tokens_per_s
        assert r.step_ms.method == STEP_SPREAD and r.step_ms.n >= 20
        assert t.low <= t.estimate <= t.high
        assert t.estimate == pytest.approx(1e3 * r.batch / r.step_ms.estimate)
        assert r.cache_bytes <= r.budget_bytes
    kvarn = next(r for r in rows if r.scheme == "kvarn4")
    assert "rerun" in kvarn.note  # the file says why its batch is smaller than the budget allows
    with pytest.raises(ValueError, match="capacity' or 'grid"):
        capacity.batch_rows("batch_capacity-w16-32k-h200.json", part="both")


def test_throughput_is_named_only_where_bands_are_apart() -> None:
    rows = {r.scheme: r for r in capacity.batch_rows("batch_capacity-w16-32k-h200.json")}
    for row in rows.values():
        c = capacity.compare_throughput(rows["mlx_lm_fp16"], row)
        assert "10th-90th percentile ranges of 24 steps" in c.sentence()
        assert (c.winner is None) == c.a_value.overlaps(c.b_value)
        assert not WINNER_WORDS.search(c.sentence())
    table = capacity.markdown_table(list(rows.values()))
    assert table.count("\n") == len(rows) + 1 and "x 32K" in table


def test_results_doc_shows_the_committed_capacity_tables() -> None:
    readme = (Path(__file__).resolve().parents[1] / "docs" / "results.md").read_text()
    for name in ("batch_capacity-w16-128k-h200.json", "batch_capacity-w16-32k-h200.json",
                 "batch_capacity-w16-128k-h100-80gb-hbm3.json", "batch_capacity-w16-32k-h100-80gb-hbm3.json"):
        assert capacity.markdown_table(capacity.batch_rows(name)) in readme, (
            f"docs/results.md: paste gmlx_lab.measure.capacity.markdown_table(batch_rows({name!r}))")
