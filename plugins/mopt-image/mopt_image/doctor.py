"""`mopt doctor`'s container lines (registered with `mopt_register_doctor_checks`): Docker's
daemon, the NVIDIA container runtime, buildah: what the image kinds need here. The probes are
the plugin's own (the core knows no container tooling)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: seconds `docker info` may take (a daemon that hangs is reported, not waited for)
DOCKER_TIMEOUT_S = 8.0


def _check(name: str, status: str, summary: str, cause: str = "", fix: str = "") -> dict[str, str]:
    return {"name": name, "status": status, "summary": summary, "cause": cause, "fix": fix}


def _run(argv: list[str], timeout: float) -> tuple[int, str, str]:
    """(returncode, stdout, stderr); a tool that is missing or does not answer is a returncode."""
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
                           errors="replace")  # fmt: skip
    except subprocess.TimeoutExpired:
        return 124, "", f"{argv[0]} did not answer within {timeout:g} s"
    except OSError as exc:
        return 126, "", f"{argv[0]}: {exc}"
    return p.returncode, p.stdout, p.stderr


@dataclass(frozen=True)
class DockerProbe:
    client: str | None  # path of the docker CLI
    daemon: bool
    server_version: str | None = None
    runtimes: tuple[str, ...] = ()
    error: str | None = None
    host: str | None = None  # DOCKER_HOST or the default socket

    @property
    def nvidia_runtime(self) -> bool:
        return "nvidia" in self.runtimes


def probe_docker() -> DockerProbe:
    """Is the docker daemon reachable, and which runtimes does it have registered?"""
    client = shutil.which("docker")
    host = os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"
    if client is None:
        return DockerProbe(None, False, error="docker CLI not found on PATH", host=host)
    rc, out, errtext = _run([client, "info", "--format", "{{json .}}"], DOCKER_TIMEOUT_S)
    if rc != 0 or not out.strip().startswith("{"):
        msg = " ".join((errtext or out).split()) or f"docker info exited {rc}"
        return DockerProbe(client, False, error=msg[:300], host=host)
    try:
        info = json.loads(out)
    except ValueError:
        return DockerProbe(client, False, error="docker info printed bad JSON", host=host)
    if info.get("ServerErrors"):
        return DockerProbe(client, False, error="; ".join(map(str, info["ServerErrors"]))[:300], host=host)
    runtimes = tuple(sorted((info.get("Runtimes") or {}).keys()))
    return DockerProbe(client, True, info.get("ServerVersion"), runtimes, None, host)


def _cdi_specs() -> tuple[str, ...]:
    """The NVIDIA CDI specs (GPU devices for containers without the 'nvidia' runtime)."""
    found = []
    for d in ("/etc/cdi", "/var/run/cdi"):
        try:
            found += [str(p) for p in sorted(Path(d).iterdir()) if "nvidia" in p.name]
        except OSError:
            continue
    return tuple(found)


def containers(m: Any) -> list[dict[str, str]]:
    """Checks of this machine's Docker daemon, nvidia-ctk, CDI specs and buildah (`m`, mopt's
    `Machine`, is not needed: these are probed here)."""
    out = []
    d = probe_docker()
    nvidia_ctk = shutil.which("nvidia-ctk") or shutil.which("nvidia-container-runtime")
    cdi_specs = _cdi_specs()
    buildah = shutil.which("buildah")
    if d.client is None:
        out.append(
            _check(
                "docker",
                "missing",
                "docker CLI not found",
                "Docker is not installed (the image kind can use buildah instead)",
                "install Docker Engine (https://docs.docker.com/engine/install/) or buildah",
            )
        )
    elif not d.daemon:
        err = d.error or ""
        if "permission denied" in err.lower():
            cause = f"your user may not use the Docker socket ({d.host})"
            fix = "add yourself to the docker group (sudo usermod -aG docker $USER; log in again), or use rootless Docker / buildah"
        else:
            cause = (
                f"no Docker daemon answers at {d.host}: it is not running, or (inside a container) "
                "its socket is not mounted"
            )
            fix = (
                "start it (sudo systemctl start docker), point DOCKER_HOST at one, mount "
                "/var/run/docker.sock into this container, or build images daemonless with buildah"
            )
        out.append(
            _check("docker", "missing", f"docker client {d.client}, daemon not reachable: {err}", cause, fix)
        )
    else:
        out.append(
            _check(
                "docker",
                "ok",
                f"docker daemon {d.server_version or '?'} reachable; runtimes: {', '.join(d.runtimes) or '-'}",
            )
        )
    ctk = "; " + ("nvidia-ctk " + nvidia_ctk if nvidia_ctk else "no nvidia-ctk on PATH")
    cdi = f"; CDI specs: {', '.join(cdi_specs)}" if cdi_specs else ""
    toolkit_fix = (
        "install the NVIDIA Container Toolkit, then `sudo nvidia-ctk runtime configure "
        "--runtime=docker && sudo systemctl restart docker`"
    )
    if d.daemon and (d.nvidia_runtime or cdi_specs):
        out.append(_check("nvidia-container-runtime", "ok", "registered with Docker" + ctk + cdi))
    elif d.daemon:
        out.append(
            _check(
                "nvidia-container-runtime",
                "missing",
                "Docker has no 'nvidia' runtime and no CDI spec for NVIDIA GPUs" + ctk,
                "the NVIDIA Container Toolkit is not installed or not configured for Docker",
                toolkit_fix,
            )
        )
    else:
        out.append(
            _check(
                "nvidia-container-runtime",
                "missing",
                "cannot tell: no Docker daemon to ask" + ctk + cdi,
                "GPU containers need the NVIDIA Container Toolkit registered with a running daemon",
                toolkit_fix + " (once a daemon runs)",
            )
        )
    if buildah:
        from mopt_image.builders import buildah_version

        out.append(_check("buildah", "ok", f"buildah {buildah_version() or '?'} ({buildah})"))
    else:
        out.append(
            _check(
                "buildah",
                "missing",
                "buildah not found on PATH",
                "the image kind builds OCI images without a daemon through buildah",
                "sudo apt-get install buildah (Debian/Ubuntu) or dnf install buildah",
            )
        )
    return out
