"""The course as a learner sees it: JupyterLab driven by Chromium, and the documentation site.

Needs Debian's Chromium and the playwright package (never `playwright install`, whose browser
download is not reachable here):

    apt-get install chromium fonts-noto-color-emoji fonts-noto-cjk   # CJK: the Chinese edition
    .venv/bin/pip install -r requirements.txt -c constraints.txt   # playwright: the test extra

Without them every test here is skipped, with that reason. `.ci/run` installs both.

JupyterLab runs on 127.0.0.1 with a random token, in a temporary folder that holds a copy of the
repository's layout (notebooks read ../examples/ and ../benchmarks/), with its own settings; each
test opens its notebook in a workspace of its own, and its kernels are shut down after it.
Chromium is Debian's, launched with --no-sandbox (CI runs as root). Deadlines are generous
(`seconds()`, DDP_HELPERS_TEST_TIME_SCALE): the machine is a busy 2-core one.
"""
import base64
import functools
import http.server
import io
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import REPO, cannot_run, needs_mini, seconds

CHROMIUM = os.environ.get("DDP_HELPERS_CHROMIUM", "/usr/bin/chromium")


try:
    from playwright.sync_api import sync_playwright
except ImportError:
    cannot_run("browser tests: the playwright package is missing (pip install -r requirements.txt; "
               "the browser is Debian's chromium, never `playwright install`)", whole_module=True)
if not os.path.exists(CHROMIUM):
    cannot_run(f"browser tests: no Chromium at {CHROMIUM} (Debian: apt-get install chromium "
               f"fonts-noto-color-emoji; or set DDP_HELPERS_CHROMIUM)", whole_module=True)

import psutil  # noqa: E402  (JupyterLab's dependency; after the skips)

ROOT = Path(REPO)
COPY_SKIP = {"docs", "data", "build", "peers", "screenshots", "gpu-suite", "__pycache__"}  # git-ignored or large
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
STOPPED_RANKS = re.compile(r"\branks?\b.*\bstopped\b|\bstopped\b.*\branks?\b", re.I)


# ------------------------------------------------------------------ the browser and the server
@pytest.fixture(scope="module")
def browser():
    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield chromium
        chromium.close()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_json(path, value):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value))


class Lab:
    """A JupyterLab server of this module's own, and what the tests ask it."""

    def __init__(self, home):
        self.home = home
        self.root = home / "course"
        # the repository's layout: notebooks read ../examples/ and ../benchmarks/
        skip = shutil.ignore_patterns(".*", "__pycache__", "*.egg-info")
        self.root.mkdir()
        for entry in ROOT.iterdir():
            if entry.name.startswith(".") or entry.name in COPY_SKIP or entry.name.endswith(".egg-info"):
                continue
            if entry.is_dir():
                shutil.copytree(entry, self.root / entry.name, ignore=skip)
            else:
                shutil.copy2(entry, self.root / entry.name)
        settings = home / "settings"
        # no news fetched from the internet; every cell in the page (no virtual scrolling)
        _write_json(settings / "@jupyterlab/apputils-extension/notification.jupyterlab-settings",
                    {"fetchNews": "false", "checkForUpdates": False})
        _write_json(settings / "@jupyterlab/notebook-extension/tracker.jupyterlab-settings",
                    {"windowingMode": "none"})
        self.token = secrets.token_hex(16)
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, JUPYTERLAB_SETTINGS_DIR=str(settings),
                   JUPYTERLAB_WORKSPACES_DIR=str(home / "workspaces"),
                   JUPYTER_CONFIG_DIR=str(home / "config"), JUPYTER_RUNTIME_DIR=str(home / "runtime"),
                   JUPYTER_DATA_DIR=str(home / "data"))   # no user kernelspec: the kernel is this Python
        self.log = open(home / "jupyterlab.log", "w")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1",
             f"--ServerApp.port={self.port}", "--ServerApp.port_retries=0",
             f"--IdentityProvider.token={self.token}", f"--ServerApp.root_dir={self.root}",
             "--LabApp.expose_app_in_browser=True"] + (["--allow-root"] if os.geteuid() == 0 else []),
            env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + seconds(30)
        while True:
            try:
                self.api("GET", "status")
                break
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError("JupyterLab did not start: "
                                       + (home / "jupyterlab.log").read_text()[-2000:]) from None
                time.sleep(0.3)

    def api(self, method, path):
        request = urllib.request.Request(f"{self.url}/api/{path}", method=method,
                                         headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(request, timeout=30) as response:
            body = response.read()
        return json.loads(body) if body else None

    def shutdown_kernels(self):
        for kernel in self.api("GET", "kernels"):
            self.api("DELETE", f"kernels/{kernel['id']}")

    def kernel_processes(self):
        server = psutil.Process(self.process.pid)
        return [p for p in server.children() if "ipykernel" in " ".join(_cmdline(p))]

    def stop(self):
        if self.process.poll() is None:
            self.process.terminate()       # the server shuts its kernels down
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()


def _cmdline(process):
    try:
        return process.cmdline()
    except psutil.Error:
        return []


def workers_of(kernel):
    """The kernel's worker processes: what its forkserver forked (the forkserver itself stays, and so does
    the process that serves the launches' rendezvous stores, which writes to its store-<pid>.log)."""
    found = []
    try:
        for child in kernel.children():
            if "forkserver" in " ".join(_cmdline(child)):
                found += [p for p in child.children(recursive=True) if not _serves_stores(p)]
    except psutil.NoSuchProcess:
        pass
    return found


def _serves_stores(process):
    try:
        return any(re.search(r"/store-\d+\.log$", f.path) for f in process.open_files())
    except psutil.Error:
        return False


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    server = Lab(tmp_path_factory.mktemp("lab"))
    yield server
    server.stop()


class Notebook:
    """One notebook open in its own workspace, driven through the page as a learner would."""

    def __init__(self, lab, browser, path, workspace):
        self.lab = lab
        self.context = browser.new_context(viewport={"width": 1400, "height": 1000})
        self.page = self.context.new_page()
        self.page.set_default_timeout(seconds(20) * 1000)
        self.page.goto(f"{lab.url}/lab/workspaces/{workspace}/tree/{path}?reset&token={lab.token}")
        self.page.wait_for_function("() => window.jupyterapp && window.jupyterapp.shell.currentWidget"
                                    " && window.jupyterapp.shell.currentWidget.content"
                                    " && window.jupyterapp.shell.currentWidget.context.isReady",
                                    timeout=seconds(60) * 1000)
        self.wait_idle(seconds(60))

    def close(self):
        self.context.close()

    def state(self, with_data=False):
        """Kernel status and each code cell: execution count, prompt, outputs (text and types)."""
        return self.page.evaluate("""(withData) => {
            const panel = window.jupyterapp.shell.currentWidget;
            const kernel = panel.sessionContext.session && panel.sessionContext.session.kernel;
            const cells = [];
            const widgets = panel.content.widgets;
            for (let i = 0; i < widgets.length; i++) {
                const cell = widgets[i];
                if (cell.model.type !== 'code') continue;
                const prompt = cell.node.querySelector('.jp-InputPrompt');
                const outputs = cell.model.outputs.toJSON().map(o => {
                    const data = o.data || {};
                    return {type: o.output_type, name: o.name, ename: o.ename, evalue: o.evalue,
                            traceback: o.traceback, text: o.text || data['text/plain'] || '',
                            mimes: Object.keys(data), png: withData ? data['image/png'] : undefined};
                });
                cells.push({index: i, count: cell.model.executionCount,
                            prompt: prompt ? prompt.textContent.trim() : '',
                            source: cell.model.sharedModel.getSource(), outputs});
            }
            return {status: kernel ? kernel.status : 'none', cells};
        }""", with_data)

    def wait_idle(self, timeout, settle=1.5):
        """Wait until the kernel is idle and no cell waits to run, for `settle` seconds in a row."""
        deadline, quiet_since = time.monotonic() + timeout, None
        while time.monotonic() < deadline:
            state = self.state()
            busy = state["status"] != "idle" or any(c["prompt"] == "[*]:" for c in state["cells"])
            if busy:
                quiet_since = None
            elif quiet_since is None:
                quiet_since = time.monotonic()
            elif time.monotonic() - quiet_since >= settle:
                return state
            time.sleep(0.25)
        raise AssertionError(f"the kernel was still busy after {timeout:.0f} s: {_summary(self.state())}")

    def wait_started(self, timeout):
        """Wait until the kernel is busy or restarting, or a cell waits to run."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.state()
            if state["status"] != "idle" or any(c["prompt"] == "[*]:" for c in state["cells"]):
                return
            time.sleep(0.1)
        raise AssertionError(f"nothing started running within {timeout:.0f} s")

    def menu(self, menu, item):
        self.page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(f"^{menu}$")).click()
        self.page.locator(".lm-Menu-itemLabel", has_text=item).first.click()

    def restart_and_run_all(self):
        self.menu("Run", "Restart Kernel and Run All Cells")
        self.page.locator(".jp-Dialog .jp-mod-accept").click()     # "Restart"
        self.wait_started(seconds(30))

    def run_cell(self, index):
        """Select the cell and press the toolbar's Run button."""
        self.page.evaluate("(i) => { const nb = window.jupyterapp.shell.currentWidget.content;"
                           " nb.activeCellIndex = i; nb.mode = 'command'; }", index)
        self.page.locator(".jp-NotebookPanel-toolbar [data-command='notebook:run-cell-and-select-next']").click()

    def interrupt(self):
        self.page.locator(".jp-NotebookPanel-toolbar [data-command='notebook:interrupt-kernel']").click()

    def cell_index(self, needle):
        for cell in self.state()["cells"]:
            if needle in cell["source"]:
                return cell["index"]
        raise AssertionError(f"no code cell contains {needle!r}")

    def cell(self, index, with_data=False):
        return next(c for c in self.state(with_data)["cells"] if c["index"] == index)

    def kernel(self):
        kernels = self.lab.kernel_processes()
        assert len(kernels) == 1, f"expected one kernel process, found {[_cmdline(k) for k in kernels]}"
        return kernels[0]


@pytest.fixture
def open_notebook(lab, browser, request):
    opened = []

    def open_(path):
        workspace = re.sub(r"\W+", "-", request.node.name)[:60] + "-" + secrets.token_hex(3)
        notebook = Notebook(lab, browser, path, workspace)
        opened.append(notebook)
        return notebook

    yield open_
    for notebook in opened:
        notebook.close()
    lab.shutdown_kernels()


def _summary(state):
    return [(c["index"], c["prompt"], [o["type"] for o in c["outputs"]]) for c in state["cells"]]


def _error_outputs(state):
    return [(c["index"], c["source"][:80], o["ename"], o["evalue"])
            for c in state["cells"] for o in c["outputs"] if o["type"] == "error"]


def _text(output):
    text = output["text"] if output["type"] != "error" else "\n".join(output["traceback"] or [])
    return ANSI.sub("", "".join(text) if isinstance(text, list) else text)


# ------------------------------------------------------------------ the notebooks
def test_00_restart_and_run_all_ends_without_error(open_notebook):
    nb = open_notebook("notebooks/00_welcome.ipynb")
    nb.restart_and_run_all()
    state = nb.wait_idle(seconds(120), settle=3)
    assert not _error_outputs(state), f"error outputs after Run All: {_error_outputs(state)}"
    unrun = [(c["index"], c["source"][:60]) for c in state["cells"] if c["count"] is None]
    assert not unrun, f"cells left unrun after Run All: {unrun}"
    counts = [c["count"] for c in state["cells"]]
    assert counts == list(range(1, len(counts) + 1)), f"not every cell ran once, in order, after the restart: {counts}"


def _png_progress(png_b64):
    """The live view's progress bar (the top strip, tab:blue): the filled fraction of its width."""
    from PIL import Image
    image = Image.open(io.BytesIO(base64.b64decode(png_b64))).convert("RGB")
    width, height = image.size
    best = 0
    for y in range(int(height * 0.15)):
        row = [image.getpixel((x, y)) for x in range(width)]
        best = max(best, sum(1 for r, g, b in row if abs(r - 31) < 25 and abs(g - 119) < 25 and abs(b - 180) < 25))
    return best / width


def test_03_moving_the_ring_slider_changes_the_picture(open_notebook):
    nb = open_notebook("notebooks/03_collectives.ipynb")
    # the cells the slider needs, run one by one as a learner would (Run All of 03 is in the run-all script):
    # the setup, the pool, the recorded ring, the step-by-step picture, the slider
    first = nb.state()["cells"][0]["index"]
    for index in [first] + [nb.cell_index(text) for text in
                            ("%ddp start", "ring_all_reduce_steps(", "ring_all_steps(", "ring_stepper(")]:
        nb.run_cell(index)
        nb.wait_idle(seconds(60), settle=0.5)
        errors = [o for o in nb.cell(index)["outputs"] if o["type"] == "error"]
        assert not errors, f"cell {index} raised: {errors[0]['ename']}: {errors[0]['evalue']}"
    cell = nb.page.locator(".jp-Notebook .jp-CodeCell").nth(
        [c["index"] for c in nb.state()["cells"]].index(index))
    handle = cell.locator(".widget-slider .noUi-handle")
    handle.wait_for(timeout=seconds(30) * 1000)
    picture = cell.locator(".jp-OutputArea-output img").first
    picture.wait_for(timeout=seconds(30) * 1000)
    before, readout = picture.get_attribute("src"), cell.locator(".widget-readout").first.inner_text()
    track = cell.locator(".widget-slider .noUi-target").first
    track.scroll_into_view_if_needed()
    track.click(position={"x": track.bounding_box()["width"] * 0.6, "y": track.bounding_box()["height"] / 2})
    if cell.locator(".widget-readout").first.inner_text() == readout:    # no tap on the track: the keys
        handle.focus()
        for _ in range(3):
            nb.page.keyboard.press("ArrowRight")
    deadline = time.monotonic() + seconds(20)
    while time.monotonic() < deadline:
        if picture.count() and picture.get_attribute("src") != before:
            break
        time.sleep(0.25)
    after_readout = cell.locator(".widget-readout").first.inner_text()
    assert after_readout != readout, f"the slider did not move (readout {readout!r})"
    assert picture.get_attribute("src") != before, \
        f"the picture did not change when the slider moved to {after_readout}"


def _start_training(nb):
    nb.run_cell(nb.cell_index("import tempfile"))   # the notebook's imports
    nb.wait_idle(seconds(60))
    index = nb.cell_index("live.compare(")
    nb.run_cell(index)
    return index


def _wait_for_workers(nb, timeout):
    kernel = nb.kernel()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        workers = workers_of(kernel)
        time.sleep(0.3)   # a store process just forked has not opened its log yet: look again
        workers = [w for w in workers if not _serves_stores(w)]
        if workers:
            return kernel, workers
    raise AssertionError("no worker process appeared under the kernel")


def _alive(process):
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _assert_interrupted(nb, index, kernel, workers):
    nb.interrupt()
    nb.wait_idle(seconds(60))
    deadline = time.monotonic() + seconds(10)
    while time.monotonic() < deadline and any(_alive(w) for w in workers):
        time.sleep(0.2)
    assert not [w.pid for w in workers if _alive(w)], \
        f"worker processes left after the interrupt: {[w.pid for w in workers if _alive(w)]}"
    assert not workers_of(kernel), f"the kernel still has workers: {[w.pid for w in workers_of(kernel)]}"
    outputs = nb.cell(index)["outputs"]
    errors = [o for o in outputs if o["type"] == "error"]
    assert errors and errors[-1]["ename"] == "KeyboardInterrupt", \
        f"expected the cell to end with KeyboardInterrupt, got {[(o['type'], o.get('ename')) for o in outputs]}"
    traceback = [line for line in _text(errors[-1]).splitlines() if line.strip()]
    said = [line for o in outputs for line in _text(o).splitlines() if STOPPED_RANKS.search(line)]
    assert said, f"no line says that the ranks were stopped; the cell shows: {[_text(o)[-300:] for o in outputs]}"
    assert len(traceback) <= 2, \
        f"expected a one-line message, the error shows {len(traceback)} lines:\n" + "\n".join(traceback)


@pytest.mark.parametrize("ranks", ["fresh", "warm pool"])
def test_interrupt_button_stops_a_running_ddp_cell(open_notebook, lab, ranks):
    nbformat = pytest.importorskip("nbformat")
    setup = "%load_ext ddp_helpers" + ("\n%ddp start -n 2" if ranks == "warm pool" else "")
    scratch = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell(setup),
        nbformat.v4.new_code_cell("%%ddp -n 2\nimport time\nprint('working', flush=True)\n"
                                  "for _ in range(3000):\n    time.sleep(0.1)"),
    ])
    scratch.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    name = f"scratch_interrupt_{ranks.replace(' ', '_')}.ipynb"
    nbformat.write(scratch, lab.root / "notebooks" / name)
    nb = open_notebook(f"notebooks/{name}")
    nb.run_cell(0)
    nb.wait_idle(seconds(60))
    nb.run_cell(1)
    kernel, workers = _wait_for_workers(nb, seconds(60))
    deadline = time.monotonic() + seconds(60)
    while not any("working" in _text(o) for o in nb.cell(1)["outputs"]):
        assert time.monotonic() < deadline, "the %%ddp cell never printed"
        time.sleep(0.2)
    _assert_interrupted(nb, 1, kernel, workers)


@needs_mini
def test_06_live_view_updates_in_place_and_the_interrupt_button_stops_the_training(open_notebook):
    nb = open_notebook("notebooks/06_ddp_cifar10.ipynb")
    index = _start_training(nb)
    kernel, workers = _wait_for_workers(nb, seconds(60))
    pictures, progress, most_outputs = [], [], 0
    deadline = time.monotonic() + seconds(120)
    while time.monotonic() < deadline and len(pictures) < 3:
        cell = nb.cell(index, with_data=True)
        most_outputs = max(most_outputs, len(cell["outputs"]))
        pngs = [o["png"] for o in cell["outputs"] if o["png"]]
        if pngs and (not pictures or pngs[-1] != pictures[-1]):
            pictures.append(pngs[-1])
            progress.append(_png_progress(pngs[-1]))
        assert cell["prompt"] == "[*]:", \
            f"the training cell ended before the test could interrupt it: {cell['outputs']}"
        time.sleep(0.2)
    # the live view: one output, redrawn in place, its progress bar advancing
    assert most_outputs == 1, f"the live view should be one output redrawn in place, saw {most_outputs} outputs"
    assert len(pictures) >= 3, \
        f"the picture was drawn {len(pictures)} time(s), expected it to be redrawn as training goes"
    assert progress[-1] > progress[0] and progress[-1] > 0, f"the progress bar did not advance: {progress}"
    # the Interrupt button, in the middle of the training
    _assert_interrupted(nb, index, kernel, workers)


# ------------------------------------------------------------------ the documentation site
SITE = ROOT / "docs" / "_build" / "html"


@pytest.fixture(scope="module")
def site():
    if not (SITE / ".built-ok").is_file():      # written by docs/build.py when the build and its checks passed
        pytest.importorskip("sphinx", reason="the site is not built and Sphinx is missing "
                                             "(pip install -e \".[docs]\")")
        subprocess.run([sys.executable, str(ROOT / "docs" / "build.py")], check=True, timeout=600)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(SITE))
    handler.log_message = lambda *args: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_every_site_page_loads_without_console_errors_and_shows_its_images(browser, site):
    pages = sorted(p.relative_to(SITE).as_posix() for p in SITE.rglob("*.html"))
    assert "index.html" in pages and any(p.startswith("notebooks/") for p in pages) and "api.html" in pages
    context = browser.new_context(viewport={"width": 1300, "height": 900})
    page = context.new_page()
    problems, seen = [], []
    page.on("console", lambda m: seen.append(f"console {m.type}: {m.text} ({m.location.get('url')})")
            if m.type == "error" else None)
    page.on("pageerror", lambda e: seen.append(f"page error: {e}"))
    page.on("requestfailed", lambda r: seen.append(f"request failed: {r.url}"))
    page.on("response", lambda r: seen.append(f"HTTP {r.status}: {r.url}") if r.status >= 400 else None)
    try:
        for name in pages:
            seen.clear()
            page.goto(f"{site}/{name}", wait_until="load")
            page.evaluate("() => document.querySelectorAll('img').forEach(i => i.loading = 'eager')")
            page.wait_for_function("() => [...document.images].every(i => i.complete)", timeout=seconds(20) * 1000)
            broken = page.evaluate("() => [...document.images].filter(i => !i.naturalWidth).map(i => i.src)")
            if page.locator("pre.mermaid").count():
                drawn = "() => [...document.querySelectorAll('pre.mermaid')].every(p => p.querySelector('svg'))"
                page.wait_for_function(drawn, timeout=seconds(20) * 1000)
            problems += [f"{name}: {line}" for line in seen] + [f"{name}: image not shown: {src}" for src in broken]
    finally:
        context.close()
    assert not problems, "\n".join(problems)


def test_site_text_is_shown_as_written(browser, site):
    # No typographic replacement: "--allow-root" outside backticks became an en dash (the copied
    # command failed), and ASCII quotes after Chinese text became two closing quotes.
    page = browser.new_page()
    try:
        page.goto(f"{site}/index.html", wait_until="load")
        text = page.inner_text("body")
        assert "--allow-root" in text and "–allow-root" not in text and "—allow-root" not in text
        page.goto(f"{site}/notebooks/glossary.html", wait_until="load")
        text = page.inner_text("body")
        assert "“常不译”" in text and "”常不译”" not in text
    finally:
        page.close()


def test_site_wraps_shell_commands_only_and_code_keeps_its_lines(browser, site):
    # Shell commands wrap at spaces, so the Start commands are seen whole at 1300 px. Code and outputs
    # keep their lines and scroll sideways where they are wide: wrapped, 06's source and 04's tables
    # broke mid-statement and mid-row.
    page = browser.new_page(viewport={"width": 1300, "height": 900})
    try:
        page.goto(f"{site}/index.html", wait_until="load")
        shell = page.evaluate(
            "() => [...document.querySelectorAll('div.highlight-bash pre')]"
            ".map(p => [p.scrollWidth > p.clientWidth + 1, getComputedStyle(p).whiteSpace,"
            "           p.textContent.slice(0, 60)])")
        assert len(shell) >= 2 and all(style == "pre-wrap" for _, style, _ in shell), shell
        assert not [text for wide, _, text in shell if wide], shell
        page.goto(f"{site}/notebooks/04_gloo_vs_nccl.html", wait_until="load")
        code = page.evaluate(
            "() => [...document.querySelectorAll('div.cell_input pre, div.cell_output pre')]"
            ".map(p => getComputedStyle(p).whiteSpace)")
        assert code and set(code) == {"pre"}, set(code)
    finally:
        page.close()


def test_the_landing_page_is_the_course_and_the_project_has_its_own_page(browser, site):
    page = browser.new_page()
    try:
        page.goto(f"{site}/index.html", wait_until="load")
        headings = ("() => [...document.querySelectorAll('article h2')]"
                    ".map(h => h.textContent.replace(/[#¶]/g, '').trim())")
        landing = page.evaluate(headings)
        assert {"Start", "The notebooks", "For instructors"} <= set(landing), landing
        assert not {"Layout", "Tests and CI", "How the notebooks start workers"} & set(landing), landing
        page.goto(f"{site}/project.html", wait_until="load")
        assert {"Layout", "Tests and CI", "How the notebooks start workers"} <= set(page.evaluate(headings))
    finally:
        page.close()


def test_formulas_are_drawn_by_the_sites_own_mathjax(browser, site):
    # 10's log-sum-exp merge was shown as raw "e^{L_a}" text; MathJax now draws it, served by the site.
    page = browser.new_page()
    loaded = []
    page.on("request", lambda r: loaded.append(r.url))
    try:
        page.goto(f"{site}/notebooks/10_pipeline_and_context_parallel.html", wait_until="load")
        page.wait_for_function("() => document.querySelectorAll('mjx-container').length >= 3",
                               timeout=seconds(20) * 1000)
        assert "e^{L_a}" not in page.inner_text("article")
        assert all(url.startswith(site) for url in loaded), [u for u in loaded if not u.startswith(site)]
    finally:
        page.close()


# ------------------------------------------------------------------ the Chinese edition
# Whether Chinese characters are drawn as glyphs, not as boxes: each Han character of the element's text
# is drawn alone, in the element's own font, and the pictures compared. Without a CJK font every one of
# them is the same empty box (the one a private-use character gets), so they would all look alike.
HAN_GLYPHS = """([selector, most]) => {
    const el = document.querySelector(selector);
    if (!el) return {error: 'nothing matches ' + selector};
    const han = [...new Set(el.innerText.match(/\\p{Script=Han}/gu) || [])].slice(0, most);
    const style = getComputedStyle(el);
    const canvas = document.createElement('canvas');
    canvas.width = canvas.height = 48;
    const ctx = canvas.getContext('2d', {willReadFrequently: true});
    const draw = (ch) => {
        ctx.clearRect(0, 0, 48, 48);
        ctx.font = `32px ${style.fontFamily}`;
        ctx.textBaseline = 'top';
        ctx.fillText(ch, 4, 4);
        return ctx.getImageData(0, 0, 48, 48).data.filter((_, i) => i % 4 === 3).join(',');
    };
    const box = draw('\\uE000');
    const drawn = han.map(draw);
    return {font: style.fontFamily, lang: document.documentElement.lang, han: han.join(''),
            distinct: new Set(drawn).size, boxes: drawn.filter(d => d === box).length};
}"""


def _assert_han_drawn(page, selector, most=12):
    got = page.evaluate(HAN_GLYPHS, [selector, most])
    assert "error" not in got, got
    assert len(got["han"]) >= 4, f"no Chinese text in {selector}: {got}"
    assert got["boxes"] == 0 and got["distinct"] == len(got["han"]), (
        f"Chinese characters drawn as boxes (no CJK font? Debian: apt-get install fonts-noto-cjk): {got}")
    return got


def test_chinese_site_pages_render_their_characters_and_link_to_the_english(browser, site):
    page = browser.new_page()
    try:
        page.goto(f"{site}/zh/notebooks/04_gloo_vs_nccl.html", wait_until="load")
        assert page.evaluate("() => document.documentElement.lang") == "zh-CN"
        title = page.inner_text("article h1")
        assert "Gloo" in title and re.search(r"[\u4e00-\u9fff]", title), title
        _assert_han_drawn(page, "article")
        assert "术语表" in page.inner_text("aside, nav, .sidebar-drawer"), "the Chinese site's navigation"
        page.locator("a.counterpart-link").click()          # to the English page, and back
        page.wait_for_load_state("load")
        assert page.url == f"{site}/notebooks/04_gloo_vs_nccl.html", page.url
        assert not re.search(r"[\u4e00-\u9fff]", page.inner_text("article h1"))
        page.locator("a.counterpart-link").click()
        page.wait_for_load_state("load")
        assert page.url == f"{site}/zh/notebooks/04_gloo_vs_nccl.html", page.url
        page.goto(f"{site}/index.html", wait_until="load")
        page.locator("a.counterpart-link").click()
        page.wait_for_load_state("load")
        assert page.url == f"{site}/zh/index.html", page.url
        _assert_han_drawn(page, "article")
    finally:
        page.close()


def test_a_chinese_notebook_in_jupyterlab_renders_its_characters(open_notebook):
    nb = open_notebook("notebooks/zh/00_welcome.ipynb")
    nb.page.wait_for_selector(".jp-RenderedMarkdown h1", timeout=seconds(30) * 1000)
    title = nb.page.inner_text(".jp-RenderedMarkdown h1")
    assert title.startswith("00 · ") and re.search(r"[\u4e00-\u9fff]", title), title
    _assert_han_drawn(nb.page, ".jp-MarkdownCell .jp-RenderedMarkdown")


def test_the_glyph_check_sees_boxes_where_no_cjk_font_is_installed(browser, site, tmp_path):
    # The check above must fail on a machine without a CJK font: the same Chinese page, in a Chromium
    # whose fontconfig sees only the folders that hold no CJK font, has its characters drawn as boxes.
    fc_list = shutil.which("fc-list")
    if not fc_list:
        pytest.skip("no fc-list (fontconfig) to build a font set without CJK")
    fonts = subprocess.run([fc_list, "--format", "%{file}\t%{family}\n"], capture_output=True, text=True,
                           check=True).stdout.splitlines()
    cjk_dirs = {str(Path(f).parent) for f, _, family in (line.partition("\t") for line in fonts) if "CJK" in family}
    dirs = sorted({str(Path(line.partition("\t")[0]).parent) for line in fonts} - cjk_dirs)
    conf = tmp_path / "fonts.conf"
    conf.write_text('<?xml version="1.0"?>\n<!DOCTYPE fontconfig SYSTEM "fonts.dtd">\n<fontconfig>\n'
                    + "".join(f"  <dir>{d}</dir>\n" for d in dirs)
                    + f"  <cachedir>{tmp_path / 'cache'}</cachedir>\n</fontconfig>\n")
    no_cjk = browser.browser_type.launch(executable_path=CHROMIUM, args=["--no-sandbox"],
                                         env=dict(os.environ, FONTCONFIG_FILE=str(conf)))
    try:
        page = no_cjk.new_page()
        page.goto(f"{site}/zh/notebooks/04_gloo_vs_nccl.html", wait_until="load")
        with pytest.raises(AssertionError, match="drawn as boxes"):
            _assert_han_drawn(page, "article")
    finally:
        no_cjk.close()
