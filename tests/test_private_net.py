"""The ranks' network is their own: another local user (and even the kernel's own network) cannot
connect to a launch's or a warm pool's sockets: the rendezvous store and the ranks' Gloo sockets.

A security property, on by default: where this machine cannot test it (no root for a second user, no
network namespace for the ranks), each test is skipped with the reason, and in CI (CI=true) fails with
it (conftest.cannot_run), as the browser tests do."""
import encodings.idna  # noqa: F401 (the second user may not read Python's own files: imported here first)
import os
import pwd
import socket
import subprocess
import sys
import textwrap
import time
from functools import cache

import psutil
import pytest
from conftest import REPO, cannot_run, seconds

from ddp_helpers import WorkerError, launch
from ddp_helpers.pool import Pool
from ddp_helpers.runtime import private_net

SHARED = "ddp_helpers: the ranks use this machine's network"   # the launcher's line where it must


@cache
def why_not_private():
    """None where a launch from this process gives the ranks a network of their own; else why not, as the
    launcher says it (one launch of one rank in a fresh Python: its line, or its error)."""
    if not private_net.wanted():
        return f"{private_net.SWITCH}=0 is set"
    probe = subprocess.run([sys.executable, "-c", "from ddp_helpers import launch; launch(lambda: 0, 1)"],
                           capture_output=True, text=True, env={**os.environ, "PYTHONPATH": REPO},
                           timeout=seconds(60))
    said = [line for line in probe.stdout.splitlines() if SHARED in line]
    if said:
        return said[0]
    return None if probe.returncode == 0 else f"a launch failed: {probe.stderr.strip()[-300:]}"


def needs_private_network():
    why = why_not_private()
    if why:
        cannot_run(f"private network: the ranks get no network of their own here ({why})")


def needs_root():
    if os.geteuid() != 0:
        cannot_run("private network: switching to a second local user needs root")


def listening_ports():
    """The TCP ports listening where this process is (the ranks' own network, in a rank)."""
    return sorted({c.laddr.port for c in psutil.net_connections("tcp") if c.status == psutil.CONN_LISTEN})


def report_ports_then_wait(folder):
    ports = listening_ports()
    with open(os.path.join(folder, f"ports{os.environ['RANK']}"), "w") as f:
        f.write(" ".join(map(str, ports)) + f" {os.environ['MASTER_PORT']}")
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(folder, "done")) and time.monotonic() < deadline:
        time.sleep(0.05)
    return ports


def second_user():
    """A local user other than this one: one made for the test where `useradd` exists, else `nobody`."""
    name = "ddp_helpers_other"
    try:
        return pwd.getpwnam(name)
    except KeyError:
        pass
    if subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
                      capture_output=True).returncode == 0:
        return pwd.getpwnam(name)
    return pwd.getpwnam("nobody")


def connections_as(user, ports):
    """Try to connect to 127.0.0.1:port for each port, as `user`; {port: "refused" or "CONNECTED"}."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:   # the child becomes the other user, tries, reports, and leaves at once
        try:
            os.close(read)
            os.setgroups([])
            os.setgid(user.pw_gid)
            os.setuid(user.pw_uid)
            verdicts = []
            for port in ports:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=2).close()
                    verdicts.append(f"{port}:CONNECTED")
                except OSError:
                    verdicts.append(f"{port}:refused")
            os.write(write, " ".join(verdicts).encode())
        except BaseException as exc:
            os.write(write, f"error:{type(exc).__name__}_{exc}".replace(" ", "_").encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        text = f.read()
    os.waitpid(pid, 0)
    assert not text.startswith("error:"), text
    return dict(item.split(":", 1) for item in text.split())


def wait_for_files(folder, names):
    deadline = time.monotonic() + seconds(20)
    while not all((folder / n).exists() for n in names) and time.monotonic() < deadline:
        time.sleep(0.05)


def test_another_user_cannot_connect_to_a_running_launch_or_an_idle_pool(tmp_path):
    import threading
    needs_root()
    needs_private_network()
    user = second_user()
    assert user.pw_uid != os.getuid()
    results = {}
    runner = threading.Thread(target=lambda: results.update(
        ranks=launch(report_ports_then_wait, 2, args=(str(tmp_path),), timeout=seconds(30), quiet=True)))
    runner.start()
    try:
        wait_for_files(tmp_path, ["ports0", "ports1"])
        ports = sorted({int(p) for r in (0, 1) for p in (tmp_path / f"ports{r}").read_text().split()})
        store_port = int((tmp_path / "ports0").read_text().split()[-1])
        assert store_port in ports and len(ports) >= 3, ports   # the store and each rank's Gloo socket
        # before: the store (in the kernel) and the ranks' sockets listened on the machine's 127.0.0.1
        assert set(connections_as(user, ports).values()) == {"refused"}, connections_as(user, ports)
        assert set(connections_as(pwd.getpwuid(os.getuid()), ports).values()) == {"refused"}
    finally:
        (tmp_path / "done").touch()
        runner.join()
    assert len(results["ranks"]) == 2, "the ranks themselves reached each other and the store"

    with Pool(world_size=2) as pool:
        inside = pool.run(listening_ports)[0]
        assert len(inside) >= 3, inside
        assert set(connections_as(user, inside).values()) == {"refused"}


def test_the_switch_puts_the_ranks_on_the_machines_network():
    needs_private_network()   # before: where there was none, the test saw the launcher's notice and passed
    script = textwrap.dedent("""
        import os, socket
        from ddp_helpers import launch
        port = int(launch(lambda: os.environ["MASTER_PORT"], 1)[0])
        def connect_from_the_rank(port):
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
            return "reached"
        print("shared:", launch(connect_from_the_rank, 1, args=(port,))[0])
    """)
    # a port of this test process's network: a rank can reach it only on the machine's network
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        script = script.replace("args=(port,)", f"args=({port},)")
        env = {**os.environ, "PYTHONPATH": REPO}
        off = subprocess.run([sys.executable, "-c", script], env={**env, private_net.SWITCH: "0"},
                             capture_output=True, text=True, timeout=seconds(60))
        assert "shared: reached" in off.stdout, off.stderr[-2000:]
        assert SHARED not in off.stdout, "no notice when turned off"
        on = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                            timeout=seconds(60))
    # a private network: the rank cannot reach this process's port
    assert on.returncode != 0 and "ConnectionRefusedError" in on.stderr, (on.stdout, on.stderr[-2000:])


def reach_the_internet():
    socket.create_connection(("download.pytorch.org", 443), timeout=5).close()


def test_a_rank_that_reaches_for_the_internet_is_told_why_it_cannot():
    needs_private_network()
    with pytest.raises(WorkerError) as caught:
        launch(reach_the_internet, 1, timeout=seconds(20))
    assert "ranks have no network but their own: download in the notebook, or set " \
           f"{private_net.SWITCH}=0" in str(caught.value)


def run_these_tests(env, select="not where_they_cannot_run"):   # never this test itself
    assert "not where_they_cannot_run" in select
    return subprocess.run([sys.executable, "-m", "pytest", "-n", "0", "-p", "no:cacheprovider", "-rfs", "-q",
                           "--no-header", __file__, "-k", select],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=seconds(120))


def test_where_they_cannot_run_they_fail_in_ci_and_skip_elsewhere():
    # before: the switch test passed and the internet test was skipped without a word in CI, and the
    # other-user test failed on its assert, not on the reason. DDP_HELPERS_PRIVATE_NET=0: this
    # process's ranks get no network of their own, as on a machine that refuses namespaces.
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "PYTEST_XDIST_WORKER")}
    env.update({private_net.SWITCH: "0",   # the repository first, then the path the suite had (its packages)
                "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))})
    ci = run_these_tests({**env, "CI": "true"})
    assert ci.returncode == 1 and "3 failed" in ci.stdout, ci.stdout[-3000:]
    reason = f"the ranks get no network of their own here ({private_net.SWITCH}=0 is set)"
    assert ci.stdout.count(reason) >= 3 and "CI must run it" in ci.stdout, ci.stdout[-3000:]
    elsewhere = run_these_tests(env)   # outside CI: skipped, with the reason
    assert elsewhere.returncode == 0 and "3 skipped" in elsewhere.stdout, elsewhere.stdout[-3000:]
    assert reason in elsewhere.stdout and "CI must run it" not in elsewhere.stdout, elsewhere.stdout[-3000:]
