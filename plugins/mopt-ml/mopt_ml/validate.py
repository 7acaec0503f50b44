"""The `validate` target: the artifact under test against the PyTorch reference, with a gate.

Task-aware: for `task = "embedding"` it compares pooled embeddings (cosine); for
`task = "text-generation"` it compares next-token distributions on held-out text and greedy
continuations (`validate_generation`, maths in `mopt_ml.genmetrics`), against the fp32
PyTorch model of the section's weights.

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

from mopt_ml.genmetrics import DEFAULT_GATES as DEFAULT_GEN_GATES

#: the kinds whose folders hold a model.onnx this plugin can run
ONNX_KINDS = ("ort-quantize", "onnx-slim", "onnx")
#: the artifact formats validate, bench and select take (any kind producing them)
TESTED_FORMATS = ("onnx", "openvino-ir", "torch-compile-cache")
#: the task whose artifacts are tested token by token (the others: by pooled embeddings)
GENERATION = "text-generation"


def generation_format(folder: Path) -> str:
    """The artifact format of a generation model folder, for `genruntime.open_generator`."""
    if (folder / "model.onnx").is_file():
        return "onnx"
    if is_openvino(folder):
        return "openvino-ir"
    if (folder / "hf_quant_config.json").is_file():
        return "modelopt-checkpoint"
    return "hf-checkpoint"


def open_generator(path: Path, **kw: Any) -> Any:
    """`mopt_ml.genruntime.open_generator` (looked up at call time: tests replace it)."""
    from mopt_ml import genruntime

    return genruntime.open_generator(path, **kw)


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
    import fcntl

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
        path.parent.mkdir(parents=True, exist_ok=True)
        # one computes, a concurrent validate of the section (-j 2 starts two at once) waits
        # and reads its file instead of computing the same reference beside it
        with open(path.with_suffix(".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if path.is_file():
                return np.load(path)
            return _reference(family, ref_dir, texts, kw, path)
    return _reference(family, ref_dir, texts, kw, None)


def _reference(family: Any, ref_dir: Path, texts: list[str], kw: dict[str, Any], path: Path | None) -> Any:
    import os

    import numpy as np

    model = family.load(ref_dir, dtype="fp32")
    reference = family.embed(model, family.load_tokenizer(ref_dir), texts, **kw)
    del model
    if path is not None:
        part = path.with_name(f".{path.name}.{os.getpid()}.{id(reference)}.npy")
        np.save(part, reference)
        os.replace(part, path)  # atomic: a reader without the lock sees a whole file or none
    return reference


class GateFailed(RuntimeError):
    """The artifact is not accurate enough for the recipe's thresholds."""


class ArtifactTester(TargetKind):
    """Base of the kinds that test one artifact against the PyTorch reference (`validate`,
    `bench`): fanned out over the section's artifacts, reading an optional `data` file."""

    # imported once by the build's fork server
    preload = ("torch", "transformers", "transformers.modeling_utils", "onnxruntime",
               "transformers.models.auto.modeling_auto", "transformers.models.auto.tokenization_auto",
               # what common.require("transformers") imports in every action
               "transformers.models.bert.modeling_bert", "transformers.models.qwen3.modeling_qwen3")

    consumes = (
        Input("model", formats=TESTED_FORMATS, fanout=True),
        Input("reference", formats=("hf-checkpoint",), kinds=("pretrain", "weights")),
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
    """Embeddings: min / mean cosine of pooled embeddings vs the PyTorch reference, max abs
    diff and top-1 neighbour agreement on the validation texts. Text generation: mean KL
    and its p99 (the default gates), perplexity ratio, top-1 next-token agreement and greedy
    agreement on held-out text. Fails beyond the thresholds."""

    name = "validate"
    version = "1"
    description = "accuracy of an artifact vs the PyTorch reference, with a gate"

    class Params(Params):
        min_cosine: float | None = Field(default=0.99, description="fail below this min cosine")
        mean_cosine: float | None = Field(default=None, description="fail below this mean cosine")
        min_top1: float | None = Field(
            default=None,
            description="fail below this top-1 agreement (embedding: nearest neighbour; text-generation: "
            "held-out next token, reported always); null: off",
        )
        max_abs_diff: float | None = Field(default=None, description="fail above this max abs diff")
        data: str | None = Field(
            default=None,
            description="validation texts (.txt / .jsonl, relative to the recipe); null: the shipped split",
        )
        batch_size: int = Field(default=32, ge=1, description="texts per forward pass")
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
        # ---- text-generation (task = "text-generation"; ignored for embeddings)
        max_ppl_ratio: float | None = Field(
            default=None,
            gt=0,
            description="generation: fail above this perplexity ratio (candidate / reference, reported "
            "always); null: off",
        )
        max_kl: float | None = Field(
            default=DEFAULT_GEN_GATES["max_kl"],
            ge=0,
            description="generation: fail above this mean KL(ref || cand) per token, nats (llama.cpp's "
            "LLaMA-3-8B: q4_K_M 0.031, q4_0 0.072); null: off",
        )
        max_kl_p99: float | None = Field(
            default=DEFAULT_GEN_GATES["max_kl_p99"],
            ge=0,
            description="generation: fail above this 99th percentile of the per-token KL, nats; null: off",
        )
        min_greedy: float | None = Field(
            default=None,
            ge=0,
            le=1,
            description="generation: fail below this mean fraction of a greedy continuation equal to "
            "the reference's before the first divergence (reported always); null: off",
        )
        max_tokens: int = Field(
            default=128, ge=2, description="generation: tokens per held-out passage, at most"
        )
        passage_sentences: int = Field(
            default=4, ge=1, description="generation: held-out sentences joined into one passage"
        )
        max_texts: int | None = Field(
            default=64, ge=1, description="generation: passages compared, at most (null: all)"
        )
        greedy_prompts: int = Field(
            default=8, ge=0, description="generation: passages whose start is continued greedily (0: none)"
        )
        prompt_tokens: int = Field(default=16, ge=1, description="generation: tokens of each greedy prompt")
        greedy_tokens: int = Field(default=32, ge=1, description="generation: tokens generated per prompt")
        top_k: int = Field(
            default=1024,
            ge=1,
            description="generation: reference tokens kept per position for the KL (the rest is one "
            "bucket; exact when ≥ the vocabulary)",
        )
        device: Literal["auto", "cpu", "cuda"] = Field(
            default="auto",
            description="generation: where the candidate runs (auto: cuda on a GPU profile with a GPU)",
        )

    def fingerprint(self) -> dict[str, str]:
        from mopt_ml.common import versions

        return versions("torch", "transformers", "onnxruntime", "numpy", "tokenizers", "openvino")

    def test(self, art: Artifact, ref: Path, ctx: BuildContext, label: str) -> dict[str, Any]:
        if ctx.task == GENERATION:
            return validate_generation(
                art.path,
                ref,
                ctx.out,
                ctx.params,
                ctx.project_dir,
                ctx.log,
                label=label,
                device=_device(ctx.params.device, ctx.hardware),
                cache=(ctx.cache_dir, ctx.input("reference").digest) if ctx.cache_dir else None,
            )
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
        from mopt_ml.openvino_ir import embed_folder

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
    gate_outcome(failed, summary, params.on_fail, log)
    return {
        "passed": not failed,
        "failed_gates": failed,
        **{k: numbers[k] for k in ("min_cosine", "mean_cosine", "max_abs_diff")},
        "top1_agreement": numbers.get("top1_agreement"),
        "n": len(texts),
        **({"inference_precision": runtime["inference_precision"]} if runtime else {}),
    }


# --------------------------------------------------------------------------- text generation


#: the params that shape a generation validate's numbers (recorded in its report)
GEN_SETTINGS = ("max_tokens", "passage_sentences", "max_texts", "greedy_prompts", "prompt_tokens",
                "greedy_tokens", "top_k")  # fmt: skip


def gate_outcome(failed: list[str], summary: str, on_fail: str, log: Any) -> None:
    """The end of a validation (embedding or generation): the summary in the log, then
    GateFailed when a gate failed and on_fail = "fail", or the failures logged as recorded."""
    log(summary)
    if failed and on_fail == "fail":
        raise GateFailed(
            f"validation gate failed: {'; '.join(failed)} ({summary}); to record it and build on, "
            'set on_fail = "record" on this target'
        )
    if failed:
        log(f'validation gate failed (recorded, on_fail = "record"): {"; ".join(failed)}')


def _device(choice: str, hardware: Any) -> str:
    """`auto`: cuda on a GPU profile when torch sees a GPU, else cpu."""
    if choice != "auto":
        return choice
    if getattr(hardware, "is_gpu", False):
        import torch

        if torch.cuda.is_available():
            return "cuda"
    return "cpu"


def held_out_passages(params: Any, project_dir: Path) -> list[str]:
    """The held-out texts of a generation validate: the recipe's `data`, or the shipped
    validation split (never the calibration split), `passage_sentences` consecutive texts
    joined into one passage, at most `max_texts` passages."""
    from mopt_ml.common import texts_from_param

    texts = texts_from_param(params.data, project_dir, "validation")
    k = params.passage_sentences
    passages = [" ".join(texts[i : i + k]) for i in range(0, len(texts), k)]
    return passages[: params.max_texts] if params.max_texts else passages


def _token_ids(tokenizer: Any, passages: list[str], max_tokens: int) -> list[list[int]]:
    # no special tokens: the synthetic and Qwen tokenizers would append <|endoftext|>
    return [list(tokenizer(p, add_special_tokens=False)["input_ids"])[:max_tokens] for p in passages]


def reference_generation(
    ref_dir: Path,
    ids: list[list[int]],
    prompts: list[list[int]],
    params: Any,
    device: str,
    cache: tuple[Path, str] | None,
    log: Any,
) -> tuple[list[Any], list[list[int]], int, bool]:
    """The fp32 PyTorch reference's next-token distributions (`genmetrics.RefDist`, one per
    passage), greedy continuations of `prompts`, its vocabulary (logits width), and whether
    they came from the cache.
    Cached like the embedding reference: per weights digest, token ids, settings, threads
    and library versions, so a sweep computes it once."""
    import os

    import numpy as np
    import torch

    from mopt_ml.common import spec_hash, versions
    from mopt_ml.genmetrics import RefDist, next_token_targets, summarize

    path = None
    if cache is not None:
        key = {
            "weights": cache[1],
            "task": GENERATION,
            "layout": 2,  # of the .npz (2: with the logits width)
            "ids": spec_hash(ids),
            "prompts": spec_hash(prompts),
            "settings": {"top_k": params.top_k, "greedy_tokens": params.greedy_tokens, "device": device},
            "threads": torch.get_num_threads(),
            "tools": versions("torch", "transformers", "tokenizers"),
        }
        path = cache[0] / f"reference-gen-{spec_hash(key, 32)}.npz"
        if path.is_file():
            with np.load(path) as z:
                dists = [RefDist.from_arrays(z, f"t{i}_") for i in range(len(ids))]
                cont = [list(map(int, row)) for row in z["greedy"]] if prompts else []
                vocab = int(z["vocab"])
            return dists, cont, vocab, True
    gen = open_generator(ref_dir, format="hf-checkpoint", device=device, dtype="fp32", threads=params.threads)
    try:
        dists = [summarize(np.asarray(gen.logits(x))[:-1], next_token_targets(x), params.top_k) for x in ids]
        cont = [list(gen.generate(p, params.greedy_tokens)) for p in prompts]
        vocab = int(gen.vocab_size)
    finally:
        gen.close()
    if path is not None:
        arrays: dict[str, Any] = {}
        for i, d in enumerate(dists):
            arrays.update(d.to_arrays(f"t{i}_"))
        arrays["greedy"] = np.asarray(cont, dtype=np.int64).reshape(len(cont), -1)
        arrays["vocab"] = np.asarray(vocab)
        path.parent.mkdir(parents=True, exist_ok=True)
        part = path.with_name(f".{path.name}.{os.getpid()}.{id(arrays)}.npz")
        np.savez(part, **arrays)
        os.replace(part, path)  # atomic: a concurrent validate reads a whole file or none
    log(f"reference: fp32 PyTorch on {device}, {sum(len(x) - 1 for x in ids)} positions")
    return dists, cont, vocab, False


def validate_generation(
    model_dir: Path,
    ref_dir: Path,
    out: Path,
    params: Any,
    project_dir: Path,
    log: Any,
    label: str = "",
    device: str = "cpu",
    cache: tuple[Path, str] | None = None,
) -> dict[str, Any]:
    """Mean KL(ref || cand) and its 99th percentile, perplexity ratio and top-1 next-token
    agreement on held-out passages (teacher-forced), and greedy agreement over
    `greedy_tokens` tokens, of the generator in `model_dir` against the fp32 PyTorch model
    in `ref_dir`; gates `max_kl`, `max_kl_p99` (on by default), `min_top1`, `max_ppl_ratio`,
    `min_greedy` (where the recipe sets them; see `mopt_ml.genmetrics`)."""
    import numpy as np
    import torch

    from mopt_ml import genmetrics as gm
    from mopt_ml.common import load_tokenizer, read_meta, versions, write_json

    if params.threads:  # process-wide in torch: only when the recipe asks
        torch.set_num_threads(params.threads)
    passages = held_out_passages(params, project_dir)
    tokenizer = load_tokenizer(ref_dir)
    ids = [x for x in _token_ids(tokenizer, passages, params.max_tokens) if len(x) >= 2]
    if not ids:
        raise ValueError("validate: no held-out passage has 2 tokens or more; give longer texts in `data`")
    prompts = [x[: params.prompt_tokens] for x in ids if len(x) > params.prompt_tokens][
        : params.greedy_prompts
    ]
    dists, ref_cont, ref_vocab, cached = reference_generation(
        ref_dir, ids, prompts, params, device, cache, log
    )
    fmt = generation_format(model_dir)
    gen = open_generator(model_dir, format=fmt, device=device, threads=params.threads)
    try:
        if int(gen.vocab_size) != ref_vocab:
            raise ValueError(
                f"validate: {label or model_dir.name} gives logits over {gen.vocab_size} tokens, the reference "
                f"over {ref_vocab}: not the same vocabulary; build the artifact from this section's weights"
            )
        parts = [
            gm.compare(d, np.asarray(gen.logits(x))[:-1], gm.next_token_targets(x))
            for d, x in zip(dists, ids, strict=True)
        ]
        cand_cont = [list(gen.generate(p, params.greedy_tokens)) for p in prompts]
        backend = getattr(gen, "backend", fmt)
    finally:
        gen.close()
    numbers = gm.metrics(parts, list(zip(ref_cont, cand_cont, strict=True)), params.greedy_tokens)
    limits = {
        "min_top1": params.min_top1,
        "max_ppl_ratio": params.max_ppl_ratio,
        "max_kl": params.max_kl,
        "max_kl_p99": params.max_kl_p99,
        "min_greedy": params.min_greedy if prompts else None,
    }
    results, failed = gm.gate(numbers, limits)
    per_text = sorted(((float(p.kl.mean()), i) for i, p in enumerate(parts)), reverse=True)[: params.worst]
    worst = [
        {"kl_mean": gm._sig(kl), "top1_agreement": gm._sig(parts[i].agree.mean()), "text": passages[i]}
        for kl, i in per_text
    ]
    meta = read_meta(model_dir)
    report = {
        "format": "mopt-validate/1",
        "task": GENERATION,
        "artifact": label or str(model_dir.name),
        "backend": backend,
        "device": device,
        "precision": meta.get("precision"),
        "quantization": meta.get("quantization"),
        "texts": {
            "n": len(ids),
            "positions": numbers["positions"],
            "source": params.data or "shipped validation split (never calibration)",
        },
        "settings": {k: getattr(params, k) for k in GEN_SETTINGS}
        | {"threads": params.threads or "default", "reference_cached": cached},
        "metrics": numbers,
        "gates": results,
        "passed": not failed,
        "worst": worst,
        "greedy": [
            {
                "prompt": p,
                "reference": r,
                "candidate": c,
                # the same as text, for a reader
                "reference_text": tokenizer.decode(r),
                "candidate_text": tokenizer.decode(c),
            }
            for p, r, c in zip(prompts, ref_cont, cand_cont, strict=True)
        ],
        "tools": versions("torch", "transformers", "onnxruntime"),
    }
    write_json(out / "report.json", report)
    greedy = (
        f", greedy prefix {numbers['greedy_prefix']:.3f} ({numbers['greedy_identical']}/{len(prompts)} identical "
        f"over {params.greedy_tokens} tokens)"
        if prompts
        else ""
    )
    summary = (
        f"{label or model_dir.name}: top-1 {numbers['top1_agreement']:.4f}, ppl ratio {numbers['ppl_ratio']:.4f} "
        f"({numbers['ppl_candidate']:.2f} vs {numbers['ppl_reference']:.2f}), KL {numbers['kl_mean']:.4f} "
        f"(p99 {numbers['kl_p99']:.4f}){greedy} on {len(ids)} passages, {numbers['positions']} positions"
    )
    gate_outcome(failed, summary, params.on_fail, log)
    return {
        "passed": not failed,
        "failed_gates": failed,
        "task": GENERATION,
        **{
            k: numbers.get(k)
            for k in ("top1_agreement", "ppl_ratio", "kl_mean", "kl_p99", "greedy_prefix", "greedy_match")
        },
        "n": len(ids),
        "positions": numbers["positions"],
    }
