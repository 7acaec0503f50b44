"""The `select` target: the best variant of a section's sweep, by an objective, under gates.

It gathers every candidate artifact of the section (the kinds `validate` and `bench` take),
and the `validate` and `bench` results about them; it takes whatever got built (its slots
are `partial`): a variant that failed or cannot build on this machine is listed with the
reason, not fatal. A variant whose validation gate failed (`validate` with
`on_fail = "record"`) or that misses one of select's own gates is excluded; the fastest
(or whatever the objective says) of the rest wins. The output is the winner's files, so
downstream targets (`image`, `triton-repo`) can consume `select` and always carry the
current winner, plus:

- `selection.json` (`mopt-select/1`): the objective, the winner, and one row per variant
  with its numbers and why it lost or was excluded;
- `pareto.svg`: latency vs min cosine, size as the dot's area, the winner marked (the
  recipe report inlines it: the result names it under `figures`);
- `selection.html`: the table and the plot.

No variant passing is an error whose message is the table. The choice is deterministic:
variants whose objective values are within `tie_tolerance` of the best are tied, and a tie
goes to the higher mean cosine, then the smaller artifact, then the label in sort order.
Name the target `best` to get the winner at build/<model>/<hardware>/best/.

For `task = "text-generation"` (`select_generation`) the rows carry the generation gates'
numbers (top-1, perplexity ratio, KL, greedy) and the generation bench's (`mopt-genbench/1`:
TTFT, ITL, output tokens/s at one step of batch or concurrency); the objectives are
GEN_OBJECTIVES (default `max_output_tok_s`), and a tie goes to the lower KL, then the smaller
artifact, then the label.
"""

from __future__ import annotations

import json
import math
import shutil
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from mopt.api import Artifact, BuildContext, Input, Missing, Params, TargetKind
from pydantic import Field, model_validator

from mopt_ml import pages, plots
from mopt_ml.common import probe_level
from mopt_ml.decide import Decision, Estimate
from mopt_ml.finals import Finals
from mopt_ml.validate import TESTED_FORMATS

OBJECTIVES = (
    "min_latency_p99",
    "min_latency_p50",
    "max_throughput",
    "min_memory",
    "max_throughput_under_latency",
    "max_throughput_under_slo",
)

#: objectives of a text-generation section (bench.json `mopt-genbench/1`)
GEN_OBJECTIVES = (
    "max_output_tok_s",
    "min_ttft_p50",
    "min_ttft_p99",
    "min_itl_p50",
    "min_itl_p99",
    "max_output_tok_s_under_ttft",
    "min_memory",
)

#: files select writes next to the winner's
OWN_FILES = ("selection.json", "selection.html", "pareto.svg", "serving.svg")


class NoWinner(RuntimeError):
    """No variant of the sweep passed the gates."""


class SelectKind(TargetKind):
    """Pick the best variant of the section by `objective` among those that pass the gates."""

    name = "select"
    # 2: drift from the benches' probes; 3: the faster end of each probe (probe_level);
    # 4: head-to-head finals, intervals, a tie band (mopt_ml.finals, mopt_ml.decide)
    version = "4"
    reproducible = False  # the finals time the finalists
    exclusive = True  # timed alone: nothing else of the build runs beside the finals
    description = "the best variant of a sweep (objective + gates), with a table of why"
    consumes = (
        Input("candidates", formats=(*TESTED_FORMATS, "vllm-config"), gather=True, partial=True),
        # not required: a serving section selects on serve-check alone, an ONNX one on these
        Input("validate", kinds=("validate",), gather=True, partial=True, required=False),
        Input("bench", kinds=("bench",), gather=True, partial=True, required=False),
        # serve-check results (serve.json) about `vllm` candidates: max_throughput_under_slo
        Input("serve", kinds=("serve-check",), gather=True, partial=True, required=False),
    )
    produces = "selection"
    static_fingerprint = True

    class Params(Params):
        objective: (
            Literal[
                "min_latency_p99",
                "min_latency_p50",
                "max_throughput",
                "min_memory",
                "max_throughput_under_latency",
                "max_throughput_under_slo",
                "max_output_tok_s",
                "min_ttft_p50",
                "min_ttft_p99",
                "min_itl_p50",
                "min_itl_p99",
                "max_output_tok_s_under_ttft",
            ]
            | None
        ) = Field(
            default=None,
            description="what the winner is best at (null: min_latency_p99 for embeddings, "
            "max_output_tok_s for text generation)",
        )
        ttft_slo_ms: float | None = Field(
            default=None,
            gt=0,
            description="generation: max_output_tok_s_under_ttft's TTFT p99 budget (a ChatBox: 300 ms)",
        )
        baseline: str | None = Field(
            default=None,
            description="max_throughput_under_slo: the candidate the winner is compared with "
            "(null: the vllm config that leaves every vLLM default alone)",
        )
        latency_budget_ms: float | None = Field(
            default=None, gt=0, description="p99 budget of max_throughput_under_latency (ms)"
        )
        batch_size: int | None = Field(
            default=None,
            ge=1,
            description="bench point the latency objectives read (null: the largest measured)",
        )
        seq_len: int | None = Field(
            default=None, ge=1, description="bench point's sequence length (null: largest)"
        )
        min_cosine: float | None = Field(
            default=None, description="gate: exclude variants below this min cosine"
        )
        mean_cosine: float | None = Field(default=None, description="gate: exclude below this mean cosine")
        max_memory_mb: float | None = Field(
            default=None, gt=0, description="gate: exclude above this peak memory"
        )
        normalize: bool = Field(
            default=False,
            description="scale latencies by each bench's drift probe (a fixed workload timed between "
            "its calls; older benches: the PyTorch reference timed in the same run) to cancel "
            "machine drift between benches",
        )
        tie_tolerance: float = Field(
            default=0.03,
            ge=0.0,
            lt=1.0,
            description="a winner must beat the runner-up by more than this fraction, at `confidence` "
            "(the interval of their ratio wholly beyond 1 + tie_tolerance); else a tie, broken by "
            "accuracy (mean cosine; text generation: KL), then size, then the recipe's order",
        )
        confidence: float = Field(default=0.95, gt=0.5, lt=1.0, description="of the intervals the decision reads")
        finals: bool = Field(
            default=True,
            description="time the finalists side by side, interleaved in rounds, and decide on that "
            "(latency and throughput objectives, ONNX Runtime and OpenVINO candidates); false: decide "
            "on the benches' numbers, measured apart",
        )
        finals_margin: float | None = Field(
            default=None,
            ge=0.0,
            description="finalists: the variants whose bench value is within this fraction of the "
            "leader's (at least two, at most max_finalists, best first); null: the best "
            "max_finalists whatever their bench read (a bench timed under load read 3x slow)",
        )
        max_finalists: int = Field(default=4, ge=2, description="at most this many finalists")
        finals_min_rounds: int = Field(default=10, ge=3, description="rounds of the finals before the first decision")
        finals_max_rounds: int = Field(default=400, ge=3, description="rounds of the finals, at most")
        finals_max_seconds: float = Field(
            default=30.0, gt=0, description="seconds of finals, at most (then the decision is made on what was timed)"
        )

        @model_validator(mode="after")
        def _budget(self) -> SelectKind.Params:
            if self.objective == "max_throughput_under_latency" and self.latency_budget_ms is None:
                raise ValueError("objective max_throughput_under_latency needs latency_budget_ms")
            if self.objective == "max_output_tok_s_under_ttft" and self.ttft_slo_ms is None:
                raise ValueError("objective max_output_tok_s_under_ttft needs ttft_slo_ms")
            return self

    def fingerprint(self) -> dict[str, str]:
        return {}

    def run(self, ctx: BuildContext) -> dict[str, Any]:
        if ctx.params.objective == "max_throughput_under_slo":
            return run_serving(ctx)
        if ctx.task == "text-generation":
            return run_generation(ctx)
        sel = select(
            ctx.inputs.get("candidates", []),
            ctx.inputs.get("validate", []),
            ctx.inputs.get("bench", []),
            ctx.missing,
            ctx.params,
            finals=_finals_runner(ctx),
        )
        table = render_table(sel)
        win = _materialize_winner(ctx, sel, table)
        doc = sel.to_json()
        (ctx.out / "selection.json").write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
        svg = pareto_svg(sel)
        (ctx.out / "pareto.svg").write_text(svg, encoding="utf-8")
        (ctx.out / "selection.html").write_text(render_html(sel, svg, ctx.section), encoding="utf-8")
        ctx.log(f"winner: {sel.winner} ({sel.objective} {_fmt_value(sel.objective, win.value)})")
        return {
            "winner": sel.winner,
            "winner_kind": win.kind,
            "objective": sel.objective,
            "value": win.value,
            "eligible": sum(1 for r in sel.rows if r.status in ("winner", "lost")),
            "variants": len(sel.rows),
            # each candidate's outcome, for `mopt report`'s reason column (a generic result key)
            "verdicts": {r.label: {"status": r.status, "why": r.why} for r in sel.rows},
            "figures": ["pareto.svg"],
            "reports": ["selection.html"],
            # the winner's numbers, so `mopt report` shows them on this row
            "winner_min_cosine": win.min_cosine,
            "winner_p50_ms": win.p50_ms,
            "precision": win.meta.get("precision"),
            "quantization": win.meta.get("quantization"),
            "decision": sel.decision,
            # what `mopt build` prints under the "selected" line: the ranking and why
            "explain": ranking(sel),
        }


def _finals_runner(ctx: BuildContext) -> FinalsFn:
    """The finals of this select action: the finalists' ONNX / OpenVINO models served by
    benchworker processes, at their bench point, with their benches' thread count."""

    def run(finalists: list[Row], params: Any) -> tuple[Finals | None, str | None]:
        from mopt_ml.benchworker import save_inputs
        from mopt_ml.common import cpu_threads, load_tokenizer, texts_from_param
        from mopt_ml.finals import Finalist, run_finals
        from mopt_ml.timing import exclusive_cpu
        from mopt_ml.validate import is_openvino

        entrants = []
        for r in finalists:
            if r.path is None or r.bench_point is None:
                return None, f"{r.label} has no bench point"
            if is_openvino(r.path):
                backend, model = "openvino", str(r.path)
            elif (r.path / "model.onnx").is_file():
                backend, model = "onnx", str(r.path / "model.onnx")
            else:
                return None, f"{r.label} ({r.kind}) is not an ONNX or OpenVINO model: the finals time those only"
            pt = r.bench_point
            entrants.append(Finalist(r.label, backend, model, str(r.path), float(pt["p50_ms"]) / 1000.0, _tie_order(r)))
        pt = finalists[0].bench_point or {}
        point = (int(pt["batch"]), int(pt["seq"]))
        texts = texts_from_param(None, ctx.project_dir, "validation")
        save_inputs(ctx.tmp / "finals-inputs.npz", load_tokenizer(finalists[0].path), texts, [point])  # type: ignore[arg-type]
        threads = finalists[0].threads or cpu_threads(None)
        ctx.progress(f"finals: {', '.join(e.label for e in entrants)} at {point[0]}x{point[1]}, {threads} threads")
        with exclusive_cpu(ctx.log):
            fin = run_finals(
                entrants, point, threads=threads, inputs=str(ctx.tmp / "finals-inputs.npz"),
                statistic=FINALS_STAT[params.objective], tie_tolerance=params.tie_tolerance,
                confidence=params.confidence, min_rounds=params.finals_min_rounds,
                max_rounds=params.finals_max_rounds, max_seconds=params.finals_max_seconds,
                tmp=ctx.tmp, log=ctx.log,
            )  # fmt: skip
        ctx.progress(f"finals: {fin.rounds} rounds in {fin.seconds:.1f} s, stopped: {fin.stopped}")
        return fin, None

    return run


def embedding_params(params: Any) -> Any:
    """`params` with the embedding default objective (min_latency_p99) where it sets none.
    The default is resolved here, by task, not in the field: the engine hands an action its
    params as a full dump, so "unset" cannot be told from the field's default there."""
    if params.objective is not None:
        return params
    return params.model_copy(update={"objective": "min_latency_p99"})


# --------------------------------------------------------------------------- selection


@dataclass
class Row:
    """One variant: its numbers, and what became of it."""

    label: str
    kind: str
    path: Path | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    bytes: int | None = None
    min_cosine: float | None = None
    mean_cosine: float | None = None
    top1: float | None = None
    p50_ms: float | None = None
    p99_ms: float | None = None
    throughput: float | None = None  # sequences per second at the point
    baseline_ms: float | None = None  # the PyTorch reference's p50 at the point, same bench run
    probe_ms: float | None = None  # the drift probe's p50 in this bench's run (benchworker.Probe)
    drift: float = 1.0  # median probe (or baseline) / this run's (latencies are scaled by it)
    point: str | None = None  # "32x128"
    memory_mb: float | None = None
    value: float | None = None  # the objective's
    status: str = "lost"  # winner | lost | excluded | unbuilt
    why: str = ""
    # the objective's estimate the decision read, its interval and how many calls it rests on:
    # from the finals for a finalist, else from its bench (the median's interval at the point)
    median: float | None = None
    ci_low: float | None = None
    ci_high: float | None = None
    n: int | None = None
    measured: str | None = None  # "finals" | "bench"
    index: int = 0  # its place among the candidates (the recipe's order: a tie's last resort)
    threads: int | None = None  # the bench's thread count
    bench_point: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in ("path", "meta", "bench_point")}


@dataclass
class Selection:
    objective: str
    params: dict[str, Any]
    rows: list[Row]
    winner: str | None
    #: the strictest min-cosine gate in force (select's own or validate's), for the plot
    gate_min_cosine: float | None = None
    #: how the winner was decided (`decide.Decision.to_json` + method, tolerance, confidence)
    decision: dict[str, Any] | None = None
    #: the finals' record (`finals.Finals.to_json`), or None when there were none (and why not)
    finals: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "format": "mopt-select/2",
            "objective": self.objective,
            "params": self.params,
            "winner": self.winner,
            "decision": self.decision,
            "finals": self.finals,
            "variants": [r.to_json() for r in self.rows],
        }


def _of(arts: list[Artifact], label: str, slot: str = "model") -> Artifact | None:
    """The artifact (a validate or bench result) made from candidate `label`."""
    found = [a for a in arts if label in a.input_labels.get(slot, [])]
    return found[0] if found else None


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _point(points: list[dict[str, Any]], params: Any) -> dict[str, Any] | None:
    """The bench point the latency objectives read: (batch_size, seq_len); a param left
    null means the largest measured."""
    if not points:
        return None
    b = params.batch_size or max(int(p["batch"]) for p in points)
    at_b = [p for p in points if int(p["batch"]) == b]
    if not at_b:
        return None
    s = params.seq_len or max(int(p["seq"]) for p in at_b)
    return next((p for p in at_b if int(p["seq"]) == s), None)


def select(
    candidates: list[Artifact],
    validations: list[Artifact],
    benches: list[Artifact],
    missing: dict[str, list[Missing]],
    params: Any,
    finals: FinalsFn | None = None,
) -> Selection:
    """Score every candidate on its bench (screening), then decide (`_decide`): among the
    finalists timed side by side by `finals` where it runs, else on the benches' numbers.
    The winner is None when no variant passes."""
    params = embedding_params(params)
    rows: list[Row] = []
    gates: list[float] = [params.min_cosine] if params.min_cosine is not None else []
    found: dict[str, tuple[Artifact | None, Artifact | None]] = {}
    points: dict[str, list[dict[str, Any]]] = {}
    for index, art in enumerate(candidates):
        row = Row(label=art.label or art.target, kind=art.kind, path=art.path, meta=dict(art.meta), index=index)
        row.bytes = _size(art.path)
        rows.append(row)
        v = _of(validations, row.label)
        b = _of(benches, row.label)
        if v is not None:
            rep = json.loads((v.path / "report.json").read_text())
            limit = (rep.get("gates") or {}).get("min_cosine", {}).get("limit")
            if limit is not None:
                gates.append(float(limit))
            m = rep.get("metrics", {})
            row.min_cosine, row.mean_cosine = m.get("min_cosine"), m.get("mean_cosine")
            row.top1 = m.get("top1_agreement")
        if b is not None:
            rep = json.loads((b.path / "bench.json").read_text())
            res = rep["results"][0]
            gpu = res.get("peak_gpu_mb")  # GPU backends; CPU ones: the process peak RSS
            row.memory_mb = float(gpu if gpu is not None else res.get("peak_rss_mb", 0.0)) or None
            pt = _point(res.get("points", []), params)
            row.threads = (rep.get("machine") or {}).get("threads")
            if pt is not None:
                row.bench_point = pt
                row.point = f"{pt['batch']}x{pt['seq']}"
                row.p50_ms, row.p99_ms = float(pt["p50_ms"]), float(pt["p99_ms"])
                row.throughput = int(pt["batch"]) / (float(pt["p50_ms"]) / 1000.0)
                base = rep["results"][1]["points"] if len(rep["results"]) > 1 else []
                row.baseline_ms = next(
                    (float(q["p50_ms"]) for q in base if (q["batch"], q["seq"]) == (pt["batch"], pt["seq"])),
                    None,
                )
                shared = rep.get("shared_baseline")
                if row.baseline_ms is not None and shared:  # timed once for the section: at this run's speed
                    row.baseline_ms *= float(shared.get("probe_ratio") or 1.0)
                probe = res.get("probe") or {}
                row.probe_ms = probe_level(probe)
            points[row.label] = res.get("points", [])
        found[row.label] = (v, b)
    # the machine drifts between benchmarks; each bench times the same fixed workload (the
    # drift probe, outside the variant's worker right before and after it), so scaling a variant's
    # latencies by (median probe / its probe) compares the variants as if timed side by
    # side. Benches from before the probe: the PyTorch reference each timed in its run.
    timed = [r for r in rows if r.p50_ms is not None]
    for ref in ("probe_ms", "baseline_ms"):
        if params.normalize and timed and all(getattr(r, ref) for r in timed):
            med = statistics.median(getattr(r, ref) for r in timed)
            for r in timed:
                r.drift = med / getattr(r, ref)
            break
    for row in rows:
        v, b = found[row.label]
        if b is not None:
            row.value = _objective(points.get(row.label, []), row, params)
        why = _excluded(
            row.label, v, b, missing, params,
            own_gate=_cosine_gate(row, params),
            no_point=None if row.point else f"bench has no point {params.batch_size}x{params.seq_len}",
            memory_mb=row.memory_mb,
            no_value=None if row.value is not None else f"no batch size meets p99 <= {params.latency_budget_ms} ms",
        )  # fmt: skip
        if why:
            row.status, row.why = "excluded", why
    rows += _unbuilt(missing, Row)
    sel = Selection(params.objective, params.model_dump(mode="json"), rows, None, max(gates, default=None))
    _decide(sel, params, finals)
    return sel


#: objectives the finals time, and the statistic of the calls each compares
FINALS_STAT = {"min_latency_p50": "p50", "min_latency_p99": "p99", "max_throughput": "p50"}

#: runs the finals of a selection: (finalists, params) → (the Finals, or None and why not)
FinalsFn = Callable[[list[Row], Any], "tuple[Finals | None, str | None]"]


def _tie_order(r: Row) -> tuple[Any, ...]:
    """How a tie is broken: higher accuracy (mean cosine to 4 decimals: below that, numerical
    noise of equivalent graphs), then smaller, then the recipe's order."""
    return (-round(r.mean_cosine or 0.0, 4), r.bytes or 0, r.index)


def _bench_estimate(r: Row, objective: str) -> None:
    """`r.median / ci_low / ci_high / n` from its bench point, in the objective's unit (the
    median's interval when the bench has one; none for p99, memory, the latency budget)."""
    pt, k = r.bench_point or {}, r.drift
    r.median, r.ci_low, r.ci_high, r.measured = r.value, None, None, "bench"
    r.n = int(pt["samples"]) if pt.get("samples") is not None else None
    ci = pt.get("ci_ms")
    if not ci:
        return
    if objective == "min_latency_p50":
        r.ci_low, r.ci_high = ci[0] * k, ci[1] * k
    elif objective == "max_throughput":
        b = int(pt["batch"])
        r.ci_low, r.ci_high = b / (ci[1] * k / 1000.0), b / (ci[0] * k / 1000.0)


def _ratio(r: Row, best: Row, lower: bool) -> tuple[float, float | None, float | None]:
    """How many times better `best` is than `r` (> 1: best is better), with a conservative
    interval from the two estimates' intervals (measured apart: not paired), if both have one."""
    assert r.median is not None and best.median is not None
    point = r.median / best.median if lower else best.median / r.median
    if None in (r.ci_low, r.ci_high, best.ci_low, best.ci_high):
        return point, None, None
    if lower:
        return point, r.ci_low / best.ci_high, r.ci_high / best.ci_low  # type: ignore[operator]
    return point, best.ci_low / r.ci_high, best.ci_high / r.ci_low  # type: ignore[operator]


def _bench_decision(rows: list[Row], params: Any, lower: bool) -> Decision:
    """The decision rule on the benches' numbers (no finals): intervals from each bench, not
    paired; a ratio without an interval ties unless beyond the band."""
    band = 1.0 + params.tie_tolerance
    leader = rows[0]
    ratios = {r.label: _ratio(r, leader, lower) for r in rows[1:]}
    tied = [leader] + [r for r in rows[1:] if (ratios[r.label][1] or ratios[r.label][0]) <= band]
    estimates = [Estimate(r.label, r.median or 0.0, r.ci_low or 0.0, r.ci_high or 0.0, r.n or 0) for r in rows]
    fixed = {k: (v[0], v[1] or v[0], v[2] or v[0]) for k, v in ratios.items()}
    if len(rows) == 1:
        return Decision(leader.label, None, None, None, False, [leader.label], leader.label, estimates, {},
                        "the only variant that passed")  # fmt: skip
    runner = rows[1]
    r, lo, hi = ratios[runner.label]
    interval = f" [{lo:.3f}, {hi:.3f}]" if lo is not None else " (no interval: one measurement)"
    if len(tied) == 1:
        why = f"{leader.label} beats {runner.label} by {r:.3f}x{interval} on the benches, beyond the ±{params.tie_tolerance:.0%} tie band"
        return Decision(leader.label, runner.label, r, (lo, hi) if lo is not None else None, False,  # type: ignore[arg-type]
                        [leader.label], leader.label, estimates, fixed, why)  # fmt: skip
    win = min(tied, key=_tie_order)
    others = [t.label for t in tied if t is not win]
    up = leader if win is not leader else next(t for t in tied if t is not win)
    ur, ulo, uhi = _ratio(win, up, lower) if win is not leader else _ratio(up, win, lower)
    why = (f"tie: {', '.join(t.label for t in tied)} within the ±{params.tie_tolerance:.0%} band on the benches "
           f"({runner.label} vs {leader.label}: {r:.3f}x{interval}); broken by accuracy, size, recipe order → {win.label}")  # fmt: skip
    ratio = 1.0 / ur if win is not leader else ur
    ci = None if ulo is None else ((1.0 / uhi, 1.0 / ulo) if win is not leader else (ulo, uhi))  # type: ignore[operator]
    return Decision(win.label, up.label, ratio, ci, True, [win.label, *others], leader.label, estimates, fixed, why)


def _decide(sel: Selection, params: Any, finals: FinalsFn | None) -> None:
    """Pick `sel`'s winner among the eligible rows (passed every gate, have a value): the
    finalists (within `finals_margin` of the bench leader; at least two, at most
    `max_finalists`) timed side by side where the finals run, else the benches' numbers;
    the rule says "tie" unless the winner's margin over the runner-up is beyond
    `tie_tolerance` at `confidence` (`mopt_ml.decide`). Sets statuses, whys, `decision`."""
    objective = params.objective
    lower = objective.startswith("min_")
    eligible = [r for r in sel.rows if r.status == "lost" and r.value is not None]
    for r in eligible:
        _bench_estimate(r, objective)
    sign = 1.0 if lower else -1.0
    eligible.sort(key=lambda r: sign * (r.value or 0.0))
    if not eligible:
        sel.rows.sort(key=lambda r: (_ORDER[r.status], r.label))
        return
    lead = eligible[0].value or 0.0
    margin = math.inf if params.finals_margin is None else params.finals_margin
    near = [r for r in eligible if (r.value or 0.0) <= lead * (1 + margin)] if lower else [
        r for r in eligible if (r.value or 0.0) >= lead / (1 + margin)]  # fmt: skip
    finalists = (near if len(near) >= 2 else eligible[:2])[: params.max_finalists]
    result, why_not = None, None
    if len(eligible) < 2:
        why_not = "one variant passed: nothing to compare"
    elif not params.finals:
        why_not = "finals = false"
    elif objective not in FINALS_STAT:
        why_not = f"no finals for {objective} (decided on the benches' numbers)"
    elif finals is None:
        why_not = "no finals runner"
    else:
        result, why_not = finals(finalists, params)
    if result is not None:
        d = result.decision
        by = {r.label: r for r in finalists}
        for e in d.estimates:
            r = by[e.label]
            r.measured, r.n = "finals", e.n
            if objective == "max_throughput":
                b = int((r.bench_point or {})["batch"])
                r.median, r.ci_low, r.ci_high = b / e.value, b / e.high, b / e.low
            else:
                r.median, r.ci_low, r.ci_high = e.value * 1000, e.low * 1000, e.high * 1000
        sel.finals = {"ran": True, "point": finalists[0].point, "statistic": FINALS_STAT[objective]} | result.to_json()
        method = "finals"
        contenders = finalists
    else:
        d = _bench_decision(eligible if not finals or len(eligible) < 2 else finalists, params, lower)
        sel.finals = {"ran": False, "why": why_not}
        method = "bench"
        contenders = eligible if not finals or len(eligible) < 2 else finalists
    sel.winner = d.winner
    sel.decision = d.to_json() | {"method": method, "tie_tolerance": params.tie_tolerance,
                                  "confidence": params.confidence}  # fmt: skip
    names = {r.label for r in contenders}
    win = next(r for r in sel.rows if r.label == d.winner)
    win.status, win.why = "winner", (f"tie, won the tie-break ({d.why})" if d.tie else d.why)
    for r in eligible:
        if r is win:
            continue
        if r.label not in names:
            beyond = (f"beyond the {params.finals_margin:.0%} finals margin" if r not in near
                      else f"not among the {params.max_finalists} best")  # fmt: skip
            r.why = f"screened out: {_fmt_value(objective, r.value)} on its bench vs {_fmt_value(objective, lead)}, {beyond}"
        elif r.label in d.tied:
            r.why = f"tied with {win.label}; lost the tie-break (accuracy, size, recipe order)"
        else:
            paired = d.ratios.get(r.label) if method == "finals" and d.leader == win.label else None
            rr, lo, hi = paired if paired else _ratio(r, win, lower)
            iv = f" [{lo:.3f}, {hi:.3f}]" if lo is not None else ", no interval"
            r.why = (f"{_fmt_value(objective, r.median)} vs {_fmt_value(objective, win.median)} "
                     f"({rr:.2f}x{iv}; {method})")  # fmt: skip
    sel.rows.sort(key=lambda r: (_ORDER[r.status], sign * (r.median if r.median is not None else
                                                            (r.value if r.value is not None else 0.0))
                                 if r.status in ("winner", "lost") else 0.0, r.label))  # fmt: skip


def rep_passed(v: Artifact) -> bool:
    if "passed" in v.meta:
        return bool(v.meta["passed"])
    return bool(json.loads((v.path / "report.json").read_text()).get("passed", False))


def _failed_gates(v: Artifact) -> list[str]:
    """`min_cosine 0.9711 < 0.99`, from validate's result or, failing that, its report."""
    if v.meta.get("failed_gates"):
        return list(v.meta["failed_gates"])
    gates = json.loads((v.path / "report.json").read_text()).get("gates") or {}
    out = [
        f"{name} {g['value']:.4f} {'>' if name == 'max_abs_diff' else '<'} {g['limit']}"
        for name, g in gates.items()
        if not g.get("passed", True)
    ]
    return out or ["see validate's report"]


def _missing_for(m: Missing) -> list[str]:
    """The candidates a missing validate / bench node was about."""
    return list(m.input_labels.get("model", []))


def _not_there(what: str, gone: list[Missing]) -> str:
    if gone:
        g = gone[0]
        return f"{what} {g.status}: {g.reason or g.status}"
    return f"no {what} result for it (add {what!r} to the section's targets)"


def _excluded(
    label: str,
    v: Artifact | None,
    b: Artifact | None,
    missing: dict[str, list[Missing]],
    params: Any,
    *,
    own_gate: str | None,
    no_point: str | None,
    memory_mb: float | None,
    no_value: str | None,
) -> str | None:
    """Why a variant cannot win, the first reason only (None: it can): no validate result,
    a failed validate gate, select's own gate, no bench result, no bench point / step, over
    the memory gate, no objective value. The embedding and text-generation selects share it."""
    if v is None:
        return _not_there("validate", [m for m in missing.get("validate", []) if label in _missing_for(m)])
    if not rep_passed(v):
        return "failed its validation gate: " + "; ".join(_failed_gates(v))
    if own_gate:
        return own_gate
    if b is None:
        return _not_there("bench", [m for m in missing.get("bench", []) if label in _missing_for(m)])
    if no_point:
        return no_point
    if params.max_memory_mb is not None and (memory_mb or 0.0) > params.max_memory_mb:
        return f"peak memory {memory_mb:.0f} MB > {params.max_memory_mb:.0f} MB"
    return no_value


def _cosine_gate(row: Any, params: Any) -> str | None:
    """select's own min_cosine / mean_cosine gate on a row (embeddings, served configs)."""
    if params.min_cosine is not None and (row.min_cosine or 0.0) < params.min_cosine:
        return f"min cosine {_n(row.min_cosine, 4)} < {params.min_cosine}"
    if params.mean_cosine is not None and (row.mean_cosine or 0.0) < params.mean_cosine:
        return f"mean cosine {_n(row.mean_cosine, 4)} < {params.mean_cosine}"
    return None


def _unbuilt(missing: dict[str, list[Missing]], row_type: Any) -> list[Any]:
    """A row (of `row_type`) for every candidate that was not built, saying why."""
    rows = []
    for m in missing.get("candidates", []):
        why = m.reason if m.reason.startswith(m.status) else f"{m.status}: {m.reason or 'no reason given'}"
        rows.append(row_type(label=m.label, kind=m.kind, status="unbuilt", why=why))
    return rows


_ORDER = {"winner": 0, "lost": 1, "excluded": 2, "unbuilt": 3}


def _pick_winner(
    rows: list[Any],
    objective: str,
    tie_tolerance: float,
    tie_key: Callable[[Any], Any],
    tie_by: tuple[str, str],
    fmt: Callable[[str, float | None], str],
) -> str | None:
    """Make the best of the eligible rows (still "lost", with a value) by `objective` the
    winner and say why each other one lost; values within `tie_tolerance` of the best are
    ties, broken by `tie_key` (`tie_by`: its name in the winner's and in the losers' why).
    Sorts `rows`: winner, losers best first, excluded, unbuilt. The winner's label (None:
    none eligible)."""
    lower = objective.startswith("min_")
    eligible = [r for r in rows if r.status == "lost" and r.value is not None]
    winner = None
    if eligible:
        values = [r.value for r in eligible]
        best = min(values) if lower else max(values)
        tol = tie_tolerance * abs(best)

        def tied(r: Any) -> bool:
            return bool((r.value - best <= tol) if lower else (best - r.value <= tol))

        ties = sorted((r for r in eligible if tied(r)), key=tie_key)
        win = ties[0]
        win.status, win.why = "winner", "best " + objective.replace("_", " ")
        if len(ties) > 1:
            win.why += f" (tied with {', '.join(t.label for t in ties[1:])}; {tie_by[0]} / smaller / name)"
        winner = win.label
        for r in eligible:
            if r is win:
                continue
            if tied(r):
                r.why = f"tied with {win.label}, lost the tie-break ({tie_by[1]}, size, name)"
            else:
                ratio = r.value / win.value if win.value else math.inf
                r.why = f"{fmt(objective, r.value)} vs {fmt(objective, win.value)} ({ratio:.2f}x)"
    sign = 1.0 if lower else -1.0
    rows.sort(key=lambda r: (_ORDER[r.status], sign * r.value if r.value is not None else math.inf, r.label))
    return winner


def _materialize_winner(ctx: BuildContext, sel: Selection, table: str) -> Any:
    """Log the selection's `table`; NoWinner (with the table) when no variant passed; else
    the winner's files into the output, and its row."""
    for line in table.splitlines():
        ctx.log(line)
    if sel.winner is None:
        raise NoWinner(f"no variant of {ctx.section} passed the gates:\n{table}")
    win = next(r for r in sel.rows if r.label == sel.winner)
    assert win.path is not None
    _copy_winner(win.path, ctx.out)
    return win


def _copy_winner(src_dir: Path, out: Path) -> None:
    """The winner's files into the select's output, modes kept (serve.sh stays executable),
    writable; a winner that is itself a selection: its selection files are left out (ours
    replace them)."""
    for src in sorted(src_dir.rglob("*")):
        rel = src.relative_to(src_dir)
        if len(rel.parts) == 1 and rel.parts[0] in OWN_FILES:
            continue
        dest = out / rel
        if src.is_dir():
            dest.mkdir(parents=True, exist_ok=True)
        else:
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dest)
            dest.chmod(src.stat().st_mode & 0o777 | 0o200)


def _text_table(head: tuple[str, ...], lines: list[tuple[str, ...]]) -> str:
    """Rows of cells as a plain-text table, columns aligned."""
    widths = [max(len(h), *(len(x[i]) for x in lines)) if lines else len(h) for i, h in enumerate(head)]
    out = ["  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)).rstrip()]
    out += ["  ".join(c.ljust(w) for c, w in zip(x, widths, strict=True)).rstrip() for x in lines]
    return "\n".join(out)


def _objective(points: list[dict[str, Any]], row: Row, params: Any) -> float | None:
    o = params.objective
    k = row.drift
    if o == "min_latency_p99":
        return row.p99_ms * k if row.p99_ms is not None else None
    if o == "min_latency_p50":
        return row.p50_ms * k if row.p50_ms is not None else None
    if o == "max_throughput":
        return row.throughput / k if row.throughput is not None else None
    if o == "min_memory":
        return row.memory_mb
    # max_throughput_under_latency: the best throughput over the grid within the budget
    ok = [
        int(p["batch"]) / (float(p["p50_ms"]) * k / 1000.0)
        for p in points
        if float(p["p99_ms"]) * k <= params.latency_budget_ms
        and (params.seq_len is None or int(p["seq"]) == params.seq_len)
    ]
    return max(ok) if ok else None


def _fmt_value(objective: str, v: float | None) -> str:
    if v is None:
        return "–"
    if "latency" in objective and "throughput" not in objective:
        return f"{v:.1f} ms"
    if "throughput" in objective:
        return f"{v:.1f} seq/s"
    return f"{v:.0f} MB"


# --------------------------------------------------------------------------- rendering


def render_table(sel: Selection) -> str:
    """A plain-text table of every variant (the log, and the error when none passes): its
    accuracy, size, the objective's estimate with its interval and what it rests on, and
    what became of it and why."""
    unit = _unit(sel.objective)
    conf = f"{sel.params.get('confidence', 0.95):.0%}"
    head = ("variant", "kind", "min cos", "mean cos", "MB", f"{unit}", f"{conf} interval", "n", "from", "result")
    lines = []
    for r in sel.rows:
        lines.append(
            (
                r.label,
                r.kind,
                _n(r.min_cosine, 4),
                _n(r.mean_cosine, 4),
                _n((r.bytes or 0) / 2**20, 1) if r.bytes is not None else "–",
                _n(r.median if r.median is not None else r.value, 1),
                f"[{r.ci_low:.1f}, {r.ci_high:.1f}]" if r.ci_low is not None and r.ci_high is not None else "–",
                str(r.n) if r.n is not None else "–",
                r.measured or "–",
                f"{r.status.upper()}: {r.why}" if r.why else r.status.upper(),
            )
        )
    out = _text_table(head, lines)
    if sel.decision:
        out += "\n" + ("tie: " if sel.decision["tie"] else "decided: ") + sel.decision["why"]
    if sel.finals and not sel.finals.get("ran"):
        out += f"\nno finals: {sel.finals.get('why')}"
    return out


def ranking(sel: Selection) -> list[str]:
    """The short ranking `mopt build` prints: the passing variants best first with their
    interval, the gates each excluded one failed, and one line saying why the winner won."""
    unit = _unit(sel.objective)
    lines = []
    for i, r in enumerate(x for x in sel.rows if x.status in ("winner", "lost")):
        iv = f" [{r.ci_low:.1f}, {r.ci_high:.1f}]" if r.ci_low is not None and r.ci_high is not None else ""
        lines.append(f"  {i + 1}. {r.label}: {_n(r.median, 1)} {unit}{iv} (n={r.n}, {r.measured}) {r.why}")
    for r in sel.rows:
        if r.status in ("excluded", "unbuilt"):
            lines.append(f"  -  {r.label}: {r.status}: {r.why}")
    if sel.decision:
        lines.append(("  tie: " if sel.decision["tie"] else "  why: ") + sel.decision["why"])
    return lines


def _unit(objective: str) -> str:
    if objective == "min_memory":
        return "MB"
    if "throughput" in objective:
        return "seq/s"
    return "p99 ms" if objective.endswith("p99") else "p50 ms"


def _n(v: float | None, nd: int) -> str:
    return "–" if v is None else f"{v:.{nd}f}"


def pareto_svg(sel: Selection, width: int = 560, height: int = 340) -> str:
    """Latency (x) vs min cosine (y) of every variant, marker area ∝ artifact size, drawn by
    `plots.pareto_svg`. Under a latency objective x is the estimate the decision read (a
    finalist's from the finals, else its bench's) with its interval where it has one."""
    p99 = "p99" in sel.objective
    as_compared = "latency" in sel.objective and "throughput" not in sel.objective
    points = []
    for r in sel.rows:
        raw = r.p99_ms if p99 and r.p99_ms is not None else r.p50_ms
        est = r.median if r.median is not None else r.value  # what the decision read
        x = est if as_compared and est is not None else raw
        lo, hi = r.ci_low, r.ci_high
        interval = as_compared and est is not None and lo is not None and hi is not None
        points.append(
            {
                "label": r.label,
                "x": x,
                "x_lo": lo if interval else None,
                "x_hi": hi if interval else None,
                "y": r.min_cosine,
                "size_bytes": r.bytes,
                "status": r.status,
                "why": r.why,
            }
        )
    how = ", drift-scaled" if sel.params.get("normalize") else ""
    x_label = f"latency {'p99' if p99 else 'p50'} (ms{how}{'; finalists: side by side' if sel.finals and sel.finals.get('ran') else ''})"
    return plots.pareto_svg(
        points,
        gate_min_cosine=sel.gate_min_cosine,
        x_label=x_label,
        title=f"latency vs accuracy ({sel.objective})",
        width=width,
        height=height,
    )


def render_html(sel: Selection, svg: str, section: str) -> str:
    """selection.html: the decision, the plot and one row per variant (`templates/selection.html.j2`).
    A row's interval of the objective's median (`ci_low`, `ci_high`, `n`) and the selection's
    `decision` are shown when the selection has them."""
    rows = []
    for r in sel.rows:
        lo, hi, n = getattr(r, "ci_low", None), getattr(r, "ci_high", None), getattr(r, "n", None)
        rows.append(
            {
                "label": r.label,
                "kind": r.kind,
                "min_cos": _n(r.min_cosine, 4),
                "mean_cos": _n(r.mean_cosine, 4),
                "p50": _n(r.p50_ms, 1),
                "p99": _n(r.p99_ms, 1),
                "throughput": _n(r.throughput, 1),
                "drift": f"{r.drift:.3f}" if r.probe_ms or r.baseline_ms else "–",
                "objective": _fmt_value(sel.objective, r.value),
                "interval": (
                    f"{_fmt_value(sel.objective, lo)} – {_fmt_value(sel.objective, hi)}"
                    if lo is not None and hi is not None
                    else "–"
                ),
                "n": "–" if n is None else str(n),
                "mib": _n((r.bytes or 0) / 2**20, 2) if r.bytes is not None else "–",
                "status": r.status,
                "out": r.status not in ("winner", "lost", "tie"),
                "why": r.why,
            }
        )
    decision = getattr(sel, "decision", None) or None
    return pages.render(
        "selection.html.j2",
        section=section,
        winner=sel.winner,
        objective=sel.objective,
        params=json.dumps(sel.params, sort_keys=True),
        normalize=bool(sel.params.get("normalize")),
        svg=pages.markup(svg),
        decision=decision,
        rows=rows,
        has_interval=any(r["interval"] != "–" for r in rows),
        has_n=any(r["n"] != "–" for r in rows),
        has_out=any(r["out"] for r in rows),
    )


# --------------------------------------------------------------------------- serving (serve-check)


@dataclass
class ServeRow:
    """One served config: its serve-check's numbers and what became of it."""

    label: str
    kind: str
    path: Path | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    check: str | None = None  # the serve-check's label
    min_cosine: float | None = None
    mean_cosine: float | None = None
    errors: int = 0
    knee_concurrency: int | None = None
    value: float | None = None  # tokens/s at the knee
    knee_requests_per_s: float | None = None
    knee_p99_ms: float | None = None
    startup_s: float | None = None
    engine_mib: float | None = None
    steps: list[dict[str, Any]] = field(default_factory=list)
    knee: dict[str, Any] | None = None
    status: str = "lost"
    why: str = ""

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in ("path", "meta")}


@dataclass
class ServeSelection:
    rows: list[ServeRow]
    winner: str | None
    baseline: str | None
    ratio: float | None  # winner / baseline tokens/s at the SLO
    slo_p99_ms: float | None
    params: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {
            "format": "mopt-select/1",
            "objective": "max_throughput_under_slo",
            "params": self.params,
            "winner": self.winner,
            "baseline": self.baseline,
            "ratio_vs_baseline": self.ratio,
            "slo_p99_ms": self.slo_p99_ms,
            "variants": [r.to_json() for r in self.rows],
        }


def select_serving(
    candidates: list[Artifact], serves: list[Artifact], missing: dict[str, list[Missing]], params: Any
) -> ServeSelection:
    """The served config with the highest throughput at its knee (the highest load whose p99
    met serve-check's SLO), among those whose serve-check passed (cosine gate) with no failed
    request and select's own `min_cosine` / `mean_cosine`; compared with the baseline."""
    rows: list[ServeRow] = []
    slos: list[float] = []
    for art in candidates:
        row = ServeRow(label=art.label or art.target, kind=art.kind, path=art.path, meta=dict(art.meta))
        rows.append(row)
        sc = _of(serves, row.label, slot="serve")
        if sc is None:
            gone = [m for m in missing.get("serve", []) if row.label in m.input_labels.get("serve", [])]
            row.status, row.why = "excluded", _not_there("serve-check", gone)
            continue
        doc = json.loads((sc.path / "serve.json").read_text())
        row.check = sc.label or sc.target
        row.min_cosine, row.mean_cosine = doc.get("min_cosine"), doc.get("mean_cosine")
        row.steps = list(doc.get("loadtest", []))
        row.errors = sum(int(s.get("errors", 0)) for s in row.steps)
        row.knee = doc.get("knee")
        row.startup_s = doc.get("startup_s")
        row.engine_mib = (doc.get("gpu_memory") or {}).get("engine_mib")
        if doc.get("slo_p99_ms") is not None:
            slos.append(float(doc["slo_p99_ms"]))
        if row.knee:
            row.value = float(row.knee["tokens_per_s"])
            row.knee_concurrency = int(row.knee["concurrency"])
            row.knee_requests_per_s = float(row.knee["requests_per_s"])
            row.knee_p99_ms = float(row.knee["p99_ms"])
        if not doc.get("passed", False):
            row.status, row.why = "excluded", "serve-check failed: " + "; ".join(doc.get("failures", []))
        elif row.errors:
            row.status, row.why = "excluded", f"{row.errors} load-test requests failed"
        elif gate := _cosine_gate(row, params):
            row.status, row.why = "excluded", gate
        elif row.value is None:
            row.status, row.why = "excluded", f"no load step met p99 <= {doc.get('slo_p99_ms')} ms"
    rows += _unbuilt(missing, ServeRow)
    if len(set(slos)) > 1:
        # throughputs at different SLOs do not compare: say so rather than pick by them
        for r in rows:
            if r.status == "lost":
                r.status, r.why = "excluded", f"serve-checks used different SLOs {sorted(set(slos))}"
    eligible = [r for r in rows if r.status == "lost"]
    winner = None
    if eligible:
        best = max(r.value or 0.0 for r in eligible)
        tol = params.tie_tolerance * best
        ties = sorted(
            (r for r in eligible if best - (r.value or 0.0) <= tol),
            key=lambda r: (-(r.mean_cosine or 0.0), r.label),
        )
        win = ties[0]
        win.status, win.why = "winner", "highest tokens/s at the SLO"
        winner = win.label
        for r in eligible:
            if r is not win:
                r.why = (
                    f"{r.value:,.0f} vs {win.value:,.0f} tokens/s ({(r.value or 0) / (win.value or 1):.2f}x)"
                )
    base = params.baseline
    if base is None:
        base = next((r.label for r in rows if r.kind == "vllm" and r.meta.get("defaults")), None)
    brow = next((r for r in rows if r.label == base), None)
    ratio = None
    if winner is not None and brow is not None and brow.value:
        w = next(r for r in rows if r.label == winner)
        ratio = (w.value or 0.0) / brow.value
    order = {"winner": 0, "lost": 1, "excluded": 2, "unbuilt": 3}
    rows.sort(key=lambda r: (order[r.status], -(r.value or 0.0), r.label))
    return ServeSelection(
        rows, winner, base, ratio, slos[0] if slos else None, params.model_dump(mode="json")
    )


def render_serving_table(sel: ServeSelection) -> str:
    head = ("variant", "min cos", "knee c", "tok/s @SLO", "req/s", "p99 ms", "start s", "GPU MiB", "result")
    lines = [
        (
            r.label,
            _n(r.min_cosine, 4),
            str(r.knee_concurrency) if r.knee_concurrency is not None else "–",
            _n(r.value, 0),
            _n(r.knee_requests_per_s, 1),
            _n(r.knee_p99_ms, 1),
            _n(r.startup_s, 1),
            _n(r.engine_mib, 0),
            f"{r.status.upper()}: {r.why}" if r.why else r.status.upper(),
        )
        for r in sel.rows
    ]
    out = [_text_table(head, lines)]
    if sel.ratio is not None:
        out.append(
            f"winner {sel.winner} vs baseline {sel.baseline} at p99 <= {sel.slo_p99_ms} ms: {sel.ratio:.2f}x"
        )
    return "\n".join(out)


def serving_svg(sel: ServeSelection, width: int = 680, height: int = 380) -> str:
    """p99 latency against tokens/s for every served config (one curve each), the SLO dashed,
    knees ringed, the winner's curve thick, the configs out of the running dashed."""
    style = {"winner": "winner", "lost": ""}
    series = [(r.label, r.steps, r.knee, style.get(r.status, "dim")) for r in sel.rows if r.steps]
    title = f"p99 latency vs throughput per config (SLO {sel.slo_p99_ms} ms)"
    return plots.latency_throughput_svg(series, sel.slo_p99_ms, title, width, height)


def run_serving(ctx: BuildContext) -> dict[str, Any]:
    sel = select_serving(
        ctx.inputs.get("candidates", []), ctx.inputs.get("serve", []), ctx.missing, ctx.params
    )
    table = render_serving_table(sel)
    for line in table.splitlines():
        ctx.log(line)
    if sel.winner is None:
        raise NoWinner(f"no served config of {ctx.section} passed the gates:\n{table}")
    win = next(r for r in sel.rows if r.label == sel.winner)
    assert win.path is not None
    _copy_winner(win.path, ctx.out)
    (ctx.out / "selection.json").write_text(json.dumps(sel.to_json(), indent=2, sort_keys=True) + "\n")
    svg = serving_svg(sel)
    (ctx.out / "serving.svg").write_text(svg, encoding="utf-8")
    ratio = f"{sel.ratio:.2f}x" if sel.ratio is not None else "–"
    (ctx.out / "selection.html").write_text(
        pages.render(
            "table_page.html.j2",
            title=f"select: {ctx.section}",
            heading=f"{ctx.section}: {sel.winner}",
            notes=[f"max tokens/s with p99 <= {sel.slo_p99_ms} ms; vs baseline {sel.baseline}: {ratio}"],
            figures=[pages.markup(svg)],
            head=["variant", "min cos", "knee concurrency", "tokens/s at SLO", "p99 ms", "result", "why"],
            rows=[[r.label, _n(r.min_cosine, 4), r.knee_concurrency or "–", _n(r.value, 0), _n(r.knee_p99_ms, 1),
                   r.status, r.why] for r in sel.rows],
            row_class=[r.status for r in sel.rows],
            pre=None,
        ),
        encoding="utf-8",
    )
    ctx.log(
        f"winner: {sel.winner} ({win.value:,.0f} tokens/s at p99 <= {sel.slo_p99_ms} ms; {ratio} baseline)"
    )
    return {
        "winner": sel.winner,
        "winner_kind": win.kind,
        "objective": "max_throughput_under_slo",
        "value": win.value,
        "baseline": sel.baseline,
        "ratio_vs_baseline": sel.ratio,
        "slo_p99_ms": sel.slo_p99_ms,
        "eligible": sum(1 for r in sel.rows if r.status in ("winner", "lost")),
        "variants": len(sel.rows),
        # each candidate's outcome, for `mopt report`'s reason column (a generic result key)
        "verdicts": {r.label: {"status": r.status, "why": r.why} for r in sel.rows},
        "figures": ["serving.svg"],
        "reports": ["selection.html"],
        "winner_min_cosine": win.min_cosine,
        "quantization": win.meta.get("quantization"),
    }


# --------------------------------------------------------------------------- text generation


@dataclass
class GenRow:
    """One generation variant: its gate numbers, its bench numbers at the step, its fate."""

    label: str
    kind: str
    path: Path | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    bytes: int | None = None
    top1: float | None = None
    ppl_ratio: float | None = None
    kl: float | None = None
    greedy: float | None = None
    step: int | None = None  # batch size or concurrency the numbers are at
    output_tok_s: float | None = None
    ttft_p50_ms: float | None = None
    ttft_p99_ms: float | None = None
    itl_p50_ms: float | None = None
    itl_p99_ms: float | None = None
    drift: float = 1.0  # this bench's probe / the median probe (else: median baseline tok/s / its)
    probe_ms: float | None = None  # the drift probe's p50 around this bench's run (CPU)
    baseline_tok_s: float | None = None
    baseline_stable: bool = False  # its baseline's step met the bench's ci_rel
    memory_mb: float | None = None
    value: float | None = None
    status: str = "lost"
    why: str = ""

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in ("path", "meta")}


def gen_objective(params: Any) -> str:
    """The objective of a text-generation select: the recipe's, or max_output_tok_s when it
    sets none; an embedding objective is refused with the list of generation ones."""
    if params.objective is None:
        return "max_output_tok_s"
    if params.objective not in GEN_OBJECTIVES:
        raise ValueError(
            f"select: objective {params.objective!r} is for embeddings; a text-generation section "
            f"takes one of {', '.join(GEN_OBJECTIVES)}"
        )
    return str(params.objective)


def _step_key(s: dict[str, Any]) -> int:
    return int(s.get("batch", s.get("concurrency", 0)))


def _gen_step(steps: list[dict[str, Any]], want: int | None) -> dict[str, Any] | None:
    """The bench step at batch size / concurrency `want` (None: the largest measured)."""
    if not steps:
        return None
    target = want or max(_step_key(s) for s in steps)
    return next((s for s in steps if _step_key(s) == target), None)


def select_generation(
    candidates: list[Artifact],
    validations: list[Artifact],
    benches: list[Artifact],
    missing: dict[str, list[Missing]],
    params: Any,
) -> Selection:
    """Score every generation candidate (validate's generation gates, bench's
    `mopt-genbench/1`) and pick the winner by `gen_objective(params)`."""
    objective = gen_objective(params)
    rows: list[GenRow] = []
    found: dict[str, tuple[Artifact | None, Artifact | None]] = {}
    all_steps: dict[str, list[dict[str, Any]]] = {}
    for art in candidates:
        row = GenRow(label=art.label or art.target, kind=art.kind, path=art.path, meta=dict(art.meta))
        row.bytes = _size(art.path)
        rows.append(row)
        v, b = _of(validations, row.label), _of(benches, row.label)
        if v is not None:
            m = json.loads((v.path / "report.json").read_text()).get("metrics", {})
            row.top1, row.ppl_ratio = m.get("top1_agreement"), m.get("ppl_ratio")
            row.kl, row.greedy = m.get("kl_mean"), m.get("greedy_prefix")
        if b is not None:
            rep = json.loads((b.path / "bench.json").read_text())
            if rep.get("format") != "mopt-genbench/1":
                raise ValueError(
                    f"select: {b.label or b.target}'s bench.json is {rep.get('format')!r}, "
                    "not a text-generation bench (mopt-genbench/1)"
                )
            res = rep["results"][0]
            gpu = res.get("peak_gpu_mb")
            row.memory_mb = float(gpu if gpu is not None else res.get("peak_rss_mb", 0.0)) or None
            all_steps[row.label] = res.get("steps", [])
            st = _gen_step(res.get("steps", []), params.batch_size)
            if st is not None:
                row.step = _step_key(st)
                row.output_tok_s = st.get("output_tok_s")
                row.ttft_p50_ms, row.ttft_p99_ms = st["ttft_ms"].get("p50"), st["ttft_ms"].get("p99")
                row.itl_p50_ms, row.itl_p99_ms = st["itl_ms"].get("p50"), st["itl_ms"].get("p99")
                base = _gen_step(rep["results"][1]["steps"], row.step) if len(rep["results"]) > 1 else None
                row.baseline_tok_s = base.get("output_tok_s") if base else None
                row.baseline_stable = bool(base and base.get("stable"))
                shared = rep.get("shared_baseline")
                if row.baseline_tok_s and shared:  # timed once for the section: at this run's speed
                    row.baseline_tok_s /= float(shared.get("probe_ratio") or 1.0)
                row.probe_ms = probe_level(res.get("probe"))
        found[row.label] = (v, b)
    timed = [r for r in rows if r.output_tok_s is not None]
    # drift: from the benches' drift probes (a fixed workload timed around each run) when all
    # have one; else from the baselines, only when each was timed to the bench's precision: a
    # baseline of one noisy sample would scale a variant by its noise (seen on a loaded CI machine)
    if params.normalize and timed and all(r.probe_ms for r in timed):
        med_probe = statistics.median(float(r.probe_ms or 0.0) for r in timed)
        for r in timed:
            r.drift = float(r.probe_ms or 0.0) / med_probe
    elif params.normalize and timed and all(r.baseline_tok_s and r.baseline_stable for r in timed):
        med = statistics.median(r.baseline_tok_s for r in timed if r.baseline_tok_s)
        for r in timed:
            assert r.baseline_tok_s
            r.drift = med / r.baseline_tok_s
    for row in rows:
        v, b = found[row.label]
        row.value = _gen_value(objective, row, all_steps.get(row.label, []), params)
        why = _excluded(
            row.label, v, b, missing, params,
            own_gate=None,
            no_point=None if row.step is not None else f"bench has no step {params.batch_size}",
            memory_mb=row.memory_mb,
            no_value=None if row.value is not None else f"no step meets TTFT p99 <= {params.ttft_slo_ms} ms",
        )  # fmt: skip
        if why:
            row.status, row.why = "excluded", why
    rows += _unbuilt(missing, GenRow)
    winner = _pick_winner(
        rows,
        objective,
        params.tie_tolerance,
        tie_key=lambda r: (r.kl or 0.0, r.bytes or 0, r.label),
        tie_by=("lower KL", "KL"),
        fmt=_gen_fmt,
    )
    doc_params = params.model_dump(mode="json") | {"objective": objective}
    sel = Selection(objective, doc_params, rows, winner)  # type: ignore[arg-type]
    sel.decision = _point_decision(rows, objective, winner, params.tie_tolerance)
    sel.finals = {"ran": False, "why": "no finals for text generation (decided on the benches' numbers)"}
    return sel


def _point_decision(rows: list[Any], objective: str, winner: str | None, tie_tolerance: float) -> dict[str, Any] | None:
    """The `decision` of a selection made on single numbers (`_pick_winner`): no interval,
    a tie when the runner-up is within `tie_tolerance`."""
    if winner is None:
        return None
    ranked = [r for r in rows if r.status in ("winner", "lost") and r.value is not None]
    win = next(r for r in ranked if r.label == winner)
    others = [r for r in ranked if r is not win]
    tied = [r.label for r in others if r.why.startswith("tied with")]
    up = others[0] if others else None
    ratio = None
    if up is not None and win.value and up.value:
        ratio = up.value / win.value if objective.startswith("min_") else win.value / up.value
    why = (f"{winner}: best {objective.replace('_', ' ')}"
           + (f", {ratio:.3f}x over {up.label} (one measurement each, no interval)" if up and ratio else "")
           + (f"; tied with {', '.join(tied)} within ±{tie_tolerance:.0%}" if tied else ""))  # fmt: skip
    return {"winner": winner, "runner_up": up.label if up else None, "ratio": ratio, "ratio_ci": None,
            "tie": bool(tied), "tied": [winner, *tied] if tied else [winner], "leader": winner,
            "why": why, "method": "bench", "tie_tolerance": tie_tolerance}  # fmt: skip


def _gen_value(objective: str, row: GenRow, steps: list[dict[str, Any]], params: Any) -> float | None:
    k = row.drift
    if objective == "max_output_tok_s":
        return row.output_tok_s * k if row.output_tok_s is not None else None
    if objective == "min_memory":
        return row.memory_mb
    if objective == "max_output_tok_s_under_ttft":
        ok = [
            float(s["output_tok_s"]) * k
            for s in steps
            if s.get("output_tok_s") is not None
            and s["ttft_ms"].get("p99") is not None
            and float(s["ttft_ms"]["p99"]) / k <= params.ttft_slo_ms
        ]
        return max(ok) if ok else None
    value = getattr(row, objective.replace("min_", "") + "_ms")
    return value / k if value is not None else None


def _gen_fmt(objective: str, v: float | None) -> str:
    if v is None:
        return "–"
    if "tok_s" in objective:
        return f"{v:.1f} tok/s"
    if objective == "min_memory":
        return f"{v:.0f} MB"
    return f"{v:.1f} ms"


def render_gen_table(sel: Selection) -> str:
    """The generation variants as plain text (the log, and the error when none passes)."""
    head = (
        "variant",
        "kind",
        "top-1",
        "ppl ratio",
        "KL",
        "greedy",
        "step",
        "TTFT p50",
        "ITL p50",
        "tok/s",
        "MB",
        "result",
    )
    lines = [
        (
            r.label,
            r.kind,
            _n(r.top1, 4),
            _n(r.ppl_ratio, 4),
            _n(r.kl, 4),
            _n(r.greedy, 3),
            str(r.step) if r.step is not None else "–",
            _n(r.ttft_p50_ms, 1),
            _n(r.itl_p50_ms, 2),
            _n(r.output_tok_s, 1),
            _n((r.bytes or 0) / 2**20, 1) if r.bytes is not None else "–",
            f"{r.status.upper()}: {r.why}" if r.why else r.status.upper(),
        )
        for r in sel.rows
    ]
    return _text_table(head, lines)


def run_generation(ctx: BuildContext) -> dict[str, Any]:
    sel = select_generation(
        ctx.inputs.get("candidates", []),
        ctx.inputs.get("validate", []),
        ctx.inputs.get("bench", []),
        ctx.missing,
        ctx.params,
    )
    table = render_gen_table(sel)
    win = _materialize_winner(ctx, sel, table)
    assert isinstance(win, GenRow)
    (ctx.out / "selection.json").write_text(json.dumps(sel.to_json(), indent=2, sort_keys=True) + "\n")
    (ctx.out / "selection.html").write_text(
        pages.render(
            "table_page.html.j2",
            title=f"select: {ctx.section}",
            heading=f"{ctx.section}: {sel.winner}",
            notes=[f"objective {sel.objective} at step {win.step}",
                   (sel.decision or {}).get("why", "")],
            figures=[],
            head=None,
            rows=[],
            row_class=None,
            pre=table,
        ),
        encoding="utf-8",
    )
    ctx.log(f"winner: {sel.winner} ({sel.objective} {_gen_fmt(sel.objective, win.value)})")
    return {
        "winner": sel.winner,
        "winner_kind": win.kind,
        "task": "text-generation",
        "objective": sel.objective,
        "value": win.value,
        "step": win.step,
        "eligible": sum(1 for r in sel.rows if r.status in ("winner", "lost")),
        "variants": len(sel.rows),
        # each candidate's outcome, for `mopt report`'s reason column (a generic result key)
        "verdicts": {r.label: {"status": r.status, "why": r.why} for r in sel.rows},
        "reports": ["selection.html"],
        "winner_top1": win.top1,
        "winner_kl": win.kl,
        "winner_output_tok_s": win.output_tok_s,
        "winner_ttft_p50_ms": win.ttft_p50_ms,
        "precision": win.meta.get("precision"),
        "quantization": win.meta.get("quantization"),
    }
