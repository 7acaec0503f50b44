"""How a bench action times a backend: the benchmark lock (one benchmark at a time on this
machine), a worker process per backend with its output read live, the PyTorch baseline in the
action's own process, and the drift probe timed right before and after each (`_probed`).
Shared by the embedding bench (`mopt_ml.bench`), the generation bench (`mopt_ml.genbench`) and
`select`'s finals."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mopt.api import PROGRESS

from mopt_ml.benchworker import POINT

_BENCH_LOCK = threading.Lock()


@contextlib.contextmanager
def exclusive_cpu(log: Any) -> Iterator[None]:
    """Hold the benchmark lock: one benchmark at a time in this process (mopt runs actions in
    threads) and across processes on this machine (a lock file), so two benchmarks never
    time each other. Within one build the kind is also `exclusive` (the scheduler runs
    nothing beside it); another build or program on the machine can still disturb it."""
    import fcntl
    import tempfile

    if not _BENCH_LOCK.acquire(blocking=False):
        log("waiting for another benchmark in this build to finish")
        _BENCH_LOCK.acquire()
    try:
        path = Path(tempfile.gettempdir()) / "mopt-ml-bench.lock"
        with open(path, "a") as fh:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                log(f"waiting for another process's benchmark to finish ({path})")
                fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)
    finally:
        _BENCH_LOCK.release()


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _run_worker(
    spec: dict[str, Any], tmp: Path, log: Any, *, module: str = "mopt_ml.benchworker", files: str = ""
) -> dict[str, Any]:
    """`python -m <module> SPEC OUT` in a fresh process (thread settings and peak memory of
    one backend do not leak into another's), its finished points logged live as progress;
    `files`: a prefix of the spec and result file names (the generation bench: "gen")."""
    name = spec["label"].replace(" ", "_").replace("/", "_")
    spec_path = tmp / f"{name}.{files}spec.json"
    out_path = tmp / f"{name}.{files}result.json"
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    if spec.get("threads"):
        threads = str(spec["threads"])
        env.update({"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads})
    t0 = time.perf_counter()
    lines: list[str] = []
    with subprocess.Popen(
        [sys.executable, "-m", module, str(spec_path), str(out_path)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
    ) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:  # live: a line per finished point
            line = line.rstrip("\n")
            lines.append(line)
            if line.startswith(POINT):
                log(PROGRESS + line[len(POINT) :])
    if proc.returncode != 0:
        tail = "\n".join(lines[-15:])
        raise RuntimeError(f"benchmark worker for {spec['label']} failed (exit {proc.returncode}):\n{tail}")
    result: dict[str, Any] = json.loads(out_path.read_text())
    # the worker's whole life (start, imports, load, warm-up, timing): where a bench's time goes
    result["process_seconds"] = round(time.perf_counter() - t0, 3)
    return result


class _ActionProbe:
    """The drift probe (`benchworker.Probe`) in the bench action's own process, timed right
    before and right after each backend's worker. That process only waits on the worker
    meanwhile: no other runtime's threads run beside the probe (the bias of probing inside
    a worker, between an ONNX Runtime session's spinning calls), and no process per probe
    is started (two per worker before: ~0.4 s of CPU each, seconds of wall under load).
    One session per action, so every reading of a bench is from the same session."""

    SAMPLES = 12  # per reading (two readings per worker: before and after)

    def __init__(self, path: str, threads: int) -> None:
        self.path, self.threads = path, threads
        self._probe: Any = None

    def reading(self) -> list[float]:
        from mopt_ml.benchworker import Probe

        if self._probe is None:
            self._probe = Probe(Path(self.path), self.threads)
        self._probe.times = []
        self._probe.block(self.SAMPLES)
        return [t * 1000 for t in self._probe.times]


def _run_in_process(spec: dict[str, Any], log: Any) -> dict[str, Any]:
    """`benchworker.run(spec)` in this process, for the PyTorch baseline of `bench-baseline`:
    the action's worker has torch and transformers imported already (the build's fork
    server), which a fresh worker process pays again (3-5 s of CPU quiet, 30 s of wall at
    load 12). Nothing else runs in this process meanwhile; torch's thread count is set by
    `run` and restored by mopt's runner after the action. Peak memory: VmHWM is reset
    first (/proc/self/clear_refs), so `peak_rss_mb` is this run's peak, of a process that
    has torch and transformers loaded, as a fresh torch worker has."""
    from mopt_ml import benchworker

    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")
    t0 = time.perf_counter()
    result = benchworker.run(spec, on_point=lambda line: log(PROGRESS + line))
    result["process_seconds"] = round(time.perf_counter() - t0, 3)
    result["in_process"] = True
    return result


def _probed(
    spec: dict[str, Any], tmp: Path, log: Any, in_process: bool = False, run: Any = None
) -> dict[str, Any]:
    """`run(spec, tmp, log)` (default `_run_worker`; the generation bench: `genbench.run_worker`;
    `in_process`: `_run_in_process`) between two drift-probe readings (`_ActionProbe`): the
    result's `probe` is the median of both, i.e. how fast the machine ran around it."""
    if run is None:
        run = (lambda s, _t, lg: _run_in_process(s, lg)) if in_process else _run_worker
    if not spec.get("probe_model"):
        return dict(run(spec, tmp, log))
    probe = _ACTION_PROBES.setdefault(
        (spec["probe_model"], int(spec["threads"])), _ActionProbe(spec["probe_model"], int(spec["threads"]))
    )
    before = probe.reading()
    result = dict(run(spec, tmp, log))
    after = probe.reading()
    times = before + after
    result["probe"] = {
        "p50_ms": statistics.median(times),
        "min_ms": min(times),
        "samples": len(times),
        "before_ms": statistics.median(before),
        "after_ms": statistics.median(after),
        # what drift correction uses (common.probe_level): the faster end
        "level_ms": min(statistics.median(before), statistics.median(after)),
    }
    return result


#: one probe session per model file and thread count, for the action running in this process
_ACTION_PROBES: dict[tuple[str, int], _ActionProbe] = {}


@contextlib.contextmanager
def _probes_of_this_action() -> Iterator[None]:
    """Drop the action's probe sessions (and their ONNX Runtime threads) when it ends: mopt
    runs the next action in the same warm worker process."""
    try:
        yield
    finally:
        _ACTION_PROBES.clear()
