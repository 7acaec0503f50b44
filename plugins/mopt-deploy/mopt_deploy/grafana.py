"""The Grafana dashboard of the bundle, built with grafana-foundation-sdk (Grafana's own
dashboards-as-code library), over the recording rules of rules.yml: the SLO, the plan's
target and the knee are threshold lines on the panels they belong to."""

from __future__ import annotations

import json
from typing import Any

from mopt_deploy import prom
from mopt_deploy.plan import CapacityPlan
from mopt_deploy.served import Served


def dashboard_json(served: Served, plan: CapacityPlan, job: str, t: prom.Thresholds) -> str:
    """The dashboard as Grafana's JSON model (import it, or provision it from a file)."""
    from grafana_foundation_sdk.builders import common as cb
    from grafana_foundation_sdk.builders import dashboard, prometheus, stat, timeseries
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models import common as cm
    from grafana_foundation_sdk.models.dashboard import DataSourceRef, Threshold, ThresholdsMode

    ds = DataSourceRef(type_val="prometheus", uid="${datasource}")
    sel = f'{{job="{job}"}}'

    def query(expr: str, legend: str, ref: str = "A") -> Any:
        return prometheus.Dataquery().expr(expr).legend_format(legend).ref_id(ref)

    def line_at(value: float, color: str = "red") -> Any:
        return (
            dashboard.ThresholdsConfig()
            .mode(ThresholdsMode.ABSOLUTE)
            .steps([Threshold(None, "green"), Threshold(value, color)])
        )

    def series(
        title: str, unit: str, targets: list[Any], threshold: float | None = None, desc: str = ""
    ) -> Any:
        p = timeseries.Panel().title(title).description(desc).unit(unit).datasource(ds).height(8).span(12)
        for q in targets:
            p = p.with_target(q)
        if threshold is not None:
            p = p.thresholds(line_at(threshold)).thresholds_style(
                cb.GraphThresholdsStyleConfig().mode(cm.GraphTresholdsStyleMode.LINE)
            )
        return p

    slo_s = plan.slo_p99_ms / 1000
    target_rps = plan.target if plan.unit == "requests/s" else None
    d = (
        dashboard.Dashboard(f"{job}: serving (mopt)")
        .uid(f"mopt-{job}"[:40])
        .tags(["mopt", served.runtime])
        .refresh("30s")
        .time("now-1h", "now")
        .with_variable(dashboard.DatasourceVariable("datasource").type("prometheus"))
        .with_panel(
            stat.Panel().title("capacity plan").datasource(ds).height(4).span(24)
            .description(" ".join(plan.lines()))
            .with_target(query(f"{prom.UP}{sel}", "replicas up"))
        )
        .with_panel(series(
            "latency p50 / p99", "s",
            [query(f"{prom.P50}{sel}", "p50"), query(f"{prom.P99}{sel}", "p99", "B")],
            slo_s, f"from {served.metrics.latency}; the red line is the SLO (p99 <= {plan.slo_p99_ms:g} ms)",
        ))
        .with_panel(series(
            "requests/s", "reqps", [query(f"{prom.RATE}{sel}", "requests/s")], target_rps,
            f"the red line is the plan's target ({plan.target:,.6g} {plan.unit}); one replica's knee is "
            f"{plan.knee:,.1f} {plan.unit}",
        ))
        .with_panel(series(
            "error ratio", "percentunit", [query(f"{prom.ERRORS}{sel}", "errors")], t.max_error_ratio,
            "server errors / requests",
        ))
        .with_panel(series(
            "requests in flight", "short", [query(f"{prom.IN_FLIGHT}{sel}", "in flight (all replicas)")],
            float((served.knee.concurrency or 1) * plan.replicas),
            f"the knee was {served.knee.concurrency} concurrent requests per replica (the HPA's target)",
        ))
        .with_panel(series(
            "replicas up", "short", [query(f"{prom.UP}{sel}", "up")], None,
            f"the plan: {plan.sentence()}",
        ))
    )  # fmt: skip
    if served.metrics.kv_cache:
        d = d.with_panel(series("KV-cache usage", "percentunit", [query(f"{prom.KV}{sel}", "max over replicas")],
                                t.kv_cache_usage, "vllm:kv_cache_usage_perc"))  # fmt: skip
    return json.dumps(d.build(), cls=JSONEncoder, indent=2, sort_keys=True) + "\n"
