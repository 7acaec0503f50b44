"""Recipe merging and the graph: sweeps, sharing, wiring, selectors, rendering, schema."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_mopt, write_files

BASE = """\
schema = 1

[models.toy]
family = "toyfam"
source = { path = "toy-model" }

[defaults]
targets = ["toy-weights", "toy-export", "toy-engine", "toy-check"]
toy-engine = { precision = "int8", opt_level = 1 }
toy-check = { min_score = 0.25 }
"""

CHILD = """\
schema = 1
extends = ["base/base.toml"]

[defaults]
toy-engine = { opt_level = 2 }

[toy.cpu]
hardware = "cpu"

[toy.gpu]
hardware = "toy-gpu"
opset = 18

[toy.gpu.toy-engine]
max_batch_size = 4

[toy.gpu.sweep]
"toy-engine.max_batch_size" = [64, 128]
"toy-engine.opt_level" = [2, 3]
"""


def _plan(project: Path, *args: str) -> dict:
    proc = run_mopt("plan", "r.toml", "--json", *args, cwd=project)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def _setup(project: Path) -> None:
    write_files(project, {"base/base.toml": BASE.replace('"toy-model"', '"../toy-model"'), "r.toml": CHILD})


def test_plan_shows_sweep_variants_and_shared_nodes(project: Path) -> None:
    _setup(project)
    nodes = {n["id"]: n for n in _plan(project)["nodes"]}
    engines = sorted(i for i in nodes if i.startswith("toy.gpu:toy-engine"))
    assert engines == [
        "toy.gpu:toy-engine@max_batch_size=128,opt_level=2",
        "toy.gpu:toy-engine@max_batch_size=128,opt_level=3",
        "toy.gpu:toy-engine@max_batch_size=64,opt_level=2",
        "toy.gpu:toy-engine@max_batch_size=64,opt_level=3",
    ]
    v = nodes["toy.gpu:toy-engine@max_batch_size=64,opt_level=3"]
    assert v["variant"] == {"max_batch_size": 64, "opt_level": 3}
    # merge order: sweep > target table > section > child defaults > extended file > kind default
    assert v["params"] == {"precision": "int8", "max_batch_size": 64, "opt_level": 3}
    assert nodes["toy.cpu:toy-engine"]["params"] == {"precision": "int8", "max_batch_size": 32, "opt_level": 2}
    # section-level `opset` reaches only the kinds that take it, only in that section
    gpu_export = [n for n in nodes.values() if n["kind"] == "toy-export"]
    assert sorted(n["params"]["opset"] for n in gpu_export) == [17, 18]
    # weights are identical in both sections: one node, two addresses
    w = nodes["toy.cpu:toy-weights"]
    assert w["addresses"] == ["toy.cpu:toy-weights", "toy.gpu:toy-weights"]
    assert not any(i == "toy.gpu:toy-weights" for i in nodes)
    # the fan-out check validates every engine variant and the export, against the weights
    checks = sorted(i for i in nodes if i.startswith("toy.gpu:toy-check"))
    assert len(checks) == 5  # 4 engine variants + the export (opset 18 here: not shared)
    c = nodes["toy.gpu:toy-check[toy-engine@max_batch_size=64,opt_level=3]"]
    assert c["inputs"] == {"model": ["toy.gpu:toy-engine@max_batch_size=64,opt_level=3"],
                           "reference": ["toy.cpu:toy-weights"]}
    assert c["params"]["min_score"] == 0.25


def test_selectors_with_globs_pull_in_dependencies(project: Path) -> None:
    _setup(project)
    ids = [n["id"] for n in _plan(project, "*.gpu:toy-engine@max_batch_size=64*")["nodes"]]
    assert ids == [
        "toy.cpu:toy-weights",
        "toy.gpu:toy-export",
        "toy.gpu:toy-engine@max_batch_size=64,opt_level=2",
        "toy.gpu:toy-engine@max_batch_size=64,opt_level=3",
    ]
    assert [n["id"] for n in _plan(project, "toy.cpu:toy-weights")["nodes"]] == ["toy.cpu:toy-weights"]


def test_graph_formats(project: Path) -> None:
    _setup(project)
    dot = run_mopt("graph", "r.toml", cwd=project).stdout
    assert dot.startswith("digraph mopt {")
    assert '"toy.cpu:toy-weights" -> "toy.gpu:toy-export";' in dot
    mer = run_mopt("graph", "r.toml", "--format", "mermaid", cwd=project).stdout
    assert mer.startswith("flowchart LR") and " --> " in mer
    bad = run_mopt("graph", "r.toml", "--format", "png", cwd=project)
    assert bad.returncode == 2 and "unknown format 'png'" in bad.stderr


def test_schema_describes_recipes_for_editors(tmp_path: Path) -> None:
    proc = run_mopt("schema", cwd=tmp_path)
    schema = json.loads(proc.stdout)
    section = schema["additionalProperties"]["additionalProperties"]
    assert "h200" in section["properties"]["hardware"]["enum"]
    assert section["properties"]["toy-engine"]["properties"]["opt_level"]["maximum"] == 5
    assert "qwen3" in schema["properties"]["models"]["additionalProperties"]["properties"]["family"]["enum"] \
        or "toyfam" in schema["properties"]["models"]["additionalProperties"]["properties"]["family"]["enum"]


def test_help_reads_well(tmp_path: Path) -> None:
    proc = run_mopt("--help", cwd=tmp_path)
    assert proc.returncode == 0
    for cmd in ("build", "plan", "explain", "show", "ls", "graph", "plugins", "hardware", "gc", "schema"):
        assert cmd in proc.stdout


def test_sections_with_equal_layers_share_validation_not_places(tmp_path: Path) -> None:
    """Sections whose layers hold the same values are merged once (10,000 sections under one
    [defaults]); each still gets its own targets, places and bound params, and a section that
    differs (an override, a sweep, a bad value) is resolved on its own."""
    from mopt.errors import MoptError
    from mopt.graph import build_graph
    from mopt.plugins import get_registry
    from mopt.recipe import load_recipe

    base = (
        'schema = 1\n[defaults]\ntargets = ["a"]\n[defaults.a]\nkind = "command"\n'
        'files = ["in/{model}.txt"]\nargv = ["cat", "{file}"]\n'
    )
    body = "".join(f"[models.m{i}]\n[m{i}.cpu]\n" for i in range(3))
    body += '[models.s]\n[s.cpu.sweep]\n"a.shell" = [false, true]\n'
    body += '[models.o]\n[o.cpu]\nshell = true\n'
    (tmp_path / "r.toml").write_text(base + body)
    reg = get_registry(())
    recipe = load_recipe(tmp_path / "r.toml", reg)
    secs = {s.id: s for s in recipe.sections}
    assert [t.where.table for t in secs["m2.cpu"].targets] == ["m2.cpu.a"]
    assert secs["m0.cpu"].targets[0] is not secs["m1.cpu"].targets[0]
    assert [t.label for t in secs["s.cpu"].targets] == ["a@shell=false", "a@shell=true"]
    assert secs["o.cpu"].targets[0].params.shell is True and secs["m1.cpu"].targets[0].params.shell is False
    graph = build_graph(recipe, reg)
    assert graph.nodes["m1.cpu:a"].target.params.files == ["in/m1.txt"]
    assert graph.nodes["m2.cpu:a"].target.params.files == ["in/m2.txt"]
    # a bad value in one of several equal-looking sections is named in its own table
    (tmp_path / "r.toml").write_text(base + body + '[models.bad]\n[bad.cpu]\nshell = "maybe"\n')
    with pytest.raises(MoptError) as exc:
        load_recipe(tmp_path / "r.toml", reg)
    assert exc.value.table == "bad.cpu", exc.value.render()
