"""Where an action may run on a Ray cluster, and what a worker machine offers.

Rules (documented in the plugin's README):

* A GPU hardware profile's artifact that depends on the hardware (the kind is
  `per_hardware`, or requires `hardware`) runs only on a node started with the custom
  resource `mopt:<profile name>`; it takes 1 unit of it. A worker advertises one unit per
  group of `gpu_count` matching GPUs (`mopt worker --print-resources`).
* `num_gpus` is the kind's `gpu` slots, at least the profile's `gpu_count` when the kind
  requires `hardware`, at least 1 when it requires `gpu` or `cuda...`.
* `num_cpus` is the kind's `cpu` slots (default 1).
* The `cpu` profile (and any `device = "cpu"` profile) maps to no custom resource: every Ray
  node has CPUs, and a CPU profile means "any x86-64/aarch64 machine". Hardware-independent
  kinds (weights, onnx, ...) run on any node too, GPU sections included.
* Kinds listed in the executor's `portable_kinds` setting never take a profile resource
  (e.g. serving-config generators that are per_hardware but need no GPU to run).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from mopt.api import HardwareProfile, TargetKind

RESOURCE_PREFIX = "mopt:"


def profile_resource(profile_name: str) -> str:
    """The Ray custom resource naming hardware profile `profile_name`."""
    return f"{RESOURCE_PREFIX}{profile_name}"


@dataclass(frozen=True)
class Placement:
    """What one action asks Ray for."""

    num_cpus: float = 1.0
    num_gpus: float = 0.0
    resources: dict[str, float] = field(default_factory=dict)

    def demand(self) -> dict[str, float]:
        """As Ray names node resources: CPU, GPU and the custom ones (zeros left out)."""
        d = {"CPU": self.num_cpus, "GPU": self.num_gpus, **self.resources}
        return {k: v for k, v in d.items() if v > 0}


def placement(
    kind: TargetKind, params: Any, hardware: HardwareProfile, *, portable_kinds: Iterable[str] = ()
) -> Placement:
    """Ray resources for running `kind` with `params` for `hardware` (see the module doc)."""
    reqs = [r.strip().lower() for r in kind.requirements(params, hardware)]
    needs_hw = "hardware" in reqs
    needs_gpu = any(r == "gpu" or r.startswith("cuda") for r in reqs)
    slots = dict(kind.resources)
    num_cpus = float(slots.get("cpu", 1))
    num_gpus = float(slots.get("gpu", 0))
    if needs_hw and hardware.is_gpu:
        num_gpus = max(num_gpus, float(max(1, hardware.gpu_count)))
    elif needs_gpu or needs_hw:
        num_gpus = max(num_gpus, 1.0)
    resources: dict[str, float] = {}
    if hardware.is_gpu and (kind.per_hardware or needs_hw) and kind.name not in set(portable_kinds):
        resources[profile_resource(hardware.name)] = 1.0
    return Placement(num_cpus=num_cpus, num_gpus=num_gpus, resources=resources)


def _fmt(res: Mapping[str, float]) -> str:
    parts = []
    for k, v in sorted(res.items()):
        if (
            k.startswith("node:")
            or k in ("memory", "object_store_memory")
            or k.startswith("accelerator_type")
        ):
            continue
        parts.append(f"{k} {v:g}")
    return ", ".join(parts) or "nothing"


def infeasible(p: Placement, nodes: Iterable[Mapping[str, float]]) -> str | None:
    """None when some node's total resources can hold `p`, else why no node can."""
    demand = p.demand()
    nodes = [dict(n) for n in nodes]
    for n in nodes:
        if all(n.get(k, 0.0) >= v for k, v in demand.items()):
            return None
    total: dict[str, float] = {}
    for n in nodes:
        for k, v in n.items():
            total[k] = total.get(k, 0.0) + v
    custom = [k for k in p.resources if total.get(k, 0.0) <= 0]
    if custom:
        names = ", ".join(custom)
        res_json = "{" + ", ".join(f'"{k}": 1' for k in custom) + "}"
        profiles = ", ".join(k[len(RESOURCE_PREFIX) :] for k in custom)
        return (
            f"no Ray worker offers {names} (the cluster offers: {_fmt(total)}); start one on a "
            f"{profiles} machine with `ray start --address=<head> --resources='{res_json}'` "
            "(`mopt worker --print-resources` prints the JSON for a machine)"
        )
    return f"no single Ray node has {_fmt(demand)} (the cluster offers: {_fmt(total)})"


def local_resources(registry: Any, gpus: Any) -> tuple[dict[str, float], list[str]]:
    """The `ray start --resources` JSON for this machine, and notes on how it was found.

    One `mopt:<profile>` unit per group of `gpu_count` visible GPUs matching a GPU profile.
    CPU profiles need no resource. `gpus` is what the core handed the plugin (a command's
    `Core`, an `ExecutorSession`): its `probe_gpus()` and `gpu_matches()`. Without GPU
    detection: nothing.
    """
    notes: list[str] = []
    try:
        probe = gpus.probe_gpus()
    except (ImportError, AttributeError, OSError) as exc:  # detection not available here
        return {}, [f"GPU detection unavailable ({exc}); offering CPU-only work"]
    if not probe.visible:
        notes.append(f"no NVIDIA GPU visible ({probe.error or 'none found'}); offering CPU-only work")
        return {}, notes
    out: dict[str, float] = {}
    for p in registry.hardware.values():
        if not p.is_gpu:
            continue
        n = sum(1 for g in probe.visible if gpus.gpu_matches(g, p) is None)
        units = n // max(1, p.gpu_count)
        if units > 0:
            out[profile_resource(p.name)] = float(units)
    gpus = ", ".join(f"{g.index}: {g.name} (cc {g.cc})" for g in probe.visible)
    notes.append(f"visible GPUs: {gpus}")
    if not out:
        notes.append("no hardware profile matches these GPUs; offering CPU-only work")
    return out, notes


def node_resources() -> list[dict[str, float]]:
    """Total resources of every alive node of the connected Ray cluster."""
    import ray

    try:
        return [dict(n.get("Resources") or {}) for n in ray.nodes() if n.get("Alive")]
    except Exception:  # an older/newer Ray without per-node detail: treat it as one node
        return [dict(ray.cluster_resources())]
