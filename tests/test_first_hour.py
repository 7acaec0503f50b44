"""The first hour (issue 28, section 3): errors found before a build, a failing action's own
output, what the terminal shows, the recipe found without naming it, JSON errors, `mopt kinds`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.conftest import TOY_MODEL, run_mopt, write_files

MODEL = """\
schema = 1

[models.toy]
family = "toyfam"
source = { path = "toy-model" }
"""


@pytest.mark.parametrize(
    ("where", "extra", "expected"),
    [
        ("target", '[toy.cpu.toy-check]\ndata = "my-texts.txt"\n', "r.toml:11: [toy.cpu.toy-check] data"),
        ("defaults", '[defaults]\ntoy-check = { data = "my-texts.txt" }\n', "r.toml:11: [defaults.toy-check] data"),
        ("extended", "", "base.toml:2: [defaults.toy-check] data"),
        ("command", '[toy.cpu.c]\nkind = "command"\nargv = ["true"]\nfiles = ["{model}/my-texts.txt"]\n',
         "r.toml:13: [toy.cpu.c] files"),
    ],
)
def test_a_missing_data_file_is_found_before_any_action_runs(tmp_path: Path, where: str, extra: str,
                                                               expected: str) -> None:
    """`check`, `plan` and `build` (with or without its check) name the recipe line of the
    param naming the missing file; no action runs (the targets before it would have built)."""
    shutil.copytree(TOY_MODEL, tmp_path / "toy-model")
    targets = '"toy-weights", "toy-export", "toy-check"' + (', "c"' if where == "command" else "")
    head = MODEL.replace("schema = 1\n", 'schema = 1\nextends = ["base.toml"]\n' if where == "extended" else "schema = 1\n")
    write_files(tmp_path, {"r.toml": head + f"\n[toy.cpu]\ntargets = [{targets}]\n\n" + extra,
                           "base.toml": '[defaults]\ntoy-check = { data = "my-texts.txt" }\n'})
    missing = tmp_path / ("toy/my-texts.txt" if where == "command" else "my-texts.txt")
    for cmd in (["check"], ["plan"], ["build"], ["build", "--no-check"]):
        proc = run_mopt(*cmd, "r.toml", cwd=tmp_path)
        assert proc.returncode == 2, (cmd, proc.stdout, proc.stderr)
        assert proc.stderr.splitlines()[-1] == (
            f"error: {expected}: input file {missing} does not exist "
            "(fix the path, relative to the recipe's folder, or create the file)"
        ), cmd
        assert "running" not in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "build").exists()
    missing.parent.mkdir(exist_ok=True)
    missing.write_text("a text\n")
    assert run_mopt("build", "r.toml", cwd=tmp_path).returncode == 0


def test_a_failing_command_shows_its_own_output_not_mopts_frames(tmp_path: Path) -> None:
    write_files(tmp_path, {"r.toml": 'schema = 1\n[models.m]\nfamily = "generic"\n[m.cpu]\ntargets = ["c"]\n'
                           '[m.cpu.c]\nkind = "command"\n'
                           'argv = ["sh", "-c", "for i in $(seq 1 20); do echo err $i >&2; done; exit 3"]\n'})
    proc = run_mopt("build", "r.toml", cwd=tmp_path)
    assert proc.returncode == 1
    shown = [line[4:] for line in proc.stderr.splitlines() if line.startswith("  | ")]
    assert shown == [f"err {i}" for i in range(6, 21)], proc.stderr  # the last 15 lines it printed
    assert "Traceback" not in proc.stderr and "runner.py" not in proc.stderr
    log = Path(proc.stderr.split("full log: ")[1].split()[0])
    assert "Traceback" in log.read_text()  # kept for a plugin's author


def test_the_live_view_prints_names_and_messages_as_they_are_and_cuts_long_lines(monkeypatch) -> None:
    import io
    import sys
    import time
    from types import SimpleNamespace

    from rich.console import Console

    from mopt.cli_build import LiveReporter

    monkeypatch.setattr(sys, "stderr", io.StringIO())
    r = LiveReporter()
    st = SimpleNamespace(node=SimpleNamespace(id="m.cpu:b", kind="command"), status="failed",
                         reason="RuntimeError: [red]no[/red] :smile:", started=time.time(),
                         last_line="step 1 of 9: " + "word " * 60)
    r.start({"a": st, "b": st})
    r.started(st)
    view = io.StringIO()
    Console(file=view, width=60).print(r.live.renderable)  # what the terminal shows while it runs
    rows = view.getvalue().splitlines()
    assert len(rows) == 2 and "m.cpu:b step 1 of 9: word" in rows[0] and rows[0].endswith("…"), rows
    r.done(st)
    r.stop()
    assert "     failed m.cpu:b: RuntimeError: [red]no[/red] :smile:\n" in sys.stderr.getvalue()


CMD = 'schema = 1\n[models.m]\nfamily = "generic"\n[m.cpu]\ntargets = ["a", "b"]\n' \
      '[m.cpu.a]\nkind = "command"\nargv = ["sh", "-c", "echo a > {out}/a"]\n' \
      '[m.cpu.b]\nkind = "command"\ninput = "a"\nargv = ["sh", "-c", "cat {in}/a > {out}/b"]\n'


def test_the_one_recipe_in_the_folder_is_used_when_recipe_is_left_out(tmp_path: Path) -> None:
    write_files(tmp_path, {"mopt.toml": '[store]\npath = ".mopt"\n', "pyproject.toml": '[project]\nname = "x"\n'})
    proc = run_mopt("plan", cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr == (
        f"error: no RECIPE given, and no recipe (a *.toml with `schema = 1`) in {tmp_path} (give the recipe's path)\n")
    write_files(tmp_path, {"r.toml": CMD})
    assert "m.cpu:b" in run_mopt("plan", cwd=tmp_path).stdout
    # a first argument that is no recipe is a selector
    plan = run_mopt("plan", "m.cpu:a", "--json", cwd=tmp_path)
    assert [n["id"] for n in json.loads(plan.stdout)["nodes"]] == ["m.cpu:a"]
    assert "0 errors" in run_mopt("check", cwd=tmp_path).stdout
    build = run_mopt("build", cwd=tmp_path)
    assert build.returncode == 0 and (tmp_path / "build/m/cpu/b/b").read_text() == "a\n"
    # ids mopt prints, typed back without the recipe: explain and show take TARGET alone
    assert "m.cpu:b" in run_mopt("explain", "m.cpu:b", cwd=tmp_path).stdout
    assert json.loads(run_mopt("show", "m.cpu:b", "--json", cwd=tmp_path).stdout)
    none = run_mopt("show", cwd=tmp_path)
    assert none.returncode == 2 and none.stderr.startswith("error: no TARGET given")
    write_files(tmp_path, {"s.toml": CMD})
    for cmd in ("build", "plan", "check"):
        proc = run_mopt(cmd, cwd=tmp_path)
        assert proc.returncode == 2 and proc.stderr == (
            f"error: no RECIPE given, and 2 recipes in {tmp_path}: r.toml, s.toml (name one)\n")
    assert run_mopt("plan", "s.toml", cwd=tmp_path).returncode == 0


def test_with_json_an_error_is_json_on_stdout_and_graph_takes_json(tmp_path: Path) -> None:
    write_files(tmp_path, {"r.toml": CMD.replace('input = "a"', 'input = "z"')})
    proc = run_mopt("plan", "r.toml", "--json", cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr == ""
    assert json.loads(proc.stdout) == {
        "error": "input 'z' is not a target of this section",
        "where": {"file": "r.toml", "line": 11, "table": "m.cpu.b", "key": "input"},
        "hint": "valid targets: a",
    }
    proc = run_mopt("graph", "r.toml", "--json", "--bogus", cwd=tmp_path)
    assert proc.returncode == 2 and json.loads(proc.stdout)["error"] == "No such option '--bogus'."
    write_files(tmp_path, {"r.toml": CMD})
    got = json.loads(run_mopt("graph", "r.toml", "--json", cwd=tmp_path).stdout)
    assert got["nodes"] == [
        {"id": "m.cpu:a", "kind": "command", "section": "m.cpu", "inputs": {"input": []}},
        {"id": "m.cpu:b", "kind": "command", "section": "m.cpu", "inputs": {"input": ["m.cpu:a"]}},
    ]
