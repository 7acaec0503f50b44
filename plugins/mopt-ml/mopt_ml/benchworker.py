"""One benchmark run in a fresh process: `python -m mopt_ml.benchworker SPEC.json OUT.json`.

A process per backend keeps thread settings and peak memory (ru_maxrss) of one backend from
leaking into the other's numbers.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import math
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


def median_ci(values: list[float], confidence: float = 0.95) -> tuple[float, float] | None:
    """A distribution-free confidence interval of the median: order statistics x(j) and
    x(n+1-j), with j the largest rank such that P(Binomial(n, 1/2) < j) <= (1 - confidence) / 2
    (the sign-test interval; no assumption about the timing distribution, which is skewed
    and often bimodal on a shared machine). None when `values` are too few for
    `confidence` (at 95 %: fewer than 6)."""
    n = len(values)
    xs = sorted(values)
    tail = (1.0 - confidence) / 2.0
    cdf = 0.0
    j = 0
    for k in range(n + 1):
        cdf += math.comb(n, k) / 2.0**n
        if cdf > tail:
            break
        j = k + 1
    if j < 1:
        return None
    return xs[j - 1], xs[n - j]


#: how a worker marks a finished point's line on stderr (the bench action prints it as progress)
POINT = "point: "

#: rows of the drift probe's input (its size: see `write_probe`)
PROBE_ROWS = 512


def write_probe(path: Path) -> None:
    """The drift probe's model (see `Probe`), written by the parent so that the workers
    need no `onnx` import: four seeded fp32 MatMuls, 512 × 384 × 1536 and back, twice."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper, save

    rng = np.random.default_rng(0)
    inits, nodes, x = [], [], "x"
    for i, (k, n) in enumerate([(384, 1536), (1536, 384)] * 2):
        w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
        inits.append(numpy_helper.from_array(w, f"w{i}"))
        nodes.append(helper.make_node("MatMul", [x, f"w{i}"], [f"m{i}"]))
        nodes.append(helper.make_node("Relu", [f"m{i}"], [f"r{i}"]))
        x = f"r{i}"
    graph = helper.make_graph(
        nodes,
        "mopt_drift_probe",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [PROBE_ROWS, 384])],
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, [PROBE_ROWS, 384])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = min(model.ir_version, 8)
    save(model, str(path))


class Probe:
    """The drift probe: a fixed ONNX Runtime workload (`write_probe`: 2.4 GFLOP, 9 MiB of
    weights, ~20 ms on 2 quiet AVX2 cores: long enough to span scheduler slices, like the
    calls it tracks) timed between a backend's calls, in its process,
    with its thread count. Its median says how fast this machine ran while that backend
    was timed: `select` scales each bench's latencies by (the section's median probe / its
    own probe), so benchmarks run minutes apart compare as if side by side, and a bench
    reading its section's shared PyTorch baseline (kind `bench-baseline`) rescales the
    baseline's latency by the ratio of the two runs' probes."""

    #: at most one probe call per this many seconds of timed calls (a few % of the time)
    EVERY_S = 0.4

    def __init__(self, path: Path, threads: int) -> None:
        import numpy as np
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
        so.log_severity_level = 3
        self.sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        self.feed = {"x": np.random.default_rng(1).standard_normal((PROBE_ROWS, 384)).astype(np.float32)}
        self.times: list[float] = []
        self.last = 0.0
        for _ in range(2):  # warm-up
            self.sess.run(None, self.feed)

    def sample(self) -> None:
        t = time.perf_counter()
        self.sess.run(None, self.feed)
        self.last = time.perf_counter()
        self.times.append(self.last - t)

    def block(self, n: int = 3) -> None:
        """`n` probe calls in a row: at each grid point's start and after the last one, so a
        short run has samples too."""
        for _ in range(n):
            self.sample()

    def maybe(self) -> None:
        if time.perf_counter() - self.last >= self.EVERY_S:
            self.sample()

    def result(self) -> dict[str, Any] | None:
        if not self.times:
            return None
        return {
            "p50_ms": statistics.median(self.times) * 1000,
            "min_ms": min(self.times) * 1000,
            "samples": len(self.times),
        }


def measure(fn: Callable[[], Any], timing: dict[str, Any], probe: Probe | None = None) -> dict[str, Any]:
    """Warm up, then time calls until the estimate is stable: the `confidence` interval of
    the median within `ci_rel` of it on either side, after at least `min_samples` calls; at
    most `max_samples` calls or `max_seconds` (the point is then marked not stable). With
    `probe`, a drift-probe call is timed (apart) between calls, every `Probe.EVERY_S`."""
    for _ in range(timing["warmup"]):
        fn()
    conf = timing.get("confidence", 0.95)
    start = time.perf_counter()
    times: list[float] = []
    stable = False
    ci: tuple[float, float] | None = None
    if probe is not None:
        probe.block()
    stopped = "ci"
    while True:
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
        if probe is not None:
            probe.maybe()
        if len(times) >= timing["min_samples"]:
            ci = median_ci(times, conf)
            if ci is not None and stable_ci(statistics.median(times), ci, timing["ci_rel"]):
                stable = True
                break
        if len(times) >= timing["max_samples"]:
            stopped = "max_samples"
            break
        if time.perf_counter() - start > timing["max_seconds"]:
            stopped = "max_seconds"
            break
    med = statistics.median(times)
    return {
        "p50_ms": med * 1000,
        "p90_ms": percentile(times, 90) * 1000,
        "p99_ms": percentile(times, 99) * 1000,
        "mean_ms": statistics.fmean(times) * 1000,
        "min_ms": min(times) * 1000,
        "samples": len(times),
        "timed_s": round(time.perf_counter() - start, 3),
        "ci_ms": [ci[0] * 1000, ci[1] * 1000] if ci else None,
        "ci_confidence": conf,
        "stable": stable,
        # why timing stopped: "ci" (the interval got within ci_rel), else the cap it hit
        "stopped": stopped,
    }


def point_line(backend: str, p: dict[str, Any]) -> str:
    """One finished grid point, as the build prints it: median, its interval, calls, why it stopped."""
    ci = p.get("ci_ms")
    interval = f" [{ci[0]:.1f}, {ci[1]:.1f}]" if ci else ""
    why = "interval within ci_rel" if p.get("stopped", "ci") == "ci" else f"stopped at {p['stopped']}"
    return (f"{backend} b={p['batch']} s={p['seq']}: p50 {p['p50_ms']:.1f} ms{interval} "
            f"({p['samples']} calls in {p['timed_s']:.1f} s, {why})")  # fmt: skip


def stable_ci(median: float, ci: tuple[float, float], rel: float) -> bool:
    """Whether the interval `ci` lies within `rel` of `median` on both sides."""
    return median - ci[0] <= rel * median and ci[1] - median <= rel * median


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


def save_inputs(path: Path, tokenizer: Any, texts: list[str], shapes: list[tuple[int, int]]) -> None:
    """The inputs of every grid point, tokenized once (by the parent) into an .npz: the
    ONNX Runtime and OpenVINO workers then never import transformers (3 s of CPU each on 2
    cores), and every backend times exactly the same tokens."""
    import numpy as np

    arrays = {}
    for batch, seq in shapes:
        feeds = make_inputs(tokenizer, texts, batch, seq)
        arrays[f"input_ids_{batch}x{seq}"] = feeds["input_ids"]
        arrays[f"attention_mask_{batch}x{seq}"] = feeds["attention_mask"]
    np.savez(path, **arrays)


def load_inputs(spec: dict[str, Any]) -> dict[tuple[int, int], dict[str, Any]] | None:
    """The pre-tokenized inputs of `spec["inputs"]` by (batch, seq), or None."""
    if not spec.get("inputs"):
        return None
    import numpy as np

    out: dict[tuple[int, int], dict[str, Any]] = {}
    with np.load(spec["inputs"]) as data:
        for key in data.files:
            name, _, shape = key.rpartition("_")
            b, s = (int(x) for x in shape.split("x"))
            out.setdefault((b, s), {})[name] = data[key]
    return out


def auto_tokenizer(folder: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def load_family(ref: str) -> Any:
    module, _, qual = ref.partition(":")
    obj: Any = importlib.import_module(module)
    for part in qual.split("."):
        obj = getattr(obj, part)
    return obj()


def run_probe(spec: dict[str, Any]) -> dict[str, Any]:
    """`backend = "probe"`: only the drift probe, `samples` calls, in a process of its own
    (no other runtime's threads beside it: an ONNX Runtime session's spinning workers or
    OpenVINO's would slow it by different amounts, biasing the comparison between them)."""
    probe = Probe(Path(spec["probe"]), int(spec["threads"]))
    probe.block(int(spec.get("samples", 15)))
    return {"backend": "probe", "label": spec.get("label", "probe"), "threads": int(spec["threads"]),
            "probe": probe.result(), "times_ms": [t * 1000 for t in probe.times]}  # fmt: skip


def load_backend(spec: dict[str, Any]) -> tuple[Callable[[dict[str, Any]], Callable[[], Any]], Any, Any, Any]:
    """Load `spec`'s model in its backend: (a function from feeds to a timed call, the
    tokenizer or None, the pre-tokenized inputs or None, the runtime properties or None)."""
    threads = int(spec["threads"])
    runtime: dict[str, Any] | None = None  # OpenVINO: the properties its CPU plugin chose
    inputs = load_inputs(spec)
    tokenizer: Any = None
    if spec["backend"] == "onnx":
        from mopt_ml.common import OUTPUT_NAME, ort_session

        if inputs is None:
            tokenizer = auto_tokenizer(spec["tokenizer"])
        sess = ort_session(Path(spec["model"]), threads=threads)
        names = {i.name for i in sess.get_inputs()}

        def runner(feeds: dict[str, Any]) -> Callable[[], Any]:
            f = {k: v for k, v in feeds.items() if k in names}
            return lambda: sess.run([OUTPUT_NAME], f)

    elif spec["backend"] == "openvino":
        from mopt_ml.openvino_ir import Runner, compile_folder, effective

        if inputs is None:
            tokenizer = auto_tokenizer(spec["tokenizer"])
        compiled = compile_folder(Path(spec["model"]), threads=threads)
        runtime = effective(compiled)
        ov_run = Runner(compiled)

        def runner(feeds: dict[str, Any]) -> Callable[[], Any]:
            f = ov_run.feeds(feeds)
            return lambda: ov_run.request.infer(f, share_inputs=True, share_outputs=True)

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

    return runner, tokenizer, inputs, runtime


def run(spec: dict[str, Any], on_point: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Time `spec`'s backend over its grid; `on_point` gets a line per finished point
    (default: this process's stderr, which the bench action reads live)."""
    if spec["backend"] == "probe":
        return run_probe(spec)
    threads = int(spec["threads"])
    rss_start = rss_mb()
    t0 = time.perf_counter()
    runner, tokenizer, inputs, runtime = load_backend(spec)
    load_s = time.perf_counter() - t0
    rss_loaded = rss_mb()
    # in-process probing (spec "probe"; bench uses probe processes instead: see run_probe)
    probe = Probe(Path(spec["probe"]), threads) if spec.get("probe") else None
    points = []
    grid = spec.get("shapes") or [[b, s] for s in spec["seq_lens"] for b in spec["batch_sizes"]]
    for batch, seq in grid:
        feeds = inputs[(batch, seq)] if inputs is not None else make_inputs(tokenizer, spec["texts"], batch, seq)
        stats = measure(runner(feeds), spec["timing"], probe)
        stats.update(
            {
                "batch": batch,
                "seq": seq,
                "sequences_per_s": batch / (stats["p50_ms"] / 1000),
                "tokens_per_s": batch * seq / (stats["p50_ms"] / 1000),
            }
        )
        points.append(stats)
        line = point_line(spec.get("label", spec["backend"]), stats)
        if on_point is not None:
            on_point(line)
        else:
            print(POINT + line, file=sys.stderr, flush=True)
    if probe is not None:
        probe.block()
    gpu_peak = None
    if spec["backend"] in ("torch-compile", "torch-cuda-eager"):  # on the GPU
        import torch

        gpu_peak = torch.cuda.max_memory_allocated() / 2**20
    return {
        "backend": spec["backend"],
        "label": spec.get("label", spec["backend"]),
        "threads": threads,
        "peak_gpu_mb": gpu_peak,
        "runtime": runtime,  # tensors allocated by torch on the GPU (None on CPU)
        "load_seconds": load_s,
        "rss_start_mb": rss_start,
        "rss_loaded_mb": rss_loaded,
        "peak_rss_mb": peak_rss_mb(),
        "points": points,
        # the drift probe's timing over this run (None when the spec asked for none)
        "probe": probe.result() if probe is not None else None,
    }


def serve(spec: dict[str, Any]) -> int:
    """`--serve SPEC.json`: a finals contestant (`mopt_ml.finals`). Loads the model, makes the
    call of `spec["point"]` ([batch, seq]), says `{"ready": ...}` on stdout, then answers
    each line `N` on stdin with N timed calls: `{"times": [s, ...]}`.
    Ends at EOF. Nothing else runs in this process between the parent's requests."""
    t0 = time.perf_counter()
    runner, tokenizer, inputs, runtime = load_backend(spec)
    batch, seq = spec["point"]
    feeds = inputs[(batch, seq)] if inputs is not None else make_inputs(tokenizer, spec["texts"], batch, seq)
    call = runner(feeds)
    for _ in range(3):  # warm-up, before any finalist is timed
        call()
    out = sys.stdout
    out.write(json.dumps({"ready": True, "load_seconds": time.perf_counter() - t0, "runtime": runtime}) + "\n")
    out.flush()
    for line in sys.stdin:
        n = int(line)
        times = []
        for _ in range(n):
            t = time.perf_counter()
            call()
            times.append(time.perf_counter() - t)
        out.write(json.dumps({"times": times}) + "\n")
        out.flush()
    return 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["--serve"]:
        return serve(json.loads(Path(argv[1]).read_text()))
    spec = json.loads(Path(argv[0]).read_text())
    result = run(spec)
    Path(argv[1]).write_text(json.dumps(result, indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
