"""The `triton-repo` target: a Triton Inference Server model repository.

Output layout (the artifact folder *is* the repository; start Triton with
`tritonserver --model-repository <artifact>`):

    <model>/config.pbtxt
    <model>/1/model.onnx (+ its external-data file)   platform "onnxruntime_onnx"
    <model>/1/model.plan                              platform "tensorrt_plan"

Inputs and outputs (names, types, dims) are read from the artifact itself: the ONNX graph
(with `onnx`, without loading weights) or the `io.json` a `trt-engine` writes beside its plan.
With `max_batch_size > 0`, axis 0 is Triton's implicit batch axis and is left out of `dims`.
Tokenization stays with the client (the repository serves token ids → embeddings).
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field

from mopt.api import BuildContext, CheckContext, Finding, Input, Params, Role, TargetKind

ONNX_TO_TRITON = {
    "FLOAT": "TYPE_FP32", "FLOAT16": "TYPE_FP16", "BFLOAT16": "TYPE_BF16", "DOUBLE": "TYPE_FP64",
    "INT64": "TYPE_INT64", "INT32": "TYPE_INT32", "INT16": "TYPE_INT16", "INT8": "TYPE_INT8",
    "UINT64": "TYPE_UINT64", "UINT32": "TYPE_UINT32", "UINT16": "TYPE_UINT16", "UINT8": "TYPE_UINT8",
    "BOOL": "TYPE_BOOL", "STRING": "TYPE_STRING",
}  # fmt: skip
TRT_TO_TRITON = {
    "float32": "TYPE_FP32", "float16": "TYPE_FP16", "bfloat16": "TYPE_BF16", "int64": "TYPE_INT64",
    "int32": "TYPE_INT32", "int8": "TYPE_INT8", "uint8": "TYPE_UINT8", "bool": "TYPE_BOOL",
}  # fmt: skip
ENGINE_KINDS = ("trt-engine",)


def onnx_io(onnx_path: Path) -> dict[str, list[dict[str, Any]]]:
    """Inputs (minus initializers) and outputs of a graph as {name, data_type, shape}; dynamic
    dims are -1."""
    import onnx

    model = onnx.load(str(onnx_path), load_external_data=False)
    # exporters leave some output dims symbolic that inference resolves (e.g. the hidden size);
    # if inference fails, the declared shapes are still valid
    with contextlib.suppress(Exception):
        model = onnx.shape_inference.infer_shapes(model)
    inits = {i.name for i in model.graph.initializer}

    def one(v: Any) -> dict[str, Any]:
        tt = v.type.tensor_type
        name = onnx.TensorProto.DataType.Name(tt.elem_type)
        if name not in ONNX_TO_TRITON:
            raise ValueError(f"tensor {v.name!r} has type {name}, which Triton does not take")
        shape = [int(d.dim_value) if d.HasField("dim_value") else -1 for d in tt.shape.dim]
        return {"name": v.name, "data_type": ONNX_TO_TRITON[name], "shape": shape}

    return {
        "inputs": [one(v) for v in model.graph.input if v.name not in inits],
        "outputs": [one(v) for v in model.graph.output],
    }


def fill_hidden_size(io: dict[str, Any], folder: Path) -> dict[str, Any]:
    """Resolve a symbolic last axis of the embedding output from the `onnx` kind's
    `mopt_ml.json` (its output name and hidden size), when the graph leaves it symbolic."""
    p = folder / "mopt_ml.json"
    meta = json.loads(p.read_text()) if p.is_file() else {}
    hidden, name = meta.get("hidden_size"), meta.get("output")
    for t in io["outputs"]:
        if isinstance(hidden, int) and t["name"] == name and len(t["shape"]) == 2 and t["shape"][1] == -1:
            t["shape"] = [t["shape"][0], hidden]
    return io


def engine_io(io_json: Path) -> dict[str, Any]:
    """The same from a trt-engine's io.json, plus the profile's max batch."""
    io = json.loads(io_json.read_text())

    def one(t: dict[str, Any]) -> dict[str, Any]:
        return {"name": t["name"], "data_type": TRT_TO_TRITON[t["dtype"]], "shape": list(t["shape"])}

    max_batch = min((t["profile"]["max"][0] for t in io["inputs"] if t.get("profile")), default=None)
    return {
        "inputs": [one(t) for t in io["inputs"]],
        "outputs": [one(t) for t in io["outputs"]],
        "max_batch": max_batch,
    }


def tensor_block(tensors: list[dict[str, Any]], batched: bool) -> list[str]:
    lines = []
    for k, t in enumerate(tensors):
        shape = t["shape"]
        if batched:
            if not shape or shape[0] != -1:
                raise ValueError(
                    f"tensor {t['name']!r} has shape {shape}: with max_batch_size > 0 its first axis must be the "
                    "dynamic batch axis (or set max_batch_size = 0)"
                )
            shape = shape[1:]
        dims = ", ".join(str(d) for d in shape) if shape else "1"
        lines += [
            "  {",
            f'    name: "{t["name"]}"',
            f"    data_type: {t['data_type']}",
            f"    dims: [ {dims} ]",
        ]
        lines.append("  }," if k < len(tensors) - 1 else "  }")
    return lines


def config_pbtxt(name: str, platform: str, io: dict[str, Any], p: Any, gpu: bool) -> str:
    """`config.pbtxt` (protobuf text format of Triton's ModelConfig)."""
    batched = p.max_batch_size > 0
    lines = [f'name: "{name}"', f'platform: "{platform}"', f"max_batch_size: {p.max_batch_size}", "input ["]
    lines += tensor_block(io["inputs"], batched)
    lines += ["]", "output ["]
    lines += tensor_block(io["outputs"], batched)
    lines += ["]", "instance_group [", "  {", f"    count: {p.instance_count}"]
    lines += [f"    kind: {'KIND_GPU' if gpu else 'KIND_CPU'}", "  }", "]"]
    if batched and p.dynamic_batching:
        lines.append("dynamic_batching {")
        if p.preferred_batch_size:
            lines.append(f"  preferred_batch_size: [ {', '.join(str(b) for b in p.preferred_batch_size)} ]")
        lines.append(f"  max_queue_delay_microseconds: {p.max_queue_delay_microseconds}")
        lines.append("}")
    return "\n".join(lines) + "\n"


def find_onnx(folder: Path) -> Path:
    """`model.onnx`, else the only `*.onnx` of the folder."""
    if (folder / "model.onnx").is_file():
        return folder / "model.onnx"
    found = sorted(folder.glob("*.onnx"))
    if len(found) != 1:
        raise FileNotFoundError(f"{folder} holds {len(found)} .onnx files; expected model.onnx")
    return found[0]


def model_dir_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)


class TritonRepoKind(TargetKind):
    """Triton model repository wrapping an ONNX graph or a TensorRT engine."""

    name = "triton-repo"
    version = "1"
    description = "Triton Inference Server model repository (config.pbtxt + version folder)"
    memory_model = "engine"  # mopt check: batch × sequence through one forward pass
    # `select` (a sweep's winner) first: a section that selects serves what it selected
    consumes = (Input("model", kinds=("select", "trt-engine", "ort-quantize", "onnx-slim", "onnx")),)
    produces = "triton-repo"
    per_hardware = True

    class Params(Params):
        model_name: str | None = Field(default=None, description="null: the recipe's model name")
        max_batch_size: Annotated[int, Role.batch_size] = Field(default=32, ge=0, description="0: no batching axis")
        dynamic_batching: bool = True
        preferred_batch_size: list[int] = Field(default=[], description="[] : Triton picks")
        max_queue_delay_microseconds: int = Field(default=100, ge=0)
        instance_count: int = Field(default=1, ge=1)
        instance_kind: Literal["auto", "gpu", "cpu"] = Field(
            default="auto", description="auto: from the profile"
        )

    def fingerprint(self) -> dict[str, str]:
        from mopt.api import plugin_env as _env

        return {"onnx": _env.dist_version("onnx") or "missing"}

    def check(self, params: Any, ctx: CheckContext) -> list[Finding]:
        out = []
        bad = [b for b in params.preferred_batch_size if b < 1 or b > params.max_batch_size]
        if bad:
            out.append(
                Finding(
                    "error",
                    "preferred-batch",
                    f"preferred_batch_size {bad} must lie in 1..max_batch_size ({params.max_batch_size})",
                    "",
                    ctx.section,
                    ctx.target,
                    "preferred_batch_size",
                )
            )
        if params.instance_kind == "gpu" and not ctx.hardware.is_gpu:
            out.append(
                Finding(
                    "error",
                    "engine-on-cpu",
                    f"instance_kind 'gpu' on profile {ctx.hardware.name!r}, which has no GPU",
                    'instance_kind = "auto"',
                    ctx.section,
                    ctx.target,
                    "instance_kind",
                )
            )
        return out

    def run(self, ctx: BuildContext) -> dict[str, Any]:
        p = ctx.params
        art = ctx.input("model")
        name = model_dir_name(p.model_name or ctx.model_name)
        version_dir = ctx.out / name / "1"
        version_dir.mkdir(parents=True)
        gpu = ctx.hardware.is_gpu if p.instance_kind == "auto" else p.instance_kind == "gpu"
        # a select output is its winner's files: serve it as the winner's kind
        kind = str(art.meta.get("winner_kind", art.kind)) if art.kind == "select" else art.kind
        if kind in ENGINE_KINDS:
            io = engine_io(art.path / "io.json")
            if p.max_batch_size > (io["max_batch"] or 0):
                raise ValueError(
                    f"max_batch_size {p.max_batch_size} exceeds the engine's profile max batch {io['max_batch']}"
                )
            shutil.copyfile(art.path / "engine.plan", version_dir / "model.plan")
            platform = "tensorrt_plan"
            if not gpu:
                raise ValueError("a TensorRT engine needs instance_kind gpu")
            files = ["model.plan"]
        else:
            onnx_path = find_onnx(art.path)
            io = fill_hidden_size(onnx_io(onnx_path), art.path)
            import onnx
            from onnx.external_data_helper import _get_all_tensors

            refs = set()
            for t in _get_all_tensors(onnx.load(str(onnx_path), load_external_data=False)):
                refs.update(kv.value for kv in t.external_data if kv.key == "location")
            shutil.copyfile(onnx_path, version_dir / "model.onnx")
            for ref in sorted(refs):
                shutil.copyfile(art.path / ref, version_dir / ref)
            platform = "onnxruntime_onnx"
            files = ["model.onnx", *sorted(refs)]
        text = config_pbtxt(name, platform, io, p, gpu)
        (ctx.out / name / "config.pbtxt").write_text(text)
        ctx.log(text)
        return {
            "model_name": name,
            "platform": platform,
            "inputs": [t["name"] for t in io["inputs"]],
            "outputs": [t["name"] for t in io["outputs"]],
            "files": [f"{name}/config.pbtxt", *(f"{name}/1/{f}" for f in files)],
        }
