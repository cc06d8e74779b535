"""The notebooks are committed clean: no outputs, no execution counts, no widget state, one title each.

The one exception: a cell marked `# NBVAL_CHECK_OUTPUT` (a verdict or key number) keeps its committed text output,
which `make test` compares with a fresh run under nbval (`pytest --nbval-lax`, see docs/notebooks.md).
"""

import json
import re
from pathlib import Path

import nbformat
import pytest
from conftest import occurrences

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))
CHECKED = "# NBVAL_CHECK_OUTPUT"


def test_the_notebooks_are_numbered() -> None:
    assert [p.name[:2] for p in NOTEBOOKS] == [f"{i:02d}" for i in range(14)]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_clean(path: Path) -> None:
    raw = json.loads(path.read_text(encoding="utf-8"))
    assert all("id" in cell for cell in raw["cells"]), f"{path.name}: a cell has no id (nbformat 4.5)"
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    assert "widgets" not in nb.metadata, "widget state saved in the notebook metadata"
    assert nb.cells[0].cell_type == "markdown" and nb.cells[0].source.startswith(f"# {path.name[:2]} ")
    for cell in nb.cells:
        if cell.cell_type == "code" and cell.source.startswith(CHECKED):
            assert cell.outputs and all(o.output_type == "stream" for o in cell.outputs), (
                f"{path.name}: a {CHECKED} cell keeps its committed text output, for nbval to compare")
            assert isinstance(cell.execution_count, int), "nbval compares only a cell that shows it ran"
        elif cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None, f"{path.name}: outputs not cleared"
            assert "plotly" not in cell.source or "renderers.default" not in cell.source, "keep plotly's renderer"


def test_plotlyjs_is_saved_once_in_the_importing_cell(tmp_path: Path) -> None:
    """An executed notebook holds plotly.js once (in the cell that imports the lab), not per figure and not inside
    the first widget that draws one; every figure's HTML (what an HTML export shows) uses that copy."""
    from nbclient import NotebookClient
    from plotly.offline import get_plotlyjs

    code = nbformat.v4.new_code_cell
    nb = nbformat.v4.new_notebook(cells=[
        code("import ipywidgets as W\nimport plotly.graph_objects as go\n\nfrom gmlx_lab import viz"),
        code("W.interactive(lambda n=1: go.Figure(go.Bar(y=[n])).show(), n=(1, 3))"),  # first figure: in a widget
        code("go.Figure(go.Bar(y=[1, 2]))"),
        code("go.Figure(go.Bar(y=[2, 1])).show()"),
    ])
    client = NotebookClient(nb, timeout=180, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}})
    with client.setup_kernel():
        for i, cell in enumerate(nb.cells):
            client.execute_cell(cell, i)
        client.execute_cell(nb.cells[0], 0)  # the importing cell again, in the same kernel: its new output
        client.execute_cell(nb.cells[2], 2)  # replaces the old one, library and all
        client.set_widgets_metadata()
    marker = get_plotlyjs()[:300]
    assert occurrences(nb, marker) == 1, "plotly.js must be saved exactly once"
    assert occurrences(nb.cells[0].outputs, marker) == 1
    for cell in nb.cells[2:]:
        (html,) = [o.data["text/html"] for o in cell.outputs if "text/html" in o.get("data", {})]
        assert "Plotly.newPlot" in html and marker not in html
        assert any("application/vnd.plotly.v1+json" in o.get("data", {}) for o in cell.outputs)  # JupyterLab's
    assert len(json.dumps(nb)) < len(json.dumps(get_plotlyjs())) + 100_000  # the library once; figures are small


def test_plotlyjs_changes_nothing_outside_a_kernel() -> None:
    import plotly.io as pio

    from gmlx_lab.viz import plotlyjs

    before = pio.renderers.default
    assert plotlyjs.install(None) is False and pio.renderers.default == before


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_cells_that_write_the_text_are_folded(path: Path) -> None:
    """A cell that only writes the page's text from measured values (its last statement `viz.say`, nothing else
    displayed) has its code folded: collapsed in JupyterLab, behind a <details> in the book."""
    from gmlx_lab.book.site import source_hidden, writes_prose

    nb = nbformat.read(path, as_version=4)
    shown = [c.id for c in nb.cells if c.cell_type == "code" and writes_prose(c.source) and not source_hidden(c)]
    assert shown == [], f"{path.name}: set metadata.jupyter.source_hidden on these prose cells"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_page_draws_an_idea_or_says_why_it_needs_none(path: Path) -> None:
    """A page calls one of the builders that draw an idea (`viz.DRAWN_IDEAS`), or a Markdown cell opens a sentence
    with `viz.NO_DIAGRAM` and gives the reason after it."""
    from gmlx_lab import viz

    cells = nbformat.read(path, as_version=4).cells
    code = "\n".join(c.source for c in cells if c.cell_type == "code")
    drawn = [name for name in viz.DRAWN_IDEAS if re.search(rf"\bviz\.{name}\(", code)]
    reasons = [c.source.split(viz.NO_DIAGRAM, 1)[1].strip() for c in cells
               if c.cell_type == "markdown" and viz.NO_DIAGRAM in c.source]
    assert drawn or any(len(r.split()) >= 8 for r in reasons), \
        f"{path.name} draws none of {viz.DRAWN_IDEAS} and gives no reason after {viz.NO_DIAGRAM!r}"
