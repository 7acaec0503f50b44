"""The `trt-engine` target: a TensorRT engine (plan) built from an ONNX artifact with the
TensorRT Python API.

TensorRT 10.x and 11.x differ in how precision is chosen:

* 10.x: a plain (fp32) ONNX graph + `BuilderFlag.FP16` / `BF16` (weak typing). A graph whose
  precision is already set (an `autocast` or `modelopt-quantize` artifact) is built strongly
  typed, with no precision flags.
* 11.x removed the precision flags, INT8 calibrators and the algorithm selector: every network
  is strongly typed, so fp16/bf16 must come from an `autocast` input and int8/fp8/int4 from a
  `modelopt-quantize` (Q/DQ) input. Asking for fp16 from a plain graph is an error that says so.

Engines are not portable (same TensorRT version and GPU architecture unless built
version-compatible / hardware-compatible) and not byte-reproducible (tactic timing), hence
`per_hardware` and `reproducible = False`. Timing caches: see `timing_cache`.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field

from mopt.api import BuildContext, CheckContext, Finding, HardwareProfile, Input, Params, Role, TargetKind
from mopt.api import plugin_env as _env
from mopt_tensorrt import _onnx, timing_cache

INSTALL_TENSORRT = "pip install tensorrt-cu12 or tensorrt-cu13 (wheels come from pypi.nvidia.com)"

#: ONNX producers whose output already carries its precision
TYPED_INPUT_KINDS = ("autocast", "modelopt-quantize")
#: precisions a plain graph can get from builder flags on TensorRT 10.x
FLAG_PRECISIONS = {"fp32": (), "fp16": ("FP16",), "bf16": ("BF16",)}
#: precisions that only exist as Q/DQ in the graph (no calibrators: deprecated in 10, gone in 11)
QDQ_PRECISIONS = ("int8", "fp8", "int4")

HW_COMPAT = {
    "none": "NONE",
    "ampere_plus": "AMPERE_PLUS",
    "same_compute_capability": "SAME_COMPUTE_CAPABILITY",
}

TRT_DTYPES = {
    "FLOAT": "float32",
    "HALF": "float16",
    "BF16": "bfloat16",
    "INT8": "int8",
    "INT32": "int32",
    "INT64": "int64",
    "BOOL": "bool",
    "UINT8": "uint8",
    "FP8": "fp8",
    "INT4": "int4",
    "FP4": "fp4",
}


class PrecisionError(ValueError):
    """The requested precision cannot be built from this input with this TensorRT."""


@dataclass(frozen=True)
class PrecisionPlan:
    strongly_typed: bool
    flags: tuple[str, ...]
    note: str


def precision_plan(
    precision: str, trt_major: int, input_kind: str, input_precision: str | None
) -> PrecisionPlan:
    """How to get `precision` out of an input of `input_kind` on TensorRT `trt_major`.x."""
    if input_kind in TYPED_INPUT_KINDS:
        if input_precision is not None and input_precision != precision:
            raise PrecisionError(
                f"precision = {precision!r}, but the {input_kind!r} input was made for {input_precision!r}; "
                f"make them agree"
            )
        return PrecisionPlan(True, (), f"strongly typed: precision comes from the {input_kind} graph")
    if precision in QDQ_PRECISIONS:
        raise PrecisionError(
            f"precision = {precision!r} needs Q/DQ nodes in the ONNX graph (TensorRT calibrators are "
            f"deprecated in 10.x and removed in 11.x): add a target of kind 'modelopt-quantize' with "
            f"quantize_mode = {precision!r} and use it as this engine's input"
        )
    if trt_major >= 11:
        if precision == "fp32":
            return PrecisionPlan(True, (), "strongly typed (TensorRT 11): fp32 graph")
        raise PrecisionError(
            f"TensorRT {trt_major}.x builds strongly typed networks only (the FP16/BF16 builder flags were "
            f"removed), so precision = {precision!r} must already be in the ONNX graph: add a target of kind "
            f"'autocast' with low_precision_type = {precision!r} and use it as this engine's input"
        )
    return PrecisionPlan(False, FLAG_PRECISIONS[precision], f"TensorRT {trt_major}.x builder flags")


def profile_shapes(inputs: Mapping[str, Sequence[int]], p: Any) -> dict[str, tuple[tuple[int, ...], ...]]:
    """(min, opt, max) shapes per network input. Dynamic dims (-1) are batch at axis 0 and
    sequence at axis 1; `p.shapes` gives explicit triples for anything else."""
    out: dict[str, tuple[tuple[int, ...], ...]] = {}
    for name, dims in inputs.items():
        if name in p.shapes:
            triple = tuple(tuple(int(x) for x in s) for s in p.shapes[name])
            out[name] = triple
            continue
        lo, mid, hi = [], [], []
        for axis, d in enumerate(dims):
            if d is not None and int(d) >= 0:
                lo.append(int(d))
                mid.append(int(d))
                hi.append(int(d))
            elif axis == 0:
                lo.append(p.min_batch_size)
                mid.append(p.opt_batch_size or p.max_batch_size)
                hi.append(p.max_batch_size)
            elif axis == 1:
                lo.append(p.min_seq_len)
                mid.append(p.opt_seq_len or p.max_seq_len)
                hi.append(p.max_seq_len)
            else:
                raise ValueError(
                    f"input {name!r} has a dynamic axis {axis} (shape {list(dims)}): only axis 0 (batch) "
                    f"and 1 (sequence) get shapes from the params; give shapes.{name} = [min, opt, max]"
                )
        out[name] = (tuple(lo), tuple(mid), tuple(hi))
    return out


def shape_findings(p: Any) -> list[tuple[str, str]]:
    """(key, message) for min/opt/max values out of order."""
    bad = []
    for what, lo, opt, hi in (
        ("batch_size", p.min_batch_size, p.opt_batch_size, p.max_batch_size),
        ("seq_len", p.min_seq_len, p.opt_seq_len, p.max_seq_len),
    ):
        opt_v = hi if opt is None else opt
        if not (1 <= lo <= opt_v <= hi):
            bad.append(
                (
                    f"opt_{what}",
                    f"need 1 <= min_{what} <= opt_{what} <= max_{what}, got {lo} / {opt_v} / {hi}",
                )
            )
    for name, triple in p.shapes.items():
        if len(triple) != 3 or len({len(s) for s in triple}) != 1:
            bad.append(("shapes", f"shapes.{name} must be [min, opt, max] of equal rank"))
            continue
        for a, b, c in zip(*triple, strict=True):
            if not (1 <= a <= b <= c):
                bad.append(("shapes", f"shapes.{name}: need 1 <= min <= opt <= max per axis, got {triple}"))
                break
    return bad


def trt_version() -> str | None:
    """The installed TensorRT version (imports `tensorrt` only when it is installed)."""
    if not _env.has_module("tensorrt"):
        return None
    import tensorrt  # lazily: only on the machine that builds

    return str(tensorrt.__version__)


def cuda_of_tensorrt() -> str:
    """The CUDA that TensorRT's wheels were built for and load: `12`/`13` from the wheel names,
    plus the CUDA runtime wheel version when there is one."""
    dists = _env.installed_dists("tensorrt")
    majors = sorted({m.group(1) for d in dists if (m := re.search(r"cu(\d+)", d))})
    runtime = _env.dist_version(
        *(f"nvidia-cuda-runtime-cu{m}" for m in (majors or ["13", "12"])), "nvidia-cuda-runtime"
    )
    parts = [f"cu{'/'.join(majors)}" if majors else "cu?"]
    if runtime:
        parts.append(runtime)
    return "+".join(parts)


class TrtEngineKind(TargetKind):
    """TensorRT engine from an ONNX graph, with optimization profiles from the recipe."""

    name = "trt-engine"
    version = "1"
    description = "TensorRT engine (plan) from ONNX via the TensorRT Python API"
    memory_model = "engine"  # mopt check: batch × sequence through one forward pass
    consumes = (Input("onnx", kinds=("modelopt-quantize", "autocast", "onnx-slim", "onnx")),)
    produces = "tensorrt-plan"
    per_hardware = True
    requires = ("gpu", "hardware", "python:tensorrt")
    resources: ClassVar[dict[str, int]] = {"cpu": 1, "gpu": 1}
    reproducible = False
    install_hints: ClassVar[dict[str, str]] = {"python:tensorrt": INSTALL_TENSORRT}

    class Params(Params):
        precision: Annotated[Literal["fp32", "fp16", "bf16", "int8", "fp8", "int4"], Role.precision] = Field(
            default="fp16", description="engine precision; on TensorRT 11 it must come from the ONNX input"
        )
        min_batch_size: int = Field(default=1, ge=1)
        opt_batch_size: int | None = Field(default=None, ge=1, description="null: max_batch_size")
        max_batch_size: Annotated[int, Role.batch_size] = Field(default=32, ge=1)
        min_seq_len: int = Field(default=1, ge=1)
        opt_seq_len: int | None = Field(default=None, ge=1, description="null: max_seq_len")
        max_seq_len: Annotated[int, Role.seq_len] = Field(default=512, ge=1)
        shapes: Annotated[dict[str, list[list[int]]], Role.shapes] = Field(
            default={}, description="explicit [min, opt, max] shapes per input name (overrides the above)"
        )
        opt_level: int = Field(default=3, ge=0, le=5, description="builder_optimization_level")
        workspace_gb: Annotated[float | None, Role.workspace_gb] = Field(
            default=None, gt=0, description="WORKSPACE pool limit (null: TensorRT's)"
        )
        hardware_compatibility: Literal["none", "ampere_plus", "same_compute_capability"] = "none"
        version_compatible: bool = Field(default=False, description="BuilderFlag.VERSION_COMPATIBLE")
        timing_cache: bool = Field(default=True, description="read and update the shared timing cache")

    def fingerprint(self) -> dict[str, str]:
        return {
            "tensorrt": trt_version() or "missing",
            "cuda": cuda_of_tensorrt(),
            **_env.gpu_facts(),
        }

    def platform(self, hardware: HardwareProfile) -> dict[str, Any]:
        cc = hardware.compute_capability
        return {"gpu": hardware.gpu_name, "compute_capability": f"{cc[0]}.{cc[1]}" if cc else None}

    def check(self, params: Any, ctx: CheckContext) -> list[Finding]:
        hw = ctx.hardware
        out: list[Finding] = []

        def add(severity: str, code: str, msg: str, fix: str = "", key: str | None = None) -> None:
            out.append(Finding(severity, code, msg, fix, ctx.section, ctx.target, key))

        if not hw.is_gpu:
            add(
                "error",
                "engine-on-cpu",
                f"a TensorRT engine needs an NVIDIA GPU; profile {hw.name!r} has none",
                "build ONNX / ort-quantize targets for CPU profiles, or pick a GPU profile",
            )
            return out
        if params.precision not in hw.precisions:
            need = {"fp8": "8.9", "bf16": "8.0", "int4": "7.5"}.get(params.precision, "?")
            cc = hw.compute_capability or (0, 0)
            add(
                "error",
                "precision-unsupported",
                f"precision {params.precision!r} needs compute capability >= {need}; {hw.name} is "
                f"{cc[0]}.{cc[1]} (supports {', '.join(hw.precisions)})",
                f"choose one of: {', '.join(hw.precisions)}",
                key="precision",
            )
        for key, msg in shape_findings(params):
            add("error", "shape-order", msg, "fix the min/opt/max values", key=key)
        mpe = (ctx.model_config or {}).get("max_position_embeddings")
        if isinstance(mpe, int) and params.max_seq_len > mpe:
            add(
                "warning",
                "seq-beyond-model",
                f"max_seq_len {params.max_seq_len} exceeds the model's max_position_embeddings {mpe}",
                f"max_seq_len = {mpe}",
                key="max_seq_len",
            )
        if params.workspace_gb and hw.memory_gb and params.workspace_gb > hw.memory_gb:
            add(
                "error",
                "workspace-too-large",
                f"workspace_gb {params.workspace_gb} exceeds {hw.name}'s {hw.memory_gb} GB",
                key="workspace_gb",
            )
        cc = hw.compute_capability or (0, 0)
        if params.hardware_compatibility == "ampere_plus" and cc < (8, 0):
            add(
                "error",
                "hwcompat-unsupported",
                f"hardware_compatibility 'ampere_plus' needs an Ampere or newer GPU; {hw.name} is {cc[0]}.{cc[1]}",
                key="hardware_compatibility",
            )
        if params.precision in QDQ_PRECISIONS:
            add(
                "info",
                "needs-qdq-input",
                f"precision {params.precision!r} is built from Q/DQ nodes: the input must be a "
                f"'modelopt-quantize' target (quantize_mode = {params.precision!r})",
            )
        elif params.precision in ("fp16", "bf16"):
            add(
                "info",
                "trt11-needs-autocast",
                f"on TensorRT 11 (strongly typed only) precision {params.precision!r} must come from an "
                f"'autocast' input; TensorRT 10 uses the {params.precision.upper()} builder flag on a plain graph",
            )
        return out

    def run(self, ctx: BuildContext) -> dict[str, Any]:
        p = ctx.params
        trt = _env.require_module("tensorrt", self.name, INSTALL_TENSORRT)
        gpu = _env.require_gpu(self.name, ctx.hardware)
        version = str(trt.__version__)
        major = int(version.split(".")[0])
        art = ctx.input("onnx")
        onnx_path = _onnx.find_onnx(art.path)
        plan = precision_plan(p.precision, major, art.kind, (art.meta or {}).get("precision"))
        ctx.log(f"TensorRT {version} on {gpu['name']}; {plan.note}")

        logger = trt.Logger(trt.Logger.WARNING)
        builder = trt.Builder(logger)
        flags = 0
        if plan.strongly_typed and major < 11:
            flags |= 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
        network = builder.create_network(flags)
        parser = trt.OnnxParser(network, logger)
        if not parser.parse_from_file(str(onnx_path)):  # resolves external data beside the file
            errors = [str(parser.get_error(i)) for i in range(parser.num_errors)]
            raise RuntimeError(f"TensorRT could not parse {onnx_path.name}: " + "; ".join(errors))

        config = builder.create_builder_config()
        if p.workspace_gb:
            config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(p.workspace_gb * 2**30))
        config.builder_optimization_level = p.opt_level
        for flag in plan.flags:
            config.set_flag(getattr(trt.BuilderFlag, flag))
        if p.version_compatible:
            config.set_flag(trt.BuilderFlag.VERSION_COMPATIBLE)
        level = getattr(trt.HardwareCompatibilityLevel, HW_COMPAT[p.hardware_compatibility], None)
        if level is None:
            raise RuntimeError(
                f"TensorRT {version} has no hardware compatibility level {p.hardware_compatibility!r}"
            )
        config.hardware_compatibility_level = level

        inputs = {}
        for i in range(network.num_inputs):
            t = network.get_input(i)
            inputs[t.name] = tuple(int(d) for d in t.shape)
        shapes = profile_shapes(inputs, p)
        profile = builder.create_optimization_profile()
        for name, (lo, opt, hi) in shapes.items():
            profile.set_shape(name, lo, opt, hi)
        config.add_optimization_profile(profile)

        facts = {"tensorrt": version, "cuda": cuda_of_tensorrt(), **_env.gpu_facts()}
        cache_path: Path | None = None
        cache_loaded = 0
        if p.timing_cache:
            root, persistent = timing_cache.cache_root(ctx)
            cache_path = root / timing_cache.cache_file_name(facts, p.hardware_compatibility)
            blob = timing_cache.read(cache_path)
            cache_loaded = len(blob)
            config.set_timing_cache(config.create_timing_cache(blob), False)
            ctx.log(
                f"timing cache {cache_path} ({cache_loaded} bytes)"
                + ("" if persistent else "; not persisted: set MOPT_CACHE_DIR to keep it between builds")
            )

        t0 = time.perf_counter()
        serialized = builder.build_serialized_network(network, config)
        build_s = time.perf_counter() - t0
        if serialized is None:
            raise RuntimeError("TensorRT failed to build the engine (see the log above)")
        engine = bytes(memoryview(serialized))  # IHostMemory exposes the buffer protocol
        (ctx.out / "engine.plan").write_bytes(engine)
        cache_written = timing_cache.merge_and_write(cache_path, config, ctx.log) if cache_path else 0

        def tensor(t: Any) -> dict[str, Any]:
            return {
                "name": t.name,
                "dtype": TRT_DTYPES.get(t.dtype.name, t.dtype.name),
                "shape": [int(d) for d in t.shape],
            }

        io: dict[str, Any] = {"tensorrt": version, "precision": p.precision, "inputs": [], "outputs": []}
        for i in range(network.num_inputs):
            t = tensor(network.get_input(i))
            t["profile"] = dict(zip(("min", "opt", "max"), (list(s) for s in shapes[t["name"]]), strict=True))
            io["inputs"].append(t)
        io["outputs"] = [tensor(network.get_output(i)) for i in range(network.num_outputs)]
        (ctx.out / "io.json").write_text(json.dumps(io, indent=2, sort_keys=True) + "\n")
        graph_files = {onnx_path.name, *_onnx.external_data_files(onnx_path)}
        copied = _onnx.copy_companions(art.path, ctx.out, graph_files)
        ctx.log(f"engine built in {build_s:.1f} s ({len(engine) / 2**20:.1f} MB)")
        return {
            "tensorrt": version,
            "gpu": gpu["name"],
            "precision": p.precision,
            "strongly_typed": plan.strongly_typed,
            "builder_flags": list(plan.flags),
            "profile": {k: [list(s) for s in v] for k, v in shapes.items()},
            "build_seconds": round(build_s, 2),
            "timing_cache": {
                "path": str(cache_path) if cache_path else None,
                "loaded_bytes": cache_loaded,
                "written_bytes": cache_written,
            },
            "engine_mb": round(len(engine) / 2**20, 2),
            "files": ["engine.plan", "io.json", *copied],
            "reproducible": False,
            "note": "engine bytes are not reproducible across builds (TensorRT times tactics)",
        }
