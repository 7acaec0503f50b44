"""A CPU serving image that serves, through the real `mopt` command line: recipes/cpu-serve.toml's
tiny BERT section → ONNX → INT8 → a Debian base image made by mopt (mmdebstrap) → the embed
image, built once with buildah and once with the docker daemon → `container-check` on each:
the container runs with --network host and --restart on-failure, answers /health,
/v1/models and /v1/embeddings (cosine vs fp32 PyTorch), exposes /metrics, serves a bounded
load test with 0 failed requests, comes back healthy after kill -9 of the server inside it,
and is removed afterwards. Needs buildah, mmdebstrap, a docker daemon (DOCKER_HOST; .ci/run
starts one), the Debian mirror and PyPI."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import docker
import pytest
from image_helpers import needs_buildah, needs_docker
from mopt_image.testing import shared_serving_store

pytestmark = [
    needs_buildah,
    needs_docker,
    pytest.mark.skipif(shutil.which("mmdebstrap") is None, reason="mmdebstrap is not installed (apt-get install mmdebstrap)"),
]

RECIPE = Path(__file__).resolve().parents[3] / "recipes" / "cpu-serve.toml"
#: the tiny section of the recipe, plus the same image built by the docker daemon and checked
EXTRA = """
[tiny-bert.cpu]
hardware = "cpu"
targets = ["weights", "onnx", "int8", "base", "image", "check", "deploy", "image-docker", "check-docker"]

[tiny-bert.cpu.image-docker]
kind = "image"
backend = "embed"
builder = "docker"
input = ["int8"]

[tiny-bert.cpu.check-docker]
kind = "container-check"
input = ["image-docker", "weights"]
min_cosine = 0.95
concurrency = [4]
"""


def mopt(project: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 1500):
    full = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "mopt", *args], cwd=project, env=full, capture_output=True,
                          text=True, timeout=timeout, check=False)


def build_served(project: Path) -> tuple[Path, float]:
    text = RECIPE.read_text()
    text = text.replace('[tiny-bert.cpu]\nhardware = "cpu"\n', EXTRA, 1)
    assert "image-docker" in text
    (project / "serve.toml").write_text(text)
    t0 = time.monotonic()
    r = mopt(project, "build", "serve.toml", "tiny-bert.*", "-j", "2")
    wall = time.monotonic() - t0
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    print(f"\nbuild of tiny-bert.* (base image, two images, two container checks; cold unless "
          f"mopt-deploy's test built the shared ones first): {wall:.0f} s")
    print(r.stdout[-3000:] + r.stderr[-3000:])
    return project, wall


def _doc(project: Path, target: str, name: str) -> dict:
    return json.loads((project / "build" / "tiny-bert" / "cpu" / target / name).read_text())


def check_the_base_image_is_debian_packages_pinned_by_digest(served) -> None:
    project, _ = served
    base = _doc(project, "base", "base.json")
    assert base["python"] == "3.11"
    names = {p.split("=")[0] for p in base["packages"]}
    assert {"python3.11-minimal", "libpython3.11-stdlib", "libstdc++6", "libc6"} <= names
    assert not names & {"apt", "perl", "usrmerge"}  # only what the server needs (merged /usr by the hook)
    from mopt_image import oci

    assert oci.read_image(project / "build" / "tiny-bert" / "cpu" / "base" / "image.oci.tar").digest == base["image_digest"]
    image = _doc(project, "image", "image.json")
    assert image["base"]["digest"] == base["image_digest"]
    assert image["labels"]["org.opencontainers.image.base.digest"] == base["image_digest"]
    assert image["base_packages"] == base["packages"]


def check_the_image_serves_and_passes_the_acceptance_check(served, image: str, check: str, builder: str) -> None:
    project, _ = served
    info = _doc(project, image, "image.json")
    assert info["builder"]["name"] == builder and info["backend"] == "embed"
    assert info["smoke_test"]["passed"]
    assert any(p.startswith("onnxruntime==") for p in info["python_packages"])
    doc = _doc(project, check, "serve.json")
    assert doc["passed"], doc["failures"]
    assert doc["image_digest"] == info["image_digest"]
    assert doc["models"] == ["tiny-bert"]
    assert doc["min_cosine"] >= 0.95 and doc["embedding_dim"] == 32
    assert doc["loadtest"] and all(s["errors"] == 0 and s["completed"] == s["requests"] for s in doc["loadtest"])
    assert doc["metrics"]["kept"]["mopt_embed_requests_total"] >= sum(s["requests"] for s in doc["loadtest"])
    assert doc["knee"] is None or doc["knee"]["p99_ms"] <= doc["slo_p99_ms"]
    assert (project / "build" / "tiny-bert" / "cpu" / check / "loadtest.svg").read_text().startswith("<svg")
    rec = doc["recovery"][-1]
    assert rec["recovered"] and rec["restart_count"] == 1 and rec["healthy_after_s"] <= rec["bound_s"]
    assert doc["after_restart_min_cosine"] > 0.99999
    assert doc["container"]["run"] == {"network": "host", "restart": "on-failure", "init": True,
                                       "port": doc["container"]["run"]["port"]}
    log = (project / "build" / "tiny-bert" / "cpu" / check / "server.log").read_text()
    assert log.count("mopt-embed-server: tiny-bert") == 2  # started, killed, started again
    rps = round(max(s["requests_per_s"] for s in doc["loadtest"]), 1)
    print(f"\n{builder}: healthy after {doc['startup_s']} s, min cosine {doc['min_cosine']:.6f}, "
          f"peak {rps} req/s, kill -9 → healthy after {rec['healthy_after_s']} s")


def check_nothing_is_left_in_the_daemon(served) -> None:
    client = docker.from_env()
    try:
        left = client.containers.list(all=True, filters={"label": "dev.mopt.serve-check"})
        assert left == []
        project, _ = served
        ids = {_doc(project, t, "image.json")["image_id"] for t in ("image", "image-docker")}
        assert not ids & {img.id for img in client.images.list(all=True)}
    finally:
        client.close()


def check_without_a_daemon_the_check_says_so_and_the_image_stays_built(served) -> None:
    project, _ = served
    # another gate: a new check action (the passed one is cached), the same image
    text = (project / "serve.toml").read_text()
    text = text.replace("[tiny-bert.cpu.check]\nmin_cosine = 0.95", "[tiny-bert.cpu.check]\nmin_cosine = 0.951", 1)
    assert "0.951" in text
    (project / "nodaemon.toml").write_text(text)
    r = mopt(project, "build", "nodaemon.toml", "tiny-bert.cpu:check", "--no-check",
             env={"DOCKER_HOST": f"unix://{project}/no-such.sock"}, timeout=300)
    assert r.returncode != 0
    out = r.stdout + r.stderr
    assert "no docker daemon answers" in out and "DOCKER_HOST" in out
    assert "was not run or checked" in out
    assert "cached tiny-bert.cpu:image" in out  # the image itself is not rebuilt
    assert (project / "build" / "tiny-bert" / "cpu" / "image" / "image.oci.tar").is_file()



def test_cpu_serving_image_end_to_end(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """One test, so pytest-xdist never builds the (minutes-long) project twice on two workers."""
    with shared_serving_store(tmp_path_factory) as store:
        (tmp_path / "mopt.toml").write_text(f'[store]\npath = "{store}"\n')
        _end_to_end(tmp_path)


def _end_to_end(tmp_path: Path) -> None:
    served = build_served(tmp_path)
    check_the_base_image_is_debian_packages_pinned_by_digest(served)
    check_the_image_serves_and_passes_the_acceptance_check(served, "image", "check", "buildah")
    check_the_image_serves_and_passes_the_acceptance_check(served, "image-docker", "check-docker", "docker")
    check_nothing_is_left_in_the_daemon(served)
    check_without_a_daemon_the_check_says_so_and_the_image_stays_built(served)
