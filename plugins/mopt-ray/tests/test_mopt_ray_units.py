"""The Ray executor without a cluster: placement rules, feasibility, the worker command."""

from __future__ import annotations

import json
from pathlib import Path

import click
import pytest
from click.testing import CliRunner
from mopt_ray.placement import Placement, infeasible, local_resources, placement
from mopt_ray.plugin import RayExecutor

from mopt.api import HardwareProfile
from mopt.plugins import get_registry

pytest.importorskip("mopt_fixture")


def _kind(name: str):  # type: ignore[no-untyped-def]
    return get_registry().targets[name]()


def _hw(name: str) -> HardwareProfile:
    return get_registry().hardware[name]


def test_registered_as_executor() -> None:
    assert get_registry().executors["ray"] is RayExecutor
    s = RayExecutor.Settings.model_validate({"kind": "ray", "address": "ray://head:10001"})
    assert s.max_retries == 3 and s.address == "ray://head:10001"
    with pytest.raises(ValueError, match="adress"):
        RayExecutor.Settings.model_validate({"kind": "ray", "adress": "auto"})


def test_placement_rules() -> None:
    engine = _kind("toy-engine")  # per_hardware, no requirements
    p = placement(engine, engine.Params(), _hw("rtx4060-laptop"))
    assert p == Placement(num_cpus=1.0, num_gpus=0.0, resources={"mopt:rtx4060-laptop": 1.0})
    # a CPU profile needs no custom resource: any node has CPUs
    assert placement(engine, engine.Params(), _hw("cpu")).resources == {}
    # hardware-independent kinds run anywhere, GPU sections included
    export = _kind("toy-export")
    assert placement(export, export.Params(), _hw("toy-gpu")).demand() == {"CPU": 1.0}
    # requires "gpu": a GPU, and (per_hardware) the profile's node
    gpu_only = _kind("toy-gpu-only")
    p = placement(gpu_only, gpu_only.Params(), _hw("toy-gpu"))
    assert p.num_gpus == 1.0 and p.resources == {"mopt:toy-gpu": 1.0}
    # portable kinds: per_hardware, but may run on any node
    assert placement(engine, engine.Params(), _hw("toy-gpu"), portable_kinds=["toy-engine"]).resources == {}


def test_requires_hardware_takes_the_profiles_gpu_count() -> None:
    class TP8(type(_kind("toy-engine"))):  # type: ignore[misc]
        requires = ("hardware",)

    hw = HardwareProfile(
        name="h200x8", description="8 × H200", gpu_name="NVIDIA H200", compute_capability=(9, 0), gpu_count=8
    )
    p = placement(TP8(), TP8.Params(), hw)
    assert p.num_gpus == 8.0 and p.resources == {"mopt:h200x8": 1.0}


def test_infeasible_names_the_missing_resource() -> None:
    nodes = [{"CPU": 2.0, "mopt:rtx4060-laptop": 1.0, "memory": 1e9, "node:10.0.0.1": 1.0}]
    assert infeasible(Placement(resources={"mopt:rtx4060-laptop": 1.0}), nodes) is None
    why = infeasible(Placement(resources={"mopt:toy-gpu": 1.0}), nodes)
    assert why is not None
    assert "no Ray worker offers mopt:toy-gpu" in why and "mopt:rtx4060-laptop 1" in why
    assert "--resources='{\"mopt:toy-gpu\": 1}'" in why and "node:" not in why
    why = infeasible(Placement(num_cpus=4.0), nodes)
    assert why is not None and "no single Ray node has CPU 4" in why
    # two nodes that together have enough are not one node that has enough
    split = [{"CPU": 1.0, "GPU": 1.0}, {"CPU": 1.0, "mopt:a": 1.0}]
    assert infeasible(Placement(num_gpus=1.0, resources={"mopt:a": 1.0}), split) is not None


def _worker_cli() -> click.Group:
    """The real `mopt` group: `worker` comes in through the plugin's mopt_register_commands."""
    from mopt.cli import app

    return app


def _fake_probe(monkeypatch: pytest.MonkeyPatch, gpus: list[tuple[str, tuple[int, int]]]) -> None:
    from mopt import machine

    found = tuple(machine.GPU(i, name, cc, 8188, "580.00") for i, (name, cc) in enumerate(gpus))
    probe = machine.GPUProbe(
        gpus=found, visible=found, source="nvidia-smi", error=None if found else "no GPU"
    )
    monkeypatch.setattr(machine, "probe_gpus", lambda: probe)


def test_worker_print_resources(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    _fake_probe(monkeypatch, [("NVIDIA GeForce RTX 4060 Laptop GPU", (8, 9))])
    res = runner.invoke(_worker_cli(), ["worker", "--print-resources"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout) == {"mopt:rtx4060-laptop": 1}
    res = runner.invoke(_worker_cli(), ["worker", "--address", "10.0.0.1:6379"])
    assert "ray start --address=10.0.0.1:6379 --resources='{\"mopt:rtx4060-laptop\": 1}'" in res.stdout

    _fake_probe(monkeypatch, [])
    res = runner.invoke(_worker_cli(), ["worker", "--print-resources"])
    assert res.exit_code == 0 and json.loads(res.stdout) == {}
    assert "CPU-only" in res.stderr


def test_local_resources_counts_gpu_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_probe(monkeypatch, [("NVIDIA H200", (9, 0))] * 8)
    from mopt.cli import PluginCore

    res, _notes = local_resources(get_registry(), PluginCore())
    assert res.get("mopt:h200") == 8.0


def test_needs_a_writable_remote_cache(tmp_path: Path) -> None:
    from mopt.build import Engine
    from mopt.cli import Session
    from mopt.errors import MoptError
    from mopt.executor import BuildSession

    (tmp_path / "mopt.toml").write_text('[store]\npath = ".mopt"\n')
    (tmp_path / "r.toml").write_text(
        'schema = 1\n[models.toy]\nfamily = "toyfam"\n[toy.cpu]\nhardware = "cpu"\ntargets = ["c"]\n'
        '[toy.cpu.c]\nkind = "command"\nargv = ["true"]\n'
    )
    engine = Engine(Session(tmp_path / "r.toml"))
    with pytest.raises(MoptError, match=r"\[remote\] url: the ray executor needs a remote cache"):
        RayExecutor().build(BuildSession(engine, list(engine.graph.nodes), remote=engine.remote))
    (tmp_path / "mopt.toml").write_text(
        f'[store]\npath = ".mopt"\n[remote]\nurl = "file://{tmp_path}/remote"\npush = false\n'
    )
    engine = Engine(Session(tmp_path / "r.toml"))
    with pytest.raises(MoptError, match=r"\[remote\] push: .* push = false"):
        RayExecutor().build(BuildSession(engine, list(engine.graph.nodes), remote=engine.remote),
                            settings={"kind": "ray"})
