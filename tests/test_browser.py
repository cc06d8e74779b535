"""Notebooks 06 and 03 in a real browser: JupyterLab headless, run all cells, drive 06's live compare.

Needs Debian's chromium (`bash tools/system_deps.sh`) and the Python playwright
package (`pip install -e .[test]`); Playwright's own browser download is never
used. Every request that is not to localhost is aborted and fails the test, so
the figures and widgets are proven to render offline. The screenshots go to
docs/images/notebook06.png and notebook03.png (the README shows them).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "06_live_compare.ipynb"
RECORDS = ROOT / "notebooks" / "03_kvarn_records.ipynb"
SCREENSHOT = ROOT / "docs" / "images" / "notebook06.png"
SCREENSHOT_03 = ROOT / "docs" / "images" / "notebook03.png"
CHROMIUM = Path(os.environ.get("GMLX_CHROMIUM", "/usr/bin/chromium"))
HOW_TO_INSTALL = "install them with `bash tools/system_deps.sh` (chromium) and `pip install -e .[test]` (playwright)"


def _missing() -> list[str]:
    missing = []
    if not CHROMIUM.exists():
        missing.append(f"chromium ({CHROMIUM})")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        missing.append("the playwright Python package")
    return missing


def _require_browser() -> None:
    missing = _missing()
    if not missing:
        return
    message = f"browser test needs {' and '.join(missing)}: {HOW_TO_INSTALL}"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(url: str, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"JupyterLab exited with code {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.3)
    raise TimeoutError(f"JupyterLab did not answer {url} within {timeout} s")


@pytest.fixture()
def lab(tmp_path: Path):
    """A JupyterLab server on a free localhost port, serving temporary copies of notebooks 06 and 03."""
    _require_browser()
    root = tmp_path / "root"
    root.mkdir()
    for notebook in (NOTEBOOK, RECORDS):
        shutil.copy(notebook, root / notebook.name)
    settings = tmp_path / "settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True)
    (settings / "notification.jupyterlab-settings").write_text(
        json.dumps({"fetchNews": "false", "checkForUpdates": False}))
    port, token = _free_port(), "gmlx-lab-test"
    env = {**os.environ, "JUPYTERLAB_SETTINGS_DIR": str(tmp_path / "settings"), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root", "--ServerApp.ip=127.0.0.1",
         f"--ServerApp.port={port}", "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}",
         f"--ServerApp.root_dir={root}",
         # A fresh workspace each time: the default one (~/.jupyter/lab/workspaces) reopens the previous test's
         # notebook in a hidden tab, whose saved plots then match this test's locators.
         f"--LabApp.workspaces_dir={tmp_path / 'workspaces'}"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(f"{base}/api/status?token={token}", proc)
        yield base, token
    finally:
        try:
            req = urllib.request.Request(f"{base}/api/shutdown?token={token}", method="POST")
            urllib.request.urlopen(req, timeout=5)
            proc.wait(timeout=15)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()


class _Browser:
    """Headless chromium on the lab, every request outside localhost aborted and recorded."""

    def __init__(self, playwright, base: str, token: str):
        self.base, self.token, self.outside = base, token, []
        self.browser = playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True)
        self.page = self.browser.new_page(viewport={"width": 1500, "height": 2000})
        self.page.route("**/*", self.guard)

    def guard(self, route) -> None:
        host = route.request.url.split("/")[2].split(":")[0] if "://" in route.request.url else ""
        if host in ("127.0.0.1", "localhost") or route.request.url.startswith(("data:", "blob:")):
            route.continue_()
        else:
            self.outside.append(route.request.url)
            route.abort()

    def run_all(self, name: str):
        """Open a notebook, wait for its kernel, run every cell, and return the locator of its panel."""
        from playwright.sync_api import expect

        page = self.page
        page.goto(f"{self.base}/lab/tree/{name}?token={self.token}")
        panel = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden)")  # the notebook's own tab, not another one
        expect(panel.locator(".jp-Cell").first).to_be_visible()
        expect(page.locator("#jp-main-statusbar .jp-StatusBar-TextItem", has_text="| Idle").first).to_be_visible()
        page.get_by_role("menuitem", name="Run", exact=True).click()
        page.get_by_role("menuitem", name="Run All Cells", exact=True).click()
        return panel


@pytest.fixture()
def browser(lab, monkeypatch):
    from playwright.sync_api import expect, sync_playwright

    # `make test` preloads OpenBLAS for MLX; inside Playwright's node driver and chromium it breaks thread creation.
    # The JupyterLab kernel (started above) keeps it.
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    expect.set_options(timeout=120_000)  # first plotly import and model load on 2 CPU cores
    with sync_playwright() as p:
        b = _Browser(p, *lab)
        try:
            yield b
        finally:
            b.browser.close()
    assert not b.outside, f"the notebook tried to reach outside localhost: {b.outside[:5]}"


def test_notebook06_streams_every_scheme_in_columns(browser) -> None:
    from playwright.sync_api import expect

    page = browser.page
    panel = browser.run_all(NOTEBOOK.name)
    app = panel.locator(".gmlx-compare").first
    status = app.locator(".widget-html", has_text="done:").first
    expect(status).to_be_visible(timeout=300_000)  # the first generation runs when the app is built
    expect(panel.locator(".jp-InputPrompt", has_text="[*]")).to_have_count(0, timeout=300_000)
    columns = app.locator(".gmlx-column")
    n_columns = columns.count()
    assert n_columns >= 4  # fp16, affine, affine_rot, kvarn (and any other registered scheme)

    app.locator("button", has_text="Generate").click()
    expect(app.locator("button", has_text="Generating")).to_be_visible()
    seen = set()  # tokens in the first quantized column while streaming: the text grows, it does not jump
    while app.locator("button", has_text="Generating").count():
        seen.add(columns.nth(1).locator("span[title^='token ']").count())
        page.wait_for_timeout(150)
    expect(app.locator(".widget-html", has_text="done:").first).to_be_visible()
    assert len([n for n in seen if 0 < n < 60]) >= 3, f"no progressive text: token counts seen {sorted(seen)}"
    for i in range(n_columns):
        tokens = columns.nth(i).locator("span[title^='token ']").count()
        assert tokens >= 60, f"column {i} holds {tokens} tokens"
    assert "sink 128" in app.inner_text() and "records" in app.inner_text()  # what kvarn's cache holds
    expect(app.locator(".js-plotly-plot .gtitle").first).to_contain_text("equal memory")

    app.scroll_into_view_if_needed()
    page.wait_for_timeout(500)
    SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
    app.screenshot(path=str(SCREENSHOT))


def test_notebook03_records_render(browser) -> None:
    from playwright.sync_api import expect

    page = browser.page
    panel = browser.run_all(RECORDS.name)
    plots = panel.locator(".jp-Cell .js-plotly-plot")
    expect(plots.first).to_be_visible(timeout=300_000)
    expect(panel.locator(".jp-InputPrompt", has_text="[*]")).to_have_count(0, timeout=300_000)
    cell = panel.locator(".jp-Cell", has=page.locator(".js-plotly-plot")).first
    cell.scroll_into_view_if_needed()
    page.wait_for_timeout(500)
    cell.screenshot(path=str(SCREENSHOT_03))
