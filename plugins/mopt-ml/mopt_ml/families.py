"""Model families of this plugin: qwen3 and bert, on the core's family contract.

The contract (`mopt.api.Family`: dims for the estimator; load, tokenizer, pooling, export
spec, sanitizing and synthetic models for the kinds) is the core's, and its Hugging Face
implementation (`mopt.api.TransformersFamily`: AutoModel, mean pooling, WordPiece synthetic
tokenizers) too, so a third-party family needs nothing from this plugin: every kind here
works with any registered family that implements the contract. `EmbeddingFamily` is that
base under its old name.

torch and transformers are imported inside the methods, never at module import.
"""

from __future__ import annotations

import itertools
import json
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

from mopt.api import (
    DTYPES,
    EMBEDDING,
    TEXT_GENERATION,
    Family,
    TransformersFamily,
    quiet_transformers,
    torch_dtype,
)

__all__ = ["DTYPES", "FAMILIES", "BertFamily", "EmbeddingFamily", "Qwen3Family", "as_family",
           "quiet_transformers", "task_kwargs", "torch_dtype"]  # fmt: skip

#: the base of the embedding families (the core's Hugging Face family)
EmbeddingFamily = TransformersFamily

#: Qwen3's chat format for plain conversations (the real template also renders tools and
#: strips earlier turns' reasoning; a plain system / user / assistant conversation renders
#: the same): `<|im_start|>role\ncontent<|im_end|>\n` per message, then the assistant's
#: header; `enable_thinking=false` adds Qwen3's empty think block
QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\n\n</think>\n\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)
#: Qwen3's special tokens, in the real vocabulary's order (ids follow the learnt merges)
QWEN3_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
QWEN3_CHAT_SPECIALS = (*QWEN3_SPECIALS, "<think>", "</think>")


def task_kwargs(task: str) -> dict[str, str]:
    """`task=` for a family method, omitted for embedding (families written before tasks
    existed take no `task` keyword in their synthetic / sanitize overrides)."""
    return {} if task == EMBEDDING else {"task": task}


class Qwen3Family(TransformersFamily):
    """Qwen3 / Qwen3-Embedding: decoder-only, causal attention, last-token pooling; and
    Qwen3 chat models (task text-generation: `Qwen3ForCausalLM`, KV-cache export, a chat
    template).

    Left and right padding give the same embedding: position ids are computed from the
    attention mask (so the first real token is always position 0) and pooling takes, per row,
    the last position the mask keeps.
    """

    name = "qwen3"
    description = "Qwen3 / Qwen3-Embedding (last-token pooling, left or right padding); Qwen3 chat LMs"
    architectures = ("Qwen3Model", "Qwen3ForCausalLM")
    model_types = ("qwen3",)
    tasks = (EMBEDDING, TEXT_GENERATION)
    pooling = "last-token"
    default_padding_side = "left"
    qk_norm = True  # estimator: gated MLP (the default) and per-head q/k RMSNorm
    synthetic_defaults: ClassVar[dict[str, Any]] = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        "use_cache": False,
        "initializer_range": 0.02,
    }

    def config_class(self) -> Any:
        from transformers import Qwen3Config

        return Qwen3Config

    def synthetic_config(self, overrides: dict[str, Any], vocab_size: int, *, task: str = EMBEDDING) -> Any:
        values = dict(overrides)
        if task == TEXT_GENERATION:
            values.setdefault("use_cache", True)
            # initializer_range stays Qwen3's own 0.02 (synthetic_defaults) unless the recipe's
            # config sets it: the accuracy gates read distributions (KL), whose size a random
            # model's flat logits make small, not argmaxes (docs/recipes.md)
        cfg = super().synthetic_config(values, vocab_size)
        cfg.architectures = ["Qwen3ForCausalLM" if task == TEXT_GENERATION else "Qwen3Model"]
        return cfg

    def generation_ids(self, tokenizer: Any) -> dict[str, Any]:
        """Qwen3's generation ids: bos and pad <|endoftext|>, eos <|im_end|> then
        <|endoftext|> (generation_config.json of Qwen3-0.6B: 151643 / [151645, 151643])."""
        end = tokenizer.convert_tokens_to_ids("<|endoftext|>")
        im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        return {"bos_token_id": end, "eos_token_id": [im_end, end], "pad_token_id": end}

    def sanitize_tokenizer(self, tokenizer: Any) -> list[str]:
        notes = []
        if tokenizer.pad_token is None:
            for cand in ("<|endoftext|>", tokenizer.eos_token):
                if cand is not None and tokenizer.convert_tokens_to_ids(cand) is not None:
                    tokenizer.pad_token = cand
                    notes.append(f"tokenizer had no pad token: set to {cand!r}")
                    break
        notes += super().sanitize_tokenizer(tokenizer)
        return notes

    def forward(self, model: Any, input_ids: Any, attention_mask: Any) -> Any:
        # positions count real tokens only, so left padding does not shift them
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
        return out.last_hidden_state

    def pool(self, last_hidden: Any, attention_mask: Any) -> Any:
        """The hidden state at the last position the mask keeps, per row (works for left
        and right padding, without a data-dependent branch, so it exports)."""
        import torch

        seq = attention_mask.shape[1]
        positions = torch.arange(seq, device=attention_mask.device).unsqueeze(0)
        last = (attention_mask.long() * positions).argmax(dim=1)
        index = last.view(-1, 1, 1).expand(-1, 1, last_hidden.shape[-1])
        return torch.gather(last_hidden, 1, index).squeeze(1)

    def synthetic_tokenizer(self, texts: Sequence[str], *, task: str = EMBEDDING) -> Any:
        """A byte-level BPE tokenizer (Qwen's scheme) with merges learnt from `texts`,
        deterministically; appends <|endoftext|> like Qwen3-Embedding; left padding.

        For text-generation it is the chat tokenizer of Qwen3: nothing appended, eos
        <|im_end|>, pad <|endoftext|>, <think> / </think> added, and Qwen3's chat template."""
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
        from transformers import PreTrainedTokenizerFast

        chat = task == TEXT_GENERATION
        specials = list(QWEN3_CHAT_SPECIALS if chat else QWEN3_SPECIALS)
        pre = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
        words: Counter[str] = Counter()
        for text in texts:
            words.update(w for w, _ in pre.pre_tokenize_str(text))
        merges = _learn_bpe(words, num_merges=256)
        vocab: dict[str, int] = {}
        for tok in alphabet + ["".join(m) for m in merges]:
            vocab.setdefault(tok, len(vocab))
        for tok in specials:
            vocab[tok] = len(vocab)
        tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
        tk.pre_tokenizer = pre
        tk.decoder = decoders.ByteLevel()
        tk.add_special_tokens(specials)
        if chat:
            tok = PreTrainedTokenizerFast(
                tokenizer_object=tk,
                eos_token="<|im_end|>",
                pad_token="<|endoftext|>",
                padding_side="left",
                model_max_length=512,
            )
            tok.chat_template = QWEN3_CHAT_TEMPLATE
            return tok
        eos = vocab["<|endoftext|>"]
        tk.post_processor = processors.TemplateProcessing(
            single="$A <|endoftext|>",
            pair="$A <|endoftext|> $B <|endoftext|>",
            special_tokens=[("<|endoftext|>", eos)],
        )
        return PreTrainedTokenizerFast(
            tokenizer_object=tk,
            eos_token="<|endoftext|>",
            pad_token="<|endoftext|>",
            padding_side="left",
            model_max_length=512,
        )


class BertFamily(TransformersFamily):
    """BERT-style encoders (all-MiniLM-L6-v2, ...): mean pooling over the mask, then L2; the
    base class's WordPiece synthetic tokenizer."""

    name = "bert"
    description = "BERT encoders, e.g. all-MiniLM-L6-v2 (mean pooling, L2-normalised)"
    architectures = ("BertModel",)
    model_types = ("bert",)
    pooling = "mean"
    encoder = True
    pooler_architectures = ("BertModel",)
    synthetic_defaults: ClassVar[dict[str, Any]] = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 512,
        "type_vocab_size": 2,
        "initializer_range": 0.02,
        "use_cache": False,
    }

    def config_class(self) -> Any:
        from transformers import BertConfig

        return BertConfig

    def synthetic_config(self, overrides: dict[str, Any], vocab_size: int) -> Any:
        cfg = super().synthetic_config(dict(overrides), vocab_size)
        cfg.pad_token_id = 0
        return cfg


def _learn_bpe(words: Counter[str], num_merges: int) -> list[tuple[str, str]]:
    """Plain BPE on a word histogram; ties go to the lexicographically smallest pair, so
    the merges depend only on `words`."""
    corpus = {tuple(w): c for w, c in sorted(words.items())}
    merges: list[tuple[str, str]] = []
    for _ in range(num_merges):
        pairs: Counter[tuple[str, str]] = Counter()
        for symbols, count in corpus.items():
            for a, b in itertools.pairwise(symbols):
                pairs[(a, b)] += count
        if not pairs:
            break
        best = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))[0]
        if pairs[best] < 2:
            break
        merges.append(best)
        merged = best[0] + best[1]
        new_corpus: dict[tuple[str, ...], int] = {}
        for symbols, count in corpus.items():
            out: list[str] = []
            i = 0
            while i < len(symbols):
                if i + 1 < len(symbols) and symbols[i] == best[0] and symbols[i + 1] == best[1]:
                    out.append(merged)
                    i += 2
                else:
                    out.append(symbols[i])
                    i += 1
            key = tuple(out)
            new_corpus[key] = new_corpus.get(key, 0) + count
        corpus = new_corpus
    return merges


#: the families this plugin registers, by name
FAMILIES: dict[str, type[TransformersFamily]] = {f.name: f for f in (Qwen3Family, BertFamily)}


def family_for_folder(folder: Path) -> TransformersFamily:
    """Guess a folder's family from its config.json `model_type` / `architectures`."""
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise ValueError(f"{folder} has no config.json: cannot tell the model family")
    cfg = json.loads(cfg_path.read_text())
    mtype = cfg.get("model_type")
    archs = set(cfg.get("architectures") or [])
    for fam in FAMILIES.values():
        if mtype in fam.model_types or archs & set(fam.architectures):
            return fam()
    raise ValueError(
        f"no mopt-ml family handles model_type {mtype!r} (architectures {sorted(archs)}); "
        f"known: {', '.join(sorted(FAMILIES))}"
    )


#: what the kinds of this plugin call on a family (the embedding part of the contract)
NEEDED = ("load", "load_tokenizer", "pool", "export_spec")
#: what they call for text-generation (no pooling: logits and a KV cache)
NEEDED_GENERATION = ("load", "load_tokenizer", "export_spec")
#: what the `synthetic` source calls
SYNTHETIC = ("synthetic_config", "synthetic_tokenizer")
#: helpers the kinds use beyond the contract; TransformersFamily has them
HELPERS = ("embed", "embed_batch", "sanitize_tokenizer", "sanitize_config")


def as_family(
    family: Any, folder: Path | None = None, task: str = "embedding", needs: Sequence[str] = NEEDED
) -> Any:
    """The family object a target works with: the context's family (class or instance),
    or one guessed from `folder`'s config. It must implement `needs` of the contract for `task`."""
    if family is None:
        if folder is None:
            raise ValueError("no model family given and no folder to guess it from")
        return family_for_folder(folder)
    if isinstance(family, type):
        family = family()
    name = getattr(family, "name", family)
    if not isinstance(family, Family):
        raise TypeError(
            f"family {name!r} is not a mopt.api.Family: subclass mopt.api.TransformersFamily "
            "(a Hugging Face AutoModel family) or mopt.api.Family"
        )
    if not family.supports(task):
        raise ValueError(f"family {name!r} has no task {task!r} (it supports {', '.join(family.tasks)})")
    if task == TEXT_GENERATION and needs is NEEDED:
        needs = NEEDED_GENERATION
    stubs = [m for m in needs if getattr(type(family), m, None) is getattr(Family, m)]
    helpers = [m for m in HELPERS if needs is NEEDED and not callable(getattr(family, m, None))]
    if stubs or helpers:
        what = [f"{', '.join(stubs)} of the mopt.api.Family contract"] if stubs else []
        what += [f"{', '.join(helpers)} (TransformersFamily's helpers)"] if helpers else []
        raise TypeError(
            f"family {name!r} does not implement {' and '.join(what)}, which mopt-ml's kinds call; "
            "subclass mopt.api.TransformersFamily, which implements them for a Hugging Face "
            "AutoModel architecture"
        )
    return family
