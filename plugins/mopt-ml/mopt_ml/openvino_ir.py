"""Running an OpenVINO IR artifact (format `openvino-ir`): compile it with the runtime
properties its metadata records, read back what the CPU plugin actually chose, and embed texts.

`validate` and `bench` import this module when an artifact folder holds a `model.xml`, so that
they test an OpenVINO artifact the way they test an ONNX one; mopt-openvino, which makes those
artifacts and depends on mopt-ml, uses it to check what it built (mopt-ml never imports
mopt-openvino). Nothing here is imported at plugin load; openvino (installed with
mopt-openvino) is imported inside the functions.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

#: the IR's two files in an artifact folder
IR_XML = "model.xml"
IR_BIN = "model.bin"
#: the artifact format the kinds of this plugin produce (COMMON naming across plugins)
FORMAT = "openvino-ir"

#: recipe values of `inference_precision` → OpenVINO's element type names
PRECISIONS = {"f32": "f32", "bf16": "bf16"}


def is_ir(folder: Path) -> bool:
    """Whether `folder` holds an OpenVINO IR this module can run."""
    return (folder / IR_XML).is_file() and (folder / IR_BIN).is_file()


def core() -> Any:
    import openvino as ov

    return ov.Core()


def cpu_capabilities() -> dict[str, Any]:
    """What OpenVINO's CPU plugin reports about this CPU: its name and optimisation
    capabilities (FP32, BF16, INT8, ...), plus the x86 flags that decide its int8 and bf16
    kernels (VNNI, AMX, AVX512-BF16) from /proc/cpuinfo."""
    c = core()
    caps = [str(x) for x in c.get_property("CPU", "OPTIMIZATION_CAPABILITIES")]
    return {
        "device": str(c.get_property("CPU", "FULL_DEVICE_NAME")),
        "capabilities": caps,
        "flags": cpu_flags(),
    }


def cpu_flags() -> list[str]:
    """The CPU flags (of /proc/cpuinfo) that OpenVINO's int8 / bf16 kernels depend on."""
    wanted = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_bf16", "amx_int8", "amx_tile")
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            have = set(line.split(":", 1)[1].split())
            return [f for f in wanted if f in have]
    return []


def native_bf16() -> bool:
    """Whether this CPU has bf16 arithmetic OpenVINO uses natively (AVX512-BF16 or AMX);
    elsewhere a bf16 inference-precision hint runs in f32."""
    return bool({"avx512_bf16", "amx_bf16"} & set(cpu_flags()))


def runtime_properties(meta: dict[str, Any], threads: int | None = None) -> dict[str, Any]:
    """The compile properties for an artifact: its recorded runtime settings (inference
    precision, performance hint, streams), with `threads` inference threads."""
    rt = dict(meta.get("runtime") or {})
    props: dict[str, Any] = {
        "PERFORMANCE_HINT": rt.get("performance_hint", "LATENCY"),
        "NUM_STREAMS": int(rt.get("num_streams") or 1),
    }
    prec = rt.get("inference_precision")
    if prec and prec != "default":
        props["INFERENCE_PRECISION_HINT"] = PRECISIONS[prec]
    if threads:
        props["INFERENCE_NUM_THREADS"] = int(threads)
    return props


def effective(compiled: Any) -> dict[str, Any]:
    """What the CPU plugin chose (read back from the compiled model): the requested
    precision is a hint that falls back to f32 on CPUs without bf16."""
    prec = compiled.get_property("INFERENCE_PRECISION_HINT")
    return {
        "inference_precision": prec.get_type_name() if hasattr(prec, "get_type_name") else str(prec),
        "performance_hint": str(compiled.get_property("PERFORMANCE_HINT")),
        "num_streams": int(compiled.get_property("NUM_STREAMS")),
        "inference_num_threads": int(compiled.get_property("INFERENCE_NUM_THREADS")),
        "optimal_requests": int(compiled.get_property("OPTIMAL_NUMBER_OF_INFER_REQUESTS")),
    }


def compile_folder(folder: Path, threads: int | None = None, meta: dict[str, Any] | None = None) -> Any:
    """The artifact's model compiled for the CPU with its recorded runtime properties."""
    import json

    if meta is None:
        p = folder / "mopt_ml.json"
        meta = json.loads(p.read_text()) if p.is_file() else {}
    return compile_model(folder / IR_XML, runtime_properties(meta, threads))


def compile_model(model: Any, props: dict[str, Any]) -> Any:
    """`model` (an ov.Model or an IR path) compiled for the CPU with `props`."""
    c = core()
    if isinstance(model, Path):
        model = c.read_model(str(model))
    return c.compile_model(model, "CPU", props)


class Runner:
    """One infer request over a compiled model, fed like an ONNX Runtime session (a dict
    of int64 arrays, extra keys dropped), returning the first output."""

    def __init__(self, compiled: Any) -> None:
        self.compiled = compiled
        self.names = {n for i in compiled.inputs for n in i.get_names()}
        self.request = compiled.create_infer_request()

    def feeds(self, feeds: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in feeds.items() if k in self.names}

    def __call__(self, feeds: dict[str, Any], copy: bool = True) -> Any:
        out = self.request.infer(self.feeds(feeds), share_inputs=True, share_outputs=not copy)
        return out[0]


def embed(
    runner: Runner,
    tokenizer: Any,
    texts: Sequence[str],
    batch_size: int = 32,
    max_length: int = 128,
    pad_to: int | None = None,
) -> Any:
    """Pooled embeddings [len(texts), hidden], batched like mopt-ml's `embed_onnx`."""
    import numpy as np

    from mopt_ml.common import tokenize

    out = []
    for i in range(0, len(texts), batch_size):
        feeds = tokenize(tokenizer, texts[i : i + batch_size], max_length, pad_to)
        out.append(np.array(runner(feeds), dtype=np.float32))
    return np.concatenate(out)


def embed_folder(
    folder: Path, tokenizer: Any, texts: Sequence[str], threads: int | None = None, **kw: Any
) -> tuple[Any, dict[str, Any]]:
    """Embeddings of `texts` by the artifact in `folder`, and the runtime settings used."""
    compiled = compile_folder(folder, threads)
    return embed(Runner(compiled), tokenizer, texts, **kw), effective(compiled)
