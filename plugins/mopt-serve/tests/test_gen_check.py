"""serve-check for text generation, on CPU: the step statistics, knee and prefix-caching effect
on `vllm bench serve` results recorded on the H200 (tests/data/h200-gen-2026-12-01, 2026-12-01,
vLLM 0.26.0, a random Qwen3-0.6B-shaped model); the endpoint checks and the greedy verification
against a small OpenAI-compatible streaming server; the load-test worker's generation path
against a stand-in for vLLM's benchmark module (what it asks `vllm bench serve` for)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from mopt_serve.common import DEFAULT_KL_GATES
from mopt_serve.gen_check import (
    endpoint_checks,
    gen_gate_failures,
    gen_knee,
    gen_step_from_bench,
    greedy_completions,
    held_out_distribution,
    prefix_effect,
    served_prompt_logprobs,
    summary_lines,
    teacher_forced,
    token_id,
)
from mopt_serve.serve_check import ServeCheckKind
from mopt_serve.server import LOADTEST_WORKER, free_port, local_vllm

ROOT = Path(__file__).resolve().parents[3]
DATA = ROOT / "tests/data/h200-gen-2026-12-01"
FAKE = Path(__file__).with_name("fake_openai_gen_server.py")
SWEEP = [1, 8, 32, 128, 256]


def recorded(name: str) -> dict:
    return json.loads((DATA / "bench" / f"{name}.json").read_text())


def recorded_steps() -> list[dict]:
    return [gen_step_from_bench(recorded(f"bf16-chat-c{c}")).to_json() for c in SWEEP]


# --------------------------------------------------------------------------- recorded on the H200


def test_steps_from_recorded_vllm_bench_results():
    steps = recorded_steps()
    assert [s["concurrency"] for s in steps] == SWEEP  # from the file's max_concurrency
    s32 = steps[2]
    assert s32["completed"] == s32["requests"] == 128 and s32["errors"] == 0
    assert s32["ttft_p99_ms"] == pytest.approx(122.87, abs=0.01)
    assert s32["itl_p50_ms"] == pytest.approx(2.45, abs=0.01)
    assert s32["output_tokens_per_s"] == pytest.approx(9441.99, abs=0.01)
    # the generic keys select and the plot read are the generation ones
    assert s32["tokens_per_s"] == s32["output_tokens_per_s"] and s32["p99_ms"] == s32["ttft_p99_ms"]
    # throughput grows with concurrency up to 128 and falls at 256 (TTFT p99 839 ms there)
    tps = [s["output_tokens_per_s"] for s in steps]
    assert tps[:4] == sorted(tps[:4]) and tps[4] < tps[3]


def test_knee_under_a_ttft_slo_on_recorded_steps():
    steps = recorded_steps()
    assert gen_knee(steps, 300.0)["concurrency"] == 32  # c=128 has p99 TTFT 415 ms
    assert gen_knee(steps, 500.0)["concurrency"] == 128
    assert gen_knee(steps, 20.0) is None  # even one client waits 28 ms for its first token
    bad = [dict(s) for s in steps]
    bad[2]["errors"] = 1
    assert gen_knee(bad, 300.0)["concurrency"] == 8  # a step with a failed request is no knee


def test_prefix_caching_effect_on_recorded_probe():
    shared = gen_step_from_bench(recorded("bf16-prefix-shared")).to_json()
    unshared = gen_step_from_bench(recorded("bf16-prefix-unshared")).to_json()
    # /metrics deltas of the same run (docs/h200-gen-2026-12-01/phase1/bf16-summary.json)
    shared["metrics_delta"] = {
        "vllm:prefix_cache_queries_total": 184320.0,
        "vllm:prefix_cache_hits_total": 162816.0,
    }
    unshared["metrics_delta"] = {
        "vllm:prefix_cache_queries_total": 184320.0,
        "vllm:prefix_cache_hits_total": 0.0,
    }
    pe = prefix_effect(shared, unshared)
    assert pe["ttft_p50_ratio"] == pytest.approx(125.54 / 67.93, rel=1e-3)
    assert pe["hit_rate_shared"] == pytest.approx(0.8833, abs=1e-4) and pe["hit_rate_unshared"] == 0.0
    doc = {"loadtest": recorded_steps(), "knee": gen_knee(recorded_steps(), 300.0), "ttft_slo_ms": 300.0,
           "prefix_caching": pe, "verify": {"top1": 0.984, "tokens": 64, "max_rank": 1}}  # fmt: skip
    text = "\n".join(summary_lines(doc))
    assert "knee (p99 TTFT <= 300.0 ms): concurrency 32" in text and "hit rate 0.8833 vs 0.0" in text


def test_recorded_memory_is_the_kv_cache_arithmetic():
    """What vLLM reported for the 0.6B shape: KV tokens = KV bytes / (2 x layers x kv heads x
    head_dim x 2 bytes), in whole 16-token blocks."""
    m = json.loads((DATA / "gen-memory.json").read_text())
    c, v = m["config"], m["vllm_reported"]
    per_token = 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * c["head_dim"] * 2
    assert per_token == v["kv_bytes_per_token"] == 114688
    tokens = int(v["kv_cache_gib"] * 2**30 / per_token) // v["block_size"] * v["block_size"]
    assert abs(tokens - v["kv_cache_tokens"]) / v["kv_cache_tokens"] < 1e-3


# --------------------------------------------------------------------------- against a streaming server


class ByteTokenizer:
    """A stand-in tokenizer: UTF-8 bytes, the ChatML template the fake server counts."""

    chat_template = "chatml"

    def __init__(self, extra: str = "") -> None:
        self.extra = extra

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return list((text + "<|im_start|>assistant\n" + self.extra).encode())


def rule_rows(vocab: int = 1000):
    """The reference the fake server's rule is: next = (last * 31 + 7) % vocab, as log-prob rows."""
    import torch

    def rows(prompt_ids, tokens):
        seq, out = list(prompt_ids), []
        for t in tokens:
            row = torch.full((vocab,), -10.0)
            row[(seq[-1] * 31 + 7) % vocab] = -0.01
            out.append(row)
            seq.append(t)
        return out

    return rows


@pytest.fixture
def fake_server(tmp_path):
    def start(*extra: str):
        port = free_port()
        return local_vllm([sys.executable, str(FAKE), str(port), "0.001", *extra], tmp_path / f"log{port}",
                          port=port, startup_timeout_s=30)  # fmt: skip

    return start


def test_endpoints_and_greedy_tokens_of_a_correct_server(fake_server):
    pytest.importorskip("torch")
    with fake_server() as server:
        outs = greedy_completions(server.base_url, "fake-gen", [[5, 6, 7], [100, 200]], max_tokens=16)
        doc, failures = endpoint_checks(server.base_url, "fake-gen", ByteTokenizer(), max_tokens=8)
    assert failures == []
    assert [len(o["tokens"]) for o in outs] == [16, 16] and outs[0]["tokens"][0] == (7 * 31 + 7) % 1000
    assert doc["chat_stream"]["chunks"] == 8 and doc["chat_stream"]["done"]
    assert doc["completions_stream"]["usage"]["completion_tokens"] == 8
    assert doc["chat_template_prompt_tokens"]["served"] == doc["chat_template_prompt_tokens"]["tokenizer"]
    v = teacher_forced(outs, rule_rows())
    assert v["top1"] == 1.0 and v["max_rank"] == 0 and v["first_divergence_min"] is None and v["tokens"] == 32


def test_a_server_that_drifts_from_the_reference_fails_the_top1_gate(fake_server):
    """Like a quantized model whose greedy path leaves the reference's after a few tokens."""
    pytest.importorskip("torch")
    with fake_server("--wrong-after", "4") as server:
        outs = greedy_completions(server.base_url, "fake-gen", [[5, 6, 7], [100, 200]], max_tokens=16)
    v = teacher_forced(outs, rule_rows())
    assert v["top1"] == pytest.approx(4 / 16) and v["first_divergence_min"] == 4 and v["max_rank"] == 1
    assert v["greedy_prefix"] == pytest.approx(4 / 16)
    assert ServeCheckKind.Params().min_top1 is None  # reported; gated where the recipe asks
    assert gen_gate_failures({"verify": v}, ServeCheckKind.Params(min_top1=0.9, max_kl=None, max_kl_p99=None)) == [
        "served greedy tokens are the fp32 reference's top-1 for 0.250 of 32 positions < min_top1 0.9"
    ]


def rule_logprobs(sharpness: float = 6.0, vocab: int = 1000):
    """The fake server's distribution as a reference: after ids, the rule token at logit
    `sharpness`, every other token at 0 (log-softmax rows [len(ids), vocab])."""
    import numpy as np

    def logprobs(ids):
        rows = np.zeros((len(ids), vocab))
        for t in range(len(ids)):
            rows[t, (ids[t] * 31 + 7) % vocab] = sharpness
        return rows - np.log(np.exp(sharpness) + vocab - 1)

    return logprobs


def closed_form_kl(s_ref: float, s_served: float, vocab: int = 1000) -> float:
    """KL between two such distributions: only the rule token's mass differs, and the rest is
    uniform in both (so the served top-k coarsening loses nothing)."""
    import math

    p = math.exp(s_ref) / (math.exp(s_ref) + vocab - 1)
    q = math.exp(s_served) / (math.exp(s_served) + vocab - 1)
    return p * math.log(p / q) + (1 - p) * math.log((1 - p) / (1 - q))


def test_held_out_kl_through_prompt_logprobs_passes_a_faithful_server_and_fails_a_flat_one(fake_server):
    """vLLM's prompt_logprobs (top-20 and the prompt's token per position) against an fp32
    reference of the same shape: a server whose distribution is slightly flatter keeps the
    default KL gates; one that is much flatter (a poor quantization: the favourite keeps its
    rank, so top-1 agrees everywhere) fails mean KL and p99, with the exact KL."""
    import numpy as np

    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 1000, size=n).tolist() for n in (40, 25, 60)]
    dist = {}
    for s in (5.8, 2.0):
        with fake_server("--sharpness", str(s)) as server:
            served = served_prompt_logprobs(server.base_url, "fake-gen", prompts, 20)
        assert [len(r) for r in served] == [39, 24, 59] and all(20 <= len(d) <= 21 for r in served for d in r)
        dist[s] = held_out_distribution(prompts, served, rule_logprobs(6.0), 20)
    good, bad = dist[5.8], dist[2.0]
    assert good["positions"] == bad["positions"] == 122 and good["served_top_k"] == 20
    assert good["kl_mean"] == pytest.approx(closed_form_kl(6.0, 5.8), rel=1e-5)
    assert bad["kl_mean"] == pytest.approx(closed_form_kl(6.0, 2.0), rel=1e-5) == pytest.approx(0.819, abs=1e-3)
    assert bad["kl_p99"] == pytest.approx(bad["kl_mean"], rel=1e-5)  # the same at every position
    assert good["top1_agreement"] == bad["top1_agreement"] == 1.0
    # the random prompt tokens are rarely the favourite: the flat server "predicts" them better,
    # a perplexity ratio under 1 -- why it is reported, not a default gate
    assert bad["ppl_ratio"] < good["ppl_ratio"] < 1.0
    p = ServeCheckKind.Params()
    assert gen_gate_failures({"distribution": good}, p) == []
    assert gen_gate_failures({"distribution": bad}, p) == [
        f"held-out kl_mean {bad['kl_mean']:.4f} > 0.05 (max_kl; served top-20 vs fp32, 122 positions)",
        f"held-out kl_p99 {bad['kl_p99']:.4f} > 0.5 (max_kl_p99; served top-20 vs fp32, 122 positions)",
    ]
    # not measured (kl_passages = 0) but gated: the gate fails, saying why
    assert gen_gate_failures({}, p)[0] == "kl_mean not measured (gate max_kl = 0.05; kl_passages = 0)"


def test_a_served_position_without_its_prompt_token_or_finite_logprobs_is_the_worst_case():
    rows = rule_logprobs(6.0)
    ids = [3, 94, 5]
    served = [[{100: -0.5, 7: -1.0}, {(94 * 31 + 7) % 1000: float("nan")}]]
    d = held_out_distribution([ids], served, rows, 2)
    assert d["positions"] == 2 and d["kl_mean"] == 50.0 and d["top1_agreement"] == 0.0


def test_serve_check_kl_gates_are_validates():
    gm = pytest.importorskip("mopt_ml.genmetrics")
    assert DEFAULT_KL_GATES == gm.DEFAULT_GATES
    p = ServeCheckKind.Params()
    assert {k: getattr(p, k) for k in DEFAULT_KL_GATES} == DEFAULT_KL_GATES


def test_a_server_without_the_tokenizers_chat_template_is_caught(fake_server):
    with fake_server() as server:
        _, failures = endpoint_checks(
            server.base_url, "fake-gen", ByteTokenizer(extra="<think>\n"), max_tokens=4
        )
    assert len(failures) == 1 and "not using the model's chat template" in failures[0]


def test_token_id_parsing():
    assert token_id("token_id:17") == 17 and token_id("hello") is None and token_id("token_id:x") is None


# --------------------------------------------------------------------------- the worker's generation path

FAKE_VLLM = textwrap.dedent(
    """
    import json, os
    from pathlib import Path
    DATA = Path(os.environ["RECORDED"])
    def add_cli_args(parser):
        pass
    def main(argv):
        with open(os.environ["ARGV_LOG"], "a") as f:
            f.write(json.dumps(argv) + "\\n")
        a = dict(zip(argv[::1], argv[1::1]))
        ds = a["--dataset-name"]
        name = {"prefix_repetition": "bf16-prefix-shared"}.get(ds)
        if name is None:
            name = "bf16-prefix-unshared" if a.get("--seed") == "1002" else "bf16-chat-c" + a["--max-concurrency"]
        r = json.loads((DATA / (name + ".json")).read_text())
        out = Path(a["--result-dir"]) / a["--result-filename"]
        out.write_text(json.dumps(r))
        return r
    """
)


def test_load_test_worker_generation_spec(tmp_path, fake_server):
    """The worker asks `vllm bench serve` for one run per step (a seed each, --ignore-eos, the
    chat backend, TTFT/ITL/TPOT/E2EL at p50/p90/p99, --save-result), then the two prefix runs
    with the server's /metrics before and after each."""
    _stub_vllm(tmp_path / "stub")
    with fake_server() as server:
        spec = {"task": "text-generation", "concurrency": [1, 8, 32], "requests": [16, 32, 128], "input_len": 512,
                "output_len": 128, "range_ratio": 0.0, "warmups": 16, "seed": 0, "endpoint": "chat",
                "result_dir": str(tmp_path / "bench"), "base_url": server.base_url, "model": "fake-gen",
                "tokenizer": str(tmp_path), "out": str(tmp_path / "o.jsonl"),
                "prefix": {"prefix_len": 1024, "suffix_len": 128, "output_len": 64, "concurrency": 16,
                           "requests": 160}}  # fmt: skip
        (tmp_path / "spec.json").write_text(json.dumps(spec))
        env = {"PYTHONPATH": str(tmp_path / "stub"), "RECORDED": str(DATA / "bench"),
               "ARGV_LOG": str(tmp_path / "argv.jsonl"), "PATH": "/usr/bin:/bin"}  # fmt: skip
        proc = subprocess.run([sys.executable, str(LOADTEST_WORKER), str(tmp_path / "spec.json")], env=env,
                              capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    argvs = [json.loads(line) for line in (tmp_path / "argv.jsonl").read_text().splitlines()]
    assert len(argvs) == 5
    for a in argvs[:3]:
        assert a[a.index("--backend") + 1] == "openai-chat" and "--ignore-eos" in a and "--save-result" in a
        assert a[a.index("--percentile-metrics") + 1] == "ttft,tpot,itl,e2el"
        assert a[a.index("--metric-percentiles") + 1] == "50,90,99"
    assert [a[a.index("--seed") + 1] for a in argvs[:3]] == ["0", "1", "2"]  # no step reuses prompts
    assert [a[a.index("--max-concurrency") + 1] for a in argvs[:3]] == ["1", "8", "32"]
    assert [a[a.index("--num-warmups") + 1] for a in argvs[:3]] == ["1", "8", "16"]
    assert argvs[3][argvs[3].index("--dataset-name") + 1] == "prefix_repetition"
    assert argvs[3][argvs[3].index("--prefix-repetition-num-prefixes") + 1] == "1"
    steps = [json.loads(line) for line in (tmp_path / "o.jsonl").read_text().splitlines()]
    assert [s.get("probe") for s in steps] == [None, None, None, "prefix-shared", "prefix-unshared"]
    assert steps[2]["ttft_p99_ms"] == pytest.approx(122.87, abs=0.01)
    assert (tmp_path / "bench" / "c32.json").is_file() and steps[2]["result_file"] == "c32.json"
    assert "vllm:prompt_tokens_total" in steps[3]["metrics_delta"]


# --------------------------------------------------------------------------- the kind, end to end on CPU


def test_serve_check_generation_end_to_end_on_cpu(tmp_path, monkeypatch):
    """ServeCheckKind.run for a text-generation model with the fake server as "vllm serve" and
    the stand-in benchmark module: serve.json, the bench files, the knee, the prefix probe, the
    held-out distributions and the greedy check against a real fp32 reference (which the fake
    server's rule does not follow: the KL gates and the top-1 gate the recipe sets fail and,
    with on_fail = "record", are written down)."""
    pytest.importorskip("torch")
    import logging

    from mopt_serve import serve_check as sc
    from mopt_serve.gen_check import run_generation  # noqa: F401  (the path run() takes)
    from test_modelopt_gen import tiny_causal_lm

    from mopt.api import Artifact, BuildContext
    from mopt.builtin.hardware import PROFILES

    w = tiny_causal_lm(tmp_path / "w")
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(str(w)))
    serve = tmp_path / "vllm"
    serve.mkdir()
    (serve / "args.json").write_text(json.dumps({"argv": [sys.executable, str(FAKE), "0.001"], "env": {}}))
    stub = tmp_path / "stub"
    _stub_vllm(stub)
    monkeypatch.setenv("PYTHONPATH", str(stub))
    monkeypatch.setenv("RECORDED", str(DATA / "bench"))
    monkeypatch.setenv("ARGV_LOG", str(tmp_path / "argv.jsonl"))
    monkeypatch.setenv("FAKE_VOCAB", str(vocab))
    monkeypatch.setattr(sc._env, "has_module", lambda m: True)
    monkeypatch.setattr(sc._env, "require_gpu", lambda *a, **k: None)
    out, tmp = tmp_path / "out", tmp_path / "tmp"
    out.mkdir()
    tmp.mkdir()
    params = ServeCheckKind.Params(concurrency=[1, 8, 32], on_fail="record", gen_prompts=2, gen_tokens=8,
                                   prefix_requests=16, startup_timeout_s=30, min_top1=0.9, kl_passages=2)  # fmt: skip
    ctx = BuildContext(
        out=out, tmp=tmp, params=params,
        inputs={"serve": [Artifact(serve, "vllm", "vllm", "0" * 64, {"served_model_name": "fake-gen"})],
                "model": [Artifact(w, "weights", "weights", "0" * 64, {})],
                "reference": [Artifact(w, "weights", "weights", "0" * 64, {})]},
        model_name="qwen3-chat", family=None, task="text-generation", source=None,
        hardware={p.name: p for p in PROFILES}["h200"], section="qwen3-chat.h200", target="serve-check",
        project_dir=tmp_path, logger=logging.getLogger("test"),
    )  # fmt: skip
    meta = ServeCheckKind().run(ctx)
    doc = json.loads((out / "serve.json").read_text())
    assert meta["task"] == "text-generation" and doc["models"] == ["fake-gen"]
    assert [s["concurrency"] for s in doc["loadtest"]] == [1, 8, 32]
    assert doc["knee"]["concurrency"] == 32 and meta["knee_tokens_per_s"] == pytest.approx(9441.99, abs=0.01)
    assert doc["prefix_caching"]["ttft_p50_ratio"] == pytest.approx(125.54 / 67.93, rel=1e-3)
    assert sorted(p.name for p in (out / "bench").iterdir()) == [
        "c1.json", "c32.json", "c8.json", "prefix-shared.json", "prefix-unshared.json"]  # fmt: skip
    assert doc["chat_stream"]["done"] and doc["completions_stream"]["chunks"] == 8
    assert doc["verify"]["tokens"] == 16 and doc["verify"]["top1"] < 0.9
    assert not doc["passed"] and any("min_top1" in f for f in doc["failures"]) and not meta["passed"]
    d = doc["distribution"]  # DEFAULT_TEXTS, 4 a passage: 2 passages
    assert d["passages"] == 2 and d["positions"] > 10 and d["kl_mean"] > 0.05 and meta["kl_mean"] == d["kl_mean"]
    assert [f.split()[1] for f in doc["failures"] if f.startswith("held-out")] == ["kl_mean", "kl_p99"]
    assert doc["gates"] == {"max_kl": 0.05, "max_kl_p99": 0.5, "max_ppl_ratio": None, "min_top1": 0.9}
    assert '<g id="series-0">' in (out / "loadtest.svg").read_text()


def _stub_vllm(root: Path) -> None:
    pkg = root / "vllm"
    (pkg / "benchmarks").mkdir(parents=True)
    (pkg / "utils").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "benchmarks" / "__init__.py").write_text("")
    (pkg / "benchmarks" / "serve.py").write_text(FAKE_VLLM)
    (pkg / "utils" / "__init__.py").write_text("")
    (pkg / "utils" / "argparse_utils.py").write_text(
        "class FlexibleArgumentParser:\n    def parse_args(self, argv):\n        return list(argv)\n"
    )


# --------------------------------------------------------------------------- mopt's own run on the H200


def test_recorded_mopt_serve_check_of_the_h200_section():
    """`mopt build recipes/qwen3-chat.toml 'qwen3-chat-0-6b.h200'` on the H200 (2026-12-01,
    tests/data/h200-gen-2026-12-01/phase2/serve.json): a seed per step, the knee, the prefix
    probe, the memory vLLM reported, and the bf16 greedy check the synthetic model failed."""
    doc = json.loads((DATA / "phase2" / "serve.json").read_text())
    steps = doc["loadtest"]
    assert [s["concurrency"] for s in steps] == SWEEP and all(s["errors"] == 0 for s in steps)
    assert gen_knee(steps, 300.0)["concurrency"] == 32 == doc["knee"]["concurrency"]
    assert doc["knee"]["output_tokens_per_s"] == pytest.approx(6508.1, abs=0.1)
    pe = prefix_effect(*doc["prefix_probe"])
    assert pe == doc["prefix_caching"] and pe["hit_rate_shared"] > 0.85 > 0.15 > pe["hit_rate_unshared"]
    assert pe["shared"]["ttft_p99_ms"] < pe["unshared"]["ttft_p99_ms"]
    assert doc["vllm_log"]["kv_cache_tokens"] == 1188352 and doc["vllm_log"]["weights_gib"] == 1.12
    assert doc["chat_template_prompt_tokens"] == {"served": 50, "tokenizer": 50}
    assert doc["verify"]["top1"] == 0.875 and not doc["passed"]
    assert doc["failures"] == [
        "served greedy tokens are the fp32 reference's top-1 for 0.875 of 128 positions < min_top1 0.9"
    ]


def test_select_over_recorded_generation_serve_checks(tmp_path):
    """select's serving objective reads a generation serve.json (knee at the TTFT SLO): the
    recorded bf16 check failed its gate, so it is excluded; a passing copy wins."""
    from mopt_ml.select import SelectKind, select_serving

    from mopt.api import Artifact

    doc = json.loads((DATA / "phase2" / "serve.json").read_text())
    for name, passed in (("sc-a", False), ("sc-b", True)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "serve.json").write_text(json.dumps({**doc, "passed": passed,
                                                                 "failures": [] if passed else doc["failures"]}))  # fmt: skip
    cands = [Artifact(tmp_path, "vllm", "vllm", "0" * 64, {"defaults": True}, label="vllm"),
             Artifact(tmp_path, "vllm", "vllm-b", "0" * 64, {}, label="vllm-b")]  # fmt: skip
    serves = [Artifact(tmp_path / "sc-a", "serve-check", "sc-a", "0" * 64, {}, label="sc-a", input_labels={"serve": ["vllm"]}),
              Artifact(tmp_path / "sc-b", "serve-check", "sc-b", "0" * 64, {}, label="sc-b", input_labels={"serve": ["vllm-b"]})]  # fmt: skip
    sel = select_serving(cands, serves, {}, SelectKind.Params(objective="max_throughput_under_slo"))
    rows = {r.label: r for r in sel.rows}
    assert rows["vllm"].status == "excluded" and "min_top1" in rows["vllm"].why
    assert sel.winner == "vllm-b" and rows["vllm-b"].value == pytest.approx(6508.1, abs=0.1)
    assert sel.slo_p99_ms == 300.0


def test_vllm_env_reaches_serve_sh_and_args_json(tmp_path):
    """The h200 section serves with VLLM_USE_FLASHINFER_SAMPLER=0 (the sampler's first-start JIT
    compile cost 75 s of a 189 s start-up on the H200): serve.sh exports it, serve-check starts
    vLLM with args.json's env."""
    import logging

    from mopt_serve.vllm import VllmKind

    from mopt.api import Artifact, BuildContext
    from mopt.builtin.hardware import PROFILES

    w = tmp_path / "w"
    w.mkdir()
    (w / "config.json").write_text(json.dumps({"model_type": "qwen3", "max_position_embeddings": 40960}))
    out, tmp = tmp_path / "out", tmp_path / "tmp"
    out.mkdir()
    tmp.mkdir()
    ctx = BuildContext(
        out=out, tmp=tmp, params=VllmKind.Params(max_model_len=32768, env={"VLLM_USE_FLASHINFER_SAMPLER": "0"}),
        inputs={"model": [Artifact(w, "weights", "weights", "0" * 64, {})]}, model_name="qwen3-chat-0-6b",
        family=None, task="text-generation", source=None, hardware={p.name: p for p in PROFILES}["h200"],
        section="qwen3-chat-0-6b.h200", target="vllm", project_dir=tmp_path, logger=logging.getLogger("test"),
    )  # fmt: skip
    meta = VllmKind().run(ctx)
    assert meta["runner"] == "generate" and meta["max_model_len"] == 32768
    assert json.loads((out / "args.json").read_text())["env"] == {"VLLM_USE_FLASHINFER_SAMPLER": "0"}
    assert "export VLLM_USE_FLASHINFER_SAMPLER=0" in (out / "serve.sh").read_text()
