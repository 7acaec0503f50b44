"""`select` in a text-generation section: generation gates exclude, bench.json
`mopt-genbench/1` numbers rank; the embedding selection is untouched (test_select.py)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
from mopt.api import Artifact, BuildContext, HardwareProfile

from mopt_ml.select import NoWinner, SelectKind, gen_objective, select, select_generation

CPU = HardwareProfile(name="cpu", description="cpu", device="cpu", gpu_count=0)


def step(n: int, tok_s: float, ttft_p99: float, mode: str = "batch") -> dict[str, Any]:
    return {
        mode: n,
        "prompt_len": 128,
        "output_len": 64,
        "requests": 4 * n,
        "samples": 4,
        "stable": True,
        "ttft_ms": {"p50": ttft_p99 * 0.8, "p90": ttft_p99 * 0.9, "p99": ttft_p99, "mean": ttft_p99 * 0.8},
        "itl_ms": {"p50": 1000 / tok_s, "p90": 1100 / tok_s, "p99": 1200 / tok_s, "mean": 1000 / tok_s},
        "e2e_ms": {"p50": 1.0, "p90": 1.0, "p99": 1.0, "mean": 1.0},
        "output_tok_s": tok_s,
    }


def variant(root: Path, label: str, passed: bool, kl: float, steps: list[dict], base_tok_s: float = 10.0):
    cand = root / label
    cand.mkdir()
    (cand / "model.onnx").write_bytes(b"x" * (100 if "int8" in label else 400))
    v = root / f"validate-{label}"
    v.mkdir()
    failed = [] if passed else [f"top1_agreement 0.7000 < 0.9; kl_mean {kl:.4f} > 0.05"]
    (v / "report.json").write_text(
        json.dumps(
            {
                "format": "mopt-validate/1",
                "task": "text-generation",
                "passed": passed,
                "metrics": {
                    "top1_agreement": 0.99 if passed else 0.7,
                    "ppl_ratio": 1.01,
                    "kl_mean": kl,
                    "greedy_prefix": 0.9,
                },
            }
        )
    )
    b = root / f"bench-{label}"
    b.mkdir()
    base = [{**s, "output_tok_s": base_tok_s} for s in steps]
    (b / "bench.json").write_text(
        json.dumps(
            {
                "format": "mopt-genbench/1",
                "task": "text-generation",
                "mode": "batch",
                "results": [
                    {"label": label, "peak_rss_mb": 500.0, "peak_gpu_mb": None, "steps": steps},
                    {"label": "pytorch-fp32-eager", "peak_rss_mb": 900.0, "steps": base},
                ],
            }
        )
    )
    inputs = {"model": [label]}
    return (
        Artifact(cand, "ort-quantize" if "int" in label else "onnx", label, "c" * 64, {}, label),
        Artifact(
            v,
            "validate",
            "validate",
            "v" * 64,
            {"passed": passed, "failed_gates": failed},
            f"v[{label}]",
            inputs,
        ),
        Artifact(b, "bench", "bench", "b" * 64, {}, f"b[{label}]", inputs),
    )


@pytest.fixture
def sweep(tmp_path: Path) -> tuple[list[Artifact], list[Artifact], list[Artifact]]:
    vs = [
        variant(tmp_path, "onnx", True, 0.0, [step(1, 20.0, 90.0), step(4, 60.0, 300.0)]),
        variant(tmp_path, "int8", True, 0.01, [step(1, 30.0, 60.0), step(4, 80.0, 500.0)]),
        variant(tmp_path, "int4", False, 0.2, [step(1, 50.0, 40.0), step(4, 150.0, 150.0)]),
    ]
    return [v[0] for v in vs], [v[1] for v in vs], [v[2] for v in vs]


def test_fastest_variant_that_keeps_the_generation_gates_wins(sweep: Any) -> None:
    sel = select_generation(*sweep, {}, SelectKind.Params())
    assert sel.objective == "max_output_tok_s" and sel.winner == "int8"
    rows = {r.label: r for r in sel.rows}
    assert rows["int8"].step == 4 and rows["int8"].value == 80.0  # the largest step by default
    assert rows["onnx"].status == "lost" and "60.0 tok/s vs 80.0 tok/s (0.75x)" in rows["onnx"].why
    assert (
        rows["int4"].status == "excluded"
        and "failed its validation gate: top1_agreement 0.7000" in rows["int4"].why
    )
    doc = sel.to_json()
    assert doc["params"]["objective"] == "max_output_tok_s" and doc["variants"][0]["label"] == "int8"


def test_objectives_at_a_step_and_under_a_ttft_slo(sweep: Any) -> None:
    at1 = select_generation(*sweep, {}, SelectKind.Params(objective="min_ttft_p99", batch_size=1))
    assert at1.winner == "int8" and next(r for r in at1.rows if r.label == "int8").value == 60.0
    # TTFT p99 <= 300 ms: onnx's batch 4 (60 tok/s) qualifies, int8's batch 4 (500 ms) does not
    slo = select_generation(
        *sweep, {}, SelectKind.Params(objective="max_output_tok_s_under_ttft", ttft_slo_ms=300)
    )
    assert slo.winner == "onnx"
    assert {r.label: r.value for r in slo.rows}["int8"] == 30.0
    none = select_generation(
        *sweep, {}, SelectKind.Params(objective="max_output_tok_s_under_ttft", ttft_slo_ms=10)
    )
    assert none.winner is None
    assert all(r.status == "excluded" for r in none.rows)
    assert "no step meets TTFT p99 <= 10.0 ms" in next(r for r in none.rows if r.label == "onnx").why


def test_drift_between_benches_is_normalized_by_the_baseline(tmp_path: Path) -> None:
    # int8 was timed on a machine twice as busy (its baseline ran at half speed): scaled up, it wins
    a = variant(tmp_path, "onnx", True, 0.0, [step(1, 20.0, 90.0)], base_tok_s=10.0)
    b = variant(tmp_path, "int8", True, 0.01, [step(1, 15.0, 90.0)], base_tok_s=5.0)
    arts = ([a[0], b[0]], [a[1], b[1]], [b[2], a[2]])
    assert select_generation(*arts, {}, SelectKind.Params(normalize=True)).winner == "int8"
    assert select_generation(*arts, {}, SelectKind.Params(normalize=False)).winner == "onnx"
    # baselines not timed to precision (stable false): no normalization, the raw numbers decide
    for b_art in arts[2]:
        doc = json.loads((b_art.path / "bench.json").read_text())
        for st in doc["results"][1]["steps"]:
            st["stable"] = False
        (b_art.path / "bench.json").write_text(json.dumps(doc))
    sel = select_generation(*arts, {}, SelectKind.Params(normalize=True))
    assert sel.winner == "onnx" and all(r.drift == 1.0 for r in sel.rows)


def test_the_default_objective_is_the_tasks_after_the_engines_params_round_trip(sweep: Any) -> None:
    # the engine hands an action its params as a full dump (runner: Params.model_validate of
    # params.model_dump), so every field counts as set there: the default must still apply
    params = SelectKind.Params.model_validate(SelectKind.Params().model_dump(mode="json"))
    assert "objective" in params.model_fields_set
    assert gen_objective(params) == "max_output_tok_s"
    assert select_generation(*sweep, {}, params).objective == "max_output_tok_s"
    assert select(*sweep, {}, params).objective == "min_latency_p99"  # an embedding section's


def test_embedding_objectives_are_refused_for_generation() -> None:
    assert gen_objective(SelectKind.Params()) == "max_output_tok_s"
    with pytest.raises(ValueError, match="objective 'min_latency_p50' is for embeddings; a text-generation"):
        gen_objective(SelectKind.Params(objective="min_latency_p50"))
    with pytest.raises(ValueError, match="needs ttft_slo_ms"):
        SelectKind.Params(objective="max_output_tok_s_under_ttft")


def test_kind_copies_the_winner_and_fails_with_the_table_when_none_passes(tmp_path: Path, sweep: Any) -> None:
    cands, vals, benches = sweep

    def ctx(out: Path, vals: list[Artifact], **params: Any) -> BuildContext:
        out.mkdir()
        return BuildContext(
            out=out,
            tmp=tmp_path,
            params=SelectKind.Params(**params),
            inputs={"candidates": cands, "validate": vals, "bench": benches},
            model_name="chat",
            family=None,
            task="text-generation",
            source=None,
            hardware=CPU,
            section="chat.cpu",
            target="best",
            project_dir=tmp_path,
            logger=logging.getLogger("genselect-test"),
        )

    meta = SelectKind().run(ctx(tmp_path / "best", vals))
    assert (
        meta["winner"] == "int8" and meta["task"] == "text-generation" and meta["winner_output_tok_s"] == 80.0
    )
    assert (tmp_path / "best" / "model.onnx").stat().st_size == 100
    assert json.loads((tmp_path / "best" / "selection.json").read_text())["winner"] == "int8"
    with pytest.raises(NoWinner, match=r"no variant of chat\.cpu passed the gates") as err:
        SelectKind().run(ctx(tmp_path / "none", [vals[2]]))
    assert "EXCLUDED: no validate result" in str(err.value) and "top-1" in str(err.value)
