"""`mopt report --compare REF`: the nodes of this build beside those of an earlier one that a
mopt.lock recorded (at a git revision, or in a file); and its errors. Through the real CLI on
the fixture plugin's toy kinds (the core's tests/fixture_plugin, installed by `nox -s tests`)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from mopt_report.report import metric_diff, shape_order

from tests.conftest import run_mopt

RECIPE = """\
schema = 1

[models.toy]
family = "toyfam"
source = { path = "toy-model" }

[toy.cpu]
hardware = "cpu"
targets = ["toy-weights", "toy-export", "toy-engine", "toy-check"]
"""

OPSET_13 = "\n[toy.cpu.toy-export]\nopset = 13\n"


def git(cwd: Path, *args: str) -> None:
    subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *args],
        cwd=cwd, check=True, capture_output=True,
    )  # fmt: skip


def build(cwd: Path) -> None:
    proc = run_mopt("build", "r.toml", "--no-check", cwd=cwd)
    assert proc.returncode == 0, proc.stderr


def compare_json(cwd: Path, ref: str, env: dict[str, str] | None = None) -> dict:
    proc = run_mopt("report", "r.toml", "--compare", ref, "--json", cwd=cwd, env=env)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)["compare"]


@pytest.fixture
def repo(project: Path) -> Path:
    """The toy recipe built once and committed with its mopt.lock, then built again with
    the export's opset changed (17 → 13)."""
    (project / "r.toml").write_text(RECIPE)
    build(project)
    git(project, "init", "-q", ".")
    git(project, "add", "r.toml", "mopt.lock")
    git(project, "commit", "-qm", "first build")
    (project / "r.toml").write_text(RECIPE + OPSET_13)
    build(project)
    return project


def test_compare_with_a_git_revision_shows_the_changed_param_and_what_it_changed(repo: Path) -> None:
    cmp = compare_json(repo, "HEAD")
    nodes = {n["id"]: n for n in cmp["nodes"]}
    assert cmp["ref"] == "HEAD" and cmp["lock"] == "HEAD:mopt.lock"
    assert cmp["counts"] == {"same": 1, "changed": 4}
    assert nodes["toy.cpu:toy-weights"]["state"] == "same"
    export = nodes["toy.cpu:toy-export"]
    assert export["params"] == {"opset": [17, 13]} and export["changes"] == ["param opset: 17 → 13"]
    # the export's result is {"opset": n}: a number without an interval claims nothing
    assert export["metrics"] == [
        {"metric": "opset", "old": 17, "new": 13, "old_ci": None, "new_ci": None, "old_n": None, "new_n": None,
         "change_pct": -23.53, "verdict": "no interval"}
    ]  # fmt: skip
    for dependent in ("toy.cpu:toy-engine", "toy.cpu:toy-check[toy-export]", "toy.cpu:toy-check[toy-engine]"):
        assert nodes[dependent]["changes"] == ["input 'model' changed"] and nodes[dependent]["params"] == {}

    # the terminal table, and the page's section
    proc = run_mopt("report", "r.toml", "--compare", "HEAD", "-o", "page.html", cwd=repo)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "r.toml: HEAD → now: 4 changed, 1 same"
    assert lines[1].split() == ["node", "state", "what", "changed", "old", "new", "change", "verdict"]
    assert lines[2].split() == ["toy.cpu:toy-export", "changed"]
    assert lines[3].split() == ["param", "opset:", "17", "→", "13"]
    assert lines[4].split() == ["opset", "17", "13", "-23.5", "%", "no", "interval"]
    page = (repo / "page.html").read_text()
    assert "<h2>compared with HEAD</h2>" in page
    assert '<tr data-node="toy.cpu:toy-export" data-state="changed">' in page
    assert "<div>param opset: 17 → 13</div>" in page
    assert 'data-node="toy.cpu:toy-weights"' not in page  # the same: counted, not listed


def test_compare_with_a_lock_file_lists_nodes_of_one_build_only_and_gc_d_entries(repo: Path) -> None:
    (repo / "old.lock").write_text(subprocess.run(["git", "show", "HEAD:mopt.lock"], cwd=repo, text=True,
                                                  capture_output=True, check=True).stdout)  # fmt: skip
    # the checks leave the recipe; a second engine joins it (its first build is now)
    (repo / "r.toml").write_text(
        RECIPE.replace('"toy-check"]', '"engine-2"]') + OPSET_13 + '\n[toy.cpu.engine-2]\nkind = "toy-engine"\n'
        'opt_level = 5\n'
    )  # fmt: skip
    build(repo)
    nodes = {n["id"]: n for n in compare_json(repo, "old.lock")["nodes"]}
    assert nodes["toy.cpu:engine-2"]["state"] == "only-new"
    assert nodes["toy.cpu:engine-2"]["note"] == "not in old.lock's build"
    for gone in ("toy.cpu:toy-check[toy-export]", "toy.cpu:toy-check[toy-engine]"):
        assert nodes[gone]["state"] == "only-old" and nodes[gone]["note"] == "no longer in the recipe"
    assert nodes["toy.cpu:toy-export"]["state"] == "changed"

    # entries no lock file pins any more are collected: the earlier export is gone from the store
    gc = run_mopt("gc", "--older-than", "0s", cwd=repo)
    assert gc.returncode == 0, gc.stderr
    nodes = {n["id"]: n for n in compare_json(repo, "old.lock")["nodes"]}
    export = nodes["toy.cpu:toy-export"]
    assert export["state"] == "gone" and export["note"] == "not in the store any more (gc'd)"
    assert export["changes"] == [] and export["metrics"] == []
    proc = run_mopt("report", "r.toml", "--compare", "old.lock", cwd=repo)
    assert proc.returncode == 0, proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines()]
    assert ["toy.cpu:toy-export", "gone", "not", "in", "the", "store", "any", "more", "(gc'd)"] in rows


def test_compare_errors_say_what_is_wrong_exit_2_and_no_traceback(project: Path) -> None:
    (project / "r.toml").write_text(RECIPE)
    build(project)
    # outside any git repository (git must not find one above tmp_path either)
    env = {"GIT_CEILING_DIRECTORIES": str(project.parent)}

    def fails(ref: str, *expected: str) -> None:
        proc = run_mopt("report", "r.toml", "--compare", ref, cwd=project, env=env)
        assert proc.returncode == 2, (ref, proc.stdout, proc.stderr)
        assert "Traceback" not in proc.stderr
        for text in expected:
            assert text in proc.stderr, (ref, proc.stderr)

    fails("HEAD~1", "--compare HEAD~1: no such file, and", "is not in a git repository")
    (project / "other.lock").write_text(json.dumps({"recipes": {"other.toml": {"artifacts": {}}}}))
    fails(
        "other.lock", "other.lock: the lock file records no build of recipe r.toml (it records: other.toml)"
    )
    (project / "bad.lock").write_text("{not json")
    fails("bad.lock", "bad.lock: lock file is not valid JSON")

    git(project, "init", "-q", ".")
    git(project, "add", "r.toml")
    git(project, "commit", "-qm", "the recipe, without its lock file")
    fails("no-such-rev", "--compare no-such-rev: unknown git revision")
    fails("HEAD", "--compare HEAD: that revision has no mopt.lock", "git log -- mopt.lock")


def test_an_interval_that_overlaps_is_noise_one_apart_is_significant() -> None:
    old = {"p50_ms": {"1x8": 10.0, "8x8": 20.0, "1x16": 5.0}, "p50_ci_ms": {"1x8": [9.0, 11.0], "8x8": [19.0, 21.0],
           "1x16": None}, "samples": {"1x8": 6, "8x8": 6, "1x16": 3}, "score": 0.5}  # fmt: skip
    new = {"p50_ms": {"1x8": 10.5, "8x8": 25.0, "1x16": 4.0}, "p50_ci_ms": {"1x8": [10.0, 11.5], "8x8": [24.0, 26.0],
           "1x16": [3.9, 4.1]}, "samples": {"1x8": 6, "8x8": 6, "1x16": 8}, "score": 0.5}  # fmt: skip
    got = {m["metric"]: (m["verdict"], m["change_pct"]) for m in metric_diff(old, new)}
    assert got == {
        "p50_ms[1x8]": ("within noise", 5.0),
        "p50_ms[8x8]": ("significant", 25.0),
        "p50_ms[1x16]": ("no interval", -20.0),  # the old run had too few calls for one
    }


def test_shapes_are_ordered_by_batch_then_sequence_length() -> None:
    shapes = ["32x128", "1x128", "8x128", "8x64", "bucket-a"]
    assert sorted(shapes, key=shape_order) == ["1x128", "8x64", "8x128", "32x128", "bucket-a"]


def test_jinja2_is_imported_by_the_page_only() -> None:
    """No command but `report` renders, and loading the plugin loads neither the report nor
    jinja2: it stays out of every other path (the no-op build's above all)."""
    import sys

    code = "import sys, mopt.cli, mopt.cli_build, mopt.build, mopt_report.plugin; print('jinja2' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_report_help_names_the_default_it_writes(tmp_path: Path) -> None:
    proc = run_mopt("report", "--help", cwd=tmp_path)
    assert "build/report.html" not in proc.stdout
    assert "report-<recipe name>.html in the build folder" in " ".join(proc.stdout.split())


def test_the_command_comes_from_the_plugin_and_goes_with_it(tmp_path: Path) -> None:
    listed = run_mopt("--help", cwd=tmp_path).stdout
    assert "report" in listed.split()
    proc = run_mopt("report", "--help", cwd=tmp_path, env={"MOPT_DISABLE_PLUGINS": "report"})
    assert proc.returncode == 2 and "No such command 'report'" in proc.stderr


def test_a_kinds_explain_lines_are_shown_beside_its_figure() -> None:
    """A deploy's capacity plan (its `explain` lines) beside its capacity figure (the load curve)."""
    from mopt_report.report import render, sections

    svg = '<svg xmlns="http://www.w3.org/2000/svg"><text>load curve</text></svg>'
    row = {"id": "m.cpu:deploy", "section": "m.cpu", "target": "deploy", "kind": "deploy", "bytes": 10,
           "path": "build/m/cpu/deploy", "key": "k" * 64, "built": "2026-12-05 10:00", "seconds": 1.0,
           "fingerprint": {}, "shapes": {}, "reasons": [], "verdicts": [], "mark": "", "figures": [svg],
           "notes": ["capacity for 2,000 requests/s at p99 <= 100 ms: 3 replicas, 4 to be safe at the lower bound"]}  # fmt: skip
    (sec,) = sections([row])
    assert [(t, notes) for t, _data, notes in sec["figures"]] == [("deploy", row["notes"])]
    page = render(Path("r.toml"), [row])
    m = re.search(r'<figure><figcaption>deploy</figcaption><div class="fig-row"><img [^>]*>\s*'
                  r'<pre class="notes" data-target="deploy">([^<]*)</pre></div></figure>', page)  # fmt: skip
    assert m and "3 replicas, 4 to be safe at the lower bound" in m[1]
