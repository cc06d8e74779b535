"""Library source in a notebook: a function's code, read with `inspect.getsource`, folded under one line.

    viz.source(records.normalize)        # "records.normalize(tiles, iters, history) - 36 lines", click to open
    viz.Source.of_file(kernels_dir / "kvarn_decode.cu")   # a source file, folded the same way

The notebooks show the code that made a figure beside it, from the library itself, so what is shown is what ran.
"""

from __future__ import annotations

import html
import inspect
from pathlib import Path
from typing import Any

__all__ = ["Source", "source"]


class Source:
    """A function's (or class's) source: folded `<details>` in Jupyter, plain text elsewhere."""

    def __init__(self, obj: Any, title: str | None = None, open: bool = False):
        self.code = inspect.getsource(obj)
        module = getattr(obj, "__module__", "") or ""
        name = f"{module.removeprefix('gmlx_lab.')}.{obj.__qualname__}" if module else obj.__qualname__
        if callable(obj) and not isinstance(obj, type):
            name += f"({', '.join(inspect.signature(obj).parameters)})"
        self.title = title or name
        self.open = open
        self.language = "python"

    @classmethod
    def of_file(cls, path: str | Path, title: str | None = None, open: bool = False) -> Source:
        """A source file (a kernel's .cu/.metal/.h/.body, a .py) folded the same way, titled by its name."""
        path = Path(path)
        self = cls.__new__(cls)
        self.code, self.title, self.open = path.read_text(encoding="utf-8"), title or path.name, open
        self.language = "python" if path.suffix == ".py" else "cpp"  # CUDA, Metal and the .body parts are C++
        return self

    @property
    def lines(self) -> int:
        return len(self.code.splitlines())

    def _repr_html_(self) -> str:
        summary = f"<code>{html.escape(self.title)}</code> &middot; {self.lines} lines of library source"
        return (f"<details{' open' if self.open else ''}><summary>{summary}</summary>"
                f"<div style='max-height:32em;overflow:auto'>{_highlight(self.code, self.language)}</div></details>")

    def __repr__(self) -> str:
        return f"# {self.title}\n{self.code}"


def _highlight(code: str, language: str = "python") -> str:
    """Source as HTML, coloured by pygments when it is installed (it comes with IPython)."""
    try:
        from pygments import highlight
        from pygments.formatters import HtmlFormatter
        from pygments.lexers import get_lexer_by_name
    except ImportError:
        return f"<pre>{html.escape(code)}</pre>"
    return highlight(code, get_lexer_by_name(language), HtmlFormatter(noclasses=True, nobackground=True))


def source(obj: Any, title: str | None = None, open: bool = False) -> Source:
    """The source of `obj` from the library (`inspect.getsource`), folded under its name and signature."""
    return Source(obj, title, open)
