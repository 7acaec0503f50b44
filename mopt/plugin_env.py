"""What this machine has: packages (without importing them), GPUs (through nvidia-smi, so no
CUDA library is loaded), and errors that name what to install.

Shared by the GPU plugins (mopt-tensorrt, mopt-serve, mopt-torch); stdlib only, so importing it
loads no GPU library.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import importlib.util
import re
import shutil
import subprocess
from functools import lru_cache
from types import ModuleType
from typing import Any


def dist_version(*names: str) -> str | None:
    """Version of the first installed distribution among `names` (None when none is)."""
    for name in names:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            continue
    return None


def installed_dists(prefix: str) -> dict[str, str]:
    """{distribution: version} for installed distributions whose name starts with `prefix`."""
    out: dict[str, str] = {}
    norm = prefix.lower().replace("_", "-")
    for dist in md.distributions():
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if name.startswith(norm):
            out[name] = dist.version
    return dict(sorted(out.items()))


def has_module(name: str) -> bool:
    """Whether a top-level module can be imported, without importing it."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def require_module(module: str, kind: str, install: str) -> ModuleType:
    """Import `module` or raise a RuntimeError that names the package to install."""
    if not has_module(module):
        raise RuntimeError(
            f"target kind {kind!r} needs the Python package {module!r}, which is not installed here "
            f"({install})"
        )
    return importlib.import_module(module)


@lru_cache(maxsize=1)
def gpus() -> tuple[dict[str, Any], ...]:
    """The GPUs nvidia-smi reports: name, compute capability, memory, driver."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return ()
    try:
        q = subprocess.run(
            [
                exe,
                "--query-gpu=name,compute_cap,memory.total,driver_version",
                "--format=csv,noheader,nounits",
            ],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired):
        return ()
    if q.returncode != 0:
        return ()
    out = []
    for line in q.stdout.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 4:
            continue
        cc = tuple(int(x) for x in parts[1].split(".")) if re.fullmatch(r"\d+\.\d+", parts[1]) else None
        out.append(
            {
                "name": parts[0],
                "compute_capability": cc,
                "memory_mb": int(float(parts[2])) if parts[2].replace(".", "").isdigit() else None,
                "driver": parts[3],
            }
        )
    return tuple(out)


def gpu_facts() -> dict[str, str]:
    """Fingerprint fields of GPU 0: name and compute capability ("none" without a GPU)."""
    found = gpus()
    if not found:
        return {"gpu": "none", "compute_capability": "none"}
    g = found[0]
    cc = g["compute_capability"]
    return {"gpu": g["name"], "compute_capability": f"{cc[0]}.{cc[1]}" if cc else "unknown"}


def require_gpu(kind: str, hardware: Any = None) -> dict[str, Any]:
    """GPU 0, checked against the section's hardware profile; RuntimeError when there is no
    GPU or it is not the profile's architecture (an engine built elsewhere would be wrong)."""
    found = gpus()
    if not found:
        raise RuntimeError(f"target kind {kind!r} needs a CUDA GPU, and nvidia-smi finds none here")
    g = found[0]
    want, have = getattr(hardware, "compute_capability", None), g["compute_capability"]
    if want is not None and have is not None and tuple(want) != tuple(have):
        raise RuntimeError(
            f"target kind {kind!r} builds for profile {hardware.name!r} (compute capability "
            f"{want[0]}.{want[1]}), but this machine's GPU is {g['name']} "
            f"({have[0]}.{have[1]}); build it on a matching GPU"
        )
    return g
