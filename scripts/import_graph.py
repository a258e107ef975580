"""Draw the imports between ddp_helpers' own modules, read with `ast` (nothing is imported).

    .venv/bin/python scripts/import_graph.py           # the numbers, the circles, the imports back up
    .venv/bin/python scripts/import_graph.py --edges   # every arrow too

- rooms:   the package's modules (a package's __init__ is a room of its own);
- arrows:  A imports B. A module-level import (at the top, or in a class body or an `if` there) runs
           when A is imported: those make the layers. A function-level import runs when the function
           is called, and is listed apart. Imports under `if TYPE_CHECKING:` run never, and are left out.
           Importing a.b.c also runs a/__init__ and a/b/__init__: those implicit arrows are left out of
           the drawing (every package's __init__ would close a circle with its own modules), and
           `reach()` follows them, for "what does importing X load";
- circles: strongly connected components of more than one room, over the module-level arrows; and
           the function-level imports that would close one (B imports A in a function while A reaches B
           at import time);
- floors:  the depth of the layering: the longest chain of module-level arrows through the condensed
           graph (each circle one room), counted in rooms;
- imports back up: a module under runtime/ importing a top-level module that is not a foundation, or
           any arrow inside a circle, or a foundation importing anything but another foundation.
           Foundations (FOUNDATIONS: machine, compat, files) are top-level modules below the runtime:
           the trainer stands on them too, so they cannot live under runtime/.
"""
from __future__ import annotations

import ast
import dataclasses
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "ddp_helpers"
# Top-level modules below the runtime: what this machine has, torch's differences, writing a file. The
# trainer stands on them too, so they cannot live under runtime/; each may import only the others.
FOUNDATIONS = ("machine", "compat", "files")


@dataclasses.dataclass(frozen=True)
class Arrow:
    source: str
    target: str
    level: str   # "module" or "function"
    line: int


def modules(root: str = REPO) -> dict[str, str]:
    """{dotted name: file path} of every module of the package."""
    found = {}
    for folder, _, files in os.walk(os.path.join(root, PACKAGE)):
        for name in sorted(files):
            if name.endswith(".py"):
                rel = os.path.relpath(os.path.join(folder, name), root)[:-3].split(os.sep)
                if rel[-1] == "__init__":
                    rel = rel[:-1]
                found[".".join(rel)] = os.path.join(folder, name)
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


class _Imports(ast.NodeVisitor):
    def __init__(self, name: str, is_package: bool, known: set[str]) -> None:
        self.name, self.is_package, self.known = name, is_package, known
        self.depth = 0
        self.arrows: list[Arrow] = []

    def _add(self, target: str, line: int) -> None:
        if target != self.name:
            self.arrows.append(Arrow(self.name, target, "function" if self.depth else "module", line))

    def visit_FunctionDef(self, node: ast.AST) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_AsyncFunctionDef = visit_Lambda = visit_FunctionDef

    def visit_If(self, node: ast.If) -> None:
        if _is_type_checking(node.test):   # never runs: only the type checker reads it
            for child in node.orelse:
                self.visit(child)
            return
        self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name.split(".")[0] == PACKAGE:
                parts = alias.name.split(".")
                while parts and ".".join(parts) not in self.known:
                    parts.pop()
                if parts:
                    self._add(".".join(parts), node.lineno)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            here = self.name.split(".") if self.is_package else self.name.split(".")[:-1]
            base_parts = here[:len(here) - (node.level - 1)] + (node.module.split(".") if node.module else [])
        elif node.module and node.module.split(".")[0] == PACKAGE:
            base_parts = node.module.split(".")
        else:
            return
        base = ".".join(base_parts)
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            if sub in self.known:        # from . import launcher: the submodule
                self._add(sub, node.lineno)
            elif base in self.known:     # from .launcher import launch: the module
                self._add(base, node.lineno)


def arrows(root: str = REPO) -> list[Arrow]:
    found = modules(root)
    known = set(found)
    out: list[Arrow] = []
    for name, path in found.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        visitor = _Imports(name, path.endswith("__init__.py"), known)
        visitor.visit(tree)
        seen: set[tuple[str, str]] = set()
        # one arrow per (source, target): module-level wins over function-level
        for arrow in sorted(visitor.arrows, key=lambda a: (a.target, a.level != "module", a.line)):
            if (arrow.target, arrow.source) not in seen:
                seen.add((arrow.target, arrow.source))
                out.append(arrow)
    return out


def circles(rooms: list[str], edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components (Tarjan's, iteratively), each a sorted list of rooms."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    counter = 0
    for start in rooms:
        if start in index:
            continue
        work = [(start, iter(sorted(edges.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    components.append(sorted(component))
    return components


def reaches(edges: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        node = todo.pop()
        for child in edges.get(node, ()):
            if child not in seen:
                seen.add(child)
                todo.append(child)
    return seen


def reach(name: str, root: str = REPO, function_level: bool = False) -> set[str]:
    """The package's modules that `import name` loads (with the packages' __init__ each import runs)."""
    known = set(modules(root))
    edges: dict[str, set[str]] = {}
    for a in arrows(root):
        if function_level or a.level == "module":
            edges.setdefault(a.source, set()).add(a.target)
    loaded: set[str] = set()
    todo = [name]
    while todo:
        current = todo.pop()
        parts = current.split(".")
        for cut in range(1, len(parts) + 1):   # a.b.c runs a, a.b, then a.b.c
            module = ".".join(parts[:cut])
            if module in known and module not in loaded:
                loaded.add(module)
                todo.extend(edges.get(module, ()))
    return loaded


@dataclasses.dataclass
class Drawing:
    rooms: list[str]
    arrows: list[Arrow]
    floors: int
    circles: list[list[str]]
    closing: list[Arrow]        # function-level imports that would close a circle
    foundations: list[str]
    all_circles: list[list[str]]   # counting function-level imports too
    back_up: list[Arrow]        # module-level imports back up (runtime -> top, or inside a circle)
    back_up_later: list[Arrow]  # the same, by function-level imports


def draw(root: str = REPO) -> Drawing:
    rooms = sorted(modules(root))
    every = arrows(root)
    at_import = [a for a in every if a.level == "module"]
    edges: dict[str, set[str]] = {}
    for a in at_import:
        edges.setdefault(a.source, set()).add(a.target)
    components = circles(rooms, edges)
    component_of = {room: i for i, c in enumerate(components) for room in c}
    # floors: longest chain through the condensed graph (components in reverse topological order)
    condensed: dict[int, set[int]] = {}
    for a in at_import:
        s, t = component_of[a.source], component_of[a.target]
        if s != t:
            condensed.setdefault(s, set()).add(t)
    height: dict[int, int] = {}
    for i in range(len(components)):   # Tarjan emits a component after all it reaches
        height[i] = 1 + max((height[j] for j in condensed.get(i, ())), default=0)
    closing = [a for a in every if a.level == "function" and a.source in reaches(edges, a.target)]

    def top_level(name: str) -> bool:
        return name.count(".") == 1 and name not in _packages(rooms)

    foundations = sorted(f"{PACKAGE}.{name}" for name in FOUNDATIONS if f"{PACKAGE}.{name}" in rooms)
    every_edge: dict[str, set[str]] = {}
    for a in every:
        every_edge.setdefault(a.source, set()).add(a.target)
    all_circles = [c for c in circles(rooms, every_edge) if len(c) > 1]

    def back_up(a: Arrow) -> bool:
        from_runtime = a.source.startswith(f"{PACKAGE}.runtime")
        up = from_runtime and (a.target == PACKAGE or (top_level(a.target) and a.target not in foundations))
        up = up or (a.source in foundations and a.target not in foundations)   # a foundation stands on nothing
        same = component_of.get(a.source) == component_of.get(a.target)
        inside = same and len(components[component_of[a.source]]) > 1
        return up or inside

    return Drawing(rooms=rooms, arrows=every, floors=max(height.values(), default=0),
                   circles=[c for c in components if len(c) > 1], closing=closing,
                   foundations=foundations, all_circles=all_circles,
                   back_up=[a for a in at_import if back_up(a)],
                   back_up_later=[a for a in every if a.level == "function" and (back_up(a) or a in closing)])


def _packages(rooms: list[str]) -> set[str]:
    return {r for r in rooms if any(other.startswith(r + ".") for other in rooms)}


def _short(name: str) -> str:
    return f"{PACKAGE} (__init__)" if name == PACKAGE else name[len(PACKAGE) + 1:]


def report(drawing: Drawing, show_edges: bool = False) -> str:
    at_import = [a for a in drawing.arrows if a.level == "module"]
    lines = [f"rooms:   {len(drawing.rooms)} modules",
             f"floors:  {drawing.floors} (longest chain of module-level imports, circles condensed)",
             f"arrows:  {len(drawing.arrows)} ({len(at_import)} module-level, "
             f"{len(drawing.arrows) - len(at_import)} function-level)",
             f"circles: {len(drawing.circles)} (module-level)"]
    lines += [f"  - {' <-> '.join(_short(r) for r in c)}" for c in drawing.circles]
    lines.append(f"circles counting function-level imports too: {len(drawing.all_circles)}")
    lines += [f"  - {' <-> '.join(_short(r) for r in c)}" for c in drawing.all_circles]
    lines.append(f"function-level imports that close a circle: {len(drawing.closing)}")
    lines += [f"  - {_short(a.source)}:{a.line} -> {_short(a.target)}" for a in drawing.closing]
    lines.append(f"imports back up: {len(drawing.back_up)} (module-level: runtime/ -> a top-level module "
                 "other than a foundation, or inside a circle)")
    lines += [f"  - {_short(a.source)}:{a.line} -> {_short(a.target)}" for a in drawing.back_up]
    lines.append(f"imports back up at call time: {len(drawing.back_up_later)} (function-level)")
    lines += [f"  - {_short(a.source)}:{a.line} -> {_short(a.target)}" for a in drawing.back_up_later]
    lines.append("foundations (top-level, below the runtime; import only each other): "
                 + ", ".join(_short(r) for r in drawing.foundations))
    if show_edges:
        lines.append("arrows:")
        lines += [f"  {_short(a.source)} -> {_short(a.target)}" + ("" if a.level == "module" else "  (in a function)")
                  for a in sorted(drawing.arrows, key=lambda a: (a.source, a.target))]
    return "\n".join(lines)


if __name__ == "__main__":
    import argparse
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--edges", action="store_true", help="list every arrow too")
    parser.add_argument("--root", default=REPO, help="the checkout to read (default: this one)")
    options = parser.parse_args()
    print(report(draw(options.root), show_edges=options.edges))
