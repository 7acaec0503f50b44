"""The embed backend and the base-image input without building anything: what the Dockerfile
says, and the clear errors for inputs it cannot serve."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from image_helpers import DIGEST, artifact, image_params, make_ctx, tiny_onnx, write_weights
from mopt_image.build import EMBED_PACKAGES, resolve_base
from mopt_image.debian import BaseImageKind, installed_packages, python_version
from mopt_image.kind import ImageKind
from mopt_image.templates import Inputs, TemplateError, make_spec, render_dockerfile
from pydantic import ValidationError


def onnx_folder(tmp_path: Path) -> Path:
    folder = tiny_onnx(tmp_path / "int8")
    (folder / "tokenizer.json").write_text("{}")
    return folder


def test_embed_spec_serves_the_onnx_folder_with_the_server_and_its_wheels(tmp_path: Path) -> None:
    model = artifact(onnx_folder(tmp_path), "ort-quantize", "int8")
    p = image_params(backend="embed", base=f"vllm/vllm-openai@{DIGEST}", port=9000)
    (tmp_path / "server").mkdir()
    (tmp_path / "site").mkdir()
    spec = make_spec("embed", Inputs(None, model, []), p, "tiny-qwen3", server=tmp_path / "server",
                     site=tmp_path / "site")
    assert spec.entrypoint == ["python3", "/opt/mopt/server/embed_server.py", "--model", "/models/tiny-qwen3",
                               "--host", "0.0.0.0", "--port", "9000", "--served-model-name", "tiny-qwen3"]
    assert spec.env["PYTHONPATH"] == "/opt/mopt/site" and spec.ports == [9000]
    df = render_dockerfile(spec, base_ref=f"localhost/mopt-base@{DIGEST}", labels={}, health_options="", header="")
    assert 'COPY ["site/", "/opt/mopt/site/"]' in df and 'COPY ["model/", "/models/tiny-qwen3/"]' in df
    assert "127.0.0.1:9000/health" in df
    # the smoke test imports the server's packages inside the image
    assert "import fastapi, numpy, onnxruntime" in spec.smoke_script()
    # bind pins the packages into the params (so the key changes with them)
    assert p.python_packages == EMBED_PACKAGES and all("==" in r for r in p.python_packages)


def test_embed_refuses_what_it_cannot_serve(tmp_path: Path) -> None:
    p = image_params(backend="embed", base=f"vllm/vllm-openai@{DIGEST}")
    weights = artifact(write_weights(tmp_path / "weights"), "weights")
    with pytest.raises(TemplateError, match="serves a mopt ONNX folder"):
        make_spec("embed", Inputs(None, weights, []), p, "m", server=tmp_path, site=tmp_path)
    bare = tiny_onnx(tmp_path / "bare")
    with pytest.raises(TemplateError, match=r"no tokenizer\.json"):
        make_spec("embed", Inputs(None, artifact(bare, "onnx"), []), p, "m", server=tmp_path, site=tmp_path)


def test_python_packages_must_be_pinned() -> None:
    with pytest.raises(ValidationError, match="pinned as name==version"):
        ImageKind.Params(base=f"vllm/vllm-openai@{DIGEST}", python_packages=["numpy>=2"])
    with pytest.raises(ValidationError, match="not a Python version"):
        ImageKind.Params(base=f"vllm/vllm-openai@{DIGEST}", python_version="3")


def test_a_base_image_input_is_the_base_and_excludes_another(tmp_path: Path) -> None:
    base_dir = tmp_path / "base"
    base_dir.mkdir()
    (base_dir / "base.json").write_text(json.dumps({"archive": "image.oci.tar", "image_digest": DIGEST,
                                                    "python": "3.11", "packages": []}))
    (base_dir / "image.oci.tar").write_bytes(b"")
    base = artifact(base_dir, "base-image", "base")
    ctx = make_ctx(tmp_path, image_params(backend="embed"), {"base": [base]})
    ref, info = resolve_base(ctx)
    assert ref.digest == DIGEST and ref.archive == str(base_dir / "image.oci.tar") and info["python"] == "3.11"
    both = make_ctx(tmp_path, image_params(base=f"vllm/vllm-openai@{DIGEST}"), {"base": [base]}, name="both")
    with pytest.raises(TemplateError, match="keep one"):
        resolve_base(both)
    none = make_ctx(tmp_path, image_params(), {}, name="none")
    with pytest.raises(ValueError, match="add a `base-image` target"):
        resolve_base(none)


def test_base_image_params_and_package_records(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="not a Debian package name"):
        BaseImageKind.Params(packages=["Python3 minimal"])
    with pytest.raises(ValidationError, match=r"snapshot\.debian\.org time stamp"):
        BaseImageKind.Params(snapshot="yesterday")
    import io
    import tarfile

    status = (b"Package: libc6\nStatus: install ok installed\nArchitecture: amd64\nVersion: 2.36-9\n\n"
              b"Package: python3.11-minimal\nStatus: install ok installed\nArchitecture: amd64\nVersion: 3.11.2-6\n\n"
              b"Package: gone\nStatus: deinstall ok config-files\nVersion: 1\n")
    with tarfile.open(tmp_path / "rootfs.tar", "w") as tar:
        ti = tarfile.TarInfo("./var/lib/dpkg/status")
        ti.size = len(status)
        tar.addfile(ti, io.BytesIO(status))
    pkgs = installed_packages(tmp_path / "rootfs.tar")
    assert pkgs == ["libc6=2.36-9 amd64", "python3.11-minimal=3.11.2-6 amd64"]
    assert python_version(pkgs) == "3.11"


def test_base_image_refuses_offline(tmp_path: Path) -> None:
    ctx = make_ctx(tmp_path, BaseImageKind.Params(), {}, offline=True)
    with pytest.raises(RuntimeError, match="--offline forbids that"):
        BaseImageKind().run(ctx)
