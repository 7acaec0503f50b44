"""A synthetic causal LM whose config asks for a larger vocabulary than the synthetic
tokenizer has (Qwen3-0.6B's 151,936) gets a tokenizer covering every id, so whatever the
random model generates decodes (on the H200, vLLM streams text chunks per token only then)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")


def test_the_tokenizer_covers_a_larger_vocab_size(tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    from mopt_ml.families import Qwen3Family
    from mopt_ml.synthetic import write_synthetic

    cfg = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
           "num_key_value_heads": 1, "head_dim": 16, "vocab_size": 3000}  # fmt: skip
    write_synthetic(Qwen3Family(), 0, cfg, tmp_path, task="text-generation")
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    assert AutoConfig.from_pretrained(str(tmp_path)).vocab_size == 3000 == len(tok)
    assert tok.decode([2999]) == "zzfill2999"  # a filler decodes as its name
    ids = tok("Paris is the capital of France.")["input_ids"]
    assert (
        max(ids) < 600 and tok.decode(ids) == "Paris is the capital of France."
    )  # the learnt merges unchanged
    assert tok.chat_template and tok.eos_token == "<|im_end|>"
