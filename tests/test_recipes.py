"""The shipped recipes plan and check (they need the first-party plugins installed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_mopt

ROOT = Path(__file__).resolve().parents[1]


def _needs(*dists: str) -> None:
    import importlib.metadata as md

    for d in dists:
        try:
            md.version(d)
        except md.PackageNotFoundError:
            pytest.skip(f"plugin {d} is not installed (nox -s tests installs every plugin)")


def test_qwen3_recipe_plans_with_sweeps_and_shared_nodes(tmp_path: Path) -> None:
    _needs("mopt-ml", "mopt-tensorrt", "mopt-serve", "mopt-torch")
    proc = run_mopt("plan", str(ROOT / "recipes/qwen3.toml"), "--json", cwd=tmp_path,
                    env={"HF_HUB_CACHE": str(tmp_path / "hf")})
    assert proc.returncode == 0, proc.stderr
    nodes = {n["id"]: n for n in json.loads(proc.stdout)["nodes"]}
    weights = nodes["qwen3-embedding.cpu:weights"]
    assert weights["addresses"] == [f"qwen3-embedding.{s}:weights" for s in ("cpu", "rtx4060", "h100", "h200")]
    assert weights["status"]["state"] == "unavailable"  # the real weights are not in this machine's cache
    engines = [i for i in nodes if i.startswith("qwen3-embedding.h200:trt-engine@")]
    assert len(engines) == 6
    e = nodes["qwen3-embedding.h200:trt-engine@max_batch_size=128,opt_level=5"]
    assert e["inputs"] == {"onnx": ["qwen3-embedding.cpu:onnx"]}
    assert e["params"]["max_seq_len"] == 2048 and e["hardware"] == "h200"
    assert nodes["qwen3-embedding.h100:vllm"]["inputs"]["model"] == ["qwen3-embedding.h100:fp8"]
    assert nodes["qwen3-embedding.cpu:validate[int8]"]["params"]["mean_cosine"] == 0.997


def test_qwen3_recipe_passes_check_with_memory_estimates(tmp_path: Path) -> None:
    _needs("mopt-ml", "mopt-tensorrt", "mopt-serve", "mopt-torch")
    proc = run_mopt("check", str(ROOT / "recipes/qwen3.toml"), "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert not [f for f in data["findings"] if f["severity"] == "error"]
    text = run_mopt("check", str(ROOT / "recipes/qwen3.toml"), cwd=tmp_path).stdout
    assert "qwen3-embedding.rtx4060" in text and "largest that fits" in text


def test_demo_recipe_plans(tmp_path: Path) -> None:
    _needs("mopt-ml")
    proc = run_mopt("plan", str(ROOT / "recipes/demo.toml"), "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    kinds = {n["kind"] for n in json.loads(proc.stdout)["nodes"]}
    assert {"weights", "onnx", "onnx-slim", "ort-quantize", "validate", "bench"} <= kinds


def test_chat_h200_section_serves_a_pretrained_model_and_a_must_fail_variant(tmp_path: Path) -> None:
    """Every served variant of qwen3-chat-0-6b.h200 comes from `pretrained`, which is also each
    serve-check's reference; the must-fail `int2-tensor` is served and checked like the others.
    Explicit inputs fill slots in order: the second hf-checkpoint goes to `reference`, not into
    `model` beside the first (where it used to be dropped without a word)."""
    _needs("mopt-ml", "mopt-serve")
    proc = run_mopt("graph", str(ROOT / "recipes/qwen3-chat.toml"), "qwen3-chat-0-6b.h200", "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    nodes = {n["id"].split(":")[1]: n for n in json.loads(proc.stdout)["nodes"]}
    sec = "qwen3-chat-0-6b.h200"
    assert nodes["pretrained"]["inputs"] == {"model": ["qwen3-chat-0-6b.cpu:weights"]}
    for v, model in (("", "pretrained"), ("-fp8", "fp8"), ("-int2-tensor", "int2-tensor")):
        assert nodes[f"serve-check{v}"]["inputs"] == {
            "serve": [f"{sec}:vllm{v}"], "model": [f"{sec}:{model}"], "reference": [f"{sec}:pretrained"]
        }, v
    assert nodes["int2-tensor"]["kind"] == "rtn" and nodes["fp8"]["inputs"]["model"] == [f"{sec}:pretrained"]
    assert len(nodes["best"]["inputs"]["serve"]) == 3
    plan = run_mopt("plan", str(ROOT / "recipes/qwen3-chat.toml"), "qwen3-chat-0-6b.h200", "--json", cwd=tmp_path)
    params = {n["id"].split(":")[1]: n["params"] for n in json.loads(plan.stdout)["nodes"]}
    assert params["int2-tensor"]["bits"] == 2 and params["int2-tensor"]["scale"] == "tensor"
    assert params["pretrained"]["steps"] == 300 and params["pretrained"]["device"] == "auto"

    # one input too many for the slots that take it: named, with the fix
    text = (ROOT / "recipes/qwen3-chat.toml").read_text().replace(
        'input = ["vllm-fp8", "fp8", "pretrained"]', 'input = ["vllm-fp8", "fp8", "pretrained", "weights"]'
    )
    (tmp_path / "data").symlink_to(ROOT / "recipes/data")
    (tmp_path / "r.toml").write_text(text)
    proc = run_mopt("graph", "r.toml", "qwen3-chat-0-6b.h200", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "input 'weights' (weights) has no slot left: kind 'serve-check' takes one 'model' and one " \
           "'reference' input, already 'fp8', 'pretrained'" in proc.stderr, proc.stderr
    assert "qwen3-chat-0-6b.h200.serve-check-fp8" in proc.stderr and "name each input once" in proc.stderr
