"""pdb in a rank, from the notebook cell: `%ddp debug` after a cell raised, and breakpoints.

A real Jupyter kernel is driven through its stdin channel, as a person at JupyterLab's input box
would answer pdb's prompts (`input_request` messages, answered with `client.input`); nbclient runs
(no stdin, as nbval) use the commands given up front; a plain script without a terminal has no one
to answer.
"""
import os
import queue
import subprocess
import sys
import textwrap
import time

import pytest
from conftest import REPO, seconds
from jupyter_client import KernelManager
from test_kernel import run_notebook, text_of, wait_until_dead

UNEVEN = """%%ddp
batch = torch.zeros(4 - rank, 3)   # rank 1's last batch is one row short
flat = batch.view(4, 3)
"""


@pytest.fixture
def kernel():
    km = KernelManager(kernel_name="python3")
    km.start_kernel(cwd=REPO)
    client = km.client()
    client.start_channels()
    client.wait_for_ready(timeout=seconds(20))
    try:
        yield km, client
    finally:
        client.stop_channels()
        km.shutdown_kernel(now=True)


def execute(client, code, answers=(), timeout=60):
    """Run `code`; answer each input_request with the next of `answers` (a string, or a function
    called instead). Returns (stream and error text, the prompts asked)."""
    answers, prompts, text = list(answers), [], []
    msg_id = client.execute(code, allow_stdin=True)
    deadline = time.monotonic() + seconds(timeout)
    while time.monotonic() < deadline:
        try:
            msg = client.get_stdin_msg(timeout=0.05)
        except queue.Empty:
            pass
        else:
            if msg["msg_type"] == "input_request":
                prompts.append(msg["content"]["prompt"])
                assert answers, f"an unexpected prompt {prompts[-1]!r} after {''.join(text)!r}"
                answer = answers.pop(0)
                answer() if callable(answer) else client.input(answer)
        try:
            msg = client.get_iopub_msg(timeout=0.05)
        except queue.Empty:
            continue
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        kind, content = msg["msg_type"], msg["content"]
        if kind == "status" and content["execution_state"] == "idle":
            return "".join(text), prompts
        if kind == "stream":
            text.append(content["text"])
        elif kind == "execute_result":
            text.append(content["data"]["text/plain"] + "\n")
        elif kind == "error":
            text.append(f"{content['ename']}: {content['evalue']}\n")
    raise AssertionError(f"the cell did not end in {seconds(timeout)} s: {''.join(text)!r}, prompts {prompts}")


def pool_pids(client):
    text, _ = execute(client, "from ddp_helpers.magic import DDPMagics\n"
                              "print(' '.join(str(r['pid']) for r in DDPMagics.pool.status()))")
    return [int(p) for p in text.split()]


def test_post_mortem_prints_a_local_of_the_rank_that_raised_and_quits(kernel):
    _, client = kernel
    execute(client, "%load_ext ddp_helpers")
    assert "2 ranks ready" in execute(client, "%ddp start -n 2")[0]
    pids = pool_pids(client)
    text, _ = execute(client, UNEVEN)
    assert "rank 1 raised RuntimeError" in text
    text, prompts = execute(client, "%ddp debug", answers=["p batch.shape", "q"])
    assert prompts == ["[rank 1] (Pdb) ", "[rank 1] (Pdb) "]
    assert "[rank 1] -> flat = batch.view(4, 3)" in text
    assert "[rank 1] torch.Size([3, 3])" in text
    # the pool still works, with the same ranks and their variables
    text, _ = execute(client, "%%ddp\nbatch.shape[0]")
    assert text == "[rank 0] 4\n[rank 1] 3\n", text
    assert pool_pids(client) == pids
    text, _ = execute(client, "%ddp debug 0")
    assert "UsageError: %ddp debug: nothing to debug: no rank raised in the last cell" in text
    execute(client, UNEVEN)
    text, _ = execute(client, "%ddp debug 0")
    assert "UsageError: %ddp debug: rank 0 did not raise in the last cell (rank(s) [1] did)" in text
    text, _ = execute(client, "%ddp stop\n%ddp debug")
    assert "UsageError: no pool is running" in text


def test_a_breakpoint_on_rank_1_of_2_continues_and_its_wait_does_not_count(kernel):
    _, client = kernel
    execute(client, "%load_ext ddp_helpers")

    limit = seconds(3)   # the cell's -t (and its group's timeout): long enough to start 2 ranks here

    def after_the_timeout():
        time.sleep(limit + 1)   # longer than the cell's -t: the time at the prompt does not count
        client.input("c")

    # dist.breakpoint: the other rank waits in its barrier (with the group's timeout raised, as
    # torch's does: this cell's group has the cell's -t), then both meet in the all_reduce
    cell = f"%%ddp -t {limit:g}\ny = rank * 10\ndist.breakpoint(1)\nt = torch.tensor([y])\ndist.all_reduce(t)\nt.item()"
    text, prompts = execute(client, cell, answers=["p y", after_the_timeout])
    assert prompts == ["[rank 1] (Pdb) ", "[rank 1] (Pdb) "]
    assert "[rank 1] > <ddp-cell-1>(2)<module>()\n[rank 1] -> dist.breakpoint(1)\n" in text
    assert "[rank 1] 10\n" in text
    assert text.endswith("[rank 0] 10\n[rank 1] 10\n"), text


def test_q_at_a_breakpoint_lets_every_rank_go_on(kernel):
    _, client = kernel
    execute(client, "%load_ext ddp_helpers\n%ddp start -n 2")
    pids = pool_pids(client)
    cell = "%%ddp\nx = rank + 1\nif rank == 1:\n    breakpoint()\nt = torch.tensor([x])\ndist.all_reduce(t)\nt.item()"
    text, prompts = execute(client, cell, answers=["p x", "q"])
    assert prompts == ["[rank 1] (Pdb) ", "[rank 1] (Pdb) "]
    assert "[rank 1] -> t = torch.tensor([x])\n" in text and "[rank 1] 2\n" in text
    assert text.endswith("[rank 0] 3\n[rank 1] 3\n"), text
    text, prompts = execute(client, "%%ddp\nbreakpoint()\nrank", answers=["q", "q"])
    assert sorted(prompts) == ["[rank 0] (Pdb) ", "[rank 1] (Pdb) "] and text.endswith("[rank 0] 0\n[rank 1] 1\n"), text
    assert pool_pids(client) == pids


def test_an_interrupt_at_the_prompt_ends_the_session_and_leaves_nothing(kernel):
    km, client = kernel
    execute(client, "%load_ext ddp_helpers\n%ddp start -n 2")
    pids = pool_pids(client)
    run_dir, _ = execute(client, "print(DDPMagics.pool.run_dir, end='')")
    text, prompts = execute(client, "%%ddp\nif rank == 1:\n    breakpoint()\nrank", answers=[km.interrupt_kernel])
    assert prompts == ["[rank 1] (Pdb) "]
    assert "KeyboardInterrupt" in text and "variables are reset" in text, text
    assert not wait_until_dead(pids, seconds(10)), "the interrupted ranks must end"
    assert not os.path.exists(os.path.join(run_dir, "pdb.sock"))
    text, _ = execute(client, "%%ddp\nrank")
    assert text.endswith("[rank 0] 0\n[rank 1] 1\n"), text
    # an Interrupt in a post-mortem (no collective runs) ends the session; the ranks stay as they were
    pids = pool_pids(client)
    execute(client, UNEVEN)
    text, prompts = execute(client, "%ddp debug", answers=["p batch.shape", km.interrupt_kernel])
    assert prompts == ["[rank 1] (Pdb) ", "[rank 1] (Pdb) "] and "[rank 1] torch.Size([3, 3])" in text
    assert "KeyboardInterrupt: the debugging session was ended; the rank keeps its variables." in text, text
    text, _ = execute(client, "%%ddp\nbatch.shape[0]")
    assert text == "[rank 0] 4\n[rank 1] 3\n", text
    assert pool_pids(client) == pids


def test_commands_given_up_front_answer_without_stdin(tmp_path):
    # nbclient, as nbval runs a notebook: the kernel has no stdin
    cells = ["%load_ext ddp_helpers\n%ddp start -n 2", UNEVEN,
             "%ddp debug",   # no one could answer: the commands must be given
             '%ddp debug 1 -c "p batch.shape" -c "q"',
             '%%ddp --pdb "p y;; c"\ny = rank * 10\nif rank == 1:\n    breakpoint()\ny',
             "%%ddp\nif rank == 1:\n    breakpoint()\nrank",
             # rank 0 waits for rank 1 in a collective: it is stopped, rank 1 stays for %ddp debug
             "%%ddp\nx = rank + 5\nif rank == 1:\n    raise ValueError('only rank 1')\ndist.barrier()",
             '%ddp debug -c "p x"',
             "%%ddp\nrank",
             "%ddp debug",
             "%ddp stop"]
    out = run_notebook(cells, timeout=seconds(60))
    assert "no one can answer pdb's prompts here (this kernel has no stdin)" in text_of(out[2])
    assert text_of(out[3]) == ("[rank 1] > <ddp-cell-1>(2)<module>()\n[rank 1] -> flat = batch.view(4, 3)\n"
                               "[rank 1] (Pdb) p batch.shape\n[rank 1] torch.Size([3, 3])\n[rank 1] (Pdb) q\n")
    assert text_of(out[4]) == ("[rank 1] > <ddp-cell-2>(4)<module>()\n[rank 1] -> y\n"
                               "[rank 1] (Pdb) p y;; c\n[rank 1] 10\n[rank 0] 0\n[rank 1] 10"), text_of(out[4])
    assert text_of(out[5]) == ("[rank 1] breakpoint() at <ddp-cell-3>:2: no one to answer here; continuing\n"
                               "[rank 0] 0\n[rank 1] 1"), text_of(out[5])
    assert "so they were stopped; rank 1 stays for `%ddp debug` until the next cell" in text_of(out[6])
    assert text_of(out[7]) == ("[rank 1] > <ddp-cell-4>(3)<module>()\n[rank 1] -> raise ValueError('only rank 1')\n"
                               "[rank 1] (Pdb) p x\n[rank 1] 6\n[rank 1] (Pdb) q\n"), text_of(out[7])
    assert text_of(out[8]) == ("ddp pool: started 2 new ranks (gloo); their variables are empty.\n"
                               "[rank 0] 0\n[rank 1] 1"), text_of(out[8])
    assert "nothing to debug: no rank raised in the last cell" in text_of(out[9])


SCRIPT = '''
import torch.distributed as dist
from ddp_helpers import launch

def f():
    x = dist.get_rank() * 10
    if dist.get_rank() == 1:
        breakpoint()
    dist.breakpoint(0)
    return x + 1

print(launch(f, world_size=2, timeout=60))
'''


@pytest.mark.parametrize("hook", [None, "0"])
def test_a_breakpoint_in_a_launched_function_from_a_script_without_stdin_continues(tmp_path, hook):
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(SCRIPT))
    env = {**os.environ, "PYTHONPATH": REPO}
    env.pop("PYTHONBREAKPOINT", None)
    if hook is not None:
        env["PYTHONBREAKPOINT"] = hook
    done = subprocess.run([sys.executable, str(script)], stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, env=env, timeout=seconds(60))
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.endswith("[1, 11]\n"), done.stdout
    notices = sorted(line for line in done.stdout.splitlines() if "no one to answer" in line)
    rank0 = f"[rank 0] dist.breakpoint(0) at {script}:9: no one to answer here; continuing"
    rank1 = f"[rank 1] breakpoint() at {script}:8: no one to answer here; continuing"
    assert notices == ([rank0] if hook == "0" else [rank0, rank1]), done.stdout
    assert "Pdb" not in done.stdout + done.stderr
