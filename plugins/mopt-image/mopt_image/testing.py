"""Test helpers: a tiny base image made locally, with no network and no builder.

`make_busybox_base` writes an OCI archive of a one-layer image holding a static busybox
(Debian: `apt-get install busybox-static`) with its applets linked under /bin — enough for
`sh`, `test` and `ls` inside the image, so a smoke test can run there. The archive is
assembled byte-for-byte deterministically in Python, so its digest is the same on every
machine with the same busybox binary.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import os
import shutil
import struct
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mopt_image import oci

#: applets linked to /bin/busybox (what smoke tests and test commands use)
APPLETS = ("sh", "test", "[", "ls", "cat", "echo", "true", "false", "env", "find", "sha256sum", "wc")
BUSYBOX_CANDIDATES = ("/bin/busybox", "/usr/bin/busybox")


@dataclass(frozen=True)
class BaseImage:
    archive: Path
    digest: str  # manifest digest: pin it as base = "oci-archive:<archive>@<digest>"
    image_id: str

    @property
    def base(self) -> str:
        return f"oci-archive:{self.archive}@{self.digest}"


def is_static_elf(path: Path) -> bool:
    """Whether `path` is an ELF executable with no program interpreter (statically linked)."""
    with open(path, "rb") as f:
        head = f.read(64)
        if head[:4] != b"\x7fELF":
            return False
        is64 = head[4] == 2
        endian = "<" if head[5] == 1 else ">"
        if is64:
            phoff, = struct.unpack(endian + "Q", head[32:40])
            phentsize, phnum = struct.unpack(endian + "HH", head[54:58])
        else:
            phoff, = struct.unpack(endian + "I", head[28:32])
            phentsize, phnum = struct.unpack(endian + "HH", head[42:46])
        for i in range(phnum):
            f.seek(phoff + i * phentsize)
            p_type, = struct.unpack(endian + "I", f.read(4))
            if p_type == 3:  # PT_INTERP: needs a dynamic loader, which FROM scratch lacks
                return False
    return True


def find_static_busybox() -> Path | None:
    """A statically linked busybox on this machine, or None."""
    for c in (*BUSYBOX_CANDIDATES, shutil.which("busybox") or ""):
        if c and os.path.isfile(c) and is_static_elf(Path(c)):
            return Path(c)
    return None


def _ti(name: str, *, mode: int, kind: bytes = tarfile.REGTYPE, size: int = 0, link: str = "") -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.type, ti.mode, ti.size, ti.linkname = kind, mode, size, link
    ti.mtime, ti.uid, ti.gid, ti.uname, ti.gname = 0, 0, 0, "", ""
    return ti


def fake_server(name: str) -> bytes:
    """A stand-in for a serving executable (`vllm`, `trtllm-serve`, `tritonserver`): a shell
    script that prints its arguments, so a smoke test can find it on PATH."""
    return f'#!/bin/sh\necho "fake {name}: $*"\n'.encode()


def make_busybox_base(
    dest: Path, busybox: Path | None = None, extra: dict[str, tuple[bytes, int]] | None = None
) -> BaseImage:
    """Write an OCI archive at `dest` of a FROM-scratch image with a static busybox (and the
    `extra` files: path in the image → (bytes, mode)); return it with its manifest digest.
    Raises FileNotFoundError when no static busybox is installed."""
    from mopt_image.oci import host_arch

    bb = busybox or find_static_busybox()
    if bb is None:
        raise FileNotFoundError("no static busybox found: apt-get install busybox-static")
    layer_tar = io.BytesIO()
    with tarfile.open(fileobj=layer_tar, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for d in ("bin", "etc", "tmp"):
            tar.addfile(_ti(d, mode=0o1777 if d == "tmp" else 0o755, kind=tarfile.DIRTYPE))
        data = bb.read_bytes()
        tar.addfile(_ti("bin/busybox", mode=0o755, size=len(data)), io.BytesIO(data))
        for applet in APPLETS:
            tar.addfile(_ti(f"bin/{applet}", mode=0o777, kind=tarfile.SYMTYPE, link="busybox"))
        passwd = b"root:x:0:0:root:/:/bin/sh\n"
        tar.addfile(_ti("etc/passwd", mode=0o644, size=len(passwd)), io.BytesIO(passwd))
        made = {"bin", "etc", "tmp"}
        for path, (body, mode) in sorted((extra or {}).items()):
            parts = path.strip("/").split("/")
            for i in range(1, len(parts)):
                d = "/".join(parts[:i])
                if d not in made:
                    tar.addfile(_ti(d, mode=0o755, kind=tarfile.DIRTYPE))
                    made.add(d)
            tar.addfile(_ti("/".join(parts), mode=mode, size=len(body)), io.BytesIO(body))
    raw_layer = layer_tar.getvalue()
    gz = io.BytesIO()
    oci.gzip_deterministic(io.BytesIO(raw_layer), gz)
    layer = gz.getvalue()
    config = {
        "created": "1970-01-01T00:00:00Z",
        "architecture": host_arch(),
        "os": "linux",
        "config": {"Env": ["PATH=/usr/local/bin:/usr/bin:/bin"], "Cmd": ["/bin/sh"]},
        "rootfs": {"type": "layers", "diff_ids": [oci.sha256_bytes(raw_layer)]},
        "history": [{"created": "1970-01-01T00:00:00Z", "created_by": "mopt_image.testing: static busybox"}],
    }
    cfg = oci.canonical(config)
    manifest = {
        "schemaVersion": 2,
        "mediaType": oci.OCI_MANIFEST,
        "config": {"mediaType": oci.OCI_CONFIG, "digest": oci.sha256_bytes(cfg), "size": len(cfg)},
        "layers": [{"mediaType": oci.OCI_LAYER_GZIP, "digest": oci.sha256_bytes(layer), "size": len(layer)}],
    }
    man = oci.canonical(manifest)
    digest = oci.sha256_bytes(man)
    index = {
        "schemaVersion": 2,
        "manifests": [{"mediaType": oci.OCI_MANIFEST, "digest": digest, "size": len(man),
                       "annotations": {"org.opencontainers.image.ref.name": "busybox"}}],
    }
    layout = dest.with_name(dest.name + ".layout")
    if layout.exists():
        shutil.rmtree(layout)
    (layout / "blobs" / "sha256").mkdir(parents=True)
    for blob in (cfg, layer, man):
        (layout / "blobs" / "sha256" / oci.sha256_bytes(blob).split(":")[1]).write_bytes(blob)
    (layout / "index.json").write_bytes(oci.canonical(index))
    (layout / "oci-layout").write_text(json.dumps({"imageLayoutVersion": "1.0.0"}))
    oci.write_archive(layout, dest, repo_tag="localhost/busybox:static")
    shutil.rmtree(layout)
    return BaseImage(dest, digest, manifest["config"]["digest"])


@contextlib.contextmanager
def shared_serving_store(tmp_path_factory: Any) -> Iterator[Path]:
    """The store mopt-image's test_serving_image.py and mopt-deploy's test_prometheus.py share
    (the same tiny-bert section of recipes/cpu-serve.toml: its base, image and check are built
    once a test run), and a lock that runs the two one at a time (both load the same image
    into the daemon, and the image test checks none is left there). `tmp_path_factory`:
    pytest's; under xdist the run's base folder, not the worker's."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if base.name.startswith("popen-gw") else base
    (root / "cpu-serving").mkdir(exist_ok=True)
    with open(root / "cpu-serving" / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield root / "cpu-serving" / "store"
