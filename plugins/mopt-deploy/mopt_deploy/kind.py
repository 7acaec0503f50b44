"""The `deploy` kind: a checked serving artifact → a deployment bundle.

Output (no artifact format: nothing consumes a bundle; docs/deploy.md has its layout): k8s/ (Deployment, Service, PodDisruptionBudget, HPA, and a
ConfigMap for a vLLM config), chart/ (a Helm chart: the same manifests as templates over
values.yaml), capacity.json + capacity.svg (replicas from the measured knee and its interval
for the recipe's target), prometheus/ (scrape configs, recording rules, alerts, their promtool
unit tests, the prometheus-adapter rule of the HPA's metric), grafana/dashboard.json
(grafana-foundation-sdk), deploy.json (what was read, computed and validated, by which tool
and version) and README.md.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from pydantic import Field, field_validator, model_validator

from mopt.api import (
    BuildContext,
    CheckContext,
    ConfigError,
    Finding,
    Input,
    Params,
    TargetKind,
    package_versions,
)
from mopt_deploy import __version__, grafana, k8s, prom, validate
from mopt_deploy.figure import capacity_svg
from mopt_deploy.plan import capacity_plan, memory
from mopt_deploy.served import DeployInputError, pinned_image, read_served

_DURATION = re.compile(r"([0-9]+(ms|s|m|h))+")
_QUANTITY = re.compile(r"[0-9]+(\.[0-9]+)?m?")
#: host memory of the serving process besides the model, per runtime (MiB): the embed server
#: (Python, onnxruntime, FastAPI) was measured at ~100-160 MiB resident (tests/test_prometheus.py
#: reads process_resident_memory_bytes); vLLM's (torch, CUDA libraries, the API server) is assumed
RUNTIME_MIB = {"embed": 256, "vllm": 8192}
PACKAGES = ("kubernetes-validate", "grafana-foundation-sdk", "pyyaml", "matplotlib")


class DeployKind(TargetKind):
    """Kubernetes manifests, a Helm chart, a capacity plan from the measured knee, Prometheus
    rules and alerts and a Grafana dashboard for a checked serving artifact, validated by
    kubernetes-validate and promtool (and Helm where installed)."""

    name = "deploy"
    version = "1"
    description = (
        "k8s manifests + Helm chart + capacity plan + Prometheus rules + Grafana dashboard, validated"
    )
    consumes = (
        Input("measured", kinds=("container-check", "serve-search", "serve-check")),
        Input("image", kinds=("image",), required=False),
        Input("model", kinds=("weights",), required=False),
        # the vllm config a serve-check checked: only when named (a section has several)
        Input("serve", kinds=("*",), required=False),
    )
    per_hardware = True  # GPU requests and node selectors come from the profile
    network = False
    memory_model = "none"

    class Params(Params):
        target_rps: float | None = Field(default=None, gt=0, description="the load to plan for, requests/s")
        target_tokens_per_s: float | None = Field(default=None, gt=0, description="or the load in tokens/s")
        slo_p99_ms: float | None = Field(
            default=None,
            gt=0,
            description="null: the SLO the knee was measured at (must equal it when given)",
        )
        name: str | None = Field(default=None, description="the Kubernetes name (null: the model's name)")
        namespace: str = "default"
        image: str | None = Field(
            default=None,
            description='the image the cluster pulls, "<repo>@sha256:<digest>" (null: the image input)',
        )
        registry: str | None = Field(
            default=None, description="where `mopt image push` put the image input (its repository prefix)"
        )
        kubernetes_version: str = Field(
            default="1.32", description="the schemas kubernetes-validate checks against"
        )
        cpu_request: str = Field(
            default="1", description="CPU per replica (the knee holds for the cores it was measured with)"
        )
        cpu_limit: str | None = None
        memory_tokens: int | None = Field(
            default=None, ge=1, description="tokens in flight the activations are sized for "
            "(null: the knee's concurrency × texts per request × max length)",
        )  # fmt: skip
        runtime_memory_mib: float | None = Field(
            default=None, gt=0, description="null: 256 (embed), 8192 (vLLM)"
        )
        memory_limit_factor: float = Field(default=2.0, ge=1)
        startup_margin: float = Field(
            default=3.0, ge=1, description="the startup probe allows this × the measured start-up"
        )
        probe_period_s: int = Field(default=5, ge=1)
        max_replicas: int | None = Field(
            default=None, ge=1, description="HPA's maximum (null: twice the minimum)"
        )
        gpu_resource: str = "nvidia.com/gpu"
        node_selector: dict[str, str] | None = Field(
            default=None,
            description="null: a GPU profile's gpu_name as nvidia.com/gpu.product (GPU feature discovery)",
        )
        model_pvc: str | None = Field(
            default=None, description="vLLM: the claim holding the model (null: <name>-model)"
        )
        termination_grace_s: int = Field(default=30, ge=0)
        scrape_interval: str = "15s"
        evaluation_interval: str = "15s"
        rate_window: str = Field(default="1m", description="the window of rate() in the recording rules")
        slo_for: str = Field(default="5m", description="p99 over the SLO this long fires the alert")
        max_error_ratio: float = Field(default=0.01, gt=0, lt=1)
        errors_for: str = "5m"
        down_for: str = Field(default="1m", description="a target down this long fires the alert")
        kv_cache_usage_alert: float = Field(default=0.95, gt=0, le=1)

        @field_validator(
            "scrape_interval", "evaluation_interval", "rate_window", "slo_for", "errors_for", "down_for"
        )
        @classmethod
        def _duration(cls, v: str) -> str:
            if not _DURATION.fullmatch(v):
                raise ValueError(f"{v!r} is not a Prometheus duration (e.g. 15s, 1m, 1h30m)")
            return v

        @field_validator("cpu_request", "cpu_limit")
        @classmethod
        def _cpu(cls, v: str | None) -> str | None:
            if v is not None and not _QUANTITY.fullmatch(v):
                raise ValueError(f"{v!r} is not a CPU quantity (e.g. 1, 2, 500m)")
            return v

        @field_validator("name")
        @classmethod
        def _name(cls, v: str | None) -> str | None:
            if v is not None and k8s.dns_name(v) != v:
                raise ValueError(
                    f"{v!r} is not a Kubernetes name (lowercase letters, digits, '-'; e.g. {k8s.dns_name(v)!r})"
                )
            return v

        @model_validator(mode="after")
        def _one_target(self) -> DeployKind.Params:
            if (self.target_rps is None) == (self.target_tokens_per_s is None):
                raise ValueError("give the load to plan for: target_rps or target_tokens_per_s (one of them)")
            return self

    def fingerprint(self) -> dict[str, str]:
        """The libraries that write the bundle, and the tools that validate it (their record is output)."""
        return {**package_versions(*PACKAGES),
                "promtool": validate.tool_version(["promtool", "--version"]) or "absent",
                "helm": validate.tool_version(["helm", "version", "--short"]) or "absent"}  # fmt: skip

    def check(self, params: Any, ctx: CheckContext) -> list[Finding]:
        out = []
        if params.image and pinned_image(params.image) is None:
            out.append(Finding("warning", "deploy-image-not-pinned", f"image {params.image!r} is a tag, not a digest",
                               fix='image = "<repo>@sha256:<64 hex>"', section=ctx.section, target=ctx.target,
                               key="image"))  # fmt: skip
        if validate.tool_version(["promtool", "--version"]) is None:
            out.append(Finding("info", "deploy-no-promtool", "promtool is not installed: the bundle's rules will not "
                               "be checked by it here", fix="apt-get install prometheus", section=ctx.section,
                               target=ctx.target))  # fmt: skip
        return out

    def run(self, ctx: BuildContext) -> dict[str, Any]:
        p = ctx.params
        try:
            served = read_served(ctx, p.image, p.registry)
        except DeployInputError as exc:
            raise RuntimeError(str(exc)) from None
        if p.slo_p99_ms is not None and abs(p.slo_p99_ms - served.slo_p99_ms) > 1e-9:
            raise RuntimeError(
                f"slo_p99_ms = {p.slo_p99_ms:g}, but the knee was measured at p99 <= {served.slo_p99_ms:g} ms by "
                f"{served.measured_target}: set the same SLO on both (or leave slo_p99_ms out here)"
            )
        plan = capacity_plan(served, p.target_rps, p.target_tokens_per_s)
        dims, dims_note = _dims(ctx)
        tokens = (
            p.memory_tokens or (served.knee.concurrency or 1) * served.texts_per_request * served.max_length
        )
        mem = memory(served, dims, tokens=tokens, runtime_mib=p.runtime_memory_mib or RUNTIME_MIB[served.runtime],
                     limit_factor=p.memory_limit_factor)  # fmt: skip
        name = p.name or k8s.dns_name(ctx.model_name)
        hw = ctx.hardware
        selector = p.node_selector
        if selector is None:
            selector = (
                {"nvidia.com/gpu.product": hw.gpu_name.replace(" ", "-")} if hw.is_gpu and hw.gpu_name else {}
            )
        if served.gpus and not hw.is_gpu:
            raise RuntimeError(
                f"{served.measured_target} serves on {served.gpus} GPU(s); profile {hw.name!r} has none"
            )
        shape = k8s.Shape(name=name, namespace=p.namespace, cpu_request=p.cpu_request, cpu_limit=p.cpu_limit,
                          max_replicas=p.max_replicas, startup_margin=p.startup_margin, probe_period_s=p.probe_period_s,
                          gpu_resource=p.gpu_resource, node_selector=selector,
                          model_pvc=p.model_pvc or f"{name}-model", termination_grace_s=p.termination_grace_s)  # fmt: skip
        t = prom.Thresholds(slo_p99_ms=served.slo_p99_ms, slo_for=p.slo_for, max_error_ratio=p.max_error_ratio,
                            errors_for=p.errors_for, down_for=p.down_for, kv_cache_usage=p.kv_cache_usage_alert,
                            rate_window=p.rate_window, scrape_interval=p.scrape_interval,
                            evaluation_interval=p.evaluation_interval)  # fmt: skip
        annotations = {
            f"{k8s.ANNOTATION}section": ctx.section,
            f"{k8s.ANNOTATION}measured-by": served.measured_target,
            f"{k8s.ANNOTATION}capacity-plan": f"{plan.target:,.6g} {plan.unit} at p99 <= {plan.slo_p99_ms:g} ms: "
                                              + plan.sentence(),
        }  # fmt: skip
        out = ctx.out
        write = _writer(out)
        manifests = k8s.manifests(served, plan, mem, shape, annotations=annotations)
        for fname, doc in manifests.items():
            write(f"k8s/{fname}", k8s.dump(doc))
        for rel, text in k8s.chart_files(served, plan, mem, shape, __version__, annotations).items():
            write(f"chart/{rel}", text)
        write("prometheus/rules.yml", k8s.dump(prom.rules(served, plan, name, t)))
        write("prometheus/rules.test.yml", k8s.dump(prom.rule_tests(served, plan, name, t)))
        write(
            "prometheus/prometheus.yml",
            k8s.dump(prom.scrape_config(name, t, namespace=p.namespace, target=None)),
        )
        write("prometheus/prometheus-docker.yml", k8s.dump(
            prom.scrape_config(name, t, namespace=None, target=f"127.0.0.1:{served.port}")))  # fmt: skip
        write("prometheus/adapter.yml", k8s.dump(prom.adapter_rules(served)))
        write("grafana/dashboard.json", grafana.dashboard_json(served, plan, name, t))
        os.environ.setdefault("MPLCONFIGDIR", str(ctx.tmp / "matplotlib"))  # the worker restores the env
        write("capacity.svg", capacity_svg(served, plan, f"{ctx.section}: {served.measured_target}"))
        threshold, exact = prom.latency_threshold(served.slo_p99_ms, served.metrics.buckets)
        capacity = {**plan.to_json(), "measured_by": served.measured_target, "lines": plan.lines(),
                    "knee_concurrency": served.knee.concurrency, "knee_p99_ms": served.knee.p99_ms}  # fmt: skip
        write("capacity.json", json.dumps(capacity, indent=2, sort_keys=True) + "\n")
        ctx.log("validating: kubernetes-validate, promtool, helm (where installed)")
        record = {
            "kubernetes-validate": validate.kubernetes_validate(sorted((out / "k8s").glob("*.yaml")),
                                                                p.kubernetes_version),
            "promtool": validate.promtool(out / "prometheus", ["prometheus.yml", "prometheus-docker.yml"],
                                          "rules.yml", "rules.test.yml"),
            "helm": validate.helm(out / "chart"),
            "grafana": {"library": "grafana-foundation-sdk",
                        "version": package_versions("grafana-foundation-sdk")["grafana-foundation-sdk"],
                        "checked": "built by the library; not loaded into a Grafana here"},
            "not_run": ["no Kubernetes cluster here: nothing was applied, scheduled or autoscaled",
                        "prometheus/adapter.yml (prometheus-adapter) has no schema to check it against"],
        }  # fmt: skip
        for key in ("promtool", "helm"):
            if record[key].get("not_run"):
                ctx.log(f"{key}: {record[key]['not_run']}")
        doc = {
            "format": "mopt-deploy/1",
            "name": name,
            "namespace": p.namespace,
            "runtime": served.runtime,
            "served_model": served.served_model,
            "measured_by": served.measured_target,
            "image": {"ref": served.image, "pinned": served.image_pinned, "how": served.image_note},
            "startup_s": served.startup_s,
            "startup": served.startup_note,
            "recovery_s": served.recovery_s,
            "slo_p99_ms": served.slo_p99_ms,
            "latency_alert": {"threshold_s": threshold, "is_the_slo": exact, "buckets": list(served.metrics.buckets),
                              "histogram": served.metrics.latency},
            "knee": {"concurrency": served.knee.concurrency, "requests_per_s": served.knee.requests_per_s,
                     "requests_per_s_ci": list(served.knee.requests_per_s_ci),
                     "tokens_per_s": served.knee.tokens_per_s,
                     "tokens_per_s_ci": list(served.knee.tokens_per_s_ci) if served.knee.tokens_per_s_ci else None,
                     "p99_ms": served.knee.p99_ms, "interval": served.knee.interval, "bounded": served.knee.bounded},
            "capacity": capacity,
            "memory": {"request": mem.request_mi, "limit": mem.limit_mi, "how": mem.how, "params": mem.params,
                       "model_config": dims_note},
            "gpus_per_replica": served.gpus,
            "facts": served.facts,
            "metrics": served.metrics.source,
            "validation": record,
        }  # fmt: skip
        write("deploy.json", json.dumps(doc, indent=2, sort_keys=True) + "\n")
        write(
            "README.md",
            _readme(
                doc, plan.lines(), sorted(str(f.relative_to(out)) for f in out.rglob("*") if f.is_file())
            ),
        )
        lines = [*plan.lines(), f"image {served.image}" + ("" if served.image_pinned else " (NOT pinned by digest)"),
                 f"memory per replica: request {mem.request_mi}, limit {mem.limit_mi} ({mem.how})",
                 "validated: " + "; ".join(_said(v) for v in record.values() if isinstance(v, dict) and "tool" in v)]  # fmt: skip
        for line in lines:
            ctx.log(line)
        return {
            "plan": plan.sentence(),
            "target": plan.target,
            "target_unit": plan.unit,
            "replicas": plan.replicas,
            "replicas_safe": plan.replicas_safe,
            "gpus": plan.gpus,
            "gpus_safe": plan.gpus_safe,
            "knee": plan.knee,
            "knee_ci": list(plan.knee_ci),
            "slo_p99_ms": plan.slo_p99_ms,
            "image": served.image,
            "image_pinned": served.image_pinned,
            "validated_by": {
                k: v.get("version") for k, v in record.items() if isinstance(v, dict) and "tool" in v
            },
            "explain": lines,
            "figures": ["capacity.svg"],
        }


def _said(v: dict[str, Any]) -> str:
    if v.get("not_run"):
        return f"{v['tool']}: not run: {v['not_run']}"
    extra = f", Kubernetes {v['kubernetes']}" if v.get("kubernetes") else ""
    return f"{v['tool']} {v['version']}{extra}: {len(v.get('checked') or {})} checks passed"


def _dims(ctx: BuildContext) -> tuple[Any, str]:
    """The model's dims from its config.json (the `model` input), as `mopt check` reads them."""
    arts = ctx.inputs.get("model") or []
    if not arts:
        return None, "no model input: weights not counted"
    cfg_path = arts[0].path / "config.json"
    if ctx.family is None or not cfg_path.is_file():
        return None, f"{cfg_path} or the model's family is missing: weights not counted"
    try:
        return ctx.family.dims(
            json.loads(cfg_path.read_text())
        ), f"{arts[0].label or arts[0].target}/config.json"
    except (ConfigError, ValueError) as exc:
        return None, f"{cfg_path}: {exc}: weights not counted"


def _writer(out: Path) -> Any:
    def write(rel: str, text: str) -> None:
        path = out / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")

    return write


def _readme(doc: dict[str, Any], plan_lines: list[str], files: list[str]) -> str:
    v = doc["validation"]
    said = [f"- {_said(x)}" for x in v.values() if isinstance(x, dict) and "tool" in x]
    said += [f"- {x['tool']}: {what}: {why}" for x in v.values() if isinstance(x, dict)
             for what, why in (x.get("skipped") or {}).items()]  # fmt: skip
    img = doc["image"]
    return "\n".join([
        f"# {doc['name']}: deployment bundle (generated by mopt's deploy kind)",
        "",
        f"Serves {doc['served_model']} ({doc['runtime']}), measured by {doc['measured_by']}.",
        f"Image: `{img['ref']}` — {img['how']}." + ("" if img["pinned"] else " **Not pinned by digest.**"),
        "",
        "## Capacity plan",
        "",
        *[f"    {line}" for line in plan_lines],
        "",
        "## Validated",
        "",
        *said,
        *[f"- not run: {x}" for x in v["not_run"]],
        "",
        "## Files",
        "",
        *[f"- `{f}`" for f in sorted({*files, "README.md"})],
        "",
        "Apply: `kubectl apply -f k8s/` (the model's image must be reachable by the cluster), or",
        f"`helm install {doc['name']} chart/`. Prometheus: `prometheus/prometheus.yml` (pods of the Deployment) or",
        "`prometheus/prometheus-docker.yml` (one container on this host), with `prometheus/rules.yml`.",
        "",
    ])  # fmt: skip
