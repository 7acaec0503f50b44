"""Sources known before they exist: a source whose bytes follow from its declaration (the
fixture's `toygen`, a `package`) is keyed on that declaration, so plan makes nothing; the
folder's digest is recorded in mopt.lock when an action first reads it and checked after."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from mopt.digest import hash_tree
from tests.conftest import run_mopt

RECIPE = """\
schema = 1

[models.toy]
family = "toyfam"
source = SOURCE

[toy.cpu]
hardware = "cpu"
targets = ["toy-weights", "toy-export"]
"""


def recipe(project: Path, source: str = '{ toygen = "a", seed = 0 }', extra: str = "") -> None:
    (project / "r.toml").write_text(RECIPE.replace("SOURCE", source) + extra)


def plan_keys(project: Path, env: dict[str, str] | None = None) -> dict[str, str]:
    proc = run_mopt("plan", "r.toml", "--json", cwd=project, env=env)
    assert proc.returncode == 0, proc.stderr
    return {n["id"]: n["status"].get("key") for n in json.loads(proc.stdout)["nodes"]}


def source_part(project: Path, env: dict[str, str] | None = None) -> str:
    proc = run_mopt("explain", "r.toml", "toy.cpu:toy-weights", "--json", cwd=project, env=env)
    assert proc.returncode == 0, proc.stderr
    return str(json.loads(proc.stdout)["parts"]["source"])


def build(project: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return run_mopt("build", "r.toml", "--no-check", *args, cwd=project, env=env)


def lock_entry(project: Path) -> dict:
    return json.loads((project / "mopt.lock").read_text())["recipes"]["r.toml"]["sources"]["toy"]


def tree(folder: Path) -> str:
    return hash_tree(folder)[0]


def generated(project: Path) -> list[Path]:
    return sorted((project / ".mopt" / "sources").glob("toygen-*"))


def test_plan_and_explain_make_nothing_and_the_key_follows_the_declaration(project: Path) -> None:
    recipe(project)
    first = plan_keys(project)
    assert first["toy.cpu:toy-weights"] and plan_keys(project) == first  # stable across runs
    assert source_part(project).startswith("declared:")
    assert generated(project) == []  # neither plan nor explain made the folder
    recipe(project, '{ toygen = "a", seed = 1 }')
    seed1 = plan_keys(project)["toy.cpu:toy-weights"]
    assert seed1 != first["toy.cpu:toy-weights"]
    recipe(project, '{ toygen = "b", seed = 0 }')
    assert plan_keys(project)["toy.cpu:toy-weights"] not in (seed1, first["toy.cpu:toy-weights"])
    recipe(project)
    bumped = plan_keys(project, env={"MOPT_FIXTURE_TOYGEN_VERSION": "2"})["toy.cpu:toy-weights"]
    assert bumped not in (seed1, first["toy.cpu:toy-weights"])
    assert generated(project) == []


def test_the_first_read_records_the_digest_and_cached_builds_keep_it(project: Path) -> None:
    recipe(project)
    assert build(project).returncode == 0
    (folder,) = generated(project)
    entry = lock_entry(project)
    assert entry["identity"] == source_part(project)
    assert entry["declared"] == {"label": "a", "seed": 0, "generator": "1"}
    assert entry["digest"] == tree(folder)  # the folder's content digest
    # nothing reads the source in a cached build: the recorded digest stays
    again = build(project, "--json")
    assert json.loads(again.stdout)["counts"] == {"cached": 2}
    assert lock_entry(project)["digest"] == tree(folder)


def test_a_tampered_folder_is_caught_when_an_action_reads_it(project: Path) -> None:
    recipe(project)
    assert build(project).returncode == 0
    (folder,) = generated(project)
    weights = folder / "weights.bin"
    weights.write_text(weights.read_text() + "edited in place\n")
    recipe(project, extra='[toy.cpu.toy-weights]\ndtype = "fp16"\n')  # a miss: the action reads the source
    proc = build(project)
    assert proc.returncode == 1
    line = next(x for x in proc.stderr.splitlines() if x.startswith("FAILED toy.cpu:toy-weights"))
    assert "[models.toy] source: its folder" in line and str(folder) in line
    assert "mopt.lock recorded" in line and "delete that folder" in line
    assert "Traceback" not in proc.stderr
    # what mopt.lock recorded is kept; made again, the folder passes
    assert lock_entry(project)["digest"] != tree(folder)
    shutil.rmtree(folder)
    assert build(project).returncode == 0
    assert lock_entry(project)["digest"] == tree(generated(project)[0])


def test_a_generator_that_is_not_deterministic_is_caught_in_a_fresh_store(project: Path) -> None:
    recipe(project)
    noisy = {"MOPT_FIXTURE_TOYGEN_NOISE": "1"}
    assert build(project, env=noisy).returncode == 0
    recorded = lock_entry(project)["digest"]
    shutil.rmtree(project / ".mopt")  # another machine, the same recipe and mopt.lock
    proc = build(project, env=noisy)
    assert proc.returncode == 1
    assert f"but mopt.lock recorded {recorded[:12]} for this same declaration" in proc.stderr
    assert "not deterministic" in proc.stderr


def test_frozen_holds_for_the_same_declaration_and_names_what_changed(project: Path) -> None:
    recipe(project)
    assert build(project).returncode == 0
    assert build(project, "--frozen").returncode == 0
    shutil.rmtree(project / ".mopt")  # --frozen in a fresh store: built, read and checked
    assert build(project, "--frozen").returncode == 0
    recipe(project, '{ toygen = "a", seed = 3 }')
    proc = build(project, "--frozen")
    assert proc.returncode == 2
    assert "--frozen: source of model 'toy' changed (seed 0 → 3)" in proc.stderr


def _fake_package(site: Path, version: str, editable: bool = False) -> None:
    """An installed distribution `fake-model-pkg` shipping a model folder."""
    shutil.rmtree(site, ignore_errors=True)
    pkg = site / "fake_model_pkg" / "model"
    pkg.mkdir(parents=True)
    (site / "fake_model_pkg" / "__init__.py").write_text("")
    (pkg / "config.json").write_text('{"model_type": "toy"}')
    (pkg / "weights.bin").write_text("w" * 100)
    info = site / f"fake_model_pkg-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: fake-model-pkg\nVersion: {version}\n")
    if editable:
        (info / "direct_url.json").write_text(json.dumps({"url": "file:///src", "dir_info": {"editable": True}}))


@pytest.mark.parametrize("editable", [False, True])
def test_a_package_source_is_keyed_on_its_installed_version(project: Path, editable: bool) -> None:
    site = project / "site"
    env = {"PYTHONPATH": str(site)}
    recipe(project, '{ package = "fake-model-pkg", subdir = "model" }')
    _fake_package(site, "1.0", editable)
    v1 = plan_keys(project, env)["toy.cpu:toy-weights"]
    part = source_part(project, env)
    _fake_package(site, "2.0", editable)
    v2 = plan_keys(project, env)["toy.cpu:toy-weights"]
    if not editable:
        assert part.startswith("declared:") and v1 != v2
        assert build(project, env=env).returncode == 0
        assert lock_entry(project)["declared"] == {"package": "fake-model-pkg", "version": "2.0", "subdir": "model"}
        assert lock_entry(project)["digest"] == tree(site / "fake_model_pkg" / "model")
    else:  # an editable install's files change under one version: its bytes are its identity
        assert len(part) == 64 and v1 == v2
        (site / "fake_model_pkg" / "model" / "weights.bin").write_text("edited")
        assert plan_keys(project, env)["toy.cpu:toy-weights"] != v2
