"""Compare mopt's memory estimator with the measured peak of a real forward pass.

Builds randomly initialised transformers Qwen3 models (`Qwen3Model`, the embedding model's
body: no lm_head) of a few sizes, runs one forward pass per (batch, seq) and measures:

  --device cpu   peak RSS during the forward pass (VmHWM, reset through
                 /proc/self/clear_refs after a small warm-up pass) minus the RSS before the
                 model was built, in fp32. Compared with the estimator's weights + activations
                 (no runtime overhead on CPU). Measured twice: with glibc's default malloc
                 (what a user sees; freed tensors may stay resident) and with
                 MALLOC_MMAP_THRESHOLD_=65536 (every large tensor mmapped and returned on free:
                 the live tensor memory, which is what the estimator models).
  --device cuda  torch.cuda.max_memory_allocated() of the forward pass, in bf16 (default),
                 compared with the estimator's weights + activations (the CUDA context is not
                 counted by the allocator, so it is left out of both).

Each case runs in its own subprocess so peaks do not leak between cases. Prints a table and
the error of the estimate (estimate / measured - 1). Needs torch and transformers:

    .venv/bin/python benchmarks/estimator_vs_measured.py            # CPU
    python benchmarks/estimator_vs_measured.py --device cuda        # on a GPU machine
    python benchmarks/estimator_vs_measured.py --json               # machine-readable
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from mopt.api import Family  # noqa: E402
from mopt.estimate import Workload, estimate  # noqa: E402


class Qwen3Shape(Family):
    """The shape mopt-ml's qwen3 family gives the estimator (gated MLP, q/k norms)."""

    name = "qwen3"
    qk_norm = True

QWEN3_0_6B = json.loads((HERE.parent / "recipes" / "configs" / "qwen3-embedding-0.6b.json").read_text())

MODELS: dict[str, dict[str, object]] = {
    "qwen3-tiny-13m": {
        **QWEN3_0_6B,
        "hidden_size": 256,
        "intermediate_size": 768,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "vocab_size": 32000,
    },
    "qwen3-small-0.1b": {
        **QWEN3_0_6B,
        "hidden_size": 512,
        "intermediate_size": 1536,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 64,
    },
    "qwen3-embedding-0.6b": dict(QWEN3_0_6B),
}

CASES_CPU = [
    ("qwen3-tiny-13m", 1, 128),
    ("qwen3-tiny-13m", 8, 2048),
    ("qwen3-small-0.1b", 1, 512),
    ("qwen3-small-0.1b", 8, 1024),
    ("qwen3-small-0.1b", 4, 2048),
    ("qwen3-embedding-0.6b", 1, 512),
    ("qwen3-embedding-0.6b", 4, 1024),
    ("qwen3-embedding-0.6b", 2, 2048),
]
CASES_CUDA = [
    ("qwen3-small-0.1b", 8, 1024),
    ("qwen3-small-0.1b", 32, 2048),
    ("qwen3-embedding-0.6b", 1, 512),
    ("qwen3-embedding-0.6b", 8, 2048),
    ("qwen3-embedding-0.6b", 32, 2048),
    ("qwen3-embedding-0.6b", 64, 4096),
    ("qwen3-embedding-0.6b", 4, 32768),
]

_CHILD = r"""
import json, os, sys, resource
import torch
from transformers import Qwen3Config, Qwen3Model

cfg, batch, seq, device, dtype, attn = json.loads(sys.argv[1])

def rss():
    with open("/proc/self/status") as f:
        d = dict(l.split(":", 1) for l in f if ":" in l)
    return int(d["VmRSS"].split()[0]) * 1024, int(d["VmHWM"].split()[0]) * 1024

torch.manual_seed(0)
torch.set_num_threads(max(1, os.cpu_count() or 1))
tdtype = getattr(torch, dtype)
cfg = {k: v for k, v in cfg.items() if k not in ("bos_token_id", "eos_token_id")}
config = Qwen3Config(**cfg)
config._attn_implementation = attn
ids = torch.randint(0, cfg["vocab_size"], (batch, seq))
res = {}
if device == "cpu":
    base, _ = rss()
    model = Qwen3Model(config).to(tdtype).eval()
    built, _ = rss()
    with torch.inference_mode():  # load kernels' code pages before measuring
        model(input_ids=ids[:1, :16], use_cache=False)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        reset = True
    except OSError:
        reset = False
    with torch.inference_mode():
        out = model(input_ids=ids, use_cache=False).last_hidden_state
        float(out[:, -1].float().sum())
    _, peak = rss()
    if not reset:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    res = {"weights": built - base, "peak": peak - base, "reset": reset}
else:
    torch.cuda.init()
    model = Qwen3Model(config).to(device="cuda", dtype=tdtype).eval()
    torch.cuda.synchronize()
    built = torch.cuda.memory_allocated()
    ids = ids.cuda()
    torch.cuda.reset_peak_memory_stats()
    with torch.inference_mode():
        out = model(input_ids=ids, use_cache=False).last_hidden_state
        float(out[:, -1].float().sum())
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    free, total = torch.cuda.mem_get_info()
    res = {"weights": built, "peak": peak, "reserved": torch.cuda.max_memory_reserved(),
           "gpu": torch.cuda.get_device_name(), "device_used": total - free}
res["params"] = sum(p.numel() for p in model.parameters())
print("RESULT " + json.dumps(res))
"""


def _child(arg: str, env: dict[str, str]) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, arg],
        capture_output=True,
        text=True,
        timeout=1800,
        env={**os.environ, "TOKENIZERS_PARALLELISM": "false", **env},
    )
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(((proc.stderr or proc.stdout).strip().splitlines() or ["failed"])[-1])
    out: dict[str, Any] = json.loads(line[len("RESULT ") :])
    return out


def run_case(name: str, batch: int, seq: int, device: str, dtype: str, attn: str) -> dict[str, Any]:
    cfg = MODELS[name]
    arg = json.dumps([cfg, batch, seq, device, dtype, attn])
    try:
        measured = _child(arg, {})
        live = _child(arg, {"MALLOC_MMAP_THRESHOLD_": "65536"}) if device == "cpu" else measured
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        return {"failed": str(exc)}
    dims = Qwen3Shape().dims(cfg)
    precision = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[dtype]
    w = Workload(
        precision=precision,
        batch=batch,
        seq_len=seq,
        device="cpu" if device == "cpu" else "gpu",
        attention="eager" if attn == "eager" else "fused",
        runtime_overhead_gb=0.0,
    )
    e = estimate(dims, w)
    est_total = e.weights + e.activations
    return {
        "model": name,
        "batch": batch,
        "seq": seq,
        "attention": attn,
        "params_est": e.params,
        "params_real": measured["params"],
        "weights_est": e.weights,
        "weights_meas": measured["weights"],
        "act_est": e.activations,
        "act_meas": measured["peak"] - measured["weights"],
        "total_est": est_total,
        "total_meas": measured["peak"],
        "total_live": live["peak"],
        "error": est_total / measured["peak"] - 1,
        "error_live": est_total / live["peak"] - 1,
        "raw": measured,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--dtype", default=None, help="float32 (cpu default), bfloat16 (cuda default)")
    ap.add_argument("--attn", default="sdpa", help="sdpa (default) or eager")
    ap.add_argument("--quick", action="store_true", help="only the two smallest cases")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--save", metavar="FILE", help="also write the rows as JSON to FILE")
    args = ap.parse_args()
    dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    cases = CASES_CPU if args.device == "cpu" else CASES_CUDA
    if args.quick:
        cases = cases[:2]
    rows: list[dict[str, Any]] = []
    mib = 1 << 20
    if not args.json:
        print(f"device={args.device} dtype={dtype} attention={args.attn}")
        print(
            f"{'model':22} {'batch':>5} {'seq':>6} {'params':>12} {'weights est/meas MiB':>22} "
            f"{'act est/meas MiB':>18} {'peak est/meas MiB':>19} {'error':>7} "
            f"{'live MiB':>9} {'error':>7}"
        )
    for name, b, s in cases:
        r = run_case(name, b, s, args.device, dtype, args.attn)
        rows.append(r)
        if args.json:
            continue
        if "failed" in r:
            print(f"{name:22} {b:>5} {s:>6}  FAILED: {r['failed']}")
            continue
        print(
            f"{name:22} {b:>5} {s:>6} {r['params_est']:>12,} "
            f"{r['weights_est'] / mib:>10.0f}/{r['weights_meas'] / mib:<10.0f} "
            f"{r['act_est'] / mib:>8.0f}/{r['act_meas'] / mib:<8.0f} "
            f"{r['total_est'] / mib:>9.0f}/{r['total_meas'] / mib:<9.0f} "
            f"{r['error']:>+7.1%} {r['total_live'] / mib:>9.0f} {r['error_live']:>+7.1%}",
            flush=True,
        )
    if args.save:
        Path(args.save).write_text(json.dumps(rows, indent=2))
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    for key, what in (("error", "peak RSS"), ("error_live", "live tensors")):
        errs = [r[key] for r in rows if "failed" not in r]
        if errs:
            print(
                f"vs {what}: error from {min(errs):+.1%} to {max(errs):+.1%}, "
                f"mean |error| {sum(abs(e) for e in errs) / len(errs):.1%} over {len(errs)} cases"
            )


if __name__ == "__main__":
    main()
