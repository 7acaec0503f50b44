"""The memory estimator: parameter counts against transformers, the KV-cache formula, the
pooled-runtime arithmetic, and the "largest setting that fits" search."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import ClassVar

import pytest

from mopt.api import Family
from mopt.estimate import (
    GIB,
    ConfigError,
    ModelDims,
    Workload,
    activation_bytes,
    bytes_per_value,
    estimate,
    kv_bytes_per_token,
    largest_fitting,
    normalize_precision,
    weight_bytes,
)
from mopt.family import model_dims


class Qwen3Shape(Family):
    """What a qwen3 family tells the estimator (mopt-ml's Qwen3Family says the same)."""

    name = "qwen3-shape"
    qk_norm = True


class BertShape(Family):
    """A BERT encoder with its pooler (mopt-ml's BertFamily)."""

    name = "bert-shape"
    encoder = True
    pooler_architectures = ("BertModel",)


def qwen3(cfg: dict) -> ModelDims:
    return model_dims(cfg, Qwen3Shape)


def bert(cfg: dict) -> ModelDims:
    return model_dims(cfg, BertShape)


ROOT = Path(__file__).resolve().parent.parent
QWEN3 = json.loads((ROOT / "recipes" / "configs" / "qwen3-embedding-0.6b.json").read_text())
MINILM = json.loads(
    (Path(__file__).parent / "check_recipes" / "models" / "minilm" / "config.json").read_text()
)


def test_qwen3_embedding_config_is_the_published_shape() -> None:
    d = qwen3(QWEN3)
    assert (d.layers, d.hidden, d.intermediate, d.heads, d.kv_heads, d.head_dim) == (
        28,
        1024,
        3072,
        16,
        8,
        128,
    )
    assert (d.vocab, d.max_position, d.tied, d.gated_mlp, d.qk_norm) == (151669, 32768, True, True, True)
    assert d.q_dim == 2048  # 16 heads × 128: wider than hidden
    assert d.config_dtype == "bf16"


def test_qwen3_embedding_param_count_matches_transformers_exactly() -> None:
    # transformers counts 595,776,512 for Qwen3Model with this config (checked with torch's
    # meta device; the test below repeats it where transformers is installed)
    assert qwen3(QWEN3).param_counts().total == 595_776_512


def test_minilm_param_count_is_22_7m() -> None:
    d = bert(MINILM)
    assert d.encoder and not d.gated_mlp and d.pooler
    assert d.param_counts().total == 22_713_216


SHAPES = {
    "qwen3-0.6b": {},
    "qwen3-gqa-1kv": {
        "num_hidden_layers": 2,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "vocab_size": 1000,
    },
    "qwen3-untied": {"tie_word_embeddings": False, "num_hidden_layers": 3},
}


@pytest.fixture(scope="module")
def transformers_counts() -> dict[str, int]:
    """Parameter counts transformers itself reports (meta device, one subprocess for all)."""
    pytest.importorskip("transformers")
    pytest.importorskip("torch")
    cases = {name: ("Qwen3Model", "Qwen3Config", {**QWEN3, **o}) for name, o in SHAPES.items()}
    cases["minilm"] = ("BertModel", "BertConfig", MINILM)
    code = (
        "import json, sys, torch, transformers as t\n"
        "out = {}\n"
        "for name, (model, config, cfg) in json.loads(sys.argv[1]).items():\n"
        "    with torch.device('meta'):\n"
        "        m = getattr(t, model)(getattr(t, config)(**cfg))\n"
        "    out[name] = sum(p.numel() for p in m.parameters())\n"
        "print(json.dumps(out))\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code, json.dumps(cases)],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    counts: dict[str, int] = json.loads(res.stdout.strip().splitlines()[-1])
    return counts


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_param_count_equals_transformers_for_qwen3_shapes(
    name: str, transformers_counts: dict[str, int]
) -> None:
    d = qwen3({**QWEN3, **SHAPES[name]})
    # Qwen3Model has no lm_head: the estimator counts an untied one for serving
    assert d.param_counts().total - d.param_counts().lm_head == transformers_counts[name]


def test_bert_param_count_equals_transformers(transformers_counts: dict[str, int]) -> None:
    assert bert(MINILM).param_counts().total == transformers_counts["minilm"]


def test_missing_keys_are_named() -> None:
    with pytest.raises(ConfigError) as exc:
        qwen3({"hidden_size": 64, "model_type": "qwen3"})
    assert exc.value.missing == ["num_hidden_layers", "num_attention_heads", "vocab_size"]


@pytest.mark.parametrize(
    ("name", "canonical"),
    [
        ("float16", "fp16"),
        ("BF16", "bf16"),
        ("bfloat16", "bf16"),
        ("fp8_e4m3", "fp8"),
        ("int4_awq", "int4"),
        ("modelopt_fp4", "nvfp4"),
        ("torch.float32", "fp32"),
        ("auto", None),
        ("mixed", None),
        (3, None),
    ],
)
def test_precision_names(name: object, canonical: str | None) -> None:
    assert normalize_precision(name) == canonical


def test_bytes_per_value_include_scales() -> None:
    assert bytes_per_value("fp16") == 2
    assert bytes_per_value("int4") == pytest.approx(0.5 + 2 / 128)
    assert bytes_per_value("nvfp4") == pytest.approx(0.5625)


def test_weights_by_precision() -> None:
    d = qwen3(QWEN3)
    pc = d.param_counts()
    assert weight_bytes(d, "fp32") == pc.total * 4
    assert weight_bytes(d, "bf16") == pc.total * 2
    # quantized: linear layers in 1 byte, embeddings and norms stay 16-bit
    assert weight_bytes(d, "fp8") == pc.linear * 1 + (pc.total - pc.linear) * 2
    assert weight_bytes(d, "int4") < weight_bytes(d, "int8") < weight_bytes(d, "fp16")


def test_kv_cache_formula() -> None:
    d = qwen3(QWEN3)
    # 2 × 28 layers × 8 kv heads × 128 × 2 bytes = 114,688 bytes per token
    assert kv_bytes_per_token(d, "fp16") == 2 * 28 * 8 * 128 * 2 == 114_688
    assert kv_bytes_per_token(d, "fp8") == 57_344
    assert kv_bytes_per_token(d, "fp16", tp=2) == 57_344  # kv heads split
    assert kv_bytes_per_token(d, "fp16", tp=16) == 2 * 28 * 1 * 128 * 2  # replicated past 8
    e = estimate(d, Workload(precision="bf16", batch=4, seq_len=1000, kv_cache=True))
    assert e.kv_cache == 114_688 * 4000


def test_activations_grow_with_tokens_and_eager_attention() -> None:
    d = qwen3(QWEN3)
    a1 = activation_bytes(d, 1024, "fp16")
    assert activation_bytes(d, 2048, "fp16") == pytest.approx(2 * a1)
    eager = activation_bytes(d, 4096, "fp16", batch=1, seq_len=4096, attention="eager")
    assert eager - activation_bytes(d, 4096, "fp16") == 10 * 16 * 4096 * 4096  # bytes per score element


def test_engine_estimate_breakdown_sums_up() -> None:
    d = qwen3(QWEN3)
    e = estimate(d, Workload(precision="fp16", batch=8, seq_len=512, workspace_gb=1.0), capacity_gb=8)
    assert e.total == e.weights + e.activations + e.workspace + e.runtime
    assert e.workspace == GIB and e.runtime == GIB // 2 and e.kv_cache == 0
    assert e.fits and e.budget == 8 * GIB
    assert [ln.name for ln in e.lines] == ["weights", "activations", "workspace", "runtime"]
    js = e.to_json()
    assert js["bytes"]["total"] == round(e.total) and js["fits"] is True


def test_shared_memory_counts_the_host_copy_of_the_weights_in_the_same_pool() -> None:
    """A Jetson's GPU memory is the machine's: the weights read into host memory on their way
    to the device take from the same capacity (the runtime line says so)."""
    d = qwen3(QWEN3)
    w = Workload(precision="fp16", batch=8, seq_len=512)
    alone = estimate(d, w, capacity_gb=8)
    shared = estimate(d, Workload(**{**w.__dict__, "shared_memory": True}), capacity_gb=8)
    assert shared.total == pytest.approx(alone.total + alone.weights)
    assert shared.runtime == alone.runtime + alone.weights
    assert shared.lines[-1].formula == "CUDA context ≈ 0.5 GiB + the weights' host copy 1.11 GiB (memory shared with the CPU)"
    # Qwen3-Embedding-0.6B at fp16 fits 8 GiB of its own at batch 8 × 512, and on a Jetson too
    assert alone.fits and shared.fits
    on_jetson = largest_fitting(d, Workload(**{**w.__dict__, "shared_memory": True}), 3, "batch", 1 << 16)
    assert on_jetson is not None and 1 < on_jetson < largest_fitting(d, w, 3, "batch", 1 << 16) // 2  # type: ignore[operator]


def test_vllm_pool_leaves_the_rest_for_kv_cache() -> None:
    d = qwen3(QWEN3)
    w = Workload(
        precision="bf16", batch=16, seq_len=32768, num_tokens=32768, kv_cache=True, memory_fraction=0.9
    )
    e = estimate(d, w, capacity_gb=141)
    assert e.budget == pytest.approx(0.9 * 141 * GIB)
    assert e.kv_available == pytest.approx(e.budget - e.fixed)
    assert e.kv_tokens_available == int(e.kv_available // 114_688)
    assert e.fits  # 16 × 32768 tokens × 112 KiB = 56 GiB < ~124 GiB left
    e2 = estimate(d, Workload(**{**w.__dict__, "batch": 64}), capacity_gb=141)
    assert e2.model_fits and not e2.fits


def test_trtllm_kv_fraction_of_free_memory() -> None:
    d = qwen3(QWEN3)
    w = Workload(precision="bf16", batch=8, seq_len=8192, num_tokens=8192, kv_cache=True, kv_fraction=0.5)
    e = estimate(d, w, capacity_gb=80)
    assert e.kv_available == pytest.approx(0.5 * (80 * GIB - e.fixed))


def test_tensor_parallel_shards_weights() -> None:
    d = qwen3(QWEN3)
    one = estimate(d, Workload(precision="bf16"))
    four = estimate(d, Workload(precision="bf16", tp=4))
    assert four.weights == pytest.approx(one.weights / 4)


def test_largest_fitting_is_the_boundary() -> None:
    d = qwen3(QWEN3)
    w = Workload(precision="fp16", batch=512, seq_len=2048)
    b = largest_fitting(d, w, 8, "batch", 4096)
    assert b is not None and 1 < b < 512
    assert estimate(d, Workload(precision="fp16", batch=b, seq_len=2048), 8).fits
    assert not estimate(d, Workload(precision="fp16", batch=b + 1, seq_len=2048), 8).fits
    # nothing fits when the weights alone exceed the GPU
    assert largest_fitting(d, Workload(precision="fp32"), 1, "batch", 64) is None


def test_rope_scaling_extends_the_max_sequence() -> None:
    cfg = {
        **QWEN3,
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    }
    assert qwen3(cfg).max_sequence == 131072
    assert qwen3(QWEN3).max_sequence == 32768


def test_estimator_imports_no_torch() -> None:
    code = "import sys, mopt.estimate, mopt.check, mopt.machine, mopt.doctor, mopt.cli_check; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "False"


def test_the_family_decides_the_shape_not_the_model_type() -> None:
    """A renamed copy of BERT is an encoder because its family says so; the estimator keeps no
    list of model types (without a family a config reads as a gated decoder)."""
    renamed = {**MINILM, "model_type": "acme-bert", "architectures": ["BertModel"]}
    d = bert(renamed)
    assert d.encoder and d.param_counts().total == 22_713_216
    assert not model_dims(renamed).encoder


def test_family_config_keys_name_the_dims() -> None:
    class DistilShape(Family):
        name = "distil-shape"
        encoder = True
        config_keys: ClassVar[dict[str, tuple[str, ...]]] = {
            "hidden": ("dim",), "layers": ("n_layers",), "heads": ("n_heads",), "intermediate": ("hidden_dim",)
        }  # fmt: skip

    cfg = {"model_type": "distilbert", "dim": 768, "n_layers": 6, "n_heads": 12, "hidden_dim": 3072,
           "vocab_size": 30522, "max_position_embeddings": 512}  # fmt: skip
    d = model_dims(cfg, DistilShape)
    assert (d.hidden, d.layers, d.heads, d.intermediate, d.encoder) == (768, 6, 12, 3072, True)
    # distilbert-base-uncased: 66,362,880 parameters (transformers' DistilBertModel)
    assert d.param_counts().total == 66_362_880
    with pytest.raises(ConfigError) as exc:
        model_dims({"vocab_size": 10}, DistilShape)
    assert exc.value.missing == ["dim", "n_layers", "n_heads"]
