"""The `serve-check` target: start the `vllm` config for real and test what it serves, with
the launchers and checks of `server.py` (text-generation models: `gen_check.py`).

What one run records in `serve.json` (`mopt-serve-check/1`): the exact command line, start-up
time to a healthy /health, /v1/models, the min / mean cosine of the served embeddings of a
held-out text set against an fp32 PyTorch reference with the family's own pooling (gate
`min_cosine`), the /metrics series, the engine's GPU memory (nvidia-smi, per process of the
server's process group) with vLLM's own report of weights and KV cache from its log, and a
bounded load test: one step per concurrency with requests/s, tokens/s, p50 / p90 / p99 latency
and errors, and the knee (the highest load whose p99 meets `slo_p99_ms`). Also the server log
(`server.log`) and `loadtest.svg` (latency vs throughput), which `mopt report` shows.
"""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field

from mopt.api import BuildContext, CheckContext, Finding, Input, Params, Role, TargetKind
from mopt.api import plugin_env as _env
from mopt_serve.common import CHECKPOINT_KINDS, DEFAULT_KL_GATES, PREFER_MODEL
from mopt_serve.server import (
    DEFAULT_TEXTS,
    INSTALL_VLLM,
    KEPT_METRICS,
    Outcome,
    Server,
    cosines,
    embed,
    free_port,
    gpu_memory,
    knee,
    load_test,
    local_vllm,
    parse_vllm_log,
    read_metrics,
    read_texts_file,
    reference_embeddings,
    requests_for,
    serve_command,
    served_models,
    write_outcome,
)

FORMAT = "mopt-serve-check/1"

class ServeCheckKind(TargetKind):
    """Start the vLLM config, check health / models / embeddings / metrics / memory, load-test it."""

    name = "serve-check"
    # vLLM writes ~/.cache/vllm and needs the GPU; not yet run under bubblewrap on a GPU
    # machine, so it runs in a plain worker process (the input check still applies)
    sandbox = False
    version = "2"
    description = (
        "start vllm serve, check /health, /v1/models, embeddings (or greedy generation) vs fp32, /metrics, "
        "memory; load test (TTFT / ITL knee and prefix caching for generation)"
    )
    memory_model = "none"
    consumes = (
        Input("serve", kinds=("vllm",)),
        Input("model", formats=("modelopt-checkpoint", "hf-checkpoint"), prefer=PREFER_MODEL),
        Input("reference", kinds=CHECKPOINT_KINDS),
    )
    produces = "report"
    per_hardware = True
    requires = ("gpu", "hardware", "python:vllm", "python:torch", "python:transformers")
    resources: ClassVar[dict[str, int]] = {"cpu": 1, "gpu": 1}
    reproducible = False  # latency numbers
    install_hints: ClassVar[dict[str, str]] = {"python:vllm": INSTALL_VLLM}

    class Params(Params):
        texts: str | None = Field(
            default=None,
            description="held-out .jsonl (`text`) or .txt for the cosine check; null: 16 built-in",
        )
        num_texts: int = Field(default=64, ge=1)
        batch_size: int = Field(
            default=16, ge=1, description="texts per /v1/embeddings request (cosine check)"
        )
        max_length: Annotated[int, Role.seq_len] = Field(default=512, ge=1)
        min_cosine: float = Field(default=0.99, ge=-1, le=1)
        on_fail: Literal["error", "record"] = Field(
            default="error", description="record: a failed gate is written to serve.json (select excludes it)"
        )
        startup_timeout_s: float = Field(default=600, gt=0)
        concurrency: list[int] = Field(default=[4, 16, 64, 128], min_length=1, description="load-test steps")
        slo_p99_ms: float = Field(default=100.0, gt=0, description="the knee: highest load with p99 <= this")
        input_len: int = Field(default=256, ge=8, description="tokens per load-test request (mean)")
        input_len_range: float = Field(
            default=0.5, ge=0, lt=1, description="± this fraction around input_len"
        )
        texts_per_request: int = Field(default=1, ge=1)
        requests_per_client: int = Field(default=24, ge=1)
        min_requests: int = Field(default=300, ge=1)
        max_requests: int = Field(default=3000, ge=1)
        warmup_requests: int = Field(default=32, ge=0)
        loadtest_timeout_s: float = Field(default=240, gt=0)
        loadtest_tool: Literal["vllm-bench", "mopt-loop"] = Field(
            default="vllm-bench",
            description="vllm-bench: vLLM's own `vllm bench serve` code; mopt-loop: the stdlib fallback",
        )
        # ---- text generation (task "text-generation"; see gen_check.py)
        ttft_slo_ms: float = Field(
            default=300.0, gt=0, description="generation knee: highest concurrency with p99 TTFT <= this"
        )
        output_len: int = Field(
            default=128, ge=1, description="generation: output tokens per load-test request"
        )
        gen_prompts: int = Field(default=8, ge=1, description="held-out prompts for the greedy check")
        gen_tokens: int = Field(default=16, ge=1, description="greedy tokens per prompt checked against fp32")
        min_top1: float | None = Field(
            default=None,
            ge=0,
            le=1,
            description="generation: fail below this share of served greedy tokens that are the fp32 "
            "reference's argmax (teacher-forced; reported always); null: off",
        )
        kl_passages: int = Field(
            default=16, ge=0, description="generation: held-out passages (4 texts each) for the KL gates; 0: none"
        )
        kl_max_tokens: int = Field(default=128, ge=2, description="generation: tokens per KL passage, at most")
        kl_top_k: int = Field(
            default=20,
            ge=1,
            description="generation: served log-probs per position (vLLM's prompt_logprobs; at most the "
            "server's --max-logprobs, 20 by default): the KL is over these and a rest bucket",
        )
        max_kl: float | None = Field(
            default=DEFAULT_KL_GATES["max_kl"],
            ge=0,
            description="generation: fail above this held-out mean KL(fp32 || served), nats",
        )
        max_kl_p99: float | None = Field(
            default=DEFAULT_KL_GATES["max_kl_p99"],
            ge=0,
            description="generation: fail above its 99th percentile over positions, nats",
        )
        max_ppl_ratio: float | None = Field(
            default=None, gt=0, description="generation: fail above this held-out perplexity ratio (served / fp32)"
        )
        gen_requests_per_client: int = Field(default=4, ge=1)
        gen_min_requests: int = Field(default=16, ge=1)
        gen_max_requests: int = Field(default=1024, ge=1)
        loadtest_endpoint: Literal["chat", "completions"] = Field(
            default="chat",
            description="generation load test: /v1/chat/completions (chat template) or /v1/completions",
        )
        prefix_probe: bool = Field(
            default=True, description="generation: measure prefix caching on a shared system prompt"
        )
        prefix_len: int = Field(
            default=1024, ge=1, description="shared system-prompt tokens of the prefix probe"
        )
        prefix_suffix_len: int = Field(
            default=128, ge=1, description="per-request tokens after the shared prefix"
        )
        prefix_output_len: int = Field(default=64, ge=1)
        prefix_concurrency: int = Field(default=16, ge=1)
        prefix_requests: int = Field(default=160, ge=1)

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
        if ctx.task == "text-generation":
            from mopt_serve.gen_check import run_generation

            return run_generation(ctx, self)
        serve, model, ref_art = ctx.input("serve"), ctx.input("model"), ctx.input("reference")
        if serve.meta.get("model_target") not in (None, model.target):
            raise RuntimeError(
                f"the vllm target {serve.target!r} serves {serve.meta.get('model_target')!r}, this check got "
                f"{model.target!r}: set input = [...] to the same model"
            )
        texts = DEFAULT_TEXTS
        if p.texts:
            texts = read_texts_file((ctx.project_dir / p.texts).resolve(), p.num_texts)
        texts = (texts * (p.num_texts // len(texts) + 1))[: p.num_texts]
        ctx.log(f"reference: fp32 PyTorch on {ref_art.target!r}, {len(texts)} held-out texts")
        ref = reference_embeddings(ref_art.path, ctx.family, texts, p.max_length)
        args = json.loads((serve.path / "args.json").read_text())
        port = free_port()
        argv = serve_command(args, model.path, serve.path, port)
        served = serve.meta.get("served_model_name") or ctx.model_name
        log_path = ctx.out / "server.log"
        before = gpu_memory(None)
        ctx.log("$ " + " ".join(argv))
        out = Outcome()
        env = {**os.environ, **args.get("env", {})}
        with local_vllm(argv, log_path, port=port, startup_timeout_s=p.startup_timeout_s, env=env) as server:
            out = check_server(server, served, texts, ref, model.path, p, ctx.tmp, ctx.log)
            out.doc["startup_s"] = round(server.startup_s, 1)
            out.doc["gpu_memory"] = gpu_memory(server.pid)
        out.doc["gpu_memory"]["before_mib"] = before.get("gpu_used_mib")
        out.doc["command"] = argv
        out.doc["vllm_log"] = parse_vllm_log(log_path.read_text(errors="replace"))
        out.doc["vllm"] = _env.dist_version("vllm")
        out.doc["config"] = {k: v for k, v in serve.meta.items() if k != "files"}
        out.doc["serve_target"] = serve.label or serve.target
        return self._finish(ctx, out)

    def _finish(self, ctx: BuildContext, out: Outcome) -> dict[str, Any]:
        p, doc = ctx.params, out.doc
        kn = write_outcome(ctx, out, p.slo_p99_ms, "p99 vs throughput", summary_lines)
        return {
            "passed": doc["passed"],
            "failures": out.failures,
            "startup_s": doc.get("startup_s"),
            "min_cosine": doc.get("min_cosine"),
            "mean_cosine": doc.get("mean_cosine"),
            "knee_concurrency": kn["concurrency"] if kn else None,
            "knee_tokens_per_s": kn["tokens_per_s"] if kn else None,
            "knee_requests_per_s": kn["requests_per_s"] if kn else None,
            "slo_p99_ms": p.slo_p99_ms,
            "engine_gpu_mib": (doc.get("gpu_memory") or {}).get("engine_mib"),
            "figures": ["loadtest.svg"],
        }


def check_server(
    server: Server,
    served: str,
    texts: list[str],
    ref: list[list[float]],
    tokenizer_dir: Path,
    p: Any,
    tmp: Path,
    log: Callable[[str], None],
) -> Outcome:
    """Every check against a healthy server's base_url (any launcher's)."""
    out = Outcome()
    doc = out.doc
    base = server.base_url
    models = served_models(base)
    doc["models"] = models
    if served not in models:
        out.failures.append(f"/v1/models lists {models}, not {served!r}")
        served = models[0] if models else served
    got = embed(base, served, texts, p.batch_size)
    cos = cosines(got, ref)
    doc["min_cosine"], doc["mean_cosine"] = min(cos), statistics.fmean(cos)
    doc["texts"] = len(texts)
    doc["embedding_dim"] = len(got[0]) if got else None
    if not doc["min_cosine"] >= p.min_cosine:
        out.failures.append(f"min cosine {doc['min_cosine']:.5f} < {p.min_cosine} (served vs fp32 reference)")
    m0 = read_metrics(base)
    spec = {
        "tool": p.loadtest_tool,
        "concurrency": list(p.concurrency),
        "input_len": p.input_len,
        "range_ratio": p.input_len_range,
        "texts_per_request": p.texts_per_request,
        "requests": [
            requests_for(c, p.requests_per_client, p.min_requests, p.max_requests) for c in p.concurrency
        ],
        "warmups": p.warmup_requests,
        "seed": 0,
    }
    steps = load_test(base, served, tokenizer_dir, spec, tmp / "loadtest.jsonl", p.loadtest_timeout_s, log)
    m1 = read_metrics(base)
    doc["metrics"] = {
        "series": sum(1 for k in m1 if k.startswith("vllm:")),
        "before": {k: m0[k] for k in KEPT_METRICS if k in m0},
        "after": {k: m1[k] for k in KEPT_METRICS if k in m1},
    }
    doc["loadtest"] = [s.to_json() for s in steps]
    doc["loadtest_spec"] = spec
    kn = knee(steps, p.slo_p99_ms)
    doc["slo_p99_ms"] = p.slo_p99_ms
    doc["knee"] = kn.to_json() if kn else None
    if not steps:
        out.failures.append("the load test finished no step")
    elif sum(s.errors for s in steps):
        out.failures.append(f"{sum(s.errors for s in steps)} load-test requests failed")
    return out


def summary_lines(doc: dict[str, Any]) -> list[str]:
    out = [
        f"start-up {doc.get('startup_s')} s; min cosine {doc.get('min_cosine', float('nan')):.6f} "
        f"(mean {doc.get('mean_cosine', float('nan')):.6f}); engine GPU memory "
        f"{(doc.get('gpu_memory') or {}).get('engine_mib')} MiB; vLLM log {doc.get('vllm_log')}",
        "concurrency  requests  errors  req/s     tokens/s    p50 ms   p90 ms   p99 ms",
    ]
    for s in doc.get("loadtest", []):
        out.append(
            f"{s['concurrency']:>11}  {s['requests']:>8}  {s['errors']:>6}  {s['requests_per_s']:>8.1f}  "
            f"{s['tokens_per_s']:>10,.0f}  {s['p50_ms']:>7.1f}  {s['p90_ms']:>7.1f}  {s['p99_ms']:>7.1f}"
        )
    kn = doc.get("knee")
    out.append(
        f"knee (p99 <= {doc.get('slo_p99_ms')} ms): "
        + (f"concurrency {kn['concurrency']}, {kn['tokens_per_s']:,.0f} tokens/s" if kn else "none")
    )
    return out
