"""`validate` for task = "text-generation": the kind, end to end on a small numpy language
model behind the Generator protocol (genfake), with a real synthetic Qwen3 tokenizer."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("numpy")
pytest.importorskip("transformers")

import genfake
from mopt.api import Artifact, BuildContext, HardwareProfile

from mopt_ml.common import calibration_texts, validation_texts
from mopt_ml.validate import GateFailed, ValidateKind, held_out_passages

CPU = HardwareProfile(name="cpu", description="cpu", device="cpu", gpu_count=0)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from mopt_ml.families import Qwen3Family

    return Qwen3Family().synthetic_tokenizer(calibration_texts() + validation_texts())


@pytest.fixture
def models(tmp_path: Path, tokenizer: Any, monkeypatch: Any) -> dict[str, Path]:
    genfake.install(monkeypatch)
    return {
        "ref": genfake.make_model(tmp_path / "weights", tokenizer),
        "same": genfake.make_model(tmp_path / "onnx", tokenizer, noise=0.0),
        "int8": genfake.make_model(tmp_path / "int8", tokenizer, noise=0.05),
        "int3": genfake.make_model(tmp_path / "int3", tokenizer, noise=1.5),
    }


def run_validate(
    tmp_path: Path, model: Path, ref: Path, cache: Path | None = None, **params: Any
) -> tuple[dict[str, Any], dict[str, Any]]:
    out = tmp_path / f"out-{model.name}-{len(list(tmp_path.iterdir()))}"
    out.mkdir()
    ctx = BuildContext(
        out=out,
        tmp=tmp_path,
        params=ValidateKind.Params(**{"max_texts": 16, **params}),
        inputs={
            "model": [Artifact(model, "onnx", model.name, "d-" + model.name, label=model.name)],
            "reference": [Artifact(ref, "weights", "weights", "digest-of-weights")],
        },
        model_name="chat",
        family=None,
        task="text-generation",
        source=None,
        hardware=CPU,
        section="chat.cpu",
        target="validate",
        project_dir=tmp_path,
        logger=logging.getLogger("genvalidate-test"),
        cache_dir=cache,
    )
    meta = ValidateKind().test(ctx.input("model"), ref, ctx, model.name)
    return meta, json.loads((out / "report.json").read_text())


def test_identical_candidate_passes_with_perfect_numbers(tmp_path: Path, models: dict[str, Path]) -> None:
    meta, rep = run_validate(tmp_path, models["same"], models["ref"])
    assert meta["passed"] and meta["failed_gates"] == []
    m = rep["metrics"]
    assert m["top1_agreement"] == 1.0 and m["kl_mean"] == 0.0 and m["ppl_ratio"] == 1.0
    assert m["greedy_prefix"] == 1.0 and m["greedy_identical"] == 8
    assert rep["task"] == "text-generation" and rep["backend"] == "fake-bigram"
    assert set(rep["gates"]) == {"max_kl", "max_kl_p99"}  # the defaults: distribution distance only
    assert rep["gates"]["max_kl_p99"] == {"limit": 0.5, "value": m["kl_p99"], "passed": True}
    assert rep["texts"]["positions"] == m["positions"] > 500
    g = rep["greedy"][0]
    assert len(g["reference"]) == 32 and g["reference"] == g["candidate"]
    assert isinstance(g["reference_text"], str) and g["reference_text"] == g["candidate_text"]


def test_light_quantization_passes_and_heavy_fails_with_the_numbers(
    tmp_path: Path, models: dict[str, Path]
) -> None:
    meta, rep = run_validate(tmp_path, models["int8"], models["ref"])
    assert meta["passed"], rep["metrics"]
    assert 0 < rep["metrics"]["kl_mean"] < 0.05 and rep["metrics"]["kl_p99"] < 0.5
    with pytest.raises(GateFailed) as err:
        run_validate(tmp_path, models["int3"], models["ref"])
    msg = str(err.value)
    assert msg.startswith("validation gate failed: kl_mean ")
    for part in ("> 0.05", "; kl_p99 ", "> 0.5", "top-1 0.", "ppl ratio", "greedy prefix", "on 16 passages"):
        assert part in msg, msg
    # top-1, perplexity and greedy agreement are in the summary, not among the failures
    assert "top1_agreement" not in msg and "ppl_ratio" not in msg and "greedy_prefix <" not in msg


def test_on_fail_record_keeps_the_failure_in_the_result(tmp_path: Path, models: dict[str, Path]) -> None:
    meta, rep = run_validate(tmp_path, models["int3"], models["ref"], on_fail="record")
    assert meta["passed"] is False and not rep["passed"]
    assert any(f.startswith("kl_mean ") for f in meta["failed_gates"])
    assert rep["worst"] and rep["worst"][0]["kl_mean"] >= rep["worst"][-1]["kl_mean"]


def test_gates_follow_the_recipe(tmp_path: Path, models: dict[str, Path]) -> None:
    # lax enough for the heavy variant: passes
    meta, _ = run_validate(tmp_path, models["int3"], models["ref"], max_kl=None, max_kl_p99=None)
    assert meta["passed"]
    # the optional gates, where the recipe sets them (the keys of before keep working)
    meta, rep = run_validate(
        tmp_path, models["int3"], models["ref"], max_kl=None, max_kl_p99=None, min_top1=0.9,
        max_ppl_ratio=1.05, min_greedy=0.5, on_fail="record",
    )  # fmt: skip
    assert [f.split()[0] for f in meta["failed_gates"]] == ["top1_agreement", "ppl_ratio", "greedy_prefix"]
    assert set(rep["gates"]) == {"min_top1", "max_ppl_ratio", "min_greedy"}
    # strict enough for the light one: fails on KL only
    meta, rep = run_validate(tmp_path, models["int8"], models["ref"], max_kl=1e-6, on_fail="record")
    assert [f.split()[0] for f in meta["failed_gates"]] == ["kl_mean"]
    # no greedy prompts: the greedy gate is off, not failed
    meta, rep = run_validate(tmp_path, models["same"], models["ref"], greedy_prompts=0)
    assert meta["passed"] and "min_greedy" not in rep["gates"] and "greedy_prefix" not in rep["metrics"]


def test_reference_is_computed_once_per_weights(tmp_path: Path, models: dict[str, Path]) -> None:
    cache = tmp_path / "cache"
    genfake.OPENED.clear()
    _, first = run_validate(tmp_path, models["int8"], models["ref"], cache=cache)
    _, second = run_validate(tmp_path, models["int3"], models["ref"], cache=cache, on_fail="record")
    assert genfake.OPENED == {"weights": 1, "int8": 1, "int3": 1}
    assert first["settings"]["reference_cached"] is False and second["settings"]["reference_cached"] is True
    assert len(list(cache.glob("reference-gen-*.npz"))) == 1
    # the cached reference gives the same numbers as a fresh one
    _, fresh = run_validate(tmp_path, models["int3"], models["ref"], on_fail="record")
    assert fresh["metrics"] == second["metrics"]
    # other settings: another reference
    run_validate(tmp_path, models["int8"], models["ref"], cache=cache, greedy_tokens=8)
    assert len(list(cache.glob("reference-gen-*.npz"))) == 2


def test_held_out_text_is_the_validation_split_never_calibration(tmp_path: Path) -> None:
    params = ValidateKind.Params(max_texts=None)
    passages = held_out_passages(params, tmp_path)
    joined = "\n".join(passages)
    assert not any(t in joined for t in calibration_texts())
    assert all(t in joined for t in validation_texts())
    assert len(passages) == -(-len(validation_texts()) // params.passage_sentences)
    # the recipe's own file instead
    (tmp_path / "held.txt").write_text("one two three four five six\nseven eight nine ten\n")
    assert held_out_passages(ValidateKind.Params(data="held.txt"), tmp_path) == [
        "one two three four five six seven eight nine ten"
    ]


# --------------------------------------------------------------------------- a real causal LM


def quantized_copy(src: Path, dst: Path, bits: int, per_tensor: bool) -> Path:
    """`src` with every matrix rounded to a symmetric `bits`-bit grid (scales per row, or
    one per tensor): what weight-only quantization does to a checkpoint, kept in fp32."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    q = 2 ** (bits - 1) - 1
    for f in dst.glob("*.safetensors"):
        sd = load_file(f)
        for k, v in sd.items():
            if v.ndim == 2:
                amax = v.abs().amax() if per_tensor else v.abs().amax(dim=1, keepdim=True)
                s = (amax / q).clamp_min(1e-12)
                sd[k] = (torch.round(v / s).clamp(-q, q) * s).to(v.dtype)
        save_file(sd, f, metadata={"format": "pt"})
    return dst


@pytest.mark.slow  # ~50 s on the shared 2-core machine at load 10 (transformers import, 3 models)
def test_real_tiny_causal_lm_int8_passes_and_ternary_fails(tmp_path: Path) -> None:
    """The torch-eager backend of mopt_ml.genruntime on a synthetic Qwen3ForCausalLM: at
    initializer_range 0.2 (recipes/qwen3-chat.toml's tiny model), 8-bit per-row weights keep
    the default (KL) gates and ternary weights with one scale per tensor fail both, with the
    numbers. At Qwen3's own 0.02 the random model's next-token distribution is nearly uniform
    and even the ternary copy stays under the gates: why the recipe sets 0.2."""
    pytest.importorskip("torch")
    from mopt_ml.families import Qwen3Family
    from mopt_ml.synthetic import write_synthetic
    from mopt_ml.validate import validate_generation

    small = ValidateKind.Params(max_texts=8, greedy_prompts=4, greedy_tokens=8, on_fail="record")
    results = {}
    for init in (0.2, 0.02):
        ref = tmp_path / f"weights-{init}"
        ref.mkdir()
        write_synthetic(Qwen3Family(), 0, {"initializer_range": init}, ref, task="text-generation")
        for name, bits, per_tensor in (("int8", 8, False), ("ternary", 2, True)):
            model = quantized_copy(ref, tmp_path / f"{name}-{init}", bits, per_tensor)
            out = tmp_path / f"out-{name}-{init}"
            out.mkdir()
            results[name, init] = validate_generation(model, ref, out, small, tmp_path, lambda _m: None, label=name)
    good, bad = results["int8", 0.2], results["ternary", 0.2]
    # seen 2026-12-05 (AMD EPYC, 2 cores): at 0.2 int8 KL 0.0011 (p99 0.0043), top-1 0.96; ternary
    # KL 2.2 (p99 3.4), top-1 0.003; at 0.02 ternary KL 0.018 (p99 0.024), top-1 0.56
    assert good["passed"] and good["kl_mean"] < 0.01 and good["kl_p99"] < 0.05, good
    assert not bad["passed"] and bad["kl_mean"] > 0.05 and bad["kl_p99"] > 0.5
    assert bad["failed_gates"] == [f"kl_mean {bad['kl_mean']:.4f} > 0.05", f"kl_p99 {bad['kl_p99']:.4f} > 0.5"]
    assert bad["top1_agreement"] < 0.5  # reported beside the gates
    flat = results["ternary", 0.02]
    assert flat["passed"] and flat["kl_mean"] < 0.05, flat  # the gates cannot see it on a flat model


def test_a_candidate_of_another_vocabulary_is_refused_in_one_line(
    tmp_path: Path, tokenizer: Any, monkeypatch: Any
) -> None:
    genfake.install(monkeypatch)
    ref = genfake.make_model(tmp_path / "weights", tokenizer)
    other = genfake.make_model(tmp_path / "other", tokenizer, noise=0.0)
    (other / "config.json").write_text(json.dumps({"vocab_size": len(tokenizer) + 64, "model_type": "qwen3"}))
    with pytest.raises(
        ValueError, match=r"validate: other gives logits over \d+ tokens, the reference over \d+"
    ):
        run_validate(tmp_path, other, ref)
