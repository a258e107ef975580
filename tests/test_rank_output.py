"""What ranks show in a real Jupyter kernel beyond `[rank N] ...` lines: figures and rich values
(labelled with their rank), `%%ddp --ranks` on part of a warm pool (a collective there is refused at
once), per-rank tabs (`--tabs`), and `input()`, which a rank cannot serve.

Kernels are slow to start: each test drives one kernel through many cells."""
from datetime import datetime

from conftest import seconds
from test_kernel import text_of


def shown(cell):
    """The cell's outputs in order: ("text", str), ("png"/"html", ...), ("error", ename: evalue)."""
    items = []
    for out in cell.outputs:
        if out.output_type == "stream":
            items.append(("text", out.text))
        elif out.output_type in ("display_data", "execute_result"):
            data = out.data
            kind = "png" if "image/png" in data else "html" if "text/html" in data else "text"
            items.append((kind, data.get("text/html") if kind == "html" else data.get("text/plain", "")))
        elif out.output_type == "error":
            items.append(("error", f"{out.ename}: {out.evalue}"))
    return items


def seconds_taken(cell):
    times = cell.metadata["execution"]
    start, end = (datetime.fromisoformat(times[k].replace("Z", "+00:00"))
                  for k in ("iopub.execute_input", "shell.execute_reply"))
    return (end - start).total_seconds()


def label_before(items, rank, kind):
    """Is there a `[rank N]` text right before an output of this kind?"""
    return any(a == ("text", f"[rank {rank}]\n") and b[0] == kind for a, b in zip(items, items[1:]))


def widget_pages(nb):
    """{tab title: text of its Output widget} from the widget state nbclient stored."""
    state = nb.metadata["widgets"]["application/vnd.jupyter.widget-state+json"]["state"]
    outputs = {f"IPY_MODEL_{k}": "".join(o.get("text", "") + str(o.get("data", {}).get("text/plain", ""))
                                          for o in v["state"].get("outputs", []))
               for k, v in state.items() if v["model_name"] == "OutputModel"}
    pages = {}
    for v in state.values():
        if v["model_name"] == "TabModel":
            pages.update(zip(v["state"]["titles"], (outputs[c] for c in v["state"]["children"])))
    return pages


def run_nb(cells, timeout):
    import nbformat
    from conftest import REPO
    from nbclient import NotebookClient
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    NotebookClient(nb, timeout=timeout, kernel_name="python3", allow_errors=True,
                   resources={"metadata": {"path": REPO}}).execute()
    return nb


def test_rich_output_tabs_and_input_without_a_pool():
    cells = [
        "%load_ext ddp_helpers",
        # a figure left open at the end of the cell
        "%%ddp -n 2\nimport matplotlib.pyplot as plt\nplt.plot([0, rank])\nprint('drawn on', rank)",
        "%%ddp -n 2\nanswer = input('answer? ')",
        "%%ddp -n 2 --tabs\nprint('hello from', rank)\nrank",
        "%%ddp -n 2\nrank * 10",
        # launch's ranks too: plt.show() and input()
        "from ddp_helpers import launch, WorkerError\ndef draw():\n    import matplotlib.pyplot as plt\n"
        "    plt.plot([1, 2])\n    plt.show()\nlaunch(draw, 2)\ntry:\n    launch(lambda: input('x? '), 1)\n"
        "except WorkerError as e:\n    print('launch:', e.exc_type)",
    ]
    nb = run_nb(cells, timeout=seconds(40))
    out = nb.cells
    items = shown(out[1])
    assert "<Figure size" not in text_of(out[1]), items
    assert label_before(items, 0, "png") and label_before(items, 1, "png"), items
    assert "[rank 0] drawn on 0" in text_of(out[1])

    error = text_of(out[2])
    assert "NoStdin" in error and "no stdin" in error and "%ddp push" in error, error
    assert "answer?" not in "".join(o.get("text", "") for o in out[2].outputs), "no half-written prompt"

    pages = widget_pages(nb)
    assert "hello from 0" in pages["rank 0"] and "hello from 1" in pages["rank 1"], pages
    assert "hello from 0" not in pages["rank 1"]
    assert "hello from" not in "".join(o.get("text", "") for o in out[3].outputs), \
        "with --tabs the printed lines go to the tabs only"
    assert "[rank 0] 0\n[rank 1] 1" in text_of(out[3])
    assert [o.output_type for o in out[4].outputs] == ["execute_result"]
    assert out[4].outputs[0].data == {"text/plain": "[rank 0] 0\n[rank 1] 10"}, "plain values as before"
    items = shown(out[5])
    assert label_before(items, 0, "png") and label_before(items, 1, "png"), items
    assert "launch: NoStdin" in text_of(out[5])


def test_warm_pool_rich_output_and_cells_on_some_ranks():
    cells = [
        "%load_ext ddp_helpers",
        "%ddp start -n 2",
        # 2: display() of an HTML object, plt.show(), a PIL image as the last value
        "%%ddp\nimport matplotlib.pyplot as plt\nfrom IPython.display import display, HTML\n"
        "from PIL import Image\ndisplay(HTML(f'<b>bold {rank}</b>'))\nplt.plot([0, rank])\nplt.show()\n"
        "print('after show', rank)\nImage.new('RGB', (4, 4), (255 * rank, 0, 0))",
        # 3: on rank 1 only
        "%%ddp -r 1\nprint('only', rank)\nrank",
        # 4, 5: a collective, a send to a rank outside the subset: refused at once
        "%%ddp --ranks 1 -t 60\nt = torch.ones(1)\ndist.all_reduce(t)",
        "%%ddp -r 0 -t 60\ndist.send(torch.ones(1), dst=1)",
        # 6-10: bad lists
        "%%ddp -r 0,0\nrank", "%%ddp -r 2\nrank", "%%ddp -r ,\nrank", "%%ddp -r one\nrank",
        "%%ddp -r -1\nrank",
        # 11, 12: input() in a rank; its prompt does not reach the next cell
        "%%ddp\nif rank == 1:\n    answer = input('answer? ')",
        "%%ddp\nt = torch.ones(1)\ndist.all_reduce(t)\nprint('next', rank, t.item())",
        # 13: on both ranks, by name, collectives are fine
        "%%ddp -r 0,1\nt = torch.ones(1)\ndist.all_reduce(t)\nt.item()",
        "%ddp stop",
        "%%ddp -r 0\nrank",
    ]
    nb = run_nb(cells, timeout=seconds(40))
    out = nb.cells
    items = shown(out[2])
    assert "<Figure size" not in text_of(out[2]) and "HTML object" not in text_of(out[2]), items
    for r in (0, 1):
        assert label_before(items, r, "html") and label_before(items, r, "png"), items
        assert ("html", f"<b>bold {r}</b>") in items, items
    pngs = [i for i, (kind, _) in enumerate(items) if kind == "png"]
    assert len(pngs) == 4, f"one figure and one image per rank: {items}"
    assert "[rank 1] after show 1" in text_of(out[2])

    assert text_of(out[3]) == "[rank 1] only 1\n[rank 1] 1", text_of(out[3])
    for cell in out[4:6]:
        text = text_of(cell)
        assert "WorkerError" in text and "plain %%ddp" in text and "--ranks" in text, text
        assert seconds_taken(cell) < seconds(10), "said at once, not at the timeout"
    assert "send" in text_of(out[5]) and "rank 1" in text_of(out[5])
    assert "dist.all_reduce(t)" in text_of(out[4]) and "distributed_c10d.py" not in text_of(out[4]), \
        "the traceback ends at the cell's line"
    for cell, words in zip(out[6:11], ["twice", "0 or 1", "no ranks", "'one'", "0 or 1"]):
        text = text_of(cell)
        assert text.startswith("UsageError: ") and words in text, text

    error = text_of(out[11])
    assert "NoStdin" in error and "no stdin" in error, error
    after = text_of(out[12])
    assert "answer?" not in after, after
    assert "[rank 0] next 0 2.0" in after and "ddp pool: started" not in after, "the pool is still up"
    assert "[rank 0] 2.0\n[rank 1] 2.0" in text_of(out[13])
    assert "no pool is running" in text_of(out[15]) and text_of(out[15]).startswith("UsageError")


def test_a_pool_knows_whether_its_ranks_see_their_collectives(capfd):
    from ddp_helpers.pool import Pool
    from ddp_helpers.runtime import rank_io
    with Pool(world_size=2) as pool:
        assert pool._sees_collectives, "torch's collectives dispatch to c10d operators here"
        assert pool.run(rank_io.collectives_visible) == [True, True]
        assert list(pool.run_cell("t = torch.ones(1)\ndist.all_reduce(t)\nt.item()")) == [2.0, 2.0], \
            "the probe sent nothing: the group is in step"
        capfd.readouterr()
        pool._sees_collectives = False   # a torch whose collectives a dispatch mode cannot see
        assert list(pool.run_cell("rank", ranks=[1])) == [1]
        assert "would wait until the timeout" in capfd.readouterr().out


def test_a_display_line_after_unfinished_text_or_a_progress_line():
    import json

    from ddp_helpers.runtime.output import MARK, _Display, _Stream
    line = (MARK + json.dumps({"data": {"text/plain": "x", "image/png": "AAA"}, "metadata": {}})).encode()
    stream = _Stream(0, "stdout")
    pieces = stream.feed(b"50%\r60%\r" + line[:20])
    assert [p for p, _ in pieces] == ["[rank 0] 50%", "\r[rank 0] 60%"], "half a display is not shown"
    pieces = stream.feed(line[20:] + b"\nasked: " + line + b"\n")
    assert isinstance(pieces[0][0], _Display) and pieces[0][0].data["image/png"] == "AAA"
    assert pieces[1][0] == "[rank 0] asked: \n", "text before a display keeps its own line"
    assert isinstance(pieces[2][0], _Display) and pieces[2][1] == b"[display: text/plain, image/png]\n"


def test_a_trailing_semicolon_hides_the_cells_value_as_in_ipython():
    from ddp_helpers.runtime.cell_exec import exec_cell
    assert exec_cell("x = 3\nx;  # hidden\n", {}, "<semicolon-1>") is None
    assert exec_cell("x = 3\nx", {}, "<semicolon-2>") == 3
    assert exec_cell("s = 'a;'\ns", {}, "<semicolon-3>") == "a;"


# ------------------------------------------------------------ large output from a rank
def _bundle_line(image_bytes, text="<noise>"):
    """One display message as a rank's send_bundle writes it: MARK + JSON + newline, an image/png
    of `image_bytes` random bytes (base64 in the JSON, as Jupyter keeps binary data)."""
    import base64
    import json
    import os

    from ddp_helpers.runtime.rank_io import MARK
    data = {"text/plain": text, "image/png": base64.b64encode(os.urandom(image_bytes)).decode()}
    return (MARK + json.dumps({"data": data, "metadata": {}}) + "\n").encode()


def _feed(stream, blob, chunk=1 << 16):
    """What the pump gets from reads of at most `chunk` bytes (a pipe's 64 KiB by default)."""
    pieces = []
    for at in range(0, len(blob), chunk):
        pieces += stream.feed(blob[at:at + chunk])
    return pieces


def _best_time(work, repeat=2):
    import time
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        result = work()
        best = min(best, time.perf_counter() - start)
    return best, result


def test_a_16_mb_image_is_read_in_linear_time():
    """One 16 MB image takes about as long as sixteen of 1 MB (the same bytes, read the same way):
    each read looks only at the new bytes. Re-joining the whole unfinished line at every 64 KiB read
    made it ~15 times as long (24 s here against 1.6 s)."""
    from ddp_helpers.runtime.output import _Display, _Stream
    small, big = _bundle_line(10**6, "<small>"), _bundle_line(16 * 10**6, "<big>")
    base, pieces = _best_time(lambda: _feed(_Stream(0, "stdout"), small * 16))
    assert [type(p) for p, _ in pieces] == [_Display] * 16
    taken, pieces = _best_time(lambda: _feed(_Stream(0, "stdout"), big))
    assert len(pieces) == 1 and isinstance(pieces[0][0], _Display), [type(p) for p, _ in pieces]
    assert pieces[0][0].data["text/plain"] == "<big>" and len(pieces[0][0].data["image/png"]) > 21 * 10**6
    assert taken < 4 * base, f"16 MB at once: {taken:.2f} s; 16 x 1 MB: {base:.2f} s"


def test_a_10_mb_print_line_is_read_in_linear_time_and_shown_once():
    """One 10 MB line, after a progress line's `\\r`, against the same bytes in lines of 64 KiB:
    about the same time, and the unfinished line is not shown again at every read."""
    from ddp_helpers.runtime.output import _Stream
    line = b"x" * (10 * 10**6)
    short = (b"y" * ((1 << 16) - 1) + b"\n") * (len(line) >> 16)
    base, _ = _best_time(lambda: _feed(_Stream(0, "stdout"), short), repeat=3)
    taken, pieces = _best_time(lambda: _feed(_Stream(0, "stdout"), b"50%\r" + line + b"\n"), repeat=3)
    shown = "".join(p for p, _ in pieces)
    assert shown.endswith("\r[rank 0] " + "x" * len(line) + "\n"), shown[-100:]
    assert len(shown) < len(line) + 5000, f"{len(shown)} characters shown for a line of {len(line)}"
    assert taken < 4 * base, f"one 10 MB line: {taken:.2f} s; 10 MB in 64 KiB lines: {base:.2f} s"


def test_a_display_over_the_limit_is_one_line(monkeypatch):
    """A display message larger than DISPLAY_LIMIT is not kept (nor shown): one line says so, what
    came before it and after it is shown as usual, and the pump never holds much more than the
    limit. The default limit: 32 MB (a 16 MB image is shown; see output.DISPLAY_LIMIT)."""
    from ddp_helpers.runtime import output
    from ddp_helpers.runtime.output import _Display, _Stream
    assert output.DISPLAY_LIMIT == 32 * 10**6
    monkeypatch.setattr(output, "DISPLAY_LIMIT", 2 * 10**6)
    line = _bundle_line(3 * 10**6)   # 4 MB as base64
    for chunk in (1 << 16, len(line) + 100):   # read in pieces, or in one read
        stream = _Stream(1, "stdout")
        held = []
        pieces = []
        for at in range(0, len(line), chunk):
            pieces += stream.feed(b"before " + line[at:at + chunk] if at == 0 else line[at:at + chunk])
            held.append(len(stream.pending))
        pieces += stream.feed(b"after\n")
        assert not any(isinstance(p, _Display) for p, _ in pieces)
        shown = [p for p, _ in pieces]
        assert shown[0] == "[rank 1] before \n" and shown[-1] == "[rank 1] after\n", shown
        assert len(shown) == 3 and shown[1].startswith("[rank 1] an image (image/png) of 4.0 MB was not "
                                                       "shown: larger than the 2 MB limit for one display; "
                                                       "save it to a file instead"), shown
        assert shown[1].count("\n") == 1 and shown[1].endswith("\n")
        assert max(held) <= 2 * 10**6 + chunk, "the pump does not keep what it will not show"


def test_a_cut_off_or_damaged_display_is_never_shown_as_text():
    """A display message that the rank's end (death, a timeout's stop) cut off, or whose JSON cannot
    be read, is one line, never megabytes of base64 in the cell."""
    from ddp_helpers.runtime.output import _Stream
    line = _bundle_line(10**6)
    stream = _Stream(0, "stdout")
    pieces = _feed(stream, b"half: " + line[:len(line) // 2]) + stream.finish()
    shown = "".join(p for p, _ in pieces)
    logged = b"".join(log for _, log in pieces)
    assert shown.startswith("[rank 0] half: \n[rank 0] an image (image/png) was cut off after 0.7 MB"), shown
    assert len(shown) < 300 and shown.count("\n") == 2 and len(logged) < 300, shown

    stream = _Stream(0, "stdout")
    damaged = line[:1000] + b'"written by another thread"' + line[1000:]
    shown = "".join(p for p, _ in _feed(stream, damaged + b"next\n"))
    assert "could not be read" in shown and len(shown) < 300 and shown.endswith("[rank 0] next\n"), shown


def test_a_pool_cell_that_ends_mid_display_keeps_the_rest_for_later(tmp_path):
    """At a warm pool cell's end the pump ends unfinished lines (`end_lines`), but a display message
    still on its way is left to finish, not called cut off."""
    import os

    from ddp_helpers.runtime.output import OutputPump, _Display
    from ddp_helpers.runtime.run_dirs import rank_file
    pump = OutputPump(str(tmp_path), 1, quiet=True)
    writer = os.open(rank_file(str(tmp_path), 0, "stdout"), os.O_WRONLY)
    try:
        line = _bundle_line(1000)
        shown = []
        pump._print = lambda printed: shown.extend(printed["stdout"])
        os.write(writer, line[:500])
        pump.drain()
        pump.end_lines()
        os.write(writer, line[500:])
        pump.drain()
        assert len(shown) == 1 and isinstance(shown[0][1], _Display), shown
    finally:
        os.close(writer)
        pump.close()


def test_large_output_from_a_launched_rank(capfd, monkeypatch):
    """End to end: a 16 MB image, a 10 MB print line, a 40 MB image (over the limit), then the rank
    dies half-way through a display. Against the same launch with everything 16 times smaller: a
    re-read of the unfinished line at each 64 KiB took 49 s for the 16 MB image alone."""
    import sys
    import time

    import pytest

    from ddp_helpers import WorkerError, launch
    if "IPython" in sys.modules:   # an IPython shell made by another test here displays the bundles
        monkeypatch.setattr(sys.modules["IPython"], "get_ipython", lambda: None)   # as text: read as a script

    def run(scale):
        start = time.perf_counter()
        with pytest.raises(WorkerError):
            launch(_large_output, 1, args=(scale,), timeout=seconds(60))
        taken = time.perf_counter() - start
        return taken, capfd.readouterr().out

    run(16)   # a process's first launch starts the fork server: not part of the baseline
    base, out = run(16)
    assert "[rank 0] <noise 1 MB>\n" in out and "<noise 2.5 MB>" in out   # under the limit at 1/16
    taken, out = run(1)
    assert "[rank 0] <noise 16 MB>\n" in out
    assert "[rank 0] " + "x" * 10**7 + "\n" in out
    assert "[rank 0] an image (image/png) of 53.3 MB was not shown: larger than the 32 MB limit" in out
    assert "[rank 0] after\n" in out
    assert "[rank 0] an image (image/png) was cut off after 1.0 MB" in out
    assert "AAAA" not in out and len(out) < 10**7 + 2000, "no base64 in the cell"
    assert taken < 3 * base + seconds(5), f"sizes x16: {taken:.1f} s; sizes x1: {base:.1f} s"


def _large_output(divide):
    """In a rank: large outputs, each `divide` times smaller; then half a display, and death."""
    import base64
    import os

    from ddp_helpers.runtime.rank_io import MARK, send_bundle

    def noise(mb):
        size = f"{mb / divide:g}"
        return {"text/plain": f"<noise {size} MB>",
                "image/png": base64.b64encode(os.urandom(int(mb * 10**6 / divide))).decode()}

    send_bundle(noise(16))
    print("x" * (10**7 // divide), flush=True)
    send_bundle(noise(40))
    print("after", flush=True)
    os.write(1, (MARK + '{"data": {"text/plain": "<cut>", "image/png": "' + "A" * (10**6 // divide)).encode())
    os._exit(3)
