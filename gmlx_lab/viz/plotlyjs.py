"""plotly.js once per notebook, in the output of the cell that imports the lab, never once per figure.

JupyterLab draws a figure from its `application/vnd.plotly.v1+json` output with the plotly.js it bundles
(offline). An HTML export (nbconvert, "Save and Export Notebook As... HTML") draws each figure from its
`text/html` output, which needs plotly.js defined earlier on the page. plotly's `notebook` renderer displays the
library before the first figure it draws; when that figure is inside a widget (a slider's output), the library
lands in the widget's output, which the saved notebook does not keep, and every later figure of the export is
blank. Here the library is displayed once, by `install`, in the cell that imports `gmlx_lab.viz`, and again
whenever that same cell is run again in the same kernel (its old output, the library with it, is then gone).
"""

from __future__ import annotations

from typing import Any

import plotly.io as pio
from plotly.io.base_renderers import NotebookRenderer

__all__ = ["RENDERER", "OnceRenderer", "install"]

RENDERER = "gmlx_notebook"


class OnceRenderer(NotebookRenderer):
    """plotly's offline notebook renderer (each figure's HTML uses the page's plotly.js) that leaves displaying
    plotly.js to `emit`: plotly's own first-figure activation would put it wherever that figure is drawn."""

    def activate(self) -> None:
        return None

    def emit(self) -> None:
        """Display plotly.js (and plotly's window config) as one HTML output of the running cell."""
        NotebookRenderer.activate(self)


def install(shell: Any) -> bool:
    """In a Jupyter kernel whose plotly renderer is the plain `plotly_mimetype`: draw figures as the mimetype
    (JupyterLab) plus HTML without the library, and display plotly.js now, once; return whether it did.

    A renderer you chose is kept, and outside a kernel (pytest, a script, a terminal IPython) nothing changes.
    """
    if shell is None or "IPKernelApp" not in shell.config or pio.renderers.default != "plotly_mimetype":
        return False
    renderer = OnceRenderer(connected=False)
    pio.renderers[RENDERER] = renderer
    pio.renderers.default = f"plotly_mimetype+{RENDERER}"
    renderer.emit()
    home: dict[str, str] = {}

    def after(result: Any) -> None:
        info = getattr(result, "info", None)
        key = (getattr(info, "cell_id", None) or getattr(info, "raw_cell", None) or "") if info else ""
        if "cell" not in home:
            home["cell"] = key  # the cell that imported the lab and holds plotly.js
        elif key and key == home["cell"]:
            renderer.emit()  # that cell ran again: its new output needs the library too

    shell.events.register("post_run_cell", after)
    return True
