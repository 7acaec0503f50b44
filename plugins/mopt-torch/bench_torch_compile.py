#!/usr/bin/env python3
"""torch.compile vs eager on a Qwen3-Embedding-0.6B-shaped model, in one run.

Standalone on purpose: it runs on a CUDA machine that has torch + transformers but not
mopt's own dependencies (pydantic, blake3), so it imports nothing from mopt.

What it measures, for a random-weight model with Qwen3-Embedding-0.6B's shapes (hidden 1024,
28 layers, 16 heads, 8 KV heads, head_dim 128, intermediate 3072, vocab 151669), fp16,
batch 32 x 512, last-token pooling + L2 norm (what the `torch-compile` target compiles):

* eager ms/batch (transformers' default sdpa path, attention mask passed);
* per torch.compile mode (default, max-autotune-no-cudagraphs, max-autotune), each in a fresh
  process with an empty Inductor/Triton cache: cold compile seconds (compile call to first
  result), ms/batch, min cosine vs an fp32 eager reference, % of the fp16 matmul roofline;
* warm start: a fresh process with another empty cache that first loads the cache artifact
  written by the cold run (`torch.compiler.save_cache_artifacts()` bytes) - seconds from the
  compile call to the first result, and from process start.

Compiled variants use `attention = sdpa-causal`: transformers' sdpa kernel without a
materialised mask (is_causal=True). For a causal decoder with right padding this is exact
for every real token (a real token never attends to later padding), and it keeps the flash
kernel under torch.compile, where transformers (torch < 2.14) always materialises the mask.

Usage (CUDA):  PYTHONUNBUFFERED=1 python bench_torch_compile.py --out "$OUT"
Smoke (CPU):   python bench_torch_compile.py --tiny --device cpu --dtype fp32 --modes default
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

T_PROCESS = time.perf_counter()  # before torch is imported: warm/cold "from process start"

QWEN3_06B = dict(
    hidden_size=1024,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=3072,
    vocab_size=151669,
    max_position_embeddings=32768,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)
TINY = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    vocab_size=1000,
    max_position_embeddings=512,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)
PEAK_TFLOPS = 790.0  # dense fp16/bf16 matmul measured on this workplace's H200 (KINDS.md)


def flops_per_batch(cfg: dict, batch: int, seq: int) -> float:
    """Matmul FLOPs of one forward: projections + MLP + QK^T and PV (full, not causal-halved)."""
    h, i, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    tokens = batch * seq
    per_layer_params = h * (q + 2 * kv) + q * h + 3 * h * i
    proj = 2.0 * tokens * per_layer_params * L
    attn = 4.0 * batch * cfg["num_attention_heads"] * seq * seq * cfg["head_dim"] * L
    return proj + attn


# --------------------------------------------------------------------------- model


def register_sdpa_causal() -> None:
    """`sdpa-causal`: transformers' sdpa attention with no mask (mask creation is skipped for
    attention functions that have no mask function registered)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    AttentionInterface.register("sdpa_causal", sdpa_attention_forward)


def build_model(cfg: dict, attn: str, device: str, dtype, state_dict=None, seed: int = 0):
    import torch
    from transformers import Qwen3Config, Qwen3Model

    if attn == "sdpa_causal":
        register_sdpa_causal()
    config = Qwen3Config(**cfg)
    config._attn_implementation = attn
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen3Model(config)
    if state_dict is not None:
        model.load_state_dict(state_dict)
    model = model.to(dtype=dtype).eval()
    if hasattr(model, "set_attn_implementation"):
        try:
            model.set_attn_implementation(attn)
        except Exception:  # older/newer transformers: the config attribute above is enough
            model.config._attn_implementation = attn
    return model


def make_embedder(model):
    import torch

    class Embedder(torch.nn.Module):
        """Last-token pooling (right padding: the last real token) + L2 normalisation."""

        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, input_ids, attention_mask):
            h = self.m(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            last = attention_mask.sum(dim=1) - 1
            pooled = h[torch.arange(h.shape[0], device=h.device), last]
            return torch.nn.functional.normalize(pooled.float(), dim=-1)

    return Embedder(model).eval()


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_ms(fn, args, device: str, iters: int, warmup: int = 3) -> dict:
    """Median / mean / min ms per call (CUDA events on GPU, perf_counter on CPU)."""
    import torch

    for _ in range(warmup):
        fn(*args)
    sync(device)
    times = []
    for _ in range(iters):
        if device.startswith("cuda"):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn(*args)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t = time.perf_counter()
            fn(*args)
            times.append((time.perf_counter() - t) * 1e3)
    return {"median": statistics.median(times), "mean": statistics.fmean(times), "min": min(times)}


def min_cosine(out, ref) -> float:
    import torch

    cos = torch.nn.functional.cosine_similarity(out.float().cpu(), ref.float().cpu(), dim=-1)
    if torch.isnan(cos).any():
        return float("nan")
    return float(cos.min())


def dtype_of(name: str):
    import torch

    return {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[name]


# --------------------------------------------------------------------------- children


def child(args) -> None:
    """One fresh process: cold compile (`compile`) or warm start from an artifact (`warm`)."""
    import torch

    t_import = time.perf_counter() - T_PROCESS
    data = torch.load(args.data, map_location="cpu", weights_only=True)
    cfg = json.loads(Path(args.data).with_suffix(".json").read_text())
    dev, dt = args.device, dtype_of(args.dtype)
    model = build_model(cfg, "sdpa_causal", dev, dt, state_dict=data["weights"])
    emb = make_embedder(model)
    ids, mask, ref = data["ids"].to(dev), data["mask"].to(dev), data["ref"]
    sync(dev)
    t_ready = time.perf_counter()
    res: dict = {"mode": args.mode, "role": args.child, "import_s": round(t_import, 2)}
    res["model_ready_s"] = round(t_ready - T_PROCESS, 2)

    load_s = 0.0
    if args.child == "warm":
        blob = Path(args.artifact).read_bytes()
        t = time.perf_counter()
        info = torch.compiler.load_cache_artifacts(blob)
        load_s = time.perf_counter() - t
        res["artifact_mb"] = round(len(blob) / 2**20, 2)
        res["loaded"] = info is not None
        if info is not None:
            res["loaded_entries"] = {k: len(v) for k, v in getattr(info, "artifacts", {}).items()}
    compiled = torch.compile(emb, mode=None if args.mode == "default" else args.mode, dynamic=False)
    with torch.no_grad():
        t = time.perf_counter()
        out = compiled(ids, mask)
        sync(dev)
        t_first = time.perf_counter()
        first = out.clone()
        res["first_result_s"] = round(load_s + (t_first - t), 2)  # artifact load + compile + run
        res["first_result_from_process_start_s"] = round(t_first - T_PROCESS, 2)
        res["load_artifact_s"] = round(load_s, 2)
        ms = time_ms(compiled, (ids, mask), dev, args.iters)
        res["ms"] = {k: round(v, 3) for k, v in ms.items()}
        res["min_cosine"] = min_cosine(compiled(ids, mask).clone(), ref)
        res["min_cosine_first_call"] = min_cosine(first, ref)
    if args.child == "compile" and args.artifact:
        saved = torch.compiler.save_cache_artifacts()
        if saved is None:
            res["artifact_error"] = "save_cache_artifacts() returned None"
        else:
            blob, info = saved
            Path(args.artifact).write_bytes(blob)
            res["artifact_mb"] = round(len(blob) / 2**20, 2)
            res["saved_entries"] = {k: len(v) for k, v in getattr(info, "artifacts", {}).items()}
    if dev.startswith("cuda"):
        res["peak_mem_gb"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    Path(args.result).write_text(json.dumps(res))


def run_child(role: str, mode: str, args, work: Path, artifact: Path | None, timeout: float) -> dict:
    cache = Path(tempfile.mkdtemp(prefix=f"inductor-{role}-{mode}-", dir=work))
    env = dict(os.environ)
    env["TORCHINDUCTOR_CACHE_DIR"] = str(cache)  # empty: a cold compile really is cold
    env["TRITON_CACHE_DIR"] = str(cache / "triton")
    env["PYTHONUNBUFFERED"] = "1"
    result = work / f"result-{role}-{mode}.json"
    argv = [
        sys.executable, os.path.abspath(__file__), "--child", role, "--mode", mode,
        "--data", str(work / "data.pt"), "--result", str(result), "--device", args.device,
        "--dtype", args.dtype, "--iters", str(args.iters),
    ]  # fmt: skip
    if artifact is not None:
        argv += ["--artifact", str(artifact)]
    t = time.perf_counter()
    try:
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"mode": mode, "role": role, "error": f"timed out after {timeout:.0f} s"}
    wall = time.perf_counter() - t
    if proc.returncode != 0 or not result.exists():
        tail = (proc.stderr or proc.stdout)[-1500:]
        return {"mode": mode, "role": role, "error": f"exit {proc.returncode}: {tail}"}
    res = json.loads(result.read_text())
    res["process_wall_s"] = round(wall, 2)
    return res


# --------------------------------------------------------------------------- parent


def parent(args) -> int:
    import torch

    out_dir = Path(args.out or ".").resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-tc-"))
    budget_end = T_PROCESS + args.budget_s
    cfg = dict(TINY if args.tiny else QWEN3_06B)
    batch, seq = (2, 32) if args.tiny else (args.batch, args.seq)
    dev, dt = args.device, dtype_of(args.dtype)
    import transformers

    env = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "python": sys.version.split()[0],
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if dev.startswith("cuda"):
        p = torch.cuda.get_device_properties(0)
        env.update(gpu=p.name, compute_capability=f"{p.major}.{p.minor}", sms=p.multi_processor_count)
    flops = flops_per_batch(cfg, batch, seq)
    results: dict = {"env": env, "shape": {"batch": batch, "seq": seq, **cfg}, "dtype": args.dtype}
    results["tflop_per_batch"] = round(flops / 1e12, 3)
    results["peak_tflops"] = PEAK_TFLOPS
    results["runs"] = []

    def save() -> None:
        (out_dir / "bench_torch_compile.json").write_text(json.dumps(results, indent=2))

    print(f"env: {env}")
    print(f"shape: batch {batch} x seq {seq}, {results['tflop_per_batch']} TFLOP/batch ({args.dtype})")

    # fp32 reference and the fp16 weights every child loads
    torch.manual_seed(1234)
    ids = torch.randint(0, cfg["vocab_size"], (batch, seq))
    mask = torch.ones(batch, seq, dtype=torch.long)
    ref_model = build_model(cfg, "sdpa", dev, torch.float32, seed=0)
    with torch.no_grad():
        ref = make_embedder(ref_model)(ids.to(dev), mask.to(dev)).cpu()
    weights = {k: v.detach().to(dt).cpu() for k, v in ref_model.state_dict().items()}
    del ref_model
    torch.save({"weights": weights, "ids": ids, "mask": mask, "ref": ref}, work / "data.pt")
    (work / "data.json").write_text(json.dumps(cfg))

    # eager baselines: transformers' default sdpa path (mask passed), and sdpa-causal
    for attn in ("sdpa", "sdpa_causal"):
        m = make_embedder(build_model(cfg, attn, dev, dt, state_dict=weights))
        with torch.no_grad():
            ms = time_ms(m, (ids.to(dev), mask.to(dev)), dev, args.iters)
            cos = min_cosine(m(ids.to(dev), mask.to(dev)), ref)
        row = {"mode": "eager", "role": f"eager-{attn}", "ms": {k: round(v, 3) for k, v in ms.items()}}
        row["min_cosine"] = cos
        results["runs"].append(row)
        print(f"eager[{attn}]: {ms['median']:.2f} ms/batch, min cos {cos:.6f}")
        del m
        if dev.startswith("cuda"):
            torch.cuda.empty_cache()
    save()

    # need (s) a cold compile is given before it starts; a warm start gets far less
    need = {"default": 60, "max-autotune-no-cudagraphs": 120, "max-autotune": 90}
    for mode in args.modes.split(","):
        left = budget_end - time.perf_counter()
        if left < need.get(mode, 60):
            results["runs"].append({"mode": mode, "role": "compile", "error": f"skipped: {left:.0f} s left"})
            print(f"skip {mode}: {left:.0f} s of budget left")
            continue
        artifact = work / f"cache-{mode}.bin"
        r = run_child("compile", mode, args, work, artifact, timeout=left - 5)
        results["runs"].append(r)
        print(f"compile[{mode}]: {json.dumps(r)[:600]}")
        save()
        left = budget_end - time.perf_counter()
        if "error" not in r and artifact.exists() and left > 40:
            w = run_child("warm", mode, args, work, artifact, timeout=left - 5)
            results["runs"].append(w)
            print(f"warm[{mode}]: {json.dumps(w)[:600]}")
            save()

    # the table
    eager = next(r for r in results["runs"] if r["role"] == "eager-sdpa")["ms"]["median"]
    lines = [
        f"{'variant':<34}{'ms/batch':>9}{'x eager':>9}{'%roof':>7}{'min cos':>10}{'1st result s':>13}{'from start s':>13}",
    ]
    for r in results["runs"]:
        name = r["role"] if r["mode"] == "eager" else f"{r['role']}:{r['mode']}"
        if "error" in r:
            lines.append(f"{name:<34}  {r['error'][:90]}")
            continue
        ms = r["ms"]["median"]
        roof = 100.0 * flops / (ms * 1e-3) / (PEAK_TFLOPS * 1e12)
        first = r.get("first_result_s", float("nan"))
        start = r.get("first_result_from_process_start_s", float("nan"))
        lines.append(
            f"{name:<34}{ms:>9.2f}{eager / ms:>9.2f}{roof:>7.1f}{r['min_cosine']:>10.5f}{first:>13.1f}{start:>13.1f}"
        )
    colds = {r["mode"]: r for r in results["runs"] if r["role"] == "compile" and "error" not in r}
    warms = {r["mode"]: r for r in results["runs"] if r["role"] == "warm" and "error" not in r}
    for mode, w in warms.items():
        c = colds[mode]
        ratio = c["first_result_s"] / max(w["first_result_s"], 1e-9)
        ratio_p = c["first_result_from_process_start_s"] / max(w["first_result_from_process_start_s"], 1e-9)
        lines.append(
            f"warm start [{mode}]: {ratio:.1f}x sooner (compile call -> first result), "
            f"{ratio_p:.1f}x (process start -> first result); artifact {w.get('artifact_mb')} MB"
        )
    if colds:
        best = min(colds.values(), key=lambda r: r["ms"]["median"])
        ms = best["ms"]["median"]
        roof = 100.0 * flops / (ms * 1e-3) / (PEAK_TFLOPS * 1e12)
        verdict = {
            ">= 2x eager": eager / ms >= 2.0,
            f">= 60% roofline (<= {flops / (0.6 * PEAK_TFLOPS * 1e12) * 1e3:.1f} ms)": roof >= 60.0,
            "min cosine >= 0.999": all(
                r["min_cosine"] >= 0.999
                for r in results["runs"]
                if "min_cosine" in r and not math.isnan(r["min_cosine"])
            ),
            "warm >= 5x sooner": bool(warms)
            and max(colds[m]["first_result_s"] / warms[m]["first_result_s"] for m in warms) >= 5.0,
        }
        results["best"] = {"mode": best["mode"], "ms": ms, "x_eager": eager / ms, "roofline_pct": roof}
        results["targets"] = verdict
        lines.append(f"best: {best['mode']} {ms:.2f} ms ({eager / ms:.2f}x eager, {roof:.1f}% of roofline)")
        lines.append("targets: " + ", ".join(f"{k}: {'PASS' if v else 'FAIL'}" for k, v in verdict.items()))
    table = "\n".join(lines)
    results["table"] = table
    results["total_s"] = round(time.perf_counter() - T_PROCESS, 1)
    save()
    (out_dir / "bench_torch_compile.txt").write_text(table + "\n")
    print()
    print(table)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT"))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="fp16", choices=["fp16", "bf16", "fp32"])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--modes", default="default,max-autotune-no-cudagraphs,max-autotune")
    ap.add_argument("--budget-s", type=float, default=540.0, help="stop starting new work after this")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer toy config (smoke test)")
    ap.add_argument("--child", choices=["compile", "warm"], help=argparse.SUPPRESS)
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--artifact", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return 0
    return parent(args)


if __name__ == "__main__":
    sys.exit(main())
