"""The `deploy` kind on its inputs' files: the capacity plan's arithmetic, the manifests and the
chart, the alert thresholds against the SLO, the dashboard, and the validators rejecting what
is wrong. CPU inputs are written here; the H200 inputs are the results recorded there on
2026-12-05 (tests/data/h200-2026-12-05, a fixture: no GPU runs here). The real chain through
`mopt build` with a running container and a real Prometheus is tests/test_prometheus.py."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy_helpers import (
    DIGEST,
    EMBED_BUCKETS,
    ROOT,
    TINY_BERT,
    ceil,
    container_check_inputs,
    family,
    load,
    recorded_h200_search,
    run_deploy,
    step,
)
from mopt_deploy import prom
from mopt_deploy.plan import replicas_for
from mopt_deploy.served import VLLM_METRICS
from mopt_deploy.validate import BundleInvalid, kubernetes_validate

from mopt.tomlfile import tomllib

needs_promtool = pytest.mark.skipif(
    shutil.which("promtool") is None,
    reason="promtool is not installed (apt-get install prometheus; .ci/run does)",
)
#: a CPU load test: the SLO (100 ms) breaks between 8 and 16 clients
STEPS = [step(1, 180.0, 8.0), step(4, 400.0, 30.0), step(8, 520.0, 70.0), step(16, 560.0, 150.0)]


def test_replicas_are_the_ceiling_of_target_over_the_knee_and_over_its_lower_bound() -> None:
    assert replicas_for(1000, 250) == 4 and replicas_for(1000, 249.9) == 5 and replicas_for(1000, 1e6) == 1
    assert replicas_for(1.1, 0.1) == 11  # 1.1 / 0.1 = 11.000000000000002 in floats: still 11


def test_cpu_plan_from_a_container_check(tmp_path: Path) -> None:
    res, out = run_deploy(tmp_path, container_check_inputs(tmp_path, STEPS), target_rps=2000)
    knee = STEPS[2]  # the highest load whose p99 met 100 ms
    n, dur = knee["completed"], knee["duration_s"]
    lo = (n - 1.959963984540054 * n**0.5) / dur  # the counting interval of that step
    assert res["knee"] == pytest.approx(520.0)
    assert res["knee_ci"][0] == pytest.approx(lo)
    assert res["replicas"] == ceil(2000 / 520.0) == 4
    assert res["replicas_safe"] == ceil(2000 / lo) == 5
    assert res["plan"] == "4 replicas, 5 to be safe at the lower bound"
    cap = load(out, "capacity.json")
    assert (cap["replicas"], cap["replicas_safe"], cap["target"], cap["unit"]) == (4, 5, 2000, "requests/s")
    dep = load(out, "k8s/deployment.yaml")
    c = dep["spec"]["template"]["spec"]["containers"][0]
    assert c["image"] == f"mopt/tiny-bert@{DIGEST}" and res["image_pinned"]
    assert dep["spec"]["replicas"] == 5  # the lower bound's replicas: the target is served even there
    assert c["args"] == ["--port", "8000"] and c["ports"][0]["containerPort"] == 8000
    assert "nvidia.com/gpu" not in c["resources"]["requests"]
    assert (
        c["startupProbe"]["httpGet"]["path"] == "/health"
        and c["readinessProbe"]["httpGet"]["path"] == "/health"
    )
    assert c["startupProbe"]["failureThreshold"] * c["startupProbe"]["periodSeconds"] >= 3 * 1.5
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    hpa = load(out, "k8s/hpa.yaml")
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (5, 10)
    assert hpa["spec"]["metrics"][0]["pods"]["target"]["averageValue"] == "8"  # the knee's clients per pod
    assert load(out, "k8s/pdb.yaml")["spec"]["maxUnavailable"] == 1
    # memory: mopt check's parameter count of the model at the served precision (int8)
    dims = family("bert").dims(TINY_BERT)
    pc = dims.param_counts()
    doc = load(out, "deploy.json")
    assert doc["memory"]["params"] == pc.total
    weights_mib = (pc.linear * 1 + (pc.total - pc.linear) * 4) / 2**20
    assert f"= {weights_mib:,.1f} MiB" in doc["memory"]["how"]
    assert c["resources"]["requests"]["memory"] == doc["memory"]["request"]


def test_the_p99_alert_fires_over_the_recipes_slo(tmp_path: Path) -> None:
    for slo in (100.0, 50.0):
        steps = [step(1, 180.0, 8.0), step(4, 400.0, 30.0), step(8, 520.0, 70.0 if slo == 100 else 45.0)]
        inputs = container_check_inputs(tmp_path / f"slo{slo:g}", steps, slo_ms=slo)
        _res, out = run_deploy(tmp_path, inputs, target_rps=100, name=f"slo{slo:g}")
        alerts = {r["alert"]: r for g in load(out, "prometheus/rules.yml")["groups"] for r in g["rules"]
                  if "alert" in r}  # fmt: skip
        expr = alerts[prom.ALERT_P99]["expr"]
        m = re.fullmatch(r'job:mopt_request_latency_seconds:p99\{job="tiny-bert"\} > ([0-9.e-]+)', expr)
        assert m and float(m[1]) == slo / 1000, expr
        assert load(out, "deploy.json")["latency_alert"]["is_the_slo"]


def test_an_slo_between_buckets_alerts_at_the_next_boundary_and_says_so() -> None:
    assert prom.latency_threshold(100, EMBED_BUCKETS) == (0.1, True)
    assert prom.latency_threshold(150, EMBED_BUCKETS) == (0.2, False)
    assert prom.latency_threshold(100, VLLM_METRICS.buckets) == (0.3, False)  # vLLM's first bucket is 0.3 s
    assert prom.latency_threshold(20_000, (0.5, 1.0)) == (20.0, False)  # above every bucket: the SLO itself


def test_h200_plan_from_the_recorded_serve_search(tmp_path: Path) -> None:
    """RECORDED H200 RESULTS (2026-12-05) AS A FIXTURE: the winner vllm-fp8's knee, 380.9 req/s
    (143,026 tokens/s [82,017, 154,036]) per GPU at p99 <= 100 ms; the recipe's target."""
    recipe = tomllib.loads((ROOT / "recipes/h200-serve.toml").read_text())
    params = {k: v for k, v in recipe["qwen3-shape"]["h200"]["deploy"].items() if k not in ("kind", "input")}
    res, out = run_deploy(tmp_path, recorded_h200_search(tmp_path), hardware="h200", model="qwen3-shape",
                          fam="qwen3", **params)  # fmt: skip
    search = json.loads((ROOT / "tests/data/h200-2026-12-05/search.json").read_text())
    win = next(c for c in search["configs"] if c["label"] == search["decision"]["winner"])
    k = win["knee"]
    rps, tps, (tlo, _thi) = k["requests_per_s"], k["tokens_per_s"], k["tokens_per_s_ci"]
    target = params["target_rps"]
    assert win["label"] == "vllm-fp8" and k["concurrency"] == 26
    assert res["replicas"] == ceil(target / rps) == 3
    assert res["replicas_safe"] == ceil(target / (tlo * rps / tps)) == 5
    assert (res["gpus"], res["gpus_safe"]) == (3, 5)
    assert res["plan"] == "3 replicas (3 GPUs), 5 to be safe at the lower bound (5 GPUs)"
    dep = load(out, "k8s/deployment.yaml")
    pod = dep["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["resources"]["requests"]["nvidia.com/gpu"] == 1 == c["resources"]["limits"]["nvidia.com/gpu"]
    assert dep["spec"]["replicas"] == 5 and load(out, "k8s/hpa.yaml")["spec"]["minReplicas"] == 5
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H200"}
    assert c["command"] == ["vllm", "serve", "/models/model", "--config", "/config/vllm.yaml", "--host", "0.0.0.0",
                            "--port", "8000"]  # fmt: skip
    cm = load(out, "k8s/configmap.yaml")
    assert cm["data"]["vllm.yaml"] == (ROOT / "tests/data/h200-2026-12-01/vllm-fp8/vllm.yaml").read_text()
    # probes from the measured cold start-up (95.6 s): the startup probe allows 3x
    assert c["startupProbe"]["failureThreshold"] == ceil(3 * win["startup_s"] / 5) == 58
    assert c["readinessProbe"]["initialDelaySeconds"] == 95
    # no image digest is known for the H200 run: the tag is named, and said to be unpinned
    assert c["image"] == "vllm/vllm-openai:v0.26.0" and res["image_pinned"] is False
    assert "Not pinned by digest" in (out / "README.md").read_text()
    # vLLM's request-latency histogram starts at 0.3 s: a 100 ms SLO is below its resolution
    doc = load(out, "deploy.json")
    assert doc["latency_alert"] == {**doc["latency_alert"], "threshold_s": 0.3, "is_the_slo": False}
    p99 = next(r for g in load(out, "prometheus/rules.yml")["groups"] for r in g["rules"]
               if r.get("alert") == prom.ALERT_P99)  # fmt: skip
    assert p99["expr"].endswith("> 0.3") and "cannot resolve 100 ms" in p99["annotations"]["description"]
    assert any(
        r.get("alert") == prom.ALERT_KV
        for g in load(out, "prometheus/rules.yml")["groups"]
        for r in g["rules"]
    )
    assert doc["validation"]["kubernetes-validate"]["checked"]["deployment.yaml: Deployment/qwen3-shape"]


def _render(template: str, values: dict[str, Any]) -> str:
    """The three template forms the chart uses, substituted from values.yaml: NOT Helm (not
    installed here); it checks the templates say what k8s/ says."""

    def get(path: str) -> Any:
        cur: Any = values
        for part in path.split("."):
            cur = cur[part]
        return cur

    def block(m: re.Match[str]) -> str:
        text = yaml.safe_dump(get(m[1]), sort_keys=False, default_flow_style=False).rstrip("\n")
        return "".join("\n" + " " * int(m[2]) + line for line in text.splitlines())

    out = re.sub(r"\n *\{\{- toYaml \.Values\.([\w.]+) \| nindent (\d+) \}\}", block, template)
    out = re.sub(r"\{\{ \.Values\.([\w.]+) \| toYaml \}\}",
                 lambda m: yaml.safe_dump(get(m[1]), default_flow_style=True).strip().removesuffix("\n...").strip(),
                 out)  # fmt: skip
    out = re.sub(r"\{\{ \.Values\.([\w.]+) \| quote \}\}", lambda m: json.dumps(str(get(m[1]))), out)
    out = re.sub(r"\{\{ \.Values\.([\w.]+) \}\}", lambda m: str(get(m[1])), out)
    assert "{{" not in out, out
    return out


@pytest.mark.parametrize("which", ["cpu", "h200"])
def test_the_helm_chart_renders_to_the_manifests(tmp_path: Path, which: str) -> None:
    if which == "cpu":
        _res, out = run_deploy(tmp_path, container_check_inputs(tmp_path, STEPS), target_rps=2000)
    else:
        _res, out = run_deploy(tmp_path, recorded_h200_search(tmp_path), hardware="h200", model="qwen3-shape",
                               fam="qwen3", target_rps=1000)  # fmt: skip
    values = load(out, "chart/values.yaml")
    manifests = sorted(p.name for p in (out / "k8s").glob("*.yaml"))
    assert manifests == sorted(p.name for p in (out / "chart/templates").glob("*.yaml"))
    for name in manifests:
        rendered = yaml.safe_load(_render((out / "chart/templates" / name).read_text(), values))
        assert rendered == load(out, f"k8s/{name}"), name
    chart = load(out, "chart/Chart.yaml")
    assert chart["apiVersion"] == "v2" and chart["name"] == values["name"]
    helm = load(out, "deploy.json")["validation"]["helm"]
    if shutil.which("helm") is None:
        assert helm["version"] is None and "not installed" in helm["not_run"]


def test_kubernetes_validate_rejects_broken_manifests(tmp_path: Path) -> None:
    _res, out = run_deploy(tmp_path, container_check_inputs(tmp_path, STEPS), target_rps=2000)
    dep = load(out, "k8s/deployment.yaml")
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump(dep))
    assert kubernetes_validate([good], "1.32")["checked"] == {"good.yaml: Deployment/tiny-bert": "valid against "
                                                               "Kubernetes 1.32 (strict)"}  # fmt: skip
    bad = {
        "replicas as text": lambda d: d["spec"].__setitem__("replicas", "five"),
        "a misspelled field": lambda d: d["spec"]["template"]["spec"]["containers"][0].__setitem__("imagePull", "x"),
        "a probe without a handler port": lambda d: d["spec"]["template"]["spec"]["containers"][0]["startupProbe"][
            "httpGet"].pop("port"),
    }  # fmt: skip
    for what, breaks in bad.items():
        d = json.loads(json.dumps(dep))
        breaks(d)
        f = tmp_path / "bad.yaml"
        f.write_text(yaml.safe_dump(d))
        with pytest.raises(BundleInvalid, match=r"is not valid Kubernetes 1\.32"):
            kubernetes_validate([f], "1.32")
        del what


@needs_promtool
def test_promtool_checks_the_bundle_and_its_unit_tests_catch_a_wrong_threshold(tmp_path: Path) -> None:
    _res, out = run_deploy(tmp_path, container_check_inputs(tmp_path, STEPS), target_rps=2000)
    rec = load(out, "deploy.json")["validation"]["promtool"]
    assert rec["version"] and rec["checked"] == {
        "check config prometheus-docker.yml": "ok",
        "check rules rules.yml": "ok",
        "test rules rules.test.yml": "ok",
    }
    prom_dir = out / "prometheus"
    rules = (prom_dir / "rules.yml").read_text()
    assert '{job="tiny-bert"} > 0.1\n' in rules
    for wrong in ("0.2", "0.05"):  # over the slow instance's p99 / under the fast one's
        work = tmp_path / f"wrong-{wrong}"
        shutil.copytree(prom_dir, work)
        (work / "rules.yml").write_text(
            rules.replace('{job="tiny-bert"} > 0.1\n', f'{{job="tiny-bert"}} > {wrong}\n')
        )
        r = subprocess.run(
            ["promtool", "test", "rules", "rules.test.yml"], cwd=work, capture_output=True, text=True
        )
        assert r.returncode != 0, f"threshold {wrong}: promtool test rules passed:\n{r.stdout}{r.stderr}"
    broken = tmp_path / "broken"
    shutil.copytree(prom_dir, broken)
    (broken / "rules.yml").write_text(rules.replace("histogram_quantile(0.99,", "histogram_quantile(0.99", 1))
    r = subprocess.run(
        ["promtool", "check", "rules", "rules.yml"], cwd=broken, capture_output=True, text=True
    )
    assert r.returncode != 0


def test_the_dashboard_is_built_from_the_recorded_series(tmp_path: Path) -> None:
    _res, out = run_deploy(tmp_path, container_check_inputs(tmp_path, STEPS), target_rps=2000)
    dash = load(out, "grafana/dashboard.json")
    recorded = {
        r["record"] for g in load(out, "prometheus/rules.yml")["groups"] for r in g["rules"] if "record" in r
    }
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    assert exprs and all(e.split("{")[0] in recorded for e in exprs)
    latency = next(p for p in dash["panels"] if p["title"].startswith("latency"))
    assert [s["value"] for s in latency["fieldConfig"]["defaults"]["thresholds"]["steps"]] == [None, 0.1]
    rate = next(p for p in dash["panels"] if p["title"] == "requests/s")
    assert rate["fieldConfig"]["defaults"]["thresholds"]["steps"][1]["value"] == 2000


def test_what_cannot_be_planned_is_refused_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match=r"slo_p99_ms = 50, but the knee was measured at p99 <= 100 ms"):
        run_deploy(tmp_path, container_check_inputs(tmp_path / "a", STEPS), target_rps=10, slo_p99_ms=50)
    slow = [step(1, 50.0, 150.0), step(4, 60.0, 400.0)]
    with pytest.raises(RuntimeError, match="no load met the SLO"):
        run_deploy(tmp_path, container_check_inputs(tmp_path / "b", slow), target_rps=10, name="b")
    inputs = container_check_inputs(tmp_path / "c", STEPS)
    del inputs["image"]
    with pytest.raises(RuntimeError, match="needs the image it checked"):
        run_deploy(tmp_path, inputs, target_rps=10, name="c")
    with pytest.raises(ValueError, match="target_rps or target_tokens_per_s"):
        run_deploy(tmp_path, container_check_inputs(tmp_path / "d", STEPS), name="d")


@needs_promtool
def test_the_rules_unit_tests_hold_at_second_scale_intervals(tmp_path: Path) -> None:
    """What the live test uses: a 1 s scrape, a 5 s rate window, a 3 s target-down delay."""
    fast = {"scrape_interval": "1s", "evaluation_interval": "1s", "rate_window": "5s", "slo_for": "5s",
            "errors_for": "5s", "down_for": "3s"}  # fmt: skip
    _res, out = run_deploy(tmp_path, container_check_inputs(tmp_path, STEPS), target_rps=2000, **fast)
    assert load(out, "deploy.json")["validation"]["promtool"]["checked"]["test rules rules.test.yml"] == "ok"
    assert load(out, "prometheus/rules.test.yml")["tests"][0]["interval"] == "1s"
    down = next(r for g in load(out, "prometheus/rules.yml")["groups"] for r in g["rules"]
                if r.get("alert") == prom.ALERT_DOWN)  # fmt: skip
    assert down["for"] == "3s"
