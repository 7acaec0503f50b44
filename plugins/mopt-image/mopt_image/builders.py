"""Image builders behind one interface: buildah (daemonless) and the docker SDK (a daemon).

Both take the same request (a build context, a pinned base, maybe a local archive of it) and
leave an OCI layout of the image in `request.layout`; the image kind then normalises it and
writes the archive. Each build uses private state under the action's scratch folder: buildah
gets its own `--root`/`--runroot`/TMPDIR there, so parallel builds never share storage and
nothing is left behind; the docker builder removes what it added to the daemon.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from mopt.api import run_process
from mopt_image import oci
from mopt_image.baseref import BaseRef


class BuilderError(RuntimeError):
    """A build step failed; the message says which and shows the tool's last lines."""

    def __init__(self, message: str, returncode: int | None = None) -> None:
        super().__init__(message)
        self.returncode = returncode


class BuilderUnavailable(BuilderError):
    """This machine has no such builder (the message says what to install or start)."""


@dataclass
class BuildRequest:
    context: Path
    base: BaseRef
    base_image: oci.PinnedImage | None  # the verified local archive/layout holding the base
    format: str  # "docker" (keeps HEALTHCHECK) or "oci"
    compress: bool
    offline: bool
    work: Path  # private scratch folder of this build
    layout: Path  # where the built image's OCI layout goes
    log: Callable[[str], None]
    storage_driver: str = "vfs"
    ref_name: str = "latest"


@dataclass
class BuildOutput:
    builder: str
    version: str
    local_id: str  # the image as the builder's own storage names it
    reproducible: bool
    notes: list[str] = field(default_factory=list)


class Builder(ABC):
    name: ClassVar[str]

    @classmethod
    @abstractmethod
    def unavailable(cls) -> str | None:
        """Why this builder cannot run here, or None."""

    @classmethod
    @abstractmethod
    def version(cls) -> str:
        """The builder's version (it shapes the image bytes)."""

    @abstractmethod
    def build(self, req: BuildRequest) -> BuildOutput:
        """Build the context into an OCI layout at `req.layout`."""

    @abstractmethod
    def smoke(self, req: BuildRequest, out: BuildOutput, argv: list[str]) -> list[str]:
        """Run `argv` inside the built image; its output lines; BuilderError if it fails."""

    @abstractmethod
    def close(self) -> None:
        """Remove everything this build created outside `req.layout`."""


def _tail(lines: list[str], n: int = 15) -> str:
    return "\n".join(lines[-n:])


# --------------------------------------------------------------------------- buildah


@functools.lru_cache(maxsize=1)
def buildah_version() -> str | None:
    exe = shutil.which("buildah")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=20, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"version\s+(\S+)", out)
    return m.group(1) if m else (out.strip() or None)


_PASS_ENV = ("PATH", "HOME", "LANG", "REGISTRY_AUTH_FILE", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY",
             "http_proxy", "https_proxy", "no_proxy", "XDG_RUNTIME_DIR", "CONTAINERS_REGISTRIES_CONF")


class BuildahBuilder(Builder):
    """`buildah bud --isolation chroot --timestamp 0` in a private vfs storage root."""

    name = "buildah"

    def __init__(self, req: BuildRequest) -> None:
        self.req = req
        self.root = req.work / "root"
        self.runroot = req.work / "runroot"
        self.tmp = req.work / "tmp"
        for d in (self.root, self.runroot, self.tmp):
            d.mkdir(parents=True, exist_ok=True)
        self.env = {k: v for k in _PASS_ENV if (v := os.environ.get(k)) is not None}
        self.env.update({"TMPDIR": str(self.tmp), "BUILDAH_ISOLATION": "chroot", "LC_ALL": "C"})
        self.containers: list[str] = []

    @classmethod
    def unavailable(cls) -> str | None:
        if shutil.which("buildah") is None:
            return "buildah is not installed (Debian/Ubuntu: apt-get install buildah)"
        return None

    @classmethod
    def version(cls) -> str:
        return buildah_version() or "absent"

    def _argv(self, *args: str) -> list[str]:
        # a fixed umask, so whatever buildah creates has the same modes on every machine
        return [
            "sh", "-c", 'umask 022 && exec "$@"', "buildah-umask022",
            "buildah", "--root", str(self.root), "--runroot", str(self.runroot),
            "--storage-driver", self.req.storage_driver, *args,
        ]

    def run(self, *args: str, what: str, quiet: bool = False) -> list[str]:
        lines: list[str] = []

        def on_line(line: str) -> None:
            lines.append(line)
            if not quiet:
                self.req.log(line)

        self.req.log("$ buildah " + " ".join(args))
        try:
            rc = run_process(self._argv(*args), cwd=self.req.work, env=self.env, on_line=on_line)
        except FileNotFoundError:
            raise BuilderUnavailable("buildah is not installed (apt-get install buildah)") from None
        if rc != 0:
            raise BuilderError(f"{what} failed (buildah exit {rc}):\n{_tail(lines)}", rc)
        return lines

    def _load_base(self) -> None:
        req, base = self.req, self.req.base
        local = f"{base.name}:mopt-base"
        if req.base_image is not None:
            img = req.base_image
            transport = "oci" if img.path.is_dir() else "oci-archive"
            src = f"{transport}:{img.path}"
            if len(oci.list_images(img.path)) > 1:
                if not img.ref_name:
                    raise BuilderError(
                        f"{img.path} holds several images and {base.digest} has no "
                        "org.opencontainers.image.ref.name to select it by; export it alone"
                    )
                src += f":{img.ref_name}"
            lines = self.run("pull", "--quiet", src, what=f"loading the base image from {img.path}", quiet=True)
        else:
            if req.offline:
                raise BuilderError(
                    f"--offline: the base {base.ref} would have to be pulled; give its local copy "
                    "with base_archive (an OCI archive: `skopeo copy docker://IMAGE@DIGEST "
                    "oci-archive:FILE`)"
                )
            lines = self.run("pull", "--quiet", f"docker://{base.ref}", what=f"pulling {base.ref}", quiet=True)
        image_id = next((ln.strip() for ln in reversed(lines) if re.fullmatch(r"[0-9a-f]{64}", ln.strip())), None)
        if image_id is None:
            raise BuilderError(f"buildah pull printed no image id:\n{_tail(lines)}")
        self.run("tag", image_id, local, what="tagging the base image", quiet=True)
        # the pinned reference must now resolve, locally, to exactly this image
        found = self.run("inspect", "--type", "image", "--format", "{{.FromImageID}}", base.ref,
                         what=f"resolving {base.ref}", quiet=True)
        if image_id not in "".join(found):
            raise BuilderError(f"{base.ref} resolves to {''.join(found)!r}, not the loaded {image_id}")
        req.log(f"base {base.ref} = image {image_id[:12]}")

    def build(self, req: BuildRequest) -> BuildOutput:
        self._load_base()
        iid_file = req.work / "iid"
        self.run(
            "bud",
            "--isolation", "chroot",
            "--timestamp", "0",
            "--pull=never",
            "--layers=false",
            "--format", req.format,
            "--iidfile", str(iid_file),
            "-f", str(req.context / "Dockerfile"),
            str(req.context),
            what="buildah bud",
        )
        image_id = iid_file.read_text().strip().removeprefix("sha256:")
        push = ["push", "--quiet", "--format", "v2s2" if req.format == "docker" else "oci"]
        if not req.compress:
            push.append("--disable-compression")
        self.run(*push, image_id, f"oci:{req.layout}:{req.ref_name}", what="writing the OCI layout", quiet=True)
        return BuildOutput("buildah", self.version(), image_id, reproducible=True)

    def smoke(self, req: BuildRequest, out: BuildOutput, argv: list[str]) -> list[str]:
        name = "mopt-smoke"
        self.run("from", "--pull=never", "--name", name, out.local_id, what="creating the smoke-test container",
                 quiet=True)
        self.containers.append(name)
        return self.run("run", "--isolation", "chroot", name, "--", *argv, what="the smoke test")

    def close(self) -> None:
        try:
            if self.containers:
                self.run("rm", "--all", what="removing containers", quiet=True)
        except BuilderError as exc:
            self.req.log(f"warning: {exc}")
        _unmount_below(self.req.work, self.req.log)
        rmtree(self.req.work)


def _mounts_below(path: Path) -> list[str]:
    prefix = str(path.resolve()).rstrip("/") + "/"
    found = []
    try:
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            mnt = line.split()[4].replace("\\040", " ")
            if mnt.startswith(prefix):
                found.append(mnt)
    except OSError:
        pass
    return sorted(found, key=len, reverse=True)


def _unmount_below(path: Path, log: Callable[[str], None]) -> None:
    """Chroot runs mount /proc, /dev, /sys into the container in their own namespace; make
    sure none is left in ours before anything under `path` is deleted."""
    for mnt in _mounts_below(path):
        log(f"unmounting leftover {mnt}")
        subprocess.run(["umount", "-l", mnt], capture_output=True, check=False)
    left = _mounts_below(path)
    if left:
        raise BuilderError(f"cannot unmount {left[0]}: refusing to delete the build's storage under it")


def rmtree(path: Path) -> None:
    """Remove `path`, also read-only folders left by a builder (best effort)."""

    def onerror(func: Any, p: str, _exc: Any) -> None:
        try:
            os.chmod(os.path.dirname(p), 0o755)
            if not os.path.islink(p):
                os.chmod(p, 0o755)
            func(p)
        except OSError:
            pass

    if path.exists():
        shutil.rmtree(path, onerror=onerror)


# --------------------------------------------------------------------------- docker


def _docker_module() -> Any:
    try:
        import docker  # type: ignore[import-not-found]
    except ImportError:
        raise BuilderUnavailable(
            "the docker builder needs the docker SDK: pip install 'mopt-image[docker]'"
        ) from None
    return docker


@functools.lru_cache(maxsize=1)
def docker_daemon() -> tuple[str | None, str | None]:
    """(server version, None) when a docker daemon answers, else (None, why not)."""
    try:
        docker = _docker_module()
    except BuilderUnavailable as exc:
        return None, str(exc)
    try:
        client = docker.from_env(timeout=10)
        version = client.version().get("Version")
        client.close()
        return str(version or "unknown"), None
    except Exception as exc:
        return None, f"no docker daemon answers ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})"


class DockerBuilder(Builder):
    """The docker SDK against a daemon (its classic builder: not bit-reproducible)."""

    name = "docker"

    def __init__(self, req: BuildRequest) -> None:
        self.req = req
        docker = _docker_module()
        self.errors = docker.errors
        self.client = docker.from_env(timeout=600)
        self.added: list[str] = []  # images / tags this build added to the daemon
        req.work.mkdir(parents=True, exist_ok=True)

    @classmethod
    def unavailable(cls) -> str | None:
        return docker_daemon()[1]

    @classmethod
    def version(cls) -> str:
        return docker_daemon()[0] or "absent"

    def _load_base(self) -> str:
        """The base as the daemon knows it: an image id, or the pinned reference itself."""
        req, base = self.req, self.req.base
        if req.base_image is not None:
            tar = req.work / "base.docker.tar"
            expected = oci.layout_to_docker_archive(req.base_image.path, base.digest, tar, repo_tag=None)
            with open(tar, "rb") as f:
                loaded = self.client.images.load(f)
            ids = [img.id for img in loaded]
            if expected not in ids:
                raise BuilderError(f"docker loaded {ids} from the base archive, expected {expected}")
            tar.unlink()
            req.log(f"base {base.ref} loaded as {expected[:19]}")
            return expected
        try:
            img = self.client.images.get(base.ref)
        except self.errors.ImageNotFound:
            if req.offline:
                raise BuilderError(
                    f"--offline: the daemon does not have {base.ref}; pull it first or give base_archive"
                ) from None
            req.log(f"docker pull {base.ref}")
            img = self.client.images.pull(base.ref)
        if base.ref not in (img.attrs.get("RepoDigests") or []) and not any(
            d.endswith("@" + base.digest) for d in img.attrs.get("RepoDigests") or []
        ):
            raise BuilderError(f"the daemon's {base.ref} does not carry the digest {base.digest}")
        return base.ref

    def build(self, req: BuildRequest) -> BuildOutput:
        import io
        import tarfile

        from_ref = self._load_base()
        dockerfile = (req.context / "Dockerfile").read_text()
        if from_ref != req.base.ref:  # an archive base is known to the daemon by its id only
            dockerfile = dockerfile.replace(f"FROM {req.base.ref}\n", f"FROM {from_ref}\n", 1)
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for p in sorted(req.context.rglob("*")):
                rel = p.relative_to(req.context).as_posix()
                if rel == "Dockerfile":
                    continue
                tar.add(p, arcname=rel, recursive=False)
            raw = dockerfile.encode()
            ti = tarfile.TarInfo("Dockerfile")
            ti.size, ti.mode = len(raw), 0o644
            tar.addfile(ti, io.BytesIO(raw))
        buf.seek(0)
        image_id = None
        lines: list[str] = []
        for chunk in self.client.api.build(fileobj=buf, custom_context=True, rm=True, forcerm=True,
                                           pull=False, decode=True):
            if "stream" in chunk:
                for line in str(chunk["stream"]).splitlines():
                    if line.strip():
                        lines.append(line)
                        req.log(line)
            if "error" in chunk:
                raise BuilderError(f"docker build failed: {chunk['error']}\n{_tail(lines)}")
            aux = chunk.get("aux") or {}
            if aux.get("ID"):
                image_id = aux["ID"]
        if image_id is None:
            m = next((re.search(r"Successfully built ([0-9a-f]+)", ln) for ln in reversed(lines)
                      if "Successfully built" in ln), None)
            image_id = m.group(1) if m else None
        if image_id is None:
            raise BuilderError(f"docker build reported no image id:\n{_tail(lines)}")
        self.added.append(image_id)
        saved = req.work / "image.docker.tar"
        with open(saved, "wb") as f:
            for chunk in self.client.images.get(image_id).save(named=False):
                f.write(chunk)
        oci.docker_archive_to_layout(saved, req.layout, compress=req.compress, oci=req.format == "oci")
        saved.unlink()
        return BuildOutput(
            "docker", self.version(), image_id, reproducible=False,
            notes=["docker's builder stamps creation times into the image: rebuilds differ byte-wise"],
        )

    def smoke(self, req: BuildRequest, out: BuildOutput, argv: list[str]) -> list[str]:
        try:
            logs = self.client.containers.run(out.local_id, entrypoint=argv[:1], command=argv[1:], remove=True,
                                              stdout=True, stderr=True, network_disabled=True)
        except self.errors.ContainerError as exc:
            raise BuilderError(f"the smoke test failed (exit {exc.exit_status}): {exc.stderr!r}",
                               exc.exit_status) from None
        lines = logs.decode(errors="replace").splitlines()
        for line in lines:
            req.log(line)
        return lines

    def close(self) -> None:
        for ref in self.added:
            try:
                self.client.images.remove(ref, force=True)
            except Exception as exc:  # the image is still usable; say so and go on
                self.req.log(f"warning: could not remove {ref} from the daemon: {exc}")
        self.client.close()
        rmtree(self.req.work)


BUILDERS: dict[str, type[Builder]] = {"buildah": BuildahBuilder, "docker": DockerBuilder}


def select(preference: str) -> type[Builder]:
    """The builder class to use: the one asked for, or for "auto" buildah, else docker."""
    if preference != "auto":
        cls = BUILDERS[preference]
        why = cls.unavailable()
        if why:
            raise BuilderUnavailable(f"builder {preference!r} cannot run here: {why}")
        return cls
    reasons = []
    for cls in (BuildahBuilder, DockerBuilder):
        why = cls.unavailable()
        if why is None:
            return cls
        reasons.append(f"{cls.name}: {why}")
    raise BuilderUnavailable("no image builder here (" + "; ".join(reasons) + ")")


def describe() -> dict[str, Any]:
    """What `mopt doctor`-style output can say about the builders."""
    return {name: {"available": cls.unavailable() is None, "why_not": cls.unavailable(), "version": cls.version()}
            for name, cls in BUILDERS.items()}


__all__ = ["BuildOutput", "BuildRequest", "Builder", "BuilderError", "BuilderUnavailable", "select"]
