"""`mopt image load|push RECIPE TARGET`: hand a built image to a runtime or a registry.

The plugin's `mopt_register_commands(cli, core)` calls `register(cli, core)`, which adds an
`image` group to the `mopt` click group. The archive used is the one the store holds for
TARGET's current action key (`core.built_target`: a stale or missing build is an error, not
a silent fallback).

load: `docker` (the SDK; the archive carries a docker `manifest.json`), `podman load`, or
      `buildah pull` into the user's containers-storage.
push: `skopeo copy` (blobs as they are: the registry reports the same digest as image.json),
      else `buildah push` (recompresses; the digest is re-checked and a difference reported).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import click

from mopt.api import BuildFailed, Core, MoptError
from mopt_image.oci import ARCHIVE


def built_image(core: Core, recipe: Path, target: str) -> tuple[str, Path, dict[str, Any]]:
    """(node id, archive path in the store, image.json) of the built image TARGET."""
    built = core.built_target(recipe, target, kind="image")
    if ARCHIVE not in built.files or "image.json" not in built.files:
        raise MoptError(f"{built.node_id}'s output has no {ARCHIVE}", hint="rebuild it")
    meta = json.loads(built.files["image.json"].read_text())
    return built.node_id, built.files[ARCHIVE], meta


def _run(argv: list[str]) -> str:
    click.echo("$ " + " ".join(argv), err=True)
    p = subprocess.run(argv, capture_output=True, text=True)
    if p.returncode != 0:
        tail = "\n".join((p.stderr or p.stdout).strip().splitlines()[-10:])
        click.echo(tail, err=True)
        raise BuildFailed(f"{argv[0]} exited with {p.returncode}")
    return p.stdout


def load_image(archive: Path, meta: dict[str, Any], to: str) -> str:
    """Load the archive into `to` (auto: docker, else podman, else buildah); what it is called there."""
    tag = meta.get("tag")
    choices = [to] if to != "auto" else ["docker", "podman", "buildah"]
    reasons = []
    for runtime in choices:
        if runtime == "docker":
            from mopt_image.builders import docker_daemon

            version, why = docker_daemon()
            if version is None:
                reasons.append(f"docker: {why}")
                continue
            import docker  # type: ignore[import-not-found]

            client = docker.from_env(timeout=600)
            with open(archive, "rb") as f:
                images = client.images.load(f)
            ids = [i.id for i in images]
            if meta["image_id"] not in ids:
                raise BuildFailed(f"docker loaded {ids}, expected {meta['image_id']}")
            return f"docker: {tag} ({meta['image_id'][:19]})"
        exe = shutil.which(runtime)
        if exe is None:
            reasons.append(f"{runtime}: not installed")
            continue
        if runtime == "podman":
            _run([exe, "load", "-i", str(archive)])
            return f"podman: {tag}"
        out = _run([exe, "pull", "--quiet", f"oci-archive:{archive}"])
        image_id = out.strip().splitlines()[-1] if out.strip() else ""
        if tag:
            _run([exe, "tag", image_id, tag])
        return f"buildah: {tag or image_id}"
    raise MoptError("nowhere to load the image: " + "; ".join(reasons),
                    hint="start a docker daemon, or install podman or buildah")


def push_image(archive: Path, meta: dict[str, Any], dest: str) -> str:
    """Copy the archive to `dest` (docker://registry/repo:tag or any containers transport)."""
    if "://" not in dest and not dest.startswith(("oci:", "oci-archive:", "docker-archive:", "dir:")):
        dest = f"docker://{dest}"
    skopeo = shutil.which("skopeo")
    with tempfile.TemporaryDirectory(prefix="mopt-image-push-") as tmp:
        digest_file = Path(tmp) / "digest"
        if skopeo:
            _run([skopeo, "copy", "--digestfile", str(digest_file), f"oci-archive:{archive}", dest])
        elif shutil.which("buildah"):
            b = ["buildah", "--root", f"{tmp}/root", "--runroot", f"{tmp}/runroot", "--storage-driver", "vfs"]
            image_id = _run([*b, "pull", "--quiet", f"oci-archive:{archive}"]).strip().splitlines()[-1]
            fmt = "v2s2" if "docker" in str(meta.get("media_type")) else "oci"
            _run([*b, "push", "--format", fmt, "--digestfile", str(digest_file), image_id, dest])
        else:
            raise MoptError("pushing needs skopeo or buildah", hint="apt-get install skopeo")
        pushed = digest_file.read_text().strip() if digest_file.exists() else "?"
    if pushed != meta["image_digest"]:
        click.echo(
            f"note: the registry's digest {pushed} differs from the built {meta['image_digest']} "
            "(layers were recompressed on the way; skopeo copies them as they are)",
            err=True,
        )
    return pushed


def register(app: click.Group, core: Core) -> None:
    """Add `mopt image load|push|path` to the `mopt` command line."""

    @app.group("image", context_settings={"help_option_names": ["-h", "--help"]})
    def image() -> None:
        """Hand built images (kind `image`) to a container runtime or a registry."""

    @image.command("load")
    @click.argument("recipe", type=click.Path(path_type=Path))
    @click.argument("target")
    @click.option("--to", type=click.Choice(["auto", "docker", "podman", "buildah"]), default="auto",
                  show_default=True, help="where to load it")
    def load(recipe: Path, target: str, to: str) -> None:
        """Load TARGET's image into a local docker daemon, podman or buildah storage."""
        node_id, archive, meta = built_image(core, recipe, target)
        where = load_image(archive, meta, to)
        click.echo(f"{node_id}: {meta['image_digest']} loaded into {where}")

    @image.command("push")
    @click.argument("recipe", type=click.Path(path_type=Path))
    @click.argument("target")
    @click.argument("dest")
    def push(recipe: Path, target: str, dest: str) -> None:
        """Push TARGET's image to DEST (registry/repo:tag, or docker://..., oci:..., ...)."""
        node_id, archive, meta = built_image(core, recipe, target)
        digest = push_image(archive, meta, dest)
        click.echo(f"{node_id}: pushed {dest} @ {digest}")

    @image.command("path")
    @click.argument("recipe", type=click.Path(path_type=Path))
    @click.argument("target")
    def path(recipe: Path, target: str) -> None:
        """Print the path of TARGET's OCI archive in the store (for skopeo, crane, ...)."""
        _node_id, archive, _meta = built_image(core, recipe, target)
        click.echo(str(archive))
