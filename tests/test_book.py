"""The book's parts: the batch runner (`gmlx-lab book`), the static widgets, the pages.

The book `make test` builds is rendered from the notebooks JupyterLab saved in tests/test_browser.py (one run of
every notebook serves both checks); `test_book_site_renders` there opens each page in headless Chromium.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import nbformat
import pytest

from gmlx_lab import book
from gmlx_lab.book import run, site
from gmlx_lab.book import static_widgets as widgets


def test_widget_cell_does_not_wait_out_its_timeout(tmp_path: Path) -> None:
    """An `interactive` (an Output widget the kernel writes into) answers at once, not after the cell timeout.

    Plain nbclient 0.11 with ipykernel 7 receives this cell's reply only when its timeout runs out (see
    gmlx_lab/book/run.py); the timeout here is 60 s.
    """
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("import ipywidgets as W\n\ndef f(x=3):\n    print(x * 2)\n\n"
                                          "W.interactive(f, x=W.IntSlider(3))"),
                nbformat.v4.new_code_cell("print('after')")]
    path = tmp_path / "widget.ipynb"
    nbformat.write(nb, path)
    start = time.perf_counter()
    result = run.execute(path, timeout=60)
    assert time.perf_counter() - start < 30
    state = widgets.widget_state(result.nb)
    outputs = [m["state"]["outputs"] for m in state.values() if m["model_name"] == "OutputModel"]
    assert outputs and outputs[0][0]["text"] == "6\n"  # what the Output widget showed is in the saved state
    assert result.nb.cells[1].outputs[0]["text"] == "after\n"


def test_a_failing_cell_names_its_notebook(tmp_path: Path) -> None:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("1 / 0")]
    path = tmp_path / "broken.ipynb"
    nbformat.write(nb, path)
    with pytest.raises(run.NotebookFailed, match=r"broken.ipynb, cell 0: ZeroDivisionError: division by zero"):
        run.execute(path)


def _model(name: str, state: dict, module: str = "@jupyter-widgets/controls") -> dict:
    return {"model_name": name, "model_module": module, "model_module_version": "2.0.0", "state": state}


def test_static_widgets_draw_the_executed_state() -> None:
    figure = {"data": [{"type": "bar", "x": [1, 2], "y": [3, 4]}], "layout": {"title": {"text": "a bar"}}}
    state = {
        "box": _model("VBoxModel", {"children": ["IPY_MODEL_s", "IPY_MODEL_d", "IPY_MODEL_o", "IPY_MODEL_x"]}),
        "s": _model("IntSliderModel", {"value": 12, "min": 1, "max": 40, "step": 1, "description": "outlier"}),
        "d": _model("DropdownModel", {"_options_labels": ["fp16", "kvarn"], "index": 1, "description": "scheme"}),
        "o": _model("OutputModel", {"outputs": [{"output_type": "display_data",
                                                 "data": {site.PLOTLY: figure, "text/plain": "Figure"}}]},
                    "@jupyter-widgets/output"),
        "x": _model("SomethingNewModel", {}),
    }
    drawn = widgets.StaticWidgets(state, site.outputs_html).view("box")
    assert re.search(r'<input type="range" disabled min="1" max="40" step="1" value="12">', drawn)
    assert "<option selected>kvarn</option>" in drawn and "<option>fp16</option>" in drawn
    assert "plotly-graph-div" in drawn and '"a bar"' in drawn  # the Output's figure, drawn by plotly.js
    assert "SomethingNew (drawn only in a running notebook)" in drawn  # an unknown widget is named, not dropped
    assert "Interactive in a running notebook" in drawn  # the note that the controls need a kernel


def test_figure_widget_buffers_become_plotly_typed_arrays() -> None:
    """plotly's FigureWidget sends numpy arrays as binary buffers; the page gets plotly.js typed arrays."""
    import base64

    import numpy as np

    y = np.array([[1.0, 2.0], [3.0, 4.0]])
    model = _model("AnyModel", {"_widget_data": [{"type": "heatmap", "z": {"dtype": "float64", "shape": [2, 2]}}],
                                "_widget_layout": {}}, "anywidget")
    model["buffers"] = [{"path": ["_widget_data", 0, "z", "buffer"], "encoding": "base64",
                         "data": base64.b64encode(y.tobytes()).decode()}]
    drawn = widgets.StaticWidgets({"f": model}, site.outputs_html).draw("IPY_MODEL_f")
    assert '"dtype":"f8"' in drawn and '"shape":"2, 2"' in drawn
    assert base64.b64encode(y.tobytes()).decode() in drawn


def test_static_notebook_leaves_no_widget_state_and_no_plotly_json() -> None:
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("fig")
    cell.outputs = [nbformat.v4.new_output("display_data", data={site.PLOTLY: {"data": [], "layout": {}}})]
    from plotly.offline import get_plotlyjs

    library = nbformat.v4.new_code_cell("from gmlx_lab import viz")  # what JupyterLab's run saves (viz/plotlyjs.py)
    library.outputs = [nbformat.v4.new_output("display_data", data={"text/html": f"<script>{get_plotlyjs()}</script>"}),
                       nbformat.v4.new_output("stream", text="kept\n")]
    nb.cells = [library, cell]
    nb.metadata["widgets"] = {widgets.WIDGET_STATE: {"state": {}}}
    static = site.static_notebook(nb)
    assert "widgets" not in static.metadata and "widgets" in nb.metadata  # the executed notebook is not changed
    assert [o["output_type"] for o in static.cells[0].outputs] == ["stream"]  # the site loads plotly.js once
    assert len(nb.cells[0].outputs) == 2
    assert list(static.cells[1].outputs[0]["data"]) == ["text/html"]


def test_binder_links_name_the_notebook() -> None:
    assert site.binder_url("owner/gmlx_lab", "notebooks/04_sink_and_tail.ipynb") == (
        "https://mybinder.org/v2/gh/owner/gmlx_lab/HEAD?labpath=notebooks/04_sink_and_tail.ipynb")
    assert site.binder_url(None, "notebooks/") is None


def test_load_pages_refuses_a_notebook_it_did_not_execute(tmp_path: Path) -> None:
    nbformat.write(nbformat.v4.new_notebook(), tmp_path / "00_x.ipynb")
    with pytest.raises(ValueError, match="not executed by gmlx_lab.book"):
        book.load_pages(tmp_path, ["00_x.ipynb"])
    with pytest.raises(FileNotFoundError, match="01_y.ipynb not found"):
        book.load_pages(tmp_path, ["01_y.ipynb"])


def test_each_page_is_titled_by_its_notebook(tmp_path: Path) -> None:
    """The browser tab and history name the page ("03 · Records · gmlx_lab"), not nbconvert's "Notebook"."""
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# 03 · Records\n\nWhat a record holds.")])
    page = site.Page(tmp_path / "03_records.ipynb", nb, 1.0)
    (written,) = site.build_site([page], tmp_path / "site", None, "now", "here")
    assert "<title>03 · Records · gmlx_lab</title>" in written.read_text()


def test_the_index_summary_reads_links_as_their_words(tmp_path: Path) -> None:
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell(
        "# 04 · Sink\n\nThe [sink](13_glossary.ipynb#sink) and the **tail**, `fp16`.")])
    assert site.Page(tmp_path / "04_sink.ipynb", nb, 1.0).summary == "The sink and the tail, fp16."


def test_folded_code_sits_behind_details_in_the_book(tmp_path: Path) -> None:
    prose = nbformat.v4.new_code_cell("viz.say('a takeaway')", metadata={"jupyter": {"source_hidden": True}})
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# 05 · Policy"), prose,
                                         nbformat.v4.new_code_cell("figure()")])
    (written,) = site.build_site([site.Page(tmp_path / "05_policy.ipynb", nb, 1.0)], tmp_path / "site", None, "now",
                                 "here")
    text = written.read_text()
    folded, after = text.split('<details class="book-code">')[1].split("</details>", 1)
    assert text.count('<details class="book-code">') == 1 and "takeaway" in folded and ">figure<" in after
    assert site.writes_prose("x = 1\nviz.say(f'{x}')") and not site.writes_prose("display(fig)\nviz.say('x')")


def test_links_between_notebooks_go_to_their_pages() -> None:
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell(
        "A [record](13_glossary.ipynb#record), [the README](../README.md), `13_glossary.ipynb`.")])
    assert site.static_notebook(nb).cells[0].source == (
        "A [record](13_glossary.html#record), [the README](../README.md), `13_glossary.ipynb`.")


def test_every_glossary_link_names_a_term_there() -> None:
    """Each `13_glossary.ipynb#anchor` in the notebooks is a heading of the glossary (JupyterLab and nbconvert
    both make a heading's text its anchor)."""
    folder = Path(__file__).resolve().parents[1] / "notebooks"
    glossary = nbformat.read(folder / "13_glossary.ipynb", as_version=4)
    anchors = {line.lstrip("#").strip() for c in glossary.cells if c.cell_type == "markdown"
               for line in c.source.splitlines() if line.startswith("### ")}
    links = {(p.name, a) for p in folder.glob("*.ipynb") for c in nbformat.read(p, as_version=4).cells
             if c.cell_type == "markdown" for a in re.findall(r"13_glossary\.ipynb#([\w-]+)", c.source)}
    assert len(links) >= 10 and {a for _, a in links} <= anchors, sorted(a for _, a in links if a not in anchors)


def test_the_stamp_says_uncommitted_only_for_what_the_pages_are_made_from(tmp_path: Path) -> None:
    import subprocess

    def git(*args: str) -> None:
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    for name in ("notebooks/00_a.ipynb", "docs/images/shot.png"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("one")
    git("init", "-q")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "x", "--allow-empty")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "files")
    folder = tmp_path / "notebooks"
    assert book.commit_stamp(folder).startswith(" at commit ") and "uncommitted" not in book.commit_stamp(folder)
    (tmp_path / "docs/images/shot.png").write_text("two")  # a test's screenshot: not what a page is made from
    assert "uncommitted" not in book.commit_stamp(folder)
    (tmp_path / "notebooks/00_a.ipynb").write_text("two")
    assert book.commit_stamp(folder).endswith(" with uncommitted changes")


def test_the_book_does_not_show_nbval_s_marker() -> None:
    """A checked cell's marker line is for the tests: the page shows the code and its output without it."""
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("# NBVAL_CHECK_OUTPUT\nprint(1)")])
    assert site.static_notebook(nb).cells[0].source == "print(1)"
