"""Head-to-head finals: `select` times its finalists interleaved in one window.

Each finalist runs in a process of its own (`python -m mopt_ml.benchworker --serve`), all
with the same thread count and environment, loaded and warmed up before any timing starts.
Then rounds: in each, the finalists in a fresh shuffled order, each runs a short block of
timed calls (~0.1 s) while the others wait on a pipe (idle: a 10 ms pause follows every block,
so no runtime's threads still spin when the next starts). Short rounds see one machine: a
burst of load that lasts seconds slows every block of a round alike, which the paired
comparison cancels. The rounds feed `mopt_ml.decide` every few rounds; the finals stop when
its answer is settled at two checks in a row, or at `max_rounds` / `max_seconds`, and say which.
"""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from mopt_ml.decide import Contestant, Decision, decide, settled

#: seconds of calls per block (the block size follows from the screening median): short, so
#: that a round (one block of each finalist) is over before the machine's load changes
BLOCK_S = 0.1
#: seconds between two blocks: a runtime's worker threads stop spinning before the next one's start
GAP_S = 0.01
#: rounds between two decisions (each is a bootstrap: a few ms of CPU that must not disturb timing)
CHECK_EVERY = 5


@dataclass
class Finalist:
    label: str
    backend: str  # "onnx" | "openvino"
    model: str  # the .onnx file, or the OpenVINO folder
    tokenizer: str  # the folder with its tokenizer
    screen_s: float  # its screening median at the point (seconds), to size its blocks
    order: tuple[Any, ...] = ()


@dataclass
class Finals:
    decision: Decision
    rounds: int
    block: dict[str, int]  # timed calls per block, by label
    stopped: str  # "settled" | "max_rounds" | "max_seconds"
    seconds: float
    times: dict[str, list[list[float]]]  # label → rounds × calls (seconds)

    def to_json(self) -> dict[str, Any]:
        return {
            "rounds": self.rounds,
            "calls_per_round": self.block,
            "stopped": self.stopped,
            "seconds": round(self.seconds, 2),
            "estimates": [
                {"label": e.label, "median_ms": e.value * 1000, "ci_low_ms": e.low * 1000,
                 "ci_high_ms": e.high * 1000, "n": e.n}
                for e in self.decision.estimates
            ],
            "times_ms": {k: [[round(t * 1000, 4) for t in r] for r in v] for k, v in self.times.items()},
        }


class _Contestant:
    """One finalist's worker process."""

    def __init__(self, f: Finalist, spec: dict[str, Any], tmp: Path, env: dict[str, str]) -> None:
        self.f = f
        path = tmp / f"finals-{len(list(tmp.glob('finals-*.json')))}.json"
        path.write_text(json.dumps(spec))
        self.err = open(tmp / f"{path.stem}.log", "w")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mopt_ml.benchworker", "--serve", str(path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.err,
            text=True,
            env=env,
        )
        self.log_path = Path(self.err.name)

    def _read(self) -> dict[str, Any]:
        out: IO[str] = self.proc.stdout  # type: ignore[assignment]
        line = out.readline()
        if not line:
            self.proc.wait()
            tail = "\n".join(self.log_path.read_text(errors="replace").splitlines()[-12:])
            raise RuntimeError(f"finals worker for {self.f.label} ended (exit {self.proc.returncode}):\n{tail}")
        return dict(json.loads(line))

    def ready(self) -> dict[str, Any]:
        return self._read()

    def block(self, n: int) -> list[float]:
        inp: IO[str] = self.proc.stdin  # type: ignore[assignment]
        inp.write(f"{n}\n")
        inp.flush()
        return list(self._read()["times"])

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.err.close()


def run_finals(
    finalists: list[Finalist],
    point: tuple[int, int],
    *,
    threads: int,
    inputs: str,
    statistic: str,
    tie_tolerance: float,
    confidence: float,
    min_rounds: int,
    max_rounds: int,
    max_seconds: float,
    tmp: Path,
    log: Callable[[str], None],
    seed: int = 0,
) -> Finals:
    """Time `finalists` at `point` (batch, seq) in interleaved rounds; decide on them. `inputs`:
    the .npz of pre-tokenized inputs (`benchworker.save_inputs`) holding the point."""
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"})
    block = {f.label: max(1, min(50, math.ceil(BLOCK_S / f.screen_s))) if f.screen_s > 0 else 5 for f in finalists}
    rng = random.Random(seed)
    workers = []
    try:
        for f in finalists:
            spec = {"backend": f.backend, "model": f.model, "tokenizer": f.tokenizer, "threads": threads,
                    "inputs": inputs, "point": list(point), "label": f.label}  # fmt: skip
            workers.append(_Contestant(f, spec, tmp, env))
        for w in workers:
            w.ready()
        times: dict[str, list[list[float]]] = {f.label: [] for f in finalists}
        order = {f.label: f.order for f in finalists}
        t0 = time.perf_counter()
        stopped, last, streak, decision = "max_rounds", None, 0, None
        for r in range(max_rounds):
            rng.shuffle(workers)
            for w in workers:
                times[w.f.label].append(w.block(block[w.f.label]))
                time.sleep(GAP_S)
            if r + 1 < min_rounds or (r + 1 - min_rounds) % CHECK_EVERY:
                continue
            decision = decide(
                [Contestant(k, v, order[k]) for k, v in times.items()], statistic, tie_tolerance, confidence, seed
            )
            answer = (decision.winner, decision.tie) if settled(decision, tie_tolerance) else None
            streak = streak + 1 if answer is not None and answer == last else (1 if answer is not None else 0)
            last = answer
            log(f"finals round {r + 1}: " + ", ".join(
                f"{e.label} {e.value * 1000:.1f} ms [{e.low * 1000:.1f}, {e.high * 1000:.1f}]"
                for e in decision.estimates
            ))  # fmt: skip
            if streak >= 2:
                stopped = "settled"
                break
            if time.perf_counter() - t0 > max_seconds:
                stopped = "max_seconds"
                break
        seconds = time.perf_counter() - t0
    finally:
        for w in workers:
            w.close()
    if decision is None:
        decision = decide([Contestant(k, v, order[k]) for k, v in times.items()], statistic, tie_tolerance, confidence, seed)
    return Finals(decision, len(next(iter(times.values()))), block, stopped, seconds, times)
