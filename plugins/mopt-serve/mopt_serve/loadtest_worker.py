"""serve-check's load-test worker, run as `python loadtest_worker.py spec.json` (its own process,
so vLLM's benchmark code never loads into mopt's). One closed-loop step per concurrency; each
finished step is appended to `spec["out"]` as one JSON line at once, so a timeout keeps them.

tool "vllm-bench" runs vLLM's own `vllm bench serve` (`vllm.benchmarks.serve.main`, backend
`openai-embeddings`, its `random` dataset) in this process, once per step, so vLLM is imported
once for the sweep instead of once per step (~10 s each). Its pooling result gives requests/s,
tokens/s (prompt tokens the server counted) and e2e-latency percentiles.

A generation spec (`"task": "text-generation"`) runs `vllm bench serve --backend openai-chat`
on the random dataset (`--ignore-eos`, one seed per step), saving each step's result JSON
(`--save-result`) in `spec["result_dir"]`, then, with `spec["prefix"]`, the prefix-caching
probe: a shared-prefix workload (`prefix_repetition`, one prefix) and the same lengths without
one, each with the server's /metrics counters before and after. It has no fallback tool: the
numbers that matter (TTFT, ITL) need a streaming client, and vLLM's is the field's.

tool "mopt-loop" is the fallback for a machine where vLLM's benchmark code does not import or
run (it needs aiohttp, pybase64, PIL): stdlib threads, one keep-alive HTTP connection each,
sending the next request when the last one answered. The worker switches to it, and says so in
each step's `tool`, when the vLLM path fails on its first step.
"""

from __future__ import annotations

import http.client
import json
import random
import socket
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

HERE = Path(__file__).resolve().parent
# run as a script, Python puts this file's folder first on sys.path, where mopt_serve's own
# vllm.py would shadow the real vLLM ("No module named 'vllm.benchmarks'; 'vllm' is not a
# package": what happened on the H200, 2026-12-01, so every step fell back to mopt-loop)
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
if str(HERE.parent) not in sys.path:
    sys.path.append(str(HERE.parent))  # mopt_serve's own statistics, whatever the cwd

from mopt_serve.gen_check import gen_step_from_bench  # noqa: E402
from mopt_serve.serve_check import parse_metrics, step_from_latencies, step_from_vllm_bench  # noqa: E402


def vllm_bench_step(spec: dict[str, Any], concurrency: int, n: int) -> dict[str, Any]:
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    argv = [
        "--backend", "openai-embeddings", "--endpoint", "/v1/embeddings",
        "--base-url", spec["base_url"], "--model", spec["tokenizer"], "--served-model-name", spec["model"],
        "--tokenizer", spec["tokenizer"], "--dataset-name", "random",
        "--random-input-len", str(spec["input_len"]), "--random-range-ratio", str(spec["range_ratio"]),
        "--random-batch-size", str(spec["texts_per_request"]), "--random-output-len", "1",
        "--num-prompts", str(n), "--max-concurrency", str(concurrency), "--num-warmups", str(spec["warmups"]),
        "--percentile-metrics", "e2el", "--metric-percentiles", "50,90,99", "--seed", str(spec["seed"]),
        "--disable-tqdm",
    ]  # fmt: skip
    print("vllm bench serve " + " ".join(argv), flush=True)
    result: dict[str, Any] = main(parser.parse_args(argv))
    result["num_prompts"] = n
    return result


def vllm_bench_gen(
    spec: dict[str, Any], name: str, concurrency: int, n: int, dataset: list[str]
) -> dict[str, Any]:
    """One `vllm bench serve` run of a generation server; its result JSON is saved as
    `result_dir/name.json` (what the recorded fixtures are)."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    backend = ["--backend", "openai-chat", "--endpoint", "/v1/chat/completions"]
    if spec.get("endpoint") == "completions":
        backend = ["--backend", "vllm", "--endpoint", "/v1/completions"]
    argv = [
        *backend, "--base-url", spec["base_url"], "--model", spec["model"], "--tokenizer", spec["tokenizer"],
        *dataset, "--ignore-eos", "--num-prompts", str(n), "--max-concurrency", str(concurrency),
        "--num-warmups", str(min(spec["warmups"], concurrency)),
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
        "--save-result", "--result-dir", spec["result_dir"], "--result-filename", f"{name}.json", "--disable-tqdm",
    ]  # fmt: skip
    print("vllm bench serve " + " ".join(argv), flush=True)
    result: dict[str, Any] = main(parser.parse_args(argv))
    result["num_prompts"] = n
    return result


def read_metrics(base: str) -> dict[str, float]:
    import urllib.request

    with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
        return parse_metrics(r.read().decode(errors="replace"))


def gen_main(spec: dict[str, Any], out: Path) -> int:
    """The generation load test: one step per concurrency, then the prefix probe."""
    Path(spec["result_dir"]).mkdir(parents=True, exist_ok=True)

    def write(step: dict[str, Any]) -> None:
        with out.open("a") as f:
            f.write(json.dumps(step) + "\n")
        print(
            f"{step.get('probe') or 'c=' + str(step['concurrency'])}: {step['requests_per_s']:.1f} req/s "
            f"{step['output_tokens_per_s']:.0f} out tok/s TTFT p50 {step['ttft_p50_ms']:.1f} p99 "
            f"{step['ttft_p99_ms']:.1f} ms ITL p50 {step['itl_p50_ms']:.2f} p99 {step['itl_p99_ms']:.2f} ms "
            f"errors {step['errors']}",
            flush=True,
        )

    lens = ["--random-input-len", str(spec["input_len"]), "--random-output-len", str(spec["output_len"]),
            "--random-range-ratio", str(spec["range_ratio"])]  # fmt: skip
    for i, (c, n) in enumerate(zip(spec["concurrency"], spec["requests"], strict=True)):
        # a seed per step: the same seed would send the same prompts, which the prefix cache
        # then serves (seen on the H200: 42 % of the sweep's prompt tokens were cache hits)
        name = f"c{c}"
        r = vllm_bench_gen(
            spec, name, c, n, ["--dataset-name", "random", *lens, "--seed", str(spec["seed"] + i)]
        )
        write(gen_step_from_bench(r, c, f"{name}.json").to_json())
    pp = spec.get("prefix")
    if pp:
        c, n = pp["concurrency"], pp["requests"]
        runs = {
            "prefix-shared": ["--dataset-name", "prefix_repetition",
                              "--prefix-repetition-prefix-len", str(pp["prefix_len"]),
                              "--prefix-repetition-suffix-len", str(pp["suffix_len"]),
                              "--prefix-repetition-num-prefixes", "1",
                              "--prefix-repetition-output-len", str(pp["output_len"]), "--seed", "1001"],
            "prefix-unshared": ["--dataset-name", "random",
                                "--random-input-len", str(pp["prefix_len"] + pp["suffix_len"]),
                                "--random-output-len", str(pp["output_len"]), "--seed", "1002"],
        }  # fmt: skip
        for name, ds in runs.items():
            m0 = read_metrics(spec["base_url"])
            r = vllm_bench_gen(spec, name, c, n, ds)
            m1 = read_metrics(spec["base_url"])
            step = gen_step_from_bench(r, c, f"{name}.json").to_json()
            step["probe"] = name
            step["metrics_delta"] = {
                k: m1[k] - m0.get(k, 0.0) for k in m1 if "prefix_cache" in k or "tokens_total" in k
            }
            write(step)
    return 0


def prompts(spec: dict[str, Any], n: int) -> list[str]:
    """Texts of about input_len tokens (± range_ratio), from the model's own tokenizer."""
    rng = random.Random(spec["seed"])
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(spec["tokenizer"])
        vocab = [i for i in range(tok.vocab_size) if i not in set(tok.all_special_ids)]
    except Exception:
        tok, vocab = None, []
    lo = int(spec["input_len"] * (1 - spec["range_ratio"]))
    hi = int(spec["input_len"] * (1 + spec["range_ratio"]))
    out = []
    for _ in range(n):
        k = rng.randint(max(lo, 1), max(hi, 1))
        if tok is not None:
            out.append(tok.decode([rng.choice(vocab) for _ in range(k)]))
        else:
            out.append(" ".join(rng.choice(("alpha", "beta", "gamma", "delta", "omega")) for _ in range(k)))
    return out


def loop_step(spec: dict[str, Any], concurrency: int, n: int) -> dict[str, Any]:
    """Closed loop with `concurrency` threads until `n` requests are done."""
    u = urlparse(spec["base_url"])
    texts = prompts(spec, n + spec["warmups"])
    lock = threading.Lock()
    next_i = [0]
    lat: list[float] = []
    tokens = [0]
    errors: list[str] = []

    def one(conn: http.client.HTTPConnection, text: str) -> tuple[float, int]:
        body = json.dumps({"model": spec["model"], "input": [text] * spec["texts_per_request"]})
        t = time.perf_counter()
        conn.request("POST", "/v1/embeddings", body, {"Content-Type": "application/json"})
        r = conn.getresponse()
        raw = r.read()
        dt = time.perf_counter() - t
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {raw[:200]!r}")
        return dt, int(json.loads(raw).get("usage", {}).get("prompt_tokens", 0))

    def connect() -> http.client.HTTPConnection:
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
        conn.connect()
        # no Nagle: a request's small writes must not wait for the delayed ACK (+40 ms)
        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return conn

    def client(first: int, count: int) -> None:
        conn = connect()
        while True:
            with lock:
                i = next_i[0]
                if i >= count:
                    break
                next_i[0] += 1
            try:
                dt, tk = one(conn, texts[first + i])
                with lock:
                    lat.append(dt)
                    tokens[0] += tk
            except Exception as e:  # a failed request is counted, the client goes on
                with lock:
                    errors.append(f"{type(e).__name__}: {e}")
                conn.close()
                conn = connect()
        conn.close()

    def run(first: int, count: int) -> float:
        next_i[0] = 0
        threads = [threading.Thread(target=client, args=(first, count)) for _ in range(concurrency)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return time.perf_counter() - t0

    if spec["warmups"]:
        run(n, spec["warmups"])
        lat.clear()
        tokens[0] = 0
        errors.clear()
    dur = run(0, n)
    step = step_from_latencies(concurrency, lat, tokens[0], len(errors), dur, "mopt-loop").to_json()
    step["error_sample"] = errors[0][:200] if errors else ""
    return step


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    out = Path(spec["out"])
    if spec.get("task") == "text-generation":
        return gen_main(spec, out)
    tool = spec.get("tool", "vllm-bench")
    why_fallback = ""
    for c, n in zip(spec["concurrency"], spec["requests"], strict=True):
        t0 = time.perf_counter()
        step: dict[str, Any]
        if tool == "vllm-bench":
            try:
                step = step_from_vllm_bench(vllm_bench_step(spec, c, n), c).to_json()
            except Exception as e:
                traceback.print_exc()
                why_fallback = f"vllm bench serve failed: {type(e).__name__}: {e}"[:300]
                print(why_fallback + "; falling back to mopt-loop", flush=True)
                tool = "mopt-loop"
        if tool == "mopt-loop":
            step = loop_step(spec, c, n)
            if why_fallback:
                step["tool"] = f"mopt-loop ({why_fallback})"
        with out.open("a") as f:
            f.write(json.dumps(step) + "\n")
        print(
            f"c={c} n={n}: {step['requests_per_s']:.1f} req/s {step['tokens_per_s']:.0f} tok/s "
            f"p50 {step['p50_ms']:.1f} p99 {step['p99_ms']:.1f} ms errors {step['errors']} "
            f"({time.perf_counter() - t0:.1f} s)",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
