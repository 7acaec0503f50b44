"""Micro-benchmarks on the H200 for the Qwen3-0.6B shape (fp16, batch 32 x 512):
peak GEMM, the layer's GEMMs (separate and fused), copy bandwidth, and causal GQA attention
per SDPA backend (flash / cudnn / efficient; native GQA or K/V repeated) with its error
against an fp32 reference. Prints BACKEND=cudnn when cuDNN attention works and beats flash
by >= 5 %, else BACKEND=auto.   python3 probe.py out.json
"""
import json
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

F = torch.nn.functional
dt = torch.float16
out: dict = {"torch": torch.__version__, "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version()}


def bench(fn, iters=30, warm=5):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(iters):
        fn()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / iters


a = torch.randn(8192, 8192, dtype=dt, device="cuda")
b = torch.randn(8192, 8192, dtype=dt, device="cuda")
ms = bench(lambda: a @ b, 20, 5)
out["peak_gemm_8192_fp16_tflops"] = round(2 * 8192**3 / ms / 1e9, 1)
del a, b
x = torch.empty(2**29, dtype=torch.uint8, device="cuda")
y = torch.empty_like(x)
ms = bench(lambda: y.copy_(x), 20, 3)
out["copy_GBps"] = round(2 * x.numel() / ms / 1e6, 1)
del x, y

M, h, inter, q, kv, L = 32 * 512, 1024, 3072, 2048, 1024, 28
shapes = {
    "q": (h, q), "k": (h, kv), "v": (h, kv), "qkv_fused": (h, q + 2 * kv), "o": (q, h),
    "gate": (h, inter), "up": (h, inter), "gate_up_fused": (h, 2 * inter), "down": (inter, h),
}
gemm = {}
for name, (k, n) in shapes.items():
    xin = torch.randn(M, k, dtype=dt, device="cuda")
    w = torch.randn(n, k, dtype=dt, device="cuda") * 0.02
    ms = bench(lambda: F.linear(xin, w), 30, 5)
    gemm[name] = {"ms": round(ms, 4), "tflops": round(2 * M * k * n / ms / 1e9, 1)}
out["gemm_M16384"] = gemm
sep = sum(gemm[n]["ms"] for n in ("q", "k", "v", "o", "gate", "up", "down"))
fus = sum(gemm[n]["ms"] for n in ("qkv_fused", "o", "gate_up_fused", "down"))
out["gemm_28_layers_ms"] = {"separate": round(sep * L, 2), "fused_qkv_gateup": round(fus * L, 2)}

B, H, KV, S, D = 32, 16, 8, 512, 128
g = torch.Generator(device="cuda").manual_seed(0)
qq = torch.randn(B, H, S, D, dtype=dt, device="cuda", generator=g)
kk = torch.randn(B, KV, S, D, dtype=dt, device="cuda", generator=g)
vv = torch.randn(B, KV, S, D, dtype=dt, device="cuda", generator=g)
rep = lambda t: t[:, :, None].expand(B, KV, H // KV, S, D).reshape(B, H, S, D)  # noqa: E731
with sdpa_kernel([SDPBackend.MATH]):
    ref = F.scaled_dot_product_attention(qq.float(), rep(kk).float(), rep(vv).float(), is_causal=True)
causal_flops = 2 * B * H * S * S * D  # QK^T + PV over the lower triangle (4·B·H·S²·D / 2)
attn = {}
for be_name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                    ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
    for gqa in ("native", "repeat"):
        def fn(be=be, gqa=gqa):
            with sdpa_kernel([be]):
                if gqa == "native":
                    return F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, enable_gqa=True)
                return F.scaled_dot_product_attention(qq, rep(kk), rep(vv), is_causal=True)
        try:
            o = fn()
            err = (o.float() - ref).abs().max().item()
            ms = bench(fn, 30, 5)
            attn[f"{be_name}-{gqa}"] = {"ms": round(ms, 4), "tflops_causal": round(causal_flops / ms / 1e9, 1),
                                        "max_abs_err_vs_fp32": err, "x28_layers_ms": round(28 * ms, 2)}
        except Exception as exc:  # noqa: BLE001
            attn[f"{be_name}-{gqa}"] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
out["attention_b32_h16_kv8_s512_d128_causal"] = attn
ok = {k: v["ms"] for k, v in attn.items() if "ms" in v and v["max_abs_err_vs_fp32"] < 1e-2}
flash = ok.get("flash-native", ok.get("flash-repeat"))
cud = min((v for k, v in ok.items() if k.startswith("cudnn")), default=None)
choice = "cudnn" if cud is not None and flash is not None and cud < 0.95 * flash else "auto"
out["choice"] = choice
json.dump(out, open(sys.argv[1], "w"), indent=1)
print(json.dumps(out, indent=1))
print(f"BACKEND={choice}")
