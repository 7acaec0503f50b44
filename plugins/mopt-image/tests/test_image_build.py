"""Real images built with buildah from a tiny local base (no network, no daemon): the same
inputs give the same image digest from clean storage, the smoke test runs inside the image,
and the archive is a valid OCI image that buildah can run again."""

from __future__ import annotations

import json
import subprocess
import tarfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from image_helpers import (
    artifact,
    image_params,
    make_ctx,
    needs_buildah,
    serve_artifact,
    tiny_onnx,
    write_weights,
)
from mopt_image import oci
from mopt_image.builders import BuilderError
from mopt_image.kind import ImageKind
from mopt_image.testing import make_busybox_base

pytestmark = needs_buildah


def build(tmp_path: Path, params, inputs, name: str = "run", **kw):
    ctx = make_ctx(tmp_path, params, inputs, name=name, **kw)
    return ctx, ImageKind().run(ctx)


def test_busybox_base_is_byte_for_byte_reproducible(tmp_path: Path, base_image) -> None:
    again = make_busybox_base(tmp_path / "again.tar", extra={
        f"usr/local/bin/{n}": (b'#!/bin/sh\necho "fake ' + n.encode() + b': $*"\n', 0o755)
        for n in ("vllm", "trtllm-serve", "tritonserver")
    })
    assert again.digest == base_image.digest
    assert again.archive.read_bytes() == base_image.archive.read_bytes()


def test_two_clean_builds_give_the_same_image_digest(tmp_path: Path, base_image) -> None:
    weights = artifact(write_weights(tmp_path / "weights"), "weights")
    params = image_params(base=base_image.base)
    ctx1, first = build(tmp_path, params, {"model": [weights]}, name="first")
    ctx2, second = build(tmp_path, params, {"model": [weights]}, name="second")
    assert first["image_digest"] == second["image_digest"]
    assert first["image_id"] == second["image_id"]
    # not only the digest: every output byte (archive, image.json, Dockerfile, context.json)
    for name in ("image.oci.tar", "image.json", "Dockerfile", "context.json"):
        assert (ctx1.out / name).read_bytes() == (ctx2.out / name).read_bytes(), name
    assert sorted(p.name for p in ctx1.out.iterdir()) == ["Dockerfile", "context.json", "image.json", "image.oci.tar"]
    # the smoke test ran inside the image
    assert first["smoke_test"]["passed"] and first["smoke_test"]["runner"] == "buildah run"
    assert "/models/tiny-qwen3/config.json" in first["smoke_test"]["command"][2]
    # each build's private storage, context copy and layout are gone
    assert list(ctx1.tmp.iterdir()) == [] and list(ctx2.tmp.iterdir()) == []
    # provenance: base and input digests, and the build context's digest
    labels = first["labels"]
    assert labels["org.opencontainers.image.base.digest"] == base_image.digest
    assert labels["dev.mopt.input.weights"] == f"weights blake3:{weights.digest}"
    assert first["base"]["digest"] == base_image.digest
    assert first["context_digest"] == json.loads((ctx1.out / "context.json").read_text())["digest"]
    print(f"\nimage digest of two clean builds: {first['image_digest']}")


def test_parallel_builds_do_not_share_storage(tmp_path: Path, base_image) -> None:
    weights = artifact(write_weights(tmp_path / "weights"), "weights")
    params = image_params(base=base_image.base)
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda n: build(tmp_path, params, {"model": [weights]}, name=n)[1], ["a", "b"]))
    assert results[0]["image_digest"] == results[1]["image_digest"]


def test_the_archive_is_a_runnable_oci_image_with_the_files_in_place(tmp_path: Path, base_image) -> None:
    weights = artifact(write_weights(tmp_path / "weights"), "weights")
    ctx, info = build(tmp_path, image_params(base=base_image.base, labels={"note": 'quote " and $HOME'}),
                      {"model": [weights]})
    archive = ctx.out / "image.oci.tar"
    image = oci.read_image(archive)
    assert image.digest == info["image_digest"] and image.image_id == info["image_id"]
    assert image.labels["note"] == 'quote " and $HOME'  # survived Dockerfile quoting
    with tarfile.open(archive) as tar:
        names = tar.getnames()
        assert {"index.json", "oci-layout", "manifest.json"} <= set(names)
        assert all(m.mtime == 0 and m.uid == 0 for m in tar.getmembers())
    # a fresh buildah storage reads the archive and runs a command in it
    root = tmp_path / "check"
    b = ["buildah", "--root", str(root / "root"), "--runroot", str(root / "run"), "--storage-driver", "vfs"]
    env = {"PATH": "/usr/bin:/bin:/usr/sbin:/sbin", "TMPDIR": str(tmp_path)}
    ctr = subprocess.run([*b, "from", "--quiet", f"oci-archive:{archive}"], capture_output=True, text=True,
                         env=env, check=True).stdout.strip()
    try:
        got = subprocess.run([*b, "run", "--isolation", "chroot", ctr, "--", "sha256sum",
                              "/models/tiny-qwen3/model.safetensors"], capture_output=True, text=True, env=env)
        assert got.returncode == 0, got.stderr
        want = oci.sha256_file(weights.path / "model.safetensors").split(":")[1]
        assert got.stdout.split()[0] == want
    finally:
        subprocess.run([*b, "rm", "--all"], capture_output=True, env=env)
        subprocess.run(["rm", "-rf", str(root)], capture_output=True)


def test_vllm_image_keeps_its_healthcheck_and_runs_the_config(tmp_path: Path, base_image) -> None:
    weights = artifact(write_weights(tmp_path / "weights"), "weights")
    serve = serve_artifact(tmp_path, "vllm", weights, port=8123)
    ctx, info = build(tmp_path, image_params(base=base_image.base), {"serve": [serve], "model": [weights]})
    assert info["backend"] == "vllm" and info["ports"] == [8123]
    cfg = oci.read_image(ctx.out / "image.oci.tar").config["config"]
    assert cfg["Entrypoint"][:5] == ["vllm", "serve", "/models/tiny-qwen3", "--config", "/opt/mopt/serve/vllm.yaml"]
    assert cfg["Healthcheck"]["Test"][0] == "CMD" and "127.0.0.1:8123/health" in cfg["Healthcheck"]["Test"][-1]
    assert cfg["Healthcheck"]["StartPeriod"] == 600 * 10**9
    assert "8123/tcp" in cfg["ExposedPorts"]
    assert cfg["Hostname"] == ""  # the build container's hostname was cleared
    assert info["smoke_test"]["passed"]


def test_triton_and_trtllm_images_build_and_pass_their_smoke_tests(tmp_path: Path, base_image) -> None:
    weights = artifact(write_weights(tmp_path / "weights"), "weights")
    trt = serve_artifact(tmp_path, "trtllm", weights)
    _, info = build(tmp_path, image_params(base=base_image.base), {"serve": [trt], "model": [weights]}, name="t")
    assert info["backend"] == "trtllm" and info["smoke_test"]["passed"]
    repo = serve_artifact(tmp_path, "triton-repo", artifact(tiny_onnx(tmp_path / "onnx"), "onnx"))
    _, info = build(tmp_path, image_params(base=base_image.base), {"serve": [repo]}, name="tr")
    assert info["backend"] == "triton" and info["smoke_test"]["passed"]
    assert info["entrypoint"][0] == "tritonserver"


def test_a_failing_smoke_test_fails_the_build_and_says_why(tmp_path: Path, base_image) -> None:
    weights = artifact(write_weights(tmp_path / "weights"), "weights")
    params = image_params(base=base_image.base, command=["not-a-server"])  # not on PATH in the image
    with pytest.raises(BuilderError, match="the smoke test failed inside the image: not-a-server is not on PATH"):
        build(tmp_path, params, {"model": [weights]})


def test_wrong_base_digest_is_refused_before_building(tmp_path: Path, base_image) -> None:
    wrong = "sha256:" + "1" * 64
    with pytest.raises(oci.OCIError, match=f"does not hold {wrong}.*it holds {base_image.digest}"):
        build(tmp_path, image_params(base=f"oci-archive:{base_image.archive}@{wrong}"), {})


def test_corrupt_base_archive_is_refused(tmp_path: Path, base_image) -> None:
    bad = tmp_path / "bad.tar"
    with tarfile.open(base_image.archive) as src, tarfile.open(bad, "w") as dst:
        for m in src.getmembers():
            data = src.extractfile(m).read() if m.isfile() else None
            if data is not None and m.name == "blobs/sha256/" + base_image.digest.split(":")[1]:
                data = data.replace(b'"schemaVersion":2', b'"schemaVersion":3')
            dst.addfile(m, None if data is None else __import__("io").BytesIO(data))
    with pytest.raises(oci.OCIError, match="is corrupt"):
        build(tmp_path, image_params(base=f"oci-archive:{bad}@{base_image.digest}"), {})


def test_offline_never_pulls_a_registry_base(tmp_path: Path) -> None:
    params = image_params(base="docker.io/library/busybox@sha256:" + "2" * 64)
    with pytest.raises(BuilderError, match=r"--offline: the base .* would have to be pulled; give its local copy"):
        build(tmp_path, params, {}, offline=True)


def test_a_registry_named_base_can_come_from_a_local_archive(tmp_path: Path, base_image) -> None:
    # the Dockerfile names the registry image; the bytes come from the archive, offline
    params = image_params(base=f"docker.io/vllm/vllm-openai@{base_image.digest}",
                          base_archive=str(base_image.archive), backend="plain")
    ctx, info = build(tmp_path, params, {}, offline=True)
    assert f"FROM docker.io/vllm/vllm-openai@{base_image.digest}\n" in (ctx.out / "Dockerfile").read_text()
    assert info["labels"]["org.opencontainers.image.base.name"] == f"docker.io/vllm/vllm-openai@{base_image.digest}"


def test_a_base_can_be_an_oci_layout_folder(tmp_path: Path, base_image) -> None:
    layout = tmp_path / "layout"
    with tarfile.open(base_image.archive) as tar:
        tar.extractall(layout, filter="data")
    ctx, info = build(tmp_path, image_params(base=f"oci:{layout}@{base_image.digest}"), {})
    assert info["smoke_test"]["passed"] and info["base"]["digest"] == base_image.digest
    assert ImageKind().input_files(ctx.params, tmp_path) == [layout.resolve()]  # its tree is keyed


def test_oci_format_is_also_reproducible(tmp_path: Path, base_image) -> None:
    weights = artifact(write_weights(tmp_path / "weights"), "weights")
    params = image_params(base=base_image.base, format="oci", compress=False)
    _, a = build(tmp_path, params, {"model": [weights]}, name="a")
    _, b = build(tmp_path, params, {"model": [weights]}, name="b")
    assert a["image_digest"] == b["image_digest"]
    assert a["media_type"] == oci.OCI_MANIFEST and a["normalized_fields"] == []


def test_docker_save_archives_convert_to_the_same_image(tmp_path: Path, base_image) -> None:
    """The docker builder's path from `docker save` output to an OCI layout, fed with a
    docker-archive of the base (what `docker save` of that image would write)."""
    docker_tar = tmp_path / "saved.tar"
    config = oci.layout_to_docker_archive(base_image.archive, base_image.digest, docker_tar, repo_tag="x:y")
    assert config == base_image.image_id
    layout = tmp_path / "layout"
    oci.docker_archive_to_layout(docker_tar, layout, compress=True, oci=True)
    manifest_digest = json.loads((layout / "index.json").read_text())["manifests"][0]["digest"]
    assert manifest_digest == base_image.digest  # same config and (already gzipped) layers
