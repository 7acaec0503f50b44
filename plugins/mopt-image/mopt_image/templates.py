"""Dockerfile templates, one per serving backend, and the spec they are rendered from.

A backend turns the image target's inputs (the serving artifact of `vllm`, `trtllm` or
`triton-repo`, the model folder, extra artifacts) and params into a `ServeSpec`: what is
copied where, the serving command, the port and the health check. `render_dockerfile` turns
a spec into a Dockerfile, deterministically (same spec, same bytes).

| backend | serving input | command (ENTRYPOINT) | health check |
|---|---|---|---|
| vllm | `vllm` | its `args.json` argv: `vllm serve <model_dir> --config <config_dir>/vllm.yaml` | `GET /health` |
| trtllm | `trtllm` | its argv: `trtllm-serve serve <model_dir> ... --extra_llm_api_options …` | `GET /health` |
| triton | `triton-repo` | `tritonserver --model-repository=/models --http-port=P --grpc-port=P+1 --metrics-port=P+2` | `GET /v2/health/ready` |
| plain | none needed | `command`, if given | `healthcheck`, if given |

The serving targets write their command with `{model}` (the model folder) and `{here}` (their
own folder) as placeholders; the image puts the model at `model_dir` and the serving
artifact at `config_dir` and substitutes those, so the image runs exactly the command line
of the serving config.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mopt.api import Artifact

#: serving-artifact kind → backend (for backend = "auto")
BACKEND_OF_KIND = {"vllm": "vllm", "trtllm": "trtllm", "triton-repo": "triton"}
BACKENDS = ("vllm", "trtllm", "triton", "embed", "plain")
#: where a Triton image holds its model repository (what --model-repository points at)
TRITON_REPOSITORY = "/models"
#: the file name and command each serving backend's executable goes by
EXECUTABLE = {"vllm": "vllm", "trtllm": "trtllm-serve", "triton": "tritonserver"}
HEALTH_PATH = {"vllm": "/health", "trtllm": "/health", "triton": "/v2/health/ready", "embed": "/health"}
#: where the embed backend puts its server and its Python packages in the image
EMBED_SERVER_DIR = "/opt/mopt/server"
EMBED_SITE_DIR = "/opt/mopt/site"
EMBED_SERVER = "embed_server.py"
#: exit status of the smoke script's first check (the next ones count up from it)
SMOKE_EXIT = 10


class TemplateError(ValueError):
    """The inputs and params do not make an image of this backend (the message says why)."""


@dataclass(frozen=True)
class Copy:
    """One input artifact copied into the image: the folder, where it goes, and the file the
    smoke test must find there."""

    src: Path
    dest: str  # absolute path in the image
    context_dir: str  # folder name inside the build context
    what: str  # "model (weights target 'weights')" — for messages and labels
    check: str | None = None  # a file the smoke test must find


@dataclass
class ServeSpec:
    backend: str
    copies: list[Copy] = field(default_factory=list)
    entrypoint: list[str] | None = None  # None: keep the base image's
    ports: list[int] = field(default_factory=list)
    health: list[str] | str | None = None  # exec form (list) or shell form (str)
    env: dict[str, str] = field(default_factory=dict)
    executable: str | None = None  # must be on PATH in the image (smoke test)
    config_files: list[str] = field(default_factory=list)  # serving configs, paths in the image
    notes: list[str] = field(default_factory=list)
    extra_checks: list[tuple[str, str]] = field(default_factory=list)  # (shell condition, what is wrong)

    def smoke_checks(self) -> list[tuple[str, str]]:
        """(shell condition, what is wrong when it fails), in order."""
        checks = []
        for path in [c.check for c in self.copies if c.check] + self.config_files:
            checks.append((f"test -f {shlex.quote(path)}", f"missing {path}"))
        if self.executable:
            checks.append((f"command -v {shlex.quote(self.executable)} >/dev/null",
                           f"{self.executable} is not on PATH"))
        return checks + self.extra_checks

    def smoke_script(self) -> str:
        """A POSIX sh script that fails unless the model files and serving configs are where
        the command expects them and the executable is on PATH. Each check exits with its own
        status (10, 11, ...): `smoke_reason` maps it back, since a runner may lose the output."""
        lines = ["set -e"]
        for i, (cond, why) in enumerate(self.smoke_checks()):
            lines.append(f"{cond} || {{ echo {shlex.quote(why)} >&2; exit {SMOKE_EXIT + i}; }}")
        lines.append("echo mopt-smoke-ok")
        return "\n".join(lines)

    def smoke_reason(self, status: int | None) -> str | None:
        checks = self.smoke_checks()
        i = (status or 0) - SMOKE_EXIT
        return checks[i][1] if 0 <= i < len(checks) else None


# --------------------------------------------------------------------------- helpers


def _first_file(folder: Path, prefer: tuple[str, ...] = ("config.json",)) -> str | None:
    """A file of `folder` for the smoke test to look for: a preferred name, else the first."""
    for name in prefer:
        if (folder / name).is_file():
            return name
    files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    return files[0] if files else None


def _join(dest: str, rel: str | None) -> str | None:
    return None if rel is None else f"{dest.rstrip('/')}/{rel}"


def _find_yaml(folder: Path, names: tuple[str, ...]) -> Path | None:
    for n in names:
        if (folder / n).is_file():
            return folder / n
    found = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix in (".yaml", ".yml"))
    return found[0] if len(found) == 1 else None


def has_flag(args: list[str], *flags: str) -> bool:
    return any(a == f or a.startswith(f + "=") for a in args for f in flags)


def health_exec(port: int, path: str) -> list[str]:
    """A health check that needs only python3 (in every vLLM, TensorRT-LLM and Triton image;
    curl is not in all of them): exit 0 on HTTP 2xx, else 1."""
    code = f"import urllib.request as u; u.urlopen('http://127.0.0.1:{port}{path}', timeout=8)"
    return ["python3", "-c", code]


# --------------------------------------------------------------------------- backends


@dataclass
class Inputs:
    """The image target's inputs by role."""

    serve: Artifact | None
    model: Artifact | None
    files: list[Artifact]


def choose_backend(requested: str, inputs: Inputs) -> str:
    if inputs.serve is not None:
        implied = BACKEND_OF_KIND.get(inputs.serve.kind)
        if requested == "auto":
            return implied or "plain"
        if implied and implied != requested and requested != "plain":
            raise TemplateError(
                f"backend {requested!r} does not serve a {inputs.serve.kind!r} artifact "
                f"(target {inputs.serve.target!r}); use backend = {implied!r} or \"auto\""
            )
        return requested
    return "plain" if requested == "auto" else requested


def make_spec(backend: str, inputs: Inputs, p: Any, model_name: str, *, server: Path | None = None,
              site: Path | None = None) -> ServeSpec:
    """The spec of `backend` for these inputs and params (an ImageKind.Params); `server` and
    `site` are the embed backend's server folder and installed Python packages."""
    model_dir = p.model_dir.replace("{model}", model_name)
    bake = p.bake_model if p.bake_model is not None else backend != "triton"
    spec = ServeSpec(backend=backend, env=dict(p.env))
    if inputs.model is not None and bake:
        spec.copies.append(
            Copy(inputs.model.path, model_dir, "model", f"model ({inputs.model.kind} target {inputs.model.target!r})",
                 _join(model_dir, _first_file(inputs.model.path)))
        )
    for art in inputs.files:
        dest = f"{p.files_dir.rstrip('/')}/{art.target}"
        spec.copies.append(
            Copy(art.path, dest, f"files/{art.target}", f"files ({art.kind} target {art.target!r})",
                 _join(dest, _first_file(art.path)))
        )
    if backend == "plain":
        _plain(spec, inputs, p)
    elif backend == "embed":
        _embed(spec, inputs, p, model_dir, model_name, server, site)
    elif backend in ("vllm", "trtllm"):
        _llm_server(spec, inputs, p, model_dir, bake, backend)
    elif backend == "triton":
        _triton(spec, inputs, p, model_dir, bake)
    else:  # pragma: no cover - Params validation restricts it
        raise TemplateError(f"unknown backend {backend!r}")
    if site is not None and backend != "embed":  # python_packages for another backend's command
        spec.copies.append(Copy(site, EMBED_SITE_DIR, "site", "Python packages (python_packages)"))
        spec.env.setdefault("PYTHONPATH", EMBED_SITE_DIR)
    if p.healthcheck is not None:
        spec.health = p.healthcheck or None  # "" disables it
    return spec


def _serve_copy(spec: ServeSpec, art: Artifact, dest: str) -> None:
    spec.copies.append(
        Copy(art.path, dest, "serve", f"serving config ({art.kind} target {art.target!r})",
             _join(dest, _first_file(art.path, ())))
    )


def _needs_model(backend: str, inputs: Inputs, bake: bool) -> None:
    if inputs.model is None and bake:
        raise TemplateError(
            f"a {backend} image serves a model folder: add a `weights` target to the section "
            "(or set bake_model = false and mount the model at model_dir when running the image)"
        )


def _plain(spec: ServeSpec, inputs: Inputs, p: Any) -> None:
    if inputs.serve is not None:
        _serve_copy(spec, inputs.serve, p.config_dir)
    spec.entrypoint = list(p.command) if p.command is not None else None
    if p.command:
        spec.executable = p.command[0]
    spec.ports = [p.port or 8000] if p.command else []  # a plain image serves only with a command


#: what each LLM server runs when its serving target left no argv (args.json) to follow
DEFAULT_ARGV = {
    "vllm": (["vllm", "serve", "{model}"], ("vllm.yaml",), "--config"),
    "trtllm": (["trtllm-serve", "serve", "{model}"], ("extra_llm_api_options.yaml",), "--extra_llm_api_options"),
}
_PORT_YAML = re.compile(r"^port:\s*([0-9]+)\s*$", re.M)
_HOST_YAML = re.compile(r"^host:\s*['\"]?([^'\"\s]+)", re.M)
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def serving_argv(art: Artifact) -> list[str] | None:
    """The serving command a `vllm` / `trtllm` target wrote: `args.json`'s `argv`, with
    `{model}` for the model folder and `{here}` for the serving artifact's own folder."""
    argv = None
    if (art.path / "args.json").is_file():
        try:
            doc = json.loads((art.path / "args.json").read_text())
        except ValueError as exc:
            raise TemplateError(f"the {art.kind} target {art.target!r} wrote an args.json that is not JSON: {exc}") from None
        argv = doc.get("argv") if isinstance(doc, dict) else doc
    elif isinstance(art.meta, dict) and "argv" in art.meta:
        argv = art.meta["argv"]
    if argv is None:
        return None
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
        raise TemplateError(f"the {art.kind} target {art.target!r} gives an argv that is not a list of strings")
    return list(argv)


def flag_value(argv: list[str], flag: str) -> str | None:
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def set_flag(argv: list[str], flag: str, value: str) -> list[str]:
    """`argv` with `flag`'s value replaced, or the flag appended (CLI flags override a config file)."""
    out = list(argv)
    for i, a in enumerate(out):
        if a == flag and i + 1 < len(out):
            out[i + 1] = value
            return out
        if a.startswith(flag + "="):
            out[i] = f"{flag}={value}"
            return out
    return [*out, flag, value]


def _check_model_wiring(serve: Artifact, model: Artifact | None) -> None:
    want = serve.meta.get("model_target") if isinstance(serve.meta, dict) else None
    if want and model is not None and model.target != want:
        raise TemplateError(
            f"the {serve.kind} target {serve.target!r} serves the {serve.meta.get('model_kind', 'model')} target "
            f"{want!r}, but the image's model input is {model.target!r}: say which with input = [{serve.target!r}, {want!r}]"
        )


def _llm_server(spec: ServeSpec, inputs: Inputs, p: Any, model_dir: str, bake: bool, backend: str) -> None:
    _needs_model({"vllm": "vLLM", "trtllm": "TensorRT-LLM"}[backend], inputs, bake)
    default, configs, config_flag = DEFAULT_ARGV[backend]
    serve = inputs.serve
    argv = None
    if serve is not None:
        _check_model_wiring(serve, inputs.model)
        _serve_copy(spec, serve, p.config_dir)
        argv = serving_argv(serve)
        if argv is None:
            cfg = next((c for c in configs if (serve.path / c).is_file()), None)
            argv = default + ([config_flag, "{here}/" + cfg] if cfg else [])
    if argv is None:
        argv = list(default)
    here = p.config_dir.rstrip("/")
    argv = [a.replace("{model}", model_dir).replace("{here}", here) for a in argv]
    spec.config_files += [a for a in argv if a.startswith(here + "/") and not a.endswith("/engine")]
    argv += list(p.args)
    yaml_text = "".join(
        (serve.path / c).read_text(errors="replace") for c in configs if serve is not None and (serve.path / c).is_file()
    )
    port_s = flag_value(argv, "--port") or (m.group(1) if (m := _PORT_YAML.search(yaml_text)) else None)
    port = int(port_s) if port_s else 8000
    if p.port is not None and p.port != port:
        argv = set_flag(argv, "--port", str(p.port))
        port = p.port
    host = flag_value(argv, "--host") or (m.group(1) if (m := _HOST_YAML.search(yaml_text)) else None)
    if host in LOOPBACK:
        spec.notes.append(f"the serving config binds {host}: the server is unreachable from outside the container")
    spec.entrypoint = list(p.command) if p.command is not None else argv
    spec.executable = spec.entrypoint[0] if spec.entrypoint else argv[0]
    spec.ports = [port]
    spec.health = health_exec(port, HEALTH_PATH[backend])


#: the model kinds the embed server takes: mopt ONNX folders (model.onnx + tokenizer files)
EMBED_MODEL_KINDS = ("onnx", "onnx-slim", "ort-quantize", "select")


def _embed(spec: ServeSpec, inputs: Inputs, p: Any, model_dir: str, model_name: str, server: Path | None,
           site: Path | None) -> None:
    model = inputs.model
    if model is None or not (model.path / "model.onnx").is_file():
        what = f"the {model.kind} target {model.target!r}" if model is not None else "no model input"
        raise TemplateError(
            f"the embed backend serves a mopt ONNX folder (model.onnx + tokenizer.json) and got {what}: "
            f"name one with input = [\"<{' | '.join(EMBED_MODEL_KINDS)} target>\"]"
        )
    if not (model.path / "tokenizer.json").is_file():
        raise TemplateError(f"the {model.kind} target {model.target!r} has no tokenizer.json for the server")
    if inputs.serve is not None:
        raise TemplateError(f"the embed backend serves the model itself: drop the {inputs.serve.kind!r} input")
    if server is None or site is None:  # pragma: no cover - build_image prepares both
        raise TemplateError("the embed backend needs its server and Python packages prepared")
    spec.copies.append(Copy(server, EMBED_SERVER_DIR, "server", "embeddings server (mopt-image)",
                            f"{EMBED_SERVER_DIR}/{EMBED_SERVER}"))
    spec.copies.append(Copy(site, EMBED_SITE_DIR, "site", "Python packages (python_packages)"))
    port = p.port or 8000
    argv = ["python3", f"{EMBED_SERVER_DIR}/{EMBED_SERVER}", "--model", model_dir, "--host", "0.0.0.0",
            "--port", str(port), "--served-model-name", model_name, *p.args]
    spec.env = {"PYTHONPATH": EMBED_SITE_DIR, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1", **spec.env}
    spec.entrypoint = list(p.command) if p.command is not None else argv
    spec.executable = spec.entrypoint[0]
    spec.ports = [port]
    spec.health = health_exec(port, HEALTH_PATH["embed"])
    # the server's imports resolve in the image (the wheels fit its Python and glibc)
    imports = "import fastapi, numpy, onnxruntime, prometheus_client, tokenizers, uvicorn"
    spec.extra_checks.append((f"PYTHONPATH={EMBED_SITE_DIR} python3 -c {shlex.quote(imports)}",
                              "the server's Python packages do not import in the image"))


def _triton(spec: ServeSpec, inputs: Inputs, p: Any, model_dir: str, bake: bool) -> None:
    if inputs.serve is None or inputs.serve.kind != "triton-repo":
        raise TemplateError("a triton image serves a Triton model repository: add a `triton-repo` target")
    if bake and inputs.model is not None and (model_dir.rstrip("/") + "/").startswith(TRITON_REPOSITORY + "/"):
        raise TemplateError(
            f"model_dir {model_dir!r} is inside the Triton model repository {TRITON_REPOSITORY}: Triton would "
            "try to load it as a model; set model_dir elsewhere (e.g. /opt/models/{model})"
        )
    repo = inputs.serve.path
    models = sorted(d.name for d in repo.iterdir() if d.is_dir() and (d / "config.pbtxt").is_file())
    if not models:
        raise TemplateError(f"the triton-repo target {inputs.serve.target!r} holds no model (no <name>/config.pbtxt)")
    spec.copies.append(
        Copy(repo, TRITON_REPOSITORY, "serve", f"model repository (triton-repo target {inputs.serve.target!r})",
             f"{TRITON_REPOSITORY}/{models[0]}/config.pbtxt")
    )
    # every file the repository lists (config.pbtxt, 1/model.onnx, ...) must be in place
    listed = inputs.serve.meta.get("files") if isinstance(inputs.serve.meta, dict) else None
    files = [f for f in listed if isinstance(f, str)] if isinstance(listed, list) else [f"{m}/config.pbtxt" for m in models]
    spec.config_files += [f"{TRITON_REPOSITORY}/{f}" for f in files if f != f"{models[0]}/config.pbtxt"]
    args = list(p.args)
    port = p.port or 8000
    argv = ["tritonserver", f"--model-repository={TRITON_REPOSITORY}"]
    # HTTP, gRPC, metrics: Triton's defaults are 8000-8002; keep them together
    ports = (("--http-port", port), ("--grpc-port", port + 1), ("--metrics-port", port + 2))
    argv += [f"{flag}={n}" for flag, n in ports if not has_flag(args, flag)]
    spec.entrypoint = list(p.command) if p.command is not None else argv + args
    spec.executable = spec.entrypoint[0] if spec.entrypoint else "tritonserver"
    spec.ports = [n for _flag, n in ports]
    spec.health = health_exec(port, HEALTH_PATH["triton"])


# --------------------------------------------------------------------------- rendering


def _quote(value: str) -> str:
    """A double-quoted Dockerfile word: `"` and `\\` escaped, `$` kept from expansion."""
    if "\n" in value or "\r" in value:
        raise TemplateError(f"a label or env value cannot span lines: {value[:60]!r}")
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("$", "\\$") + '"'


def _exec_form(argv: list[str]) -> str:
    return json.dumps(argv, ensure_ascii=False)


def render_dockerfile(
    spec: ServeSpec,
    *,
    base_ref: str,
    labels: dict[str, str],
    health_options: str,
    header: str,
) -> str:
    """The Dockerfile of `spec` (the same spec always renders to the same bytes)."""
    lines = [f"# {line}" if line else "#" for line in header.splitlines()]
    lines += [f"FROM {base_ref}"]
    # the metadata first, the files last: docker's classic builder runs every instruction in a
    # new container, and on vfs storage (CI) each container is a full copy of the image so far,
    # so metadata steps on the bare base cost far less than on base + model + packages
    if spec.env:  # one instruction: docker's classic builder makes a container per instruction
        lines.append("ENV " + " \\\n    ".join(f"{k}={_quote(spec.env[k])}" for k in sorted(spec.env)))
    if labels:
        body = " \\\n      ".join(f"{_quote(k)}={_quote(labels[k])}" for k in sorted(labels))
        lines.append(f"LABEL {body}")
    for port in spec.ports:
        lines.append(f"EXPOSE {port}")
    if spec.health:
        cmd = _exec_form(spec.health) if isinstance(spec.health, list) else spec.health
        lines.append(f"HEALTHCHECK {health_options} CMD {cmd}".replace("  ", " "))
    if spec.entrypoint is not None:
        lines.append(f"ENTRYPOINT {_exec_form(spec.entrypoint)}")
        lines.append("CMD []")
    for c in sorted(spec.copies, key=lambda c: c.dest):
        lines.append(f"COPY {_exec_form([c.context_dir + '/', c.dest.rstrip('/') + '/'])}")
    return "\n".join(lines) + "\n"
