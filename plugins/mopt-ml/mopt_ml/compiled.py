"""Running a `torch-compile` artifact (plugin mopt-torch) in `validate` and `bench`.

The artifact is a compile cache: the module is rebuilt from the `weights` folder and compiled
warm from it (`mopt_torch.warm.compiled_embedder`), on a CUDA GPU, for the artifact's fixed
(batch, seq) buckets only — other shapes would compile new graphs. Batches are padded on the
right to a bucket (exact for causal decoders with the artifact's `sdpa-causal` attention);
short batches are filled with copies of their first row, whose outputs are dropped.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: kinds whose folders hold a torch.compile cache artifact
TORCH_KINDS = ("torch-compile",)


def _require_cuda() -> Any:
    try:
        import torch
        from mopt_torch.warm import compiled_embedder
    except ImportError as exc:
        raise RuntimeError(
            f"a torch-compile artifact needs torch and the mopt-torch plugin ({exc}); "
            "pip install -e plugins/mopt-torch"
        ) from None
    if not torch.cuda.is_available():
        raise RuntimeError(
            "a torch-compile artifact runs on the CUDA GPU it was compiled for, and this machine has "
            "none: build this target on that GPU (mopt doctor shows what this machine has)"
        )
    return compiled_embedder


def load(weights_dir: Path, art_dir: Path) -> tuple[Any, dict[str, Any]]:
    """(compiled module on CUDA, the artifact's meta.json)."""
    compiled_embedder = _require_cuda()
    return compiled_embedder(weights_dir, art_dir)  # type: ignore[no-any-return]


def pick_bucket(meta: dict[str, Any], seq_needed: int) -> tuple[int, int]:
    """The largest-batch bucket whose length holds `seq_needed` (else the longest)."""
    buckets = [(int(b["batch"]), int(b["seq"])) for b in meta["buckets"]]
    fits = [b for b in buckets if b[1] >= seq_needed]
    if fits:
        return max(fits, key=lambda b: (b[0], -b[1]))
    return max(buckets, key=lambda b: b[1])


def embed(weights_dir: Path, art_dir: Path, family: Any, texts: list[str], max_length: int) -> Any:
    """L2-normalised float32 embeddings of `texts` through the compiled artifact."""
    import numpy as np
    import torch

    model, meta = load(weights_dir, art_dir)
    tok = family.load_tokenizer(weights_dir)
    batch, seq = pick_bucket(meta, max_length)
    limit = min(max_length, seq)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    out = []
    with torch.inference_mode():
        for i in range(0, len(texts), batch):
            chunk = texts[i : i + batch]
            enc = tok(list(chunk), truncation=True, max_length=limit, padding=False)["input_ids"]
            rows = list(enc) + [enc[0]] * (batch - len(enc))
            ids = torch.full((batch, seq), pad, dtype=torch.long)
            mask = torch.zeros((batch, seq), dtype=torch.long)
            for r, row in enumerate(rows):
                ids[r, : len(row)] = torch.tensor(row, dtype=torch.long)
                mask[r, : len(row)] = 1
            y = model(ids.cuda(), mask.cuda()).float().cpu().numpy()
            out.append(y[: len(chunk)])
    emb = np.concatenate(out).astype(np.float32)
    return emb / np.linalg.norm(emb, axis=1, keepdims=True)
