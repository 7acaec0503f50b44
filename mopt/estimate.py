"""Memory estimator: how much GPU (or CPU) memory a model needs for a given workload.

Everything comes from the model's Hugging Face `config.json` (a dict); nothing here imports
torch. The numbers are estimates for planning (`mopt check`), not promises.

Parameters
    Decoder (qwen2/qwen3/llama/mistral style, `ModelDims.gated_mlp`):
        embedding  V·H (+ an untied lm_head V·H)
        attention  per layer: q H·(n_q·d), k and v H·(n_kv·d) each (GQA), o (n_q·d)·H
                   (+ biases when `attention_bias`; + q_norm/k_norm d each for qwen3)
        MLP        per layer: 3·H·I (gate, up, down)
        norms      2·H per layer + H final
    Encoder (bert style): word + position + token-type embeddings (+ LayerNorm), per layer
        4·(H²+H) attention, 2·H·I + I + H MLP (2 matrices), 2 LayerNorms (weight + bias),
        and the pooler H²+H. All-MiniLM-L6-v2 comes out at 22,713,216, as transformers counts.
    Checked against transformers' own parameter count (tests/test_estimate.py).

Weights
    linear layers × bytes of the precision (+ quantization scales: `BYTES`, `SCALE_BYTES`),
    everything else (embeddings, norms, biases) × bytes of the activation dtype.

KV cache (runtimes that keep one: vLLM, TensorRT-LLM)
    2 (K and V) × layers × kv_heads × head_dim × bytes × tokens, per GPU divided by the
    tensor-parallel size (kv heads are replicated when TP > kv_heads) and pipeline size.

Activations (peak of one forward pass of T = batch × seq tokens; layers run one at a time,
so only one layer's tensors are alive)
    a · T · (3·H + 2·head_dim + max(attention, MLP) / TP), where
        3·H         the layer's input, the residual sum and the normalised copy,
        2·head_dim  the rotary cos / sin tables,
        attention = 4·q_dim + 2·kv_dim (q, rotated q, the attention output and its
                    contiguous copy; k and v), fused attention (flash / SDPA / TensorRT MHA),
        MLP       = 3.5·I gated (gate activation, up, their product, and the allocator's
                    share) or 2.5·I (intermediate, activation),
    plus, for eager (unfused) attention, batch · heads · seq² score elements × 10 bytes
    (16-bit: scores, masked scores, fp32 softmax, cast back) or × 8 bytes (fp32).
    a = 2 bytes (fp16/bf16; also for quantized weights), 4 for fp32. The constants were fitted
    to measured peaks of transformers' Qwen3 on CPU (docs/performance.md).

Workspace and runtime
    the TensorRT workspace when the recipe sets one (`workspace_gb`), and ~0.5 GiB of CUDA
    context per GPU process (0 on CPU).

Pooled runtimes
    `memory_fraction` × capacity (vLLM's gpu_memory_utilization), of which what weights,
    activations and the context leave is KV cache; or `kv_fraction` of the memory they leave
    (TensorRT-LLM's kv_cache_free_gpu_memory_fraction). The KV cache needed for batch × seq_len
    (max_num_seqs × max_model_len) is compared with what is left.

Units: bytes; profiles' `memory_gb` is read as GiB (2**30), which matches what nvidia-smi
reports for the built-in profiles to within 1-2 %.

Measured error (GPU and CPU peaks, vLLM's KV cache on the H200) and what was not measured:
docs/performance.md, "The memory estimator".
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

GIB = 1 << 30

#: bytes per stored value
BYTES: dict[str, float] = {
    "fp32": 4.0,
    "fp16": 2.0,
    "bf16": 2.0,
    "fp8": 1.0,
    "int8": 1.0,
    "int4": 0.5,
    "nvfp4": 0.5,
}
#: extra bytes per value for quantization scales (int4: fp16 scale / 128; nvfp4: fp8 scale / 16)
SCALE_BYTES: dict[str, float] = {"int4": 2.0 / 128, "nvfp4": 1.0 / 16}

#: canonical precision → the names recipes, configs and quantization tools give it
_NAMES: dict[str, str] = {
    "fp32": "fp32 float32 float f32 full tf32",
    "fp16": "fp16 float16 half f16",
    "bf16": "bf16 bfloat16",
    "fp8": "fp8 float8 fp8_e4m3 fp8_e5m2 fp8_e4m3fn float8_e4m3fn e4m3 e5m2 w8a8_fp8",
    "int8": "int8 qint8 w8a8 int8_sq smoothquant int8_weight_only w8a16",
    "int4": "int4 int4_awq w4a16 w4a16_awq w4a8_awq awq gptq int4_weight_only",
    "nvfp4": "nvfp4 fp4 modelopt_fp4 mxfp4",
}
_ALIASES = {name: canonical for canonical, names in _NAMES.items() for name in names.split()}


def normalize_precision(value: Any) -> str | None:
    """Canonical precision name (fp32, fp16, bf16, fp8, int8, int4, nvfp4), or None when
    the value does not name one ("auto", "mixed", a quantization method we cannot size)."""
    if not isinstance(value, str):
        return None
    v = value.strip().lower().replace("-", "_")
    if v.startswith("torch."):
        v = v[len("torch.") :]
    return _ALIASES.get(v)


def bytes_per_value(precision: str) -> float:
    """Bytes per stored value of `precision`, scales included."""
    return BYTES[precision] + SCALE_BYTES.get(precision, 0.0)


def activation_dtype(precision: str) -> str:
    """The dtype activations are kept in for weights of `precision` (fp32 stays fp32)."""
    return "fp32" if precision == "fp32" else ("bf16" if precision == "bf16" else "fp16")


class ConfigError(ValueError):
    """The config.json lacks what the estimator needs; `missing` lists the keys."""

    def __init__(self, missing: list[str]) -> None:
        self.missing = missing
        super().__init__("config.json lacks " + ", ".join(missing))


@dataclass(frozen=True)
class ModelDims:
    """The shape of a transformer, read from config.json."""

    model_type: str
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    max_position: int | None
    tied: bool
    gated_mlp: bool
    encoder: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    type_vocab: int = 0
    pooler: bool = False
    config_dtype: str | None = None
    rope_factor: float | None = None
    original_max_position: int | None = None

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def max_sequence(self) -> int | None:
        """Longest sequence the position encoding supports (with RoPE scaling, when set)."""
        if self.max_position is None:
            return None
        if self.rope_factor and self.rope_factor > 1 and not self.encoder:
            base = self.original_max_position or self.max_position
            return max(self.max_position, int(base * self.rope_factor))
        return self.max_position

    def param_counts(self) -> ParamCounts:
        """Parameters by part, as transformers would count them for the base model."""
        h, i_, d = self.hidden, self.intermediate, self.head_dim
        if self.encoder:
            pos = (self.max_position or 512) * h
            emb = self.vocab * h
            other = self.type_vocab * h + 2 * h  # token types + embedding LayerNorm
            attn = self.layers * (4 * h * h)
            attn_bias = self.layers * 4 * h
            mlp = self.layers * (2 * h * i_)
            mlp_bias = self.layers * (i_ + h)
            norms = self.layers * 2 * 2 * h
            pooler = (h * h + h) if self.pooler else 0
            return ParamCounts(
                embedding=emb,
                position=pos,
                attention=attn,
                mlp=mlp,
                norms=norms,
                lm_head=0,
                other=other + attn_bias + mlp_bias + pooler,
                linear=attn + mlp + (h * h if self.pooler else 0),
            )
        attn = self.layers * (2 * h * self.q_dim + 2 * h * self.kv_dim)
        bias = self.layers * (self.q_dim + 2 * self.kv_dim) if self.attention_bias else 0
        qk = self.layers * 2 * d if self.qk_norm else 0
        mlp = self.layers * ((3 if self.gated_mlp else 2) * h * i_)
        norms = self.layers * 2 * h + h + qk
        lm_head = 0 if self.tied else self.vocab * h
        return ParamCounts(
            embedding=self.vocab * h,
            position=0,
            attention=attn,
            mlp=mlp,
            norms=norms,
            lm_head=lm_head,
            other=bias,
            linear=attn + mlp,
        )


@dataclass(frozen=True)
class ParamCounts:
    """Parameter counts by part. `linear` = the matrices quantization applies to."""

    embedding: int
    position: int
    attention: int
    mlp: int
    norms: int
    lm_head: int
    other: int
    linear: int

    @property
    def total(self) -> int:
        return self.embedding + self.position + self.attention + self.mlp + self.norms + self.lm_head + self.other


@dataclass(frozen=True)
class Workload:
    """What the runtime is asked to hold: the settings of one target.

    `batch` × `seq_len` is the largest request shape (TensorRT max_batch_size × max_seq_len,
    vLLM max_num_seqs × max_model_len). `num_tokens` is how many tokens one forward pass
    processes (defaults to batch × seq_len; vLLM max_num_batched_tokens, TensorRT-LLM
    max_num_tokens). `kv_cache` is true for runtimes that keep a KV cache.
    """

    precision: str = "fp16"
    kv_dtype: str | None = None
    batch: int = 1
    seq_len: int = 512
    num_tokens: int | None = None
    kv_cache: bool = False
    tp: int = 1
    pp: int = 1
    workspace_gb: float = 0.0
    #: vLLM gpu_memory_utilization: the share of the GPU the runtime may take
    memory_fraction: float | None = None
    #: TensorRT-LLM kv_cache_free_gpu_memory_fraction: share of the memory left for the KV cache
    kv_fraction: float | None = None
    attention: str = "fused"  # "fused" (flash / SDPA / TensorRT MHA) or "eager"
    device: str = "gpu"
    runtime_overhead_gb: float | None = None  # default: 0.5 GiB on GPU, 0 on CPU
    shared_memory: bool = False  # one pool with the CPU (Jetson): the weights' host copy counts too
    runtime: str = "engine"  # "engine", or the serving kind sized by its KV pool: for messages

    @property
    def tokens(self) -> int:
        return self.num_tokens if self.num_tokens is not None else self.batch * self.seq_len


@dataclass(frozen=True)
class Line:
    """One row of a breakdown: what, how many bytes, and how it was computed."""

    name: str
    bytes: float
    formula: str


@dataclass(frozen=True)
class MemoryEstimate:
    """A breakdown of the memory one GPU (or the CPU process) needs, in bytes."""

    params: int
    workload: Workload
    weights: float
    kv_cache: float
    activations: float
    workspace: float
    runtime: float
    capacity: float | None  # the GPU's memory (per GPU)
    budget: float | None  # what this runtime may use of it (vLLM: × gpu_memory_utilization)
    kv_available: float | None  # pooled runtimes: what is left for the KV cache
    kv_per_token: float
    lines: tuple[Line, ...] = field(default=())

    @property
    def fixed(self) -> float:
        """Everything but the KV cache."""
        return self.weights + self.activations + self.workspace + self.runtime

    @property
    def total(self) -> float:
        """Memory needed for the whole workload (KV cache for every sequence included)."""
        return self.fixed + self.kv_cache

    @property
    def model_fits(self) -> bool:
        """Weights, activations and overheads fit in the budget (ignoring the KV cache)."""
        return self.budget is None or self.fixed <= self.budget

    @property
    def fits(self) -> bool:
        """The whole workload fits: for pooled runtimes, every sequence's KV cache fits."""
        if self.budget is None:
            return True
        if self.kv_available is not None:
            return self.model_fits and self.kv_available >= self.kv_cache
        return self.total <= self.budget

    @property
    def kv_tokens_available(self) -> int | None:
        """Tokens of KV cache a pooled runtime would have room for."""
        if self.kv_available is None or self.kv_per_token <= 0:
            return None
        return max(0, int(self.kv_available // self.kv_per_token))

    def to_json(self) -> dict[str, Any]:
        w = self.workload
        return {
            "params": self.params,
            "precision": w.precision,
            "kv_dtype": w.kv_dtype,
            "runtime": w.runtime,
            "batch": w.batch,
            "seq_len": w.seq_len,
            "tokens": w.tokens,
            "tp": w.tp,
            "pp": w.pp,
            "bytes": {
                "weights": round(self.weights),
                "kv_cache": round(self.kv_cache),
                "activations": round(self.activations),
                "workspace": round(self.workspace),
                "runtime": round(self.runtime),
                "total": round(self.total),
            },
            "capacity_bytes": round(self.capacity) if self.capacity is not None else None,
            "budget_bytes": round(self.budget) if self.budget is not None else None,
            "kv_available_bytes": round(self.kv_available) if self.kv_available is not None else None,
            "kv_bytes_per_token": self.kv_per_token,
            "kv_tokens_available": self.kv_tokens_available,
            "fits": self.fits,
            "lines": [{"name": ln.name, "bytes": round(ln.bytes), "formula": ln.formula} for ln in self.lines],
        }


def gib(n: float) -> str:
    """`1.23 GiB` (or MiB below 1 GiB)."""
    if abs(n) < GIB:
        return f"{n / (1 << 20):.0f} MiB"
    return f"{n / GIB:.2f} GiB"


def weight_bytes(dims: ModelDims, precision: str) -> float:
    """Bytes of the weights (whole model, all GPUs together)."""
    pc = dims.param_counts()
    base = BYTES[activation_dtype(precision)]
    return pc.linear * bytes_per_value(precision) + (pc.total - pc.linear) * base


def kv_bytes_per_token(dims: ModelDims, kv_dtype: str, tp: int = 1, pp: int = 1) -> float:
    """KV cache bytes one token takes on one GPU: 2 × layers × kv_heads × head_dim × bytes."""
    kv_heads_per_gpu = max(1, math.ceil(dims.kv_heads / tp))
    layers = math.ceil(dims.layers / pp)
    return 2 * layers * kv_heads_per_gpu * dims.head_dim * bytes_per_value(kv_dtype)


#: bytes per attention-score element alive at once in eager attention: the scores, the masked
#: scores, the softmax (computed in fp32) and its cast back (16-bit); fp32 needs no cast.
#: Measured on the H200 (bf16: 9.5-9.9) and on CPU (fp32: 8.3).
_EAGER_SCORE_BYTES = {"fp16": 10, "bf16": 10, "fp32": 8}


def activation_bytes(
    dims: ModelDims, tokens: int, act_dtype: str, *, batch: int = 1, seq_len: int = 0,
    tp: int = 1, attention: str = "fused",
) -> float:
    """Peak activation bytes of one forward pass over `tokens` tokens (see the module doc)."""
    a = BYTES[act_dtype]
    attn = 4 * dims.q_dim + 2 * dims.kv_dim
    mlp = (3.5 if dims.gated_mlp else 2.5) * dims.intermediate
    per_token = 3 * dims.hidden + 2 * dims.head_dim + max(attn, mlp) / tp
    out = a * tokens * per_token
    if attention == "eager" and seq_len:
        out += _EAGER_SCORE_BYTES[act_dtype] * batch * math.ceil(dims.heads / tp) * seq_len * seq_len
    return out


def estimate(dims: ModelDims, w: Workload, capacity_gb: float | None = None) -> MemoryEstimate:
    """The memory breakdown of workload `w` on one GPU with `capacity_gb` GiB (None: no limit)."""
    pc = dims.param_counts()
    shards = max(1, w.tp) * max(1, w.pp)
    act_dtype = activation_dtype(w.precision)
    kv_dtype = w.kv_dtype or act_dtype
    weights = weight_bytes(dims, w.precision) / shards
    kv_tok = kv_bytes_per_token(dims, kv_dtype, w.tp, w.pp)
    kv_tokens = w.batch * w.seq_len if w.kv_cache else 0
    kv = kv_tok * kv_tokens
    act = activation_bytes(
        dims, w.tokens, act_dtype, batch=w.batch, seq_len=w.seq_len, tp=max(1, w.tp), attention=w.attention
    )
    workspace = w.workspace_gb * GIB
    overhead = w.runtime_overhead_gb if w.runtime_overhead_gb is not None else (0.5 if w.device == "gpu" else 0.0)
    host = weights if w.shared_memory else 0.0  # read into host memory before they reach the device
    runtime = overhead * GIB + host
    capacity = capacity_gb * GIB if capacity_gb is not None else None
    budget = capacity
    kv_available = None
    if capacity is not None and w.kv_cache:
        fixed = weights + act + workspace + runtime
        if w.memory_fraction is not None:
            budget = capacity * w.memory_fraction
            kv_available = max(0.0, budget - fixed)
        elif w.kv_fraction is not None:
            kv_available = max(0.0, (capacity - fixed) * w.kv_fraction)
    shard = f" / {shards} GPUs" if shards > 1 else ""
    wb = bytes_per_value(w.precision)
    lines = [
        Line(
            "weights",
            weights,
            f"{pc.total / 1e6:,.1f}M params ({pc.linear / 1e6:,.1f}M in linear layers × {wb:g} B {w.precision}"
            + (f", rest × {BYTES[act_dtype]:g} B" if wb != BYTES[act_dtype] else "")
            + f"){shard}",
        ),
    ]
    if w.kv_cache:
        lines.append(
            Line(
                "KV cache",
                kv,
                f"2 × {dims.layers} layers × {dims.kv_heads} kv heads × {dims.head_dim} × "
                f"{bytes_per_value(kv_dtype):g} B {kv_dtype} = {kv_tok / 1024:.0f} KiB/token "
                f"× {w.batch} × {w.seq_len} tokens" + (f" (per GPU, TP {w.tp})" if w.tp > 1 else ""),
            )
        )
    attn_part = " + eager scores" if w.attention == "eager" else ""
    lines.append(
        Line(
            "activations",
            act,
            f"{w.tokens:,} tokens × (3·H + 2·d + max(attn, MLP)) × {BYTES[act_dtype]:g} B{attn_part}",
        )
    )
    if workspace:
        lines.append(Line("workspace", workspace, f"workspace_gb = {w.workspace_gb:g}"))
    if runtime:
        lines.append(Line("runtime", runtime, f"CUDA context ≈ {overhead:g} GiB"
                          + (f" + the weights' host copy {gib(host)} (memory shared with the CPU)" if host else "")))
    return MemoryEstimate(
        params=pc.total,
        workload=w,
        weights=weights,
        kv_cache=kv,
        activations=act,
        workspace=workspace,
        runtime=runtime,
        capacity=capacity,
        budget=budget,
        kv_available=kv_available,
        kv_per_token=kv_tok,
        lines=tuple(lines),
    )


def largest_fitting(
    dims: ModelDims,
    w: Workload,
    capacity_gb: float,
    field_name: str,
    upper: int,
    fits: Callable[[MemoryEstimate], bool] | None = None,
) -> int | None:
    """The largest value of integer workload field `field_name` (batch, seq_len, num_tokens)
    in [1, upper] for which the workload fits (`fits`, default `MemoryEstimate.fits`), or
    None when even 1 does not. Memory grows with each field, so this is a binary search."""
    test = fits or (lambda e: e.fits)

    def ok(v: int) -> bool:
        kw: dict[str, Any] = {field_name: v}
        return test(estimate(dims, replace(w, **kw), capacity_gb))

    if upper < 1 or not ok(1):
        return None
    lo, hi = 1, upper
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo

