"""How a synthetic causal LM reacts to low precision: bf16 and simulated FP8 against fp32,
teacher-forced on the shipped held-out passages (never calibration).

    python benchmarks/synthetic_margins.py --shape tiny --init 0.2 --init 0.02
    python benchmarks/synthetic_margins.py --shape 0.6b --init 0.2 --layers 28

For each initializer_range: the fp32 model's own numbers (perplexity on the passages' real
next tokens, median top-1 probability, median top-1 - top-2 logit margin, mean entropy, the
share of positions whose argmax is the input token: an "echo" model), then per variant the
top-1 agreement, mean KL(fp32 || variant) and its p99 in nats and the perplexity ratio, as
`validate` reports them (mopt_ml.genmetrics). FP8 is simulated: every Linear weight except the
head cast to torch.float8_e4m3fn with one per-tensor scale (amax / 448) and back, the
activations too (per tensor, per call: what ModelOpt's FP8 does), compute in fp32. The RTN
variants round every Linear weight, the head's too, to symmetric integers (amax / (2^(b-1) - 1)
per output channel, per block of 32 inputs, or per tensor: ort-quantize mode "rtn"'s
arithmetic; `int4-tensor` is recipes/qwen3-chat.toml's must-fail). Prints one JSON line a row.

Measured 2026-12-01 (2-core AMD EPYC, shared, load 5-13), FP8 top-1 vs fp32: tiny model at
init 0.2 0.786 (bf16 0.975); at 0.02 1.000 (it echoes its input token); at 0.02 after 100 Adam
steps (--train-steps 100) 0.913 (bf16 0.987). Qwen3-0.6B shape at 0.2: 0.198, KL 3.11 (bf16
0.853; the H200 gave 0.224 / 0.875); at 0.02: 0.661 with near-flat logits (bf16 0.958).
Measured 2026-12-05 (same machine; seed 0; KL mean / p99): tiny at 0.02 int4-tensor 7.3e-4 /
1.4e-3, at 0.2 0.47 / 1.25, at 0.02 after 300 Adam steps 0.28 / 1.50; Qwen3-0.6B shape at 0.02
(--passages 8) int4-tensor 0.0075 / 0.010, int4-block32 0.0016, FP8 1.4e-4, bf16 1.9e-6, with a
mean next-token entropy of 11.73 nats of ln(151936) = 11.93 (docs/recipes.md has the table).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SHAPES = {
    "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 512},
    "0.6b": {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
             "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960,
             "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True},
}  # fmt: skip

FP8_MAX = 448.0


def fp8(t: Any) -> Any:
    import torch

    scale = t.abs().amax().clamp(min=1e-12) / FP8_MAX
    return (t / scale).to(torch.float8_e4m3fn).to(t.dtype) * scale


class FP8Linear:
    """Wraps an nn.Linear's forward: activations and weight through simulated FP8."""

    def __init__(self, lin: Any) -> None:
        self.lin = lin
        self.w = fp8(lin.weight.data)

    def __call__(self, x: Any) -> Any:
        import torch

        return torch.nn.functional.linear(fp8(x), self.w, self.lin.bias)


def rtn(w: Any, bits: int, scale: str, block: int = 32) -> Any:
    """`w` [out, in] rounded as the `rtn` kind rounds it (`mopt_ml.quantize.round_to_nearest`,
    which takes [in, out]), back in `w`'s dtype and device."""
    import torch
    from mopt_ml.quantize import round_to_nearest

    wq, _ = round_to_nearest(w.detach().float().cpu().numpy().T, bits, scale, block)
    return torch.from_numpy(wq.T.copy()).to(dtype=w.dtype, device=w.device)


def rtn_model(model: Any, bits: int, scale: str) -> Any:
    """Every Linear's weight through `rtn`; a tied head gets its own rounded copy (the input
    embedding stays fp32, as in the ONNX graph whose head is a MatMul of its own)."""
    import copy

    import torch

    m = copy.deepcopy(model)
    for mod in m.modules():
        if isinstance(mod, torch.nn.Linear):
            mod.weight = torch.nn.Parameter(rtn(mod.weight.data.clone(), bits, scale))
    return m


def fp8_model(model: Any) -> Any:
    import copy

    import torch

    m = copy.deepcopy(model)
    for name, mod in m.named_modules():
        if isinstance(mod, torch.nn.Linear) and not name.endswith("lm_head"):
            mod.forward = FP8Linear(mod)  # type: ignore[method-assign]
    return m


def logits_of(model: Any, ids: list[list[int]]) -> list[Any]:
    import torch

    with torch.no_grad():
        return [model(input_ids=torch.tensor([x], device=model.device)).logits[0].float().cpu().numpy() for x in ids]


def train(model: Any, tok: Any, steps: int, lr: float, seed: int, corpus: str = "calibration") -> float:
    """`steps` of next-token training, batches of 8 rows of at most 64 tokens: passages of the
    calibration split (never the held-out one), or with corpus "stdlib" windows of `pretrain`'s
    default corpus (the kind's own sampling); the seconds it took."""
    import torch
    from mopt_ml.common import calibration_texts

    if corpus == "stdlib":
        from mopt_ml.pretrain import PretrainKind, corpus_text

        text, _ = corpus_text(PretrainKind.Params(), Path("."))
        tok.model_max_length = len(text) + 1
        stream = tok(text, add_special_tokens=False)["input_ids"]
        rows = [stream[i : i + 64] for i in range(0, len(stream) - 64, 64)]
    else:
        texts = calibration_texts()
        rows = [tok(" " + " ".join(texts[i : i + 2]), add_special_tokens=False)["input_ids"][:64]
                for i in range(0, len(texts), 2)]  # fmt: skip
        rows = [r for r in rows if len(r) >= 8]
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    t0 = time.perf_counter()
    for _ in range(steps):
        pick = torch.randint(len(rows), (8,), generator=g).tolist()
        n = min(len(rows[i]) for i in pick)
        x = torch.tensor([rows[i][:n] for i in pick], device=model.device)
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    return time.perf_counter() - t0


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--init", type=float, action="append", help="initializer_range (repeat)")
    ap.add_argument("--layers", type=int, help="num_hidden_layers override")
    ap.add_argument("--passages", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--config", default="{}", help="extra config overrides (JSON)")
    ap.add_argument("--train-steps", type=int, action="append",
                    help="also: the model after this many Adam steps on the calibration split (repeat)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--corpus", choices=("calibration", "stdlib"), default="calibration",
                    help="what --train-steps trains on: the calibration split, or pretrain's default corpus")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda for the 0.6B shape's training")
    a = ap.parse_args(argv)

    import torch
    from mopt_ml.common import texts_from_param
    from mopt_ml.families import Qwen3Family
    from mopt_ml.synthetic import write_synthetic
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(max(1, torch.get_num_threads()))
    texts = texts_from_param(None, Path("."), "validation")
    passages = [" ".join(texts[i : i + 4]) for i in range(0, len(texts), 4)][: a.passages]
    for init in a.init or [0.2]:
        cfg = dict(SHAPES[a.shape], initializer_range=init, **json.loads(a.config))
        if a.layers:
            cfg["num_hidden_layers"] = a.layers
        with tempfile.TemporaryDirectory() as d:
            t0 = time.perf_counter()
            write_synthetic(Qwen3Family(), a.seed, cfg, Path(d), task="text-generation")
            tok = AutoTokenizer.from_pretrained(d)
            model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).to(a.device).eval()
            made_s = time.perf_counter() - t0
        for steps in [0, *(a.train_steps or [])]:
            if steps:
                import copy

                m = copy.deepcopy(model)
                train_s = train(m, tok, steps, a.lr, a.seed, a.corpus)
            else:
                m, train_s = model, 0.0
            row = measure(m, tok, passages, a, cfg, init)
            row.update(train_steps=steps, train_s=round(train_s, 1), made_s=round(made_s, 1), lr=a.lr,
                       corpus=a.corpus if steps else None, device=a.device)  # fmt: skip
            print(json.dumps(row), flush=True)
    return 0


def measure(model: Any, tok: Any, passages: list[str], a: Any, cfg: dict[str, Any], init: float) -> dict[str, Any]:
    import copy

    import numpy as np
    import torch
    from mopt_ml import genmetrics as gm

    ids = [tok(" " + p, add_special_tokens=False)["input_ids"][: a.max_tokens] for p in passages]
    ref = logits_of(model, ids)
    dists = [gm.summarize(r[:-1], gm.next_token_targets(x), 1024) for r, x in zip(ref, ids, strict=True)]
    # the fp32 model's own margins
    tgt = [np.asarray(x[1:]) for x in ids]
    lg = np.concatenate([r[:-1] for r in ref])
    srt = np.sort(lg, axis=1)
    logp = lg - lg.max(1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(1, keepdims=True))
    t_all = np.concatenate(tgt)
    ppl = float(np.exp(-logp[np.arange(len(t_all)), t_all].mean()))
    echo = float(np.mean(lg.argmax(1) == np.concatenate([np.asarray(x[:-1]) for x in ids])))
    row: dict[str, Any] = {
        "shape": a.shape, "layers": cfg["num_hidden_layers"], "init": init, "extra": json.loads(a.config),
        "fp32_ppl": round(ppl, 2), "top1_prob_p50": round(float(np.median(np.exp(logp.max(1)))), 4),
        "entropy_mean": round(float(-(np.exp(logp) * logp).sum(1).mean()), 3), "vocab": int(lg.shape[1]),
        "margin_p50": round(float(np.median(srt[:, -1] - srt[:, -2])), 4), "echo_share": round(echo, 3),
        "positions": len(t_all),
    }  # fmt: skip

    variants = {
        "bf16": lambda: copy.deepcopy(model).to(torch.bfloat16), "fp8": lambda: fp8_model(model),
        "int8-channel": lambda: rtn_model(model, 8, "channel"), "int4-block32": lambda: rtn_model(model, 4, "block"),
        "int4-tensor": lambda: rtn_model(model, 4, "tensor"), "int3-tensor": lambda: rtn_model(model, 3, "tensor"),
        "int2-tensor": lambda: rtn_model(model, 2, "tensor"),
    }  # fmt: skip
    for name, make in variants.items():
        m = make()  # one copy at a time: the 0.6B shape is 2.4 GB in fp32
        cand = logits_of(m, ids)
        del m
        parts = [
            gm.compare(d, c[:-1], gm.next_token_targets(x)) for d, c, x in zip(dists, cand, ids, strict=True)
        ]
        n = gm.metrics(parts, [], 0)
        row[name] = {k: float(f"{n[k]:.4g}") for k in ("top1_agreement", "kl_mean", "kl_p99", "ppl_ratio")}
    return row


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
