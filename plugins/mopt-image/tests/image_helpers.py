"""Helpers of the image tests (a uniquely named module: every test folder has a `conftest`)."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
from mopt_image.kind import ImageKind
from mopt_image.testing import find_static_busybox

from mopt.api import Artifact, BuildContext, HardwareProfile

needs_buildah = pytest.mark.skipif(
    shutil.which("buildah") is None, reason="buildah is not installed (apt-get install buildah)"
)
needs_busybox = pytest.mark.skipif(
    find_static_busybox() is None, reason="no static busybox (apt-get install busybox-static)"
)

DIGEST = "sha256:" + "0123456789abcdef" * 4
CPU = HardwareProfile(name="cpu", description="any CPU", device="cpu")
H200 = HardwareProfile(name="h200", description="H200", gpu_name="NVIDIA H200", compute_capability=(9, 0),
                       memory_gb=141)


def write_weights(folder: Path) -> Path:
    """A small HF-style model folder (what a `weights` target writes, in miniature)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3Model"], "model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
        "max_position_embeddings": 512, "vocab_size": 1000, "torch_dtype": "float32",
    }))
    (folder / "model.safetensors").write_bytes(bytes(range(256)) * 64)
    (folder / "tokenizer.json").write_text('{"version": "1.0"}')
    return folder


def make_ctx(
    tmp_path: Path,
    params: Any,
    inputs: dict[str, list[Artifact]],
    *,
    name: str = "run",
    hardware: HardwareProfile = CPU,
    offline: bool = False,
) -> BuildContext:
    out, tmp = tmp_path / name / "out", tmp_path / name / "tmp"
    out.mkdir(parents=True)
    tmp.mkdir(parents=True)
    logger = logging.getLogger(f"test-image.{tmp_path.name}.{name}")
    logger.setLevel(logging.INFO)
    return BuildContext(
        out=out, tmp=tmp, params=params, inputs=inputs, model_name="tiny-qwen3", family=None,
        task="embedding", source=None, hardware=hardware, section=f"tiny-qwen3.{hardware.name}",
        target="image", project_dir=tmp_path, logger=logger, offline=offline,
    )


def image_params(**kw: Any) -> Any:
    """ImageKind params as mopt would hand them to run() (validated, bound to a section)."""
    return ImageKind().bind(ImageKind.Params(**kw), model="tiny-qwen3", hardware="cpu", section="tiny-qwen3.cpu")


def artifact(path: Path, kind: str, target: str | None = None, meta: dict[str, Any] | None = None) -> Artifact:
    from mopt.digest import hash_tree

    return Artifact(path, kind, target or kind, hash_tree(path)[0], meta or {})


def serve_artifact(tmp_path: Path, kind: str, model: Artifact, hardware: HardwareProfile = H200,
                   **params: Any) -> Artifact:
    """The real output of mopt-serve's `vllm` / `trtllm` / `triton-repo` kind for `model`."""
    mods = {"vllm": ("mopt_serve.vllm", "VllmKind"), "trtllm": ("mopt_serve.trtllm", "TrtllmKind"),
            "triton-repo": ("mopt_serve.triton", "TritonRepoKind")}
    mod = pytest.importorskip(mods[kind][0], reason="mopt-serve is not installed")
    cls = getattr(mod, mods[kind][1])
    k = cls()
    ctx = make_ctx(tmp_path, cls.Params(**params), {"model": [model]}, name=f"serve-{kind}", hardware=hardware)
    meta = k.run(ctx)
    return artifact(ctx.out, kind, kind, meta)


def tiny_onnx(folder: Path) -> Path:
    """A one-node ONNX graph (what an `onnx` target writes, in miniature)."""
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper

    folder.mkdir(parents=True)
    x = helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"])
    y = helper.make_tensor_value_info("embeddings", TensorProto.INT64, ["batch", "seq"])
    graph = helper.make_graph([helper.make_node("Identity", ["input_ids"], ["embeddings"])], "g", [x], [y])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(folder / "model.onnx"))
    return folder


def docker_why_not() -> str | None:
    """Why the docker tests cannot run here (no SDK, no daemon at DOCKER_HOST), or None."""
    from mopt_image.builders import docker_daemon

    return docker_daemon()[1]


needs_docker = pytest.mark.skipif(
    docker_why_not() is not None,
    reason=f"no docker daemon: {docker_why_not()} (.ci/run starts one and sets DOCKER_HOST)",
)
