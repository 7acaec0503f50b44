"""Kubernetes manifests (Deployment, Service, PodDisruptionBudget, HorizontalPodAutoscaler,
a ConfigMap for a vLLM config) and a Helm chart with the same content as values + templates.

The manifests are plain dicts dumped as YAML. The chart's templates are the same dicts with
the deployment-specific values (image, replicas, resources, probes, autoscaling bounds, ...)
replaced by `.Values` lookups, so `helm template` with the chart's own values.yaml renders
the manifests under k8s/ (checked in the tests by substituting the values; Helm itself is
not installed here).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import yaml

from mopt_deploy.plan import CapacityPlan, Memory
from mopt_deploy.served import Served

ANNOTATION = "mopt.dev/"
PROBE_PATH = "/health"


@dataclass(frozen=True)
class Shape:
    """The deployment's settings that are not measurements (the recipe's params)."""

    name: str
    namespace: str
    cpu_request: str
    cpu_limit: str | None
    max_replicas: int | None
    startup_margin: float
    probe_period_s: int
    gpu_resource: str
    node_selector: dict[str, str]
    model_pvc: str | None
    termination_grace_s: int


def dns_name(s: str) -> str:
    """A DNS-1123 label (what Kubernetes names must be)."""
    out = re.sub(r"[^a-z0-9-]+", "-", s.lower()).strip("-")[:63].strip("-")
    return out or "model"


def probes(served: Served, shape: Shape) -> dict[str, Any]:
    """Start-up, readiness and liveness probes on /health, timed from the measured start-up:
    the startup probe allows `startup_margin` × the measured time before the kubelet gives
    up; readiness is first asked when a start can have finished; liveness starts after the
    startup probe succeeded (Kubernetes holds it until then)."""
    period = shape.probe_period_s
    budget = served.startup_s * shape.startup_margin
    http = {"path": PROBE_PATH, "port": "http"}
    return {
        "startupProbe": {"httpGet": http, "periodSeconds": period, "timeoutSeconds": 2,
                         "failureThreshold": max(3, math.ceil(budget / period))},
        "readinessProbe": {"httpGet": http, "initialDelaySeconds": int(served.startup_s), "periodSeconds": period,
                           "timeoutSeconds": 2, "failureThreshold": 3},
        "livenessProbe": {"httpGet": http, "periodSeconds": 2 * period, "timeoutSeconds": 5, "failureThreshold": 3},
    }  # fmt: skip


def resources(served: Served, mem: Memory, shape: Shape) -> dict[str, Any]:
    req: dict[str, Any] = {"cpu": shape.cpu_request, "memory": mem.request_mi}
    lim: dict[str, Any] = {"memory": mem.limit_mi}
    if shape.cpu_limit:
        lim["cpu"] = shape.cpu_limit
    if served.gpus:  # extended resources: requests must equal limits
        req[shape.gpu_resource] = served.gpus
        lim[shape.gpu_resource] = served.gpus
    return {"requests": req, "limits": lim}


def autoscaling(plan: CapacityPlan, served: Served, shape: Shape) -> dict[str, Any]:
    """min = the replicas at the knee's lower bound, max = the recipe's or twice that; the
    metric is the requests in flight per pod, with the knee's concurrency as the target."""
    lo = plan.replicas_safe
    return {
        "minReplicas": lo,
        "maxReplicas": max(shape.max_replicas or 2 * lo, lo),
        "metric": "mopt_requests_in_flight",
        "targetAverageValue": str(served.knee.concurrency or 1),
    }


def values(served: Served, plan: CapacityPlan, mem: Memory, shape: Shape) -> dict[str, Any]:
    """What the Helm chart's values.yaml holds (and what the manifests are rendered from)."""
    return {
        "name": shape.name,
        "namespace": shape.namespace,
        "image": served.image,
        "replicas": plan.replicas_safe,
        "port": served.port,
        "resources": resources(served, mem, shape),
        "probes": probes(served, shape),
        "autoscaling": autoscaling(plan, served, shape),
        "pdb": {"maxUnavailable": max(1, plan.replicas_safe - plan.replicas)},
        "nodeSelector": dict(shape.node_selector),
        "modelClaim": shape.model_pvc if served.model_mount else None,
    }


#: values a template takes from .Values: manifest placeholder → (values path, how)
def _v(path: str) -> str:
    return f"__VALUE__{path}__"


def _b(path: str) -> str:
    return f"__BLOCK__{path}__"


def _labels(shape: Shape) -> dict[str, str]:
    return {"app.kubernetes.io/name": shape.name, "app.kubernetes.io/part-of": "mopt"}


def manifests(served: Served, plan: CapacityPlan, mem: Memory, shape: Shape, *, template: bool = False,
              annotations: dict[str, str] | None = None) -> dict[str, dict[str, Any]]:  # fmt: skip
    """file name → manifest. `template`: placeholders where the chart reads .Values."""
    vals = values(served, plan, mem, shape)

    def val(path: str) -> Any:
        if template:
            return _v(path)
        cur: Any = vals
        for part in path.split("."):
            cur = cur[part]
        return cur

    def block(path: str) -> Any:
        return _b(path) if template else val(path)

    name, ns = val("name"), val("namespace")
    labels = {"app.kubernetes.io/name": name, "app.kubernetes.io/part-of": "mopt"}
    selector = {"app.kubernetes.io/name": name}
    container: dict[str, Any] = {
        "name": "server",
        "image": val("image"),
        "imagePullPolicy": "IfNotPresent",
        "ports": [{"name": "http", "containerPort": val("port"), "protocol": "TCP"}],
        "resources": block("resources"),
        "startupProbe": block("probes.startupProbe"),
        "readinessProbe": block("probes.readinessProbe"),
        "livenessProbe": block("probes.livenessProbe"),
    }
    if served.command is not None:
        container["command"] = list(served.command)
    if served.args:  # the port the check passed is the Deployment's port
        port_arg = "__QUOTED__port__" if template else str(vals["port"])
        container["args"] = [port_arg if a == str(served.port) else a for a in served.args]
    if served.env:
        container["env"] = [{"name": k, "value": v} for k, v in sorted(served.env.items())]
    volumes: list[dict[str, Any]] = []
    mounts: list[dict[str, Any]] = []
    out: dict[str, dict[str, Any]] = {}
    if served.config_files:
        cm_name = f"{shape.name}-config" if not template else "__TEXT__{{ .Values.name }}-config__"
        out["configmap.yaml"] = {
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": cm_name, "namespace": ns, "labels": labels},
            "data": dict(served.config_files),
        }  # fmt: skip
        volumes.append({"name": "config", "configMap": {"name": cm_name}})
        mounts.append({"name": "config", "mountPath": served.config_mount, "readOnly": True})
    if served.model_mount:
        volumes.append(
            {"name": "model", "persistentVolumeClaim": {"claimName": val("modelClaim"), "readOnly": True}}
        )
        mounts.append({"name": "model", "mountPath": served.model_mount, "readOnly": True})
    if served.runtime == "vllm":  # vLLM's workers share tensors through /dev/shm (docker: --ipc=host)
        volumes.append({"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}})
        mounts.append({"name": "shm", "mountPath": "/dev/shm"})
    if mounts:
        container["volumeMounts"] = mounts
    pod_spec: dict[str, Any] = {
        "terminationGracePeriodSeconds": shape.termination_grace_s,
        "containers": [container],
    }
    if shape.node_selector:
        pod_spec["nodeSelector"] = block("nodeSelector")
    if volumes:
        pod_spec["volumes"] = volumes
    meta_ann = dict(annotations or {})
    out["deployment.yaml"] = {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": name, "namespace": ns, "labels": labels, **({"annotations": meta_ann} if meta_ann else {})},
        "spec": {
            "replicas": val("replicas"),
            "selector": {"matchLabels": selector},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            "template": {"metadata": {"labels": labels}, "spec": pod_spec},
        },
    }  # fmt: skip
    out["service.yaml"] = {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name, "namespace": ns, "labels": labels},
        "spec": {"selector": selector, "ports": [{"name": "http", "port": val("port"), "targetPort": "http",
                                                   "protocol": "TCP"}]},
    }  # fmt: skip
    out["pdb.yaml"] = {
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
        "metadata": {"name": name, "namespace": ns, "labels": labels},
        "spec": {"maxUnavailable": val("pdb.maxUnavailable"), "selector": {"matchLabels": selector}},
    }  # fmt: skip
    out["hpa.yaml"] = {
        "apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": name, "namespace": ns, "labels": labels},
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": name},
            "minReplicas": val("autoscaling.minReplicas"),
            "maxReplicas": val("autoscaling.maxReplicas"),
            "metrics": [{"type": "Pods", "pods": {
                "metric": {"name": val("autoscaling.metric")},
                "target": {"type": "AverageValue", "averageValue": val("autoscaling.targetAverageValue")},
            }}],
        },
    }  # fmt: skip
    return out


class _Dumper(yaml.SafeDumper):
    """YAML without anchors and aliases (Helm templates and kubectl users read it as text)."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def dump(doc: dict[str, Any]) -> str:
    return yaml.dump(doc, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=120)


def template_text(doc: dict[str, Any]) -> str:
    """A manifest with placeholders as a Helm template: scalars `{{ .Values.x }}` (strings
    quoted), blocks `{{- toYaml .Values.x | nindent N }}` under their key."""
    text = dump(doc)
    lines = []
    for line in text.splitlines():
        m = re.fullmatch(r"(\s*)(- )?([\w.-]+): (?:'|\")?__BLOCK__([\w.]+)__(?:'|\")?", line)
        if m:
            indent = len(m[1]) + (2 if m[2] else 0)
            lines.append(f"{m[1]}{m[2] or ''}{m[3]}:")
            lines.append(" " * (indent + 2) + f"{{{{- toYaml .Values.{m[4]} | nindent {indent + 2} }}}}")
            continue
        line = re.sub(r"(?:'|\")?__TEXT__(.+?)__(?:'|\")?$", lambda mm: mm[1], line)
        line = re.sub(r"'?__VALUE__([\w.]+)__'?", lambda mm: "{{ .Values." + mm[1] + " | toYaml }}", line)
        line = re.sub(r"'?__QUOTED__([\w.]+)__'?", lambda mm: "{{ .Values." + mm[1] + " | quote }}", line)
        lines.append(line)
    return "\n".join(lines) + "\n"


def chart_files(served: Served, plan: CapacityPlan, mem: Memory, shape: Shape, version: str,
                annotations: dict[str, str]) -> dict[str, str]:  # fmt: skip
    """chart/ path → text: Chart.yaml, values.yaml, templates/*.yaml."""
    chart = {
        "apiVersion": "v2",
        "name": shape.name,
        "description": f"{served.served_model} served by {served.runtime} (generated by mopt's deploy kind)",
        "type": "application",
        "version": version,
        "appVersion": served.image.rsplit("@", 1)[-1][:19] if served.image_pinned else served.image,
    }
    files = {"Chart.yaml": dump(chart), "values.yaml": dump(values(served, plan, mem, shape))}
    for fname, doc in manifests(served, plan, mem, shape, template=True, annotations=annotations).items():
        files[f"templates/{fname}"] = template_text(doc)
    return files
