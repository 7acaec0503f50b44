"""One benchmark run in a fresh process: `python -m mopt_ml.benchworker SPEC.json OUT.json`.

A process per backend keeps thread settings and peak memory (ru_maxrss) of one backend from
leaking into the other's numbers.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import resource
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _status_mb(field: str) -> float | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def rss_mb() -> float:
    """Resident set size of this process now (MB)."""
    v = _status_mb("VmRSS")
    return float("nan") if v is None else v


def peak_rss_mb() -> float:
    """Peak resident set size of this process (MB). VmHWM, not ru_maxrss: Linux carries
    ru_maxrss over exec, so a child would report its parent's peak."""
    v = _status_mb("VmHWM")
    return v if v is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100]."""
    xs = sorted(values)
    if len(xs) == 1:
        return xs[0]
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def measure(fn: Callable[[], Any], timing: dict[str, Any]) -> dict[str, Any]:
    """Warm up, then time windows of calls until two consecutive window medians agree
    within `rel_tol` (or the window / time budget runs out). Percentiles come from the
    last two windows."""
    for _ in range(timing["warmup"]):
        fn()
    start = time.perf_counter()
    windows: list[list[float]] = []
    stable = False
    while True:
        times: list[float] = []
        w0 = time.perf_counter()
        while len(times) < timing["min_iters"] or time.perf_counter() - w0 < timing["min_window_s"]:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
            if len(times) >= 1000:
                break
        windows.append(times)
        if len(windows) >= 2:
            a, b = statistics.median(windows[-2]), statistics.median(windows[-1])
            if abs(b - a) / max(a, 1e-12) <= timing["rel_tol"]:
                stable = True
                break
        if len(windows) >= timing["max_windows"] or time.perf_counter() - start > timing["max_seconds"]:
            break
    last = [t for w in windows[-2:] for t in w]
    return {
        "p50_ms": percentile(last, 50) * 1000,
        "p90_ms": percentile(last, 90) * 1000,
        "p99_ms": percentile(last, 99) * 1000,
        "mean_ms": statistics.fmean(last) * 1000,
        "samples": len(last),
        "windows": len(windows),
        "window_medians_ms": [statistics.median(w) * 1000 for w in windows],
        "stable": stable,
    }


def make_inputs(tokenizer: Any, texts: list[str], batch: int, seq: int) -> dict[str, Any]:
    """`batch` rows of `seq` real tokens (sentences run together, each row from a different
    starting sentence), so no row is padding."""
    import numpy as np

    rows = []
    for i in range(batch):
        k = i % len(texts)
        rows.append(" ".join(texts[k:] + texts[:k]))
    enc = tokenizer(rows, truncation=True, max_length=seq, padding="max_length", return_tensors="np")
    return {
        "input_ids": enc["input_ids"].astype(np.int64),
        "attention_mask": enc["attention_mask"].astype(np.int64),
    }


def load_family(ref: str) -> Any:
    module, _, qual = ref.partition(":")
    obj: Any = importlib.import_module(module)
    for part in qual.split("."):
        obj = getattr(obj, part)
    return obj()


def run(spec: dict[str, Any]) -> dict[str, Any]:
    threads = int(spec["threads"])
    rss_start = rss_mb()
    t0 = time.perf_counter()
    if spec["backend"] == "onnx":
        from transformers import AutoTokenizer

        from mopt_ml.common import OUTPUT_NAME, ort_session

        tokenizer = AutoTokenizer.from_pretrained(spec["tokenizer"])
        sess = ort_session(Path(spec["model"]), threads=threads)
        names = {i.name for i in sess.get_inputs()}

        def runner(feeds: dict[str, Any]) -> Callable[[], Any]:
            f = {k: v for k, v in feeds.items() if k in names}
            return lambda: sess.run([OUTPUT_NAME], f)

    elif spec["backend"] in ("torch-compile", "torch-cuda-eager"):
        import torch

        family = load_family(spec["family"])
        tokenizer = family.load_tokenizer(spec["weights"])
        if spec["backend"] == "torch-compile":
            from mopt_ml.compiled import load

            model, _meta = load(Path(spec["weights"]), Path(spec["model"]))
        else:
            from mopt_torch.embedder import load_embedder
            from mopt_torch.warm import read_meta as read_compile_meta

            cm = read_compile_meta(spec["model"])
            model, _inner = load_embedder(
                spec["weights"], cm["precision"], "cuda", cm.get("family"), cm["pooling"], "sdpa"
            )

        def runner(feeds: dict[str, Any]) -> Callable[[], Any]:
            ids = torch.from_numpy(feeds["input_ids"]).cuda()
            mask = torch.from_numpy(feeds["attention_mask"]).cuda()

            def call() -> Any:
                with torch.inference_mode():
                    y = model(ids, mask)
                torch.cuda.synchronize()
                return y

            return call

    else:
        import torch

        torch.set_num_threads(threads)
        with contextlib.suppress(RuntimeError):
            torch.set_num_interop_threads(1)
        family = load_family(spec["family"])
        tokenizer = family.load_tokenizer(spec["tokenizer"])
        model = family.load(spec["model"], dtype="fp32", attn_implementation=spec.get("attn"))

        def runner(feeds: dict[str, Any]) -> Callable[[], Any]:
            ids = torch.from_numpy(feeds["input_ids"])
            mask = torch.from_numpy(feeds["attention_mask"])

            def call() -> Any:
                with torch.inference_mode():
                    return family.embed_batch(model, ids, mask)

            return call

    load_s = time.perf_counter() - t0
    rss_loaded = rss_mb()
    points = []
    grid = spec.get("shapes") or [[b, s] for s in spec["seq_lens"] for b in spec["batch_sizes"]]
    for batch, seq in grid:
        feeds = make_inputs(tokenizer, spec["texts"], batch, seq)
        stats = measure(runner(feeds), spec["timing"])
        stats.update(
            {
                "batch": batch,
                "seq": seq,
                "sequences_per_s": batch / (stats["p50_ms"] / 1000),
                "tokens_per_s": batch * seq / (stats["p50_ms"] / 1000),
            }
        )
        points.append(stats)
        print(
            f"{spec['backend']} b={batch} s={seq}: p50 {stats['p50_ms']:.1f} ms "
            f"({stats['windows']} windows{'' if stats['stable'] else ', not stable'})",
            file=sys.stderr,
            flush=True,
        )
    gpu_peak = None
    if spec["backend"] in ("torch-compile", "torch-cuda-eager"):  # on the GPU
        import torch

        gpu_peak = torch.cuda.max_memory_allocated() / 2**20
    return {
        "backend": spec["backend"],
        "label": spec.get("label", spec["backend"]),
        "threads": threads,
        "peak_gpu_mb": gpu_peak,  # tensors allocated by torch on the GPU (None on CPU)
        "load_seconds": load_s,
        "rss_start_mb": rss_start,
        "rss_loaded_mb": rss_loaded,
        "peak_rss_mb": peak_rss_mb(),
        "points": points,
    }


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    result = run(spec)
    Path(argv[1]).write_text(json.dumps(result, indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
