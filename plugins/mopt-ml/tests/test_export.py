"""The `onnx` and `onnx-slim` targets: graph interface, dynamic axes, numbers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest


def _io(path: Path) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
    import onnx

    m = onnx.load(str(path), load_external_data=False)
    inits = {i.name for i in m.graph.initializer}

    def dims(v: Any) -> list[Any]:
        return [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]

    ins = {i.name: dims(i) for i in m.graph.input if i.name not in inits}
    outs = {o.name: dims(o) for o in m.graph.output}
    return ins, outs


@pytest.mark.parametrize("chain", ["qwen3_chain", "minilm_chain"])
def test_onnx_graph_has_named_dynamic_inputs_and_one_pooled_output(chain: str, request: Any) -> None:
    c = request.getfixturevalue(chain)
    ins, outs = _io(c["onnx"] / "model.onnx")
    assert ins == {"input_ids": ["batch", "sequence"], "attention_mask": ["batch", "sequence"]}
    hidden = 64 if chain == "qwen3_chain" else 384
    assert outs == {"mopt_embedding": ["batch", hidden]}
    meta = json.loads((c["onnx"] / "mopt_ml.json").read_text())
    assert meta["exporter"] == "torchscript" and meta["opset"] == 17
    assert meta["output"] == "mopt_embedding" and meta["precision"] == "fp32"
    assert meta["check"]["n"] == 64 and meta["check"]["min_cosine"] > 0.9999
    assert meta["check"]["max_abs_diff"] < 1e-4
    for f in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        assert (c["onnx"] / f).is_file()
    assert not (c["onnx"] / "model.onnx.data").exists()  # small models keep weights inline


def test_onnx_runs_at_other_batch_and_sequence_sizes(qwen3_chain: dict[str, Any]) -> None:
    from mopt_ml.common import embed_onnx, load_tokenizer, ort_session, validation_texts
    from mopt_ml.families import Qwen3Family

    fam = Qwen3Family()
    texts = validation_texts()[:7]
    model = fam.load(qwen3_chain["weights"])
    tok = load_tokenizer(qwen3_chain["onnx"])
    sess = ort_session(qwen3_chain["onnx"] / "model.onnx")
    for pad_to, bs in ((None, 7), (200, 3), (None, 1)):
        ref = fam.embed(model, tok, texts, pad_to=pad_to, batch_size=bs)
        got = embed_onnx(sess, tok, texts, pad_to=pad_to, batch_size=bs)
        assert np.abs(ref - got).max() < 1e-4, (pad_to, bs)
    # and with right padding, through the same graph
    tok.padding_side = "right"
    got_right = embed_onnx(sess, tok, texts)
    assert np.abs(got_right - fam.embed(model, tok, texts)).max() < 1e-4


@pytest.mark.slow
def test_dynamo_exporter_gives_the_same_interface(runner: Any, qwen3_chain: dict[str, Any]) -> None:
    from mopt_ml.export import OnnxKind

    out, meta = runner.run(
        OnnxKind,
        {"exporter": "dynamo"},
        inputs={"model": [runner.artifact(qwen3_chain["weights"], "weights")]},
    )
    ins, outs = _io(out / "model.onnx")
    assert set(ins) == {"input_ids", "attention_mask"} and ins["input_ids"] == ["batch", "sequence"]
    assert list(outs) == ["mopt_embedding"]
    assert meta["opset"] == 18 and meta["check"]["min_cosine"] > 0.9999


def test_external_data_when_asked(runner: Any, qwen3_chain: dict[str, Any]) -> None:
    import onnx

    from mopt_ml.export import OnnxKind

    out, meta = runner.run(
        OnnxKind,
        {"external_data": True, "check_texts": 8},
        inputs={"model": [runner.artifact(qwen3_chain["weights"], "weights")]},
    )
    assert meta["external_data"] is True
    assert (out / "model.onnx.data").stat().st_size > 100_000
    assert (out / "model.onnx").stat().st_size < 100_000
    onnx.checker.check_model(str(out / "model.onnx"))


def test_failed_numeric_check_fails_the_export_with_the_numbers(
    runner: Any, qwen3_chain: dict[str, Any]
) -> None:
    from mopt_ml.export import NumericCheckError, OnnxKind

    with pytest.raises(
        NumericCheckError, match=r"min cosine [01]\.\d+ < check_min_cosine 1\.01 \(mean \d\.\d+, max abs diff"
    ):
        runner.run(
            OnnxKind,
            {"check_min_cosine": 1.01, "check_texts": 8},
            inputs={"model": [runner.artifact(qwen3_chain["weights"], "weights")]},
        )


def test_onnx_slim_simplifies_and_keeps_the_numbers(qwen3_chain: dict[str, Any]) -> None:
    import onnx

    slim = qwen3_chain["onnx-slim"]
    meta = json.loads((slim / "mopt_ml.json").read_text())
    assert meta["slim"]["nodes_after"] < meta["slim"]["nodes_before"]
    assert len(onnx.load(str(slim / "model.onnx")).graph.node) == meta["slim"]["nodes_after"]
    assert meta["slim"]["check"]["min_cosine"] > 0.9999
    ins, outs = _io(slim / "model.onnx")
    assert ins["input_ids"] == ["batch", "sequence"] and list(outs) == ["mopt_embedding"]
    assert meta["exporter"] == "torchscript"  # carried over from the input graph
