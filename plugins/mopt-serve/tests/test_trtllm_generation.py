"""The `trtllm` kind for a text-generation model (Qwen3-0.6B): the LLM-API YAML and the
`trtllm-serve serve` line it writes, and its checks. TensorRT-LLM cannot be installed here
(NVIDIA's index only), so the config is tested, never run; the option names follow
tensorrt_llm/llmapi/llm_args.py (TorchLlmArgs, KvCacheConfig, CudaGraphConfig,
SchedulerConfig) and tensorrt_llm/commands/serve.py as read 2026-12."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import yaml
from mopt_serve.trtllm import TrtllmKind, chunked_prefill, llm_api_options, serve_argv

from mopt.api import Artifact, BuildContext, CheckContext, HardwareProfile
from mopt.builtin.hardware import PROFILES

HW = {p.name: p for p in PROFILES}
# Qwen3-0.6B's config.json (the fields the kind reads)
CHAT = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
}
GEN = "text-generation"


def run(tmp_path: Path, **params):
    w = tmp_path / "weights"
    w.mkdir()
    (w / "config.json").write_text(json.dumps(CHAT))
    out, tmp = tmp_path / "out", tmp_path / "tmp"
    out.mkdir()
    tmp.mkdir()
    ctx = BuildContext(
        out=out,
        tmp=tmp,
        params=TrtllmKind.Params(**params),
        inputs={"model": [Artifact(w, "weights", "weights", "0" * 64)]},
        model_name="qwen3-chat",
        family=None,
        task=GEN,
        source=None,
        hardware=HW["h200"],
        section="qwen3-chat.h200",
        target="trtllm",
        project_dir=tmp_path,
        logger=logging.getLogger("test"),
    )
    meta = TrtllmKind().run(ctx)
    return (
        meta,
        yaml.safe_load((out / "extra_llm_api_options.yaml").read_text()),
        json.loads((out / "args.json").read_text())["argv"],
    )


def check(hw, task=GEN, cfg=CHAT, **params):
    k = TrtllmKind()
    hwp = hw if isinstance(hw, HardwareProfile) else HW[hw]
    return k.check(k.Params(**params), CheckContext(hwp, cfg, None, "qwen3-chat.hw", "trtllm", task=task))


def codes(findings, severity="error"):
    return sorted(f.code for f in findings if f.severity == severity)


def test_chat_config_for_the_h200(tmp_path):
    meta, opts, argv = run(
        tmp_path,
        max_batch_size=64,
        max_num_tokens=8192,
        free_gpu_memory_fraction=0.85,
        tokens_per_block=32,
        kv_cache_dtype="fp8",
    )
    assert opts == {
        "dtype": "auto",
        "tensor_parallel_size": 1,
        "pipeline_parallel_size": 1,
        "max_batch_size": 64,
        "max_num_tokens": 8192,
        "max_seq_len": 40960,  # null in the recipe: the model's max_position_embeddings
        "kv_cache_config": {
            "free_gpu_memory_fraction": 0.85,
            "tokens_per_block": 32,
            "enable_block_reuse": True,
            "dtype": "fp8",
        },
        "max_beam_width": 1,
        "enable_chunked_prefill": True,  # 8192 tokens per pass < a 40960-token prompt
        "scheduler_config": {"capacity_scheduler_policy": "GUARANTEED_NO_EVICT"},
        "cuda_graph_config": {"enable_padding": True, "max_batch_size": 64},
        "trust_remote_code": False,
    }
    assert meta["options"] == opts
    s = " ".join(argv)
    for part in (
        "trtllm-serve serve {model}",
        "--backend pytorch",
        "--max_batch_size 64",
        "--max_num_tokens 8192",
        "--max_seq_len 40960",
        "--tp_size 1",
        "--pp_size 1",
        "--kv_cache_free_gpu_memory_fraction 0.85",
        "--max_beam_width 1",
        "--enable_chunked_prefill",
        "--extra_llm_api_options {here}/extra_llm_api_options.yaml",
    ):
        assert part in s, part


def test_generation_options_follow_the_params():
    p = TrtllmKind.Params(
        max_seq_len=4096,
        max_num_tokens=8192,
        cuda_graph=False,
        kv_cache_max_tokens=200_000,
        capacity_scheduler_policy="MAX_UTILIZATION",
        reasoning_parser="qwen3",
        tp_size=2,
    )
    opts = llm_api_options(p, CHAT, GEN)
    assert opts["enable_chunked_prefill"] is False and not chunked_prefill(
        p, CHAT
    )  # a whole prompt fits a pass
    assert opts["cuda_graph_config"] is None  # null in the YAML turns CUDA graphs off
    assert opts["kv_cache_config"]["max_tokens"] == 200_000
    assert opts["scheduler_config"] == {"capacity_scheduler_policy": "MAX_UTILIZATION"}
    assert opts["reasoning_parser"] == "qwen3" and opts["tensor_parallel_size"] == 2
    argv = serve_argv(p, CHAT, task=GEN)
    assert "--enable_chunked_prefill" not in argv and argv[argv.index("--reasoning_parser") + 1] == "qwen3"
    # the embedding config is what it was: no generation keys
    emb = llm_api_options(TrtllmKind.Params(), CHAT)
    assert not {"enable_chunked_prefill", "cuda_graph_config", "scheduler_config", "max_beam_width"} & set(
        emb
    )


def test_generation_checks_with_their_messages():
    f = check("h200", max_seq_len=65536)
    assert codes(f) == ["len-beyond-model"]
    (e,) = f
    assert e.message.startswith("max_seq_len 65536 exceeds the model's max_position_embeddings 40960")
    assert e.fix == "max_seq_len ≤ 40960, or null (TensorRT-LLM takes the model's)" and e.key == "max_seq_len"
    # for an embedding model the same setting stays a warning
    assert codes(check("h200", task="embedding", max_seq_len=65536), "warning") == [
        "len-beyond-model",
        "trtllm-embeddings",
    ]
    f = check("h200", enable_chunked_prefill=False, max_num_tokens=8192)
    assert codes(f) == ["num-tokens-below-seq"]
    assert f[0].message == (
        "enable_chunked_prefill = false with max_num_tokens 8192 < max_seq_len 40960: a prompt longer than 8192 "
        "tokens cannot be scheduled"
    )
    assert f[0].fix == "enable_chunked_prefill = true (or null), or max_num_tokens ≥ 40960"
    assert codes(check("h200", cuda_graph_max_batch_size=512, max_batch_size=64), "warning") == [
        "cuda-graph-batch"
    ]
    big = HardwareProfile(
        name="h200x4",
        description="4×H200",
        gpu_name="NVIDIA H200",
        compute_capability=(9, 0),
        memory_gb=141,
        gpu_count=4,
    )
    assert codes(check(big, tp_size=3)) == ["tp-heads", "tp-kv-heads"]
    assert codes(check(big, tp_size=4)) == [] and codes(check("h200")) == []
    assert "trtllm-embeddings" not in codes(check("h200"), "warning")  # a chat model: no embedding caveat
    assert codes(check("a10", kv_cache_dtype="fp8")) == ["precision-unsupported"]


def test_mopt_check_of_a_chat_recipe_with_trtllm(tmp_path):
    """recipe → graph → generic rules (KV cache from free_gpu_memory_fraction of what the
    weights leave, memory_model "trtllm") → the kind's own findings, for task text-generation."""
    import pytest

    from mopt.check import run_checks
    from mopt.graph import build_graph
    from mopt.plugins import get_registry
    from mopt.recipe import load_recipe

    reg = get_registry()
    fam = reg.families.get("qwen3")
    if "weights" not in reg.targets or fam is None or "text-generation" not in getattr(fam, "tasks", ()):
        pytest.skip("needs the mopt-ml plugin with the qwen3 text-generation family")
    w = tmp_path / "weights"
    w.mkdir()
    (w / "config.json").write_text(json.dumps(CHAT))
    (tmp_path / "r.toml").write_text(
        'schema = 1\n[models.chat]\nfamily = "qwen3"\ntask = "text-generation"\nsource = { path = "weights" }\n'
        'config = "weights/config.json"\n'
        '[chat.rtx]\nhardware = "rtx4060-laptop"\ntargets = ["weights", "trtllm"]\n'
        "[chat.rtx.trtllm]\nmax_seq_len = 32768\nmax_batch_size = 8\nfree_gpu_memory_fraction = 0.9\n"
        '[chat.h200]\nhardware = "h200"\ntargets = ["weights", "trtllm"]\n'
        "[chat.h200.trtllm]\nmax_seq_len = 65536\nmax_batch_size = 64\n"
    )
    report = run_checks(build_graph(load_recipe(tmp_path / "r.toml", reg), reg))
    got = sorted((f.section, f.severity, f.code) for f in report.findings if f.target == "trtllm")
    assert got == [
        (
            "chat.h200",
            "error",
            "len-beyond-model",
        ),  # the kind's error replaces the generic one on max_seq_len
        ("chat.h200", "warning", "kv-cache-short"),
        ("chat.rtx", "warning", "kv-cache-short"),
    ], got
    rtx = next(f for f in report.findings if f.section == "chat.rtx")
    assert rtx.message.startswith(
        "rtx4060-laptop 8 GiB: max_seq_len 32,768 × max_batch_size 8 needs 28.00 GiB of KV cache (112 KiB/token, bf16)"
    ), rtx.message
    assert "fits max_batch_size ≤ 1 at 32,768" in rtx.message


def test_a_chat_section_without_a_serving_target_is_sized_by_vllms_defaults(tmp_path):
    """The core knows no runtime: the `vllm` kind's `kv_pool` (baseline) gives vLLM's defaults
    for a text-generation section none of whose targets sets serving limits."""
    import pytest

    from mopt.check import run_checks
    from mopt.graph import build_graph
    from mopt.plugins import get_registry
    from mopt.recipe import load_recipe

    reg = get_registry()
    fam = reg.families.get("qwen3")
    if "weights" not in reg.targets or fam is None or "text-generation" not in getattr(fam, "tasks", ()):
        pytest.skip("needs the mopt-ml plugin with the qwen3 text-generation family")
    w = tmp_path / "weights"
    w.mkdir()
    (w / "config.json").write_text(json.dumps(CHAT))
    (tmp_path / "r.toml").write_text(
        'schema = 1\n[models.chat]\nfamily = "qwen3"\ntask = "text-generation"\nsource = { path = "weights" }\n'
        'config = "weights/config.json"\n[chat.h200]\nhardware = "h200"\ntargets = ["weights"]\n'
    )
    report = run_checks(build_graph(load_recipe(tmp_path / "r.toml", reg), reg))
    (f,) = [f for f in report.findings if f.code == "kv-cache-fit"]
    assert f.message.endswith("(the defaults of kind 'vllm'; no target of this section sets them)"), f.message
    (est,) = report.estimates
    w8 = est.estimate.workload
    assert (w8.runtime, w8.batch, w8.num_tokens, w8.memory_fraction) == ("vllm", 1024, 8192, 0.92)
    assert set(est.largest) == {"max_num_seqs", "max_model_len"}
