"""The notebooks are committed clean: no outputs, no execution counts, no widget state, one title each.

Running them is nbval's job: `pytest --nbval-lax notebooks/` (see docs/notebooks.md).
"""

import json
from pathlib import Path

import nbformat
import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


def test_the_notebooks_are_numbered() -> None:
    assert [p.name[:2] for p in NOTEBOOKS] == [f"{i:02d}" for i in range(11)]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_clean(path: Path) -> None:
    raw = json.loads(path.read_text(encoding="utf-8"))
    assert all("id" in cell for cell in raw["cells"]), f"{path.name}: a cell has no id (nbformat 4.5)"
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    assert "widgets" not in nb.metadata, "widget state saved in the notebook metadata"
    assert nb.cells[0].cell_type == "markdown" and nb.cells[0].source.startswith(f"# {path.name[:2]} ")
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None, f"{path.name}: outputs not cleared"
            assert "plotly" not in cell.source or "renderers.default" not in cell.source, "keep plotly's renderer"
