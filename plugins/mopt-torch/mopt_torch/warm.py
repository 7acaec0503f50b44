"""Start warm from a `torch-compile` artifact (for `validate`, `bench`, serving code).

    from mopt_torch.warm import compiled_embedder, bucket_for
    model, meta = compiled_embedder(weights_dir, artifact_dir)      # loads cache.bin first
    b, s = bucket_for(batch, seq, meta)                               # pad (right) to a bucket
    emb = model(input_ids, attention_mask)                            # yours to keep, also with CUDA graphs

`load_warm` refuses an artifact made by another torch version or for another GPU
architecture (a cache from sm_90 is never used on sm_89): it would not be hit anyway, and
silently recompiling would hide the cold start the artifact exists to remove.
Imports nothing from mopt.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class WarmStartMismatch(RuntimeError):
    """The artifact was made for another torch / GPU than this process has."""


def read_meta(path: Path | str) -> dict[str, Any]:
    return json.loads((Path(path) / "meta.json").read_text())  # type: ignore[no-any-return]


def mismatch(meta: dict[str, Any], here: dict[str, Any]) -> list[str]:
    """What differs between the artifact's build and this process (empty: compatible)."""
    return [
        f"{k}: artifact {meta.get(k)!r}, here {here.get(k)!r}"
        for k in ("torch", "triton", "cuda", "compute_capability")
        if meta.get(k) != here.get(k)
    ]


def here_versions() -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda, "compute_capability": None}
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        out["triton"] = None
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(0)
        out["compute_capability"] = f"{major}.{minor}"
    return out


def load_warm(path: Path | str, strict: bool = True) -> dict[str, Any]:
    """Load the artifact's compile caches into this process (before the first torch.compile
    call); returns its meta. With `strict`, a torch/Triton/CUDA/GPU mismatch raises."""
    import torch

    meta = read_meta(path)
    diff = mismatch(meta, here_versions())
    if diff:
        if strict:
            raise WarmStartMismatch("torch-compile artifact does not fit this process: " + "; ".join(diff))
        meta["loaded"] = False
        return meta
    info = torch.compiler.load_cache_artifacts((Path(path) / "cache.bin").read_bytes())
    meta["loaded"] = info is not None
    return meta


def compile_like(module: Any, meta: dict[str, Any]) -> Any:
    """`torch.compile` with the options the artifact was built with (or its caches miss)."""
    import torch

    mode = None if meta["mode"] == "default" else meta["mode"]
    return torch.compile(module, mode=mode, dynamic=meta["dynamic"], fullgraph=meta["fullgraph"])


#: modes whose compiled module replays CUDA graphs
CUDAGRAPH_MODES = ("reduce-overhead", "max-autotune")


class KeptOutputs:
    """Calls a CUDA-graph compiled module so that its outputs may be kept.

    A CUDA graph writes its outputs into a static memory pool that the next replay
    overwrites; torch raises when a kept output of an earlier replay is read. Each call here
    marks a new step and returns a clone (batch × hidden floats: negligible next to the
    forward pass). Other attributes come from the compiled module."""

    def __init__(self, compiled: Any) -> None:
        self.compiled = compiled

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        import torch

        torch.compiler.cudagraph_mark_step_begin()
        return self.compiled(*args, **kwargs).clone()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.compiled, name)


def compiled_embedder(
    weights: Path | str, path: Path | str, device: str = "cuda"
) -> tuple[Any, dict[str, Any]]:
    """The embedding module of `weights`, compiled warm from the artifact at `path`.
    For CUDA-graph modes it is wrapped in `KeptOutputs`: every output is the caller's own."""
    from mopt_torch.embedder import load_embedder

    meta = load_warm(path)
    wrapper, _ = load_embedder(
        weights,
        meta["precision"],
        device,
        meta.get("family"),
        meta["pooling"],
        meta["attention"],
        meta.get("sdpa_backend", "auto"),
        meta.get("rope_table", False),
    )
    compiled = compile_like(wrapper, meta)
    if meta["mode"] in CUDAGRAPH_MODES:
        compiled = KeptOutputs(compiled)
    return compiled, meta


def bucket_for(batch: int, seq: int, meta: dict[str, Any]) -> tuple[int, int]:
    """The smallest compiled (batch, seq) bucket that holds a batch of this size; pad to it
    (right padding) so no new graph is compiled."""
    fits = [(b["batch"], b["seq"]) for b in meta["buckets"] if b["batch"] >= batch and b["seq"] >= seq]
    if not fits:
        raise ValueError(
            f"no bucket holds {batch} x {seq}; buckets: {[(b['batch'], b['seq']) for b in meta['buckets']]}"
        )
    return min(fits, key=lambda bs: bs[0] * bs[1])
