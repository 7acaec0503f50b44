"""The `weights` target: canonical folder, manifest content, and what it refuses."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from mopt_ml.families import Qwen3Family
from mopt_ml.weights import WeightsKind


def _copy_without_weights(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copyfile(f, dst / f.name)
    return dst


def test_qwen3_weights_manifest_lists_every_tensor(qwen3_chain: dict[str, Any]) -> None:
    from safetensors import safe_open

    w = qwen3_chain["weights"]
    manifest = json.loads((w / "manifest.json").read_text())
    tensors = manifest["tensors"]
    assert tensors["embed_tokens.weight"]["shape"] == [515, 64]
    assert tensors["layers.0.self_attn.q_proj.weight"]["shape"] == [64, 64]  # 4 heads x 16
    assert tensors["layers.1.self_attn.k_proj.weight"]["shape"] == [32, 64]  # 2 kv heads x 16
    assert tensors["layers.0.self_attn.q_norm.weight"]["shape"] == [16]
    assert tensors["norm.weight"] == {"shape": [64], "dtype": "float32", "file": "model.safetensors"}
    with safe_open(str(w / "model.safetensors"), "np") as f:
        assert sorted(f.keys()) == sorted(tensors)
        assert f.metadata() == {"format": "pt"}
    assert manifest["num_parameters"] == sum(__import__("math").prod(t["shape"]) for t in tensors.values())
    assert manifest["model_class"] == "Qwen3Model"
    cfg = json.loads((w / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3Model"]
    assert cfg["pad_token_id"] == manifest["tokenizer"]["pad_token_id"] is not None
    assert (w / "tokenizer.json").is_file() and (w / "tokenizer_config.json").is_file()
    assert manifest["check"]["min_cosine"] > 0.9999


def test_minilm_weights_drop_unused_buffers_and_keep_loader_files(minilm_chain: dict[str, Any]) -> None:
    w = minilm_chain["weights"]
    manifest = json.loads((w / "manifest.json").read_text())
    assert manifest["family"] == "bert"
    assert "embeddings.position_ids" in manifest["dropped"]
    assert "embeddings.position_ids" not in manifest["tensors"]
    assert manifest["tensors"]["embeddings.word_embeddings.weight"]["shape"] == [30522, 384]
    assert manifest["tensors"]["encoder.layer.5.intermediate.dense.weight"]["shape"] == [1536, 384]
    assert 22_000_000 < manifest["num_parameters"] < 23_000_000
    assert (w / "modules.json").is_file() and (w / "1_Pooling" / "config.json").is_file()
    cfg = json.loads((w / "config.json").read_text())
    assert cfg["pad_token_id"] == 0 and cfg["model_type"] == "bert"
    assert "gradient_checkpointing" not in cfg


def test_dtype_cast_to_fp16(runner: Any, synthetic_qwen3: Path) -> None:
    from safetensors import safe_open

    out, meta = runner.run(WeightsKind, {"dtype": "fp16"}, source=synthetic_qwen3, family=Qwen3Family)
    assert meta["dtype"] == "float16"
    manifest = json.loads((out / "manifest.json").read_text())
    assert {t["dtype"] for t in manifest["tensors"].values()} == {"float16"}
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert str(f.get_tensor("embed_tokens.weight").dtype) == "torch.float16"
    assert json.loads((out / "config.json").read_text())["dtype"] == "float16"
    assert manifest["check"]["min_cosine"] > 0.99


def test_missing_pad_token_id_is_set_from_the_tokenizer(
    runner: Any, synthetic_qwen3: Path, tmp_path: Path
) -> None:
    src = tmp_path / "ckpt"
    shutil.copytree(synthetic_qwen3, src)
    cfg = json.loads((src / "config.json").read_text())
    del cfg["pad_token_id"]
    (src / "config.json").write_text(json.dumps(cfg))
    out, meta = runner.run(WeightsKind, source=src, family=Qwen3Family)
    fixed = json.loads((out / "config.json").read_text())
    assert fixed["pad_token_id"] == 512  # <|endoftext|> of the synthetic tokenizer
    assert any("pad_token_id was missing" in n for n in meta["notes"])


def test_causal_lm_checkpoint_stores_the_tied_table_once(
    runner: Any, synthetic_qwen3: Path, tmp_path: Path
) -> None:
    """A *ForCausalLM checkpoint with a separate copy of the tied lm_head: the base model keeps
    one embedding table, the `model.` prefix goes, lm_head is dropped and listed."""
    from safetensors.torch import load_file, save_file

    src = _copy_without_weights(synthetic_qwen3, tmp_path / "causal")
    sd = load_file(str(synthetic_qwen3 / "model.safetensors"))
    causal = {f"model.{k}": v for k, v in sd.items()}
    causal["lm_head.weight"] = sd["embed_tokens.weight"].clone()
    save_file(causal, str(src / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    cfg["architectures"] = ["Qwen3ForCausalLM"]
    (src / "config.json").write_text(json.dumps(cfg))
    out, _meta = runner.run(WeightsKind, source=src, family=Qwen3Family)
    manifest = json.loads((out / "manifest.json").read_text())
    assert "lm_head.weight" in manifest["dropped"]
    assert [k for k in manifest["tensors"] if "embed" in k] == ["embed_tokens.weight"]
    assert set(manifest["tensors"]) == set(sd)
    assert manifest["check"]["min_cosine"] > 0.9999


def test_safe_pickle_is_converted_and_unsafe_pickle_refused(
    runner: Any, synthetic_qwen3: Path, tmp_path: Path
) -> None:
    import torch
    from safetensors.torch import load_file

    safe = _copy_without_weights(synthetic_qwen3, tmp_path / "safe")
    torch.save(load_file(str(synthetic_qwen3 / "model.safetensors")), safe / "pytorch_model.bin")
    out, meta = runner.run(WeightsKind, source=safe, family=Qwen3Family)
    assert any("weights_only=True" in n for n in meta["notes"])
    assert (out / "model.safetensors").is_file() and not list(out.glob("*.bin"))

    unsafe = _copy_without_weights(synthetic_qwen3, tmp_path / "unsafe")
    torch.save({"embed_tokens.weight": _Payload()}, unsafe / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"refusing pytorch_model\.bin.*weights_only=True"):
        runner.run(WeightsKind, source=unsafe, family=Qwen3Family)


class _Payload:
    """An object whose unpickling would run code."""

    def __reduce__(self) -> Any:
        return (print, ("this must never run",))


def test_checkpoint_without_tokenizer_or_tensors_is_refused(
    runner: Any, synthetic_qwen3: Path, tmp_path: Path
) -> None:
    from safetensors.torch import load_file, save_file

    no_tok = tmp_path / "no-tok"
    no_tok.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copyfile(synthetic_qwen3 / name, no_tok / name)
    with pytest.raises(FileNotFoundError, match="no tokenizer"):
        runner.run(WeightsKind, source=no_tok, family=Qwen3Family)

    partial = _copy_without_weights(synthetic_qwen3, tmp_path / "partial")
    sd = load_file(str(synthetic_qwen3 / "model.safetensors"))
    save_file({k: v for k, v in sd.items() if "layers.1.mlp" not in k}, str(partial / "model.safetensors"))
    with pytest.raises(ValueError, match=r"lacks 3 tensor\(s\)"):
        runner.run(WeightsKind, source=partial, family=Qwen3Family)


def test_weights_output_is_byte_identical_when_rebuilt(
    runner: Any, qwen3_chain: dict[str, Any], synthetic_qwen3: Path
) -> None:
    import hashlib

    def digests(folder: Path) -> dict[str, str]:
        return {
            str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*"))
            if p.is_file()
        }

    again, _ = runner.run(WeightsKind, source=synthetic_qwen3, family=Qwen3Family)
    assert digests(again) == digests(qwen3_chain["weights"])
