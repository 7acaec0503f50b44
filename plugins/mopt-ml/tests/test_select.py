"""`select`: the best variant of a sweep. Unit tests on hand-made validate / bench results
(the numbers are chosen, so every outcome is known), then end to end through the `mopt` CLI
on a real tiny model: a sweep, a variant that cannot build here, an objective change that
re-runs only select, and an all-failing sweep."""

from __future__ import annotations

import html
import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from mopt.api import Artifact, Missing

from mopt_ml.select import NoWinner, SelectKind, render_table, select

# --------------------------------------------------------------------------- unit


def _variant(
    root: Path,
    label: str,
    *,
    min_cos: float,
    mean_cos: float,
    p50: float,
    p99: float | None = None,
    size: int = 1000,
    passed: bool = True,
    points: list[tuple[int, int, float, float]] | None = None,
    rss: float = 500.0,
    baseline: float | None = None,
    probe: float | None = None,
    shared: dict[str, Any] | None = None,
    probe_ends: tuple[float, float] | None = None,
) -> tuple[Artifact, Artifact, Artifact]:
    """A candidate folder of `size` bytes, its validate report and its bench result."""
    cand = root / "cand" / label
    cand.mkdir(parents=True)
    (cand / "model.onnx").write_bytes(b"x" * size)
    val = root / "val" / label
    val.mkdir(parents=True)
    failed = [] if passed else [f"min_cosine {min_cos:.4f} < 0.99"]
    (val / "report.json").write_text(
        json.dumps({"metrics": {"min_cosine": min_cos, "mean_cosine": mean_cos, "top1_agreement": 1.0},
                    "passed": passed})
    )
    ben = root / "bench" / label
    ben.mkdir(parents=True)
    pts = points or [(32, 128, p50, p99 if p99 is not None else p50 * 1.1)]
    results = [{"peak_rss_mb": rss, "points": [{"batch": b, "seq": s, "p50_ms": a, "p99_ms": c} for b, s, a, c in pts]}]
    if probe is not None:  # the drift probe, timed between the variant's calls
        results[0]["probe"] = {"p50_ms": probe, "min_ms": probe, "samples": 10}
        if probe_ends is not None:  # the readings right before and right after the worker
            results[0]["probe"].update(before_ms=probe_ends[0], after_ms=probe_ends[1], level_ms=min(probe_ends))
    if baseline is not None:  # the PyTorch reference, timed in the same bench run (or shared)
        results.append({"points": [{"batch": b, "seq": s, "p50_ms": baseline, "p99_ms": baseline} for b, s, *_ in pts]})
    (ben / "bench.json").write_text(json.dumps({"results": results, "shared_baseline": shared}))
    return (
        Artifact(cand, "ort-quantize", "int8", "d-" + label, {"precision": "int8"}, label=label),
        Artifact(val, "validate", "validate", "v-" + label, {"passed": passed, "failed_gates": failed},
                 label=f"validate[{label}]", input_labels={"model": [label], "reference": ["weights"]}),
        Artifact(ben, "bench", "bench", "b-" + label, {}, label=f"bench[{label}]",
                 input_labels={"model": [label], "reference": ["weights"]}),
    )


def _select(variants: list[tuple[Artifact, Artifact, Artifact]], missing: dict[str, list[Missing]] | None = None,
            **params: Any) -> Any:
    return select(
        [v[0] for v in variants],
        [v[1] for v in variants],
        [v[2] for v in variants],
        missing or {},
        SelectKind.Params(**params),
    )


def test_the_fastest_passing_variant_wins_and_every_other_says_why(tmp_path: Path) -> None:
    vs = [
        _variant(tmp_path, "fast-but-wrong", min_cos=0.93, mean_cos=0.97, p50=300, passed=False),
        _variant(tmp_path, "fast", min_cos=0.995, mean_cos=0.998, p50=400),
        _variant(tmp_path, "slow", min_cos=0.9999, mean_cos=0.9999, p50=600),
        _variant(tmp_path, "fast-below-own-gate", min_cos=0.991, mean_cos=0.996, p50=350),
    ]
    missing = {"candidates": [Missing("trt", "trt-engine", "unbuildable", "unbuildable here: needs tensorrt")]}
    sel = _select(vs, missing, objective="min_latency_p50", min_cosine=0.992)
    assert sel.winner == "fast"
    rows = {r.label: r for r in sel.rows}
    assert rows["fast"].status == "winner"
    assert rows["slow"].status == "lost" and "600.0 ms vs 400.0 ms (1.50x, no interval; bench)" in rows["slow"].why
    assert rows["fast-but-wrong"].status == "excluded"
    assert rows["fast-but-wrong"].why == "failed its validation gate: min_cosine 0.9300 < 0.99"
    assert rows["fast-below-own-gate"].why == "min cosine 0.9910 < 0.992"
    assert rows["trt"].status == "unbuilt" and rows["trt"].why == "unbuildable here: needs tensorrt"
    assert rows["fast"].bytes == 1000 and rows["fast"].throughput == pytest.approx(32 / 0.4)
    # rows: winner, then losers by value, then excluded, then unbuilt
    assert [r.status for r in sel.rows] == ["winner", "lost", "excluded", "excluded", "unbuilt"]
    table = render_table(sel)
    assert "WINNER" in table and "needs tensorrt" in table and "0.9300" in table


def test_a_missing_validate_or_bench_excludes_with_the_reason(tmp_path: Path) -> None:
    a = _variant(tmp_path, "a", min_cos=0.999, mean_cos=0.999, p50=100)
    b = _variant(tmp_path, "b", min_cos=0.999, mean_cos=0.999, p50=50)
    c = _variant(tmp_path, "c", min_cos=0.999, mean_cos=0.999, p50=10)
    missing = {
        "validate": [Missing("validate[b]", "validate", "failed", "RuntimeError: boom", {"model": ["b"]})],
        "bench": [Missing("bench[c]", "bench", "blocked", "input x failed", {"model": ["c"]})],
    }
    sel = select([a[0], b[0], c[0]], [a[1], c[1]], [a[2], b[2]], missing, SelectKind.Params())
    rows = {r.label: r for r in sel.rows}
    assert sel.winner == "a"
    assert rows["b"].why == "validate failed: RuntimeError: boom"
    assert rows["c"].why == "bench blocked: input x failed"


def test_ties_are_broken_deterministically(tmp_path: Path) -> None:
    vs = [
        _variant(tmp_path, "zeta", min_cos=0.999, mean_cos=0.9990, p50=100, size=500),
        _variant(tmp_path, "alpha", min_cos=0.999, mean_cos=0.9990, p50=100, size=500),
        _variant(tmp_path, "small", min_cos=0.999, mean_cos=0.9990, p50=100, size=400),
        _variant(tmp_path, "accurate", min_cos=0.999, mean_cos=0.9995, p50=100.5, size=900),
    ]
    winners = set()
    for seed in range(6):  # the order the inputs come in does not matter
        order = list(vs)
        random.Random(seed).shuffle(order)
        winners.add(_select(order, objective="min_latency_p50", tie_tolerance=0.0).winner)
    assert winners == {"small"}  # exact tie on 100 ms, equal accuracy: the smaller artifact
    # 100.5 is within 1 % of 100: a tie, and the higher mean cosine takes it
    sel = _select(vs, objective="min_latency_p50", tie_tolerance=0.01)
    assert sel.winner == "accurate"
    assert sel.decision is not None and sel.decision["tie"] is True
    assert next(r.why for r in sel.rows if r.label == "accurate").startswith("tie, won the tie-break")
    assert "tied with accurate" in next(r.why for r in sel.rows if r.label == "small")
    # equal in everything but the name: the recipe's order decides
    only = [v for v in vs if v[0].label in ("zeta", "alpha")]
    assert _select(only, objective="min_latency_p50").winner == "zeta"
    assert _select(only[::-1], objective="min_latency_p50").winner == "alpha"


def test_objectives_read_the_right_numbers(tmp_path: Path) -> None:
    vs = [
        # low p50, bad tail; big memory
        _variant(tmp_path, "spiky", min_cos=0.999, mean_cos=0.999, p50=90, p99=300, rss=900,
                 points=[(1, 128, 5, 6), (32, 128, 90, 300)]),
        # higher p50, steady tail; small memory
        _variant(tmp_path, "steady", min_cos=0.999, mean_cos=0.999, p50=100, p99=110, rss=400,
                 points=[(1, 128, 8, 9), (32, 128, 100, 110)]),
    ]
    assert _select(vs, objective="min_latency_p50").winner == "spiky"
    assert _select(vs, objective="min_latency_p99").winner == "steady"
    assert _select(vs, objective="max_throughput").winner == "spiky"
    assert _select(vs, objective="min_memory").winner == "steady"
    assert _select(vs, objective="min_latency_p50", batch_size=1).winner == "spiky"
    # within 150 ms p99, spiky can only run batch 1 (200 seq/s); steady runs 32 (320 seq/s)
    sel = _select(vs, objective="max_throughput_under_latency", latency_budget_ms=150)
    assert sel.winner == "steady"
    assert {r.label: round(r.value) for r in sel.rows} == {"steady": 320, "spiky": 200}
    # nothing fits 4 ms: all excluded
    sel = _select(vs, objective="max_throughput_under_latency", latency_budget_ms=4)
    assert sel.winner is None and all("p99 <= 4.0 ms" in r.why for r in sel.rows)
    sel = _select(vs, objective="min_latency_p50", max_memory_mb=500)
    assert sel.winner == "steady"
    assert next(r.why for r in sel.rows if r.label == "spiky") == "peak memory 900 MB > 500 MB"


def test_params_need_a_budget_for_the_budget_objective() -> None:
    with pytest.raises(ValueError, match="latency_budget_ms"):
        SelectKind.Params(objective="max_throughput_under_latency")


def test_no_winner_fails_with_the_table(tmp_path: Path) -> None:
    import logging

    from mopt.api import BuildContext, HardwareProfile

    vs = [
        _variant(tmp_path, "x", min_cos=0.90, mean_cos=0.95, p50=100, passed=False),
        _variant(tmp_path, "y", min_cos=0.91, mean_cos=0.95, p50=90, passed=False),
    ]
    out = tmp_path / "out"
    out.mkdir()
    ctx = BuildContext(
        out=out, tmp=tmp_path / "t", params=SelectKind.Params(),
        inputs={"candidates": [v[0] for v in vs], "validate": [v[1] for v in vs], "bench": [v[2] for v in vs]},
        model_name="m", family=None, task="embedding", source=None,
        hardware=HardwareProfile(name="cpu", description="cpu", device="cpu", gpu_count=0),
        section="m.cpu", target="best", project_dir=tmp_path, logger=logging.getLogger("t"),
    )
    with pytest.raises(NoWinner) as exc:
        SelectKind().run(ctx)
    msg = str(exc.value)
    assert msg.startswith("no variant of m.cpu passed the gates:")
    assert "min_cosine 0.9000 < 0.99" in msg and "min_cosine 0.9100 < 0.99" in msg
    assert list(out.iterdir()) == []


# --------------------------------------------------------------------------- end to end

RECIPE = """\
schema = 1

[models.tiny]
family = "qwen3"
source = { synthetic = "qwen3", seed = 1 }

[tiny.cpu]
hardware = "cpu"
targets = ["weights", "onnx", "int8", "compiled", "validate", "bench", "best"]

[tiny.cpu.sweep]
"int8.per_channel" = [true, false]

[tiny.cpu.int8]
kind = "ort-quantize"
smooth = false

[tiny.cpu.compiled]           # needs a CUDA GPU (`mopt check` says so: --no-check): unbuildable here
kind = "torch-compile"

[tiny.cpu.validate]
min_cosine = MIN
on_fail = "record"

[tiny.cpu.bench]
batch_sizes = [2]
seq_lens = [16]
max_seconds = 2
baseline = false

[tiny.cpu.best]
kind = "select"
objective = "OBJECTIVE"
"""


def mopt(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mopt", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=600)


def _write(tmp: Path, objective: str = "min_latency_p50", min_cos: str = "0.5", extra: str = "") -> None:
    (tmp / "r.toml").write_text(RECIPE.replace("OBJECTIVE", objective).replace("MIN", min_cos) + extra)


def test_sweep_select_end_to_end(tmp_path: Path) -> None:
    pytest.importorskip("mopt_torch", reason="the unbuildable variant is a torch-compile target (mopt-torch)")
    (tmp_path / "mopt.toml").write_text('[store]\npath = ".mopt"\n')
    _write(tmp_path)
    first = mopt(tmp_path, "build", "r.toml", "--json", "--keep-going", "--no-check")
    # torch-compile cannot build without a GPU: the build says so (exit 1), best still picks
    assert first.returncode == 1, first.stderr
    states = {n["id"]: n for n in json.loads(first.stdout)["nodes"]}
    assert states["tiny.cpu:compiled"]["status"] == "unbuildable"
    assert states["tiny.cpu:best"]["status"] == "built", states["tiny.cpu:best"]
    best = tmp_path / "build/tiny/cpu/best"
    sel = json.loads((best / "selection.json").read_text())
    rows = {r["label"]: r for r in sel["variants"]}
    assert set(rows) == {"onnx", "int8@per_channel=true", "int8@per_channel=false", "compiled"}
    assert rows["compiled"]["status"] == "unbuilt"
    assert rows["compiled"]["why"].startswith("unbuildable here: no NVIDIA GPU")
    measured = {k: r for k, r in rows.items() if r["status"] in ("winner", "lost")}
    assert len(measured) == 3
    # the benches screen (raw p50, the drift probe still timed); the finalists are timed side by
    # side, interleaved, and the decision rests on that: a winner beyond the tie band, or a tie
    assert all(r["probe_ms"] > 0 and r["value"] == pytest.approx(r["p50_ms"]) for r in measured.values())
    d, fin = sel["decision"], sel["finals"]
    assert d["method"] == "finals" and fin["ran"] and fin["stopped"] in ("settled", "max_rounds", "max_seconds")
    win = rows[sel["winner"]]
    assert d["winner"] == sel["winner"] and win["status"] == "winner" and win["measured"] == "finals"
    finalists = [r for r in measured.values() if r["measured"] == "finals"]
    assert len(finalists) >= 2 and all(r["ci_low"] <= r["median"] <= r["ci_high"] and r["n"] > 0 for r in finalists)
    assert d["tie"] or d["ratio_ci"][0] > 1 + d["tie_tolerance"]
    assert len(fin["times_ms"][sel["winner"]]) == fin["rounds"]
    # the winner's files are the build output, with the table and the plot beside them
    assert (best / "model.onnx").is_file() and (best / "pareto.svg").read_text().startswith("<svg")
    assert "<table>" in (best / "selection.html").read_text()

    # a new objective: only best runs again
    _write(tmp_path, objective="min_memory")
    second = json.loads(mopt(tmp_path, "build", "r.toml", "--json", "--keep-going", "--no-check").stdout)
    ran = {n["id"] for n in second["nodes"] if n["status"] == "built"}
    assert ran == {"tiny.cpu:best"}
    picked = json.loads((best / "selection.json").read_text())
    assert picked["objective"] == "min_memory"
    # the build says what was picked and where it is
    again = mopt(tmp_path, "build", "r.toml", "--keep-going", "--no-check")
    assert f"selected tiny.cpu: {picked['winner']} (min_memory; 3 of 4 variants passed) → {best}" in again.stderr
    # ... then its ranking (value, interval where there is one, n, what it rests on), the
    # reason of each variant out of the running, and why the winner won
    lines = again.stderr.splitlines()
    at = lines.index(next(x for x in lines if x.startswith("selected tiny.cpu:")))
    ranking = lines[at + 1 : at + 6]
    assert ranking[0].startswith(f"  1. {picked['winner']}: ") and " MB (n=" in ranking[0]
    assert [x.split(":")[0].strip() for x in ranking[1:3]] == [f"{i}. {r['label']}" for i, r in
                                                               enumerate(picked["variants"][1:3], 2)]  # fmt: skip
    assert ranking[3].startswith("  -  compiled: unbuilt: unbuildable here")
    assert ranking[4].startswith(("  why: ", "  tie: ")) and ranking[4].endswith(picked["decision"]["why"])

    # the report shows the sweep: the winner on best's row and the Pareto plot inline
    rep = mopt(tmp_path, "report", "r.toml", "-o", "report.html")
    assert rep.returncode == 0, rep.stderr
    page = (tmp_path / "report.html").read_text()
    assert "data:image/svg+xml;base64," in page and "selection.html" in page
    # each variant's row says what best made of it (its `verdicts`): the winner starred
    win = picked["winner"]
    assert f'<tr class="winner" data-id="tiny.cpu:{win}">' in page
    for r in picked["variants"]:
        if r["status"] in ("winner", "lost"):
            assert html.escape(f"best: {r['status']} — {r['why']}") in page, r

    # only the INT8 variants as candidates, under a gate neither passes: validate records,
    # best fails with the table of why
    _write(tmp_path, min_cos="0.99999999", extra='input = ["int8"]\n')
    third = mopt(tmp_path, "build", "r.toml", "--keep-going", "--no-check")
    assert third.returncode == 1
    failed = next(x for x in third.stderr.splitlines() if x.startswith("FAILED tiny.cpu:best"))
    assert "no variant of tiny.cpu passed the gates" in failed
    # the table is in the log that the failure message points at
    assert "failed its validation gate: min_cosine" in third.stderr, third.stderr[-3000:]


def test_latencies_are_compared_through_each_bench_s_own_reference(tmp_path: Path) -> None:
    # "a" was timed while the machine was slow (its reference took 500 ms), "b" while fast
    # (400 ms): raw, b looks faster; against the median reference (450 ms) a is
    vs = [
        _variant(tmp_path, "a", min_cos=0.999, mean_cos=0.999, p50=100, baseline=500),
        _variant(tmp_path, "b", min_cos=0.999, mean_cos=0.999, p50=90, baseline=400),
    ]
    sel = _select(vs, objective="min_latency_p50", normalize=True)
    rows = {r.label: r for r in sel.rows}
    assert sel.winner == "a"
    assert rows["a"].value == pytest.approx(90.0) and rows["b"].value == pytest.approx(101.25)
    assert rows["a"].p50_ms == 100 and rows["a"].drift == pytest.approx(0.9)
    assert _select(vs, objective="min_latency_p50", normalize=False).winner == "b"
    assert _select(vs, objective="max_throughput", normalize=True).winner == "a"


def test_the_drift_probe_takes_precedence_over_the_reference(tmp_path: Path) -> None:
    # both benches read one shared baseline (400 ms); "a" ran while the machine was slow
    # (probe 12 ms), "b" while fast (8 ms): against the median probe (10 ms) a is faster
    vs = [
        _variant(tmp_path, "a", min_cos=0.999, mean_cos=0.999, p50=100, baseline=400, probe=12.0,
                 shared={"target": "baseline", "probe_ratio": 1.2}),
        _variant(tmp_path, "b", min_cos=0.999, mean_cos=0.999, p50=90, baseline=400, probe=8.0,
                 shared={"target": "baseline", "probe_ratio": 0.8}),
    ]
    sel = _select(vs, objective="min_latency_p50", normalize=True)
    rows = {r.label: r for r in sel.rows}
    assert sel.winner == "a"
    assert rows["a"].drift == pytest.approx(10 / 12) and rows["b"].drift == pytest.approx(10 / 8)
    assert rows["a"].value == pytest.approx(100 * 10 / 12) and rows["b"].value == pytest.approx(112.5)
    # the shared baseline is read at each run's machine speed (x its probe ratio)
    assert rows["a"].baseline_ms == pytest.approx(480) and rows["b"].baseline_ms == pytest.approx(320)
    assert "no finals: no finals runner" in render_table(sel)
    # one bench without a probe (timed before it existed): all fall back to the references
    old = tmp_path / "old"
    old.mkdir()
    mixed = [vs[0], _variant(old, "c", min_cos=0.999, mean_cos=0.999, p50=95, baseline=500)]
    rows = {r.label: r for r in _select(mixed, objective="min_latency_p50", normalize=True).rows}
    assert rows["a"].drift == pytest.approx(490 / 480) and rows["c"].drift == pytest.approx(490 / 500)


def test_a_slow_reading_at_one_end_of_a_bench_does_not_rescale_it(tmp_path: Path) -> None:
    # what a quiet 2-core machine gave (demo, 2026-12-01): one bench's probe read 26 ms right
    # before its worker and 18 ms right after (median of both: 26), every other bench 16-17 ms.
    # Scaled by the median, "ov-bf16" (230 ms) would beat "int8" (147 ms); the faster end
    # (level_ms) says the machine ran at its usual speed around it.
    vs = [
        _variant(tmp_path, "ov-bf16", min_cos=1.0, mean_cos=1.0, p50=230, probe=26.1, probe_ends=(26.4, 17.9)),
        _variant(tmp_path, "int8", min_cos=0.999, mean_cos=0.999, p50=147, probe=16.6, probe_ends=(16.3, 16.6)),
        _variant(tmp_path, "ov", min_cos=1.0, mean_cos=1.0, p50=236, probe=16.0, probe_ends=(15.9, 16.5)),
    ]
    sel = _select(vs, objective="min_latency_p50", normalize=True)
    rows = {r.label: r for r in sel.rows}
    assert sel.winner == "int8"
    assert rows["ov-bf16"].probe_ms == pytest.approx(17.9) and rows["int8"].probe_ms == pytest.approx(16.3)
    assert rows["ov-bf16"].drift == pytest.approx(16.3 / 17.9)
    # results from before level_ms was recorded: their median, as before
    old = tmp_path / "old"
    old.mkdir()
    legacy = [_variant(old, "a", min_cos=0.999, mean_cos=0.999, p50=100, probe=12.0),
              _variant(old, "b", min_cos=0.999, mean_cos=0.999, p50=90, probe=8.0)]
    assert _select(legacy, objective="min_latency_p50", normalize=True).winner == "a"


def test_serving_targets_take_the_winner(tmp_path: Path) -> None:
    pytest.importorskip("mopt_serve", reason="triton-repo is in mopt-serve")
    pytest.importorskip("mopt_image", reason="image is in mopt-image")
    digest = "0" * 64
    (tmp_path / "r.toml").write_text(f"""\
schema = 1
[models.tiny]
family = "qwen3"
source = {{ synthetic = "qwen3", seed = 1 }}
[tiny.cpu]
hardware = "cpu"
targets = ["weights", "onnx", "int8", "validate", "bench", "best", "triton-repo", "image"]
[tiny.cpu.int8]
kind = "ort-quantize"
[tiny.cpu.best]
kind = "select"
[tiny.cpu.image]
input = ["best"]
base = "docker.io/library/python:3.12-slim@sha256:{digest}"
""")
    plan = mopt(tmp_path, "plan", "r.toml", "--json")
    assert plan.returncode == 0, plan.stderr
    nodes = {n["id"]: n for n in json.loads(plan.stdout)["nodes"]}
    # triton-repo prefers select over the section's other model artifacts; image when named
    assert nodes["tiny.cpu:triton-repo"]["inputs"]["model"] == ["tiny.cpu:best"]
    # (`base`: an optional base-image target of the section; none here)
    assert nodes["tiny.cpu:image"]["inputs"] == {
        "serve": ["tiny.cpu:triton-repo"], "model": ["tiny.cpu:best"], "files": [], "base": []
    }
    # select gathers every candidate (any kind producing a tested format, in section order)
    # and every validate / bench of the section in one node
    assert nodes["tiny.cpu:best"]["inputs"] == {
        "candidates": ["tiny.cpu:onnx", "tiny.cpu:int8"],
        "validate": ["tiny.cpu:validate[onnx]", "tiny.cpu:validate[int8]"],
        "bench": ["tiny.cpu:bench[onnx]", "tiny.cpu:bench[int8]"],
        "serve": [],  # serve-check results (max_throughput_under_slo): none in this section
    }


def test_memory_is_the_gpu_peak_for_gpu_benchmarks(tmp_path: Path) -> None:
    a = _variant(tmp_path, "a", min_cos=0.999, mean_cos=0.999, p50=10, rss=100)
    b = _variant(tmp_path, "b", min_cos=0.999, mean_cos=0.999, p50=10, rss=900)
    bench = json.loads((b[2].path / "bench.json").read_text())
    bench["results"][0]["peak_gpu_mb"] = 50.0  # a GPU backend: its process RSS is not the point
    (b[2].path / "bench.json").write_text(json.dumps(bench))
    sel = _select([a, b], objective="min_memory")
    assert sel.winner == "b" and {r.label: r.memory_mb for r in sel.rows} == {"a": 100.0, "b": 50.0}
