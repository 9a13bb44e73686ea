"""The shape of the package: no import circles, small folders, small modules.

Every import counts, wherever it sits: at the top of a module, inside a function
(a lazy import is a circle postponed, not removed) or under ``TYPE_CHECKING``.
"""

import ast
import pathlib

import pytest

SRC = pathlib.Path(__file__).parents[1] / "jaxsync"
MAX_MODULES_PER_FOLDER = 15
MAX_LINES = 450


def module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: pathlib.Path) -> dict[str, set[str]]:
    """``module -> modules it imports`` for every module under ``root`` (a package)."""
    paths = {module_name(p, root): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([base] if base else []))
                # `from pkg import module` imports the module; `from mod import name` the module.
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in paths else base
                           for a in node.names]  # fmt: skip
            else:
                continue
            deps.update(t for t in targets if t in paths and t != name)
        graph[name] = deps
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph[v]:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_no_import_circles():
    found = circles(import_graph(SRC))
    assert not found, "import circles (a third module should own what they share):\n" + "\n".join(
        " <-> ".join(c) for c in found
    )


def package_graph(graph: dict[str, set[str]], root: str = "jaxsync._src") -> dict[str, set[str]]:
    """The module graph folded onto the packages directly under ``root``."""

    def package(m: str) -> str | None:
        rest = m[len(root) + 1 :].split(".") if m.startswith(root + ".") else None
        return rest[0] if rest and len(rest) > 1 else None

    folded: dict[str, set[str]] = {}
    for m, deps in graph.items():
        if (p := package(m)) is not None:
            folded.setdefault(p, set()).update(
                q for d in deps if (q := package(d)) is not None and q != p
            )
    return folded


def test_packages_form_layers():
    """Packages depend one way: core < layout < deterministic < sync < optim < fsdp <
    step < checkpoint (gpu and multihost beside them). A reader following a gradient
    never climbs back into a package it left."""
    graph = package_graph(import_graph(SRC))
    assert {"core", "sync", "optim", "fsdp", "step", "checkpoint"} <= set(graph)
    found = circles(graph)
    assert not found, f"packages that import each other: {found}"
    assert graph["core"] == set(), f"core must build on no other package: {graph['core']}"


def test_the_checker_sees_a_planted_circle(tmp_path):
    """A circle through a function-level import and one under TYPE_CHECKING are found."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..c import x\n")
    (pkg / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import a\nx = 1\n"
    )
    (pkg / "d.py").write_text("from .c import x\n")  # on no circle
    assert circles(import_graph(pkg)) == [["pkg.a", "pkg.c", "pkg.sub.b"]]
    (pkg / "c.py").write_text("x = 1\n")
    assert circles(import_graph(pkg)) == []


@pytest.mark.parametrize("folder", sorted({p.parent for p in SRC.rglob("*.py")}), ids=str)
def test_folders_stay_small(folder):
    modules = [p for p in folder.glob("*.py") if p.name != "__init__.py"]
    assert len(modules) <= MAX_MODULES_PER_FOLDER, (
        f"{folder} holds {len(modules)} modules; split it by concept into packages "
        f"(at most {MAX_MODULES_PER_FOLDER} each)."
    )


def test_modules_stay_small():
    long = {
        str(p.relative_to(SRC.parent)): n
        for p in SRC.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines (split them by concept): {long}"


def test_subpackages_only_document():
    """Package ``__init__``s re-export nothing: importing one module never drags in its
    siblings, so a circle cannot hide behind a package import."""
    for init in (SRC / "_src").rglob("__init__.py"):
        tree = ast.parse(init.read_text())
        code = [n for n in tree.body if not (isinstance(n, ast.Expr) and
                                             isinstance(n.value, ast.Constant))]  # fmt: skip
        assert not code, f"{init} should hold only its docstring"
