"""A kind whose code changed under the same `version` is noticed (its cached outputs are still
reused: warned about, once per kind, in plan and build, the no-op included), and `mopt build
--rebuild SEL` runs selected targets again (what reads them follows if their bytes change)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import run_mopt

PLUGIN = """\
import os

from mopt.api import TargetKind, hookimpl


class Echo(TargetKind):
    name = "echo"
    version = "1"
    produces = "files"

    def run(self, ctx):
        (ctx.out / "e").write_text(os.environ.get("CODEPLUG_OUT", "same"))


@hookimpl
def mopt_register_targets(register):
    register(Echo)
"""

RECIPE = """\
schema = 1

[models.m]
[m.cpu]
targets = ["e", "d"]

[m.cpu.e]
kind = "echo"

[m.cpu.d]
kind = "command"
input = "e"
argv = ["sh", "-c", "cat {in}/e > {out}/d"]
"""

WARNING = (
    "warning: kind 'echo' (plugin 'codeplug') changed since it built m.cpu:e, but its version '1' did "
    "not: that output is reused (bump the kind's version if its outputs change; `mopt build --rebuild "
    "m.cpu:e` rebuilds it)"
)


def _project(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    site = tmp_path / "site"
    site.mkdir()
    (site / "codeplug.py").write_text(PLUGIN)
    info = site / "codeplug-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: codeplug\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[mopt]\ncodeplug = codeplug\n")
    proj = tmp_path / "p"
    proj.mkdir()
    (proj / "r.toml").write_text(RECIPE)
    return proj, {"PYTHONPATH": str(site)}


def _build(proj: Path, env: dict[str, str], *args: str) -> tuple[dict[str, str], dict, list[str]]:
    proc = run_mopt("build", "r.toml", "--json", *args, cwd=proj, env=env)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    return {n["id"]: n["status"] for n in data["nodes"]}, data["io"], proc.stderr.splitlines()


def test_a_kind_changed_under_the_same_version_is_warned_about(tmp_path: Path) -> None:
    proj, env = _project(tmp_path)
    status, _, err = _build(proj, env)
    assert status == {"m.cpu:e": "built", "m.cpu:d": "built"} and WARNING not in err
    module = tmp_path / "site" / "codeplug.py"
    module.write_text(PLUGIN.replace("    def run(self, ctx):", "    def run(self, ctx):  # refactored"))
    plan = run_mopt("plan", "r.toml", cwd=proj, env=env)
    assert plan.returncode == 0 and plan.stderr.splitlines().count(WARNING) == 1
    assert "m.cpu:e  echo" in plan.stdout and "up to date" in plan.stdout
    status, io, err = _build(proj, env)
    assert status == {"m.cpu:e": "cached", "m.cpu:d": "cached"} and err.count(WARNING) == 1
    # the next build is a no-op, and still says it (from the build log)
    status, io, err = _build(proj, env)
    assert io.get("noop") is True and err.count(WARNING) == 1
    plan = run_mopt("plan", "r.toml", cwd=proj, env=env)
    assert plan.stderr.splitlines().count(WARNING) == 1
    # --rebuild runs it again with this code; same bytes: what reads it stays cached
    status, io, err = _build(proj, env, "--rebuild", "m.cpu:e")
    assert status == {"m.cpu:e": "built", "m.cpu:d": "cached"} and WARNING not in err
    status, io, err = _build(proj, env)
    assert io.get("noop") is True and WARNING not in err
    assert run_mopt("plan", "r.toml", cwd=proj, env=env).stderr == ""
    # a version bump is a new key: rebuilt, nothing to warn about
    module.write_text(PLUGIN.replace('version = "1"', 'version = "2"'))
    status, io, err = _build(proj, env)
    assert status == {"m.cpu:e": "built", "m.cpu:d": "cached"} and not [w for w in err if "warning" in w]


def test_rebuild_runs_the_selected_targets_and_what_reads_changed_bytes(tmp_path: Path) -> None:
    proj, env = _project(tmp_path)
    _build(proj, env)
    status, _, _ = _build(proj, env, "--rebuild", "m.cpu:d")
    assert status == {"m.cpu:e": "cached", "m.cpu:d": "built"}
    # e's output now differs (the kind reads an environment variable its key does not hold):
    # d, which reads it, runs too
    status, _, _ = _build(proj, {**env, "CODEPLUG_OUT": "other"}, "--rebuild", "*:e")
    assert status == {"m.cpu:e": "built", "m.cpu:d": "built"}
    assert (proj / "build/m/cpu/d/d").read_text() == "other"
    proc = run_mopt("build", "r.toml", "--rebuild", "m.cpu:x", cwd=proj, env=env)
    assert proc.returncode == 2 and "selector 'm.cpu:x' matches no target" in proc.stderr
