"""The model-family contract: what a family tells mopt about an architecture (plugins import
`mopt.api.Family` / `mopt.api.TransformersFamily`; docs/plugins.md, "Model families").

Methods that depend on the task take it (`task=`, "embedding" by default): a new task is a new
branch of the same methods, not a second family. torch, transformers and tokenizers are
imported inside the methods, never at import.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from mopt.estimate import ConfigError, ModelDims, normalize_precision

#: the task every first-party ML kind builds for
EMBEDDING = "embedding"
#: causal language modelling with a KV cache (chat models)
TEXT_GENERATION = "text-generation"
#: why a WordPiece tokenizer is refused for text-generation
NO_WORDPIECE = ("it lower-cases, wraps text in [CLS] ... [SEP] and cannot spell every byte, so generated text does "
                "not round-trip; a causal LM needs a byte-level BPE one (docs/plugins.md, *Causal language models*)")
#: transformers dtype names of mopt's precision names
DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}

#: ModelDims field → the config.json keys it is read from, first present wins. A family
#: whose config names them differently adds its names in `config_keys` (they are tried first).
DEFAULT_CONFIG_KEYS: dict[str, tuple[str, ...]] = {
    "hidden": ("hidden_size", "d_model", "n_embd"),
    "layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "heads": ("num_attention_heads", "n_head"),
    "kv_heads": ("num_key_value_heads",),
    "head_dim": ("head_dim",),
    "vocab": ("vocab_size",),
    "intermediate": ("intermediate_size", "n_inner"),
    "max_position": ("max_position_embeddings", "n_positions"),
    "type_vocab": ("type_vocab_size",),
}


@dataclass(frozen=True)
class ExportSpec:
    """What the ONNX exporter traces for a task: `wrapper(*inputs) -> outputs`.

    `inputs` are the graph's input names in call order (int64 tensors the tokenizer gives),
    `outputs` its output names, `dynamic_axes` per name the axes that vary
    ({0: "batch", 1: "sequence"}); `check` says how the export is verified ("embedding":
    cosine of the outputs against PyTorch on the validation sentences; "text-generation":
    logits against PyTorch, prefill and a decode step with past).

    For text-generation, `kv_cache` is {"layers", "kv_heads", "head_dim"}: the wrapper takes
    (input_ids, attention_mask, position_ids, *past) with past = key, value per layer
    [batch, kv_heads, past_sequence, head_dim], and returns (logits, *present) in the same
    order; `generation_graph_names(layers)` gives the names.
    """

    wrapper: Any
    inputs: tuple[str, ...] = ("input_ids", "attention_mask")
    outputs: tuple[str, ...] = ("mopt_embedding",)
    dynamic_axes: Mapping[str, Mapping[int, str]] = field(
        default_factory=lambda: {
            "input_ids": {0: "batch", 1: "sequence"},
            "attention_mask": {0: "batch", 1: "sequence"},
            "mopt_embedding": {0: "batch"},
        }
    )
    check: str = EMBEDDING
    kv_cache: Mapping[str, int] | None = None


def generation_graph_names(layers: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Input and output names of a text-generation graph with `layers` layers of KV cache
    (the Optimum / ONNX Runtime GenAI naming)."""
    past = tuple(f"past_key_values.{i}.{kv}" for i in range(layers) for kv in ("key", "value"))
    present = tuple(n.replace("past_key_values.", "present.", 1) for n in past)
    return ("input_ids", "attention_mask", "position_ids", *past), ("logits", *present)


def generation_dynamic_axes(layers: int) -> dict[str, dict[int, str]]:
    """The dynamic axes of a text-generation graph's inputs and outputs."""
    inputs, outputs = generation_graph_names(layers)
    axes: dict[str, dict[int, str]] = {
        "input_ids": {0: "batch", 1: "sequence"},
        "attention_mask": {0: "batch", 1: "total_sequence"},
        "position_ids": {0: "batch", 1: "sequence"},
        "logits": {0: "batch", 1: "sequence"},
    }
    for name in inputs[3:]:
        axes[name] = {0: "batch", 2: "past_sequence"}
    for name in outputs[1:]:
        axes[name] = {0: "batch", 2: "total_sequence"}
    return axes


class Family:
    """A model family: subclass, set the class attributes, override what differs.

    The light part (used by `mopt check`, `plan`, the graph) is the class attributes and
    `dims(config)`; the heavy part (used by the ML kinds when they run) is `load`,
    `load_tokenizer`, `pool`, `export_spec`, `sanitize_*` and `synthetic_*`.
    """

    name: ClassVar[str]
    description: ClassVar[str] = ""
    #: transformers architecture class names of its checkpoints ("BertModel", ...)
    architectures: ClassVar[tuple[str, ...]] = ()
    #: transformers `model_type`s it handles (used to guess a folder's family)
    model_types: ClassVar[tuple[str, ...]] = ()
    #: the tasks it can build for; recipes with another `task` are refused
    tasks: ClassVar[tuple[str, ...]] = (EMBEDDING,)
    #: how token states become one embedding: "last-token", "mean" or "cls"
    pooling: ClassVar[str] = "mean"

    # ------------------------------------------------------------------ shape (estimator)

    #: a bidirectional encoder (BERT-style: absolute positions, biases, LayerNorms, a
    #: two-matrix MLP) rather than a decoder
    encoder: ClassVar[bool] = False
    #: the decoder MLP is gated (gate, up, down: llama / qwen); ignored for encoders
    gated_mlp: ClassVar[bool] = True
    #: per-head RMSNorm on q and k (qwen3)
    qk_norm: ClassVar[bool] = False
    #: q/k/v projections carry biases when the config does not say (`attention_bias`)
    attention_bias: ClassVar[bool] = False
    #: checkpoints of these architectures carry an encoder pooler layer (BertModel)
    pooler_architectures: ClassVar[tuple[str, ...]] = ()
    #: extra config.json key names per ModelDims field, tried before DEFAULT_CONFIG_KEYS
    config_keys: ClassVar[Mapping[str, tuple[str, ...]]] = {}
    #: small default config of a `synthetic` model (the recipe's `config` overrides it);
    #: a plain dict so that `mopt check` can estimate a synthetic model without building it
    synthetic_defaults: ClassVar[dict[str, Any]] = {}

    def dims(self, config: Mapping[str, Any]) -> ModelDims:
        """The dimensions the memory estimator needs, from a config.json dict; raises
        `ConfigError` naming the missing keys. Reads the standard Hugging Face names (and
        `config_keys`), and the shape class from the attributes above."""
        cfg = dict(config)
        if isinstance(cfg.get("text_config"), Mapping):  # multimodal wrappers
            cfg = {**cfg, **cfg["text_config"]}

        def get(name: str) -> Any:
            for key in (*self.config_keys.get(name, ()), *DEFAULT_CONFIG_KEYS[name]):
                if cfg.get(key) is not None:
                    return cfg[key]
            return None

        required = {"hidden": "hidden_size", "layers": "num_hidden_layers", "heads": "num_attention_heads",
                    "vocab": "vocab_size"}  # fmt: skip
        values = {f: get(f) for f in required}
        missing = [
            self.config_keys.get(f, (key,))[0]
            for f, key in required.items()
            if not isinstance(values[f], int) or isinstance(values[f], bool) or values[f] <= 0
        ]
        if missing:
            raise ConfigError(missing)
        hidden, layers, heads, vocab = (int(values[f]) for f in required)
        encoder = self.encoder
        max_pos = get("max_position")
        rope = cfg.get("rope_scaling") or {}
        factor = rope.get("factor") if isinstance(rope, Mapping) else None
        orig = rope.get("original_max_position_embeddings") if isinstance(rope, Mapping) else None
        archs = cfg.get("architectures") or []
        return ModelDims(
            model_type=str(cfg.get("model_type") or getattr(self, "name", "") or "unknown"),
            layers=layers,
            hidden=hidden,
            intermediate=int(get("intermediate") or 4 * hidden),
            heads=heads,
            kv_heads=int(get("kv_heads") or heads),
            head_dim=int(get("head_dim") or hidden // heads),
            vocab=vocab,
            max_position=int(max_pos) if isinstance(max_pos, int) else None,
            tied=bool(cfg.get("tie_word_embeddings", encoder or not cfg.get("model_type"))),
            gated_mlp=self.gated_mlp and not encoder,
            encoder=encoder,
            attention_bias=bool(cfg.get("attention_bias", self.attention_bias or encoder)),
            qk_norm=self.qk_norm and not encoder,
            type_vocab=int(get("type_vocab") or 0) if encoder else 0,
            pooler=encoder and any(a in self.pooler_architectures for a in archs),
            config_dtype=normalize_precision(cfg.get("torch_dtype") or cfg.get("dtype")),
            rope_factor=float(factor) if isinstance(factor, (int, float)) else None,
            original_max_position=int(orig) if isinstance(orig, int) else None,
        )

    # ------------------------------------------------------------------ heavy part (kinds)

    def load(
        self, path: Path | str, *, task: str = EMBEDDING, dtype: str | None = None,
        attn_implementation: str | None = None,
    ) -> Any:  # fmt: skip
        """The model for `task` from an HF-format folder, in eval mode (`dtype`: fp32/fp16/bf16)."""
        raise self._missing("load")

    def load_tokenizer(self, path: Path | str, *, task: str = EMBEDDING) -> Any:
        """The fast tokenizer of a folder, with `sanitize_tokenizer` applied."""
        raise self._missing("load_tokenizer")

    def pool(self, last_hidden: Any, attention_mask: Any) -> Any:
        """Token states [batch, seq, hidden] → one vector per row (not normalised)."""
        raise self._missing("pool")

    def export_spec(self, model: Any, *, task: str = EMBEDDING) -> ExportSpec:
        """What the ONNX exporter traces for `task` (see `ExportSpec`)."""
        raise self._missing("export_spec")

    def sanitize_tokenizer(self, tokenizer: Any) -> list[str]:
        """Fix the family's tokenizer quirks in place; notes of what changed."""
        return []

    def sanitize_config(
        self, config: dict[str, Any], tokenizer: Any, *, task: str = EMBEDDING
    ) -> tuple[dict[str, Any], list[str]]:
        """Normalise a config.json dict; the new dict and notes of what changed."""
        return dict(config), []

    def synthetic_config(self, overrides: dict[str, Any], vocab_size: int, *, task: str = EMBEDDING) -> Any:
        """The family's real transformers config, small (`synthetic_defaults` under
        `overrides`), for a tokenizer of `vocab_size` tokens (text-generation: its causal-LM
        architecture). Callers pass `task` only when it is not embedding."""
        raise self._missing("synthetic_config")

    def synthetic_tokenizer(self, texts: Sequence[str], *, task: str = EMBEDDING) -> Any:
        """A small fast tokenizer of the family's scheme, learnt deterministically from `texts`
        (text-generation: with a chat template). Callers pass `task` only when it is not embedding."""
        raise self._missing("synthetic_tokenizer")

    def supports(self, task: str) -> bool:
        return task in self.tasks or "any" in self.tasks

    def _missing(self, method: str) -> NotImplementedError:
        return NotImplementedError(
            f"family {getattr(self, 'name', type(self).__name__)!r} does not implement {method}() "
            "(subclass mopt.api.TransformersFamily for a Hugging Face AutoModel architecture)"
        )


def model_dims(config: Mapping[str, Any], family: Any = None) -> ModelDims:
    """The dims of a config.json dict, as `family` (a `Family` class or instance) reads them;
    raise `ConfigError` naming the missing keys. The estimator has no knowledge of model
    types of its own: without a family, the config is read as `Family`'s defaults do (a
    decoder with a gated MLP, the larger of the usual cases)."""
    if family is None:
        family = Family
    fam = family() if isinstance(family, type) else family
    dims = fam.dims(config)
    if not isinstance(dims, ModelDims):
        raise TypeError(f"{type(fam).__name__}.dims() returned {type(dims).__name__}, not ModelDims")
    return dims


class TransformersFamily(Family):
    """A family of a Hugging Face `AutoModel` architecture, for the embedding task: mean
    pooling over the attention mask, L2-normalised; WordPiece synthetic tokenizers; the
    config class found by `AutoConfig.for_model(model_types[0])`. Override what differs."""

    #: transformers attention implementation for export and reference runs
    attn_implementation: ClassVar[str] = "eager"

    def load(
        self, path: Path | str, *, task: str = EMBEDDING, dtype: str | None = None,
        attn_implementation: str | None = None,
    ) -> Any:  # fmt: skip
        from transformers import AutoModel, AutoModelForCausalLM

        self._task(task)
        quiet_transformers()
        kwargs: dict[str, Any] = {"attn_implementation": attn_implementation or self.attn_implementation}
        if dtype is not None:
            kwargs["dtype"] = torch_dtype(dtype)
        auto = AutoModelForCausalLM if task == TEXT_GENERATION else AutoModel
        return auto.from_pretrained(str(path), **kwargs).eval()

    def load_tokenizer(self, path: Path | str, *, task: str = EMBEDDING) -> Any:
        from transformers import AutoTokenizer

        self._task(task)
        tok = AutoTokenizer.from_pretrained(str(path))
        if not getattr(tok, "is_fast", False):
            raise ValueError(
                f"the tokenizer in {path} has no fast (Rust) implementation; "
                "save a tokenizer.json with transformers first"
            )
        if task == TEXT_GENERATION and type(tok.backend_tokenizer.model).__name__ == "WordPiece":
            raise ValueError(f"the tokenizer in {path} is WordPiece: {NO_WORDPIECE}")
        self.sanitize_tokenizer(tok)
        return tok

    def sanitize_tokenizer(self, tokenizer: Any) -> list[str]:
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

    def sanitize_config(
        self, config: dict[str, Any], tokenizer: Any, *, task: str = EMBEDDING
    ) -> tuple[dict[str, Any], list[str]]:
        """Missing `pad_token_id` (and, for text-generation, `eos_token_id`) from the
        tokenizer; training-only switches off; `use_cache` off for embedding, on for
        text-generation."""
        cfg = dict(config)
        notes: list[str] = []
        if cfg.get("pad_token_id") is None and tokenizer.pad_token_id is not None:
            cfg["pad_token_id"] = int(tokenizer.pad_token_id)
            notes.append(f"pad_token_id was missing: set to {tokenizer.pad_token_id} from the tokenizer")
        if task == TEXT_GENERATION and cfg.get("eos_token_id") is None and tokenizer.eos_token_id is not None:
            cfg["eos_token_id"] = int(tokenizer.eos_token_id)
            notes.append(f"eos_token_id was missing: set to {tokenizer.eos_token_id} from the tokenizer")
        if "gradient_checkpointing" in cfg:
            del cfg["gradient_checkpointing"]
            notes.append("dropped training-only key 'gradient_checkpointing'")
        if task == TEXT_GENERATION:
            if cfg.get("use_cache") is False:
                cfg["use_cache"] = True
                notes.append("use_cache set to true (generation keeps a KV cache)")
        elif cfg.get("use_cache"):
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
        return (last_hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)

    def embed_batch(self, model: Any, input_ids: Any, attention_mask: Any) -> Any:
        """Pooled, L2-normalised embeddings of one tokenised batch (torch tensors)."""
        import torch

        pooled = self.pool(self.forward(model, input_ids, attention_mask), attention_mask).float()
        return torch.nn.functional.normalize(pooled, p=2.0, dim=-1)

    def embed(
        self, model: Any, tokenizer: Any, texts: Sequence[str], max_length: int = 128,
        batch_size: int = 32, pad_to: int | None = None,
    ) -> Any:  # fmt: skip
        """L2-normalised float32 numpy embeddings [len(texts), hidden], computed with PyTorch."""
        import numpy as np
        import torch

        out = []
        with torch.inference_mode():
            for i in range(0, len(texts), batch_size):
                feeds = tokenize(tokenizer, texts[i : i + batch_size], max_length, pad_to)
                ids = torch.from_numpy(feeds["input_ids"])
                mask = torch.from_numpy(feeds["attention_mask"])
                out.append(self.embed_batch(model, ids, mask).numpy())
        return np.concatenate(out).astype(np.float32)

    def export_spec(self, model: Any, *, task: str = EMBEDDING) -> ExportSpec:
        """embedding: (input_ids, attention_mask) → `mopt_embedding` (pooled, L2-normalised);
        text-generation: the KV-cache graph of a causal LM (`generation_export_spec`)."""
        import torch

        self._task(task)
        if task == TEXT_GENERATION:
            return generation_export_spec(model)
        family = self

        class EmbeddingWrapper(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.model = model

            def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
                return family.embed_batch(self.model, input_ids, attention_mask)

        return ExportSpec(wrapper=EmbeddingWrapper().eval())

    def export_wrapper(self, model: Any) -> Any:
        """The embedding task's export wrapper (`export_spec(model).wrapper`)."""
        return self.export_spec(model).wrapper

    # ------------------------------------------------------------------ synthetic models

    def config_class(self) -> Any:
        """The transformers config class (default: `AutoConfig.for_model(model_types[0])`)."""
        from transformers import AutoConfig

        if not self.model_types:
            raise self._missing("config_class")
        mtype = self.model_types[0]
        return lambda **values: AutoConfig.for_model(mtype, **values)

    def synthetic_config(self, overrides: dict[str, Any], vocab_size: int, *, task: str = EMBEDDING) -> Any:
        values = {"vocab_size": vocab_size, **self.synthetic_defaults, **overrides}  # as `mopt check` reads it
        if values["vocab_size"] < vocab_size:
            raise ValueError(
                f"config.vocab_size={values['vocab_size']} is smaller than the synthetic "
                f"tokenizer's vocabulary ({vocab_size})"
            )
        cfg = self.config_class()(**values)
        if self.architectures:
            cfg.architectures = [self.architectures[0]]
        return cfg

    def synthetic_tokenizer(self, texts: Sequence[str], *, task: str = EMBEDDING) -> Any:
        """A lower-casing WordPiece tokenizer ([CLS] text [SEP]) whose vocabulary (every
        character, and the most frequent words of `texts`) is chosen deterministically."""
        if task == TEXT_GENERATION:
            raise ValueError(f"family {self.name!r} has only a WordPiece synthetic tokenizer: {NO_WORDPIECE}")
        return wordpiece_tokenizer(texts)

    def _task(self, task: str) -> None:
        if not self.supports(task):
            raise ValueError(
                f"family {self.name!r} has no task {task!r} (it supports {', '.join(self.tasks)})"
            )


# --------------------------------------------------------------------------- helpers


def generation_export_spec(model: Any) -> ExportSpec:
    """The KV-cache export of a transformers causal LM: the wrapper rebuilds a `DynamicCache`
    from the flat past tensors (transformers 5 takes the cache as an object), runs the model
    with `use_cache=True` and returns the logits and the grown cache, flat again."""
    import torch
    from transformers import DynamicCache

    cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    layers = int(cfg.num_hidden_layers)
    heads = int(cfg.num_attention_heads)
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    if any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or ())):
        raise ValueError(
            "the KV-cache export handles full-attention layers only; this config has "
            f"layer_types {sorted(set(cfg.layer_types))} (sliding windows need a sliding cache)"
        )
    inputs, outputs = generation_graph_names(layers)

    class CausalLMWithPast(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(
            self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
            *past: torch.Tensor,
        ) -> tuple[torch.Tensor, ...]:  # fmt: skip
            pairs = [(past[2 * i], past[2 * i + 1]) for i in range(layers)]
            cache = DynamicCache(ddp_cache_data=pairs, config=self.model.config)
            out = self.model(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                cache=cache, use_cache=True,
            )  # fmt: skip
            present: list[torch.Tensor] = []
            for layer in out.cache.layers:
                present += [layer.keys, layer.values]
            return (out.logits, *present)

    return ExportSpec(
        wrapper=CausalLMWithPast().eval(),
        inputs=inputs,
        outputs=outputs,
        dynamic_axes=generation_dynamic_axes(layers),
        check=TEXT_GENERATION,
        kv_cache={"layers": layers, "kv_heads": kv_heads, "head_dim": head_dim},
    )


def quiet_transformers() -> None:
    """No progress bars or load-report tables on stdout: targets log what matters."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def torch_dtype(name: str | None) -> Any:
    """torch dtype for "fp32" / "fp16" / "bf16" (None → None)."""
    import torch

    return None if name is None else getattr(torch, DTYPES[name])


def tokenize(tokenizer: Any, texts: Sequence[str], max_length: int, pad_to: int | None = None) -> dict[str, Any]:
    """int64 numpy input_ids / attention_mask, padded to the longest row or to `pad_to`."""
    import numpy as np

    if pad_to:
        enc = tokenizer(list(texts), padding="max_length", truncation=True, max_length=pad_to, return_tensors="np")
    else:
        enc = tokenizer(list(texts), padding=True, truncation=True, max_length=max_length, return_tensors="np")
    return {
        "input_ids": enc["input_ids"].astype(np.int64),
        "attention_mask": enc["attention_mask"].astype(np.int64),
    }


def wordpiece_tokenizer(texts: Sequence[str], max_words: int = 600) -> Any:
    """A BERT-style fast tokenizer learnt deterministically from `texts`."""
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
    for tok in specials + chars + ["##" + c for c in chars] + frequent[:max_words]:
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
