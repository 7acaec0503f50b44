"""`mopt doctor`'s OpenVINO line (registered with `mopt_register_doctor_checks`): its CPU
plugin's capabilities, and the CPU flags that decide whether its INT8 and bf16 kernels are fast
here (VNNI / AMX, AVX512-BF16)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

#: OpenVINO's CPU plugin: its name and optimisation capabilities (FP32, BF16, INT8, ...)
_OV_PROBE = (
    "import json, openvino as ov; c = ov.Core(); print(json.dumps({'device': "
    "str(c.get_property('CPU', 'FULL_DEVICE_NAME')), 'capabilities': "
    "[str(x) for x in c.get_property('CPU', 'OPTIMIZATION_CAPABILITIES')]}))"
)


def _check(name: str, status: str, summary: str, cause: str = "", fix: str = "") -> dict[str, str]:
    return {"name": name, "status": status, "summary": summary, "cause": cause, "fix": fix}


def openvino(m: Any) -> list[dict[str, str]]:
    """One check of machine `m` (mopt's `Machine`: its libraries; OpenVINO's CPU is probed here)."""
    return [_openvino_check(m)]


def probe_cpu_plugin() -> tuple[dict[str, Any] | None, str | None]:
    """OpenVINO's CPU plugin as `_OV_PROBE` prints it, or (None, why): in a subprocess, since
    the import takes seconds and a broken install may crash it."""
    try:
        p = subprocess.run([sys.executable, "-c", _OV_PROBE], capture_output=True, text=True, timeout=60,
                           stdin=subprocess.DEVNULL, errors="replace")  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"probe failed: {exc}"
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        msg = (p.stderr or p.stdout).strip().splitlines()
        return None, f"probe exited {p.returncode}: {msg[-1] if msg else 'no output'}"
    try:
        return json.loads(lines[-1]), None
    except ValueError as exc:
        return None, f"probe printed bad JSON: {exc}"


def _openvino_check(m: Any) -> dict[str, str]:
    v = m.libraries.get("openvino")
    if v is None:
        return _check(
            "openvino",
            "missing",
            "openvino is not installed",
            "the openvino and nncf-quantize kinds (plugin mopt-openvino) build and run OpenVINO IR with it",
            "pip install -e plugins/mopt-openvino (installs openvino and nncf)",
        )
    cpu, error = probe_cpu_plugin()
    if cpu is None:
        return _check(
            "openvino",
            "fail",
            f"openvino {v} is installed but its CPU plugin could not be queried: {error}",
            "a broken install or a CPU OpenVINO does not support",
            "pip install --force-reinstall openvino",
        )
    caps = [str(c) for c in cpu.get("capabilities", [])]
    flags = _cpu_flags()
    int8 = "AMX" if "amx_int8" in flags else "VNNI" if {"avx512_vnni", "avx_vnni"} & flags else "no VNNI/AMX"
    bf16 = "native" if {"amx_bf16", "avx512_bf16"} & flags else "none (a bf16 hint runs f32)"
    nncf = m.libraries.get("nncf")
    return _check(
        "openvino",
        "ok",
        f"openvino {v}: CPU capabilities {', '.join(caps) or 'none'}; int8 dot product: {int8}; "
        f"bf16: {bf16}; nncf {nncf or 'not installed'}",
    )


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8")
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return set(line.split(":", 1)[1].split())
    return set()
