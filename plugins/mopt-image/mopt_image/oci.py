"""OCI image layouts and archives: read, verify by digest, normalise, and write byte-for-byte
reproducibly. Standard library only.

An OCI *layout* is a folder with `oci-layout`, `index.json` and `blobs/sha256/<hex>`; an OCI
*archive* is a tar of one. The archives this module writes also carry a docker-style
`manifest.json` (as `docker save` does since Docker 25), so `docker load` takes them too.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import platform
import re
import shutil
import tarfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

ARCHIVE = "image.oci.tar"  # the image kind's output
LABEL_PREFIX = "dev.mopt."  # mopt's provenance labels
_GOARCH = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64", "ppc64le": "ppc64le",
           "s390x": "s390x"}


def host_arch() -> str:
    """This machine's architecture as OCI names it (amd64, arm64, ...)."""
    m = platform.machine().lower()
    return _GOARCH.get(m, m)

OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
OCI_LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
OCI_LAYER = "application/vnd.oci.image.layer.v1.tar"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_CONFIG = "application/vnd.docker.container.image.v1+json"
DOCKER_LAYER_GZIP = "application/vnd.docker.image.rootfs.diff.tar.gzip"
DOCKER_LAYER = "application/vnd.docker.image.rootfs.diff.tar"

INDEX_TYPES = (OCI_INDEX, DOCKER_LIST)
MANIFEST_TYPES = (OCI_MANIFEST, DOCKER_MANIFEST)

DIGEST_RE = re.compile(r"sha256:[0-9a-f]{64}")
#: fields of an image config that a builder fills with per-run values (the build container's
#: id and hostname): they change the image id without changing anything the image does
VOLATILE_CONFIG_FIELDS = ("container", "config.Hostname", "container_config.Hostname")


class OCIError(ValueError):
    """An archive or layout is not what it should be (the message says which file and why)."""


def sha256_bytes(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def sha256_file(path: str | os.PathLike[str]) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


def _blob_name(digest: str) -> str:
    if not DIGEST_RE.fullmatch(digest):
        raise OCIError(f"not a sha256 digest: {digest!r}")
    return "blobs/sha256/" + digest.split(":", 1)[1]


def canonical(obj: Any) -> bytes:
    """Compact JSON in the key order given (what containers/image and docker write)."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


# --------------------------------------------------------------------------- reading


class _Source:
    """Read named files of a layout folder or an archive (tar) without unpacking it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._tar: tarfile.TarFile | None = None
        self._members: dict[str, tarfile.TarInfo] = {}
        if path.is_dir():
            return
        if not path.is_file():
            raise OCIError(f"{path}: no such OCI archive or layout")
        try:
            self._tar = tarfile.open(path, "r:*")  # noqa: SIM115 - closed by close()
            for m in self._tar.getmembers():
                name = m.name[2:] if m.name.startswith("./") else m.name
                self._members[name.rstrip("/")] = m
        except (tarfile.TarError, OSError) as exc:
            raise OCIError(f"{path}: not a tar archive ({exc})") from None

    def exists(self, name: str) -> bool:
        if self._tar is None:
            return (self.path / name).is_file()
        return name in self._members

    @contextmanager
    def open(self, name: str) -> Iterator[IO[bytes]]:
        if self._tar is None:
            with open(self.path / name, "rb") as f:
                yield f
            return
        m = self._members.get(name)
        if m is None or not m.isfile():
            raise OCIError(f"{self.path}: has no {name}")
        f = self._tar.extractfile(m)
        assert f is not None
        try:
            yield f
        finally:
            f.close()

    def read(self, name: str, limit: int = 16 << 20) -> bytes:
        with self.open(name) as f:
            data = f.read(limit + 1)
        if len(data) > limit:
            raise OCIError(f"{self.path}: {name} is larger than {limit} bytes")
        return data

    def size(self, name: str) -> int:
        if self._tar is None:
            return (self.path / name).stat().st_size
        return self._members[name].size

    def digest(self, name: str) -> str:
        h = hashlib.sha256()
        with self.open(name) as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
        return "sha256:" + h.hexdigest()

    def close(self) -> None:
        if self._tar is not None:
            self._tar.close()


@dataclass(frozen=True)
class PinnedImage:
    """An image found in a local archive or layout by its pinned digest, verified."""

    path: Path
    digest: str  # the pinned digest: of a manifest, or of an index (multi-platform)
    media_type: str
    ref_name: str | None  # its org.opencontainers.image.ref.name in index.json, if any
    config_digest: str | None  # None for an index
    platforms: tuple[str, ...] = ()
    layers: tuple[str, ...] = ()
    annotations: dict[str, str] = field(default_factory=dict)
    top_level: bool = True  # listed in index.json itself (else inside a listed index)


def _json(src: _Source, name: str) -> dict[str, Any]:
    try:
        doc = json.loads(src.read(name))
    except ValueError as exc:
        raise OCIError(f"{src.path}: {name} is not JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise OCIError(f"{src.path}: {name} is not a JSON object")
    return doc


def list_images(path: Path) -> list[dict[str, Any]]:
    """The descriptors of index.json of an OCI archive or layout (what it holds)."""
    src = _Source(path)
    try:
        if not src.exists("index.json"):
            hint = " (it looks like a `docker save` archive: convert it with `skopeo copy docker-archive:X oci-archive:Y`)" if src.exists("manifest.json") else ""
            raise OCIError(f"{path}: not an OCI archive or layout: no index.json{hint}")
        return list(_json(src, "index.json").get("manifests") or [])
    finally:
        src.close()


def find_pinned(path: Path, digest: str) -> PinnedImage:
    """Find the manifest (or index) `digest` in the OCI archive/layout at `path` and verify
    it: the blob's bytes must hash to the digest, and for a manifest, so must its config.
    Layers are verified by the builder when it reads them (containers/image checks every blob)."""
    if not DIGEST_RE.fullmatch(digest):
        raise OCIError(f"{digest!r} is not a sha256 digest (sha256:<64 hex>)")
    src = _Source(path)
    try:
        if not src.exists("index.json"):
            raise OCIError(f"{path}: not an OCI archive or layout: no index.json")
        index = _json(src, "index.json")
        top = list(index.get("manifests") or [])
        hit = next((d for d in top if d.get("digest") == digest), None)
        top_level = hit is not None
        if hit is None:  # maybe one platform's manifest inside a listed index
            for d in top:
                if d.get("mediaType") in INDEX_TYPES and src.exists(_blob_name(d["digest"])):
                    inner = _json(src, _blob_name(d["digest"]))
                    hit = next((m for m in inner.get("manifests") or [] if m.get("digest") == digest), None)
                    if hit is not None:
                        hit = {**hit, "annotations": {**(d.get("annotations") or {}), **(hit.get("annotations") or {})}}
                        break
        if hit is None:
            have = ", ".join(str(d.get("digest")) for d in top) or "nothing"
            raise OCIError(f"{path} does not hold {digest} (it holds {have})")
        name = _blob_name(digest)
        if not src.exists(name):
            raise OCIError(f"{path}: index.json lists {digest} but its blob is missing")
        actual = src.digest(name)
        if actual != digest:
            raise OCIError(f"{path}: blob {digest} is corrupt: its bytes hash to {actual}")
        body = _json(src, name)
        media = str(hit.get("mediaType") or body.get("mediaType") or "")
        ann = dict(hit.get("annotations") or {})
        ref = ann.get("org.opencontainers.image.ref.name")
        if media in INDEX_TYPES:
            plats = tuple(
                f"{(m.get('platform') or {}).get('os', '?')}/{(m.get('platform') or {}).get('architecture', '?')}"
                for m in body.get("manifests") or []
            )
            return PinnedImage(path, digest, media, ref, None, plats, (), ann, top_level)
        cfg = (body.get("config") or {}).get("digest")
        if not cfg or not src.exists(_blob_name(cfg)):
            raise OCIError(f"{path}: manifest {digest} names config {cfg}, which is missing")
        if src.digest(_blob_name(cfg)) != cfg:
            raise OCIError(f"{path}: config blob {cfg} is corrupt")
        config = _json(src, _blob_name(cfg))
        layers = tuple(str(x.get("digest")) for x in body.get("layers") or [])
        missing = [d for d in layers if not src.exists(_blob_name(d))]
        if missing:
            raise OCIError(f"{path}: manifest {digest} names layer {missing[0]}, which is missing")
        plat = f"{config.get('os', '?')}/{config.get('architecture', '?')}"
        return PinnedImage(path, digest, media, ref, cfg, (plat,), layers, ann, top_level)
    finally:
        src.close()


@dataclass(frozen=True)
class ImageInfo:
    """The single image of an archive mopt wrote: digests, config and labels."""

    digest: str  # manifest digest: what a registry reports, what `@sha256:` pins
    image_id: str  # config digest: what `docker images` / `buildah images` show as ID
    media_type: str
    config: dict[str, Any]
    layers: tuple[str, ...]
    ref_name: str | None

    @property
    def labels(self) -> dict[str, str]:
        return dict((self.config.get("config") or {}).get("Labels") or {})


def read_image(path: Path) -> ImageInfo:
    """The image of a one-image OCI archive or layout."""
    images = list_images(path)
    if len(images) != 1:
        raise OCIError(f"{path} holds {len(images)} images, expected one")
    d = images[0]
    pinned = find_pinned(path, d["digest"])
    if pinned.config_digest is None:
        raise OCIError(f"{path}: {d['digest']} is an index, expected one image manifest")
    src = _Source(path)
    try:
        config = _json(src, _blob_name(pinned.config_digest))
    finally:
        src.close()
    return ImageInfo(pinned.digest, pinned.config_digest, pinned.media_type, config, pinned.layers, pinned.ref_name)


# --------------------------------------------------------------------------- normalising


def _write_blob(layout: Path, data: bytes) -> str:
    digest = sha256_bytes(data)
    p = layout / _blob_name(digest)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(data)
    return digest


def _drop(config: dict[str, Any], dotted: str) -> bool:
    *parents, last = dotted.split(".")
    node: Any = config
    for part in parents:
        node = node.get(part) if isinstance(node, dict) else None
    if isinstance(node, dict) and node.get(last):
        if parents:
            node[last] = ""  # keep the key: docker's config struct always has it
        else:
            del node[last]
        return True
    return False


@dataclass(frozen=True)
class Normalized:
    digest: str
    image_id: str
    media_type: str
    layers: tuple[str, ...]
    dropped: tuple[str, ...]  # volatile config fields that were cleared


def normalize_layout(layout: Path, *, ref_name: str, full_name: str) -> Normalized:
    """Make the one image of `layout` independent of the build run: clear the volatile config
    fields (the build container's id and hostname, which buildah's docker format records),
    rewrite the manifest to point at the new config, and write a fresh index.json naming the
    image. Layers are untouched; blobs no longer referenced are removed."""
    index = json.loads((layout / "index.json").read_text())
    manifests = index.get("manifests") or []
    if len(manifests) != 1:
        raise OCIError(f"{layout}: expected one image, found {len(manifests)}")
    mdesc = manifests[0]
    manifest = json.loads((layout / _blob_name(mdesc["digest"])).read_bytes())
    media = mdesc.get("mediaType") or manifest.get("mediaType") or OCI_MANIFEST
    if media not in MANIFEST_TYPES:
        raise OCIError(f"{layout}: expected an image manifest, found {media}")
    cfg_digest = manifest["config"]["digest"]
    config = json.loads((layout / _blob_name(cfg_digest)).read_bytes())
    dropped = tuple(f for f in VOLATILE_CONFIG_FIELDS if _drop(config, f))
    old = {mdesc["digest"], cfg_digest}
    if dropped:
        raw = canonical(config)
        new_cfg = _write_blob(layout, raw)
        manifest["config"] = {**manifest["config"], "digest": new_cfg, "size": len(raw)}
        cfg_digest = new_cfg
    mraw = canonical(manifest)
    mdigest = _write_blob(layout, mraw)
    new_index = {
        "schemaVersion": 2,
        "mediaType": OCI_INDEX,
        "manifests": [
            {
                "mediaType": media,
                "digest": mdigest,
                "size": len(mraw),
                "annotations": {
                    "io.containerd.image.name": full_name,
                    "org.opencontainers.image.ref.name": ref_name,
                },
            }
        ],
    }
    (layout / "index.json").write_bytes(canonical(new_index))
    (layout / "oci-layout").write_bytes(canonical({"imageLayoutVersion": "1.0.0"}))
    keep = {mdigest, cfg_digest, *(x["digest"] for x in manifest.get("layers") or [])}
    for d in old - keep:
        (layout / _blob_name(d)).unlink(missing_ok=True)
    layers = tuple(x["digest"] for x in manifest.get("layers") or [])
    return Normalized(mdigest, cfg_digest, media, layers, dropped)


# --------------------------------------------------------------------------- writing


def _tarinfo(name: str, *, size: int = 0, directory: bool = False) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.mtime = 0
    ti.uid = ti.gid = 0
    ti.uname = ti.gname = ""
    if directory:
        ti.type = tarfile.DIRTYPE
        ti.mode = 0o755
    else:
        ti.mode = 0o644
        ti.size = size
    return ti


def write_archive(layout: Path, dest: Path, *, repo_tag: str | None = None) -> None:
    """Tar the layout into `dest`, byte-for-byte reproducibly (sorted names, zero times and
    owners, fixed modes), with a docker-style manifest.json so `docker load` reads it too."""
    index = json.loads((layout / "index.json").read_bytes())
    docker_manifest: list[dict[str, Any]] = []
    for d in index.get("manifests") or []:
        if d.get("mediaType") not in MANIFEST_TYPES:
            continue
        m = json.loads((layout / _blob_name(d["digest"])).read_bytes())
        docker_manifest.append(
            {
                "Config": _blob_name(m["config"]["digest"]),
                "RepoTags": [repo_tag] if repo_tag else [],
                "Layers": [_blob_name(x["digest"]) for x in m.get("layers") or []],
            }
        )
    extra = {"manifest.json": canonical(docker_manifest)} if docker_manifest else {}
    blobs = sorted(p.name for p in (layout / "blobs" / "sha256").iterdir())
    tmp = dest.with_name(dest.name + ".part")
    with open(tmp, "wb") as raw, tarfile.open(fileobj=raw, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        tar.addfile(_tarinfo("blobs", directory=True))
        tar.addfile(_tarinfo("blobs/sha256", directory=True))
        for name in blobs:
            p = layout / "blobs" / "sha256" / name
            with open(p, "rb") as f:
                tar.addfile(_tarinfo(f"blobs/sha256/{name}", size=p.stat().st_size), f)
        for name in ("index.json", "manifest.json", "oci-layout"):
            data = extra[name] if name in extra else (layout / name).read_bytes() if (layout / name).exists() else None
            if data is not None:
                tar.addfile(_tarinfo(name, size=len(data)), io.BytesIO(data))
    os.replace(tmp, dest)


def gzip_deterministic(src: IO[bytes], dst: IO[bytes], level: int = 6) -> None:
    """gzip with no file name and a zero time in the header: same bytes in, same bytes out."""
    with gzip.GzipFile(filename="", mode="wb", fileobj=dst, mtime=0, compresslevel=level) as gz:
        shutil.copyfileobj(src, gz, 1 << 20)


def docker_archive_to_layout(archive: Path, layout: Path, *, compress: bool, oci: bool) -> None:
    """Turn `docker save` output (manifest.json + config + layer tars; Docker 25+ adds an OCI
    index too) into an OCI layout of one image, compressing layers deterministically."""
    (layout / "blobs" / "sha256").mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive, "r:*") as tar:
        def member(name: str) -> IO[bytes]:
            f = tar.extractfile(name)
            if f is None:
                raise OCIError(f"{archive}: has no file {name}")
            return f

        entries = json.loads(member("manifest.json").read())
        if len(entries) != 1:
            raise OCIError(f"{archive}: expected one image in manifest.json, found {len(entries)}")
        entry = entries[0]
        cfg = member(entry["Config"]).read()
        cfg_digest = _write_blob(layout, cfg)
        layers = []
        for name in entry["Layers"]:
            tmp = layout / "blobs" / ".layer.part"
            with member(name) as f:
                head = f.read(2)
            with member(name) as f, open(tmp, "wb") as out:
                if head == b"\x1f\x8b" or not compress:
                    shutil.copyfileobj(f, out, 1 << 20)
                else:
                    gzip_deterministic(f, out)
            gz = head == b"\x1f\x8b" or compress
            d = sha256_file(tmp)
            os.replace(tmp, layout / _blob_name(d))
            if oci:
                media = OCI_LAYER_GZIP if gz else OCI_LAYER
            else:
                media = DOCKER_LAYER_GZIP if gz else DOCKER_LAYER
            layers.append({"mediaType": media, "digest": d, "size": (layout / _blob_name(d)).stat().st_size})
    manifest = {
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST if oci else DOCKER_MANIFEST,
        "config": {"mediaType": OCI_CONFIG if oci else DOCKER_CONFIG, "digest": cfg_digest, "size": len(cfg)},
        "layers": layers,
    }
    mraw = canonical(manifest)
    md = _write_blob(layout, mraw)
    index = {"schemaVersion": 2, "manifests": [{"mediaType": manifest["mediaType"], "digest": md, "size": len(mraw)}]}
    (layout / "index.json").write_bytes(canonical(index))
    (layout / "oci-layout").write_bytes(canonical({"imageLayoutVersion": "1.0.0"}))


def layout_to_docker_archive(src: Path, digest: str, dest: Path, *, repo_tag: str | None) -> str:
    """A `docker load`-able tar of image `digest` of an OCI archive/layout (docker before 25
    reads only manifest.json); returns the image id (config digest) docker will give it."""
    pinned = find_pinned(src, digest)
    if pinned.config_digest is None:
        raise OCIError(f"{src}: {digest} is a multi-platform index; pin one platform's manifest for docker")
    s = _Source(src)
    try:
        names = [_blob_name(pinned.config_digest), *(_blob_name(d) for d in pinned.layers)]
        manifest = [{"Config": names[0], "RepoTags": [repo_tag] if repo_tag else [], "Layers": names[1:]}]
        with tarfile.open(dest, "w", format=tarfile.USTAR_FORMAT) as tar:
            tar.addfile(_tarinfo("blobs", directory=True))
            tar.addfile(_tarinfo("blobs/sha256", directory=True))
            for name in sorted(set(names)):
                with s.open(name) as f:
                    tar.addfile(_tarinfo(name, size=s.size(name)), f)
            raw = canonical(manifest)
            tar.addfile(_tarinfo("manifest.json", size=len(raw)), io.BytesIO(raw))
    finally:
        s.close()
    return pinned.config_digest


# --------------------------------------------------------------------------- one-layer images


@dataclass(frozen=True)
class Written:
    digest: str  # manifest digest: pin it as "oci-archive:FILE@<digest>"
    image_id: str  # config digest
    layer: str  # compressed layer digest
    diff_id: str  # uncompressed layer digest
    size: int  # archive bytes


def write_single_layer_archive(
    layer_tar: Path, dest: Path, *, config: dict[str, Any], ref_name: str, repo_tag: str | None,
    created_by: str, created: str = "1970-01-01T00:00:00Z",
) -> Written:
    """An OCI archive of a one-layer image whose layer is the tar file `layer_tar` (gzipped
    deterministically), with `config` (Env, Cmd, Labels, ...) as its run config. Same tar and
    config in, same bytes out: the image digest is a function of the file system alone."""

    layout = dest.with_name(dest.name + ".layout")
    if layout.exists():
        shutil.rmtree(layout)
    (layout / "blobs" / "sha256").mkdir(parents=True)
    part = layout / "blobs" / ".layer.part"
    h = hashlib.sha256()

    class _Hashing(io.RawIOBase):
        """Hash the uncompressed bytes on their way into gzip (one pass over the tar)."""

        def __init__(self, f: IO[bytes]) -> None:
            self.f = f

        def readable(self) -> bool:
            return True

        def readinto(self, b: Any) -> int:
            data = self.f.read(len(b))
            h.update(data)
            b[: len(data)] = data
            return len(data)

    with open(layer_tar, "rb") as src, open(part, "wb") as out:
        gzip_deterministic(io.BufferedReader(_Hashing(src), 1 << 20), out)
    diff_id = "sha256:" + h.hexdigest()
    layer = sha256_file(part)
    os.replace(part, layout / _blob_name(layer))
    full = {
        "created": created,
        "architecture": host_arch(),
        "os": "linux",
        "config": config,
        "rootfs": {"type": "layers", "diff_ids": [diff_id]},
        "history": [{"created": created, "created_by": created_by}],
    }
    cfg = canonical(full)
    cfg_digest = _write_blob(layout, cfg)
    manifest = {
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "config": {"mediaType": OCI_CONFIG, "digest": cfg_digest, "size": len(cfg)},
        "layers": [{"mediaType": OCI_LAYER_GZIP, "digest": layer, "size": (layout / _blob_name(layer)).stat().st_size}],
    }
    man = canonical(manifest)
    digest = _write_blob(layout, man)
    index = {
        "schemaVersion": 2,
        "manifests": [{"mediaType": OCI_MANIFEST, "digest": digest, "size": len(man),
                       "annotations": {"org.opencontainers.image.ref.name": ref_name}}],
    }
    (layout / "index.json").write_bytes(canonical(index))
    (layout / "oci-layout").write_bytes(canonical({"imageLayoutVersion": "1.0.0"}))
    write_archive(layout, dest, repo_tag=repo_tag)
    shutil.rmtree(layout)
    return Written(digest, cfg_digest, layer, diff_id, dest.stat().st_size)
