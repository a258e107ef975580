"""The fork server's private bytecode cache (`ddp_helpers.runtime.bytecode_cache`).

Where Python may not keep compiled bytecode beside the sources (`PYTHONDONTWRITEBYTECODE=1`, a read-only
image) and torch ships none, every new process compiles torch from source. The fork server then keeps
what it compiles in a folder of this user's alone, and the next fork server reads it.
"""
import os
import stat
import subprocess
import sys
import textwrap

import pytest
from conftest import REPO

PROBE = textwrap.dedent("""
    import sys
    from ddp_helpers.runtime import bytecode_cache
    print(bytecode_cache.needed(sys.argv[1]))
""")


def fresh_python(code, *args, env=None, timeout=120):
    environment = {**os.environ, "PYTHONPATH": REPO, **(env or {})}
    done = subprocess.run([sys.executable, "-c", code, *args], env=environment, capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.fixture
def package(tmp_path):
    """A package whose bytecode is not beside its source."""
    folder = tmp_path / "site" / "shipped_bare"
    folder.mkdir(parents=True)
    (folder / "__init__.py").write_text("VALUE = 1\n")
    return folder


def test_it_is_needed_only_where_bytecode_is_missing_and_cannot_be_written(package):
    site = str(package.parent)
    no_writing = {"PYTHONDONTWRITEBYTECODE": "1", "PYTHONPATH": f"{REPO}{os.pathsep}{site}"}
    assert fresh_python(PROBE, "shipped_bare", env=no_writing) == "True"
    writing = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{site}"}
    writing.pop("PYTHONDONTWRITEBYTECODE", None)
    done = subprocess.run([sys.executable, "-c", PROBE, "shipped_bare"], env=writing,
                          capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "False", done.stderr     # Python keeps it beside the source itself
    subprocess.run([sys.executable, "-m", "py_compile", str(package / "__init__.py")], env=writing,
                   check=True, timeout=120)                 # the bytecode is there: nothing to do
    assert fresh_python(PROBE, "shipped_bare", env=no_writing) == "False"
    assert fresh_python(PROBE, "shipped_bare", env={**no_writing, "PYTHONPYCACHEPREFIX": site}) == "False"


USE = textwrap.dedent("""
    import sys
    from ddp_helpers.runtime import bytecode_cache
    print(bytecode_cache.use(), sys.pycache_prefix, sys.dont_write_bytecode)
""")


@pytest.mark.parametrize("unsafe", ["others may write", "a link", "no folder"])
def test_a_folder_not_private_is_not_used(tmp_path, unsafe):
    target = tmp_path / "cache"
    if unsafe == "others may write":
        target.mkdir(mode=0o700)
        os.chmod(target, 0o777)
    elif unsafe == "a link":
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        target.symlink_to(tmp_path / "elsewhere")
    else:
        target.write_text("a file")
    out = fresh_python(USE, env={"DDP_HELPERS_BYTECODE_CACHE": str(target), "PYTHONDONTWRITEBYTECODE": "1"})
    assert out == "None None True"


def test_a_private_folder_is_made_and_used(tmp_path):
    target = tmp_path / "made" / "pycache"
    out = fresh_python(USE, env={"DDP_HELPERS_BYTECODE_CACHE": str(target), "PYTHONDONTWRITEBYTECODE": "1"})
    assert out == f"{target} {target} False"
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o700
    assert fresh_python(USE, env={"DDP_HELPERS_BYTECODE_CACHE": "0", "PYTHONDONTWRITEBYTECODE": "1"}) \
        == "None None True"


LAUNCH = textwrap.dedent("""
    from ddp_helpers import launch

    def where():
        import sys
        import torch
        preloaded = "torch._dynamo" in sys.modules and "torchvision" in sys.modules
        import torchvision  # noqa: F401   (as a rank that trains a ResNet does; torch._dynamo with it)
        return sys.pycache_prefix, preloaded

    print(*launch(where, 1, backend="gloo")[0])
""")


def test_the_fork_server_compiles_torch_once_and_its_ranks_share_it(tmp_path):
    """Two fresh programs in a row: the first fork server writes torch's bytecode into the folder, its
    rank runs with it, and the second server reads those files rather than writing them again.
    torch._dynamo and torchvision, which take as long as torch to compile, are not in the folder for
    the first server: it leaves them out (its first launch is seconds sooner), the rank that trains
    compiles them into the folder, and the second server has them imported for its ranks."""
    target = tmp_path / "pycache"
    env = {"DDP_HELPERS_BYTECODE_CACHE": str(target), "PYTHONDONTWRITEBYTECODE": "1",
           "DDP_HELPERS_EARLY_FORKSERVER": "0"}
    assert fresh_python(LAUNCH, env=env, timeout=300) == f"{target} False"
    import torch
    compiled = os.path.join(str(target) + os.path.dirname(os.path.abspath(torch.__file__)),
                            f"__init__.{sys.implementation.cache_tag}.pyc")
    assert os.path.exists(compiled), sorted(os.listdir(target))
    written = os.stat(compiled).st_mtime_ns
    assert fresh_python(LAUNCH, env=env, timeout=300) == f"{target} True"
    assert os.stat(compiled).st_mtime_ns == written       # read, not compiled again


def test_without_a_cache_the_fork_server_imports_torch_dynamo_for_its_ranks():
    """Where no bytecode is kept, the server imports torch._dynamo and torchvision once, rather than
    every rank that trains."""
    env = {"DDP_HELPERS_BYTECODE_CACHE": "0", "DDP_HELPERS_EARLY_FORKSERVER": "0"}
    assert fresh_python(LAUNCH, env=env, timeout=300) == "None True"


HAS = textwrap.dedent("""
    import sys
    from ddp_helpers.runtime import bytecode_cache
    print(bytecode_cache.has_bytecode(sys.argv[1]))
""")


def test_has_bytecode_says_whether_importing_would_compile(package):
    """What the fork server asks before it imports torch._dynamo: compiled from source, it would take
    as long as torch."""
    import py_compile
    env = {"PYTHONDONTWRITEBYTECODE": "1", "PYTHONPATH": f"{REPO}{os.pathsep}{package.parent}"}
    assert fresh_python(HAS, "shipped_bare", env=env) == "False"
    assert fresh_python(HAS, "no_such_module", env=env) == "False"
    py_compile.compile(str(package / "__init__.py"), doraise=True)    # beside it, in __pycache__
    assert fresh_python(HAS, "shipped_bare", env=env) == "True"
    assert fresh_python(HAS, "shipped_bare", env={**env, "PYTHONPYCACHEPREFIX": str(package.parent / "elsewhere")}) \
        == "False"                                                    # read from the prefix only
    bare = package.parent / "bytecode_only"
    bare.mkdir()
    py_compile.compile(str(package / "__init__.py"), cfile=str(bare / "__init__.pyc"), doraise=True)
    assert fresh_python(HAS, "bytecode_only", env=env) == "True"     # no source: nothing to compile
