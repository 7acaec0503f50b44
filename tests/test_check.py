"""`mopt check`: a table of recipes with known violations gives exactly the expected findings,
a table of valid recipes gives none; the CLI prints the breakdown and exits 2 on errors.

The recipes (tests/check_recipes/) use the toy kinds of tests/check_fixture_plugin.py, which
carry the param names of the real engine and serving kinds.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import check_fixture_plugin as fx
import pytest
from click.testing import CliRunner

from mopt.check import run_checks
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

# text-generation sections (model `chat`: Qwen3-0.6B's config.json)
VIOLATIONS += [
    ("gen_laptop_32k.toml", {("warning", "kv-cache-short", "chat.rtx4060", "max_num_seqs")}),
    (
        "gen_errors.toml",
        {
            ("error", "seq-over-max-position", "chat.h200", "max_model_len"),
            ("warning", "kv-cache-short", "chat.h200", "max_num_seqs"),
            ("error", "tp-heads", "chat.h100x4", "tp_size"),
            ("error", "tp-kv-heads", "chat.h100x4", "tp_size"),
            ("error", "kv-cache-too-small", "chat.t4", "max_model_len"),
        },
    ),
    (
        "gen_defaults.toml",
        {("info", "kv-cache-fit", "chat.rtx4060", None), ("info", "kv-cache-fit", "chat.h200", None)},
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
    from mopt.estimate import estimate
    from mopt.family import model_dims

    cfg = json.loads((RECIPES / "configs" / "qwen3-embedding-0.6b.json").read_text())
    dims = model_dims(cfg, fx.ToyQwen3)
    hw = registry.hardware["rtx4060-laptop"]
    params = {"max_model_len": proposed, "max_num_seqs": 4, "gpu_memory_utilization": 0.5}
    spec = workload_for(role_values(fx.ToyVllm, params), dims, hw, fx.ToyVllm().kv_pool(hw, "embedding"))
    assert spec is not None
    e = estimate(dims, spec[0], hw.memory_gb)
    assert (e.kv_tokens_available or 0) >= proposed


def test_selection_limits_the_sections_checked(registry: Any) -> None:
    recipe = load_recipe(RECIPES / "bad_unknown_config.toml", registry)
    graph = build_graph(recipe, registry)
    findings = run_checks(graph, graph.select(["synthbert.*"])).findings
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


def test_a_kind_crashing_in_check_shows_its_traceback_on_request(
    cli: Any, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    r = cli("check", str(RECIPES / "bad_kind_checks.toml"))
    assert "kind-check-failed" in r.output and "Traceback" not in r.output + capfd.readouterr().err
    monkeypatch.setenv("MOPT_TRACEBACK", "1")
    r = cli("check", str(RECIPES / "bad_kind_checks.toml"))
    err = capfd.readouterr().err
    assert "kind-check-failed" in r.output and "Traceback (most recent call last)" in err + r.output
    assert "in check" in err + r.output  # the plugin's own frame


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


# --------------------------------------------------------------------------- text generation


def _finding(report: Any, code: str, section: str) -> Any:
    (f,) = [f for f in report.findings if f.code == code and f.section == section]
    return f


def test_generation_laptop_32k_says_what_fits(registry: Any) -> None:
    """The classic failure: 32k context × 8 sequences of Qwen3-0.6B on an 8 GB laptop GPU."""
    f = _finding(_check("gen_laptop_32k.toml", registry), "kv-cache-short", "chat.rtx4060")
    assert f.message.startswith(
        "rtx4060-laptop 8 GiB: max_model_len 32,768 × max_num_seqs 8 needs 28.00 GiB of KV cache "
        "(112 KiB/token, bf16); 5.54 GiB is left in 0.9 × 8 GiB = 7.20 GiB: fits max_num_seqs ≤ 1 at 32,768 "
        "or max_model_len ≤ 6,478 at 8; sequences beyond that queue. Besides the KV cache: weights 1.11 GiB"
    ), f.message
    assert f.fix == (
        "max_num_seqs ≤ 1 for full-length sequences; or max_model_len ≤ 6,478 for 8 concurrent sequences; "
        'or kv_cache_dtype = "fp8" (halves the KV cache)'
    )


def test_generation_errors_carry_the_numbers_and_a_fix(registry: Any) -> None:
    report = _check("gen_errors.toml", registry)
    f = _finding(report, "seq-over-max-position", "chat.h200")
    assert f.message.startswith("max_model_len = 65536 over chat's max_position_embeddings 40960")
    assert f.fix.startswith("keep max_model_len ≤ 40960")
    assert _finding(report, "tp-heads", "chat.h100x4").message == (
        "tp_size = 3 does not divide the 16 attention heads of chat"
    )
    f = _finding(report, "tp-kv-heads", "chat.h100x4")
    assert f.message == (
        "tp_size = 3 and the 8 KV heads of chat: neither divides the other, so KV heads can be neither "
        "split nor replicated evenly"
    )
    assert f.fix == "use tp_size in {1, 2, 4, 8, 16} for chat"
    f = _finding(report, "kv-cache-too-small", "chat.t4")
    assert f.message.startswith(
        "the KV cache left in 0.2 × 15 GiB = 3.00 GiB of toy-t4 holds 12,508 tokens (1.34 GiB at 112 KiB/token), "
        "fewer than one max_model_len = 40,960 sequence (4.38 GiB); the runtime refuses to start."
    ), f.message
    assert f.fix == "set max_model_len ≤ 12508, or gpu_memory_utilization = 0.41"


def test_generation_sections_without_limits_get_a_serving_kinds_defaults_and_what_fits(registry: Any) -> None:
    report = _check("gen_defaults.toml", registry)
    f = _finding(report, "kv-cache-fit", "chat.rtx4060")
    assert f.severity == "info" and f.message == (
        "rtx4060-laptop 8 GiB: max_model_len 40,960 × max_num_seqs 256 needs 1120.00 GiB of KV cache "
        "(112 KiB/token, bf16); 5.70 GiB is left in 0.92 × 8 GiB = 7.36 GiB: fits max_num_seqs ≤ 1 at 40,960 "
        "or max_model_len ≤ 208 at 256 (the defaults of kind 'toy-vllm'; no target of this section sets them)"
    )
    est = {e.section: e for e in report.estimates}
    assert est["chat.h200"].largest == {"max_num_seqs": 29, "max_model_len": 40960}
    assert est["chat.h200"].estimate.workload.batch == 1024  # vLLM's default on a >= 70 GiB GPU
    cpu = est["chat.cpu"].estimate
    assert cpu.capacity is None and cpu.kv_cache == 229_376 * 40_960  # fp32 KV of one full context


def test_without_a_serving_kinds_defaults_the_core_assumes_no_runtime(monkeypatch: pytest.MonkeyPatch) -> None:
    """No kind says `baseline` (mopt-serve off, the toy vLLM kind's pool not a baseline): a
    chat section with no serving target gets the KV cache of one full context, no runtime's
    defaults and no finding about them."""
    pool = fx.ToyVllm.kv_pool
    monkeypatch.setattr(fx.ToyVllm, "kv_pool", lambda self, hw, task: replace(pool(self, hw, task), baseline=False))
    report = _check("gen_defaults.toml", fx.registry(disable=("mopt-serve",)))
    assert [f for f in report.findings if f.code == "kv-cache-fit"] == []
    h200 = next(e for e in report.estimates if e.section == "chat.h200")
    assert h200.basis == (
        "text-generation, bf16 (no serving kind gives its runtime's defaults), KV cache for 1 × 40,960 tokens "
        "(the model's context)"
    )
    assert h200.estimate.workload.batch == 1 and h200.estimate.kv_cache == 114_688 * 40_960


def test_fp8_kv_cache_halves_the_bytes_per_token(registry: Any) -> None:
    from mopt.check import role_values, workload_for
    from mopt.estimate import estimate
    from mopt.family import model_dims

    dims = model_dims(
        json.loads((RECIPES / "configs" / "qwen3-0.6b.json").read_text()), fx.ToyQwen3Chat
    )
    hw = registry.hardware["rtx4060-laptop"]
    got = {}
    for kv in ("auto", "fp8"):
        params = {"max_model_len": 32768, "max_num_seqs": 8, "kv_cache_dtype": kv}
        spec = workload_for(role_values(fx.ToyVllm, params), dims, hw, fx.ToyVllm().kv_pool(hw, "text-generation"))
        assert spec is not None
        got[kv] = estimate(dims, spec[0], hw.memory_gb)
    assert got["auto"].kv_per_token == 2 * 28 * 8 * 128 * 2 and got["fp8"].kv_per_token == 2 * 28 * 8 * 128
    assert got["fp8"].kv_tokens_available == pytest.approx(2 * got["auto"].kv_tokens_available, rel=1e-6)


def test_kv_bytes_per_token_match_vllm_on_the_h200() -> None:
    """Recorded on the H200 (tests/data/h200-2026-12-01, vLLM 0.26.0): for Qwen3-0.6B's body
    (Qwen3-Embedding-0.6B, the same 28 layers × 8 KV heads × 128), vLLM reported a KV cache of
    126.51 GiB holding 1,184,464 tokens (max_num_seqs 256, max_num_batched_tokens 16384):
    126.51 GiB / 1,184,464 = 114,688 B/token (to the log's 0.01 GiB rounding), which is
    2 × 28 × 8 × 128 × 2 B (bf16), what mopt's estimator uses for the chat model too."""
    from mopt.estimate import GIB, kv_bytes_per_token
    from mopt.family import model_dims

    doc = json.loads(
        (Path(__file__).parent / "data/h200-2026-12-01/serve-check-tuned-s256-t16384/serve.json").read_text()
    )
    log = doc["vllm_log"]
    assert (log["kv_cache_gib"], log["kv_cache_tokens"]) == (126.51, 1184464)
    measured = log["kv_cache_gib"] * GIB / log["kv_cache_tokens"]
    chat = model_dims(
        json.loads((RECIPES / "configs" / "qwen3-0.6b.json").read_text()), fx.ToyQwen3Chat
    )
    ours = kv_bytes_per_token(chat, "bf16")
    assert ours == 114_688
    assert abs(measured - ours) / ours < 0.005 / 126.51  # within the log's rounding
    assert chat.max_position == 40960 and (chat.layers, chat.kv_heads, chat.head_dim) == (28, 8, 128)


def test_generation_kv_capacity_against_vllm_on_the_h200(registry: Any) -> None:
    """Recorded on the H200 (tests/data/h200-gen-2026-12-01/gen-memory.json, vLLM 0.26.0):
    `vllm serve` of a Qwen3-0.6B-shape chat model with every default (bf16, max_model_len
    40,960, gpu_memory_utilization 0.92, chunked prefill at 8,192 tokens) reported 114,688
    KV bytes per token and a KV cache of 1,188,352 tokens; an FP8 ModelOpt export at
    utilization 0.3, max_model_len 2,048, eager: 379,344 tokens. mopt check's estimate for the
    same settings (text-generation, the profile's 141 GiB) is within 1.5 % of both."""
    from mopt.check import role_values, workload_for
    from mopt.estimate import estimate
    from mopt.family import model_dims

    doc = json.loads((Path(__file__).parent / "data/h200-gen-2026-12-01/gen-memory.json").read_text())
    rep = doc["vllm_reported"]
    dims = model_dims({**doc["config"], "model_type": "qwen3"}, fx.ToyQwen3Chat)
    assert dims.param_counts().total == doc["params"] == 596_049_920
    h200 = registry.hardware["h200"]
    spec = workload_for(
        role_values(fx.ToyVllm, {"dtype": "bfloat16"}), dims, h200, fx.ToyVllm().kv_pool(h200, "text-generation")
    )
    assert spec is not None
    w, _ = spec
    assert (w.batch, w.seq_len, w.num_tokens, w.memory_fraction) == (
        1024,
        40960,
        8192,
        0.92,
    )  # vLLM's defaults
    e = estimate(dims, w, h200.memory_gb)
    assert e.kv_per_token == rep["kv_bytes_per_token"] == 114_688
    err = (e.kv_tokens_available - rep["kv_cache_tokens"]) / rep["kv_cache_tokens"]
    assert abs(err) < 0.015, err  # seen: +0.76 % (the profile's 141 GiB is 0.9 % above the card's 139.8)
    fp8 = doc["fp8_eager_check"]
    params = {
        "dtype": "bfloat16",
        "quantization": "fp8",
        "gpu_memory_utilization": 0.3,
        "max_model_len": 2048,
    }
    spec = workload_for(role_values(fx.ToyVllm, params), dims, h200, fx.ToyVllm().kv_pool(h200, "text-generation"))
    assert spec is not None
    e = estimate(dims, spec[0], h200.memory_gb)
    err = (e.kv_tokens_available - fp8["kv_cache_tokens"]) / fp8["kv_cache_tokens"]
    assert abs(err) < 0.015, err
