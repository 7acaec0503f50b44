"""The layers of `mopt/` are a contract (issue #25): no import circle among its modules, and
`mopt.api`, what plugins import, imports nothing of the engine or the CLI. An AST scan of
every import at any depth (function-level ones too: a lazy import is still an arrow).
What plugins may import is tests/test_plugin_imports.py's business."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "mopt"
#: what `mopt.api` may import: values and leaf helpers it re-exports, none of which imports
#: anything of the engine (each is checked below to reach only this set)
API_MAY_IMPORT = {
    "mopt",
    "mopt.digest",
    "mopt.errors",
    "mopt.estimate",
    "mopt.family",
    "mopt.filehash",
    "mopt.plugin_env",
    "mopt.procs",
}


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, root: Path = PACKAGE) -> list[tuple[int, str]]:
    """(line, module) of every import of a module of the package at `root`, at any depth;
    `from mopt import x` counts as an import of `mopt.x` when `mopt/x` is a module."""
    pkg = root.name
    here = _module_name(path, root)
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = here.split(".")
                base = base[: len(base) - node.level + (path.name == "__init__.py")]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            found.append((node.lineno, mod))
            for a in node.names:
                sub = f"{mod}.{a.name}"
                rel = Path(*sub.split(".")[1:]) if sub.startswith(pkg + ".") else None
                if rel is not None and ((root / rel).with_suffix(".py").is_file() or (root / rel).is_dir()):
                    found.append((node.lineno, sub))
    return sorted((n, m) for n, m in found if m == pkg or m.startswith(pkg + "."))


def import_graph(root: Path = PACKAGE) -> dict[str, dict[str, int]]:
    """module → {module it imports → first line}, for every module of the package at `root`
    (the package's own `__init__` left out as a target: importing `mopt.x` runs it, but it
    imports nothing)."""
    graph: dict[str, dict[str, int]] = {}
    for path in sorted(root.rglob("*.py")):
        name = _module_name(path, root)
        edges = graph.setdefault(name, {})
        for line, mod in imports_of(path, root):
            if mod != name and mod != root.name:
                edges.setdefault(mod, line)
    return graph


def circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, {}):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _describe(comp: list[str], graph: dict[str, dict[str, int]]) -> str:
    members = set(comp)
    arrows = [
        f"  {a} -> {b} ({a.replace('.', '/')}.py:{line})"
        for a in comp
        for b, line in sorted(graph[a].items())
        if b in members
    ]
    return f"circle of {len(comp)}: {', '.join(comp)}\n" + "\n".join(arrows)


def test_no_import_circle_in_mopt() -> None:
    graph = import_graph()
    found = circles(graph)
    assert found == [], "import circles in mopt/ (every arrow listed):\n" + "\n".join(
        _describe(c, graph) for c in found
    )


def test_api_imports_no_engine_and_no_cli() -> None:
    graph = import_graph()
    bad = [
        f"mopt/api.py:{line}: imports {mod}"
        for mod, line in graph["mopt.api"].items()
        if mod not in API_MAY_IMPORT
    ]
    assert bad == [], f"mopt.api may import only {sorted(API_MAY_IMPORT)}:\n" + "\n".join(bad)


def test_what_api_imports_reaches_nothing_else() -> None:
    """The modules `mopt.api` re-exports are leaves: nothing they import, however far down,
    is outside the allowed set (a back door through a helper is still a back door)."""
    graph = import_graph()
    seen: dict[str, str] = {}
    todo = [("mopt.api", m) for m in graph["mopt.api"]]
    while todo:
        via, mod = todo.pop()
        if mod in seen:
            continue
        seen[mod] = via
        todo += [(mod, m) for m in graph.get(mod, {})]
    bad = [f"{mod} (through {via})" for mod, via in sorted(seen.items()) if mod not in API_MAY_IMPORT]
    assert bad == [], "mopt.api reaches modules outside its allowed set:\n" + "\n".join(bad)


def test_the_scan_sees_every_form_of_import(tmp_path: Path) -> None:
    pkg = tmp_path / "mopt"
    (pkg / "sub").mkdir(parents=True)
    for name in ("__init__.py", "a.py", "b.py", "c.py", "sub/__init__.py", "sub/d.py"):
        (pkg / name).write_text("")
    (pkg / "a.py").write_text(
        "import os\n"
        "from mopt import b, errors_not_a_module\n"
        "def f():\n"
        "    from mopt.c import thing\n"
        "    import mopt.sub.d\n"
        "class K:\n"
        "    def g(self):\n"
        "        from . import c\n"
        "        from .sub import d\n"
    )
    assert imports_of(pkg / "a.py", pkg) == [
        (2, "mopt"),
        (2, "mopt.b"),
        (4, "mopt.c"),
        (5, "mopt.sub.d"),
        (8, "mopt"),
        (8, "mopt.c"),
        (9, "mopt.sub"),
        (9, "mopt.sub.d"),
    ]


def test_a_circle_is_found_and_named_with_its_lines(tmp_path: Path) -> None:
    pkg = tmp_path / "mopt"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from mopt import b\n")
    (pkg / "b.py").write_text("x = 1\n\ndef f():\n    from mopt.c import y\n")
    (pkg / "c.py").write_text("import mopt.a\n")
    (pkg / "d.py").write_text("from mopt import a\n")
    graph = import_graph(pkg)
    found = circles(graph)
    assert found == [["mopt.a", "mopt.b", "mopt.c"]]
    assert "  mopt.b -> mopt.c (mopt/b.py:4)" in _describe(found[0], graph)
