"""What `ImageKind.run` does: context → builder → normalised, reproducible archive → smoke test."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mopt
from mopt.api import BuildContext
from mopt_image import oci
from mopt_image.baseref import LOCAL_BASE_NAME, BaseRef, parse_base, qualify
from mopt_image.builders import BuilderError, BuildRequest, rmtree, select
from mopt_image.context import assemble
from mopt_image.oci import ARCHIVE, LABEL_PREFIX, host_arch
from mopt_image.templates import (
    EMBED_SERVER,
    Inputs,
    TemplateError,
    choose_backend,
    make_spec,
    render_dockerfile,
)

#: what the embed server needs, pinned (with --no-deps: this list is the whole closure; the
#: transitive deps that the server never imports, e.g. tokenizers' huggingface_hub, stay out)
EMBED_PACKAGES = [
    "fastapi==0.165.0", "annotated-doc==0.0.7", "starlette==1.10.0", "pydantic==2.14.4", "pydantic-core==2.50.5",
    "typing-extensions==4.16.0", "typing-inspection==0.4.5", "annotated-types==0.8.0", "anyio==4.16.0",
    "idna==3.20", "uvicorn==0.54.0", "click==8.5.1", "h11==0.16.0", "onnxruntime==1.32.0", "numpy==2.4.6",
    "protobuf==7.36.2", "flatbuffers==25.12.19", "packaging==26.4", "tokenizers==0.23.3",
    "prometheus-client==0.26.0", "opentelemetry-api==1.45.2",  # fastapi imports its telemetry hooks
]


def _one(ctx: BuildContext, slot: str) -> Any:
    arts = ctx.inputs.get(slot) or []
    return arts[0] if arts else None


def provenance_labels(ctx: BuildContext, p: Any, base_ref: str, base_digest: str, backend: str,
                      plugin_version: str) -> dict[str, str]:
    """OCI and mopt labels: where the image comes from, down to its inputs' digests."""
    section = p.section or ctx.section
    labels = {
        "org.opencontainers.image.title": f"{section}:{ctx.target}",
        "org.opencontainers.image.base.name": base_ref,
        "org.opencontainers.image.base.digest": base_digest,
        f"{LABEL_PREFIX}section": section,
        f"{LABEL_PREFIX}model": p.model_name or ctx.model_name,
        f"{LABEL_PREFIX}target": ctx.target,
        f"{LABEL_PREFIX}backend": backend,
        f"{LABEL_PREFIX}mopt.version": mopt.__version__,
        f"{LABEL_PREFIX}mopt-image.version": plugin_version,
    }
    for _slot, arts in sorted(ctx.inputs.items()):
        for a in arts:
            labels[f"{LABEL_PREFIX}input.{a.target}"] = f"{a.kind} blake3:{a.digest}"
    labels.update(p.labels)
    return labels


def resolve_base(ctx: BuildContext) -> tuple[BaseRef, dict[str, Any] | None]:
    """The pinned base: the params' or a `base-image` input's (with its base.json)."""
    p = ctx.params
    art = _one(ctx, "base")
    if art is None:
        return parse_base(p.base, p.base_archive, p.base_digest), None
    if p.base is not None or p.base_archive is not None:
        raise TemplateError(
            f"the image has both a base ({p.base or p.base_archive!r}) and the base-image input "
            f"{art.target!r}: keep one"
        )
    info = json.loads((art.path / "base.json").read_text())
    archive = art.path / info["archive"]
    return BaseRef(LOCAL_BASE_NAME, info["image_digest"], str(archive), f"{art.target} ({archive.name})"), info


def install_packages(ctx: BuildContext, packages: list[str], python: str, dest: Path) -> list[str]:
    """pip-install wheels for the image's Python and glibc into `dest` on the host (the image
    needs no pip and no network); returns `name==version` of what got installed."""
    import os
    import re
    import subprocess
    import sys


    arch = {"amd64": "x86_64", "arm64": "aarch64"}.get(host_arch(), host_arch())
    nodot = python.replace(".", "")
    argv = [sys.executable, "-m", "pip", "install", "--no-deps", "--only-binary=:all:", "--no-compile",
            "--disable-pip-version-check", "--progress-bar", "off", "--no-warn-script-location",
            "--target", str(dest), "--python-version", python, "--implementation", "cp",
            "--abi", f"cp{nodot}", "--abi", "abi3", "--abi", "none"]
    for plat in ctx.params.wheel_platforms:
        argv += ["--platform", f"{plat}_{arch}"]
    if ctx.offline:
        argv.append("--no-index")  # wheels only from the configured find-links / cache
    argv += packages
    # the host's constraints file pins the host's packages; the image's pins are this list
    env = {**os.environ, "PIP_CONSTRAINT": "", "PYTHONDONTWRITEBYTECODE": "1"}
    ctx.log("$ pip install --target site " + " ".join(packages))
    r = subprocess.run(argv, capture_output=True, text=True, env=env, check=False)
    if r.returncode != 0:
        tail = "\n".join((r.stdout + r.stderr).splitlines()[-12:])
        raise RuntimeError(f"pip could not install the image's Python packages (exit {r.returncode}):\n{tail}")
    # console scripts carry the host interpreter's path in their #! line: the image runs
    # `python3 -m` / the server file instead, and RECORD must not depend on this machine
    rmtree(dest / "bin")
    got = []
    for rec in sorted(dest.glob("*.dist-info/RECORD")):
        lines = rec.read_text().splitlines()
        rec.write_text("".join(ln + "\n" for ln in lines if not re.match(r"(\.\./)+bin/", ln)))
        name, _, version = rec.parent.name.removesuffix(".dist-info").rpartition("-")
        got.append(f"{name}=={version}")
    if f"{sys.version_info.major}.{sys.version_info.minor}" == python:
        # hash-checked .pyc (no mtimes, the image's paths): the server starts faster, also after a kill
        subprocess.run([sys.executable, "-m", "compileall", "-q", "-j", "0", "--invalidation-mode", "checked-hash",
                        "-d", "/opt/mopt/site", str(dest)], capture_output=True, check=False)
    return got


def build_image(ctx: BuildContext, *, plugin_version: str) -> dict[str, Any]:
    p = ctx.params
    model = p.model_name or ctx.model_name
    base, base_info = resolve_base(ctx)
    archive_path = base.archive_path(ctx.project_dir)
    pinned = None
    if archive_path is not None:
        pinned = oci.find_pinned(archive_path, base.digest)  # checked: never re-downloaded
        ctx.log(f"base {base.digest} found in {archive_path} ({pinned.media_type}, {', '.join(pinned.platforms)})")

    inputs = Inputs(serve=_one(ctx, "serve"), model=_one(ctx, "model"), files=list(ctx.inputs.get("files") or []))
    backend = choose_backend(p.backend, inputs)
    server = site = None
    packages = p.python_packages if p.python_packages is not None else (EMBED_PACKAGES if backend == "embed" else [])
    installed: list[str] = []
    if packages:
        python = p.python_version or (base_info or {}).get("python")
        if not python:
            raise TemplateError(
                "python_packages: the base's Python version is unknown; set python_version = \"3.11\" "
                "(or use a base-image input, which records it)"
            )
        site = ctx.tmp / "site"
        installed = install_packages(ctx, list(packages), python, site)
        ctx.log(f"{len(installed)} Python packages for Python {python}: {' '.join(installed)}")
    if backend == "embed":
        server = ctx.tmp / "server"
        server.mkdir()
        src = Path(__file__).with_name("servers") / EMBED_SERVER
        (server / EMBED_SERVER).write_bytes(src.read_bytes())
    spec = make_spec(backend, inputs, p, model, server=server, site=site)
    labels = provenance_labels(ctx, p, base.ref, base.digest, backend, plugin_version)
    health = (
        f"--interval={p.health_interval} --timeout={p.health_timeout} "
        f"--start-period={p.health_start_period} --retries={p.health_retries}"
    )
    header = (
        f"Generated by mopt-image {plugin_version} (backend {backend}) for {p.section or ctx.section}:{ctx.target}.\n"
        "Do not edit: change the recipe and rebuild."
    )
    dockerfile = render_dockerfile(spec, base_ref=base.ref, labels=labels, health_options=health, header=header)
    context = assemble(ctx.tmp / "context", spec, dockerfile)
    ctx.log(f"build context {context.digest[:16]}: {len(context.entries)} files")
    (ctx.out / "Dockerfile").write_text(dockerfile, encoding="utf-8")
    _write_json(ctx.out / "context.json", context.manifest())

    tag = p.tag or f"mopt/{model}:latest"
    repo, _, tag_part = tag.rpartition(":") if ":" in tag.rsplit("/", 1)[-1] else (tag, "", "latest")
    builder_cls = select(p.builder)
    req = BuildRequest(
        context=context.path,
        base=base,
        base_image=pinned,
        format=p.format,
        compress=p.compress,
        offline=ctx.offline,
        work=ctx.tmp / f"{builder_cls.name}-work",
        layout=ctx.tmp / "layout",
        log=ctx.log,
        storage_driver=p.storage_driver,
        ref_name=tag_part,
    )
    builder = builder_cls(req)
    smoke: dict[str, Any] | None = None
    try:
        out = builder.build(req)
        rmtree(context.path)  # a copy of the model: free the disk before the archive is written
        norm = oci.normalize_layout(req.layout, ref_name=tag_part, full_name=f"{qualify(repo)}:{tag_part}")
        if norm.dropped:
            ctx.log(f"cleared volatile config fields {', '.join(norm.dropped)}")
        oci.write_archive(req.layout, ctx.out / ARCHIVE, repo_tag=f"{repo}:{tag_part}")
        rmtree(req.layout)
        ctx.log(f"image {norm.digest} (id {norm.image_id[:19]}) → {ARCHIVE}")
        if p.smoke_test:
            argv = list(p.smoke_command) if p.smoke_command else ["sh", "-c", spec.smoke_script()]
            try:
                builder.smoke(req, out, argv)
            except BuilderError as exc:
                why = None if p.smoke_command else spec.smoke_reason(exc.returncode)
                if why is None:
                    raise
                raise BuilderError(f"the smoke test failed inside the image: {why}\n{exc}", exc.returncode) from None
            smoke = {"command": argv, "passed": True, "runner": f"{out.builder} run"}
    finally:
        builder.close()

    image = oci.read_image(ctx.out / ARCHIVE)
    info: dict[str, Any] = {
        "archive": ARCHIVE,
        "image_digest": image.digest,
        "image_id": image.image_id,
        "media_type": image.media_type,
        "layers": list(image.layers),
        "tag": f"{repo}:{tag_part}",
        "base": {
            "ref": base.ref,
            "digest": base.digest,
            "archive": base.archive,
        },
        "backend": backend,
        "entrypoint": spec.entrypoint,
        "ports": spec.ports,
        "healthcheck": spec.health,
        "labels": image.labels,
        "builder": {"name": out.builder, "version": out.version, "format": p.format,
                    "storage_driver": p.storage_driver if out.builder == "buildah" else None},
        "reproducible": out.reproducible,
        "normalized_fields": list(norm.dropped),
        "context_digest": context.digest,
        "python_packages": installed,
        "base_packages": (base_info or {}).get("packages"),
        "smoke_test": smoke,
        "notes": spec.notes + out.notes,
    }
    _write_json(ctx.out / "image.json", info)
    return info


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")
