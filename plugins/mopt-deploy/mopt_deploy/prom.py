"""Prometheus: scrape configs, recording rules, SLO alerts and their promtool unit tests,
and the prometheus-adapter rule the HPA's metric comes through.

The p99 alert compares the server's latency histogram with the recipe's SLO. That is exact
only where the SLO is one of the histogram's bucket boundaries (then "p99 > SLO" is "more
than 1 % of requests slower than the SLO"); otherwise `histogram_quantile` interpolates
inside a bucket and the alert's threshold is the smallest boundary at or above the SLO,
which the record and the alert's description say (vLLM's request-latency buckets start at
0.3 s: a 100 ms SLO is below its resolution).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from mopt_deploy.plan import CapacityPlan
from mopt_deploy.served import Served

#: recording rules' names (level:metric:operation)
P50 = "job:mopt_request_latency_seconds:p50"
P99 = "job:mopt_request_latency_seconds:p99"
RATE = "job:mopt_requests:rate"
ERRORS = "job:mopt_request_errors:ratio"
IN_FLIGHT = "job:mopt_requests_in_flight:sum"
KV = "job:mopt_kv_cache_usage:max"
UP = "job:mopt_replicas_up:count"
ALERT_P99 = "MoptLatencyP99OverSLO"
ALERT_ERRORS = "MoptErrorRatioHigh"
ALERT_DOWN = "MoptTargetDown"
ALERT_REPLICAS = "MoptReplicasBelowPlan"
ALERT_KV = "MoptKvCacheNearlyFull"


@dataclass(frozen=True)
class Thresholds:
    """The alerts' thresholds and durations (the recipe's params)."""

    slo_p99_ms: float
    slo_for: str
    max_error_ratio: float
    errors_for: str
    down_for: str
    kv_cache_usage: float
    rate_window: str
    scrape_interval: str
    evaluation_interval: str


def latency_threshold(slo_ms: float, buckets: tuple[float, ...]) -> tuple[float, bool]:
    """(the p99 alert's threshold in seconds, whether it is the SLO itself): the SLO when it
    is a bucket boundary, else the smallest boundary above it (the histogram cannot tell
    finer), else the SLO (above every bucket: nothing better exists)."""
    slo = slo_ms / 1000
    if any(math.isclose(b, slo, rel_tol=1e-9) for b in buckets):
        return slo, True
    above = [b for b in buckets if b > slo]
    return (above[0], False) if above else (slo, False)


def _num(x: float) -> str:
    """A threshold as PromQL reads it (0.1, 1, 0.01; no float noise)."""
    return format(x, ".12g")


def rules(served: Served, plan: CapacityPlan, job: str, t: Thresholds) -> dict[str, Any]:
    """rules.yml: the recording rules and the alerts of one serving job."""
    m = served.metrics
    sel = f'job="{job}"'
    w = t.rate_window
    hist = f"sum by (job, le) (rate({m.latency}_bucket{{{sel}}}[{w}]))"
    err_sel = m.errors.replace("{", "{" + sel + ",", 1) if "{" in m.errors else f"{m.errors}{{{sel}}}"
    req_sel = m.requests.replace("{", "{" + sel + ",", 1) if "{" in m.requests else f"{m.requests}{{{sel}}}"
    in_flight = " + ".join(f"{part.strip()}{{{sel}}}" for part in m.in_flight.split("+"))
    recording = [
        {"record": P50, "expr": f"histogram_quantile(0.5, {hist})"},
        {"record": P99, "expr": f"histogram_quantile(0.99, {hist})"},
        {"record": RATE, "expr": f"sum by (job) (rate({req_sel}[{w}]))"},
        {
            "record": ERRORS,
            # 0, not nothing, while no request failed (the failed series do not exist yet)
            "expr": f"(sum by (job) (rate({err_sel}[{w}])) or 0 * sum by (job) (rate({req_sel}[{w}]))) "
            f"/ sum by (job) (rate({req_sel}[{w}]))",
        },
        {"record": IN_FLIGHT, "expr": f"sum by (job) ({in_flight})"},
        {"record": UP, "expr": f"count by (job) (up{{{sel}}} == 1)"},
    ]
    if m.kv_cache:
        recording.append({"record": KV, "expr": f"max by (job) ({m.kv_cache}{{{sel}}})"})
    thr, exact = latency_threshold(t.slo_p99_ms, m.buckets)
    slo_txt = f"{t.slo_p99_ms:g} ms"
    p99_desc = (
        f"p99 of {m.latency} over the SLO of {slo_txt} for {t.slo_for}: the capacity plan's knee "
        f"({plan.knee:,.1f} {plan.unit} per replica) assumes p99 <= {slo_txt}"
    )
    if not exact:
        p99_desc += (
            f"; the histogram's buckets cannot resolve {slo_txt}: the alert fires over {_num(thr * 1000)} ms, "
            "the smallest bucket boundary above the SLO"
        )
    alerts = [
        {"alert": ALERT_P99, "expr": f"{P99}{{{sel}}} > {_num(thr)}", "for": t.slo_for,
         "labels": {"severity": "page", "slo": "latency"},
         "annotations": {"summary": f"{job}: p99 latency over the SLO ({slo_txt})", "description": p99_desc}},
        {"alert": ALERT_ERRORS, "expr": f"{ERRORS}{{{sel}}} > {_num(t.max_error_ratio)}", "for": t.errors_for,
         "labels": {"severity": "page", "slo": "errors"},
         "annotations": {"summary": f"{job}: more than {t.max_error_ratio:.2%} of requests fail",
                         "description": f"server errors / requests over {w} above {_num(t.max_error_ratio)} "
                                        f"for {t.errors_for}"}},
        {"alert": ALERT_DOWN, "expr": f"up{{{sel}}} == 0", "for": t.down_for,
         "labels": {"severity": "page"},
         "annotations": {"summary": f"{job}: a serving target is down",
                         "description": f"Prometheus could not scrape a {job} target for {t.down_for}"}},
        {"alert": ALERT_REPLICAS, "expr": f"{UP}{{{sel}}} < {plan.replicas}", "for": t.slo_for,
         "labels": {"severity": "warning"},
         "annotations": {"summary": f"{job}: fewer replicas up than the capacity plan needs",
                         "description": f"the plan needs {plan.replicas} replicas for {plan.target:,.6g} {plan.unit} "
                                        f"at p99 <= {slo_txt} ({plan.sentence()})"}},
    ]  # fmt: skip
    if m.kv_cache:
        alerts.append({
            "alert": ALERT_KV, "expr": f"{KV}{{{sel}}} > {_num(t.kv_cache_usage)}", "for": t.slo_for,
            "labels": {"severity": "warning"},
            "annotations": {"summary": f"{job}: KV cache nearly full",
                            "description": f"KV-cache usage over {t.kv_cache_usage:.0%} for {t.slo_for}: "
                                           "requests queue (vllm:num_requests_waiting grows)"},
        })  # fmt: skip
    return {
        "groups": [
            {"name": f"{job}.recording", "interval": t.evaluation_interval, "rules": recording},
            {"name": f"{job}.alerts", "interval": t.evaluation_interval, "rules": alerts},
        ]
    }


def scrape_config(job: str, t: Thresholds, *, namespace: str | None, target: str | None,
                  rule_file: str = "rules.yml") -> dict[str, Any]:  # fmt: skip
    """prometheus.yml: in a cluster (`namespace`: the pods of the Deployment by its label,
    port `http`), or one static `target` (host:port; a container run with --network host)."""
    job_cfg: dict[str, Any] = {"job_name": job, "metrics_path": "/metrics", "scheme": "http"}
    if namespace is not None:
        job_cfg["kubernetes_sd_configs"] = [{"role": "pod", "namespaces": {"names": [namespace]}}]
        job_cfg["relabel_configs"] = [
            {
                "source_labels": ["__meta_kubernetes_pod_label_app_kubernetes_io_name"],
                "regex": job,
                "action": "keep",
            },
            {
                "source_labels": ["__meta_kubernetes_pod_container_port_name"],
                "regex": "http",
                "action": "keep",
            },
            {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
            {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
        ]
    else:
        job_cfg["static_configs"] = [{"targets": [target or "127.0.0.1:8000"]}]
    return {
        "global": {"scrape_interval": t.scrape_interval, "evaluation_interval": t.evaluation_interval},
        "rule_files": [rule_file],
        "scrape_configs": [job_cfg],
    }


def adapter_rules(served: Served) -> dict[str, Any]:
    """prometheus-adapter's rule exposing the in-flight requests per pod as the custom metric
    `mopt_requests_in_flight` (what the HPA scales on)."""
    parts = [p.strip() for p in served.metrics.in_flight.split("+")]
    query = " + ".join(f"sum({p}{{<<.LabelMatchers>>}}) by (<<.GroupBy>>)" for p in parts)
    return {
        "rules": [{
            "seriesQuery": f'{parts[0]}{{namespace!="",pod!=""}}',
            "resources": {"overrides": {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}},
            "name": {"matches": ".*", "as": "mopt_requests_in_flight"},
            "metricsQuery": query,
        }]
    }  # fmt: skip


def _duration_s(d: str) -> int:
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}
    total = 0.0
    for num, unit in re.findall(r"(\d+)(ms|s|m|h|d)", d):
        total += int(num) * units[unit]
    return math.ceil(total)


def rule_tests(served: Served, plan: CapacityPlan, job: str, t: Thresholds) -> dict[str, Any]:
    """rules.test.yml for `promtool test rules`: a slow instance (every request in the bucket
    just above the alert's threshold) fires the p99 alert and a fast one (every request in the
    bucket just below) does not; a failing instance fires the error alert; an instance that
    stops answering fires the target-down alert; the recording rules' values are checked."""
    m = served.metrics
    thr, _exact = latency_threshold(t.slo_p99_ms, m.buckets)
    bounds = [*m.buckets]
    above = min((b for b in bounds if b > thr), default=None)
    below_hi = max((b for b in bounds if b <= thr), default=None)
    # samples 3 to a rate window (rate() needs two in it), at most every 15 s
    window = _duration_s(t.rate_window)
    step = max(1, min(15, window // 3))
    horizon = (
        window + max(_duration_s(t.slo_for), _duration_s(t.errors_for), _duration_s(t.down_for)) + 4 * step
    )
    n = horizon // step + 2

    def counter(per_step: float) -> str:
        return f"0+{_num(per_step)}x{n}"

    def hist(instance: str, slow_to: float | None) -> list[dict[str, str]]:
        """10 requests per step, all in the bucket ending at `slow_to`."""
        out = []
        for b in [*bounds, math.inf]:
            le = "+Inf" if b == math.inf else _num(b)
            hit = slow_to is not None and b >= slow_to
            out.append({"series": f'{m.latency}_bucket{{job="{job}",instance="{instance}",le="{le}"}}',
                        "values": counter(10 if hit else 0)})  # fmt: skip
        return out

    series: list[dict[str, str]] = []
    cases = {}
    if above is not None:
        series += hist("slow:8000", above)
        cases["slow"] = above
    if below_hi is not None:
        series += hist("fast:8000", below_hi)
        cases["fast"] = below_hi
    req, err = m.requests.split("{")[0], m.errors.split("{")[0]
    err_labels = _literal(m.errors[m.errors.index("{") + 1 : -1]) if "{" in m.errors else ""
    ok_labels = ',status="200"' if req == err else ""
    # "failing": as many failed requests as served ones (half fail: the error ratio is 0.5 or 1)
    series.append(
        {"series": f'{req}{{job="{job}",instance="failing:8000"{ok_labels}}}', "values": counter(10)}
    )
    series.append(
        {"series": f'{err}{{job="{job}",instance="failing:8000",{err_labels}}}', "values": counter(10)}
    )
    series.append({"series": f'up{{job="{job}",instance="fast:8000"}}', "values": f"1x{n}"})
    series.append({"series": f'up{{job="{job}",instance="down:8000"}}', "values": f"1x2 0x{n}"})
    at = f"{horizon}s"
    alerts: list[dict[str, Any]] = []
    if "slow" in cases:
        p99 = {"alertname": ALERT_P99, "eval_time": at, "exp_alerts": [{"exp_labels": {
            "severity": "page", "slo": "latency", "job": job}}]}  # fmt: skip
        alerts.append(p99)
    down = {"alertname": ALERT_DOWN, "eval_time": at, "exp_alerts": [{"exp_labels": {
        "severity": "page", "job": job, "instance": "down:8000"}}]}  # fmt: skip
    alerts.append(down)
    errs = {"alertname": ALERT_ERRORS, "eval_time": at, "exp_alerts": [{"exp_labels": {
        "severity": "page", "slo": "errors", "job": job}}]}  # fmt: skip
    alerts.append(errs)
    # annotations are compared too: the rules' own text
    ann = {r["alert"]: r["annotations"] for g in rules(served, plan, job, t)["groups"] for r in g["rules"]
           if "alert" in r}  # fmt: skip
    for a in alerts:
        for e in a["exp_alerts"]:
            e["exp_annotations"] = ann[a["alertname"]]
    tests: list[dict[str, Any]] = [
        {"interval": f"{step}s", "input_series": series, "alert_rule_test": alerts}
    ]
    if "fast" in cases:
        # the fast instance alone: the p99 alert stays silent (the threshold is not below it)
        fast_only = [s for s in series if 'instance="fast:8000"' in s["series"] and "_bucket" in s["series"]]
        fast_only.append(
            {"series": f'{req}{{job="{job}",instance="fast:8000"{ok_labels}}}', "values": counter(10)}
        )
        lo = max((b for b in bounds if b < cases["fast"]), default=0.0)
        # its p99 lies inside its bucket, at or under the threshold (compared with `bool`:
        # promtool compares sample values exactly)
        inside = f'({P99}{{job="{job}"}} > bool {_num(lo)}) * ({P99}{{job="{job}"}} <= bool {_num(thr)})'
        tests.append({
            "interval": f"{step}s", "input_series": fast_only,
            "alert_rule_test": [{"alertname": ALERT_P99, "eval_time": at, "exp_alerts": []}],
            "promql_expr_test": [
                {"expr": inside, "eval_time": at, "exp_samples": [{"labels": f'{{job="{job}"}}', "value": 1}]},
                # no request failed: the error ratio is 0 (not absent)
                {"expr": f'{ERRORS}{{job="{job}"}}', "eval_time": at,
                 "exp_samples": [{"labels": f'{ERRORS}{{job="{job}"}}', "value": 0}]},
            ],
        })  # fmt: skip
    return {"rule_files": ["rules.yml"], "evaluation_interval": t.evaluation_interval, "tests": tests}


def _literal(selector: str) -> str:
    """An error selector's labels as literal series labels (`status=~"5.."` → `status="500"`,
    `status="5xx"` stays)."""
    out = []
    for part in selector.split(","):
        k, _, v = part.partition("=")
        k = k.strip().rstrip("~")
        v = v.lstrip("~").strip('"')
        if k == "handler":
            v = "/v1/embeddings"
        elif v == "5..":
            v = "500"
        out.append(f'{k}="{v}"')
    return ",".join(out)
