"""What was served and what was measured, read from the inputs' files (JSON and YAML only).

A `deploy` target takes one measured artifact:

* `container-check` (mopt-serve): the CPU serving image run in docker; its `serve.json` has
  the load test, the knee under the SLO, the start-up and the kill -9 recovery times. The
  image is the `image` input (mopt-image's `image.json`: tag, digest, entrypoint, port).
* `serve-search` (mopt-serve): vLLM configs searched on a GPU; its output holds the winner's
  config files (`args.json`, `vllm.yaml`) and `search.json` (the winner's knee with its
  interval, start-up, GPU memory, vLLM version).
* `serve-check` (mopt-serve): one vLLM config started and load-tested (`serve.json`); the
  config files come from its `vllm` input, given as the `serve` input.

Nothing here imports another plugin: the formats are the files' documented contents.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from mopt.api import Artifact, BuildContext

#: z of a two-sided 95 % interval (the counting interval of a single load-test step)
Z95 = 1.959963984540054
_PINNED = re.compile(r"(?P<repo>[a-z0-9][a-z0-9._/:-]*)@(?P<digest>sha256:[0-9a-f]{64})")


class DeployInputError(RuntimeError):
    """An input is not what `deploy` can read; the message says which file and what to do."""


@dataclass(frozen=True)
class Metrics:
    """The series a runtime exposes on /metrics that the rules and the dashboard use."""

    latency: str  # a histogram of end-to-end request latency in seconds
    buckets: tuple[float, ...]  # its bucket boundaries (the `le` values below +Inf)
    requests: str  # a counter of requests (rate = requests/s)
    errors: str  # a counter selector of failed requests (server errors)
    in_flight: str  # PromQL of the requests being served per pod
    kv_cache: str | None = None  # a gauge of KV-cache usage in [0, 1]
    source: str = ""


#: mopt-image's embed server (mopt_image/servers/embed_server.py: prometheus-client)
EMBED_METRICS = Metrics(
    latency="mopt_embed_request_seconds",
    buckets=(0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10),
    requests="mopt_embed_requests_total",
    errors='mopt_embed_requests_total{status=~"5.."}',
    in_flight="mopt_embed_requests_in_flight",
    source="mopt-image's embed server: mopt_embed_request_seconds (histogram), mopt_embed_requests_total{status}, "
    "mopt_embed_requests_in_flight",
)
#: vllm/v1/metrics/loggers.py's request_latency_buckets (vllm:e2e_request_latency_seconds)
VLLM_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
#: vLLM's /metrics (seen on the H200 with vLLM 0.26: vllm:e2e_request_latency_seconds_count/_sum,
#: vllm:num_requests_running/_waiting, vllm:kv_cache_usage_perc; the histogram's buckets are
#: vllm/v1/metrics/loggers.py's request_latency_buckets; http_requests_total is the API
#: server's prometheus-fastapi-instrumentator counter, status codes grouped as "5xx")
VLLM_METRICS = Metrics(
    latency="vllm:e2e_request_latency_seconds",
    buckets=VLLM_BUCKETS,
    requests="vllm:e2e_request_latency_seconds_count",
    errors='http_requests_total{handler=~"/v1/.*",status="5xx"}',
    in_flight="vllm:num_requests_running + vllm:num_requests_waiting",
    kv_cache="vllm:kv_cache_usage_perc",
    source="vLLM: vllm:e2e_request_latency_seconds (histogram), vllm:num_requests_running/_waiting, "
    "vllm:kv_cache_usage_perc, http_requests_total (API server)",
)


@dataclass(frozen=True)
class Knee:
    """The highest measured load whose p99 met the SLO, per replica, with an interval."""

    concurrency: int | None
    requests_per_s: float
    requests_per_s_ci: tuple[float, float]
    tokens_per_s: float | None
    tokens_per_s_ci: tuple[float, float] | None
    p99_ms: float
    #: how the interval was obtained (it is part of the plan's text)
    interval: str
    #: False: the SLO held at every load tried, so the knee is at least this (the plan is safe)
    bounded: bool = True


@dataclass
class Served:
    """One served artifact as a deployment needs it."""

    runtime: str  # "embed" (mopt's CPU server in its image) or "vllm"
    measured_kind: str
    measured_target: str
    served_model: str
    image: str
    image_pinned: bool
    image_note: str
    port: int
    command: list[str] | None  # None: the image's entrypoint
    args: list[str]
    env: dict[str, str]
    startup_s: float
    startup_note: str
    recovery_s: float | None
    slo_p99_ms: float
    knee: Knee
    steps: list[dict[str, Any]]
    metrics: Metrics
    gpus: int = 0
    precision: str = "fp32"
    config_files: dict[str, str] = field(default_factory=dict)  # name → text (a ConfigMap)
    config_mount: str = "/config"
    model_mount: str | None = None  # vLLM: where the model volume goes
    model_digest: str | None = None
    facts: dict[str, Any] = field(default_factory=dict)  # what else was measured (for the plan)
    input_len: int | None = None
    texts_per_request: int = 1
    max_length: int = 512


def _json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise DeployInputError(f"{path}: cannot read {what} ({exc}); rebuild that target") from None


def pinned_image(ref: str) -> tuple[str, str] | None:
    """(repository, digest) of `repo@sha256:<64 hex>`, or None for a tag or anything else."""
    m = _PINNED.fullmatch(ref)
    return (m["repo"], m["digest"]) if m else None


def counting_interval(completed: int, duration_s: float) -> tuple[float, float]:
    """95 % interval of a rate from one step: `completed` requests in `duration_s` seconds
    (normal approximation of a Poisson count). It covers counting noise within the step, not
    run-to-run spread, which one step cannot show."""
    n = max(completed, 0)
    half = Z95 * math.sqrt(n)
    return (max(n - half, 0.0) / duration_s, (n + half) / duration_s)


def knee_of_steps(
    steps: list[dict[str, Any]], knee: dict[str, Any] | None, slo_ms: float, where: str
) -> Knee:
    """The knee of a serve-check / container-check load test (one step per load)."""
    if not knee:
        tried = (
            ", ".join(f"c={s['concurrency']}: p99 {s['p99_ms']:.1f} ms" for s in steps) or "no step finished"
        )
        raise DeployInputError(
            f"{where}: no load met the SLO (p99 <= {slo_ms:g} ms; {tried}): there is no knee to plan "
            "capacity from; lower the load-test concurrency or raise slo_p99_ms of the check"
        )
    c = int(knee["concurrency"])
    higher = [s for s in steps if s["concurrency"] > c]
    bounded = any(s["p99_ms"] > slo_ms or s.get("errors") for s in higher)
    rps = float(knee["requests_per_s"])
    ci = counting_interval(int(knee["completed"]), float(knee["duration_s"]))
    tps = knee.get("tokens_per_s")
    tci = None if not tps else (ci[0] * tps / rps, ci[1] * tps / rps)
    how = (f"counting interval of the knee's step ({knee['completed']} requests in {knee['duration_s']:.1f} s, "
           "95 %): one step per load, so no run-to-run spread")  # fmt: skip
    if not bounded:
        how += f"; the SLO held at every load tried (up to c={c}): the knee is at least this"
    return Knee(c, rps, ci, float(tps) if tps else None, tci, float(knee["p99_ms"]), how, bounded)


def _one(ctx: BuildContext, slot: str) -> Artifact | None:
    arts = ctx.inputs.get(slot) or []
    return arts[0] if len(arts) == 1 else None


def read_served(ctx: BuildContext, image_param: str | None, registry: str | None) -> Served:
    """The `measured` input (and `image` / `serve`) as a `Served`."""
    measured = ctx.input("measured")
    readers = {
        "container-check": _container_check,
        "serve-search": _serve_search,
        "serve-check": _serve_check,
    }
    if measured.kind not in readers:
        raise DeployInputError(f"deploy takes {', '.join(readers)} results, not {measured.kind!r}")
    served = readers[measured.kind](ctx, measured, image_param, registry)
    served.measured_target = f"{ctx.section}:{served.measured_target}"
    return served


def _image_ref(image_param: str | None, registry: str | None, info: dict[str, Any] | None,
               runtime_default: str | None) -> tuple[str, bool, str]:  # fmt: skip
    """The image the Deployment runs: (reference, pinned by digest, where it came from)."""
    if image_param:
        pin = pinned_image(image_param)
        return image_param, pin is not None, "the recipe's `image`" + ("" if pin else " (a tag: not pinned)")
    if info is not None:
        repo = (
            str(info["tag"]).rsplit(":", 1)[0]
            if ":" in str(info["tag"]).rsplit("/", 1)[-1]
            else str(info["tag"])
        )
        name = repo.rsplit("/", 1)[-1] if registry else repo
        ref = f"{registry.rstrip('/')}/{name}" if registry else repo
        how = (f"the image mopt built, by its manifest digest (push it there first: mopt image push RECIPE TARGET "
               f"{ref}@{info['image_digest']} keeps the digest)")  # fmt: skip
        return f"{ref}@{info['image_digest']}", True, how
    assert runtime_default is not None
    return (
        runtime_default,
        False,
        (
            f'no image digest is known: {runtime_default} is a tag; set image = "<repo>@sha256:<digest>" in the '
            "recipe (the vLLM image the config was measured with), or give an `image` input"
        ),
    )


def _container_check(
    ctx: BuildContext, art: Artifact, image_param: str | None, registry: str | None
) -> Served:
    doc = _json(art.path / "serve.json", "container-check's serve.json")
    img = _one(ctx, "image")
    if img is None and not image_param:
        raise DeployInputError(
            f"deploy of {art.label or art.target!r} needs the image it checked: add the section's `image` target "
            'to this target\'s input (input = ["check", "image"])'
        )
    info = _json(img.path / "image.json", "mopt-image's image.json") if img is not None else None
    if info is not None and info.get("image_digest") != doc.get("image_digest"):
        raise DeployInputError(
            f"the image input {img.label or img.target!r} ({info.get('image_digest')}) is not the image "  # type: ignore[union-attr]
            f"{art.label or art.target!r} checked ({doc.get('image_digest')}): give the check's own image target"
        )
    ref, pinned, note = _image_ref(image_param, registry, info, None)
    ports = (info or {}).get("ports") or [8000]
    spec = doc.get("loadtest_spec") or {}
    slo = float(doc["slo_p99_ms"])
    rec = (doc.get("recovery") or [{}])[-1]
    where = f"{art.label or art.target} (serve.json)"
    return Served(
        runtime="embed", measured_kind=art.kind, measured_target=art.label or art.target,
        served_model=(doc.get("models") or [ctx.model_name])[0], image=ref, image_pinned=pinned, image_note=note,
        port=int(ports[0]), command=None, args=["--port", str(int(ports[0]))], env={},
        startup_s=float(doc["startup_s"]),
        startup_note=f"docker run to /health 200, measured by {art.label or art.target}",
        recovery_s=rec.get("healthy_after_s"), slo_p99_ms=slo,
        knee=knee_of_steps(doc["loadtest"], doc.get("knee"), slo, where), steps=list(doc["loadtest"]),
        metrics=EMBED_METRICS, gpus=0, precision=_embed_precision(info),
        facts={"image_digest": doc.get("image_digest"), "image_builder": (doc.get("image_builder") or {}).get("name"),
               "min_cosine": doc.get("min_cosine"), "daemon": (doc.get("container") or {}).get("daemon")},
        input_len=spec.get("input_len"), texts_per_request=int(spec.get("texts_per_request") or 1),
    )  # fmt: skip


def _embed_precision(info: dict[str, Any] | None) -> str:
    """The served ONNX's weight precision, from the image's provenance labels (its model input's kind)."""
    labels = (info or {}).get("labels") or {}
    kinds = {v.split(" ", 1)[0] for k, v in labels.items() if k.startswith("dev.mopt.input.")}
    return "int8" if kinds & {"ort-quantize", "modelopt-quantize"} else "fp32"


def _vllm_files(folder: Path, where: str) -> tuple[dict[str, Any], dict[str, str]]:
    args = _json(folder / "args.json", "the vllm config's args.json")
    files = {}
    for name in ("vllm.yaml",):
        p = folder / name
        if not p.is_file():
            raise DeployInputError(f"{where}: no {name} beside args.json; rebuild the vllm target")
        files[name] = p.read_text(encoding="utf-8")
    return args, files


def _vllm_command(args: dict[str, Any], port: int, model_mount: str, config_mount: str) -> list[str]:
    argv = [a.replace("{model}", model_mount).replace("{here}", config_mount) for a in args["argv"]]
    return [*argv, "--host", "0.0.0.0", "--port", str(port)]


def _gpus_of(vllm_yaml: str) -> int:
    cfg = yaml.safe_load(vllm_yaml) or {}
    tp = int(cfg.get("tensor-parallel-size") or 1)
    pp = int(cfg.get("pipeline-parallel-size") or 1)
    return tp * pp


def _vllm_precision(cfg_meta: dict[str, Any]) -> str:
    if cfg_meta.get("qformat") == "fp8" or cfg_meta.get("quantization") in ("fp8", "modelopt"):
        return "fp8"
    return "bf16"


def _serve_search(ctx: BuildContext, art: Artifact, image_param: str | None, registry: str | None) -> Served:
    doc = _json(art.path / "search.json", "serve-search's search.json")
    winner = (doc.get("decision") or {}).get("winner")
    res = next((c for c in doc.get("configs") or [] if c.get("label") == winner), None)
    if res is None or not res.get("knee") or not res["knee"].get("concurrency"):
        raise DeployInputError(f"{art.path}/search.json: no winner with a knee; serve-search picked nothing")
    args, files = _vllm_files(art.path, art.label or art.target)
    img = _one(ctx, "image")
    info = _json(img.path / "image.json", "mopt-image's image.json") if img is not None else None
    vllm_version = (doc.get("fingerprint") or {}).get("vllm", "latest")
    ref, pinned, note = _image_ref(image_param, registry, info, f"vllm/vllm-openai:v{vllm_version}")
    port = 8000
    k = res["knee"]
    ci = k.get("tokens_per_s_ci")
    if not ci:
        raise DeployInputError(f"{art.path}/search.json: the winner's knee has no tokens_per_s_ci")
    rps, tps = float(k["requests_per_s"]), float(k["tokens_per_s"])
    knee = Knee(
        int(k["concurrency"]), rps, (ci[0] * rps / tps, ci[1] * rps / tps), tps, (float(ci[0]), float(ci[1])),
        float(k["p99_ms"]),
        "serve-search's interval of the knee's tokens/s (95 %), scaled to requests/s by the step's own "
        f"tokens per request ({tps / rps:.0f})",
        bounded=k.get("broke_at") is not None,
    )  # fmt: skip
    params = doc.get("params") or {}
    log = res.get("vllm_log") or {}
    return Served(
        runtime="vllm", measured_kind=art.kind, measured_target=f"{art.label or art.target} → {winner}",
        served_model=ctx.model_name, image=ref, image_pinned=pinned, image_note=note, port=port,
        command=_vllm_command(args, port, "/models/model", "/config"), args=[], env=dict(args.get("env") or {}),
        startup_s=float(res["startup_s"]),
        startup_note=f"vllm serve to /health 200 with an empty compile cache, measured by {art.label or art.target}",
        recovery_s=None, slo_p99_ms=float(doc["slo_p99_ms"]), knee=knee, steps=list(res.get("steps") or []),
        metrics=VLLM_METRICS, gpus=_gpus_of(files["vllm.yaml"]), precision=_vllm_precision(res.get("config") or {}),
        config_files=files, model_mount="/models/model",
        facts={"winner": winner, "gpu": (doc.get("fingerprint") or {}).get("gpu"), "vllm": vllm_version,
               "engine_gpu_mib": res.get("engine_mib"), "weights_gib": log.get("weights_gib"),
               "kv_cache_gib": log.get("kv_cache_gib"), "min_cosine": res.get("min_cosine")},
        input_len=params.get("input_len"), texts_per_request=int(params.get("texts_per_request") or 1),
        max_length=int(params.get("max_length") or 512),
    )  # fmt: skip


def _serve_check(ctx: BuildContext, art: Artifact, image_param: str | None, registry: str | None) -> Served:
    doc = _json(art.path / "serve.json", "serve-check's serve.json")
    serve = _one(ctx, "serve")
    if serve is not None and serve.kind != "vllm":
        raise DeployInputError(
            f"the serve input {serve.label or serve.target!r} is a {serve.kind!r}, not a vllm config"
        )
    if serve is None:
        raise DeployInputError(
            f"deploy of {art.label or art.target!r} needs the vllm config it checked: add that `vllm` target to "
            'this target\'s input (input = ["<serve-check>", "<vllm>"])'
        )
    args, files = _vllm_files(serve.path, serve.label or serve.target)
    img = _one(ctx, "image")
    info = _json(img.path / "image.json", "mopt-image's image.json") if img is not None else None
    ver = (doc.get("vllm") or {}).get("version") if isinstance(doc.get("vllm"), dict) else doc.get("vllm")
    ref, pinned, note = _image_ref(image_param, registry, info, f"vllm/vllm-openai:v{ver or 'latest'}")
    slo = float(doc["slo_p99_ms"])
    port = 8000
    spec = doc.get("loadtest_spec") or {}
    return Served(
        runtime="vllm", measured_kind=art.kind, measured_target=art.label or art.target, served_model=ctx.model_name,
        image=ref, image_pinned=pinned, image_note=note, port=port,
        command=_vllm_command(args, port, "/models/model", "/config"), args=[], env=dict(args.get("env") or {}),
        startup_s=float(doc["startup_s"]), startup_note=f"vllm serve to /health 200, measured by {art.label or art.target}",
        recovery_s=None, slo_p99_ms=slo,
        knee=knee_of_steps(doc["loadtest"], doc.get("knee"), slo, f"{art.label or art.target} (serve.json)"),
        steps=list(doc["loadtest"]), metrics=VLLM_METRICS, gpus=_gpus_of(files["vllm.yaml"]),
        precision=_vllm_precision(doc.get("config") or {}), config_files=files, model_mount="/models/model",
        facts={"engine_gpu_mib": (doc.get("gpu_memory") or {}).get("engine_mib"), "vllm": ver,
               "min_cosine": doc.get("min_cosine")},
        input_len=spec.get("input_len"), texts_per_request=int(spec.get("texts_per_request") or 1),
    )  # fmt: skip
