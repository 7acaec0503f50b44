"""The `image` target kind: a reproducible OCI image of the serving stack."""

from __future__ import annotations

import importlib.metadata as md
import re
import shutil
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

import mopt
from mopt.api import BuildContext, CheckContext, Finding, HardwareProfile, Input, Params, TargetKind
from mopt_image.baseref import BaseRefError, parse_base, qualify
from mopt_image.oci import LABEL_PREFIX, host_arch

PLUGIN_VERSION = "0.1.0"
_DURATION = re.compile(r"[0-9]+(ms|s|m|h)")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_REPO = re.compile(r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*")
_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
_PINNED_REQ = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(\[[A-Za-z0-9,._-]+\])?==[A-Za-z0-9.+!_-]+")
def _slug(s: str) -> str:
    return re.sub(r"[^a-z0-9._-]+", "-", s.lower()).strip("-._") or "x"


class ImageKind(TargetKind):
    """A pinned, reproducible OCI image of the serving stack: a Dockerfile generated for the
    serving backend (vLLM, TensorRT-LLM, Triton, or plain), the artifacts it serves copied in,
    built by buildah (daemonless) or docker into `image.oci.tar` + `image.json`."""

    name = "image"
    # buildah / mmdebstrap / docker keep state in /etc/containers, /var/lib/containers and
    # the daemon: outside a bubblewrap sandbox (the input check still applies)
    sandbox = False
    version = "1"
    description = "reproducible OCI image of the serving stack (buildah or docker)"
    produces = "oci-image"
    consumes = (
        Input("serve", kinds=("vllm", "trtllm", "triton-repo"), required=False),
        # the same preference as the vllm / trtllm kinds, so both take the same model target
        # (`select`, a sweep's winner, only when named: `input = ["best"]`)
        Input("model", kinds=("modelopt-ptq", "weights", "onnx-slim", "onnx", "ort-quantize", "trt-engine", "select"),
              required=False),
        # a base image mopt built from Debian packages (instead of `base` + `base_archive`)
        Input("base", kinds=("base-image",), required=False),
        # any other artifact, only when named: input = ["my-command-target"]
        Input("files", kinds=("*",), required=False),
    )
    requires = ("tool:buildah",)
    reproducible = True

    class Params(Params):
        base: str | None = Field(
            default=None,
            description='base image pinned by digest: "vllm/vllm-openai@sha256:…", '
            '"oci-archive:FILE@sha256:…" or "oci:DIR@sha256:…" (a tag alone is refused)',
        )
        base_archive: str | None = Field(
            default=None, description="local OCI archive (file) or layout (folder) holding the base; never pulled"
        )
        base_digest: str | None = Field(default=None, description="manifest digest of base_archive's image")
        backend: Literal["auto", "vllm", "trtllm", "triton", "embed", "plain"] = Field(
            default="auto", description="Dockerfile template; auto: from the serving input's kind "
            "(embed: mopt's OpenAI-compatible ONNX embeddings server on CPU)"
        )
        python_packages: list[str] | None = Field(
            default=None,
            description="wheels pip installs on the host into the image's /opt/mopt/site, each pinned "
            "name==version (embed: a pinned default set)",
        )
        python_version: str | None = Field(
            default=None, description="the image's Python (X.Y) the wheels are for (default: the base-image's)"
        )
        wheel_platforms: list[str] = Field(
            default=["manylinux_2_28", "manylinux_2_17", "manylinux2014"],
            description="manylinux tags the image's glibc takes (the machine's architecture is added)",
        )
        builder: Literal["auto", "buildah", "docker"] = Field(
            default="auto", description="auto: buildah when installed, else a reachable docker daemon"
        )
        format: Literal["docker", "oci"] = Field(
            default="docker", description="image config format; OCI's has no HEALTHCHECK (buildah drops it)"
        )
        tag: str | None = Field(default=None, description="repo:tag recorded in the archive (default mopt/<model>:<hardware>)")
        model_dir: str = Field(default="/models/{model}", description="where the model folder goes in the image")
        config_dir: str = Field(default="/opt/mopt/serve", description="where the serving config goes")
        files_dir: str = Field(default="/opt/mopt/files", description="where extra inputs go, one folder each")
        bake_model: bool | None = Field(
            default=None, description="copy the model into the image (default: yes, except for triton)"
        )
        port: int | None = Field(
            default=None, ge=1, le=65533,
            description="serving port (default: the serving config's, else 8000; Triton: HTTP, +1 gRPC, +2 metrics)",
        )
        command: list[str] | None = Field(default=None, description="the serving command (replaces the backend's)")
        args: list[str] = Field(default=[], description="extra arguments appended to the serving command")
        env: dict[str, str] = Field(default={}, description="ENV of the image")
        labels: dict[str, str] = Field(default={}, description="extra labels")
        healthcheck: str | None = Field(
            default=None, description='shell command for HEALTHCHECK (default: the backend\'s; "" for none)'
        )
        health_interval: str = "30s"
        health_timeout: str = "10s"
        health_start_period: str = Field(default="10m", description="grace time for loading the model")
        health_retries: int = Field(default=3, ge=1)
        smoke_test: bool = Field(default=True, description="run a check inside the image after building it")
        smoke_command: list[str] | None = Field(
            default=None, description="argv of the check (default: model, config and executable are in place)"
        )
        compress: bool = Field(default=True, description="gzip the layers")
        storage_driver: Literal["vfs", "overlay"] = Field(
            default="vfs", description="buildah storage driver (vfs works everywhere; overlay needs kernel support)"
        )
        section: str | None = Field(default=None, description="recorded in the labels (set by mopt)")
        model_name: str | None = Field(default=None, description="the model's name in paths and tag (set by mopt)")

        @field_validator("base")
        @classmethod
        def _pinned(cls, v: str | None) -> str | None:
            if v is not None:
                parse_base(v)  # BaseRefError is a ValueError: pydantic reports it on `base`
            return v

        @field_validator("python_packages")
        @classmethod
        def _pinned_packages(cls, v: list[str] | None) -> list[str] | None:
            for req in v or []:
                if not _PINNED_REQ.fullmatch(req):
                    raise ValueError(f"{req!r}: python_packages must be pinned as name==version")
            return v

        @field_validator("python_version")
        @classmethod
        def _pyver(cls, v: str | None) -> str | None:
            if v is not None and not re.fullmatch(r"3\.[0-9]{1,2}", v):
                raise ValueError(f"{v!r} is not a Python version like 3.11")
            return v

        @field_validator("base_digest")
        @classmethod
        def _digest(cls, v: str | None) -> str | None:
            if v is not None:
                parse_base(None, "x", v)
            return v

        @field_validator("health_interval", "health_timeout", "health_start_period")
        @classmethod
        def _duration(cls, v: str) -> str:
            if not _DURATION.fullmatch(v):
                raise ValueError(f"{v!r} is not a duration (e.g. 30s, 10m, 1h)")
            return v

        @field_validator("model_dir", "config_dir", "files_dir")
        @classmethod
        def _absolute(cls, v: str) -> str:
            if not v.startswith("/") or ".." in v.split("/"):
                raise ValueError(f"{v!r} must be an absolute path in the image")
            return v

        @field_validator("env")
        @classmethod
        def _env(cls, v: dict[str, str]) -> dict[str, str]:
            for k, val in v.items():
                if not _ENV_NAME.fullmatch(k):
                    raise ValueError(f"{k!r} is not an environment variable name")
                if "\n" in val:
                    raise ValueError(f"env {k}: the value cannot span lines")
            return v

        @field_validator("labels")
        @classmethod
        def _labels(cls, v: dict[str, str]) -> dict[str, str]:
            for k, val in v.items():
                if not k or "\n" in k or "\n" in val:
                    raise ValueError(f"label {k!r}: keys must be non-empty and neither may span lines")
                if k.startswith(LABEL_PREFIX):
                    raise ValueError(f"label {k!r}: {LABEL_PREFIX}* labels are mopt's provenance")
            return v

        @field_validator("tag")
        @classmethod
        def _tag(cls, v: str | None) -> str | None:
            if v is None:
                return v
            repo, _, tag = v.rpartition(":") if ":" in v.rsplit("/", 1)[-1] else (v, "", "latest")
            _host, _, path = qualify(repo).partition("/")
            if not _REPO.fullmatch(path) or not _TAG.fullmatch(tag):
                raise ValueError(f"{v!r} is not a repo:tag (lowercase repository, tag of letters, digits, _.-)")
            return v

        @model_validator(mode="after")
        def _base_given(self) -> ImageKind.Params:
            if self.base is None and self.base_archive is None and self.base_digest is None:
                return self  # the base comes from a `base-image` input (checked when wired)
            try:
                parse_base(self.base, self.base_archive, self.base_digest)
            except BaseRefError as exc:
                raise ValueError(str(exc)) from None
            return self

    # ------------------------------------------------------------------ keying

    def bind(self, params: Any, *, model: str, hardware: str, section: str) -> Any:
        """Record the section and model (they are in the labels and the model's path, so they
        are part of the key: an image is not shared between sections)."""
        update: dict[str, Any] = {}
        if params.section is None:
            update["section"] = section
        if params.model_name is None:
            update["model_name"] = model
        if params.tag is None:
            update["tag"] = f"mopt/{_slug(model)}:{_slug(hardware)}"
        if params.backend == "embed" and params.python_packages is None:
            from mopt_image.build import EMBED_PACKAGES

            update["python_packages"] = list(EMBED_PACKAGES)  # in the key: a new pin rebuilds
        return params.model_copy(update=update) if update else params

    def input_files(self, params: Any, project_dir: Path) -> list[Path]:
        """The local base archive/layout: a fixed-output input, its content is keyed."""
        if params.base is None and params.base_archive is None:
            return []  # a base-image input: keyed by its digest like any input
        base = parse_base(params.base, params.base_archive, params.base_digest)
        p = base.archive_path(project_dir)
        return [p.resolve()] if p is not None else []

    def requirements(self, params: Any, hardware: HardwareProfile) -> list[str]:
        from mopt_image.builders import docker_daemon

        if params.builder == "buildah":
            return ["tool:buildah"]
        if params.builder == "docker":
            return ["python:docker"]
        if shutil.which("buildah"):
            return ["tool:buildah"]
        if docker_daemon()[0] is not None:
            return ["python:docker"]
        return ["tool:buildah"]  # neither: name the daemonless one (`check` explains both)

    def fingerprint(self) -> dict[str, str]:
        from mopt_image.builders import buildah_version

        # the docker builder is not bit-reproducible: its daemon's version goes in image.json
        return {"mopt": mopt.__version__, "buildah": buildah_version() or "absent"}

    def platform(self, hardware: HardwareProfile) -> dict[str, Any]:
        return {"arch": host_arch()}  # the image is built for the machine's architecture

    def check(self, params: Any, ctx: CheckContext) -> list[Finding]:
        from mopt_image.builders import select

        out = []
        try:
            select(params.builder)
        except Exception as exc:
            out.append(
                Finding(
                    "warning", "image-builder-missing", f"this machine cannot build images: {exc}",
                    fix="apt-get install buildah (daemonless), or pip install 'mopt-image[docker]' with a running daemon",
                    section=ctx.section, target=ctx.target, key="builder",
                )
            )
        if params.format == "oci" and params.healthcheck != "":
            out.append(
                Finding(
                    "info", "image-oci-no-healthcheck",
                    "format = \"oci\": the OCI image config has no HEALTHCHECK; buildah drops it",
                    fix='keep format = "docker" for a HEALTHCHECK, or use orchestrator probes',
                    section=ctx.section, target=ctx.target, key="format",
                )
            )
        return out

    # ------------------------------------------------------------------ building

    def run(self, ctx: BuildContext) -> dict[str, Any]:
        from mopt_image.build import build_image

        return build_image(ctx, plugin_version=plugin_version())


def plugin_version() -> str:
    try:
        return md.version("mopt-image")
    except md.PackageNotFoundError:  # pragma: no cover - running from a source tree
        return PLUGIN_VERSION


__all__ = ["ImageKind"]
