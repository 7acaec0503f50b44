"""mopt-tensorrt: what is ours (profiles, precision plans, timing-cache handling, ModelOpt
command lines, checks, fingerprints) on CPU; building a real engine only where TensorRT and a
GPU exist (`-m gpu`)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
from mopt_tensorrt import timing_cache
from mopt_tensorrt.modelopt_onnx import (
    AutoCastKind,
    ModelOptQuantizeKind,
    autocast_argv,
    calibration_flag,
    make_calibration_npz,
    quantize_argv,
)
from mopt_tensorrt.trt_engine import (
    PrecisionError,
    TrtEngineKind,
    precision_plan,
    profile_shapes,
)

from mopt import plugin_env as _env
from mopt.api import Artifact, BuildContext, CheckContext, HardwareProfile
from mopt.builtin.hardware import PROFILES

HW = {p.name: p for p in PROFILES}
QWEN3 = {
    "model_type": "qwen3",
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "max_position_embeddings": 32768,
}


def check(kind, hw: str, model_config=None, **params):
    k = kind()
    return k.check(k.Params(**params), CheckContext(HW[hw], model_config, None, "m.hw", kind.name))


def codes(findings, severity="error"):
    return sorted(f.code for f in findings if f.severity == severity)


def ctx_for(tmp_path: Path, kind, inputs: dict, hw: str = "h200", **params) -> BuildContext:
    out, tmp = tmp_path / "out", tmp_path / "tmp"
    out.mkdir(parents=True)
    tmp.mkdir(parents=True)
    return BuildContext(
        out=out,
        tmp=tmp,
        params=kind.Params(**params),
        inputs=inputs,
        model_name="qwen3-embedding",
        family=None,
        task="embedding",
        source=None,
        hardware=HW[hw],
        section="qwen3-embedding.h200",
        target=kind.name,
        project_dir=tmp_path,
        logger=logging.getLogger("test"),
    )


def tiny_onnx(path: Path) -> Path:
    """A real graph with the onnx kind's interface: input_ids, attention_mask → embedding."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    emb = numpy_helper.from_array(np.random.default_rng(0).standard_normal((50, 8)).astype(np.float32), "emb")
    nodes = [
        helper.make_node("Gather", ["emb", "input_ids"], ["h"]),
        helper.make_node("Cast", ["attention_mask"], ["m"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["m", "axes"], ["m3"]),
        helper.make_node("Mul", ["h", "m3"], ["hm"]),
        helper.make_node("ReduceSum", ["hm", "one"], ["mopt_embedding"], keepdims=0),
    ]
    graph = helper.make_graph(
        nodes,
        "tiny",
        [
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
            helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "seq"]),
        ],
        [helper.make_tensor_value_info("mopt_embedding", TensorProto.FLOAT, ["batch", 8])],
        [
            emb,
            numpy_helper.from_array(np.array([2], np.int64), "axes"),
            numpy_helper.from_array(np.array([1], np.int64), "one"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path


# --------------------------------------------------------------------------- import + registry


def test_importing_the_plugin_imports_no_heavy_library():
    code = (
        "import sys, mopt_tensorrt.plugin\n"
        "from mopt.plugins import get_registry\n"
        "reg = get_registry()\n"
        "assert {'trt-engine', 'autocast', 'modelopt-quantize'} <= set(reg.targets)\n"
        "bad = [m for m in ('tensorrt', 'modelopt', 'torch', 'onnxruntime', 'tensorrt_llm') if m in sys.modules]\n"
        "print(bad)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_plugin_registers_its_kinds_under_its_own_name():
    from mopt.plugins import get_registry

    reg = get_registry()
    info = reg.plugin_of("targets", "trt-engine")
    assert info.name == "mopt-tensorrt" and info.dist == "mopt-tensorrt"
    assert info.registered["targets"] == ["trt-engine", "autocast", "modelopt-quantize"]


# --------------------------------------------------------------------------- profiles


def test_profile_shapes_come_from_the_params():
    p = TrtEngineKind.Params(
        min_batch_size=1,
        opt_batch_size=16,
        max_batch_size=64,
        min_seq_len=8,
        opt_seq_len=256,
        max_seq_len=512,
    )
    shapes = profile_shapes({"input_ids": (-1, -1), "attention_mask": (-1, -1)}, p)
    assert shapes == {
        "input_ids": ((1, 8), (16, 256), (64, 512)),
        "attention_mask": ((1, 8), (16, 256), (64, 512)),
    }


def test_profile_opt_defaults_to_max_and_static_dims_are_kept():
    p = TrtEngineKind.Params(max_batch_size=128, max_seq_len=2048)
    shapes = profile_shapes({"input_ids": (-1, -1), "token_type_ids": (-1, 2048), "scale": (1,)}, p)
    assert shapes["input_ids"] == ((1, 1), (128, 2048), (128, 2048))
    assert shapes["token_type_ids"] == ((1, 2048), (128, 2048), (128, 2048))
    assert shapes["scale"] == ((1,), (1,), (1,))


def test_profile_explicit_shapes_win_and_unknown_dynamic_axes_are_refused():
    p = TrtEngineKind.Params(shapes={"pixel_values": [[1, 3, 224], [8, 3, 224], [16, 3, 224]]})
    shapes = profile_shapes({"pixel_values": (-1, 3, -1)}, p)
    assert shapes["pixel_values"] == ((1, 3, 224), (8, 3, 224), (16, 3, 224))
    with pytest.raises(ValueError, match="dynamic axis 2"):
        profile_shapes({"x": (-1, -1, -1)}, TrtEngineKind.Params())


# --------------------------------------------------------------------------- precision


def test_trt10_plain_graph_uses_the_precision_builder_flag():
    plan = precision_plan("fp16", 10, "onnx", None)
    assert plan.flags == ("FP16",) and not plan.strongly_typed
    assert precision_plan("bf16", 10, "onnx-slim", None).flags == ("BF16",)


def test_trt11_refuses_fp16_from_a_plain_graph_and_names_autocast():
    with pytest.raises(PrecisionError, match=r"add a target of kind 'autocast'"):
        precision_plan("fp16", 11, "onnx", "fp32")
    assert precision_plan("fp32", 11, "onnx", None).strongly_typed


def test_typed_inputs_build_strongly_typed_without_flags_on_10_and_11():
    for major in (10, 11):
        plan = precision_plan("fp16", major, "autocast", "fp16")
        assert plan.strongly_typed and plan.flags == ()
        assert precision_plan("int8", major, "modelopt-quantize", "int8").strongly_typed


def test_quantized_precisions_need_a_qdq_input_and_matching_precision():
    with pytest.raises(PrecisionError, match="modelopt-quantize"):
        precision_plan("int8", 10, "onnx", None)
    with pytest.raises(PrecisionError, match="was made for 'bf16'"):
        precision_plan("fp16", 11, "autocast", "bf16")


# --------------------------------------------------------------------------- check


def test_check_refuses_fp8_on_a10():
    f = check(TrtEngineKind, "a10", precision="fp8")
    assert codes(f) == ["precision-unsupported"]
    msg = next(x for x in f if x.code == "precision-unsupported").message
    assert "8.9" in msg and "8.6" in msg


def test_check_refuses_an_engine_on_the_cpu_profile():
    f = check(TrtEngineKind, "cpu", precision="fp16")
    assert codes(f) == ["engine-on-cpu"]


def test_check_refuses_min_opt_max_out_of_order():
    f = check(TrtEngineKind, "h200", min_batch_size=8, opt_batch_size=4, max_batch_size=16)
    assert codes(f) == ["shape-order"]
    assert check(TrtEngineKind, "h200", min_seq_len=600, max_seq_len=512)[0].code == "shape-order"


def test_check_passes_a_sane_fp16_engine_on_h200_with_notes():
    f = check(TrtEngineKind, "h200", QWEN3, precision="fp16", max_batch_size=64, max_seq_len=512)
    assert codes(f) == []
    assert "trt11-needs-autocast" in codes(f, "info")


def test_check_warns_when_seq_exceeds_the_model():
    f = check(TrtEngineKind, "h200", {**QWEN3, "max_position_embeddings": 512}, max_seq_len=1024)
    assert codes(f, "warning") == ["seq-beyond-model"]


def test_modelopt_checks_are_gated_on_the_profile():
    assert codes(check(ModelOptQuantizeKind, "a10", quantize_mode="fp8", calibration_texts="c.txt")) == [
        "precision-unsupported"
    ]
    assert codes(check(ModelOptQuantizeKind, "h200", quantize_mode="fp8", calibration_texts="c.txt")) == []
    assert codes(check(ModelOptQuantizeKind, "h200", quantize_mode="int8"), "warning") == [
        "no-calibration-data"
    ]
    t4 = HardwareProfile(
        name="t4", description="T4", gpu_name="Tesla T4", compute_capability=(7, 5), memory_gb=16
    )
    k = AutoCastKind()
    f = k.check(k.Params(low_precision_type="bf16"), CheckContext(t4, None, None, "s", "autocast"))
    assert codes(f) == ["precision-unsupported"]


# --------------------------------------------------------------------------- requirements, fingerprint, run


def test_requirements_name_the_gpu_and_tensorrt():
    k = TrtEngineKind()
    assert k.requirements(k.Params(), HW["h200"]) == ["gpu", "hardware", "python:tensorrt"]
    assert "tensorrt-cu12" in k.install_hints["python:tensorrt"]
    assert TrtEngineKind.per_hardware and not TrtEngineKind.reproducible


def test_fingerprint_has_tensorrt_cuda_gpu_and_compute_capability():
    fp = TrtEngineKind().fingerprint()
    assert set(fp) == {"tensorrt", "cuda", "gpu", "compute_capability"}
    if not _env.has_module("tensorrt"):
        assert fp["tensorrt"] == "missing"
    if not _env.gpus():
        assert fp["gpu"] == "none"
    assert set(AutoCastKind().fingerprint()) == {"nvidia-modelopt", "onnx", "onnxruntime"}


@pytest.mark.skipif(_env.has_module("tensorrt"), reason="tensorrt is installed here")
def test_run_without_tensorrt_fails_naming_the_package(tmp_path):
    onnx_dir = tmp_path / "onnx"
    tiny_onnx(onnx_dir / "model.onnx")
    ctx = ctx_for(tmp_path, TrtEngineKind, {"onnx": [Artifact(onnx_dir, "onnx", "onnx", "0" * 64)]})
    with pytest.raises(RuntimeError, match=r"'tensorrt'.*pip install tensorrt-cu12"):
        TrtEngineKind().run(ctx)
    assert not any(ctx.out.iterdir())


@pytest.mark.skipif(_env.has_module("modelopt"), reason="modelopt is installed here")
def test_autocast_run_without_modelopt_fails_naming_the_package(tmp_path):
    onnx_dir = tmp_path / "onnx"
    tiny_onnx(onnx_dir / "model.onnx")
    ctx = ctx_for(tmp_path, AutoCastKind, {"onnx": [Artifact(onnx_dir, "onnx", "onnx", "0" * 64)]})
    with pytest.raises(RuntimeError, match=r"nvidia-modelopt"):
        AutoCastKind().run(ctx)


# --------------------------------------------------------------------------- timing cache


FACTS = {"tensorrt": "10.13.3.9", "cuda": "cu12+12.9.79", "gpu": "NVIDIA H200", "compute_capability": "9.0"}


def test_timing_cache_name_depends_on_gpu_trt_cuda_and_compat_level_only():
    name = timing_cache.cache_file_name(FACTS, "none")
    assert name == "trt-10.13.3.9_cuda-cu12-12.9.79_nvidia-h200_sm90_hwc-none.cache"
    assert timing_cache.cache_file_name({**FACTS, "compute_capability": "8.9"}, "none") != name
    assert timing_cache.cache_file_name({**FACTS, "tensorrt": "11.1.0.5"}, "none") != name
    assert timing_cache.cache_file_name(FACTS, "ampere_plus").endswith("hwc-ampere-plus.cache")


def test_timing_cache_folder_core_then_env_then_scratch(tmp_path, monkeypatch):
    class Ctx:
        tmp = tmp_path / "tmp"

    monkeypatch.delenv("MOPT_CACHE_DIR", raising=False)
    assert timing_cache.cache_root(Ctx()) == (tmp_path / "tmp" / "tensorrt-timing", False)
    monkeypatch.setenv("MOPT_CACHE_DIR", str(tmp_path / "cache"))
    assert timing_cache.cache_root(Ctx()) == (tmp_path / "cache" / "tensorrt-timing", True)
    Ctx.cache_dir = tmp_path / "store-cache"  # what the core would provide
    assert timing_cache.cache_root(Ctx()) == (tmp_path / "store-cache" / "tensorrt-timing", True)


class _Cache:
    """The two ITimingCache methods merge_and_write uses (TensorRT is not installable here)."""

    def __init__(self, entries: dict):
        self.entries = dict(entries)

    def combine(self, other: _Cache, ignore_mismatch: bool) -> bool:
        self.entries.update(other.entries)
        return True

    def serialize(self) -> bytes:
        return json.dumps(self.entries, sort_keys=True).encode()


class _Config:
    def __init__(self, ours: dict):
        self.ours = _Cache(ours)

    def get_timing_cache(self) -> _Cache:
        return self.ours

    def create_timing_cache(self, blob: bytes) -> _Cache:
        return _Cache(json.loads(blob) if blob else {})


def test_timing_cache_merge_keeps_entries_other_builds_wrote(tmp_path):
    path = tmp_path / "c" / "x.cache"
    assert timing_cache.read(path) == b""
    timing_cache.merge_and_write(path, _Config({"a": 1}), print)
    timing_cache.merge_and_write(path, _Config({"b": 2}), print)
    assert json.loads(timing_cache.read(path)) == {"a": 1, "b": 2}
    assert sorted(p.name for p in path.parent.iterdir()) == ["x.cache", "x.cache.lock"]  # no temp left


# --------------------------------------------------------------------------- ModelOpt command lines


def test_autocast_command_line():
    p = AutoCastKind.Params(low_precision_type="bf16", data_max=512.0, nodes_to_exclude=["/norm/.*"])
    argv = autocast_argv("python", Path("in/model.onnx"), Path("out/model.onnx"), p, Path("c.npz"))
    assert argv[:3] == ["python", "-m", "modelopt.onnx.autocast"]
    s = " ".join(argv)
    assert (
        "--onnx_path in/model.onnx --output_path out/model.onnx --low_precision_type bf16 --keep_io_types"
        in s
    )
    assert "--calibration_data c.npz" in s and "--data_max 512.0" in s and "--nodes_to_exclude /norm/.*" in s
    assert argv[-2:] == ["--providers", "cpu"]


def test_quantize_command_line_and_the_renamed_calibration_flag():
    p = ModelOptQuantizeKind.Params(quantize_mode="fp8", calibration_method="max", calibration_texts="t.txt")
    assert calibration_flag("  --calibration_data_path CALIBRATION_DATA_PATH") == "--calibration_data_path"
    assert calibration_flag("  --calibration_data CALIBRATION_DATA") == "--calibration_data"
    argv = quantize_argv(
        "py", Path("a.onnx"), Path("b.onnx"), p, Path("c.npz"), "--calibration_data_path", True
    )
    s = " ".join(argv)
    assert argv[:3] == ["py", "-m", "modelopt.onnx.quantization"]
    assert "--quantize_mode fp8 --high_precision_dtype fp16 --calibration_method max" in s
    assert "--calibration_data_path c.npz" in s and argv[-1] == "--use_external_data_format"


def test_calibration_npz_is_tokenized_with_the_artifacts_tokenizer(tmp_path):
    import numpy as np
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[PAD]", "[UNK]", "hello", "world", "engines", "are", "fast"]
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="[PAD]", unk_token="[UNK]").save_pretrained(
        tmp_path / "art"
    )
    onnx_path = tiny_onnx(tmp_path / "art" / "model.onnx")
    dst = make_calibration_npz(
        tmp_path / "art", onnx_path, ["hello world", "engines are fast"], 6, tmp_path / "c.npz", None
    )
    data = np.load(dst)
    assert sorted(data.files) == ["attention_mask", "input_ids"]
    assert data["input_ids"].shape == (2, 6) and data["input_ids"].dtype == np.int64
    assert data["input_ids"][1, :3].tolist() == [4, 5, 6] and data["attention_mask"][0].tolist() == [
        1,
        1,
        0,
        0,
        0,
        0,
    ]


# --------------------------------------------------------------------------- the real thing


@pytest.mark.gpu
def test_builds_a_real_engine_with_a_profile_and_a_timing_cache(tmp_path, monkeypatch):
    trt = pytest.importorskip("tensorrt", reason="needs TensorRT (pip install tensorrt-cu12 or -cu13)")
    if not _env.gpus():
        pytest.skip("needs a CUDA GPU")
    gpu = _env.gpus()[0]
    hw = HardwareProfile(name="here", description="this GPU", gpu_name=gpu["name"],
                         compute_capability=gpu["compute_capability"], memory_gb=gpu["memory_mb"] / 1024)  # fmt: skip
    monkeypatch.setenv("MOPT_CACHE_DIR", str(tmp_path / "cache"))
    onnx_dir = tmp_path / "onnx"
    tiny_onnx(onnx_dir / "model.onnx")
    ctx = ctx_for(tmp_path, TrtEngineKind, {"onnx": [Artifact(onnx_dir, "onnx", "onnx", "0" * 64)]},
                  precision="fp32", max_batch_size=4, max_seq_len=16)  # fmt: skip
    ctx.hardware = hw
    meta = TrtEngineKind().run(ctx)
    assert (ctx.out / "engine.plan").stat().st_size > 0
    io = json.loads((ctx.out / "io.json").read_text())
    assert io["inputs"][0]["profile"] == {"min": [1, 1], "opt": [4, 16], "max": [4, 16]}
    assert meta["timing_cache"]["written_bytes"] > 0 and meta["tensorrt"] == trt.__version__


def test_mopt_check_refuses_engines_on_incompatible_profiles(tmp_path):
    """Through the core: recipe → graph → `mopt check` findings (exit 2 on errors)."""
    from click.testing import CliRunner

    from mopt.cli import app
    from mopt.plugins import get_registry

    reg = get_registry()
    if "onnx" not in reg.targets or "qwen3" not in reg.families:
        pytest.skip("needs the mopt-ml plugin (onnx kind, qwen3 family)")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps({**QWEN3, "hidden_size": 1024, "num_hidden_layers": 28,
                                                                "intermediate_size": 3072, "head_dim": 128,
                                                                "vocab_size": 151669}))  # fmt: skip
    (tmp_path / "r.toml").write_text(
        'schema = 1\n[models.q]\nfamily = "qwen3"\nsource = { path = "model" }\nconfig = "model/config.json"\n'
        '[q.a10]\nhardware = "a10"\ntargets = ["weights", "onnx", "trt-engine"]\n[q.a10.trt-engine]\nprecision = "fp8"\n'
        '[q.cpu]\nhardware = "cpu"\ntargets = ["weights", "onnx", "trt-engine"]\n'
        '[q.h200]\nhardware = "h200"\ntargets = ["weights", "onnx", "trt-engine"]\n'
    )
    res = CliRunner().invoke(app, ["check", str(tmp_path / "r.toml"), "--json"])
    assert res.exit_code == 2, res.output
    found = json.loads(res.output)["findings"]
    errors = sorted((f["section"], f["code"]) for f in found if f["severity"] == "error")
    assert errors == [("q.a10", "precision-unsupported"), ("q.cpu", "engine-on-cpu")]


# --------------------------------------------------------------------------- run() against a stand-in


def fake_tensorrt(version: str, calls: list):
    """A stand-in for the part of TensorRT's Python API `run()` uses (TensorRT cannot be
    installed here). It records our calls; it says nothing about TensorRT itself."""
    import types
    from enum import Enum

    trt = types.ModuleType("tensorrt")
    trt.__version__ = version
    DataType = Enum("DataType", "FLOAT HALF INT64")
    trt.BuilderFlag = Enum("BuilderFlag", "FP16 BF16 VERSION_COMPATIBLE")
    trt.MemoryPoolType = Enum("MemoryPoolType", "WORKSPACE")
    trt.HardwareCompatibilityLevel = Enum(
        "HardwareCompatibilityLevel", "NONE AMPERE_PLUS SAME_COMPUTE_CAPABILITY"
    )

    class Flag:
        STRONGLY_TYPED = 3

    trt.NetworkDefinitionCreationFlag = Flag

    class Logger:
        WARNING = 2

        def __init__(self, level):
            pass

    class Tensor:
        def __init__(self, name, dtype, shape):
            self.name, self.dtype, self.shape = name, dtype, shape

    class Network:
        num_inputs, num_outputs = 2, 1

        def get_input(self, i):
            return Tensor(("input_ids", "attention_mask")[i], DataType.INT64, (-1, -1))

        def get_output(self, i):
            return Tensor("mopt_embedding", DataType.FLOAT, (-1, 8))

    class Cache:
        def serialize(self):
            return b"timing"

        def combine(self, other, ignore):
            return True

    class Config:
        def set_memory_pool_limit(self, pool, n):
            calls.append(("pool", pool.name, n))

        def set_flag(self, f):
            calls.append(("flag", f.name))

        def add_optimization_profile(self, p):
            calls.append(("profile", dict(p.shapes)))

        def create_timing_cache(self, blob):
            calls.append(("timing-cache-in", bytes(blob)))
            return Cache()

        def set_timing_cache(self, cache, ignore):
            pass

        def get_timing_cache(self):
            return Cache()

        def __setattr__(self, k, v):
            calls.append((k, getattr(v, "name", v)))

    class Profile:
        def __init__(self):
            self.shapes = {}

        def set_shape(self, name, lo, opt, hi):
            self.shapes[name] = (lo, opt, hi)

    class Builder:
        def __init__(self, logger):
            pass

        def create_network(self, flags):
            calls.append(("network-flags", flags))
            return Network()

        def create_builder_config(self):
            return Config()

        def create_optimization_profile(self):
            return Profile()

        def build_serialized_network(self, network, config):
            return b"PLAN"

    class OnnxParser:
        num_errors = 0

        def __init__(self, network, logger):
            pass

        def parse_from_file(self, path):
            calls.append(("parse", Path(path).name))
            return True

    trt.Logger, trt.Builder, trt.OnnxParser = Logger, Builder, OnnxParser
    return trt


H200_SMI = (
    {
        "name": "NVIDIA H200",
        "compute_capability": (9, 0),
        "memory_mb": 143771,
        "driver": "580",
        "cuda_driver": "13.0",
    },
)


def test_run_drives_the_builder_as_documented_for_trt10_and_trt11(tmp_path, monkeypatch):
    onnx_dir = tmp_path / "graph"
    tiny_onnx(onnx_dir / "model.onnx")
    (onnx_dir / "tokenizer.json").write_text("{}")
    monkeypatch.setattr(_env, "gpus", lambda: H200_SMI)
    monkeypatch.setattr(_env, "has_module", lambda m: True)
    monkeypatch.setenv("MOPT_CACHE_DIR", str(tmp_path / "cache"))
    calls: list = []
    monkeypatch.setitem(sys.modules, "tensorrt", fake_tensorrt("10.13.3.9", calls))
    inputs = {"onnx": [Artifact(onnx_dir, "onnx", "onnx", "0" * 64, {})]}
    ctx = ctx_for(tmp_path / "a", TrtEngineKind, inputs, precision="fp16", max_batch_size=16, max_seq_len=128,
                  opt_level=5, workspace_gb=2, version_compatible=True)  # fmt: skip
    meta = TrtEngineKind().run(ctx)
    assert ("network-flags", 0) in calls and ("parse", "model.onnx") in calls
    assert ("pool", "WORKSPACE", 2 * 2**30) in calls and ("builder_optimization_level", 5) in calls
    assert ("flag", "FP16") in calls and ("flag", "VERSION_COMPATIBLE") in calls
    assert ("hardware_compatibility_level", "NONE") in calls
    assert (
        "profile",
        {"input_ids": ((1, 1), (16, 128), (16, 128)), "attention_mask": ((1, 1), (16, 128), (16, 128))},
    ) in calls
    assert (ctx.out / "engine.plan").read_bytes() == b"PLAN"
    assert sorted(p.name for p in ctx.out.iterdir()) == ["engine.plan", "io.json", "tokenizer.json"]
    io = json.loads((ctx.out / "io.json").read_text())
    assert io["inputs"][0] == {"name": "input_ids", "dtype": "int64", "shape": [-1, -1],
                               "profile": {"min": [1, 1], "opt": [16, 128], "max": [16, 128]}}  # fmt: skip
    assert (
        meta["builder_flags"] == ["FP16"]
        and not meta["strongly_typed"]
        and meta["timing_cache"]["written_bytes"] > 0
    )
    cache_files = list((tmp_path / "cache" / "tensorrt-timing").glob("*.cache"))
    assert [f.name.split("_")[0] for f in cache_files] == ["trt-10.13.3.9"]
    # a second build reads what the first one wrote
    calls.clear()
    TrtEngineKind().run(ctx_for(tmp_path / "b", TrtEngineKind, inputs, precision="fp16"))
    assert ("timing-cache-in", b"timing") in calls

    # TensorRT 11: the same recipe is refused with the fix; an autocast input builds strongly typed
    monkeypatch.setitem(sys.modules, "tensorrt", fake_tensorrt("11.1.0.5", calls))
    with pytest.raises(PrecisionError, match="autocast"):
        TrtEngineKind().run(ctx_for(tmp_path / "c", TrtEngineKind, inputs, precision="fp16"))
    calls.clear()
    typed = {"onnx": [Artifact(onnx_dir, "autocast", "fp16-graph", "0" * 64, {"precision": "fp16"})]}
    meta = TrtEngineKind().run(ctx_for(tmp_path / "d", TrtEngineKind, typed, precision="fp16"))
    assert meta["strongly_typed"] and not any(c[0] == "flag" for c in calls) and ("network-flags", 0) in calls


def test_run_refuses_a_gpu_that_is_not_the_profiles(tmp_path, monkeypatch):
    onnx_dir = tmp_path / "graph"
    tiny_onnx(onnx_dir / "model.onnx")
    ada = (
        {
            "name": "NVIDIA GeForce RTX 4090",
            "compute_capability": (8, 9),
            "memory_mb": 24564,
            "driver": "580",
            "cuda_driver": "13.0",
        },
    )
    monkeypatch.setattr(_env, "gpus", lambda: ada)
    monkeypatch.setattr(_env, "has_module", lambda m: True)
    monkeypatch.setitem(sys.modules, "tensorrt", fake_tensorrt("10.13.3.9", []))
    ctx = ctx_for(tmp_path, TrtEngineKind, {"onnx": [Artifact(onnx_dir, "onnx", "onnx", "0" * 64)]})
    with pytest.raises(RuntimeError, match=r"profile 'h200' \(compute capability 9.0\).*RTX 4090 \(8.9\)"):
        TrtEngineKind().run(ctx)
