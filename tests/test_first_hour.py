"""The first hour (issue 28, section 3): errors found before a build, a failing action's own
output, what the terminal shows, the recipe found without naming it, JSON errors, `mopt kinds`."""

from __future__ import annotations

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
    for cmd in (["check"], ["plan"], ["plan", "--json"], ["build"], ["build", "--no-check"]):
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
