"""The `rtn` target: a checkpoint whose linear weights are rounded to a poorer format and
stored back in their own dtype (fake quantization of an hf-checkpoint).

Every 2-D weight of a linear layer (`*.weight` of rank 2 that is not an embedding table) is
rounded to `bits`-bit symmetric integers times a scale per tensor, per output channel or per
`block_size` inputs of a channel (`mopt_ml.quantize.round_to_nearest`, the rounding the ONNX
`ort-quantize` mode "rtn" applies), then cast back to the checkpoint's dtype. With `head`
(default) the output projection is rounded too; a model whose head is tied to its input
embeddings is untied first (`lm_head.weight` written on its own, `tie_word_embeddings` false
in config.json), so the embedding lookup keeps its weights, as in the ONNX graph.

The result is an ordinary hf-checkpoint: vLLM serves it (bf16 like the original), `onnx`
exports it, and `serve-check` / `validate` measure what the format costs in accuracy, none of
its speed. Its use is the deliberately poor variant an accuracy gate must reject:
`bits = 2, scale = "tensor"` in recipes/qwen3-chat.toml's H200 section (`int2-tensor`); the CPU
section's `int4-tensor` rounds the ONNX graph instead (`ort-quantize`, mode "rtn").
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Literal

from mopt.api import BuildContext, Input, Params, TargetKind
from pydantic import Field

#: linear weights whose name ends so are embedding tables, not layers to round
EMBEDDINGS = ("embed_tokens.weight", "wte.weight", "wpe.weight", "word_embeddings.weight",
              "position_embeddings.weight", "token_type_embeddings.weight", "embed_positions.weight")  # fmt: skip
HEADS = ("lm_head.weight",)


class RtnKind(TargetKind):
    """Round a checkpoint's linear weights to N-bit integers (fake quantization)."""

    preload = ("torch",)
    name = "rtn"
    version = "1"
    description = "round a checkpoint's linear weights to N-bit integers × scale, stored in their dtype"
    consumes = (Input("model", formats=("hf-checkpoint",)),)
    produces = "hf-checkpoint"
    fingerprint_packages = ("torch", "safetensors", "numpy")
    network = False

    class Params(Params):
        bits: int = Field(
            default=4, ge=2, le=8, description="integer bits (symmetric, 2^(bits-1) - 1 levels a side)"
        )
        scale: Literal["tensor", "channel", "block"] = Field(
            default="tensor",
            description="one scale per weight tensor, per output channel, or per block_size inputs of a channel",
        )
        block_size: int = Field(default=32, ge=2, description="scale = block: inputs per block")
        head: bool = Field(
            default=True,
            description="round the output projection (lm_head) too; a tied head is untied first",
        )

    def run(self, ctx: BuildContext) -> dict[str, Any]:
        from mopt_ml.common import require

        require("torch", "safetensors", "numpy")
        return round_checkpoint(ctx.input("model").path, ctx.out, ctx.params, ctx.log)


def round_checkpoint(src: Path, out: Path, params: Any, log: Any) -> dict[str, Any]:
    """Write `src` with its linear weights rounded to `out`; what was rounded, and its error."""
    import numpy as np
    import torch
    from safetensors.torch import load_file, save_file

    from mopt_ml.quantize import round_to_nearest

    shards = sorted(src.glob("*.safetensors"))
    if not shards:
        raise ValueError(f"rtn: {src} has no *.safetensors weights")
    config = json.loads((src / "config.json").read_text()) if (src / "config.json").is_file() else {}
    tied = bool(config.get("tie_word_embeddings", False))
    tensors: dict[str, Any] = {}
    for f in shards:
        tensors.update(load_file(str(f)))
    untied = False
    if params.head and tied and not any(k.endswith(HEADS) for k in tensors):
        emb = next((k for k in tensors if k.endswith("embed_tokens.weight")), None)
        if emb is None:
            raise ValueError("rtn: the head is tied to the embeddings, but no *embed_tokens.weight was found")
        prefix = emb[: -len("model.embed_tokens.weight")] if emb.endswith("model.embed_tokens.weight") else ""
        tensors[prefix + "lm_head.weight"] = tensors[emb].clone()
        untied = True
    errors: list[float] = []
    names: list[str] = []
    for name in sorted(tensors):
        t = tensors[name]
        if t.ndim != 2 or not name.endswith(".weight") or name.endswith(EMBEDDINGS):
            continue
        if name.endswith(HEADS) and not params.head:
            continue
        if not t.is_floating_point():
            continue
        # round_to_nearest takes [in, out]: a Linear stores [out, in]
        wq, err = round_to_nearest(t.float().numpy().T, params.bits, params.scale, params.block_size)
        tensors[name] = torch.from_numpy(np.ascontiguousarray(wq.T)).to(t.dtype)
        errors.append(err)
        names.append(name)
    if not names:
        raise ValueError(f"rtn: {src} has no linear weight to round")
    for f in sorted(src.iterdir()):
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copyfile(f, out / f.name)
    if untied:
        config["tie_word_embeddings"] = False
        (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file(
        {k: v.contiguous() for k, v in tensors.items()},
        str(out / "model.safetensors"),
        metadata={"format": "pt"},
    )
    fmt = f"int{params.bits}-{params.scale}" + (str(params.block_size) if params.scale == "block" else "")
    log(f"rtn: {len(names)} linear weights rounded ({fmt}), mean relative error {np.mean(errors):.4f}"
        + ("; head untied from the embeddings" if untied else ""))  # fmt: skip
    return {"format": fmt, "weights": len(names), "rel_error_mean": round(float(np.mean(errors)), 5),
            "head": params.head, "untied": untied, "simulated": True}  # fmt: skip
