"""`rtn`: an hf-checkpoint's linear weights rounded to N-bit integers, stored back in their
dtype. Per-tensor INT4 of every linear (the head untied and rounded too) is the poor variant
the KL gates must reject; INT8 per channel is a control they must pass."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from mopt.api import Artifact, BuildContext, HardwareProfile

from mopt_ml.common import validation_texts
from mopt_ml.genmetrics import DEFAULT_GATES, compare, gate, metrics, next_token_targets, summarize
from mopt_ml.rtn import RtnKind

CPU = HardwareProfile(name="cpu", description="cpu", device="cpu", gpu_count=0)
#: the CI chat model of recipes/qwen3-chat.toml (initializer 0.2: peaked next-token distributions)
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 512, "initializer_range": 0.2}  # fmt: skip


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mopt_ml.families import Qwen3Family
    from mopt_ml.synthetic import write_synthetic

    src = tmp_path_factory.mktemp("synthetic")
    write_synthetic(Qwen3Family(), 0, TINY, src, task="text-generation")
    return src


def _rtn(src: Path, tmp: Path, **params: Any) -> tuple[Path, dict[str, Any]]:
    out = tmp / "out"
    out.mkdir()
    ctx = BuildContext(
        out=out, tmp=tmp / "tmp", params=RtnKind.Params(**params),
        inputs={"model": [Artifact(path=src, kind="weights", target="weights", digest="x")]},
        model_name="tiny", family=None, task="text-generation", source=None, hardware=CPU,
        section="tiny.cpu", target="int4-tensor", project_dir=tmp, logger=logging.getLogger("mopt-ml-tests.rtn"),
    )  # fmt: skip
    return out, RtnKind().run(ctx)


def _numbers(ref_dir: Path, cand_dir: Path) -> dict[str, Any]:
    """validate's numbers (genmetrics) of `cand_dir` against `ref_dir`, teacher-forced on the
    shipped held-out passages, both in fp32 PyTorch."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(ref_dir))
    texts = validation_texts()
    ids = [
        tok(" ".join(texts[i : i + 4]), add_special_tokens=False)["input_ids"][:96] for i in range(0, 32, 4)
    ]

    def logits(folder: Path) -> list[Any]:
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
        with torch.no_grad():
            return [model(input_ids=torch.tensor([i])).logits[0, :-1].double().numpy() for i in ids]

    ref, cand = logits(ref_dir), logits(cand_dir)
    parts = []
    for i, r, c in zip(ids, ref, cand, strict=True):
        targets = next_token_targets(i)
        parts.append(compare(summarize(r, targets, top_k=r.shape[1]), c, targets))
    return metrics(parts)


def _tensors(folder: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def test_per_tensor_int4_rounds_every_linear_unties_the_head_and_fails_the_kl_gates(
    synthetic: Path, tmp_path: Path
) -> None:
    out, meta = _rtn(synthetic, tmp_path, bits=4, scale="tensor")
    src_t, out_t = _tensors(synthetic), _tensors(out)
    # the tied head was untied: its own rounded lm_head, the embedding lookup unchanged
    assert json.loads((synthetic / "config.json").read_text())["tie_word_embeddings"] is True
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    assert "lm_head.weight" not in src_t and "lm_head.weight" in out_t
    assert out_t["model.embed_tokens.weight"].equal(src_t["model.embed_tokens.weight"])
    linears = [k for k, v in out_t.items() if v.ndim == 2 and "embed_tokens" not in k]
    assert len(linears) == 2 * 7 + 1 == meta["weights"] and meta["untied"] is True
    for k in linears:
        w = out_t[k].double()
        ref = (src_t.get(k, src_t["model.embed_tokens.weight"])).double()
        step = ref.abs().max() / 7  # one scale for the whole tensor, 15 levels
        levels = (w / step).round()
        assert levels.unique().numel() <= 15 and (w - levels * step).abs().max() < 1e-6 * step, k
        assert ((w - ref).abs() <= step / 2 + 1e-6 * step).all(), k
        assert (
            w.dtype == ref.dtype and out_t[k].dtype == src_t.get(k, src_t["model.embed_tokens.weight"]).dtype
        )
    for k, v in src_t.items():  # norms are not linears: untouched
        if v.ndim == 1:
            assert out_t[k].equal(v), k
    assert meta["format"] == "int4-tensor" and 0.05 < meta["rel_error_mean"] < 0.5
    # the gates validate and serve-check apply by default reject it
    numbers = _numbers(synthetic, out)
    _, failed = gate(numbers, DEFAULT_GATES)
    assert numbers["kl_mean"] > DEFAULT_GATES["max_kl"] and any(f.startswith("kl_mean") for f in failed), (
        numbers
    )


def test_int8_per_channel_is_a_control_that_passes(synthetic: Path, tmp_path: Path) -> None:
    out, meta = _rtn(synthetic, tmp_path, bits=8, scale="channel")
    numbers = _numbers(synthetic, out)
    _, failed = gate(numbers, DEFAULT_GATES)
    assert failed == [] and numbers["kl_mean"] < DEFAULT_GATES["max_kl"] / 10, numbers
    assert meta["format"] == "int8-channel" and meta["rel_error_mean"] < 0.01


def test_head_false_keeps_the_tie_and_the_head(synthetic: Path, tmp_path: Path) -> None:
    out, meta = _rtn(synthetic, tmp_path, bits=4, scale="block", block_size=16, head=False)
    out_t, src_t = _tensors(out), _tensors(synthetic)
    assert "lm_head.weight" not in out_t and meta["untied"] is False and meta["weights"] == 14
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    assert out_t["model.embed_tokens.weight"].equal(src_t["model.embed_tokens.weight"])
    assert meta["format"] == "int4-block16"
    # a block of 16 inputs of one output channel shares a scale: at most 15 levels in each
    w = out_t["model.layers.0.mlp.down_proj.weight"].double()  # [out 64, in 128]
    blocks = w.reshape(64, 8, 16)
    steps = (
        src_t["model.layers.0.mlp.down_proj.weight"].double().reshape(64, 8, 16).abs().amax(-1, keepdim=True)
        / 7
    )
    assert ((blocks / steps).round() - blocks / steps).abs().max() < 1e-6


def test_a_checkpoint_without_weights_is_one_clear_line(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    with pytest.raises(ValueError, match=r"rtn: .* has no \*\.safetensors weights"):
        _rtn(tmp_path / "src", tmp_path)
