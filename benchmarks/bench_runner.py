"""Per-action overhead of mopt's action runners, and the no-op build, through the real CLI.

A recipe of N independent `command` actions (`sh -c 'echo i > {out}/f'`, so the work itself is
one fork + exec of sh, the same for every runner) is built clean, then again (no-op), with
`[executor] sandbox` set to each available value. Printed: the clean build's seconds per
action (at -j 1, so it is the overhead of one action end to end: key, lock,
scratch, worker round trip, input check, store, materialize), and the no-op build's seconds.
The per-action figure is the slope between a build of N/4 and one of N actions, so the
one-off start-up (the worker's interpreter and plugins) is reported apart.

    python benchmarks/bench_runner.py            # N=40, 3 repetitions, medians
    python benchmarks/bench_runner.py -n 100 -r 5

`sandbox = "none"` runs each action in a warm worker process, `"bwrap"` in a warm worker
inside bubblewrap (skipped where `bwrap` is missing); both fork their workers from a zygote
(fork server), and the "exec" rows (MOPT_ZYGOTE=0) start each worker as a new interpreter
instead, for comparison. `--baseline DIR` also runs the mopt
package found under DIR (e.g. `git archive <commit> mopt | tar -x -C DIR`): code from before
the runner ignores the setting and runs actions in threads of the mopt process.
"""

from __future__ import annotations

import argparse
import json
import os
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


def build(root: Path, *args: str, mopt_path: str | None = None, zygote: bool = True) -> tuple[float, dict]:
    env = dict(os.environ)
    env["MOPT_ZYGOTE"] = "1" if zygote else "0"
    if mopt_path:  # another checkout's mopt package (e.g. the code before the runner)
        env["PYTHONPATH"] = os.pathsep.join([mopt_path, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "mopt", "build", "r.toml", "--json", "--no-check", "-q", *args],
        cwd=root,
        capture_output=True,
        text=True,
        env=env,
    )
    dt = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"mopt build failed:\n{proc.stderr[-2000:]}")
    return dt, json.loads(proc.stdout)


def measure(
    n: int, reps: int, sandbox: str, jobs: int, mopt_path: str | None, zygote: bool = True
) -> tuple[float, float, float]:
    """Medians of (clean build, first rebuild: every action a hit, second rebuild: the
    no-op fast path)."""
    clean, hits, noop = [], [], []
    for _ in range(reps):
        with tempfile.TemporaryDirectory(prefix="mopt-bench-runner-") as tmp:
            root = Path(tmp)
            write_project(root, n, sandbox)
            dt, data = build(root, "-j", str(jobs), mopt_path=mopt_path, zygote=zygote)
            if data["counts"].get("built") != n:
                raise SystemExit(f"expected {n} built actions, got {data['counts']}")
            clean.append(dt)
            for times in (hits, noop):
                time.sleep(0.3)  # past the no-op stamp's racy window
                dt, data = build(root, "-j", str(jobs), mopt_path=mopt_path, zygote=zygote)
                if data["counts"] != {"cached": n}:
                    raise SystemExit(f"expected a no-op, got {data['counts']}")
                times.append(dt)
    return statistics.median(clean), statistics.median(hits), statistics.median(noop)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=40, help="actions per build")
    ap.add_argument("-r", "--reps", type=int, default=3, help="repetitions (medians are printed)")
    ap.add_argument("-j", "--jobs", type=int, default=1, help="parallel actions")
    ap.add_argument(
        "--baseline", metavar="DIR", help="also run the mopt package under DIR (e.g. an export of main)"
    )
    a = ap.parse_args()
    modes = ["none"] + (["bwrap"] if shutil.which("bwrap") else [])
    small = max(1, a.n // 4)
    print(f"{small} and {a.n} command actions, -j {a.jobs}, median of {a.reps}")
    print("ms/action: the slope between the two clean builds (what one more action costs);")
    print("fixed s: the rest of the clean build of N (start-up, plugins, the first worker)")
    print(
        f"{'runner':<22} {'clean s':>8} {'ms/action':>10} {'fixed s':>8} {'all hits s':>10} {'no-op s':>8}"
    )
    runs = [(f"baseline ({mode})", mode, a.baseline, True) for mode in modes[:1] if a.baseline]
    for mode in modes:
        name = "process (none)" if mode == "none" else "bwrap"
        runs += [(f"{name}, zygote", mode, None, True), (f"{name}, exec", mode, None, False)]
    for label, mode, path, zygote in runs:
        clean_small, _, _ = measure(small, a.reps, mode, a.jobs, path, zygote)
        clean, hits, noop = measure(a.n, a.reps, mode, a.jobs, path, zygote)
        slope = (clean - clean_small) / (a.n - small) if a.n > small else clean / a.n
        fixed = clean - slope * a.n
        print(f"{label:<22} {clean:8.2f} {1000 * slope:10.1f} {fixed:8.2f} {hits:10.3f} {noop:8.3f}")
    if len(modes) == 1:
        print("bwrap: not installed (apt-get install bubblewrap), sandbox not measured")


if __name__ == "__main__":
    main()
