"""Every page of the book asks the learner to predict before looking, folds its answer, and ends with a cell to edit."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

PAGES = sorted(p for p in (Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb")
               if not p.name.startswith("13_"))  # the glossary is a reference, not a lesson


def _cells(path: Path) -> list[tuple[str, str]]:
    return [(c["cell_type"], "".join(c["source"])) for c in json.loads(path.read_text())["cells"]]


def test_every_lesson_is_checked() -> None:
    assert len(PAGES) == 13


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.stem)
def test_a_prediction_with_its_answer_folded(page: Path) -> None:
    """A "Predict, then look" question, and after it an answer inside <details> (revealed on click)."""
    cells = _cells(page)
    asked = next((i for i, (kind, text) in enumerate(cells) if kind == "markdown" and "Predict, then look" in text),
                 None)
    assert asked is not None, f"{page.name}: no 'Predict, then look' question"
    answer = next((text for kind, text in cells[asked:] if kind == "markdown" and "<details>" in text
                   and "Answer" in text), None)
    assert answer is not None, f"{page.name}: the question's answer is not folded in <details> after it"
    assert "</details>" in answer and len(answer.split()) > 40  # an answer, not a placeholder


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.stem)
def test_a_your_turn_section_the_learner_edits(page: Path) -> None:
    """A "Your turn" section: a code cell to edit that names what to try, or (notebook 09, whose lesson is a class
    the learner edits) a list of edits as code."""
    cells = _cells(page)
    at = next((i for i, (kind, text) in enumerate(cells) if kind == "markdown" and "## Your turn" in text), None)
    assert at is not None, f"{page.name}: no '## Your turn' section"
    section = cells[at][1]
    nxt = cells[at + 1] if at + 1 < len(cells) else ("", "")
    edits_in_code = nxt[0] == "code" and nxt[1].startswith("# Your turn") and "try" in nxt[1]
    edits_listed = section.count("`") >= 6 and "- " in section
    assert edits_in_code or edits_listed, f"{page.name}: 'Your turn' needs a cell that says what to change ('# try')"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.stem)
def test_the_your_turn_has_a_worked_answer_computed_in_the_run(page: Path) -> None:
    """After the "Your turn" cell, an answer computed by the page's run (a code cell ending in `viz.answer(...)`,
    which folds it under "Answer"), its code hidden as the page's other prose cells are."""
    from gmlx_lab.book.site import source_hidden

    cells = json.loads(page.read_text())["cells"]
    at = next(i for i, c in enumerate(cells) if c["cell_type"] == "markdown" and "## Your turn" in "".join(c["source"]))
    def ends_in_answer(source: str) -> bool:
        last = ast.parse(source).body[-1]
        return isinstance(last, ast.Expr) and isinstance(last.value, ast.Call) and \
            ast.unparse(last.value.func) == "viz.answer"

    answers = [c for c in cells[at + 1:at + 3] if c["cell_type"] == "code" and ends_in_answer("".join(c["source"]))]
    assert answers, f"{page.name}: no worked answer (a code cell ending in viz.answer(...)) after 'Your turn'"
    assert source_hidden(answers[0]), f"{page.name}: hide the answer cell's code (metadata.jupyter.source_hidden)"


def test_an_answer_is_folded_under_its_summary() -> None:
    from gmlx_lab import viz

    text = viz.answer("first **paragraph**", "second").text
    assert text.startswith("<details><summary><b>Answer</b>") and text.endswith("</details>")
    assert "\n\nfirst **paragraph**\n\nsecond\n\n" in text  # blank lines: Markdown inside the HTML block renders
