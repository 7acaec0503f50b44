"""The `modelopt-ptq` target: a quantized Hugging Face checkpoint from NVIDIA Model Optimizer.

`modelopt.torch.quantization.quantize(model, CFG, forward_loop)` calibrates on real text, then
`modelopt.torch.export.export_hf_checkpoint` writes a checkpoint (weights + hf_quant_config.json)
that TensorRT-LLM and vLLM (`--quantization modelopt` / `modelopt_fp4`) load. The format is
gated on the hardware profile: FP8 needs compute capability 8.9, NVFP4 Blackwell (10.x / 12.x).
Runs in a subprocess so torch and modelopt never load into mopt's process.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field

from mopt.api import BuildContext, CheckContext, Finding, Input, Params, Role, TargetKind
from mopt.api import plugin_env as _env
from mopt_serve import common

INSTALL_MODELOPT = 'pip install "nvidia-modelopt[torch]"'

#: qformat → (ModelOpt config name, minimum compute capability)
QFORMATS: dict[str, tuple[str, tuple[int, int]]] = {
    "fp8": ("FP8_DEFAULT_CFG", (8, 9)),
    "int8_sq": ("INT8_SMOOTHQUANT_CFG", (7, 5)),
    "int4_awq": ("INT4_AWQ_CFG", (8, 0)),
    "w4a8_awq": ("W4A8_AWQ_BETA_CFG", (8, 9)),
    "nvfp4": ("NVFP4_DEFAULT_CFG", (10, 0)),
}

#: the qformats whose ModelOpt export vLLM 0.26 loads (measured on the H200, 2026-12-01:
#: FP8 served; INT4 AWQ (quant_algo W4A16_AWQ) and INT8 SmoothQuant (W8A8_SQ_PER_CHANNEL)
#: refused by vLLM's ModelOpt loader, docs/h200-gen-2026-12-01/phase1/vllm-load-*.json)
VLLM_LOADS = ("fp8", "nvfp4")
#: what `export_hf_checkpoint` (ModelOpt 0.47) writes as quant_algo for each qformat
EXPORTED_ALGO = {"fp8": "FP8", "int8_sq": "W8A8_SQ_PER_CHANNEL", "int4_awq": "W4A16_AWQ",
                 "w4a8_awq": "W4A8_AWQ", "nvfp4": "NVFP4"}  # fmt: skip

WORKER = r"""
import json, shutil, sys, time
from pathlib import Path
spec = json.loads(open(sys.argv[1]).read())
import torch
import modelopt
import modelopt.torch.quantization as mtq
from modelopt.torch.export import export_hf_checkpoint
from transformers import AutoModelForCausalLM, AutoTokenizer

tok = AutoTokenizer.from_pretrained(spec["model"])
if tok.pad_token is None:
    tok.pad_token = tok.eos_token
tok.padding_side = "right"
# the causal-LM class: ModelOpt's HF export writes decoder checkpoints of that layout, which
# vLLM loads for pooling too (--runner pooling --convert embed); an embedding model's base
# weights load into it (its lm_head is tied to the embeddings)
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # the kind requires a GPU; CPU for its tests
model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32).to(DEV).eval()
texts, vtexts = spec["texts"], spec["validate_texts"]
bs, seq = spec["batch_size"], spec["seq_len"]

def batches(ts):
    for i in range(0, len(ts), bs):
        enc = tok(ts[i:i + bs], return_tensors="pt", padding=True, truncation=True, max_length=seq)
        yield {k: v.to(DEV) for k, v in enc.items()}

def embed(m, ts):
    # the family's pooling on the base model's last hidden state (right padding: the last
    # position the mask keeps), L2-normalised
    out = []
    with torch.no_grad():
        for b in batches(ts):
            h = m.model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).last_hidden_state.float()
            mask = b["attention_mask"]
            if spec["pooling"] == "last-token":
                pooled = h[torch.arange(h.shape[0]), mask.sum(1) - 1]
            elif spec["pooling"] == "cls":
                pooled = h[:, 0]
            else:
                mm = mask.unsqueeze(-1).float()
                pooled = (h * mm).sum(1) / mm.sum(1).clamp(min=1e-9)
            out.append(torch.nn.functional.normalize(pooled, dim=-1))
    return torch.cat(out)

def next_token_logprobs(m, ts):
    # teacher-forced next-token log-probabilities at every real position (right padding)
    out = []
    with torch.no_grad():
        for b in batches(ts):
            logits = m(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits.float()
            lp = torch.log_softmax(logits[:, :-1], -1)
            keep = b["attention_mask"][:, 1:].bool()
            out.append((lp[keep], b["input_ids"][:, 1:][keep]))
    return out

generation = spec.get("task") == "text-generation"
# fp32 reference, before quantization
ref = next_token_logprobs(model, vtexts) if generation else embed(model, vtexts)
model = model.to(torch.bfloat16)

def forward_loop(m):
    with torch.no_grad():
        for b in batches(texts):
            m(**b)

t0 = time.time()
cfg = getattr(mtq, spec["config"])
mtq.quantize(model, cfg, forward_loop)
t1 = time.time()
# validation on held-out texts (never the calibration set), with the quantizers active
if generation:
    # mean KL(reference || quantized) and its 99th percentile over positions, top-1 next-token
    # agreement, perplexity ratio
    agree = nll_q = nll_r = n = 0.0
    kls = []
    for (lr, tgt), (lq, _) in zip(ref, next_token_logprobs(model, vtexts)):
        agree += float((lr.argmax(-1) == lq.argmax(-1)).sum())
        kls.append((lr.exp() * (lr - lq)).sum(-1).clamp(min=0).double().cpu())
        nll_r -= float(lr.gather(1, tgt[:, None]).sum())
        nll_q -= float(lq.gather(1, tgt[:, None]).sum())
        n += tgt.numel()
    kl = torch.cat(kls)
    metrics = {"top1": agree / n, "mean_kl": float(kl.mean()), "kl_p99": float(torch.quantile(kl, 0.99)),
               "ppl_ratio": float(torch.exp(torch.tensor((nll_q - nll_r) / n))),
               "ppl_reference": float(torch.exp(torch.tensor(nll_r / n))), "validate_tokens": int(n)}
else:
    cos = (embed(model, vtexts) * ref).sum(-1)
    metrics = {"min_cosine": float(cos.min()), "mean_cosine": float(cos.mean())}
with torch.inference_mode():
    export_hf_checkpoint(model, export_dir=spec["out"])
t2 = time.time()
tok.save_pretrained(spec["out"])
src, out = Path(spec["model"]), Path(spec["out"])
for rel in spec["copy_files"]:  # sentence-transformers files, generation_config.json, chat template
    if (src / rel).is_file() and not (out / rel).exists():
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src / rel, out / rel)
report = {
    "modelopt": modelopt.__version__, "config": spec["config"], "calib_texts": len(texts),
    "validate_texts": len(vtexts), "task": spec.get("task", "embedding"), **metrics,
    "quantize_s": round(t1 - t0, 2), "export_s": round(t2 - t1, 2),
}
Path(spec["report"]).write_text(json.dumps(report, indent=2) + "\n")
print("validation vs fp32 on held-out texts:", json.dumps(report))
"""


def read_texts(path: Path, limit: int) -> list[str]:
    """Texts from a .jsonl (`text` field) or plain text file (one per line)."""
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line:
            continue
        if path.suffix == ".jsonl":
            obj = json.loads(line)
            line = obj["text"] if isinstance(obj, dict) else str(obj)
        out.append(line)
        if len(out) >= limit:
            break
    return out


class ModelOptPtqKind(TargetKind):
    """FP8 / INT8-SQ / INT4-AWQ / W4A8-AWQ / NVFP4 checkpoint via ModelOpt PTQ."""

    name = "modelopt-ptq"
    # GPU kind not yet run under bubblewrap on a GPU machine: a plain worker process
    sandbox = False
    version = "1"
    description = "quantized HF checkpoint via nvidia-modelopt mtq.quantize + export_hf_checkpoint"
    memory_model = "none"
    consumes = (Input("model", kinds=common.CHECKPOINT_KINDS),)
    produces = "modelopt-checkpoint"
    requires = ("gpu", "python:modelopt", "python:torch", "python:transformers")
    resources: ClassVar[dict[str, int]] = {"cpu": 1, "gpu": 1}
    reproducible = False  # calibration statistics come from GPU kernels with atomics
    install_hints: ClassVar[dict[str, str]] = {"python:modelopt": INSTALL_MODELOPT}

    class Params(Params):
        qformat: Literal["fp8", "int8_sq", "int4_awq", "w4a8_awq", "nvfp4"] = "fp8"
        calib_texts: str = Field(
            description="a .jsonl (`text`) or .txt of calibration texts (relative to the recipe)"
        )
        calib_size: int = Field(
            default=512, ge=1, description="number of calibration samples (128-512 is usual)"
        )
        calib_seq_len: Annotated[int, Role.seq_len] = Field(default=512, ge=8)
        batch_size: int = Field(default=8, ge=1)
        validate_texts: str | None = Field(
            default=None,
            description="held-out .jsonl / .txt: the quantized model's embeddings vs fp32 before export "
            "(must share no text with calib_texts)",
        )
        num_validate: int = Field(default=64, ge=1)
        min_cosine: float | None = Field(
            default=None, description="gate on the held-out min cosine vs fp32 (null: record only)"
        )
        min_top1: float | None = Field(
            default=None,
            ge=0,
            le=1,
            description="text generation: gate on held-out top-1 next-token agreement with fp32 (null: record only)",
        )
        max_kl: float | None = Field(
            default=common.DEFAULT_KL_GATES["max_kl"],
            ge=0,
            description="text generation: gate on the held-out mean KL(fp32 || quantized) per token, nats "
            "(validate's default; null: record only)",
        )
        max_kl_p99: float | None = Field(
            default=common.DEFAULT_KL_GATES["max_kl_p99"],
            ge=0,
            description="text generation: gate on its 99th percentile over positions, nats (null: record only)",
        )
        max_ppl_ratio: float | None = Field(
            default=None, gt=0, description="text generation: gate on held-out perplexity, quantized / fp32"
        )
        serve_with: Literal["vllm", "tensorrt-llm"] = Field(
            default="vllm",
            description="the engine that will load the export: mopt check refuses qformats it does not load",
        )

    def input_files(self, params: Any, project_dir: Path) -> list[Path]:
        files = [(project_dir / params.calib_texts).resolve()]
        if params.validate_texts:
            files.append((project_dir / params.validate_texts).resolve())
        return files

    def fingerprint(self) -> dict[str, str]:
        return {
            "nvidia-modelopt": _env.dist_version("nvidia-modelopt") or "missing",
            "torch": _env.dist_version("torch") or "missing",
            "transformers": _env.dist_version("transformers") or "missing",
        }

    def check(self, params: Any, ctx: CheckContext) -> list[Finding]:
        hw, cfg = ctx.hardware, ctx.model_config or {}
        out: list[Finding] = []

        def add(sev: str, code: str, msg: str, fix: str = "", key: str | None = None) -> None:
            out.append(Finding(sev, code, msg, fix, ctx.section, ctx.target, key))

        if not hw.is_gpu:
            add(
                "error",
                "engine-on-cpu",
                f"ModelOpt checkpoints are for GPU serving; profile {hw.name!r} has no GPU",
            )
            return out
        _, need = QFORMATS[params.qformat]
        if (hw.compute_capability or (0, 0)) < need:
            ok = [q for q, (_, cc) in QFORMATS.items() if (hw.compute_capability or (0, 0)) >= cc]
            add(
                "error",
                "precision-unsupported",
                f"qformat {params.qformat!r} needs compute capability >= {need[0]}.{need[1]}; {hw.name} is "
                f"{common.cc_str(hw)}",
                f"qformat = one of {ok}",
                "qformat",
            )
        if params.serve_with == "vllm" and params.qformat not in VLLM_LOADS:
            add(
                "error",
                "qformat-not-served",
                f"vLLM 0.26 does not load ModelOpt {params.qformat!r} exports ({QFORMATS[params.qformat][0]} is "
                f"exported as quant_algo {EXPORTED_ALGO[params.qformat]!r}; vLLM's ModelOpt loader takes FP8, "
                "FP8_PER_CHANNEL_PER_TOKEN, FP8_PB_WO, NVFP4, W4A16_NVFP4, MXFP8, MIXED_PRECISION: its "
                "'ModelOpt currently only supports ...' error, seen on the H200 2026-12-01)",
                'qformat = "fp8" (or "nvfp4" on Blackwell), or serve_with = "tensorrt-llm"',
                "qformat",
            )
        if params.validate_texts is None:
            add(
                "warning",
                "no-heldout",
                "no validate_texts: the quantized model is checked on calibration texts, which it was fitted to",
                "validate_texts = a held-out .txt / .jsonl sharing no text with calib_texts",
                "validate_texts",
            )
        if not 128 <= params.calib_size <= 512:
            add(
                "warning",
                "calib-size",
                f"calib_size {params.calib_size}: ModelOpt's guidance is 128-512 samples",
                key="calib_size",
            )
        if common.is_encoder(cfg):
            add(
                "error",
                "encoder-model",
                f"model_type {cfg.get('model_type')!r} is an encoder: the ModelOpt HF export serves decoder "
                "checkpoints to TensorRT-LLM / vLLM",
                "quantize its ONNX graph with modelopt-quantize instead",
            )
        return out

    def run(self, ctx: BuildContext) -> dict[str, Any]:
        p = ctx.params
        for mod, hint in (
            ("modelopt", INSTALL_MODELOPT),
            ("torch", "pip install torch"),
            ("transformers", "pip install transformers"),
        ):
            if not _env.has_module(mod):
                raise RuntimeError(f"target kind 'modelopt-ptq' needs the Python package {mod!r} ({hint})")
        _env.require_gpu(self.name)
        texts = read_texts((ctx.project_dir / p.calib_texts).resolve(), p.calib_size)
        if not texts:
            raise RuntimeError(f"{p.calib_texts} holds no calibration texts")
        vtexts = texts[: min(16, len(texts))]
        if p.validate_texts:
            vtexts = read_texts((ctx.project_dir / p.validate_texts).resolve(), p.num_validate)
            shared = set(vtexts) & set(texts)
            if shared:
                raise RuntimeError(
                    f"{p.validate_texts} shares {len(shared)} texts with {p.calib_texts} "
                    f"(e.g. {sorted(shared)[0]!r}): validation texts must be held out from calibration"
                )
        config_name, _ = QFORMATS[p.qformat]
        spec = {
            "model": str(ctx.input("model").path),
            "out": str(ctx.out),
            "texts": texts,
            "config": config_name,
            "batch_size": p.batch_size,
            "seq_len": p.calib_seq_len,
            "validate_texts": vtexts,
            "pooling": str(getattr(ctx.family, "pooling", "mean") or "mean"),
            "task": ctx.task,
            "copy_files": ["modules.json", "sentence_bert_config.json", "config_sentence_transformers.json",
                           "1_Pooling/config.json", "generation_config.json", "chat_template.jinja"],
            "report": str(ctx.out / "ptq_report.json"),
        }  # fmt: skip
        (ctx.tmp / "spec.json").write_text(json.dumps(spec))
        (ctx.tmp / "ptq_worker.py").write_text(WORKER)
        argv = [sys.executable, str(ctx.tmp / "ptq_worker.py"), str(ctx.tmp / "spec.json")]
        ctx.log(f"ModelOpt {config_name} on {len(texts)} texts")
        proc = subprocess.run(
            argv, cwd=ctx.tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace"
        )
        for line in proc.stdout.splitlines():
            ctx.log(line)
        if proc.returncode != 0:
            raise RuntimeError(f"ModelOpt PTQ failed (exit {proc.returncode}; log above)")
        rep = json.loads((ctx.out / "ptq_report.json").read_text())
        if ctx.task == "text-generation":
            bad = gen_gate_failures(rep, p)
            if bad:
                raise RuntimeError(f"{p.qformat} on held-out texts vs fp32: " + "; ".join(bad))
            return {
                "task": ctx.task,
                "top1": rep["top1"],
                "mean_kl": rep["mean_kl"],
                "kl_p99": rep["kl_p99"],
                "ppl_ratio": rep["ppl_ratio"],
                "validate_texts": rep["validate_texts"],
                "validate_tokens": rep["validate_tokens"],
                "quantize_s": rep["quantize_s"],
                "export_s": rep["export_s"],
                "qformat": p.qformat,
                "modelopt_config": config_name,
                "calib_samples": len(texts),
                "modelopt": _env.dist_version("nvidia-modelopt"),
            }
        if p.min_cosine is not None and not rep["min_cosine"] >= p.min_cosine:
            raise RuntimeError(
                f"{p.qformat} on held-out texts: min cosine {rep['min_cosine']:.5f} vs fp32 < min_cosine {p.min_cosine}"
            )
        return {
            "min_cosine": rep["min_cosine"],
            "mean_cosine": rep["mean_cosine"],
            "validate_texts": rep["validate_texts"],
            "quantize_s": rep["quantize_s"],
            "export_s": rep["export_s"],
            "qformat": p.qformat,
            "modelopt_config": config_name,
            "calib_samples": len(texts),
            "modelopt": _env.dist_version("nvidia-modelopt"),
        }


def gen_gate_failures(rep: dict[str, Any], p: Any) -> list[str]:
    """The generation gates a quantized model's held-out numbers fail (empty: all pass)."""
    out = []
    if p.min_top1 is not None and not rep["top1"] >= p.min_top1:
        out.append(f"top-1 next-token agreement {rep['top1']:.4f} < min_top1 {p.min_top1}")
    if p.max_kl is not None and not rep["mean_kl"] <= p.max_kl:
        out.append(f"mean KL {rep['mean_kl']:.5f} > max_kl {p.max_kl}")
    if p.max_kl_p99 is not None and not rep["kl_p99"] <= p.max_kl_p99:
        out.append(f"KL p99 {rep['kl_p99']:.5f} > max_kl_p99 {p.max_kl_p99}")
    if p.max_ppl_ratio is not None and not rep["ppl_ratio"] <= p.max_ppl_ratio:
        out.append(f"perplexity ratio {rep['ppl_ratio']:.4f} > max_ppl_ratio {p.max_ppl_ratio}")
    return out
