"""`mopt doctor` and machine detection: the real CLI in a subprocess, with PATH controlling
which tools exist (an empty folder: no nvidia-smi, no docker, no buildah; or a fake
nvidia-smi that reports an H200 or a broken driver)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from mopt import machine
from mopt.api import HardwareProfile
from mopt.doctor import STATUSES

H200_SMI = """#!/bin/sh
case "$*" in
  *--query-gpu*) echo "NVIDIA H200, 9.0, 143771 MiB, 580.159.03, GPU-8f0e2b4c-1111-2222-3333-444455556666" ;;
  *) echo "| NVIDIA-SMI 580.159.03    Driver Version: 580.159.03    CUDA Version: 13.0 |" ;;
esac
"""
BROKEN_SMI = """#!/bin/sh
echo "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver." >&2
exit 9
"""


def _bin(tmp_path: Path, smi: str | None) -> Path:
    d = tmp_path / "bin"
    d.mkdir(exist_ok=True)
    if smi is not None:
        p = d / "nvidia-smi"
        p.write_text(smi)
        p.chmod(p.stat().st_mode | stat.S_IEXEC)
    return d


def _doctor(
    tmp_path: Path, *args: str, smi: str | None = None, extra_env: dict[str, str] | None = None
) -> Any:
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "MOPT_DISABLE_PLUGINS")}
    env["PATH"] = str(_bin(tmp_path, smi))  # only our fake tools: no docker, buildah, real nvidia-smi
    env.update(extra_env or {})
    return subprocess.run(
        [sys.executable, "-m", "mopt", "doctor", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )


def _checks(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in data["checks"]}


def test_doctor_json_without_gpu_or_docker(tmp_path: Path) -> None:
    r = _doctor(tmp_path, "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert set(data) == {"machine", "checks", "profiles", "recipe", "targets"}
    assert {"cpu_model", "cpu_count", "ram_gib", "gpu", "torch", "libraries"} <= set(
        data["machine"]
    )
    assert {"torch", "onnxruntime", "tensorrt", "tensorrt-llm", "vllm", "nvidia-modelopt"} <= set(
        data["machine"]["libraries"]
    )
    checks = _checks(data)
    for name in (
        "cpu",
        "memory",
        "gpu",
        "torch",
        "cuda",
        "onnxruntime",
        "tensorrt",
        "tensorrt-llm",
        "vllm",
        "nvidia-modelopt",
        "docker",
        "nvidia-container-runtime",
        "buildah",
    ):
        assert name in checks, name
    for c in data["checks"]:
        assert c["status"] in STATUSES
        if c["status"] in ("missing", "warn", "fail"):
            assert c["cause"] and c["fix"], c  # every failed check: likely cause and fix
    if not data["machine"]["gpu"]["visible"]:
        gpu = checks["gpu"]
        assert gpu["status"] == "missing" and gpu["summary"].startswith("no NVIDIA GPU")
        assert "--gpus all" in gpu["fix"]
        assert data["profiles"] == ["cpu"]
    assert checks["docker"]["status"] == "missing" and "docker CLI not found" in checks["docker"]["summary"]
    assert checks["buildah"]["status"] == "missing" and "apt-get install buildah" in checks["buildah"]["fix"]


def test_doctor_text_says_what_is_missing(tmp_path: Path) -> None:
    r = _doctor(tmp_path)
    assert r.returncode == 0, r.stderr
    if "nvidia-smi not found" in r.stdout:
        assert "no NVIDIA GPU" in r.stdout
    assert "fix:" in r.stdout and "cause:" in r.stdout
    assert "hardware profiles this machine matches:" in r.stdout


def test_doctor_with_a_fake_h200(tmp_path: Path) -> None:
    data = json.loads(_doctor(tmp_path, "--json", smi=H200_SMI).stdout)
    gpu = data["machine"]["gpu"]
    assert gpu["source"] == "nvidia-smi" and gpu["driver_cuda"] == "13.0"
    assert gpu["gpus"][0]["name"] == "NVIDIA H200" and gpu["gpus"][0]["compute_capability"] == "9.0"
    assert data["profiles"][0] == "h200" and "cpu" in data["profiles"]
    checks = _checks(data)
    assert checks["gpu"]["status"] == "ok" and "NVIDIA H200" in checks["gpu"]["summary"]
    if data["machine"]["torch"]["installed"] and not data["machine"]["torch"]["cuda"]:
        # a CPU-only torch on a GPU machine is the classic mistake
        assert checks["cuda"]["status"] == "fail" and "download.pytorch.org" in checks["cuda"]["fix"]


def test_doctor_gpu_hidden_by_cuda_visible_devices(tmp_path: Path) -> None:
    data = json.loads(
        _doctor(tmp_path, "--json", smi=H200_SMI, extra_env={"CUDA_VISIBLE_DEVICES": ""}).stdout
    )
    gpu = _checks(data)["gpu"]
    assert gpu["status"] == "fail" and "none visible" in gpu["summary"]
    assert "CUDA_VISIBLE_DEVICES" in gpu["fix"]
    assert data["profiles"] == ["cpu"]


def test_doctor_broken_driver(tmp_path: Path) -> None:
    data = json.loads(_doctor(tmp_path, "--json", smi=BROKEN_SMI).stdout)
    gpu = _checks(data)["gpu"]
    assert gpu["status"] == "missing" and "nvidia-smi failed (exit 9)" in gpu["summary"]
    assert "driver" in gpu["cause"] and "reboot" in gpu["fix"]


def test_doctor_bad_recipe_exits_2(tmp_path: Path) -> None:
    r = _doctor(tmp_path, "nope.toml")
    assert r.returncode == 2
    assert "recipe not found" in r.stderr and "Traceback" not in r.stderr


def test_check_missing_recipe_exits_2(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "mopt", "check", "missing.toml"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "recipe not found" in r.stderr


def test_check_bad_recipe_exits_2_with_location(tmp_path: Path) -> None:
    (tmp_path / "r.toml").write_text(
        'schema = 1\n[models.m]\nfamily = "no-such-family"\nsource = { path = "x" }\n'
    )
    r = subprocess.run(
        [sys.executable, "-m", "mopt", "check", "r.toml"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2
    assert "r.toml" in r.stderr and "family" in r.stderr and "Traceback" not in r.stderr


# --------------------------------------------------------------------------- in process


@pytest.fixture
def fake_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Point PATH at a folder holding only the given fake nvidia-smi; forget cached probes."""

    def use(smi: str | None) -> None:
        monkeypatch.setenv("PATH", str(_bin(tmp_path, smi)))
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        machine.reset()

    yield use
    machine.reset()


H200 = HardwareProfile(
    name="h200", description="", gpu_name="NVIDIA H200", compute_capability=(9, 0), memory_gb=141
)
RTX4090 = HardwareProfile(
    name="rtx4090",
    description="",
    gpu_name="NVIDIA GeForce RTX 4090",
    compute_capability=(8, 9),
    memory_gb=24,
)
H200X2 = H200.model_copy(update={"name": "h200x2", "gpu_count": 2})
CPU = HardwareProfile(name="cpu", description="", device="cpu", gpu_count=0)


def test_requirements_on_a_machine_without_gpu(fake_path: Any) -> None:
    fake_path(None)
    if machine.probe_gpus().visible:  # NVML found one anyway
        pytest.skip("this machine has a GPU visible through NVML")
    assert "no NVIDIA GPU" in (machine.check_requirement("gpu", H200) or "")
    assert "no NVIDIA GPU" in (machine.check_requirement("hardware", H200) or "")
    assert "no NVIDIA GPU" in (machine.check_requirement("cuda>=12", H200) or "")
    assert machine.check_requirement("hardware", CPU) is None
    assert machine.gpu_count() == 0


def test_requirements_with_a_fake_h200(fake_path: Any) -> None:
    fake_path(H200_SMI)
    assert machine.check_requirement("gpu", H200) is None
    assert machine.check_requirement("hardware", H200) is None
    why = machine.check_requirement("hardware", RTX4090)
    assert why is not None and "compute capability 9.0" in why and "8.9" in why
    why = machine.check_requirement("hardware", H200X2)
    assert why is not None and "needs 2 × NVIDIA H200" in why
    assert machine.gpu_count() == 1
    # CUDA from torch when it has CUDA, else the driver's (13.0 here)
    if not machine.probe_torch().cuda:
        assert machine.check_requirement("cuda>=12", H200) is None
        assert "needs CUDA >= 14" in (machine.check_requirement("cuda>=14", H200) or "")


def test_matching_profiles_with_a_fake_h200(fake_path: Any) -> None:
    from mopt.plugins import get_registry

    fake_path(H200_SMI)
    assert machine.matching_profiles(get_registry())[:1] == ["h200"]


def test_python_and_tool_requirements(fake_path: Any) -> None:
    fake_path(None)
    assert machine.check_requirement("python:json", H200) is None
    assert machine.check_requirement("python:pydantic>=2", H200) is None
    assert "needs pydantic >= 99" in (machine.check_requirement("python:pydantic>=99", H200) or "")
    assert "not installed" in (machine.check_requirement("python:no_such_pkg_xyz", H200) or "")
    assert "not installed" in (machine.check_requirement("python:tensorrt-llm", H200) or "") or (
        machine.dist_version("tensorrt-llm") is not None
    )
    assert "not found on PATH" in (machine.check_requirement("tool:buildah", H200) or "")
    assert "unknown requirement" in (machine.check_requirement("quantum", H200) or "")


def test_requirement_list_drops_repeats(fake_path: Any) -> None:
    fake_path(None)
    if machine.probe_gpus().visible:
        pytest.skip("this machine has a GPU visible through NVML")
    reasons = machine.check_requirements(["gpu", "hardware", "tool:sh-not-here"], H200)
    assert len(reasons) == 2


def test_parse_nvidia_smi_and_visible_devices() -> None:
    gpus = machine.parse_nvidia_smi_csv(
        "NVIDIA H200, 9.0, 143771 MiB, 580.159.03, GPU-aaa\nNVIDIA H200, 9.0, 143771 MiB, 580.159.03, GPU-bbb\n"
    )
    assert [(g.index, g.compute_capability, g.memory_mib) for g in gpus] == [
        (0, (9, 0), 143771),
        (1, (9, 0), 143771),
    ]
    assert [g.index for g in machine._visible(gpus, "1")] == [1]
    assert [g.index for g in machine._visible(gpus, "GPU-bbb,0")] == [1, 0]
    assert machine._visible(gpus, "") == [] and machine._visible(gpus, "-1") == []
    assert [g.index for g in machine._visible(gpus, "0,7,1")] == [0]  # CUDA stops at an invalid entry


def test_version_compare() -> None:
    assert machine.version_ok("12.4.1", ">=", "12")
    assert machine.version_ok("2.11.0+cu130", ">=", "2.11")
    assert not machine.version_ok("11.8", ">=", "12")
    assert machine.version_ok("10.8.0", "<", "11")
