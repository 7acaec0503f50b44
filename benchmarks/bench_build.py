"""Build-tool benchmark: mopt vs DVC and Snakemake on the peers' DAG, side by side in one run.

The DAG (../shared/bench/peers): M models × 5 chained stages, `sha1sum in > out`, the first
stage reading an S-MiB weight file. Phases: full build, no-op, `mopt plan`, all cached with
the recipe touched (new mtime, same bytes), `plan_edited` / `edited` (a comment appended to
the recipe: `plan` and `build` read it, build the graph and key every action again, every
key found in the cache: the full path), `plan_one_edited` / `one_edited` (one node's
argv changed in the recipe: that node is built, every other key hits), `again` (the same
command at once after each `one_edited`: the build typed twice, whose second must be the
no-op), touch of every weight file without a content change, one input changed. Prints a
table and the ratios.

    python benchmarks/bench_build.py                 # 200, 2,000 and 10,000 nodes, peers at 200 and 2,000
    python benchmarks/bench_build.py --no-peers      # mopt only
    python benchmarks/bench_build.py --only xlarge   # the 10,000-node case alone

The 10,000-node case (M=2000 × 5, 1 MiB weights) runs mopt only unless --xlarge-peers
(Snakemake; DVC's `repro` is O(n²) in its lock file there): its full build takes ~15 min
on 2 cores. Its store is kept under /tmp/peers/dag_M2000_S1 and reused by the next run
(`--fresh` builds it again), so later runs measure the cached phases only.
"""

from __future__ import annotations

import argparse
import csv
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from gen_mopt_dag import model_name  # noqa: E402
from gen_mopt_dag import write as write_recipe  # noqa: E402

PEERS = (HERE.parent.parent / "shared" / "bench" / "peers").resolve()


#: an installed mopt has its .pyc files; a shell with PYTHONDONTWRITEBYTECODE=1 would make
#: every run compile every module of mopt and its plugins again (~0.5 s here)
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def mopt(recipe: Path, python: str = sys.executable) -> tuple[float, dict]:
    t0 = time.perf_counter()
    proc = subprocess.run(
        [python, "-m", "mopt", "build", recipe.name, "--json", "--no-check", "-q"],
        cwd=recipe.parent, capture_output=True, text=True, env=ENV,
    )
    dt = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"mopt build failed:\n{proc.stderr[-2000:]}")
    return dt, json.loads(proc.stdout)


def mopt_plan(recipe: Path, python: str = sys.executable) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(
        [python, "-m", "mopt", "plan", recipe.name],
        cwd=recipe.parent, capture_output=True, text=True, env=ENV,
    )
    dt = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"mopt plan failed:\n{proc.stderr[-2000:]}")
    return dt


def built(data: dict) -> int:
    return data["counts"].get("built", 0)


def was_noop(data: dict) -> int:
    """1 if the build was the no-op, else 0 (`noop_stamp`: an earlier engine's word for it)."""
    return int(bool(data["io"].get("noop") or data["io"].get("noop_stamp")))


def bench_mopt(
    root: Path, m: int, reps: int, full_phases: bool, fresh: bool = True, before: str | None = None
) -> dict[str, dict[str, list]]:
    """The phases for this mopt ("mopt") and, with `before` (another installation's Python),
    for that one too ("mopt-before", in a copy of the project beside it, on the same weights):
    side by side, each phase run by one and then the other, so both see the same machine."""
    sides = [("mopt", sys.executable, write_recipe(root, m))]
    if before:
        sides.append(("mopt-before", before, write_recipe(root, m, "mopt-before")))
    res: dict[str, dict[str, list]] = {name: {} for name, _py, _recipe in sides}
    for _name, _py, recipe in sides:
        if fresh:
            for d in (recipe.parent / ".mopt", recipe.parent / "build"):
                shutil.rmtree(d, ignore_errors=True)

    def run(phase: str, edit: Any = None, plan: str | None = None) -> None:
        """The phase on each side: `edit(recipe)` first, then `plan` (a plan phase's name)."""
        for name, py, recipe in sides:
            if edit is not None:
                edit(recipe)
            if plan is not None:
                res[name].setdefault(plan, []).append((mopt_plan(recipe, py), 0, 0))
            dt, data = mopt(recipe, py)
            res[name].setdefault(phase, []).append((dt, built(data), data["io"]["hashed_bytes"], was_noop(data)))

    if fresh or not all((recipe.parent / ".mopt").is_dir() for _n, _p, recipe in sides):
        run("full")
    run("warm")  # a first build after the store was made or copied; not reported
    for _ in range(reps):
        run("noop")
    for _ in range(reps):
        for name, py, recipe in sides:
            res[name].setdefault("plan", []).append((mopt_plan(recipe, py), 0, 0))
    for _ in range(reps):
        run("all_cached", os.utime)  # new mtime, same bytes
    for i in range(reps):
        # the recipe's bytes change (a comment), its targets do not: `plan` and `build` must
        # read the recipe, build the graph and key every node again; every key hits
        run("edited", lambda r, i=i: _append(r, f"\n# bench edit {i}\n"), plan="plan_edited")
    nonce = time.time_ns()  # a new argv each run (the kept 10,000-node store holds the last run's)
    for i in range(reps):
        # one section's content changes: the last stage of model i gets its own argv (a new
        # key for that one node: it is built; every other key hits, as in `edited`)
        argv = f'["sh", "-c", "sha1sum {{in}}/out > {{out}}/out # edit {i} {nonce}"]'
        run("one_edited", lambda r, i=i, a=argv: _append(r, f"\n[{model_name(m, i)}.cpu.bench]\nargv = {a}\n"),
            plan="plan_one_edited")
        run("again")  # at once: the build typed twice
    if full_phases:
        weights = sorted(glob.glob(str(root / "weights" / "*.bin")))
        for w in weights:
            os.utime(w)
        run("touched")
        run("after_touch")
        with open(weights[len(weights) // 2], "ab") as fh:
            fh.write(b"x")
        run("incremental")
        for _ in range(reps):
            run("after_change")
    return res


def _append(recipe: Path, text: str) -> None:
    with open(recipe, "a") as fh:
        fh.write(text)


def bench_peers(m: int, s: int, reps: int, noop_only: bool, tools: str = "dvc snakemake") -> dict[str, dict[str, list]]:
    """Run the peers' measure.sh for dvc and snakemake; parse its TSV."""
    res_dir = Path("/tmp/peers/results-bench")
    res_dir.mkdir(parents=True, exist_ok=True)
    before = set(res_dir.glob("*.tsv"))
    args = ["bash", str(PEERS / "measure.sh"), "-t", tools, "-M", str(m), "-S", str(s), "-r", str(reps)]
    if noop_only:
        args += ["-n", "-f"]
    env = dict(os.environ, VENV=os.environ.get("PEERS_VENV", sys.prefix), RES=str(res_dir))
    subprocess.run(args, env=env, check=True, stdout=subprocess.DEVNULL)
    tsv = sorted(set(res_dir.glob("*.tsv")) - before)[-1]
    out: dict[str, dict[str, list]] = {}
    with open(tsv) as fh:
        rows = csv.DictReader((line for line in fh if not line.startswith("#")), delimiter="\t")
        for r in rows:
            out.setdefault(r["tool"], {}).setdefault(r["phase"], []).append(
                (float(r["seconds"]), int(r["rewritten"]), None)
            )
    return out


def fmt(xs: list | None) -> str:
    if not xs:
        return "-"
    secs = [x[0] for x in xs]
    n = max(x[1] for x in xs)
    t = f"{min(secs):.3f}" if len(secs) == 1 else f"{min(secs):.3f}/{statistics.median(secs):.3f}"
    return f"{t}s [{n}]"


def hashing() -> None:
    import hashlib
    import tempfile

    from mopt.digest import hash_file

    with tempfile.NamedTemporaryFile(dir="/tmp", delete=False) as fh:
        for _ in range(512):
            fh.write(os.urandom(1 << 20))
        path = fh.name
    try:
        hash_file(path)
        t0 = time.perf_counter()
        for _ in range(3):
            hash_file(path)
        b3 = 3 * 512 / 1024 / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        with open(path, "rb") as f:
            h = hashlib.sha256()
            while chunk := f.read(1 << 22):
                h.update(chunk)
        sha = 512 / 1024 / (time.perf_counter() - t0)
    finally:
        os.unlink(path)
    print(f"hashing 512 MiB, warm page cache: BLAKE3 (mopt.digest) {b3:.2f} GiB/s, SHA-256 {sha:.2f} GiB/s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--no-peers", action="store_true", help="measure mopt only")
    ap.add_argument("-r", type=int, default=5, help="no-op repetitions")
    ap.add_argument("--only", choices=["small", "large", "xlarge"], help="one configuration")
    ap.add_argument("--xlarge-peers", action="store_true", help="run Snakemake at 10,000 nodes too")
    ap.add_argument("--fresh", action="store_true", help="rebuild the kept 10,000-node store from empty")
    ap.add_argument("--root", default="/tmp/peers", help="where the DAGs live (default /tmp/peers)")
    ap.add_argument("--before", metavar="PYTHON", help="another mopt installation's Python: measured side by side")
    a = ap.parse_args()
    hashing()
    configs = [("small", 40, 64, True), ("large", 400, 1, False), ("xlarge", 2000, 1, False)]
    for name, m, s, full in configs:
        if a.only and a.only != name:
            continue
        root = Path(a.root) / f"dag_M{m}_S{s}"
        subprocess.run([sys.executable, str(PEERS / "gen_dag.py"), str(root), "-M", str(m), "-S", str(s),
                        "--tools", "make"], check=True, stdout=subprocess.DEVNULL)
        keep = name == "xlarge" and not a.fresh
        res: dict[str, dict[str, list]] = bench_mopt(root, m, a.r, full, fresh=not keep, before=a.before)
        peers = not a.no_peers and (name != "xlarge" or a.xlarge_peers)
        if peers:
            tools = "snakemake" if name == "xlarge" else "dvc snakemake"
            res.update(bench_peers(m, s, a.r, noop_only=not full, tools=tools))
        phases = ["full", "noop", "plan", "all_cached", "plan_edited", "edited", "plan_one_edited", "one_edited",
                  "again", "touched", "incremental", "after_change"]
        load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
        print(f"\n(load average after this case: {load} on {os.cpu_count()} CPUs: read the ratios, not the seconds)")
        print(f"\n## M={m} models × 5 stages = {m * 5} targets, weights {s} MiB each")
        print("seconds min/median [outputs rewritten]")
        print("| tool | " + " | ".join(phases) + " |")
        print("|---" * (len(phases) + 1) + "|")
        for tool, ph in res.items():
            cells = [fmt(ph.get(p) or (ph.get("full_commit") if p == "full" else None)) for p in phases]
            print(f"| {tool} | " + " | ".join(cells) + " |")
        mo = res["mopt"]
        for tool in ("mopt", "mopt-before"):
            again = res.get(tool, {}).get("again")
            if again:
                print(f"{tool} again (the build typed twice): the no-op in {sum(x[3] for x in again)} of {len(again)} runs")
        noop = min(x[0] for x in mo["noop"])
        read = max(x[2] for x in mo["noop"])
        print(f"mopt no-op: {noop:.3f} s, artifact bytes hashed during no-op: {read}")
        if "touched" in mo:
            t = mo["touched"][0]
            print(f"mopt touched: {t[0]:.3f} s, reran {t[1]}, rehashed {t[2] / 2**30:.2f} GiB")
        for peer in ("dvc", "snakemake"):
            if peer in res and res[peer].get("noop"):
                pn = min(x[0] for x in res[peer]["noop"])
                print(f"ratio no-op {peer}/mopt: {pn / noop:.1f}×")
            if peer in res and res[peer].get("touched") and "touched" in mo:
                print(f"ratio touched {peer}/mopt: {res[peer]['touched'][0][0] / mo['touched'][0][0]:.1f}×"
                      f" ({peer} reran {res[peer]['touched'][0][1]})")


if __name__ == "__main__":
    main()
