"""The book's running example (viz/example.py): one rule finds the layer, and pages 01-07 name it at the top."""

from pathlib import Path

import nbformat
import pytest

import gmlx_lab
from gmlx_lab import kv_inspect, viz

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
PAGES = sorted(p for p in NOTEBOOKS.glob("0[1-7]_*.ipynb"))


@pytest.fixture(scope="module")
def bundled() -> tuple:
    """The bundled model's running example, from one capture."""
    model, tokenizer = gmlx_lab.load(None)
    cap = kv_inspect.capture(model, kv_inspect.eval_tokens(tokenizer, viz.EXAMPLE_TOKENS))
    return model, tokenizer, cap


def test_the_pages_are_there() -> None:
    assert [p.name[:2] for p in PAGES] == ["01", "02", "03", "04", "05", "06", "07"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.stem)
def test_each_page_names_the_running_example_at_its_top(page: Path) -> None:
    top = nbformat.read(page, as_version=4).cells[0]
    assert top.cell_type == "markdown"
    assert "[Running example](13_glossary.ipynb#running-example)" in top.source
    assert "Gemma 3 270M" in top.source and "tokens 128-255" in top.source


def test_the_strongest_outlier_layer_of_the_bundled_model(bundled) -> None:
    cap = bundled[2]
    ex = viz.running_example(cap)
    ratios = {i: viz.outlier_ratio(cap.k(i, 0)) for i in cap.layers}
    assert ex.layer == max(ratios, key=ratios.get) and ex.outlier == ratios[ex.layer]
    assert (ex.head, ex.tile) == (0, (128, 256))
    assert (ex.k(cap) == cap.k(ex.layer, 0)[128:256]).all() and ex.k(cap).shape[0] == 128
    assert (ex.v(cap) == cap.v(ex.layer, 0)[128:256]).all()
    text = ex.banner()
    assert f"layer **{ex.layer}**" in text and "tokens 128-255" in text
    assert "the book follows gemma3-270m" in text  # not Gemma: the banner says the book's model is another


def test_what_a_policy_does_with_the_layer(bundled) -> None:
    model, _, cap = bundled
    ex = viz.running_example(cap)
    quantized = gmlx_lab.policy(model, "kvarn", bits=4)
    assert ex.fate(quantized) == f"Under {quantized.label}, the running example's layer {ex.layer} is stored as " \
                                 f"{quantized.label}."
    kept = gmlx_lab.policy(model, "kvarn", fp16_layers=[ex.layer])
    assert f"layer {ex.layer} stays fp16 (" in ex.fate(kept)


def test_a_capture_too_short_for_the_tile_is_refused(bundled) -> None:
    model, tokenizer, _ = bundled
    cap = kv_inspect.capture(model, kv_inspect.eval_tokens(tokenizer, 200))
    with pytest.raises(ValueError, match="at least 256 tokens, got 200"):
        viz.running_example(cap)


def test_gemma_is_the_example_and_its_layer_is_a_quantized_global_layer(gemma) -> None:
    cap = kv_inspect.capture(gemma["model"], kv_inspect.eval_tokens(gemma["tokenizer"], viz.EXAMPLE_TOKENS))
    ex = viz.running_example(cap)
    assert viz.example_model() == viz.EXAMPLE_MODEL == cap.model
    decision = gmlx_lab.policy(gemma["model"], "kvarn").layers[ex.layer]
    assert decision.kind == "attention" and decision.decision == "kvarn"
    assert "the book follows" not in ex.banner()
