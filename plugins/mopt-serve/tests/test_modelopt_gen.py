"""modelopt-ptq for a causal LM on CPU: the real worker (calibration on calib texts, the
generation gates on held-out texts, export) with a stand-in for ModelOpt whose "quantization"
perturbs the weights by a known amount: a light one keeps the gates, a heavy one must fail them.
The real ModelOpt run is on the H200 (docs/h200-gen-2026-12-01)."""

from __future__ import annotations

import json
import logging
import textwrap
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from mopt_serve import modelopt_ptq  # noqa: E402
from mopt_serve.modelopt_ptq import ModelOptPtqKind  # noqa: E402

from mopt.api import Artifact, BuildContext  # noqa: E402
from mopt.builtin.hardware import PROFILES  # noqa: E402

STUB = textwrap.dedent(
    """
    import torch
    NOISE = {"FP8_DEFAULT_CFG": 0.002, "INT4_AWQ_CFG": 20.0}
    FP8_DEFAULT_CFG, INT4_AWQ_CFG = "FP8_DEFAULT_CFG", "INT4_AWQ_CFG"
    CALLS = []
    def quantize(model, cfg, forward_loop):
        forward_loop(model)  # calibration
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.dim() == 2 and "embed" not in name:
                    p.mul_(1 + NOISE[cfg] * torch.randn(p.shape, generator=g).to(p.dtype))
        return model
    """
)


def tiny_causal_lm(path: Path) -> Path:
    from mopt_ml.common import read_texts, shipped_sentences_path
    from mopt_ml.families import Qwen3Family
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tok = Qwen3Family().synthetic_tokenizer(read_texts(shipped_sentences_path()))
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                      tie_word_embeddings=True, pad_token_id=tok.pad_token_id)  # fmt: skip
    torch.manual_seed(0)
    Qwen3ForCausalLM(cfg).eval().save_pretrained(str(path))
    tok.save_pretrained(str(path))
    (path / "generation_config.json").write_text('{"do_sample": false}')
    return path


@pytest.fixture
def stub_modelopt(tmp_path, monkeypatch):
    root = tmp_path / "stub"
    q = root / "modelopt" / "torch" / "quantization"
    e = root / "modelopt" / "torch" / "export"
    q.mkdir(parents=True)
    e.mkdir(parents=True)
    (root / "modelopt" / "__init__.py").write_text('__version__ = "stub"\n')
    (root / "modelopt" / "torch" / "__init__.py").write_text("")
    (q / "__init__.py").write_text(STUB)
    (e / "__init__.py").write_text(
        "def export_hf_checkpoint(model, export_dir):\n    model.save_pretrained(export_dir)\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(root))
    monkeypatch.setattr(modelopt_ptq._env, "has_module", lambda m: True)
    monkeypatch.setattr(modelopt_ptq._env, "require_gpu", lambda *a, **k: None)
    return root


def build(tmp_path: Path, weights: Path, **params) -> BuildContext:
    out, tmp = tmp_path / "out", tmp_path / "tmp"
    out.mkdir(parents=True, exist_ok=True)
    tmp.mkdir(parents=True, exist_ok=True)
    root = Path(__file__).resolve().parents[3]
    return BuildContext(
        out=out, tmp=tmp, params=ModelOptPtqKind.Params(**params), inputs={"model": [Artifact(weights, "weights", "weights", "0" * 64, {})]},
        model_name="qwen3-chat", family=None, task="text-generation", source=None,
        hardware={p.name: p for p in PROFILES}["h200"], section="qwen3-chat.h200", target="fp8",
        project_dir=root, logger=logging.getLogger("test"),
    )  # fmt: skip


CALIB = "recipes/data/serve-calib.txt"
HELDOUT = "recipes/data/serve-heldout.txt"


@pytest.mark.slow  # two worker processes importing torch + transformers: ~50 s each on 2 loaded cores
def test_light_quantization_keeps_the_generation_gates(tmp_path, stub_modelopt):
    w = tiny_causal_lm(tmp_path / "w")
    ctx = build(tmp_path, w, qformat="fp8", calib_texts=CALIB, validate_texts=HELDOUT, calib_size=32,
                min_top1=0.9, max_kl=0.01, max_ppl_ratio=1.02)  # fmt: skip
    meta = ModelOptPtqKind().run(ctx)
    assert meta["task"] == "text-generation" and meta["top1"] >= 0.9 and meta["ppl_ratio"] < 1.02
    rep = json.loads((ctx.out / "ptq_report.json").read_text())
    assert rep["validate_texts"] == 64 and rep["calib_texts"] == 32 and rep["validate_tokens"] > 500
    assert 0 <= rep["mean_kl"] <= rep["kl_p99"] < 0.5 and meta["kl_p99"] == rep["kl_p99"]  # the default p99 gate
    assert (ctx.out / "generation_config.json").is_file() and (ctx.out / "tokenizer.json").is_file()


@pytest.mark.slow
def test_heavy_quantization_fails_the_generation_gates(tmp_path, stub_modelopt):
    w = tiny_causal_lm(tmp_path / "w")
    ctx = build(tmp_path, w, qformat="int4_awq", serve_with="tensorrt-llm", calib_texts=CALIB,
                validate_texts=HELDOUT, calib_size=32, min_top1=0.9, max_kl=0.01)  # fmt: skip
    with pytest.raises(
        RuntimeError,
        match=r"int4_awq on held-out texts vs fp32: top-1 next-token agreement 0\.\d+ < min_top1 0\.9",
    ):
        ModelOptPtqKind().run(ctx)
    rep = json.loads((ctx.out / "ptq_report.json").read_text())
    assert rep["mean_kl"] > 0.01 and rep["top1"] < 0.9  # the numbers are kept for the report


def test_generation_gates_default_to_kl_and_read_the_p99():
    """The held-out gates of a causal LM's PTQ: mean KL and its p99 by default (validate's
    values), top-1 and perplexity only where the recipe sets them."""
    p = ModelOptPtqKind.Params(calib_texts=CALIB)
    assert (p.max_kl, p.max_kl_p99, p.min_top1, p.max_ppl_ratio) == (0.05, 0.5, None, None)
    calm = {"top1": 0.6, "mean_kl": 0.0002, "kl_p99": 0.001, "ppl_ratio": 1.2}  # FP8 on a flat model
    assert modelopt_ptq.gen_gate_failures(calm, p) == []
    tail = dict(calm, kl_p99=0.8)
    assert modelopt_ptq.gen_gate_failures(tail, p) == ["KL p99 0.80000 > max_kl_p99 0.5"]
    strict = ModelOptPtqKind.Params(calib_texts=CALIB, min_top1=0.9)
    assert modelopt_ptq.gen_gate_failures(calm, strict) == ["top-1 next-token agreement 0.6000 < min_top1 0.9"]
