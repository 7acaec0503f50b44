"""The `torch-compile` and `aoti` target kinds.

Both run their work in a child process (`compile_worker`, `aoti_worker`): torch never loads
into mopt's process, each build starts from empty Inductor / Triton caches, and a crash in
torch is an error with its signal, not a dead build.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, field_validator

from mopt.api import BuildContext, CheckContext, Finding, HardwareProfile, Input, Params, Role, TargetKind
from mopt.api import plugin_env as _env
from mopt_torch.aoti import AotiLoadError, describe_exit, probe_load
from mopt_torch.embedder import family_spec, resolve_attention

INSTALL_TORCH = "pip install torch transformers (a CUDA build of torch)"


def torch_cuda_version() -> str:
    """The CUDA torch was built with, read from torch/version.py without importing torch."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return "missing"
    p = Path(next(iter(spec.submodule_search_locations))) / "version.py"
    m = re.search(r"^cuda(?::[^=]*)?=\s*['\"]?([^'\"\n]+)", p.read_text(), re.M) if p.is_file() else None
    return m.group(1).strip() if m else "unknown"


def torch_fingerprint() -> dict[str, str]:
    return {
        "torch": _env.dist_version("torch") or "missing",
        "triton": _env.dist_version("triton", "pytorch-triton") or "missing",
        "cuda": torch_cuda_version(),
        "transformers": _env.dist_version("transformers") or "missing",
        **_env.gpu_facts(),
    }


def model_config_of(weights: Path) -> dict[str, Any]:
    p = weights / "config.json"
    return json.loads(p.read_text()) if p.is_file() else {}


def run_worker(argv: list[str], ctx: BuildContext, env: dict[str, str] | None = None) -> None:
    ctx.log("$ " + " ".join(argv))
    proc = subprocess.run(
        argv,
        cwd=ctx.tmp,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
    )
    for line in proc.stdout.splitlines():
        ctx.log(line)
    if proc.returncode != 0:
        raise RuntimeError(f"{argv[2]} failed: {describe_exit(proc.returncode)} (log above)")


def fresh_cache_env(tmp: Path) -> dict[str, str]:
    """The environment with empty Inductor and Triton cache folders under `tmp`."""
    env = dict(os.environ)
    env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp / "inductor-cache")
    env["TRITON_CACHE_DIR"] = str(tmp / "triton-cache")
    return env


def gpu_checks(kind: str, params: Any, ctx: CheckContext) -> list[Finding]:
    hw = ctx.hardware
    out = []
    if not hw.is_gpu:
        out.append(
            Finding(
                "error",
                "engine-on-cpu",
                f"{kind} builds CUDA kernels; profile {hw.name!r} has no GPU",
                "use the onnx / ort-quantize targets on CPU profiles",
                ctx.section,
                ctx.target,
            )
        )
    elif params.precision not in hw.precisions:
        out.append(
            Finding(
                "error",
                "precision-unsupported",
                f"{params.precision} needs compute capability >= 8.0; "
                f"{hw.name} supports {', '.join(hw.precisions)}",
                'precision = "fp16"',
                ctx.section,
                ctx.target,
                "precision",
            )
        )
    cfg = ctx.model_config or {}
    if params.attention == "sdpa-causal" and cfg and resolve_attention("auto", cfg, None) != "sdpa-causal":
        out.append(
            Finding(
                "error",
                "attention-not-causal",
                f"attention 'sdpa-causal' drops the attention mask, which is exact only for causal decoders; "
                f"model_type {cfg.get('model_type')!r} is not one",
                'attention = "auto"',
                ctx.section,
                ctx.target,
                "attention",
            )
        )
    return out


class TorchCompileKind(TargetKind):
    """A compile-cache artifact: `torch.compiler.save_cache_artifacts()` after compiling the
    embedding module for each (batch, seq) bucket; consumers start warm with `mopt_torch.warm`."""

    preload = ("torch",)  # imported once by the build's fork server

    name = "torch-compile"
    # GPU kind not yet run under bubblewrap on a GPU machine: a plain worker process
    sandbox = False
    version = "1"
    description = (
        "torch.compile cache artifact (save_cache_artifacts) for shape buckets; warm start elsewhere"
    )
    memory_model = "none"  # the buckets' workload is not in max_batch_size / max_seq_len form
    consumes = (Input("weights", formats=("hf-checkpoint",), prefer=("weights",)),)
    produces = "torch-compile-cache"
    per_hardware = True
    requires = ("gpu", "hardware", "python:torch", "python:transformers")
    resources: ClassVar[dict[str, int]] = {"cpu": 1, "gpu": 1}
    reproducible = False  # autotuning and kernel timings vary between builds
    install_hints: ClassVar[dict[str, str]] = {"python:torch": INSTALL_TORCH}

    class Params(Params):
        precision: Annotated[Literal["fp16", "bf16"], Role.precision] = "fp16"
        mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = Field(
            default="default",
            description="H200, Qwen3-0.6B shape, 32x512: default (flash) 35.9 ms, cold 43 s; "
            "max-autotune + cudnn + rope_table 34.1 ms, cold 192 s (docs/h200-2026-11-30b)",
        )
        buckets: list[tuple[int, int]] = Field(
            default=[(32, 512)], description="(batch, seq) shapes compiled statically (dynamic=False)"
        )
        attention: Literal["auto", "sdpa", "sdpa-causal"] = Field(
            default="auto",
            description="auto: sdpa-causal (no mask, right padding) for causal decoders, else sdpa",
        )
        sdpa_backend: Literal["auto", "flash", "cudnn", "efficient"] = Field(
            default="auto",
            description="the SDPA kernel of attention sdpa-causal, pinned in the compiled graph "
            "(auto: torch's choice, flash on Hopper)",
        )
        rope_table: bool = Field(
            default=True,
            description="rotary cos/sin from tables computed once, not recomputed inside every "
            "layer's fused q/k kernel (H200, Qwen3-0.6B shape: those kernels were 5.7 of 36.7 ms)",
        )
        fullgraph: bool = False
        warmup: int = Field(default=3, ge=0)
        iters: int = Field(default=20, ge=1)
        min_cosine: float = Field(
            default=0.999, description="compiled vs eager (masked sdpa) on right-padded batches"
        )
        seed: int = 0

        @field_validator("buckets")
        @classmethod
        def _positive(cls, v: list[tuple[int, int]]) -> list[tuple[int, int]]:
            if not v:
                raise ValueError("give at least one (batch, seq) bucket")
            for b, s in v:
                if b < 1 or s < 1:
                    raise ValueError(f"bucket ({b}, {s}): batch and seq must be >= 1")
            return sorted(set(v))

    def fingerprint(self) -> dict[str, str]:
        return torch_fingerprint()

    def platform(self, hardware: HardwareProfile) -> dict[str, Any]:
        cc = hardware.compute_capability
        return {"compute_capability": f"{cc[0]}.{cc[1]}" if cc else None}

    def check(self, params: Any, ctx: CheckContext) -> list[Finding]:
        out = gpu_checks(self.name, params, ctx)
        mpe = (ctx.model_config or {}).get("max_position_embeddings")
        for _, s in params.buckets:
            if isinstance(mpe, int) and s > mpe:
                out.append(
                    Finding(
                        "error",
                        "seq-beyond-model",
                        f"bucket seq {s} exceeds max_position_embeddings {mpe}",
                        "",
                        ctx.section,
                        ctx.target,
                        "buckets",
                    )
                )
        # a synthetic source's config has no model_type: then `auto` is only resolved at build time
        cfg = ctx.model_config or {}
        cfg_known_type = cfg if (cfg.get("model_type") or cfg.get("architectures")) else None
        if params.sdpa_backend != "auto" and (
            params.attention == "sdpa"
            or (
                params.attention == "auto"
                and cfg_known_type
                and resolve_attention("auto", cfg_known_type, None) != "sdpa-causal"
            )
        ):
            out.append(
                Finding(
                    "error",
                    "sdpa-backend-needs-causal",
                    f"sdpa_backend {params.sdpa_backend!r} pins the kernel of attention 'sdpa-causal' only; "
                    "this target's attention is 'sdpa' (the masked path keeps torch's choice)",
                    'sdpa_backend = "auto"',
                    ctx.section,
                    ctx.target,
                    "sdpa_backend",
                )
            )
        if params.mode in ("max-autotune", "max-autotune-no-cudagraphs"):
            out.append(
                Finding(
                    "info",
                    "slow-compile",
                    "max-autotune compiles ~4x longer than default (H200, Qwen3-0.6B shape: 192 s vs "
                    "43 s) for a small gain (0.5 % measured without CUDA graphs); the artifact makes later "
                    "starts warm either way",
                    "",
                    ctx.section,
                    ctx.target,
                    "mode",
                )
            )
        return out

    def run(self, ctx: BuildContext) -> dict[str, Any]:
        p = ctx.params
        for mod in ("torch", "transformers"):
            if not _env.has_module(mod):
                raise RuntimeError(
                    f"target kind 'torch-compile' needs the Python package {mod!r} ({INSTALL_TORCH})"
                )
        _env.require_gpu(self.name, ctx.hardware)
        weights = ctx.input("weights").path
        pooling = getattr(ctx.family, "pooling", "mean")
        attention = resolve_attention(p.attention, model_config_of(weights), pooling)
        if p.sdpa_backend != "auto" and attention != "sdpa-causal":
            raise RuntimeError(
                f"sdpa_backend {p.sdpa_backend!r} needs attention 'sdpa-causal'; this model resolves "
                f'to {attention!r}: set sdpa_backend = "auto"'
            )
        spec = {
            "weights": str(weights),
            "out": str(ctx.out),
            "device": "cuda",
            "family": family_spec(ctx.family),
            "pooling": pooling,
            "precision": p.precision,
            "mode": p.mode,
            "buckets": [list(b) for b in p.buckets],
            "attention": attention,
            "sdpa_backend": p.sdpa_backend,
            "rope_table": p.rope_table,
            "fullgraph": p.fullgraph,
            "warmup": p.warmup,
            "iters": p.iters,
            "min_cosine": p.min_cosine,
            "seed": p.seed,
        }
        (ctx.tmp / "spec.json").write_text(json.dumps(spec))
        run_worker(
            [sys.executable, "-m", "mopt_torch.compile_worker", str(ctx.tmp / "spec.json")],
            ctx,
            fresh_cache_env(ctx.tmp),
        )
        meta = json.loads((ctx.out / "meta.json").read_text())
        return {
            k: meta[k]
            for k in (
                "torch",
                "triton",
                "cuda",
                "gpu",
                "compute_capability",
                "mode",
                "attention",
                "sdpa_backend",
                "buckets",
                "compile_seconds",
                "cache_bytes",
            )
        }


class AotiKind(TargetKind):
    """`torch.export` + AOTInductor package with a dynamic batch and sequence length."""

    preload = ("torch",)  # imported once by the build's fork server

    name = "aoti"
    # GPU kind not yet run under bubblewrap on a GPU machine: a plain worker process
    sandbox = False
    version = "1"
    description = (
        "torch.export + AOTInductor package (model.pt2), dynamic batch/seq; load-checked in a child process"
    )
    memory_model = "engine"  # mopt check: batch × sequence through one forward pass
    consumes = (Input("weights", formats=("hf-checkpoint",), prefer=("weights",)),)
    produces = "aoti-package"
    per_hardware = True
    requires = ("gpu", "hardware", "python:torch", "python:transformers")
    resources: ClassVar[dict[str, int]] = {"cpu": 1, "gpu": 1}
    reproducible = False
    install_hints: ClassVar[dict[str, str]] = {"python:torch": INSTALL_TORCH}

    class Params(Params):
        precision: Annotated[Literal["fp16", "bf16"], Role.precision] = "fp16"
        min_batch_size: int = Field(default=1, ge=1)
        max_batch_size: Annotated[int, Role.batch_size] = Field(default=32, ge=1)
        min_seq_len: int = Field(default=1, ge=1)
        max_seq_len: Annotated[int, Role.seq_len] = Field(default=512, ge=1)
        seq_multiple: int = Field(
            default=16, ge=1, description="sequence lengths are a multiple of this (pad right)"
        )
        attention: Literal["auto", "sdpa", "sdpa-causal"] = "auto"
        verify_load: bool = Field(
            default=True,
            description="load and run the package in a child process; fail the build if that crashes",
        )
        seed: int = 0

    def fingerprint(self) -> dict[str, str]:
        return torch_fingerprint()

    def platform(self, hardware: HardwareProfile) -> dict[str, Any]:
        cc = hardware.compute_capability
        return {"compute_capability": f"{cc[0]}.{cc[1]}" if cc else None}

    def check(self, params: Any, ctx: CheckContext) -> list[Finding]:
        out = gpu_checks(self.name, params, ctx)
        if not params.min_batch_size <= params.max_batch_size:
            out.append(
                Finding(
                    "error",
                    "shape-order",
                    "min_batch_size > max_batch_size",
                    "",
                    ctx.section,
                    ctx.target,
                    "min_batch_size",
                )
            )
        if params.max_seq_len < 2 * params.seq_multiple or not params.min_seq_len <= params.max_seq_len:
            out.append(
                Finding(
                    "error",
                    "shape-order",
                    f"need min_seq_len <= max_seq_len and max_seq_len >= 2 × seq_multiple (export "
                    f"specialises a single block) "
                    f"({params.min_seq_len}, {params.max_seq_len}, {params.seq_multiple})",
                    "",
                    ctx.section,
                    ctx.target,
                    "max_seq_len",
                )
            )
        return out

    def run(self, ctx: BuildContext) -> dict[str, Any]:
        p = ctx.params
        for mod in ("torch", "transformers"):
            if not _env.has_module(mod):
                raise RuntimeError(f"target kind 'aoti' needs the Python package {mod!r} ({INSTALL_TORCH})")
        _env.require_gpu(self.name, ctx.hardware)
        weights = ctx.input("weights").path
        pooling = getattr(ctx.family, "pooling", "mean")
        spec = {
            "weights": str(weights),
            "out": str(ctx.out),
            "probe": str(ctx.out / "probe.pt"),
            "device": "cuda",
            "family": family_spec(ctx.family),
            "pooling": pooling,
            "precision": p.precision,
            "attention": resolve_attention(p.attention, model_config_of(weights), pooling),
            "min_batch_size": p.min_batch_size,
            "max_batch_size": p.max_batch_size,
            "min_seq_len": p.min_seq_len,
            "max_seq_len": p.max_seq_len,
            "seq_multiple": p.seq_multiple,
            "seed": p.seed,
        }
        (ctx.tmp / "spec.json").write_text(json.dumps(spec))
        run_worker(
            [sys.executable, "-m", "mopt_torch.aoti_worker", "build", str(ctx.tmp / "spec.json")],
            ctx,
            fresh_cache_env(ctx.tmp),
        )
        meta = json.loads((ctx.out / "meta.json").read_text())
        if p.verify_load:
            try:
                report = probe_load(ctx.out / "model.pt2", ctx.out / "probe.pt", "cuda")
            except AotiLoadError as exc:
                raise RuntimeError(
                    f"{exc}. The package compiled; set verify_load = false to keep it unverified."
                ) from exc
            ctx.log(f"load check in a child process: {report}")
            if not report.get("min_cosine", 1.0) >= 0.999:
                raise RuntimeError(f"the loaded package's output differs from eager: {report}")
            meta["load_check"] = report
        else:
            meta["load_check"] = "skipped (verify_load = false)"
        return meta
