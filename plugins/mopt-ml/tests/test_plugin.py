"""The plugin's registration surface: light import, what it registers, keys' ingredients."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

HEAVY = ("torch", "transformers", "onnx", "onnxruntime", "onnxslim", "safetensors", "numpy")


def test_importing_the_plugin_imports_no_heavy_library() -> None:
    code = (
        "import sys, mopt_ml.plugin as p\n"
        "for k in p.TARGETS: k().fingerprint()\n"
        "for k in p.TARGETS: k().input_files(k.Params(), __import__('pathlib').Path('.'))\n"
        f"print([m for m in {HEAVY!r} if m in sys.modules])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
    # the exact check the plugin promises
    subprocess.run(
        [sys.executable, "-c", "import mopt_ml.plugin, sys; assert 'torch' not in sys.modules"], check=True
    )


def test_registers_families_sources_and_targets_through_mopt() -> None:
    from mopt.plugins import build_registry, make_plugin_manager

    reg = build_registry(make_plugin_manager())
    assert {"qwen3", "bert"} <= set(reg.families)
    assert reg.families["qwen3"].pooling == "last-token"
    assert reg.families["bert"].pooling == "mean"
    assert "synthetic" in reg.sources
    kinds = {"weights", "onnx", "onnx-slim", "ort-quantize", "validate", "bench", "pretrain", "rtn"}
    assert kinds <= set(reg.targets)
    for k in kinds:
        assert reg.plugin_of("targets", k).name == "ml"
    assert reg.targets["weights"].uses_source
    validate = {i.name: i for i in reg.targets["validate"].consumes}
    # validate takes any kind producing a tested format (a third party's too), not kind names
    assert validate["model"].fanout and validate["model"].formats == ("onnx", "openvino-ir", "torch-compile-cache")
    assert validate["model"].kinds == ()
    assert validate["reference"].formats == ("hf-checkpoint",) and validate["reference"].kinds == ("pretrain", "weights")
    assert reg.targets["weights"].produces == "hf-checkpoint" and reg.targets["ort-quantize"].produces == "onnx"
    quant = reg.targets["ort-quantize"].consumes[0]
    assert quant.kinds == ("onnx-slim", "onnx")


def test_fingerprints_name_the_libraries_that_shape_the_output() -> None:
    import importlib.metadata as md

    from mopt_ml.plugin import TARGETS

    fps = {k.name: k().fingerprint() for k in TARGETS}
    assert fps["onnx"]["torch"] == md.version("torch")
    assert fps["onnx"]["onnx"] == md.version("onnx")
    assert fps["onnx-slim"]["onnxslim"] == md.version("onnxslim")
    assert fps["ort-quantize"]["onnxruntime"] == md.version("onnxruntime")
    assert fps["weights"]["transformers"] == md.version("transformers")
    for fp in fps.values():
        assert all(isinstance(v, str) and v for v in fp.values())


def test_data_files_enter_the_key(tmp_path: Path) -> None:
    from mopt_ml.common import shipped_sentences_path
    from mopt_ml.quantize import OrtQuantizeKind
    from mopt_ml.validate import ValidateKind

    q = OrtQuantizeKind()
    assert q.input_files(q.Params(), tmp_path) == [shipped_sentences_path()]
    files = q.input_files(q.Params(calibration="data/calib.txt"), tmp_path)
    assert files[0] == (tmp_path / "data" / "calib.txt").resolve()
    v = ValidateKind()
    assert v.input_files(v.Params(data="val.jsonl"), tmp_path) == [(tmp_path / "val.jsonl").resolve()]


def test_shipped_sentences_split_into_disjoint_calibration_and_validation() -> None:
    from mopt_ml.common import calibration_texts, read_texts, shipped_sentences_path, validation_texts

    calib, val = calibration_texts(), validation_texts()
    assert len(calib) == 40
    assert len(val) >= 200
    assert not set(calib) & set(val)
    assert len(set(read_texts(shipped_sentences_path()))) == len(calib) + len(val)
    lengths = sorted(len(t.split()) for t in val)
    assert lengths[0] <= 10 and lengths[-1] >= 20  # varied lengths


def test_read_texts_accepts_text_and_jsonl(tmp_path: Path) -> None:
    from mopt_ml.common import read_texts

    (tmp_path / "a.txt").write_text("# comment\none\n\ntwo\n")
    assert read_texts(tmp_path / "a.txt") == ["one", "two"]
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "x"}) + "\n" + json.dumps("y") + "\n")
    assert read_texts(tmp_path / "b.jsonl") == ["x", "y"]
    (tmp_path / "c.jsonl").write_text('{"no_text": 1}\n')
    with pytest.raises(ValueError, match=r"c.jsonl:1"):
        read_texts(tmp_path / "c.jsonl")
