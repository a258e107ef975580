"""The package's layout: what learners type still works, and the house rules hold.

- Every `ddp_helpers` name the notebooks, README and site use can be imported (paths learners type;
  `python -m ddp_helpers.train` and `python -m ddp_helpers.bench` run in test_train and test_bench).
- No module is over 450 lines; every package is listed in pyproject.toml.
- The reference trainer imports nothing from the launch machinery (its source is read in notebook 06),
  nor does `import ddp_helpers` outside a Jupyter kernel.
- The imports have no circle, and none goes back up (scripts/import_graph.py draws them).
"""
import importlib
import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest
from conftest import REPO

PACKAGE = os.path.join(REPO, "ddp_helpers")
MAX_LINES = 450
# The reference trainer has its own rule instead: one file, read top to bottom in notebook 06, however
# long training needs it to be; what is not training lives elsewhere (checkpoint_files, compat, progress).
UNCAPPED = {os.path.join("ddp_helpers", "train.py")}


def _modules():
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                yield os.path.join(folder, name)


def _learner_text():
    """(where, text) of every notebook code cell, and the README and site pages."""
    folder = os.path.join(REPO, "notebooks")
    for name in sorted(os.listdir(folder)):
        if name.endswith(".ipynb"):
            with open(os.path.join(folder, name)) as f:
                cells = json.load(f)["cells"]
            for i, cell in enumerate(cells):
                yield f"{name} cell {i}", "".join(cell["source"])
    pages = [os.path.join(REPO, "README.md"), os.path.join(REPO, "notebooks", "instructors.md")]
    docs = os.path.join(REPO, "docs")
    pages += [os.path.join(docs, n) for n in sorted(os.listdir(docs)) if n.endswith(".md")]
    for page in pages:
        if os.path.exists(page):
            with open(page) as f:
                yield os.path.relpath(page, REPO), f.read()


FROM_IMPORT = re.compile(r"^\s*from (ddp_helpers(?:\.\w+)*) import \(?([\w ,\n]+?)\)?\s*(?:#.*)?$", re.M)
DOTTED = re.compile(r"\b(ddp_helpers(?:\.\w+)+)")


def test_every_ddp_helpers_name_the_lessons_use_can_be_imported():
    problems = []
    for where, text in _learner_text():
        for module, names in FROM_IMPORT.findall(text):
            try:
                imported = importlib.import_module(module)
            except ImportError as err:
                problems.append(f"{where}: from {module} import ...: {err}")
                continue
            for name in (n.split(" as ")[0].strip() for n in names.split(",")):
                if name and name != "*" and not hasattr(imported, name):
                    try:
                        importlib.import_module(f"{module}.{name}")
                    except ImportError:
                        problems.append(f"{where}: from {module} import {name}: no such name")
        for dotted in set(DOTTED.findall(text)):
            parts = dotted.split(".")
            for cut in range(len(parts), 0, -1):   # the longest module, then attributes on it
                try:
                    obj = importlib.import_module(".".join(parts[:cut]))
                    break
                except ImportError:
                    continue
            for attr in parts[cut:]:
                if attr in ("py", "ipynb", "md"):
                    break   # a file name: ddp_helpers/solutions.py written with dots
                if not hasattr(obj, attr):
                    problems.append(f"{where}: {dotted}: no {attr!r} in {obj.__name__}")
                    break
                obj = getattr(obj, attr)
    assert not problems, "\n".join(problems)


def test_named_checkers_and_solution_file_are_where_the_lessons_say():
    from ddp_helpers import exercises
    used, elsewhere = set(), []
    for where, text in _learner_text():
        used.update(re.findall(r"exercises\.(check_\w+)", text))
        elsewhere += [f"{where}: {m}" for m in re.findall(r"\b(?!exercises\.)\w+\.check_\w+\(", text)]
    assert used, "no checker found in the notebooks: the pattern is out of date"
    assert [name for name in sorted(used) if not callable(getattr(exercises, name, None))] == []
    assert not elsewhere, f"a checker has one home, ddp_helpers.exercises: {elsewhere}"
    assert os.path.isfile(os.path.join(PACKAGE, "solutions.py"))


def test_no_module_is_over_450_lines():
    long = {os.path.relpath(p, REPO): n for p in _modules() if (n := len(open(p).read().splitlines())) > MAX_LINES
            and os.path.relpath(p, REPO) not in UNCAPPED}
    assert not long, f"split these along their seams (at most {MAX_LINES} lines): {long}"


def test_every_package_is_listed_in_pyproject():
    with open(os.path.join(REPO, "pyproject.toml")) as f:
        listed = set(re.search(r"^packages = \[(.*)\]$", f.read(), re.M).group(1).replace('"', "").split(", "))
    found = {os.path.relpath(folder, REPO).replace(os.sep, ".") for folder, _, files in os.walk(PACKAGE)
             if "__init__.py" in files}
    assert found == listed


def _drawing():
    """scripts/import_graph.py: the package's own imports, read with ast."""
    spec = importlib.util.spec_from_file_location("import_graph", os.path.join(REPO, "scripts", "import_graph.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules["import_graph"] = module   # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


def test_the_imports_have_no_circle_and_none_goes_back_up():
    graph = _drawing()
    drawing = graph.draw(REPO)
    assert len(drawing.rooms) > 50 and drawing.floors > 3, graph.report(drawing)   # the drawing sees the package
    assert drawing.circles == [], graph.report(drawing)
    assert drawing.closing == [], graph.report(drawing)   # nor one that a function-level import would close
    assert drawing.back_up == [], graph.report(drawing)
    assert drawing.back_up_later == [], graph.report(drawing)   # nor one made at call time


def test_the_trainer_imports_nothing_from_the_launch_machinery():
    """What importing ddp_helpers.train runs, the package's own __init__ included (importing a.b runs a
    first): module-level imports, read with ast."""
    loaded = _drawing().reach("ddp_helpers.train", REPO)
    assert "ddp_helpers" in loaded   # the package's __init__ is followed
    machinery = sorted(n for n in loaded if n.startswith("ddp_helpers.runtime")
                       or n in ("ddp_helpers.launcher", "ddp_helpers.pool", "ddp_helpers.magic"))
    assert not machinery, f"train.py reaches {machinery} (all it imports: {sorted(loaded)})"


@pytest.mark.parametrize("name, not_loaded", [
    ("ddp_helpers.speed.cuda_graph", ["ddp_helpers.train"]),
    # torchrun -m ddp_helpers.train on a GPU cluster: no launcher, no fork server, no IPython
    ("ddp_helpers.train", ["ddp_helpers.launcher", "ddp_helpers.runtime", "ddp_helpers.runtime.forkserver",
                           "ddp_helpers.runtime.supervisor", "IPython"]),
    # the package itself, outside a Jupyter kernel: nothing of the launch machinery until it is used
    ("ddp_helpers", ["ddp_helpers.launcher", "ddp_helpers.runtime", "ddp_helpers.runtime.forkserver"])])
def test_a_module_loads_only_what_it_needs(name, not_loaded):
    code = f"import sys, {name}; print(sorted(m for m in sys.modules if m.startswith(('ddp_helpers.', 'IPython'))))"
    env = {k: v for k, v in os.environ.items() if k != "DDP_HELPERS_EARLY_FORKSERVER"}
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    loaded = eval(done.stdout)
    assert [m for m in not_loaded if m in loaded] == [], loaded


def test_c10d_operator_names_have_one_home():
    """runtime.c10d_names says what the c10d operators are called; the spies and rank_io ask it."""
    from ddp_helpers.exercises import spies
    from ddp_helpers.runtime import c10d_names, rank_io
    assert spies.collective_name is c10d_names.collective_name and rank_io.called_as is c10d_names.called_as
    spelled = [os.path.relpath(p, REPO) for p in _modules()
               if re.search(r"""["']_allgather_base["']|replace\(["']allgather["']""", open(p).read())]
    assert spelled == ["ddp_helpers/runtime/c10d_names.py"], spelled
