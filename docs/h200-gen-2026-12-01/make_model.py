"""A random Qwen3ForCausalLM of Qwen3-0.6B's real shape (bf16) with a chat tokenizer, for the
H200 probes of issue #16 (the real checkpoint cannot be downloaded there).
`python3 make_model.py OUT [--tiny]`. The tokenizer: mopt's synthetic byte-level BPE (merges
learnt from the shipped sentences) padded with unreachable filler tokens to Qwen3-0.6B's
151,936 ids, so every id the random model generates decodes; Qwen's ChatML template;
eos <|im_end|>, pad <|endoftext|>; no post-processor (a generation prompt ends where it ends)."""

import json
import sys
import time
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
QWEN3_06B = dict(
    hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
    num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6,
    rope_theta=1000000.0, tie_word_embeddings=True, vocab_size=151936, initializer_range=0.02,
)


def chat_tokenizer(vocab_size: int):
    from mopt_ml.common import read_texts, shipped_sentences_path
    from mopt_ml.families import Qwen3Family
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    base = Qwen3Family().synthetic_tokenizer(read_texts(shipped_sentences_path()))
    js = json.loads(base.backend_tokenizer.to_str())
    vocab = js["model"]["vocab"]
    n = max(vocab.values()) + 1
    for i in range(n, vocab_size):
        vocab[f"zzfill{i}"] = i  # ASCII: in the byte-level alphabet, so it decodes; no merge makes it
    js["post_processor"] = None
    tk = Tokenizer.from_str(json.dumps(js))
    return PreTrainedTokenizerFast(
        tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None,
        padding_side="left", model_max_length=40960, chat_template=CHAT_TEMPLATE,
    )


def main() -> None:
    out = Path(sys.argv[1])
    tiny = "--tiny" in sys.argv
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    t0 = time.time()
    cfg_kw = dict(QWEN3_06B)
    if tiny:
        cfg_kw.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16)
    tok = chat_tokenizer(cfg_kw["vocab_size"])
    assert len(tok) == cfg_kw["vocab_size"], (len(tok), cfg_kw["vocab_size"])
    eos, pad = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
    cfg = Qwen3Config(**cfg_kw, eos_token_id=eos, pad_token_id=pad, bos_token_id=pad)
    cfg.architectures = ["Qwen3ForCausalLM"]
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    with torch.device(dev):
        model = Qwen3ForCausalLM(cfg).to(torch.bfloat16).eval()
    model.generation_config = GenerationConfig(eos_token_id=[eos, pad], pad_token_id=pad, do_sample=False)
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    n = sum(p.numel() for p in model.parameters())
    print(json.dumps({"out": str(out), "params": n, "vocab": len(tok), "eos": eos, "pad": pad,
                      "seconds": round(time.time() - t0, 1), "device": dev}))


if __name__ == "__main__":
    main()
