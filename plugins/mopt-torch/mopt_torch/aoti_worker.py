"""Worker of the `aoti` target, run in fresh processes:

    python -m mopt_torch.aoti_worker build spec.json    # torch.export + AOTInductor package
    python -m mopt_torch.aoti_worker probe model.pt2 probe.pt [device]   # load + run once

`build` exports the embedding module with a dynamic batch and a dynamic sequence length that
is a multiple of `seq_multiple` (seq = m × k): export may otherwise add divisibility guards on
the sequence axis (from reshapes) or specialise it, and consumers pad sequences (right) to a
multiple of m anyway. If export refuses those ranges it retries with `Dim.AUTO` for both axes
and records the ranges it inferred. `probe` is the load check; it runs in its own process
because loading a package can crash the process (see aoti.KNOWN_ISSUES). Imports nothing from mopt.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any


def seq_blocks_min(spec: dict[str, Any]) -> int:
    """At least 2 blocks: export specialises sizes 0 and 1, so a range starting at 1 comes
    back raised to 2 anyway; saying so up front keeps the recorded range honest."""
    return max(2, -(-spec["min_seq_len"] // spec["seq_multiple"]))


def export(wrapper: Any, ids: Any, mask: Any, spec: dict[str, Any]) -> tuple[Any, str]:
    import torch
    from torch.export import Dim

    m = spec["seq_multiple"]
    batch = Dim("batch", min=spec["min_batch_size"], max=spec["max_batch_size"])
    k = Dim("seq_blocks", min=seq_blocks_min(spec), max=spec["max_seq_len"] // m)
    seq = m * k if m > 1 else k
    shapes = {"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: seq}}
    try:
        return torch.export.export(
            wrapper, (ids, mask), dynamic_shapes=shapes, strict=False
        ), f"seq = {m} * k"
    except Exception as exc:  # constraint violations: let export infer the ranges instead
        print(
            f"export with explicit ranges failed ({type(exc).__name__}: {str(exc)[:300]}); retrying with Dim.AUTO"
        )
        auto = {"input_ids": {0: Dim.AUTO, 1: Dim.AUTO}, "attention_mask": {0: Dim.AUTO, 1: Dim.AUTO}}
        return torch.export.export(wrapper, (ids, mask), dynamic_shapes=auto, strict=False), "Dim.AUTO"


def build(spec_path: str) -> int:
    import torch

    from mopt_torch.embedder import load_embedder, right_padded_batch

    spec = json.loads(Path(spec_path).read_text())
    out, dev = Path(spec["out"]), spec["device"]
    wrapper, model = load_embedder(
        spec["weights"], spec["precision"], dev, spec["family"], spec["pooling"], spec["attention"]
    )
    vocab = int(getattr(model.config, "vocab_size", 1000))
    m = spec["seq_multiple"]
    ex_batch = min(max(2, spec["min_batch_size"]), spec["max_batch_size"])
    ex_seq = min(max(2 * m, seq_blocks_min(spec) * m), spec["max_seq_len"] // m * m)
    ids, mask = right_padded_batch(ex_batch, ex_seq, vocab, spec["seed"], dev)
    t = time.perf_counter()
    with torch.no_grad():
        ep, how = export(wrapper, ids, mask, spec)
    export_s = time.perf_counter() - t
    ranges = {str(k): str(v) for k, v in ep.range_constraints.items()}
    print(f"exported in {export_s:.1f} s ({how}); ranges {ranges}", flush=True)
    t = time.perf_counter()
    pkg = torch._inductor.aoti_compile_and_package(ep, package_path=str(out / "model.pt2"))
    compile_s = time.perf_counter() - t
    print(f"AOTInductor package {pkg} in {compile_s:.1f} s", flush=True)
    # inputs and the eager output for the load probe: a shape other than the example's
    pb, ps = min(spec["max_batch_size"], ex_batch + 1), min(spec["max_seq_len"] // m * m, ex_seq + m)
    pids, pmask = right_padded_batch(pb, ps, vocab, spec["seed"] + 1, dev)
    with torch.no_grad():
        ref = wrapper(pids, pmask).float().cpu()
    torch.save({"ids": pids.cpu(), "mask": pmask.cpu(), "ref": ref}, spec["probe"])
    meta = {
        "format": "mopt-aoti/1",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": dev,
        "precision": spec["precision"],
        "attention": spec["attention"],
        "padding_side": "right",
        "pooling": spec["pooling"],
        "family": spec["family"],
        "seq_multiple": m,
        "dynamic": how,
        "ranges": ranges,
        "batch": [spec["min_batch_size"], spec["max_batch_size"]],
        "seq": [seq_blocks_min(spec) * m, spec["max_seq_len"] // m * m],
        "export_seconds": round(export_s, 2),
        "compile_seconds": round(compile_s, 2),
    }
    if dev.startswith("cuda"):
        p = torch.cuda.get_device_properties(0)
        meta.update(gpu=p.name, compute_capability=f"{p.major}.{p.minor}")
    (out / "meta.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    return 0


def probe(package: str, probe_file: str, device: str = "cuda") -> int:
    import torch

    data = torch.load(probe_file, weights_only=True)
    runner = torch._inductor.aoti_load_package(package)
    t = time.perf_counter()
    with torch.no_grad():
        got = runner(data["ids"].to(device), data["mask"].to(device))
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    ms = (time.perf_counter() - t) * 1e3
    cos = torch.nn.functional.cosine_similarity(got.float().cpu(), data["ref"], dim=-1)
    print(
        json.dumps(
            {
                "ok": True,
                "shape": list(got.shape),
                "first_call_ms": round(ms, 2),
                "min_cosine": float(cos.min()),
            }
        )
    )
    return 0


if __name__ == "__main__":
    if sys.argv[1] == "build":
        sys.exit(build(sys.argv[2]))
    sys.exit(probe(*sys.argv[2:]))
