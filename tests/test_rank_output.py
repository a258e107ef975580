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
    from nbclient import NotebookClient
    from conftest import REPO
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
    from ddp_helpers.runtime import rank_io
    from ddp_helpers.pool import Pool
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
    from ddp_helpers.runtime.worker import exec_cell
    assert exec_cell("x = 3\nx;  # hidden\n", {}, "<semicolon-1>") is None
    assert exec_cell("x = 3\nx", {}, "<semicolon-2>") == 3
    assert exec_cell("s = 'a;'\ns", {}, "<semicolon-3>") == "a;"
