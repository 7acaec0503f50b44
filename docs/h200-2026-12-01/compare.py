"""Issue #14 item 5, on the H200: the same model and the same tokens through eager PyTorch (bf16
and fp16, SDPA) and vLLM offline (`LLM(runner="pooling", convert="embed").embed` on
pre-tokenized prompts), 32 x 512 batches, each timed as the median of repeated calls.
`python3 compare.py WEIGHTS_DIR OUT.json` (run after the serve-checks, which free the GPU).
vLLM starts its engine core with `spawn`, which re-imports this file: hence the main guard
(its absence stopped the vLLM half on 2026-12-01, after the eager half had run)."""

import json
import statistics
import sys
import time

import torch


def main() -> None:
    weights, out = sys.argv[1], sys.argv[2]
    B, S, REPS = 32, 512, 20
    res = {"batch": B, "seq": S, "device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(10, 500, (REPS + 3, B, S), generator=g)  # the synthetic tokenizer's ids are < 515

    def timed(fn, batches):
        ts = []
        for x in batches:
            torch.cuda.synchronize()
            t = time.perf_counter()
            fn(x)
            torch.cuda.synchronize()
            ts.append((time.perf_counter() - t) * 1e3)
        return ts[3:]  # the first three are warm-up

    from transformers import AutoModel

    for dt in ("bfloat16", "float16"):
        m = (
            AutoModel.from_pretrained(weights, dtype=getattr(torch, dt), attn_implementation="sdpa")
            .cuda()
            .eval()
        )
        with torch.inference_mode():
            ts = timed(lambda x: m(input_ids=x.cuda()).last_hidden_state[:, -1], ids)
        res[f"eager_{dt}"] = {
            "p50_ms": statistics.median(ts),
            "tokens_per_s": B * S / statistics.median(ts) * 1e3,
        }
        print(dt, res[f"eager_{dt}"], flush=True)
        if dt == "float16":
            # torch.compile (mode "default", static shapes) of the same fp16 model, cuDNN SDPA as in
            # recipes/h200-compile.toml (without that artifact's rope-table patch); the first
            # three timed calls (warm-up, dropped) include the compile
            from torch.nn.attention import SDPBackend, sdpa_kernel

            cm = torch.compile(m, dynamic=False)
            t0 = time.perf_counter()
            with torch.inference_mode(), sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                cm(input_ids=ids[0].cuda())
                res["compile_cold_s"] = time.perf_counter() - t0
                ts = timed(lambda x: cm(input_ids=x.cuda()).last_hidden_state[:, -1], ids)
            res["torch_compile_float16"] = {
                "p50_ms": statistics.median(ts),
                "tokens_per_s": B * S / statistics.median(ts) * 1e3,
            }
            print("torch.compile fp16", res["torch_compile_float16"], flush=True)
            del cm
        del m
        torch.cuda.empty_cache()

    with open(out, "w") as f:  # the torch half, kept if vLLM fails
        json.dump(res, f, indent=2)
    from vllm import LLM
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    llm = LLM(
        model=weights,
        runner="pooling",
        convert="embed",
        dtype="bfloat16",
        max_model_len=S,
        enable_prefix_caching=False,
        gpu_memory_utilization=0.8,
        max_num_batched_tokens=B * S,
        max_num_seqs=B,
        pooler_config={"seq_pooling_type": "LAST"},
    )
    res["vllm_offline_start_s"] = time.perf_counter() - t0
    prompts = [[TokensPrompt(prompt_token_ids=row.tolist()) for row in batch] for batch in ids]
    ts = timed(lambda p: llm.embed(p, use_tqdm=False), prompts)
    res["vllm_offline_bfloat16"] = {
        "p50_ms": statistics.median(ts),
        "tokens_per_s": B * S / statistics.median(ts) * 1e3,
    }
    print("vllm offline", res["vllm_offline_bfloat16"], flush=True)
    with open(out, "w") as f:
        json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
