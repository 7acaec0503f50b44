"""`bench` for task = "text-generation": time to first token (TTFT), inter-token latency
(ITL) and output tokens/s of a generator (`mopt_ml.genruntime`) and of the PyTorch baseline,
per step of batch size or concurrency, each backend in its own process
(`python -m mopt_ml.genbench SPEC.json OUT.json`).

What is timed, per step (one "sample" is one request, or one batch of requests):

batch mode (`batch_sizes`, static batching)
    batch 1: `generate(prompt, output_len, on_token=...)`; TTFT = first token's time - call
    start, ITL = the gaps between consecutive tokens, e2e = the call.
    batch b > 1: `generate_batch` has no per-token callback, so a sample is two calls:
    TTFT = the time of `generate_batch(prompts, 1)` (prefill + first token), e2e = the time
    of `generate_batch(prompts, output_len)`, and ITL = (e2e - TTFT) / (output_len - 1).
concurrency mode (`concurrency`)
    c threads each send `generate(..., on_token=...)` requests back to back; TTFT / ITL per
    request as for batch 1. The generator is shared by the threads: genruntime's backends
    keep no state between calls (a KV cache / IO binding per call), and torch and ONNX
    Runtime release the GIL while they compute.

Each step warms up (`warmup` samples), then samples until the `confidence` interval of the
median e2e lies within `ci_rel` of it (after `min_samples`; at most `max_samples` or
`max_seconds`): the embedding bench's adaptive stopping. output_tok_s = new tokens of every
sequence / wall seconds (batch mode: the summed e2e of the samples).

bench.json (`mopt-genbench/1`; a serving load test may write the same shape, and `select`
reads it):

    {"format": "mopt-genbench/1", "task": "text-generation", "artifact": ..., "mode": "batch" | "concurrency",
     "settings": {"prompt_len", "output_len", "steps", timing...}, "machine": {...},
     "results": [  # [0]: the artifact; [1:]: baselines
       {"backend", "label", "device", "threads", "load_seconds", "peak_rss_mb", "peak_gpu_mb",
        "steps": [{"batch": b | "concurrency": c, "prompt_len", "output_len", "requests", "samples", "stable",
                   "ttft_ms": {"p50", "p90", "p99", "mean"}, "itl_ms": {...}, "e2e_ms": {...},
                   "output_tok_s"}]}],
     "speedup_vs_baseline": [{"step", "output_tok_s_ratio", "ttft_p50_ratio"}]}
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from mopt_ml.benchworker import POINT

#: how the worker opens a generator ("module:function"); tests point it at a fake
GENERATOR_OPEN = "mopt_ml.genruntime:open_generator"
FORMAT = "mopt-genbench/1"
#: a text-generation section's `bench-baseline` (its results[0]: the PyTorch baseline)
BASELINE_FORMAT = "mopt-genbench-baseline/1"


# --------------------------------------------------------------------------- statistics


def dist(values_s: Sequence[float]) -> dict[str, float | None]:
    """p50 / p90 / p99 / mean of `values_s` (seconds), in milliseconds; None when empty."""
    from mopt_ml.benchworker import percentile

    if not values_s:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    xs = [v * 1000.0 for v in values_s]
    return {
        "p50": percentile(xs, 50),
        "p90": percentile(xs, 90),
        "p99": percentile(xs, 99),
        "mean": statistics.fmean(xs),
    }


def _stable(e2e: list[float], timing: dict[str, Any]) -> bool:
    from mopt_ml.benchworker import median_ci, stable_ci

    if len(e2e) < timing["min_samples"]:
        return False
    ci = median_ci(e2e, timing.get("confidence", 0.95))
    return ci is not None and stable_ci(statistics.median(e2e), ci, timing["ci_rel"])


def _done(n: int, started: float, e2e: list[float], timing: dict[str, Any]) -> tuple[bool, bool]:
    """(stop, stable) after `n` samples."""
    if _stable(e2e, timing):
        return True, True
    return n >= timing["max_samples"] or time.perf_counter() - started > timing["max_seconds"], False


class _Request:
    """One streamed request: its start, each token's time, its end."""

    __slots__ = ("end", "start", "times")

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.times: list[float] = []
        self.end = self.start

    def on_token(self, _token: int, ts: float) -> None:
        self.times.append(ts)


def _stream(gen: Any, prompt: Sequence[int], n: int) -> _Request:
    r = _Request()
    gen.generate(list(prompt), n, on_token=r.on_token)
    r.end = time.perf_counter()
    return r


def _step_numbers(
    ttft: list[float],
    itl: list[float],
    e2e: list[float],
    tokens: int,
    wall: float,
    samples: int,
    stable: bool,
) -> dict[str, Any]:
    return {
        "samples": samples,
        "stable": stable,
        "ttft_ms": dist(ttft),
        "itl_ms": dist(itl),
        "e2e_ms": dist(e2e),
        "output_tokens": tokens,
        "output_tok_s": tokens / wall if wall > 0 else None,
    }


def bench_batch(gen: Any, prompts: Sequence[Sequence[int]], n: int, timing: dict[str, Any]) -> dict[str, Any]:
    """One batch-mode step: `prompts` (the batch) with `n` new tokens each (module doc)."""
    batch = [list(p) for p in prompts]

    def sample() -> tuple[float, list[float], float, int]:
        if len(batch) == 1:
            r = _stream(gen, batch[0], n)
            if not r.times:
                return r.end - r.start, [], r.end - r.start, 0
            gaps = [b - a for a, b in zip(r.times, r.times[1:], strict=False)]
            return r.times[0] - r.start, gaps, r.end - r.start, len(r.times)
        t = time.perf_counter()
        gen.generate_batch(batch, 1)
        first = time.perf_counter() - t
        t = time.perf_counter()
        out = gen.generate_batch(batch, n)
        total = time.perf_counter() - t
        itl = [(total - first) / (n - 1)] if n > 1 else []
        return first, itl, total, sum(len(o) for o in out)

    for _ in range(timing["warmup"]):
        sample()
    ttft: list[float] = []
    itl: list[float] = []
    e2e: list[float] = []
    tokens = 0
    started = time.perf_counter()
    stable = False
    while True:
        a, gaps, total, k = sample()
        ttft.append(a)
        itl += gaps
        e2e.append(total)
        tokens += k
        stop, stable = _done(len(e2e), started, e2e, timing)
        if stop:
            break
    out = _step_numbers(ttft, itl, e2e, tokens, sum(e2e), len(e2e), stable)
    return {"batch": len(batch), "requests": len(e2e) * len(batch), **out}


def bench_concurrency(
    gen: Any, prompts: Sequence[Sequence[int]], concurrency: int, n: int, timing: dict[str, Any]
) -> dict[str, Any]:
    """One concurrency step: `concurrency` threads sending streamed requests back to back."""
    for i in range(timing["warmup"]):
        _stream(gen, prompts[i % len(prompts)], n)
    lock = threading.Lock()
    done: list[_Request] = []
    stop = threading.Event()
    state = {"stable": False}
    errors: list[BaseException] = []
    started = time.perf_counter()

    def client(i: int) -> None:
        k = i
        try:
            while not stop.is_set():
                r = _stream(gen, prompts[k % len(prompts)], n)
                k += concurrency
                with lock:
                    done.append(r)
                    fin, state["stable"] = _done(len(done), started, [x.end - x.start for x in done], timing)
                    if fin:
                        stop.set()
        except BaseException as exc:  # re-raised in the caller
            errors.append(exc)
            stop.set()

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = max(r.end for r in done) - started if done else 0.0
    if errors:
        raise errors[0]
    ttft = [r.times[0] - r.start for r in done if r.times]
    itl = [b - a for r in done for a, b in zip(r.times, r.times[1:], strict=False)]
    e2e = [r.end - r.start for r in done]
    tokens = sum(len(r.times) for r in done)
    out = _step_numbers(ttft, itl, e2e, tokens, wall, len(done), state["stable"])
    return {"concurrency": concurrency, "requests": len(done), **out}


# --------------------------------------------------------------------------- prompts


def make_prompts(tokenizer: Any, texts: list[str], count: int, prompt_len: int) -> list[list[int]]:
    """`count` prompts of exactly `prompt_len` real tokens: the texts run together, each
    prompt from a different starting text (no padding; repeated when the texts are short)."""
    # text by text (a tokenizer warns about one text longer than its model_max_length)
    ids = [int(t) for text in texts for t in tokenizer(" " + text, add_special_tokens=False)["input_ids"]]
    if not ids:
        raise ValueError("bench: the texts give no tokens")
    out = []
    for i in range(count):
        start = (i * max(1, len(ids) // max(count, 1))) % len(ids)
        row = (ids[start:] + ids[:start]) * (prompt_len // len(ids) + 1)
        out.append(row[:prompt_len])
    return out


# --------------------------------------------------------------------------- the worker


def _opener(ref: str) -> Callable[..., Any]:
    module, _, name = ref.partition(":")
    fn: Callable[..., Any] = getattr(importlib.import_module(module), name)
    return fn


def run(spec: dict[str, Any]) -> dict[str, Any]:
    """Time one backend over every step (in this process)."""
    from mopt_ml.benchworker import peak_rss_mb, rss_mb

    rss_start = rss_mb()
    t0 = time.perf_counter()
    gen = _opener(spec.get("open") or GENERATOR_OPEN)(
        spec["model"],
        format=spec["format"],
        device=spec["device"],
        dtype=spec.get("dtype"),
        threads=spec.get("threads"),
    )
    load_s = time.perf_counter() - t0
    rss_loaded = rss_mb()
    prompts = spec["prompts"]
    n = int(spec["output_len"])
    steps = []
    try:
        for step in spec["steps"]:
            if spec["mode"] == "concurrency":
                st = bench_concurrency(gen, prompts, int(step), n, spec["timing"])
            else:
                st = bench_batch(gen, prompts[: int(step)], n, spec["timing"])
            st.update({"prompt_len": len(prompts[0]), "output_len": n})
            steps.append(st)
            print(
                f"{POINT}{spec['label']} {spec['mode']} {step}: TTFT p50 {st['ttft_ms']['p50']:.1f} ms, "
                f"ITL p50 {(st['itl_ms']['p50'] or 0):.2f} ms, {st['output_tok_s']:.1f} tok/s "
                f"({st['samples']} samples{'' if st['stable'] else ', not stable'})",
                file=sys.stderr,
                flush=True,
            )
    finally:
        backend = getattr(gen, "backend", spec["format"])
        gen.close()
    gpu_peak = None
    if spec["device"].startswith("cuda") and "torch" in sys.modules:
        import torch

        with contextlib.suppress(Exception):
            gpu_peak = torch.cuda.max_memory_allocated() / 2**20
    return {
        "backend": backend,
        "label": spec["label"],
        "device": spec["device"],
        "dtype": spec.get("dtype"),
        "threads": spec.get("threads"),
        "load_seconds": load_s,
        "rss_start_mb": rss_start,
        "rss_loaded_mb": rss_loaded,
        "peak_rss_mb": peak_rss_mb(),
        "peak_gpu_mb": gpu_peak,
        "steps": steps,
    }


def run_worker(spec: dict[str, Any], tmp: Path, log: Any) -> dict[str, Any]:
    """`run(spec)` in a fresh process (`timing._run_worker`), a line per finished step live."""
    from mopt_ml.timing import _run_worker

    return _run_worker(spec, tmp, log, module="mopt_ml.genbench", files="gen")


# --------------------------------------------------------------------------- the kind's action


def step_of(st: dict[str, Any]) -> int:
    """A step's batch size or concurrency."""
    return int(st.get("batch", st.get("concurrency", 0)))


def _common(
    ref_dir: Path, tmp: Path, params: Any, project_dir: Path, device: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The worker spec's fields every backend shares (prompts, steps, stopping rule, threads,
    and on CPU the drift probe's model), and the bench.json settings."""
    from mopt_ml.benchworker import write_probe
    from mopt_ml.common import cpu_threads, load_tokenizer, texts_from_param

    threads = cpu_threads(params.threads) if device == "cpu" else params.threads
    mode = "concurrency" if params.concurrency else "batch"
    steps = list(params.concurrency or params.batch_sizes)
    texts = texts_from_param(params.data, project_dir, "validation")
    prompts = make_prompts(load_tokenizer(ref_dir), texts, max(max(steps), 8), params.prompt_len)
    timing = {
        k: getattr(params, k)
        for k in ("warmup", "min_samples", "max_samples", "ci_rel", "confidence", "max_seconds")
    }
    common = {
        "prompts": prompts,
        "output_len": params.output_len,
        "steps": steps,
        "mode": mode,
        "timing": timing,
        "threads": threads,
        "device": device,
        "open": GENERATOR_OPEN,
    }
    if device == "cpu":  # the drift probe is a CPU workload: it says nothing of a GPU's speed
        write_probe(tmp / "probe.onnx")
        common["probe_model"] = str(tmp / "probe.onnx")
    settings = {"prompt_len": params.prompt_len, "output_len": params.output_len, "steps": steps, **timing}
    return common, settings


def _baseline_spec(common: dict[str, Any], ref_dir: Path) -> dict[str, Any]:
    dtype = "fp32" if common["device"] == "cpu" else "bf16"
    return {
        **common,
        "model": str(ref_dir),
        "format": "hf-checkpoint",
        "dtype": dtype,
        "label": f"pytorch-{dtype}-eager",
    }


def _machine(threads: Any) -> dict[str, Any]:
    import platform

    from mopt_ml.timing import cpu_model

    return {"cpu": cpu_model(), "cpus": os.cpu_count(), "threads": threads, "platform": platform.platform()}


def _time(spec: dict[str, Any], tmp: Path, log: Any) -> dict[str, Any]:
    """One backend's worker, between drift probes when the spec has the probe's model."""
    from mopt_ml.timing import _probed

    return _probed(spec, tmp, log, run=run_worker)


def bench_generation(
    model_dir: Path,
    ref_dir: Path,
    out: Path,
    tmp: Path,
    params: Any,
    project_dir: Path,
    log: Any,
    label: str = "",
    device: str = "cpu",
    shared: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Time the artifact in `model_dir` and (with `baseline`) the PyTorch model of `ref_dir`,
    or read that baseline from `shared` (the section's `bench-baseline` bench.json, rescaled
    by the two runs' drift probes); write bench.json and report.html; the action's result."""
    from mopt_ml.common import read_meta, read_shared_baseline, versions, write_json
    from mopt_ml.timing import _probes_of_this_action, exclusive_cpu
    from mopt_ml.validate import generation_format

    if shared is not None and shared.get("format") != BASELINE_FORMAT:
        raise ValueError(
            f"bench: the section's bench-baseline {shared['target']!r} is {shared.get('format')!r}, "
            f"not a text-generation baseline ({BASELINE_FORMAT})"
        )
    common, settings = _common(ref_dir, tmp, params, project_dir, device)
    mode, threads = common["mode"], common["threads"]
    art_label = label or model_dir.name
    fmt = generation_format(model_dir)
    specs = [{**common, "model": str(model_dir), "format": fmt, "label": art_label, "dtype": None}]
    if params.baseline and shared is None:
        specs.append(_baseline_spec(common, ref_dir))
    with exclusive_cpu(log), _probes_of_this_action():
        results = [_time(s, tmp, log) for s in specs]
    # the shared baseline, at this run's machine speed: x (this run's probe / the baseline run's)
    scale, shared_info = 1.0, None
    if params.baseline and shared is not None:
        base_res, scale = read_shared_baseline(results, shared)
        shared_info = {"target": shared["target"], "probe_ratio": scale}
        lack = sorted({step_of(s) for s in results[0]["steps"]} - {step_of(s) for s in base_res["steps"]})
        log(
            f"baseline: {shared['target']} (timed once for the section), x{scale:.3f} for this run's "
            "machine speed (drift probe)"
            + (f"; it has no step {lack}: give it the bench's steps" if lack else "")
        )
    speedups = []
    if len(results) > 1:
        base = {step_of(s): s for s in results[1]["steps"]}
        for s in results[0]["steps"]:
            b = base.get(step_of(s))
            if b and b.get("output_tok_s") and s.get("output_tok_s"):
                speedups.append(
                    {
                        "step": step_of(s),
                        "output_tok_s_ratio": s["output_tok_s"] * scale / b["output_tok_s"],
                        "ttft_p50_ratio": (b["ttft_ms"]["p50"] * scale / s["ttft_ms"]["p50"])
                        if s["ttft_ms"]["p50"]
                        else None,
                    }
                )
    meta = read_meta(model_dir)
    report = {
        "format": FORMAT,
        "task": "text-generation",
        "artifact": art_label,
        "mode": mode,
        "precision": meta.get("precision"),
        "quantization": (meta.get("quantization") or {}).get("mode")
        if isinstance(meta.get("quantization"), dict)
        else meta.get("quantization"),
        "machine": _machine(threads),
        "settings": settings,
        "results": results,
        # the section's bench-baseline this bench read (null: the baseline was timed here)
        "shared_baseline": shared_info,
        "speedup_vs_baseline": speedups,
        "tools": versions("torch", "transformers", "onnxruntime"),
    }
    write_json(out / "bench.json", report)
    (out / "report.html").write_text(render_html(report), encoding="utf-8")
    for s in speedups:
        log(f"{mode} {s['step']}: {s['output_tok_s_ratio']:.2f}x output tokens/s vs {results[1]['label']}")
    first = results[0]["steps"]
    return {
        "task": "text-generation",
        "mode": mode,
        "threads": threads,
        "output_tok_s": {str(step_of(s)): _r(s["output_tok_s"]) for s in first},
        "ttft_ms_p50": {str(step_of(s)): _r(s["ttft_ms"]["p50"]) for s in first},
        "itl_ms_p50": {str(step_of(s)): _r(s["itl_ms"]["p50"]) for s in first},
        "speedup_largest": _r(max(speedups, key=lambda s: s["step"])["output_tok_s_ratio"], 3)
        if speedups
        else None,
        "peak_rss_mb": _r(results[0]["peak_rss_mb"], 1),
        "stable": all(s["stable"] for r in results for s in r["steps"]),
    }


def time_generation_baseline(
    ref_dir: Path, out: Path, tmp: Path, params: Any, project_dir: Path, log: Any, device: str = "cpu"
) -> dict[str, Any]:
    """`bench-baseline` of a text-generation section: the PyTorch model timed over the steps
    once (between drift probes on CPU); bench.json (`mopt-genbench-baseline/1`) holds it as
    `results[0]`, which each bench of the section copies to its `results[1]`."""
    from mopt_ml.common import probe_level, versions, write_json
    from mopt_ml.timing import _probes_of_this_action, exclusive_cpu

    common, settings = _common(ref_dir, tmp, params, project_dir, device)
    spec = _baseline_spec(common, ref_dir)
    with exclusive_cpu(log), _probes_of_this_action():
        result = _time(spec, tmp, log)
    report = {
        "format": BASELINE_FORMAT,
        "task": "text-generation",
        "artifact": spec["label"],
        "mode": common["mode"],
        "precision": spec["dtype"],
        "quantization": None,
        "machine": _machine(common["threads"]),
        "settings": settings,
        "results": [result],
        "shared_baseline": None,
        "speedup_vs_baseline": [],
        "tools": versions("torch", "transformers", "onnxruntime"),
    }
    write_json(out / "bench.json", report)
    (out / "report.html").write_text(render_html(report), encoding="utf-8")
    probe = result.get("probe") or {}
    steps = result["steps"]
    return {
        "task": "text-generation",
        "mode": common["mode"],
        "threads": common["threads"],
        "output_tok_s": {str(step_of(s)): _r(s["output_tok_s"]) for s in steps},
        "ttft_ms_p50": {str(step_of(s)): _r(s["ttft_ms"]["p50"]) for s in steps},
        "probe_ms": _r(probe_level(probe), 3),
        "peak_rss_mb": _r(result["peak_rss_mb"], 1),
        "stable": all(s["stable"] for s in steps),
    }


def _r(v: float | None, nd: int = 2) -> float | None:
    return None if v is None else round(float(v), nd)


def render_html(report: dict[str, Any]) -> str:
    """bench.json as one HTML page: TTFT, ITL and output tokens/s per step, and the table."""

    from mopt_ml.plots import bench_lines_svg

    results, mode = report["results"], report["mode"]
    charts = [
        bench_lines_svg(
            [(r["label"], [(step_of(s), s["ttft_ms"]["p50"] or 0.0) for s in r["steps"]]) for r in results],
            "TTFT p50",
            mode,
            "TTFT p50 (ms)",
        ),
        bench_lines_svg(
            [(r["label"], [(step_of(s), s["itl_ms"]["p50"] or 0.0) for s in r["steps"]]) for r in results],
            "ITL p50",
            mode,
            "ITL p50 (ms)",
        ),
        bench_lines_svg(
            [(r["label"], [(step_of(s), s["output_tok_s"] or 0.0) for s in r["steps"]]) for r in results],
            "Output tokens / s",
            mode,
            "output tokens/s",
        ),
    ]

    def ms(d: dict[str, Any], q: str) -> str:
        return "–" if d.get(q) is None else f"{d[q]:.1f}"

    rows = [
        [
            r["label"],
            step_of(s),
            ms(s["ttft_ms"], "p50"),
            ms(s["ttft_ms"], "p99"),
            ms(s["itl_ms"], "p50"),
            ms(s["itl_ms"], "p99"),
            f"{s['output_tok_s']:.1f}",
            s["samples"],
            "yes" if s["stable"] else "no",
        ]
        for r in results
        for s in r["steps"]
    ]
    st = report["settings"]
    from mopt_ml import pages

    return pages.render(
        "table_page.html.j2",
        title=f"mopt bench: {report['artifact']}",
        heading=f"Generation benchmark: {report['artifact']}",
        notes=[f"{st['prompt_len']} prompt tokens, {st['output_len']} new tokens, greedy; {mode} steps {st['steps']}; "
               f"{report['machine']['cpu']}, {report['machine']['threads']} threads"],
        figures=[pages.markup(c) for c in charts],
        head=["backend", mode, "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms", "output tok/s", "samples", "stable"],
        rows=rows,
        row_class=None,
        pre=None,
    )


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    Path(argv[1]).write_text(json.dumps(run(spec), indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
