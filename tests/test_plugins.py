"""The plugin API: every hook documented and exercised, discovery, disabling, bad registrations."""

from __future__ import annotations

import inspect
import json
import types
from pathlib import Path
from typing import Any

import pluggy
import pytest

from mopt import hookspecs
from mopt.api import Executor, Family, HardwareProfile, Params, Source, TargetKind, hookimpl
from mopt.errors import PluginError
from mopt.plugins import build_registry, make_plugin_manager
from tests.conftest import run_mopt, write_files

HOOKS = sorted(n for n in dir(hookspecs) if n.startswith("mopt_"))


def test_every_hook_has_a_one_line_doc() -> None:
    assert HOOKS == [
        "mopt_register_executors",
        "mopt_register_families",
        "mopt_register_hardware",
        "mopt_register_sources",
        "mopt_register_targets",
    ]
    for name in HOOKS:
        doc = inspect.getdoc(getattr(hookspecs, name))
        assert doc and "\n" not in doc.strip(), f"{name} needs a one-line docstring"


def test_every_hook_has_a_test_here() -> None:
    """datasette's rule: a hook without a test named after it fails the suite."""
    src = Path(__file__).read_text()
    for name in HOOKS:
        assert f"def test_hook_{name}" in src, f"no test for {name}"


def _registry_with(plugin: Any, name: str = "extra") -> Any:
    pm = make_plugin_manager()
    pm.register(plugin, name=name)
    return build_registry(pm)


def _module(**hooks: Any) -> types.ModuleType:
    mod = types.ModuleType("p")
    for k, v in hooks.items():
        setattr(mod, k, hookimpl(v))
    return mod


class _Kind(TargetKind):
    name = "extra-kind"

    class Params(Params):
        level: int = 1

    def run(self, ctx: Any) -> None:
        return None


def test_hook_mopt_register_targets() -> None:
    reg = _registry_with(_module(mopt_register_targets=lambda register: register(_Kind)))
    assert reg.targets["extra-kind"] is _Kind
    assert reg.origin[("targets", "extra-kind")] == "extra"
    assert "command" in reg.targets  # the core's own kind, registered through the same hook


def test_hook_mopt_register_families() -> None:
    class Fam(Family):
        name = "extra-fam"
        pooling = "cls"

    reg = _registry_with(_module(mopt_register_families=lambda register: register(Fam)))
    assert reg.families["extra-fam"] is Fam


def test_hook_mopt_register_hardware() -> None:
    prof = HardwareProfile(name="extra-gpu", description="x", compute_capability=(10, 0), memory_gb=10)
    reg = _registry_with(_module(mopt_register_hardware=lambda register: register(prof)))
    assert reg.hardware["extra-gpu"].precisions[-2:] == ("nvfp4", "int4")
    assert reg.origin[("hardware", "h200")] == "mopt.builtin.hardware"


def test_hook_mopt_register_sources() -> None:
    class Src(Source):
        name = "extra-src"

        class Params(Params):
            extra_src: str = ""

    class Src2(Source):
        name = "zip"

        class Params(Params):
            zip: str

    with pytest.raises(PluginError, match="needs a field named 'extra-src'"):
        _registry_with(_module(mopt_register_sources=lambda register: register(Src)))
    reg = _registry_with(_module(mopt_register_sources=lambda register: register(Src2)))
    assert reg.sources["zip"] is Src2 and "hf" in reg.sources


def test_hook_mopt_register_executors() -> None:
    class Ex(Executor):
        name = "extra-ex"

    reg = _registry_with(_module(mopt_register_executors=lambda register: register(Ex)))
    assert reg.executors["extra-ex"] is Ex and "local" in reg.executors


def test_duplicate_registration_names_both_plugins() -> None:
    class Dup(_Kind):
        name = "command"

    with pytest.raises(PluginError) as exc:
        _registry_with(_module(mopt_register_targets=lambda register: register(Dup)), name="dupper")
    assert "plugin 'dupper' registers target 'command', already registered by plugin 'mopt.builtin.targets'" in str(exc.value)


def test_bad_params_model_is_refused_naming_the_plugin() -> None:
    class Loose(_Kind):
        name = "loose"

        class Params:  # not pydantic
            pass

    with pytest.raises(PluginError, match=r"plugin 'badplug': Loose\.Params must be a pydantic BaseModel"):
        _registry_with(_module(mopt_register_targets=lambda register: register(Loose)), name="badplug")

    from pydantic import BaseModel

    class Open(_Kind):
        name = "open"

        class Params(BaseModel):
            x: int = 0

    with pytest.raises(PluginError, match="must forbid unknown keys"):
        _registry_with(_module(mopt_register_targets=lambda register: register(Open)))


def test_misspelled_hook_is_rejected_by_check_pending() -> None:
    pm = make_plugin_manager()
    mod = _module(mopt_register_tragets=lambda register: None)
    pm.register(mod, name="typo")
    with pytest.raises(pluggy.PluginValidationError):
        pm.check_pending()


def test_importing_mopt_does_not_import_torch() -> None:
    import subprocess
    import sys

    code = "import mopt, mopt.cli, mopt.plugins, mopt.build, sys; mopt.plugins.get_registry(); " \
           "print(sorted(m for m in ('torch','onnx','onnxruntime','transformers','tensorrt') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_installed_fixture_plugin_is_listed_and_used(tmp_path: Path) -> None:
    """tests/fixture_plugin is installed with pip install -e, like any third-party plugin."""
    proc = run_mopt("plugins", "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    plugins = {p["name"]: p for p in json.loads(proc.stdout)["plugins"]}
    fx = plugins["fixture"]
    assert fx["distribution"] == "mopt-fixture-plugin" and fx["version"] == "0.3.0"
    assert fx["registered"] == {
        "targets": ["toy-weights", "toy-export", "toy-engine", "toy-gpu-only", "toy-check", "toy-timed",
                    "toy-gather"],
        "families": ["toyfam"],
        "hardware": ["toy-gpu"],
    }
    hw = json.loads(run_mopt("hardware", "--json", cwd=tmp_path).stdout)["profiles"]
    assert {p["name"]: p["plugin"] for p in hw}["toy-gpu"] == "fixture"


def test_disable_plugin_by_env_and_by_config(tmp_path: Path) -> None:
    (tmp_path / "toy-model").mkdir()
    write_files(tmp_path, {"r.toml": 'schema = 1\n[models.m]\nfamily = "toyfam"\nsource = { path = "toy-model" }\n'
                                     '[m.cpu]\ntargets = ["toy-weights"]\n'})
    assert run_mopt("plan", "r.toml", cwd=tmp_path).returncode == 0
    proc = run_mopt("plan", "r.toml", cwd=tmp_path, env={"MOPT_DISABLE_PLUGINS": "fixture"})
    assert proc.returncode == 2 and "unknown model family 'toyfam'" in proc.stderr
    (tmp_path / "mopt.toml").write_text('[plugins]\ndisable = ["fixture"]\n')
    proc = run_mopt("plan", "r.toml", cwd=tmp_path)
    assert proc.returncode == 2 and "unknown model family 'toyfam'" in proc.stderr
    listed = json.loads(run_mopt("plugins", "--json", cwd=tmp_path).stdout)
    assert "fixture" not in {p["name"] for p in listed["plugins"]} and listed["disabled"] == ["fixture"]


def test_bad_mopt_toml_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "mopt.toml").write_text('[store]\npaht = "x"\n')
    proc = run_mopt("plugins", cwd=tmp_path)
    assert proc.returncode == 2
    assert "mopt.toml:2: [store] paht: unknown key (did you mean 'path'?)" in proc.stderr
