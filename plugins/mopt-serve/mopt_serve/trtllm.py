"""The `trtllm` target: TensorRT-LLM serving for one model on one hardware profile.

Current flow (`flow = "llm-api"`, the default): no engine build. TensorRT-LLM's PyTorch
backend serves a Hugging Face or ModelOpt checkpoint directly; we write the LLM-API options
file (`extra_llm_api_options.yaml`, read by `trtllm-serve --extra_llm_api_options` -- also
spelled `--config` in current releases -- and usable as `tensorrt_llm.LLM(model, **options)`)
and the `trtllm-serve serve` line with the same values, every one explicit. The names follow
TensorRT-LLM's `TorchLlmArgs` / `KvCacheConfig` / `CudaGraphConfig` / `SchedulerConfig`
(tensorrt_llm/llmapi/llm_args.py) and `trtllm-serve serve`'s options
(tensorrt_llm/commands/serve.py), read 2026-12.

For a text-generation model (`task = "text-generation"`) the YAML adds what a chat
deployment sets: chunked prefill when one pass (`max_num_tokens`) is shorter than a full
`max_seq_len` prompt, CUDA graphs for decode batches up to `max_batch_size` (padded),
the capacity scheduler's policy, and an fp8 KV cache where asked. `check()` refuses a
`max_seq_len` over the model's `max_position_embeddings`, a TP size that does not divide the
attention heads (and KV heads, or replicate them evenly), and (through `mopt check`'s
generic rules, sized by `kv_pool()`: TensorRT-LLM's defaults) a KV cache that does not hold one `max_seq_len`
sequence in `free_gpu_memory_fraction` of what the weights leave.

TensorRT-LLM cannot be installed here (NVIDIA's index only) nor on the H200 machine: the
config is generated and checked, never run by mopt's tests.

Legacy flow (`flow = "legacy-engine"`): TensorRT-LLM removed its TensorRT-engine backend after
1.3.0rc20, so this is only for a pinned TensorRT-LLM <= 1.2: `convert_checkpoint.py` (TP/PP are
fixed here) then `trtllm-build` with every default spelled out (they changed between
releases), then `trtllm-serve serve <engine> --backend tensorrt`.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, model_validator

from mopt.api import (
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
from mopt.api import plugin_env as _env
from mopt_serve import common

INSTALL_TRTLLM = "pip install tensorrt-llm (from pypi.nvidia.com; pin the release)"
LEGACY_MAX = (1, 2)


class TrtllmParams(Params):
    flow: Literal["llm-api", "legacy-engine"] = Field(
        default="llm-api",
        description="llm-api: serve the checkpoint (current); legacy-engine: TensorRT-LLM <= 1.2",
    )
    trtllm_version: str | None = Field(
        default=None, description="the pinned TensorRT-LLM release (required for legacy)"
    )
    backend: Literal["pytorch", "_autodeploy"] = "pytorch"
    dtype: Annotated[Literal["auto", "float16", "bfloat16"], Role.precision] = "auto"
    max_batch_size: Annotated[int, Role.batch_size] = Field(default=256, ge=1)
    max_num_tokens: Annotated[int, Role.num_tokens] = Field(default=8192, ge=1)
    max_seq_len: Annotated[int | None, Role.seq_len] = Field(
        default=None, ge=1, description="null: the model's max_position_embeddings"
    )
    max_input_len: Annotated[int | None, Role.seq_len] = Field(
        default=None, ge=1, description="legacy only; null: max_seq_len"
    )
    tp_size: Annotated[int, Role.tensor_parallel] = Field(default=1, ge=1)
    pp_size: Annotated[int, Role.pipeline_parallel] = Field(default=1, ge=1)
    free_gpu_memory_fraction: Annotated[float, Role.kv_cache_fraction] = Field(
        default=0.9, gt=0, le=1, description="kv_cache_config"
    )
    tokens_per_block: Annotated[int, Role.kv_block_tokens] = Field(
        default=32, ge=1, description="KV cache block size (a power of two)"
    )
    enable_block_reuse: bool = Field(default=True, description="kv_cache_config: prefix reuse")
    kv_cache_dtype: Annotated[Literal["auto", "fp8"], Role.kv_cache_precision] = "auto"
    kv_cache_max_tokens: int | None = Field(
        default=None, ge=1, description="kv_cache_config.max_tokens: a cap beside the fraction (null: none)"
    )
    # ---- text generation (written for task = "text-generation")
    enable_chunked_prefill: bool | None = Field(
        default=None,
        description="generation: prefill in max_num_tokens chunks (null: on when max_num_tokens < max_seq_len)",
    )
    cuda_graph: bool = Field(default=True, description="generation: CUDA graphs for decode batches")
    cuda_graph_max_batch_size: int | None = Field(
        default=None, ge=1, description="generation: largest decode batch captured (null: max_batch_size)"
    )
    capacity_scheduler_policy: Literal["GUARANTEED_NO_EVICT", "MAX_UTILIZATION"] = Field(
        default="GUARANTEED_NO_EVICT",
        description="generation: scheduler_config.capacity_scheduler_policy (MAX_UTILIZATION packs more "
        "requests and may pause some)",
    )
    max_beam_width: int = Field(default=1, ge=1, description="generation: beams (1: greedy / sampling)")
    reasoning_parser: str | None = Field(
        default=None, description="generation: trtllm-serve --reasoning_parser (e.g. for thinking models)"
    )
    trust_remote_code: bool = False
    host: str = "0.0.0.0"
    port: int = Field(default=8000, ge=1, le=65535)
    convert_script: str | None = Field(
        default=None,
        description="legacy: the release's examples/.../convert_checkpoint.py (relative to the recipe)",
    )
    extra: dict[str, Any] = Field(default={}, description="more LLM-API options merged into the YAML")

    @model_validator(mode="after")
    def _legacy_is_pinned(self) -> TrtllmParams:
        if self.flow == "legacy-engine":
            if not self.trtllm_version:
                raise ValueError(
                    "flow = 'legacy-engine' needs trtllm_version (the pinned release, <= 1.2): the engine "
                    "backend was removed after 1.3.0rc20"
                )
            if common.version_tuple(self.trtllm_version)[:2] > LEGACY_MAX:
                raise ValueError(
                    f"trtllm_version {self.trtllm_version!r}: the legacy engine flow is for TensorRT-LLM <= 1.2; "
                    "use flow = 'llm-api'"
                )
        return self


def max_seq_len_of(p: Any, model_config: dict[str, Any]) -> int | None:
    v = p.max_seq_len or model_config.get("max_position_embeddings")
    return int(v) if v else None


def chunked_prefill(p: Any, model_config: dict[str, Any]) -> bool:
    """Whether prefill runs in chunks: the recipe's choice, else when one pass
    (max_num_tokens) cannot take a full max_seq_len prompt."""
    if p.enable_chunked_prefill is not None:
        return bool(p.enable_chunked_prefill)
    seq = max_seq_len_of(p, model_config)
    return seq is not None and p.max_num_tokens < seq


def llm_api_options(p: Any, model_config: dict[str, Any], task: str = "embedding") -> dict[str, Any]:
    """The `--extra_llm_api_options` YAML (LLM-API argument names), every value explicit.
    `backend` is the command line's (`--backend`; a deprecated LlmArgs field)."""
    opts: dict[str, Any] = {
        "dtype": p.dtype,
        "tensor_parallel_size": p.tp_size,
        "pipeline_parallel_size": p.pp_size,
        "max_batch_size": p.max_batch_size,
        "max_num_tokens": p.max_num_tokens,
    }
    seq = max_seq_len_of(p, model_config)
    if seq is not None:
        opts["max_seq_len"] = seq
    opts["kv_cache_config"] = {
        "free_gpu_memory_fraction": p.free_gpu_memory_fraction,
        "tokens_per_block": p.tokens_per_block,
        "enable_block_reuse": p.enable_block_reuse,
        "dtype": p.kv_cache_dtype,
    }
    if p.kv_cache_max_tokens is not None:
        opts["kv_cache_config"]["max_tokens"] = p.kv_cache_max_tokens
    if task == "text-generation":
        opts["max_beam_width"] = p.max_beam_width
        opts["enable_chunked_prefill"] = chunked_prefill(p, model_config)
        opts["scheduler_config"] = {"capacity_scheduler_policy": p.capacity_scheduler_policy}
        opts["cuda_graph_config"] = (
            {"enable_padding": True, "max_batch_size": p.cuda_graph_max_batch_size or p.max_batch_size}
            if p.cuda_graph
            else None
        )
        if p.reasoning_parser:
            opts["reasoning_parser"] = p.reasoning_parser
    opts["trust_remote_code"] = p.trust_remote_code
    for k, v in p.extra.items():
        if isinstance(v, dict) and isinstance(opts.get(k), dict):
            opts[k] = {**opts[k], **v}
        else:
            opts[k] = v
    return opts


def serve_argv(
    p: Any, model_config: dict[str, Any], model: str = "{model}", task: str = "embedding"
) -> list[str]:
    """`trtllm-serve serve MODEL ...`: the same values on the command line, plus the YAML."""
    argv = ["trtllm-serve", "serve", model]
    if p.flow == "legacy-engine":
        argv += ["--tokenizer", "{model}", "--backend", "tensorrt"]
    else:
        argv += ["--backend", p.backend]
    argv += ["--host", p.host, "--port", str(p.port)]
    argv += ["--max_batch_size", str(p.max_batch_size), "--max_num_tokens", str(p.max_num_tokens)]
    seq = max_seq_len_of(p, model_config)
    if seq is not None:
        argv += ["--max_seq_len", str(seq)]
    argv += ["--tp_size", str(p.tp_size), "--pp_size", str(p.pp_size)]
    argv += ["--kv_cache_free_gpu_memory_fraction", repr(p.free_gpu_memory_fraction)]
    if task == "text-generation" and p.flow != "legacy-engine":
        argv += ["--max_beam_width", str(p.max_beam_width)]
        if chunked_prefill(p, model_config):
            argv.append("--enable_chunked_prefill")
        if p.reasoning_parser:
            argv += ["--reasoning_parser", p.reasoning_parser]
    if p.trust_remote_code:
        argv.append("--trust_remote_code")
    if p.flow != "legacy-engine":
        argv += ["--extra_llm_api_options", "{here}/extra_llm_api_options.yaml"]
    return argv


def legacy_commands(
    p: Any, model_config: dict[str, Any], python: str, script: str, ckpt: str, engine: str
) -> list[list[str]]:
    """`convert_checkpoint.py` then `trtllm-build`, each default written out."""
    dtype = "float16" if p.dtype == "auto" else p.dtype
    seq = max_seq_len_of(p, model_config) or 2048
    convert = [
        python, script, "--model_dir", "{model}", "--output_dir", ckpt, "--dtype", dtype,
        "--tp_size", str(p.tp_size), "--pp_size", str(p.pp_size),
    ]  # fmt: skip
    build = [
        "trtllm-build", "--checkpoint_dir", ckpt, "--output_dir", engine,
        "--max_batch_size", str(p.max_batch_size), "--max_input_len", str(p.max_input_len or seq),
        "--max_seq_len", str(seq), "--max_num_tokens", str(p.max_num_tokens), "--max_beam_width", "1",
        "--kv_cache_type", "paged", "--tokens_per_block", str(p.tokens_per_block),
        "--gemm_plugin", "auto", "--gpt_attention_plugin", "auto",
        "--remove_input_padding", "enable", "--context_fmha", "enable",
        "--use_paged_context_fmha", "enable" if p.enable_block_reuse else "disable",
        "--workers", "1", "--log_level", "info",
    ]  # fmt: skip
    return [convert, build]


class TrtllmKind(TargetKind):
    """TensorRT-LLM serving config (LLM API / trtllm-serve); legacy engines for <= 1.2."""

    name = "trtllm"
    version = "1"
    description = "TensorRT-LLM trtllm-serve config (LLM API options YAML); legacy engine for <= 1.2"
    consumes = (Input("model", formats=("modelopt-checkpoint", "hf-checkpoint"), prefer=common.PREFER_MODEL),)
    produces = "trtllm-config"
    per_hardware = True
    Params = TrtllmParams
    install_hints: ClassVar[dict[str, str]] = {"python:tensorrt_llm": INSTALL_TRTLLM}

    def requirements(self, params: Any, hardware: HardwareProfile) -> list[str]:
        # writing the config needs nothing; building a legacy engine needs the library and the GPU
        if params.flow == "legacy-engine":
            return ["gpu", "hardware", "python:tensorrt_llm"]
        return []

    def input_files(self, params: Any, project_dir: Path) -> list[Path]:
        return [(project_dir / params.convert_script).resolve()] if params.convert_script else []

    def fingerprint(self) -> dict[str, str]:
        # config generation does not depend on the installed TensorRT-LLM; a legacy engine
        # does, and its release is pinned in the params (trtllm_version, part of the key) and
        # verified against the installed one in run()
        return {}

    def platform(self, hardware: HardwareProfile) -> dict[str, Any]:
        return {"gpu_count": hardware.gpu_count, "compute_capability": common.cc_str(hardware)}

    def kv_pool(self, hardware: HardwareProfile, task: str) -> KvPool:
        # TensorRT-LLM's KvCacheConfig.free_gpu_memory_fraction 0.9 of what the model leaves,
        # and the LLM API's max_batch_size 2048 / max_num_tokens 8192
        return KvPool(
            share_of="free", fraction=0.9, max_seqs=2048, max_tokens=8192,
            fraction_key="kv_cache_free_gpu_memory_fraction",
        )  # fmt: skip

    def check(self, params: Any, ctx: CheckContext) -> list[Finding]:
        hw, cfg = ctx.hardware, ctx.model_config or {}
        out: list[Finding] = []

        def add(sev: str, code: str, msg: str, fix: str = "", key: str | None = None) -> None:
            out.append(Finding(sev, code, msg, fix, ctx.section, ctx.target, key))

        if not hw.is_gpu:
            add(
                "error",
                "engine-on-cpu",
                f"TensorRT-LLM needs NVIDIA GPUs; profile {hw.name!r} has none",
                "use a GPU profile; for CPU serve the onnx target",
            )
            return out
        if not common.is_power_of_two(params.tokens_per_block):
            p2 = 1 << max(params.tokens_per_block - 1, 1).bit_length()
            add(
                "error",
                "tokens-per-block",
                f"tokens_per_block must be a power of two, got {params.tokens_per_block}",
                f"tokens_per_block = {p2 // 2 if p2 // 2 >= 1 else 1} or {p2}",
                "tokens_per_block",
            )
        out += common.parallel_findings(
            ctx, params.tp_size, params.pp_size, tp_key="tp_size", engine="TensorRT-LLM"
        )
        if params.kv_cache_dtype == "fp8" and (hw.compute_capability or (0, 0)) < (8, 9):
            add(
                "error",
                "precision-unsupported",
                f"kv_cache_dtype 'fp8' needs compute capability >= 8.9; {hw.name} is {common.cc_str(hw)}",
                key="kv_cache_dtype",
            )
        generation = getattr(ctx, "task", "embedding") == "text-generation"
        mpe = cfg.get("max_position_embeddings")
        if params.max_seq_len and isinstance(mpe, int) and params.max_seq_len > mpe:
            if generation:  # prompt + reply beyond the positions the model was trained on
                add(
                    "error",
                    "len-beyond-model",
                    f"max_seq_len {params.max_seq_len} exceeds the model's max_position_embeddings {mpe}: "
                    "TensorRT-LLM refuses it (or, with RoPE scaling, generates past what the model learnt)",
                    f"max_seq_len ≤ {mpe}, or null (TensorRT-LLM takes the model's)",
                    key="max_seq_len",
                )
            else:
                add(
                    "warning",
                    "len-beyond-model",
                    f"max_seq_len {params.max_seq_len} exceeds the model's max_position_embeddings {mpe}",
                    key="max_seq_len",
                )
        if generation and params.enable_chunked_prefill is False:
            seq = max_seq_len_of(params, cfg)
            if seq and params.max_num_tokens < seq:
                add(
                    "error",
                    "num-tokens-below-seq",
                    f"enable_chunked_prefill = false with max_num_tokens {params.max_num_tokens} < max_seq_len "
                    f"{seq}: a prompt longer than {params.max_num_tokens} tokens cannot be scheduled",
                    f"enable_chunked_prefill = true (or null), or max_num_tokens ≥ {seq}",
                    key="enable_chunked_prefill",
                )
        if (
            generation
            and params.cuda_graph_max_batch_size
            and params.cuda_graph_max_batch_size > params.max_batch_size
        ):
            add(
                "warning",
                "cuda-graph-batch",
                f"cuda_graph_max_batch_size {params.cuda_graph_max_batch_size} > max_batch_size "
                f"{params.max_batch_size}: graphs for batches that never run cost memory (~200 MB each)",
                f"cuda_graph_max_batch_size ≤ {params.max_batch_size}",
                key="cuda_graph_max_batch_size",
            )
        seq = max_seq_len_of(params, cfg)
        if seq and params.max_num_tokens < seq and params.flow == "legacy-engine":
            add(
                "warning",
                "num-tokens-below-seq",
                f"max_num_tokens {params.max_num_tokens} < max_seq_len {seq}: a full-length prompt needs chunked context",
                key="max_num_tokens",
            )
        if common.is_encoder(cfg):
            add(
                "error",
                "encoder-model",
                f"model_type {cfg.get('model_type')!r} is an encoder; TensorRT-LLM's LLM API serves decoder checkpoints",
                "serve it with triton-repo (onnx / trt-engine) instead",
            )
        families_tasks = (
            getattr(ctx.family, "tasks", ("embedding",)) if ctx.family is not None else ("embedding",)
        )
        if "embedding" in families_tasks and not generation:
            add(
                "warning",
                "trtllm-embeddings",
                "embedding serving in TensorRT-LLM (`trtllm-serve` embeddings, PR #15424) landed mid-2026 and the first "
                "tagged release with it is unconfirmed: pin a release that has it (trtllm_version) and verify /v1/embeddings",
            )
        return out

    def run(self, ctx: BuildContext) -> dict[str, Any]:
        p = ctx.params
        art = ctx.input("model")
        model_cfg = common.read_model_config(art.path)
        where = f"the {art.kind!r} artifact of target {art.target!r} (mopt show {ctx.section}:{art.target})"
        comment = [f"TensorRT-LLM server for {ctx.model_name} on {ctx.hardware.name}", f"MODEL_DIR: {where}"]
        meta: dict[str, Any] = {"flow": p.flow, "model_target": art.target, "model_kind": art.kind}
        if p.flow == "legacy-engine":
            meta.update(self._legacy(ctx, model_cfg))
            argv = serve_argv(p, model_cfg, model="{here}/engine")
        else:
            opts = llm_api_options(p, model_cfg, ctx.task)
            yaml_text = "# generated by mopt (kind trtllm): trtllm-serve --extra_llm_api_options\n"
            common.write_text(ctx.out / "extra_llm_api_options.yaml", yaml_text + common.dump_yaml(opts))
            argv = serve_argv(p, model_cfg, task=ctx.task)
            meta["options"] = opts
        common.write_text(ctx.out / "serve.sh", common.shell_script(comment, argv), executable=True)
        common.write_text(ctx.out / "args.json", json.dumps({"argv": argv, "model": where}, indent=2) + "\n")
        ctx.log(" ".join(argv))
        meta["files"] = sorted(f.name for f in ctx.out.iterdir())
        return meta

    def _legacy(self, ctx: BuildContext, model_cfg: dict[str, Any]) -> dict[str, Any]:
        p = ctx.params
        _env.require_module("tensorrt_llm", self.name, INSTALL_TRTLLM)
        _env.require_gpu(self.name, ctx.hardware)
        installed = _env.dist_version("tensorrt-llm", "tensorrt_llm") or "?"
        if common.version_tuple(installed)[:2] != common.version_tuple(p.trtllm_version or "")[:2]:
            raise RuntimeError(
                f"the recipe pins TensorRT-LLM {p.trtllm_version}, this machine has {installed}"
            )
        if not p.convert_script:
            raise RuntimeError(
                "flow = 'legacy-engine' needs convert_script: the release's convert_checkpoint.py"
            )
        script = str((ctx.project_dir / p.convert_script).resolve())
        ckpt, engine = ctx.tmp / "checkpoint", ctx.out / "engine"
        model = str(ctx.input("model").path)
        cmds = legacy_commands(p, model_cfg, sys.executable, script, str(ckpt), str(engine))
        if shutil.which("trtllm-build") is None:
            cmds[1][0:1] = [sys.executable, "-m", "tensorrt_llm.commands.build"]
        for argv in cmds:
            argv = [model if a == "{model}" else a for a in argv]
            ctx.log("$ " + " ".join(argv))
            proc = subprocess.run(
                argv,
                cwd=ctx.tmp,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                errors="replace",
            )
            for line in proc.stdout.splitlines():
                ctx.log(line)
            if proc.returncode != 0:
                raise RuntimeError(
                    f"{Path(argv[1]).name if argv[0] == sys.executable else argv[0]} exited with {proc.returncode}"
                )
        shown = legacy_commands(
            p, model_cfg, "python", "convert_checkpoint.py", "checkpoint", "{here}/engine"
        )
        common.write_text(ctx.out / "build-commands.json", json.dumps(shown, indent=2) + "\n")
        return {"trtllm": installed, "engine": "engine/", "reproducible": False}
