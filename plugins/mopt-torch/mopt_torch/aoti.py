"""Loading AOTInductor packages safely: always first in a child process.

Known issue (seen on this project's H200 machine, torch 2.11.0+cu130, CUDA 13): loading *any*
AOTInductor package segfaults, even a Linear + ReLU, in a fresh process; compiling works.
A segfault inside mopt's own process would kill the build, so the load check runs in a child
process and a crash becomes `AotiLoadError` naming the signal and this issue.
Imports nothing from mopt.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

KNOWN_ISSUES = (
    "known issue: on torch 2.11 with CUDA 13 (seen on an H200), loading any AOTInductor package "
    "segfaults in a fresh process, even a Linear + ReLU, while compiling works; use a torch "
    "release without it, or build a `torch-compile` artifact instead"
)


class AotiLoadError(RuntimeError):
    """The package could not be loaded and run in a child process."""


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"killed by {name}"
    return f"exit status {returncode}"


def probe_load(
    package: Path | str, probe_file: Path | str, device: str = "cuda", timeout: float = 600
) -> dict[str, Any]:
    """Load the package and run it once in a child process; the child's JSON report, or
    AotiLoadError (with the known issue named when the child died of a signal)."""
    argv = [sys.executable, "-m", "mopt_torch.aoti_worker", "probe", str(package), str(probe_file), device]
    return run_probe(argv, Path(package).name, timeout)


def run_probe(argv: list[str], what: str, timeout: float = 600) -> dict[str, Any]:
    """Run a probe child; its last JSON line, or AotiLoadError describing how it died."""
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise AotiLoadError(f"loading {what} did not finish in {timeout:.0f} s") from exc
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        msg = f"loading the AOTInductor package {what} in a child process failed: {describe_exit(proc.returncode)}"
        if proc.returncode < 0:
            msg += f" ({KNOWN_ISSUES})"
        raise AotiLoadError(msg + ("; " + " | ".join(tail) if tail else ""))
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    return json.loads(lines[-1]) if lines else {"ok": True}  # type: ignore[no-any-return]


def load_checked(package: Path | str, probe_file: Path | str, device: str = "cuda") -> Any:
    """Probe in a child first; load in this process only when the child survived."""
    probe_load(package, probe_file, device)
    import torch

    return torch._inductor.aoti_load_package(str(package))
