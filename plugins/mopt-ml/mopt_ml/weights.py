"""The `weights` target: a checkpoint sanitised into a canonical Hugging Face folder.

Task-aware: for "embedding" the family's base model is loaded and the folder is checked by
the cosine of its embeddings; for "text-generation" its causal LM (tied lm_head stored once,
as `model.embed_tokens.weight`), checked by its next-token logits, with the chat template
kept in tokenizer_config.json and generation_config.json carried over.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Literal

from mopt.api import BuildContext, Params, TargetKind
from pydantic import Field

SAFETENSORS = ("*.safetensors",)
PICKLES = ("*.bin", "*.pt", "*.pth", "*.ckpt")
#: small files the sentence-transformers loader reads; kept so the folder still loads there
SENTENCE_TRANSFORMERS_FILES = (
    "modules.json",
    "sentence_bert_config.json",
    "config_sentence_transformers.json",
    "1_Pooling/config.json",
)
#: tensor names that only training uses (optimizer state, step counters, MLM/LM heads are
#: dropped because the base model does not load them)
TRAINING_ONLY_MARKERS = ("optimizer", "num_batches_tracked", "_step", "exp_avg")


class WeightsKind(TargetKind):
    """Sanitise the source checkpoint into a canonical HF folder: safetensors only, optional
    dtype cast, tied weights stored once, training-only tensors dropped, config.json
    normalised, tokenizer checked, and a manifest.json of every tensor."""

    # imported once by the build's fork server
    preload = ("torch", "transformers", "transformers.modeling_utils",
               "transformers.models.auto.modeling_auto", "transformers.models.auto.tokenization_auto",
               # what common.require("transformers") imports in every action
               "transformers.models.bert.modeling_bert", "transformers.models.qwen3.modeling_qwen3")

    name = "weights"
    version = "1"
    description = "canonical safetensors checkpoint + tokenizer + manifest"
    uses_source = True
    produces = "hf-checkpoint"
    fingerprint_packages = ("torch", "transformers", "safetensors", "tokenizers")

    class Params(Params):
        dtype: Literal["fp32", "fp16", "bf16"] | None = Field(
            default=None,
            description="cast floating-point weights to this dtype (null: keep the checkpoint's)",
        )
        max_shard_gb: float = Field(default=5.0, gt=0, description="largest safetensors shard")
        check_min_cosine: float = Field(
            default=0.9999,
            description="min cosine of the saved folder vs the source; a dtype cast is held to min(this, 0.99)",
        )

    def run(self, ctx: BuildContext) -> dict[str, Any]:
        from mopt_ml.common import require

        require("torch", "transformers", "safetensors")
        if ctx.source is None:
            raise ValueError("the weights target needs the model's source checkpoint (ctx.source)")
        return build_weights(ctx.source, ctx.out, ctx.tmp, ctx.family, ctx.params, ctx.log, task=ctx.task)


def _files(folder: Path, patterns: tuple[str, ...]) -> list[Path]:
    return sorted(p for pat in patterns for p in folder.glob(pat) if p.is_file())


def _read_checkpoint(src: Path, log: Any) -> tuple[dict[str, Any], list[str], list[str]]:
    """All tensors of the checkpoint (name → torch tensor), the files read, and notes."""
    import torch
    from safetensors.torch import load_file

    notes: list[str] = []
    st_files = _files(src, SAFETENSORS)
    pickles = _files(src, PICKLES)
    tensors: dict[str, Any] = {}
    if st_files:
        if pickles:
            notes.append(
                "ignored pickle files " + ", ".join(p.name for p in pickles) + " (safetensors present)"
            )
        for f in st_files:
            tensors.update(load_file(str(f)))
        return tensors, [p.name for p in st_files], notes
    if not pickles:
        raise FileNotFoundError(
            f"{src} holds no weights: expected *.safetensors (or a *.bin/*.pt that loads with "
            "torch.load(weights_only=True))"
        )
    for f in pickles:
        try:
            obj = torch.load(str(f), map_location="cpu", weights_only=True)
        except Exception as exc:
            raise ValueError(
                f"refusing {f.name}: it is a pickle that torch.load(weights_only=True) cannot "
                f"load ({type(exc).__name__}: {str(exc).splitlines()[0][:200]}); loading it fully "
                "could run arbitrary code. Convert it to safetensors with a tool you trust."
            ) from None
        if isinstance(obj, dict) and "state_dict" in obj and isinstance(obj["state_dict"], dict):
            obj = obj["state_dict"]
        if not isinstance(obj, dict):
            raise ValueError(f"refusing {f.name}: it does not hold a dict of tensors")
        for k, v in obj.items():
            if isinstance(v, torch.Tensor):
                tensors[k] = v
            else:
                notes.append(f"{f.name}: dropped non-tensor entry {k!r}")
        notes.append(f"read pickle {f.name} with torch.load(weights_only=True) (no code executed)")
        log(notes[-1])
    return tensors, [p.name for p in pickles], notes


def _check_tokenizer_files(src: Path) -> list[str]:
    present = [
        n for n in ("tokenizer.json", "vocab.txt", "vocab.json", "tokenizer.model") if (src / n).is_file()
    ]
    if not present:
        raise FileNotFoundError(
            f"{src} has no tokenizer (tokenizer.json, vocab.txt, vocab.json+merges.txt or "
            "tokenizer.model): the embedding targets need one; add the model's tokenizer files"
        )
    if (
        (src / "vocab.json").is_file()
        and not (src / "merges.txt").is_file()
        and "tokenizer.json" not in present
    ):
        raise FileNotFoundError(f"{src}: vocab.json without merges.txt is not a usable BPE tokenizer")
    return present


def build_weights(
    src: Path, out: Path, tmp: Path, family_obj: Any, params: Any, log: Any, task: str = "embedding"
) -> dict[str, Any]:
    import torch

    from mopt_ml.common import compare, validation_texts, write_json
    from mopt_ml.families import DTYPES, TEXT_GENERATION, as_family, task_kwargs

    family = as_family(family_obj, src, task=task)
    generation = task == TEXT_GENERATION
    tk = task_kwargs(task)
    cfg_path = src / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{src} has no config.json")
    tok_files = _check_tokenizer_files(src)

    # 1. read every tensor, refusing unsafe pickles; stage a safetensors-only copy
    tensors, weight_files, notes = _read_checkpoint(src, log)
    source_names = sorted(tensors)
    source_dtype = _dominant_dtype(tensors)
    stage = tmp / "stage"
    stage.mkdir(parents=True, exist_ok=True)
    for name in (
        "config.json",
        *tok_files,
        "tokenizer_config.json",
        "special_tokens_map.json",
        "added_tokens.json",
        "merges.txt",
        "generation_config.json",
    ):
        if (src / name).is_file() and not (stage / name).exists():
            shutil.copyfile(src / name, stage / name)
    training = [k for k in source_names if any(m in k for m in TRAINING_ONLY_MARKERS)]
    staged = {k: v.contiguous() for k, v in tensors.items() if k not in training}
    _save_deduped(staged, stage / "model.safetensors")
    del tensors, staged

    # 2. tokenizer: loads, is fast, has a pad token, ids fit the embedding table
    tokenizer = family.load_tokenizer(stage, **tk)
    tok_notes = family.sanitize_tokenizer(tokenizer)
    if generation and not getattr(tokenizer, "chat_template", None):
        tok_notes.append("the tokenizer has no chat template: chat endpoints will need one")
    raw_cfg = json.loads(cfg_path.read_text())
    vocab = raw_cfg.get("vocab_size")
    probe = tokenizer(validation_texts()[:8])["input_ids"]
    top = max(max(ids) for ids in probe)
    if vocab is not None and (top >= vocab or len(tokenizer) > vocab):
        raise ValueError(
            f"tokenizer produces ids up to {max(top, len(tokenizer) - 1)} but config.vocab_size is "
            f"{vocab}: the tokenizer does not belong to this checkpoint"
        )

    # 3. load through the family's model class: this is what decides which tensors matter
    from transformers import AutoModel, AutoModelForCausalLM

    from mopt_ml.families import quiet_transformers

    quiet_transformers()
    auto = AutoModelForCausalLM if generation else AutoModel
    model, info = auto.from_pretrained(
        str(stage),
        output_loading_info=True,
        attn_implementation=family.attn_implementation,
        dtype=torch.float32,
    )
    model.eval()
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        raise ValueError(
            f"the checkpoint lacks {len(missing)} tensor(s) the {type(model).__name__} needs "
            f"(e.g. {', '.join(missing[:5])}): they would be randomly initialised"
        )
    mismatched = info.get("mismatched_keys") or []
    if mismatched:
        raise ValueError(f"tensors with the wrong shape: {list(mismatched)[:5]}")
    if generation:
        from mopt_ml.genruntime import causal_logits

        check_texts = validation_texts()[:8]
        reference = causal_logits(model, tokenizer, check_texts)
    else:
        reference = family.embed(model, tokenizer, validation_texts()[:16])
    # null keeps the checkpoint's own precision (the model was loaded in fp32 to check it)
    dtype = params.dtype or source_dtype
    if dtype != "fp32":
        model = model.to(getattr(torch, DTYPES[dtype]))

    # 4. the state dict, tied tensors stored once, written deterministically
    state = model.state_dict()
    kept, tied = _dedupe(state)
    out_tensors = {k: state[k].detach().contiguous() for k in sorted(kept)}
    files = _write_shards(out_tensors, out, params.max_shard_gb)
    kept_names = set(out_tensors) | set(tied)
    dropped = sorted(set(source_names) - kept_names - _renamed(source_names, kept_names))
    for name in dropped:
        log(f"dropped tensor {name} (not used by {type(model).__name__})")

    # 5. config.json normalised; tokenizer saved canonically; extra loader files kept
    cfg = model.config.to_dict()
    cfg["architectures"] = [type(model).__name__]
    cfg["dtype"] = DTYPES[dtype]
    cfg.pop("torch_dtype", None)
    cfg.pop("_name_or_path", None)
    cfg, cfg_notes = family.sanitize_config(cfg, tokenizer, **tk)
    write_json(out / "config.json", cfg)
    # a chat template stays inside tokenizer_config.json (where Qwen3's checkpoints keep it)
    tokenizer.save_pretrained(str(out), **({"save_jinja_files": False} if generation else {}))
    if generation:
        gen_cfg = _generation_config(src, cfg)
        write_json(out / "generation_config.json", gen_cfg)
    for name in SENTENCE_TRANSFORMERS_FILES:
        if (src / name).is_file():
            (out / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src / name, out / name)

    # 6. the saved folder must embed like the source
    check_model = family.load(out, dtype="fp32", **tk)
    check_tok = family.load_tokenizer(out, **tk)
    if generation:
        from mopt_ml.genruntime import compare_logits

        check = compare_logits(reference, causal_logits(check_model, check_tok, check_texts))
    else:
        check = compare(reference, family.embed(check_model, check_tok, validation_texts()[:16]))
    # a cast loses precision by design; the source's own precision must round-trip exactly
    threshold = params.check_min_cosine if dtype == source_dtype else min(params.check_min_cosine, 0.99)
    if check["min_cosine"] < threshold:
        raise ValueError(
            f"the sanitised weights {'predict' if generation else 'embed'} differently from the source: "
            f"min cosine {'of next-token logits ' if generation else ''}"
            f"{check['min_cosine']:.6f} < {threshold} (mean {check['mean_cosine']:.6f})"
        )

    manifest = {
        "format": "mopt-weights/1",
        "family": family.name,
        "task": task,
        "model_class": type(model).__name__,
        "dtype": cfg["dtype"],
        "files": sorted(files),
        "tensors": {
            k: {
                "shape": list(v.shape),
                "dtype": str(v.dtype).removeprefix("torch."),
                "file": _file_of(k, files),
            }
            for k, v in out_tensors.items()
        },
        "num_parameters": int(sum(v.numel() for v in out_tensors.values())),
        "bytes": int(sum(v.numel() * v.element_size() for v in out_tensors.values())),
        "tied": tied,
        "dropped": dropped,
        "training_only": training,
        "source_files": weight_files,
        "notes": notes + tok_notes + cfg_notes,
        "tokenizer": {
            "class": type(tokenizer).__name__,
            "size": len(tokenizer),
            "pad_token": tokenizer.pad_token,
            "pad_token_id": tokenizer.pad_token_id,
            "padding_side": tokenizer.padding_side,
        },
        "check": check,
    }
    write_json(out / "manifest.json", manifest)
    log(
        f"{len(out_tensors)} tensors, {manifest['num_parameters']:,} parameters ({cfg['dtype']}); "
        f"dropped {len(dropped)}, tied {len(tied)}; reload check min cosine {check['min_cosine']:.6f}"
    )
    return {
        "family": family.name,
        "task": task,
        "dtype": cfg["dtype"],
        "num_parameters": manifest["num_parameters"],
        "tensors": len(out_tensors),
        "dropped": dropped,
        "tied": tied,
        "notes": manifest["notes"],
    }


def _dominant_dtype(tensors: dict[str, Any]) -> str:
    """ "fp32" / "fp16" / "bf16": the floating dtype holding most parameters."""
    import torch

    names = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
    count: dict[str, int] = {}
    for t in tensors.values():
        if t.dtype in names:
            count[names[t.dtype]] = count.get(names[t.dtype], 0) + t.numel()
    return max(count, key=lambda k: count[k]) if count else "fp32"


def _renamed(source: list[str], kept: set[str]) -> set[str]:
    """Source names that map onto a kept name with a prefix added or removed (e.g. the
    `model.` prefix of a *ForCausalLM checkpoint loaded as the base model)."""
    out = set()
    for name in source:
        if ("." in name and name.split(".", 1)[1] in kept) or any(k.endswith("." + name) for k in kept):
            out.add(name)
    return out


def _generation_config(src: Path, cfg: dict[str, Any]) -> dict[str, Any]:
    """The source's generation_config.json (transformers' bookkeeping dropped), or one made
    of config.json's bos / eos / pad ids."""
    path = src / "generation_config.json"
    gen = json.loads(path.read_text()) if path.is_file() else {}
    gen.pop("transformers_version", None)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if gen.get(key) is None and cfg.get(key) is not None:
            gen[key] = cfg[key]
    return gen


def _dedupe(state: dict[str, Any]) -> tuple[list[str], dict[str, str]]:
    """Names to store, and tied names → the stored name they share memory with. An output
    head (`lm_head.*`) is the tied copy, never the stored one: transformers ties it to the
    input embedding, which must be in the file."""
    seen: dict[tuple[int, tuple[int, ...], str], str] = {}
    kept: list[str] = []
    tied: dict[str, str] = {}
    for name in sorted(state, key=lambda n: (n.startswith("lm_head."), n)):
        t = state[name]
        key = (t.data_ptr(), tuple(t.shape), str(t.dtype))
        if t.numel() and key in seen:
            tied[name] = seen[key]
            continue
        seen[key] = name
        kept.append(name)
    return kept, tied


def _save_deduped(tensors: dict[str, Any], path: Path) -> None:
    from safetensors.torch import save_file

    kept, _tied = _dedupe(tensors)
    # clones: safetensors refuses tensors that share memory with others
    save_file({k: tensors[k].contiguous().clone() for k in kept}, str(path), metadata={"format": "pt"})


def _write_shards(tensors: dict[str, Any], out: Path, max_shard_gb: float) -> dict[str, list[str]]:
    """model.safetensors, or model-0000i-of-0000n.safetensors + index when larger than a shard."""
    from safetensors.torch import save_file

    limit = int(max_shard_gb * 1e9)
    shards: list[dict[str, Any]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    files: dict[str, list[str]] = {}
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata={"format": "pt"})
        (out / "model.safetensors").chmod(0o644)
        files["model.safetensors"] = sorted(shards[0])
        return files
    n = len(shards)
    weight_map = {}
    total = 0
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{n:05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        (out / fname).chmod(0o644)
        files[fname] = sorted(shard)
        for name, t in shard.items():
            weight_map[name] = fname
            total += t.numel() * t.element_size()
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2, sort_keys=True)
        + "\n"
    )
    return files


def _file_of(name: str, files: dict[str, list[str]]) -> str:
    for fname, names in files.items():
        if name in names:
            return fname
    return ""
