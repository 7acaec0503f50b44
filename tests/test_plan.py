"""`mopt plan` with the build log (a node recorded under its key, its entry and blobs as
recorded: up to date without reading them) prints what the full path (`--no-log`) prints,
on a recipe of many kinds, and writes nothing."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import TOY_MODEL, run_mopt

#: several kinds (a source-reading one, shared nodes, a fan-out, a gather, a declared input
#: file, a `command` with an env allowlist, a sweep, a third-party plugin's kind)
RECIPE = """\
schema = 1

[models.toy]
family = "toyfam"
source = { path = "toy-model" }

[defaults]
targets = ["toy-weights", "toy-export", "toy-check", "toy-gather", "cmd", "tp"]

[defaults.toy-check]
data = "data/calib.txt"

[defaults.cmd]
kind = "command"
files = ["in/{model}.txt"]
argv = ["sh", "-c", "cat {file} > {out}/a; echo $GREETING >> {out}/a"]
env = ["GREETING"]

[defaults.tp]
kind = "tp-copy"
text = "{section}"

[toy.cpu]
hardware = "cpu"

[toy.gpu]
hardware = "toy-gpu"

[toy.gpu.sweep]
"toy-export.opset" = [17, 18]
"""

PLUGIN = """\
from pydantic import Field

from mopt.api import BuildContext, Params, TargetKind, hookimpl


class TpCopy(TargetKind):
    name = "tp-copy"
    version = "1"

    class Params(Params):
        text: str = Field(default="", description="what to write")

    def run(self, ctx: BuildContext):
        (ctx.out / "t.txt").write_text(ctx.params.text)
        return {}


@hookimpl
def mopt_register_targets(register):
    register(TpCopy)
"""


def _make(project: Path) -> None:
    (project / "r.toml").write_text(RECIPE)
    (project / "data").mkdir()
    (project / "data" / "calib.txt").write_text("one\ntwo\n")
    (project / "in").mkdir()
    (project / "in" / "toy.txt").write_text("hello\n")
    site = project / "site"  # a real installed distribution with a `mopt` entry point
    site.mkdir()
    (site / "tpplug.py").write_text(PLUGIN)
    info = site / "tpplug-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: tpplug\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[mopt]\ntpplug = tpplug\n")


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project, built once per worker (its actions run once; each test copies it)."""
    p = tmp_path_factory.mktemp("planstamp") / "proj"
    shutil.copytree(TOY_MODEL, p / "toy-model")
    (p / "mopt.toml").write_text('[store]\npath = ".mopt"\n')
    _make(p)
    build(p)
    return p


@pytest.fixture
def proj(built: Path, tmp_path: Path) -> Path:
    """A copy of the built project (paths in its keys are relative: every key still hits)."""
    p = tmp_path / "proj"
    shutil.copytree(built, p, symlinks=True)
    return p


def _env(p: Path, **extra: str) -> dict[str, str]:
    return {"PYTHONPATH": str(p / "site"), "GREETING": "hi", **extra}


def build(p: Path, *args: str, **env: str) -> dict:
    # --no-lock: a lock file just written is "racy" and would keep the stamp back one build
    proc = run_mopt("build", "r.toml", "--json", "--no-check", "--no-lock", *args, cwd=p, env=_env(p, **env))
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def plan(p: Path, *args: str, **env: str) -> tuple[str, str]:
    """`mopt plan` → (stdout, stderr)."""
    full_env = {k: v for k, v in os.environ.items() if k != "MOPT_DISABLE_PLUGINS"}
    full_env.update(_env(p, **env))
    proc = subprocess.run(
        [sys.executable, "-m", "mopt", "plan", "r.toml", *args], cwd=p, env=full_env, capture_output=True,
        text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout, proc.stderr


def full_path(p: Path, *args: str, **env: str) -> tuple[str, str]:
    return plan(p, "--no-log", *args, **env)


def answered_from_the_log(p: Path, *args: str, **env: str) -> bool:
    """Whether `mopt plan` printed its table from the build log: seen from outside, by the
    modules it imported (`python -X importtime`): the full path builds the graph."""
    full_env = {k: v for k, v in os.environ.items() if k != "MOPT_DISABLE_PLUGINS"}
    full_env.update(_env(p, **env))
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "mopt", "plan", "r.toml", *args], cwd=p, env=full_env,
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return "mopt.graph" not in {ln.rsplit("|", 1)[-1].strip() for ln in proc.stderr.splitlines()}


def test_plan_prints_what_the_full_path_prints(proj: Path) -> None:
    build(proj)
    text, text_err = plan(proj)
    as_json, json_err = plan(proj, "--json")
    assert (text, text_err) == full_path(proj)
    assert (as_json, json_err) == full_path(proj, "--json")
    nodes = json.loads(as_json)["nodes"]
    kinds = {n["kind"] for n in nodes}
    assert kinds == {"toy-weights", "toy-export", "toy-check", "toy-gather", "command", "tp-copy"}
    assert all(n["status"]["summary"] == "up to date" for n in nodes)
    assert any(len(n["addresses"]) > 1 for n in nodes) and "shared)" in text  # shared nodes
    assert any(n["variant"] for n in nodes)  # the sweep
    assert text_err == json_err == ""
    # the table came from the log (nothing changed since the build); --json from the full path
    assert answered_from_the_log(proj) and not answered_from_the_log(proj, "--json")
    (proj / "in" / "toy.txt").write_text("hello again\n")
    assert not answered_from_the_log(proj)


def test_plan_of_selectors_reads_the_log_of_those_selectors(proj: Path) -> None:
    sel = "toy.gpu:toy-check*"
    build(proj, sel)
    out, err = plan(proj, sel, "--json")
    assert (out, err) == full_path(proj, sel, "--json")
    every, _err = plan(proj, "--json")
    assert len(json.loads(out)["nodes"]) < len(json.loads(every)["nodes"])
    assert every == full_path(proj, "--json")[0]


def test_plan_is_read_only(proj: Path) -> None:
    build(proj)

    def tree() -> dict[str, tuple[int, int]]:
        out = {}
        for root, _dirs, files in os.walk(proj):
            for f in files:
                if f.startswith("state.db-"):  # SQLite's own -wal and -shm come and go with a reader
                    continue
                st = os.stat(os.path.join(root, f))
                out[os.path.join(root, f)] = (st.st_size, st.st_mtime_ns)
        return out

    before = tree()
    plan(proj)
    plan(proj, "--json")
    assert tree() == before


@pytest.mark.parametrize("change", ["input byte", "recipe byte", "plugin", "environment", "input touched"])
def test_anything_stale_is_planned_as_the_full_path_plans_it(proj: Path, change: str) -> None:
    build(proj)
    before = plan(proj, "--json")
    env: dict[str, str] = {}
    if change == "input byte":
        (proj / "in" / "toy.txt").write_text("hello again\n")
    elif change == "recipe byte":
        with open(proj / "r.toml", "a") as fh:
            fh.write("\n# a comment\n")
    elif change == "plugin":
        plugin = proj / "site" / "tpplug.py"
        plugin.write_text(plugin.read_text().replace('version = "1"', 'version = "2"'))
    elif change == "environment":
        env = {"GREETING": "hello"}
    elif change == "input touched":  # same bytes, new stat
        os.utime(proj / "data" / "calib.txt", ns=(time.time_ns(), time.time_ns() - 10**9))
    out, err = plan(proj, "--json", **env)
    assert (out, err) == full_path(proj, "--json", **env)
    changed = {n["id"] for n in json.loads(out)["nodes"] if n["status"]["state"] != "up-to-date"}
    if change in ("recipe byte", "input touched"):
        assert (out, err) == before
        assert not changed
    else:
        want = {"input byte": ":cmd", "plugin": ":tp", "environment": ":cmd"}[change]
        assert changed and all(i.endswith(want) for i in changed)
