"""The `onnx` and `onnx-slim` targets: an ONNX graph of the family's embedding wrapper, with
dynamic batch and sequence axes, checked numerically on real text before it is accepted.

For task text-generation `onnx` exports the family's KV-cache graph instead (one graph for
prefill and decode, the Optimum / ONNX Runtime GenAI layout: `input_ids`, `attention_mask`
[batch, past + sequence], `position_ids`, `past_key_values.{i}.key/value` → `logits`,
`present.{i}.key/value`), checked against PyTorch on held-out sentences: teacher-forced
prefill logits, then decode steps fed their own past, then random left-padded batches with
past of several lengths. A graph that does not match fails the build with the numbers.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

from mopt.api import BuildContext, Input, Params, TargetKind
from pydantic import Field

#: what each exporter uses when `opset` is not given
DEFAULT_OPSET = {"torchscript": 17, "dynamo": 18}
#: torch.onnx keeps its export state in process globals ("GLOBALS.in_onnx_export must be
#: False" when two threads export at once), and mopt runs actions in threads: one at a time
_EXPORT_LOCK = threading.Lock()


class NumericCheckError(RuntimeError):
    """An exported graph does not compute what its reference computes."""


def _check_or_fail(what: str, numbers: dict[str, Any], threshold: float) -> None:
    if numbers["min_cosine"] < threshold:
        raise NumericCheckError(
            f"{what}: min cosine {numbers['min_cosine']:.6f} < check_min_cosine {threshold} "
            f"(mean {numbers['mean_cosine']:.6f}, max abs diff {numbers['max_abs_diff']:.3g}, "
            f"{numbers['n']} texts)"
        )


class OnnxKind(TargetKind):
    """Export the family's embedding wrapper to ONNX: inputs input_ids / attention_mask
    (int64, dynamic batch and sequence), one output `mopt_embedding` (pooled, L2-normalised,
    float32). Checked against PyTorch on the shipped validation sentences. For task
    text-generation: the KV-cache graph (module docstring), checked on logits."""

    # imported once by the build's fork server
    preload = ("torch", "transformers", "transformers.modeling_utils", "onnx",
               "transformers.models.auto.modeling_auto", "transformers.models.auto.tokenization_auto",
               # what common.require("transformers") imports in every action
               "transformers.models.bert.modeling_bert", "transformers.models.qwen3.modeling_qwen3")

    name = "onnx"
    version = "1"
    description = "ONNX graph (fp32) of the pooled embedding, checked against PyTorch"
    produces = "onnx"
    fingerprint_packages = ("torch", "transformers", "onnx", "onnxruntime", "onnxscript")
    # any Hugging Face checkpoint: the weights, or a third party's (a distilled model)
    consumes = (Input("model", formats=("hf-checkpoint",)),)

    class Params(Params):
        exporter: Literal["torchscript", "dynamo"] = Field(
            default="torchscript",
            description="torch.onnx exporter; TorchScript's MiniLM graph ran 12% faster in ORT than dynamo's",
        )
        opset: int | None = Field(
            default=None, ge=14, description="ONNX opset (null: 17 for torchscript, 18 for dynamo)"
        )
        external_data: bool | None = Field(
            default=None, description="weights in model.onnx.data (null: when larger than 1.5 GB)"
        )
        check_min_cosine: float = Field(default=0.9999, description="fail below this min cosine vs PyTorch")
        check_texts: int = Field(
            default=64, ge=4,
            description="validation sentences used by the check (text-generation: the first min(this, 8))",
        )  # fmt: skip
        max_length: int = Field(default=128, ge=8, description="tokenizer truncation for the check")
        check_min_top1: float = Field(
            default=0.99, ge=0.0, le=1.0,
            description="text-generation: fail below this argmax agreement of next-token logits vs PyTorch",
        )  # fmt: skip
        check_decode_steps: int = Field(
            default=4, ge=1, description="text-generation: decode steps with past checked per sentence"
        )

    def input_files(self, params: Any, project_dir: Path) -> list[Path]:
        from mopt_ml.common import data_input_files

        return data_input_files(None, project_dir)

    def run(self, ctx: BuildContext) -> dict[str, Any]:
        from mopt_ml.common import require

        require("torch", "transformers", "onnx", "onnxruntime")
        src = ctx.input("model").path
        if ctx.task == "text-generation":
            return export_generation_onnx(src, ctx.out, ctx.tmp, ctx.family, ctx.params, ctx.log)
        return export_onnx(src, ctx.out, ctx.tmp, ctx.family, ctx.params, ctx.log)


def export_onnx(src: Path, out: Path, tmp: Path, family_obj: Any, params: Any, log: Any) -> dict[str, Any]:
    import torch

    from mopt_ml.common import (
        INPUT_NAMES,
        META_FILE,
        OUTPUT_NAME,
        calibration_texts,
        compare,
        copy_model_files,
        embed_onnx,
        ort_session,
        tokenize,
        validation_texts,
        versions,
        write_json,
    )
    from mopt_ml.families import as_family

    family = as_family(family_obj, src)
    model = family.load(src, dtype="fp32")
    tokenizer = family.load_tokenizer(src)
    spec = family.export_spec(model, task="embedding")
    if tuple(spec.inputs) != INPUT_NAMES or tuple(spec.outputs) != (OUTPUT_NAME,):
        raise ValueError(
            f"family {family.name!r}: export_spec gives inputs {list(spec.inputs)} and outputs "
            f"{list(spec.outputs)}; the embedding graphs mopt-ml checks and runs have "
            f"{list(INPUT_NAMES)} → [{OUTPUT_NAME!r}]"
        )
    # a padded example: mask code paths that skip an all-ones mask must not be traced
    example = tokenize(tokenizer, [calibration_texts()[0], "A short one."], max_length=32)
    args = tuple(torch.from_numpy(example[n]) for n in INPUT_NAMES)
    hidden = getattr(model.config, "hidden_size", None)
    opset, export_s, external = _export_to(
        out, tmp, model, spec, args, params, "",
        lambda g: _name_dynamic_axes(g, hidden), INPUT_NAMES, (OUTPUT_NAME,),
    )  # fmt: skip
    log(f"exported with {params.exporter} (opset {opset}) in {export_s:.1f}s; external data: {external}")

    texts = validation_texts()[: params.check_texts]
    reference = family.embed(model, tokenizer, texts, max_length=params.max_length)
    sess = ort_session(out / "model.onnx")
    got = embed_onnx(sess, tokenizer, texts, max_length=params.max_length)
    # other shapes than the traced one: a single row, and rows padded to max_length
    one = embed_onnx(sess, tokenizer, texts[:1], max_length=params.max_length)
    padded = embed_onnx(sess, tokenizer, texts[:5], max_length=params.max_length, pad_to=params.max_length)
    numbers = compare(reference, got)
    shapes = compare(_concat(reference[:1], reference[:5]), _concat(one, padded))
    numbers["min_cosine"] = min(numbers["min_cosine"], shapes["min_cosine"])
    log(
        f"check vs PyTorch on {len(texts)} sentences: min cosine {numbers['min_cosine']:.6f}, "
        f"mean {numbers['mean_cosine']:.6f}, max abs diff {numbers['max_abs_diff']:.3g}"
    )
    _check_or_fail(f"ONNX export ({params.exporter}) differs from PyTorch", numbers, params.check_min_cosine)

    copied = copy_model_files(src, out)
    meta = {
        "format": "mopt-onnx/1",
        "family": family.name,
        "pooling": family.pooling,
        "inputs": list(INPUT_NAMES),
        "output": OUTPUT_NAME,
        "hidden_size": int(reference.shape[1]),
        "precision": "fp32",
        "exporter": params.exporter,
        "opset": opset,
        "external_data": external,
        "check": numbers,
        "tools": versions("torch", "transformers", "onnx", "onnxruntime"),
        "files": copied,
    }
    write_json(out / META_FILE, meta)
    return {k: meta[k] for k in ("family", "exporter", "opset", "external_data", "check")} | {
        "export_seconds": round(export_s, 2)
    }


def _names(xs: Sequence[str]) -> str:
    return str(list(xs)) if len(xs) <= 5 else f"{list(xs)[:5]}... ({len(xs)})"


def _export_to(
    out: Path,
    tmp: Path,
    model: Any,
    spec: Any,
    args: tuple[Any, ...],
    params: Any,
    what: str,
    name_axes: Callable[[Any], None],
    want_in: Sequence[str],
    want_out: Sequence[str],
) -> tuple[int, float, bool]:
    """Export `model` by `spec` (`params.exporter`, `params.opset` or the exporter's default)
    with the example `args`, name the graph's dynamic axes (`name_axes`), refuse a graph whose
    input / output names are not `want_in` / `want_out`, save it as out/model.onnx (external
    data per `params.external_data`). The embedding and the KV-cache export share it.
    (opset, export seconds, external data written)."""
    import onnx
    import torch

    from mopt_ml.common import save_onnx

    opset = params.opset or DEFAULT_OPSET[params.exporter]
    stage = tmp / "export"
    stage.mkdir(parents=True, exist_ok=True)
    raw = stage / "model.onnx"
    _quiet_exporters()
    t0 = time.perf_counter()
    try:
        with _EXPORT_LOCK, torch.no_grad():
            _export(params.exporter, spec, args, raw, opset, model)
    except Exception as exc:
        raise RuntimeError(
            f"torch.onnx.export ({params.exporter} exporter, opset {opset}){what} failed: {type(exc).__name__}: {exc}"
        ) from exc
    export_s = time.perf_counter() - t0
    graph = onnx.load(str(raw))
    name_axes(graph)
    in_names = [i.name for i in graph.graph.input]
    out_names = [o.name for o in graph.graph.output]
    if in_names != list(want_in) or out_names != list(want_out):
        raise RuntimeError(f"exported graph has inputs {_names(in_names)} and outputs {_names(out_names)}")
    graph.producer_name = "mopt-ml"
    external = bool(save_onnx(graph, out / "model.onnx", params.external_data))
    return opset, export_s, external


def export_generation_onnx(
    src: Path, out: Path, tmp: Path, family_obj: Any, params: Any, log: Any
) -> dict[str, Any]:
    """The KV-cache graph of a causal LM, checked against PyTorch (module docstring)."""
    from mopt.api import TEXT_GENERATION, generation_graph_names

    from mopt_ml.common import META_FILE, calibration_texts, copy_model_files, versions, write_json
    from mopt_ml.families import as_family

    family = as_family(family_obj, src, task=TEXT_GENERATION)
    model = family.load(src, dtype="fp32", task=TEXT_GENERATION)
    tokenizer = family.load_tokenizer(src, task=TEXT_GENERATION)
    spec = family.export_spec(model, task=TEXT_GENERATION)
    kv = dict(spec.kv_cache or {})
    if not kv.get("layers"):
        raise ValueError(f"family {family.name!r}: export_spec for text-generation gives no kv_cache")
    want_in, want_out = generation_graph_names(int(kv["layers"]))
    if tuple(spec.inputs) != want_in or tuple(spec.outputs) != want_out:
        raise ValueError(
            f"family {family.name!r}: export_spec gives inputs {list(spec.inputs)[:5]}... and outputs "
            f"{list(spec.outputs)[:3]}...; the generation graphs mopt-ml runs have {list(want_in[:5])}... "
            f"→ {list(want_out[:3])}..."
        )
    args = _generation_example(tokenizer, calibration_texts()[:2], kv)
    opset, export_s, external = _export_to(
        out, tmp, model, spec, args, params, " of the KV-cache graph",
        lambda g: _name_generation_axes(g, spec.dynamic_axes), want_in, want_out,
    )  # fmt: skip
    log(f"exported the KV-cache graph with {params.exporter} (opset {opset}) in {export_s:.1f}s; "
        f"external data: {external}")  # fmt: skip
    copied = copy_model_files(src, out)

    check = check_generation_graph(model, tokenizer, spec, out, params, args)
    log(
        f"check vs PyTorch: prefill min cosine {check['prefill']['min_cosine']:.6f}, top-1 "
        f"{check['prefill']['top1_agreement']:.4f}; decode with past min cosine "
        f"{check['decode']['min_cosine']:.6f}, top-1 {check['decode']['top1_agreement']:.4f}; padded "
        f"batches max abs diff {check['batches']['max_abs_diff']:.3g}"
    )
    failed = [
        f"{part}: min cosine {n['min_cosine']:.6f} (gate {params.check_min_cosine}), top-1 "
        f"{n['top1_agreement']:.4f} (gate {params.check_min_top1}), max abs diff {n['max_abs_diff']:.3g}"
        for part, n in check.items()
        if n["min_cosine"] < params.check_min_cosine or n["top1_agreement"] < params.check_min_top1
    ]
    if failed:
        raise NumericCheckError(
            f"ONNX export ({params.exporter}) of the KV-cache graph differs from PyTorch: " + "; ".join(failed)
        )
    cfg = model.config
    meta = {
        "format": "mopt-onnx/1",
        "task": TEXT_GENERATION,
        "family": family.name,
        "inputs": list(want_in),
        "outputs": list(want_out),
        "kv_cache": {**kv, "dtype": "float32"},
        "vocab_size": int(cfg.vocab_size),
        "max_position_embeddings": getattr(cfg, "max_position_embeddings", None),
        "precision": "fp32",
        "exporter": params.exporter,
        "opset": opset,
        "external_data": external,
        "check": check,
        "tools": versions("torch", "transformers", "onnx", "onnxruntime"),
        "files": copied,
    }
    write_json(out / META_FILE, meta)
    return {k: meta[k] for k in ("family", "task", "exporter", "opset", "external_data", "check")} | {
        "export_seconds": round(export_s, 2)
    }


def _generation_example(tokenizer: Any, texts: Any, kv: dict[str, Any], past: int = 3) -> tuple[Any, ...]:
    """Example inputs for tracing: two rows (the second left-padded) after a past of `past`
    positions, so no shape is 1 or 0 and no mask is all ones."""
    import torch

    ids = [tokenizer(t)["input_ids"][:5] for t in texts]
    seq = min(len(i) for i in ids)
    input_ids = torch.tensor([i[:seq] for i in ids], dtype=torch.long)
    mask = torch.ones(2, past + seq, dtype=torch.long)
    mask[1, :2] = 0
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)[:, past:]
    gen = torch.Generator().manual_seed(0)
    shape = (2, int(kv["kv_heads"]), past, int(kv["head_dim"]))
    cache = [torch.randn(shape, generator=gen) for _ in range(2 * int(kv["layers"]))]
    return (input_ids, mask, position_ids, *cache)


def check_generation_graph(
    model: Any, tokenizer: Any, spec: Any, folder: Path, params: Any, example: tuple[Any, ...]
) -> dict[str, Any]:
    """Logits of the exported graph against PyTorch: teacher-forced prefill on held-out
    sentences; the last `check_decode_steps` tokens of each fed one at a time with the
    graph's own past; random left-padded batches with pasts of 0, 3 and 9 positions."""
    import numpy as np
    import torch

    from mopt_ml.common import validation_texts
    from mopt_ml.genruntime import OnnxGenerator, causal_logits, compare_logits

    texts = validation_texts()[: min(params.check_texts, 8)]
    reference = causal_logits(model, tokenizer, texts, max_length=params.max_length)
    gen = OnnxGenerator(folder)
    prefill, decode, decode_ref = [], [], []
    for text, ref in zip(texts, reference, strict=True):
        ids = tokenizer(text, truncation=True, max_length=params.max_length)["input_ids"]
        prefill.append(gen.logits(ids))
        k = min(params.check_decode_steps, len(ids) - 1)
        head = ids[: len(ids) - k]
        n = len(head)
        logits, past = gen._step(
            np.asarray([head], np.int64), np.ones((1, n), np.int64), np.arange(n, dtype=np.int64)[None], None, 1
        )
        steps = []
        for j, tok in enumerate(ids[n:]):
            logits, past = gen._step(
                np.asarray([[tok]], np.int64), np.ones((1, n + j + 1), np.int64),
                np.asarray([[n + j]], np.int64), past, 1,
            )  # fmt: skip
            steps.append(logits.numpy()[0, -1])
        decode.append(np.stack(steps))
        decode_ref.append(ref[n:])
    # the wrapper itself on random left-padded feeds: batch, padding and past lengths
    sess_ref, sess_got = [], []
    layers = int(spec.kv_cache["layers"])
    rng = torch.Generator().manual_seed(1)
    vocab = int(model.config.vocab_size)
    for batch, seq, past in ((3, 6, 0), (2, 1, 9), (2, 4, 3)):
        ids = torch.randint(0, vocab, (batch, seq), generator=rng)
        mask = torch.ones(batch, past + seq, dtype=torch.long)
        mask[-1, : min(2, past + seq - 1)] = 0
        pos = (mask.cumsum(-1) - 1).clamp(min=0)[:, past:]
        shape = (batch, int(spec.kv_cache["kv_heads"]), past, int(spec.kv_cache["head_dim"]))
        cache = [torch.randn(shape, generator=rng) for _ in range(2 * layers)]
        with torch.no_grad():
            want = spec.wrapper(ids, mask, pos, *cache)
        feeds = {"input_ids": ids.numpy(), "attention_mask": mask.numpy(), "position_ids": pos.numpy()}
        feeds |= {name: c.numpy() for name, c in zip(spec.inputs[3:], cache, strict=True)}
        got = gen.session.run(None, feeds)
        # rows, positions flattened: logits, then every present tensor (as [*, head_dim])
        sess_ref += [want[0].reshape(-1, want[0].shape[-1]).numpy()]
        sess_got += [got[0].reshape(-1, got[0].shape[-1])]
        for w, g in zip(want[1:], got[1:], strict=True):
            if tuple(w.shape) != g.shape:
                raise NumericCheckError(f"present shape {g.shape} from ONNX Runtime, {tuple(w.shape)} from PyTorch")
            sess_ref.append(w.reshape(-1, w.shape[-1]).numpy())
            sess_got.append(g.reshape(-1, g.shape[-1]))
    gen.close()
    del example
    return {
        "prefill": compare_logits(reference, prefill),
        "decode": compare_logits(decode_ref, decode),
        "batches": compare_logits(sess_ref, sess_got),
    }


def _name_generation_axes(model: Any, axes: Any) -> None:
    """Name the dynamic axes as the spec says (the dynamo exporter names them after its own
    symbols, e.g. `past_sequence + sequence`)."""
    for vi in list(model.graph.input) + list(model.graph.output):
        dims = vi.type.tensor_type.shape.dim
        for i, name in (axes.get(vi.name) or {}).items():
            if i < len(dims):
                dims[i].dim_param = name


def _quiet_exporters() -> None:
    """Silence the exporters' expected warnings (tracer notes, the TorchScript exporter's
    deprecation); filters are process-wide, so they are added, never swapped in and out
    (mopt runs actions in threads)."""
    import torch

    warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"torch\.onnx\..*")
    warnings.filterwarnings("ignore", message=".*legacy TorchScript-based ONNX export.*")
    warnings.filterwarnings("ignore", message=".*Exporting aten::index operator of advanced indexing.*")
    warnings.filterwarnings(
        "ignore", message=".*will not be used, since it shares the same shape constraints.*"
    )


def _export(exporter: str, spec: Any, args: tuple[Any, ...], raw: Path, opset: int, model: Any) -> None:
    """Trace the family's export spec (wrapper, input / output names, dynamic axes)."""
    import torch

    axes = {name: dict(a) for name, a in spec.dynamic_axes.items()}
    if exporter == "dynamo" and spec.kv_cache:
        _export_generation_dynamo(spec, args, raw, opset, model)
        return
    if exporter == "torchscript":
        torch.onnx.export(
            spec.wrapper,
            args,
            str(raw),
            dynamo=False,
            input_names=list(spec.inputs),
            output_names=list(spec.outputs),
            dynamic_axes=axes,
            opset_version=opset,
            do_constant_folding=True,
        )
    else:
        max_pos = getattr(model.config, "max_position_embeddings", 512) or 512
        dims = {"batch": torch.export.Dim("batch", min=1, max=4096),
                "sequence": torch.export.Dim("sequence", min=2, max=max(int(max_pos), 8))}  # fmt: skip
        torch.onnx.export(
            spec.wrapper,
            args,
            str(raw),
            dynamo=True,
            verbose=False,
            input_names=list(spec.inputs),
            output_names=list(spec.outputs),
            dynamic_shapes={n: {i: dims[a] for i, a in axes.get(n, {}).items()} for n in spec.inputs},
            opset_version=opset,
            external_data=True,
            optimize=True,
        )


def _export_generation_dynamo(spec: Any, args: tuple[Any, ...], raw: Path, opset: int, model: Any) -> None:
    """torch.export of the KV-cache wrapper: the past is the wrapper's *args, so its dynamic
    shapes are one nested tuple; the mask's length is its own dimension (past + sequence)."""
    import torch

    max_pos = max(int(getattr(model.config, "max_position_embeddings", 4096) or 4096), 16)
    batch = torch.export.Dim("batch", min=1, max=4096)
    seq = torch.export.Dim("sequence", min=1, max=max_pos)
    past = torch.export.Dim("past_sequence", min=0, max=max_pos)
    total = torch.export.Dim("total_sequence", min=1, max=2 * max_pos)
    n_past = len(args) - 3
    dynamic = ({0: batch, 1: seq}, {0: batch, 1: total}, {0: batch, 1: seq}, tuple({0: batch, 2: past} for _ in range(n_past)))
    torch.onnx.export(
        spec.wrapper,
        args,
        str(raw),
        dynamo=True,
        verbose=False,
        input_names=list(spec.inputs),
        output_names=list(spec.outputs),
        dynamic_shapes=dynamic,
        opset_version=opset,
        external_data=True,
        optimize=True,
    )


def _concat(*arrays: Any) -> Any:
    import numpy as np

    return np.concatenate(arrays)


def _name_dynamic_axes(model: Any, hidden: int | None) -> None:
    """Name the inputs' axes `batch` / `sequence` and the output's `batch`, and give the
    output its static width (the exporters name axes after their own symbols)."""
    for vi in list(model.graph.input) + list(model.graph.output):
        dims = vi.type.tensor_type.shape.dim
        for i, dim in enumerate(dims):
            if i == 0:
                dim.dim_param = "batch"
            elif i == 1 and vi.name in ("input_ids", "attention_mask"):
                dim.dim_param = "sequence"
            elif i == 1 and hidden:
                dim.dim_value = int(hidden)


class OnnxSlimKind(TargetKind):
    """Simplify the graph with onnxslim (constant folding, dead code, fusions); the result must
    compute what the input graph computes on the shipped validation sentences."""

    preload = ("onnx", "onnxslim")  # imported once by the build's fork server

    name = "onnx-slim"
    version = "1"
    description = "onnxslim-simplified ONNX graph, checked against its input graph"
    produces = "onnx"
    fingerprint_packages = ("onnx", "onnxruntime", "onnxslim")
    # the plain export only: simplifying a quantized graph is not what this kind checks
    consumes = (Input("model", formats=("onnx",), kinds=("onnx",)),)

    class Params(Params):
        skip_fusion_patterns: list[str] = Field(default=[], description="onnxslim fusions to skip")
        skip_optimizations: list[str] = Field(default=[], description="onnxslim optimizations to skip")
        check_min_cosine: float = Field(
            default=0.9999, description="fail below this min cosine vs the input graph"
        )
        check_texts: int = Field(default=64, ge=4, description="validation sentences used by the check")
        max_length: int = Field(default=128, ge=8, description="tokenizer truncation for the check")

    def input_files(self, params: Any, project_dir: Path) -> list[Path]:
        from mopt_ml.common import data_input_files

        return data_input_files(None, project_dir)

    def run(self, ctx: BuildContext) -> dict[str, Any]:
        from mopt_ml.common import require

        require("onnx", "onnxruntime", "onnxslim")
        return slim_onnx(ctx.input("model").path, ctx.out, ctx.params, ctx.log, ctx.tmp)


def slim_onnx(src: Path, out: Path, params: Any, log: Any, tmp: Path | None = None) -> dict[str, Any]:
    import onnx
    import onnxslim

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
        validation_texts,
        versions,
        write_json,
    )

    meta = read_meta(src)
    from mopt_ml.quantize import private_onnx

    # the store's inputs are hard links, which onnx refuses for external data: a private copy
    if meta.get("external_data"):
        if tmp is None:
            raise ValueError("slim_onnx: a graph with external data needs a scratch folder (tmp)")
        before = onnx.load(str(private_onnx(src, tmp)))
    else:
        before = onnx.load(str(model_onnx(src)))
    nodes_before = len(before.graph.node)
    kwargs: dict[str, Any] = {}
    if params.skip_fusion_patterns:
        kwargs["skip_fusion_patterns"] = list(params.skip_fusion_patterns)
    if params.skip_optimizations:
        kwargs["skip_optimizations"] = list(params.skip_optimizations)
    t0 = time.perf_counter()
    slim = onnxslim.slim(before, **kwargs)
    slim_s = time.perf_counter() - t0
    del before
    external = save_onnx(slim, out / "model.onnx", meta.get("external_data"))
    nodes_after = len(slim.graph.node)
    del slim
    log(f"onnxslim: {nodes_before} → {nodes_after} nodes in {slim_s:.1f}s")

    tokenizer = load_tokenizer(src)
    texts = validation_texts()[: params.check_texts]
    reference = embed_onnx(ort_session(model_onnx(src)), tokenizer, texts, max_length=params.max_length)
    got = embed_onnx(ort_session(out / "model.onnx"), tokenizer, texts, max_length=params.max_length)
    numbers = compare(reference, got)
    log(
        f"check vs input graph: min cosine {numbers['min_cosine']:.6f}, max abs diff {numbers['max_abs_diff']:.3g}"
    )
    _check_or_fail("onnxslim changed the graph's output", numbers, params.check_min_cosine)

    copy_model_files(src, out)
    meta = dict(meta)
    meta.update(
        {
            "slim": {
                "nodes_before": nodes_before,
                "nodes_after": nodes_after,
                "check": numbers,
                "onnxslim": versions("onnxslim")["onnxslim"],
            },
            "external_data": external,
        }
    )
    write_json(out / META_FILE, meta)
    return {"nodes_before": nodes_before, "nodes_after": nodes_after, "check": numbers}
