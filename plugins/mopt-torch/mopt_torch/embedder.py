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


def register_sdpa_causal() -> str:
    """Register attention `sdpa_causal` with transformers (idempotent); returns its name.

    An attention function with no mask function registered makes transformers skip mask
    creation (mask = None), and its sdpa forward then passes is_causal=True."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    AttentionInterface.register("sdpa_causal", sdpa_attention_forward)
    return "sdpa_causal"


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


def set_attention(model: Any, name: str) -> None:
    """Switch a loaded transformers model's attention implementation."""
    impl = "sdpa_causal" if name == "sdpa-causal" else name
    if impl == "sdpa_causal":
        register_sdpa_causal()
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
) -> tuple[Any, Any]:
    """(wrapper module, the inner transformers model) on `device`, in eval mode."""
    import torch

    fam = load_family(family)
    impl = "sdpa_causal" if attention == "sdpa-causal" else attention
    if impl == "sdpa_causal":
        register_sdpa_causal()
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
