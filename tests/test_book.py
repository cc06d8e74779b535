"""The book: every notebook runs without error (the run the book renders), and the site shows every figure.

One execution serves both: each `test_notebook_runs` saves its executed notebook in build/book/executed/, and
`test_book_site_renders` builds build/book/ from those files and opens each page in headless Chromium over a
localhost server: every plotly figure drawn by the bundled plotly.js, no script error, no request outside
localhost, the run box on every page. (CI ran the notebooks with `pytest --nbval-lax` before; this replaces
that run rather than adding one.) The browser part needs Debian's chromium and the playwright package, as
tests/test_browser.py does.
"""

from __future__ import annotations

import functools
import http.server
import os
import re
import threading
import time
from pathlib import Path

import nbformat
import pytest

from gmlx_lab import book
from gmlx_lab.book import run, site, widgets

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
OUT = ROOT / "build" / "book"
EXECUTED = OUT / "executed"
CHROMIUM = Path(os.environ.get("GMLX_CHROMIUM", "/usr/bin/chromium"))
ran_here: set[str] = set()  # notebooks executed by this test session (older files in EXECUTED may be stale)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path: Path) -> None:
    """Every cell runs without raising, as `pytest --nbval-lax` checked; the executed copy is kept for the book."""
    result = book.execute_to(path, EXECUTED)  # raises NotebookFailed, naming the cell, on the first error
    ran_here.add(path.name)
    code = [c for c in result.nb.cells if c.cell_type == "code"]
    assert [c.execution_count for c in code] == list(range(1, len(code) + 1))  # every cell ran, in order
    assert (EXECUTED / path.name).is_file()


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
    nb.cells = [cell]
    nb.metadata["widgets"] = {widgets.WIDGET_STATE: {"state": {}}}
    static = site.static_notebook(nb)
    assert "widgets" not in static.metadata and "widgets" in nb.metadata  # the executed notebook is not changed
    assert list(static.cells[0].outputs[0]["data"]) == ["text/html"]


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


def _require_browser() -> None:
    missing = [] if CHROMIUM.exists() else [f"chromium ({CHROMIUM})"]
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        missing.append("the playwright Python package")
    if missing:
        message = (f"the book's browser test needs {' and '.join(missing)}: `bash tools/system_deps.sh`, "
                   "`pip install -e .[test]`")
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    """Serves the site's files without a log line per request."""

    def log_message(self, *args) -> None:
        pass


@pytest.fixture()
def served_book():
    """The book built from this session's executed notebooks, served on a free localhost port."""
    _require_browser()
    for path in NOTEBOOKS:
        if path.name not in ran_here:  # this test alone: run what the parametrized test did not
            book.execute_to(path, EXECUTED)
            ran_here.add(path.name)
    pages = book.build(ROOT / "notebooks", OUT, executed=EXECUTED, repo="gmlx/gmlx_lab")
    handler = functools.partial(QuietHandler, directory=str(OUT))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", pages
    finally:
        server.shutdown()
        server.server_close()


def _hover_label(page) -> bool:
    """Move the mouse across the first figure until plotly shows a hover label (it is live, not a picture)."""
    plot = page.locator(".js-plotly-plot").first
    plot.scroll_into_view_if_needed()
    box = plot.locator(".nsewdrag").first.bounding_box()
    for i in range(1, 20):
        page.mouse.move(box["x"] + box["width"] * i / 20, box["y"] + box["height"] / 2)
        page.wait_for_timeout(100)
        if page.locator(".hoverlayer .hovertext").count():
            return True
    return False


def test_book_site_renders(served_book, monkeypatch) -> None:
    """Every page: its plotly figures drawn (live: each has its mode bar, and one shows a hover label), no script
    error, nothing fetched from outside localhost, the run box with Binder and the two local commands; and the
    index links them all."""
    from playwright.sync_api import sync_playwright

    base, pages = served_book
    monkeypatch.delenv("LD_PRELOAD", raising=False)  # OpenBLAS preloaded by make test breaks chromium's threads
    outside, errors, hovered = [], [], False
    shots = OUT / "screenshots"
    shots.mkdir(exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), headless=True)
        page = browser.new_page(viewport={"width": 1300, "height": 1600})

        def guard(route) -> None:
            if route.request.url.startswith((base, "data:", "blob:")):
                route.continue_()
            else:
                outside.append(route.request.url)
                route.abort()

        page.route("**/*", guard)
        page.on("pageerror", lambda exc: errors.append(f"{page.url}: {exc}"))
        page.goto(f"{base}/index.html")
        links = page.locator("table a").evaluate_all("links => links.map(a => a.getAttribute('href'))")
        assert links == [p.name for p in pages]
        for target in pages:
            figures = target.read_text(encoding="utf-8").count('class="plotly-graph-div"')
            page.goto(f"{base}/{target.name}")
            page.wait_for_function(
                "n => document.querySelectorAll('.plotly-graph-div').length === n && "
                "[...document.querySelectorAll('.plotly-graph-div')].every(d => d._fullLayout)",
                arg=figures, timeout=60_000)
            assert page.locator(".js-plotly-plot .main-svg").count() >= figures, target.name
            assert page.locator(".modebar-container").count() == figures, target.name  # zoom/pan: live figures
            run_box = page.locator(".book-run").inner_text()
            assert "make lab" in run_box and "make test" in run_box and "Binder" in run_box, target.name
            binder = page.locator("a.book-binder").get_attribute("href")
            assert binder.endswith(f"labpath=notebooks/{target.with_suffix('.ipynb').name}")
            page.screenshot(path=str(shots / target.with_suffix(".png").name))
            if figures and not hovered:
                hovered = _hover_label(page)
        browser.close()
    assert hovered, "no figure showed a hover label"
    assert not errors, errors[:5]
    assert not outside, f"the book tried to reach outside localhost: {outside[:5]}"
