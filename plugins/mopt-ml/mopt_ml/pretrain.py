"""The `pretrain` target: a short causal-LM training run of a text-generation checkpoint on a
local corpus, so that a synthetic model's next-token distributions have real margins.

A random causal LM at its architecture's own initializer (0.02) predicts a nearly uniform
next token: every quantization keeps such a flat distribution, so the KL gates of `validate`
cannot fail anything (docs/recipes.md, *Text generation*). A few hundred Adam steps on real
text give it peaked, checkpoint-like distributions. The default corpus is a fixed, sorted list
of the Python standard library's files on the machine (no download): the prose of its
documentation topics (pydoc_data/topics.py) and the sources of a few dozen modules; `corpus` names a
.txt / .jsonl file instead. The files read are the kind's `input_files`, so another Python's
stdlib re-keys the action. Lines holding a sentence of the shipped held-out split (what
`validate` measures on by default) are dropped from the corpus; a recipe's own `data` for
`validate` is not known here: keep it out of `corpus` yourself.

Output: the same hf-checkpoint layout as the input (config, tokenizer and generation files
copied, one model.safetensors with tied weights stored once), so onnx, ort-quantize, vllm and
modelopt-ptq take it. `device = "auto"` trains on the first CUDA GPU when torch sees one
(Qwen3-0.6B's shape needs a GPU: one 8 x 64-token Adam step is ~1.8 TFLOP), else on the CPU.
Training is seeded and deterministic on one machine (torch's deterministic algorithms; cuBLAS
with a fixed workspace), but float reductions differ across CPUs, GPUs and thread counts: not
byte-reproducible across machines.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sysconfig
from pathlib import Path
from typing import Any, Literal

from mopt.api import BuildContext, Input, Params, TargetKind
from pydantic import Field

#: the default corpus: these modules of the running Python's standard library (sorted, fixed;
#: present in every CPython from 3.9 to 3.13), about 0.67 MB of source on 3.11
STDLIB_MODULES = (
    "abc", "bisect", "calendar", "colorsys", "contextlib", "copy", "csv", "dataclasses", "difflib",
    "enum", "fnmatch", "fractions", "functools", "getopt", "glob", "heapq", "keyword", "numbers",
    "operator", "pprint", "queue", "random", "shlex", "statistics", "string", "textwrap", "types",
    "uuid", "weakref",
)  # fmt: skip
MODEL_FILES = ("model.safetensors", "model.safetensors.index.json", "manifest.json")


#: the stdlib's documentation topics (the language reference's prose, as a dict of strings)
TOPICS = "pydoc_data/topics.py"


def stdlib_files() -> list[Path]:
    """The default corpus's files on this machine: TOPICS, then those of STDLIB_MODULES."""
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = [root / TOPICS, *(root / f"{m}.py" for m in STDLIB_MODULES)]
    return [p for p in paths if p.is_file()]


def stdlib_text(path: Path) -> str:
    """A stdlib file's training text: the source, or for TOPICS the prose of its dict's values
    (read with ast.literal_eval: nothing is executed)."""
    import ast

    source = path.read_text(encoding="utf-8")
    if path.as_posix().endswith(TOPICS):
        for node in ast.parse(source).body:
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
                topics = ast.literal_eval(node.value)
                return "\n\n".join(str(topics[k]) for k in sorted(topics))
    return source


class PretrainKind(TargetKind):
    """Train a text-generation hf-checkpoint for a few hundred steps on a local corpus."""

    preload = ("torch", "transformers")
    name = "pretrain"
    version = "1"
    description = (
        "a short causal-LM training run on a local corpus (default: Python's stdlib docs and sources)"
    )
    consumes = (Input("model", formats=("hf-checkpoint",)),)
    produces = "hf-checkpoint"
    fingerprint_packages = ("torch", "transformers", "safetensors", "tokenizers")
    reproducible = False  # float reductions differ across CPUs / thread counts
    network = False

    class Params(Params):
        steps: int = Field(
            default=1000,
            ge=1,
            description="Adam steps (1000: ~11 s for the tiny CI model on 2 cores; docs/recipes.md)",
        )
        lr: float = Field(default=3e-3, gt=0, description="Adam learning rate (constant)")
        batch_size: int = Field(default=8, ge=1, description="sequences per step")
        seq_len: int = Field(
            default=64, ge=2, description="tokens per sequence (random windows of the corpus)"
        )
        seed: int = Field(default=0, ge=0, description="torch seed (window sampling and dropout)")
        device: Literal["auto", "cpu", "cuda"] = Field(
            default="auto",
            description="where to train: auto = the first CUDA GPU when torch sees one, else the CPU",
        )
        corpus: str | None = Field(
            default=None,
            description="a .txt / .jsonl file (relative to the recipe) to train on; null: the Python "
            "standard library's documentation topics and a fixed list of its modules on this machine",
        )

    def input_files(self, params: Any, project_dir: Path) -> list[Path]:
        if params.corpus:
            return [(project_dir / params.corpus).resolve()]
        return stdlib_files()

    def run(self, ctx: BuildContext) -> dict[str, Any]:
        from mopt_ml.common import require

        require("torch", "transformers", "safetensors")
        if ctx.params.corpus:
            path = (ctx.project_dir / ctx.params.corpus).resolve()
            if not path.is_file():
                raise ValueError(
                    f"pretrain: corpus {ctx.params.corpus!r} (param `corpus` of target {ctx.target!r}) "
                    f"is not a file at {path}; give a .txt or .jsonl file relative to the recipe"
                )
        return pretrain(ctx.input("model").path, ctx.out, ctx.params, ctx.project_dir, ctx.log, ctx.progress)


def corpus_text(params: Any, project_dir: Path) -> tuple[str, dict[str, Any]]:
    """The training text and what it is made of (files, bytes, sha256, dropped lines)."""
    from mopt_ml.common import read_texts, validation_texts

    if params.corpus:
        path = (project_dir / params.corpus).resolve()
        docs = read_texts(path)
        files = [params.corpus]
    else:
        paths = stdlib_files()
        if not paths:
            raise ValueError(
                f"pretrain: no standard-library source found under {sysconfig.get_paths()['stdlib']}; "
                "give a `corpus` file"
            )
        docs = [stdlib_text(p) for p in paths]
        root = Path(sysconfig.get_paths()["stdlib"])
        files = [p.relative_to(root).as_posix() for p in paths]
    held = [s for s in validation_texts() if len(s) >= 20]
    dropped = 0
    kept_docs = []
    for doc in docs:
        lines = doc.splitlines()
        keep = [ln for ln in lines if not any(s in ln for s in held)]
        dropped += len(lines) - len(keep)
        kept_docs.append("\n".join(keep))
    text = "\n\n".join(kept_docs)
    info = {
        "files": files,
        "bytes": len(text.encode("utf-8")),
        "sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
        "held_out_lines_dropped": dropped,
    }
    return text, info


def mean_entropy(model: Any, tokenizer: Any, max_tokens: int = 128, passages: int = 16) -> float:
    """Mean next-token entropy (nats) of `model` on the shipped held-out passages (4 sentences
    each, what `validate` measures by default)."""
    import torch

    from mopt_ml.common import validation_texts

    texts = validation_texts()
    rows = [" ".join(texts[i : i + 4]) for i in range(0, len(texts), 4)][:passages]
    total, n = 0.0, 0
    with torch.no_grad():
        for p in rows:
            ids = tokenizer(p, add_special_tokens=False)["input_ids"][:max_tokens]
            x = torch.tensor([ids], device=model.device)
            lp = torch.log_softmax(model(input_ids=x).logits[0].float(), -1)
            total += float(-(lp.exp() * lp).sum(-1).sum())
            n += len(ids)
    return total / max(n, 1)


def pretrain(
    src: Path, out: Path, params: Any, project_dir: Path, log: Any, progress: Any = None
) -> dict[str, Any]:
    """Train the causal LM in `src` on the corpus and write the result to `out`."""
    import time

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mopt_ml.weights import _save_deduped

    progress = progress or log
    text, info = corpus_text(params, project_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(src))
    tokenizer.model_max_length = len(text) + 1  # one long stream, cut into windows below
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    n = params.seq_len
    if len(ids) < n + 1:
        raise ValueError(f"pretrain: the corpus has {len(ids)} tokens, fewer than seq_len + 1 = {n + 1}")
    data = torch.tensor(ids, dtype=torch.long)
    log(
        f"corpus: {len(info['files'])} files, {info['bytes']:,} bytes, {len(ids):,} tokens (sha256 {info['sha256'][:12]})"
    )

    device = params.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device == "cuda" and not torch.cuda.is_available():
        raise ValueError('pretrain: device = "cuda", but torch sees no CUDA GPU here; use "auto" or "cpu"')
    if device == "cuda":  # deterministic cuBLAS needs a fixed workspace, set before its first use
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.manual_seed(params.seed)
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).to(device)
    model.eval()
    log(f"training on {torch.cuda.get_device_name(0) if device == 'cuda' else 'the CPU'}")
    entropy_before = mean_entropy(model, tokenizer)
    gen = torch.Generator().manual_seed(params.seed)
    opt = torch.optim.Adam(model.parameters(), lr=params.lr)
    model.train()
    every = max(1, params.steps // 10)
    losses: list[float] = []
    t0 = time.perf_counter()
    with _deterministic():
        for step in range(1, params.steps + 1):
            starts = torch.randint(len(ids) - n, (params.batch_size,), generator=gen)
            x = torch.stack([data[s : s + n] for s in starts.tolist()]).to(device)
            loss = model(input_ids=x, labels=x).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
            if step % every == 0 or step == params.steps:
                progress(
                    f"step {step}/{params.steps}: loss {losses[-1]:.3f} ({time.perf_counter() - t0:.0f} s)"
                )
    model.eval()
    entropy_after = mean_entropy(model, tokenizer)

    for f in sorted(src.iterdir()):
        if f.is_file() and f.name not in MODEL_FILES and not f.name.endswith(".safetensors"):
            shutil.copyfile(f, out / f.name)
    model.to("cpu")  # tied parameters stay one tensor, which _save_deduped stores once
    _save_deduped(dict(model.state_dict()), out / "model.safetensors")
    tail = losses[-min(10, len(losses)) :]
    meta = {
        "corpus": info,
        "tokens": len(ids),
        "steps": params.steps,
        "device": device,
        "first_loss": round(losses[0], 4),
        "final_loss": round(sum(tail) / len(tail), 4),
        "seconds": round(time.perf_counter() - t0, 1),
        "held_out_entropy": {"before": round(entropy_before, 4), "after": round(entropy_after, 4)},
    }
    log(
        f"loss {meta['first_loss']} -> {meta['final_loss']} (mean of the last {len(tail)} steps); held-out "
        f"entropy {entropy_before:.3f} -> {entropy_after:.3f} nats"
    )
    return meta


class _deterministic:
    """torch.use_deterministic_algorithms for a block, restored afterwards."""

    def __enter__(self) -> None:
        import torch

        self.was = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(True)

    def __exit__(self, *exc: object) -> None:
        import torch

        torch.use_deterministic_algorithms(self.was)
