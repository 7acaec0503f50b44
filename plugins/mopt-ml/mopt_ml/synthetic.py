"""The `synthetic` source: a family's real architecture, small, randomly initialised from a
seed, with a tokenizer learnt deterministically from the shipped sentences.

The same family, seed, config and library versions give byte-identical files, so the
folder's digest (and every action key downstream) is stable.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from mopt.api import Params, Source, SourceContext, SourceError
from pydantic import Field

#: bump when the files written for the same spec change
GENERATOR_VERSION = "1"


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

    def resolve(self, params: Any, ctx: SourceContext) -> Path:
        from mopt_ml.common import spec_hash, versions
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
            family = as_family(fam_cls, needs=SYNTHETIC)
        except TypeError as exc:
            raise SourceError(f"source synthetic={params.synthetic!r} of model {ctx.model_name!r}: {exc}") from None
        spec = {
            "family": params.synthetic,
            "seed": params.seed,
            "config": params.config,
            "generator": GENERATOR_VERSION,
            "tools": versions("torch", "transformers", "tokenizers", "safetensors"),
        }
        final = Path(ctx.cache_dir) / f"synthetic-{params.synthetic}-{spec_hash(spec)}"
        if (final / "config.json").is_file():
            return final
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
        try:
            write_synthetic(family, params.seed, dict(params.config), tmp)
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

    def lock_info(self, params: Any, path: Path) -> dict[str, Any]:
        from mopt_ml.common import versions

        return {"generator": GENERATOR_VERSION, **versions("torch", "transformers", "tokenizers")}


def write_synthetic(family: Any, seed: int, overrides: dict[str, Any], out: Path) -> None:
    """Write config.json, model.safetensors and the tokenizer files of a synthetic model."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModel

    from mopt_ml.common import read_texts, shipped_sentences_path, write_json

    tokenizer = family.synthetic_tokenizer(read_texts(shipped_sentences_path()))
    config = family.synthetic_config(overrides, vocab_size=len(tokenizer))
    if getattr(config, "pad_token_id", None) is None:
        config.pad_token_id = tokenizer.pad_token_id
    if getattr(config, "eos_token_id", None) is None and tokenizer.eos_token_id is not None:
        config.eos_token_id = tokenizer.eos_token_id
    config.dtype = "float32"
    with _seeded(seed):
        model = AutoModel.from_config(config, dtype=torch.float32)
    model.eval()
    state = {k: v.detach().contiguous().clone() for k, v in sorted(model.state_dict().items())}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    write_json(out / "config.json", config.to_dict())
    tokenizer.save_pretrained(str(out))
    write_json(out / "mopt_synthetic.json", {"family": family.name, "seed": seed, "config": overrides})


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
