"""The `serve-search` target: which served config carries the most load under a latency SLO,
found cheaply and stated with its intervals.

One action takes every `vllm` config of a section (a sweep, vLLM's defaults, quantized
variants) and, one server at a time (`search_configs`):

1. predicts each config's knee before any server starts (`search.predict`: a closed-loop
   roofline whose overheads are fitted to earlier measurements of the same model, GPU and
   vLLM version, kept in the kind's cache folder as `history.jsonl`), and orders the configs:
   the baseline first, then by predicted knee;
2. starts the config (vLLM's compile cache in the kind's cache folder, the model at a path
   named by its digest, so configs that compile the same graph, and later builds, load it
   instead of compiling; the next config's imports, CPU only, run meanwhile and are paused
   while a step is timed: `prestart.py`), checks it (/v1/models, the cosine of its embeddings against the
   fp32 reference, gate `min_cosine`, or `min_cosine_quantized` for ModelOpt checkpoints);
3. **screens** it at one shared load (`screen_concurrency`, default the baseline's predicted
   knee); a config whose p99 there is clearly worse than the best screened so far stops here
   (successive halving, raced: no server starts twice);
4. **searches the knee** of the baseline and of every config still in the running, while its
   server is up: doubling, then bisection to `resolution` (search.search_knee);
5. decides (search.decide): the highest knee wins only beyond the tie band at the intervals;
   the winner is compared with the baseline, with an interval, or at equal load when the
   baseline has no knee.

It writes `search.json` (every step of every config, the predictions and their errors, the
start-ups, the decision), `selection.json` (the `select` format: winner, baseline, ratio,
variants), `serving.svg`, and the winner's config files; it appends what it measured to the
history. The checks and the load run in this process against `base_url`, so a test runs the
whole search against fake servers (`launch`).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import random
import shutil
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from pydantic import Field

from mopt.api import Artifact, BuildContext, CheckContext, Finding, Input, Params, TargetKind
from mopt.api import plugin_env as _env
from mopt_serve import search as S
from mopt_serve.common import CHECKPOINT_KINDS, PREFER_MODEL
from mopt_serve.loadgen import closed_loop, text_maker
from mopt_serve.plots import latency_throughput_svg
from mopt_serve.prestart import Prestarted, vllm_launcher
from mopt_serve.server import (
    DEFAULT_TEXTS,
    INSTALL_VLLM,
    _die_with_parent,
    cosines,
    embed,
    free_port,
    gpu_memory,
    local_vllm,
    parse_vllm_log,
    read_texts_file,
    reference_embeddings,
    serve_command,
    served_models,
)

FORMAT = "mopt-serve-search/1"


@dataclass
class Config:
    """One served config: its `vllm` artifact and the model it serves."""

    label: str
    serve_dir: Path
    model_dir: Path
    meta: dict[str, Any]
    index: int  # recipe order
    quantized: bool
    baseline: bool = False
    prediction: S.Prediction | None = None


@dataclass
class Result:
    label: str
    status: str = "lost"  # winner | lost | screened-out | excluded | unbuilt
    why: str = ""
    startup_s: float | None = None
    vllm_log: dict[str, Any] = field(default_factory=dict)
    engine_mib: float | None = None
    min_cosine: float | None = None
    mean_cosine: float | None = None
    screen: S.StepStats | None = None
    steps: list[S.StepStats] = field(default_factory=list)
    knee: S.Knee | None = None
    predicted: dict[str, Any] | None = None
    measure_s: float = 0.0  # seconds of load (all steps)
    wall_s: float = 0.0  # start to stop of its server
    config: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k not in ("screen", "steps", "knee")}
        d["screen"] = self.screen.to_json() if self.screen else None
        d["steps"] = [s.to_json() for s in self.steps]
        d["knee"] = self.knee.to_json() if self.knee else None
        return d


Launch = Callable[[Config], contextlib.AbstractContextManager[Any]]
Check = Callable[[Any, Config], tuple[float | None, float | None, list[str]]]


def search_configs(
    configs: list[Config],
    launch: Launch,
    check: Check,
    p: Any,
    texts_for: Callable[[int], list[str]],
    log: Callable[[str], None],
    progress: Callable[[str], None],
    ahead: Callable[[Config], None] = lambda cfg: None,
    quiet: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
) -> tuple[list[Result], S.Verdict, dict[str, Any]]:
    """Screen every config, search the knee of the baseline and the leaders, decide.
    `ahead(next)` is called as each config is launched (the next one's CPU-only start-up runs
    meanwhile); every timed step runs inside `quiet()` (that start-up paused)."""
    results: dict[str, Result] = {}
    best: list[S.StepStats] = []  # the best screening step so far (its p99 is lowest)
    screen_c = p.screen_concurrency or _screen_point(configs, p)
    log(f"screening load: concurrency {screen_c}; SLO p99 <= {p.slo_p99_ms} ms")
    order = _ordered(configs)
    for i, cfg in enumerate(order):
        res = results[cfg.label] = Result(cfg.label, config=_config_view(cfg.meta) | {"model_dir": str(cfg.model_dir)})
        res.predicted = cfg.prediction.to_json() if cfg.prediction else None
        t_wall = time.monotonic()
        try:
            if i + 1 < len(order):
                ahead(order[i + 1])
            with launch(cfg) as server:
                try:
                    _measure_config(cfg, res, server, check, p, screen_c, best, texts_for, progress, quiet)
                finally:
                    res.engine_mib = (gpu_memory(server.pid) or {}).get("engine_mib") if server.pid else None
            res.startup_s = round(server.startup_s, 1)
            if Path(server.log_path).is_file():
                res.vllm_log = parse_vllm_log(Path(server.log_path).read_text(errors="replace"))
        except Exception as e:  # one config that does not start is out; the search goes on
            res.status, res.why = "excluded", f"{type(e).__name__}: {e}"[:500]
            progress(f"{cfg.label}: excluded: {res.why.splitlines()[0]}")
        res.wall_s = round(time.monotonic() - t_wall, 1)
    ordered = [results[c.label] for c in sorted(configs, key=lambda c: c.index)]
    cons = [S.Contender(r.label, r.knee, (-(r.mean_cosine or 0.0), _index(configs, r.label)))
            for r in ordered if r.knee is not None and r.status == "lost"]  # fmt: skip
    verdict = S.decide(cons, p.tie_tolerance)
    if verdict.winner:
        results[verdict.winner].status = "winner"
        results[verdict.winner].why = verdict.why
    for r in ordered:
        if r.status == "lost" and not r.why and r.knee is not None and verdict.winner and r.knee.tokens_per_s:
            w = results[verdict.winner].knee
            assert w is not None
            ri = S.ratio_interval(r.knee, w)
            tied = r.label in verdict.tied
            r.why = ("tied; lost the tie-break (accuracy, recipe order): " if tied else "") + (
                f"{r.knee.tokens_per_s:,.0f} vs {w.tokens_per_s:,.0f} tokens/s at the SLO"
                + (f" ({ri[0]:.2f}x [{ri[1][0]:.2f}, {ri[1][1]:.2f}])" if ri else "")
            )
    base = next((c for c in configs if c.baseline), None)
    versus = vs_baseline(results, verdict.winner, base.label if base else None)
    return ordered, verdict, versus


def _measure_config(
    cfg: Config,
    res: Result,
    server: Any,
    check: Check,
    p: Any,
    screen_c: int,
    best: list[S.StepStats],
    texts_for: Callable[[int], list[str]],
    progress: Callable[[str], None],
    quiet: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
) -> None:
    """One config's turn while its server is up: check, screen, and search if it leads."""
    progress(f"{cfg.label}: healthy after {server.startup_s:.1f} s")
    res.min_cosine, res.mean_cosine, failures = check(server, cfg)
    if failures:
        res.status, res.why = "excluded", "; ".join(failures)
        progress(f"{cfg.label}: excluded: {res.why}")
        return

    def measure(c: int, phase: str) -> S.StepStats:
        t, texts = time.monotonic(), texts_for(c)
        with quiet():
            reqs, dur, err = closed_loop(
                server.base_url, server.model, texts, c,
                min_requests=p.min_requests, min_s=p.min_step_s, max_s=p.max_step_s,
                max_requests=p.max_requests, warmup=min(p.warmup_requests, 4 * c),
                texts_per_request=p.texts_per_request,
            )  # fmt: skip
        st = S.step_stats(c, reqs, dur, p.slo_p99_ms, p.confidence, phase, err)
        res.measure_s += time.monotonic() - t
        lo, hi = st.p99_ci_ms
        progress(
            f"{res.label}: c={c} ({phase}) {st.tokens_per_s:,.0f} tokens/s, p99 {st.p99_ms:.1f} ms "
            f"[{S._b(lo)}, {S._b(hi)}], SLO attainment {st.slo_attainment:.1%}, "
            f"{st.completed} requests, {st.errors} errors"
        )
        return st

    res.screen = measure(screen_c, "screen")
    if res.screen.errors:
        res.status, res.why = "excluded", f"{res.screen.errors} failed requests: {res.screen.error_sample}"
        res.steps = [res.screen]
        return
    lead, why = S.screen_leader(res.screen, best[0] if best else None, p.tie_tolerance)
    if not best or res.screen.p99_ms < best[0].p99_ms:
        best[:] = [res.screen]
    if not (lead or cfg.baseline):
        res.status, res.why, res.steps = "screened-out", why, [res.screen]
        progress(f"{cfg.label}: {why}")
        return
    res.knee, res.steps = S.search_knee(
        measure, screen_c, resolution=p.resolution, max_concurrency=p.max_concurrency, first=res.screen
    )
    k = res.knee
    if sum(s.errors for s in res.steps):
        res.status, res.why = "excluded", f"{sum(s.errors for s in res.steps)} load-test requests failed"
    elif k.concurrency is None:
        res.why = k.why
    if k.concurrency is not None and k.tokens_per_s_ci and k.tokens_per_s is not None:
        progress(f"{cfg.label}: knee c={k.concurrency} {k.tokens_per_s:,.0f} tokens/s "
                 f"[{k.tokens_per_s_ci[0]:,.0f}, {k.tokens_per_s_ci[1]:,.0f}] ({k.why})")  # fmt: skip
    else:
        progress(f"{cfg.label}: no knee: {k.why}")


def vs_baseline(results: dict[str, Result], winner: str | None, baseline: str | None) -> dict[str, Any]:
    """The winner against the baseline: the ratio of their knees with its interval, or, where
    the baseline has no knee, their throughput at the same (screening) load, said so."""
    if winner is None or baseline is None or baseline not in results:
        return {"baseline": baseline, "ratio": None, "ratio_ci": None, "basis": "none",
                "why": "no winner" if winner is None else "no baseline"}  # fmt: skip
    w, b = results[winner], results[baseline]
    if winner == baseline:
        return {"baseline": baseline, "ratio": 1.0, "ratio_ci": [1.0, 1.0], "basis": "knee",
                "why": "the baseline won"}  # fmt: skip
    if w.knee and b.knee and b.knee.concurrency is not None:
        r = S.ratio_interval(w.knee, b.knee)
        if r:
            return {"baseline": baseline, "ratio": r[0], "ratio_ci": list(r[1]), "basis": "knee",
                    "why": f"tokens/s at the SLO: {w.label} {w.knee.tokens_per_s:,.0f} vs {b.label} "
                           f"{b.knee.tokens_per_s:,.0f}"}  # fmt: skip
    if w.screen and b.screen and w.screen.concurrency == b.screen.concurrency:
        ws, bs = w.screen, b.screen
        ci = None
        if ws.tokens_per_s_ci and bs.tokens_per_s_ci and bs.tokens_per_s_ci[0] > 0:
            ci = [
                ws.tokens_per_s_ci[0] / bs.tokens_per_s_ci[1],
                ws.tokens_per_s_ci[1] / bs.tokens_per_s_ci[0],
            ]
        return {"baseline": baseline, "ratio": ws.tokens_per_s / bs.tokens_per_s if bs.tokens_per_s else None,
                "ratio_ci": ci, "basis": f"equal load (concurrency {ws.concurrency})",
                "why": f"{b.label} has no knee ({b.why or 'p99 above the SLO at every load tried'}): compared at "
                       f"equal load, concurrency {ws.concurrency}, p99 {ws.p99_ms:.1f} vs {bs.p99_ms:.1f} ms"}  # fmt: skip
    return {"baseline": baseline, "ratio": None, "ratio_ci": None, "basis": "none",
            "why": f"the baseline {b.label} was not measured ({b.status}: {b.why})"}  # fmt: skip


def _index(configs: list[Config], label: str) -> int:
    return next(c.index for c in configs if c.label == label)


def _ordered(configs: list[Config]) -> list[Config]:
    """The baseline first, then by predicted knee (highest first), then recipe order."""

    def key(c: Config) -> tuple[int, float, int]:
        k = c.prediction.knee_concurrency if c.prediction else None
        return (0 if c.baseline else 1, -(k or 0), c.index)

    return sorted(configs, key=key)


def _screen_point(configs: list[Config], p: Any) -> int:
    """The shared screening load: the baseline's predicted knee (else the first config's),
    within [1, max_concurrency]; 8 when nothing is predicted."""
    base = next((c for c in configs if c.baseline), configs[0] if configs else None)
    k = base.prediction.knee_concurrency if base and base.prediction else None
    return max(1, min(int(k or 8), p.max_concurrency))


def _config_view(meta: dict[str, Any]) -> dict[str, Any]:
    keep = ("quantization", "qformat", "model_target", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
            "gpu_memory_utilization", "defaults")  # fmt: skip
    return {k: meta.get(k) for k in keep if k in meta}


# --------------------------------------------------------------------------- the kind


class ServeSearchKind(TargetKind):
    """Screen every vLLM config at one load, search the knee of the leaders and the baseline,
    pick the config that serves the most under the SLO, with intervals."""

    name = "serve-search"
    sandbox = False  # vLLM on the GPU, as serve-check
    version = "2"  # 2: the next config prestarted
    reproducible = False  # latency numbers
    exclusive = True  # timed alone
    description = (
        "screen vLLM configs at one load, find the knee of the leaders, pick the best under a p99 SLO"
    )
    memory_model = "none"
    consumes = (
        Input("candidates", kinds=("vllm",), gather=True, partial=True),
        Input("model", formats=("modelopt-checkpoint", "hf-checkpoint"), prefer=PREFER_MODEL, gather=True),
        Input("reference", kinds=CHECKPOINT_KINDS),
    )
    produces = "selection"
    per_hardware = True
    requires = ("gpu", "hardware", "python:vllm", "python:torch", "python:transformers")
    resources: ClassVar[dict[str, int]] = {"cpu": 1, "gpu": 1}
    install_hints: ClassVar[dict[str, str]] = {"python:vllm": INSTALL_VLLM}

    class Params(Params):
        slo_p99_ms: float = Field(default=100.0, gt=0, description="the SLO: p99 end-to-end latency")
        baseline: str | None = Field(
            default=None,
            description="the config compared with (null: the one that leaves vLLM's defaults alone)",
        )
        screen_concurrency: int | None = Field(
            default=None, ge=1, description="the shared screening load (null: the baseline's predicted knee)"
        )
        resolution: float = Field(
            default=0.1, gt=0, le=1, description="bisect until the bracket is this close"
        )
        max_concurrency: int = Field(default=512, ge=1)
        min_requests: int = Field(
            default=800, ge=10, description="per step (>= ~730 for an upper bound on the p99 at 95%)"
        )
        min_step_s: float = Field(default=4.0, ge=0, description="per step, at least")
        max_step_s: float = Field(default=15.0, gt=0, description="per step, at most")
        max_requests: int = Field(default=4000, ge=10, description="per step, at most")
        warmup_requests: int = Field(
            default=64, ge=0, description="per step, not timed (at most 4 per client)"
        )
        tie_tolerance: float = Field(default=0.05, ge=0, lt=1)
        confidence: float = Field(default=0.95, gt=0.5, lt=1)
        input_len: int = Field(default=256, ge=8, description="tokens per request (mean)")
        input_len_range: float = Field(default=0.5, ge=0, lt=1)
        texts_per_request: int = Field(default=1, ge=1)
        texts: str | None = Field(
            default=None, description="held-out texts for the cosine check (.txt/.jsonl)"
        )
        num_texts: int = Field(default=64, ge=1)
        batch_size: int = Field(default=16, ge=1)
        max_length: int = Field(default=512, ge=1)
        min_cosine: float = Field(default=0.999, ge=-1, le=1, description="gate of unquantized configs")
        min_cosine_quantized: float = Field(
            default=0.95, ge=-1, le=1, description="gate of ModelOpt checkpoints"
        )
        startup_timeout_s: float = Field(default=600, gt=0)
        prestart: bool = Field(
            default=True,
            description="import the next config's vLLM (CPU only) while this one starts; paused while timed",
        )

    def input_files(self, params: Any, project_dir: Path) -> list[Path]:
        return [(project_dir / params.texts).resolve()] if params.texts else []

    def fingerprint(self) -> dict[str, str]:
        return {"vllm": _env.dist_version("vllm") or "missing", "torch": _env.dist_version("torch") or "missing",
                **_env.gpu_facts()}  # fmt: skip

    def check(self, params: Any, ctx: CheckContext) -> list[Finding]:
        if not ctx.hardware.is_gpu:
            return [Finding("error", "engine-on-cpu",
                            f"serve-search launches vLLM on a GPU; profile {ctx.hardware.name!r} has none",
                            "", ctx.section, ctx.target)]  # fmt: skip
        return []

    def run(self, ctx: BuildContext) -> dict[str, Any]:
        p = ctx.params
        if not _env.has_module("vllm"):
            raise RuntimeError(f"target kind 'serve-search' needs the Python package 'vllm' ({INSTALL_VLLM})")
        _env.require_gpu(self.name, ctx.hardware)
        if ctx.task not in (None, "embedding"):
            raise RuntimeError(f"serve-search measures embedding servers; this model's task is {ctx.task!r}")
        ref_art = ctx.input("reference")
        texts = (
            read_texts_file((ctx.project_dir / p.texts).resolve(), p.num_texts) if p.texts else DEFAULT_TEXTS
        )
        texts = (texts * (p.num_texts // len(texts) + 1))[: p.num_texts]
        # the fp32 reference (CPU) is computed while the first server starts
        pool = ThreadPoolExecutor(1)
        ref_future = pool.submit(reference_embeddings, ref_art.path, ctx.family, texts, p.max_length)
        cache = Path(ctx.cache_dir)
        history_path = cache / "history.jsonl"
        fp = self.fingerprint()
        configs = configs_of(ctx, cache)
        history = read_history(
            history_path, gpu=fp.get("gpu_name", ""), vllm=fp["vllm"], model=_model_key(ctx)
        )
        w = workload(ctx, ref_art)
        prof = S.Profile(ctx.hardware.fp16_tflops, ctx.hardware.bandwidth_gbps)
        for c in configs:
            c.prediction = S.predict(c.meta, w, prof, history, p.max_concurrency)
            ctx.log(f"predicted knee of {c.label}: {c.prediction.knee_concurrency} ({c.prediction.source})")
        # vLLM's compile cache (and inductor's, Triton's) in the store: kept between configs and
        # builds, never outside the store; vLLM keys its entries itself (config hash, model path)
        env_extra = {
            "VLLM_CACHE_ROOT": str(cache / "vllm"),
            "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
            "TRITON_CACHE_DIR": str(cache / "triton"),
            "HF_HUB_OFFLINE": "1",  # the model is a local folder: no lookups on the hub
        }
        make = text_maker(str(ref_art.path), p.input_len, p.input_len_range)

        @functools.cache
        def texts_for(c: int) -> list[str]:
            # the same texts for every config at one load, none repeated within a step (the
            # prefix cache would answer a repeat)
            return make(random.Random(1000 + c), p.max_requests + p.warmup_requests)

        def command(cfg: Config) -> tuple[list[str], int, dict[str, str], Path]:
            args = json.loads((cfg.serve_dir / "args.json").read_text())
            port = free_port()
            argv = serve_command(args, cfg.model_dir, cfg.serve_dir, port)
            env = {**os.environ, **args.get("env", {}), **env_extra}
            return argv, port, env, ctx.out / "logs" / f"{_safe(cfg.label)}.log"

        # the next config's imports run while this one starts and serves; paused while timed
        waiting: dict[str, tuple[Prestarted, tuple[list[str], int, dict[str, str], Path]]] = {}

        def ahead(cfg: Config) -> None:
            try:
                cmd = command(cfg)
                line = vllm_launcher(cmd[0], cfg.model_dir) if p.prestart else None
                if line is not None:
                    waiting[cfg.label] = (Prestarted.spawn(line, cmd[3], cmd[2], _die_with_parent), cmd)
            except Exception as e:  # only slower: it starts when its turn comes
                ctx.log(f"{cfg.label}: not prestarted ({type(e).__name__}: {e})")

        @contextlib.contextmanager
        def quiet() -> Iterator[None]:
            for pre, _ in waiting.values():
                pre.pause()
            try:
                yield
            finally:
                for pre, _ in waiting.values():
                    pre.resume()

        @contextlib.contextmanager
        def launch(cfg: Config) -> Iterator[Any]:
            pre, (argv, port, env, log_path) = waiting.pop(cfg.label, (None, command(cfg)))
            ctx.log("$ " + " ".join(argv) + (" (prestarted)" if pre else ""))
            with local_vllm(
                argv, log_path, port=port, startup_timeout_s=p.startup_timeout_s, env=env, pre=pre
            ) as server:
                server.model = cfg.meta.get("served_model_name") or ctx.model_name
                yield server

        def check(server: Any, cfg: Config) -> tuple[float | None, float | None, list[str]]:
            fails = []
            models = served_models(server.base_url)
            if server.model not in models:
                fails.append(f"/v1/models lists {models}, not {server.model!r}")
                return None, None, fails
            cos = cosines(embed(server.base_url, server.model, texts, p.batch_size), ref_future.result())
            lo, mean = min(cos), sum(cos) / len(cos)
            gate = p.min_cosine_quantized if cfg.quantized else p.min_cosine
            if not lo >= gate:
                fails.append(f"min cosine {lo:.5f} < {gate} (served vs the fp32 reference)")
            return lo, mean, fails

        t0 = time.monotonic()
        try:
            results, verdict, versus = search_configs(
                configs, launch, check, p, texts_for, ctx.log, ctx.progress, ahead, quiet
            )
        finally:
            for pre, _ in waiting.values():
                pre.cancel()
            pool.shutdown(wait=True, cancel_futures=True)
        total_s = time.monotonic() - t0
        unbuilt = [
            Result(m.label, "unbuilt", f"{m.status}: {m.reason}") for m in ctx.missing.get("candidates", [])
        ]
        append_history(history_path, results, configs, fp, _model_key(ctx), w)
        doc = {
            "format": FORMAT,
            "slo_p99_ms": p.slo_p99_ms,
            "params": p.model_dump(mode="json"),
            "fingerprint": fp,
            "wall_s": round(total_s, 1),
            "texts": getattr(make, "source", None),  # what the load sends
            "decision": verdict.to_json(),
            "vs_baseline": versus,
            "prediction_errors": prediction_errors(results),
            "configs": [r.to_json() for r in [*results, *unbuilt]],
        }
        (ctx.out / "search.json").write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
        lines = summary(doc)
        for line in lines:
            ctx.log(line)
        if verdict.winner is None:
            raise RuntimeError(f"no config of {ctx.section} met the SLO at any load:\n" + "\n".join(lines))
        win = next(c for c in configs if c.label == verdict.winner)
        for f in win.serve_dir.iterdir():
            if f.is_file():
                shutil.copy2(f, ctx.out / f.name)
        (ctx.out / "selection.json").write_text(
            json.dumps(selection_doc(doc, verdict), indent=2, sort_keys=True) + "\n"
        )
        (ctx.out / "serving.svg").write_text(plot(results, p.slo_p99_ms, verdict.winner), encoding="utf-8")
        wr = next(r for r in results if r.label == verdict.winner)
        assert wr.knee is not None
        return {
            "winner": verdict.winner,
            "winner_kind": "vllm",
            "objective": "max_throughput_under_slo",
            "value": wr.knee.tokens_per_s,
            "value_ci": list(wr.knee.tokens_per_s_ci) if wr.knee.tokens_per_s_ci else None,
            "tie": verdict.tie,
            "baseline": versus["baseline"],
            "ratio_vs_baseline": versus["ratio"],
            "ratio_vs_baseline_ci": versus["ratio_ci"],
            "slo_p99_ms": p.slo_p99_ms,
            "search_s": round(total_s, 1),
            "eligible": sum(1 for r in results if r.status in ("winner", "lost")),
            "variants": len(results) + len(unbuilt),
            "verdicts": {
                r.label: {"status": r.status if r.status != "screened-out" else "lost", "why": r.why}
                for r in [*results, *unbuilt]
            },
            "explain": lines[:12],
            "figures": ["serving.svg"],
            "winner_min_cosine": wr.min_cosine,
            "quantization": win.meta.get("quantization"),
        }


def configs_of(ctx: BuildContext, cache: Path) -> list[Config]:
    """The `vllm` candidates with the model each serves (by target), at a path named by the
    model's digest (vLLM's compile cache keys on the model's path)."""
    models = {m.target: m for m in ctx.inputs.get("model", [])}
    base = ctx.params.baseline
    out = []
    for i, art in enumerate(ctx.inputs.get("candidates", [])):
        meta = dict(art.meta or {})
        mt = meta.get("model_target")
        if mt not in models:
            raise RuntimeError(
                f"the vllm config {art.label or art.target!r} serves {mt!r}, which is not among this target's "
                f"model inputs ({', '.join(sorted(models)) or 'none'}): add it to the section's targets"
            )
        model = models[mt]
        label = art.label or art.target
        out.append(Config(label, art.path, stable_model_dir(cache, model), meta, i,
                          quantized=model.kind == "modelopt-ptq"))  # fmt: skip
    if not out:
        raise RuntimeError("serve-search got no vllm config (every candidate failed or was not built)")
    pick = next((c for c in out if c.label == base), None) if base else next(
        (c for c in out if c.meta.get("defaults")), None)  # fmt: skip
    if base and pick is None:
        raise RuntimeError(f"baseline {base!r} is not among the configs: {', '.join(c.label for c in out)}")
    if pick is not None:
        pick.baseline = True
    return out


def stable_model_dir(cache: Path, model: Artifact) -> Path:
    """The model's files linked (else copied) under `cache/models/<digest>`, once: the same
    path for the same bytes in every action and build, so vLLM's compile cache, which hashes
    the model's path, hits."""
    dest = cache / "models" / model.digest[:24]
    if dest.is_dir():
        return dest
    tmp = dest.with_name(dest.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)

    def link(src: str, dst: str) -> None:
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    shutil.copytree(model.path, tmp, copy_function=link)
    try:
        os.rename(tmp, dest)
    except OSError:  # another action made it first: the same bytes
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _model_key(ctx: BuildContext) -> str:
    ref = ctx.input("reference")
    return str(ref.digest)


def workload(ctx: BuildContext, ref: Artifact) -> S.Workload:
    p = ctx.params
    params = 0.0
    total = 0
    for f in ref.path.glob("*.safetensors"):
        total += f.stat().st_size
    params = total / 4 if total else 6e8  # fp32 weights
    return S.Workload(p.input_len, p.texts_per_request, params, params * 2, p.slo_p99_ms)


def read_history(path: Path, *, gpu: str, vllm: str, model: str) -> list[dict[str, Any]]:
    """Earlier measurements of the same model on the same GPU and vLLM version."""
    out = []
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        try:
            h = json.loads(line)
        except ValueError:
            continue  # a torn line of a killed build
        if isinstance(h, dict) and (h.get("gpu"), h.get("vllm"), h.get("model")) == (gpu, vllm, model):
            out.append(h)
    return out


def append_history(
    path: Path, results: list[Result], configs: list[Config], fp: dict[str, str], model: str, w: S.Workload
) -> None:
    by = {c.label: c for c in configs}
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        for r in results:
            if not r.steps:
                continue
            f.write(json.dumps({
                "date": time.strftime("%Y-%m-%d %H:%M:%S"), "gpu": fp.get("gpu_name", ""), "vllm": fp["vllm"],
                "model": model, "label": r.label, "config": by[r.label].meta, "config_key": S.config_key(by[r.label].meta),
                "input_len": w.input_len, "slo_p99_ms": w.slo_p99_ms,
                "knee_concurrency": r.knee.concurrency if r.knee else None,
                "points": [[s.concurrency, s.mean_ms / 1000] for s in r.steps if s.errors == 0],
            }) + "\n")  # fmt: skip


def prediction_errors(results: list[Result]) -> list[dict[str, Any]]:
    """Predicted vs measured knee per searched config, and the error."""
    out = []
    for r in results:
        pk = (r.predicted or {}).get("knee_concurrency")
        mk = r.knee.concurrency if r.knee else None
        err = (pk - mk) / mk if pk is not None and mk else None
        out.append({"label": r.label, "predicted": pk, "measured": mk, "error": err,
                    "source": (r.predicted or {}).get("source")})  # fmt: skip
    return out


def summary(doc: dict[str, Any]) -> list[str]:
    lines = [f"SLO p99 <= {doc['slo_p99_ms']} ms; search {doc['wall_s']} s"]
    for c in doc["configs"]:
        k = c.get("knee") or {}
        ci = k.get("tokens_per_s_ci")
        kn = (f"knee c={k['concurrency']} {k['tokens_per_s']:,.0f} tok/s [{ci[0]:,.0f}, {ci[1]:,.0f}]"
              if k.get("concurrency") and ci else "no knee" if k else "not searched")  # fmt: skip
        lines.append(f"  {c['label']}: {c['status']}; start {c.get('startup_s')} s; {kn}; "
                     f"predicted c={(c.get('predicted') or {}).get('knee_concurrency')}; {c.get('why', '')}")  # fmt: skip
    d, v = doc["decision"], doc["vs_baseline"]
    lines.append(("tie: " if d["tie"] else "decided: ") + d["why"])
    if v.get("ratio") is not None:
        ci = v.get("ratio_ci")
        lines.append(f"vs baseline {v['baseline']} ({v['basis']}): {v['ratio']:.2f}x"
                     + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else "") + f"; {v['why']}")  # fmt: skip
    else:
        lines.append(f"vs baseline: {v['why']}")
    return lines


def selection_doc(doc: dict[str, Any], verdict: S.Verdict) -> dict[str, Any]:
    """The `select` kind's shape, for consumers of a selection (report, images)."""
    v = doc["vs_baseline"]
    return {
        "format": "mopt-select/2",
        "objective": "max_throughput_under_slo",
        "winner": verdict.winner,
        "decision": verdict.to_json() | {"method": "knee search"},
        "baseline": v["baseline"],
        "ratio_vs_baseline": v["ratio"],
        "ratio_vs_baseline_ci": v["ratio_ci"],
        "ratio_basis": v["basis"],
        "slo_p99_ms": doc["slo_p99_ms"],
        "variants": [
            {
                "label": c["label"],
                "status": c["status"],
                "why": c["why"],
                "min_cosine": c["min_cosine"],
                "value": (c.get("knee") or {}).get("tokens_per_s"),
                "ci": (c.get("knee") or {}).get("tokens_per_s_ci"),
                "knee_concurrency": (c.get("knee") or {}).get("concurrency"),
            }
            for c in doc["configs"]
        ],
    }


def plot(results: list[Result], slo: float, winner: str | None) -> str:
    series = []
    for r in results:
        if not r.steps:
            continue
        style = "winner" if r.label == winner else ("" if r.status == "lost" else "dim")
        kn = None
        if r.knee and r.knee.concurrency is not None:
            kn = next((s.to_json() for s in r.steps if s.concurrency == r.knee.concurrency), None)
        series.append((r.label, [s.to_json() for s in r.steps], kn, style))
    return latency_throughput_svg(series, slo, f"p99 vs tokens/s per config, searched (SLO {slo} ms)")


def _safe(label: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in label)[:80] or "config"
