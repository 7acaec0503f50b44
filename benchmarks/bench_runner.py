"""Per-action overhead of mopt's action runners, and the no-op build, through the real CLI.

A recipe of N independent `command` actions (`sh -c 'echo i > {out}/f'`, so the work itself is
one fork + exec of sh, the same for every runner) is built clean, then again (no-op), with
`[executor] sandbox` set to each available value. Printed: the clean build's seconds per
action (wall time / N, at -j 1, so it is the overhead of one action end to end: key, lock,
scratch, worker round trip, input check, store, materialize), and the no-op build's seconds.

    python benchmarks/bench_runner.py            # N=40, 3 repetitions, medians
    python benchmarks/bench_runner.py -n 100 -r 5

`sandbox = "none"` runs each action in a warm worker process, `"bwrap"` in a warm worker
inside bubblewrap (skipped where `bwrap` is missing). On code before the runner existed
the setting is ignored and the numbers are those of the old in-thread path.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def write_project(root: Path, n: int, sandbox: str) -> Path:
    lines = ["schema = 1", "", "[models.m]", "", "[m.cpu]", "targets = ["]
    lines += [f'  "a{i:03d}",' for i in range(n)]
    lines += ["]", ""]
    for i in range(n):
        lines += [f"[m.cpu.a{i:03d}]", 'kind = "command"', f'argv = ["sh", "-c", "echo {i} > {{out}}/f"]', ""]
    (root / "r.toml").write_text("\n".join(lines))
    (root / "mopt.toml").write_text(f'[store]\npath = ".mopt"\n\n[executor]\nsandbox = "{sandbox}"\n')
    return root / "r.toml"


def build(root: Path, *args: str) -> tuple[float, dict]:
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "mopt", "build", "r.toml", "--json", "--no-check", "-q", *args],
        cwd=root,
        capture_output=True,
        text=True,
    )
    dt = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"mopt build failed:\n{proc.stderr[-2000:]}")
    return dt, json.loads(proc.stdout)


def measure(n: int, reps: int, sandbox: str, jobs: int) -> tuple[float, float]:
    clean, noop = [], []
    for _ in range(reps):
        with tempfile.TemporaryDirectory(prefix="mopt-bench-runner-") as tmp:
            root = Path(tmp)
            write_project(root, n, sandbox)
            dt, data = build(root, "-j", str(jobs))
            if data["counts"].get("built") != n:
                raise SystemExit(f"expected {n} built actions, got {data['counts']}")
            clean.append(dt)
            dt, data = build(root, "-j", str(jobs))
            if data["counts"] != {"cached": n}:
                raise SystemExit(f"expected a no-op, got {data['counts']}")
            noop.append(dt)
    return statistics.median(clean), statistics.median(noop)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=40, help="actions per build")
    ap.add_argument("-r", "--reps", type=int, default=3, help="repetitions (medians are printed)")
    ap.add_argument("-j", "--jobs", type=int, default=1, help="parallel actions")
    a = ap.parse_args()
    modes = ["none"] + (["bwrap"] if shutil.which("bwrap") else [])
    print(f"{a.n} command actions, -j {a.jobs}, median of {a.reps}")
    print(f"{'sandbox':<8} {'clean s':>8} {'ms/action':>10} {'no-op s':>8}")
    for mode in modes:
        clean, noop = measure(a.n, a.reps, mode, a.jobs)
        print(f"{mode:<8} {clean:8.2f} {1000 * clean / a.n:10.1f} {noop:8.3f}")
    if len(modes) == 1:
        print("bwrap: not installed (apt-get install bubblewrap), sandbox not measured")


if __name__ == "__main__":
    main()
