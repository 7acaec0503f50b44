"""The `nncf-quantize` target: INT8 post-training quantization of an OpenVINO IR with NNCF.

NNCF quantizes weights and activations statically (scales from calibration statistics) and
inserts FakeQuantize ops that OpenVINO's CPU plugin fuses into int8 kernels; with
`model_type = "transformer"` it also applies SmoothQuant to the MatMuls and keeps the ops
that lose accuracy (softmax, layer norm inputs, ...) in floating point.

Calibration uses the recipe's `calibration` texts, or the shipped calibration split: never
the validation split that `validate` reports on.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, ClassVar, Literal

from mopt.api import BuildContext, Input, Params, TargetKind
from pydantic import Field

TOOLS = ("openvino", "nncf", "numpy", "transformers", "tokenizers")


class NncfQuantizeKind(TargetKind):
    """NNCF post-training INT8 of an `openvino` IR, calibrated on the recipe's calibration
    texts; a quick check against the fp32 IR is logged (validate gates)."""

    preload = ("openvino", "nncf")  # imported once by the build's fork server

    name = "nncf-quantize"
    version = "1"
    description = "OpenVINO IR, INT8 by NNCF post-training quantization (SmoothQuant, static activations)"
    produces: ClassVar[str] = "openvino-ir"
    consumes = (Input("model", kinds=("openvino",)),)
    requires = ("python:openvino", "python:nncf")
    install_hints: ClassVar[dict[str, str]] = {
        "python:openvino": "pip install -e plugins/mopt-openvino",
        "python:nncf": "pip install -e plugins/mopt-openvino",
    }
    static_fingerprint = True  # library versions only: a no-op build may skip it

    class Params(Params):
        model_type: Literal["transformer", "none"] = Field(
            default="transformer",
            description="transformer: SmoothQuant, and attention/normalisation ops kept in float",
        )
        preset: Literal["performance", "mixed"] = Field(
            default="performance",
            description="performance: symmetric activations; mixed: asymmetric activations (more accurate, slower)",
        )
        smooth_quant_alpha: float = Field(
            default=0.95,
            ge=-1.0,
            le=1.0,
            description="SmoothQuant migration strength for MatMuls (-1 turns it off); 0.95 kept MiniLM's "
            "min cosine highest on AVX2 (0.987, vs 0.980 at 0.7)",
        )
        subset_size: int = Field(default=300, ge=1, description="calibration samples used, at most")
        fast_bias_correction: bool = Field(default=True, description="NNCF's fast bias correction")
        bias_correction: bool = Field(default=True, description="correct the bias shift quantization causes")
        overflow_fix: Literal["first_layer_only", "enable", "disable"] = Field(
            default="first_layer_only",
            description="7-bit weights against u8×s8 saturation on CPUs without VNNI (first layer / all / none)",
        )
        target_device: Literal["ANY", "CPU", "CPU_SPR"] = Field(
            default="CPU", description="hardware the quantization scheme is chosen for"
        )
        ignored_names: list[str] = Field(default=[], description="node names left in float")
        ignored_types: list[str] = Field(default=[], description="op types left in float (e.g. Multiply)")
        ignored_patterns: list[str] = Field(default=[], description="node-name regexes left in float")
        calibration: str | None = Field(
            default=None,
            description="calibration texts (.txt / .jsonl, relative to the recipe); null: the shipped split",
        )
        calibration_pad_to: int | None = Field(
            default=None, ge=8, description="pad calibration samples to this length (null: their own length)"
        )
        calibration_batch_size: int = Field(default=1, ge=1, description="texts per calibration sample")
        max_length: int = Field(default=128, ge=8, description="tokenizer truncation")
        inference_precision: Literal["f32", "bf16", "default"] = Field(
            default="default",
            description="precision of the ops left in float (default: OpenVINO's, bf16 where native)",
        )
        performance_hint: Literal["LATENCY", "THROUGHPUT"] = Field(
            default="LATENCY", description="OpenVINO performance hint validate and bench compile with"
        )
        num_streams: int = Field(default=1, ge=1, description="CPU streams (1: one request at a time)")
        check_texts: int = Field(default=64, ge=4, description="validation sentences for the quick check")

    def fingerprint(self) -> dict[str, str]:
        from mopt_ml.common import versions

        return versions(*TOOLS)

    def platform(self, hardware: Any) -> dict[str, Any]:
        # the quick check and the recorded effective precision run on this CPU
        from mopt_ml.openvino_ir import native_bf16

        return {"native_bf16": native_bf16()}

    def input_files(self, params: Any, project_dir: Path) -> list[Path]:
        from mopt_ml.common import data_input_files, shipped_sentences_path

        files = data_input_files(params.calibration, project_dir)
        if shipped_sentences_path() not in files:
            files.append(shipped_sentences_path())  # the quick check reads the shipped split
        return files

    def run(self, ctx: BuildContext) -> dict[str, Any]:
        from mopt_ml.common import require

        require("openvino", "nncf", "transformers")
        return quantize(ctx.input("model").path, ctx.out, ctx.family, ctx.params, ctx.project_dir, ctx.log)


def calibration_items(tokenizer: Any, texts: list[str], params: Any) -> list[dict[str, Any]]:
    """One feed dict per calibration sample (NNCF counts `subset_size` in samples)."""
    from mopt_ml.common import tokenize

    bs = params.calibration_batch_size
    return [
        tokenize(tokenizer, texts[i : i + bs], max_length=params.max_length, pad_to=params.calibration_pad_to)
        for i in range(0, len(texts), bs)
    ]


def _progress_to_stderr() -> None:
    """NNCF draws its progress bars on rich's global console and logs through a handler,
    both writing to stdout: that would corrupt `mopt build --json`. Point both at stderr
    (mopt's own output uses consoles of its own; nothing else here draws on the global one)."""
    import logging
    import sys

    import rich

    if not rich.get_console().stderr:
        rich.reconfigure(stderr=True)
    for handler in logging.getLogger("nncf").handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stdout:
            handler.setStream(sys.stderr)


def quantize(
    src: Path, out: Path, family_obj: Any, params: Any, project_dir: Path, log: Any
) -> dict[str, Any]:
    import nncf
    import openvino as ov
    from mopt_ml import openvino_ir as runtime
    from mopt_ml.common import (
        META_FILE,
        compare,
        copy_model_files,
        read_meta,
        texts_from_param,
        validation_texts,
        versions,
        write_json,
    )
    from mopt_ml.families import as_family

    meta = read_meta(src)
    if meta.get("precision", "fp32") != "fp32":
        raise ValueError(f"nncf-quantize needs an IR with fp32 weights; {src} has {meta.get('precision')}")
    family = as_family(family_obj, src)
    tokenizer = family.load_tokenizer(src)
    calib_texts = texts_from_param(params.calibration, project_dir, "calibration")
    items = calibration_items(tokenizer, calib_texts, params)
    model = runtime.core().read_model(str(src / runtime.IR_XML))

    advanced = nncf.AdvancedQuantizationParameters(
        overflow_fix=nncf.OverflowFix(params.overflow_fix),
        disable_bias_correction=not params.bias_correction,
        smooth_quant_alpha=params.smooth_quant_alpha,
    )
    ignored = None
    if params.ignored_names or params.ignored_types or params.ignored_patterns:
        ignored = nncf.IgnoredScope(
            names=list(params.ignored_names),
            types=list(params.ignored_types),
            patterns=list(params.ignored_patterns),
            validate=False,
        )
    _progress_to_stderr()
    t0 = time.perf_counter()
    qmodel = nncf.quantize(
        model,
        nncf.Dataset(items),
        preset=nncf.QuantizationPreset(params.preset),
        target_device=nncf.TargetDevice(params.target_device),
        subset_size=min(params.subset_size, len(items)),  # fewer texts than asked for: all of them
        fast_bias_correction=params.fast_bias_correction,
        model_type=nncf.ModelType.TRANSFORMER if params.model_type == "transformer" else None,
        ignored_scope=ignored,
        advanced_parameters=advanced,
    )
    quant_s = time.perf_counter() - t0
    ov.save_model(qmodel, str(out / runtime.IR_XML), compress_to_fp16=False)
    fq = sum(1 for op in qmodel.get_ops() if op.get_type_name() == "FakeQuantize")
    del qmodel, model

    settings = {
        "inference_precision": params.inference_precision,
        "performance_hint": params.performance_hint,
        "num_streams": params.num_streams,
    }
    # a quick look (no gate: validate's job) against the fp32 input IR, both as recorded
    texts = validation_texts()[: params.check_texts]
    ref = runtime.embed(runtime.Runner(runtime.compile_folder(src, meta=meta)), tokenizer, texts)
    compiled = runtime.compile_model(out / runtime.IR_XML, runtime.runtime_properties({"runtime": settings}))
    got = runtime.embed(runtime.Runner(compiled), tokenizer, texts)
    eff = runtime.effective(compiled)
    del compiled
    check = compare(ref, got)
    log(
        f"NNCF INT8 ({params.preset}, {params.model_type}, SmoothQuant alpha {params.smooth_quant_alpha}, "
        f"{min(len(items), params.subset_size)} calibration samples) in {quant_s:.1f}s, {fq} FakeQuantize ops; "
        f"vs the fp32 IR on {check['n']} sentences: min cosine {check['min_cosine']:.4f}, "
        f"mean {check['mean_cosine']:.4f} (runs {eff['inference_precision']} outside int8)"
    )
    copy_model_files(src, out)
    new_meta = dict(meta)
    new_meta.update(
        {
            "precision": "int8",
            "inference_precision": params.inference_precision,
            "runtime": settings,
            "built_on": {"effective": eff, "native_bf16": runtime.native_bf16()},
            "quantization": {
                "mode": "static",
                "tool": "nncf",
                "model_type": params.model_type,
                "preset": params.preset,
                "smooth_quant_alpha": params.smooth_quant_alpha,
                "subset_size": params.subset_size,
                "fast_bias_correction": params.fast_bias_correction,
                "bias_correction": params.bias_correction,
                "overflow_fix": params.overflow_fix,
                "target_device": params.target_device,
                "fake_quantize_ops": fq,
                "calibration": {
                    "texts": len(calib_texts),
                    "samples": min(len(items), params.subset_size),
                    "pad_to": params.calibration_pad_to,
                    "source": params.calibration or "shipped calibration split",
                },
                "check_vs_fp32": check,
                "nncf": versions("nncf")["nncf"],
            },
            "tools": versions(*TOOLS),
        }
    )
    write_json(out / META_FILE, new_meta)
    return {
        "fake_quantize_ops": fq,
        "check_vs_fp32": check,
        "quantize_seconds": round(quant_s, 2),
        "effective_precision": eff["inference_precision"],
    }
