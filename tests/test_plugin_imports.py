"""Plugins reach mopt only through `mopt.api` and `mopt.hookspecs` (DESIGN.md: a plugin that
imports any other mopt module is reaching into the engine; first-party plugins follow the
same rule). An AST scan of every import, at any depth (function-level imports included)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ALLOWED = {"mopt", "mopt.api", "mopt.hookspecs"}
#: plugin folders whose packages are scanned (their own tests/ may use mopt's internals)
SCANNED = sorted(p for p in (ROOT / "plugins").iterdir() if (p / "pyproject.toml").is_file()) + [
    ROOT / "tests" / "fixture_plugin",
    ROOT / "tests" / "thirdparty_plugin",
]


def _mopt_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import of a mopt module in a Python file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "mopt":  # `from mopt import api` imports mopt.api
                found += [(node.lineno, f"mopt.{a.name}") for a in node.names]
            else:
                found.append((node.lineno, node.module))
    return [(n, m) for n, m in found if m == "mopt" or m.startswith("mopt.")]


def _sources(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*.py") if "tests" not in p.relative_to(folder).parts[:1])


def test_plugins_import_only_the_api() -> None:
    bad = []
    for folder in SCANNED:
        for path in _sources(folder):
            for line, mod in _mopt_imports(path):
                if mod not in ALLOWED:
                    bad.append(f"{path.relative_to(ROOT)}:{line}: imports {mod}")
    assert bad == [], "plugins may import only mopt.api and mopt.hookspecs:\n" + "\n".join(bad)


def test_the_scan_sees_function_level_and_from_imports(tmp_path: Path) -> None:
    f = tmp_path / "p.py"
    f.write_text(
        "from mopt.api import hookimpl\n"
        "from mopt import hookspecs, store\n"
        "def run():\n"
        "    from mopt.build import Engine\n"
        "    import mopt.keys\n"
    )
    assert _mopt_imports(f) == [(1, "mopt.api"), (2, "mopt.hookspecs"), (2, "mopt.store"),
                                (4, "mopt.build"), (5, "mopt.keys")]  # fmt: skip


def test_every_scanned_folder_exists_and_the_first_party_plugins_are_scanned() -> None:
    assert all(f.is_dir() for f in SCANNED)
    names = {f.relative_to(ROOT).as_posix() for f in SCANNED}
    assert {"plugins/mopt-ray", "plugins/mopt-image", "plugins/mopt-ml", "plugins/mopt-report"} <= names


def _packages(folder: Path) -> set[str]:
    """The import names a plugin folder ships (its top-level packages)."""
    return {p.parent.name for p in folder.glob("*/__init__.py") if p.parent.name != "tests"}


def test_no_two_plugins_import_each_other() -> None:
    """A plugin may build on another (mopt-openvino on mopt-ml, a declared dependency), never
    in a circle: what both need lives with one of them, or in mopt.api if it is a contract."""
    owner = {pkg: folder for folder in SCANNED for pkg in _packages(folder)}
    uses: dict[Path, dict[Path, str]] = {folder: {} for folder in SCANNED}
    for folder in SCANNED:
        # what the plugin ships (a benchmark script beside it may compare two plugins)
        for path in sorted(p for pkg in _packages(folder) for p in (folder / pkg).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in ast.walk(tree):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
                if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    names = [node.module]
                for name in names:
                    other = owner.get(name.split(".")[0])
                    if other is not None and other != folder:
                        uses[folder].setdefault(other, f"{path.relative_to(ROOT)}:{node.lineno}")
    both = [
        f"{a.relative_to(ROOT)} ({uses[a][b]}) <-> {b.relative_to(ROOT)} ({uses[b][a]})"
        for a in SCANNED
        for b in uses[a]
        if a in uses[b] and str(a) < str(b)
    ]
    assert both == [], "plugins that import each other:\n" + "\n".join(both)
