"""Run a notebook top to bottom and keep its outputs and widget state: what the book renders and CI checks.

nbclient (what `jupyter nbconvert --execute`, papermill and book builders use) stands in for the frontend of
an ipywidgets Output widget: each output captured in `with out:` is echoed back to the kernel as a comm message
sent on the shell socket, while nbclient is awaiting the cell's execute_reply on that same socket
(`jupyter_client`'s `get_msg` is `socket.poll(timeout)` then recv). ZeroMQ signals a socket's readiness
edge-triggered, and the send consumes that edge: the reply, already in the socket, is seen only when the poll's
timeout runs out. So with nbclient 0.11, jupyter_client 8.10 and ipykernel 7.4 every cell that builds an
`interactive` or an explorer waits out its whole per-cell timeout, without an error (nbclient issue 312, open).
`BookClient` keeps nbclient's Output mimic, so the saved widget state still holds what each Output showed,
but sends nothing back: in a batch run no frontend and no later cell reads the kernel's copy of those outputs.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError, CellTimeoutError
from nbclient.output_widget import OutputWidget
from nbconvert.filters import strip_ansi

CELL_TIMEOUT_S = 900  # the slowest cell (Gemma 3 270M's first conversion, 2 cores) takes well under this


class RecordedOutput(OutputWidget):
    """nbclient's Output-widget stand-in without the echo to the kernel (see the module docstring)."""

    def sync_state(self) -> None:
        """Outputs stay recorded here and in the executor's widget state; nothing is sent to the kernel."""


class BookClient(NotebookClient):
    """A NotebookClient whose Output-widget stand-in never writes to the shell socket during a cell."""

    def __init__(self, nb: nbformat.NotebookNode, **kw: Any):
        super().__init__(nb, **kw)
        self.widget_registry = {"@jupyter-widgets/output": {"OutputModel": RecordedOutput}}


class NotebookFailed(RuntimeError):
    """A notebook cell raised or timed out; the message names the notebook and the cell."""


@dataclass
class Run:
    """One executed notebook: the notebook with outputs, the wall time, and the kernel's process id."""

    path: Path
    nb: nbformat.NotebookNode
    seconds: float
    kernel_pid: int | None = None
    cell_seconds: list[float] = field(default_factory=list)


def execute(path: str | Path, timeout: int = CELL_TIMEOUT_S, env: dict[str, str] | None = None,
            on_kernel: Callable[[int], None] | None = None) -> Run:
    """Run every cell of `path` in a fresh python3 kernel started in the notebook's folder.

    Raises NotebookFailed on the first cell that raises (as `pytest --nbval-lax` fails it) or runs past
    `timeout` seconds. `env` adds variables to the kernel's environment; `on_kernel(pid)` is called once the
    kernel process exists (a memory sampler uses it).
    """
    path = Path(path).resolve()
    if not path.is_file():
        raise FileNotFoundError(f"no notebook at {path}")
    nb = nbformat.read(path, as_version=4)
    client = BookClient(nb, timeout=timeout, kernel_name="python3",
                        resources={"metadata": {"path": str(path.parent)}})
    pids: list[int | None] = []

    def started(**_: Any) -> None:  # nbclient's hook: the kernel is up, no cell has run yet
        pids.append(kernel_pid(client))
        if on_kernel is not None and pids[0] is not None:
            on_kernel(pids[0])

    client.on_notebook_start = started
    start = time.perf_counter()
    try:
        client.execute(env={**os.environ, **(env or {})})
    except CellExecutionError as exc:
        index = next((i for i, c in enumerate(nb.cells) if c.cell_type == "code"
                      and any(o.get("output_type") == "error" for o in c.get("outputs", []))), "?")
        raise NotebookFailed(f"{path.name}, cell {index}: {exc.ename}: {exc.evalue}\n{strip_ansi(str(exc))}") from None
    except CellTimeoutError as exc:
        raise NotebookFailed(f"{path.name}: {strip_ansi(str(exc))}") from None
    seconds = time.perf_counter() - start
    cells = [_cell_seconds(c) for c in nb.cells if c.cell_type == "code"]
    return Run(path, nb, seconds, pids[0] if pids else None, cells)


def kernel_pid(client: NotebookClient) -> int | None:
    """The process id of the client's local kernel (None if it is not a local process)."""
    provisioner = getattr(client.km, "provisioner", None)
    process = getattr(provisioner, "process", None)
    return getattr(process, "pid", None)


def _cell_seconds(cell: nbformat.NotebookNode) -> float:
    times = cell.metadata.get("execution", {})
    if "iopub.execute_input" not in times or "shell.execute_reply" not in times:
        return 0.0
    begin, end = (datetime.fromisoformat(times[k].rstrip("Z")) for k in ("iopub.execute_input", "shell.execute_reply"))
    return (end - begin).total_seconds()


class PeakMemory:
    """Samples the resident memory of a process and its children every `interval` s; `peak` is the largest sum.

    RSS of the kernel's process tree is what mybinder.org's 2 GB limit counts against (the cgroup also holds
    the server, a few tens of MB).
    """

    def __init__(self, interval: float = 0.05):
        import threading

        self.interval, self.peak, self.pid = interval, 0, None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def watch(self, pid: int) -> None:
        self.pid = pid
        self._thread.start()

    def stop(self) -> int:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        return self.peak

    def _sample(self) -> None:
        import psutil

        root = psutil.Process(self.pid)
        while not self._stop.wait(self.interval):
            try:
                procs = [root, *root.children(recursive=True)]
                self.peak = max(self.peak, sum(_rss(p) for p in procs))
            except psutil.NoSuchProcess:
                return


def _rss(process: Any) -> int:
    import psutil

    try:
        return process.memory_info().rss
    except psutil.NoSuchProcess:
        return 0
