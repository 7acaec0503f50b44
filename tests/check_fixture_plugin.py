"""A plugin for the check tests: toy families, a synthetic-style source, toy GPU kinds with the
param names real engine / serving kinds use, and two extra hardware profiles.

Names are prefixed `toy` so they never clash with the real plugins installed beside them.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field

from mopt.api import (
    BuildContext,
    CheckContext,
    Family,
    Finding,
    HardwareProfile,
    KvPool,
    Params,
    Role,
    Source,
    SourceContext,
    TargetKind,
    hookimpl,
)

PLUGIN_NAME = "check-fixture"

#: a small qwen3 config the toy family hands to synthetic sources
TOY_QWEN3_DEFAULTS: dict[str, Any] = {
    "model_type": "qwen3",
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
}


class ToyQwen3(Family):
    name = "toy-qwen3"
    description = "qwen3-like decoder (tests)"
    architectures = ("Qwen3ForCausalLM",)
    pooling = "last-token"
    qk_norm = True  # the shape the estimator counts: gated MLP (the default) and q/k norms
    synthetic_defaults = TOY_QWEN3_DEFAULTS


class ToyQwen3Chat(ToyQwen3):
    name = "toy-qwen3-chat"
    description = "qwen3-like causal LM (tests): embedding and text-generation"
    tasks = ("embedding", "text-generation")


class ToyBert(Family):
    name = "toy-bert"
    description = "bert-like encoder (tests)"
    architectures = ("BertModel",)
    pooling = "mean"
    encoder = True
    pooler_architectures = ("BertModel",)


class ToySynth(Source):
    """Random weights of the family's architecture, configured by `config` overrides."""

    name = "toysynth"
    description = "random weights (tests)"

    class Params(Params):
        toysynth: str
        seed: int = 0
        config: dict[str, Any] = Field(default_factory=dict)

    def resolve(self, params: Any, ctx: SourceContext) -> Path:
        raise NotImplementedError


class _Kind(TargetKind):
    def run(self, ctx: BuildContext) -> dict[str, Any] | None:
        raise NotImplementedError("toy kinds do not build")


class ToyOnnx(_Kind):
    name = "toy-onnx"
    uses_source = True

    class Params(Params):
        dtype: Annotated[str, Role.precision] = "fp32"
        opset: int = 17


class ToyStore(_Kind):
    """A kind whose `dtype` is how it stores weights, not a compute precision: no role."""

    name = "toy-store"

    class Params(Params):
        dtype: str = "fp32"
        max_len: int = Field(default=128, json_schema_extra={"mopt_role": "seq_len"})


class ToyTrt(_Kind):
    name = "toy-trt"
    per_hardware = True
    requires = ("gpu", "hardware")

    class Params(Params):
        precision: Annotated[str, Role.precision] = "fp16"
        max_batch_size: Annotated[int, Role.batch_size] = 1
        max_seq_len: Annotated[int, Role.seq_len] = 512
        opt_level: int = 3
        workspace_gb: Annotated[float | None, Role.workspace_gb] = None
        shapes: Annotated[dict[str, list[list[int]]] | None, Role.shapes] = None

    def check(self, params: Any, ctx: CheckContext) -> list[Finding]:
        if params.opt_level > 5:
            return [
                Finding(
                    "error",
                    "toy-opt-level",
                    f"opt_level {params.opt_level} > 5",
                    "use 0-5",
                    key="opt_level",
                )
            ]
        return []


class ToyVllm(_Kind):
    name = "toy-vllm"
    per_hardware = True
    requires = ("gpu",)

    class Params(Params):
        dtype: Annotated[str, Role.precision] = "auto"
        max_num_seqs: Annotated[int, Role.batch_size] = 256
        max_model_len: Annotated[int | None, Role.seq_len] = None
        gpu_memory_utilization: Annotated[float, Role.memory_fraction] = 0.9
        tensor_parallel_size: Annotated[int, Role.tensor_parallel] = 1
        block_size: int = 16
        kv_cache_dtype: Annotated[str, Role.kv_cache_precision] = "auto"
        quantization: Annotated[str | None, Role.quantization] = None

    def kv_pool(self, hardware: HardwareProfile, task: str) -> KvPool:
        # vLLM 0.26's defaults, as a third party's vLLM kind would give them (mopt-serve's vllm
        # does the same): 1024 sequences and, with chunked prefill for generation, 8192 tokens
        # a pass on GPUs of >= 70 GiB (not A100); 256 and 2048 elsewhere; utilization 0.92
        big = (hardware.memory_gb or 0) >= 70 and "a100" not in (hardware.gpu_name or "").lower()
        chunked = task == "text-generation"
        return KvPool(
            share_of="gpu", fraction=0.92, max_seqs=1024 if big else 256,
            max_tokens=2048 if chunked and not big else 8192, whole_sequence=not chunked,
            seqs_key="max_num_seqs", seq_key="max_model_len", fraction_key="gpu_memory_utilization",
            tokens_key="max_num_batched_tokens", baseline=True,
        )  # fmt: skip


class ToyTrtllm(_Kind):
    name = "toy-trtllm"
    per_hardware = True
    requires = ("gpu", "python:tensorrt_llm")

    class Params(Params):
        tokens_per_block: Annotated[int, Role.kv_block_tokens] = 32
        tp_size: Annotated[int, Role.tensor_parallel] = 1
        max_batch_size: Annotated[int, Role.batch_size] = 8
        max_seq_len: Annotated[int | None, Role.seq_len] = None
        max_num_tokens: Annotated[int | None, Role.num_tokens] = None
        kv_cache_free_gpu_memory_fraction: Annotated[float, Role.kv_cache_fraction] = 0.9

    def kv_pool(self, hardware: HardwareProfile, task: str) -> KvPool:
        return KvPool(share_of="free", fraction=0.9, max_seqs=2048, max_tokens=8192,
                      fraction_key="kv_cache_free_gpu_memory_fraction")  # fmt: skip

    def check(self, params: Any, ctx: CheckContext) -> list[Finding]:
        # a kind that checks a key itself: its finding replaces the generic rule's
        if params.tokens_per_block == 24:
            return [Finding("error", "toy-tpb", "24 is not allowed", "use 32", key="tokens_per_block")]
        return []


class ToyOwnCpuCheck(_Kind):
    """A GPU kind that explains itself on a CPU profile (the generic kind-needs-gpu stays quiet)."""

    name = "toy-own-cpu-check"
    requires = ("gpu",)

    def check(self, params: Any, ctx: CheckContext) -> list[Finding]:
        if not ctx.hardware.is_gpu:
            return [Finding("error", "toy-engine-on-cpu", "needs a GPU", "use a GPU profile")]
        return []


class ToyBroken(_Kind):
    name = "toy-broken"

    def check(self, params: Any, ctx: CheckContext) -> list[Finding]:
        raise RuntimeError("boom")


PROFILES = [
    HardwareProfile(
        name="toy-t4",
        description="Turing test profile",
        gpu_name="Tesla T4",
        compute_capability=(7, 5),
        memory_gb=15,
        bandwidth_gbps=320,
        sm_count=40,
    ),
    HardwareProfile(
        name="toy-h100x4",
        description="four H100 SXM",
        gpu_name="NVIDIA H100 80GB HBM3",
        compute_capability=(9, 0),
        memory_gb=80,
        bandwidth_gbps=3350,
        sm_count=132,
        gpu_count=4,
    ),
]


@hookimpl
def mopt_register_families(register: Callable[[Any], None]) -> None:
    register(ToyQwen3)
    register(ToyQwen3Chat)
    register(ToyBert)


@hookimpl
def mopt_register_sources(register: Callable[[Any], None]) -> None:
    register(ToySynth)


@hookimpl
def mopt_register_targets(register: Callable[[Any], None]) -> None:
    for k in (ToyOnnx, ToyStore, ToyTrt, ToyVllm, ToyTrtllm, ToyOwnCpuCheck, ToyBroken):
        register(k)


@hookimpl
def mopt_register_hardware(register: Callable[[Any], None]) -> None:
    for p in PROFILES:
        register(p)


def registry(disable: tuple[str, ...] = ()) -> Any:
    """The built-in registry plus this plugin (less the installed plugins in `disable`)."""
    import sys

    from mopt.plugins import build_registry, make_plugin_manager

    pm = make_plugin_manager(disable)
    pm.register(sys.modules[__name__], name=PLUGIN_NAME)
    return build_registry(pm)
