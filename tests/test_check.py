"""`mopt check`: a table of recipes with known violations gives exactly the expected findings,
a table of valid recipes gives none; the CLI prints the breakdown and exits 2 on errors.

The recipes (tests/check_recipes/) use the toy kinds of tests/check_fixture_plugin.py, which
carry the param names of the real engine and serving kinds.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import check_fixture_plugin as fx
import pytest
from click.testing import CliRunner

from mopt.check import check_graph, run_checks
from mopt.graph import build_graph
from mopt.recipe import load_recipe

RECIPES = Path(__file__).parent / "check_recipes"


@pytest.fixture(scope="module")
def registry() -> Any:
    return fx.registry()


def _check(name: str, registry: Any) -> Any:
    recipe = load_recipe(RECIPES / name, registry)
    return run_checks(build_graph(recipe, registry))


# (recipe, {(severity, code, section, key)}) — exactly these findings, nothing else
VIOLATIONS = [
    ("bad_fp8_on_a10.toml", {("error", "precision-unsupported", "qwen.a10", "precision")}),
    ("bad_bf16_on_t4.toml", {("error", "precision-unsupported", "qwen.t4", "precision")}),
    ("bad_nvfp4_on_h100.toml", {("error", "precision-unsupported", "qwen.h100", "dtype")}),
    (
        "bad_fp8_quantization_a10.toml",
        {
            ("warning", "precision-unsupported", "qwen.a10", "quantization"),
            ("warning", "precision-unsupported", "qwen.a10", "kv_cache_dtype"),
        },
    ),
    ("bad_engine_oom_rtx4060.toml", {("error", "memory-over-capacity", "qwen.rtx4060", "max_batch_size")}),
    ("bad_sweep_one_variant.toml", {("error", "memory-over-capacity", "qwen.rtx4060", "max_batch_size")}),
    (
        "bad_weights_over_budget.toml",
        {
            ("error", "memory-over-capacity", "qwen.rtx4060", "gpu_memory_utilization"),
        },
    ),
    ("bad_kv_too_small.toml", {("error", "kv-cache-too-small", "qwen.rtx4060", "max_model_len")}),
    ("bad_kv_short.toml", {("warning", "kv-cache-short", "qwen.rtx4060", "max_num_seqs")}),
    (
        "bad_tp3_heads.toml",
        {
            ("error", "tp-heads", "qwen.h100x4", "tensor_parallel_size"),
            ("error", "tp-kv-heads", "qwen.h100x4", "tensor_parallel_size"),
        },
    ),
    ("bad_tp_over_gpus.toml", {("error", "tp-over-gpus", "qwen.h200", "tp_size")}),
    ("bad_tokens_per_block.toml", {("error", "tokens-per-block-not-pow2", "qwen.h200", "tokens_per_block")}),
    ("bad_max_model_len.toml", {("error", "seq-over-max-position", "qwen.h200", "max_model_len")}),
    (
        "bad_bert_seq_and_shapes.toml",
        {
            ("error", "seq-over-max-position", "minilm.rtx4090", "shapes.input_ids"),
        },
    ),
    (
        "bad_engine_on_cpu.toml",
        {
            ("error", "kind-needs-gpu", "qwen.cpu", "hardware"),
            ("warning", "precision-unsupported", "qwen.cpu", "dtype"),
            ("error", "toy-engine-on-cpu", "qwen.cpu", None),  # not also kind-needs-gpu
        },
    ),
    (
        "bad_fraction.toml",
        {
            ("error", "fraction-out-of-range", "qwen.h200", "kv_cache_free_gpu_memory_fraction"),
        },
    ),
    (
        "bad_kind_checks.toml",
        {
            ("error", "toy-opt-level", "qwen.rtx4090", "opt_level"),
            ("warning", "kind-check-failed", "qwen.rtx4090", None),
        },
    ),
    ("bad_kind_replaces_generic.toml", {("error", "toy-tpb", "qwen.h200", "tokens_per_block")}),
    (
        "bad_unknown_config.toml",
        {
            ("info", "model-config-unknown", "uncached.h200", "config"),
            ("info", "model-config-unknown", "synthbert.l40s", "config"),
        },
    ),
    (
        "bad_config_json.toml",
        {
            ("error", "model-config-invalid", "models.brokencfg", "config"),
            ("info", "model-config-unknown", "brokencfg.h200", "config"),
        },
    ),
]

VALID = [
    "ok_engine_rtx4060.toml",
    "ok_vllm_h200.toml",
    "ok_trtllm_h200.toml",
    "ok_fp8_nvfp4.toml",
    "ok_tp_divides.toml",
    "ok_bert_sources.toml",
    "ok_synthetic_defaults.toml",
]


@pytest.mark.parametrize(("recipe", "expected"), VIOLATIONS, ids=[v[0] for v in VIOLATIONS])
def test_recipe_with_violation_gives_exactly_the_expected_findings(
    recipe: str, expected: set[tuple[str, str, str, str | None]], registry: Any
) -> None:
    report = _check(recipe, registry)
    got = [(f.severity, f.code, f.section, f.key) for f in report.findings]
    assert len(got) == len(set(got)), got
    assert set(got) == expected
    for f in report.findings:
        assert f.message and f.fix, f  # every finding says what and what to do
        if f.section and not f.section.startswith("models."):
            assert f.severity == "info" or f.target, f


@pytest.mark.parametrize("recipe", VALID)
def test_valid_recipe_gives_no_findings(recipe: str, registry: Any) -> None:
    report = _check(recipe, registry)
    assert report.findings == []


def test_every_gpu_section_gets_an_estimate(registry: Any) -> None:
    report = _check("ok_fp8_nvfp4.toml", registry)
    assert {e.section for e in report.estimates} == {"qwen.l40s", "qwen.b200", "qwen.rtx5070"}
    assert all(e.estimate.fits for e in report.estimates)


def test_cpu_sections_get_the_model_estimate(registry: Any) -> None:
    report = _check("ok_engine_rtx4060.toml", registry)
    (cpu,) = [e for e in report.estimates if e.section == "qwen.cpu"]
    assert cpu.target == "(model)" and cpu.estimate.capacity is None
    assert cpu.estimate.weights == 595_776_512 * 4  # fp32 on CPU


def test_memory_finding_carries_the_numbers_and_the_largest_fit(registry: Any) -> None:
    report = _check("bad_engine_oom_rtx4060.toml", registry)
    (f,) = report.findings
    assert "8 GiB of rtx4060-laptop" in f.message and "weights" in f.message and "activations" in f.message
    (est,) = report.estimates
    b = est.largest["max_batch_size"]
    s = est.largest["max_seq_len"]
    assert b is not None and 1 < b < 128 and s is not None and 1 < s < 8192
    assert f"max_batch_size ≤ {b} at max_seq_len 8192" in f.fix
    assert f"max_seq_len ≤ {s} at batch 128" in f.fix


def test_kv_fix_values_actually_fit(registry: Any) -> None:
    """The max_model_len the fix proposes passes the check."""
    report = _check("bad_kv_too_small.toml", registry)
    (est,) = report.estimates
    proposed = est.largest["max_model_len"]
    assert proposed is not None and f"max_model_len ≤ {proposed}" in report.findings[0].fix
    from mopt.check import role_values, workload_for
    from mopt.estimate import ModelDims, estimate

    cfg = json.loads((RECIPES / "configs" / "qwen3-embedding-0.6b.json").read_text())
    dims = ModelDims.from_config(cfg, fx.ToyQwen3)
    hw = registry.hardware["rtx4060-laptop"]
    params = {"max_model_len": proposed, "max_num_seqs": 4, "gpu_memory_utilization": 0.5}
    spec = workload_for(role_values(fx.ToyVllm, params), dims, hw)
    assert spec is not None
    e = estimate(dims, spec[0], hw.memory_gb)
    assert (e.kv_tokens_available or 0) >= proposed


def test_selection_limits_the_sections_checked(registry: Any) -> None:
    recipe = load_recipe(RECIPES / "bad_unknown_config.toml", registry)
    graph = build_graph(recipe, registry)
    findings = check_graph(graph, graph.select(["synthbert.*"]))
    assert {f.section for f in findings} == {"synthbert.l40s"}


def test_package_and_path_sources_give_the_config(registry: Any) -> None:
    report = _check("ok_bert_sources.toml", registry)
    assert report.configs["minilm"].endswith("models/minilm/config.json")
    assert report.configs["minipkg"].endswith("config.json")


def test_synthetic_source_uses_the_family_defaults(registry: Any) -> None:
    report = _check("ok_synthetic_defaults.toml", registry)
    origin = report.configs["synth"]
    assert "synthetic defaults" in origin and "vocab_size assumed" in origin
    assert {e.target for e in report.estimates} == {"toy-trt", "toy-vllm"}


def test_generic_rules_follow_roles_not_param_names(tmp_path: Path, registry: Any) -> None:
    """toy-store's `dtype` has no role: nvfp4 there is the kind's business, not a precision
    the A10 lacks; its `max_len` has the seq_len role (through json_schema_extra) and is
    checked against the model's positions. toy-onnx marks `dtype` as a precision."""
    (tmp_path / "r.toml").write_text(
        f'schema = 1\nextends = ["{RECIPES / "models.toml"}"]\n'
        '[qwen.a10]\ntargets = ["toy-store", "toy-onnx"]\n'
        'toy-store = { dtype = "nvfp4", max_len = 40000 }\ntoy-onnx = { dtype = "nvfp4" }\n'
    )
    report = run_checks(build_graph(load_recipe(tmp_path / "r.toml", registry), registry))
    got = {(f.code, f.target, f.key) for f in report.findings if f.severity == "error"}
    assert got == {
        ("precision-unsupported", "toy-onnx", "dtype"),
        ("seq-over-max-position", "toy-store", "max_len"),
    }


def test_check_of_a_recipe_takes_well_under_a_second(registry: Any) -> None:
    recipe = load_recipe(RECIPES / "ok_tp_divides.toml", registry)
    graph = build_graph(recipe, registry)
    t0 = time.perf_counter()
    for _ in range(5):
        run_checks(graph)
    assert (time.perf_counter() - t0) / 5 < 0.5


# --------------------------------------------------------------------------- CLI (in process)


@pytest.fixture
def cli(registry: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The real `mopt` app with the fixture plugin in its registry."""
    import mopt.plugins
    from mopt.cli import _register_extra_commands, app

    monkeypatch.setattr(mopt.plugins, "get_registry", lambda *a, **k: registry)
    _register_extra_commands()
    runner = CliRunner()
    return lambda *args: runner.invoke(app, list(args), catch_exceptions=False, prog_name="mopt")


def test_cli_check_prints_breakdown_and_exits_2_on_errors(cli: Any) -> None:
    r = cli("check", str(RECIPES / "bad_engine_oom_rtx4060.toml"))
    assert r.exit_code == 2
    assert "memory-over-capacity" in r.output and "fix:" in r.output
    assert "weights" in r.output and "activations" in r.output and "largest that fits" in r.output
    assert "1 error" in r.output


def test_cli_check_valid_recipe_exits_0_with_tables(cli: Any) -> None:
    r = cli("check", str(RECIPES / "ok_vllm_h200.toml"))
    assert r.exit_code == 0, r.output
    assert "no findings" in r.output and "KV cache" in r.output and "0 errors" in r.output


def test_cli_check_json(cli: Any) -> None:
    r = cli("check", str(RECIPES / "bad_tp3_heads.toml"), "--json")
    assert r.exit_code == 2
    data = json.loads(r.output)
    assert data["ok"] is False and data["counts"]["error"] == 2
    assert {f["code"] for f in data["findings"]} == {"tp-heads", "tp-kv-heads"}
    assert data["estimates"][0]["bytes"]["weights"] > 0
    assert set(data["findings"][0]) == {"severity", "code", "section", "target", "key", "message", "fix"}


def test_cli_check_strict_fails_on_warnings(cli: Any) -> None:
    assert cli("check", str(RECIPES / "bad_kv_short.toml")).exit_code == 0
    assert cli("check", str(RECIPES / "bad_kv_short.toml"), "--strict").exit_code == 2


def test_cli_check_selector(cli: Any) -> None:
    r = cli("check", str(RECIPES / "bad_engine_on_cpu.toml"), "qwen.cpu:toy-onnx", "--json")
    data = json.loads(r.output)
    assert [f["code"] for f in data["findings"]] == ["precision-unsupported"]
    assert r.exit_code == 0


def test_cli_doctor_with_recipe_lists_targets(cli: Any) -> None:
    r = cli("doctor", str(RECIPES / "ok_trtllm_h200.toml"), "--json")
    assert r.exit_code == 0
    data = json.loads(r.output)
    (t,) = data["targets"]
    assert t["id"] == "qwen.h200:toy-trtllm" and t["requires"] == ["gpu", "python:tensorrt_llm"]
    if not data["machine"]["gpu"]["visible"]:
        assert t["buildable"] is False and any("no NVIDIA GPU" in r for r in t["reasons"])
