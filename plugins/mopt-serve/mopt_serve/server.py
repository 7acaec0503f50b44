"""Launchers and checks of an OpenAI-compatible server, shared by serve-check, its text-generation
path (`gen_check.py`), the container launcher (`container.py`) and serve-search.

* a **launcher** starts a server and yields an object with `base_url`, `log_path`,
  `kill_server()` (SIGKILL the serving process) and `stop()` (graceful, then SIGKILL);
  `local_vllm()` below is the local-process one: `vllm serve` from the argv recorded in the
  `vllm` artifact's args.json, on 127.0.0.1 and a free port, in its own process group, stopped
  in every case (a failed check, an exception, Ctrl-C and SIGTERM included).
* the **checks** are functions of `base_url` alone: `wait_healthy`, `served_models`,
  `embed`, `read_metrics`, `load_test` (+ `knee`), so any launcher's server gets the same ones.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from mopt.api import BuildContext
from mopt_serve.plots import latency_throughput_svg as loadtest_svg
from mopt_serve.search import percentile as sorted_percentile

INSTALL_VLLM = "pip install vllm (CUDA wheels on PyPI)"

DEFAULT_TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Embeddings map text to vectors whose distances mean something.",
    "TensorRT builds an engine for one GPU architecture.",
    "How many attention heads does the model have?",
    "Paris is the capital of France.",
    "A content-addressed store names every blob by its digest.",
    "The weather in Oslo is cold in January.",
    "def add(a, b):\n    return a + b",
    "Quantum computers use qubits instead of bits.",
    "She sells sea shells by the sea shore.",
    "Latency is the time one request takes; throughput is how many finish per second.",
    "Der schnelle braune Fuchs springt über den faulen Hund.",
    "La cuisine française est célèbre dans le monde entier.",
    "机器学习模型需要大量的数据。",
    "An H200 has 141 GB of HBM3e memory.",
    "Rebuilding only what changed is the point of a build system.",
]


# --------------------------------------------------------------------------- launchers


class Server(Protocol):
    """What a launcher yields: the checks need only `base_url`."""

    base_url: str
    log_path: Path

    def kill_server(self) -> None: ...

    def stop(self) -> None: ...


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class LocalServer:
    """A server process in its own process group (so stopping it stops its workers too)."""

    argv: list[str]
    base_url: str
    log_path: Path
    env: dict[str, str] | None = None
    proc: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    startup_s: float = 0.0  # start to a healthy /health
    pre: Any = None  # a prestart.Prestarted of this argv: start() tells it to go

    def start(self) -> None:
        if self.pre is not None:
            self.started = time.monotonic()
            self.proc = self.pre.go()
            return
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as logf:
            self.started = time.monotonic()
            # start_new_session: the server and the engine core processes it forks share a
            # process group of their own, which stop() and kill_server() signal as a whole
            self.proc = subprocess.Popen(
                self.argv,
                stdout=logf,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=self.env,
                preexec_fn=_die_with_parent,
            )

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def _signal(self, sig: int) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)  # the group start() created, never anything else

    def kill_server(self) -> None:
        """SIGKILL the whole server (API process and engine core)."""
        self._signal(signal.SIGKILL)
        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=30)

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM, then SIGKILL after `grace_s`; also reaps leftovers of the group."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        self._signal(signal.SIGKILL)  # engine workers that outlived the API process
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)

    def log_tail(self, n: int = 40) -> str:
        return log_tail(self.log_path, n)


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM it when the process that started it dies. An
    interrupted mopt build stops its actions' threads without running their `finally`
    (seen on the H200, 2026-12-01: a vLLM server outlived `mopt build` and held 130 GiB), and
    the server's own session keeps it out of any process-group kill."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def log_tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """While a server runs, SIGTERM raises KeyboardInterrupt, so `finally` stops the server
    when mopt itself is terminated (only the main thread may set handlers)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


@contextlib.contextmanager
def local_vllm(
    argv: list[str],
    log_path: Path,
    *,
    port: int,
    startup_timeout_s: float,
    env: dict[str, str] | None = None,
    pre: Any = None,
) -> Iterator[LocalServer]:
    """Start `argv` (a `vllm serve` line that listens on 127.0.0.1:`port`; or tell `pre`, the
    same line prestarted, to go), wait for /health, yield the server; stop it on the way out
    whatever happened."""
    server = LocalServer(argv, f"http://127.0.0.1:{port}", log_path, env, pre=pre)
    with _sigterm_as_interrupt():
        server.start()
        try:
            server.startup_s = wait_healthy(server.base_url, server.alive, startup_timeout_s, server.log_tail)
            yield server
        finally:
            server.stop()


def serve_command(args: dict[str, Any], model_dir: Path, serve_dir: Path, port: int) -> list[str]:
    """The `vllm` artifact's recorded argv with its placeholders filled, listening on
    127.0.0.1:`port`. `vllm` is the console script where it is on PATH, else this Python's
    `-m vllm.entrypoints.cli.main` (the same entry point)."""
    argv = [a.replace("{model}", str(model_dir)).replace("{here}", str(serve_dir)) for a in args["argv"]]
    if argv and argv[0] == "vllm" and shutil.which("vllm") is None:
        argv = [sys.executable, "-m", "vllm.entrypoints.cli.main", *argv[1:]]
    return [*argv, "--host", "127.0.0.1", "--port", str(port)]


# --------------------------------------------------------------------------- checks on base_url


def http_json(url: str, body: dict[str, Any] | None = None, timeout: float = 120.0) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        raw = r.read()
    return json.loads(raw) if raw else None


def wait_healthy(
    base: str, alive: Callable[[], bool], timeout: float, tail: Callable[[], str] | None = None
) -> float:
    """Seconds until GET /health answers 200; RuntimeError (with the log's tail) if the server
    exits first or is not healthy within `timeout`."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if not alive():
            raise RuntimeError(
                "the server exited before /health answered; its log ends:\n" + (tail() if tail else "")
            )
        try:
            with urllib.request.urlopen(base + "/health", timeout=5) as r:
                if r.status == 200:
                    return time.monotonic() - t0
        except (urllib.error.URLError, ConnectionError, OSError):
            pass
        time.sleep(0.5)
    raise RuntimeError(
        f"the server was not healthy after {timeout:.0f} s; its log ends:\n" + (tail() if tail else "")
    )


def served_models(base: str) -> list[str]:
    """The ids /v1/models lists."""
    return [m["id"] for m in http_json(base + "/v1/models", timeout=30).get("data", [])]


def embed(base: str, model: str, texts: list[str], batch_size: int = 16) -> list[list[float]]:
    """Embeddings of `texts` from /v1/embeddings, in order."""
    out: list[list[float]] = []
    for i in range(0, len(texts), batch_size):
        resp = http_json(base + "/v1/embeddings", {"model": model, "input": texts[i : i + batch_size]})
        out += [d["embedding"] for d in sorted(resp["data"], key=lambda d: d["index"])]
    return out


_METRIC = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfNa]+)")


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text → {series name: value summed over its label sets}."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _METRIC.match(line)
        if m:
            with contextlib.suppress(ValueError):
                out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
    return out


def read_metrics(base: str) -> dict[str, float]:
    with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
        return parse_metrics(r.read().decode(errors="replace"))


#: the /metrics series serve.json keeps (of vLLM's ~360)
KEPT_METRICS = (
    "vllm:prompt_tokens_total",
    "vllm:request_success_total",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:num_preemptions_total",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:e2e_request_latency_seconds_sum",
)


def cosines(a: list[list[float]], b: Any) -> list[float]:
    """Row-wise cosine similarity of two lists of vectors."""
    out = []
    for x, y in zip(a, b, strict=True):
        dot = sum(p * q for p, q in zip(x, y, strict=True))
        nx = sum(p * p for p in x) ** 0.5
        ny = sum(q * q for q in y) ** 0.5
        out.append(dot / (nx * ny) if nx and ny else float("nan"))
    return out


# --------------------------------------------------------------------------- load test


@dataclass
class Step:
    """One load level: `concurrency` clients, each sending its next request when the last
    one answered (closed loop), `requests` in all."""

    concurrency: int
    requests: int
    completed: int
    errors: int
    duration_s: float
    requests_per_s: float
    tokens_per_s: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    mean_ms: float
    tool: str = ""
    error_sample: str = ""

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default method), q in [0, 100]."""
    return sorted_percentile(sorted(values), q)


def step_from_latencies(
    concurrency: int, latencies_s: list[float], tokens: int, errors: int, duration_s: float, tool: str
) -> Step:
    """A step's statistics from per-request latencies of the successful requests."""
    ms = [x * 1000.0 for x in latencies_s]
    done = len(ms)
    return Step(
        concurrency=concurrency,
        requests=done + errors,
        completed=done,
        errors=errors,
        duration_s=duration_s,
        requests_per_s=done / duration_s if duration_s > 0 else 0.0,
        tokens_per_s=tokens / duration_s if duration_s > 0 else 0.0,
        p50_ms=percentile(ms, 50),
        p90_ms=percentile(ms, 90),
        p99_ms=percentile(ms, 99),
        mean_ms=statistics.fmean(ms) if ms else math.nan,
        tool=tool,
    )


def step_from_vllm_bench(result: dict[str, Any], concurrency: int) -> Step:
    """A step from `vllm bench serve`'s result dict (pooling backends: e2el percentiles)."""
    completed = int(result["completed"])
    errors = [e for e in result.get("errors", []) if e]
    requests = int(result.get("num_prompts") or completed + len(errors))
    return Step(
        concurrency=concurrency,
        requests=requests,
        completed=completed,
        errors=requests - completed,
        duration_s=float(result["duration"]),
        requests_per_s=float(result["request_throughput"]),
        tokens_per_s=float(result["total_token_throughput"]),
        p50_ms=float(result.get("p50_e2el_ms", result.get("median_e2el_ms", math.nan))),
        p90_ms=float(result.get("p90_e2el_ms", math.nan)),
        p99_ms=float(result.get("p99_e2el_ms", math.nan)),
        mean_ms=float(result.get("mean_e2el_ms", math.nan)),
        tool="vllm bench serve",
        error_sample=errors[0][:200] if errors else "",
    )


def knee(steps: list[Step], slo_p99_ms: float) -> Step | None:
    """The highest load (concurrency) whose p99 meets the SLO with no errors; None if none does."""
    ok = [s for s in steps if s.errors == 0 and s.completed > 0 and s.p99_ms <= slo_p99_ms]
    return max(ok, key=lambda s: s.concurrency) if ok else None


def requests_for(concurrency: int, per_client: int, least: int, most: int) -> int:
    """Requests in one step: `per_client` per client, within [least, most] (bounds the time)."""
    return max(least, min(most, concurrency * per_client))


LOADTEST_WORKER = Path(__file__).with_name("loadtest_worker.py")


def load_test(
    base: str,
    model: str,
    tokenizer: Path,
    spec: dict[str, Any],
    out_jsonl: Path,
    timeout_s: float,
    log: Callable[[str], None],
) -> list[Step]:
    """Run the load-test worker (in its own process: it imports vLLM's benchmark code) and
    read the steps it wrote; steps finished before a timeout are kept."""
    spec = {**spec, "base_url": base, "model": model, "tokenizer": str(tokenizer), "out": str(out_jsonl)}
    spec_path = out_jsonl.with_suffix(".spec.json")
    spec_path.write_text(json.dumps(spec))
    argv = [sys.executable, str(LOADTEST_WORKER), str(spec_path)]
    log("$ " + " ".join(argv))
    try:
        proc = subprocess.run(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            timeout=timeout_s,
        )
        for line in proc.stdout.splitlines()[-30:]:
            log("  loadtest: " + line)
    except subprocess.TimeoutExpired:
        log(f"load test stopped after {timeout_s:.0f} s; keeping the steps it finished")
    steps = []
    if out_jsonl.is_file():
        for line in out_jsonl.read_text().splitlines():
            if line.strip():
                steps.append(Step(**json.loads(line)))
    return steps


# --------------------------------------------------------------------------- GPU memory, vLLM log


def _group_pids(pgid: int) -> set[int]:
    """Processes whose process group is `pgid` (the server and its engine workers)."""
    out = set()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid:  # field 5 of /proc/PID/stat: pgrp
                out.add(int(d.name))
        except (OSError, IndexError, ValueError):
            continue
    return out


def gpu_memory(pgid: int | None) -> dict[str, Any]:
    """nvidia-smi's per-process GPU memory for the server's process group (MiB), and the
    GPU's total used memory."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return {}
    res: dict[str, Any] = {}
    try:
        q = subprocess.run(
            [exe, "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=20,
        )  # fmt: skip
        g = subprocess.run(
            [exe, "--query-gpu=memory.used,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=20,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return {}
    procs = {}
    for line in q.stdout.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit():
            procs[int(parts[0])] = int(parts[1])
    mine = _group_pids(pgid) if pgid else set()
    res["processes_mib"] = {str(p): m for p, m in procs.items()}
    res["engine_mib"] = sum(m for p, m in procs.items() if p in mine) or None
    first = g.stdout.strip().splitlines()[0].split(",") if g.stdout.strip() else []
    if len(first) == 2:
        res["gpu_used_mib"], res["gpu_total_mib"] = int(first[0]), int(first[1])
    return res


#: what vLLM's start-up log says about memory and time (0.2x wording; absent lines are skipped)
LOG_PATTERNS: dict[str, str] = {
    "weights_gib": r"Model loading took ([\d.]+) GiB",
    "kv_cache_gib": r"Available KV cache memory: ([\d.]+) GiB",
    "kv_cache_tokens": r"GPU KV cache size: ([\d,]+) tokens",
    "max_concurrency_x": r"Maximum concurrency for [\d,]+ tokens per request: ([\d.]+)x",
    "torch_compile_s": r"torch\.compile took ([\d.]+) s",
    "graph_capture_s": r"Graph capturing finished in ([\d.]+) sec",
    "init_engine_s": r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s",
    "gpu_memory_utilization": r"gpu_memory_utilization=([\d.]+)",
    "max_num_batched_tokens": r"max_num_batched_tokens=(\d+)",
    "max_num_seqs": r"max_num_seqs=(\d+)",
    "compile_cache_hit": r"(Directly load AOT compilation|Directly load the compiled graph|Loading compiled graph)",
    "compiled_now": r"(Compiling a graph for compile range)",
    "dynamo_s": r"Dynamo bytecode transform time: ([\d.]+) s",
    "profile_run_s": r"Initial profiling/warmup run took ([\d.]+) s",
    "prestart_import_s": r"mopt-prestart: imported \d+ modules in ([\d.]+) s",
}


def parse_vllm_log(text: str) -> dict[str, Any]:
    """The numbers of LOG_PATTERNS found in a vLLM log (first match each)."""
    out: dict[str, Any] = {}
    for key, pat in LOG_PATTERNS.items():
        m = re.search(pat, text)
        if not m:
            continue
        raw = m.group(1).replace(",", "")
        if key in ("compile_cache_hit", "compiled_now"):
            out[key] = True
        elif re.fullmatch(r"\d+", raw):
            out[key] = int(raw)
        else:
            with contextlib.suppress(ValueError):
                out[key] = float(raw)
    return out


# --------------------------------------------------------------------------- the end of a check


def write_outcome(
    ctx: BuildContext, out: Outcome, slo_ms: float | None, title: str, summary: Any
) -> dict[str, Any] | None:
    """A serve-check's end, for embeddings and text generation alike: passed / failures into
    the doc, serve.json, loadtest.svg (p99 against tokens/s, `title` after the served
    target's name), the `summary(doc)` lines in the log, and the error when it failed with
    on_fail = "error". The knee (None: no step met the SLO)."""
    doc = out.doc
    doc["passed"] = not out.failures
    doc["failures"] = out.failures
    (ctx.out / "serve.json").write_text(json.dumps(doc, indent=2) + "\n")
    kn: dict[str, Any] | None = doc.get("knee")
    name = doc.get("serve_target", "server")
    (ctx.out / "loadtest.svg").write_text(
        loadtest_svg([(name, doc["loadtest"], kn)], slo_ms, f"{doc.get('serve_target', '')}: {title}"),
        encoding="utf-8",
    )
    for line in summary(doc):
        ctx.log(line)
    if out.failures and ctx.params.on_fail == "error":
        raise RuntimeError("serve-check failed: " + "; ".join(out.failures))
    return kn


# --------------------------------------------------------------------------- the kind


def reference_embeddings(weights: Path, family: Any, texts: list[str], max_length: int) -> list[list[float]]:
    """fp32 PyTorch embeddings with the family's pooling (its `embed` when it has one)."""
    if isinstance(family, type):
        family = family()
    if family is not None and all(hasattr(family, m) for m in ("load", "load_tokenizer", "embed")):
        model = family.load(weights, dtype="fp32")
        tok = family.load_tokenizer(weights)
        return family.embed(model, tok, texts, max_length=max_length).tolist()  # type: ignore[no-any-return]
    import torch
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(weights))
    model = AutoModel.from_pretrained(str(weights), dtype=torch.float32).eval()
    pooling = getattr(family, "pooling", "mean")
    with torch.inference_mode():
        enc = tok(texts, padding=True, truncation=True, max_length=max_length, return_tensors="pt")
        h = model(**enc).last_hidden_state
        mask = enc["attention_mask"]
        if pooling == "last-token":
            pos = torch.arange(mask.shape[1]).unsqueeze(0)
            pooled = h[torch.arange(h.shape[0]), (mask * pos).argmax(1)]
        elif pooling == "cls":
            pooled = h[:, 0]
        else:
            m = mask.unsqueeze(-1).float()
            pooled = (h * m).sum(1) / m.sum(1).clamp(min=1e-9)
        return torch.nn.functional.normalize(pooled, dim=-1).tolist()  # type: ignore[no-any-return]


def read_texts_file(path: Path, limit: int) -> list[str]:
    from mopt_serve.modelopt_ptq import read_texts

    return read_texts(path, limit)


@dataclass
class Outcome:
    """What one serve-check found (serve.json)."""

    doc: dict[str, Any] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
