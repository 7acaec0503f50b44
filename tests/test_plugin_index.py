"""The store's plugin index: a command imports only the plugins its recipe names, and any
name the index cannot answer, any damage or any change to what is installed loads them all."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from mopt.plugins import INDEX_NAME, PluginIndex
from tests.conftest import run_mopt, write_files

TOY = (
    'schema = 1\n[models.m]\nfamily = "toyfam"\nsource = { path = "toy-model" }\n'
    '[m.cpu]\ntargets = ["toy-weights"]\n'
)
COMMAND = 'schema = 1\n[models.m]\n[m.cpu]\ntargets = ["c"]\n[m.cpu.c]\nkind = "command"\nargv = ["true"]\n'

#: prints the plugin modules a session imported, as JSON (a session of a command that may
#: write the store, as `mopt build`'s: a full load files the index)
SESSION = (
    "import json, sys; from pathlib import Path; from mopt.cli import Session; "
    "s = Session(Path(sys.argv[1]), writes_store=True); "
    "print(json.dumps(sorted(m for m in sys.modules if m.startswith(('mopt_', 'acme_')) and "
    "m.endswith(('.plugin', '.faults')))))"
)


def _session_plugins(cwd: Path, recipe: str, env: dict[str, str] | None = None) -> list[str]:
    full = {k: v for k, v in os.environ.items() if k != "MOPT_DISABLE_PLUGINS"}
    full.update(env or {})
    proc = subprocess.run([sys.executable, "-c", SESSION, recipe], cwd=cwd, env=full,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return list(json.loads(proc.stdout))


def _project(tmp_path: Path) -> Path:
    (tmp_path / "toy-model").mkdir()
    (tmp_path / ".mopt").mkdir()  # the store: the index lives there, and is never what creates it
    write_files(tmp_path, {"r.toml": TOY, "c.toml": COMMAND})
    return tmp_path


def test_plugin_index_loads_only_the_plugins_a_recipe_names(tmp_path: Path) -> None:
    proj = _project(tmp_path)
    everything = _session_plugins(proj, "r.toml")  # no index yet: every plugin, and the index is written
    assert {"mopt_fixture.plugin", "mopt_ml.plugin"} <= set(everything)
    assert (proj / ".mopt" / INDEX_NAME).is_file()
    assert _session_plugins(proj, "r.toml") == ["mopt_fixture.plugin"]
    assert _session_plugins(proj, "c.toml") == []  # the built-in `command` kind needs no plugin
    lazy = json.loads(run_mopt("plan", "r.toml", "--json", cwd=proj).stdout)
    os.unlink(proj / ".mopt" / INDEX_NAME)
    full = json.loads(run_mopt("plan", "r.toml", "--json", cwd=proj).stdout)
    assert lazy == full
    assert not (proj / ".mopt" / INDEX_NAME).exists()  # plan is read-only: it never writes the index


def test_plugin_index_unknown_names_and_disabled_plugins_read_as_without_it(tmp_path: Path) -> None:
    proj = _project(tmp_path)
    write_files(proj, {"typo.toml": TOY.replace('"toy-weights"', '"toy-wieghts"')})
    cases = [("typo.toml", {}), ("r.toml", {"MOPT_DISABLE_PLUGINS": "fixture"}), ("c.toml", {})]
    without = [run_mopt("plan", r, cwd=proj, env=env) for r, env in cases]  # full loads
    _session_plugins(proj, "c.toml")  # a build's session files the index: one entry per disable list
    _session_plugins(proj, "c.toml", {"MOPT_DISABLE_PLUGINS": "fixture"})
    assert len(json.loads((proj / ".mopt" / INDEX_NAME).read_text())["by_key"]) == 2
    with_index = [run_mopt("plan", r, cwd=proj, env=env) for r, env in cases]
    for a, b in zip(without, with_index, strict=True):
        assert (a.returncode, a.stdout, a.stderr) == (b.returncode, b.stdout, b.stderr)
    assert without[0].returncode == 2 and "did you mean 'toy-weights'" in without[0].stderr
    assert without[1].returncode == 2 and "disabled by MOPT_DISABLE_PLUGINS" in without[1].stderr


def test_damaged_plugin_index_is_a_full_load_and_is_rewritten(tmp_path: Path) -> None:
    proj = _project(tmp_path)
    _session_plugins(proj, "r.toml")
    index = proj / ".mopt" / INDEX_NAME
    good = json.loads(index.read_text())
    for damage in ("{not json", json.dumps({"version": 1, "by_key": {k: {"offers": 3} for k in good["by_key"]}})):
        index.write_text(damage)
        assert "mopt_ml.plugin" in _session_plugins(proj, "r.toml")  # a miss: everything loads
        assert json.loads(index.read_text()) == good
        assert _session_plugins(proj, "r.toml") == ["mopt_fixture.plugin"]


def test_plugin_index_wrong_offer_loads_every_plugin(tmp_path: Path) -> None:
    """An index that names the wrong plugin for a name (stale) costs a full load, never an error."""
    proj = _project(tmp_path)
    _session_plugins(proj, "r.toml")
    index = proj / ".mopt" / INDEX_NAME
    data = json.loads(index.read_text())
    for entry in data["by_key"].values():
        entry["offers"]["families/toyfam"] = "ml"
    index.write_text(json.dumps(data))
    loaded = _session_plugins(proj, "r.toml")
    assert {"mopt_ml.plugin", "mopt_fixture.plugin", "mopt_serve.plugin"} <= set(loaded)


def test_plugin_index_key_changes_with_what_is_installed(tmp_path: Path, monkeypatch: object) -> None:
    site = tmp_path / "lib" / "site-packages"
    site.mkdir(parents=True)
    sys.path.append(str(site))
    try:
        before = PluginIndex(tmp_path, ()).key
        assert PluginIndex(tmp_path, ()).key == before
        (site / "newdist-1.0.dist-info").mkdir()  # an install changes its folder
        os.utime(site, ns=(1, 1))
        after = PluginIndex(tmp_path, ()).key
        assert after != before
        assert PluginIndex(tmp_path, ("fixture",)).key not in (before, after)
        # the recipe's folder (sys.path[0] of `python -m mopt`) changes with every lock file
        sys.path.insert(0, str(tmp_path))
        try:
            mid = PluginIndex(tmp_path, ()).key
            (tmp_path / "mopt.lock").write_text("{}")
            os.utime(tmp_path, ns=(2, 2))
            assert PluginIndex(tmp_path, ()).key == mid
        finally:
            sys.path.remove(str(tmp_path))
    finally:
        sys.path.remove(str(site))
