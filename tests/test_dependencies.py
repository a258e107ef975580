"""What the package imports is what pyproject.toml declares.

Every third-party package that a module of `ddp_helpers` imports is declared: in `dependencies` (what
`pip install ddp_helpers` brings), or in the extra of the feature that needs it. The notebook side
(IPython's display and magics, ipywidgets' slider) is the `notebooks` extra: `launch`, `spawn`, the
trainer and `python -m ddp_helpers.bench` run without it (tests/test_no_jupyter.py), so the package
imports those packages only inside a function, under `try: ... except ImportError`, or in a module
loaded by `%load_ext ddp_helpers` alone (NOTEBOOK_MODULES).
"""
import ast
import importlib.metadata
import os
import re
import sys

import pytest
from conftest import REPO

tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs tomllib (Python 3.11)")

PACKAGE = os.path.join(REPO, "ddp_helpers")
NOTEBOOK_MODULES = {"ddp_helpers/magic.py"}   # loaded by %load_ext ddp_helpers, in a Jupyter kernel only


def _name(requirement):
    """The distribution a requirement names, normalised (PEP 503): "Pillow>=9" -> "pillow"."""
    return re.sub(r"[-_.]+", "-", re.match(r"\s*([A-Za-z0-9._-]+)", requirement).group(1)).lower()


def declared():
    """{"core": names, extra: names}; an extra that names the package itself (ddp_helpers[x]) gets x's too."""
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    extras = project.get("optional-dependencies", {})

    def names(requirements):
        out = set()
        for req in requirements:
            if _name(req) == "ddp-helpers":
                for extra in re.search(r"\[(.*)\]", req).group(1).split(","):
                    out |= names(extras[extra.strip()])
            else:
                out.add(_name(req))
        return out

    return {"core": names(project["dependencies"]), **{extra: names(reqs) for extra, reqs in extras.items()}}


def third_party_imports(path):
    """(top-level package, optional) for each absolute import of a package outside the standard library:
    optional when the import runs only when called (in a function) or may fail (try/except ImportError)."""
    tree = ast.parse(open(path).read(), path)
    found = []

    def visit(node, optional):
        for child in ast.iter_child_nodes(node):
            inner = optional or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Try) and any(
                    isinstance(h.type, ast.Name) and h.type.id in ("ImportError", "ModuleNotFoundError")
                    for h in child.handlers):
                for statement in child.body:
                    visit(ast.Module(body=[statement], type_ignores=[]), True)
                for part in (child.handlers, child.orelse, child.finalbody):
                    for statement in part:
                        visit(ast.Module(body=[statement], type_ignores=[]), optional)
                continue
            if isinstance(child, ast.Import):
                found.extend((alias.name.split(".")[0], optional) for alias in child.names)
            elif isinstance(child, ast.ImportFrom) and child.level == 0:
                found.append((child.module.split(".")[0], optional))
            visit(child, inner)

    visit(tree, False)
    return [(top, optional) for top, optional in found
            if top not in sys.stdlib_module_names and top != "ddp_helpers"]


def modules():
    for folder, _, files in os.walk(PACKAGE):
        for name in sorted(files):
            if name.endswith(".py"):
                yield os.path.relpath(os.path.join(folder, name), REPO).replace(os.sep, "/")


def test_every_package_the_modules_import_is_declared_for_their_feature():
    deps = declared()
    distributions = importlib.metadata.packages_distributions()   # "PIL" -> ["pillow"]
    wrong = []
    for module in modules():
        for top, optional in third_party_imports(os.path.join(REPO, module)):
            names = {_name(d) for d in distributions.get(top, [])}
            if not names:
                wrong.append(f"{module}: imports {top}, which no installed distribution provides")
            elif names & deps["core"]:
                continue
            elif names & deps.get("notebooks", set()) and (optional or module in NOTEBOOK_MODULES):
                continue
            elif names & deps.get("notebooks", set()):
                wrong.append(f"{module}: imports {top} ({', '.join(sorted(names))}, the notebooks extra) at "
                             f"import time: import it where the notebook needs it, or declare it in dependencies")
            else:
                wrong.append(f"{module}: imports {top}, but pyproject.toml declares {', '.join(sorted(names))} "
                             f"neither in dependencies nor in the notebooks extra")
    assert not wrong, "\n".join(wrong)


def test_the_extras_are_there():
    deps = declared()
    assert {"notebooks", "test", "docs", "debug"} <= set(deps), sorted(deps)
    assert {"jupyterlab", "ipywidgets", "ipython"} <= deps["notebooks"]
    assert {"pytest", "pytest-xdist", "nbval", "ruff", "mypy", "polib", "playwright"} <= deps["test"]
    assert deps["notebooks"] <= deps["test"], "the tests run every notebook"
    assert {"sphinx", "myst-nb", "furo"} <= deps["docs"]


def test_requirements_txt_installs_the_package_with_its_extras():
    lines = [line.split("#")[0].strip() for line in open(os.path.join(REPO, "requirements.txt"))]
    assert [line for line in lines if line] == ["-e .[notebooks,test,docs]"]


def test_the_checker_sees_what_it_should(tmp_path):
    # an import at the top is seen, one inside a function or a try/except ImportError is optional
    path = tmp_path / "probe.py"
    path.write_text("import numpy\nfrom PIL import Image\nimport os\n"
                    "def f():\n    import ipywidgets\n"
                    "try:\n    import IPython.display\nexcept ImportError:\n    pass\n")
    assert third_party_imports(path) == [("numpy", False), ("PIL", False), ("ipywidgets", True),
                                         ("IPython", True)]
