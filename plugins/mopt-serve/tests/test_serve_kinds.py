"""mopt-serve: vLLM / TensorRT-LLM / Triton config generation and checks, on CPU with real
files; launching servers and quantizing only where vLLM / ModelOpt and a GPU exist (`-m gpu`)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from mopt_serve.modelopt_ptq import ModelOptPtqKind
from mopt_serve.serve_check import ServeCheckKind
from mopt_serve.server import cosines
from mopt_serve.triton import TritonRepoKind, config_pbtxt, onnx_io
from mopt_serve.trtllm import TrtllmKind, legacy_commands, llm_api_options, serve_argv
from mopt_serve.vllm import VllmKind, flags, vllm_config
from pydantic import ValidationError

from mopt import plugin_env as _env
from mopt.api import Artifact, BuildContext, CheckContext, HardwareProfile
from mopt.builtin.hardware import PROFILES

HW = {p.name: p for p in PROFILES}
# Qwen3-Embedding-0.6B's config.json (the fields these kinds read)
QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151669,
    "max_position_embeddings": 32768,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
}
MINILM = {"model_type": "bert", "hidden_size": 384, "intermediate_size": 1536, "num_hidden_layers": 6,
          "num_attention_heads": 12, "vocab_size": 30522, "max_position_embeddings": 512}  # fmt: skip


def weights_dir(tmp_path: Path, cfg: dict = QWEN3) -> Path:
    d = tmp_path / "weights"
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def ctx_for(
    tmp_path: Path, kind, inputs: dict, hw: str = "h200", task: str = "embedding", **params
) -> BuildContext:
    out, tmp = tmp_path / "out", tmp_path / "tmp"
    out.mkdir(parents=True)
    tmp.mkdir(parents=True)
    return BuildContext(
        out=out, tmp=tmp, params=kind.Params(**params), inputs=inputs, model_name="qwen3-embedding",
        family=None, task=task, source=None, hardware=HW[hw], section=f"qwen3-embedding.{hw}",
        target=kind.name, project_dir=tmp_path, logger=logging.getLogger("test"),
    )  # fmt: skip


def check(kind, hw, model_config=QWEN3, **params):
    k = kind()
    hwp = hw if isinstance(hw, HardwareProfile) else HW[hw]
    return k.check(k.Params(**params), CheckContext(hwp, model_config, None, "m.hw", kind.name))


def codes(findings, severity="error"):
    return sorted(f.code for f in findings if f.severity == severity)


def art(path: Path, kind: str, target: str | None = None, meta: dict | None = None) -> Artifact:
    return Artifact(path, kind, target or kind, "0" * 64, meta or {})


def test_importing_the_plugin_imports_no_heavy_library():
    code = (
        "import sys, mopt_serve.plugin\n"
        "from mopt.plugins import get_registry\n"
        "assert {'vllm', 'trtllm', 'modelopt-ptq', 'triton-repo', 'serve-check'} <= set(get_registry().targets)\n"
        "print([m for m in ('vllm', 'tensorrt_llm', 'modelopt', 'torch', 'tensorrt', 'onnx') if m in sys.modules])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# --------------------------------------------------------------------------- vllm


def test_vllm_config_for_an_embedding_model(tmp_path):
    w = weights_dir(tmp_path)
    ctx = ctx_for(tmp_path, VllmKind, {"model": [art(w, "weights")]})
    meta = VllmKind().run(ctx)
    text = (ctx.out / "vllm.yaml").read_text()
    cfg = yaml.safe_load(text)
    assert cfg == {
        "served-model-name": "qwen3-embedding",
        "runner": "pooling",
        "dtype": "auto",
        "convert": "embed",
        "max-model-len": 32768,
        "block-size": 16,
        "kv-cache-dtype": "auto",
        "tensor-parallel-size": 1,
        "pipeline-parallel-size": 1,
        "seed": 0,
        "host": "0.0.0.0",
        "port": 8000,
    }
    serve = (ctx.out / "serve.sh").read_text()
    assert 'exec vllm serve "$MODEL_DIR" --config "$HERE/vllm.yaml" "$@"' in serve
    assert str(tmp_path) not in serve + text  # no path of the building machine in the artifact
    args = json.loads((ctx.out / "args.json").read_text())
    assert args["flags"][:5] == ["vllm", "serve", "{model}", "--served-model-name", "qwen3-embedding"]
    assert args["flags"][5:7] == ["--runner", "pooling"] and "--block-size" in args["flags"]
    assert meta["runner"] == "pooling" and meta["quantization"] is None and meta["model_target"] == "weights"


def test_vllm_generate_runner_explicit_values_and_a_modelopt_checkpoint(tmp_path):
    w = weights_dir(tmp_path)
    ctx = ctx_for(
        tmp_path, VllmKind, {"model": [art(w, "modelopt-ptq", "fp4", {"qformat": "nvfp4"})]}, hw="b200",
        task="generation", max_model_len=4096, max_num_batched_tokens=8192, block_size=32, kv_cache_dtype="fp8",
        tensor_parallel_size=1, enforce_eager=True, enable_prefix_caching=False, docker_image="vllm/vllm-openai@sha256:abc",
    )  # fmt: skip
    VllmKind().run(ctx)
    cfg = yaml.safe_load((ctx.out / "vllm.yaml").read_text())
    assert cfg["runner"] == "generate" and cfg["quantization"] == "modelopt_fp4"
    assert cfg["max-model-len"] == 4096 and cfg["max-num-batched-tokens"] == 8192 and cfg["block-size"] == 32
    assert cfg["kv-cache-dtype"] == "fp8" and cfg["enforce-eager"] is True
    assert "--no-enable-prefix-caching" in (ctx.out / "serve.sh").read_text()
    docker = (ctx.out / "docker-run.sh").read_text()
    assert "--gpus all --ipc=host" in docker and '-v "$MODEL_DIR:/models/model:ro"' in docker


def test_vllm_flags_render_booleans_like_vllm():
    p = VllmKind.Params(enforce_eager=True)
    cfg = vllm_config(p, task="embedding", model_config={}, served_name="m", quantization="fp8")
    f = flags(cfg)
    assert "--enforce-eager" in f and f[f.index("--quantization") + 1] == "fp8"
    assert "--max-model-len" not in f  # unknown without a config: left to vLLM


def test_vllm_check_tensor_parallel_and_gpus():
    assert codes(check(VllmKind, "h200", tensor_parallel_size=2)) == ["not-enough-gpus"]
    node = HardwareProfile(name="h200x8", description="8×H200", gpu_name="NVIDIA H200", compute_capability=(9, 0),
                           memory_gb=141, gpu_count=8)  # fmt: skip
    assert codes(check(VllmKind, node, tensor_parallel_size=3)) == ["tp-heads", "tp-kv-heads"]
    assert codes(check(VllmKind, node, tensor_parallel_size=8)) == []


def test_vllm_check_pooling_batch_limits_quantization_and_cpu():
    # chunked prefill: causal attention with last-token pooling may batch fewer tokens than a
    # sequence; an encoder (MEAN / CLS pooling) may not, and fewer tokens than sequences never
    assert codes(check(VllmKind, "h200", max_model_len=8192, max_num_batched_tokens=4096)) == []
    f = check(VllmKind, "h200", MINILM, max_model_len=512, max_num_batched_tokens=256)
    assert codes(f) == ["batched-tokens-below-len"]
    f = check(VllmKind, "h200", max_num_seqs=512, max_num_batched_tokens=256)
    assert codes(f) == ["batched-tokens-below-seqs"]
    assert codes(check(VllmKind, "h200", max_model_len=8192)) == []
    # beyond the position embeddings vLLM refuses to start, unless told to allow it
    assert codes(check(VllmKind, "h200", max_model_len=40000)) == ["len-beyond-model"]
    f = check(VllmKind, "h200", max_model_len=40000, allow_long_max_model_len=True)
    assert codes(f) == [] and codes(f, "warning") == ["len-beyond-model"]
    assert codes(check(VllmKind, "h200", {**QWEN3, "rope_scaling": {"type": "yarn", "factor": 4.0}},
                       max_model_len=40000)) == []  # fmt: skip
    assert codes(check(VllmKind, "a10", quantization="modelopt_fp4")) == ["precision-unsupported"]
    assert codes(check(VllmKind, "a10", quantization="fp8"), "warning") == ["precision-unsupported"]
    assert codes(check(VllmKind, "cpu"), "warning") == ["vllm-on-cpu"]


def test_mopt_check_runs_these_kinds_with_the_core_memory_estimator(tmp_path):
    """The whole `mopt check` path: recipe → graph → the core's generic rules and memory
    estimator (driven by each kind's `memory_model`) → the kinds' own findings."""
    from mopt.check import run_checks
    from mopt.graph import build_graph
    from mopt.plugins import get_registry
    from mopt.recipe import load_recipe

    reg = get_registry()
    if "weights" not in reg.targets or "qwen3" not in reg.families:
        pytest.skip("needs the mopt-ml plugin (weights kind, qwen3 family)")
    weights_dir(tmp_path)
    (tmp_path / "r.toml").write_text(
        'schema = 1\n[models.q]\nfamily = "qwen3"\nsource = { path = "weights" }\nconfig = "weights/config.json"\n'
        '[q.rtx]\nhardware = "rtx4060-laptop"\ntargets = ["weights", "vllm"]\n'
        "[q.rtx.vllm]\nmax_model_len = 32768\ngpu_memory_utilization = 0.5\n"
        '[q.h200]\nhardware = "h200"\ntargets = ["weights", "vllm", "trtllm"]\n'
        "[q.h200.vllm]\ntensor_parallel_size = 3\nmax_model_len = 8192\nmax_num_seqs = 64\n"
        "[q.h200.trtllm]\ntokens_per_block = 48\nmax_seq_len = 8192\nmax_batch_size = 64\n"
    )
    graph = build_graph(load_recipe(tmp_path / "r.toml", reg), reg)
    errors = sorted(
        (f.section, f.target, f.code) for f in run_checks(graph).findings if f.severity == "error"
    )
    assert errors == [
        ("q.h200", "trtllm", "tokens-per-block"),
        ("q.h200", "vllm", "not-enough-gpus"),
        ("q.h200", "vllm", "tp-heads"),
        ("q.h200", "vllm", "tp-kv-heads"),
        ("q.rtx", "vllm", "kv-cache-too-small"),  # the core's estimator: 32k tokens of KV do not fit
    ]


# --------------------------------------------------------------------------- trtllm


def test_trtllm_llm_api_yaml_and_command_line(tmp_path):
    w = weights_dir(tmp_path)
    ctx = ctx_for(tmp_path, TrtllmKind, {"model": [art(w, "weights")]}, max_batch_size=64, max_num_tokens=4096,
                  free_gpu_memory_fraction=0.85, tokens_per_block=64)  # fmt: skip
    meta = TrtllmKind().run(ctx)
    opts = yaml.safe_load((ctx.out / "extra_llm_api_options.yaml").read_text())
    assert opts == {  # `backend` is on the command line (a deprecated LlmArgs field)
        "dtype": "auto",
        "tensor_parallel_size": 1,
        "pipeline_parallel_size": 1,
        "max_batch_size": 64,
        "max_num_tokens": 4096,
        "max_seq_len": 32768,
        "kv_cache_config": {
            "free_gpu_memory_fraction": 0.85,
            "tokens_per_block": 64,
            "enable_block_reuse": True,
            "dtype": "auto",
        },
        "trust_remote_code": False,
    }
    argv = json.loads((ctx.out / "args.json").read_text())["argv"]
    assert argv[:3] == ["trtllm-serve", "serve", "{model}"]
    s = " ".join(argv)
    for part in ("--backend pytorch", "--max_batch_size 64", "--max_num_tokens 4096", "--max_seq_len 32768",
                 "--tp_size 1", "--pp_size 1", "--kv_cache_free_gpu_memory_fraction 0.85",
                 "--extra_llm_api_options {here}/extra_llm_api_options.yaml"):  # fmt: skip
        assert part in s
    assert '--extra_llm_api_options "$HERE/extra_llm_api_options.yaml"' in (ctx.out / "serve.sh").read_text()
    assert meta["flow"] == "llm-api" and TrtllmKind().requirements(ctx.params, HW["h200"]) == []


def test_trtllm_extra_options_merge_into_nested_tables():
    p = TrtllmKind.Params(extra={"kv_cache_config": {"max_tokens": 100000}, "enable_chunked_prefill": True})
    opts = llm_api_options(p, {})
    assert (
        opts["kv_cache_config"]["max_tokens"] == 100000 and opts["kv_cache_config"]["tokens_per_block"] == 32
    )
    assert opts["enable_chunked_prefill"] is True and "max_seq_len" not in opts


def test_trtllm_legacy_engine_only_for_pinned_releases_up_to_1_2():
    with pytest.raises(ValidationError, match="needs trtllm_version"):
        TrtllmKind.Params(flow="legacy-engine")
    with pytest.raises(ValidationError, match=r"<= 1\.2"):
        TrtllmKind.Params(flow="legacy-engine", trtllm_version="1.3.0rc5")
    p = TrtllmKind.Params(flow="legacy-engine", trtllm_version="1.2.0", tp_size=2, max_seq_len=2048)
    assert TrtllmKind().requirements(p, HW["h200"]) == ["gpu", "hardware", "python:tensorrt_llm"]
    convert, build = legacy_commands(p, QWEN3, "python", "convert_checkpoint.py", "ckpt", "engine")
    assert convert == ["python", "convert_checkpoint.py", "--model_dir", "{model}", "--output_dir", "ckpt",
                       "--dtype", "float16", "--tp_size", "2", "--pp_size", "1"]  # fmt: skip
    b = " ".join(build)
    for part in ("--gemm_plugin auto", "--max_batch_size 256", "--max_input_len 2048", "--max_seq_len 2048",
                 "--max_num_tokens 8192", "--kv_cache_type paged", "--tokens_per_block 32",
                 "--remove_input_padding enable", "--context_fmha enable", "--max_beam_width 1"):  # fmt: skip
        assert part in b
    legacy = serve_argv(p, QWEN3, model="{here}/engine")
    assert legacy[2:7] == ["{here}/engine", "--tokenizer", "{model}", "--backend", "tensorrt"]
    assert "--extra_llm_api_options" not in legacy


def test_trtllm_check_tokens_per_block_heads_and_gpus():
    assert codes(check(TrtllmKind, "h200", tokens_per_block=48)) == ["tokens-per-block"]
    assert codes(check(TrtllmKind, "h200", tp_size=2)) == ["not-enough-gpus"]
    big = HardwareProfile(name="h200x16", description="16×H200", gpu_name="NVIDIA H200", compute_capability=(9, 0),
                          memory_gb=141, gpu_count=16)  # fmt: skip
    assert codes(check(TrtllmKind, big, tp_size=3)) == ["tp-heads", "tp-kv-heads"]
    f = check(TrtllmKind, big, tp_size=16)
    assert codes(f) == [] and "tp-kv-replicated" in codes(f, "warning")
    assert codes(check(TrtllmKind, "cpu")) == ["engine-on-cpu"]
    assert codes(check(TrtllmKind, "a10", kv_cache_dtype="fp8")) == ["precision-unsupported"]
    assert codes(check(TrtllmKind, "h200", MINILM)) == ["encoder-model"]
    assert "trtllm-embeddings" in codes(check(TrtllmKind, "h200"), "warning")


# --------------------------------------------------------------------------- modelopt-ptq, serve-check


def test_modelopt_ptq_formats_are_gated_on_the_profile():
    assert codes(check(ModelOptPtqKind, "a10", qformat="fp8", calib_texts="c.txt")) == [
        "precision-unsupported"
    ]
    assert codes(check(ModelOptPtqKind, "h200", qformat="nvfp4", calib_texts="c.txt")) == [
        "precision-unsupported"
    ]
    assert codes(check(ModelOptPtqKind, "b200", qformat="nvfp4", calib_texts="c.txt")) == []
    assert codes(check(ModelOptPtqKind, "h200", MINILM, qformat="fp8", calib_texts="c.txt")) == [
        "encoder-model"
    ]
    assert codes(
        check(ModelOptPtqKind, "h200", calib_texts="c.txt", calib_size=32, validate_texts="v.txt"), "warning"
    ) == ["calib-size"]
    assert codes(check(ModelOptPtqKind, "h200", calib_texts="c.txt"), "warning") == ["no-heldout"]


def test_modelopt_qformats_vllm_does_not_load_are_refused_with_the_reason():
    """Measured on the H200 (2026-12-01): vLLM 0.26 refuses ModelOpt's INT4 AWQ and INT8
    SmoothQuant exports; TensorRT-LLM is the engine for them."""
    for q in ("int4_awq", "int8_sq", "w4a8_awq"):
        f = check(ModelOptPtqKind, "h200", qformat=q, calib_texts="c.txt", validate_texts="v.txt")
        assert codes(f) == ["qformat-not-served"]
        assert "vLLM 0.26 does not load" in f[0].message and f[0].key == "qformat"
    assert (
        codes(
            check(ModelOptPtqKind, "h200", qformat="int4_awq", calib_texts="c.txt", serve_with="tensorrt-llm")
        )
        == []
    )
    assert codes(check(ModelOptPtqKind, "h200", qformat="fp8", calib_texts="c.txt")) == []


@pytest.mark.skipif(_env.has_module("modelopt"), reason="modelopt is installed here")
def test_modelopt_ptq_without_modelopt_fails_naming_the_package(tmp_path):
    w = weights_dir(tmp_path)
    ctx = ctx_for(tmp_path, ModelOptPtqKind, {"model": [art(w, "weights")]}, calib_texts="c.txt")
    with pytest.raises(RuntimeError, match=r"'modelopt'.*nvidia-modelopt"):
        ModelOptPtqKind().run(ctx)


@pytest.mark.skipif(_env.has_module("vllm"), reason="vllm is installed here")
def test_serve_check_without_vllm_fails_naming_the_package(tmp_path):
    w = weights_dir(tmp_path)
    ctx = ctx_for(tmp_path, ServeCheckKind, {"serve": [art(tmp_path, "vllm")], "model": [art(w, "weights")],
                                             "reference": [art(w, "weights")]})  # fmt: skip
    assert ServeCheckKind().requirements(ctx.params, HW["h200"]) == [
        "gpu", "hardware", "python:vllm", "python:torch", "python:transformers"
    ]  # fmt: skip
    with pytest.raises(RuntimeError, match=r"'vllm'.*pip install vllm"):
        ServeCheckKind().run(ctx)


def test_cosines():
    assert cosines([[1.0, 0.0], [1.0, 1.0]], [[2.0, 0.0], [1.0, -1.0]]) == [1.0, 0.0]


# --------------------------------------------------------------------------- triton-repo


def tiny_onnx(path: Path, batch_axis: bool = True) -> Path:
    """A real ONNX embedding model exported with torch: (input_ids, attention_mask) → [batch, 8]."""
    import torch

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(100, 8)

        def forward(self, input_ids, attention_mask):
            h = self.emb(input_ids) * attention_mask.unsqueeze(-1).float()
            return torch.nn.functional.normalize(h.sum(1), dim=-1)

    path.parent.mkdir(parents=True, exist_ok=True)
    ids = torch.ones(2, 5, dtype=torch.long)
    axes = {
        "input_ids": {0: "batch", 1: "seq"},
        "attention_mask": {0: "batch", 1: "seq"},
        "mopt_embedding": {0: "batch"},
    }
    torch.onnx.export(Tiny(), (ids, ids), str(path), input_names=["input_ids", "attention_mask"],
                      output_names=["mopt_embedding"], dynamic_axes=axes if batch_axis else None, dynamo=False)  # fmt: skip
    return path


def test_triton_repository_for_an_onnx_artifact(tmp_path):
    src = tmp_path / "onnx"
    tiny_onnx(src / "model.onnx")
    (src / "tokenizer.json").write_text("{}")
    ctx = ctx_for(tmp_path, TritonRepoKind, {"model": [art(src, "onnx")]}, max_batch_size=64,
                  preferred_batch_size=[16, 32], max_queue_delay_microseconds=500)  # fmt: skip
    meta = TritonRepoKind().run(ctx)
    assert (ctx.out / "qwen3-embedding" / "config.pbtxt").read_text() == (
        'name: "qwen3-embedding"\n'
        'platform: "onnxruntime_onnx"\n'
        "max_batch_size: 64\n"
        "input [\n"
        "  {\n"
        '    name: "input_ids"\n'
        "    data_type: TYPE_INT64\n"
        "    dims: [ -1 ]\n"
        "  },\n"
        "  {\n"
        '    name: "attention_mask"\n'
        "    data_type: TYPE_INT64\n"
        "    dims: [ -1 ]\n"
        "  }\n"
        "]\n"
        "output [\n"
        "  {\n"
        '    name: "mopt_embedding"\n'
        "    data_type: TYPE_FP32\n"
        "    dims: [ 8 ]\n"
        "  }\n"
        "]\n"
        "instance_group [\n"
        "  {\n"
        "    count: 1\n"
        "    kind: KIND_GPU\n"
        "  }\n"
        "]\n"
        "dynamic_batching {\n"
        "  preferred_batch_size: [ 16, 32 ]\n"
        "  max_queue_delay_microseconds: 500\n"
        "}\n"
    )
    copied = ctx.out / "qwen3-embedding" / "1" / "model.onnx"
    assert copied.read_bytes() == (src / "model.onnx").read_bytes()
    assert meta["platform"] == "onnxruntime_onnx" and meta["outputs"] == ["mopt_embedding"]


def test_triton_cpu_profile_and_fixed_batch_axis(tmp_path):
    path = tiny_onnx(tmp_path / "fixed" / "model.onnx", batch_axis=False)
    io = onnx_io(path)
    assert io["inputs"][0]["shape"] == [2, 5]
    with pytest.raises(ValueError, match="max_batch_size = 0"):
        config_pbtxt("m", "onnxruntime_onnx", io, TritonRepoKind.Params(max_batch_size=8), gpu=False)
    text = config_pbtxt("m", "onnxruntime_onnx", io, TritonRepoKind.Params(max_batch_size=0), gpu=False)
    assert "dims: [ 2, 5 ]" in text and "kind: KIND_CPU" in text and "dynamic_batching" not in text


def test_triton_repository_for_a_trt_engine_reads_its_io_json(tmp_path):
    eng = tmp_path / "engine"
    eng.mkdir()
    (eng / "engine.plan").write_bytes(b"plan")
    io = {
        "inputs": [{"name": "input_ids", "dtype": "int64", "shape": [-1, -1],
                    "profile": {"min": [1, 1], "opt": [32, 512], "max": [32, 512]}}],
        "outputs": [{"name": "mopt_embedding", "dtype": "float32", "shape": [-1, 1024]}],
    }  # fmt: skip
    (eng / "io.json").write_text(json.dumps(io))
    ctx = ctx_for(tmp_path, TritonRepoKind, {"model": [art(eng, "trt-engine")]}, max_batch_size=32)
    TritonRepoKind().run(ctx)
    text = (ctx.out / "qwen3-embedding" / "config.pbtxt").read_text()
    assert (
        'platform: "tensorrt_plan"' in text and "dims: [ 1024 ]" in text and "data_type: TYPE_INT64" in text
    )
    assert (ctx.out / "qwen3-embedding" / "1" / "model.plan").read_bytes() == b"plan"
    ctx2 = ctx_for(tmp_path / "b", TritonRepoKind, {"model": [art(eng, "trt-engine")]}, max_batch_size=64)
    with pytest.raises(ValueError, match="profile max batch 32"):
        TritonRepoKind().run(ctx2)


def test_triton_check_preferred_sizes():
    assert codes(check(TritonRepoKind, "h200", max_batch_size=16, preferred_batch_size=[8, 32])) == [
        "preferred-batch"
    ]
    assert codes(check(TritonRepoKind, "cpu", instance_kind="gpu")) == ["engine-on-cpu"]


# --------------------------------------------------------------------------- the real things


def test_triton_takes_the_hidden_size_from_the_onnx_kinds_metadata(tmp_path):
    from mopt_serve.triton import fill_hidden_size

    (tmp_path / "mopt_ml.json").write_text(json.dumps({"output": "mopt_embedding", "hidden_size": 1024}))
    io = {"inputs": [], "outputs": [{"name": "mopt_embedding", "data_type": "TYPE_FP32", "shape": [-1, -1]}]}
    assert fill_hidden_size(io, tmp_path)["outputs"][0]["shape"] == [-1, 1024]


def test_config_kinds_fingerprint_nothing_so_any_machine_shares_their_cache_entries():
    assert VllmKind().fingerprint() == {} and TrtllmKind().fingerprint() == {}
    assert set(ServeCheckKind().fingerprint()) == {"vllm", "torch", "gpu", "compute_capability"}
    assert set(ModelOptPtqKind().fingerprint()) == {"nvidia-modelopt", "torch", "transformers"}


def test_triton_repository_for_a_selected_winner(tmp_path):
    # a `select` output is its winner's files, with the winner's kind in its metadata
    src = tmp_path / "best"
    tiny_onnx(src / "model.onnx")
    (src / "selection.json").write_text("{}")
    winner = Artifact(src, "select", "best", "d-best", {"winner": "int8@a", "winner_kind": "ort-quantize"})
    ctx = ctx_for(tmp_path, TritonRepoKind, {"model": [winner]}, max_batch_size=8)
    TritonRepoKind().run(ctx)
    config = (ctx.out / "qwen3-embedding" / "config.pbtxt").read_text()
    assert 'platform: "onnxruntime_onnx"' in config
    assert (ctx.out / "qwen3-embedding" / "1" / "model.onnx").is_file()
    assert "select" in TritonRepoKind.consumes[0].kinds
