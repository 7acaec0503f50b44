"""Dockerfile content of every template, without a daemon or buildah: the base is pinned by
digest, the model and serving config are copied where the command expects them, the
command is the serving config's, and a HEALTHCHECK probes the server's port."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from image_helpers import DIGEST, artifact, image_params, serve_artifact, tiny_onnx, write_weights
from mopt_image.templates import Inputs, TemplateError, choose_backend, make_spec, render_dockerfile
from pydantic import ValidationError

VLLM_BASE = f"vllm/vllm-openai@{DIGEST}"
TRITON_BASE = f"nvcr.io/nvidia/tritonserver@{DIGEST}"
TRTLLM_BASE = f"nvcr.io/nvidia/tensorrt-llm/release@{DIGEST}"


def render(params, inputs: Inputs) -> tuple[str, object]:
    backend = choose_backend(params.backend, inputs)
    spec = make_spec(backend, inputs, params, "tiny-qwen3")
    from mopt_image.baseref import parse_base

    base = parse_base(params.base, params.base_archive, params.base_digest)
    df = render_dockerfile(spec, base_ref=base.ref, labels={"a": "b"}, health_options="--interval=30s",
                           header="test")
    return df, spec


def directives(df: str, name: str) -> list[str]:
    return [ln[len(name) + 1:] for ln in df.splitlines() if ln.startswith(name + " ")]


def entrypoint(df: str) -> list[str]:
    (line,) = directives(df, "ENTRYPOINT")
    return json.loads(line)


def copies(df: str) -> dict[str, str]:
    """COPY destination → context folder."""
    return {json.loads(c)[1].rstrip("/"): json.loads(c)[0].rstrip("/") for c in directives(df, "COPY")}


@pytest.fixture
def weights(tmp_path: Path):
    return artifact(write_weights(tmp_path / "weights"), "weights")


def test_vllm_dockerfile_runs_the_vllm_targets_command_on_the_baked_model(tmp_path: Path, weights) -> None:
    serve = serve_artifact(tmp_path, "vllm", weights, port=8123, max_model_len=256)
    df, spec = render(image_params(base=VLLM_BASE), Inputs(serve=serve, model=weights, files=[]))
    assert directives(df, "FROM") == [f"docker.io/vllm/vllm-openai@{DIGEST}"]
    assert copies(df) == {"/models/tiny-qwen3": "model", "/opt/mopt/serve": "serve"}
    # the vllm target's own argv ({model}, {here}) with the image's paths substituted
    argv = json.loads((serve.path / "args.json").read_text())["argv"]
    expected = [a.replace("{model}", "/models/tiny-qwen3").replace("{here}", "/opt/mopt/serve") for a in argv]
    assert entrypoint(df) == expected
    assert expected[:5] == ["vllm", "serve", "/models/tiny-qwen3", "--config", "/opt/mopt/serve/vllm.yaml"]
    assert "vllm.yaml" in {p.name for p in serve.path.iterdir()}
    # the port comes from the serving config (vllm.yaml says port: 8123)
    assert directives(df, "EXPOSE") == ["8123"]
    (health,) = directives(df, "HEALTHCHECK")
    assert "http://127.0.0.1:8123/health" in health and health.startswith("--interval=30s CMD [")
    assert directives(df, "CMD") == ["[]"]
    # the smoke test checks the model, the config and the executable
    script = spec.smoke_script()
    assert "/models/tiny-qwen3/config.json" in script and "/opt/mopt/serve/vllm.yaml" in script
    assert "command -v vllm" in script


def test_vllm_port_override_is_passed_after_the_config(tmp_path: Path, weights) -> None:
    serve = serve_artifact(tmp_path, "vllm", weights)
    df, _ = render(image_params(base=VLLM_BASE, port=9000), Inputs(serve=serve, model=weights, files=[]))
    assert entrypoint(df)[-2:] == ["--port", "9000"]  # vLLM: command-line flags win over --config
    assert directives(df, "EXPOSE") == ["9000"]
    assert "127.0.0.1:9000/health" in directives(df, "HEALTHCHECK")[0]


def test_trtllm_dockerfile_uses_trtllm_serve_and_its_options_file(tmp_path: Path, weights) -> None:
    serve = serve_artifact(tmp_path, "trtllm", weights, max_seq_len=256)
    df, spec = render(image_params(base=TRTLLM_BASE), Inputs(serve=serve, model=weights, files=[]))
    assert directives(df, "FROM") == [f"nvcr.io/nvidia/tensorrt-llm/release@{DIGEST}"]
    ep = entrypoint(df)
    assert ep[:3] == ["trtllm-serve", "serve", "/models/tiny-qwen3"]
    i = ep.index("--extra_llm_api_options")
    assert ep[i + 1] == "/opt/mopt/serve/extra_llm_api_options.yaml"
    assert ep[ep.index("--port") + 1] == "8000"
    assert copies(df) == {"/models/tiny-qwen3": "model", "/opt/mopt/serve": "serve"}
    assert "127.0.0.1:8000/health" in directives(df, "HEALTHCHECK")[0]
    assert "command -v trtllm-serve" in spec.smoke_script()


def test_triton_dockerfile_serves_the_repository_at_models(tmp_path: Path, weights) -> None:
    onnx_art = artifact(tiny_onnx(tmp_path / "onnx"), "onnx")
    repo = serve_artifact(tmp_path, "triton-repo", onnx_art)
    df, spec = render(image_params(base=TRITON_BASE), Inputs(serve=repo, model=weights, files=[]))
    assert directives(df, "FROM") == [f"nvcr.io/nvidia/tritonserver@{DIGEST}"]
    # the artifact is the model repository; the HF weights are not baked into a Triton image
    assert copies(df) == {"/models": "serve"}
    assert entrypoint(df) == [
        "tritonserver", "--model-repository=/models", "--http-port=8000", "--grpc-port=8001", "--metrics-port=8002",
    ]
    assert directives(df, "EXPOSE") == ["8000", "8001", "8002"]
    assert "127.0.0.1:8000/v2/health/ready" in directives(df, "HEALTHCHECK")[0]
    script = spec.smoke_script()
    assert "/models/tiny-qwen3/config.pbtxt" in script and "/models/tiny-qwen3/1/model.onnx" in script
    assert "command -v tritonserver" in script


def test_plain_dockerfile_has_a_healthcheck_only_when_asked(tmp_path: Path, weights) -> None:
    df, _ = render(image_params(base=VLLM_BASE), Inputs(serve=None, model=weights, files=[]))
    assert directives(df, "HEALTHCHECK") == [] and directives(df, "ENTRYPOINT") == []
    df, _ = render(
        image_params(base=VLLM_BASE, command=["python3", "-m", "http.server", "8080"], port=8080,
                     healthcheck="wget -qO- http://127.0.0.1:8080/ || exit 1"),
        Inputs(serve=None, model=weights, files=[]),
    )
    assert entrypoint(df) == ["python3", "-m", "http.server", "8080"]
    assert directives(df, "HEALTHCHECK") == ["--interval=30s CMD wget -qO- http://127.0.0.1:8080/ || exit 1"]
    assert directives(df, "EXPOSE") == ["8080"]


def test_rendering_is_deterministic(tmp_path: Path, weights) -> None:
    serve = serve_artifact(tmp_path, "vllm", weights)
    a, _ = render(image_params(base=VLLM_BASE), Inputs(serve=serve, model=weights, files=[]))
    b, _ = render(image_params(base=VLLM_BASE), Inputs(serve=serve, model=weights, files=[]))
    assert a == b


def test_backend_must_match_the_serving_input(tmp_path: Path, weights) -> None:
    serve = serve_artifact(tmp_path, "vllm", weights)
    with pytest.raises(TemplateError, match="backend 'triton' does not serve a 'vllm' artifact"):
        choose_backend("triton", Inputs(serve=serve, model=weights, files=[]))
    assert choose_backend("auto", Inputs(serve=serve, model=weights, files=[])) == "vllm"
    assert choose_backend("auto", Inputs(serve=None, model=weights, files=[])) == "plain"


def test_image_model_must_be_the_one_the_serving_config_serves(tmp_path: Path, weights) -> None:
    serve = serve_artifact(tmp_path, "vllm", weights)
    other = artifact(write_weights(tmp_path / "other"), "weights", "other-weights")
    with pytest.raises(TemplateError, match=r"serves the weights target 'weights'.*'other-weights'"):
        render(image_params(base=VLLM_BASE), Inputs(serve=serve, model=other, files=[]))


def test_vllm_without_a_model_says_what_to_add(tmp_path: Path) -> None:
    with pytest.raises(TemplateError, match="add a `weights` target"):
        render(image_params(base=VLLM_BASE, backend="vllm"), Inputs(serve=None, model=None, files=[]))


def test_labels_and_env_are_quoted_against_dockerfile_expansion() -> None:
    from mopt_image.templates import ServeSpec

    spec = ServeSpec(backend="plain", env={"GREETING": 'say "hi" to $USER'})
    df = render_dockerfile(spec, base_ref="x@" + DIGEST, labels={"k": 'a "b" \\ $HOME'}, health_options="",
                           header="h")
    assert 'ENV GREETING="say \\"hi\\" to \\$USER"' in df
    assert 'LABEL "k"="a \\"b\\" \\\\ \\$HOME"' in df


# --------------------------------------------------------------------------- params


@pytest.mark.parametrize(
    "base, message",
    [
        ("vllm/vllm-openai:v0.11.0", "not pinned by digest \\(the tag 'v0.11.0' can move\\)"),
        ("vllm/vllm-openai", "not pinned by digest"),
        ("vllm/vllm-openai@sha256:abc", "is not a digest"),
        ("oci-archive:base.tar", "must be pinned by digest"),
        ("Vllm/VLLM@" + DIGEST, "not a valid image repository name"),
    ],
)
def test_a_base_not_pinned_by_digest_is_refused(base: str, message: str) -> None:
    from mopt_image.kind import ImageKind

    with pytest.raises(ValidationError, match=message) as exc:
        ImageKind.Params(base=base)
    assert exc.value.errors()[0]["loc"] == ("base",)


def test_base_forms() -> None:
    from mopt_image.baseref import parse_base

    b = parse_base(f"vllm/vllm-openai:v1@{DIGEST}")
    assert (b.name, b.digest, b.archive) == ("docker.io/vllm/vllm-openai", DIGEST, None)
    assert parse_base(f"ubuntu@{DIGEST}").ref == f"docker.io/library/ubuntu@{DIGEST}"
    assert parse_base(f"nvcr.io/nvidia/tritonserver@{DIGEST}").name == "nvcr.io/nvidia/tritonserver"
    a = parse_base(f"oci-archive:bases/x.tar@{DIGEST}")
    assert (a.name, a.archive) == ("localhost/mopt-base", "bases/x.tar")
    c = parse_base(f"vllm/vllm-openai@{DIGEST}", "bases/vllm.tar")
    assert (c.name, c.archive) == ("docker.io/vllm/vllm-openai", "bases/vllm.tar")
    d = parse_base(None, "bases/x.tar", DIGEST)
    assert (d.ref, d.archive) == (f"localhost/mopt-base@{DIGEST}", "bases/x.tar")


def test_missing_or_contradictory_base_is_a_params_error() -> None:
    from mopt_image.kind import ImageKind

    ImageKind.Params()  # the base may come from a base-image input (resolve_base checks it)
    with pytest.raises(ValidationError, match="needs base_digest"):
        ImageKind.Params(base_archive="x.tar")
    other = "sha256:" + "f" * 64
    with pytest.raises(ValidationError, match="disagree"):
        ImageKind.Params(base=f"vllm/vllm-openai@{DIGEST}", base_digest=other)


def test_bind_records_section_model_and_tag() -> None:
    p = image_params(base=VLLM_BASE)
    assert (p.section, p.model_name, p.tag) == ("tiny-qwen3.cpu", "tiny-qwen3", "mopt/tiny-qwen3:cpu")


def test_the_base_archive_is_an_input_file_of_the_key(tmp_path: Path) -> None:
    from mopt_image.kind import ImageKind

    p = ImageKind.Params(base_archive="bases/b.tar", base_digest=DIGEST)
    assert ImageKind().input_files(p, tmp_path) == [(tmp_path / "bases/b.tar").resolve()]
    assert ImageKind().input_files(ImageKind.Params(base=VLLM_BASE), tmp_path) == []


def test_requirements_name_the_builder(monkeypatch: pytest.MonkeyPatch) -> None:
    from image_helpers import CPU
    from mopt_image import builders
    from mopt_image.kind import ImageKind

    k = ImageKind()
    assert k.requirements(ImageKind.Params(base=VLLM_BASE, builder="buildah"), CPU) == ["tool:buildah"]
    assert k.requirements(ImageKind.Params(base=VLLM_BASE, builder="docker"), CPU) == ["python:docker"]
    # neither buildah nor a daemon: the daemonless builder is what is asked for
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setattr(builders, "docker_daemon", lambda: (None, "no daemon"))
    assert k.requirements(ImageKind.Params(base=VLLM_BASE), CPU) == ["tool:buildah"]
    with pytest.raises(builders.BuilderUnavailable, match=r"no image builder here.*buildah is not installed"):
        builders.select("auto")


def test_image_labels_in_dockerfile_name_inputs_and_versions(tmp_path: Path, weights) -> None:
    from image_helpers import make_ctx
    from mopt_image.build import provenance_labels

    ctx = make_ctx(tmp_path, image_params(base=VLLM_BASE), {"model": [weights]})
    labels = provenance_labels(ctx, ctx.params, f"docker.io/vllm/vllm-openai@{DIGEST}", DIGEST, "vllm", "0.1.0")
    assert labels["org.opencontainers.image.base.digest"] == DIGEST
    assert labels["dev.mopt.section"] == "tiny-qwen3.cpu"
    assert labels["dev.mopt.input.weights"] == f"weights blake3:{weights.digest}"
    assert re.fullmatch(r"\d+\.\d+.*", labels["dev.mopt.mopt.version"])
