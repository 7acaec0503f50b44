"""Fresh process: warm start from mopt's torch-compile artifact vs eager, same run."""
import json, sys, time
T0 = time.time()
import torch
from mopt_torch.warm import compiled_embedder, load_warm
from mopt_torch.embedder import load_embedder
weights, art, out = sys.argv[1], sys.argv[2], sys.argv[3]
t_call = time.time()
model, meta = compiled_embedder(weights, art)
ids = torch.randint(0, 150000, (32, 512), device="cuda")
mask = torch.ones(32, 512, dtype=torch.long, device="cuda")
with torch.inference_mode():
    y = model(ids, mask); torch.cuda.synchronize()
first = time.time()
res = {"warm_process_start_to_first_s": first - T0, "warm_compile_call_to_first_s": first - t_call}
def bench(m):
    with torch.inference_mode():
        for _ in range(3): m(ids, mask)
        torch.cuda.synchronize(); s = torch.cuda.Event(enable_timing=True); e = torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(20): m(ids, mask)
        e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e) / 20
res["compiled_warm_ms"] = bench(model)
eager, _ = load_embedder(weights, meta["precision"], "cuda", meta.get("family"), meta["pooling"], "sdpa")
res["eager_fp16_ms"] = bench(eager)
res["speedup"] = res["eager_fp16_ms"] / res["compiled_warm_ms"]
json.dump(res, open(out, "w"), indent=1); print(json.dumps(res, indent=1))
