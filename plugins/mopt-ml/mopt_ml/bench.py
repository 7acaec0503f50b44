"""The `bench` target: latency and throughput of the artifact and of the PyTorch FP32
baseline over a grid of batch sizes × sequence lengths, in the same run, each backend in
its own process. Writes bench.json and a self-contained report.html (inline SVG plots from
`plots.bench_lines_svg`, the page from `templates/bench.html.j2`).

Task-aware: for `task = "text-generation"` it times TTFT, ITL and output tokens/s per
batch size or concurrency instead (`mopt_ml.genbench`, bench.json `mopt-genbench/1`)."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any, Literal

from mopt.api import Artifact, BuildContext, Input, Params, TargetKind
from pydantic import Field

from mopt_ml.common import probe_level, read_shared_baseline
from mopt_ml.timing import _probed, _probes_of_this_action, _run_worker, cpu_model, exclusive_cpu
from mopt_ml.validate import GENERATION, ArtifactTester, _device


class TimingParams(Params):
    """The grid and the stopping rule, shared by `bench` and `bench-baseline`."""

    batch_sizes: list[int] = Field(default=[1, 8, 32], min_length=1, description="batch sizes")
    seq_lens: list[int] = Field(default=[128], min_length=1, description="sequence lengths (tokens)")
    threads: int | None = Field(default=None, ge=1, description="intra-op threads (null: the CPUs usable)")
    torch_attn: Literal["sdpa", "eager"] = Field(default="sdpa", description="baseline attention")
    warmup: int = Field(default=1, ge=0, description="untimed calls per grid point")
    min_samples: int = Field(default=6, ge=2, description="timed calls per grid point, at least")
    max_samples: int = Field(default=60, ge=2, description="timed calls per grid point, at most")
    ci_rel: float = Field(
        default=0.03,
        gt=0,
        description="stop when the confidence interval of the median is within this fraction of it",
    )
    confidence: float = Field(default=0.95, gt=0.5, lt=1.0, description="of that interval")
    max_seconds: float = Field(
        default=2.0,
        gt=0,
        description="timed seconds per grid point, at most (bench screens; `select` times its finalists "
        "side by side)",
    )
    data: str | None = Field(default=None, description="texts the inputs are made of (null: shipped)")


class GenerationTiming(Params):
    """What a text-generation bench times (task = "text-generation"; `batch_sizes` are its
    batch steps), shared by `bench` and `bench-baseline`."""

    prompt_len: int = Field(default=128, ge=1, description="generation: prompt tokens per request")
    output_len: int = Field(default=64, ge=1, description="generation: new tokens per request (greedy)")
    concurrency: list[int] | None = Field(
        default=None,
        min_length=1,
        description="generation: concurrent streamed requests per step instead of static batches "
        "of batch_sizes (null: batches)",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        default="auto", description="generation: where it runs (auto: cuda on a GPU profile with a GPU)"
    )


class BenchKind(ArtifactTester):
    """Latency p50/p90/p99, throughput and peak memory of an artifact and its PyTorch FP32
    baseline: warm-up, then timed calls until the median's confidence interval is narrow
    (bounded by a count and a time cap). A drift probe is timed in the action's process
    right before and after each backend's (see `mopt_ml.timing._ActionProbe`). When the section has a `bench-baseline` target, its timing of
    the baseline is used (rescaled by the two runs' probes) instead of timing it again."""

    name = "bench"
    version = "4"  # 2: the drift probe (results[i].probe), the shared baseline; 3: probed in the action;
    # 4: the probe's level_ms (the faster end), which select and the shared baseline's scaling read
    description = "latency / throughput / memory of the artifact and the PyTorch FP32 baseline"
    reproducible = False
    exclusive = True  # timed alone: other actions of the build wait while it runs
    consumes = (
        *ArtifactTester.consumes,
        # the section's shared PyTorch baseline, timed once for all its benches
        Input("baseline", formats=("report",), kinds=("bench-baseline",), required=False),
    )

    class Params(TimingParams, GenerationTiming):
        baseline: bool = Field(default=True, description="also time the PyTorch FP32 reference")

    def fingerprint(self) -> dict[str, str]:
        from mopt_ml.common import versions

        return versions("torch", "transformers", "onnxruntime", "numpy", "openvino")

    def platform(self, hardware: Any) -> dict[str, Any]:
        return {"machine": platform.machine(), "cpu": cpu_model(), "cpus": os.cpu_count()}

    def test(self, art: Artifact, ref: Path, ctx: BuildContext, label: str) -> dict[str, Any]:
        p = ctx.params
        shared = None
        base = ctx.inputs.get("baseline") or []
        if base and p.baseline:  # the section's bench-baseline: the baseline is not timed again
            shared = json.loads((base[0].path / "bench.json").read_text())
            shared["target"] = base[0].target
        if ctx.task == GENERATION:
            from mopt_ml.genbench import bench_generation

            device = _device(p.device, ctx.hardware)
            return bench_generation(
                art.path,
                ref,
                ctx.out,
                ctx.tmp,
                p,
                ctx.project_dir,
                ctx.log,
                label,
                device=device,
                shared=shared,
            )
        return bench(
            art.path, ref, ctx.out, ctx.tmp, ctx.family, p, ctx.project_dir, ctx.log, label, art.kind, shared
        )


class BenchBaselineKind(TargetKind):
    """The PyTorch FP32 baseline of a section's benches, timed once (with the drift probe)
    instead of once per bench: each `bench` of the section reads it, rescaled by the ratio
    of its own drift probe to this one (how much faster or slower the machine ran then)."""

    name = "bench-baseline"
    version = "4"  # 3: the drift probe in the action's process (as bench 3's); 4: its level_ms
    description = "the PyTorch FP32 baseline of a section's benches, timed once with the drift probe"
    reproducible = False
    exclusive = True
    consumes = (Input("reference", formats=("hf-checkpoint",), kinds=("pretrain", "weights")),)
    produces = "report"
    static_fingerprint = True
    # timed in the action's process (see `time_baseline`): torch and transformers come imported
    preload = ArtifactTester.preload

    class Params(TimingParams, GenerationTiming):
        pass

    def fingerprint(self) -> dict[str, str]:
        from mopt_ml.common import versions

        return versions("torch", "transformers", "onnxruntime", "numpy")

    def platform(self, hardware: Any) -> dict[str, Any]:
        return {"machine": platform.machine(), "cpu": cpu_model(), "cpus": os.cpu_count()}

    def input_files(self, params: Any, project_dir: Path) -> list[Path]:
        from mopt_ml.common import data_input_files

        return data_input_files(params.data, project_dir)

    def run(self, ctx: BuildContext) -> dict[str, Any]:
        from mopt_ml.common import require

        require("torch", "transformers", "onnxruntime")
        ref = ctx.input("reference")
        if ctx.task == GENERATION:
            from mopt_ml.genbench import time_generation_baseline

            device = _device(ctx.params.device, ctx.hardware)
            return time_generation_baseline(
                ref.path, ctx.out, ctx.tmp, ctx.params, ctx.project_dir, ctx.log, device=device
            )
        return time_baseline(ref.path, ctx.out, ctx.tmp, ctx.family, ctx.params, ctx.project_dir, ctx.log)


def _family_ref(family: Any) -> str:
    cls = type(family)
    return f"{cls.__module__}:{cls.__qualname__}"


def bench(
    model_dir: Path,
    ref_dir: Path,
    out: Path,
    tmp: Path,
    family_obj: Any,
    params: Any,
    project_dir: Path,
    log: Any,
    label: str = "",
    kind: str = "onnx",
    shared: dict[str, Any] | None = None,
) -> dict[str, Any]:
    from mopt_ml.common import cpu_threads, read_meta, versions, write_json
    from mopt_ml.families import as_family

    family = as_family(family_obj, ref_dir)
    threads = cpu_threads(params.threads)
    common, timing = _common_spec(params, threads, family, project_dir)
    meta = read_meta(model_dir)
    art_label = label or model_dir.name
    if kind == "torch-compile":
        # compiled for fixed buckets only: time those, against eager fp16 on the same GPU
        cmeta = json.loads((model_dir / "meta.json").read_text())
        shapes = sorted({(int(b["batch"]), int(b["seq"])) for b in cmeta["buckets"]})
        common["batch_sizes"] = sorted({b for b, _ in shapes})
        common["seq_lens"] = sorted({s for _, s in shapes})
        common["shapes"] = [list(x) for x in shapes]
        meta = {"precision": cmeta.get("precision")}
        results = [
            _run_worker(
                {
                    **common,
                    "backend": "torch-compile",
                    "label": art_label,
                    "model": str(model_dir),
                    "weights": str(ref_dir),
                },
                tmp,
                log,
            ),
        ]
        if params.baseline:
            results.append(
                _run_worker(
                    {
                        **common,
                        "backend": "torch-cuda-eager",
                        "label": f"pytorch-{cmeta.get('precision')}-eager",
                        "model": str(model_dir),
                        "weights": str(ref_dir),
                    },
                    tmp,
                    log,
                )
            )
        log("baseline: eager PyTorch in the artifact's precision on the same GPU")
    else:
        # tokenized once, here, for every backend (before the benchmark lock: no timing yet)
        _prepare_inputs(family.load_tokenizer(model_dir), common, tmp)
        with exclusive_cpu(log), _probes_of_this_action():
            results = _time_all(model_dir, ref_dir, art_label, common, params, tmp, log, shared is None)
    # the shared baseline's latencies, scaled to this run's machine speed: x (this run's
    # probe / the baseline run's probe); 1 when the baseline was timed in this run
    base_scale = 1.0
    shared_info = None
    if params.baseline and shared is not None:
        base_res, base_scale = read_shared_baseline(results, shared)
        shared_info = {"target": shared["target"], "probe_ratio": base_scale}
        have = {(p["batch"], p["seq"]) for p in base_res["points"]}
        lack = [
            f"{p['batch']}x{p['seq']}" for p in results[0]["points"] if (p["batch"], p["seq"]) not in have
        ]
        log(
            f"baseline: {shared['target']} (timed once for the section), x{base_scale:.3f} "
            "for this run's machine speed (drift probe)"
            + (f"; it has no point {', '.join(lack)}: give it the bench's grid" if lack else "")
        )
    speedups = []
    if params.baseline:
        base = {(p["batch"], p["seq"]): p for p in results[1]["points"]}
        for p in results[0]["points"]:
            b = base.get((p["batch"], p["seq"]))
            if b:
                speedups.append(
                    {
                        "batch": p["batch"],
                        "seq": p["seq"],
                        "speedup_p50": b["p50_ms"] * base_scale / p["p50_ms"],
                    }
                )
    report = {
        "format": "mopt-bench/1",
        "artifact": art_label,
        "precision": meta.get("precision"),
        "quantization": (meta.get("quantization") or {}).get("mode"),
        # OpenVINO: inference precision, streams, hint and threads its CPU plugin ran with
        "runtime": results[0].get("runtime"),
        "machine": {
            "cpu": cpu_model(),
            "cpus": os.cpu_count(),
            "threads": threads,
            "platform": platform.platform(),
        },
        "settings": {
            "batch_sizes": list(params.batch_sizes),
            "seq_lens": list(params.seq_lens),
            **timing,
            "torch_attn": params.torch_attn,
        },
        "results": results,
        # the section's bench-baseline this bench read (null: the baseline was timed here)
        "shared_baseline": shared_info,
        "speedup_vs_pytorch_fp32": speedups,
        "tools": versions(
            "torch", "transformers", "onnxruntime", *(("openvino",) if results[0].get("runtime") else ())
        ),
    }
    write_json(out / "bench.json", report)
    (out / "report.html").write_text(render_html(report), encoding="utf-8")
    for s in speedups:
        log(f"b={s['batch']} s={s['seq']}: {s['speedup_p50']:.2f}x vs PyTorch FP32")
    top = max(speedups, key=lambda s: s["batch"] * s["seq"]) if speedups else None
    return {
        "threads": threads,
        "points": len(results[0]["points"]),
        "p50_ms": {f"{p['batch']}x{p['seq']}": round(p["p50_ms"], 2) for p in results[0]["points"]},
        # per shape: the interval of the median (null: too few calls for one), the timed
        # calls, the speedup vs the PyTorch baseline (what `mopt report` shows per shape)
        "p50_ci_ms": {
            f"{p['batch']}x{p['seq']}": [round(x, 2) for x in p["ci_ms"]] if p.get("ci_ms") else None
            for p in results[0]["points"]
        },
        "samples": {f"{p['batch']}x{p['seq']}": p.get("samples") for p in results[0]["points"]},
        "speedup": {f"{s['batch']}x{s['seq']}": round(s["speedup_p50"], 3) for s in speedups},
        "speedup_largest": round(top["speedup_p50"], 3) if top else None,
        "peak_rss_mb": round(results[0]["peak_rss_mb"], 1),
        "stable": all(p["stable"] for r in results for p in r["points"]),
        **({"runtime": results[0]["runtime"]} if results[0].get("runtime") else {}),
    }


def _common_spec(
    params: Any, threads: int, family: Any, project_dir: Path
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The worker spec's fields every backend shares, and the stopping rule."""
    from mopt_ml.common import texts_from_param

    timing = {
        k: getattr(params, k)
        for k in ("warmup", "min_samples", "max_samples", "ci_rel", "confidence", "max_seconds")
    }
    common = {
        "threads": threads,
        "batch_sizes": list(params.batch_sizes),
        "seq_lens": list(params.seq_lens),
        "timing": timing,
        "texts": texts_from_param(params.data, project_dir, "validation"),
        "family": _family_ref(family),
    }
    return common, timing


def _prepare_inputs(tokenizer: Any, common: dict[str, Any], tmp: Path) -> None:
    """Tokenize the grid's inputs once (an .npz every backend reads) and write the drift
    probe's model; both paths go into the spec."""
    from mopt_ml.benchworker import save_inputs, write_probe

    shapes = [(b, s) for s in common["seq_lens"] for b in common["batch_sizes"]]
    save_inputs(tmp / "inputs.npz", tokenizer, common["texts"], shapes)
    common["inputs"] = str(tmp / "inputs.npz")
    write_probe(tmp / "probe.onnx")
    common["probe_model"] = str(tmp / "probe.onnx")


def _baseline_spec(common: dict[str, Any], ref_dir: Path, params: Any) -> dict[str, Any]:
    return {
        **common,
        "backend": "torch",
        "label": "pytorch-fp32",
        "model": str(ref_dir),
        "tokenizer": str(ref_dir),
        "attn": params.torch_attn,
    }


def _time_all(
    model_dir: Path,
    ref_dir: Path,
    art_label: str,
    common: dict[str, Any],
    params: Any,
    tmp: Path,
    log: Any,
    with_baseline: bool = True,
) -> list[dict[str, Any]]:
    from mopt_ml.common import model_onnx
    from mopt_ml.validate import is_openvino

    if is_openvino(model_dir):  # compiled with the runtime properties the artifact records
        spec = {"backend": "openvino", "model": str(model_dir)}
    else:
        spec = {"backend": "onnx", "model": str(model_onnx(model_dir))}
    results = [_probed({**common, **spec, "label": art_label, "tokenizer": str(model_dir)}, tmp, log)]
    if params.baseline and with_baseline:
        results.append(_probed(_baseline_spec(common, ref_dir, params), tmp, log))
    return results


def time_baseline(
    ref_dir: Path, out: Path, tmp: Path, family_obj: Any, params: Any, project_dir: Path, log: Any
) -> dict[str, Any]:
    """`bench-baseline`: the PyTorch FP32 reference timed over the grid, once, with the
    drift probe, in this process (`_run_in_process`); bench.json holds it as `results[0]`
    (a bench copies it to its `results[1]`)."""
    from mopt_ml.common import cpu_threads, versions, write_json
    from mopt_ml.families import as_family

    family = as_family(family_obj, ref_dir)
    threads = cpu_threads(params.threads)
    common, timing = _common_spec(params, threads, family, project_dir)
    _prepare_inputs(family.load_tokenizer(ref_dir), common, tmp)
    with exclusive_cpu(log), _probes_of_this_action():
        result = _probed(_baseline_spec(common, ref_dir, params), tmp, log, in_process=True)
    report = {
        "format": "mopt-bench-baseline/1",
        "artifact": "pytorch-fp32",
        "precision": "fp32",
        "quantization": None,
        "runtime": None,
        "machine": {
            "cpu": cpu_model(),
            "cpus": os.cpu_count(),
            "threads": threads,
            "platform": platform.platform(),
        },
        "settings": {
            "batch_sizes": list(params.batch_sizes),
            "seq_lens": list(params.seq_lens),
            **timing,
            "torch_attn": params.torch_attn,
        },
        "results": [result],
        "shared_baseline": None,
        "speedup_vs_pytorch_fp32": [],
        "tools": versions("torch", "transformers", "onnxruntime"),
    }
    write_json(out / "bench.json", report)
    (out / "report.html").write_text(render_html(report), encoding="utf-8")
    probe = result.get("probe") or {}
    return {
        "threads": threads,
        "points": len(result["points"]),
        "p50_ms": {f"{p['batch']}x{p['seq']}": round(p["p50_ms"], 2) for p in result["points"]},
        "p50_ci_ms": {
            f"{p['batch']}x{p['seq']}": [round(x, 2) for x in p["ci_ms"]] if p.get("ci_ms") else None
            for p in result["points"]
        },
        "samples": {f"{p['batch']}x{p['seq']}": p.get("samples") for p in result["points"]},
        "probe_ms": round(float(probe_level(probe) or 0.0), 3) if probe else None,
        "peak_rss_mb": round(result["peak_rss_mb"], 1),
        "stable": all(p["stable"] for p in result["points"]),
    }


# --------------------------------------------------------------------------- HTML report


def _latency_point(p: dict[str, Any]) -> tuple[float, float, float | None, float | None]:
    """(batch, p50 ms, and the interval of the median where the bench had one)."""
    ci = p.get("ci_ms") or [None, None]
    return (p["batch"], p["p50_ms"], ci[0], ci[1])


def _throughput_point(p: dict[str, Any]) -> tuple[float, float, float | None, float | None]:
    """(batch, sequences/s, and its interval: the median's, inverted)."""
    lo, hi = p.get("ci_ms") or [None, None]
    b = p["batch"]
    return (b, p["sequences_per_s"], b * 1000 / hi if hi else None, b * 1000 / lo if lo else None)


def render_html(report: dict[str, Any]) -> str:
    """The bench report as one HTML file (`templates/bench.html.j2`): summary, plots (latency
    and throughput vs batch size, per sequence length, with the median's interval as error
    bars), and the full table."""
    from mopt_ml import pages
    from mopt_ml.plots import bench_lines_svg

    results = report["results"]
    seqs = report["settings"]["seq_lens"]
    charts = []

    def name(r: dict[str, Any], seq: int) -> str:
        return r["label"] if len(seqs) == 1 else f"{r['label']} s={seq}"

    for seq in seqs:
        lat = [(name(r, seq), [_latency_point(p) for p in r["points"] if p["seq"] == seq]) for r in results]
        thr = [
            (name(r, seq), [_throughput_point(p) for p in r["points"] if p["seq"] == seq]) for r in results
        ]
        charts.append(
            bench_lines_svg(lat, f"Latency p50 vs batch size (seq {seq})", "batch size", "p50 latency (ms)")
        )
        charts.append(
            bench_lines_svg(
                thr, f"Throughput vs batch size (seq {seq})", "batch size", "throughput (sequences/s)"
            )
        )
    sp = report["speedup_vs_pytorch_fp32"]
    if sp and len(report["settings"]["batch_sizes"]) > 1:
        charts.append(
            bench_lines_svg(
                [
                    (f"s={seq}", [(s["batch"], s["speedup_p50"]) for s in sp if s["seq"] == seq])
                    for seq in seqs
                ],
                "Speedup vs PyTorch FP32 (p50)",
                "batch size",
                "speedup (×)",
            )
        )

    def interval(p: dict[str, Any]) -> str:
        ci = p.get("ci_ms")
        return f"{ci[0]:.2f} – {ci[1]:.2f}" if ci else "–"

    rows = [
        (
            r["label"],
            p["batch"],
            p["seq"],
            f"{p['p50_ms']:.2f}",
            interval(p),
            f"{p['p90_ms']:.2f}",
            f"{p['p99_ms']:.2f}",
            f"{p['sequences_per_s']:.1f}",
            f"{p['tokens_per_s']:.0f}",
            p["samples"],
            "yes" if p["stable"] else "no",
        )
        for r in results
        for p in r["points"]
    ]
    memory = [
        (
            r["label"],
            f"{r['peak_rss_mb']:.0f}",
            f"{r['rss_loaded_mb']:.0f}",
            f"{r['rss_start_mb']:.0f}",
            f"{r['load_seconds']:.2f}",
        )
        for r in results
    ]
    best = None
    if sp:
        top = max(sp, key=lambda s: s["batch"] * s["seq"])
        best = {"speedup": f"{top['speedup_p50']:.2f}", "batch": top["batch"], "seq": top["seq"]}
    settings = report["settings"]
    return pages.render(
        "bench.html.j2",
        artifact=report["artifact"],
        machine=report["machine"],
        precision=str(report.get("precision")),
        tools={
            "onnxruntime": report["tools"].get("onnxruntime", ""),
            "torch": report["tools"].get("torch", ""),
        },
        runtime=report.get("runtime"),
        best=best,
        charts=[pages.markup(c) for c in charts],
        rows=rows,
        memory=memory,
        settings=settings,
        confidence=f"{settings['confidence'] * 100:g}",
        ci_rel=f"{settings['ci_rel'] * 100:g}",
    )
