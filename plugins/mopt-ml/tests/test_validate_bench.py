"""The `validate` and `bench` targets: the numbers, the gate, the reports."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import pytest

from mopt_ml.validate import GateFailed, ValidateKind


def _validate(
    runner: Any, chain: dict[str, Any], kind: str, params: dict[str, Any] | None = None
) -> tuple[Path, dict[str, Any]]:
    return runner.run(
        ValidateKind,
        params,
        inputs={
            "model": [runner.artifact(chain[kind], kind)],
            "reference": [runner.artifact(chain["weights"], "weights")],
        },
        family=chain["family"],
    )


def test_minilm_int8_passes_the_default_gate(runner: Any, minilm_chain: dict[str, Any]) -> None:
    out, meta = _validate(runner, minilm_chain, "ort-quantize")
    report = json.loads((out / "report.json").read_text())
    m = report["metrics"]
    assert report["passed"] and meta["passed"]
    assert report["texts"] == {"n": 223, "source": "shipped validation split"}
    assert m["n"] == 223
    assert 0.99 <= m["min_cosine"] <= m["mean_cosine"] < 1.0
    assert m["mean_cosine"] >= 0.995
    assert 0 < m["max_abs_diff"] < 0.1
    assert m["top1_agreement"] >= 0.9
    assert report["gates"]["min_cosine"] == {"limit": 0.99, "value": m["min_cosine"], "passed": True}
    assert report["precision"] == "int8" and report["quantization"]["mode"] == "dynamic"
    assert len(report["worst"]) == 5 and report["worst"][0]["cosine"] == pytest.approx(m["min_cosine"])


def test_fp32_graph_matches_the_reference(runner: Any, minilm_chain: dict[str, Any]) -> None:
    out, _ = _validate(
        runner, minilm_chain, "onnx", {"min_cosine": 0.9999, "min_top1": 1.0, "max_abs_diff": 1e-4}
    )
    m = json.loads((out / "report.json").read_text())["metrics"]
    assert m["min_cosine"] > 0.9999 and m["top1_agreement"] == 1.0


def test_gate_below_threshold_fails_the_build_with_the_numbers(
    runner: Any, minilm_chain: dict[str, Any]
) -> None:
    with pytest.raises(GateFailed) as err:
        _validate(runner, minilm_chain, "ort-quantize", {"min_cosine": 0.9999, "mean_cosine": 0.99999})
    msg = str(err.value)
    assert "validation gate failed" in msg
    assert "min_cosine 0.99" in msg and "< 0.9999" in msg
    assert "mean_cosine 0.99" in msg and "< 0.99999" in msg
    assert "on 223 texts" in msg
    assert msg.endswith('set on_fail = "record" on this target')  # what to do, in the one line


def test_validate_reads_the_recipe_texts(runner: Any, qwen3_chain: dict[str, Any]) -> None:
    (runner.project_dir / "val.txt").write_text("first sentence\nsecond one here\na third, longer sentence\n")
    out, meta = _validate(runner, qwen3_chain, "onnx-slim", {"data": "val.txt", "min_top1": 1.0})
    report = json.loads((out / "report.json").read_text())
    assert report["texts"] == {"n": 3, "source": "val.txt"}
    assert meta["min_cosine"] > 0.9999


def test_bench_times_the_artifact_and_the_pytorch_baseline(
    runner: Any, qwen3_chain: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    from mopt.api import PROGRESS

    from mopt_ml.bench import BenchKind

    caplog.set_level(logging.INFO, logger="mopt-ml-tests")

    params = {
        "batch_sizes": [1, 4],
        "seq_lens": [16, 32],
        "threads": 1,
        "warmup": 1,
        "min_samples": 6,
        "max_samples": 8,
        "max_seconds": 2.0,
    }
    out, meta = runner.run(
        BenchKind,
        params,
        inputs={
            "model": [runner.artifact(qwen3_chain["ort-quantize"], "ort-quantize")],
            "reference": [runner.artifact(qwen3_chain["weights"], "weights")],
        },
        family=qwen3_chain["family"],
    )
    report = json.loads((out / "bench.json").read_text())
    assert [r["backend"] for r in report["results"]] == ["onnx", "torch"]
    # a progress line per finished point, as it finishes (printed by `mopt build` without a
    # terminal too): the median, its interval, the calls and why timing stopped
    progress = [r.getMessage()[len(PROGRESS) :] for r in caplog.records if r.getMessage().startswith(PROGRESS)]
    assert len(progress) == 8, progress
    for r in report["results"]:
        for p in r["points"]:
            why = "interval within ci_rel" if p["stopped"] == "ci" else f"stopped at {p['stopped']}"
            assert p["stopped"] in ("ci", "max_samples", "max_seconds") and (p["stopped"] == "ci") == p["stable"]
            assert any(f"b={p['batch']} s={p['seq']}: p50 {p['p50_ms']:.1f} ms" in x and f"{p['samples']} calls" in x
                       and why in x for x in progress), (p, progress)  # fmt: skip
    for r in report["results"]:
        assert [(p["batch"], p["seq"]) for p in r["points"]] == [(1, 16), (4, 16), (1, 32), (4, 32)]
        for p in r["points"]:
            assert 0 < p["p50_ms"] <= p["p90_ms"] <= p["p99_ms"]
            assert 6 <= p["samples"] <= 8 and p["tokens_per_s"] == pytest.approx(
                p["batch"] * p["seq"] / p["p50_ms"] * 1000
            )
        assert r["peak_rss_mb"] >= r["rss_loaded_mb"] > r["rss_start_mb"] > 0
        assert r["threads"] == 1
    assert len(report["speedup_vs_pytorch_fp32"]) == 4
    assert report["precision"] == "int8"
    html = (out / "report.html").read_text()
    assert html.count("<svg") >= 4 and "Latency p50 vs batch size" in html
    assert "<th>interval of p50, ms</th>" in html and "p50 latency (ms)" in html
    namespaces = r'xmlns(:xlink)?="http://www.w3.org/[^"]*"'
    assert "<script" not in html and "http://" not in re.sub(namespaces, "", html)
    assert "https://" not in html
    assert meta["points"] == 4 and set(meta["p50_ms"]) == {"1x16", "4x16", "1x32", "4x32"}
    # per shape, what `mopt report` shows: p50, its interval, the calls timed, the speedup
    ours = {f"{p['batch']}x{p['seq']}": p for p in report["results"][0]["points"]}
    for shape, p in ours.items():
        assert meta["p50_ms"][shape] == round(p["p50_ms"], 2) and meta["samples"][shape] == p["samples"]
        ci = p["ci_ms"]
        assert meta["p50_ci_ms"][shape] == (None if ci is None else [round(ci[0], 2), round(ci[1], 2)])
    assert meta["speedup"] == {
        f"{s['batch']}x{s['seq']}": round(s["speedup_p50"], 3) for s in report["speedup_vs_pytorch_fp32"]
    }


def test_a_shared_baseline_is_timed_once_and_read_at_each_bench_s_speed(
    runner: Any, qwen3_chain: dict[str, Any]
) -> None:
    from mopt_ml.bench import BenchBaselineKind, BenchKind

    params = {"batch_sizes": [1, 4], "seq_lens": [16], "threads": 1, "warmup": 1, "min_samples": 6,
              "max_samples": 8, "max_seconds": 2.0}  # fmt: skip
    weights = runner.artifact(qwen3_chain["weights"], "weights")
    base_dir, base_meta = runner.run(
        BenchBaselineKind, {**params, "batch_sizes": [1]}, inputs={"reference": [weights]},
        family=qwen3_chain["family"],
    )  # fmt: skip
    base = json.loads((base_dir / "bench.json").read_text())
    assert [r["backend"] for r in base["results"]] == ["torch"]
    assert base_meta["probe_ms"] > 0 and base["results"][0]["probe"]["samples"] == 24
    # timed in the action's process (torch already imported there), its own peak memory
    b0 = base["results"][0]
    assert b0["in_process"] and b0["peak_rss_mb"] >= b0["rss_loaded_mb"] > 0
    out, meta = runner.run(
        BenchKind,
        params,
        inputs={
            "model": [runner.artifact(qwen3_chain["onnx"], "onnx")],
            "reference": [weights],
            "baseline": [runner.artifact(base_dir, "bench-baseline")],
        },
        family=qwen3_chain["family"],
    )
    report = json.loads((out / "bench.json").read_text())
    onnx, torch = report["results"]
    assert onnx["backend"] == "onnx" and onnx["probe"]["p50_ms"] > 0
    assert torch == {**base["results"][0], "shared_from": torch["shared_from"]}  # not timed again
    probe = onnx["probe"]  # the faster of the readings before and after the worker is its level
    assert probe["level_ms"] == min(probe["before_ms"], probe["after_ms"])
    ratio = probe["level_ms"] / base["results"][0]["probe"]["level_ms"]
    assert report["shared_baseline"]["probe_ratio"] == pytest.approx(ratio)
    # the baseline has no 4x16: no speedup there (and the log says to align the grids)
    [sp] = report["speedup_vs_pytorch_fp32"]
    assert (sp["batch"], sp["seq"]) == (1, 16)
    assert sp["speedup_p50"] == pytest.approx(
        torch["points"][0]["p50_ms"] * ratio / onnx["points"][0]["p50_ms"]
    )
    assert meta["points"] == 2


def test_concurrent_validates_compute_the_reference_once(
    tmp_path: Path, qwen3_chain: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading
    import time

    import numpy as np

    from mopt_ml import validate
    from mopt_ml.families import as_family

    family = as_family(qwen3_chain["family"])
    kw = {"max_length": 32, "batch_size": 4, "pad_to": None}
    texts = ["first sentence", "a second, longer sentence"]
    computed = []
    real = validate._reference

    def slow_reference(*args: Any) -> Any:  # the real computation, counted and slowed
        computed.append(1)
        time.sleep(0.5)  # the second caller arrives while this one computes
        return real(*args)

    monkeypatch.setattr(validate, "_reference", slow_reference)
    got: list[Any] = []

    def call() -> None:
        got.append(validate.reference_embeddings(family, qwen3_chain["weights"], texts, kw, (tmp_path, "d")))

    threads = [threading.Thread(target=call) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(computed) == 1 and len(got) == 2 and np.array_equal(got[0], got[1])


def test_validate_reuses_the_reference_per_weights_and_texts(
    tmp_path: Path, qwen3_chain: dict[str, Any]
) -> None:
    import numpy as np

    from mopt_ml.families import as_family
    from mopt_ml.validate import reference_embeddings

    family = as_family(qwen3_chain["family"])
    weights = qwen3_chain["weights"]
    kw = {"max_length": 32, "batch_size": 4, "pad_to": None}
    texts = ["first sentence", "a second, longer sentence", "third"]
    fresh = reference_embeddings(family, weights, texts, kw, None)
    first = reference_embeddings(family, weights, texts, kw, (tmp_path, "digest-a"))
    files = sorted(tmp_path.glob("reference-*.npy"))
    assert len(files) == 1 and np.array_equal(first, fresh)
    np.save(files[0], np.zeros_like(fresh))  # the second call must return the cached file
    assert not reference_embeddings(family, weights, texts, kw, (tmp_path, "digest-a")).any()
    # other weights, texts or settings: their own entries, computed afresh
    other = reference_embeddings(family, weights, texts, kw, (tmp_path, "digest-b"))
    assert np.array_equal(other, fresh)
    reference_embeddings(family, weights, texts[:2], kw, (tmp_path, "digest-a"))
    reference_embeddings(family, weights, texts, {**kw, "max_length": 16}, (tmp_path, "digest-a"))
    assert len(list(tmp_path.glob("reference-*.npy"))) == 4
    assert not list(tmp_path.glob(".reference-*"))  # no partial files left behind
