"""launch and %%ddp inside a real Jupyter kernel: interrupt, kernel death, the cell magic."""
import os
import signal
import time

import nbformat
from conftest import REPO, seconds
from jupyter_client import KernelManager
from nbclient import NotebookClient
from test_launch import pid_alive

SLEEPER = '''
import os, time
from ddp_helpers import launch
def sleeper(folder):
    with open(os.path.join(folder, "pid" + os.environ["RANK"]), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(600)
'''


def run_notebook(cells, timeout, **options):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    NotebookClient(nb, timeout=timeout, kernel_name="python3", allow_errors=True,
                   resources={"metadata": {"path": REPO}}, **options).execute()
    return nb.cells


def text_of(cell):
    parts = []
    for out in cell.outputs:
        if out.output_type == "stream":
            parts.append(out.text)
        elif out.output_type == "execute_result":
            parts.append(out.data["text/plain"])
        elif out.output_type == "error":
            parts.append(f"{out.ename}: {out.evalue}\n" + "\n".join(out.traceback))
    return "".join(parts)


def wait_until_dead(pids, seconds):
    end = time.monotonic() + seconds
    while time.monotonic() < end and any(pid_alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if pid_alive(p)]


def run_cell(client, code, timeout, then=None):
    """Run `code` in the kernel and return it as a notebook cell with its outputs; `then()` is called
    once the request is sent (while the cell runs)."""
    msg_id = client.execute(code)
    if then is not None:
        then()
    outputs, deadline = [], time.monotonic() + timeout
    while True:
        msg = client.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))  # queue.Empty: too slow
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            return nbformat.v4.new_code_cell(code, outputs=outputs)
        if msg["msg_type"] in ("stream", "error", "execute_result", "display_data"):
            outputs.append(nbformat.v4.output_from_msg(msg))


def test_interrupt_button_stops_every_worker(tmp_path):
    # the kernel is interrupted (as Jupyter's Interrupt button does) once both ranks run the function
    km = KernelManager(kernel_name="python3")
    km.start_kernel(cwd=REPO)
    client = km.client()
    interrupted = []

    def interrupt_when_started():
        end = time.monotonic() + seconds(60)
        while time.monotonic() < end and not all((tmp_path / f"pid{r}").exists() for r in range(2)):
            time.sleep(0.05)
        interrupted.append(time.time())
        km.interrupt_kernel()

    try:
        client.start_channels()
        client.wait_for_ready(timeout=seconds(60))
        run_cell(client, SLEEPER, seconds(60))
        launched = run_cell(client, f"launch(sleeper, 2, args=({str(tmp_path)!r},), timeout=300)",
                            seconds(90), then=interrupt_when_started)
        after = run_cell(client, f"import time; open({str(tmp_path / 'after')!r}, 'w').write(str(time.time()))\n"
                                 "launch(lambda: 'fine', 2)", seconds(60))
    finally:
        client.stop_channels()
        km.shutdown_kernel(now=True)
    errors = [o for o in launched.outputs if o.output_type == "error"]
    assert errors and errors[0].ename == "KeyboardInterrupt", text_of(launched)
    # one line, not the launcher's internal traceback (issue 16: it was 56 lines)
    assert errors[0].traceback == ["KeyboardInterrupt: interrupted; the ranks were stopped (nothing is left running)."]
    pids = [int((tmp_path / f"pid{r}").read_text()) for r in range(2)]
    assert wait_until_dead(pids, seconds(1)) == []
    ended = float((tmp_path / "after").read_text())
    assert ended - interrupted[0] < seconds(5), "the interrupt was slow to end the cell"
    assert "['fine', 'fine']" in text_of(after), "the kernel works after an interrupt"


def test_workers_exit_when_the_kernel_dies(tmp_path):
    km = KernelManager(kernel_name="python3")
    km.start_kernel(cwd=REPO)
    try:
        client = km.client()
        client.start_channels()
        client.wait_for_ready(timeout=seconds(60))
        client.execute(SLEEPER + f"\nlaunch(sleeper, 2, args=({str(tmp_path)!r},), timeout=300)")
        end = time.monotonic() + seconds(30)
        while time.monotonic() < end and not (tmp_path / "pid1").exists():
            time.sleep(0.1)
        pids = [int((tmp_path / f"pid{r}").read_text()) for r in range(2)]
        os.kill(km.provisioner.process.pid, signal.SIGKILL)  # the kernel alone, not its process group
        assert wait_until_dead(pids, seconds(5)) == [], "workers outlived their kernel"
    finally:
        client.stop_channels()
        km.shutdown_kernel(now=True)


def test_ddp_magic_runs_the_cell_on_every_rank():
    cells = [
        "%load_ext ddp_helpers",
        "scale = 3",
        "%%ddp -n 2\nt = torch.ones(2) * (rank + 1) * scale\ndist.all_reduce(t)\nprint('sum on', rank)\nt",
        "%%ddp -n 2 -b gloo\nif rank == 1:\n    raise ValueError('boom on one rank')\nrank",
        "%%ddp -n 2\nx = 1",
        "%%ddp -n 2 -o kept\nrank * 2",
        "kept[1] + 100",
    ]
    out = run_notebook(cells, timeout=seconds(60))
    text = text_of(out[2])
    assert "[rank 0] sum on 0" in text and "[rank 1] sum on 1" in text
    assert "[rank 0] tensor([9., 9.])\n[rank 1] tensor([9., 9.])" in text
    error = [o for o in out[3].outputs if o.output_type == "error"][0]
    assert error.ename == "WorkerError"
    assert "rank 1 raised ValueError: boom on one rank" in text_of(out[3])
    assert "raise ValueError('boom on one rank')" in text_of(out[3]), "the cell's own line in the traceback"
    assert out[4].outputs == [], "no last expression, no output"
    assert text_of(out[6]) == "102", "-o keeps the per-rank values in a notebook variable"


def test_warm_pool_magics_in_a_kernel(tmp_path):
    pid_file = tmp_path / "pids"
    cells = [
        "%load_ext ddp_helpers",
        "%ddp start -n 2",
        "%%ddp\nx = torch.ones(1) * (rank + 1)",
        "%%ddp\ndist.all_reduce(x)\nx",                      # x survived the previous cell
        "lr = 0.25\n%ddp push lr",
        "%ddp pull lr",
        "import os, shutil, tempfile\n"                     # a GPU machine, as gpu_leases' tests fake one
        "saved = dict(os.environ)\n"
        "os.environ.pop('CUDA_VISIBLE_DEVICES', None)\n"
        "os.environ['DDP_HELPERS_FAKE_GPUS'] = 'GPU-aaaaaaaa-0000'\n"
        "top = tempfile.mkdtemp(dir='/tmp')\n"
        "os.environ['DDP_HELPERS_GPU_LEASES'] = os.path.join(top, 'leases')\n"
        "try:\n"
        "    get_ipython().run_line_magic('ddp', 'status')\n"
        "finally:\n"
        "    os.environ.clear(); os.environ.update(saved); shutil.rmtree(top)",
        "import time\ntime.sleep(600)",                      # an unrelated cell, interrupted
        "%%ddp\nx",                                          # idle ranks ignored that interrupt
        "from ddp_helpers.magic import DDPMagics\n"
        f"open({str(pid_file)!r}, 'w').write(' '.join(str(r['pid']) for r in DDPMagics.pool.status()))",
        "%%ddp\nimport time\ntime.sleep(600)",               # a pool cell, interrupted
        "%%ddp\nx",                                          # fresh ranks: x is gone
        "%%ddp -n 3\nrank",
        "%ddp stop",
        "%ddp bogus",
    ]
    interrupted = {cells[7]: seconds(1), cells[10]: seconds(2)}   # once they run: no need to wait longer
    out = run_notebook(cells, timeout=None, interrupt_on_timeout=True,
                       timeout_func=lambda cell: interrupted.get(cell.source, seconds(5)))
    assert "2 ranks ready (gloo)" in text_of(out[1])
    assert "[rank 0] tensor([3.])\n[rank 1] tensor([3.])" in text_of(out[3])
    assert "[rank 0] 0.25\n[rank 1] 0.25" in text_of(out[5])
    assert "rank 1: pid" in text_of(out[6]) and "idle" in text_of(out[6])
    assert "GPU 0 (GPU-aaaaaaaa-0000): free" in text_of(out[6])          # a gloo pool holds no GPU
    assert [o.ename for o in out[7].outputs if o.output_type == "error"] == ["KeyboardInterrupt"]
    assert "[rank 0] tensor([3.])" in text_of(out[8]), "an interrupt elsewhere must not touch idle ranks"
    [error] = [o for o in out[10].outputs if o.output_type == "error"]
    assert error.ename == "KeyboardInterrupt" and len(error.traceback) == 1
    assert "variables are reset" in error.traceback[0]
    old_pids = [int(p) for p in pid_file.read_text().split()]
    assert not any(pid_alive(p) for p in old_pids)
    assert "NameError" in text_of(out[11])
    assert "a pool of 2 gloo ranks is running" in text_of(out[12])
    assert "stopped" in text_of(out[13])
    assert "unknown %ddp command 'bogus'" in text_of(out[14])


def test_kernel_shutdown_leaves_no_pool_worker(tmp_path):
    km = KernelManager(kernel_name="python3")
    km.start_kernel(cwd=REPO)
    client = km.client()
    try:
        client.start_channels()
        client.wait_for_ready(timeout=seconds(60))
        reply = client.execute_interactive(
            "from ddp_helpers.pool import Pool\npool = Pool(3)\n"
            f"open({str(tmp_path / 'pids')!r}, 'w').write(' '.join(str(r['pid']) for r in pool.status()))",
            timeout=seconds(60))
        assert reply["content"]["status"] == "ok"
    finally:
        client.stop_channels()
        km.shutdown_kernel(now=False)
    pids = [int(p) for p in (tmp_path / "pids").read_text().split()]
    assert len(pids) == 3
    assert wait_until_dead(pids, seconds(5)) == []


def test_mistakes_in_the_magics_are_usage_errors_and_start_nothing():
    mistakes = {   # cell -> words the message must have
        "%%ddp -n 0\nprint('ran on', rank)": "-n",
        "%%ddp -n -1\nprint('ran on', rank)": "-n",
        "%%ddp -n 65\nprint('ran on', rank)": "between 1 and 64",
        "%%ddp -b bogus\nprint('ran on', rank)": "unknown backend 'bogus'",
        "%%ddp -t 0\nprint('ran on', rank)": "timeout must be a positive number",
        "%%ddp -o 1bad\nprint('ran on', rank)": "-o",
        "%%ddp stop\nprint('ran on', rank)": "%%ddp takes options only",
        "%ddp bogus": "unknown %ddp command 'bogus'",
        "%ddp stop": "no pool is running",
        "%ddp pull x": "no pool is running",
        "%ddp start -n 0": "-n",
        "%ddp start -b bogus": "unknown backend 'bogus'",
    }
    with_pool = {
        "%ddp push not_defined_anywhere": "not defined in the notebook: ['not_defined_anywhere']",
        "%ddp push": "no names given",
        "%ddp pull": "one variable name",
        "%ddp pull a b": "one variable name",
        "%ddp pull not_there": "no variable 'not_there'",
        "%%ddp -n 3\nprint('ran on', rank)": "a pool of 2 gloo ranks is running",
        "%ddp status extra": "takes no names",
        "%ddp start -n 0": "-n",
    }
    cells = (["%load_ext ddp_helpers"] + list(mistakes) + ["%ddp start -n 2"] + list(with_pool)
             + ["%%ddp\nprint('ran on', rank)", "%ddp stop"])
    out = run_notebook(cells, timeout=seconds(60))
    expected = [None] + list(mistakes.values()) + [None] + list(with_pool.values())
    for cell, source, words in zip(out, cells, expected):
        if words is None:
            continue
        text = text_of(cell)
        assert text.startswith("UsageError: ") and words in text, (source, text)
        assert "Traceback" not in text and "[rank" not in text, (source, text)
    assert "ddp pool: 2 ranks ready" in text_of(out[len(mistakes) + 1])
    after = text_of(out[-2])
    assert "[rank 0] ran on 0" in after and "[rank 1] ran on 1" in after, "the pool survives the mistakes"


def test_pool_notices_come_before_the_cells_output_on_stdout():
    cells = ["%load_ext ddp_helpers", "%ddp start -n 2",
             "%%ddp\nprint('bye from', rank)\ndist.destroy_process_group()",
             "%%ddp\nprint('hello from', rank)", "%ddp stop"]
    out = run_notebook(cells, timeout=seconds(60))
    for cell in out[2:4]:
        assert [o.name for o in cell.outputs if o.output_type == "stream" and o.name == "stderr"] == [], \
            f"information is not an error: {cell.outputs}"
    assert text_of(out[2]).index("[rank 0] bye from 0") < text_of(out[2]).index("destroyed the process group")
    text = text_of(out[3])
    assert text.startswith("ddp pool: started 2 new ranks"), text
    assert "[rank 0] hello from 0" in text
