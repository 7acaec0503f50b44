"""The `synthetic` source: a family's real architecture, small, randomly initialised from a
seed, with a tokenizer learnt deterministically from the shipped sentences.

The model is built for the recipe model's `task`: for "embedding" the family's base model
(e.g. Qwen3Model); for "text-generation" its causal LM (e.g. Qwen3ForCausalLM, tied
embeddings stored once as the real checkpoints do), a chat tokenizer with the family's chat
template in tokenizer_config.json, and a generation_config.json with the eos / pad ids.
`config` overrides select any shape, e.g. Qwen3-0.6B's (see recipes/qwen3-chat.toml).

The same family, seed, config and library versions give byte-identical files. The source
declares them as its identity (`identity`): action keys are made from the declaration, so a
plan never generates the weights, and mopt checks the folder's digest against the one
mopt.lock recorded whenever a build reads it. Bump GENERATOR_VERSION (or
GENERATION_VERSION) whenever the files written for the same spec change.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from mopt.api import EMBEDDING, TEXT_GENERATION, Params, Source, SourceContext, SourceError
from pydantic import Field

#: bump when the files written for the same spec change
GENERATOR_VERSION = "1"
#: bump when the files written for a text-generation spec change (embedding folders keep
#: their names: they are keyed on GENERATOR_VERSION alone)
GENERATION_VERSION = "4"  # 4: initializer_range 0.02 (Qwen3's), not 0.2; 3: pad_tokenizer


class SyntheticSource(Source):
    """A tiny random model of a family's real architecture (deterministic bytes)."""

    name = "synthetic"
    description = "a family's real architecture, small and randomly initialised from a seed"

    class Params(Params):
        synthetic: str = Field(
            description="the registered family whose architecture to build (qwen3, bert, a plugin's)"
        )
        seed: int = Field(default=0, ge=0, description="torch seed for the random weights")
        config: dict[str, Any] = Field(
            default={}, description="overrides of the family's small default config"
        )

    def describe(self, params: Any) -> str:
        extra = f",{sorted(params.config.items())}" if params.config else ""
        return f"synthetic:{params.synthetic}(seed={params.seed}{extra})"

    def identity(self, params: Any, ctx: SourceContext) -> Any:
        """Family, seed, config, task, generator version and the versions of the libraries
        that write the files (from package metadata: nothing is imported or generated)."""
        from mopt_ml.common import versions

        family = self._family(params, ctx)  # an unknown family fails here, not at the first build
        task = getattr(ctx, "task", None) or EMBEDDING
        spec: dict[str, Any] = {
            "family": params.synthetic,
            "seed": params.seed,
            "config": params.config,
            "generator": GENERATOR_VERSION,
            "tools": versions("torch", "transformers", "tokenizers", "safetensors"),
        }
        vocab = getattr(family, "synthetic_defaults", {}).get("vocab_size")
        if vocab is not None:  # a family's own vocab_size is built (it was the tokenizer's before)
            spec["vocab_size"] = vocab
        if task != EMBEDDING:  # embedding folders keep the names they had before tasks
            spec["task"] = task
            spec["generation"] = GENERATION_VERSION
        return spec

    def _family(self, params: Any, ctx: SourceContext) -> Any:
        from mopt_ml.families import FAMILIES, SYNTHETIC, as_family

        # any registered family (a third party's too); the plugin's own when the context
        # has no registry (direct calls)
        fam_cls: Any = ctx.families.get(params.synthetic) or FAMILIES.get(params.synthetic)
        if fam_cls is None and getattr(ctx.family, "name", None) == params.synthetic:
            fam_cls = ctx.family if isinstance(ctx.family, type) else type(ctx.family)
        if fam_cls is None:
            known = sorted(set(ctx.families) | set(FAMILIES))
            raise SourceError(
                f"source synthetic={params.synthetic!r} of model {ctx.model_name!r}: no such "
                f"family (registered: {', '.join(known)})"
            )
        try:
            return as_family(fam_cls, task=getattr(ctx, "task", None) or EMBEDDING, needs=SYNTHETIC)
        except (TypeError, ValueError) as exc:
            raise SourceError(
                f"source synthetic={params.synthetic!r} of model {ctx.model_name!r}: {exc}"
            ) from None

    def resolve(self, params: Any, ctx: SourceContext) -> Path:
        from mopt_ml.common import spec_hash

        family = self._family(params, ctx)
        task = getattr(ctx, "task", None) or EMBEDDING
        spec = self.identity(params, ctx)
        final = Path(ctx.cache_dir) / f"synthetic-{params.synthetic}-{spec_hash(spec)}"
        if (final / "config.json").is_file():
            return final
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
        try:
            write_synthetic(family, params.seed, dict(params.config), tmp, task=task)
            try:
                os.rename(tmp, final)
            except OSError:
                if not (final / "config.json").is_file():  # not a lost race: a real error
                    raise
        except Exception as exc:
            if isinstance(exc, SourceError):
                raise
            raise SourceError(
                f"source synthetic={params.synthetic!r} of model {ctx.model_name!r}: "
                f"could not build it: {type(exc).__name__}: {exc}"
            ) from exc
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        return final


def write_synthetic(
    family: Any, seed: int, overrides: dict[str, Any], out: Path, task: str = EMBEDDING
) -> None:
    """Write config.json, model.safetensors and the tokenizer files of a synthetic model
    (and generation_config.json for text-generation)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModel, AutoModelForCausalLM

    from mopt_ml.common import read_texts, shipped_sentences_path, write_json
    from mopt_ml.families import task_kwargs

    generation = task == TEXT_GENERATION
    tokenizer = family.synthetic_tokenizer(read_texts(shipped_sentences_path()), **task_kwargs(task))
    config = family.synthetic_config(overrides, vocab_size=len(tokenizer), **task_kwargs(task))
    if generation and int(getattr(config, "vocab_size", 0) or 0) > len(tokenizer):
        pad_tokenizer(tokenizer, int(config.vocab_size))
    ids = generation_ids(family, tokenizer) if generation else {}
    for key, value in ids.items():
        if getattr(config, key, None) is None:
            setattr(config, key, value if key != "eos_token_id" or not isinstance(value, list) else value[0])
    if getattr(config, "pad_token_id", None) is None:
        config.pad_token_id = tokenizer.pad_token_id
    if getattr(config, "eos_token_id", None) is None and tokenizer.eos_token_id is not None:
        config.eos_token_id = tokenizer.eos_token_id
    config.dtype = "float32"
    auto = AutoModelForCausalLM if generation else AutoModel
    with _seeded(seed):
        model = auto.from_config(config, dtype=torch.float32)
    model.eval()
    state: dict[str, Any] = {}
    seen: set[tuple[int, tuple[int, ...]]] = set()
    # the output head last, so a tied head is the copy dropped and the input embedding stays
    for k, v in sorted(model.state_dict().items(), key=lambda kv: (kv[0].startswith("lm_head."), kv[0])):
        key = (v.data_ptr(), tuple(v.shape))
        if v.numel() and key in seen:  # a tied tensor (lm_head = embed_tokens): stored once
            continue
        seen.add(key)
        state[k] = v.detach().contiguous().clone()
    save_file(dict(sorted(state.items())), str(out / "model.safetensors"), metadata={"format": "pt"})
    write_json(out / "config.json", config.to_dict())
    # the chat template inside tokenizer_config.json, where Qwen3's checkpoints keep it
    tokenizer.save_pretrained(str(out), **({"save_jinja_files": False} if generation else {}))
    if generation:
        write_json(out / "generation_config.json", {"do_sample": False, **ids})
    meta: dict[str, Any] = {"family": family.name, "seed": seed, "config": overrides}
    if generation:
        meta["task"] = task
    write_json(out / "mopt_synthetic.json", meta)


def pad_tokenizer(tokenizer: Any, size: int) -> None:
    """Give a fast tokenizer `size` ids: unreachable filler tokens (`zzfill<id>`, ASCII, so the
    byte-level decoder decodes them; no merge produces them) after its own. A causal LM with
    a larger vocab_size than its tokenizer (Qwen3-0.6B's 151,936 with the small synthetic
    tokenizer) generates ids the tokenizer cannot decode; vLLM then streams empty text chunks
    and its benchmark client, which times chunks with content, measures no real TTFT / ITL."""
    import json

    from tokenizers import Tokenizer

    js = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = js["model"]["vocab"]
    taken = set(vocab.values()) | {int(a["id"]) for a in js.get("added_tokens") or []}
    for i in range(max(taken) + 1, size):
        vocab[f"zzfill{i}"] = i
    tokenizer._tokenizer = Tokenizer.from_str(json.dumps(js))


def generation_ids(family: Any, tokenizer: Any) -> dict[str, Any]:
    """bos / eos / pad ids of a synthetic causal LM: the family's `generation_ids(tokenizer)`
    when it has one, else the tokenizer's."""
    hook = getattr(family, "generation_ids", None)
    if callable(hook):
        return dict(hook(tokenizer))
    out: dict[str, Any] = {}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(tokenizer, key, None)
        if value is not None:
            out[key] = int(value)
    return out


class _seeded:
    """Seed torch's CPU generator for a block and restore its state afterwards."""

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def __enter__(self) -> None:
        import torch

        self.state = torch.random.get_rng_state()
        torch.manual_seed(self.seed)

    def __exit__(self, *exc: object) -> None:
        import torch

        torch.random.set_rng_state(self.state)
