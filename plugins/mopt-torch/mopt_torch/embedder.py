"""Load an embedding model as one `nn.Module`: (input_ids, attention_mask) → L2-normalised
pooled embeddings. Used by the compile / AOTI workers and by consumers of their artifacts.

Imports nothing from mopt (workers run it in a fresh process). A model family is named by
`"module:QualName"`; when it offers `load` and `export_wrapper` (mopt-ml's families do) they
are used, so the compiled module is exactly what `onnx` exports and `validate` checks.

Attention `sdpa-causal`: transformers' sdpa kernel called without a materialised mask
(`is_causal=True`). For a causal decoder fed *right-padded* batches this is exact for every
real token (a real token never attends to the padding after it), and under `torch.compile` it
keeps the flash kernel: transformers (on torch < 2.14) always materialises the mask while
compiling, which forces a kernel that takes an explicit mask. With it, bench_torch_compile.py
measured 37.1 ms per batch on an H200 (Qwen3-0.6B shape, fp16, 32 × 512, torch 2.11); the
issue's earlier hand measurement through the masked path was 42.4 ms (not an A/B in one run).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

#: model_types that are causal decoders (sdpa-causal is exact for them with right padding)
CAUSAL_DECODERS = ("qwen2", "qwen3", "llama", "mistral", "gemma", "gemma2", "gemma3", "phi3")
DTYPES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}


#: `sdpa_backend` values: the SDPA kernel the compiled graph pins (auto: torch's own choice)
SDPA_BACKENDS = ("auto", "flash", "cudnn", "efficient")


def register_sdpa_causal(backend: str = "auto") -> str:
    """Register attention `sdpa_causal` (or `sdpa_causal_<backend>`, flash: `_fa2`) with transformers
    (idempotent); returns its name.

    An attention function with no mask function registered makes transformers skip mask
    creation (mask = None), and its sdpa forward then passes is_causal=True. With a backend
    other than `auto` the call runs inside `torch.nn.attention.sdpa_kernel([that backend])`,
    which torch.compile bakes into the graph (so a warm start picks the same kernel)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if backend == "auto":
        AttentionInterface.register("sdpa_causal", sdpa_attention_forward)
        return "sdpa_causal"
    # transformers reads any attention name containing "flash" as a flash-attn kernel request
    name = "sdpa_causal_" + {"flash": "fa2"}.get(backend, backend)
    AttentionInterface.register(name, _pinned_sdpa_forward(backend, sdpa_gqa_native(backend)))
    return name


def _sdpa_backend(backend: str) -> Any:
    from torch.nn.attention import SDPBackend

    return {
        "flash": SDPBackend.FLASH_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
    }[backend]


_GQA_NATIVE: dict[str, bool] = {}


def sdpa_gqa_native(backend: str) -> bool:
    """Whether SDPA `backend` runs grouped-query attention itself (`enable_gqa=True`) on this
    GPU; probed once, eagerly, on a tiny input (never inside a compiled region). When it does
    not, K/V heads are repeated before the call (what transformers does with a mask)."""
    if backend not in _GQA_NATIVE:
        import torch
        from torch.nn.attention import sdpa_kernel

        ok = False
        if torch.cuda.is_available():
            q = torch.randn(1, 4, 64, 128, device="cuda", dtype=torch.float16)
            kv = torch.randn(1, 2, 64, 128, device="cuda", dtype=torch.float16)
            try:
                with sdpa_kernel([_sdpa_backend(backend)]):
                    torch.nn.functional.scaled_dot_product_attention(
                        q, kv, kv, is_causal=True, enable_gqa=True
                    )
                torch.cuda.synchronize()
                ok = True
            except RuntimeError:
                ok = False
        _GQA_NATIVE[backend] = ok
    return _GQA_NATIVE[backend]


def _pinned_sdpa_forward(backend: str, gqa_native: bool) -> Any:
    """transformers' sdpa attention (no-mask causal path) pinned to one SDPA kernel."""
    import torch
    from torch.nn.attention import sdpa_kernel
    from transformers.integrations.sdpa_attention import repeat_kv

    be = _sdpa_backend(backend)

    def forward(
        module: Any,
        query: Any,
        key: Any,
        value: Any,
        attention_mask: Any,
        dropout: float = 0.0,
        scaling: float | None = None,
        is_causal: bool | None = None,
        **kwargs: Any,
    ) -> tuple[Any, None]:
        extra = {}
        n_rep = query.shape[1] // key.shape[1]
        if n_rep > 1:
            if gqa_native:
                extra["enable_gqa"] = True
            else:
                key, value = repeat_kv(key, n_rep), repeat_kv(value, n_rep)
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        causal = query.shape[2] > 1 and attention_mask is None and bool(causal)
        with sdpa_kernel([be]):
            out = torch.nn.functional.scaled_dot_product_attention(
                query,
                key,
                value,
                attn_mask=attention_mask,
                dropout_p=dropout,
                scale=scaling,
                is_causal=causal,
                **extra,
            )
        return out.transpose(1, 2).contiguous(), None

    return forward


def resolve_attention(attention: str, model_config: dict[str, Any], pooling: str | None) -> str:
    """`sdpa` or `sdpa-causal` for `attention = auto|sdpa|sdpa-causal`."""
    if attention != "auto":
        return attention
    mt = model_config.get("model_type")
    archs = model_config.get("architectures") or []
    causal = mt in CAUSAL_DECODERS or any(str(a).endswith("ForCausalLM") for a in archs)
    return "sdpa-causal" if causal and model_config.get("is_causal", True) else "sdpa"


def load_family(spec: str | None) -> Any:
    """The family object named `module:QualName` (instantiated when it is a class)."""
    if not spec:
        return None
    mod, _, qual = spec.partition(":")
    obj: Any = importlib.import_module(mod)
    for part in qual.split("."):
        obj = getattr(obj, part)
    return obj() if isinstance(obj, type) else obj


def family_spec(family: Any) -> str | None:
    """`module:QualName` of a family object or class (None for None)."""
    if family is None:
        return None
    cls = family if isinstance(family, type) else type(family)
    return f"{cls.__module__}:{cls.__qualname__}"


def pool(hidden: Any, mask: Any, pooling: str) -> Any:
    import torch

    if pooling == "last-token":
        pos = torch.arange(mask.shape[1], device=mask.device).unsqueeze(0)
        last = (mask.long() * pos).argmax(dim=1)
        idx = last.view(-1, 1, 1).expand(-1, 1, hidden.shape[-1])
        return torch.gather(hidden, 1, idx).squeeze(1)
    if pooling == "cls":
        return hidden[:, 0]
    m = mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)


def cache_rotary(model: Any) -> int:
    """Replace the model's rotary-embedding modules (transformers' default RoPE: `inv_freq`,
    `attention_scaling`) by a lookup in cos/sin tables computed once, eagerly, by the module
    itself for every position up to max_position_embeddings; returns how many were replaced.

    Same values as the module (fp32 tables, cast to the activations' dtype as it does). Why:
    Inductor fuses the module's cos/sin into every layer's q/k-norm + RoPE kernel and
    recomputes them per element and head, which made those kernels compute-bound (5.7 of
    36.7 ms per batch on an H200, Qwen3-0.6B shape, 32 x 512); a table is two cached loads."""
    import torch

    class RopeTable(torch.nn.Module):
        def __init__(self, orig: Any, n: int) -> None:
            super().__init__()
            pos = torch.arange(n, device=orig.inv_freq.device).unsqueeze(0)
            with torch.no_grad():
                cos, sin = orig(torch.zeros(1, device=orig.inv_freq.device, dtype=torch.float32), pos)
            self.register_buffer("cos", cos[0].float().contiguous(), persistent=False)
            self.register_buffer("sin", sin[0].float().contiguous(), persistent=False)

        def forward(self, x: Any, position_ids: Any) -> tuple[Any, Any]:
            return self.cos[position_ids].to(x.dtype), self.sin[position_ids].to(x.dtype)

    done = 0
    for name, mod in list(model.named_modules()):
        if not name or not (hasattr(mod, "inv_freq") and hasattr(mod, "attention_scaling")):
            continue
        if getattr(mod, "rope_type", "default") != "default":
            continue  # dynamic / long-context RoPE types change with the sequence length
        cfg = getattr(mod, "config", None) or getattr(model, "config", None)
        n = getattr(mod, "max_seq_len_cached", None) or getattr(cfg, "max_position_embeddings", None)
        if not n:
            continue
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, RopeTable(mod, int(n)))
        done += 1
    return done


def set_attention(model: Any, name: str, sdpa_backend: str = "auto") -> None:
    """Switch a loaded transformers model's attention implementation."""
    impl = register_sdpa_causal(sdpa_backend) if name == "sdpa-causal" else name
    if hasattr(model, "set_attn_implementation"):
        try:
            model.set_attn_implementation(impl)
            return
        except Exception:  # some versions refuse names they do not know; the config attribute works
            pass
    model.config._attn_implementation = impl


def load_embedder(
    weights: Path | str,
    precision: str,
    device: str,
    family: str | None,
    pooling: str,
    attention: str = "sdpa",
    sdpa_backend: str = "auto",
    rope_table: bool = False,
) -> tuple[Any, Any]:
    """(wrapper module, the inner transformers model) on `device`, in eval mode.
    `sdpa_backend` pins the SDPA kernel of attention `sdpa-causal` (see register_sdpa_causal);
    `rope_table` swaps the rotary embedding for cos/sin tables (see cache_rotary)."""
    import torch

    fam = load_family(family)
    impl = register_sdpa_causal(sdpa_backend) if attention == "sdpa-causal" else attention
    if fam is not None and hasattr(fam, "load") and hasattr(fam, "export_wrapper"):
        model = fam.load(weights, dtype=precision, attn_implementation=impl)
        wrapper = fam.export_wrapper(model)
    else:
        from transformers import AutoModel

        model = AutoModel.from_pretrained(
            str(weights), dtype=getattr(torch, DTYPES[precision]), attn_implementation=impl
        )

        class Embedder(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.model = model

            def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
                h = self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
                return torch.nn.functional.normalize(pool(h, attention_mask, pooling).float(), dim=-1)

        wrapper = Embedder()
    model = model.to(device=device, dtype=getattr(torch, DTYPES[precision])).eval()
    if rope_table:
        cache_rotary(model)
    return wrapper.to(device).eval(), model


def right_padded_batch(batch: int, seq: int, vocab: int, seed: int, device: str) -> tuple[Any, Any]:
    """Random token ids with right padding: row 0 full length, the others 1/4..full."""
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, max(vocab, 2), (batch, seq), generator=g)
    lengths = torch.randint(max(1, seq // 4), seq + 1, (batch,), generator=g)
    lengths[0] = seq
    mask = (torch.arange(seq).unsqueeze(0) < lengths.unsqueeze(1)).long()
    return ids.to(device), mask.to(device)
