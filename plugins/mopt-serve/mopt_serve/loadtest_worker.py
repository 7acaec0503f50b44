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

import json
import math
import random
import sys
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
# run as a script, Python puts this file's folder first on sys.path, where mopt_serve's own
# vllm.py would shadow the real vLLM ("No module named 'vllm.benchmarks'; 'vllm' is not a
# package": what happened on the H200, 2026-12-01, so every step fell back to mopt-loop)
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
if str(HERE.parent) not in sys.path:
    sys.path.append(str(HERE.parent))  # mopt_serve's own statistics, whatever the cwd

from mopt_serve.gen_check import gen_step_from_bench  # noqa: E402
from mopt_serve.loadgen import closed_loop, text_maker  # noqa: E402
from mopt_serve.server import parse_metrics, step_from_latencies, step_from_vllm_bench  # noqa: E402


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


def loop_step(spec: dict[str, Any], concurrency: int, n: int) -> dict[str, Any]:
    """Closed loop with `concurrency` threads until `n` requests are done (mopt_serve.loadgen,
    the client serve-search uses)."""
    make = text_maker(spec["tokenizer"], spec["input_len"], spec["range_ratio"])
    texts = make(random.Random(spec["seed"]), n + spec["warmups"])
    reqs, dur, err = closed_loop(
        spec["base_url"], spec["model"], texts, concurrency, min_requests=n, min_s=0.0, max_s=math.inf,
        max_requests=n, warmup=spec["warmups"], texts_per_request=spec["texts_per_request"],
    )  # fmt: skip
    ok = [r for r in reqs if r.ok]
    step = step_from_latencies(
        concurrency, [r.latency_s for r in ok], sum(r.tokens for r in ok), len(reqs) - len(ok), dur, "mopt-loop"
    ).to_json()
    step["error_sample"] = err[:200]
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
