"""The capacity plan (replicas from the measured knee and its interval) and the memory a
replica requests (mopt check's parameter count of the model at the served precision, the
activations of the tokens in flight, the runtime's own)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from mopt.api import activation_bytes
from mopt_deploy.served import Served

MIB = 1 << 20
#: bytes per stored value (mopt check's table for the precisions served here)
BYTES = {"fp32": 4.0, "fp16": 2.0, "bf16": 2.0, "fp8": 1.0, "int8": 1.0}
#: a float quotient a hair above an integer (1.1 / 0.1 = 11.000000000000002) is that integer
_EPS = 1e-9


def replicas_for(target: float, per_replica: float) -> int:
    """⌈target / per_replica⌉, at least 1."""
    if per_replica <= 0:
        raise ValueError("a replica's capacity must be positive")
    return max(1, math.ceil(target / per_replica - _EPS))


@dataclass(frozen=True)
class CapacityPlan:
    """Replicas for a target load from the knee (per replica) and its interval."""

    unit: str  # "requests/s" or "tokens/s"
    target: float
    knee: float
    knee_ci: tuple[float, float]
    replicas: int  # at the knee
    replicas_safe: int  # at the interval's lower bound
    replicas_optimistic: int  # at the interval's upper bound
    gpus_per_replica: int
    slo_p99_ms: float
    interval: str
    bounded: bool

    @property
    def gpus(self) -> int:
        return self.replicas * self.gpus_per_replica

    @property
    def gpus_safe(self) -> int:
        return self.replicas_safe * self.gpus_per_replica

    def sentence(self) -> str:
        """`4 replicas, 5 to be safe at the lower bound` (and the GPUs where there are any)."""
        gpu = lambda n: f" ({n * self.gpus_per_replica} GPU{'s' if n * self.gpus_per_replica != 1 else ''})"  # noqa: E731
        head = f"{self.replicas} replica{'s' if self.replicas != 1 else ''}"
        if self.gpus_per_replica:
            head += gpu(self.replicas)
        if self.replicas_safe == self.replicas:
            return head + ", the same at the lower bound of the knee's interval"
        return (
            head
            + f", {self.replicas_safe} to be safe at the lower bound"
            + (gpu(self.replicas_safe) if self.gpus_per_replica else "")
        )

    def lines(self) -> list[str]:
        u = self.unit
        lo, hi = self.knee_ci
        out = [
            f"capacity for {self.target:,.6g} {u} at p99 <= {self.slo_p99_ms:g} ms: {self.sentence()}",
            f"  knee per replica {self.knee:,.1f} {u} [{lo:,.1f}, {hi:,.1f}] ({self.interval})",
            f"  replicas = ceil({self.target:,.6g} / {self.knee:,.1f}) = {self.replicas}; at the lower bound "
            f"ceil({self.target:,.6g} / {lo:,.1f}) = {self.replicas_safe}; at the upper bound {self.replicas_optimistic}",
        ]
        if not self.bounded:
            out.append(
                "  the knee is a lower bound (the SLO held at every load tried): these replicas are enough"
            )
        return out

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(
            gpus=self.gpus, gpus_safe=self.gpus_safe, sentence=self.sentence(), knee_ci=list(self.knee_ci)
        )
        return d


def capacity_plan(
    served: Served, target_rps: float | None, target_tokens_per_s: float | None
) -> CapacityPlan:
    """The plan for the recipe's target (one of requests/s or tokens/s)."""
    k = served.knee
    if target_tokens_per_s is not None:
        if k.tokens_per_s is None or k.tokens_per_s_ci is None:
            raise ValueError(
                "target_tokens_per_s: the measurement recorded no tokens/s; give target_rps instead"
            )
        unit, target, knee, ci = "tokens/s", target_tokens_per_s, k.tokens_per_s, k.tokens_per_s_ci
    else:
        assert target_rps is not None
        unit, target, knee, ci = "requests/s", target_rps, k.requests_per_s, k.requests_per_s_ci
    lo, hi = ci
    return CapacityPlan(
        unit=unit, target=target, knee=knee, knee_ci=(lo, hi), replicas=replicas_for(target, knee),
        replicas_safe=replicas_for(target, lo) if lo > 0 else replicas_for(target, knee),
        replicas_optimistic=replicas_for(target, hi), gpus_per_replica=served.gpus, slo_p99_ms=served.slo_p99_ms,
        interval=k.interval, bounded=k.bounded,
    )  # fmt: skip


@dataclass(frozen=True)
class Memory:
    """A replica's memory request: weights + activations in flight + the runtime's own."""

    params: int | None
    weights_bytes: float
    activations_bytes: float
    tokens: int
    runtime_bytes: float
    request_bytes: float
    limit_bytes: float
    how: str

    @property
    def request_mi(self) -> str:
        return f"{math.ceil(self.request_bytes / MIB)}Mi"

    @property
    def limit_mi(self) -> str:
        return f"{math.ceil(self.limit_bytes / MIB)}Mi"


def memory(served: Served, dims: Any, *, tokens: int, runtime_mib: float, limit_factor: float) -> Memory:
    """A replica's memory from the model's dims (`mopt.api.ModelDims`, as `mopt check` reads
    config.json) at the served precision. The runtime is on the host: for vLLM the weights
    pass through host memory on load and the activations live on the GPU (not counted here)."""
    runtime = runtime_mib * MIB
    if dims is None:
        req = runtime
        how = f"runtime {runtime_mib:g} MiB only (no model config: add the section's `weights` as the model input)"
        return Memory(None, 0.0, 0.0, tokens, runtime, req, req * limit_factor, how)
    pc = dims.param_counts()
    prec = served.precision
    act_dtype = "fp32" if served.runtime == "embed" else "bf16"
    weights = pc.linear * BYTES[prec] + (pc.total - pc.linear) * BYTES[act_dtype]
    # the activations of one pass over `tokens` tokens, as mopt check counts them
    acts = activation_bytes(dims, tokens, act_dtype) if served.runtime == "embed" else 0.0
    req = weights + acts + runtime
    how = (f"weights {pc.total / 1e6:,.2f}M params ({pc.linear / 1e6:,.2f}M linear × {BYTES[prec]:g} B {prec}, rest × "
           f"{BYTES[act_dtype]:g} B) = {weights / MIB:,.1f} MiB"
           + (f" + activations of {tokens:,} tokens in flight = {acts / MIB:,.1f} MiB" if acts else "")
           + f" + runtime {runtime_mib:g} MiB; limit = {limit_factor:g} × request")  # fmt: skip
    return Memory(pc.total, weights, acts, tokens, runtime, req, req * limit_factor, how)
