"""serve-check for text generation: the checks a served chat LLM gets, on its `base_url` alone.

* **endpoints**: /v1/completions (greedy, token ids in, `logprobs` with `return_tokens_as_token_ids`
  out), /v1/completions and /v1/chat/completions **streaming** (SSE `data:` chunks up to
  `data: [DONE]`; the chat request goes through the tokenizer's chat template on the server,
  and the prompt token count it reports is compared with the same template applied here).
* **distributions against the reference** (the default gates): held-out passages (the recipe's
  `texts`, never calibration) teacher-forced through the server (vLLM's `prompt_logprobs`: per
  position the served top-k log-probs and the real next token's) and through the fp32 PyTorch
  reference: mean KL(ref || served) and its 99th percentile (gates `max_kl`, `max_kl_p99`, the
  values of `validate`'s), perplexity ratio (`max_ppl_ratio`, off unless set) and same-top-1
  rate. The KL is that of the two distributions coarsened to the served top-k tokens and one
  "rest" bucket: a lower bound of the full KL, close to it when the top-k holds most of the mass.
* **verification of greedy decoding**: the served greedy continuation of held-out prompts,
  teacher-forced through the fp32 PyTorch reference (one forward over prompt + served tokens):
  the share of served tokens that are the reference's argmax (`top1`, gated by `min_top1` only
  where the recipe sets it), each served token's rank under the reference, and the first
  position where they differ (`greedy_prefix`: the mean share before it).
* **load test** (the worker runs `vllm bench serve`, backend `openai-chat`, its `random`
  dataset with `--ignore-eos`, one seed per step so no step reuses another's prompts from the
  prefix cache): per concurrency TTFT / ITL / TPOT / end-to-end p50 / p90 / p99, output and
  total tokens/s, requests/s, errors; the knee is the highest concurrency whose p99 **TTFT**
  meets `ttft_slo_ms` (a ChatBox wants < 300 ms).
* **prefix caching**: a shared-system-prompt workload (`prefix_repetition`, one prefix) against
  the same lengths without a shared prefix, on the same server; TTFT of both and the server's
  prefix-cache hit rate (/metrics) over each.

Steps keep the embedding load test's generic keys too (`tokens_per_s` = output tokens/s,
`p50_ms` / `p90_ms` / `p99_ms` = TTFT), so `select` and the latency plot read both tasks.
Measured on the H200 (2026-12-01, docs/h200-gen-2026-12-01): what the recorded fixtures in
tests/data/h200-gen-2026-12-01 hold.
"""

from __future__ import annotations

import json
import math
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mopt.api import plugin_env as _env
from mopt_serve.server import http_json

#: the /metrics series a generation serve-check keeps
GEN_METRICS = (
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:request_success_total",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:num_preemptions_total",
    "vllm:kv_cache_usage_perc",
)


# --------------------------------------------------------------------------- endpoints


def greedy_completions(
    base: str, model: str, prompts: list[list[int]], max_tokens: int, top_k: int = 5
) -> list[dict[str, Any]]:
    """Greedy continuations of token-id prompts from /v1/completions, as token ids with their
    logprobs (`return_tokens_as_token_ids`: "token_id:N" keys), EOS ignored so every prompt
    gets `max_tokens`."""
    out = []
    for ids in prompts:
        r = http_json(
            base + "/v1/completions",
            {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "logprobs": top_k,
             "return_tokens_as_token_ids": True, "ignore_eos": True},
        )  # fmt: skip
        ch = r["choices"][0]
        lp = ch.get("logprobs") or {}
        toks = [token_id(t) for t in lp.get("tokens", [])]
        if not toks or any(t is None for t in toks):
            raise RuntimeError(f"/v1/completions gave no token ids in logprobs.tokens: {str(lp)[:200]}")
        out.append({"prompt_ids": ids, "tokens": toks, "token_logprobs": lp.get("token_logprobs", []),
                    "text_head": str(ch.get("text", ""))[:80], "usage": r.get("usage")})  # fmt: skip
    return out


def token_id(t: str) -> int | None:
    """17 from "token_id:17"; None for anything else."""
    if isinstance(t, str) and t.startswith("token_id:"):
        try:
            return int(t.split(":", 1)[1])
        except ValueError:
            return None
    return None


def stream(base: str, path: str, body: dict[str, Any], timeout: float = 120.0) -> dict[str, Any]:
    """POST a `stream: true` request, read its SSE chunks to `data: [DONE]`: text chunks, time to
    the first one, usage (when `stream_options.include_usage`), finish reason."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    req = urllib.request.Request(
        base + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    t0 = time.perf_counter()
    chunks, first, text, usage, finish, done = 0, None, "", None, None, False
    with urllib.request.urlopen(req, timeout=timeout) as r:
        ctype = r.headers.get("Content-Type", "")
        for raw in r:
            line = raw.decode(errors="replace").strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
                break
            obj = json.loads(data)
            usage = obj.get("usage") or usage
            for ch in obj.get("choices") or []:
                piece = (ch.get("delta") or {}).get("content") if "delta" in ch else ch.get("text")
                if piece:
                    chunks += 1
                    text += piece
                    if first is None:
                        first = time.perf_counter() - t0
                finish = ch.get("finish_reason") or finish
    return {"chunks": chunks, "ttft_ms": None if first is None else round(first * 1e3, 2),
            "total_ms": round((time.perf_counter() - t0) * 1e3, 2), "done": done, "content_type": ctype,
            "usage": usage, "finish_reason": finish, "text_head": text[:80]}  # fmt: skip


CHAT_PROBE = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of France?"},
]


def endpoint_checks(
    base: str, model: str, tokenizer: Any, max_tokens: int = 16
) -> tuple[dict[str, Any], list[str]]:
    """Streaming /v1/completions and /v1/chat/completions answer; the chat prompt's token count
    is the local tokenizer's chat template's (so the server used the tokenizer's template)."""
    doc: dict[str, Any] = {}
    failures: list[str] = []
    comp = stream(base, "/v1/completions", {"model": model, "prompt": "The capital of France is",
                                             "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})  # fmt: skip
    chat = stream(base, "/v1/chat/completions", {"model": model, "messages": CHAT_PROBE, "max_tokens": max_tokens,
                                                  "temperature": 0, "ignore_eos": True})  # fmt: skip
    doc["completions_stream"], doc["chat_stream"] = comp, chat
    for name, s in (("/v1/completions", comp), ("/v1/chat/completions", chat)):
        if not s["done"] or s["chunks"] == 0:
            failures.append(
                f"{name} streaming: {s['chunks']} text chunks, [DONE] {'seen' if s['done'] else 'missing'}"
            )
        got = (s.get("usage") or {}).get("completion_tokens")
        if got is not None and got != max_tokens:
            failures.append(f"{name} streaming: {got} completion tokens, asked for {max_tokens} (ignore_eos)")
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        want = len(chat_template_ids(tokenizer, CHAT_PROBE))
        got = (chat.get("usage") or {}).get("prompt_tokens")
        doc["chat_template_prompt_tokens"] = {"served": got, "tokenizer": want}
        if got is not None and got != want:
            failures.append(
                f"/v1/chat/completions counted {got} prompt tokens, the tokenizer's chat template gives {want}: "
                "the server is not using the model's chat template"
            )
    return doc, failures


def chat_template_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


def served_prompt_logprobs(base: str, model: str, prompts: list[list[int]], top_k: int) -> list[list[dict[int, float]]]:
    """The served model's teacher-forced next-token log-probs over token-id `prompts`: vLLM's
    `prompt_logprobs = top_k` on /v1/completions (max_tokens 1). Its answer,
    `choices[0].prompt_logprobs`, has one entry per prompt token, None for the first, else
    {token id: {"logprob", "rank", "decoded_token"}} holding the top-k and the prompt's own
    token; per prompt, the dicts of positions 1.. as {id: logprob} (entry t: what the server
    gave ids[t] and its rivals after ids[:t]). `top_k` above the server's --max-logprobs (20
    by default) is refused by vLLM."""
    out = []
    for ids in prompts:
        r = http_json(base + "/v1/completions", {"model": model, "prompt": ids, "max_tokens": 1, "temperature": 0,
                                                 "prompt_logprobs": top_k})  # fmt: skip
        pl = (r.get("choices") or [{}])[0].get("prompt_logprobs")
        if not isinstance(pl, list) or len(pl) != len(ids) or any(not isinstance(d, dict) for d in pl[1:]):
            raise RuntimeError(
                f"/v1/completions gave no prompt_logprobs for a {len(ids)}-token prompt (vLLM's extension, "
                f"prompt_logprobs = {top_k}): {str(pl)[:200]}"
            )
        out.append([{int(t): float(v["logprob"] if isinstance(v, dict) else v) for t, v in d.items()} for d in pl[1:]])
    return out


def held_out_distribution(
    prompts: list[list[int]], served: list[list[dict[int, float]]], logprobs: Any, top_k: int
) -> dict[str, Any]:
    """Served vs reference next-token distributions over held-out `prompts` (teacher-forced).
    `served`: `served_prompt_logprobs`' answer; `logprobs(ids)`: the reference's log-softmax
    rows [len(ids), vocab]. Per position, KL(ref || served) over the served top-k tokens and a
    "rest" bucket (nats), same top-1, and each side's -log p of the real next token. Returns
    mean / p99 (numpy's linear interpolation) / max KL, top-1 agreement, perplexities and their
    ratio, positions; a position whose served log-probs are not finite is charged 50 nats."""
    import numpy as np

    kl, agree, nll_r, nll_s = [], [], [], []
    for ids, rows in zip(prompts, served, strict=True):
        ref = np.asarray(logprobs(ids), dtype=np.float64)
        for t, got in enumerate(rows):  # position t predicts ids[t + 1]
            r, nxt = ref[t], ids[t + 1]
            toks = np.fromiter(got, dtype=np.int64)
            q = np.fromiter(got.values(), dtype=np.float64)
            if not np.isfinite(q).all() or nxt not in got:
                kl.append(50.0)
                agree.append(False)
                nll_r.append(-r[nxt])
                nll_s.append(50.0)
                continue
            p = np.exp(r[toks])
            p_rest, q_rest = max(1.0 - float(p.sum()), 0.0), max(1.0 - float(np.exp(q).sum()), 1e-12)
            d = float(np.sum(p * (r[toks] - q)))
            if p_rest > 0:
                d += p_rest * (math.log(p_rest) - math.log(q_rest))
            kl.append(max(d, 0.0))
            agree.append(int(toks[np.argmax(q)]) == int(np.argmax(r)))
            nll_r.append(-r[nxt])
            nll_s.append(-got[nxt])
    if not kl:
        raise ValueError("no held-out positions: every passage is shorter than 2 tokens")
    arr = np.asarray(kl)
    sig = lambda x: float(f"{float(x):.7g}")  # noqa: E731  (7 digits, as validate's report)
    return {
        "positions": len(kl), "passages": len(prompts), "served_top_k": top_k,
        "kl_mean": sig(arr.mean()), "kl_p99": sig(np.quantile(arr, 0.99)), "kl_max": sig(arr.max()),
        "top1_agreement": sig(np.mean(agree)), "ppl_reference": sig(math.exp(min(float(np.mean(nll_r)), 700.0))),
        "ppl_served": sig(math.exp(min(float(np.mean(nll_s)), 700.0))),
        "ppl_ratio": sig(math.exp(min(float(np.mean(nll_s) - np.mean(nll_r)), 700.0))),
    }  # fmt: skip


def gen_gate_failures(doc: dict[str, Any], p: Any) -> list[str]:
    """The generation gates serve.json's numbers fail: `max_kl`, `max_kl_p99` and
    `max_ppl_ratio` on the held-out distributions (`doc["distribution"]`), `min_top1` on the
    served greedy tokens (`doc["verify"]`); a gate whose number was not measured fails."""
    out = []
    dist, v = doc.get("distribution"), doc.get("verify") or {}
    for gate, key, label in (("max_kl", "kl_mean", "kl_mean"), ("max_kl_p99", "kl_p99", "kl_p99"),
                             ("max_ppl_ratio", "ppl_ratio", "ppl_ratio")):  # fmt: skip
        limit = getattr(p, gate)
        if limit is None:
            continue
        if dist is None:
            out.append(f"{label} not measured (gate {gate} = {limit}; kl_passages = 0)")
        elif not dist[key] <= limit:
            out.append(
                f"held-out {label} {dist[key]:.4f} > {limit} ({gate}; served top-{dist['served_top_k']} vs fp32, "
                f"{dist['positions']} positions)"
            )
    if p.min_top1 is not None and not v.get("top1", 0.0) >= p.min_top1:
        out.append(
            f"served greedy tokens are the fp32 reference's top-1 for {v.get('top1', 0.0):.3f} of "
            f"{v.get('tokens')} positions < min_top1 {p.min_top1}"
        )
    return out


# --------------------------------------------------------------------------- reference


def teacher_forced(outputs: list[dict[str, Any]], logprob_rows: Any) -> dict[str, Any]:
    """Compare served greedy tokens with the reference. `logprob_rows(prompt_ids, tokens)` gives,
    per served position, the reference's log-probabilities over the vocabulary (a sequence of
    rows supporting `argmax()` and indexing). Per prompt: top-1 agreement, ranks, first
    divergence; overall `top1` and `max_rank`."""
    per = []
    prefixes: list[float] = []
    for o in outputs:
        rows = logprob_rows(o["prompt_ids"], o["tokens"])
        ranks, agree, first = [], 0, None
        for i, t in enumerate(o["tokens"]):
            row = rows[i]
            r = int((row > row[t]).sum())
            ranks.append(r)
            if r == 0:
                agree += 1
            elif first is None:
                first = i
        per.append({"ranks": ranks, "top1": agree / max(len(o["tokens"]), 1), "first_divergence": first})
        prefixes.append((len(o["tokens"]) if first is None else first) / max(len(o["tokens"]), 1))
    n = sum(len(o["tokens"]) for o in outputs)
    return {
        "prompts": len(outputs),
        "tokens": n,
        "top1": sum(p["top1"] * len(o["tokens"]) for p, o in zip(per, outputs, strict=True)) / max(n, 1),
        # the reference's own greedy path equals the served one up to the first divergence
        "greedy_prefix": sum(prefixes) / max(len(prefixes), 1),
        "max_rank": max((max(p["ranks"]) for p in per if p["ranks"]), default=None),
        "first_divergence_min": min(
            (p["first_divergence"] for p in per if p["first_divergence"] is not None), default=None
        ),
        "per_prompt": per,
    }


def torch_reference_logprobs(weights: Path, device: str | None = None) -> Any:
    """`logprobs(ids)`: an fp32 causal LM's log-softmax rows [len(ids), vocab] for a token-id
    sequence (row t: the next-token distribution after ids[:t + 1]), on the GPU when there
    is one, returned on the CPU."""
    import torch
    from transformers import AutoModelForCausalLM

    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = AutoModelForCausalLM.from_pretrained(str(weights), dtype=torch.float32).to(dev).eval()

    def logprobs(ids: list[int]) -> Any:
        with torch.inference_mode():
            x = torch.tensor([list(ids)], device=dev)
            return torch.log_softmax(model(input_ids=x).logits[0].float(), -1).cpu()

    return logprobs


def reference_rows(logprobs: Any) -> Any:
    """`logprob_rows` for `teacher_forced` from `torch_reference_logprobs`' function."""

    def rows(prompt_ids: list[int], tokens: list[int]) -> Any:
        p = len(prompt_ids)
        return logprobs(list(prompt_ids) + list(tokens))[p - 1 : p - 1 + len(tokens)]

    return rows


def torch_reference_rows(weights: Path, device: str | None = None) -> Any:
    """`logprob_rows` for `teacher_forced` from an fp32 causal LM (GPU when there is one)."""
    return reference_rows(torch_reference_logprobs(weights, device))


# --------------------------------------------------------------------------- load-test steps


@dataclass
class GenStep:
    """One load level of a generation load test (`vllm bench serve` at one max concurrency)."""

    concurrency: int
    requests: int
    completed: int
    errors: int
    duration_s: float
    requests_per_s: float
    output_tokens_per_s: float
    total_tokens_per_s: float
    ttft_p50_ms: float
    ttft_p90_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    tpot_p50_ms: float
    tpot_p99_ms: float
    e2el_p50_ms: float
    e2el_p99_ms: float
    input_tokens: int
    output_tokens: int
    tool: str = "vllm bench serve"
    result_file: str = ""
    error_sample: str = ""

    def to_json(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        # the generic keys the embedding load test has (select, the plot, summary lines)
        d.update(tokens_per_s=self.output_tokens_per_s, p50_ms=self.ttft_p50_ms, p90_ms=self.ttft_p90_ms,
                 p99_ms=self.ttft_p99_ms, mean_ms=self.ttft_p50_ms, metric="ttft")  # fmt: skip
        return d


def _f(r: dict[str, Any], *keys: str) -> float:
    for k in keys:
        if r.get(k) is not None:
            return float(r[k])
    return math.nan


def gen_step_from_bench(
    result: dict[str, Any], concurrency: int | None = None, result_file: str = ""
) -> GenStep:
    """A step from `vllm bench serve`'s result (its --save-result JSON or `main()`'s dict), run
    with `--percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99`."""
    completed = int(result["completed"])
    requests = max(int(result.get("num_prompts") or 0), completed + int(result.get("failed") or 0))
    errs = [e for e in result.get("errors", []) if e]
    c = concurrency if concurrency is not None else result.get("max_concurrency")
    return GenStep(
        concurrency=int(c) if c is not None else 0,
        requests=requests,
        completed=completed,
        errors=max(requests - completed, 0),
        duration_s=float(result["duration"]),
        requests_per_s=float(result["request_throughput"]),
        output_tokens_per_s=float(result["output_throughput"]),
        total_tokens_per_s=float(result["total_token_throughput"]),
        ttft_p50_ms=_f(result, "p50_ttft_ms", "median_ttft_ms"),
        ttft_p90_ms=_f(result, "p90_ttft_ms"),
        ttft_p99_ms=_f(result, "p99_ttft_ms"),
        itl_p50_ms=_f(result, "p50_itl_ms", "median_itl_ms"),
        itl_p99_ms=_f(result, "p99_itl_ms"),
        tpot_p50_ms=_f(result, "p50_tpot_ms", "median_tpot_ms"),
        tpot_p99_ms=_f(result, "p99_tpot_ms"),
        e2el_p50_ms=_f(result, "p50_e2el_ms", "median_e2el_ms"),
        e2el_p99_ms=_f(result, "p99_e2el_ms"),
        input_tokens=int(result.get("total_input_tokens") or 0),
        output_tokens=int(result.get("total_output_tokens") or 0),
        result_file=result_file,
        error_sample=errs[0][:200] if errs else "",
    )


def gen_knee(steps: list[dict[str, Any]], ttft_slo_ms: float) -> dict[str, Any] | None:
    """The highest concurrency whose p99 TTFT meets the SLO with no failed request."""
    ok = [s for s in steps if s.get("probe") is None and s["errors"] == 0 and s["completed"] > 0
          and s["ttft_p99_ms"] <= ttft_slo_ms]  # fmt: skip
    return max(ok, key=lambda s: s["concurrency"]) if ok else None


def prefix_effect(shared: dict[str, Any], unshared: dict[str, Any]) -> dict[str, Any]:
    """TTFT and throughput with a shared system prompt vs the same lengths without one, and the
    prefix-cache hit rate the server counted over each (`metrics_delta` of the steps)."""

    def hit_rate(s: dict[str, Any]) -> float | None:
        d = s.get("metrics_delta") or {}
        q = d.get("vllm:prefix_cache_queries_total")
        return round(d.get("vllm:prefix_cache_hits_total", 0.0) / q, 4) if q else None

    return {
        "shared": {
            k: shared[k] for k in ("ttft_p50_ms", "ttft_p99_ms", "output_tokens_per_s", "requests_per_s")
        },
        "unshared": {
            k: unshared[k] for k in ("ttft_p50_ms", "ttft_p99_ms", "output_tokens_per_s", "requests_per_s")
        },
        "ttft_p50_ratio": round(unshared["ttft_p50_ms"] / shared["ttft_p50_ms"], 3)
        if shared["ttft_p50_ms"]
        else None,
        "hit_rate_shared": hit_rate(shared),
        "hit_rate_unshared": hit_rate(unshared),
    }


def summary_lines(doc: dict[str, Any]) -> list[str]:
    v = doc.get("verify") or {}
    out = [
        f"start-up {doc.get('startup_s')} s; greedy vs fp32 reference: top-1 {v.get('top1', float('nan')):.3f} "
        f"over {v.get('tokens')} tokens, max rank {v.get('max_rank')}; engine GPU memory "
        f"{(doc.get('gpu_memory') or {}).get('engine_mib')} MiB; vLLM log {doc.get('vllm_log')}",
        "concurrency  requests  errors  req/s   out tok/s  TTFT p50  TTFT p99  ITL p50  ITL p99",
    ]
    d = doc.get("distribution")
    if d:
        out.insert(1, f"held-out vs fp32 ({d['positions']} positions, served top-{d['served_top_k']}): KL mean "
                      f"{d['kl_mean']:.4g}, p99 {d['kl_p99']:.4g}; ppl ratio {d['ppl_ratio']:.4f}; same top-1 "
                      f"{d['top1_agreement']:.3f}")  # fmt: skip
    for s in doc.get("loadtest", []):
        out.append(
            f"{s['concurrency']:>11}  {s['requests']:>8}  {s['errors']:>6}  {s['requests_per_s']:>6.1f}  "
            f"{s['output_tokens_per_s']:>9,.0f}  {s['ttft_p50_ms']:>8.1f}  {s['ttft_p99_ms']:>8.1f}  "
            f"{s['itl_p50_ms']:>7.2f}  {s['itl_p99_ms']:>7.2f}"
        )
    kn = doc.get("knee")
    out.append(
        f"knee (p99 TTFT <= {doc.get('ttft_slo_ms')} ms): "
        + (
            f"concurrency {kn['concurrency']}, {kn['output_tokens_per_s']:,.0f} output tokens/s"
            if kn
            else "none"
        )
    )
    pe = doc.get("prefix_caching")
    if pe:
        out.append(
            f"prefix caching (shared system prompt): TTFT p50 {pe['shared']['ttft_p50_ms']:.1f} ms vs "
            f"{pe['unshared']['ttft_p50_ms']:.1f} ms unshared ({pe['ttft_p50_ratio']}x), hit rate "
            f"{pe['hit_rate_shared']} vs {pe['hit_rate_unshared']}"
        )
    return out


# --------------------------------------------------------------------------- the kind's generation path


def gen_requests(concurrency: int, per_client: int, least: int, most: int) -> int:
    """Requests in one generation step: each lasts output_len tokens, so far fewer than an
    embedding step's, within [least, most]."""
    return max(least, min(most, concurrency * per_client))


def run_generation(ctx: Any, kind: Any) -> dict[str, Any]:
    """serve-check of a text-generation model: start vLLM from the `vllm` artifact, check the
    endpoints, the greedy continuation, the load test and the prefix probe; stop the server;
    then verify the served tokens against the fp32 reference."""
    import os

    from mopt_serve import server as sc

    p = ctx.params
    serve, model, ref_art = ctx.input("serve"), ctx.input("model"), ctx.input("reference")
    held = sc.DEFAULT_TEXTS
    if p.texts:
        held = sc.read_texts_file((ctx.project_dir / p.texts).resolve(), max(p.gen_prompts, 4 * p.kl_passages, 1))
    texts = (held * (p.gen_prompts // len(held) + 1))[: p.gen_prompts]
    tokenizer = None
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(model.path))
    except Exception as e:  # the checks that need it say so
        ctx.log(f"no tokenizer from {model.path}: {type(e).__name__}: {e}")
    if tokenizer is None:
        raise RuntimeError(f"serve-check: the model folder of {model.target!r} has no loadable tokenizer")
    prompts = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    passages = [" ".join(held[i : i + 4]) for i in range(0, len(held), 4)][: p.kl_passages]
    kl_ids = [x for x in (tokenizer(t, add_special_tokens=False)["input_ids"][: p.kl_max_tokens] for t in passages)
              if len(x) >= 2]  # fmt: skip
    args = json.loads((serve.path / "args.json").read_text())
    port = sc.free_port()
    argv = sc.serve_command(args, model.path, serve.path, port)
    served = serve.meta.get("served_model_name") or ctx.model_name
    log_path = ctx.out / "server.log"
    before = sc.gpu_memory(None)
    ctx.log("$ " + " ".join(argv))
    out = sc.Outcome()
    doc, failures = out.doc, out.failures
    env = {**os.environ, **args.get("env", {})}
    outputs: list[dict[str, Any]] = []
    with sc.local_vllm(argv, log_path, port=port, startup_timeout_s=p.startup_timeout_s, env=env) as server:
        doc["startup_s"] = round(server.startup_s, 1)
        doc["gpu_memory"] = sc.gpu_memory(server.pid)
        base = server.base_url
        models = sc.served_models(base)
        doc["models"] = models
        if served not in models:
            failures.append(f"/v1/models lists {models}, not {served!r}")
            served = models[0] if models else served
        outputs = greedy_completions(base, served, prompts, p.gen_tokens)
        served_lp = served_prompt_logprobs(base, served, kl_ids, p.kl_top_k) if kl_ids else []
        ep, bad = endpoint_checks(base, served, tokenizer, p.gen_tokens)
        doc.update(ep)
        failures += bad
        m0 = sc.read_metrics(base)
        spec: dict[str, Any] = {
            "task": "text-generation",
            "concurrency": list(p.concurrency),
            "requests": [
                gen_requests(c, p.gen_requests_per_client, p.gen_min_requests, p.gen_max_requests)
                for c in p.concurrency
            ],
            "input_len": p.input_len,
            "output_len": p.output_len,
            "range_ratio": p.input_len_range,
            "warmups": p.warmup_requests,
            "seed": 0,
            "endpoint": p.loadtest_endpoint,
            "result_dir": str(ctx.out / "bench"),
        }
        if p.prefix_probe:
            spec["prefix"] = {"prefix_len": p.prefix_len, "suffix_len": p.prefix_suffix_len,
                              "output_len": p.prefix_output_len, "concurrency": p.prefix_concurrency,
                              "requests": p.prefix_requests}  # fmt: skip
        steps = run_gen_load_test(base, served, model.path, spec, ctx.tmp / "loadtest.jsonl", p.loadtest_timeout_s,
                                  ctx.log)  # fmt: skip
        m1 = sc.read_metrics(base)
        doc["gpu_memory_after_load"] = sc.gpu_memory(server.pid)
    doc["gpu_memory"]["before_mib"] = before.get("gpu_used_mib")
    doc["metrics"] = {"before": {k: m0[k] for k in GEN_METRICS if k in m0},
                      "after": {k: m1[k] for k in GEN_METRICS if k in m1}}  # fmt: skip
    doc["loadtest"] = [s for s in steps if s.get("probe") is None]
    probes = {s["probe"]: s for s in steps if s.get("probe")}
    doc["loadtest_spec"] = spec
    doc["ttft_slo_ms"] = p.ttft_slo_ms
    doc["slo_p99_ms"] = p.ttft_slo_ms  # select compares knees at one SLO: here the p99 TTFT one
    doc["knee"] = gen_knee(doc["loadtest"], p.ttft_slo_ms)
    if "prefix-shared" in probes and "prefix-unshared" in probes:
        doc["prefix_caching"] = prefix_effect(probes["prefix-shared"], probes["prefix-unshared"])
        doc["prefix_probe"] = [probes["prefix-shared"], probes["prefix-unshared"]]
    elif p.prefix_probe:
        failures.append("the prefix-caching probe did not finish")
    if not doc["loadtest"]:
        failures.append("the load test finished no step")
    elif sum(s["errors"] for s in doc["loadtest"]):
        failures.append(f"{sum(s['errors'] for s in doc['loadtest'])} load-test requests failed")
    # after the server is gone: the GPU is free for the fp32 reference
    ctx.log(
        f"reference: fp32 PyTorch on {ref_art.target!r}, {len(outputs)} held-out prompts x {p.gen_tokens} tokens"
    )
    doc["greedy"] = outputs
    logprobs = torch_reference_logprobs(ref_art.path)
    doc["verify"] = teacher_forced(outputs, reference_rows(logprobs))
    if kl_ids:
        ctx.log(f"held-out distributions: {len(kl_ids)} passages, served top-{p.kl_top_k} vs fp32")
        doc["distribution"] = held_out_distribution(kl_ids, served_lp, logprobs, p.kl_top_k)
    doc["gates"] = {k: getattr(p, k) for k in ("max_kl", "max_kl_p99", "max_ppl_ratio", "min_top1")}
    doc["min_top1"] = p.min_top1
    failures += gen_gate_failures(doc, p)
    doc["command"] = argv
    doc["vllm_log"] = sc.parse_vllm_log(log_path.read_text(errors="replace"))
    doc["vllm"] = _env.dist_version("vllm")
    doc["config"] = {k: v for k, v in serve.meta.items() if k != "files"}
    doc["serve_target"] = serve.label or serve.target
    doc["task"] = "text-generation"
    return finish_generation(ctx, out)


def run_gen_load_test(
    base: str, model: str, tokenizer: Path, spec: dict[str, Any], out_jsonl: Path, timeout_s: float, log: Any
) -> list[dict[str, Any]]:
    """The load-test worker on a generation spec; the steps it finished (a timeout keeps them)."""
    import subprocess
    import sys

    from mopt_serve.server import LOADTEST_WORKER

    spec = {**spec, "base_url": base, "model": model, "tokenizer": str(tokenizer), "out": str(out_jsonl)}
    spec_path = out_jsonl.with_suffix(".spec.json")
    spec_path.write_text(json.dumps(spec))
    argv = [sys.executable, str(LOADTEST_WORKER), str(spec_path)]
    log("$ " + " ".join(argv))
    try:
        proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                              timeout=timeout_s)  # fmt: skip
        lines = proc.stdout.splitlines()
        for line in [ln for ln in lines if " req/s " in ln] or lines[-30:]:
            log("  loadtest: " + line)
        if proc.returncode != 0:
            for line in lines[-15:]:
                log("  loadtest: " + line)
    except subprocess.TimeoutExpired:
        log(f"load test stopped after {timeout_s:.0f} s; keeping the steps it finished")
    if not out_jsonl.is_file():
        return []
    return [json.loads(line) for line in out_jsonl.read_text().splitlines() if line.strip()]


def finish_generation(ctx: Any, out: Any) -> dict[str, Any]:
    from mopt_serve.server import write_outcome

    p, doc = ctx.params, out.doc
    kn = write_outcome(ctx, out, p.ttft_slo_ms, "p99 TTFT vs output tokens/s", summary_lines)
    v = doc.get("verify") or {}
    pe = doc.get("prefix_caching") or {}
    return {
        "passed": doc["passed"],
        "failures": out.failures,
        "task": "text-generation",
        "startup_s": doc.get("startup_s"),
        "top1": v.get("top1"),
        "greedy_prefix": v.get("greedy_prefix"),
        **{k: (doc.get("distribution") or {}).get(k) for k in ("kl_mean", "kl_p99", "ppl_ratio", "top1_agreement")},
        "max_rank": v.get("max_rank"),
        "knee_concurrency": kn["concurrency"] if kn else None,
        "knee_tokens_per_s": kn["output_tokens_per_s"] if kn else None,
        "knee_requests_per_s": kn["requests_per_s"] if kn else None,
        "knee_ttft_p99_ms": kn["ttft_p99_ms"] if kn else None,
        "ttft_slo_ms": p.ttft_slo_ms,
        "slo_p99_ms": p.ttft_slo_ms,
        "prefix_ttft_p50_ratio": pe.get("ttft_p50_ratio"),
        "engine_gpu_mib": (doc.get("gpu_memory") or {}).get("engine_mib"),
        "figures": ["loadtest.svg"],
    }
