"""Varying CPU load for decision-stability runs: N processes that each spin, then sleep, for
a random 0.5-4 s at a time (seeded), until killed.

    python benchmarks/noise.py [--procs 2] [--seed 0] [--low 0.5] [--high 4]
"""

from __future__ import annotations

import argparse
import multiprocessing
import random
import signal
import sys
import time


def _churn(seed: int, low: float, high: float) -> None:
    rng = random.Random(seed)
    while True:
        end = time.perf_counter() + rng.uniform(low, high)
        while time.perf_counter() < end:
            pass
        time.sleep(rng.uniform(low, high))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--low", type=float, default=0.5)
    ap.add_argument("--high", type=float, default=4.0)
    a = ap.parse_args()
    procs = [
        multiprocessing.Process(target=_churn, args=(a.seed + i, a.low, a.high), daemon=True) for i in range(a.procs)
    ]
    for p in procs:
        p.start()

    def stop(*_: object) -> None:  # a kill of this process ends the churners too
        for p in procs:
            p.terminate()
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)
    try:
        for p in procs:
            p.join()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
