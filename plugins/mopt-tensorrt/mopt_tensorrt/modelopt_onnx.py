"""ONNX graphs whose precision is set before TensorRT sees them (NVIDIA Model Optimizer):

* `autocast` — fp16/bf16 mixed precision via `python -m modelopt.onnx.autocast` (what
  TensorRT 11's strongly typed builds need instead of the removed FP16/BF16 builder flags);
* `modelopt-quantize` — explicit Q/DQ (int8 / fp8 / int4) via `python -m modelopt.onnx.quantization`.

Both run ModelOpt's command-line entry points in a subprocess (so nothing heavy is imported
into mopt) and copy the input's tokenizer and config files beside the new `model.onnx`.
Calibration inputs come from an `.npz` file, or are tokenized from a text file with the
artifact's own tokenizer.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field

from mopt.api import BuildContext, CheckContext, Finding, Input, Params, Role, TargetKind
from mopt.api import plugin_env as _env
from mopt_tensorrt import _onnx

INSTALL_MODELOPT = 'pip install "nvidia-modelopt[onnx]"'
ONNX_INPUTS = ("onnx-slim", "onnx")


def autocast_argv(python: str, src: Path, dst: Path, p: Any, calibration: Path | None) -> list[str]:
    """`python -m modelopt.onnx.autocast ...` for these params."""
    argv = [python, "-m", "modelopt.onnx.autocast", "--onnx_path", str(src), "--output_path", str(dst)]
    argv += ["--low_precision_type", p.low_precision_type]
    if p.keep_io_types:
        argv.append("--keep_io_types")
    if calibration is not None:
        argv += ["--calibration_data", str(calibration)]
    if p.data_max is not None:
        argv += ["--data_max", repr(float(p.data_max))]
    if p.init_max is not None:
        argv += ["--init_max", repr(float(p.init_max))]
    if p.op_types_to_exclude:
        argv += ["--op_types_to_exclude", *p.op_types_to_exclude]
    if p.nodes_to_exclude:
        argv += ["--nodes_to_exclude", *p.nodes_to_exclude]
    if p.opset is not None:
        argv += ["--opset", str(p.opset)]
    argv += ["--providers", *p.providers]
    return argv


def calibration_flag(help_text: str) -> str:
    """ModelOpt renamed `--calibration_data` to `--calibration_data_path`; use what is there."""
    return "--calibration_data_path" if "--calibration_data_path" in help_text else "--calibration_data"


def quantize_argv(
    python: str, src: Path, dst: Path, p: Any, calibration: Path | None, calib_flag: str, external: bool
) -> list[str]:
    """`python -m modelopt.onnx.quantization ...` for these params."""
    argv = [python, "-m", "modelopt.onnx.quantization", "--onnx_path", str(src), "--output_path", str(dst)]
    argv += ["--quantize_mode", p.quantize_mode, "--high_precision_dtype", p.high_precision_dtype]
    if p.calibration_method is not None:
        argv += ["--calibration_method", p.calibration_method]
    if calibration is not None:
        argv += [calib_flag, str(calibration)]
    if p.calibration_eps:
        argv += ["--calibration_eps", *p.calibration_eps]
    if p.op_types_to_exclude:
        argv += ["--op_types_to_exclude", *p.op_types_to_exclude]
    if p.nodes_to_exclude:
        argv += ["--nodes_to_exclude", *p.nodes_to_exclude]
    if p.simplify:
        argv.append("--simplify")
    if external:
        argv.append("--use_external_data_format")
    return argv


def read_texts(path: Path, limit: int) -> list[str]:
    """Texts from a .jsonl file (`text` field) or a plain text file (one per line)."""
    out: list[str] = []
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line:
            continue
        if path.suffix == ".jsonl":
            obj = json.loads(line)
            line = obj["text"] if isinstance(obj, dict) else str(obj)
        out.append(line)
        if len(out) >= limit:
            break
    if not out:
        raise ValueError(f"{path} holds no texts")
    return out


def make_calibration_npz(
    art_dir: Path, onnx_path: Path, texts: list[str], seq_len: int, dst: Path, family: Any
) -> Path:
    """Tokenize `texts` with the artifact's tokenizer, padded to `seq_len`, into an .npz whose
    keys are the graph's input names."""
    import numpy as np

    if family is not None and isinstance(family, type):
        family = family()
    if family is not None and hasattr(family, "load_tokenizer"):
        tok = family.load_tokenizer(art_dir)
    else:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(art_dir))
    enc = tok(texts, padding="max_length", truncation=True, max_length=seq_len, return_tensors="np")
    names = [i["name"] for i in _onnx.graph_io(onnx_path)["inputs"]]
    missing = [n for n in names if n not in enc]
    if missing:
        raise RuntimeError(f"the tokenizer gives no {missing} for the graph's inputs {names}")
    np.savez(dst, **{n: enc[n].astype(np.int64) for n in names})
    return dst


def run_logged(argv: list[str], ctx: BuildContext) -> None:
    ctx.log("$ " + " ".join(argv))
    proc = subprocess.run(
        argv, cwd=ctx.tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace"
    )
    for line in proc.stdout.splitlines():
        ctx.log(line)
    if proc.returncode != 0:
        raise RuntimeError(f"{argv[2]} exited with status {proc.returncode} (log above)")


class _CalibrationParams(Params):
    calibration_data: str | None = Field(
        default=None, description="an .npz of graph inputs (relative to the recipe)"
    )
    calibration_texts: str | None = Field(
        default=None, description="a .jsonl (`text`) or .txt file tokenized with the artifact's tokenizer"
    )
    calibration_samples: int = Field(default=128, ge=1)
    calibration_seq_len: Annotated[int, Role.seq_len] = Field(default=128, ge=1)


def _calibration(ctx: BuildContext, onnx_path: Path, art_dir: Path) -> Path | None:
    p = ctx.params
    if p.calibration_data:
        return (ctx.project_dir / p.calibration_data).resolve()
    if p.calibration_texts:
        texts = read_texts((ctx.project_dir / p.calibration_texts).resolve(), p.calibration_samples)
        ctx.log(f"calibration: {len(texts)} texts padded to {p.calibration_seq_len} tokens")
        return make_calibration_npz(
            art_dir, onnx_path, texts, p.calibration_seq_len, ctx.tmp / "calib.npz", ctx.family
        )
    return None


def _calib_files(params: Any, project_dir: Path) -> list[Path]:
    return [(project_dir / f).resolve() for f in (params.calibration_data, params.calibration_texts) if f]


def _modelopt_fingerprint() -> dict[str, str]:
    return {
        "nvidia-modelopt": _env.dist_version("nvidia-modelopt") or "missing",
        "onnx": _env.dist_version("onnx") or "missing",
        "onnxruntime": _env.dist_version("onnxruntime", "onnxruntime-gpu") or "missing",
    }


class AutoCastKind(TargetKind):
    """fp16/bf16 mixed-precision ONNX via ModelOpt AutoCast (the strongly typed path)."""

    name = "autocast"
    version = "1"
    description = "fp16/bf16 mixed-precision ONNX via python -m modelopt.onnx.autocast"
    memory_model = "none"
    consumes = (Input("onnx", kinds=ONNX_INPUTS),)
    produces = "onnx"
    requires = ("python:modelopt", "python:onnx", "python:onnxruntime")
    install_hints: ClassVar[dict[str, str]] = {"python:modelopt": INSTALL_MODELOPT}

    class Params(_CalibrationParams):
        low_precision_type: Literal["fp16", "bf16"] = "fp16"
        keep_io_types: bool = Field(default=True, description="keep fp32 graph inputs and outputs")
        data_max: float | None = Field(default=None, description="nodes with larger outputs stay fp32")
        init_max: float | None = Field(default=None, description="nodes with larger initializers stay fp32")
        op_types_to_exclude: list[str] = Field(default=[])
        nodes_to_exclude: list[str] = Field(default=[], description="regexes of node names kept in fp32")
        opset: int | None = None
        providers: list[str] = Field(
            default=["cpu"], description="ONNX Runtime providers of the reference runs"
        )

    def input_files(self, params: Any, project_dir: Path) -> list[Path]:
        return _calib_files(params, project_dir)

    def fingerprint(self) -> dict[str, str]:
        return _modelopt_fingerprint()

    def check(self, params: Any, ctx: CheckContext) -> list[Finding]:
        hw = ctx.hardware
        out = []
        if not hw.is_gpu:
            out.append(
                Finding(
                    "warning",
                    "autocast-on-cpu",
                    f"autocast graphs are made for TensorRT; profile {hw.name!r} has no GPU",
                    "use the fp32 onnx (or ort-quantize) on CPU",
                    ctx.section,
                    ctx.target,
                )
            )
        elif params.low_precision_type not in hw.precisions:
            out.append(
                Finding(
                    "error",
                    "precision-unsupported",
                    f"{params.low_precision_type} needs compute capability >= 8.0; {hw.name} supports "
                    f"{', '.join(hw.precisions)}",
                    'low_precision_type = "fp16"',
                    ctx.section,
                    ctx.target,
                    "low_precision_type",
                )
            )
        return out

    def run(self, ctx: BuildContext) -> dict[str, Any]:
        p = ctx.params
        if not _env.has_module("modelopt"):
            raise RuntimeError(
                f"target kind 'autocast' needs the Python package 'modelopt' ({INSTALL_MODELOPT})"
            )
        art = ctx.input("onnx")
        src = _onnx.find_onnx(art.path)
        calib = _calibration(ctx, src, art.path)
        run_logged(autocast_argv(sys.executable, src, ctx.out / "model.onnx", p, calib), ctx)
        copied = _onnx.copy_companions(art.path, ctx.out, {src.name, *_onnx.external_data_files(src)})
        _onnx.update_ml_meta(ctx.out, precision=p.low_precision_type)
        return {
            "precision": p.low_precision_type,
            "keep_io_types": p.keep_io_types,
            "calibration": "npz" if p.calibration_data else ("texts" if p.calibration_texts else "random"),
            "modelopt": _env.dist_version("nvidia-modelopt"),
            "files": ["model.onnx", *copied],
        }


class ModelOptQuantizeKind(TargetKind):
    """Explicitly quantized (Q/DQ) ONNX via ModelOpt's ONNX PTQ."""

    name = "modelopt-quantize"
    version = "1"
    description = "int8/fp8/int4 Q/DQ ONNX via python -m modelopt.onnx.quantization"
    memory_model = "none"
    consumes = (Input("onnx", kinds=ONNX_INPUTS),)
    produces = "onnx"
    requires = ("python:modelopt", "python:onnx", "python:onnxruntime")
    install_hints: ClassVar[dict[str, str]] = {"python:modelopt": INSTALL_MODELOPT}

    class Params(_CalibrationParams):
        quantize_mode: Literal["int8", "fp8", "int4"] = "int8"
        calibration_method: Literal["max", "entropy", "awq_clip", "rtn_dq"] | None = Field(
            default=None, description="null: ModelOpt's default (entropy for int8/fp8, awq_clip for int4)"
        )
        high_precision_dtype: Literal["fp32", "fp16", "bf16"] = "fp16"
        calibration_eps: list[str] = Field(default=[], description="[] : ModelOpt's default order")
        op_types_to_exclude: list[str] = Field(default=[])
        nodes_to_exclude: list[str] = Field(default=[])
        simplify: bool = False

    def input_files(self, params: Any, project_dir: Path) -> list[Path]:
        return _calib_files(params, project_dir)

    def fingerprint(self) -> dict[str, str]:
        return _modelopt_fingerprint()

    def check(self, params: Any, ctx: CheckContext) -> list[Finding]:
        hw = ctx.hardware
        out = []

        def add(sev: str, code: str, msg: str, fix: str = "", key: str | None = None) -> None:
            out.append(Finding(sev, code, msg, fix, ctx.section, ctx.target, key))

        if params.quantize_mode not in hw.precisions:
            need = {"fp8": "8.9", "int4": "7.5"}.get(params.quantize_mode, "?")
            add(
                "error",
                "precision-unsupported",
                f"quantize_mode {params.quantize_mode!r} needs compute capability >= {need}; {hw.name} supports "
                f"{', '.join(hw.precisions)}",
                'quantize_mode = "int8"',
                "quantize_mode",
            )
        if params.high_precision_dtype == "bf16" and "bf16" not in hw.precisions:
            add(
                "error",
                "precision-unsupported",
                f"bf16 is not supported on {hw.name}",
                key="high_precision_dtype",
            )
        if not params.calibration_data and not params.calibration_texts and params.quantize_mode != "int4":
            add(
                "warning",
                "no-calibration-data",
                "no calibration_data / calibration_texts: ModelOpt calibrates on random inputs, so the scales "
                "say nothing about real activations",
                'calibration_texts = "data/calib.jsonl"',
            )
        if params.calibration_method in ("awq_clip", "rtn_dq") and params.quantize_mode != "int4":
            add(
                "error",
                "bad-calibration-method",
                f"calibration_method {params.calibration_method!r} is for int4; int8/fp8 take max or entropy",
                key="calibration_method",
            )
        return out

    def run(self, ctx: BuildContext) -> dict[str, Any]:
        p = ctx.params
        if not _env.has_module("modelopt"):
            raise RuntimeError(
                f"target kind 'modelopt-quantize' needs the Python package 'modelopt' ({INSTALL_MODELOPT})"
            )
        art = ctx.input("onnx")
        src = _onnx.find_onnx(art.path)
        data_files = _onnx.external_data_files(src)
        size = src.stat().st_size + sum((art.path / f).stat().st_size for f in data_files)
        external = bool(data_files) or size > 1.9e9
        calib = _calibration(ctx, src, art.path)
        helptext = subprocess.run(
            [sys.executable, "-m", "modelopt.onnx.quantization", "--help"], capture_output=True, text=True
        ).stdout
        argv = quantize_argv(
            sys.executable, src, ctx.out / "model.onnx", p, calib, calibration_flag(helptext), external
        )
        run_logged(argv, ctx)
        copied = _onnx.copy_companions(art.path, ctx.out, {src.name, *data_files})
        _onnx.update_ml_meta(ctx.out, precision=p.quantize_mode)
        return {
            "precision": p.quantize_mode,
            "high_precision_dtype": p.high_precision_dtype,
            "calibration": "npz" if p.calibration_data else ("texts" if p.calibration_texts else "random"),
            "modelopt": _env.dist_version("nvidia-modelopt"),
            "files": ["model.onnx", *copied],
        }
