"""The image kind through the real `mopt` command line: a recipe builds an image from a local
base archive, twice from a clean store to the same digest; a tag-only base is a recipe error;
without a builder the target is unbuildable with the reason; `mopt image path|push` find
the archive in the store."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from image_helpers import needs_buildah
from mopt_image.testing import BaseImage, find_static_busybox, make_busybox_base

pytestmark = needs_buildah

RECIPE = """\
schema = 1

[models.toy]
family = "generic"
task = "embedding"
source = {{ path = "toy" }}

[toy.cpu]
hardware = "cpu"
targets = ["fake-weights", "image"]

[toy.cpu.fake-weights]            # stands in for a weights target: a small model folder
kind = "command"
argv = ["sh", "-c", "mkdir -p {{out}}/m && printf '{{\\"model_type\\": \\"toy\\"}}' > {{out}}/m/config.json && printf abc > {{out}}/m/model.safetensors"]

[toy.cpu.image]
input = ["fake-weights"]
base_archive = "bases/busybox.oci.tar"
base_digest = "{digest}"
{extra}
"""


def mopt(project: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "DOCKER_HOST": "unix:///nonexistent/docker.sock", **(env or {})}
    full.pop("MOPT_DISABLE_PLUGINS", None)
    return subprocess.run([sys.executable, "-m", "mopt", *args], cwd=project, env=full, capture_output=True,
                          text=True, timeout=300)


@pytest.fixture
def project(tmp_path: Path) -> tuple[Path, BaseImage]:
    if find_static_busybox() is None:
        pytest.skip("no static busybox (apt-get install busybox-static)")
    (tmp_path / "bases").mkdir()
    base = make_busybox_base(tmp_path / "bases" / "busybox.oci.tar")
    (tmp_path / "toy").mkdir()
    (tmp_path / "toy" / "config.json").write_text("{}")
    (tmp_path / "mopt.toml").write_text('[store]\npath = ".mopt"\n')
    (tmp_path / "r.toml").write_text(RECIPE.format(digest=base.digest, extra=""))
    return tmp_path, base


def image_json(project: Path) -> dict:
    return json.loads((project / "build" / "toy" / "cpu" / "image" / "image.json").read_text())


def test_recipe_builds_the_same_image_twice_from_a_clean_store(project) -> None:
    root, base = project
    first = mopt(root, "build", "r.toml")
    assert first.returncode == 0, first.stderr + first.stdout
    info = image_json(root)
    assert info["smoke_test"]["passed"]
    assert info["base"]["digest"] == base.digest
    assert info["labels"]["dev.mopt.section"] == "toy.cpu"
    assert (root / "build/toy/cpu/image/image.oci.tar").is_file()
    # a no-op build takes the cache hit
    again = mopt(root, "build", "r.toml")
    assert again.returncode == 0 and "2 cached" in again.stdout + again.stderr
    # a clean store and build folder: the same image digest
    shutil.rmtree(root / ".mopt", ignore_errors=True)
    subprocess.run(["chmod", "-R", "u+w", str(root / "build")], check=True)
    shutil.rmtree(root / "build")
    clean = mopt(root, "build", "r.toml")
    assert clean.returncode == 0, clean.stderr + clean.stdout
    assert image_json(root)["image_digest"] == info["image_digest"]
    assert image_json(root) == info  # every field, the context digest included
    # the base archive's bytes are part of the key (a fixed-output input)
    explain = mopt(root, "explain", "r.toml", "toy.cpu:image", "--json")
    assert explain.returncode == 0, explain.stderr
    files = json.loads(explain.stdout)["parts"]["files"]
    assert list(files) == ["bases/busybox.oci.tar"]

    # `mopt image path|push`: the plugin's commands, added through mopt_register_commands
    res = mopt(root, "image", "path", "r.toml", "toy.cpu:image")
    assert res.returncode == 0, res.stderr + res.stdout
    archive = Path(res.stdout.strip().splitlines()[-1])
    assert archive.read_bytes() == (root / "build/toy/cpu/image/image.oci.tar").read_bytes()
    dest = root / "pushed.tar"
    res = mopt(root, "image", "push", "r.toml", "toy.cpu:image", f"oci-archive:{dest}")
    assert res.returncode == 0, res.stderr + res.stdout
    assert dest.is_file()


def test_a_tag_only_base_is_a_recipe_error(project) -> None:
    root, _ = project
    (root / "bad.toml").write_text(
        RECIPE.format(digest="", extra="").replace('base_archive = "bases/busybox.oci.tar"\nbase_digest = ""\n',
                                                    'base = "vllm/vllm-openai:latest"\n')
    )
    res = mopt(root, "plan", "bad.toml")
    assert res.returncode == 2
    assert "bad.toml" in res.stderr and "base" in res.stderr
    assert "not pinned by digest" in res.stderr and "vllm/vllm-openai@sha256:<digest>" in res.stderr


def test_without_a_builder_the_image_is_unbuildable_with_the_reason(project, tmp_path: Path) -> None:
    root, _ = project
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("sh", "mkdir", "printf"):  # what the command target needs, and no buildah
        found = shutil.which(tool)
        if found:
            (bin_dir / tool).symlink_to(found)
    res = mopt(root, "build", "r.toml", env={"PATH": str(bin_dir)})
    assert res.returncode == 1
    out = res.stdout + res.stderr
    assert "unbuildable here: tool 'buildah' not found on PATH" in out, out


def test_check_warns_when_no_builder_is_available(project, tmp_path: Path) -> None:
    root, _ = project
    res = mopt(root, "check", "r.toml", env={"PATH": str(tmp_path / "empty")})
    out = res.stdout + res.stderr
    assert "image-builder-missing" in out or "cannot build images" in out, out


def test_recipe_level_params_reach_the_dockerfile(project) -> None:
    root, _ = project
    extra = textwrap.dedent("""\
        command = ["sh", "-c", "echo serving"]
        healthcheck = "test -f /opt/mopt/files/fake-weights/m/config.json"
        env = { MODE = "prod" }
        """)
    (root / "r.toml").write_text(RECIPE.format(digest=project[1].digest, extra=extra))
    res = mopt(root, "build", "r.toml")
    assert res.returncode == 0, res.stderr + res.stdout
    df = (root / "build/toy/cpu/image/Dockerfile").read_text()
    assert 'COPY ["files/fake-weights/", "/opt/mopt/files/fake-weights/"]' in df
    assert 'ENTRYPOINT ["sh", "-c", "echo serving"]' in df
    assert "HEALTHCHECK --interval=30s --timeout=10s --start-period=10m --retries=3 CMD test -f" in df
    assert 'ENV MODE="prod"' in df


DEMO = """\
schema = 1

[models.tiny-qwen3]               # the demo recipe's seeded tiny Qwen3 (real architecture)
family = "qwen3"
task = "embedding"
source = {{ synthetic = "qwen3", seed = 0, config = {{ hidden_size = 64, num_hidden_layers = 2, num_attention_heads = 4, num_key_value_heads = 2, head_dim = 16, intermediate_size = 128 }} }}

[tiny-qwen3.h200]
hardware = "h200"
targets = ["weights", "vllm", "image"]

[tiny-qwen3.h200.image]
base = "vllm/vllm-openai@{digest}"   # named as the registry image; its bytes come from the archive
base_archive = "bases/base.oci.tar"
"""


def _kinds() -> set[str]:
    from mopt.plugins import get_registry

    return set(get_registry([]).targets)


def test_demo_weights_to_vllm_to_image_twice_from_clean_stores(tmp_path: Path) -> None:
    """The real chain: weights (mopt-ml) → vllm config (mopt-serve) → image, offline, on a
    stand-in base whose `vllm` only prints its arguments (nothing here can run vLLM)."""
    missing = {"weights", "vllm"} - _kinds()
    if missing:
        pytest.skip(f"kinds {sorted(missing)} are not installed (mopt-ml, mopt-serve)")
    if find_static_busybox() is None:
        pytest.skip("no static busybox (apt-get install busybox-static)")
    from mopt_image.testing import fake_server

    (tmp_path / "bases").mkdir()
    base = make_busybox_base(tmp_path / "bases" / "base.oci.tar", extra={"usr/local/bin/vllm": (fake_server("vllm"), 0o755)})
    (tmp_path / "mopt.toml").write_text('[store]\npath = ".mopt"\n')
    (tmp_path / "demo.toml").write_text(DEMO.format(digest=base.digest))
    digests = []
    for _ in range(2):
        res = mopt(tmp_path, "build", "demo.toml", "--offline")
        assert res.returncode == 0, res.stderr + res.stdout
        info = json.loads((tmp_path / "build/tiny-qwen3/h200/image/image.json").read_text())
        digests.append(info["image_digest"])
        assert info["backend"] == "vllm" and info["smoke_test"]["passed"]
        assert info["entrypoint"][:5] == ["vllm", "serve", "/models/tiny-qwen3", "--config", "/opt/mopt/serve/vllm.yaml"]
        subprocess.run(["chmod", "-R", "u+w", str(tmp_path / "build")], check=True)
        shutil.rmtree(tmp_path / "build")
        shutil.rmtree(tmp_path / ".mopt")
    assert digests[0] == digests[1]
    print(f"\nimage digest of the demo chain, two clean stores: {digests[0]}")
