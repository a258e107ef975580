"""The package's layout: what learners type still works, and the house rules hold.

- Every `ddp_helpers` name the notebooks, README and site use can be imported (paths learners type;
  `python -m ddp_helpers.train` and `python -m ddp_helpers.bench` run in test_train and test_bench).
- No module is over 450 lines; every package is listed in pyproject.toml.
- The reference trainer imports nothing from the launch machinery (its source is read in notebook 06).
"""
import ast
import importlib
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


def _imports_of(path):
    """The ddp_helpers modules a module imports (relative or absolute), as file paths."""
    tree = ast.parse(open(path).read())
    here = os.path.dirname(path)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = here
                for _ in range(node.level - 1):
                    base = os.path.dirname(base)
                parts = node.module.split(".") if node.module else []
            elif node.module and node.module.split(".")[0] == "ddp_helpers":
                base, parts = REPO, node.module.split(".")
            else:
                continue
            target = os.path.join(base, *parts)
            candidates = [target + ".py"] + [os.path.join(target, a.name + ".py") for a in node.names]
            found += [c for c in candidates if os.path.isfile(c)]
            if os.path.isfile(os.path.join(target, "__init__.py")) and target != PACKAGE:  # imported anyway
                found.append(os.path.join(target, "__init__.py"))
    return found


def test_the_trainer_imports_nothing_from_the_launch_machinery():
    seen, todo = set(), [os.path.join(PACKAGE, "train.py")]
    while todo:
        path = todo.pop()
        if path not in seen:
            seen.add(path)
            todo += _imports_of(path)
    names = sorted(os.path.relpath(p, PACKAGE) for p in seen)
    machinery = [n for n in names if n.startswith("runtime") or n in ("launcher.py", "pool.py", "magic.py")]
    assert not machinery, f"train.py reaches {machinery} (all it imports: {names})"


@pytest.mark.parametrize("name, not_loaded", [
    ("ddp_helpers.speed.cuda_graph", ["ddp_helpers.train"]),
    # torchrun -m ddp_helpers.train on a GPU cluster: no launcher, no IPython
    ("ddp_helpers.train", ["ddp_helpers.launcher", "ddp_helpers.runtime.supervisor", "IPython"])])
def test_a_module_loads_only_what_it_needs(name, not_loaded):
    code = f"import sys, {name}; print(sorted(m for m in sys.modules if m.startswith(('ddp_helpers.', 'IPython'))))"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    loaded = eval(done.stdout)
    assert [m for m in not_loaded if m in loaded] == [], loaded
