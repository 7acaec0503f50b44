"""The demo's cost: wall time of `mopt build recipes/demo.toml` from an empty store (the
Quickstart's first command), optionally side by side with an earlier checkout of mopt.

    python benchmarks/bench_demo.py [--runs 1] [--before PATH_TO_OLD_CHECKOUT]

With --before, the old checkout's code is imported instead (PYTHONPATH: it and its plugins;
same interpreter and packages), and the two builds take turns. Prints one line per build:
seconds of wall time, and what `best` picked.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mopt_ml.timing import cpu_model

ROOT = Path(__file__).resolve().parent.parent


def _pythonpath(tree: Path) -> str:
    return os.pathsep.join([str(tree), *(str(p) for p in sorted((tree / "plugins").iterdir()) if p.is_dir())])


def build_once(tree: Path, label: str, keep: Path | None = None) -> dict:
    with tempfile.TemporaryDirectory(prefix="mopt-demo-") as tmp:
        work = Path(tmp) if keep is None else keep
        if keep is not None:
            shutil.rmtree(keep, ignore_errors=True)
            keep.mkdir(parents=True)
        shutil.copytree(tree / "recipes", work / "recipes")
        (work / "mopt.toml").write_text('[store]\npath = ".mopt"\n')
        env = dict(os.environ, PYTHONPATH=_pythonpath(tree))
        t0 = time.perf_counter()
        res = subprocess.run(
            [sys.executable, "-m", "mopt", "build", "recipes/demo.toml", "--json"],
            cwd=work, env=env, capture_output=True, text=True, timeout=3600,
        )  # fmt: skip
        wall = time.perf_counter() - t0
        picked = "-"
        sel = next((work / "build").glob("minilm/cpu/best/selection.json"), None)
        if sel is not None:
            doc = json.loads(sel.read_text())
            d = doc.get("decision") or {}
            picked = doc["winner"] + (" (tie)" if d.get("tie") else "")
        return {"code": label, "exit": res.returncode, "wall_s": round(wall, 1),
                "best": picked, "stderr_tail": res.stderr[-2000:] if res.returncode else ""}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--before", type=Path, help="an earlier checkout of mopt, timed in turn with this one")
    ap.add_argument("--keep", type=Path, help="build this checkout's demo in this folder and keep it (for `mopt report`)")
    a = ap.parse_args()
    print(f"demo first build: {cpu_model()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", flush=True)  # fmt: skip
    trees = [(ROOT, "this checkout")] + ([(a.before.resolve(), f"before ({a.before})")] if a.before else [])
    for i in range(a.runs):
        for tree, label in trees:
            r = build_once(tree, label, a.keep if tree == ROOT else None)
            print(f"run {i + 1} {label}: {r['wall_s']} s wall, exit {r['exit']}, "
                  f"best: {r['best']}", flush=True)  # fmt: skip
            if r["stderr_tail"]:
                print(r["stderr_tail"], file=sys.stderr)


if __name__ == "__main__":
    main()
