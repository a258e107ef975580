"""Write the API page (docs/api.md) from ddp_helpers' own docstrings and signatures.

The docstrings are plain text written for `help()` in a notebook, not reStructuredText, so they are
turned into Markdown here: indented blocks become code, `name: text` lines become a list of
parameters; everything else is Markdown already (backticks, "- " lists).
A name listed below that the package no longer has fails the build (the page promises it). A class
listed without any of its methods gets all its public methods.
"""
import ast
import dataclasses
import importlib
import inspect
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# (title, module, intro from the module docstring?, members; "Class.method" documents a method)
SECTIONS = [
    ("Starting workers: `launch`", "ddp_helpers.launcher", True,
     ["launch", "spawn", "WorkerError", "WorkerTimeout"]),
    ("The `%%ddp` cell magic", "ddp_helpers.magic", True, ["DDPMagics.ddp"]),
    ("The warm pool", "ddp_helpers.pool", True,
     ["Pool", "Pool.run_cell", "Pool.run", "Pool.push", "Pool.pull", "Pool.status", "Pool.stop"]),
    ("Measuring collectives: `bench`", "ddp_helpers.bench", True,
     ["measure", "sweep", "size_range", "parse_size", "bus_factor", "algbw_GBps", "busbw_GBps", "plan",
      "available_setups", "compare"]),
    ("The reference trainer", "ddp_helpers.train", True,
     ["run", "Config", "make_config", "setup", "Plain", "Trainer"]),
    ("The live training view", "ddp_helpers.live", True, ["train"]),
    ("Checking the exercises", "ddp_helpers.exercises", True,
     ["Verdict", "check_ring_all_reduce", "check_one_bucket_average", "check_shard_and_reassemble"]),
    ("The tiny transformer of notebooks 09 and 10", "ddp_helpers.tiny_transformer", True,
     ["Config", "TinyTransformer", "batch"]),
]
PARAM = re.compile(r"^([A-Za-z_][\w.]*|\*\*?\w+):\s+(.*)$")


def docstring_to_markdown(doc):
    """Plain-text docstring -> Markdown (see the module docstring)."""
    blocks, current = [], []
    for line in (doc or "").splitlines():
        if line.strip():
            current.append(line.rstrip())
        elif current:
            blocks.append(current)
            current = []
    if current:
        blocks.append(current)
    out = []
    if blocks and blocks[0] == ["::"]:      # reStructuredText's literal block (IPython's magic_arguments)
        return "```text\n" + (doc or "").split("::", 1)[1].strip() + "\n```"
    for block in blocks:
        indents = [len(line) - len(line.lstrip()) for line in block]
        if min(indents) >= 4:
            width = min(indents)
            code = "\n".join(line[width:] for line in block)
            try:
                ast.parse(code)
                language = "python"
            except SyntaxError:   # a table or a shell line: shown as it is
                language = "text"
            out.append(f"```{language}\n{code}\n```")
        elif PARAM.match(block[0]) and sum(bool(PARAM.match(line)) for line in block) >= 1 and \
                all(PARAM.match(line) or line.startswith(" ") for line in block):
            items = []
            for line in block:
                m = PARAM.match(line)
                if m:
                    items.append(f"- **`{m.group(1)}`**: {m.group(2)}")
                else:
                    items[-1] += " " + line.strip()
            out.append("\n".join(items))
        else:
            # the text before a list or a code block ends with ':'; Markdown needs nothing more
            out.append("\n".join(block))
    return "\n\n".join(out)


def _signature(obj, name):
    try:
        try:   # hints written as strings (`from __future__ import annotations`) shown as types
            sig = str(inspect.signature(obj, eval_str=True))
        except NameError:
            sig = str(inspect.signature(obj))
    except (TypeError, ValueError):
        sig = "(...)"
    if sig.startswith("(self, "):
        sig = "(" + sig[len("(self, "):]
    elif sig == "(self)":
        sig = "()"
    return name + sig


def _config_table(cls):
    rows = ["| setting | default | what it does |", "| --- | --- | --- |"]
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else "(required)"
        text = str(f.metadata.get("help", "")).replace("|", "\\|")
        rows.append(f"| `{f.name}` | `{default!r}` | {text} |")
    return "\n".join(rows)


def public_methods(cls):
    """The class's own public methods, in source order."""
    return [n for n, v in vars(cls).items() if not n.startswith("_") and inspect.isfunction(v)]


def member(module, name):
    obj = module
    for part in name.split("."):
        if not hasattr(obj, part):
            raise AttributeError(f"docs/api_page.py lists {module.__name__}.{name}, which does not exist: "
                                 f"update SECTIONS")
        obj = getattr(obj, part)
    return obj


def document(module, name):
    obj = member(module, name)
    doc = inspect.getdoc(obj) if (obj.__doc__ or "").strip() else ""
    if dataclasses.is_dataclass(obj) and doc.startswith(obj.__name__ + "("):
        doc = ""     # the signature that dataclass writes when there is no docstring: the table says it
    body = docstring_to_markdown(doc) if doc else ("" if dataclasses.is_dataclass(obj) else "*(no docstring)*")
    if inspect.isclass(obj):
        if dataclasses.is_dataclass(obj):
            head = f"{{py:class}} {name}(**settings)"
            body += "\n\n" + _config_table(obj)
        else:
            head = f"{{py:class}} {_signature(obj, name)}"
    elif "." in name:
        kind = "py:method"
        head = f"{{{kind}}} {_signature(obj, name)}"
    else:
        head = f"{{py:function}} {_signature(obj, name)}"
    return f"````{head}\n:module: {module.__name__}\n\n{body}\n````"


def module_lines(package="ddp_helpers"):
    """One line per module of the package, from the first line of its docstring; the machinery
    (`runtime`) last. A module without a docstring fails the build: each says why it exists."""
    root = Path(importlib.import_module(package).__file__).parent
    names = sorted((p.relative_to(root.parent).with_suffix("").as_posix().replace("/", ".")
                    for p in root.rglob("*.py") if "__pycache__" not in p.parts),
                   key=lambda n: (".runtime" in n, n))
    rows = ["| module | what it is for |", "| --- | --- |"]
    for name in names:
        name = name.removesuffix(".__init__")
        if name.endswith("__main__"):
            continue
        source = (root.parent / (name.replace(".", "/"))).with_suffix(".py")
        if not source.exists():
            source = root.parent / name.replace(".", "/") / "__init__.py"
        doc = ast.get_docstring(ast.parse(source.read_text(encoding="utf-8")))
        if not doc:
            raise ValueError(f"{source}: no module docstring (each module says why it exists)")
        first = " ".join(doc.split("\n\n")[0].split())
        first = re.split(r"(?<=\.) (?=[A-Z`])", first)[0].replace("|", "\\|")   # its first sentence
        rows.append(f"| `{name}` | {first} |")
    return "\n".join(rows)


def api_markdown():
    parts = ["# API: `ddp_helpers`",
             "What the notebooks import, generated from the package's docstrings and signatures "
             "(`help(...)` in a notebook shows the same text)."]
    for title, modname, intro, names in SECTIONS:
        module = importlib.import_module(modname)
        parts.append(f"## {title}")
        parts.append(f"Module `{modname}`.")
        if intro and module.__doc__:
            parts.append(docstring_to_markdown(inspect.cleandoc(module.__doc__)))
        for name in names:
            parts.append(document(module, name))
            obj = member(module, name)
            if inspect.isclass(obj) and not dataclasses.is_dataclass(obj) and \
                    not any(n.startswith(name + ".") for n in names):
                parts += [document(module, f"{name}.{m}") for m in public_methods(obj)]
    parts.append("## The package, module by module")
    parts.append("The faces a notebook uses stand at the top; `runtime` holds the machinery that starts, "
                 "watches and stops ranks, which no notebook imports.")
    parts.append(module_lines())
    return "\n\n".join(parts) + "\n"


def write_api_page(path):
    text = api_markdown()
    path = Path(path)
    if not path.exists() or path.read_text(encoding="utf-8") != text:
        path.write_text(text, encoding="utf-8")


if __name__ == "__main__":
    print(api_markdown())
