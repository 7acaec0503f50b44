"""Decision stability: build a recipe's `bench` and `select` nodes again and again, under the
load of `benchmarks/noise.py`, and record what `select` decided each time.

    python benchmarks/decisions.py RECIPE [RECIPE...] --runs 5 --out DIR
        [--python PY --pythonpath PATHS --name NAME]...

Each run removes the action entries of the recipe's bench and select nodes from the store
(the rest stays cached: weights, graphs, validation), builds, and copies `selection.json`
and every `bench.json` to DIR/<name>/<recipe>/run<i>/. With several --python, the codes take
turns within each run (side by side under the same load). Prints one line per decision.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path


def _mopt(py: str, pythonpath: str, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    return subprocess.run([py, "-m", "mopt", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=3600)


def _forget(py: str, pp: str, recipe: Path) -> None:
    """Remove the bench and select nodes' action entries (they run again)."""
    plan = _mopt(py, pp, recipe.parent, "plan", recipe.name, "--json")
    if plan.returncode != 0:
        raise SystemExit(plan.stderr)
    store = recipe.parent / ".mopt"  # the experiment's mopt.toml: [store] path = ".mopt"
    for n in json.loads(plan.stdout)["nodes"]:
        key = n["status"].get("key")
        if n["kind"] in ("bench", "select") and key:
            (store / "ac" / f"{key}.json").unlink(missing_ok=True)


def _summary(sel: dict) -> str:
    d = sel.get("decision")
    if d:
        ci = d.get("ratio_ci")
        iv = f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else ""
        ratio = f"{d['ratio']:.3f}x{iv}" if d.get("ratio") else "-"
        return f"{'TIE ' if d['tie'] else ''}{d['winner']} vs {d.get('runner_up')}: {ratio} ({d.get('method')})"
    rows = {r["label"]: r for r in sel["variants"]}
    win = rows[sel["winner"]]
    losers = sorted((r for r in rows.values() if r["status"] == "lost"), key=lambda r: r["value"])
    if not losers:
        return f"{sel['winner']}"
    up = losers[0]
    return f"{sel['winner']} vs {up['label']}: {up['value'] / win['value']:.3f}x (raw p50 {win['p50_ms']:.1f} / {up['p50_ms']:.1f} ms, drift {win['drift']:.3f} / {up['drift']:.3f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("recipes", nargs="+", type=Path)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--python", action="append", default=[])
    ap.add_argument("--pythonpath", action="append", default=[])
    ap.add_argument("--name", action="append", default=[])
    a = ap.parse_args()
    codes = list(zip(a.name or ["current"], a.python or [sys.executable], a.pythonpath or [""], strict=True))
    for i in range(1, a.runs + 1):
        for recipe in a.recipes:
            recipe = recipe.resolve()
            for name, py, pp in codes:
                _forget(py, pp, recipe)
                t0 = time.time()
                res = _mopt(py, pp, recipe.parent, "build", recipe.name, "--no-check", "--json")
                dt = time.time() - t0
                dest = a.out / name / recipe.stem / f"run{i}"
                dest.mkdir(parents=True, exist_ok=True)
                (dest / "build.json").write_text(res.stdout)
                (dest / "stderr.txt").write_text(res.stderr)
                build = recipe.parent / "build"
                sel_path = next(build.glob("*/*/best/selection.json"), None)
                if res.returncode != 0 or sel_path is None:
                    print(f"{name} {recipe.stem} run{i}: build failed ({res.returncode}) in {dt:.0f} s", flush=True)
                    continue
                shutil.copy(sel_path, dest / "selection.json")
                for b in build.glob("*/*/bench*/bench.json"):
                    shutil.copy(b, dest / f"{b.parent.name}.json")
                sel = json.loads(sel_path.read_text())
                load = os.getloadavg()[0]
                print(f"{name} {recipe.stem} run{i} ({dt:.0f} s, load {load:.1f}): {_summary(sel)}", flush=True)


if __name__ == "__main__":
    main()
