"""`mopt doctor`'s container lines (registered with `mopt_register_doctor_checks`): Docker's
daemon, the NVIDIA container runtime, buildah: what the image kinds need here."""

from __future__ import annotations

from typing import Any


def _check(name: str, status: str, summary: str, cause: str = "", fix: str = "") -> dict[str, str]:
    return {"name": name, "status": status, "summary": summary, "cause": cause, "fix": fix}


def containers(m: Any) -> list[dict[str, str]]:
    """Checks of machine `m` (mopt's `Machine`: its Docker, nvidia-ctk, CDI and buildah probes)."""
    out = []
    d = m.docker
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
    ctk = "; " + ("nvidia-ctk " + m.nvidia_ctk if m.nvidia_ctk else "no nvidia-ctk on PATH")
    cdi = f"; CDI specs: {', '.join(m.cdi_specs)}" if m.cdi_specs else ""
    toolkit_fix = (
        "install the NVIDIA Container Toolkit, then `sudo nvidia-ctk runtime configure "
        "--runtime=docker && sudo systemctl restart docker`"
    )
    if d.daemon and (d.nvidia_runtime or m.cdi_specs):
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
    if m.buildah:
        out.append(_check("buildah", "ok", m.buildah_version or m.buildah))
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
