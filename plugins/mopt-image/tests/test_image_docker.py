"""The docker builder for real, through the docker SDK against a daemon (`.ci/run` starts
a private one and sets DOCKER_HOST): a base from a local archive (no registry), the labels
and digests recorded, the smoke test under `docker run`, the daemon left as it was, and
what docker does and does not reproduce compared with buildah."""

from __future__ import annotations

import gzip
import io
import tarfile
import time
from pathlib import Path

import docker
import pytest
from image_helpers import artifact, image_params, make_ctx, needs_busybox, needs_docker, write_weights
from mopt_image import oci
from mopt_image.kind import ImageKind

pytestmark = [needs_docker, needs_busybox]


def build(tmp_path: Path, params, inputs, name: str = "run"):
    ctx = make_ctx(tmp_path, params, inputs, name=name)
    return ctx, ImageKind().run(ctx)


@pytest.fixture
def client():
    c = docker.from_env(timeout=300)
    yield c
    c.close()


def test_docker_builder_builds_from_a_local_base_with_provenance(tmp_path: Path, base_image, client) -> None:
    weights = artifact(write_weights(tmp_path / "weights"), "weights")
    before = {img.id for img in client.images.list(all=True)}
    params = image_params(base=base_image.base, builder="docker", command=["sh", "-c", "echo served \"$0\""],
                          labels={"team": "search"})
    ctx, info = build(tmp_path, params, {"model": [weights]})
    # the archive is the artifact: an OCI image whose digest image.json records
    image = oci.read_image(ctx.out / "image.oci.tar")
    assert info["image_digest"] == image.digest and info["image_id"] == image.image_id
    assert info["builder"]["name"] == "docker" and info["builder"]["version"] == client.version()["Version"]
    assert info["reproducible"] is False
    labels = image.labels
    assert labels["org.opencontainers.image.base.digest"] == base_image.digest
    assert labels["dev.mopt.input.weights"] == f"weights blake3:{weights.digest}"
    assert labels["dev.mopt.backend"] == "plain" and labels["team"] == "search"
    assert info["smoke_test"] == {"command": info["smoke_test"]["command"], "passed": True, "runner": "docker run"}
    # the base's layer is the archive's own (loaded, never pulled): the built image starts with it
    base_layers = oci.find_pinned(base_image.archive, base_image.digest).layers
    assert len(image.layers) > len(base_layers)
    # the built image and its intermediate layers were removed from the daemon; only the base it
    # loaded stays. Other tests build images on the same daemon at the same time (pytest -n 2),
    # so this looks only at images carrying this build's labels (team=search is this test's own).
    ours = {img.id for img in client.images.list(all=True, filters={"label": "team=search"})}
    assert ours - before == set()
    assert info["image_id"] not in {img.id for img in client.images.list(all=True)}
    # the archive runs under docker: load it, run its command
    with open(ctx.out / "image.oci.tar", "rb") as f:
        loaded = client.images.load(f)
    assert [i.id for i in loaded] == [image.image_id]
    try:
        out = client.containers.run(image.image_id, command=["ok"], remove=True, network_disabled=True)
        assert out.decode().strip() == "served ok"
        assert client.images.get(image.image_id).labels["dev.mopt.target"] == "image"
    finally:
        client.images.remove(image.image_id, force=True)


def _layer_entries(archive: Path) -> list[list[tuple]]:
    """(name, type, mode, uid, gid, mtime, size) of every entry of every layer but the base's."""
    img = oci.read_image(archive)
    out = []
    with tarfile.open(archive) as tar:
        for d in img.layers[1:]:
            raw = gzip.decompress(tar.extractfile("blobs/sha256/" + d.split(":")[1]).read())
            with tarfile.open(fileobj=io.BytesIO(raw)) as layer:
                out.append([(m.name, m.type, m.mode, m.uid, m.gid, m.mtime, m.size) for m in layer])
    return out


def test_what_docker_reproduces_and_what_it_does_not(tmp_path: Path, base_image) -> None:
    """Two docker builds of the same context: the files in the COPY layers are the same bytes
    with the same times (the context has fixed times and modes), but the folders COPY creates
    (/models, /models/<model>) carry the time of the build, and the config its `created`
    stamps: the layers and the image digest differ. buildah's are equal (test_image_build)."""
    weights = artifact(write_weights(tmp_path / "weights"), "weights")
    params = image_params(base=base_image.base, builder="docker")
    ctx1, first = build(tmp_path, params, {"model": [weights]}, name="first")
    time.sleep(1.1)  # docker's times have one-second resolution in the layer tars
    ctx2, second = build(tmp_path, params, {"model": [weights]}, name="second")
    assert first["image_digest"] != second["image_digest"]
    e1, e2 = _layer_entries(ctx1.out / "image.oci.tar"), _layer_entries(ctx2.out / "image.oci.tar")
    differ = {a[0] for la, lb in zip(e1, e2, strict=True) for a, b in zip(la, lb, strict=True) if a != b}
    assert differ == {"models", "models/tiny-qwen3"}
    files = [e for layer in e1 for e in layer if e[1] == tarfile.REGTYPE]
    assert files and all(e[5] == 0 for e in files)  # the files keep the context's time
    c1, c2 = (oci.read_image(c.out / "image.oci.tar").config for c in (ctx1, ctx2))
    assert c1["created"] != c2["created"]
    assert c1["config"]["Labels"] == c2["config"]["Labels"]
    print(f"\ndocker: image digests {first['image_digest'][:19]} != {second['image_digest'][:19]}; differing "
          f"layer entries: {sorted(differ)} (created {c1['created']} vs {c2['created']})")
