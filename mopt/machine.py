"""What this machine is and has: CPU, memory, GPUs, CUDA, backend libraries, containers.

Used by `mopt doctor` (the whole report) and by the build executor (`check_requirement`, to
report a target as unbuildable here instead of attempting it). Nothing here imports torch or
any GPU library: GPUs come from `nvidia-smi` (or NVML through pynvml when importable), the
CUDA runtime and ONNX Runtime's execution providers from short subprocesses with timeouts.
The GPU and torch probes, which every build asks about each target, are cached for the life of
the process; `reset()` forgets them (tests).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata as md
import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mopt.api import HardwareProfile
from mopt.plugin_env import dist_version

#: distributions `mopt doctor` reports (name shown → candidate distribution names)
LIBRARIES: dict[str, tuple[str, ...]] = {
    "torch": ("torch",),
    "transformers": ("transformers",),
    "onnx": ("onnx",),
    "onnxruntime": ("onnxruntime-gpu", "onnxruntime"),
    "tensorrt": ("tensorrt", "tensorrt-cu13", "tensorrt-cu12", "tensorrt_cu13", "tensorrt_cu12"),
    "tensorrt-llm": ("tensorrt-llm", "tensorrt_llm"),
    "vllm": ("vllm",),
    "nvidia-modelopt": ("nvidia-modelopt", "nvidia_modelopt"),
    "optimum": ("optimum",),
    "openvino": ("openvino",),
    "nncf": ("nncf",),
    "polygraphy": ("polygraphy",),
}

PROBE_TIMEOUT_S = 60.0
SMI_TIMEOUT_S = 10.0


# --------------------------------------------------------------------------- results


@dataclass(frozen=True)
class GPU:
    """One NVIDIA GPU as nvidia-smi / NVML reports it."""

    index: int
    name: str
    compute_capability: tuple[int, int] | None
    memory_mib: int | None
    driver: str | None
    uuid: str | None = None

    @property
    def memory_gib(self) -> float | None:
        return self.memory_mib / 1024 if self.memory_mib is not None else None

    @property
    def cc(self) -> str:
        return ".".join(map(str, self.compute_capability)) if self.compute_capability else "?"


@dataclass(frozen=True)
class GPUProbe:
    """All GPUs seen, the ones CUDA_VISIBLE_DEVICES leaves visible, and why none, if none."""

    gpus: tuple[GPU, ...]
    visible: tuple[GPU, ...]
    source: str  # "nvidia-smi", "nvml" or "" when neither worked
    error: str | None = None  # why no GPU could be listed
    driver_cuda: str | None = None  # highest CUDA version the driver supports


@dataclass(frozen=True)
class TorchProbe:
    """What torch sees (from a subprocess, so the CLI stays light)."""

    installed: bool
    version: str | None = None
    cuda: str | None = None  # CUDA runtime torch was built with (torch.version.cuda)
    cuda_available: bool | None = None
    device_count: int | None = None
    devices: tuple[str, ...] = ()
    cudnn: int | None = None
    error: str | None = None


@dataclass(frozen=True)
class Machine:
    """The whole picture, as `mopt doctor` prints it."""

    hostname: str
    os: str
    arch: str
    python: str
    cpu_model: str
    cpu_count: int
    cpu_usable: int
    ram_gib: float | None
    ram_available_gib: float | None
    cgroup_limit_gib: float | None
    gpu: GPUProbe
    cuda_visible_devices: str | None
    torch: TorchProbe
    libraries: dict[str, str | None]
    ort_providers: tuple[str, ...] | None
    ort_error: str | None

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["gpu"]["gpus"] = [{**asdict(g), "compute_capability": g.cc} for g in self.gpu.gpus]
        d["gpu"]["visible"] = [g.index for g in self.gpu.visible]
        return d


# --------------------------------------------------------------------------- probes


def _run(argv: list[str], timeout: float, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """Run argv; (returncode, stdout, stderr). Missing tools and timeouts are returncodes."""
    try:
        p = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
            env=env,
            errors="replace",
        )
    except FileNotFoundError:
        return 127, "", f"{argv[0]}: not found"
    except subprocess.TimeoutExpired:
        return 124, "", f"{argv[0]} did not answer within {timeout:g} s"
    except OSError as exc:
        return 126, "", f"{argv[0]}: {exc}"
    return p.returncode, p.stdout, p.stderr


def _parse_cc(s: str) -> tuple[int, int] | None:
    m = re.match(r"\s*(\d+)\.(\d+)", s)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _parse_mib(s: str) -> int | None:
    m = re.match(r"\s*(\d+)", s)
    return int(m.group(1)) if m else None


def parse_nvidia_smi_csv(text: str) -> list[GPU]:
    """Rows of `nvidia-smi --query-gpu=name,compute_cap,memory.total,driver_version[,uuid]
    --format=csv,noheader`."""
    gpus = []
    for i, line in enumerate(ln for ln in text.splitlines() if ln.strip()):
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 4:
            continue
        gpus.append(
            GPU(
                index=i,
                name=parts[0],
                compute_capability=_parse_cc(parts[1]),
                memory_mib=_parse_mib(parts[2]),
                driver=parts[3] or None,
                uuid=parts[4] if len(parts) > 4 and parts[4] else None,
            )
        )
    return gpus


def _visible(gpus: list[GPU], cvd: str | None) -> list[GPU]:
    """The GPUs CUDA_VISIBLE_DEVICES leaves visible (indices or UUID prefixes)."""
    if cvd is None:
        return gpus
    out: list[GPU] = []
    for tok in (t.strip() for t in cvd.split(",")):
        if not tok:
            break
        if tok.lstrip("-").isdigit():
            idx = int(tok)
            if idx < 0:
                break  # CUDA stops at the first invalid entry
            hit = next((g for g in gpus if g.index == idx), None)
        else:
            hit = next((g for g in gpus if g.uuid and (g.uuid == tok or g.uuid.startswith(tok))), None)
        if hit is None:
            break
        if hit not in out:
            out.append(hit)
    return out


def _nvml_gpus() -> tuple[list[GPU], str | None]:
    try:
        import pynvml
    except ImportError:
        return [], "pynvml not importable"
    try:
        pynvml.nvmlInit()
    except Exception as exc:
        return [], f"NVML init failed: {exc}"
    try:
        driver = pynvml.nvmlSystemGetDriverVersion()
        driver = driver.decode() if isinstance(driver, bytes) else str(driver)
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(h)
            name = name.decode() if isinstance(name, bytes) else str(name)
            major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(h)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h).total // (1 << 20)
            uuid = pynvml.nvmlDeviceGetUUID(h)
            uuid = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
            gpus.append(GPU(i, name, (int(major), int(minor)), int(mem), driver, uuid))
        return gpus, None
    except Exception as exc:
        return [], f"NVML query failed: {exc}"
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


@functools.lru_cache(maxsize=1)
def probe_gpus() -> GPUProbe:
    """GPUs from nvidia-smi, else NVML; the error says why there are none."""
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    smi = shutil.which("nvidia-smi")
    error: str | None = None
    if smi:
        rc, out, errtext = _run(
            [smi, "--query-gpu=name,compute_cap,memory.total,driver_version,uuid", "--format=csv,noheader"],
            SMI_TIMEOUT_S,
        )
        if rc == 0:
            gpus = parse_nvidia_smi_csv(out)
            if gpus:
                return GPUProbe(
                    tuple(gpus), tuple(_visible(gpus, cvd)), "nvidia-smi", None, _driver_cuda(smi)
                )
            error = "nvidia-smi lists no GPU"
        else:
            msg = (errtext or out).strip().splitlines()
            error = f"nvidia-smi failed (exit {rc}): {msg[0] if msg else 'no output'}"
    gpus, nvml_err = _nvml_gpus()
    if gpus:
        return GPUProbe(tuple(gpus), tuple(_visible(gpus, cvd)), "nvml", None)
    if error is None:
        error = "nvidia-smi not found on PATH" + (f" and {nvml_err}" if nvml_err else "")
    return GPUProbe((), (), "", error)


def _driver_cuda(smi: str) -> str | None:
    """The 'CUDA Version' nvidia-smi's banner shows (the newest runtime the driver supports)."""
    rc, out, _ = _run([smi], SMI_TIMEOUT_S)
    m = re.search(r"CUDA Version:\s*([\d.]+)", out) if rc == 0 else None
    return m.group(1) if m else None


_TORCH_PROBE = r"""
import json
d = {}
try:
    import torch
except Exception as e:
    print(json.dumps({"error": f"import torch failed: {type(e).__name__}: {e}"})); raise SystemExit
d["version"] = torch.__version__
d["cuda"] = torch.version.cuda
try:
    d["cuda_available"] = bool(torch.cuda.is_available())
    d["device_count"] = torch.cuda.device_count() if d["cuda_available"] else 0
    d["devices"] = [torch.cuda.get_device_name(i) for i in range(d["device_count"])]
    d["cudnn"] = torch.backends.cudnn.version() if d["cuda_available"] else None
except Exception as e:
    d["error"] = f"{type(e).__name__}: {e}"
print(json.dumps(d))
"""


def _json_probe(code: str, timeout: float) -> tuple[dict[str, Any] | None, str | None]:
    rc, out, errtext = _run([sys.executable, "-c", code], timeout)
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    if rc != 0 or not lines:
        msg = (errtext or out).strip().splitlines()
        return None, f"probe exited {rc}: {msg[-1] if msg else 'no output'}"
    try:
        return json.loads(lines[-1]), None
    except ValueError as exc:
        return None, f"probe printed bad JSON: {exc}"


@functools.lru_cache(maxsize=1)
def probe_torch() -> TorchProbe:
    """torch's version, CUDA runtime and devices, asked in a subprocess (imports take seconds)."""
    if importlib.util.find_spec("torch") is None:
        return TorchProbe(installed=False)
    data, error = _json_probe(_TORCH_PROBE, PROBE_TIMEOUT_S)
    if data is None:
        return TorchProbe(installed=True, version=dist_version("torch"), error=error)
    return TorchProbe(
        installed=True,
        version=data.get("version"),
        cuda=data.get("cuda"),
        cuda_available=data.get("cuda_available"),
        device_count=data.get("device_count"),
        devices=tuple(data.get("devices") or ()),
        cudnn=data.get("cudnn"),
        error=data.get("error"),
    )


def probe_ort_providers() -> tuple[tuple[str, ...] | None, str | None]:
    """ONNX Runtime's available execution providers, or (None, why)."""
    if importlib.util.find_spec("onnxruntime") is None:
        return None, "onnxruntime is not installed"
    data, error = _json_probe(
        "import json, onnxruntime as o; print(json.dumps({'p': o.get_available_providers()}))",
        PROBE_TIMEOUT_S,
    )
    if data is None:
        return None, error
    return tuple(data.get("p") or ()), None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith(("model name", "hardware", "cpu model")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _meminfo() -> tuple[float | None, float | None]:
    try:
        d = dict(ln.split(":", 1) for ln in Path("/proc/meminfo").read_text().splitlines() if ":" in ln)
        total = int(d["MemTotal"].split()[0]) / (1 << 20)
        avail = int(d.get("MemAvailable", d["MemTotal"]).split()[0]) / (1 << 20)
        return total, avail
    except (OSError, KeyError, ValueError):
        pass
    try:
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return pages / (1 << 30), None
    except (ValueError, OSError, AttributeError):
        return None, None


def _cgroup_limit() -> float | None:
    for p in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            raw = Path(p).read_text().strip()
        except OSError:
            continue
        if raw.isdigit() and int(raw) < (1 << 60):
            return int(raw) / (1 << 30)
    return None


def detect() -> Machine:
    """Everything `mopt doctor` reports; the slow probes run in parallel."""
    with ThreadPoolExecutor(max_workers=3) as pool:
        f_gpu = pool.submit(probe_gpus)
        f_torch = pool.submit(probe_torch)
        f_ort = pool.submit(probe_ort_providers)
        ram, avail = _meminfo()
        try:
            usable = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            usable = os.cpu_count() or 1
        providers, ort_error = f_ort.result()
        return Machine(
            hostname=platform.node(),
            os=f"{platform.system()} {platform.release()}",
            arch=platform.machine(),
            python=platform.python_version(),
            cpu_model=_cpu_model(),
            cpu_count=os.cpu_count() or 1,
            cpu_usable=usable,
            ram_gib=ram,
            ram_available_gib=avail,
            cgroup_limit_gib=_cgroup_limit(),
            gpu=f_gpu.result(),
            cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
            torch=f_torch.result(),
            libraries={name: dist_version(*dists) for name, dists in LIBRARIES.items()},
            ort_providers=providers,
            ort_error=ort_error,
        )


def reset() -> None:
    """Forget the cached probes (tests, or after the environment changed)."""
    probe_gpus.cache_clear()
    probe_torch.cache_clear()


def gpu_count() -> int:
    """NVIDIA GPUs visible to this process (after CUDA_VISIBLE_DEVICES)."""
    return len(probe_gpus().visible)


# --------------------------------------------------------------------------- matching


def _norm_name(name: str) -> str:
    n = name.lower().replace("nvidia", " ").replace("geforce", " ").replace("-", " ")
    return " ".join(n.split())


def gpu_matches(gpu: GPU, profile: HardwareProfile) -> str | None:
    """None when `gpu` is the profile's GPU, else why not. The compute capability must be
    equal (engines are built per architecture) and the names must agree (one contains the
    other, ignoring 'NVIDIA'/'GeForce': 'NVIDIA H200' matches 'NVIDIA H200 NVL')."""
    if not profile.is_gpu:
        return f"profile {profile.name!r} is a CPU profile"
    want_cc = profile.compute_capability
    if want_cc is not None and gpu.compute_capability is not None and gpu.compute_capability != want_cc:
        return (
            f"GPU {gpu.index} ({gpu.name}) has compute capability {gpu.cc}, "
            f"profile {profile.name!r} needs {want_cc[0]}.{want_cc[1]}"
        )
    if profile.gpu_name:
        a, b = _norm_name(gpu.name), _norm_name(profile.gpu_name)
        if not (a == b or a in b or b in a):
            return f"GPU {gpu.index} is a {gpu.name}, profile {profile.name!r} is a {profile.gpu_name}"
    elif want_cc is None:
        return f"profile {profile.name!r} names no GPU or compute capability to match"
    return None


def matching_profiles(registry: Any) -> list[str]:
    """Names of the hardware profiles this machine matches: GPU profiles whose GPU is visible
    here (and enough of them for the profile's gpu_count), then the CPU profiles."""
    probe = probe_gpus()
    gpu_hits: list[str] = []
    cpu_hits: list[str] = []
    profiles: Iterable[HardwareProfile] = registry.hardware.values()
    for p in profiles:
        if not p.is_gpu:
            cpu_hits.append(p.name)
            continue
        n = sum(1 for g in probe.visible if gpu_matches(g, p) is None)
        if n >= max(1, p.gpu_count):
            gpu_hits.append(p.name)
    return gpu_hits + cpu_hits


# --------------------------------------------------------------------------- requirements

#: install commands for modules whose distribution has another name or lives on another index
_INSTALL = {
    "modelopt": "pip install nvidia-modelopt",
    "tensorrt": "pip install tensorrt --extra-index-url https://pypi.nvidia.com",
    "tensorrt_llm": "pip install tensorrt-llm --extra-index-url https://pypi.nvidia.com",
    "tensorrt-llm": "pip install tensorrt-llm --extra-index-url https://pypi.nvidia.com",
    "yaml": "pip install pyyaml",
    "cv2": "pip install opencv-python-headless",
}
_REQ = re.compile(r"^\s*([A-Za-z0-9_.\-]+)\s*(>=|<=|==|!=|>|<)?\s*([0-9][0-9A-Za-z.+\-]*)?\s*$")


def _vtuple(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v.split("+")[0])[:4])


def version_ok(have: str, op: str, want: str) -> bool:
    """Compare dotted versions numerically (release parts only: '12.4.1', '2.11.0+cu130')."""
    a, b = _vtuple(have), _vtuple(want)
    n = max(len(a), len(b))
    a, b = a + (0,) * (n - len(a)), b + (0,) * (n - len(b))
    return {
        ">=": a >= b,
        "<=": a <= b,
        "==": a == b,
        "!=": a != b,
        ">": a > b,
        "<": a < b,
    }[op]


def _no_gpu_reason(probe: GPUProbe) -> str:
    if probe.gpus and not probe.visible:
        return (
            f"no NVIDIA GPU visible: CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '')!r} "
            f"hides all {len(probe.gpus)}"
        )
    return f"no NVIDIA GPU ({probe.error or 'none found'})"


def check_requirement(req: str, hardware: HardwareProfile) -> str | None:
    """None when this machine meets requirement `req`, else the reason it does not.

    Requirements: "gpu" (an NVIDIA GPU is visible), "cuda>=12" (CUDA runtime seen by torch,
    else the driver's CUDA version; any comparison operator), "python:<module or dist>[op
    version]" (importable module or installed distribution), "tool:<exe>" (on PATH),
    "hardware" (a visible GPU matching `hardware`'s GPU and compute capability, as many as
    its gpu_count). Unknown requirement strings are reported, not ignored.
    """
    r = req.strip()
    low = r.lower()
    if low == "gpu":
        probe = probe_gpus()
        return None if probe.visible else _no_gpu_reason(probe)
    if low == "hardware":
        if not hardware.is_gpu:
            return None
        probe = probe_gpus()
        if not probe.visible:
            return _no_gpu_reason(probe)
        n = sum(1 for g in probe.visible if gpu_matches(g, hardware) is None)
        need = max(1, hardware.gpu_count)
        if n >= need:
            return None
        if n == 0:
            reasons = "; ".join(filter(None, (gpu_matches(g, hardware) for g in probe.visible)))
            return f"needs a {hardware.gpu_name or hardware.name} ({hardware.name}): {reasons}"
        return f"needs {need} × {hardware.gpu_name} ({hardware.name}), {n} visible here"
    if low.startswith("cuda"):
        m = re.match(r"^cuda\s*(>=|<=|==|!=|>|<)\s*([\d.]+)$", low)
        probe = probe_gpus()
        if not probe.visible:
            return _no_gpu_reason(probe)
        if m is None:
            return None if low == "cuda" else f"unrecognised requirement {req!r} (write e.g. cuda>=12)"
        op, want = m.group(1), m.group(2)
        tp = probe_torch()
        have, what = (
            (tp.cuda, "torch's CUDA runtime") if tp.cuda else (probe.driver_cuda, "the driver's CUDA")
        )
        if have is None:
            return f"needs CUDA {op} {want}: no CUDA runtime found (torch is CPU-only or missing)"
        return None if version_ok(have, op, want) else f"needs CUDA {op} {want}, {what} is {have}"
    if low.startswith("python:"):
        m = _REQ.match(r.split(":", 1)[1])
        if m is None:
            return f"unrecognised requirement {req!r} (write e.g. python:tensorrt>=10)"
        name, op, want = m.group(1), m.group(2), m.group(3)
        have = dist_version(name, name.replace("_", "-"), name.replace("-", "_"))
        importable = "-" not in name and importlib.util.find_spec(name.split(".")[0]) is not None
        if have is None and importable and op:
            # a module whose distribution has another name (modelopt → nvidia-modelopt)
            dists = md.packages_distributions().get(name.split(".")[0]) or []
            have = dist_version(*dists) if dists else None
        if have is None and not importable:
            hint = _INSTALL.get(name, f"pip install {name.replace('_', '-')}")
            return f"Python package {name!r} is not installed ({hint})"
        if op and want:
            if have is None:
                return f"needs {name} {op} {want}: its version is unknown (no distribution metadata)"
            if not version_ok(have, op, want):
                return f"needs {name} {op} {want}, {have} is installed"
        return None
    if low.startswith("tool:"):
        exe = r.split(":", 1)[1].strip()
        return None if shutil.which(exe) else f"tool {exe!r} not found on PATH"
    return f"unknown requirement {req!r} (known: gpu, hardware, cuda>=N, python:<pkg>, tool:<exe>)"


def check_requirements(
    reqs: Iterable[str], hardware: HardwareProfile, hints: dict[str, str] | None = None
) -> list[str]:
    """The reasons this machine cannot meet `reqs` (empty when it can), without repeats, each
    with its install hint from `hints`."""
    out: list[str] = []
    for r in reqs:
        why = check_requirement(r, hardware)
        if why is not None and hints and r in hints:
            why = f"{why} ({hints[r]})"
        if why is not None and why not in out:
            out.append(why)
    return out


def unmet(requirements: Iterable[str], hardware: HardwareProfile, hints: dict[str, str] | None = None) -> str | None:
    """Why this machine cannot meet `requirements` for `hardware`, or None."""
    return "; ".join(check_requirements(requirements, hardware, hints)) or None
