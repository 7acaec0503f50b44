"""CPU generation: ONNX Runtime (KV cache; fp32, INT8, INT4) vs PyTorch eager, side by side in one run.

Reads a section's build folder (what `mopt build recipes/qwen3-chat.toml 'qwen3-chat.cpu'`
materializes: `weights/`, `onnx/`, `int8/`, ...) and, per backend, through
`mopt_ml.genruntime`: load seconds, time to first token (TTFT: prefill of `--prompt-len`
tokens + the first greedy token), inter-token latency (ITL, the decode step with a KV cache),
decode tokens/s, and agreement with PyTorch fp32 (next-token logits on held-out passages:
min cosine, top-1; greedy continuations: tokens equal before the first divergence).

    python benchmarks/bench_generation_cpu.py build/qwen3-chat/cpu
    python benchmarks/bench_generation_cpu.py build/qwen3-chat-0-6b/cpu --variants onnx,int8,int4 --reps 3

Medians over `--reps` generate() calls after one warm-up; every backend gets the same
`--threads` (torch intra-op threads, ORT intra-op threads). Prints the CPU, its int8
instructions and the load average beside the numbers: on a shared machine read ratios.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any


def cpu_line() -> str:
    model = platform.processor() or "?"
    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model in ("?", "", "x86_64"):
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    isa = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8", "avx512_bf16") if f in flags]
    return f"{model}; {os.cpu_count()} CPUs; {' '.join(isa) or 'no avx2'}"


def prompts_from(tokenizer: Any, n: int, length: int) -> list[list[int]]:
    """`n` prompts of exactly `length` tokens cut from the held-out sentences (never calibration)."""
    from mopt_ml.common import validation_texts

    ids: list[int] = []
    for text in validation_texts():
        ids += tokenizer(text + " ")["input_ids"]
    out = []
    for i in range(n):
        start = (i * 37) % max(1, len(ids) - length)
        chunk = ids[start : start + length]
        while len(chunk) < length:
            chunk += ids[: length - len(chunk)]
        out.append(chunk)
    return out


def time_backend(gen: Any, prompt: list[int], new_tokens: int, reps: int) -> dict[str, float]:
    gen.generate(prompt, min(4, new_tokens))  # warm-up: allocations, ORT's first-run planning
    ttft, itl, e2e = [], [], []
    for _ in range(reps):
        stamps: list[float] = []
        t0 = time.perf_counter()
        gen.generate(prompt, new_tokens, on_token=lambda _t, ts, s=stamps: s.append(ts))
        e2e.append(time.perf_counter() - t0)
        ttft.append(stamps[0] - t0)
        itl += [b - a for a, b in itertools.pairwise(stamps)]
    med_itl = statistics.median(itl) if itl else float("nan")
    return {
        "ttft_ms": 1e3 * statistics.median(ttft),
        "itl_ms": 1e3 * med_itl,
        "decode_tok_s": 1.0 / med_itl if itl else float("nan"),
        "e2e_ms": 1e3 * statistics.median(e2e),
    }


def agreement(ref: Any, gen: Any, passages: list[list[int]], prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    from mopt_ml.genruntime import compare_logits

    logits = compare_logits([ref.logits(p) for p in passages], [gen.logits(p) for p in passages])
    prefix = []
    for p in prompts:
        a, b = ref.generate(p, new_tokens), gen.generate(p, new_tokens)
        prefix.append(next((k for k, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a)) / len(a))
    return {"min_cosine": logits["min_cosine"], "top1": logits["top1_agreement"],
            "greedy_prefix": statistics.mean(prefix)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", type=Path, help="a section's build folder (weights/, onnx/, int8/, ...)")
    ap.add_argument("--variants", default="onnx,int8,int4", help="ONNX artifact folders to time beside PyTorch")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--passages", type=int, default=8, help="held-out passages for the logits agreement")
    ap.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    args = ap.parse_args(argv)

    from mopt_ml.genruntime import load_tokenizer, open_generator

    weights = args.folder / "weights"
    variants = [v for v in args.variants.split(",") if v and (args.folder / v / "model.onnx").is_file()]
    if not (weights / "config.json").is_file() or not variants:
        print(f"{args.folder}: needs weights/ and at least one of {args.variants} (build the section first)",
              file=sys.stderr)  # fmt: skip
        return 2
    tok = load_tokenizer(weights)
    prompt = prompts_from(tok, 1, args.prompt_len)[0]
    passages = prompts_from(tok, args.passages, min(args.prompt_len, 128))
    greedy_prompts = prompts_from(tok, 4, 32)

    rows: list[dict[str, Any]] = []
    t = time.perf_counter()
    ref = open_generator(weights, format="hf-checkpoint", threads=args.threads)
    rows.append({"variant": "pytorch fp32", "backend": ref.backend, "load_s": time.perf_counter() - t,
                 **time_backend(ref, prompt, args.new_tokens, args.reps),
                 "min_cosine": 1.0, "top1": 1.0, "greedy_prefix": 1.0})  # fmt: skip
    for v in variants:
        t = time.perf_counter()
        gen = open_generator(args.folder / v, format="onnx", threads=args.threads)
        load = time.perf_counter() - t
        meta = json.loads((args.folder / v / "mopt_ml.json").read_text())
        rows.append({"variant": f"ort {meta.get('precision', '?')} ({v})", "backend": gen.backend, "load_s": load,
                     **time_backend(gen, prompt, args.new_tokens, args.reps),
                     **agreement(ref, gen, passages, greedy_prompts, min(args.new_tokens, 16))})  # fmt: skip
        gen.close()
    ref.close()

    base = rows[0]
    print(f"CPU: {cpu_line()}; threads {args.threads}; load average {os.getloadavg()[0]:.1f} at the end")
    print(f"model: {args.folder}; prompt {args.prompt_len} tokens, {args.new_tokens} new, median of {args.reps}")
    head = f"{'variant':28} {'load s':>7} {'TTFT ms':>9} {'ITL ms':>8} {'tok/s':>7} {'TTFT x':>7} {'ITL x':>6} " \
           f"{'min cos':>8} {'top-1':>6} {'greedy':>6}"  # fmt: skip
    print(head)
    for r in rows:
        print(f"{r['variant']:28} {r['load_s']:7.1f} {r['ttft_ms']:9.1f} {r['itl_ms']:8.2f} {r['decode_tok_s']:7.1f} "
              f"{base['ttft_ms'] / r['ttft_ms']:7.2f} {base['itl_ms'] / r['itl_ms']:6.2f} "
              f"{r['min_cosine']:8.5f} {r['top1']:6.3f} {r['greedy_prefix']:6.2f}")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps({"cpu": cpu_line(), "threads": args.threads, "prompt_len": args.prompt_len,
                                         "new_tokens": args.new_tokens, "rows": rows}, indent=2) + "\n")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
