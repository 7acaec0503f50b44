"""A small real language model in numpy behind the `mopt_ml.genruntime` Generator protocol,
for the generation validate / bench / select tests: a bigram table (next-token logits depend
on the last token), with a clear favourite per token like a trained model. A "quantized"
copy is the same table plus seeded noise, read from `fake.json` in the model folder.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

#: how many times each folder was opened (tests check the reference cache with it)
OPENED: dict[str, int] = {}


class BigramLM:
    backend = "fake-bigram"

    def __init__(self, vocab: int, noise: float = 0.0, seed: int = 0, delay_s: float = 0.0) -> None:
        rng = np.random.default_rng(seed)
        table = rng.normal(0.0, 1.0, size=(vocab, vocab))
        table[np.arange(vocab), rng.permutation(vocab)] += rng.uniform(3.0, 6.0, size=vocab)
        if noise:
            table = table + np.random.default_rng(seed + 1).normal(0.0, noise, size=table.shape)
        self.table = table.astype(np.float32)
        self.vocab_size = vocab
        self.delay_s = delay_s  # per forward pass: a "slow" model for the bench tests

    def logits(self, input_ids: Sequence[int]) -> np.ndarray:
        if self.delay_s:
            time.sleep(self.delay_s)
        return self.table[np.asarray(list(input_ids), dtype=np.int64)]

    def generate(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        *,
        on_token: Callable[[int, float], None] | None = None,
        stop_at_eos: bool = False,
    ) -> list[int]:
        out: list[int] = []
        last = int(prompt_ids[-1])
        if self.delay_s:
            time.sleep(self.delay_s * 2)  # prefill costs more than a decode step
        for _ in range(max_new_tokens):
            if self.delay_s and out:
                time.sleep(self.delay_s)
            last = int(np.argmax(self.table[last]))
            out.append(last)
            if on_token is not None:
                on_token(last, time.perf_counter())
        return out

    def generate_batch(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
        if self.delay_s:  # one batched pass costs about as much as one sequence's
            d, self.delay_s = self.delay_s, 0.0
            time.sleep(d * (1 + max_new_tokens))
            try:
                return [self.generate(p, max_new_tokens) for p in prompts]
            finally:
                self.delay_s = d
        return [self.generate(p, max_new_tokens) for p in prompts]

    def close(self) -> None:
        pass


def open_generator(
    path: Any, *, format: str, device: str = "cpu", dtype: Any = None, threads: Any = None
) -> BigramLM:
    folder = Path(path)
    OPENED[folder.name] = OPENED.get(folder.name, 0) + 1
    spec: dict[str, Any] = (
        json.loads((folder / "fake.json").read_text()) if (folder / "fake.json").is_file() else {}
    )
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    return BigramLM(vocab, noise=spec.get("noise", 0.0), delay_s=spec.get("delay_s", 0.0))


def make_model(folder: Path, tokenizer: Any, noise: float | None = None, delay_s: float = 0.0) -> Path:
    """A model folder: tokenizer, config.json, and (for candidates) fake.json; an
    `model.onnx` placeholder marks it as the ONNX candidate (never parsed)."""
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(folder))
    (folder / "config.json").write_text(json.dumps({"vocab_size": len(tokenizer), "model_type": "qwen3"}))
    if noise is not None:
        (folder / "fake.json").write_text(json.dumps({"noise": noise, "delay_s": delay_s}))
        (folder / "model.onnx").write_bytes(b"")
    return folder


def install(monkeypatch: Any) -> None:
    """Route mopt_ml's generator opening to this module (genruntime may not exist yet)."""
    import sys
    import types

    try:
        from mopt_ml import genruntime
    except ImportError:
        genruntime = types.ModuleType("mopt_ml.genruntime")
        monkeypatch.setitem(sys.modules, "mopt_ml.genruntime", genruntime)
        import mopt_ml

        monkeypatch.setattr(mopt_ml, "genruntime", genruntime, raising=False)
    monkeypatch.setattr(genruntime, "open_generator", open_generator, raising=False)
