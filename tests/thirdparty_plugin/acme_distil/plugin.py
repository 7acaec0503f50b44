"""What a third party adds to mopt, through `mopt.api` alone (the test of the plugin API):

* `distilbert`: a family of an architecture mopt does not ship. It is a Hugging Face
  AutoModel encoder, so `TransformersFamily` does the loading, pooling, export and synthetic
  tokenizer; the family only says its shape (an encoder) and its config's key names.
* `distill`: a kind that keeps the first `layers` transformer layers of a checkpoint. It
  produces an `hf-checkpoint`, so mopt-ml's `onnx`, `validate`, `bench` and `select` take it
  like the `weights` kind's output.
* `nvidia-l4`: a hardware profile.
* `gpt2`: a causal-LM family (text-generation) of an architecture mopt does not ship: GPT-2's
  shape, its config's names and a byte-level BPE synthetic tokenizer (docs/plugins.md,
  *Causal language models*).
* `jetson-orin-nano`: a profile whose GPU shares its memory with the CPU.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from typing import Any, ClassVar

from pydantic import Field

from mopt.api import (
    TEXT_GENERATION,
    BuildContext,
    HardwareProfile,
    Input,
    Params,
    TargetKind,
    TransformersFamily,
    hookimpl,
)


class DistilBertFamily(TransformersFamily):
    """DistilBERT encoders: mean pooling over the mask, L2-normalised."""

    name = "distilbert"
    description = "DistilBERT encoders (mean pooling, L2-normalised)"
    architectures = ("DistilBertModel",)
    model_types = ("distilbert",)
    pooling = "mean"
    encoder = True
    # DistilBertConfig's own names for what the estimator reads
    config_keys: ClassVar[dict[str, tuple[str, ...]]] = {
        "hidden": ("dim",),
        "layers": ("n_layers",),
        "heads": ("n_heads",),
        "intermediate": ("hidden_dim",),
    }
    synthetic_defaults: ClassVar[dict[str, Any]] = {
        "dim": 64,
        "hidden_dim": 128,
        "n_layers": 3,
        "n_heads": 4,
        "max_position_embeddings": 128,
        "initializer_range": 0.02,
        "pad_token_id": 0,
        "vocab_size": 1024,  # over the synthetic tokenizer's ~700: `mopt check` and the build agree
    }


class Gpt2Family(TransformersFamily):
    """GPT-2 causal LMs. TransformersFamily loads them (`AutoModelForCausalLM` for
    text-generation) and exports the KV-cache graph; the family gives the shape (a plain MLP,
    biased attention), and a byte-level BPE synthetic tokenizer with a chat template."""

    name = "gpt2"
    description = "GPT-2 causal LMs (text-generation)"
    architectures = ("GPT2LMHeadModel",)
    model_types = ("gpt2",)
    tasks = (TEXT_GENERATION,)
    pooling = "last-token"
    gated_mlp = False  # fc → GELU → proj
    attention_bias = True
    # n_embd / n_layer / n_head / n_positions are among the names mopt reads already; GPT2Config
    # says bos = eos = 50256: the synthetic tokenizer's <|endoftext|> is id 0
    synthetic_defaults: ClassVar[dict[str, Any]] = {
        "n_embd": 64,
        "n_layer": 2,
        "n_head": 4,
        "n_positions": 256,
        "vocab_size": 512,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "pad_token_id": 0,
    }

    def synthetic_tokenizer(self, texts: Any, *, task: str = TEXT_GENERATION) -> Any:
        """Byte-level BPE learnt from `texts` by tokenizers' trainer (deterministic for the
        same texts): every byte spells, so any generated text decodes."""
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
        from transformers import PreTrainedTokenizerFast

        tk = Tokenizer(models.BPE())
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tk.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
        trainer = trainers.BpeTrainer(
            vocab_size=400, special_tokens=["<|endoftext|>"], initial_alphabet=alphabet, show_progress=False
        )
        tk.train_from_iterator(texts, trainer)
        tok = PreTrainedTokenizerFast(
            tokenizer_object=tk, eos_token="<|endoftext|>", pad_token="<|endoftext|>", padding_side="left"
        )
        tok.chat_template = (
            "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}<|endoftext|>{% endfor %}"
            "{% if add_generation_prompt %}assistant: {% endif %}"
        )
        return tok


_LAYER = re.compile(r"^transformer\.layer\.(\d+)\.")


class DistillKind(TargetKind):
    """Keep the first `layers` transformer layers of a DistilBERT checkpoint (a toy
    distillation: no training), with its config and tokenizer."""

    name = "distill"
    version = "1"
    description = "the first N transformer layers of a checkpoint"
    produces = "hf-checkpoint"
    consumes = (Input("model", formats=("hf-checkpoint",)),)
    fingerprint_packages = ("safetensors", "torch")

    class Params(Params):
        layers: int = Field(default=1, ge=1, description="transformer layers to keep")

    def run(self, ctx: BuildContext) -> dict[str, Any]:
        from safetensors.torch import load_file, save_file

        src = ctx.input("model").path
        cfg = json.loads((src / "config.json").read_text())
        have = int(cfg["n_layers"])
        keep = min(ctx.params.layers, have)
        tensors = {}
        for f in sorted(src.glob("*.safetensors")):
            for name, t in load_file(str(f)).items():
                m = _LAYER.match(name)
                if m is None or int(m.group(1)) < keep:
                    tensors[name] = t
        save_file(tensors, str(ctx.out / "model.safetensors"), metadata={"format": "pt"})
        cfg["n_layers"] = keep
        (ctx.out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        for f in sorted(src.iterdir()):
            if f.is_file() and f.name.startswith(("tokenizer", "special_tokens", "vocab")):
                shutil.copyfile(f, ctx.out / f.name)
        ctx.log(f"kept {keep} of {have} layers: {len(tensors)} tensors")
        return {"layers": keep, "of": have, "tensors": len(tensors)}


# NVIDIA L4 data sheet (https://www.nvidia.com/en-us/data-center/l4/): Ada AD104, 24 GB GDDR6
# at 300 GB/s, FP16 tensor 121 TFLOPS dense (242 with sparsity), compute capability 8.9
# (https://developer.nvidia.com/cuda-gpus). 7,424 CUDA cores at 128 per Ada SM = 58 SMs
# (some spec databases list the full AD104's 60).
NVIDIA_L4 = HardwareProfile(
    name="nvidia-l4",
    description="NVIDIA L4 (Ada, AD104), 72 W inference card",
    gpu_name="NVIDIA L4",
    compute_capability=(8, 9),
    memory_gb=24,
    bandwidth_gbps=300,
    sm_count=58,
    fp16_tflops=121,
    source="https://www.nvidia.com/en-us/data-center/l4/",
)


# Jetson Orin Nano 8GB module data sheet (https://developer.nvidia.com/embedded/jetson-modules):
# Ampere GPU of 1,024 CUDA cores (8 SMs), 8 GB LPDDR5 at 68 GB/s shared by CPU and GPU; compute
# capability 8.7 (https://developer.nvidia.com/cuda-gpus). No gpu_name: a Jetson has no nvidia-smi.
JETSON_ORIN_NANO = HardwareProfile(
    name="jetson-orin-nano",
    description="NVIDIA Jetson Orin Nano 8GB (Ampere, memory shared with the CPU)",
    compute_capability=(8, 7),
    memory_gb=8,
    bandwidth_gbps=68,
    sm_count=8,
    shared_memory=True,
    source="https://developer.nvidia.com/embedded/jetson-modules",
)


@hookimpl
def mopt_register_families(register: Callable[[Any], None]) -> None:
    """distilbert, gpt2."""
    register(DistilBertFamily)
    register(Gpt2Family)


@hookimpl
def mopt_register_targets(register: Callable[[Any], None]) -> None:
    """distill."""
    register(DistillKind)


@hookimpl
def mopt_register_hardware(register: Callable[[Any], None]) -> None:
    """nvidia-l4, jetson-orin-nano."""
    register(NVIDIA_L4)
    register(JETSON_ORIN_NANO)
