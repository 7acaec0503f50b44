"""Issue #16 phase-1 probe on the H200 (standalone, no mopt): `vllm serve` a random
Qwen3-0.6B-shaped chat model, check /v1/completions and streaming /v1/chat/completions,
verify greedy tokens against a torch fp32 reference, load-test with vLLM's own
`vllm bench serve` (in-process, --save-result JSON per step), probe prefix caching.

  python3 probe_gen.py serve MODEL RES [--label bf16] [--extra "--no-enable-prefix-caching"] [--sweep 1,8,32,128,256] [--prefix]
  python3 probe_gen.py reference MODEL RES LABEL   # teacher-forced check of RES/LABEL-outputs.json
Everything lands in RES as it arrives.
"""

import argparse
import contextlib
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France.",
    "def add(a, b):\n    return a + b",
    "An H200 has 141 GB of HBM3e memory.",
]
LOG_PATTERNS = {
    "weights_gib": r"Model loading took ([\d.]+) GiB",
    "kv_cache_gib": r"Available KV cache memory: ([\d.]+) GiB",
    "kv_cache_tokens": r"GPU KV cache size: ([\d,]+) tokens",
    "max_concurrency_x": r"Maximum concurrency for ([\d,]+ tokens per request: [\d.]+)x",
    "torch_compile_s": r"torch\.compile took ([\d.]+) s",
    "graph_capture_s": r"Graph capturing finished in ([\d.]+) sec",
    "init_engine_s": r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s",
    "gpu_memory_utilization": r"gpu_memory_utilization=([\d.]+)",
    "max_num_batched_tokens": r"max_num_batched_tokens=(\d+)",
    "max_num_seqs": r"max_num_seqs=(\d+)",
    "max_model_len": r"max_model_len=(\d+)",
    "attention_backend": r"Using (\w+) attention backend",
    "chunked_prefill": r"(Chunked prefill is enabled[^\n]*)",
    "prefix_caching": r"enable_prefix_caching=(\w+)",
}


def wjson(path, obj):
    Path(path).write_text(json.dumps(obj, indent=2) + "\n")


def http(url, body=None, timeout=120):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read() or b"null")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gpu_mem():
    q = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                       capture_output=True, text=True).stdout
    g = subprocess.run(["nvidia-smi", "--query-gpu=memory.used,memory.total", "--format=csv,noheader,nounits"],
                       capture_output=True, text=True).stdout
    return {"processes_mib": q.strip().splitlines(), "gpu_used_total_mib": g.strip()}


def parse_log(text):
    out = {}
    for k, pat in LOG_PATTERNS.items():
        m = re.search(pat, text)
        if m:
            out[k] = m.group(1)
    return out


def stream_chat(base, model, messages, max_tokens=32):
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    req = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    chunks, first, text, usage, finish = 0, None, "", None, None
    with urllib.request.urlopen(req, timeout=120) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            obj = json.loads(data)
            if obj.get("usage"):
                usage = obj["usage"]
            for ch in obj.get("choices", []):
                delta = ch.get("delta", {}).get("content")
                if delta:
                    chunks += 1
                    text += delta
                    if first is None:
                        first = time.perf_counter() - t0
                finish = ch.get("finish_reason") or finish
    return {"chunks": chunks, "ttft_ms": first and first * 1e3, "total_ms": (time.perf_counter() - t0) * 1e3,
            "text_head": text[:120], "usage": usage, "finish_reason": finish}


def bench(base, model, tokenizer, res_dir, name, argv_extra):
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    p = FlexibleArgumentParser()
    add_cli_args(p)
    argv = ["--base-url", base, "--model", model, "--tokenizer", tokenizer, "--save-result",
            "--result-dir", str(res_dir), "--result-filename", f"{name}.json", "--disable-tqdm",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99", *argv_extra]
    print("$ vllm bench serve " + shlex.join(argv), flush=True)
    t0 = time.perf_counter()
    r = main(p.parse_args(argv))
    keep = {k: r.get(k) for k in ("completed", "failed", "duration", "request_throughput", "output_throughput",
                                   "total_token_throughput", "median_ttft_ms", "p99_ttft_ms", "median_itl_ms",
                                   "p99_itl_ms", "median_tpot_ms", "p99_tpot_ms", "total_input_tokens",
                                   "total_output_tokens")}
    keep["wall_s"] = round(time.perf_counter() - t0, 1)
    print(name, json.dumps(keep), flush=True)
    return keep


def cmd_serve(a):
    res = Path(a.res)
    res.mkdir(parents=True, exist_ok=True)
    tag = a.label
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    model_name = "qwen3-gen"
    argv = ["vllm", "serve", a.model, "--served-model-name", model_name, "--dtype", "bfloat16",
            "--host", "127.0.0.1", "--port", str(port), "--seed", "0", *shlex.split(a.extra)]
    log_path = res / f"{tag}-server.log"
    summary = {"argv": argv, "label": tag}
    t0 = time.monotonic()
    logf = open(log_path, "wb")
    proc = subprocess.Popen(argv, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited rc={proc.returncode}")
            with contextlib.suppress(Exception):
                with urllib.request.urlopen(base + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            if time.monotonic() - t0 > a.startup_timeout:
                raise RuntimeError("not healthy in time")
            time.sleep(0.5)
        summary["startup_s"] = round(time.monotonic() - t0, 1)
        summary["gpu_memory"] = gpu_mem()
        summary["vllm_log"] = parse_log(log_path.read_text(errors="replace"))
        summary["models"] = http(base + "/v1/models")
        print(json.dumps(summary), flush=True)
        wjson(res / f"{tag}-summary.json", summary)
        # completions with token ids in and out (greedy, top-5 logprobs as ids)
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(a.model)
        outs = []
        for text in PROMPTS:
            ids = tok(text, add_special_tokens=False)["input_ids"]
            r = http(base + "/v1/completions", {"model": model_name, "prompt": ids, "max_tokens": 16,
                                               "temperature": 0, "logprobs": 5, "return_tokens_as_token_ids": True,
                                               "ignore_eos": True})
            ch = r["choices"][0]
            toks = [int(t.split(":", 1)[1]) for t in ch["logprobs"]["tokens"]]
            outs.append({"prompt_ids": ids, "tokens": toks, "token_logprobs": ch["logprobs"]["token_logprobs"],
                         "top_logprobs": ch["logprobs"]["top_logprobs"], "text_head": ch["text"][:80],
                         "usage": r.get("usage")})
        wjson(res / f"{tag}-outputs.json", outs)
        summary["completions_ok"] = len(outs)
        summary["chat_stream"] = stream_chat(base, model_name, [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is the capital of France?"}])
        print("chat stream:", json.dumps(summary["chat_stream"]), flush=True)
        wjson(res / f"{tag}-summary.json", summary)
        bres = res / "bench"
        bres.mkdir(exist_ok=True)
        summary["bench"] = {}
        for c in [int(x) for x in a.sweep.split(",") if x]:
            n = max(16, min(4 * c, 1024))
            summary["bench"][f"c{c}"] = bench(base, model_name, a.model, bres, f"{tag}-chat-c{c}", [
                "--backend", "openai-chat", "--endpoint", "/v1/chat/completions", "--dataset-name", "random",
                "--random-input-len", str(a.input_len), "--random-output-len", str(a.output_len), "--ignore-eos",
                "--num-prompts", str(n), "--max-concurrency", str(c), "--num-warmups", str(min(c, 16)), "--seed", "0"])
            wjson(res / f"{tag}-summary.json", summary)
        if a.prefix:
            # a ChatBox: one shared 1024-token system prompt + a 128-token question, 64 tokens out
            pl, sl, ol, c, n = 1024, 128, 64, 16, 160
            m0 = metrics(base)
            summary["prefix"] = {"shared": bench(base, model_name, a.model, bres, f"{tag}-prefix-shared", [
                "--backend", "vllm", "--endpoint", "/v1/completions", "--dataset-name", "prefix_repetition",
                "--prefix-repetition-prefix-len", str(pl), "--prefix-repetition-suffix-len", str(sl),
                "--prefix-repetition-num-prefixes", "1", "--prefix-repetition-output-len", str(ol), "--ignore-eos",
                "--num-prompts", str(n), "--max-concurrency", str(c), "--seed", "1"])}
            m1 = metrics(base)
            summary["prefix"]["unshared"] = bench(base, model_name, a.model, bres, f"{tag}-prefix-unshared", [
                "--backend", "vllm", "--endpoint", "/v1/completions", "--dataset-name", "random",
                "--random-input-len", str(pl + sl), "--random-output-len", str(ol), "--ignore-eos",
                "--num-prompts", str(n), "--max-concurrency", str(c), "--seed", "2"])
            m2 = metrics(base)
            summary["prefix"]["metrics"] = {"before": m0, "after_shared": m1, "after_unshared": m2}
            wjson(res / f"{tag}-summary.json", summary)
        summary["metrics_end"] = metrics(base)
        summary["gpu_memory_end"] = gpu_mem()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        logf.close()
        summary["vllm_log"] = parse_log(log_path.read_text(errors="replace"))
        wjson(res / f"{tag}-summary.json", summary)


def metrics(base):
    with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
        text = r.read().decode()
    keep = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        for k in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:prompt_tokens_total",
                  "vllm:generation_tokens_total", "vllm:num_preemptions_total", "vllm:kv_cache_usage_perc"):
            if line.startswith(k):
                keep[k] = keep.get(k, 0.0) + float(line.rsplit(" ", 1)[1])
    return keep


def cmd_reference(a):
    """Teacher-forced on the served tokens: each served token's rank under the fp32 reference
    (same prefix), and greedy agreement (served vs reference argmax, first divergence)."""
    import torch
    from transformers import AutoModelForCausalLM

    res = Path(a.res)
    outs = json.loads((res / f"{a.label}-outputs.json").read_text())
    m = AutoModelForCausalLM.from_pretrained(a.reference, dtype=torch.float32).cuda().eval()
    rep = []
    with torch.inference_mode():
        for o in outs:
            ids = o["prompt_ids"] + o["tokens"]
            logits = m(torch.tensor([ids]).cuda()).logits[0].float()
            lp = torch.log_softmax(logits, -1)
            P = len(o["prompt_ids"])
            ranks, agree, first_div, dlp = [], [], None, []
            for i, t in enumerate(o["tokens"]):
                row = lp[P - 1 + i]
                ranks.append(int((row > row[t]).sum()))
                am = int(row.argmax())
                agree.append(am == t)
                if am != t and first_div is None:
                    first_div = i
                dlp.append(float(row[t]) - float(o["token_logprobs"][i]))
            rep.append({"ranks": ranks, "top1_agree": sum(agree) / len(agree), "first_divergence": first_div,
                        "max_abs_logprob_diff": max(abs(x) for x in dlp)})
    out = {"label": a.label, "reference": a.reference, "per_prompt": rep,
           "top1_agree": sum(r["top1_agree"] for r in rep) / len(rep),
           "max_rank": max(max(r["ranks"]) for r in rep)}
    wjson(res / f"{a.label}-reference.json", out)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve")
    s.add_argument("model")
    s.add_argument("res")
    s.add_argument("--label", default="bf16")
    s.add_argument("--extra", default="")
    s.add_argument("--sweep", default="1,8,32,128,256")
    s.add_argument("--input-len", type=int, default=512)
    s.add_argument("--output-len", type=int, default=128)
    s.add_argument("--prefix", action="store_true")
    s.add_argument("--startup-timeout", type=float, default=300)
    r = sub.add_parser("reference")
    r.add_argument("reference")
    r.add_argument("res")
    r.add_argument("label")
    a = ap.parse_args()
    {"serve": cmd_serve, "reference": cmd_reference}[a.cmd](a)
