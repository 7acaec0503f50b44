"""Worker of the `torch-compile` target, run in a fresh process:

    python -m mopt_torch.compile_worker spec.json

Loads the weights, computes eager outputs (standard masked sdpa) on a right-padded batch per
shape bucket, switches to the artifact's attention, `torch.compile`s with `dynamic=False`
(one graph per bucket), runs each bucket (compile seconds, ms per batch, min cosine vs eager),
then writes `torch.compiler.save_cache_artifacts()` bytes to `cache.bin` and `meta.json`.
The parent sets TORCHINDUCTOR_CACHE_DIR / TRITON_CACHE_DIR to empty folders, so the artifact
holds every entry this compile needs. Imports nothing from mopt.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

T0 = time.perf_counter()

#: torch.compile modes that replay CUDA graphs (outputs live in a static pool: clone to keep them)
CUDAGRAPH_MODES = ("reduce-overhead", "max-autotune")


def versions() -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda}
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        out["triton"] = None
    import transformers

    out["transformers"] = transformers.__version__
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        out["gpu"] = p.name
        out["compute_capability"] = f"{p.major}.{p.minor}"
    else:
        out["gpu"] = None
        out["compute_capability"] = None
    return out


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_ms(fn: Any, args: tuple[Any, ...], device: str, warmup: int, iters: int) -> float:
    import torch

    for _ in range(warmup):
        fn(*args)
    sync(device)
    times = []
    for _ in range(iters):
        if device.startswith("cuda"):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn(*args)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t = time.perf_counter()
            fn(*args)
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def main(spec_path: str) -> int:
    import torch

    from mopt_torch.embedder import (
        cache_rotary,
        load_embedder,
        right_padded_batch,
        sdpa_gqa_native,
        set_attention,
    )

    spec = json.loads(Path(spec_path).read_text())
    out = Path(spec["out"])
    dev = spec["device"]
    wrapper, model = load_embedder(
        spec["weights"], spec["precision"], dev, spec["family"], spec["pooling"], "sdpa"
    )
    vocab = int(getattr(model.config, "vocab_size", 1000))
    batches = {}
    eager = {}
    with torch.no_grad():
        for k, (b, s) in enumerate(spec["buckets"]):
            batches[(b, s)] = right_padded_batch(b, s, vocab, spec["seed"] + k, dev)
            eager[(b, s)] = wrapper(*batches[(b, s)]).float().cpu()
    backend = spec.get("sdpa_backend", "auto")
    set_attention(model, spec["attention"], backend)
    rope_tables = cache_rotary(model) if spec.get("rope_table") else 0
    limit = max(8, len(spec["buckets"]) + 2)
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, limit)
    compiled = torch.compile(
        wrapper,
        mode=None if spec["mode"] == "default" else spec["mode"],
        dynamic=False,
        fullgraph=spec["fullgraph"],
    )
    rows = []
    t_compile = time.perf_counter()
    with torch.no_grad():
        for (b, s), args in batches.items():
            t = time.perf_counter()
            got = compiled(*args)
            sync(dev)
            first = time.perf_counter() - t
            cos = torch.nn.functional.cosine_similarity(got.float().cpu(), eager[(b, s)], dim=-1)
            ms = time_ms(compiled, args, dev, spec["warmup"], spec["iters"])
            # again after the timed calls: with CUDA graphs this one is a graph replay, not the
            # first (warm-up) run that the check above saw
            again = compiled(*args).float().cpu()
            cos = torch.minimum(cos, torch.nn.functional.cosine_similarity(again, eager[(b, s)], dim=-1))
            rows.append(
                {
                    "batch": b,
                    "seq": s,
                    "compile_s": round(first, 2),
                    "ms": round(ms, 3),
                    "min_cosine_vs_eager": float(cos.min()),
                }
            )
            print(
                f"bucket {b}x{s}: first call {first:.1f} s, {ms:.2f} ms/batch, min cos vs eager {float(cos.min()):.6f}",
                flush=True,
            )
    compile_total = time.perf_counter() - t_compile
    saved = torch.compiler.save_cache_artifacts()
    if saved is None:
        print(
            "torch.compiler.save_cache_artifacts() returned nothing: no compile cache to store",
            file=sys.stderr,
        )
        return 3
    blob, info = saved
    (out / "cache.bin").write_bytes(blob)
    meta = {
        "format": "mopt-torch-compile/1",
        **versions(),
        "mode": spec["mode"],
        "dynamic": False,
        "fullgraph": spec["fullgraph"],
        "precision": spec["precision"],
        "attention": spec["attention"],
        "sdpa_backend": backend,
        "sdpa_gqa_native": sdpa_gqa_native(backend) if backend != "auto" else None,
        "cudagraphs": spec["mode"] in CUDAGRAPH_MODES,
        "rope_table": bool(rope_tables),
        "padding_side": "right",
        "pooling": spec["pooling"],
        "family": spec["family"],
        "buckets": rows,
        "compile_seconds": round(compile_total, 2),
        "process_seconds": round(time.perf_counter() - T0, 2),
        "cache_bytes": len(blob),
        "cache_entries": {k: len(v) for k, v in getattr(info, "artifacts", {}).items()},
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    bad = [r for r in rows if not r["min_cosine_vs_eager"] >= spec["min_cosine"]]
    if bad:
        print(f"compiled output differs from eager: {bad} (min_cosine {spec['min_cosine']})", file=sys.stderr)
        return 4
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
