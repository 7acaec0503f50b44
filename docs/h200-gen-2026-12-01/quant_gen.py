"""Issue #16 phase-1 probe: ModelOpt PTQ of a Qwen3ForCausalLM (FP8, INT4 AWQ, INT8 SmoothQuant),
`export_hf_checkpoint`, and whether vLLM 0.26 loads each export.
  python3 quant_gen.py export MODEL CALIB_TXT OUTROOT RES      # one subprocess per format
  python3 quant_gen.py vllm-load DIR LABEL RES                 # vLLM's own loader on one export
Results: RES/quant-<fmt>.json, RES/<label>-outputs.json (greedy tokens + top-5 logprobs)."""

import json
import shutil
import sys
import time
from pathlib import Path

FORMATS = {"fp8": "FP8_DEFAULT_CFG", "int4_awq": "INT4_AWQ_CFG", "int8_sq": "INT8_SMOOTHQUANT_CFG"}
PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France.",
    "def add(a, b):\n    return a + b",
    "An H200 has 141 GB of HBM3e memory.",
]


def export_one(model_dir, calib_txt, fmt, out_dir, res):
    import modelopt
    import modelopt.torch.quantization as mtq
    import torch
    from modelopt.torch.export import export_hf_checkpoint
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "right"
    texts = [t for t in Path(calib_txt).read_text().splitlines() if t.strip()][:64]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()

    def loop(m):
        with torch.no_grad():
            for i in range(0, len(texts), 8):
                enc = tok(texts[i:i + 8], return_tensors="pt", padding=True, truncation=True, max_length=256)
                m(**{k: v.cuda() for k, v in enc.items()})

    t0 = time.time()
    mtq.quantize(model, getattr(mtq, FORMATS[fmt]), loop)
    t1 = time.time()
    with torch.inference_mode():
        export_hf_checkpoint(model, export_dir=out_dir)
    t2 = time.time()
    tok.save_pretrained(out_dir)
    for f in ("generation_config.json",):
        if (Path(model_dir) / f).is_file() and not (Path(out_dir) / f).exists():
            shutil.copyfile(Path(model_dir) / f, Path(out_dir) / f)
    cfg = json.loads((Path(out_dir) / "config.json").read_text())
    hq = Path(out_dir) / "hf_quant_config.json"
    rep = {"format": fmt, "config": FORMATS[fmt], "modelopt": modelopt.__version__, "calib_texts": len(texts),
           "quantize_s": round(t1 - t0, 1), "export_s": round(t2 - t1, 1),
           "size_mib": round(sum(p.stat().st_size for p in Path(out_dir).rglob("*") if p.is_file()) / 2**20, 1),
           "files": sorted(p.name for p in Path(out_dir).iterdir()),
           "config_quantization_config": cfg.get("quantization_config"),
           "hf_quant_config": json.loads(hq.read_text()) if hq.is_file() else None}
    (Path(res) / f"quant-{fmt}.json").write_text(json.dumps(rep, indent=2) + "\n")
    print(json.dumps({k: rep[k] for k in ("format", "quantize_s", "export_s", "size_mib")}), flush=True)


def vllm_load(d, label, res):
    """First vLLM's quantization-config parse (what its loader does before any weight), then a
    real engine (eager, small KV) generating 16 greedy tokens per prompt."""
    rep = {"dir": d, "label": label}
    out = Path(res) / f"vllm-load-{label}.json"
    try:
        # the loader's own path: ModelConfig detects the method (override order included),
        # get_quant_config builds its QuantizationConfig from the checkpoint's config
        from vllm.config import LoadConfig, ModelConfig
        from vllm.model_executor.model_loader.weight_utils import get_quant_config

        try:
            mc = ModelConfig(model=d, dtype="bfloat16")
            rep["quantization"] = mc.quantization
            qc = get_quant_config(mc, LoadConfig())
            rep["config_parse"] = f"ok: {type(qc).__name__}"
        except Exception as e:
            rep["config_parse"] = f"{type(e).__name__}: {str(e)[:600]}"
            out.write_text(json.dumps(rep, indent=2) + "\n")
            print(json.dumps(rep), flush=True)
            return
        out.write_text(json.dumps(rep, indent=2) + "\n")
        from transformers import AutoTokenizer
        from vllm import LLM, SamplingParams

        t0 = time.time()
        llm = LLM(model=d, dtype="bfloat16", enforce_eager=True, gpu_memory_utilization=0.3, max_model_len=2048,
                  seed=0)
        rep["engine_start_s"] = round(time.time() - t0, 1)
        tok = AutoTokenizer.from_pretrained(d)
        sp = SamplingParams(max_tokens=16, temperature=0, logprobs=5, ignore_eos=True)
        prompts = [{"prompt_token_ids": tok(t, add_special_tokens=False)["input_ids"]} for t in PROMPTS]
        outs = []
        for p, r in zip(prompts, llm.generate(prompts, sp, use_tqdm=False)):
            c = r.outputs[0]
            outs.append({"prompt_ids": p["prompt_token_ids"], "tokens": list(c.token_ids),
                         "token_logprobs": [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)],
                         "text_head": c.text[:80]})
        (Path(res) / f"{label}-outputs.json").write_text(json.dumps(outs, indent=2) + "\n")
        rep["generate"] = "ok"
    except Exception as e:
        rep["error"] = f"{type(e).__name__}: {str(e)[:600]}"
    out.write_text(json.dumps(rep, indent=2) + "\n")
    print(json.dumps(rep), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "export":
        model, calib, root, res = sys.argv[2:6]
        fmts = sys.argv[6].split(",") if len(sys.argv) > 6 else list(FORMATS)
        for fmt in fmts:
            export_one(model, calib, fmt, f"{root}/q-{fmt}", res)
    elif sys.argv[1] == "export-one":
        export_one(*sys.argv[2:4], sys.argv[4], sys.argv[5], sys.argv[6])
    else:
        vllm_load(*sys.argv[2:5])
