"""mopt-torch: checks, fingerprints and helpers on CPU; the compile / AOTI workers for real on
a tiny random Qwen3 on CPU (`-m slow`); the CUDA paths only with a GPU (`-m gpu`)."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from mopt_torch.aoti import AotiLoadError, describe_exit, run_probe
from mopt_torch.embedder import family_spec, load_family, resolve_attention
from mopt_torch.kinds import AotiKind, TorchCompileKind, torch_cuda_version
from mopt_torch.warm import WarmStartMismatch, bucket_for, load_warm, mismatch

from mopt import plugin_env as _env
from mopt.api import Artifact, BuildContext, CheckContext, HardwareProfile
from mopt.builtin.hardware import PROFILES

HW = {p.name: p for p in PROFILES}
HERE = Path(__file__).resolve().parent
QWEN3 = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "max_position_embeddings": 32768}
BERT = {"model_type": "bert", "architectures": ["BertModel"], "max_position_embeddings": 512}


def check(kind, hw, model_config=QWEN3, **params):
    k = kind()
    hwp = hw if isinstance(hw, HardwareProfile) else HW[hw]
    return k.check(k.Params(**params), CheckContext(hwp, model_config, None, "m.hw", kind.name))


def codes(findings, severity="error"):
    return sorted(f.code for f in findings if f.severity == severity)


def test_importing_the_plugin_imports_no_torch():
    code = (
        "import sys, mopt_torch.plugin, mopt_torch.warm, mopt_torch.aoti, mopt_torch.embedder\n"
        "from mopt.plugins import get_registry\n"
        "assert {'torch-compile', 'aoti'} <= set(get_registry().targets)\n"
        "TK = get_registry().targets['torch-compile']; TK().fingerprint()\n"
        "print([m for m in ('torch', 'transformers', 'triton', 'tensorrt', 'vllm') if m in sys.modules])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_fingerprint_names_torch_triton_cuda_and_the_gpu_without_importing_torch():
    fp = TorchCompileKind().fingerprint()
    assert set(fp) == {"torch", "triton", "cuda", "transformers", "gpu", "compute_capability"}
    assert fp["torch"] == _env.dist_version("torch")
    if not _env.gpus():
        assert fp["gpu"] == "none" and fp["compute_capability"] == "none"
    import torch

    assert torch_cuda_version() == str(torch.version.cuda)  # read from torch/version.py
    assert TorchCompileKind().platform(HW["h200"]) == {"compute_capability": "9.0"}
    assert TorchCompileKind().platform(HW["rtx4090"]) != TorchCompileKind().platform(HW["h200"])


def test_requirements_and_flags():
    k = TorchCompileKind()
    assert k.requirements(k.Params(), HW["h200"]) == [
        "gpu",
        "hardware",
        "python:torch",
        "python:transformers",
    ]
    assert TorchCompileKind.per_hardware and AotiKind.per_hardware and not TorchCompileKind.reproducible


def test_buckets_are_validated_and_sorted():
    p = TorchCompileKind.Params(buckets=[(32, 512), (1, 128), (32, 512)])
    assert p.buckets == [(1, 128), (32, 512)]
    with pytest.raises(ValueError, match="must be >= 1"):
        TorchCompileKind.Params(buckets=[(0, 128)])


def test_check_refuses_cpu_profiles_old_gpus_for_bf16_and_causal_attention_on_encoders():
    assert codes(check(TorchCompileKind, "cpu")) == ["engine-on-cpu"]
    t4 = HardwareProfile(
        name="t4", description="T4", gpu_name="Tesla T4", compute_capability=(7, 5), memory_gb=16
    )
    assert codes(check(TorchCompileKind, t4, precision="bf16")) == ["precision-unsupported"]
    assert codes(check(TorchCompileKind, "h200", BERT, attention="sdpa-causal")) == ["attention-not-causal"]
    assert codes(check(TorchCompileKind, "h200", {**QWEN3, "max_position_embeddings": 256})) == [
        "seq-beyond-model"
    ]
    assert codes(check(TorchCompileKind, "h200")) == []
    assert codes(check(AotiKind, "h200", max_seq_len=16, seq_multiple=16)) == ["shape-order"]


def test_sdpa_backend_pins_only_the_causal_path():
    assert codes(check(TorchCompileKind, "h200", sdpa_backend="cudnn")) == []
    assert codes(check(TorchCompileKind, "h200", BERT, sdpa_backend="cudnn")) == ["sdpa-backend-needs-causal"]
    assert codes(check(TorchCompileKind, "h200", attention="sdpa", sdpa_backend="flash")) == [
        "sdpa-backend-needs-causal"
    ]
    synthetic = {"hidden_size": 64, "num_hidden_layers": 2}  # no model_type: resolved at build time
    assert codes(check(TorchCompileKind, "h200", synthetic, sdpa_backend="cudnn")) == []
    with pytest.raises(ValueError):
        TorchCompileKind.Params(sdpa_backend="fa3")


def test_cuda_graph_outputs_are_cloned_for_the_caller():
    import torch
    from mopt_torch.warm import KeptOutputs

    class Compiled:
        buf = torch.zeros(2)
        tag = "inner"

        def __call__(self, x):
            self.buf.copy_(x)  # like a CUDA graph: one static output buffer
            return self.buf

    m = KeptOutputs(Compiled())
    a, b = m(torch.ones(2)), m(torch.full((2,), 2.0))
    assert a.tolist() == [1.0, 1.0] and b.tolist() == [2.0, 2.0] and m.tag == "inner"


def test_auto_attention_is_causal_only_for_decoders():
    assert resolve_attention("auto", QWEN3, "last-token") == "sdpa-causal"
    assert resolve_attention("auto", BERT, "mean") == "sdpa"
    assert resolve_attention("sdpa", QWEN3, "last-token") == "sdpa"


def test_family_is_passed_to_workers_by_name():
    class Fam:
        pooling = "cls"

    assert family_spec(None) is None
    assert family_spec(Fam) == f"{__name__}:test_family_is_passed_to_workers_by_name.<locals>.Fam"
    fam = load_family("mopt_torch.embedder:pool")  # any importable attribute resolves
    assert callable(fam)


def test_warm_start_refuses_another_gpu_or_torch(tmp_path):
    meta = {"torch": "2.11.0+cu130", "triton": "3.6.0", "cuda": "13.0", "compute_capability": "9.0"}
    assert mismatch(meta, dict(meta)) == []
    assert mismatch(meta, {**meta, "compute_capability": "8.9"}) == [
        "compute_capability: artifact '9.0', here '8.9'"
    ]
    (tmp_path / "meta.json").write_text(json.dumps({**meta, "torch": "0.0-other"}))
    with pytest.raises(WarmStartMismatch, match=r"torch: artifact '0\.0-other'"):
        load_warm(tmp_path)
    assert load_warm(tmp_path, strict=False)["loaded"] is False


def test_bucket_for_picks_the_smallest_bucket_that_fits():
    meta = {"buckets": [{"batch": 1, "seq": 128}, {"batch": 32, "seq": 512}, {"batch": 8, "seq": 512}]}
    assert bucket_for(1, 100, meta) == (1, 128)
    assert bucket_for(4, 300, meta) == (8, 512)
    with pytest.raises(ValueError, match="no bucket holds 64 x 10"):
        bucket_for(64, 10, meta)


def test_a_crashing_load_becomes_an_error_naming_the_signal_and_the_known_issue():
    assert describe_exit(-11) == "killed by SIGSEGV" and describe_exit(3) == "exit status 3"
    crash = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"]
    with pytest.raises(AotiLoadError, match=r"killed by SIGSEGV \(known issue: on torch 2.11 with CUDA 13"):
        run_probe(crash, "model.pt2")
    fails = [sys.executable, "-c", "raise SystemExit('no such package')"]
    with pytest.raises(AotiLoadError, match="exit status 1; no such package"):
        run_probe(fails, "model.pt2")
    ok = [sys.executable, "-c", 'print(\'{"ok": true, "min_cosine": 1.0}\')']
    assert run_probe(ok, "model.pt2") == {"ok": True, "min_cosine": 1.0}


def test_bench_script_counts_16_tflop_per_batch_for_the_qwen3_shape():
    spec = importlib.util.spec_from_file_location("bench_tc", HERE.parent / "bench_torch_compile.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    tflop = mod.flops_per_batch(mod.QWEN3_06B, 32, 512) / 1e12
    assert 16.2 < tflop < 16.5
    src = (HERE.parent / "bench_torch_compile.py").read_text()
    assert not re.search(r"^\s*(import|from)\s+mopt", src, re.M)  # standalone: runs where pydantic is missing


def _ctx(tmp_path: Path, kind, weights: Path, **params) -> BuildContext:
    out, tmp = tmp_path / "out", tmp_path / "tmp"
    out.mkdir(parents=True)
    tmp.mkdir(parents=True)
    return BuildContext(
        out=out, tmp=tmp, params=kind.Params(**params), inputs={"weights": [Artifact(weights, "weights", "weights", "0" * 64)]},
        model_name="q", family=None, task="embedding", source=None, hardware=HW["h200"], section="q.h200",
        target=kind.name, project_dir=tmp_path, logger=logging.getLogger("test"),
    )  # fmt: skip


@pytest.mark.skipif(bool(_env.gpus()), reason="this machine has a GPU")
def test_run_without_a_gpu_fails_clearly(tmp_path):
    ctx = _ctx(tmp_path, TorchCompileKind, tmp_path)
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        TorchCompileKind().run(ctx)
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        AotiKind().run(_ctx(tmp_path / "a", AotiKind, tmp_path))


# --------------------------------------------------------------------------- real workers, CPU


def tiny_qwen3(path: Path) -> Path:
    import torch
    from transformers import Qwen3Config, Qwen3Model

    cfg = Qwen3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, vocab_size=300, max_position_embeddings=256)  # fmt: skip
    cfg.architectures = ["Qwen3Model"]
    torch.manual_seed(0)
    Qwen3Model(cfg).save_pretrained(path)
    return path


def _worker_env(tmp: Path) -> dict[str, str]:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp / "ind"), TRITON_CACHE_DIR=str(tmp / "tri"))
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    return env


def test_the_embedder_uses_the_model_familys_own_loading_and_pooling(tmp_path):
    """With mopt-ml's family, the compiled module is the family's export wrapper (what `onnx`
    exports); sdpa-causal on right-padded rows equals masked sdpa; and the fallback wrapper
    (no family) computes the same embeddings."""
    pytest.importorskip("mopt_ml.families", reason="needs the mopt-ml plugin")
    import torch
    from mopt_torch.embedder import load_embedder, right_padded_batch, set_attention

    weights = tiny_qwen3(tmp_path / "weights")
    spec = "mopt_ml.families:Qwen3Family"
    assert type(load_family(spec)).__name__ == "Qwen3Family"
    fam, model = load_embedder(weights, "fp32", "cpu", spec, "last-token", "sdpa")
    plain, _ = load_embedder(weights, "fp32", "cpu", None, "last-token", "sdpa")
    ids, mask = right_padded_batch(3, 24, 300, 0, "cpu")
    with torch.no_grad():
        a, b = fam(ids, mask), plain(ids, mask)
        set_attention(model, "sdpa-causal")
        c = fam(ids, mask)
    assert type(fam).__name__ == "EmbeddingWrapper" and a.shape == (3, 32)
    assert torch.allclose(a, b, atol=1e-5) and torch.allclose(a, c, atol=1e-5)


def test_a_pinned_sdpa_backend_and_rope_tables_equal_masked_sdpa_eager_and_compiled(tmp_path):
    """sdpa_backend (flash here: it has a CPU kernel) and rope_table (cos/sin looked up, not
    recomputed) on right-padded rows equal plain masked sdpa,
    eagerly and through dynamo (which bakes sdpa_kernel into the graph); without CUDA the GQA
    probe says no, so K/V heads are repeated before the call."""
    pytest.importorskip("mopt_ml.families", reason="needs the mopt-ml plugin")
    import torch
    from mopt_torch.embedder import load_embedder, right_padded_batch, sdpa_gqa_native

    weights = tiny_qwen3(tmp_path / "weights")
    spec = "mopt_ml.families:Qwen3Family"
    ref, _ = load_embedder(weights, "fp32", "cpu", spec, "last-token", "sdpa")
    pinned, model = load_embedder(weights, "fp32", "cpu", spec, "last-token", "sdpa-causal", "flash", True)
    assert model.config._attn_implementation == "sdpa_causal_fa2"
    assert type(model.rotary_emb).__name__ == "RopeTable" and model.rotary_emb.cos.shape == (256, 8)
    ids, mask = right_padded_batch(3, 24, 300, 0, "cpu")
    with torch.no_grad():
        a, b = ref(ids, mask), pinned(ids, mask)
        c = torch.compile(pinned, backend="eager", dynamic=False)(ids, mask)
    assert torch.allclose(a, b, atol=1e-5) and torch.allclose(a, c, atol=1e-5)
    if not torch.cuda.is_available():
        assert sdpa_gqa_native("flash") is False  # the probe needs CUDA: repeat K/V heads


@pytest.mark.slow
def test_compile_artifact_on_cpu_then_a_fresh_process_starts_warm(tmp_path):
    """The whole mechanism, on CPU: compile + save_cache_artifacts in one process, then another
    process with an empty cache loads cache.bin, compiles with the same options and hits."""
    weights = tiny_qwen3(tmp_path / "weights")
    out = tmp_path / "out"
    out.mkdir()
    spec = {"weights": str(weights), "out": str(out), "device": "cpu", "family": None, "pooling": "last-token",
            "precision": "fp32", "mode": "default", "buckets": [[2, 16]], "attention": "sdpa-causal",
            "fullgraph": False, "warmup": 1, "iters": 2, "min_cosine": 0.999, "seed": 0}  # fmt: skip
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    subprocess.run([sys.executable, "-m", "mopt_torch.compile_worker", str(tmp_path / "spec.json")],
                   env=_worker_env(tmp_path / "cold"), check=True, capture_output=True, text=True)  # fmt: skip
    meta = json.loads((out / "meta.json").read_text())
    assert meta["buckets"][0]["min_cosine_vs_eager"] > 0.9999  # sdpa-causal == masked sdpa, right padding
    assert (
        meta["cache_entries"].get("inductor", 0) >= 1
        and (out / "cache.bin").stat().st_size == meta["cache_bytes"]
    )
    warm = (
        "import json, sys, torch\n"
        "from mopt_torch.warm import compiled_embedder\n"
        "from mopt_torch.embedder import right_padded_batch\n"
        "from torch._dynamo.utils import counters\n"
        f"m, meta = compiled_embedder({str(weights)!r}, {str(out)!r}, device='cpu')\n"
        "ids, mask = right_padded_batch(2, 16, 300, 7, 'cpu')\n"
        "with torch.no_grad(): y = m(ids, mask)\n"
        "print(json.dumps({'loaded': meta['loaded'], 'hits': counters['inductor'].get('fxgraph_cache_hit', 0),"
        " 'misses': counters['inductor'].get('fxgraph_cache_miss', 0), 'shape': list(y.shape)}))\n"
    )
    res = subprocess.run([sys.executable, "-c", warm], env=_worker_env(tmp_path / "warm"), check=True,
                         capture_output=True, text=True)  # fmt: skip
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got == {"loaded": True, "hits": 1, "misses": 0, "shape": [2, 32]}


@pytest.mark.slow
def test_aoti_package_on_cpu_exports_dynamic_shapes_and_loads_in_a_child(tmp_path):
    from mopt_torch.aoti import probe_load

    weights = tiny_qwen3(tmp_path / "weights")
    out = tmp_path / "out"
    out.mkdir()
    spec = {"weights": str(weights), "out": str(out), "probe": str(out / "probe.pt"), "device": "cpu",
            "family": None, "pooling": "last-token", "precision": "fp32", "attention": "sdpa-causal",
            "min_batch_size": 1, "max_batch_size": 4, "min_seq_len": 1, "max_seq_len": 64, "seq_multiple": 8,
            "seed": 0}  # fmt: skip
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    subprocess.run([sys.executable, "-m", "mopt_torch.aoti_worker", "build", str(tmp_path / "spec.json")],
                   env=_worker_env(tmp_path), check=True, capture_output=True, text=True)  # fmt: skip
    meta = json.loads((out / "meta.json").read_text())
    assert meta["dynamic"] == "seq = 8 * k" and meta["seq"] == [16, 64] and meta["batch"] == [1, 4]
    assert (out / "model.pt2").stat().st_size > 0
    report = probe_load(out / "model.pt2", out / "probe.pt", "cpu")
    assert report["ok"] and report["min_cosine"] > 0.9999 and report["shape"] == [3, 32]


# --------------------------------------------------------------------------- CUDA


@pytest.mark.gpu
def test_torch_compile_target_on_this_gpu(tmp_path):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    weights = tiny_qwen3(tmp_path / "weights")
    major, minor = torch.cuda.get_device_capability(0)
    hw = HardwareProfile(name="here", description="this GPU", gpu_name=torch.cuda.get_device_name(0),
                         compute_capability=(major, minor), memory_gb=16)  # fmt: skip
    ctx = _ctx(tmp_path, TorchCompileKind, weights, buckets=[(2, 16)], iters=2)
    ctx.hardware = hw
    meta = TorchCompileKind().run(ctx)
    assert meta["compute_capability"] == f"{major}.{minor}" and (ctx.out / "cache.bin").stat().st_size > 0
