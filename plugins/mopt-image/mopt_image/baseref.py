"""Base image references: always pinned by digest, from a registry or a local OCI archive.

Accepted forms (the digest is the *manifest* digest, what `@sha256:` pins in a registry):

    base = "vllm/vllm-openai@sha256:<64 hex>"                # from a registry
    base = "oci-archive:bases/vllm.tar@sha256:<64 hex>"      # a local OCI archive
    base = "oci:bases/vllm-layout@sha256:<64 hex>"           # a local OCI layout folder
    base = "vllm/vllm-openai@sha256:<64 hex>", base_archive = "bases/vllm.tar"
                                                             # that image, taken from the archive
    base_archive = "bases/x.tar", base_digest = "sha256:<64 hex>"

A local base is a fixed-output input: its digest is checked, it is never downloaded, and its
file's content digest is part of the action key. Paths are relative to the project folder.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
_COMPONENT = re.compile(r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*")
_HOST = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?(?::[0-9]+)?")
_TAG = re.compile(r"[\w][\w.-]{0,127}")
#: the repository name an archive base without one is known by inside the build
LOCAL_BASE_NAME = "localhost/mopt-base"
EXAMPLE = 'base = "vllm/vllm-openai@sha256:<64 hex digits>"'


class BaseRefError(ValueError):
    """A base image reference that mopt refuses (the message says why and what to write)."""


@dataclass(frozen=True)
class BaseRef:
    """A base image pinned by digest, optionally with the local archive that holds it."""

    name: str  # fully qualified repository: docker.io/vllm/vllm-openai
    digest: str  # sha256:<hex> of its manifest (or of a multi-platform index)
    archive: str | None = None  # OCI archive (file) or layout (folder), as written in the recipe
    given: str = ""  # what the recipe said, for messages

    @property
    def ref(self) -> str:
        """`name@digest`: what the Dockerfile's FROM says."""
        return f"{self.name}@{self.digest}"

    def archive_path(self, project_dir: Path) -> Path | None:
        if self.archive is None:
            return None
        p = Path(self.archive).expanduser()
        return p if p.is_absolute() else (project_dir / p)


def qualify(name: str) -> str:
    """Docker's normalisation: `vllm/vllm-openai` → `docker.io/vllm/vllm-openai`, `ubuntu` →
    `docker.io/library/ubuntu` (so no short-name lookup ever decides which image is used)."""
    first, sep, _rest = name.partition("/")
    if not sep:
        return f"docker.io/library/{name}"
    if "." in first or ":" in first or first == "localhost":
        return name
    return f"docker.io/{name}"


def _check_repository(name: str, given: str) -> str:
    full = qualify(name)
    host, _, path = full.partition("/")
    if not _HOST.fullmatch(host) or not path or not all(_COMPONENT.fullmatch(c) for c in path.split("/")):
        raise BaseRefError(
            f"base {given!r}: {name!r} is not a valid image repository name "
            "(lowercase letters, digits, '.', '_', '-', separated by '/')"
        )
    return full


def _strip_tag(name: str) -> tuple[str, str | None]:
    head, slash, last = name.rpartition("/")
    if ":" in last:
        last, tag = last.split(":", 1)
        return f"{head}{slash}{last}", tag
    return name, None


def _check_digest(d: str, given: str) -> str:
    if not DIGEST.fullmatch(d):
        raise BaseRefError(f"base {given!r}: {d!r} is not a digest (write sha256: and 64 lowercase hex digits)")
    return d


def parse_base(base: str | None, base_archive: str | None = None, base_digest: str | None = None) -> BaseRef:
    """The pinned base these params describe, or BaseRefError saying what is wrong."""
    if base_digest is not None:
        _check_digest(base_digest, base_digest)
    if base is None:
        if base_archive is None:
            raise BaseRefError(
                f"no base image: set {EXAMPLE} (pinned by digest), or base_archive + base_digest "
                "for a local OCI archive, or add a `base-image` target to the section"
            )
        if base_digest is None:
            raise BaseRefError(
                f"base_archive {base_archive!r} needs base_digest = \"sha256:...\" (its manifest digest: "
                "the one `skopeo inspect oci-archive:FILE` or index.json lists)"
            )
        return BaseRef(LOCAL_BASE_NAME, base_digest, base_archive, f"{base_archive}@{base_digest}")
    given = base.strip()
    for transport in ("oci-archive:", "oci:"):
        if given.startswith(transport):
            if base_archive is not None:
                raise BaseRefError(f"base {given!r} already names an archive; drop base_archive")
            path, at, digest = given[len(transport) :].rpartition("@")
            if not at or not path:
                raise BaseRefError(
                    f"base {given!r}: a local base must be pinned by digest: "
                    f'"{transport}PATH@sha256:<manifest digest>"'
                )
            _check_digest(digest, given)
            if base_digest is not None and base_digest != digest:
                raise BaseRefError(f"base {given!r} and base_digest {base_digest!r} disagree")
            return BaseRef(LOCAL_BASE_NAME, digest, path, given)
    ref = given.removeprefix("docker://")
    name, at, digest = ref.partition("@")
    if not at:
        _n, tag = _strip_tag(name)
        raise BaseRefError(
            f"base {given!r} is not pinned by digest"
            + (f" (the tag {tag!r} can move)" if tag else "")
            + f": write {name.split(':')[0] if tag else name}@sha256:<digest> "
            "(`skopeo inspect docker://IMAGE:TAG` or `docker buildx imagetools inspect` prints it)"
        )
    _check_digest(digest, given)
    if base_digest is not None and base_digest != digest:
        raise BaseRefError(f"base {given!r} and base_digest {base_digest!r} disagree")
    name, _tag = _strip_tag(name)  # name:tag@digest: the digest decides; the tag is decoration
    return BaseRef(_check_repository(name, given), digest, base_archive, given)
