"""The `validate` target: the artifact under test against the PyTorch reference, with a gate.

Failing the gate raises, so the build fails and nothing is cached; the message carries the
numbers. With `on_fail = "record"` the result says `passed: false` and the build goes on
(a `select` over a sweep excludes such variants). The report is written before the gate is checked, but a failed action's output is
not kept by the store, so the numbers are in the message too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from mopt.api import Artifact, BuildContext, Input, Params, TargetKind
from pydantic import Field

#: the kinds whose folders hold a model.onnx this plugin can run
ONNX_KINDS = ("ort-quantize", "onnx-slim", "onnx")
#: the artifact formats validate, bench and select take (any kind producing them)
TESTED_FORMATS = ("onnx", "openvino-ir", "torch-compile-cache")


def is_openvino(folder: Path) -> bool:
    """An OpenVINO IR folder (by its files, whichever kind made it)."""
    return (folder / "model.xml").is_file() and (folder / "model.bin").is_file()


def reference_embeddings(
    family: Any, ref_dir: Path, texts: list[str], kw: dict[str, Any], cache: tuple[Path, str] | None
) -> Any:
    """The PyTorch fp32 reference embeddings of `texts`. With `cache` (the kind's cache
    folder, the reference artifact's digest) they are computed once per weights, texts,
    settings, threads and library versions and reused by the section's other validate
    actions (a sweep validates every variant against the same reference)."""
    import os

    import numpy as np
    import torch

    from mopt_ml.common import spec_hash, versions

    path = None
    if cache is not None:
        key = {
            "weights": cache[1],
            "family": family.name,
            "texts": spec_hash(texts),
            "settings": kw,
            "threads": torch.get_num_threads(),  # fp32 sums are ordered by the thread split
            "tools": versions("torch", "transformers", "tokenizers"),
        }
        path = cache[0] / f"reference-{spec_hash(key, 32)}.npy"
        if path.is_file():
            return np.load(path)
    model = family.load(ref_dir, dtype="fp32")
    reference = family.embed(model, family.load_tokenizer(ref_dir), texts, **kw)
    del model
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        part = path.with_name(f".{path.name}.{os.getpid()}.{id(reference)}.npy")
        np.save(part, reference)
        os.replace(part, path)  # atomic: a concurrent validate reads a whole file or none
    return reference


class GateFailed(RuntimeError):
    """The artifact is not accurate enough for the recipe's thresholds."""


class ArtifactTester(TargetKind):
    """Base of the kinds that test one artifact against the PyTorch reference (`validate`,
    `bench`): fanned out over the section's artifacts, reading an optional `data` file."""

    preload = ("torch", "transformers", "transformers.modeling_utils", "onnxruntime")  # imported once by the build's fork server

    consumes = (
        Input("model", formats=TESTED_FORMATS, fanout=True),
        Input("reference", formats=("hf-checkpoint",), kinds=("weights",)),
    )
    produces = "report"
    static_fingerprint = True  # library versions only: a no-op build may skip it

    def input_files(self, params: Any, project_dir: Path) -> list[Path]:
        from mopt_ml.common import data_input_files

        return data_input_files(params.data, project_dir)

    def run(self, ctx: BuildContext) -> dict[str, Any]:
        from mopt_ml.common import require

        require("torch", "transformers", "onnxruntime")
        art = ctx.input("model")
        return self.test(art, ctx.input("reference").path, ctx, f"{art.target} ({art.kind})")

    def test(self, art: Artifact, ref: Path, ctx: BuildContext, label: str) -> dict[str, Any]:
        """Test `art` against the reference weights in `ref`; the action's result."""
        raise NotImplementedError


class ValidateKind(ArtifactTester):
    """Min / mean cosine of pooled embeddings vs the PyTorch reference, max abs diff and
    top-1 neighbour agreement on the validation texts; fails below the thresholds."""

    name = "validate"
    version = "1"
    description = "accuracy of an artifact vs the PyTorch reference, with a gate"

    class Params(Params):
        min_cosine: float | None = Field(default=0.99, description="fail below this min cosine")
        mean_cosine: float | None = Field(default=None, description="fail below this mean cosine")
        min_top1: float | None = Field(default=None, description="fail below this top-1 agreement")
        max_abs_diff: float | None = Field(default=None, description="fail above this max abs diff")
        data: str | None = Field(
            default=None,
            description="validation texts (.txt / .jsonl, relative to the recipe); null: the shipped split",
        )
        batch_size: int = Field(default=32, ge=1)
        max_length: int = Field(default=128, ge=8, description="tokenizer truncation")
        pad_to: int | None = Field(default=None, ge=8, description="pad every batch to this length")
        threads: int | None = Field(
            default=None,
            ge=1,
            description="ORT and torch threads (null: their defaults; torch's is process-wide)",
        )
        worst: int = Field(default=5, ge=0, description="lowest-cosine texts listed in the report")
        on_fail: Literal["fail", "record"] = Field(
            default="fail",
            description="below a threshold: fail the build, or record `passed: false` and succeed "
            "(for sweeps: `select` then excludes the variant)",
        )

    def fingerprint(self) -> dict[str, str]:
        from mopt_ml.common import versions

        return versions("torch", "transformers", "onnxruntime", "numpy", "tokenizers", "openvino")

    def test(self, art: Artifact, ref: Path, ctx: BuildContext, label: str) -> dict[str, Any]:
        return validate(
            art.path,
            ref,
            ctx.out,
            ctx.family,
            ctx.params,
            ctx.project_dir,
            ctx.log,
            label=label,
            kind=art.kind,
            cache=(ctx.cache_dir, ctx.input("reference").digest) if ctx.cache_dir else None,
        )


def validate(
    model_dir: Path,
    ref_dir: Path,
    out: Path,
    family_obj: Any,
    params: Any,
    project_dir: Path,
    log: Any,
    label: str = "",
    kind: str = "onnx",
    cache: tuple[Path, str] | None = None,
) -> dict[str, Any]:
    import numpy as np
    import torch

    from mopt_ml.common import (
        compare,
        cosines,
        embed_onnx,
        load_tokenizer,
        model_onnx,
        ort_session,
        read_meta,
        texts_from_param,
        versions,
        write_json,
    )
    from mopt_ml.families import as_family

    family = as_family(family_obj, ref_dir)
    texts = texts_from_param(params.data, project_dir, "validation")
    runtime: dict[str, Any] | None = None  # an OpenVINO artifact: what its CPU plugin chose
    if params.threads:  # process-wide in torch: only when the recipe asks
        torch.set_num_threads(params.threads)
    threads = params.threads

    kw = {"max_length": params.max_length, "batch_size": params.batch_size, "pad_to": params.pad_to}
    reference = reference_embeddings(family, ref_dir, texts, kw, cache)

    if kind == "torch-compile":  # a compile cache: rebuilt from the weights, run on the GPU
        from mopt_ml import compiled

        got = compiled.embed(ref_dir, model_dir, family, texts, params.max_length)
    elif is_openvino(model_dir):  # compiled with the runtime properties the artifact records
        from mopt_openvino.runtime import embed_folder

        tokenizer = load_tokenizer(model_dir)
        family.sanitize_tokenizer(tokenizer)
        got, runtime = embed_folder(model_dir, tokenizer, texts, threads=threads, **kw)
    else:
        tokenizer = load_tokenizer(model_dir)
        family.sanitize_tokenizer(tokenizer)
        got = embed_onnx(ort_session(model_onnx(model_dir), threads=threads), tokenizer, texts, **kw)
    numbers = compare(reference, got)
    cos = cosines(reference, got)
    order = np.argsort(cos)[: params.worst]
    worst = [{"cosine": float(cos[i]), "text": texts[i]} for i in order]

    gates = {
        "min_cosine": (params.min_cosine, numbers["min_cosine"], ">="),
        "mean_cosine": (params.mean_cosine, numbers["mean_cosine"], ">="),
        "min_top1": (params.min_top1, numbers.get("top1_agreement", 1.0), ">="),
        "max_abs_diff": (params.max_abs_diff, numbers["max_abs_diff"], "<="),
    }
    failed = []
    results = {}
    for name, (limit, value, op) in gates.items():
        if limit is None:
            continue
        ok = value >= limit if op == ">=" else value <= limit
        results[name] = {"limit": limit, "value": value, "passed": ok}
        if not ok:
            failed.append(
                f"{name.replace('min_top1', 'top1_agreement')} {value:.4f} {'<' if op == '>=' else '>'} {limit}"
            )
    meta = read_meta(model_dir)
    report = {
        "format": "mopt-validate/1",
        "artifact": label or str(model_dir.name),
        "family": family.name,
        "precision": meta.get("precision"),
        "quantization": meta.get("quantization"),
        "texts": {"n": len(texts), "source": params.data or "shipped validation split"},
        "settings": {**kw, "threads": threads or "default"},
        "runtime": runtime,
        "metrics": numbers,
        "gates": results,
        "passed": not failed,
        "worst": worst,
        "tools": versions("torch", "transformers", "onnxruntime", *(("openvino",) if runtime else ())),
    }
    write_json(out / "report.json", report)
    summary = (
        f"{label or model_dir.name}: min cosine {numbers['min_cosine']:.4f}, mean {numbers['mean_cosine']:.4f}, "
        f"max abs diff {numbers['max_abs_diff']:.4f}, top-1 agreement {numbers.get('top1_agreement', 1.0):.3f} "
        f"on {len(texts)} texts"
    )
    log(summary)
    if failed and params.on_fail == "fail":
        raise GateFailed(f"validation gate failed: {'; '.join(failed)} ({summary})")
    if failed:
        log(f'validation gate failed (recorded, on_fail = "record"): {"; ".join(failed)}')
    return {
        "passed": not failed,
        "failed_gates": failed,
        **{k: numbers[k] for k in ("min_cosine", "mean_cosine", "max_abs_diff")},
        "top1_agreement": numbers.get("top1_agreement"),
        "n": len(texts),
        **({"inference_precision": runtime["inference_precision"]} if runtime else {}),
    }
