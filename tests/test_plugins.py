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
        "mopt_register_commands",
        "mopt_register_doctor_checks",
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


def test_duplicate_registration_blames_the_later_plugin_and_names_both() -> None:
    class Dup(_Kind):
        name = "command"

    with pytest.raises(PluginError) as exc:
        _registry_with(_module(mopt_register_targets=lambda register: register(Dup)), name="dupper")
    assert str(exc.value) == (
        "plugin 'dupper' registers target kind 'command', already registered by plugin "
        "'mopt.builtin.targets' (mopt 0.1.0) (rename it in 'dupper', or disable 'dupper' with "
        "MOPT_DISABLE_PLUGINS=dupper)"
    )


def test_duplicate_family_is_spelled_family() -> None:
    class Fam(Family):
        name = "generic"

    with pytest.raises(PluginError, match=r"^plugin 'dupfam' registers model family 'generic', already"):
        _registry_with(_module(mopt_register_families=lambda register: register(Fam)), name="dupfam")


def test_third_party_entry_points_register_after_mopts_own() -> None:
    """A third party named 'acme' sorts before 'ml', yet registers after it: a clash with
    mopt's own plugins is blamed on the third party, however pip ordered the entry points."""
    from mopt.plugins import _entry_points

    pytest.importorskip("acme_distil", reason="pip install -e tests/thirdparty_plugin")
    names = [ep.name for ep in _entry_points()]
    assert "acme" in names and "ml" in names
    assert names.index("ml") < names.index("acme")


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


def test_misspelled_format_is_refused_when_the_kind_registers() -> None:
    """A kind producing "hf-checkpiont" would feed no consumer, silently: refused at once."""
    from mopt.api import Input

    class Typo(_Kind):
        produces = "hf-checkpiont"

    class SlotTypo(_Kind):
        consumes = (Input("model", formats=("onx",)),)

    for cls, bad, best in ((Typo, "hf-checkpiont", "hf-checkpoint"), (SlotTypo, "onx", "onnx")):
        with pytest.raises(PluginError) as exc:
            _registry_with(_module(mopt_register_targets=lambda register, c=cls: register(c)), name="acme9")
        assert str(exc.value) == (
            f"plugin 'acme9': target kind 'extra-kind' names an unknown artifact format {bad!r} (a new "
            f"one is added to mopt.api.FORMATS first; did you mean {best!r}?)"
        )


def test_misspelled_config_keys_name_is_refused_when_the_family_registers() -> None:
    """config_keys = {"hiden": ("dim",)} would be ignored and the estimate read no hidden size."""

    class Fam(Family):
        name = "gpt2ish"
        config_keys = {"hiden": ("n_embd",), "layers": ("n_layer",)}  # noqa: RUF012

    with pytest.raises(PluginError) as exc:
        _registry_with(_module(mopt_register_families=lambda register: register(Fam)), name="acme9")
    assert str(exc.value) == (
        "plugin 'acme9': family Fam.config_keys names 'hiden', which is no dimension mopt reads "
        "(did you mean 'hidden'?)"
    )


def test_misspelled_hook_is_rejected_with_did_you_mean() -> None:
    pm = make_plugin_manager()
    mod = _module(mopt_register_tragets=lambda register: None)
    pm.register(mod, name="typo")
    with pytest.raises(pluggy.PluginValidationError):
        pm.check_pending()  # pluggy agrees; mopt says it in one line, with the fix
    with pytest.raises(PluginError) as exc:
        build_registry(pm)
    assert str(exc.value) == (
        "plugin 'typo' implements an unknown hook 'mopt_register_tragets' (did you mean "
        "'mopt_register_targets'? the hooks are listed in mopt/hookspecs.py)"
    )


def test_undecorated_hook_function_is_a_warning() -> None:
    mod = types.ModuleType("p")
    mod.mopt_register_targets = lambda register: register(_Kind)  # type: ignore[attr-defined]
    reg = _registry_with(mod, name="forgot")
    assert "extra-kind" not in reg.targets
    assert reg.warnings == [
        "plugin 'forgot': function mopt_register_targets is not decorated with @hookimpl, so mopt "
        "never calls it (from mopt.api import hookimpl)"
    ]


def test_exception_in_a_hook_names_plugin_hook_and_error() -> None:
    def boom(register: Any) -> None:
        raise RuntimeError("no GPU table found")

    with pytest.raises(PluginError) as exc:
        _registry_with(_module(mopt_register_hardware=boom), name="boomer")
    assert str(exc.value) == (
        "plugin 'boomer' failed in hook mopt_register_hardware: RuntimeError: no GPU table found "
        "(fix the plugin, or disable it with MOPT_DISABLE_PLUGINS=boomer)"
    )


def _install(site: Path, name: str, code: str) -> dict[str, str]:
    """A real installed distribution (a module and its .dist-info with a `mopt` entry point)
    on a PYTHONPATH folder: how pip would leave it, without pip."""
    site.mkdir(parents=True, exist_ok=True)
    (site / f"{name}.py").write_text(code)
    info = site / f"{name}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[mopt]\n{name} = {name}\n")
    return {"PYTHONPATH": str(site)}


def test_cli_exception_in_a_hook_is_one_line_and_exit_2(tmp_path: Path) -> None:
    env = _install(tmp_path / "site", "brokenplug", (
        "from mopt.api import hookimpl\n"
        "@hookimpl\n"
        "def mopt_register_targets(register):\n"
        "    raise KeyError('weights')\n"
    ))  # fmt: skip
    proc = run_mopt("plugins", cwd=tmp_path, env=env)
    assert proc.returncode == 2
    assert proc.stderr == (
        "error: plugin 'brokenplug' failed in hook mopt_register_targets: KeyError: 'weights' "
        "(fix the plugin, or disable it with MOPT_DISABLE_PLUGINS=brokenplug)\n"
    )
    assert run_mopt("plugins", cwd=tmp_path, env={**env, "MOPT_DISABLE_PLUGINS": "brokenplug"}).returncode == 0
    # MOPT_TRACEBACK=1 adds where the plugin raised, before the same line
    proc = run_mopt("plugins", cwd=tmp_path, env={**env, "MOPT_TRACEBACK": "1"})
    assert proc.returncode == 2
    assert proc.stderr.startswith("Traceback (most recent call last):\n")
    assert 'brokenplug.py", line 4, in mopt_register_targets\n' in proc.stderr
    assert proc.stderr.splitlines()[-1].startswith("error: plugin 'brokenplug' failed in hook mopt_register_targets")


def test_cli_failing_family_dims_is_a_plugin_error(tmp_path: Path) -> None:
    """A family whose dims() raises is its plugin's bug, one line naming plugin, family and
    method (the traceback with MOPT_TRACEBACK=1), not "add config" advice from `mopt check`."""
    env = _install(tmp_path / "site", "famplug", (
        "from mopt.api import Family, hookimpl\n"
        "class Gpt2(Family):\n"
        "    name = 'gpt2ish'\n"
        "    def dims(self, config):\n"
        "        return config['n_embd'] // config['n_head']\n"
        "@hookimpl\n"
        "def mopt_register_families(register):\n"
        "    register(Gpt2)\n"
    ))  # fmt: skip
    write_files(tmp_path, {
        "config.json": '{"n_embd": 64, "n_head": 0}',
        "r.toml": 'schema = 1\n[models.m]\nfamily = "gpt2ish"\nconfig = "config.json"\n'
                  '[m.h200]\nhardware = "h200"\ntargets = ["c"]\n[m.h200.c]\nkind = "command"\nargv = ["true"]\n',
    })  # fmt: skip
    proc = run_mopt("check", "r.toml", cwd=tmp_path, env=env)
    assert proc.returncode == 2
    assert proc.stderr == (
        f"error: plugin 'famplug' failed in family 'gpt2ish' dims() on {tmp_path / 'config.json'}: "
        "ZeroDivisionError: integer division or modulo by zero (fix the plugin (or that config.json), "
        "or disable it with MOPT_DISABLE_PLUGINS=famplug)\n"
    )
    proc = run_mopt("check", "r.toml", cwd=tmp_path, env={**env, "MOPT_TRACEBACK": "1"})
    assert 'famplug.py", line 5, in dims\n' in proc.stderr
    assert proc.stderr.splitlines()[-1].startswith("error: plugin 'famplug' failed in family 'gpt2ish' dims()")


CMD_PLUGIN = """\
from pathlib import Path

import click

from mopt.api import hookimpl


@hookimpl
def mopt_register_commands(cli, core):
    @cli.command("built-files")
    @click.argument("recipe")
    @click.argument("target")
    def built_files(recipe, target):
        \"\"\"Print a built target's files (through the core handed to the hook).\"\"\"
        built = core.built_target(Path(recipe), target, kind="command")
        for rel, blob in sorted(built.files.items()):
            click.echo(f"{built.node_id} {rel}: {blob.read_text().strip()}")
        click.echo(f"profiles: {'cpu' in core.registry().hardware}, gpus probed: {core.probe_gpus() is not None}")
"""


def test_hook_mopt_register_commands(tmp_path: Path) -> None:
    """A plugin's command, added through the hook, reaches the engine only through `core`."""
    env = _install(tmp_path / "site", "cmdplug", CMD_PLUGIN)
    (tmp_path / "mopt.toml").write_text('[store]\npath = ".mopt"\n')
    (tmp_path / "r.toml").write_text(
        'schema = 1\n[models.toy]\nfamily = "toyfam"\n[toy.cpu]\nhardware = "cpu"\ntargets = ["c"]\n'
        '[toy.cpu.c]\nkind = "command"\nargv = ["sh", "-c", "echo hello > {out}/out.txt"]\n'
    )
    assert "built-files" in run_mopt("--help", cwd=tmp_path, env=env).stdout
    proc = run_mopt("built-files", "r.toml", "toy.cpu:c", cwd=tmp_path, env=env)
    assert (proc.returncode, proc.stderr) == (2, "error: toy.cpu:c is not built (run: mopt build r.toml 'toy.cpu:c')\n")
    assert run_mopt("build", "r.toml", cwd=tmp_path, env=env).returncode == 0
    proc = run_mopt("built-files", "r.toml", "toy.cpu:c", cwd=tmp_path, env=env)
    assert (proc.returncode, proc.stdout) == (0, "toy.cpu:c out.txt: hello\nprofiles: True, gpus probed: True\n")
    # a disabled plugin adds no command
    proc = run_mopt("built-files", "r.toml", "toy.cpu:c", cwd=tmp_path, env={**env, "MOPT_DISABLE_PLUGINS": "cmdplug"})
    assert proc.returncode == 2 and "No such command 'built-files'" in proc.stderr


def test_plugin_command_may_not_replace_a_core_command(tmp_path: Path) -> None:
    env = _install(tmp_path / "site", "clashplug", (
        "from mopt.api import hookimpl\n"
        "@hookimpl\n"
        "def mopt_register_commands(cli):\n"  # takes only `cli`: pluggy passes what it names
        "    @cli.command('build')\n"
        "    def build():\n"
        "        pass\n"
    ))  # fmt: skip
    proc = run_mopt("--help", cwd=tmp_path, env=env)
    assert (proc.returncode, proc.stderr) == (
        2,
        "error: plugin 'clashplug' replaces the command 'build' (rename its command, or disable it with "
        "MOPT_DISABLE_PLUGINS=clashplug)\n",
    )


def test_cli_npu_profile_is_refused_in_one_line(tmp_path: Path) -> None:
    env = _install(tmp_path / "site", "npuplug", (
        "from mopt.api import HardwareProfile, hookimpl\n"
        "@hookimpl\n"
        "def mopt_register_hardware(register):\n"
        "    register(HardwareProfile(name='npu1', description='an NPU', device='npu', memory_gb=32))\n"
    ))  # fmt: skip
    proc = run_mopt("hardware", cwd=tmp_path, env=env)
    assert proc.returncode == 2
    assert proc.stderr == (
        "error: plugin 'npuplug' failed in hook mopt_register_hardware: invalid HardwareProfile: device: "
        "device 'npu' is not one of gpu, cpu, accelerator (an "
        'NPU, TPU, ...: device = "accelerator", accelerator = "npu") (fix the plugin, or disable it '
        "with MOPT_DISABLE_PLUGINS=npuplug)\n"
    )


def test_cli_misspelled_hook_is_printed_once(tmp_path: Path) -> None:
    env = _install(tmp_path / "site", "typoplug", (
        "from mopt.api import hookimpl\n"
        "@hookimpl\n"
        "def mopt_register_familes(register):\n"
        "    pass\n"
    ))  # fmt: skip
    proc = run_mopt("plugins", cwd=tmp_path, env=env)
    assert proc.returncode == 2
    assert proc.stderr == (
        "error: plugin 'typoplug' implements an unknown hook 'mopt_register_familes' (did you mean "
        "'mopt_register_families'? the hooks are listed in mopt/hookspecs.py)\n"
    )


def test_cli_undecorated_hook_warns_once(tmp_path: Path) -> None:
    env = _install(tmp_path / "site", "plainplug", "def mopt_register_hardware(register):\n    pass\n")
    proc = run_mopt("plugins", cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == (
        "warning: plugin 'plainplug': function mopt_register_hardware is not decorated with @hookimpl, "
        "so mopt never calls it (from mopt.api import hookimpl)\n"
    )


def test_unknown_names_to_disable_are_warned_about(tmp_path: Path) -> None:
    proc = run_mopt("plugins", cwd=tmp_path, env={"MOPT_DISABLE_PLUGINS": "fixtur"})
    assert proc.returncode == 0
    assert proc.stderr == (
        "warning: MOPT_DISABLE_PLUGINS names 'fixtur', which is no installed plugin (did you mean 'fixture'?)\n"
    )
    (tmp_path / "mopt.toml").write_text('[plugins]\ndisable = ["nosuchplugin"]\n')
    proc = run_mopt("plugins", cwd=tmp_path)
    assert proc.returncode == 0
    assert proc.stderr.startswith(
        "warning: [plugins] disable names 'nosuchplugin', which is no installed plugin (valid plugins: "
    ) and proc.stderr.count("\n") == 1


def test_hardware_profile_device_is_validated() -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="device 'npu' is not one of gpu, cpu, accelerator"):
        HardwareProfile(name="n", description="x", device="npu")
    npu = HardwareProfile(
        name="npu1", description="an NPU", device="accelerator", accelerator="npu", memory_gb=32,
        supported_precisions=("fp16", "int8"),
    )  # fmt: skip
    assert not npu.is_gpu and npu.kind_label == "npu" and npu.precisions == ("fp16", "int8")
    with pytest.raises(ValidationError, match=r'needs accelerator = "<its kind, e\.g\. npu>"'):
        HardwareProfile(name="n", description="x", device="accelerator")
    with pytest.raises(ValidationError, match="compute_capability is a CUDA GPU property"):
        HardwareProfile(name="n", description="x", device="accelerator", accelerator="npu",
                        compute_capability=(8, 0))  # fmt: skip


def test_accelerator_profile_is_listed_as_its_kind_not_a_gpu(tmp_path: Path) -> None:
    env = _install(tmp_path / "site", "npuok", (
        "from mopt.api import HardwareProfile, hookimpl\n"
        "@hookimpl\n"
        "def mopt_register_hardware(register):\n"
        "    register(HardwareProfile(name='npu1', description='an NPU', device='accelerator',\n"
        "             accelerator='npu', memory_gb=32, supported_precisions=('fp16', 'int8')))\n"
    ))  # fmt: skip
    proc = run_mopt("hardware", cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    (row,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("npu1 ")]
    assert row.split()[:3] == ["npu1", "npu", "-"] and "fp16,int8" in row


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
        "sources": ["toygen"],
        "hardware": ["toy-gpu"],
    }
    hw = json.loads(run_mopt("hardware", "--json", cwd=tmp_path).stdout)["profiles"]
    assert {p["name"]: p["plugin"] for p in hw}["toy-gpu"] == "fixture"


def test_disable_plugin_by_env_and_by_config(tmp_path: Path) -> None:
    (tmp_path / "toy-model").mkdir()
    write_files(tmp_path, {"r.toml": 'schema = 1\n[models.m]\nfamily = "toyfam"\nsource = { path = "toy-model" }\n'
                                     '[m.cpu]\ntargets = ["toy-weights"]\n',
                           "k.toml": 'schema = 1\n[models.m]\nfamily = "generic"\n'
                                     '[m.cpu]\ntargets = ["toy-weights"]\n'})  # fmt: skip
    assert run_mopt("plan", "r.toml", cwd=tmp_path).returncode == 0
    proc = run_mopt("plan", "r.toml", cwd=tmp_path, env={"MOPT_DISABLE_PLUGINS": "fixture"})
    assert proc.returncode == 2
    assert proc.stderr == (
        "error: r.toml:3: [models.m] family: model family 'toyfam' is disabled by MOPT_DISABLE_PLUGINS "
        "(plugin 'fixture') (remove 'fixture' from MOPT_DISABLE_PLUGINS to use it)\n"
    )
    (tmp_path / "mopt.toml").write_text('[plugins]\ndisable = ["fixture"]\n')
    proc = run_mopt("plan", "k.toml", cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr == (
        "error: k.toml:5: [m.cpu] targets: target kind 'toy-weights' is disabled by [plugins] disable "
        "(plugin 'fixture') (remove 'fixture' from [plugins] disable to use it)\n"
    )
    listed = json.loads(run_mopt("plugins", "--json", cwd=tmp_path).stdout)
    assert "fixture" not in {p["name"] for p in listed["plugins"]} and listed["disabled"] == ["fixture"]


def test_bad_mopt_toml_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "mopt.toml").write_text('[store]\npaht = "x"\n')
    proc = run_mopt("plugins", cwd=tmp_path)
    assert proc.returncode == 2
    assert "mopt.toml:2: [store] paht: unknown key (did you mean 'path'?)" in proc.stderr


def test_kind_that_turns_the_fast_path_off_is_named(project: Path) -> None:
    """toy-engine overrides fingerprint() (it reads an environment variable, as a kind might
    read a driver) without saying static_fingerprint: the build says so in one line, and the
    next build's --json says why it took the full path. toy-weights / toy-export have no
    fingerprint of their own and keep the fast path."""
    from mopt_fixture.plugin import ToyEngine, ToyExport, ToyWeights

    assert (ToyWeights.static_fingerprint, ToyExport.static_fingerprint, ToyEngine.static_fingerprint) == (
        True, True, False)  # fmt: skip
    (project / "r.toml").write_text(
        'schema = 1\n[models.m]\nfamily = "toyfam"\nsource = { path = "toy-model" }\n'
        '[m.gpu]\nhardware = "toy-gpu"\ntargets = ["toy-weights", "toy-export", "toy-engine"]\n'
    )
    first = run_mopt("build", "r.toml", cwd=project)
    assert first.returncode == 0, first.stderr
    note = (
        "note: no-op fast path off: kind 'toy-engine' (plugin 'fixture') may read machine state in "
        "fingerprint() (static_fingerprint = False); a kind whose fingerprint is package versions "
        "says fingerprint_packages = (...)"
    )
    assert note in first.stderr.splitlines()
    second = run_mopt("build", "r.toml", "--json", cwd=project)
    miss = json.loads(second.stdout)["io"]["noop_miss"]
    assert miss == note.removeprefix("note: ").replace("no-op fast path off", "no-op off")


def test_hook_mopt_register_doctor_checks() -> None:
    """`mopt_register_doctor_checks`: OpenVINO's and the image kinds' lines come from their
    plugins; a check that raises is reported as that check's failure, not the doctor's."""
    from mopt.doctor import diagnose
    from mopt.machine import detect
    from mopt.plugins import Registry

    reg = build_registry(make_plugin_manager([]))
    assert {"openvino", "containers"} <= set(reg.doctor_checks)
    assert reg.origin[("doctor_checks", "containers")] == "image"
    names = [c.name for c in diagnose(detect(), reg)]
    assert {"openvino", "docker", "nvidia-container-runtime", "buildah"} <= set(names)

    def broken(m: object) -> list[dict[str, str]]:
        raise RuntimeError("no probe")

    bad = Registry(doctor_checks={"broken": broken})
    last = diagnose(detect(), bad)[-1]
    assert (last.name, last.status) == ("broken", "fail") and "RuntimeError: no probe" in last.summary
