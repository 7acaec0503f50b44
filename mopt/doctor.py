"""`mopt doctor`: what this machine can build, and for every gap the likely cause and the fix.

Statuses: ok; info (a fact); missing (something GPU, engine or container targets need is not
here: expected on a CPU-only machine); warn (present but probably wrong); fail (present and
broken). Every missing / warn / fail check carries a cause and a fix.
"""

from __future__ import annotations

from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

from mopt.machine import Machine, check_requirements, detect, matching_profiles, version_ok

STATUSES = ("ok", "info", "missing", "warn", "fail")

_NVIDIA_INDEX = "--extra-index-url https://pypi.nvidia.com"


@dataclass(frozen=True)
class DoctorCheck:
    """One line of the report."""

    name: str
    status: str
    summary: str
    cause: str = ""
    fix: str = ""


@dataclass
class TargetStatus:
    """Can this machine build one node of a recipe, and if not, why not."""

    id: str
    kind: str
    hardware: str
    requires: list[str]
    reasons: list[str] = field(default_factory=list)

    @property
    def buildable(self) -> bool:
        return not self.reasons


@dataclass
class DoctorReport:
    machine: Machine
    checks: list[DoctorCheck]
    profiles: list[str]
    recipe: str | None = None
    targets: list[TargetStatus] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "machine": self.machine.to_json(),
            "checks": [asdict(c) for c in self.checks],
            "profiles": self.profiles,
            "recipe": self.recipe,
            "targets": [
                {
                    "id": t.id,
                    "kind": t.kind,
                    "hardware": t.hardware,
                    "requires": t.requires,
                    "buildable": t.buildable,
                    "reasons": t.reasons,
                }
                for t in self.targets
            ],
        }


def _gib(x: float | None) -> str:
    return f"{x:.1f} GiB" if x is not None else "?"


def diagnose(m: Machine, registry: Any = None) -> list[DoctorCheck]:
    """The checks of `mopt doctor` for machine `m`; then the plugins' own (OpenVINO's CPU
    flags, Docker and buildah for images, ...: `mopt_register_doctor_checks`)."""
    out: list[DoctorCheck] = []
    add = out.append

    cpus = f"{m.cpu_count} cores" + (f" ({m.cpu_usable} usable)" if m.cpu_usable != m.cpu_count else "")
    add(DoctorCheck("cpu", "info", f"{m.cpu_model}, {cpus}, {m.arch}, {m.os}, Python {m.python}"))

    mem = f"{_gib(m.ram_gib)} RAM, {_gib(m.ram_available_gib)} available"
    limit = m.cgroup_limit_gib
    if limit is not None and m.ram_gib is not None and limit < m.ram_gib:
        mem += f", container limit {_gib(limit)}"
    avail = min(x for x in (m.ram_available_gib, limit, m.ram_gib) if x is not None) if m.ram_gib else None
    if avail is not None and avail < 4:
        add(
            DoctorCheck(
                "memory",
                "warn",
                mem,
                "less than 4 GiB free: exporting or quantizing even a 0.6B model in fp32 needs several GiB",
                "close other work, raise the container's memory limit, or build on a larger machine",
            )
        )
    else:
        add(DoctorCheck("memory", "ok", mem))

    g = m.gpu
    if g.visible:
        names = Counter(f"{gpu.name} (CC {gpu.cc}, {_gib(gpu.memory_gib)})" for gpu in g.visible)
        desc = ", ".join(f"{n} × {k}" for k, n in names.items())
        driver = g.visible[0].driver
        add(
            DoctorCheck(
                "gpu",
                "ok",
                f"{desc}; driver {driver or '?'}"
                + (f" (supports CUDA ≤ {g.driver_cuda})" if g.driver_cuda else "")
                + f"; via {g.source}",
            )
        )
    elif g.gpus:
        add(
            DoctorCheck(
                "gpu",
                "fail",
                f"{len(g.gpus)} NVIDIA GPU(s) present but none visible: "
                f"CUDA_VISIBLE_DEVICES={m.cuda_visible_devices!r}",
                "CUDA_VISIBLE_DEVICES is empty, -1, or lists indices / UUIDs that do not exist",
                "unset CUDA_VISIBLE_DEVICES, or set it to the GPUs to use (e.g. 0 or 0,1)",
            )
        )
    else:
        err = g.error or "none found"
        if "failed" in err:
            cause = (
                "nvidia-smi is installed but cannot talk to the driver: the kernel module is not "
                "loaded or does not match the user-space libraries (often after a driver update "
                "without a reboot), or the container lacks the GPU device nodes"
            )
            fix = "reboot or reinstall the NVIDIA driver; run `nvidia-smi` by hand to see the error"
        else:
            cause = (
                "this is a CPU-only machine, the NVIDIA driver is not installed, or this container "
                "was started without GPU access"
            )
            fix = (
                "on a GPU host install the NVIDIA driver (nvidia-smi must list the GPU); in a "
                "container start it with `--gpus all` (Docker + NVIDIA Container Toolkit) or "
                "`--device nvidia.com/gpu=all` (CDI). Until then GPU targets (engines, serving "
                "configs that need a GPU) are unbuildable here: build them on a GPU machine"
            )
        add(DoctorCheck("gpu", "missing", f"no NVIDIA GPU ({err})", cause, fix))

    cvd = m.cuda_visible_devices
    if cvd is None:
        add(DoctorCheck("cuda_visible_devices", "info", "unset (every GPU visible)"))
    elif not g.gpus or g.visible:
        add(DoctorCheck("cuda_visible_devices", "info", f"{cvd!r} → {len(g.visible)} GPU(s) visible"))

    add(_torch_check(m))
    add(_cuda_check(m))
    out.extend(_library_checks(m))
    fns = registry.doctor_checks if registry is not None else {}
    with ThreadPoolExecutor() as pool:  # their own probes (Docker, OpenVINO's CPU) overlap
        running = {name: pool.submit(fn, m) for name, fn in fns.items()}
    for name, fut in running.items():
        try:
            out += [DoctorCheck(**d) for d in fut.result()]
        except Exception as exc:  # a plugin's bug is its check's failure, not the doctor's
            out.append(DoctorCheck(name, "fail", f"the check failed: {type(exc).__name__}: {exc}"))
    return out


def _torch_check(m: Machine) -> DoctorCheck:
    t = m.torch
    if not t.installed:
        return DoctorCheck(
            "torch",
            "missing",
            "torch is not installed",
            "the weights, onnx, validate and bench kinds load models with torch",
            "pip install torch (CPU: --index-url https://download.pytorch.org/whl/cpu)",
        )
    if t.version is None:
        return DoctorCheck(
            "torch",
            "fail",
            f"torch is installed but could not be imported: {t.error}",
            "a broken install or a missing system library",
            "reinstall torch in this environment (pip install --force-reinstall torch)",
        )
    return DoctorCheck("torch", "ok", f"torch {t.version}" + (" (CPU-only build)" if not t.cuda else ""))


def _cuda_check(m: Machine) -> DoctorCheck:
    t, g = m.torch, m.gpu
    if not g.visible:
        what = (
            f"torch {t.version} is built for CUDA {t.cuda}" if t.cuda else "no CUDA runtime (CPU-only torch)"
        )
        return DoctorCheck(
            "cuda",
            "missing",
            f"{what}; no GPU to run it on",
            "no NVIDIA GPU is visible (see gpu)",
            "nothing to do on a CPU-only machine; on a GPU machine install a CUDA build of torch",
        )
    if not t.installed or t.version is None:
        return DoctorCheck(
            "cuda",
            "missing",
            "CUDA runtime unknown: torch is not importable",
            "torch reports the CUDA runtime mopt's kinds use",
            "install a CUDA build of torch",
        )
    if not t.cuda:
        return DoctorCheck(
            "cuda",
            "fail",
            f"torch {t.version} is a CPU-only build on a machine with a GPU",
            "the CPU wheel of torch was installed (the default index on some platforms)",
            "pip install torch --index-url https://download.pytorch.org/whl/cu128 (choose a CUDA "
            f"version ≤ {g.driver_cuda or 'what the driver supports'})",
        )
    if not t.cuda_available:
        cause = "torch cannot initialise CUDA"
        if g.driver_cuda and version_ok(t.cuda, ">", g.driver_cuda):
            cause = f"torch's CUDA {t.cuda} is newer than the driver supports (CUDA {g.driver_cuda})"
        return DoctorCheck(
            "cuda",
            "fail",
            f"torch {t.version} (CUDA {t.cuda}) does not see the GPU" + (f": {t.error}" if t.error else ""),
            cause,
            "update the NVIDIA driver, or install a torch built for an older CUDA "
            "(https://pytorch.org/get-started/locally/)",
        )
    return DoctorCheck(
        "cuda",
        "ok",
        f"CUDA {t.cuda} runtime (torch), {t.device_count} device(s): {', '.join(t.devices)}"
        + (f"; cuDNN {t.cudnn}" if t.cudnn else ""),
    )


_LIB_FIX: dict[str, tuple[str, str]] = {
    "transformers": ("loading Hugging Face checkpoints (weights, onnx kinds)", "pip install transformers"),
    "onnx": ("the onnx, onnx-slim and ort-quantize kinds", "pip install onnx"),
    "tensorrt": (
        "the trt-engine kind builds engines with it (PyPI's tensorrt packages are stubs that fetch "
        "from NVIDIA's index)",
        f"pip install tensorrt {_NVIDIA_INDEX} (needs an NVIDIA GPU and driver), or use an "
        "nvcr.io/nvidia/tensorrt container",
    ),
    "tensorrt-llm": (
        "the trtllm kind launches / validates TensorRT-LLM configs (generating them needs nothing)",
        f"pip install tensorrt-llm {_NVIDIA_INDEX}, or use the nvcr.io/nvidia/tensorrt-llm/release container",
    ),
    "vllm": (
        "the vllm kind launches vLLM to validate its config (generating it needs nothing)",
        "pip install vllm (CUDA wheels), or use the vllm/vllm-openai image",
    ),
    "nvidia-modelopt": (
        "FP8 / INT4-AWQ / NVFP4 quantization and TensorRT 11 precision (AutoCast, ONNX Q/DQ)",
        "pip install nvidia-modelopt",
    ),
}


def _library_checks(m: Machine) -> list[DoctorCheck]:
    out = [_library_check(m, name) for name in ("transformers", "onnx")]
    ort = m.libraries.get("onnxruntime")
    if ort is None:
        out.append(
            DoctorCheck(
                "onnxruntime",
                "missing",
                "onnxruntime is not installed",
                "the ort-quantize, validate and bench kinds run ONNX graphs with it",
                "pip install onnxruntime (or onnxruntime-gpu on a GPU machine)",
            )
        )
    elif m.ort_providers is None:
        out.append(
            DoctorCheck(
                "onnxruntime",
                "fail",
                f"onnxruntime {ort} is installed but its providers could not be listed: {m.ort_error}",
                "a broken install, or both onnxruntime and onnxruntime-gpu installed over each other",
                "pip uninstall -y onnxruntime onnxruntime-gpu && pip install onnxruntime(-gpu)",
            )
        )
    else:
        provs = ", ".join(p.removesuffix("ExecutionProvider") for p in m.ort_providers)
        gpu_ep = any(p in m.ort_providers for p in ("CUDAExecutionProvider", "TensorrtExecutionProvider"))
        if m.gpu.visible and not gpu_ep:
            out.append(
                DoctorCheck(
                    "onnxruntime",
                    "warn",
                    f"onnxruntime {ort}: providers {provs}; no CUDA provider on a GPU machine",
                    "the CPU-only onnxruntime wheel is installed",
                    "pip uninstall -y onnxruntime && pip install onnxruntime-gpu",
                )
            )
        else:
            out.append(DoctorCheck("onnxruntime", "ok", f"onnxruntime {ort}: providers {provs}"))
    return out + [_library_check(m, name) for name in ("tensorrt", "tensorrt-llm", "vllm", "nvidia-modelopt")]


def _library_check(m: Machine, name: str) -> DoctorCheck:
    v = m.libraries.get(name)
    if v:
        return DoctorCheck(name, "ok", f"{name} {v}")
    return DoctorCheck(name, "missing", f"{name} is not installed", *_LIB_FIX[name])


def sandbox_check(mode: str) -> DoctorCheck:
    """How actions are isolated here (`[executor] sandbox`)."""
    from mopt.runner import SANDBOX_MODES, resolve_sandbox

    if mode not in SANDBOX_MODES:
        return DoctorCheck(
            "sandbox", "fail", f"[executor] sandbox = {mode!r} is not one of {', '.join(SANDBOX_MODES)}",
            fix='set sandbox = "auto" in mopt.toml',
        )
    sandboxed, why = resolve_sandbox(mode)
    if sandboxed:
        return DoctorCheck(
            "sandbox", "ok",
            f"actions run in {why}: the filesystem read-only but their output, scratch and the "
            "store's cache/; kinds with network = False get no network",
        )
    if mode == "none":
        return DoctorCheck(
            "sandbox", "info",
            f"{why}: actions run in worker processes; inputs are checked after each action, "
            "but nothing stops an action from writing outside its output folder",
        )
    return DoctorCheck(
        "sandbox", "fail" if mode == "bwrap" else "warn",
        f"{why}: actions run in worker processes without a read-only filesystem",
        "bubblewrap (bwrap) is not installed, or cannot create namespaces here "
        "(unprivileged user namespaces disabled, or a container without CAP_SYS_ADMIN)",
        "apt-get install bubblewrap (dnf install bubblewrap); in a container run as root or "
        "allow user namespaces",
    )


def target_statuses(graph: Any) -> list[TargetStatus]:
    """For each node: its requirements on its profile and what this machine lacks."""
    out = []
    for i in graph.nodes:
        node = graph.nodes[i]
        kind = graph.registry.targets[node.kind]()
        try:
            reqs = list(kind.requirements(node.target.params, node.hardware))
        except Exception as exc:
            out.append(TargetStatus(i, node.kind, node.hardware.name, [], [f"requirements() failed: {exc}"]))
            continue
        out.append(
            TargetStatus(i, node.kind, node.hardware.name, reqs, check_requirements(reqs, node.hardware))
        )
    return out


def doctor(registry: Any, session: Any = None) -> DoctorReport:
    """The full report; with a loaded recipe session, which of its targets are buildable here."""
    m = detect()
    report = DoctorReport(m, diagnose(m, registry), matching_profiles(registry))
    mode = session.project.config.executor.get("sandbox", "auto") if session is not None else "auto"
    report.checks.append(sandbox_check(str(mode)))
    if session is not None:
        report.recipe = str(session.recipe.path)
        report.targets = target_statuses(session.graph)
    return report
