"""The book: the notebooks, executed, as a static site anyone can read without installing anything.

    gmlx-lab book                         # run every notebooks/*.ipynb, write build/book/index.html and a page each
    gmlx-lab book --executed build/book/executed   # render notebooks already run there (CI's test run)

Built with nbconvert (the Jupyter project's own converter, already installed with JupyterLab): it needs no
network and no Node, keeps JupyterLab's look, and lets a template add the run box and navigation. Jupyter Book 2
(mystmd) fetches its site theme from a web service at build time, which a machine with only package registries
cannot reach. `run` executes, `site` renders, `widgets` draws widget state.
"""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from collections.abc import Callable
from pathlib import Path

import nbformat

from .run import PeakMemory, Run, execute
from .site import Page, build_site, github_repo

__all__ = ["PeakMemory", "Run", "build", "execute", "execute_to", "keep", "load_pages"]

META = "gmlx_book"  # notebook metadata key: the run's seconds and date
# The batch kernel's plotly renderer: figures as JSON only. The default adds a 4.8 MB copy of plotly.js to the
# first output of every notebook; the site ships plotly.js once instead.
KERNEL_ENV = {"PLOTLY_RENDERER": "plotly_mimetype", "HF_HUB_OFFLINE": "1"}


def execute_to(path: Path, folder: Path) -> Run:
    """Run one notebook (`run.execute`) and save it, outputs, widget state and run time included, in `folder`."""
    run = execute(path, env=KERNEL_ENV)
    keep(run.nb, run.seconds, folder / path.name)
    return run


def keep(nb: nbformat.NotebookNode, seconds: float, file: Path) -> None:
    """Save an executed notebook (outputs and widget state) as a page's source, with its run time and date.

    Used by `execute_to` and by tests/test_browser.py, which keeps each notebook as JupyterLab saved it after
    Run All, so `make test` runs every notebook once for both checks.
    """
    nb.metadata[META] = {"seconds": round(seconds, 1), "date": datetime.date.today().isoformat()}
    file.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, file)


def load_pages(folder: Path, names: list[str]) -> list[Page]:
    """The executed notebooks `names` from `folder`, in order; a missing or unexecuted one is an error."""
    pages = []
    for name in names:
        file = folder / name
        if not file.is_file():
            raise FileNotFoundError(f"{file} not found: run the notebook first (gmlx-lab book without --executed)")
        nb = nbformat.read(file, as_version=4)
        if META not in nb.metadata:
            raise ValueError(f"{file} was not executed by gmlx_lab.book (no {META!r} metadata)")
        pages.append(Page(file, nb, nb.metadata[META]["seconds"]))
    return pages


def build(notebooks: Path, out: Path, executed: Path | None = None, repo: str | None = None,
          log: Callable[[str], None] = print) -> list[Path]:
    """Build the site in `out` from every `notebooks/*.ipynb`; returns the pages written.

    Without `executed`, each notebook runs first (saved in `out/executed/`); with it, the notebooks already
    executed there are rendered. `repo` ("owner/name" on GitHub) makes the Binder links; by default it is read
    from the checkout's `origin` remote.
    """
    names = [p.name for p in sorted(Path(notebooks).glob("*.ipynb"))]
    if not names:
        raise FileNotFoundError(f"no notebooks in {notebooks}")
    if executed is None:
        executed = Path(out) / "executed"
        for name in names:
            run = execute_to(Path(notebooks) / name, executed)
            log(f"[book] {name}: {run.seconds:.1f} s")
    pages = load_pages(Path(executed), names)
    dates = sorted({p.nb.metadata[META]["date"] for p in pages})
    stamp = f"executed {' to '.join([dates[0], dates[-1]] if len(dates) > 1 else dates)}{commit_stamp(notebooks)}"
    machine = f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPU cores, {_mlx_device()}"
    return build_site(pages, Path(out), repo or github_repo(Path(notebooks)), stamp, machine)


BUILT_FROM = (":/notebooks", ":/gmlx_lab", ":/benchmarks/results")  # what a page's run reads: its changes count


def commit_stamp(folder: Path) -> str:
    """' at commit abc1234', with ' with uncommitted changes' where what the pages are made from differs from it
    (a test's screenshot in docs/ does not make the book's run another commit's)."""
    head = subprocess.run(["git", "-C", str(folder), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, check=False).stdout.strip()
    if not head:
        return ""
    dirty = subprocess.run(["git", "-C", str(folder), "status", "--porcelain", "--", *BUILT_FROM],
                           capture_output=True, text=True, check=False).stdout.strip()
    return f" at commit {head}{' with uncommitted changes' if dirty else ''}"


def _mlx_device() -> str:
    import mlx.core as mx

    return f"MLX {mx.__version__} on the {'CPU' if mx.default_device() == mx.cpu else 'GPU'}"
