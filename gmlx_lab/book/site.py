"""The book's pages: each executed notebook through nbconvert's JupyterLab template, plus an index.

Every page loads only files of the site itself: plotly.js is copied from the plotly package (`plotly.min.js`,
once for the whole site), each plotly figure is drawn from its JSON output by `Plotly.newPlot` (live: hover,
zoom), and widgets are drawn statically from their saved state (`gmlx_lab.book.static_widgets`).
"""

from __future__ import annotations

import ast
import copy
import functools
import html
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nbformat

from .static_widgets import WIDGET_VIEW, StaticWidgets, widget_state

PLOTLY = "application/vnd.plotly.v1+json"
TEMPLATES = Path(__file__).resolve().parent / "templates"
BINDER = "https://mybinder.org/v2/gh/{repo}/HEAD?labpath={path}"


@dataclass
class Page:
    """One notebook's page: its file, title, one-line summary and run time in this build."""

    path: Path
    nb: nbformat.NotebookNode
    seconds: float

    @property
    def href(self) -> str:
        return self.path.with_suffix(".html").name

    @property
    def number(self) -> str:
        return self.path.name[:2]

    @property
    def title(self) -> str:
        """The notebook's `# NN · Title` heading without its number."""
        first = self.nb.cells[0].source.splitlines()[0] if self.nb.cells else self.path.stem
        title = re.sub(r"^#\s*\d+\s*[·.:-]?\s*", "", first)
        return re.sub(r"[*`]", "", title).strip() or self.path.stem

    @property
    def summary(self) -> str:
        """The first paragraph under the title, as plain text (links as their words)."""
        paragraphs = self.nb.cells[0].source.split("\n\n")[1:] if self.nb.cells else []
        text = " ".join(paragraphs[0].split()) if paragraphs else ""
        text = re.sub(r"\[([^\]]+)\]\([^)]*\)", r"\1", text)  # a link reads as its words in the index
        return re.sub(r"[*`]", "", text)


def writes_prose(source: str) -> bool:
    """A code cell whose last statement is `viz.say(...)` or `viz.answer(...)` and which displays nothing else: it
    writes the page's text from measured values, so its code is folded (JupyterLab's `source_hidden`, a <details>
    in the book)."""
    try:
        body = ast.parse(source).body
    except SyntaxError:
        return False
    last = body[-1] if body else None
    return (isinstance(last, ast.Expr) and isinstance(last.value, ast.Call)
            and ast.unparse(last.value.func) in ("viz.say", "viz.answer") and "display(" not in source)


def source_hidden(cell: dict[str, Any]) -> bool:
    return bool(cell.get("metadata", {}).get("jupyter", {}).get("source_hidden"))


def plotly_html(figure: dict[str, Any]) -> str:
    """A plotly figure's JSON output as a div drawn by the page's plotly.js (no plotly.js inside); a figure with
    slider frames opens on its slider's step instead of playing through them."""
    import plotly.io as pio

    height = figure.get("layout", {}).get("height")
    return pio.to_html(figure, include_plotlyjs=False, full_html=False, validate=False, auto_play=False,
                       default_height=f"{height}px" if height else "450px", config={"responsive": True})


def outputs_html(outputs: list[dict[str, Any]]) -> str:
    """The outputs an Output widget held, as HTML (plotly figures live, images inline, text preformatted)."""
    parts = []
    for out in outputs:
        data = out.get("data", {})
        if PLOTLY in data:
            parts.append(plotly_html(data[PLOTLY]))
        elif "text/html" in data:
            parts.append(_join(data["text/html"]))
        elif "image/png" in data:
            parts.append(f'<img src="data:image/png;base64,{_join(data["image/png"])}">')
        elif "image/svg+xml" in data:
            parts.append(_join(data["image/svg+xml"]))
        elif "text/markdown" in data:
            from nbconvert.filters import markdown2html

            parts.append(markdown2html(_join(data["text/markdown"])))
        elif "text/plain" in data:
            parts.append(f"<pre>{html.escape(_join(data['text/plain']))}</pre>")
        elif out.get("output_type") == "stream":
            parts.append(f"<pre>{html.escape(_join(out.get('text', '')))}</pre>")
        elif out.get("output_type") == "error":
            from nbconvert.filters import strip_ansi

            parts.append(f"<pre>{html.escape(strip_ansi(chr(10).join(out.get('traceback', []))))}</pre>")
    return "\n".join(parts)


NOTEBOOK_LINK = re.compile(r"\]\((\d\d_[\w-]+)\.ipynb")  # [text](04_sink_and_tail.ipynb#sink)


NBVAL_MARK = "# NBVAL_CHECK_OUTPUT"


def static_notebook(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """A copy of an executed notebook whose plotly figures and widget views are HTML a static page can show.

    A notebook saved from JupyterLab holds plotly.js itself once (gmlx_lab/viz/plotlyjs.py); that output is
    dropped, since every page loads the site's one copy.
    """
    nb = copy.deepcopy(nb)
    widgets = StaticWidgets(widget_state(nb), outputs_html)
    for cell in nb.cells:
        if cell.cell_type == "markdown":  # a link to another notebook goes to its page
            cell.source = NOTEBOOK_LINK.sub(r"](\1.html", cell.source)
        elif cell.source.startswith(NBVAL_MARK):  # nbval's marker is for the tests, not the reader
            cell.source = cell.source[len(NBVAL_MARK):].lstrip("\n")
        if "outputs" in cell:
            cell.outputs = [out for out in cell.outputs if not _is_plotlyjs(out)]
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if WIDGET_VIEW in data:
                out["data"] = {"text/html": widgets.view(data[WIDGET_VIEW]["model_id"])}
            elif PLOTLY in data:
                out["data"] = {"text/html": plotly_html(data[PLOTLY])}
    nb.metadata.pop("widgets", None)
    return nb


def _is_plotlyjs(out: dict[str, Any]) -> bool:
    """Whether an output is plotly.js itself (an HTML output holding the library's source)."""
    text = out.get("data", {}).get("text/html")
    return text is not None and PLOTLY not in out.get("data", {}) and _plotlyjs_start() in _join(text)


@functools.cache
def _plotlyjs_start() -> str:
    from plotly.offline import get_plotlyjs

    return get_plotlyjs()[:300]


def binder_url(repo: str | None, path: str) -> str | None:
    """mybinder.org's launch address for `path` in GitHub repository `repo` ("owner/name"), or None."""
    return BINDER.format(repo=repo, path=path) if repo else None


def github_repo(folder: Path) -> str | None:
    """"owner/name" of the checkout's `origin` remote if it is on GitHub, else None."""
    try:
        url = subprocess.run(["git", "-C", str(folder), "remote", "get-url", "origin"], capture_output=True,
                             text=True, check=False).stdout.strip()
    except OSError:
        return None
    match = re.search(r"github\.com[:/]([\w.-]+/[\w.-]+?)(?:\.git)?/?$", url)
    return match.group(1) if match else None


def build_site(pages: list[Page], out: Path, repo: str | None, executed: str, machine: str) -> list[Path]:
    """Write index.html, one page per notebook, plotly.min.js and book.css into `out`; returns the pages."""
    import jinja2
    from nbconvert import HTMLExporter
    from plotly.offline import get_plotlyjs

    out.mkdir(parents=True, exist_ok=True)
    (out / "plotly.min.js").write_text(get_plotlyjs(), encoding="utf-8")
    (out / "book.css").write_text((TEMPLATES / "book.css").read_text(encoding="utf-8"), encoding="utf-8")
    exporter = HTMLExporter(template_name="book", extra_template_basedirs=[str(TEMPLATES)])
    written = []
    for i, page in enumerate(pages):
        book = {
            "file": f"notebooks/{page.path.name}", "path": f"notebooks/{page.path.name}", "executed": executed,
            "binder_url": binder_url(repo, f"notebooks/{page.path.name}"),
            "previous": pages[i - 1] if i > 0 else None, "next": pages[i + 1] if i + 1 < len(pages) else None,
        }
        nb = static_notebook(page.nb)
        nb.metadata["title"] = f"{page.number} · {page.title} · gmlx_lab"  # the browser tab's, not "Notebook"
        body, _ = exporter.from_notebook_node(nb, resources={"book": book})
        target = out / page.href
        target.write_text(body, encoding="utf-8")
        written.append(target)
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES / "book"), autoescape=True)
    index = env.get_template("book_index.html.j2").render(book={
        "pages": [{"number": p.number, "href": p.href, "title": p.title, "summary": p.summary,
                   "seconds": f"{p.seconds:.0f} s"} for p in pages],
        "executed": executed, "machine": machine, "path": "notebooks/", "file": "notebooks/",
        "binder_url": binder_url(repo, "notebooks/"),
    })
    (out / "index.html").write_text(index, encoding="utf-8")
    return written


def _join(x: str | list[str]) -> str:
    return "".join(x) if isinstance(x, list) else x
