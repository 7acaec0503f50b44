"""The `openvino` target: an OpenVINO IR (model.xml + model.bin, fp32 weights) of the
family's pooled embedding, converted from the ONNX graph (the default: the graph ONNX Runtime
runs, converted in seconds) or from the weights through OpenVINO's PyTorch frontend
(`input = "weights"`), with the tokenizer and config beside it.

Inference precision (f32 / bf16) is a runtime property of OpenVINO, not of the IR: the
recipe's value is recorded in the artifact's metadata, and `validate` / `bench` compile the
IR with it. On a CPU without native bf16 (no AVX512-BF16 / AMX) the CPU plugin runs a bf16
hint in f32; the metadata records what it chose on the machine that built it.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, ClassVar, Literal

from mopt.api import BuildContext, Input, Params, TargetKind
from pydantic import Field

TOOLS = ("openvino", "numpy", "transformers", "tokenizers")


class NumericCheckError(RuntimeError):
    """A converted IR does not compute what its input computes."""


class OpenVinoKind(TargetKind):
    """OpenVINO IR of the pooled embedding (inputs input_ids / attention_mask, output
    mopt_embedding), checked against its input on the shipped validation sentences."""

    preload = ("openvino",)  # imported once by the build's fork server

    name = "openvino"
    version = "1"
    description = "OpenVINO IR (fp32 weights; f32 or bf16 inference precision), from ONNX or the weights"
    produces: ClassVar[str] = "openvino-ir"
    consumes = (Input("model", formats=("onnx", "hf-checkpoint"), prefer=("onnx", "onnx-slim", "weights")),)
    requires = ("python:openvino",)
    install_hints: ClassVar[dict[str, str]] = {"python:openvino": "pip install -e plugins/mopt-openvino"}
    static_fingerprint = True  # library versions only: a no-op build may skip it

    class Params(Params):
        inference_precision: Literal["f32", "bf16", "default"] = Field(
            default="f32",
            description="runtime precision hint (default: OpenVINO's, bf16 on CPUs with AMX / AVX512-BF16)",
        )
        performance_hint: Literal["LATENCY", "THROUGHPUT"] = Field(
            default="LATENCY", description="OpenVINO performance hint validate and bench compile with"
        )
        num_streams: int = Field(default=1, ge=1, description="CPU streams (1: one request at a time)")
        compress_to_fp16: bool = Field(
            default=False, description="store weights as fp16 in model.bin (half the size; decompressed at load)"
        )
        check_min_cosine: float = Field(default=0.9999, description="fail below this min cosine vs the input")
        check_texts: int = Field(default=64, ge=4, description="validation sentences used by the check")
        max_length: int = Field(default=128, ge=8, description="tokenizer truncation for the check")

    def fingerprint(self) -> dict[str, str]:
        from mopt_ml.common import versions

        return versions(*TOOLS, "onnxruntime", "torch")

    def platform(self, hardware: Any) -> dict[str, Any]:
        # the recorded effective precision depends on the CPU's bf16 support
        from mopt_ml.openvino_ir import native_bf16

        return {"native_bf16": native_bf16()}

    def input_files(self, params: Any, project_dir: Path) -> list[Path]:
        from mopt_ml.common import data_input_files

        return data_input_files(None, project_dir)

    def run(self, ctx: BuildContext) -> dict[str, Any]:
        from mopt_ml.common import require

        art = ctx.input("model")
        # by what the input is, not by which kind made it: any kind's hf-checkpoint (a third
        # party's distill) converts from the weights, any kind's ONNX graph from the graph
        src_kind = "onnx" if any(art.path.glob("*.onnx")) else "weights"
        require("openvino", "transformers", *(("torch",) if src_kind == "weights" else ("onnxruntime",)))
        from mopt_ml.quantize import Shared

        # the IR of an ONNX graph is the same for every inference precision (a runtime
        # property): a section's `openvino` targets of one graph convert and check it once
        cache = Shared(ctx.cache_dir, art.digest) if ctx.cache_dir and src_kind != "weights" else None
        return convert(art.path, src_kind, ctx.out, ctx.family, ctx.params, ctx.log, cache)


def runtime_settings(params: Any) -> dict[str, Any]:
    """What the artifact's metadata records for the runtime (read by runtime_properties)."""
    return {
        "inference_precision": params.inference_precision,
        "performance_hint": params.performance_hint,
        "num_streams": params.num_streams,
    }


def convert(
    src: Path, src_kind: str, out: Path, family_obj: Any, params: Any, log: Any, cache: Any = None
) -> dict[str, Any]:
    import json
    import shutil

    import numpy as np
    import openvino as ov
    from mopt_ml import openvino_ir as runtime
    from mopt_ml.common import (
        INPUT_NAMES,
        META_FILE,
        OUTPUT_NAME,
        compare,
        copy_model_files,
        embed_onnx,
        model_onnx,
        ort_session,
        read_meta,
        spec_hash,
        validation_texts,
        versions,
        write_json,
    )
    from mopt_ml.families import as_family

    family = as_family(family_obj, src)
    tokenizer = family.load_tokenizer(src)
    texts = validation_texts()[: params.check_texts]
    src_meta: dict[str, Any] = {"family": family.name, "pooling": family.pooling}
    if src_kind != "weights":
        src_meta = read_meta(src)

    def converted(dest: Path = out) -> tuple[Any, dict[str, Any], float]:
        """The IR in `dest`, the source's embeddings of the check texts, the f32 check's
        numbers, and the conversion's seconds."""
        t0 = time.perf_counter()
        if src_kind == "weights":
            model, reference = _from_weights(src, family, tokenizer, texts, params.max_length)
        else:
            model = ov.convert_model(str(model_onnx(src)))
            reference = embed_onnx(ort_session(model_onnx(src)), tokenizer, texts, max_length=params.max_length)
        convert_s = time.perf_counter() - t0
        in_names = [i.get_any_name() for i in model.inputs]
        if sorted(in_names) != sorted(INPUT_NAMES) or len(model.outputs) != 1:
            raise RuntimeError(f"converted model has inputs {in_names} and {len(model.outputs)} outputs")
        model.outputs[0].get_tensor().set_names({OUTPUT_NAME})
        ov.save_model(model, str(dest / runtime.IR_XML), compress_to_fp16=params.compress_to_fp16)
        del model
        # the conversion is checked in f32 (the gate); the requested precision is then recorded
        # as the CPU plugin resolves it, with its numbers (validate gates those)
        f32 = runtime.compile_model(dest / runtime.IR_XML, {"INFERENCE_PRECISION_HINT": "f32"})
        got = runtime.embed(runtime.Runner(f32), tokenizer, texts, max_length=params.max_length)
        return reference, compare(reference, got), convert_s

    if cache is None:
        reference, numbers, convert_s = converted()
        log(f"converted from {src_kind} in {convert_s:.1f}s (weights {'fp16' if params.compress_to_fp16 else 'fp32'})")
    else:

        def compute() -> Path:
            work = out / ".convert"
            work.mkdir()
            ref, nums, secs = converted(work)
            np.save(work / "reference.npy", ref)
            (work / "check.json").write_text(json.dumps({"check": nums, "convert_s": secs}))
            return work

        key = {"fp16": params.compress_to_fp16, "texts": spec_hash(texts), "max_length": params.max_length}
        done = cache.get(cache.path("ir", key, ""), compute, lambda v, part: shutil.move(v, part), lambda p: p)
        for name in (runtime.IR_XML, runtime.IR_BIN):
            shutil.copyfile(done / name, out / name)
        reference = np.load(done / "reference.npy")
        saved = json.loads((done / "check.json").read_text())
        numbers, convert_s = saved["check"], saved["convert_s"]
        log(f"converted from {src_kind} in {convert_s:.1f}s (weights {'fp16' if params.compress_to_fp16 else 'fp32'}; "
            "once for the graph's openvino targets)")  # fmt: skip
    log(
        f"check vs {src_kind} on {len(texts)} sentences (f32): min cosine {numbers['min_cosine']:.6f}, "
        f"mean {numbers['mean_cosine']:.6f}, max abs diff {numbers['max_abs_diff']:.3g}"
    )
    if numbers["min_cosine"] < params.check_min_cosine:
        raise NumericCheckError(
            f"OpenVINO IR differs from its {src_kind} input: min cosine {numbers['min_cosine']:.6f} "
            f"< check_min_cosine {params.check_min_cosine} (mean {numbers['mean_cosine']:.6f})"
        )
    settings = runtime_settings(params)
    compiled = runtime.compile_model(out / runtime.IR_XML, runtime.runtime_properties({"runtime": settings}))
    eff = runtime.effective(compiled)
    at_precision = numbers
    if eff["inference_precision"] != "f32":
        got = runtime.embed(runtime.Runner(compiled), tokenizer, texts, max_length=params.max_length)
        at_precision = compare(reference, got)
    del compiled
    if params.inference_precision != "default" and eff["inference_precision"] != params.inference_precision:
        log(
            f"inference precision {params.inference_precision} requested; this CPU runs "
            f"{eff['inference_precision']} (no native bf16: AVX512-BF16 or AMX)"
        )
    copied = copy_model_files(src, out)
    meta = {
        "format": f"{runtime.FORMAT}/1",
        "family": src_meta.get("family", family.name),
        "pooling": src_meta.get("pooling", family.pooling),
        "inputs": list(INPUT_NAMES),
        "output": OUTPUT_NAME,
        "hidden_size": int(reference.shape[1]),
        "precision": "fp16" if params.compress_to_fp16 else "fp32",
        "inference_precision": params.inference_precision,
        "converted_from": src_kind,
        "runtime": settings,
        "built_on": {"effective": eff, "native_bf16": runtime.native_bf16()},
        "check": numbers,
        "check_at_precision": at_precision,
        "tools": versions(*TOOLS),
        "files": copied,
    }
    write_json(out / META_FILE, meta)
    return {
        "converted_from": src_kind,
        "convert_seconds": round(convert_s, 2),
        "inference_precision": params.inference_precision,
        "effective_precision": eff["inference_precision"],
        "check": numbers,
    }


def _from_weights(src: Path, family: Any, tokenizer: Any, texts: list[str], max_length: int) -> tuple[Any, Any]:
    """ov.Model from the family's PyTorch embedding wrapper (OpenVINO's PyTorch frontend),
    and the PyTorch reference embeddings of `texts`."""
    import openvino as ov
    import torch
    from mopt_ml.common import INPUT_NAMES, calibration_texts, tokenize

    model = family.load(src, dtype="fp32")
    wrapper = family.export_wrapper(model)
    # a padded example, as for the ONNX export: masked code paths must be traced
    example = tokenize(tokenizer, [calibration_texts()[0], "A short one."], max_length=32)
    args = tuple(torch.from_numpy(example[n]) for n in INPUT_NAMES)
    with torch.no_grad():
        # traced here, without torch.jit's re-trace check: mopt runs actions in threads of one
        # process, and a class traced before (the ONNX export) comes back name-mangled, which
        # that check (run by convert_model's own tracing) reports as a diverging graph
        traced = torch.jit.trace(wrapper, args, check_trace=False, strict=False)
        ov_model = ov.convert_model(
            traced,
            example_input=args,
            input=[(ov.PartialShape([-1, -1]), ov.Type.i64) for _ in INPUT_NAMES],
        )
    for port, name in zip(ov_model.inputs, INPUT_NAMES, strict=True):  # traced inputs are unnamed
        port.get_tensor().set_names({name})
    reference = family.embed(model, tokenizer, texts, max_length=max_length)
    return ov_model, reference
