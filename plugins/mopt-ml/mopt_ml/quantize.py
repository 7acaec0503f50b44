"""The `ort-quantize` target: ONNX Runtime INT8 (dynamic or static) with SmoothQuant-style
smoothing.

The defaults are the settings that kept all-MiniLM-L6-v2 above a 0.99 min cosine, not the
library's: smoothing (alpha 0.7, calibration padded to the benchmark length), then dynamic
per-channel INT8 on MatMul only. ORT's own defaults (per-tensor, every op type) lost accuracy
(min cosine 0.90) and static QDQ collapsed (0.22-0.27).

Smoothing (Xiao et al., SmoothQuant): for every group of MatMuls that share an input X and
have constant weights W ([in, out]), per input channel j

    s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)

an fp32 `Mul(X, 1/s)` is inserted before the group and every W becomes diag(s)·W. The product
is unchanged, but the outlier channels of X move into the weights, which are quantized per
output channel, so the per-tensor dynamic scale of X gets finer.

Task-aware: on a text-generation graph (the `onnx` kind's KV-cache graph) the same modes run
(calibration batches are left-padded sentences with an empty past), and mode
"matmul-nbits" quantizes the MatMul weights only, to 4 or 8 bits in blocks
(onnxruntime's MatMulNBitsQuantizer, RTN; activations stay fp32, or int8 inside the kernel
with `nbits_accuracy_level = 4`). The quick look is then next-token logits and greedy
continuations against the fp32 graph, not embeddings; the gates are validate's.

Mode "rtn" (text generation) simulates a weight format instead of running one: every
constant MatMul weight (the head's too) is rounded to `nbits_bits`-bit symmetric integers
times a scale per tensor, per output channel or per `nbits_block_size` block, and stored
back in fp32 (fake quantization: the accuracy of the format, none of its speed).
`rtn_scale = "tensor"` at 4 bits is the deliberately poor quantization a recipe's accuracy
gates must reject (recipes/qwen3-chat.toml's `int4-tensor`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

from mopt.api import BuildContext, Input, Params, TargetKind
from pydantic import Field


class OrtQuantizeKind(TargetKind):
    static_fingerprint = True  # library versions only: a no-op build may skip it
    """ONNX Runtime INT8 quantization of an fp32 graph (onnx-slim or onnx), optionally
    smoothed first."""

    preload = ("onnx", "onnxruntime", "onnxruntime.quantization")  # imported once by the build's fork server

    name = "ort-quantize"
    version = "1"
    description = "ONNX Runtime INT8 (dynamic/static), per-channel, SmoothQuant-style smoothing"
    consumes = (Input("model", formats=("onnx",), kinds=("onnx-slim", "onnx")),)
    produces = "onnx"

    class Params(Params):
        mode: Literal["dynamic", "static", "matmul-nbits", "rtn"] = Field(
            default="dynamic",
            description="dynamic / static INT8 (activations quantized at run time / calibrated), "
            "matmul-nbits: weight-only 4/8-bit blocks on MatMul (MatMulNBits), or rtn: simulated "
            "round-to-nearest weights stored in fp32 (an accuracy probe, no speed-up)",
        )
        nbits_bits: Literal[4, 8] = Field(default=4, description="matmul-nbits / rtn: weight bits")
        nbits_block_size: int = Field(
            default=32, ge=16, description="matmul-nbits / rtn (block): block size (power of 2)"
        )
        rtn_scale: Literal["tensor", "channel", "block"] = Field(
            default="block",
            description="rtn: one scale per weight tensor, per output channel, or per nbits_block_size "
            "input rows of a channel",
        )
        nbits_symmetric: bool = Field(default=True, description="matmul-nbits: symmetric blocks (no zero point)")
        nbits_accuracy_level: Literal[0, 1, 2, 3, 4] | None = Field(
            default=None,
            description="matmul-nbits: compute type of the kernel (4: int8 activations, 1: fp32; null: ORT's)",
        )
        greedy_tokens: int = Field(
            default=16, ge=1, description="text-generation: greedy tokens per prompt in the quick look vs fp32"
        )
        per_channel: bool = Field(default=True, description="weight scales per output channel")
        op_types: list[str] = Field(default=["MatMul"], description="op types to quantize")
        weight_type: Literal["auto", "qint8", "quint8"] = Field(
            default="auto",
            description="auto: qint8 on x86 CPUs with VNNI/AMX, else quint8 (u8s8 kernels saturate on AVX2)",
        )
        activation_type: Literal["quint8", "qint8"] = Field(default="quint8", description="static mode only")
        reduce_range: bool = Field(default=False, description="7-bit weights (older non-VNNI CPUs)")
        smooth: bool = Field(default=True, description="SmoothQuant-style per-channel smoothing first")
        smooth_alpha: float = Field(default=0.7, ge=0.0, le=1.0, description="migration strength")
        calibration: str | None = Field(
            default=None,
            description="calibration texts (.txt / .jsonl, relative to the recipe); null: the shipped split",
        )
        calibration_pad_to: int | None = Field(
            default=128, ge=8, description="pad calibration batches to this length (the benchmark's)"
        )
        calibration_batch_size: int = Field(default=8, ge=1, description="texts per calibration batch")
        calibration_method: Literal["minmax", "entropy", "percentile"] = Field(
            default="minmax", description="static mode only"
        )
        quant_format: Literal["qdq", "qoperator"] = Field(default="qdq", description="static mode only")
        preprocess: bool = Field(default=True, description="onnxruntime quant_pre_process first")
        exclude_nodes: list[str] = Field(default=[], description="node names left in fp32")
        check_texts: int = Field(default=64, ge=4, description="validation sentences for the quick check")

    def fingerprint(self) -> dict[str, str]:
        from mopt_ml.common import versions

        return versions("onnx", "onnxruntime", "numpy", "transformers", "tokenizers")

    def platform(self, hardware: Any) -> dict[str, Any]:
        # weight_type "auto" depends on the CPU's int8 dot-product instructions
        from mopt_ml.common import cpu_int8_dot

        return {"int8_dot": cpu_int8_dot()}

    def input_files(self, params: Any, project_dir: Path) -> list[Path]:
        from mopt_ml.common import data_input_files, shipped_sentences_path

        files = data_input_files(params.calibration, project_dir)
        if shipped_sentences_path() not in files:
            files.append(shipped_sentences_path())  # the quick check reads the shipped split
        return files

    def run(self, ctx: BuildContext) -> dict[str, Any]:
        from mopt_ml.common import require

        require("onnx", "onnxruntime")
        src = ctx.input("model")
        cache = Shared(ctx.cache_dir, src.digest) if ctx.cache_dir else None
        return quantize(src.path, ctx.out, ctx.tmp, ctx.params, ctx.project_dir, ctx.log, cache)


class Shared:
    """What the section's quantizations of one fp32 graph compute alike, computed once: the
    preprocessed graph, the calibration activation maxima and the quick check's fp32
    embeddings (a sweep of smoothing strengths and weight types repeats them all). Kept in
    the kind's cache folder, keyed by the input graph's digest and everything they depend
    on; a concurrent action waits on a lock and reads the file. Never for graphs with
    external data (> 2 GiB): those are rare and too large to keep twice."""

    def __init__(self, folder: Path, digest: str) -> None:
        self.folder = folder
        self.digest = digest

    def path(self, what: str, key: Any, suffix: str) -> Path:
        import os

        from mopt_ml.common import spec_hash, versions

        full = {"graph": self.digest, "what": what, "key": key, "cpus": os.cpu_count(),
                "tools": versions("onnx", "onnxruntime", "numpy")}  # fmt: skip
        return self.folder / f"{what}-{spec_hash(full, 32)}{suffix}"

    def get(self, path: Path, compute: Any, save: Any, load: Any) -> Any:
        """`load(path)` if it is there, else `compute()`, saved atomically by `save(value, tmp)`."""
        import fcntl
        import os

        self.folder.mkdir(parents=True, exist_ok=True)
        with open(path.with_name(path.name + ".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another action computing it: wait, then read
            if path.exists():
                return load(path)
            part = path.with_name(f".{path.name}.{os.getpid()}.part")
            save(compute(), part)
            os.replace(part, path)
            return load(path)


def _private_link(src: Path, dest: Path) -> Path:
    """`dest` as a hard link of `src` (a copy across file systems)."""
    import os
    import shutil

    dest.unlink(missing_ok=True)
    try:
        os.link(src, dest)
    except OSError:
        shutil.copyfile(src, dest)
    return dest


def _save_npz(value: dict[str, Any], path: Path) -> None:
    import numpy as np

    with open(path, "wb") as fh:  # a file object: np.savez would append ".npz" to a name
        np.savez(fh, **value)


def _load_npz(path: Path) -> dict[str, Any]:
    import numpy as np

    with np.load(path) as data:
        return {k: data[k] for k in data.files}


def _save_npy(value: Any, path: Path) -> None:
    import numpy as np

    with open(path, "wb") as fh:
        np.save(fh, value)


def _calibration_feeds(tokenizer: Any, texts: Sequence[str], params: Any) -> list[dict[str, Any]]:
    from mopt_ml.common import tokenize

    bs = params.calibration_batch_size
    return [
        tokenize(
            tokenizer,
            texts[i : i + bs],
            max_length=params.calibration_pad_to or 128,
            pad_to=params.calibration_pad_to,
        )
        for i in range(0, len(texts), bs)
    ]


def quantize(
    src: Path, out: Path, tmp: Path, params: Any, project_dir: Path, log: Any, cache: Shared | None = None
) -> dict[str, Any]:
    import shutil

    import numpy as np
    import onnx
    from onnxruntime.quantization import QuantType, quant_pre_process, quantize_dynamic

    from mopt_ml.common import (
        META_FILE,
        compare,
        copy_model_files,
        embed_onnx,
        load_tokenizer,
        model_onnx,
        ort_session,
        read_meta,
        save_onnx,
        spec_hash,
        texts_from_param,
        validation_texts,
        versions,
        write_json,
    )

    meta = read_meta(src)
    if meta.get("precision", "fp32") != "fp32":
        raise ValueError(f"ort-quantize needs an fp32 graph; {src} is {meta.get('precision')}")
    if meta.get("task") == "text-generation":
        return quantize_generation(src, out, tmp, params, project_dir, log, meta)
    if params.mode in ("matmul-nbits", "rtn"):
        raise ValueError(
            f"mode {params.mode!r} (weight-only) is for text-generation graphs; embedding graphs "
            "take mode 'dynamic' or 'static'"
        )
    tokenizer = load_tokenizer(src)
    calib_texts = texts_from_param(params.calibration, project_dir, "calibration")
    feeds = _calibration_feeds(tokenizer, calib_texts, params)
    work = tmp / "quant"
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()

    large = bool(meta.get("external_data"))
    current = private_onnx(src, work) if large else model_onnx(src)
    if large:
        cache = None
    if params.preprocess:
        pre = work / "pre.onnx"

        def preprocess(dest: Path = pre) -> Path:
            # ORT's symbolic shape inference fails on transformers-5 mask subgraphs
            quant_pre_process(
                str(current),
                str(dest),
                skip_symbolic_shape=True,
                save_as_external_data=large,
                all_tensors_to_one_file=True,
            )
            return dest

        if cache is None:
            current = preprocess()
        else:
            # the action reads its own link of the cached graph: ORT's quantizers write (and
            # then delete) "<stem>-inferred.onnx" beside the graph they are given, so two
            # actions quantizing one shared path at once remove each other's file
            current = cache.get(
                cache.path("pre", {}, ".onnx"), preprocess, lambda v, part: shutil.move(v, part),
                lambda p: _private_link(p, pre),
            )

    smooth_info: dict[str, Any] = {}
    if params.smooth:
        model = onnx.load(str(current))
        groups = matmul_groups(model)

        def amax() -> dict[str, Any]:
            return activation_max(current, list(groups), feeds, work)

        if cache is None:
            act_max = amax()
        else:
            key = {"pre": params.preprocess, "feeds": spec_hash([{k: v.tolist() for k, v in f.items()} for f in feeds])}
            act_max = cache.get(cache.path("amax", key, ".npz"), amax, _save_npz, _load_npz)
        smooth_info = apply_smoothing(model, groups, act_max, params.smooth_alpha)
        current = work / "smooth.onnx"
        save_onnx(model, current, large)
        del model
        log(
            f"smoothed {smooth_info['groups']} MatMul groups ({smooth_info['matmuls']} MatMuls), alpha {params.smooth_alpha}"
        )

    qtype = {"qint8": QuantType.QInt8, "quint8": QuantType.QUInt8}
    weight_type = resolve_weight_type(params.weight_type)
    result = work / "quant.onnx"
    if params.mode == "dynamic":
        quantize_dynamic(
            str(current),
            str(result),
            op_types_to_quantize=list(params.op_types),
            per_channel=params.per_channel,
            reduce_range=params.reduce_range,
            weight_type=qtype[weight_type],
            nodes_to_exclude=list(params.exclude_nodes) or None,
            use_external_data_format=large,
            extra_options={"MatMulConstBOnly": True},
        )
    else:
        from onnxruntime.quantization import CalibrationMethod, QuantFormat, quantize_static

        quantize_static(
            str(current),
            str(result),
            calibration_data_reader=_Reader(feeds),
            quant_format=QuantFormat.QDQ if params.quant_format == "qdq" else QuantFormat.QOperator,
            op_types_to_quantize=list(params.op_types),
            per_channel=params.per_channel,
            reduce_range=params.reduce_range,
            activation_type=qtype[params.activation_type],
            weight_type=qtype[weight_type],
            nodes_to_exclude=list(params.exclude_nodes) or None,
            use_external_data_format=large,
            calibrate_method={
                "minmax": CalibrationMethod.MinMax,
                "entropy": CalibrationMethod.Entropy,
                "percentile": CalibrationMethod.Percentile,
            }[params.calibration_method],
            extra_options={"MatMulConstBOnly": True},
        )
    quant_s = time.perf_counter() - t0
    qmodel = onnx.load(str(result))
    ops = op_histogram(qmodel)
    external = save_onnx(qmodel, out / "model.onnx", large or None)
    del qmodel

    # a quick look (no gate: that is validate's job) against the fp32 input graph
    texts = validation_texts()[: params.check_texts]

    def fp32() -> Any:
        return embed_onnx(ort_session(model_onnx(src)), tokenizer, texts)

    if cache is None:
        ref = fp32()
    else:
        ref = cache.get(cache.path("check", spec_hash(texts), ".npy"), fp32, _save_npy, np.load)
    got = embed_onnx(ort_session(out / "model.onnx"), tokenizer, texts)
    check = compare(ref, got)
    log(
        f"{params.mode} INT8 ({weight_type} weights, {'per-channel' if params.per_channel else 'per-tensor'}, "
        f"{'+'.join(params.op_types)}{', smoothed' if params.smooth else ''}) in {quant_s:.1f}s; "
        f"vs fp32 graph on {check['n']} sentences: min cosine {check['min_cosine']:.4f}, "
        f"mean {check['mean_cosine']:.4f}"
    )
    copy_model_files(src, out)
    new_meta = dict(meta)
    new_meta.update(
        {
            "precision": "int8",
            "external_data": external,
            "quantization": {
                "mode": params.mode,
                "per_channel": params.per_channel,
                "op_types": list(params.op_types),
                "weight_type": weight_type,
                "activation_type": params.activation_type if params.mode == "static" else "dynamic-uint8",
                "reduce_range": params.reduce_range,
                "smooth": smooth_info or None,
                "calibration": {
                    "texts": len(calib_texts),
                    "pad_to": params.calibration_pad_to,
                    "source": params.calibration or "shipped calibration split",
                },
                "ops": ops,
                "check_vs_fp32": check,
                "onnxruntime": versions("onnxruntime")["onnxruntime"],
            },
        }
    )
    write_json(out / META_FILE, new_meta)
    return {
        "mode": params.mode,
        "smooth": bool(smooth_info),
        "ops": ops,
        "check_vs_fp32": check,
        "quantize_seconds": round(quant_s, 2),
    }


def _generation_feeds(tokenizer: Any, texts: Sequence[str], meta: dict[str, Any], params: Any) -> list[dict[str, Any]]:
    """Calibration batches for a KV-cache graph: left-padded sentences (to their longest row),
    position ids from the mask, and an empty past."""
    import numpy as np

    kv = meta["kv_cache"]
    names = [n for n in meta["inputs"] if n.startswith("past_key_values.")]
    feeds = []
    bs = params.calibration_batch_size
    for i in range(0, len(texts), bs):
        rows = [tokenizer(t, truncation=True, max_length=params.calibration_pad_to or 128)["input_ids"]
                for t in texts[i : i + bs]]  # fmt: skip
        width = max(len(r) for r in rows)
        ids = np.full((len(rows), width), tokenizer.pad_token_id or 0, dtype=np.int64)
        mask = np.zeros((len(rows), width), dtype=np.int64)
        for r, row in enumerate(rows):
            ids[r, width - len(row) :] = row
            mask[r, width - len(row) :] = 1
        pos = np.clip(np.cumsum(mask, axis=1) - 1, 0, None).astype(np.int64)
        empty = np.zeros((len(rows), int(kv["kv_heads"]), 0, int(kv["head_dim"])), dtype=np.float32)
        feeds.append({"input_ids": ids, "attention_mask": mask, "position_ids": pos} | dict.fromkeys(names, empty))
    return feeds


def quantize_generation(
    src: Path, out: Path, tmp: Path, params: Any, project_dir: Path, log: Any, meta: dict[str, Any]
) -> dict[str, Any]:
    """ort-quantize of a text-generation (KV-cache) graph; the quick look compares next-token
    logits and greedy continuations with the fp32 graph."""
    import onnx
    from onnxruntime.quantization import QuantType, quant_pre_process, quantize_dynamic

    from mopt_ml.common import (
        META_FILE,
        copy_model_files,
        load_tokenizer,
        model_onnx,
        save_onnx,
        texts_from_param,
        versions,
        write_json,
    )

    tokenizer = load_tokenizer(src)
    calib_texts = texts_from_param(params.calibration, project_dir, "calibration")
    work = tmp / "quant"
    work.mkdir(parents=True, exist_ok=True)
    large = bool(meta.get("external_data"))
    t0 = time.perf_counter()
    current = private_onnx(src, work) if large else model_onnx(src)
    result = work / "quant.onnx"
    smooth_info: dict[str, Any] = {}
    rtn_info: dict[str, Any] | None = None
    weight_type = ""
    if params.mode == "matmul-nbits":
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

        if params.nbits_block_size & (params.nbits_block_size - 1):
            raise ValueError(f"nbits_block_size {params.nbits_block_size} is not a power of two")
        quantizer = MatMulNBitsQuantizer(
            onnx.load(str(current)),
            bits=params.nbits_bits,
            block_size=params.nbits_block_size,
            is_symmetric=params.nbits_symmetric,
            accuracy_level=params.nbits_accuracy_level,
            nodes_to_exclude=list(params.exclude_nodes) or None,
            op_types_to_quantize=("MatMul",),
        )
        quantizer.process()
        qmodel = quantizer.model.model
        weight_type = f"int{params.nbits_bits}-block{params.nbits_block_size}"
    elif params.mode == "rtn":
        qmodel = onnx.load(str(current))
        rtn_info = fake_quantize_matmuls(qmodel, params.nbits_bits, params.rtn_scale, params.nbits_block_size)
        weight_type = f"int{params.nbits_bits}-rtn-{params.rtn_scale}" + (
            str(params.nbits_block_size) if params.rtn_scale == "block" else ""
        )
        log(f"rtn: {rtn_info['weights']} MatMul weights rounded ({weight_type}), stored in fp32")
    else:
        feeds = _generation_feeds(tokenizer, calib_texts, meta, params)
        if params.preprocess:
            pre = work / "pre.onnx"
            quant_pre_process(str(current), str(pre), skip_symbolic_shape=True,
                              save_as_external_data=large, all_tensors_to_one_file=True)  # fmt: skip
            current = pre
        if params.smooth:
            model = onnx.load(str(current))
            groups = matmul_groups(model)
            act_max = activation_max(current, list(groups), feeds, work)
            smooth_info = apply_smoothing(model, groups, act_max, params.smooth_alpha)
            current = work / "smooth.onnx"
            save_onnx(model, current, large)
            del model
            log(f"smoothed {smooth_info['groups']} MatMul groups ({smooth_info['matmuls']} MatMuls), "
                f"alpha {params.smooth_alpha}")  # fmt: skip
        qtype = {"qint8": QuantType.QInt8, "quint8": QuantType.QUInt8}
        weight_type = resolve_weight_type(params.weight_type)
        common = {
            "op_types_to_quantize": list(params.op_types),
            "per_channel": params.per_channel,
            "reduce_range": params.reduce_range,
            "weight_type": qtype[weight_type],
            "nodes_to_exclude": list(params.exclude_nodes) or None,
            "use_external_data_format": large,
            "extra_options": {"MatMulConstBOnly": True},
        }
        if params.mode == "dynamic":
            quantize_dynamic(str(current), str(result), **common)
        else:
            from onnxruntime.quantization import CalibrationMethod, QuantFormat, quantize_static

            quantize_static(
                str(current), str(result), calibration_data_reader=_Reader(feeds),
                quant_format=QuantFormat.QDQ if params.quant_format == "qdq" else QuantFormat.QOperator,
                activation_type=qtype[params.activation_type],
                calibrate_method={"minmax": CalibrationMethod.MinMax, "entropy": CalibrationMethod.Entropy,
                                  "percentile": CalibrationMethod.Percentile}[params.calibration_method],
                **common,
            )  # fmt: skip
        qmodel = onnx.load(str(result))
    quant_s = time.perf_counter() - t0
    ops = op_histogram(qmodel)
    external = save_onnx(qmodel, out / "model.onnx", large or None)
    del qmodel
    copy_model_files(src, out)

    check = generation_check(src, out, tokenizer, params.check_texts, params.greedy_tokens)
    weight_only = params.mode in ("matmul-nbits", "rtn")
    precision = f"int{params.nbits_bits}" if weight_only else "int8"
    log(
        f"{params.mode} {precision} ({weight_type}{', smoothed' if smooth_info else ''}) in {quant_s:.1f}s; "
        f"vs fp32 graph: next-token top-1 {check['logits']['top1_agreement']:.4f}, min cosine "
        f"{check['logits']['min_cosine']:.4f}; greedy {check['greedy']['tokens_agree']:.3f} of "
        f"{check['greedy']['tokens']} tokens agree, {check['greedy']['prefix_mean']:.1f} before the first miss"
    )
    new_meta = dict(meta)
    new_meta.update(
        {
            "precision": precision,
            "external_data": external,
            "quantization": {
                "mode": params.mode,
                "weight_type": weight_type,
                "per_channel": params.per_channel if not weight_only else None,
                "op_types": ["MatMul"] if weight_only else list(params.op_types),
                "activation_type": {"dynamic": "dynamic-uint8", "static": params.activation_type,
                                    "rtn": "fp32"}.get(params.mode, f"accuracy_level {params.nbits_accuracy_level}"),
                "simulated": params.mode == "rtn",
                "rtn": rtn_info,
                "nbits": {"bits": params.nbits_bits, "block_size": params.nbits_block_size,
                          "symmetric": params.nbits_symmetric, "accuracy_level": params.nbits_accuracy_level}
                if params.mode == "matmul-nbits" else None,
                "smooth": smooth_info or None,
                "calibration": None if weight_only else {
                    "texts": len(calib_texts), "pad_to": "longest row",
                    "source": params.calibration or "shipped calibration split",
                },
                "ops": ops,
                "check_vs_fp32": check,
                "onnxruntime": versions("onnxruntime")["onnxruntime"],
            },
        }
    )  # fmt: skip
    write_json(out / META_FILE, new_meta)
    return {"mode": params.mode, "precision": precision, "smooth": bool(smooth_info), "ops": ops,
            "check_vs_fp32": check, "quantize_seconds": round(quant_s, 2)}  # fmt: skip


def fake_quantize_matmuls(model: Any, bits: int, scale: str, block: int) -> dict[str, Any]:
    """Round, in place, every fp32 2-D initializer that is only ever a MatMul's weight (B,
    [in, out]) with `round_to_nearest`; stored back in fp32. The weights rounded and their
    mean relative error (RMS of the error over RMS of the weight)."""
    import numpy as np
    from onnx import TensorProto, numpy_helper

    uses: dict[str, set[tuple[str, int]]] = {}
    for node in model.graph.node:
        for i, name in enumerate(node.input):
            uses.setdefault(name, set()).add((node.op_type, i))
    errors = []
    for t in model.graph.initializer:
        if len(t.dims) != 2 or t.data_type != TensorProto.FLOAT or uses.get(t.name) != {("MatMul", 1)}:
            continue
        w = numpy_helper.to_array(t)
        wq, err = round_to_nearest(w, bits, scale, block)
        errors.append(err)
        t.CopyFrom(numpy_helper.from_array(wq.astype(np.float32), t.name))
    if not errors:
        raise ValueError("rtn: the graph has no constant MatMul weight to round")
    return {"weights": len(errors), "rel_error_mean": round(float(np.mean(errors)), 5)}


def round_to_nearest(w: Any, bits: int, scale: str, block: int) -> tuple[Any, float]:
    """A weight of layout [in, out] rounded to symmetric `bits`-bit integers times a scale
    (amax / (2^(bits-1) - 1)) per tensor, per output column, or per `block` rows of a column
    (the last block may be short), in float64; and its relative error (RMS of the error over
    RMS of the weight). ONNX MatMul weights have this layout; a torch Linear's is its transpose."""
    import numpy as np

    w = np.asarray(w, dtype=np.float64)
    q = 2 ** (bits - 1) - 1
    rows, cols = w.shape
    if scale == "tensor":
        amax = np.abs(w).max(keepdims=True)
    elif scale == "channel":
        amax = np.abs(w).max(axis=0, keepdims=True)
    else:
        pad = np.pad(np.abs(w), ((0, -rows % block), (0, 0)))
        amax = np.repeat(pad.reshape(-1, block, cols).max(axis=1), block, axis=0)[:rows]
    s = np.where(amax > 0, amax / q, 1.0)
    wq = np.clip(np.rint(w / s), -q, q) * s
    err = float(np.sqrt(np.mean((wq - w) ** 2)) / max(np.sqrt(np.mean(w**2)), 1e-30))
    return wq, err


def generation_check(reference: Path, candidate: Path, tokenizer: Any, n_texts: int, n_tokens: int) -> dict[str, Any]:
    """Two KV-cache graphs side by side on the shipped validation sentences: next-token
    logits (teacher-forced) and greedy continuations of the first words of 4 sentences."""
    from mopt_ml.common import validation_texts
    from mopt_ml.genruntime import compare_logits, open_generator

    texts = validation_texts()[: min(n_texts, 8)]
    ref = open_generator(reference, format="onnx")
    got = open_generator(candidate, format="onnx")
    ids = [tokenizer(t, truncation=True, max_length=128)["input_ids"] for t in texts]
    logits = compare_logits([ref.logits(i) for i in ids], [got.logits(i) for i in ids])
    agree = total = 0
    prefixes = []
    for i in ids[:4]:
        prompt = i[: max(1, len(i) // 2)]
        a, b = ref.generate(prompt, n_tokens), got.generate(prompt, n_tokens)
        agree += sum(x == y for x, y in zip(a, b, strict=True))
        total += len(a)
        prefixes.append(next((k for k, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a)))
    ref.close()
    got.close()
    greedy = {"prompts": len(prefixes), "tokens": total, "tokens_agree": round(agree / max(total, 1), 4),
              "prefix_mean": round(sum(prefixes) / max(len(prefixes), 1), 2)}  # fmt: skip
    return {"logits": logits, "greedy": greedy}


def private_onnx(folder: Path, work: Path) -> Path:
    """A copy of `folder`'s model.onnx and its external data with inodes of their own.

    The store hands an action its inputs as hard links, and onnx >= 1.17 refuses external
    data with more than one link ("potential hardlink attack") when it loads a model (ONNX
    Runtime does not mind); the copy is scratch, deleted with the action's tmp."""
    import shutil

    from mopt_ml.common import model_onnx

    dst = work / "input"
    dst.mkdir(parents=True, exist_ok=True)
    src = model_onnx(folder)
    for f in (src, src.with_name(src.name + ".data")):
        if f.is_file():
            shutil.copyfile(f, dst / f.name)
    return dst / src.name


def resolve_weight_type(value: str) -> str:
    """`auto` → qint8 where the CPU has int8 dot-product instructions that accumulate
    without saturation (VNNI, AMX), else quint8: ORT's u8s8 AVX2 kernel (vpmaddubsw)
    saturates int16 sums, which cost MiniLM 0.01 of min cosine once smoothing widened
    the weights; u8u8 widens first and does not saturate."""
    if value != "auto":
        return value
    from mopt_ml.common import cpu_int8_dot

    return "qint8" if cpu_int8_dot() in ("vnni", "amx") else "quint8"


class _Reader:
    """onnxruntime CalibrationDataReader over pre-tokenised batches."""

    def __init__(self, feeds: list[dict[str, Any]]) -> None:
        self.feeds = feeds
        self.it: Iterator[dict[str, Any]] = iter(feeds)

    def get_next(self) -> dict[str, Any] | None:
        return next(self.it, None)

    def rewind(self) -> None:
        self.it = iter(self.feeds)


def op_histogram(model: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for node in model.graph.node:
        out[node.op_type] = out.get(node.op_type, 0) + 1
    return dict(sorted(out.items()))


def matmul_groups(model: Any) -> dict[str, list[Any]]:
    """MatMul nodes with a constant 2-D weight B, grouped by their (activation) input A.
    Weights used by any other node are left alone."""
    inits = {t.name: t for t in model.graph.initializer}
    uses: dict[str, int] = {}
    for node in model.graph.node:
        for name in node.input:
            uses[name] = uses.get(name, 0) + 1
    groups: dict[str, list[Any]] = {}
    for node in model.graph.node:
        if node.op_type != "MatMul" or len(node.input) != 2:
            continue
        a, b = node.input
        if a in inits or b not in inits or len(inits[b].dims) != 2 or uses.get(b, 0) != 1:
            continue
        groups.setdefault(a, []).append(node)
    return groups


def activation_max(
    model_path: Path, names: list[str], feeds: list[dict[str, Any]], work: Path
) -> dict[str, Any]:
    """Per-channel max |x| of each tensor in `names` over the calibration batches."""
    import numpy as np
    import onnx

    from mopt_ml.common import ort_session, save_onnx

    model = onnx.load(str(model_path))
    present = {o.name for o in model.graph.output}
    for name in names:
        if name not in present:
            model.graph.output.append(onnx.helper.make_empty_tensor_value_info(name))
    probe = work / "probe.onnx"
    save_onnx(model, probe)
    del model
    sess = ort_session(probe, optimize=False)
    valid = {i.name for i in sess.get_inputs()}
    amax: dict[str, Any] = {}
    for feed in feeds:
        outs = sess.run(names, {k: v for k, v in feed.items() if k in valid})
        for name, x in zip(names, outs, strict=True):
            m = np.abs(x.reshape(-1, x.shape[-1])).max(axis=0).astype(np.float64)
            amax[name] = m if name not in amax else np.maximum(amax[name], m)
    return amax


def apply_smoothing(
    model: Any, groups: dict[str, list[Any]], act_max: dict[str, Any], alpha: float
) -> dict[str, Any]:
    """Insert Mul(X, 1/s) before each group and scale its weights' rows by s (in place)."""
    import numpy as np
    from onnx import helper, numpy_helper

    inits = {t.name: t for t in model.graph.initializer}
    new_nodes: dict[str, Any] = {}  # input name → Mul node to insert after its producer
    n_matmuls = 0
    ratios = []
    for gi, (x_name, nodes) in enumerate(sorted(groups.items())):
        weights = [numpy_helper.to_array(inits[n.input[1]]) for n in nodes]
        if any(w.dtype != np.float32 for w in weights):
            continue
        a = act_max.get(x_name)
        if a is None or a.shape[0] != weights[0].shape[0]:
            continue
        w_max = np.max(np.stack([np.abs(w).max(axis=1) for w in weights]), axis=0).astype(np.float64)
        valid = (a > 0) & (w_max > 0)
        s = np.ones_like(a)
        s[valid] = np.power(a[valid], alpha) / np.power(w_max[valid], 1.0 - alpha)
        s = np.clip(s, 1e-5, 1e5)
        ratios.append(float(a.max() / max(np.median(a), 1e-12)))
        for node, w in zip(nodes, weights, strict=True):
            scaled = (w.astype(np.float64) * s[:, None]).astype(np.float32)
            inits[node.input[1]].CopyFrom(numpy_helper.from_array(scaled, node.input[1]))
        inv_name = f"mopt_smooth_{gi}_inv_scale"
        out_name = f"mopt_smooth_{gi}_out"
        model.graph.initializer.append(numpy_helper.from_array((1.0 / s).astype(np.float32), inv_name))
        new_nodes[x_name] = helper.make_node("Mul", [x_name, inv_name], [out_name], name=f"mopt_smooth_{gi}")
        for node in nodes:
            node.input[0] = out_name
        n_matmuls += len(nodes)
    _insert_after_producers(model, new_nodes)
    return {
        "groups": len(new_nodes),
        "matmuls": n_matmuls,
        "alpha": alpha,
        "max_outlier_ratio": round(max(ratios), 2) if ratios else None,
    }


def _insert_after_producers(model: Any, new_nodes: dict[str, Any]) -> None:
    """Keep the node list topologically sorted: each Mul right after its input's producer."""
    if not new_nodes:
        return
    from onnx import NodeProto

    def copy(node: Any) -> Any:
        new = NodeProto()
        new.CopyFrom(node)
        return new

    ordered = []
    pending = dict(new_nodes)
    graph_inputs = {i.name for i in model.graph.input} | {t.name for t in model.graph.initializer}
    for name in list(pending):
        if name in graph_inputs:
            ordered.append(pending.pop(name))
    for node in model.graph.node:
        ordered.append(copy(node))
        for out in node.output:
            if out in pending:
                ordered.append(pending.pop(out))
    if pending:
        raise RuntimeError(f"smoothing: no producer found for {sorted(pending)}")
    del model.graph.node[:]
    model.graph.node.extend(ordered)
