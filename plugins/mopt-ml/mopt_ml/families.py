"""Model families: how to load, pool, export and sanitize a model of one architecture.

The interface a family offers the targets of this plugin (`EmbeddingFamily`) is small:

- `load(path, dtype=None, attn_implementation=None)` → the base transformers model, eval mode
- `load_tokenizer(path)` → a fast tokenizer with the family's quirks fixed (`sanitize_tokenizer`)
- `forward(model, input_ids, attention_mask)` → last hidden states [batch, seq, hidden]
- `pool(last_hidden, attention_mask)` → pooled embeddings [batch, hidden] (not normalised)
- `embed(model, tokenizer, texts, max_length=..., batch_size=...)` → L2-normalised float32 numpy
- `export_wrapper(model)` → an `nn.Module` mapping (input_ids, attention_mask) to pooled,
  L2-normalised embeddings: what the ONNX exporter traces
- `sanitize_config(config, tokenizer)` → (fixed config dict, notes of what changed)
- `synthetic_config(overrides, vocab_size)` / `synthetic_tokenizer(texts)` → a small random
  model of the family's real architecture, for the `synthetic` source

torch and transformers are imported inside the methods, never at module import.
A third-party family subclasses `EmbeddingFamily` and overrides what differs (usually
`model_types`, `pool`, `synthetic_config` and `synthetic_tokenizer`).
"""

from __future__ import annotations

import itertools
import json
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from mopt.api import Family

if TYPE_CHECKING:
    import numpy as np

DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


def quiet_transformers() -> None:
    """No progress bars or load-report tables on stdout: targets log what matters."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def torch_dtype(name: str | None) -> Any:
    """torch dtype for "fp32" / "fp16" / "bf16" (None → None)."""
    import torch

    if name is None:
        return None
    return getattr(torch, DTYPES[name])


class EmbeddingFamily(Family):
    """Base class of the embedding families: mean pooling unless a subclass says otherwise."""

    #: transformers `model_type`s this family handles (used to guess a model's family)
    model_types: ClassVar[tuple[str, ...]] = ()
    #: transformers attention implementation used for export and reference runs
    attn_implementation: ClassVar[str] = "eager"
    #: the tokenizer's padding side to use when a checkpoint does not say
    default_padding_side: ClassVar[str] = "right"

    # ------------------------------------------------------------------ loading

    def load(self, path: Path | str, dtype: str | None = None, attn_implementation: str | None = None) -> Any:
        """The base model (no task head) from an HF-format folder, in eval mode."""
        from transformers import AutoModel

        quiet_transformers()
        kwargs: dict[str, Any] = {
            "attn_implementation": attn_implementation or self.attn_implementation,
        }
        if dtype is not None:
            kwargs["dtype"] = torch_dtype(dtype)
        model = AutoModel.from_pretrained(str(path), **kwargs)
        return model.eval()

    def load_tokenizer(self, path: Path | str) -> Any:
        """The fast tokenizer of a folder, with `sanitize_tokenizer` applied."""
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(path))
        if not getattr(tok, "is_fast", False):
            raise ValueError(
                f"the tokenizer in {path} has no fast (Rust) implementation; "
                "save a tokenizer.json with transformers first"
            )
        self.sanitize_tokenizer(tok)
        return tok

    def sanitize_tokenizer(self, tokenizer: Any) -> list[str]:
        """Fix the family's tokenizer quirks in place; return notes of what changed."""
        notes = []
        if tokenizer.pad_token is None:
            for cand in (tokenizer.eos_token, tokenizer.unk_token, tokenizer.sep_token):
                if cand is not None:
                    tokenizer.pad_token = cand
                    notes.append(f"tokenizer had no pad token: set to {cand!r}")
                    break
            else:
                raise ValueError("tokenizer has no pad, eos, unk or sep token to pad with")
        return notes

    def sanitize_config(self, config: dict[str, Any], tokenizer: Any) -> tuple[dict[str, Any], list[str]]:
        """Normalise a config dict: missing `pad_token_id` from the tokenizer, training-only
        switches off. Returns the new dict and notes of what changed."""
        cfg = dict(config)
        notes: list[str] = []
        if cfg.get("pad_token_id") is None and tokenizer.pad_token_id is not None:
            cfg["pad_token_id"] = int(tokenizer.pad_token_id)
            notes.append(f"pad_token_id was missing: set to {tokenizer.pad_token_id} from the tokenizer")
        for key in ("gradient_checkpointing",):
            if key in cfg:
                del cfg[key]
                notes.append(f"dropped training-only key {key!r}")
        if cfg.get("use_cache"):
            cfg["use_cache"] = False
            notes.append("use_cache set to false (embedding models keep no KV cache)")
        return cfg, notes

    # ------------------------------------------------------------------ compute

    def forward(self, model: Any, input_ids: Any, attention_mask: Any) -> Any:
        """Last hidden states of the base model."""
        return model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    def pool(self, last_hidden: Any, attention_mask: Any) -> Any:
        """Mean over the positions the attention mask keeps."""
        mask = attention_mask.unsqueeze(-1).to(last_hidden.dtype)
        summed = (last_hidden * mask).sum(dim=1)
        count = mask.sum(dim=1).clamp(min=1e-9)
        return summed / count

    def embed_batch(self, model: Any, input_ids: Any, attention_mask: Any) -> Any:
        """Pooled, L2-normalised embeddings for one tokenised batch (torch tensors)."""
        import torch

        hidden = self.forward(model, input_ids, attention_mask)
        pooled = self.pool(hidden, attention_mask).float()
        return torch.nn.functional.normalize(pooled, p=2.0, dim=-1)

    def embed(
        self,
        model: Any,
        tokenizer: Any,
        texts: Sequence[str],
        max_length: int = 128,
        batch_size: int = 32,
        pad_to: int | None = None,
    ) -> np.ndarray:
        """L2-normalised float32 embeddings [len(texts), hidden] computed with PyTorch."""
        import numpy as np
        import torch

        from mopt_ml.common import tokenize

        out = []
        with torch.inference_mode():
            for i in range(0, len(texts), batch_size):
                feeds = tokenize(tokenizer, texts[i : i + batch_size], max_length, pad_to)
                ids = torch.from_numpy(feeds["input_ids"])
                mask = torch.from_numpy(feeds["attention_mask"])
                out.append(self.embed_batch(model, ids, mask).numpy())
        return np.concatenate(out).astype(np.float32)

    def export_wrapper(self, model: Any) -> Any:
        """An nn.Module: (input_ids, attention_mask) → pooled, normalised embeddings."""
        import torch

        family = self

        class EmbeddingWrapper(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.model = model

            def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
                return family.embed_batch(self.model, input_ids, attention_mask)

        return EmbeddingWrapper().eval()

    # ------------------------------------------------------------------ synthetic models

    #: default config of a synthetic model (overridden by the source's `config` table)
    synthetic_defaults: ClassVar[dict[str, Any]] = {}

    def config_class(self) -> Any:
        raise NotImplementedError(f"family {self.name!r} cannot build synthetic models")

    def synthetic_config(self, overrides: dict[str, Any], vocab_size: int) -> Any:
        """The family's real transformers config, small, with `overrides` applied."""
        values = {**self.synthetic_defaults, "vocab_size": vocab_size, **overrides}
        if values["vocab_size"] < vocab_size:
            raise ValueError(
                f"config.vocab_size={values['vocab_size']} is smaller than the synthetic "
                f"tokenizer's vocabulary ({vocab_size})"
            )
        cfg = self.config_class()(**values)
        return cfg

    def synthetic_tokenizer(self, texts: Sequence[str]) -> Any:
        raise NotImplementedError(f"family {self.name!r} cannot build synthetic tokenizers")


class Qwen3Family(EmbeddingFamily):
    """Qwen3 / Qwen3-Embedding: decoder-only, causal attention, last-token pooling.

    Left and right padding give the same embedding: position ids are computed from the
    attention mask (so the first real token is always position 0) and pooling takes, per row,
    the last position the mask keeps.
    """

    name = "qwen3"
    description = "Qwen3 / Qwen3-Embedding (last-token pooling, left or right padding)"
    architectures = ("Qwen3Model", "Qwen3ForCausalLM")
    model_types = ("qwen3",)
    pooling = "last-token"
    default_padding_side = "left"
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

    def synthetic_config(self, overrides: dict[str, Any], vocab_size: int) -> Any:
        values = dict(overrides)
        cfg = super().synthetic_config(values, vocab_size)
        cfg.architectures = ["Qwen3Model"]
        return cfg

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

    def synthetic_tokenizer(self, texts: Sequence[str]) -> Any:
        """A byte-level BPE tokenizer (Qwen's scheme) with merges learnt from `texts`,
        deterministically; appends <|endoftext|> like Qwen3-Embedding; left padding."""
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
        from transformers import PreTrainedTokenizerFast

        specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
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


class BertFamily(EmbeddingFamily):
    """BERT-style encoders (all-MiniLM-L6-v2, ...): mean pooling over the mask, then L2."""

    name = "bert"
    description = "BERT encoders, e.g. all-MiniLM-L6-v2 (mean pooling, L2-normalised)"
    architectures = ("BertModel",)
    model_types = ("bert",)
    pooling = "mean"
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
        cfg.architectures = ["BertModel"]
        cfg.pad_token_id = 0
        return cfg

    def synthetic_tokenizer(self, texts: Sequence[str]) -> Any:
        """A lower-casing WordPiece tokenizer whose vocabulary (every character, and the
        most frequent words of `texts`) is chosen deterministically."""
        from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
        from transformers import PreTrainedTokenizerFast

        specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
        norm = normalizers.BertNormalizer(lowercase=True, strip_accents=True, clean_text=True)
        pre = pre_tokenizers.BertPreTokenizer()
        words: Counter[str] = Counter()
        for text in texts:
            words.update(w for w, _ in pre.pre_tokenize_str(norm.normalize_str(text)))
        chars = sorted({c for w in words for c in w})
        frequent = [w for w, _ in sorted(words.items(), key=lambda kv: (-kv[1], kv[0])) if len(w) > 1]
        vocab: dict[str, int] = {}
        for tok in specials + chars + ["##" + c for c in chars] + frequent[:600]:
            vocab.setdefault(tok, len(vocab))
        tk = Tokenizer(models.WordPiece(vocab=vocab, unk_token="[UNK]", max_input_chars_per_word=100))
        tk.normalizer = norm
        tk.pre_tokenizer = pre
        tk.decoder = decoders.WordPiece()
        tk.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]",
            pair="[CLS] $A [SEP] $B:1 [SEP]:1",
            special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])],
        )
        return PreTrainedTokenizerFast(
            tokenizer_object=tk,
            unk_token="[UNK]",
            pad_token="[PAD]",
            cls_token="[CLS]",
            sep_token="[SEP]",
            mask_token="[MASK]",
            padding_side="right",
            model_max_length=512,
        )


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
FAMILIES: dict[str, type[EmbeddingFamily]] = {f.name: f for f in (Qwen3Family, BertFamily)}


def family_for_folder(folder: Path) -> EmbeddingFamily:
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


def as_family(family: Any, folder: Path | None = None) -> EmbeddingFamily:
    """The family object a target works with: the context's family (class or instance),
    or one guessed from `folder`'s config. It must offer the EmbeddingFamily interface."""
    if family is None:
        if folder is None:
            raise ValueError("no model family given and no folder to guess it from")
        return family_for_folder(folder)
    if isinstance(family, type):
        family = family()
    needed = ("load", "load_tokenizer", "embed", "export_wrapper", "sanitize_config")
    missing = [m for m in needed if not callable(getattr(family, m, None))]
    if missing:
        raise TypeError(
            f"family {getattr(family, 'name', family)!r} lacks {', '.join(missing)}: "
            "mopt-ml targets need a mopt_ml.families.EmbeddingFamily (subclass it)"
        )
    return family  # type: ignore[no-any-return]
