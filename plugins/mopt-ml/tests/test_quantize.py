"""The `ort-quantize` target: quantized ops, smoothing, modes and calibration data."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest


def _ops(path: Path) -> dict[str, int]:
    import onnx

    from mopt_ml.quantize import op_histogram

    return op_histogram(onnx.load(str(path)))


def test_default_recipe_is_smoothed_dynamic_per_channel_matmul(minilm_chain: dict[str, Any]) -> None:
    from mopt_ml.quantize import resolve_weight_type

    q = minilm_chain["ort-quantize"]
    ops = _ops(q / "model.onnx")
    # every Linear of the 6 layers is quantized (q, k, v, out, ffn-in, ffn-out); attention stays fp32
    assert ops.get("MatMulInteger", 0) == 36
    assert ops.get("DynamicQuantizeLinear", 0) >= 18
    meta = json.loads((q / "mopt_ml.json").read_text())
    quant = meta["quantization"]
    assert meta["precision"] == "int8"
    assert quant["mode"] == "dynamic" and quant["per_channel"] and quant["op_types"] == ["MatMul"]
    assert quant["weight_type"] == resolve_weight_type("auto")
    # one smoothing Mul per group of MatMuls sharing an input: 4 groups x 6 layers
    assert quant["smooth"]["groups"] == 24 and quant["smooth"]["matmuls"] == 36
    assert quant["smooth"]["max_outlier_ratio"] > 5  # MiniLM has outlier channels
    import onnx

    nodes = onnx.load(str(q / "model.onnx")).graph.node
    assert sum(n.op_type == "Mul" and n.name.startswith("mopt_smooth_") for n in nodes) == 24
    assert quant["calibration"] == {"texts": 40, "pad_to": 128, "source": "shipped calibration split"}
    assert quant["check_vs_fp32"]["min_cosine"] > 0.98
    # MatMul weights are int8 now; the embedding table (a Gather) stays fp32
    assert (q / "model.onnx").stat().st_size < (minilm_chain["onnx"] / "model.onnx").stat().st_size * 0.7


def test_smoothing_keeps_the_fp32_function(qwen3_chain: dict[str, Any], tmp_path: Path) -> None:
    """Mul(X, 1/s) with W <- diag(s) W computes the same product: the smoothed fp32 graph
    matches the original before any quantization."""
    import onnx

    from mopt_ml.common import (
        calibration_texts,
        embed_onnx,
        load_tokenizer,
        ort_session,
        tokenize,
        validation_texts,
    )
    from mopt_ml.quantize import activation_max, apply_smoothing, matmul_groups

    src = qwen3_chain["onnx"] / "model.onnx"
    tok = load_tokenizer(qwen3_chain["onnx"])
    model = onnx.load(str(src))
    groups = matmul_groups(model)
    # q/k/v share an input, gate/up share one; o_proj and down_proj stand alone: 4 per layer
    assert len(groups) == 8 and sorted(len(g) for g in groups.values()) == [1, 1, 1, 1, 2, 2, 3, 3]
    feeds = [tokenize(tok, calibration_texts()[:8], 64, pad_to=64)]
    amax = activation_max(src, list(groups), feeds, tmp_path)
    info = apply_smoothing(model, groups, amax, alpha=0.7)
    assert info["groups"] == 8
    onnx.save(model, str(tmp_path / "smoothed.onnx"))
    texts = validation_texts()[:16]
    a = embed_onnx(ort_session(src), tok, texts)
    b = embed_onnx(ort_session(tmp_path / "smoothed.onnx"), tok, texts)
    assert np.abs(a - b).max() < 1e-4


def test_static_qdq_and_plain_dynamic_variants(
    runner: Any, qwen3_chain: dict[str, Any], tmp_path: Path
) -> None:
    from mopt_ml.quantize import OrtQuantizeKind

    src = {"model": [runner.artifact(qwen3_chain["onnx"], "onnx")]}
    calib = runner.project_dir / "calib.jsonl"
    calib.write_text(
        "\n".join(json.dumps({"text": t}) for t in ("one text", "another text", "a third")) + "\n"
    )
    out, _meta = runner.run(
        OrtQuantizeKind, {"mode": "static", "smooth": False, "calibration": "calib.jsonl"}, inputs=src
    )
    ops = _ops(out / "model.onnx")
    assert ops.get("QuantizeLinear", 0) > 0 and ops.get("DequantizeLinear", 0) > 0
    quant = json.loads((out / "mopt_ml.json").read_text())["quantization"]
    assert quant["mode"] == "static" and quant["calibration"]["texts"] == 3
    assert quant["calibration"]["source"] == "calib.jsonl"

    out2, _ = runner.run(
        OrtQuantizeKind,
        {"smooth": False, "per_channel": False, "op_types": [], "weight_type": "qint8"},
        inputs=src,
    )
    ops2 = _ops(out2 / "model.onnx")
    assert ops2.get("MatMulInteger", 0) > 0 and not any(k.startswith("mopt_smooth") for k in ops2)
    q2 = json.loads((out2 / "mopt_ml.json").read_text())["quantization"]
    assert q2["smooth"] is None and q2["weight_type"] == "qint8"


def test_auto_weight_type_follows_the_cpu() -> None:
    from mopt_ml.common import cpu_int8_dot
    from mopt_ml.quantize import OrtQuantizeKind, resolve_weight_type

    assert resolve_weight_type("qint8") == "qint8"
    expected = "qint8" if cpu_int8_dot() in ("vnni", "amx") else "quint8"
    assert resolve_weight_type("auto") == expected
    assert OrtQuantizeKind().platform(None) == {"int8_dot": cpu_int8_dot()}


def test_a_sweep_computes_preprocessing_calibration_and_check_once(
    qwen3_chain: dict[str, Any], tmp_path: Path
) -> None:
    """The shared steps of two quantizations of one graph come from the cache the second
    time, and the result is the same bytes as without the cache."""
    from mopt_ml.quantize import OrtQuantizeKind, Shared, quantize

    src = qwen3_chain["onnx"]
    params = OrtQuantizeKind.Params(smooth_alpha=0.5, check_texts=8)
    outs = []
    for i, cache in enumerate([None, Shared(tmp_path / "cache", "digest-a"), Shared(tmp_path / "cache", "digest-a")]):
        out, tmp = tmp_path / f"out{i}", tmp_path / f"tmp{i}"
        out.mkdir()
        tmp.mkdir()
        result = quantize(src, out, tmp, params, tmp_path, lambda _m: None, cache)
        outs.append(((out / "model.onnx").read_bytes(), result["check_vs_fp32"]))
    files = {p.name for p in (tmp_path / "cache").iterdir() if not p.name.endswith(".lock")}
    assert sorted(f.split("-")[0] for f in files) == ["amax", "check", "pre"]
    assert outs[0] == outs[1] == outs[2]
    # another graph (digest) does not read them
    assert Shared(tmp_path / "cache", "digest-a").path("pre", {}, ".onnx").name in files
    assert Shared(tmp_path / "cache", "digest-b").path("pre", {}, ".onnx").name not in files


def test_rtn_rounds_each_matmul_weight_to_its_grid_and_nothing_else() -> None:
    """mode "rtn"'s fake quantization on a hand-made graph: a MatMul weight W [in 64, out 8]
    rounded to 4-bit symmetric levels with one scale per tensor, per output column or per
    block of 32 input rows; an initializer that a Gather also reads is left alone."""
    from onnx import TensorProto, helper, numpy_helper

    from mopt_ml.quantize import fake_quantize_matmuls

    rng = np.random.default_rng(0)
    w = rng.normal(0.0, 0.02, size=(64, 8)).astype(np.float32)
    w[:, 3] *= 10.0  # one wide column: per-tensor scaling coarsens every other column
    emb = rng.normal(size=(10, 64)).astype(np.float32)

    def graph() -> Any:
        nodes = [helper.make_node("Gather", ["emb", "ids"], ["x"]), helper.make_node("MatMul", ["x", "w"], ["y"]),
                 helper.make_node("MatMul", ["y2", "emb"], ["z"])]  # fmt: skip
        g = helper.make_graph(
            nodes, "g",
            [helper.make_tensor_value_info("ids", TensorProto.INT64, [3]),
             helper.make_tensor_value_info("y2", TensorProto.FLOAT, [3, 10])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 8]),
             helper.make_tensor_value_info("z", TensorProto.FLOAT, [3, 64])],
            [numpy_helper.from_array(w, "w"), numpy_helper.from_array(emb, "emb")],
        )  # fmt: skip
        return helper.make_model(g)

    def rounded(scale: str) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
        m = graph()
        info = fake_quantize_matmuls(m, 4, scale, 32)
        arrays = {t.name: numpy_helper.to_array(t) for t in m.graph.initializer}
        return arrays["w"], arrays["emb"], info

    wt, e, info = rounded("tensor")
    assert np.array_equal(e, emb) and info["weights"] == 1  # the shared table is not a MatMul-only weight
    s = np.abs(w).max() / 7
    assert np.allclose(wt, np.clip(np.rint(w / s), -7, 7) * s, atol=1e-9)
    assert len(np.unique(np.rint(wt / s))) <= 15
    assert np.count_nonzero(wt[:, 0]) < 16  # the narrow columns round to a few levels, mostly 0
    wc, _, _ = rounded("channel")
    sc = np.abs(w).max(axis=0) / 7
    assert np.allclose(wc, np.rint(w / sc) * sc, atol=1e-9)
    wb, _, binfo = rounded("block")
    for r0 in (0, 32):
        blk = w[r0 : r0 + 32]
        sb = np.abs(blk).max(axis=0) / 7
        assert np.allclose(wb[r0 : r0 + 32], np.rint(blk / sb) * sb, atol=1e-9)
    # finer scales, smaller error: block <= channel < tensor
    err = {k: float(np.abs(v - w).mean()) for k, v in (("tensor", wt), ("channel", wc), ("block", wb))}
    assert err["block"] <= err["channel"] < err["tensor"] and binfo["rel_error_mean"] < info["rel_error_mean"]
    bare = helper.make_model(helper.make_graph([helper.make_node("Relu", ["a"], ["b"])], "g",
                             [helper.make_tensor_value_info("a", TensorProto.FLOAT, [2])],
                             [helper.make_tensor_value_info("b", TensorProto.FLOAT, [2])]))  # fmt: skip
    with pytest.raises(ValueError, match="no constant MatMul weight"):
        fake_quantize_matmuls(bare, 4, "tensor", 32)
