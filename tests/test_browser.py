"""Notebook 06 in a real browser: JupyterLab headless, run all cells, click a scheme, see the plot change.

Needs Debian's chromium (`bash tools/system_deps.sh`) and the Python playwright
package (`pip install -e .[test]`); Playwright's own browser download is never
used. Every request that is not to localhost is aborted and fails the test, so
the figures and widgets are proven to render offline. The screenshot goes to
docs/images/notebook06.png (the README shows it).
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
SCREENSHOT = ROOT / "docs" / "images" / "notebook06.png"
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
    """A JupyterLab server on a free localhost port, serving a temporary copy of notebook 06."""
    _require_browser()
    root = tmp_path / "root"
    root.mkdir()
    shutil.copy(NOTEBOOK, root / NOTEBOOK.name)
    settings = tmp_path / "settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True)
    (settings / "notification.jupyterlab-settings").write_text(
        json.dumps({"fetchNews": "false", "checkForUpdates": False}))
    port, token = _free_port(), "gmlx-lab-test"
    env = {**os.environ, "JUPYTERLAB_SETTINGS_DIR": str(tmp_path / "settings"), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root", "--ServerApp.ip=127.0.0.1",
         f"--ServerApp.port={port}", "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}",
         f"--ServerApp.root_dir={root}"],
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


def test_notebook06_scheme_toggle_updates_plot(lab, monkeypatch) -> None:
    from playwright.sync_api import expect, sync_playwright

    base, token = lab
    # `make test` preloads OpenBLAS for MLX; inside Playwright's node driver and chromium it breaks thread creation.
    # The JupyterLab kernel (started above) keeps it.
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    outside: list[str] = []
    expect.set_options(timeout=120_000)  # first plotly import and model load on 2 CPU cores

    def guard(route) -> None:
        host = route.request.url.split("/")[2].split(":")[0] if "://" in route.request.url else ""
        if host in ("127.0.0.1", "localhost") or route.request.url.startswith(("data:", "blob:")):
            route.continue_()
        else:
            outside.append(route.request.url)
            route.abort()

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), headless=True)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1800})
            page.route("**/*", guard)
            page.goto(f"{base}/lab/tree/{NOTEBOOK.name}?token={token}")
            expect(page.locator(".jp-NotebookPanel .jp-Cell").first).to_be_visible()
            expect(page.locator("#jp-main-statusbar .jp-StatusBar-TextItem", has_text="| Idle").first
                   ).to_be_visible()
            page.get_by_role("menuitem", name="Run", exact=True).click()
            page.get_by_role("menuitem", name="Run All Cells", exact=True).click()

            title = page.locator(".js-plotly-plot .gtitle").first
            expect(title).to_contain_text("KL per token: kvarn4 tail=0 vs fp16", timeout=240_000)
            before = title.text_content()
            active = page.locator(".widget-toggle-button.mod-active", has_text="kvarn")
            expect(active.first).to_be_visible()

            page.locator(".widget-toggle-button", has_text="affine").first.click()
            expect(title).not_to_have_text(before)
            expect(title).to_contain_text("affine4 g64")
            expect(page.locator(".widget-toggle-button.mod-active", has_text="affine").first).to_be_visible()
            page.wait_for_timeout(500)
            SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
            page.locator(".jp-NotebookPanel").first.screenshot(path=str(SCREENSHOT))
        finally:
            browser.close()
    assert not outside, f"the notebook tried to reach outside localhost: {outside[:5]}"
