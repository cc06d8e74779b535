"""Beyond KL (gmlx_lab.measure.experiments): passkey retrieval, draft acceptance, KV on quantized weights.

Each measurement is checked on a case whose answer is known: a stub model that reads the key from its
own input (it must score 100%, and one that gets a digit wrong 0%), a real Gemma 3 270M run that
retrieves under fp16, a draft equal to the target (it must accept every token), and fp16 weights with
an fp16 cache (KL exactly 0) against every other pair (KL > 0).
"""

from __future__ import annotations

import json
import re

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import plotly.graph_objects as go
import pytest
from mlx_lm.models.cache import make_prompt_cache

import gmlx_lab
from gmlx_lab import cli, viz
from gmlx_lab.kv_inspect import eval_tokens
from gmlx_lab.measure.audit import audit
from gmlx_lab.measure.experiments import (
    PASSKEY_FORMAT,
    choose_policy,
    draft_acceptance,
    greedy_tokens,
    layer_skip_draft,
    needle_storage,
    parse_weight_bits,
    passkey,
    passkey_prompt,
    prefill,
    quantize_weights,
    speculative_run,
    stored_prefix,
    weights_and_kv,
)
from gmlx_lab.models import specimen
from gmlx_lab.policy import policy


class ByteTokenizer:
    """Token ids are the text's UTF-8 bytes (the specimens' vocabulary of 512 holds them); no BOS."""

    bos_token_id = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode(errors="replace")


class Oracle:
    """A stub whose answer is known: it reads the key from the tokens it was given and spells it out.

    It runs a real specimen on the same inputs (so the caches fill as for a real model) but answers
    from the text it has seen since the last empty cache: " KEY." after the question, or, when `wrong`,
    the key with its last digit changed.
    """

    def __init__(self, wrong: bool = False):
        self.base = specimen("llama")
        self.wrong = wrong
        self.seen: list[int] = []
        self.gmlx_name = "oracle"

    @property
    def layers(self) -> list[nn.Module]:
        return self.base.layers

    def __call__(self, inputs: mx.array, cache: list) -> mx.array:
        if cache[0].offset == 0:  # a new prompt
            self.seen = []
        self.base(inputs, cache=cache)  # fills the caches (a prefill evaluates them)
        self.seen += inputs[0].tolist()
        text = bytes(self.seen).decode()
        found = re.search(r"pass key is (\d+)", text)
        key = found.group(1) if found else "0"
        if self.wrong:
            key = key[:-1] + str((int(key[-1]) + 1) % 10)
        said = text.rsplit(PASSKEY_FORMAT.question, 1)[1] if PASSKEY_FORMAT.question in text else ""
        answer = f" {key}.\n"
        token = ord(answer[len(said)]) if len(said) < len(answer) else ord("\n")
        row = (mx.arange(512) == token).astype(mx.float32)
        return mx.broadcast_to(row, (1, inputs.shape[1], 512))


@pytest.fixture(scope="module")
def teaching() -> tuple[nn.Module, object]:
    return gmlx_lab.load()


# -- passkey ----------------------------------------------------------------------------------------


def test_passkey_prompt_places_the_needle() -> None:
    tok = ByteTokenizer()
    unit = len(PASSKEY_FORMAT.filler.encode())
    for depth in (0.0, 0.5, 1.0):
        prompt = passkey_prompt(tok, 900, depth, "31415")
        assert 900 - unit < prompt.length <= 900
        text = tok.decode(prompt.context)
        assert text.index("The pass key is 31415.") == prompt.needle_start
        assert text[prompt.key_start:].lstrip().startswith("31415")
        before, after = text[:prompt.needle_start], text[prompt.needle_start:]
        units_before, units_after = before.count(PASSKEY_FORMAT.filler), after.count(PASSKEY_FORMAT.filler)
        assert units_before == round(depth * (units_before + units_after))
        assert tok.decode(prompt.question) == PASSKEY_FORMAT.question
    with pytest.raises(ValueError, match="too short"):
        passkey_prompt(tok, 100, 0.5, "31415")
    with pytest.raises(ValueError, match="depth"):
        passkey_prompt(tok, 900, 1.5, "31415")


@pytest.mark.parametrize("share_prefill", [True, False])
def test_passkey_scores_a_stub_whose_answer_is_known(share_prefill: bool) -> None:
    schemes = ["fp16", "affine4", "kvarn4:tail=0"]
    right = passkey(Oracle(), ByteTokenizer(), schemes, lengths=[400, 500], depths=[0.5],
                    share_prefill=share_prefill)
    assert right.labels == ["fp16", "affine4 g64", "kvarn4 tail=0"]
    assert len(right.trials) == 3 * 2 * 1
    for label in right.labels:
        assert right.accuracy(label) == 1.0
        assert right.grid(label).shape == (1, 2) and np.all(right.grid(label) == 1.0)
    keys = {t.key for t in right.trials}
    assert len(keys) == 2 and all(len(k) == 5 for k in keys)  # one key per cell, the same for every scheme
    assert all(t.answer.startswith(f" {t.key}.") for t in right.trials)
    assert right.stored_in("fp16") == {"fp16": 2} and right.stored_in("affine4 g64") == {"quantized": 2}
    assert right.window is None and right.stored_in("kvarn4 tail=0") == {"records": 2}


def test_passkey_wants_the_whole_key() -> None:
    wrong = passkey(Oracle(wrong=True), ByteTokenizer(), ["fp16"], lengths=[400], depths=[0.5])
    (trial,) = wrong.trials
    assert trial.answer.startswith(f" {trial.key[:-1]}") and not trial.correct and wrong.accuracy("fp16") == 0.0


@pytest.mark.parametrize("tail", [0, 128, 1024])
def test_needle_storage_is_where_the_cache_holds_the_key(tail: int) -> None:
    model, tok = specimen("llama"), ByteTokenizer()
    prompt = passkey_prompt(tok, 700, 0.6, "27182")
    reference = policy(model, "fp16").make_cache()
    prefill(model, prompt.context, reference)
    chosen = policy(model, "kvarn", bits=4, kv_tail_tokens=tail)
    cache = stored_prefix(reference, chosen)
    model(mx.array([prompt.question]), cache=cache)  # the question arrives: what it reads is stored as now
    regions = cache[0].region_tokens()
    ends = np.cumsum([regions[r] for r in ("sink", "body", "live", "tail")])
    held = ("sink", "records", "live", "tail")[int(np.searchsorted(ends, prompt.key_start, side="right"))]
    assert needle_storage(chosen, prompt) == held
    assert held == {0: "records", 128: "records", 1024: "tail"}[tail]  # a 1024 tail covers this whole context


def test_stored_prefix_is_a_one_chunk_kvarn_prefill_and_leaves_the_reference_alone() -> None:
    model = specimen("gemma3")  # sliding-window layers (native caches, window 128) beside global ones
    ids = mx.random.randint(0, 512, (300,), key=mx.random.key(1)).tolist()
    question = [5, 6, 7, 8]
    reference = policy(model, "fp16").make_cache()
    prefill(model, ids, reference)
    before = [np.array(c.state[0]) for c in reference]
    chosen = policy(model, "kvarn", bits=4, kv_tail_tokens=0)
    shared = stored_prefix(reference, chosen)
    own = chosen.make_cache()
    prefill(model, ids, own)
    own.settle()
    assert shared[5].n_records == own[5].n_records == 1  # (300 - 128 sink) // 128
    a, b = model(mx.array([question]), cache=shared), model(mx.array([question]), cache=own)
    assert mx.allclose(a, b, atol=1e-5).item()
    assert all(np.array_equal(x, np.array(c.state[0])) for x, c in zip(before, reference))


def test_gemma_retrieves_a_passkey_under_fp16(gemma: dict) -> None:
    model, tok = gemma["model"], gemma["tokenizer"]
    result = passkey(model, tok, ["fp16"], lengths=[320], depths=[0.5], digits=4)
    (trial,) = result.trials
    assert trial.correct, trial.answer
    assert result.window == 512 and trial.distance < 512
    prompt = passkey_prompt(tok, 320, 0.5, trial.key)
    assert prompt.length == trial.tokens
    assert needle_storage(choose_policy(model, "kvarn4:tail=0"), prompt) == "records"  # the key sealed in a record


# -- draft acceptance -------------------------------------------------------------------------------


def test_layer_skip_draft_shares_the_weights_and_has_its_own_caches(teaching) -> None:
    model, _ = teaching
    draft = layer_skip_draft(model, 3)
    assert len(draft.layers) == 3 and len(model.layers) == 8 and model.gmlx_name == "teaching-llama"  # target unchanged
    assert draft.model.embed_tokens is model.model.embed_tokens and draft.layers[2] is model.layers[2]
    assert len(make_prompt_cache(draft)) == 3
    with pytest.raises(ValueError, match="between 1 and 8"):
        layer_skip_draft(model, 9)
    with pytest.raises(ValueError, match="cannot run on its first 3 layers"):
        layer_skip_draft(specimen("gemma3"), 3)  # Gemma 3 reads its mask from layer 5's cache


def test_a_draft_equal_to_the_target_accepts_everything(teaching) -> None:
    model, tok = teaching
    prompt = eval_tokens(tok, 200)
    result = draft_acceptance(model, tok, layer_skip_draft(model, 8), ["fp16"], [prompt], max_tokens=16,
                              num_draft_tokens=3)
    run = result["fp16"]
    assert (run.accepted, run.drafted, run.steps, run.tokens) == (12, 12, 4, 16)
    assert run.acceptance == 1.0 and run.tokens_per_step == 4.0
    plain = greedy_tokens(model, prompt, policy(model, "fp16").make_cache(), 16)
    assert run.texts[0] == tok.decode(plain)  # greedy speculative decoding changes nothing


def test_quantized_target_cache_and_fp16_draft_cache_stay_apart(teaching) -> None:
    model, tok = teaching
    draft = layer_skip_draft(model, 4)
    prompt = eval_tokens(tok, 300)
    target_cache, draft_cache = choose_policy(model, "kvarn4:tail=0").make_cache(), make_prompt_cache(draft)
    tokens, drafted, accepted, steps = speculative_run(model, draft, prompt, target_cache, draft_cache, 3, 12)
    assert len(tokens) == 12 and 0 <= accepted <= drafted and steps >= 12 / 4
    assert audit(target_cache).ok and target_cache[0].n_records == 1  # records sealed in the target only
    assert all(type(c).__name__ == "KVCache" for c in draft_cache)
    assert target_cache[0].offset == 300 + 12 - 1 and all(c.offset <= 300 + 12 for c in draft_cache)
    with pytest.raises(ValueError, match="must not share"):
        speculative_run(model, layer_skip_draft(model, 8), prompt, target_cache, target_cache, 3, 4)


# -- KV on quantized weights ------------------------------------------------------------------------


def test_weights_and_kv_is_zero_only_for_fp16_weights_with_an_fp16_cache() -> None:
    model = specimen("llama")
    tokens = mx.random.randint(0, 512, (280,), key=mx.random.key(2)).tolist()
    result = weights_and_kv(model, tokens, (None, 4), ["fp16", "kvarn4:tail=0"], prefill=270, decode=8)
    assert [(r["weights"], r["kv"]) for r in result.rows] == [
        ("fp16", "fp16"), ("fp16", "kvarn4 tail=0"), ("4-bit", "fp16"), ("4-bit", "kvarn4 tail=0")]
    reference = result.cell("fp16", "fp16")
    assert max(reference["decode_kl"]) == 0.0 and reference["top1"] == 1.0
    for r in result.rows[1:]:
        assert r["mean_kl"] > 0, r
    assert result.compounding("4-bit", "kvarn4 tail=0") > 0
    assert "fp16" in result.to_markdown()


def test_simulated_weight_quantization_is_nn_quantize() -> None:
    model = specimen("llama")
    weight = np.array(model.layers[0].self_attn.q_proj.weight)
    simulated, real = quantize_weights(model, 4), quantize_weights(model, 4, simulate=False)
    assert type(real.layers[0].self_attn.q_proj).__name__ == "QuantizedLinear"
    assert type(model.layers[0].self_attn.q_proj) is nn.Linear  # the original is untouched
    assert np.array_equal(weight, np.array(model.layers[0].self_attn.q_proj.weight))
    ids = mx.array([[1, 2, 3, 4, 5, 6]])
    a, b, ref = simulated(ids), real(ids), model(ids)
    assert mx.allclose(a, b, atol=1e-4).item() and not mx.allclose(a, ref, atol=1e-4).item()


# -- command line and figures -----------------------------------------------------------------------


def test_cli_passkey_draft_and_weights_kv(capsys) -> None:
    assert cli.main(["passkey", "--model", "teaching-llama", "--lengths", "200", "--depths", "0.5", "--schemes",
                     "fp16,kvarn4:tail=0", "--json", "--quiet"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["labels"] == ["fp16", "kvarn4 tail=0"] and len(data["trials"]) == 2
    assert cli.main(["draft", "--model", "teaching-llama", "--draft-layers", "8", "--prompts", "1",
                     "--prompt-tokens", "100", "--max-tokens", "8", "--schemes", "fp16", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["runs"][0]["acceptance"] == 1.0
    assert cli.main(["weights-kv", "--model", "llama", "--weight-bits", "fp16,8", "--schemes", "fp16",
                     "--prefill", "100", "--decode", "4", "--json", "--quiet"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [r["weights"] for r in rows] == ["fp16", "8-bit"] and rows[0]["median_kl"] == 0.0
    assert cli.main(["passkey", "--depths", "half"]) == 2
    assert capsys.readouterr().err.strip() == "gmlx-lab: error: cannot read 'half' in 'half' as float"


def test_figures_draw_live_and_stored_results(teaching) -> None:
    stub = passkey(Oracle(), ByteTokenizer(), ["fp16", "kvarn4:tail=0"], lengths=[400, 450], depths=[0.3, 0.7])
    model, tok = teaching
    draft = draft_acceptance(model, tok, layer_skip_draft(model, 8), ["fp16", "affine4"], [eval_tokens(tok, 100)],
                             max_tokens=4)
    weights = weights_and_kv(specimen("llama"), list(range(1, 130)), (None, 8), ["fp16", "affine8"], prefill=120,
                             decode=4)
    for result, build, traces in ((stub, viz.passkey_heatmaps, 2), (draft, viz.draft_figure, 2),
                                  (weights, viz.weights_kv_figure, 1)):
        for data in (result, json.loads(json.dumps(result.to_dict()))):
            fig = build(data)
            assert isinstance(fig, go.Figure) and len(fig.data) == traces
    heat = viz.passkey_heatmaps(stub)
    assert heat.data[0].z.shape == (2, 2) and "baseline" in heat.layout.annotations[0].text
    assert len(viz.weights_kv_positions(weights, "8-bit").data) == 2


def test_weight_widths_are_read_and_bad_ones_refused():
    assert parse_weight_bits("fp16, 8,4") == [None, 8, 4]
    for bad in ("7", "four", "fp8"):
        with pytest.raises(ValueError, match="accepted: fp16 or one of 2, 3, 4, 5, 6, 8"):
            parse_weight_bits(bad)
    with pytest.raises(ValueError, match="weight bits=7 is not accepted"):
        quantize_weights(nn.Linear(64, 64), 7)


def test_committed_passkey_counts_and_a_heatmap_that_fits() -> None:
    """Notebook 10 states counts from the committed run (recall_counts), and its heatmaps wrap at four a row, so
    seven schemes fit a notebook's width."""
    from gmlx_lab.measure.experiments import recall_counts

    section = viz.benchmark_results("beyond-kl-gemma3-270m-cpu.json")["beyond-kl-gemma3-270m-cpu.json"]
    data = section["sections"]["passkey"]["result"]
    counts = recall_counts(data)
    assert list(counts) == data["labels"] and counts["fp16"][1] == len(data["lengths"]) * len(data["depths"])
    for label, (hits, asked) in counts.items():
        assert hits / asked == pytest.approx(data["accuracy"][label])
    heat = viz.passkey_heatmaps(data)
    assert len(data["labels"]) > 4 and heat.layout.width is None  # it takes the notebook's width
    assert {t.xaxis for t in heat.data} == {f"x{i}" if i > 1 else "x" for i in range(1, len(data["labels"]) + 1)}
    assert max(int(t.yaxis[1:] or 1) for t in heat.data) == len(data["labels"])  # one axis per panel
    assert heat.layout.xaxis5.domain[0] == heat.layout.xaxis.domain[0]  # the fifth scheme starts the second row
    assert viz.figure_problems(heat) == []
    with pytest.raises(ValueError, match="not a passkey result"):
        recall_counts({"labels": []})


def test_draft_app_opens_on_the_target_itself(teaching) -> None:
    """The draft app's default shows the takeaway: with all layers the draft is the target with an fp16 cache, so
    fp16 accepts every draft and a 2-bit affine target cache fewer; its sentence says so from the run."""
    from gmlx_lab import widgets

    model, tok = teaching
    app = widgets.draft_app(model, tok, context=128, max_tokens=12)
    assert app.layers.value == len(model.layers) and app.picker.spec == "affine2"
    fp16, affine = app.result.runs
    assert fp16.acceptance == 1.0 and affine.acceptance < 1.0
    sentence = widgets.experiments.draft_sentence(app.result, app.layers.value, len(model.layers))
    assert sentence.startswith("affine2 g64 accepted fewer drafted tokens than fp16") and "doing" in sentence
    assert "ran in" in app.status.value
    short = widgets.experiments.draft_sentence(app.result, 4, len(model.layers))
    assert "4-layer draft" in short
