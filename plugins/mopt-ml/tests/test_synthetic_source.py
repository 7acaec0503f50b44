"""The synthetic source is known before it exists: plan keys it on its declaration (family,
seed, config, generator and library versions) without generating or importing torch; a build
records the generated folder's digest in mopt.lock and checks it whenever it is read again."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from mopt.api import SourceContext
from mopt.digest import hash_tree

from mopt_ml import synthetic
from mopt_ml.synthetic import SyntheticSource

RECIPE = """\
schema = 1

[models.tiny]
family = "qwen3"
source = { synthetic = "qwen3", seed = SEED, config = { hidden_size = 32, num_hidden_layers = LAYERS, num_attention_heads = 2, num_key_value_heads = 1, head_dim = 16, intermediate_size = 64 } }

[tiny.cpu]
hardware = "cpu"
targets = ["weights", "onnx"]
"""


def mopt(cwd: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mopt", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=600, env={**os.environ, **(env or {})})


@pytest.fixture
def project(tmp_path: Path) -> Path:
    (tmp_path / "mopt.toml").write_text('[store]\npath = ".mopt"\n')
    write(tmp_path)
    return tmp_path


def write(project: Path, seed: int = 0, layers: int = 1, extra: str = "") -> None:
    (project / "r.toml").write_text(RECIPE.replace("SEED", str(seed)).replace("LAYERS", str(layers)) + extra)


def weights_key(project: Path, env: dict[str, str] | None = None) -> str:
    proc = mopt(project, "plan", "r.toml", "--json", env=env)
    assert proc.returncode == 0, proc.stderr
    nodes = {n["id"]: n["status"] for n in json.loads(proc.stdout)["nodes"]}
    assert nodes["tiny.cpu:weights"]["state"] == "new"
    return str(nodes["tiny.cpu:weights"]["key"])


def generated(project: Path) -> list[Path]:
    return sorted((project / ".mopt" / "sources").glob("synthetic-*"))


def test_plan_generates_nothing_and_imports_no_torch(project: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    # a torch that cannot be imported: generating the weights would need the real one
    poisoned = tmp_path_factory.mktemp("poisoned")
    (poisoned / "torch").mkdir()
    (poisoned / "torch" / "__init__.py").write_text("raise ImportError('plan imported torch')\n")
    env = {"PYTHONPATH": str(poisoned)}
    first = weights_key(project, env)
    assert weights_key(project, env) == first  # stable across runs
    assert generated(project) == []
    write(project, seed=1)
    seed1 = weights_key(project, env)
    write(project, layers=2)
    config2 = weights_key(project, env)
    assert len({first, seed1, config2}) == 3
    assert generated(project) == []


def _ctx(task: str = "embedding") -> SourceContext:
    return SourceContext(project_dir=Path("."), cache_dir=Path("."), offline=True, family=None,
                         model_name="tiny", task=task)


def test_identity_names_the_generator_version_the_libraries_and_the_task(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.metadata as md

    src = SyntheticSource()
    params = src.Params(synthetic="qwen3", seed=2, config={"hidden_size": 32})
    ident: dict[str, Any] = src.identity(params, _ctx())
    assert ident["family"] == "qwen3" and ident["seed"] == 2 and ident["config"] == {"hidden_size": 32}
    assert ident["tools"]["torch"] == md.version("torch")
    monkeypatch.setattr(synthetic, "GENERATOR_VERSION", "bumped")
    assert src.identity(params, _ctx())["generator"] == "bumped"
    chat = src.identity(params, _ctx("text-generation"))
    assert chat["task"] == "text-generation" and chat["generation"] == synthetic.GENERATION_VERSION


def test_an_unknown_family_fails_at_plan_with_the_registered_ones(project: Path) -> None:
    (project / "r.toml").write_text((project / "r.toml").read_text().replace('synthetic = "qwen3"', 'synthetic = "nope"'))
    proc = mopt(project, "plan", "r.toml")
    assert proc.returncode == 0, proc.stderr  # plan shows it and goes on
    assert "synthetic='nope'" in proc.stdout and "no such family" in proc.stdout


def test_the_generated_folder_is_recorded_made_again_alike_and_checked(project: Path) -> None:
    assert mopt(project, "build", "r.toml", "tiny.cpu:weights", "--no-check").returncode == 0
    (folder,) = generated(project)
    lock = json.loads((project / "mopt.lock").read_text())["recipes"]["r.toml"]["sources"]["tiny"]
    assert lock["identity"].startswith("declared:") and lock["declared"]["seed"] == 0
    assert lock["digest"] == hash_tree(folder)[0]
    # made again (a fresh store) the generator writes the very bytes recorded
    shutil.rmtree(folder)
    write(project, extra='[tiny.cpu.weights]\ndtype = "fp16"\n')
    proc = mopt(project, "build", "r.toml", "tiny.cpu:weights", "--no-check")
    assert proc.returncode == 0, proc.stderr
    assert hash_tree(folder)[0] == lock["digest"]
    # changed in place: the next action that reads it fails, naming the folder
    (folder / "config.json").chmod(0o644)
    (folder / "config.json").write_text((folder / "config.json").read_text().replace("32", "33", 1))
    write(project, extra="[tiny.cpu.weights]\nmax_shard_gb = 1.0\n")
    proc = mopt(project, "build", "r.toml", "tiny.cpu:weights", "--no-check")
    assert proc.returncode == 1
    assert f"[models.tiny] source: its folder {folder} hashes to" in proc.stderr
    assert f"mopt.lock recorded {lock['digest'][:12]}" in proc.stderr
