"""Every notebook in a real browser: JupyterLab headless, Run All, no error, a screenshot of each; 06's live compare
driven and 03's records shown (the README's images); then the book built from those runs, every page opened.

Needs Debian's chromium (`bash tools/system_deps.sh`) and the Python playwright package (`pip install -e .[test]`);
Playwright's own browser download is never used. One JupyterLab server and one browser page serve every notebook,
each notebook opened alone in the page (loaded once) with a new kernel that is shut down after it. Every request
that is not to localhost is aborted and fails the test, so figures and widgets are proven to render offline.

Screenshots: build/screenshots/NN_name/page-KK.png (git-ignored), the notebook panel from top to bottom one screen
at a time, so a person (or an agent with an image viewer) can read each notebook as a learner sees it; plus
docs/images/notebook06.png and notebook03.png. The notebook is saved from JupyterLab after the run, widget state
included, so its error outputs are read from the file and its saved size is checked: plotly.js once
(gmlx_lab/viz/plotlyjs.py).

One run serves two checks: each saved notebook is kept in build/book/executed/ (the check `pytest --nbval-lax`
once made: every cell ran, in order, none raised), and `test_book_site_renders` builds build/book/ from those
files and opens each page over a localhost server: every plotly figure drawn by the site's plotly.js, no script
error, no request outside localhost, the run box on every page.
"""

from __future__ import annotations

import functools
import http.server
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import nbformat
import pytest
from conftest import occurrences
from plotly.offline import get_plotlyjs

from gmlx_lab import book
from gmlx_lab.measure.intervals import WINNER_WORDS

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
SHOTS = ROOT / "build" / "screenshots"
BOOK = ROOT / "build" / "book"
EXECUTED = BOOK / "executed"
kept: set[str] = set()  # notebooks this session ran and kept in EXECUTED (older files there may be stale)
SCREENSHOT_06 = ROOT / "docs" / "images" / "notebook06.png"
SCREENSHOT_03 = ROOT / "docs" / "images" / "notebook03.png"
CHROMIUM = Path(os.environ.get("GMLX_CHROMIUM", "/usr/bin/chromium"))
HOW_TO_INSTALL = "install them with `bash tools/system_deps.sh` (chromium) and `pip install -e .[test]` (playwright)"
RUN_TIMEOUT_S = 900  # Run All of the slowest notebook (04 or 10: Gemma) on 2 shared CPU cores
VIEWPORT = {"width": 1400, "height": 1000}


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


def _settings(folder: Path) -> None:
    """No news toast over the screenshots; every cell rendered (no windowing), so prompts and outputs can be read;
    no autosave; widget state saved with the notebook (the book draws it)."""
    for plugin, values in {
        "@jupyterlab/apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False},
        "@jupyterlab/notebook-extension/tracker": {"windowingMode": "none"},
        # the test saves once, at the end: an autosave during a long run made JupyterLab ask "File Changed"
        "@jupyterlab/docmanager-extension/plugin": {"autosave": False},
        "@jupyter-widgets/jupyterlab-manager/plugin": {"saveState": True},
    }.items():
        path = folder / f"{plugin}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))


class Lab:
    """A JupyterLab server on a free localhost port, serving temporary copies of the notebooks."""

    def __init__(self, tmp: Path):
        self.root = tmp / "root"
        shutil.copytree(ROOT / "notebooks", self.root, ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
        _settings(tmp / "settings")
        port, self.token = _free_port(), "gmlx-lab-test"
        env = {**os.environ, "JUPYTERLAB_SETTINGS_DIR": str(tmp / "settings"), "HF_HUB_OFFLINE": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root", "--ServerApp.ip=127.0.0.1",
             f"--ServerApp.port={port}", "--ServerApp.port_retries=0", f"--IdentityProvider.token={self.token}",
             f"--ServerApp.root_dir={self.root}", f"--LabApp.workspaces_dir={tmp / 'workspaces'}",
             "--LabApp.expose_app_in_browser=True"],  # window.jupyterapp: the test reads the cells' state
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.base = f"http://127.0.0.1:{port}"
        _wait_ready(self.api("status"), self.proc)

    def api(self, path: str) -> str:
        return f"{self.base}/api/{path}?token={self.token}"

    def shutdown_kernels(self) -> None:
        """Stop every running kernel (the notebook just run), so the next one has the machine's memory."""
        with urllib.request.urlopen(self.api("kernels"), timeout=10) as r:
            kernels = json.load(r)
        for k in kernels:
            req = urllib.request.Request(self.api(f"kernels/{k['id']}"), method="DELETE")
            urllib.request.urlopen(req, timeout=30)

    def close(self) -> None:
        try:
            req = urllib.request.Request(self.api("shutdown"), method="POST")
            urllib.request.urlopen(req, timeout=5)
            self.proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()


class Browser:
    """Headless chromium on the lab, every request outside localhost aborted and recorded."""

    def __init__(self, playwright, lab: Lab):
        self.lab, self.outside, self.loaded = lab, [], False
        self.browser = playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True)
        self.page = self.browser.new_page(viewport=VIEWPORT)
        self.page.route("**/*", self.guard)

    def guard(self, route) -> None:
        host = route.request.url.split("/")[2].split(":")[0] if "://" in route.request.url else ""
        if host in ("127.0.0.1", "localhost") or route.request.url.startswith(("data:", "blob:")):
            route.continue_()
        else:
            self.outside.append(route.request.url)
            route.abort()

    def run_all(self, name: str, times: dict[str, float]):
        """Open a notebook alone in the page, wait for its kernel, run every cell, wait until all ran; return the
        locator of its panel. `times` gets the seconds of each phase ("open", "run")."""
        from playwright.sync_api import expect

        page, start = self.page, time.monotonic()
        if self.loaded:  # close the last notebook (its kernel is already shut down) and open this one in place
            page.evaluate("""async name => {
                for (const w of [...window.jupyterapp.shell.widgets('main')]) {
                    if (w.context) w.context.model.dirty = false;  // saved by the test; nothing to ask
                    w.dispose();
                }
                await window.jupyterapp.commands.execute('docmanager:open', {path: name});
            }""", name)
        else:  # JupyterLab's page loads once, on a fresh workspace
            page.goto(f"{self.lab.base}/lab/workspaces/test/tree/{name}?reset&token={self.lab.token}")
            self.loaded = True
        panel = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden)")  # the notebook's own tab, not another one
        expect(panel.locator(".jp-Cell").first).to_be_visible()
        page.wait_for_function("""name => [...window.jupyterapp.shell.widgets('main')].some(w =>
            w.context?.path === name && w.sessionContext?.session?.kernel?.status === 'idle')""", arg=name,
                               polling=200, timeout=120_000)
        expect(page.locator("#jp-main-statusbar .jp-StatusBar-TextItem", has_text="| Idle").first).to_be_visible()
        times["open"] = time.monotonic() - start
        page.get_by_role("menuitem", name="Run", exact=True).click()
        page.get_by_role("menuitem", name="Run All Cells", exact=True).click()
        self.wait_until_run(name)
        times["run"] = time.monotonic() - start - times["open"]
        return panel

    def wait_until_run(self, name: str) -> None:
        """Wait until every code cell of the notebook's model has its execution count (JupyterLab sets it when the
        cell's run ends) or one holds an error; read from JupyterLab's own model (window.jupyterapp) twice a
        second, so nothing is saved or parsed while the kernel works."""
        from playwright.sync_api import TimeoutError as PlaywrightTimeout

        done = """name => {
            for (const w of window.jupyterapp.shell.widgets('main')) {
                if (!w.context || w.context.path !== name) continue;
                const code = w.content.widgets.filter(c => c.model.type === 'code');
                const failed = code.some(c => { const o = c.model.outputs;
                    return Array.from({length: o.length}, (_, i) => o.get(i).type).includes('error'); });
                return failed || code.every(c => c.model.executionCount !== null);
            }
            return false;
        }"""
        try:
            self.page.wait_for_function(done, arg=name, polling=500, timeout=RUN_TIMEOUT_S * 1000)
        except PlaywrightTimeout:
            raise TimeoutError(f"{name}: not every cell ran within {RUN_TIMEOUT_S} s") from None

    def save(self) -> None:
        from playwright.sync_api import expect

        self.page.keyboard.press("Control+s")
        expect(self.page.locator(".jp-mod-dirty")).to_have_count(0, timeout=30_000)
        expect(self.page.locator(".jp-Dialog")).to_have_count(0)  # no "File Changed" or other question

    def screenshots(self, panel, folder: Path) -> list[Path]:
        """The notebook panel, top to bottom, one screen at a time."""
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        scroller = panel.locator(".jp-WindowedPanel-outer").first
        # the content's end: the last cell's bottom (JupyterLab pads the panel with blank space after it)
        end, screen = scroller.evaluate("e => { const cells = e.querySelectorAll('.jp-Cell'); "
                                        "const last = cells[cells.length - 1].getBoundingClientRect(); "
                                        "return [last.bottom - e.getBoundingClientRect().top + e.scrollTop + 20, "
                                        "e.clientHeight]; }")
        step = max(200, screen - 80)  # a little overlap between screens
        last = max(0, int(end) - screen)
        shots = []
        for i, top in enumerate([*range(0, last, step), last]):
            # scrolled, then two frames drawn (plotly redraws what comes into view) and a moment to settle
            scroller.evaluate(f"e => {{ e.scrollTo(0, {top}); return new Promise(r => "
                              "requestAnimationFrame(() => requestAnimationFrame(r))); }")
            self.page.wait_for_timeout(100)
            shots.append(folder / f"page-{i + 1:02d}.png")
            panel.screenshot(path=str(shots[-1]))
        return shots


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory):
    _require_browser()
    server = Lab(tmp_path_factory.mktemp("lab"))
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="module")
def browser(lab: Lab):
    from playwright.sync_api import expect, sync_playwright

    expect.set_options(timeout=120_000)  # first plotly import and model load on 2 CPU cores
    with pytest.MonkeyPatch.context() as mp:
        # `make test` preloads OpenBLAS for MLX; inside Playwright's node driver and chromium it breaks thread
        # creation. The JupyterLab server (started above) and its kernels keep it.
        mp.delenv("LD_PRELOAD", raising=False)
        with sync_playwright() as p:
            b = Browser(p, lab)
            try:
                yield b
            finally:
                b.browser.close()
    assert not b.outside, f"a notebook tried to reach outside localhost: {b.outside[:5]}"


def _live_compare_streams(browser: Browser, panel) -> None:
    """06: the live compare streams every scheme in columns, token by token, and shows kvarn's regions."""
    from playwright.sync_api import expect

    page = browser.page
    app = panel.locator(".gmlx-compare").first
    expect(app.locator(".widget-html", has_text="done:").first).to_be_visible(timeout=300_000)
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
    SCREENSHOT_06.parent.mkdir(parents=True, exist_ok=True)
    app.screenshot(path=str(SCREENSHOT_06))


def _records_render(browser: Browser, panel) -> None:
    """03: the record figure renders; its cell is the README's image."""
    cell = panel.locator(".jp-Cell", has=browser.page.locator(".js-plotly-plot")).first
    cell.scroll_into_view_if_needed()
    browser.page.wait_for_timeout(500)
    SCREENSHOT_03.parent.mkdir(parents=True, exist_ok=True)
    cell.screenshot(path=str(SCREENSHOT_03))


CHECKS = {"06": _live_compare_streams, "03": _records_render}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs_in_jupyterlab(browser: Browser, lab: Lab, path: Path) -> None:
    start, times = time.monotonic(), {}
    try:
        panel = browser.run_all(path.name, times)
        ran = time.monotonic() - start
        shown = panel.locator(".jp-OutputArea-output").filter(has_text="Traceback (most recent call last)")
        assert shown.count() == 0, f"{path.name} shows a traceback: {shown.first.inner_text()[:2000]}"
        if path.name[:2] in CHECKS:
            CHECKS[path.name[:2]](browser, panel)
        times["checks"] = time.monotonic() - start - ran
        browser.save()
        times["save"] = time.monotonic() - start - ran - times["checks"]
        mark = time.monotonic()
        shots = browser.screenshots(panel, SHOTS / path.stem)
        times["screenshots"] = time.monotonic() - mark
    finally:
        mark = time.monotonic()
        lab.shutdown_kernels()
        times["shutdown"] = time.monotonic() - mark
    saved = lab.root / path.name
    nb = nbformat.read(saved, as_version=4)
    errors = [(i, o.get("ename"), o.get("evalue")) for i, c in enumerate(nb.cells) if c.cell_type == "code"
              for o in c.outputs if o.output_type == "error"]
    assert not errors, f"{path.name}: error outputs (cell, name, value): {errors}"
    code = [c for c in nb.cells if c.cell_type == "code"]
    said = [(i, m.group(0)) for i, c in enumerate(code) for o in c.outputs for text in _output_texts(o)
            for m in WINNER_WORDS.finditer(text)]
    assert not said, f"{path.name}: outputs name a winner outside intervals.compare (code cell, words): {said}"
    assert [c.execution_count for c in code] == list(range(1, len(code) + 1))  # every cell ran, in order
    assert nb.metadata.get("widgets") or not any("widget-view" in str(c.outputs) for c in code), "no widget state"
    size = saved.stat().st_size
    copies = occurrences(nb, get_plotlyjs()[:300])
    assert copies <= 1, f"{path.name} saved from JupyterLab holds plotly.js {copies} times ({size} bytes)"
    book.keep(nb, ran, EXECUTED / path.name)
    kept.add(path.name)
    phases = ", ".join(f"{k} {v:.1f}" for k, v in times.items())
    print(f"\n[browser] {path.name}: {time.monotonic() - start:.0f} s ({phases}), saved {size / 1e6:.2f} MB "
          f"(plotly.js {copies}x), "
          f"{len(shots)} screenshots in {shots[0].parent.relative_to(ROOT)}")


def _output_texts(output: dict) -> list[str]:
    """The prose an output shows: streamed text, Markdown and plain text (figures and HTML tables left out)."""
    if output.get("output_type") == "stream":
        return [output.get("text", "")]
    data = output.get("data", {})
    return [str(data[k]) for k in ("text/markdown", "text/plain") if k in data and "text/html" not in data]


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    """Serves the site's files without a log line per request."""

    def log_message(self, *args) -> None:
        pass


def executed_notebooks() -> list[Path]:
    """Every notebook as this session's JupyterLab run saved it; one whose run is missing is executed now."""
    for path in NOTEBOOKS:
        if path.name not in kept:  # this test alone (or a notebook's test failed): the batch run stands in
            book.execute_to(path, EXECUTED)
    return [EXECUTED / path.name for path in NOTEBOOKS]


@pytest.fixture()
def served_book():
    """The book built from the notebooks this session ran in JupyterLab, served on a free localhost port."""
    _require_browser()
    executed_notebooks()
    pages = book.build(ROOT / "notebooks", BOOK, executed=EXECUTED, repo="gmlx/gmlx_lab")
    handler = functools.partial(QuietHandler, directory=str(BOOK))
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


# Every plotly figure with a slider on the page, moved to its last step (or its first, if it opens on the last) by
# the step's own animate call, as dragging the slider does: True where what is drawn changed. No kernel is involved.
SLIDE_EVERY_SLIDER = """async () => {
  const figs = [...document.querySelectorAll('.plotly-graph-div')].filter(d => (d.layout.sliders || []).length);
  const moved = [];
  for (const d of figs) {
    const state = () => JSON.stringify(d.data.map(t => [t.x, t.y, t.z]));
    const before = state();
    const steps = d.layout.sliders[0].steps;
    if (steps.length < 2) { moved.push(false); continue; }  // a slider with one step: a figure defect
    const step = steps[(d.layout.sliders[0].active || 0) === steps.length - 1 ? 0 : steps.length - 1];
    await Plotly.animate(d, step.args[0], step.args[1]);
    moved.push(before !== state());
  }
  return moved;
}"""


SHOWN_TOKENS = ("[...document.querySelectorAll('.gmlx-replay span[data-i]')]"
                ".filter(s => s.style.display !== 'none').length")


def _press_replay(page) -> tuple[int, int]:
    """Press play on the live compare's replay: the tokens shown before (all of the run), and a moment after (it
    starts again from none and adds one a step)."""
    before = page.evaluate(SHOWN_TOKENS)
    page.click(".gmlx-replay button")
    page.wait_for_timeout(1200)
    return before, page.evaluate(SHOWN_TOKENS)


def test_book_site_renders(browser: Browser, served_book) -> None:
    """Every page: its plotly figures drawn (live: each has its mode bar, and one shows a hover label), every
    slider figure moving without a kernel (00 to 04 have one), 06's live compare playing back when play is pressed,
    no script error, nothing fetched from outside localhost, the run box with Binder and the two local commands;
    and the index links them all."""
    base, pages = served_book
    outside, errors, hovered = [], [], False
    slid: dict[str, list[bool]] = {}  # each page's slider figures: did the last step change what is drawn?
    replay = (0, 0)  # 06's live compare played back: tokens shown before pressing play, and a moment after
    shots = BOOK / "screenshots"
    shots.mkdir(exist_ok=True)
    page = browser.browser.new_page(viewport={"width": 1300, "height": 1600})

    def guard(route) -> None:
        if route.request.url.startswith((base, "data:", "blob:")):
            route.continue_()
        else:
            outside.append(route.request.url)
            route.abort()

    page.route("**/*", guard)
    page.on("pageerror", lambda exc: errors.append(f"{page.url}: {exc}"))
    try:
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
            assert page.title().startswith(f"{target.name[:2]} · ") and page.title().endswith(" · gmlx_lab")
            hrefs = page.locator("a[href$='.html'], a[href*='.html#']").evaluate_all(
                "links => links.map(a => a.getAttribute('href'))")
            missing = [h for h in hrefs if "://" not in h and not (target.parent / h.split("#")[0]).is_file()]
            assert not missing, f"{target.name} links to pages the book lacks: {missing}"
            page.screenshot(path=str(shots / target.with_suffix(".png").name))
            if figures and not hovered:
                hovered = _hover_label(page)
            slid[target.name] = page.evaluate(SLIDE_EVERY_SLIDER)
            if target.name == "06_live_compare.html":
                replay = _press_replay(page)
    finally:
        page.close()
    assert replay[0] > 0 and 0 < replay[1] < replay[0], f"06's replay did not play back (tokens shown: {replay})"
    assert hovered, "no figure showed a hover label"
    for name in ("00_start_here.html", "01_affine.html", "02_hadamard.html", "03_kvarn_records.html",
                 "04_sink_and_tail.html"):
        assert slid.get(name), f"{name}: no slider figure (frames computed at build time) in the book page"
    stuck = {name: moves for name, moves in slid.items() if not all(moves)}
    assert not stuck, f"slider figures that did not move without a kernel: {stuck}"
    assert not errors, errors[:5]
    assert not outside, f"the book tried to reach outside localhost: {outside[:5]}"


def test_every_figure_the_notebooks_draw_follows_the_figure_rules() -> None:
    """The figure rules (`viz.figure_problems`) on every plotly figure of every executed notebook, not only on the
    builders' examples: a notebook's own call (its title, its data) can break a rule its builder keeps."""
    import plotly.graph_objects as go

    from gmlx_lab import viz

    found, figures = [], 0
    for path in executed_notebooks():
        for i, cell in enumerate(json.loads(path.read_text(encoding="utf-8"))["cells"]):
            for output in cell.get("outputs", []):
                data = output.get("data", {}).get("application/vnd.plotly.v1+json")
                if data is not None:
                    figures += 1
                    found += [f"{path.name} cell {i}: {p}" for p in viz.figure_problems(go.Figure(data))]
    assert figures > 50 and found == []


def test_no_text_the_notebooks_write_is_an_assembled_list() -> None:
    """No Markdown an executed notebook shows (its cells and its outputs) reads as a log: values written from one
    template bullet after bullet, or part after part of a sentence, go in a table (`viz.assembled_lists`)."""
    from gmlx_lab.viz.say import assembled_lists

    found = []
    for path in executed_notebooks():
        for i, cell in enumerate(json.loads(path.read_text(encoding="utf-8"))["cells"]):
            texts = ["".join(cell["source"])] if cell["cell_type"] == "markdown" else \
                ["".join(out.get("data", {}).get("text/markdown", "")) for out in cell.get("outputs", [])]
            found += [f"{path.name} cell {i}: {f}" for text in texts for f in assembled_lists(text)]
    assert found == []
