"""Noise bands and verdicts: intervals, the comparison that names a winner, passages, banded fidelity, notebook 12."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import mlx.core as mx
import nbformat
import numpy as np
import pytest

from gmlx_lab.measure import passages
from gmlx_lab.measure.banded import VERDICT_SPECS, Row, banded_fidelity, split_head
from gmlx_lab.measure.intervals import STEP_SPREAD, WINNER_WORDS, Interval, bootstrap, compare, wilson
from gmlx_lab.measure.speed import Source, Speed, committed_speeds, read_source, speed_key
from gmlx_lab.measure.verdict import (
    BYTES_TIE,
    FP16_KL_FLOOR,
    KEEP_KL,
    KEEP_TOP1,
    VerdictResults,
    agreement,
    floor_evidence,
    floor_gap,
    keeps_model,
    load_verdict,
    markdown_table,
    recommend,
    recommendation_table,
    recommendations,
    standing,
    standing_cell,
)

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))

# -- intervals and the comparison ---------------------------------------------------------------------------


def test_bootstrap_brackets_the_mean_and_narrows_with_more_passages() -> None:
    rng = np.random.default_rng(1)
    few, many = rng.normal(1.0, 0.2, 8), rng.normal(1.0, 0.2, 64)
    a, b = bootstrap(few), bootstrap(many)
    assert a.low < few.mean() < a.high and a.n == 8 and "bootstrap" in a.method
    assert b.high - b.low < a.high - a.low
    assert bootstrap(few) == a  # seeded: a result file reads the same every time


def test_bootstrap_refuses_what_has_no_band() -> None:
    with pytest.raises(ValueError, match="at least 2"):
        bootstrap([0.1])
    with pytest.raises(ValueError, match="finite"):
        bootstrap([0.1, float("nan")])


def test_interval_must_hold_its_estimate() -> None:
    with pytest.raises(ValueError, match="low <= estimate <= high"):
        Interval(2.0, 0.0, 1.0, 8, "t")


def test_compare_names_a_winner_only_where_intervals_are_apart() -> None:
    apart = compare("A", Interval(0.01, 0.008, 0.012, 8, "b"), "B", Interval(0.05, 0.04, 0.06, 8, "b"))
    assert apart.winner == "A" and apart.distinguishable
    assert apart.sentence().startswith("A has lower mean KL than B: 0.01 [0.008, 0.012] against 0.05")
    close = compare("A", Interval(0.01, 0.008, 0.03, 8, "b"), "B", Interval(0.02, 0.015, 0.04, 8, "b"))
    assert close.winner is None and "indistinguishable at this sample" in close.sentence()
    higher = compare("A", Interval(0.9, 0.85, 0.95, 8, "b"), "B", Interval(0.5, 0.4, 0.6, 8, "b"), "top-1",
                     lower_is_better=False)
    assert higher.winner == "A" and "higher top-1" in higher.sentence()
    with pytest.raises(TypeError, match="noise band"):
        compare("A", 0.1, "B", Interval(0.2, 0.1, 0.3, 8, "b"))


def test_compare_names_no_winner_below_the_floor() -> None:
    a, b = Interval(2e-5, 1.8e-5, 2.2e-5, 8, "b"), Interval(3e-5, 2.8e-5, 3.2e-5, 8, "b")
    assert compare("A", a, "B", b).winner == "A"  # apart, and no floor given
    low = compare("A", a, "B", b, floor=1e-4)
    assert low.winner is None and low.below_floor and "both below 0.0001" in low.sentence()
    assert not WINNER_WORDS.search(low.sentence())
    above = compare("A", a, "B", Interval(0.02, 0.01, 0.03, 8, "b"), floor=1e-4)
    assert above.winner == "A" and not above.below_floor  # only both under the floor ties
    with pytest.raises(ValueError, match="floor"):
        compare("A", a, "B", b, floor=-1.0)


def test_wilson_counts() -> None:
    w = wilson(24, 24)
    assert w.estimate == 1.0 and w.low < 1.0 and w.high == 1.0 and "Wilson" in w.method


# -- passages --------------------------------------------------------------------------------------------------


class _Chars:
    """A tokenizer of characters (BOS 0 first), enough to cut windows."""

    bos_token_id = 0

    def encode(self, text: str) -> list[int]:
        return [0] + [ord(c) % 250 + 1 for c in text]


def test_passages_ship_and_windows_keep_to_held_out_text() -> None:
    for p in passages.PASSAGES:
        assert p.path.is_file() and len(p.text()) > 40_000, p.name
    w = passages.windows("teaching-llama", _Chars(), 5000, count=8)
    assert [x.passage for x in w] == ["macbeth"] * 4 + ["julius_caesar"] * 4  # its held-out plays only
    assert all(len(x.tokens) == 5000 and x.tokens[0] == 0 for x in w)
    assert w[1].start == 4999 and w[1].tokens[1:] == _Chars().encode(passages.PASSAGES[0].text())[5000:9999]
    other = passages.windows("gemma3-270m", _Chars(), 100, count=8)
    assert len({x.passage for x in other}) == 8
    with pytest.raises(ValueError, match="multiple of 2"):
        passages.windows("teaching-llama", _Chars(), 100, count=3)
    with pytest.raises(ValueError, match="need"):
        passages.windows("gemma3-270m", _Chars(), 60_000, count=8)


# -- banded fidelity -------------------------------------------------------------------------------------------


def test_split_head_gives_the_models_logits(model) -> None:
    body, head = split_head(model)
    x = mx.array([[1, 2, 3, 4]])
    assert mx.allclose(head(body(x)), model(x), atol=1e-4).item()


def test_banded_fidelity_rows_on_a_tiny_model(model) -> None:
    rows = banded_fidelity(model, _Chars(), "tiny", ["affine4", "affine8"], contexts=(40, 24), decode=6, count=8)
    assert [(r.context, r.spec) for r in rows] == [(24, "fp16"), (24, "affine4"), (24, "affine8"),
                                                    (40, "fp16"), (40, "affine4"), (40, "affine8")]
    fp16 = rows[0]
    assert fp16.per_passage["mean_kl"] == [0.0] * 8 and fp16.per_passage["top1"] == [1.0] * 8
    a4, a8 = rows[1], rows[2]
    assert all(len(v) == 8 for v in a4.per_passage.values())
    assert a4.interval("mean_kl").estimate > a8.interval("mean_kl").estimate > 0
    assert a4.share < a8.share < 1
    again = Row.from_dict(json.loads(json.dumps(a4.to_dict())))
    assert again.interval("mean_kl") == a4.interval("mean_kl") and again.share == a4.share


def test_banded_kl_matches_the_direct_formula(model) -> None:
    """banded_fidelity's KL, p . (z_ref - z) + lse(z) - lse(z_ref), equals sum p (log p - log q) computed plainly."""
    from gmlx_lab.measure import banded

    rng = np.random.default_rng(0)
    z_ref = rng.normal(0, 3, (2, 5, 50)).astype(np.float32)
    z = z_ref + rng.normal(0, 0.1, z_ref.shape).astype(np.float32)
    ref = banded.Reference(mx.array(z_ref))
    got = ref.metrics(mx.array(z), mx.zeros((2, 5), dtype=mx.int32))["mean_kl"]
    lp = z_ref - np.log(np.exp(z_ref).sum(-1, keepdims=True))
    lq = z - np.log(np.exp(z).sum(-1, keepdims=True))
    want = (np.exp(lp) * (lp - lq)).sum(-1).mean(-1)
    assert np.allclose(got, want, rtol=1e-4, atol=1e-7)


def test_banded_fidelity_checks_its_input(model) -> None:
    with pytest.raises(ValueError, match="contexts"):
        banded_fidelity(model, _Chars(), "tiny", ["affine4"], contexts=(), decode=4)
    with pytest.raises(ValueError, match="apart"):
        banded_fidelity(model, _Chars(), "tiny", ["affine4"], contexts=(16, 18), decode=4)
    with pytest.raises(ValueError, match="unknown scheme|not a registered|accepted"):
        banded_fidelity(model, _Chars(), "tiny", ["nosuch4"], contexts=(16,), decode=4)


def test_verdict_specs_cover_every_builtin_at_its_widths() -> None:
    from gmlx_lab.specs import read_scheme_spec

    read = [read_scheme_spec(s) for s in VERDICT_SPECS]
    schemes = {name for name, _ in read}
    assert schemes == {"affine", "affine_rot", "kvarn", "turboquant", "float", "kivi"}
    for name in schemes - {"float"}:
        assert sorted(o.get("bits") for n, o in read if n == name and o.get("kv_tail_tokens") in (None, 1024)) == [
            2, 3, 4, 8], name


# -- recommendations -------------------------------------------------------------------------------------------


def _row(spec: str, share: float, kl: list[float], scheme: str = "x", top1: float = 0.97) -> Row:
    n = len(kl)
    return Row(spec, spec, scheme, 1024, "3/18", share * 100, 100.0,
               {"mean_kl": kl, "median_kl": kl, "top1": [top1] * n, "nll": [3.0] * n})


def test_recommend_takes_the_fewest_bytes_of_the_rows_as_good_as_the_best() -> None:
    rows = [_row("fp16", 1.0, [0.0] * 8, "fp16"), _row("a8", 0.9, [1e-4] * 4 + [2e-4] * 4, "a"),
            _row("a4", 0.55, [0.005] * 4 + [0.009] * 4, "a"), _row("k4", 0.5, [0.002] * 4 + [0.003] * 4, "k"),
            _row("k3", 0.45, [0.0025] * 4 + [0.0035] * 4, "k"), _row("j3", 0.46, [0.0026] * 4 + [0.0036] * 4, "j")]
    results = VerdictResults("m", rows, [])
    rec = recommend(results, 0.6, 1024)
    # k4 has the lowest KL; k3 and j3 overlap it and store fewer bytes: the smallest, k3, is the buy
    assert rec.pick.spec == "k3" and {r.spec for r in rec.tied} == {"k4", "k3", "j3"}
    assert rec.runner_up.spec == "j3"  # the runner-up is another scheme's best
    assert rec.comparison.winner is None and "fewest bytes of the 3 rows" in rec.text()
    assert rec.cells()[-1][-1] == "overlap: fewest bytes of 3" and rec.cells()[-1][1] == "j3 (46%)"
    apart = recommend(results, 0.95, 1024)
    assert (apart.pick.spec, apart.runner_up.spec, apart.comparison.winner) == ("a8", "k4", "a8")
    assert apart.cells()[-1][-1] == "ahead"
    assert apart.text().startswith("Under 95% of fp16's bytes at 1K tokens: use a8")
    none = recommend(results, 0.4, 1024)
    assert none.pick is None and "no measured row fits" in none.text() and "45%" in none.text()
    assert standing(results, "k", 0.6, 1024).startswith("under 60% at 1K: k is the recommendation (k3")
    assert "a8 has lower mean KL than k4" in standing(results, "k", 0.95, 1024)
    assert standing(results, "a", 0.5, 1024) == "under 50% at 1K: no a row fits (its smallest share is 55%)"
    with pytest.raises(ValueError, match="no z rows"):
        standing(results, "z", 0.6, 1024)
    assert standing_cell(results, "k", 0.6, 1024).startswith("picked: k3")
    assert standing_cell(results, "k", 0.95, 1024) == "k4 behind a8 (intervals apart)"
    assert standing_cell(results, "a", 0.5, 1024) == "no row fits"
    alone = recommend(VerdictResults("m", rows[:3], []), 0.95, 1024)
    assert alone.runner_up is None and alone.cells() == [("95% at 1K", "a8 (90%)", *alone.cells()[0][2:5],
                                                          "the only one that keeps it")]
    table = recommendation_table(recommendations(results, (0.95, 0.6), [1024]))
    assert table.splitlines()[1].split()[:4] == ["95%", "at", "1K", "a8"]
    with pytest.raises(ValueError, match="share of fp16"):
        recommend(results, 1.5, 1024)
    partial = VerdictResults("m", rows + [_row("a4", 0.5, [0.01] * 8)], [])
    partial.rows[-1].context = 4096  # a run stopped after one scheme at 4096
    assert partial.contexts == [1024] and partial.incomplete == [4096]
    with pytest.raises(ValueError, match="no rows at context 4096"):
        partial.at(4096)


def test_a_row_beaten_by_another_is_never_the_pick_though_it_overlaps_the_leader() -> None:
    """Overlap is not transitive: a cheap row that overlaps the lowest-KL row but is apart from a third is out."""
    rows = [_row("fp16", 1.0, [0.0] * 8, "fp16"), _row("lead", 0.9, [0.001] * 4 + [0.005] * 4, "a"),
            _row("mid", 0.8, [0.0016] * 4 + [0.0034] * 4, "b"), _row("cheap", 0.5, [0.004] * 4 + [0.008] * 4, "c")]
    rec = recommend(VerdictResults("m", rows, []), 0.95, 1024)
    assert rec.pick.spec == "mid" and "cheap" not in {r.spec for r in rec.tied}


def test_a_row_under_the_quality_floor_is_never_recommended() -> None:
    rows = [_row("fp16", 1.0, [0.0] * 8, "fp16"), _row("a8", 0.9, [1e-4] * 8, "a"),
            _row("a2", 0.4, [0.4] * 4 + [0.5] * 4, "a", top1=0.6), _row("t4", 0.5, [0.004] * 8, "t", top1=0.9)]
    results = VerdictResults("m", rows, [])
    assert not keeps_model(rows[2]) and not keeps_model(rows[3])  # KL too high; top-1 too low
    rec = recommend(results, 0.6, 1024)
    assert rec.pick is None and rec.broken.spec == "t4" and rec.smallest_kept == 0.9
    assert rec.cells() == [(*rec.cells()[0][:5], "fits, but breaks: raise to 90%")] and rec.cells()[0][1] == "t4 (50%)"
    assert "Fits, but breaks: raise the budget to 90%" in rec.text()
    assert "fits, but breaks" in markdown_table(results, (0.6,))
    only = recommend(VerdictResults("m", rows[:1] + rows[2:], []), 0.6, 1024)
    assert only.raise_to == "only fp16 keeps the model at this context"


class _Speeds:
    """A stand-in SpeedTable: one setting, the given step bands in ms (baseline 10 ms)."""

    def __init__(self, bands: dict[str, tuple[float, float, float]]):
        self.bands = bands

    def _speed(self, label: str) -> Speed:
        if label not in self.bands:
            return Speed("GPU, batch 1", label, reason="not run")
        median, low, high = self.bands[label]
        return Speed("GPU, batch 1", label, label, Interval(median, low, high, 64, STEP_SPREAD), 10.0, "f.json")

    def of(self, label: str) -> list[Speed]:
        return [self._speed(label)]

    def first(self, label: str) -> Speed:
        return self._speed(label)

    def pair(self, a: str, b: str) -> tuple[Speed, Speed] | None:
        sa, sb = self._speed(a), self._speed(b)
        return (sa, sb) if sa.measured and sb.measured else None

    def faster(self, a: str, b: str) -> bool:
        found = self.pair(a, b)
        return found is not None and found[0].faster_than(found[1])


def test_speed_breaks_a_tie_of_bytes_and_names_the_faster_buy() -> None:
    rows = [_row("fp16", 1.0, [0.0] * 8, "fp16"), _row("k4", 0.500, [0.002] * 4 + [0.003] * 4, "k"),
            _row("q4", 0.495, [0.0021] * 4 + [0.0031] * 4, "q"), _row("f4", 0.6, [0.0022] * 4 + [0.0032] * 4, "f")]
    results = VerdictResults("m", rows, [])
    slow_q = _Speeds({"k4": (11, 10, 12), "q4": (50, 45, 55), "f4": (10, 9, 11)})
    rec = recommend(results, 0.7, 1024, slow_q)
    assert rec.pick.spec == "k4"  # within BYTES_TIE of q4's bytes, and its steps are apart from q4's, shorter
    assert rec.why == "the faster decode of 2 rows equally small"
    assert rec.speed(rec.pick).short() == "0.91x GPU b1"
    even = recommend(results, 0.7, 1024, _Speeds({"k4": (11, 10, 12), "q4": (11.5, 10, 13)}))
    assert even.pick.spec == "q4"  # bands overlap: no faster one, so the fewest bytes
    assert even.faster is None
    far = recommend(results, 0.7, 1024, _Speeds({"k4": (50, 45, 55), "q4": (50, 45, 55), "f4": (10, 9, 11)}))
    assert far.pick.spec == "q4" and far.faster.spec == "f4"
    assert "f4 is as good at this sample and decodes faster" in far.text() and "10 more points" in far.text()


def test_the_quality_floor_sits_in_the_gap_of_the_lab_s_own_evidence() -> None:
    """Below the floor every measured row retrieved passkeys as fp16 did; the first row that lost them lies above."""
    evidence = floor_evidence(load_verdict("gemma3-270m"))
    assert len(evidence) >= 20
    safe, lost = floor_gap(evidence)
    assert safe.row.interval("mean_kl").high < KEEP_KL < lost.row.interval("mean_kl").low
    assert lost.row.interval("top1").estimate < KEEP_TOP1 <= min(
        e.row.interval("top1").estimate for e in evidence if e.row.interval("mean_kl").estimate <= KEEP_KL)
    assert all(e.kept_retrieval for e in evidence if keeps_model(e.row))
    assert not lost.kept_retrieval and safe.kept_retrieval


def test_no_committed_recommendation_breaks_the_model_or_is_the_larger_of_two_alike() -> None:
    from gmlx_lab.measure.speed import committed_speeds

    speeds = committed_speeds()
    for model in ("smollm2-135m", "gemma3-270m", "teaching-llama"):
        results = load_verdict(model)
        for rec in recommendations(results, speeds=speeds):
            if rec.pick is None:
                continue
            assert keeps_model(rec.pick)
            alike = [r for r in rec.tied if r.share < rec.pick.share - BYTES_TIE]
            assert not alike, (model, rec.budget, rec.context, rec.pick.label, [r.label for r in alike])
            assert rec.speed(rec.pick).short()  # a speed, or "unmeasured"


def test_rows_below_the_kl_floor_are_alike_and_the_smaller_is_recommended() -> None:
    rows = [_row("fp16", 1.0, [0.0] * 8, "fp16"), _row("a8", 0.9, [2e-5] * 8, "a"),
            _row("k8", 0.8, [3e-5] * 4 + [3.2e-5] * 4, "k"), _row("k4", 0.7, [0.002] * 8, "k")]
    on_gpu = VerdictResults("m", rows, [{"machine": {"tag": "h200"}}])
    assert on_gpu.kl_floor == FP16_KL_FLOOR and VerdictResults("m", rows, [{"machine": {"tag": "cpu"}}]).kl_floor == 0
    rec = recommend(on_gpu, 0.95, 1024)
    assert (rec.pick.spec, rec.runner_up.spec) == ("k8", "a8")  # both under the floor: fewer bytes first
    assert rec.cells()[-1][-1].startswith("both < 1e-4") and rec.comparison.winner is None
    on_cpu = recommend(VerdictResults("m", rows, [{"machine": {"tag": "cpu"}}]), 0.95, 1024)
    assert (on_cpu.pick.spec, on_cpu.comparison.winner) == ("a8", "a8")  # float32: the small KL is read


def test_committed_machines_agree_above_the_floor_and_not_below() -> None:
    """FP16_KL_FLOOR is where the H200's fp16 rows stop tracking the CPU's float32 rows of the same cases."""
    pairs = agreement(load_verdict("gemma3-270m", "cpu"), load_verdict("gemma3-270m", "h200"))
    above, below = pairs.ratios(above=FP16_KL_FLOOR), pairs.ratios(below=FP16_KL_FLOOR)
    assert len(above) >= 40 and 0.7 < min(above) and max(above) < 1.5
    assert below and min(below) > 2  # fp16 arithmetic, not the scheme, sets these
    assert "pairs" in pairs.text(above=FP16_KL_FLOOR)


def test_load_verdict_reads_the_file_with_most_contexts() -> None:
    default = load_verdict("gemma3-270m")
    assert default.path.name == "verdict-gemma3-270m-h200.json" and default.machines == ["h200"]
    assert len(default.contexts) > len(load_verdict("gemma3-270m", "cpu").contexts)
    assert default.contexts[-1] >= 8192  # the sweep reaches 8K, inside the trained context


def test_committed_verdict_loads_with_intervals() -> None:
    results = load_verdict("gemma3-270m")
    assert results.passages >= 8 and len(results.contexts) >= 2
    assert all(r.context + 256 <= 32768 for r in results.rows)  # inside Gemma 3 270M's trained context
    for r in results.at(results.contexts[-1]):
        band = r.interval("mean_kl")
        assert band.low <= band.estimate <= band.high
    with pytest.raises(FileNotFoundError, match="benchmarks/verdict.py"):
        load_verdict("no-such-model")


def test_speeds_are_read_side_by_side_from_the_committed_files() -> None:
    assert speed_key("kvarn4 tail=128 ext") == "kvarn4" and speed_key("affine4 g64") == "affine4 g64"
    speeds = committed_speeds()
    gpu = speeds.of("kvarn4 tail=128")[0]
    assert gpu.measured and gpu.measured_as == "kvarn4 tail=1024" and "read from kvarn4 tail=1024" in gpu.text()
    assert 0 < gpu.ratio < 2 and gpu.step_ms.n >= 60
    kivi = speeds.first("kivi4 tail=128")  # the GPU at batch 1 measured KIVI (its fused kernel): read first
    assert kivi.tag == "GPU b1" and kivi.measured
    cpu = speeds.first("kivi8 tail=128")  # the GPU files have no 8-bit KIVI row: the CPU's is the first measured
    assert cpu.tag == "CPU b1" and cpu.measured
    lost = speeds.first("nosuch9")
    assert not lost.measured and lost.short() == "unmeasured" and "no row in" in lost.text()
    with pytest.raises(ValueError, match="KVCache"):
        read_source(Source("x", "model_decode-cpu.json", 12345))
    with pytest.raises(FileNotFoundError, match="model_decode"):
        read_source(Source("x", "nosuch.json", 1))


def test_a_setting_of_several_runs_reads_each_row_beside_its_own_baseline(tmp_path: Path) -> None:
    """A row the first file lacks is read from the next, its ratio taken to that file's own KVCache; rows of two
    files are never ranked against each other (`faster`)."""
    def run(name: str, base_ms: float, rows: dict[str, float]) -> None:
        made = [{"label": label, "context": 64, "decode_ms_median": ms, "decode_ms_p10": ms * 0.9,
                 "decode_ms_p90": ms * 1.1, "timed_tokens": 100} for label, ms in {"mlx-lm KVCache": base_ms,
                                                                                     **rows}.items()]
        (tmp_path / name).write_text(json.dumps({"commit": "abc1234", "device": "card", "rows": made}))

    run("a.json", 10.0, {"kvarn4 tail=1024": 8.0})
    run("b.json", 20.0, {"kivi4 tail=128": 10.0})
    table = read_source(Source("GPU, batch 1", "a.json", 64, more=("b.json",)), tmp_path)
    kvarn, kivi = table.of("kvarn4"), table.of("kivi4")
    assert (kvarn.file, kvarn.ratio) == ("a.json", 10.0 / 8.0) and (kivi.file, kivi.ratio) == ("b.json", 2.0)
    assert not kvarn.faster_than(kivi) and not kivi.faster_than(kvarn)
    missing = table.of("turboquant4")
    assert not missing.measured and "a.json, b.json" in missing.reason

# -- notebooks state a winner only through compare --------------------------------------------------------------

_CODE_SPAN = re.compile(r"`[^`]*`")


def _texts(cell: nbformat.NotebookNode) -> list[str]:
    """The prose a cell can show: a Markdown cell's text, or the string literals of a code cell."""
    if cell.cell_type == "markdown":
        return [_CODE_SPAN.sub("", cell.source)]
    try:
        tree = ast.parse(cell.source)
    except SyntaxError:
        return []
    return [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_names_no_winner_by_itself(path: Path) -> None:
    """A winner is named only by `intervals.compare` (which checks the intervals); no notebook text does it."""
    nb = nbformat.read(path, as_version=4)
    found = [f"cell {i}: ...{text[max(0, m.start() - 50):m.end() + 30]}..." for i, cell in enumerate(nb.cells)
             for text in _texts(cell) for m in WINNER_WORDS.finditer(text)]
    assert not found, "state a winner through gmlx_lab.measure.intervals.compare:\n" + "\n".join(found)


def test_cli_verdict_prints_the_table_and_refuses_bad_budgets(capsys: pytest.CaptureFixture) -> None:
    from gmlx_lab import cli

    assert cli.main(["verdict", "--budgets", "0.9,0.6"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split()[:2] == ["budget", "recommended,"] and "passages" in out
    assert cli.main(["verdict", "--json"]) == 0
    first = json.loads(capsys.readouterr().out)[0]
    assert first["budget"] == 0.9 and "text" in first and "speed" in first
    assert cli.main(["verdict", "--budgets", "most"]) == 2
    assert "--budgets takes shares" in capsys.readouterr().err
    assert cli.main(["verdict", "--model", "nosuch"]) == 1


def test_readme_and_results_doc_show_the_committed_verdict() -> None:
    """The README's five sentences and docs/results.md's tables are the committed results', so neither drifts;
    the README reaches its quick start on its first screen."""
    from gmlx_lab.measure.verdict import LEAD_MODEL, SECOND_BUDGETS, SECOND_MODEL, summary

    speeds = committed_speeds()
    readme = (ROOT / "README.md").read_text()
    sentences = summary(speeds)
    assert len(sentences) == 5
    for sentence in sentences:
        assert f"- {sentence}" in readme, "README: paste gmlx_lab.measure.verdict.summary's sentences"
    assert readme.splitlines().index("## Quick start") < 40
    doc = (ROOT / "docs" / "results.md").read_text()
    for table in (markdown_table(load_verdict(LEAD_MODEL), speeds=speeds),
                  markdown_table(load_verdict(SECOND_MODEL), SECOND_BUDGETS, speeds)):
        assert table in doc, "docs/results.md: paste gmlx_lab.measure.verdict.markdown_table's output"


def test_results_doc_speed_table_reads_the_committed_speed_files() -> None:
    """docs/results.md's speed table (rows beside fidelity) shows each row's speed as the committed files give it
    now (`SpeedTable.of`), so a newer speed file cannot leave an older ratio there."""
    doc = (ROOT / "docs" / "results.md").read_text()
    block = doc.split("<!-- speed table: gmlx_lab.measure.verdict.speed_rows -->")[1].split("<!-- end of speed")[0]
    rows = block.strip().splitlines()[2:]
    assert rows
    speeds = committed_speeds()
    for line in rows:
        label, *cells = [cell.strip() for cell in line.strip("|").split("|")]
        assert cells == [s.short() for s in speeds.of(label)], f"docs/results.md speed table, row {label}"


def test_verdict_benchmark_goes_on_where_a_run_stopped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--missing measures only the (context, spec) rows the file lacks, one context at a time."""
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import verdict as bench

    calls = []

    def fake(model, tokenizer, name, specs, contexts, decode, count, on_row):
        calls.append((list(specs), list(contexts)))
        for context in contexts:
            for spec in ["fp16", *specs]:
                row = _row(spec, 0.5, [0.01] * 8, "fp16" if spec == "fp16" else spec)
                row.context = context
                on_row(row)

    monkeypatch.setattr(bench, "RESULTS", tmp_path)
    monkeypatch.setattr(bench, "load_model", lambda name: (object(), object()))
    monkeypatch.setattr(bench, "banded_fidelity", fake)
    monkeypatch.setattr(bench, "machine_tag", lambda: "test")
    assert bench.main(["--model", "m", "--contexts", "512", "--schemes", "affine4"]) == 0
    assert bench.main(["--model", "m", "--contexts", "512,1024", "--schemes", "affine4,kvarn4", "--missing"]) == 0
    assert calls[1:] == [(["kvarn4"], [512]), (["affine4", "kvarn4"], [1024])]
    before = (tmp_path / "verdict-m-test.json").read_text()
    assert bench.main(["--model", "m", "--contexts", "512,1024", "--schemes", "affine4,kvarn4", "--missing"]) == 0
    assert (tmp_path / "verdict-m-test.json").read_text() == before  # nothing measured, nothing written
    assert len(json.loads(before)["runs"]) == 2


@pytest.mark.parametrize("model", [None, "smollm2-135m", "gemma3-270m"])
def test_recommend_answers_for_your_model(model: str | None, capsys: pytest.CaptureFixture) -> None:
    """`gmlx-lab recommend`: this model's bytes, the nearest measured fidelity, the recommendation or why there is
    none, and the plan command that measures it; the bundled model, SmolLM2 and Gemma alike."""
    from gmlx_lab import cli

    argv = ["recommend", "--context", "4096", "--budget", "50%", "--json"] + (["--model", model] if model else [])
    assert cli.main(argv) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["budget"] == 0.5 and answer["context"] == 4096 and "gmlx-lab plan --model" in answer["plan_command"]
    assert answer["evidence"] in {"teaching-llama", "smollm2-135m", "gemma3-270m"}
    for row in answer["fitting"]:
        assert float(row["% of fp16's bytes (yours)"]) <= 50 and row["keeps the model"] in ("yes", "no")
    if answer["recommended"]:
        assert "use " in answer["text"]
    with pytest.raises(SystemExit) as stop:
        cli.main(["recommend", "--budget", "1.5"])
    assert stop.value.code == 2 and "outside (0, 1]" in capsys.readouterr().err


def test_recommend_borrows_from_the_model_whose_policy_is_nearest() -> None:
    from gmlx_lab.measure.advice import nearest_evidence

    grows, windows = nearest_evidence(29 / 30, 8000), nearest_evidence(2 / 18, 1000)
    assert grows[0].model == "smollm2-135m" and windows[0].model == "gemma3-270m"
    assert windows[1] == 1024 and grows[1] in grows[0].contexts


def test_every_run_of_a_speed_setting_names_its_own_commit() -> None:
    """A setting read from several runs lists each run with the commit its file names, not the first run's."""
    for setting in committed_speeds().files:
        runs = setting.runs()
        assert [r.file for r in runs] == list(setting.source.files)
        for run in runs:
            named = json.loads((ROOT / "benchmarks" / "results" / run.file).read_text()).get("commit", "unknown")
            assert run.commit == str(named)[:7], run.file
