"""The `serve-check` target: launch the `vllm` config for real and test what it serves.

Starts `vllm serve <model> --config vllm.yaml` on a free local port, waits for `/health`,
sends real `/v1/embeddings` requests (batches of texts, several rounds), records latency and
throughput, and compares every embedding with a PyTorch fp32 reference computed from the
original weights with the model family's own pooling. Fails when the minimum cosine similarity
is below `min_cosine`. Needs vLLM and a GPU that matches the profile.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Annotated, Any, ClassVar

from pydantic import Field

from mopt.api import BuildContext, CheckContext, Finding, Input, Params, Role, TargetKind
from mopt.api import plugin_env as _env

INSTALL_VLLM = "pip install vllm (CUDA wheels on PyPI)"

DEFAULT_TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Embeddings map text to vectors whose distances mean something.",
    "TensorRT builds an engine for one GPU architecture.",
    "How many attention heads does the model have?",
    "Paris is the capital of France.",
    "A content-addressed store names every blob by its digest.",
    "The weather in Oslo is cold in January.",
    "def add(a, b):\n    return a + b",
    "Quantum computers use qubits instead of bits.",
    "She sells sea shells by the sea shore.",
    "Latency is the time one request takes; throughput is how many finish per second.",
    "Der schnelle braune Fuchs springt über den faulen Hund.",
    "La cuisine française est célèbre dans le monde entier.",
    "机器学习模型需要大量的数据。",
    "An H200 has 141 GB of HBM3e memory.",
    "Rebuilding only what changed is the point of a build system.",
]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_json(url: str, body: dict[str, Any] | None = None, timeout: float = 120.0) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        raw = r.read()
    return json.loads(raw) if raw else None


def wait_healthy(base: str, proc: subprocess.Popen[bytes], timeout: float) -> float:
    """Seconds until GET /health answers 200; RuntimeError if the server dies or times out."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM exited with status {proc.returncode} before it was healthy (log above)")
        try:
            with urllib.request.urlopen(base + "/health", timeout=5) as r:
                if r.status == 200:
                    return time.monotonic() - t0
        except (urllib.error.URLError, ConnectionError, OSError):
            pass
        time.sleep(2.0)
    raise RuntimeError(f"vLLM was not healthy after {timeout:.0f} s")


def cosines(a: list[list[float]], b: Any) -> list[float]:
    """Row-wise cosine similarity of two lists of vectors."""
    out = []
    for x, y in zip(a, b, strict=True):
        dot = sum(p * q for p, q in zip(x, y, strict=True))
        nx = sum(p * p for p in x) ** 0.5
        ny = sum(q * q for q in y) ** 0.5
        out.append(dot / (nx * ny) if nx and ny else float("nan"))
    return out


def reference_embeddings(weights: Path, family: Any, texts: list[str], max_length: int) -> list[list[float]]:
    """fp32 PyTorch embeddings with the family's pooling (its `embed` when it has one)."""
    if isinstance(family, type):
        family = family()
    if family is not None and all(hasattr(family, m) for m in ("load", "load_tokenizer", "embed")):
        model = family.load(weights, dtype="fp32")
        tok = family.load_tokenizer(weights)
        return family.embed(model, tok, texts, max_length=max_length).tolist()  # type: ignore[no-any-return]
    import torch
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(weights))
    model = AutoModel.from_pretrained(str(weights), dtype=torch.float32).eval()
    pooling = getattr(family, "pooling", "mean")
    with torch.inference_mode():
        enc = tok(texts, padding=True, truncation=True, max_length=max_length, return_tensors="pt")
        h = model(**enc).last_hidden_state
        mask = enc["attention_mask"]
        if pooling == "last-token":
            pos = torch.arange(mask.shape[1]).unsqueeze(0)
            pooled = h[torch.arange(h.shape[0]), (mask * pos).argmax(1)]
        elif pooling == "cls":
            pooled = h[:, 0]
        else:
            m = mask.unsqueeze(-1).float()
            pooled = (h * m).sum(1) / m.sum(1).clamp(min=1e-9)
        return torch.nn.functional.normalize(pooled, dim=-1).tolist()  # type: ignore[no-any-return]


class ServeCheckKind(TargetKind):
    """Launch the vLLM config, send real /v1/embeddings requests, compare with the reference."""

    name = "serve-check"
    version = "1"
    description = "launch vllm serve, send /v1/embeddings requests, compare with a PyTorch reference"
    memory_model = "none"
    consumes = (
        Input("serve", kinds=("vllm",)),
        Input("model", kinds=("modelopt-ptq", "weights")),
        Input("reference", kinds=("weights",)),
    )
    produces = "report"
    per_hardware = True
    requires = ("gpu", "hardware", "python:vllm", "python:torch", "python:transformers")
    resources: ClassVar[dict[str, int]] = {"cpu": 1, "gpu": 1}
    reproducible = False  # latency numbers
    install_hints: ClassVar[dict[str, str]] = {"python:vllm": INSTALL_VLLM}

    class Params(Params):
        texts: str | None = Field(
            default=None, description=".jsonl (`text`) or .txt; null: a built-in set of 16"
        )
        num_texts: int = Field(default=64, ge=1)
        batch_size: int = Field(default=16, ge=1)
        rounds: int = Field(default=3, ge=1, description="times the text set is sent (latency statistics)")
        max_length: Annotated[int, Role.seq_len] = Field(default=512, ge=1)
        min_cosine: float = Field(default=0.99, ge=-1, le=1)
        startup_timeout_s: float = Field(default=900, gt=0)

    def input_files(self, params: Any, project_dir: Path) -> list[Path]:
        return [(project_dir / params.texts).resolve()] if params.texts else []

    def fingerprint(self) -> dict[str, str]:
        return {
            "vllm": _env.dist_version("vllm") or "missing",
            "torch": _env.dist_version("torch") or "missing",
            **_env.gpu_facts(),
        }

    def check(self, params: Any, ctx: CheckContext) -> list[Finding]:
        if not ctx.hardware.is_gpu:
            return [
                Finding(
                    "error",
                    "engine-on-cpu",
                    f"serve-check launches vLLM on a GPU; profile {ctx.hardware.name!r} has none",
                    "",
                    ctx.section,
                    ctx.target,
                )
            ]
        return []

    def run(self, ctx: BuildContext) -> dict[str, Any]:
        p = ctx.params
        if not _env.has_module("vllm"):
            raise RuntimeError(f"target kind 'serve-check' needs the Python package 'vllm' ({INSTALL_VLLM})")
        _env.require_gpu(self.name, ctx.hardware)
        serve, model, ref_art = ctx.input("serve"), ctx.input("model"), ctx.input("reference")
        if serve.meta.get("model_target") not in (None, model.target):
            raise RuntimeError(
                f"the vllm target {serve.target!r} serves {serve.meta.get('model_target')!r}, this check got "
                f"{model.target!r}: set input = [...] to the same model"
            )
        texts = DEFAULT_TEXTS
        if p.texts:
            from mopt_serve.modelopt_ptq import read_texts

            texts = read_texts((ctx.project_dir / p.texts).resolve(), p.num_texts)
        texts = (texts * (p.num_texts // len(texts) + 1))[: p.num_texts]
        ctx.log(f"reference: fp32 PyTorch on {ref_art.target!r}, {len(texts)} texts")
        ref = reference_embeddings(ref_art.path, ctx.family, texts, p.max_length)

        port = free_port()
        base = f"http://127.0.0.1:{port}"
        exe = [sys.executable, "-m", "vllm.entrypoints.cli.main"]
        argv = [*exe, "serve", str(model.path), "--config", str(serve.path / "vllm.yaml"),
                "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
        log_path = ctx.tmp / "vllm.log"
        ctx.log("$ " + " ".join(argv))
        with open(log_path, "wb") as logf:
            proc = subprocess.Popen(argv, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                startup = wait_healthy(base, proc, p.startup_timeout_s)
                served = serve.meta.get("served_model_name") or ctx.model_name
                lat: list[float] = []
                got: list[list[float]] = []
                t_all = time.perf_counter()
                for r in range(p.rounds):
                    for i in range(0, len(texts), p.batch_size):
                        t = time.perf_counter()
                        resp = http_json(
                            base + "/v1/embeddings", {"model": served, "input": texts[i : i + p.batch_size]}
                        )
                        lat.append((time.perf_counter() - t) * 1e3)
                        if r == 0:
                            got += [d["embedding"] for d in sorted(resp["data"], key=lambda d: d["index"])]
                wall = time.perf_counter() - t_all
            finally:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGTERM)  # the server's own process group, started above
                    try:
                        proc.wait(timeout=60)
                    except subprocess.TimeoutExpired:
                        os.killpg(proc.pid, signal.SIGKILL)
                        proc.wait()
        for line in log_path.read_text(errors="replace").splitlines()[-40:]:
            ctx.log(line)
        cos = cosines(got, ref)
        qs = statistics.quantiles(lat, n=10) if len(lat) >= 2 else lat * 9
        report = {
            "texts": len(texts),
            "batch_size": p.batch_size,
            "rounds": p.rounds,
            "startup_s": round(startup, 1),
            "min_cosine": min(cos),
            "mean_cosine": statistics.fmean(cos),
            "latency_ms": {"p50": statistics.median(lat), "p90": qs[8], "max": max(lat)},
            "texts_per_s": len(texts) * p.rounds / wall,
            "vllm": _env.dist_version("vllm"),
        }
        (ctx.out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
        ctx.log(json.dumps(report))
        if not report["min_cosine"] >= p.min_cosine:
            raise RuntimeError(
                f"served embeddings differ from the reference: min cosine {report['min_cosine']:.5f} < {p.min_cosine}"
            )
        return report
