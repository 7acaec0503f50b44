"""Fresh process: warm start from mopt's torch-compile artifact (through the public
mopt_torch.warm.compiled_embedder), then, in the same process: ms/batch compiled vs eager fp16,
min cosine vs an fp32 eager reference, the CUDA-graph kept-output check, Inductor cache
counters, and a kernel-time breakdown of the compiled forward.
    python3 warm.py WEIGHTS_DIR ARTIFACT_DIR out.json
"""
import json
import sys
import time

T0 = time.time()
import torch  # noqa: E402

import mopt_torch.embedder as E  # noqa: E402
import mopt_torch.warm as W  # noqa: E402

weights, art, out = sys.argv[1], sys.argv[2], sys.argv[3]
res: dict = {"import_torch_s": time.time() - T0}
parts: dict = {}


def timed(name, fn):
    def inner(*a, **k):
        t = time.time()
        r = fn(*a, **k)
        parts[name] = parts.get(name, 0) + time.time() - t
        return r
    return inner


W.load_warm = timed("load_cache_artifacts_s", W.load_warm)
E.load_embedder = timed("load_weights_s", E.load_embedder)
ids, mask = E.right_padded_batch(32, 512, 151669, 7, "cuda")
t_call = time.time()
model, meta = W.compiled_embedder(weights, art)
t_compiled = time.time()
with torch.inference_mode():
    y = model(ids, mask)
    torch.cuda.synchronize()
first = time.time()
res.update({
    "mode": meta["mode"], "sdpa_backend": meta.get("sdpa_backend"), "wrapped": type(model).__name__,
    "warm_process_start_to_first_s": first - T0,
    "warm_compiled_embedder_call_to_first_s": first - t_call,
    "warm_first_call_s (torch.compile call to first result, weights already loaded)": first - t_compiled,
    **parts,
})
from torch._dynamo.utils import counters  # noqa: E402

res["counters_after_first_call"] = {k: dict(v) for k, v in counters.items() if k in ("inductor", "aot_autograd")}


def bench(m, a=(ids, mask), iters=30):
    with torch.inference_mode():
        for _ in range(5):
            m(*a)
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(iters):
            m(*a)
        e.record()
        torch.cuda.synchronize()
    return s.elapsed_time(e) / iters


res["compiled_warm_ms"] = bench(model)
# CUDA graphs: outputs of two calls kept at once (KeptOutputs clones; the raw module does not)
ids2, mask2 = E.right_padded_batch(32, 512, 151669, 8, "cuda")
with torch.inference_mode():
    y1 = model(ids, mask)
    y2 = model(ids2, mask2)
    res["kept_outputs_differ"] = bool((y1 - y2).abs().max().item() > 1e-3)
    if hasattr(model, "compiled"):
        r1 = model.compiled(ids, mask)
        r2 = model.compiled(ids2, mask2)
        try:
            same = bool(torch.equal(r1, r2))
            res["raw_cudagraph_output_after_next_call"] = (
                "readable, silently overwritten by the next call" if same else "readable, still its own")
        except RuntimeError as exc:
            res["raw_cudagraph_output_after_next_call"] = f"raises: {str(exc)[:160]}"
eager16, _ = E.load_embedder(weights, "fp16", "cuda", meta.get("family"), meta["pooling"], "sdpa")
res["eager_fp16_ms"] = bench(eager16)
res["speedup_vs_eager_fp16"] = res["eager_fp16_ms"] / res["compiled_warm_ms"]
with torch.inference_mode():
    e16a = eager16(ids, mask).float()
del eager16
torch.cuda.empty_cache()
eager32, _ = E.load_embedder(weights, "fp32", "cuda", meta.get("family"), meta["pooling"], "sdpa")
with torch.inference_mode():
    r32a = eager32(ids, mask).float()
    r32b = eager32(ids2, mask2).float()
cos = torch.nn.functional.cosine_similarity
res["min_cosine_compiled_vs_fp32"] = min(cos(y1.float(), r32a).min().item(), cos(y2.float(), r32b).min().item())
res["min_cosine_eager_fp16_vs_fp32"] = cos(e16a, r32a).min().item()
del eager32
tflop = 16.355  # see ../h200-2026-11-30b/README.md: 2·tokens·params_per_layer·28 + 4·B·H·S²·D·28
res["pct_roofline_790"] = 100 * tflop / (res["compiled_warm_ms"] * 1e-3) / 790
print(json.dumps(res, indent=1), flush=True)
json.dump(res, open(out, "w"), indent=1)
try:
    from torch.profiler import ProfilerActivity, profile

    with torch.inference_mode(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            model(ids, mask)
        torch.cuda.synchronize()
    cats: dict = {}
    rows = []
    for ev in prof.key_averages():
        t = ev.device_time_total / 3 / 1e3  # ms per forward
        if t <= 0:
            continue
        n = ev.key.lower()
        c = ("attention" if any(s in n for s in ("flash", "fmha", "attention", "cudnn", "sdpa")) else
             "triton-mm-template" if "triton_tem" in n else
             "gemm" if any(s in n for s in ("gemm", "sm90", "cutlass", "nvjet", "xmma", "matmul")) else
             "triton-fused" if "triton" in n else "other")
        cats[c] = cats.get(c, 0) + t
        rows.append((t, ev.count // 3, c, ev.key[:110]))
    rows.sort(reverse=True)
    res["profile_ms_per_forward_by_category"] = {k: round(v, 3) for k, v in sorted(cats.items(), key=lambda kv: -kv[1])}
    res["profile_top_kernels"] = [{"ms": round(t, 3), "calls": c, "cat": k, "name": n} for t, c, k, n in rows[:25]]
except Exception as exc:  # noqa: BLE001
    res["profile_error"] = f"{type(exc).__name__}: {exc}"
print(json.dumps({k: res[k] for k in res if k.startswith("profile")}, indent=1))
json.dump(res, open(out, "w"), indent=1)
