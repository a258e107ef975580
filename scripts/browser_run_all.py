"""Run All of every notebook in JupyterLab, driven by Chromium, with screenshots (not part of CI).

    .venv/bin/python scripts/browser_run_all.py                 # every numbered notebook
    .venv/bin/python scripts/browser_run_all.py 03 06           # some of them, by number
    .venv/bin/python scripts/browser_run_all.py --out /tmp/shots
    .venv/bin/python scripts/browser_run_all.py --write-times  # and record each Run All time in
                                                                # notebooks/run_all_times.json

For each notebook, as a learner would: open it in JupyterLab, Run > Restart Kernel and Run All Cells,
wait until the kernel is idle, then screenshot the page from top to bottom (NN_name-01.png, ...).
report.md beside the pictures lists, per notebook, how long it took, error outputs, cells left
unrun, stderr output, and the page's console errors. The pictures go to the git-ignored
screenshots/ folder: look at them, keep them out of the repository.

Needs what tests/test_browser.py needs (Debian's chromium, the playwright package); it uses that
file's JupyterLab server and notebook driver. Set DDP_HELPERS_CIFAR10 for notebooks 06 and 07.

With --write-times, a notebook that ran to the end without an error output (a cell tagged raises-exception
must raise, and only it may) has its time written into
notebooks/run_all_times.json, with the machine it was measured on; measure on an idle machine, then
run scripts/stamp_times.py, which writes the times into the headers, the instructor's guide and the README.
"""
import argparse
import json
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("numbers", nargs="*", help="notebook numbers (default: all), e.g. 03 06")
    parser.add_argument("--out", default=str(ROOT / "screenshots"), help="folder for the pictures and report.md")
    parser.add_argument("--timeout", type=float, default=600, help="seconds a notebook may run")
    parser.add_argument("--max-shots", type=int, default=40, help="pictures per notebook at most")
    parser.add_argument("--write-times", action="store_true",
                        help="record each clean Run All time in notebooks/run_all_times.json")
    args = parser.parse_args()
    try:
        import test_browser as tb
    except BaseException as err:  # pytest's skip, outside pytest: say why
        raise SystemExit(f"cannot drive the browser: {err}") from err
    from playwright.sync_api import sync_playwright

    notebooks = sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb")
                       if p.name[:2].isdigit() or p.name.startswith("A"))
    if args.numbers:
        notebooks = [n for n in notebooks if n[:2] in args.numbers]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = [f"# Run All in JupyterLab ({datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC)", ""]
    lab = tb.Lab(Path(tempfile.mkdtemp(prefix="browser_run_all-")))
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=tb.CHROMIUM, args=["--no-sandbox"])
            for name in notebooks:
                lines, seconds, clean = run_one(tb, lab, browser, name, out, args)
                report += lines
                if args.write_times and clean:
                    write_time(name, seconds, browser.version)
                lab.shutdown_kernels()
                (out / "report.md").write_text("\n".join(report) + "\n")
            browser.close()
    finally:
        lab.stop()
    print("\n".join(report))
    print(f"\npictures and report.md in {out}")


def run_one(tb, lab, browser, name, out, args):
    print(f"{name} ...", flush=True)
    console = []
    nb = tb.Notebook(lab, browser, f"notebooks/{name}", "run-all-" + name[:2])
    nb.page.on("console", lambda m: console.append(m.text) if m.type == "error" else None)
    start = time.monotonic()
    lines = [f"## {name}", ""]
    try:
        nb.restart_and_run_all()
        state = nb.wait_idle(args.timeout, settle=3)
    except AssertionError as err:
        state = nb.state()
        lines.append(f"- did not finish: {err}")
    seconds = time.monotonic() - start
    cells = nbformat.read(ROOT / "notebooks" / name, as_version=4).cells
    expected = {i for i, c in enumerate(cells) if "raises-exception" in c.metadata.get("tags", [])}
    errors = [e for e in tb._error_outputs(state) if e[0] not in expected]   # a tagged cell raises on purpose
    silent = sorted(expected - {e[0] for e in tb._error_outputs(state)})
    unrun = [c["index"] for c in state["cells"] if c["count"] is None]
    stderr = [(c["index"], tb._text(o)[:200]) for c in state["cells"] for o in c["outputs"]
              if o["type"] == "stream" and "stderr" in str(o.get("name", "")) ]
    shots = screenshots(nb.page, out, name[:-len(".ipynb")], args.max_shots)
    lines += [f"- Run All took {seconds:.0f} s (restart included), {len(state['cells'])} code cells",
              f"- error outputs: {errors or 'none'}"
              + (f" (and the raises-exception cells {sorted(expected)} raised, as tagged)" if expected else ""),
              f"- raises-exception cells that did not raise: {silent or 'none'}",
              f"- cells left unrun: {unrun or 'none'}",
              f"- stderr outputs: {len(stderr)}" + "".join(f"\n  - cell {i}: {t!r}" for i, t in stderr[:5]),
              f"- console errors: {console[:5] or 'none'}",
              f"- pictures: {', '.join(s.name for s in shots)}", ""]
    nb.close()
    clean = not errors and not silent and not unrun and not any(x.startswith("- did not finish") for x in lines)
    return lines, seconds, clean


def machine(browser_version):
    """What the times were measured on, in a learner's words (short) and in full (long)."""
    import jupyterlab
    import psutil
    import torch

    from ddp_helpers import machine as machine_
    from ddp_helpers.bench.timing import hardware_name
    cores, gpus = machine_.cpu_count(), machine_.gpu_count()
    where = f"{gpus} GPU{'s' if gpus > 1 else ''}" if gpus else f"a {cores}-core CPU"
    device = torch.device("cuda" if gpus else "cpu")
    version = torch.__version__.split("+")[0]
    return {"short": where, "cores": cores, "gpus": gpus, "torch": version,
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
            "long": (f"{hardware_name(device)}, {psutil.virtual_memory().total / 2**30:.0f} GiB; torch {version}, "
                     f"JupyterLab {jupyterlab.__version__}, Chromium {browser_version}")}


def write_time(name, seconds, browser_version):
    path = ROOT / "notebooks" / "run_all_times.json"
    table = json.loads(path.read_text()) if path.is_file() else {"notebooks": {}}
    table["machine"] = machine(browser_version)
    table["notebooks"][name] = {"run_all_s": round(seconds, 1)}
    table["notebooks"] = dict(sorted(table["notebooks"].items()))
    path.write_text(json.dumps(table, indent=1) + "\n")


def screenshots(page, out, stem, max_shots):
    """The notebook from top to bottom, one viewport at a time (the notebook scrolls in its panel)."""
    page.evaluate("""() => {   // the element that scrolls the notebook (it differs between JupyterLab versions)
        const panel = window.jupyterapp.shell.currentWidget.node;
        const all = [panel, ...panel.querySelectorAll('*')].filter(e => e.scrollHeight > e.clientHeight + 20
            && ['auto', 'scroll'].includes(getComputedStyle(e).overflowY));
        all.sort((a, b) => b.scrollHeight - a.scrollHeight);
        document.querySelectorAll('[data-run-all-scroller]').forEach(e => e.removeAttribute('data-run-all-scroller'));
        if (all.length) all[0].setAttribute('data-run-all-scroller', '1');
    }""")
    scroller = "[data-run-all-scroller]"
    if not page.locator(scroller).count():
        path = out / f"{stem}-01.png"
        page.screenshot(path=str(path))
        return [path]
    page.evaluate(f"() => document.querySelector('{scroller}').scrollTop = 0")
    height = page.evaluate(f"() => document.querySelector('{scroller}').scrollHeight")
    view = page.evaluate(f"() => document.querySelector('{scroller}').clientHeight")
    taken = []
    for i in range(max_shots):
        page.evaluate(f"(y) => document.querySelector('{scroller}').scrollTop = y", i * (view - 60))
        page.wait_for_timeout(300)
        path = out / f"{stem}-{i + 1:02d}.png"
        page.screenshot(path=str(path))
        taken.append(path)
        if i * (view - 60) + view >= height:
            break
    return taken


if __name__ == "__main__":
    main()
