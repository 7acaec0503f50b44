"""The `base-image` target kind: a base image made from Debian packages by mopt itself.

`mmdebstrap` (Debian's own bootstrapper, the one built for reproducible output) installs the
listed packages and their dependencies from a Debian mirror into a root file system with
SOURCE_DATE_EPOCH set (clamped file times, hash-based .pyc files, no apt caches or logs);
mopt packs that tree as the single layer of an OCI image (gzip with no name and no time, a
config with fixed times). The image digest is then a function of the package versions: the
same versions give the same digest. `base.json` records the packages and versions
(`dpkg-query -W` of the image), the mirror, and the digest; `expect_digest` makes the
target fail when the mirror no longer gives those bytes (pin the mirror with `snapshot`).

No registry is involved: the serving image's `FROM` is this archive, pinned by its digest.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tarfile
import time
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator

from mopt.api import BuildContext, Params, TargetKind

ARCHIVE = "image.oci.tar"
#: a Python 3 userland and the C++ runtime that onnxruntime / numpy wheels link against;
#: nothing else (no perl, no apt in the image: the image installs nothing at run time)
DEFAULT_PACKAGES = ["python3-minimal", "libpython3.11-stdlib", "libstdc++6"]
_PKG = re.compile(r"[a-z0-9][a-z0-9+.-]+(=[A-Za-z0-9.+~:-]+)?")
#: mmdebstrap's hook that sets up the merged /usr itself, so the `usrmerge` package (and the
#: perl it pulls in) stays out of the image
MERGED_USR_HOOK = Path("/usr/share/mmdebstrap/hooks/merged-usr")
_SNAPSHOT = re.compile(r"[0-9]{8}T[0-9]{6}Z")
#: what the image does not need and mmdebstrap need not unpack (copyright files are kept)
DOC_EXCLUDES = ("/usr/share/doc/*", "/usr/share/man/*", "/usr/share/info/*", "/usr/share/locale/*",
                "/usr/share/lintian/*")


def mmdebstrap_version() -> str | None:
    exe = shutil.which("mmdebstrap")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=20, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.strip().split()[-1] if out.strip() else None


def run_streaming(argv: list[str], *, cwd: Path, env: dict[str, str], on_line: Any) -> int:
    """Run `argv` in its own process group, its output lines to `on_line`; its exit status."""
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, errors="replace", start_new_session=True)
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            on_line(line.rstrip("\n"))
    except BaseException:  # interrupted: do not leave the bootstrap running
        proc.kill()
        proc.wait()
        raise
    return proc.wait()


def installed_packages(rootfs_tar: Path) -> list[str]:
    """`name=version arch` of every installed package, from the image's dpkg status file."""
    with tarfile.open(rootfs_tar) as tar:
        member = next((m for m in tar if m.name.lstrip("./") == "var/lib/dpkg/status"), None)
        if member is None:
            return []
        f = tar.extractfile(member)
        text = f.read().decode("utf-8", errors="replace") if f else ""
    out = []
    for para in text.split("\n\n"):
        fields = dict(
            (k, v.strip()) for line in para.splitlines() if ":" in line and not line.startswith(" ")
            for k, v in [line.split(":", 1)]
        )
        if fields.get("Status", "").endswith(" installed") and "Package" in fields:
            out.append(f"{fields['Package']}={fields.get('Version', '?')} {fields.get('Architecture', '?')}")
    return sorted(out)


def python_version(packages: list[str]) -> str | None:
    """`3.11` when the image has python3.11-minimal (what pip's --python-version wants)."""
    for p in packages:
        m = re.match(r"python(3\.[0-9]+)-minimal=", p)
        if m:
            return m.group(1)
    return None


class BaseImageKind(TargetKind):
    """An OCI base image built from Debian packages with mmdebstrap: one layer, fixed times,
    pinned by the resulting digest; the package list and versions recorded."""

    name = "base-image"
    # buildah / mmdebstrap / docker keep state in /etc/containers, /var/lib/containers and
    # the daemon: outside a bubblewrap sandbox (the input check still applies)
    sandbox = False
    version = "1"
    description = "OCI base image from Debian packages (mmdebstrap, SOURCE_DATE_EPOCH), pinned by digest"
    produces: ClassVar[str] = "oci-image"
    requires = ("tool:mmdebstrap",)
    install_hints: ClassVar[dict[str, str]] = {"tool:mmdebstrap": "apt-get install mmdebstrap (Debian/Ubuntu)"}
    reproducible = True

    class Params(Params):
        suite: str = Field(default="bookworm", description="Debian release")
        mirror: str = Field(default="http://deb.debian.org/debian", description="Debian mirror")
        snapshot: str | None = Field(
            default=None, description="snapshot.debian.org time stamp (YYYYMMDDTHHMMSSZ): the mirror as it was then"
        )
        variant: Literal["essential", "apt", "minbase", "required", "important", "standard"] = Field(
            default="essential", description="mmdebstrap variant (essential: Essential:yes packages only)"
        )
        packages: list[str] = Field(default=list(DEFAULT_PACKAGES), description="packages to add (name or name=version)")
        components: list[str] = Field(default=["main"])
        exclude_docs: bool = Field(default=True, description="leave out docs, man pages and locales")
        merged_usr_hook: bool = Field(
            default=True, description="merged /usr by mmdebstrap's hook, not the usrmerge package (no perl)"
        )
        source_date_epoch: int = Field(default=1700000000, ge=0, description="the time every file carries")
        expect_digest: str | None = Field(
            default=None, description="fail unless the image has this digest (the packages changed on the mirror)"
        )
        tag: str = Field(default="localhost/mopt-debian:bookworm", description="repo:tag in the archive")
        env: dict[str, str] = Field(default={"LANG": "C.UTF-8"}, description="ENV of the image")

        @field_validator("packages")
        @classmethod
        def _packages(cls, v: list[str]) -> list[str]:
            for p in v:
                if not _PKG.fullmatch(p):
                    raise ValueError(f"{p!r} is not a Debian package name (or name=version)")
            return v

        @field_validator("snapshot")
        @classmethod
        def _snapshot(cls, v: str | None) -> str | None:
            if v is not None and not _SNAPSHOT.fullmatch(v):
                raise ValueError(f"{v!r} is not a snapshot.debian.org time stamp like 20260101T000000Z")
            return v

        @field_validator("expect_digest")
        @classmethod
        def _digest(cls, v: str | None) -> str | None:
            if v is not None and not re.fullmatch(r"sha256:[0-9a-f]{64}", v):
                raise ValueError(f"{v!r} is not a digest (sha256: and 64 lowercase hex digits)")
            return v

    def fingerprint(self) -> dict[str, str]:
        return {"mmdebstrap": mmdebstrap_version() or "absent"}

    def platform(self, hardware: Any) -> dict[str, Any]:
        from mopt_image.oci import host_arch

        return {"arch": host_arch()}

    def run(self, ctx: BuildContext) -> dict[str, Any]:
        from mopt_image import oci

        p = ctx.params
        mirror = f"http://snapshot.debian.org/archive/debian/{p.snapshot}/" if p.snapshot else p.mirror
        if ctx.offline:
            raise RuntimeError(
                f"base-image installs Debian packages from {mirror}; --offline forbids that: build it once "
                "online (the store keeps it), or give the image a base_archive instead"
            )
        if shutil.which("mmdebstrap") is None:
            raise RuntimeError("target kind 'base-image' needs mmdebstrap: apt-get install mmdebstrap")
        rootfs = ctx.tmp / "rootfs.tar"
        argv = [
            "mmdebstrap", "--mode=auto", f"--variant={p.variant}", f"--components={','.join(p.components)}",
            "--format=tar", "--skip=output/dev",  # device nodes: the container runtime makes them
        ]
        if p.packages:
            argv.append("--include=" + ",".join(p.packages))
        if p.merged_usr_hook and MERGED_USR_HOOK.is_dir():
            argv.append(f"--hook-dir={MERGED_USR_HOOK}")
        if p.exclude_docs:
            argv += [f"--dpkgopt=path-exclude={x}" for x in DOC_EXCLUDES]
            argv.append("--dpkgopt=path-include=/usr/share/doc/*/copyright")
        if p.snapshot:
            argv.append("--aptopt=Acquire::Check-Valid-Until \"false\"")  # old Release files are expected
        argv += [p.suite, str(rootfs), mirror]
        env = {"SOURCE_DATE_EPOCH": str(p.source_date_epoch), "TMPDIR": str(ctx.tmp), "LC_ALL": "C.UTF-8",
               "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
        ctx.log(f"$ SOURCE_DATE_EPOCH={p.source_date_epoch} " + " ".join(argv))
        lines: list[str] = []

        def on_line(line: str) -> None:
            lines.append(line)
            ctx.log(line)

        t0 = time.monotonic()
        rc = run_streaming(argv, cwd=ctx.tmp, env=env, on_line=on_line)
        if rc != 0:
            raise RuntimeError(f"mmdebstrap failed (exit {rc}):\n" + "\n".join(lines[-15:]))
        seconds = time.monotonic() - t0
        packages = installed_packages(rootfs)
        config = {
            "Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                    *(f"{k}={v}" for k, v in sorted(p.env.items()))],
            "Cmd": ["/bin/bash"],
            "Labels": {
                "org.opencontainers.image.title": f"Debian {p.suite} ({p.variant}) + {' '.join(p.packages)}",
                "dev.mopt.debian.suite": p.suite,
                "dev.mopt.debian.mirror": mirror,
                "dev.mopt.debian.packages": str(len(packages)),
            },
        }
        _repo, _, tag = p.tag.rpartition(":")
        written = oci.write_single_layer_archive(
            rootfs, ctx.out / ARCHIVE, config=config, ref_name=tag or "latest", repo_tag=p.tag,
            created_by=f"mmdebstrap --variant={p.variant} {p.suite} (mopt base-image)",
        )
        rootfs_bytes = rootfs.stat().st_size
        rootfs.unlink()
        info = {
            "archive": ARCHIVE,
            "image_digest": written.digest,
            "image_id": written.image_id,
            "base": f"oci-archive:{ARCHIVE}@{written.digest}",
            "tag": p.tag,
            "suite": p.suite,
            "mirror": mirror,
            "variant": p.variant,
            "requested": list(p.packages),
            "packages": packages,
            "python": python_version(packages),
            "source_date_epoch": p.source_date_epoch,
            "mmdebstrap": mmdebstrap_version(),
            "rootfs_bytes": rootfs_bytes,
            "archive_bytes": written.size,
            "bootstrap_seconds": round(seconds, 1),
        }
        (ctx.out / "base.json").write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
        (ctx.out / "packages.txt").write_text("\n".join(packages) + "\n")
        ctx.log(f"base image {written.digest}: {len(packages)} packages, {written.size / 1e6:.0f} MB, "
                f"python {info['python']}")
        if p.expect_digest and p.expect_digest != written.digest:
            raise RuntimeError(
                f"base-image: got {written.digest}, expect_digest is {p.expect_digest}: the mirror serves other "
                f"package versions now (see packages.txt); pin the mirror with snapshot = \"YYYYMMDDTHHMMSSZ\" "
                "or update expect_digest"
            )
        return {k: info[k] for k in ("image_digest", "image_id", "base", "python", "suite", "mirror",
                                     "archive_bytes", "bootstrap_seconds")} | {"packages": len(packages)}


__all__ = ["BaseImageKind"]
