"""Searching a served config's load for its knee, and choosing between configs: the statistics
and the rules, free of any server (serve_search.py runs them against real ones).

**A step** is `concurrency` closed-loop clients for a while (`loadgen.closed_loop`): every
request's latency, completion time and prompt tokens. From them (`StepStats`):

* p50 / p99 latency; the p99's interval is distribution-free: the order statistics whose
  ranks bound the 99th percentile at `confidence` (binomial, normal approximation); with
  fewer than ~730 requests the upper rank falls off the end and the upper bound is the
  largest latency seen (whose coverage is below the nominal level: `p99_bounded` says so).
* tokens/s and requests/s over the step; the tokens/s interval is from batch means: the
  requests in completion order cut into `SLICES` runs, each run's rate by Little's law
  (concurrency x tokens / busy seconds), a t interval over the runs, widened to hold the
  step's own tokens/s (total tokens over its duration). It is the step's sampling error, not
  the machine's day-to-day drift.
* GuideLLM's **goodput** (requests meeting every SLO, per second; here the one SLO is the
  end-to-end latency) and **SLO attainment** (the share of requests meeting it).

**The knee** (`search_knee`): the highest concurrency whose p99 meets the SLO with no failed
request. From the first load (the shared screening point) the load doubles until the SLO
breaks (or halves until it holds), then bisects between the last load that held and the first
that broke until they are within `resolution` of each other (or adjacent). The knee's
tokens/s carries an interval that holds both the sampling error and the search's: low is the
lower bound at the highest load whose p99 *surely* met the SLO (its upper bound under it),
high the upper bound at the first load that broke (the true knee lies below it).

**Between configs** (`decide`): the leader has the highest knee; a winner is declared only when
the runner-up's interval ratio (leader's low over runner-up's high, the conservative end)
lies beyond `1 + tie_tolerance`; otherwise a tie, broken by the order given (accuracy, then
recipe order). Against the baseline the same intervals give the ratio's interval; a baseline
with no knee at all is compared at equal load (the screening point) and says so.

**Screening** (`screen_leader`): every config is measured at one shared load first; a config
goes on to the knee search only when its p99 there is not clearly worse than the best seen so
far (the intervals overlap within the tolerance). Configs are screened in predicted order
(`predict`), best first, so a config that is clearly behind costs one step, not a search.

**Prediction** (`predict`): before any server starts, a model of the closed loop:
latency(c) = overhead + per_request * c + gpu_factor * roofline(c), where roofline(c) is the
time of the engine steps that c requests of `input_len` tokens need under the config's
`max_num_batched_tokens` / `max_num_seqs` (FLOPs at the profile's fp16 rate, twice that for FP8,
weights read once per step at its bandwidth). `overhead`, `per_request` (the API server's serial
work per request) and `gpu_factor` (how many times its roofline the engine really takes) are
fitted by least squares to earlier measurements of the same model, GPU and vLLM version (the
history file) when there are any, else DEFAULT_OVERHEAD_S / DEFAULT_PER_REQUEST_S and 1; a
config measured before is predicted from its own measured knee. The p99 is taken as
P99_OVER_MEAN times the mean. On the H200 (2026-12-05) the engine took ~10x its roofline at
these batch sizes and the API server's ~20 ms per request dominated: the prior constants said
13 clients for every config, the measured knees were 10 (bf16 defaults) and 26 (FP8).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

#: spans of time a step is cut into for the interval of its throughput
SLICES = 10
#: prior of the closed-loop model when no history exists (guesses, reported as such)
DEFAULT_OVERHEAD_S = 0.010
DEFAULT_PER_REQUEST_S = 0.004
P99_OVER_MEAN = 1.5


def _z(confidence: float) -> float:
    return statistics.NormalDist().inv_cdf(0.5 + confidence / 2)


def _t(confidence: float, df: int) -> float:
    """Student's t quantile (Cornish-Fisher from the normal; within 1 % for df >= 3)."""
    z = _z(confidence)
    if df <= 0:
        return math.inf
    g1 = (z**3 + z) / 4
    g2 = (5 * z**5 + 16 * z**3 + 3 * z) / 96
    g3 = (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384
    return z + g1 / df + g2 / df**2 + g3 / df**3


def percentile(sorted_xs: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default method) of sorted values, q in [0, 100]."""
    if not sorted_xs:
        return math.nan
    pos = (len(sorted_xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (pos - lo)


def quantile_interval(
    sorted_xs: Sequence[float], q: float, confidence: float, clip: bool = False
) -> tuple[float | None, float | None]:
    """Distribution-free interval of the q-th quantile (q in (0, 1)) of sorted values: the
    order statistics at ranks n*q -/+ z*sqrt(n*q*(1-q)) (1-based, the upper one + 1). A rank
    outside the sample gives None for that bound (too few values to bound it), or with `clip`
    the largest value for the upper one (its coverage is then below `confidence`)."""
    n = len(sorted_xs)
    if n == 0:
        return None, None
    half = _z(confidence) * math.sqrt(n * q * (1 - q))
    lo_rank = math.floor(n * q - half)
    hi_rank = math.ceil(n * q + half) + 1
    lo = sorted_xs[lo_rank - 1] if lo_rank >= 1 else None
    hi = sorted_xs[min(hi_rank, n) - 1] if hi_rank <= n or clip else None
    return lo, hi


@dataclass
class Request:
    """One request of a step: seconds from send to answer, when it finished (seconds since
    the step began), the prompt tokens the server counted, and whether it failed."""

    latency_s: float
    end_s: float
    tokens: int
    ok: bool = True


@dataclass
class StepStats:
    concurrency: int
    requests: int
    completed: int
    errors: int
    duration_s: float
    requests_per_s: float
    tokens_per_s: float
    tokens_per_s_ci: tuple[float, float] | None
    p50_ms: float
    p90_ms: float
    p99_ms: float
    p99_ci_ms: tuple[float | None, float | None]
    mean_ms: float
    goodput_rps: float  # requests meeting the SLO, per second
    slo_attainment: float  # share of the requests meeting the SLO (failed ones count as missed)
    slo_p99_ms: float
    phase: str = ""  # screen | up | down | bisect
    p99_bounded: bool = True  # enough requests for the p99's upper bound at its confidence
    tool: str = "mopt-loop"
    error_sample: str = ""

    @property
    def meets(self) -> bool:
        """p99 within the SLO and no failed request (the point estimate)."""
        return self.errors == 0 and self.completed > 0 and self.p99_ms <= self.slo_p99_ms

    @property
    def surely_meets(self) -> bool:
        """Its p99's upper bound is within the SLO too."""
        hi = self.p99_ci_ms[1]
        return self.meets and hi is not None and hi <= self.slo_p99_ms

    def to_json(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["tokens_per_s_ci"] = list(self.tokens_per_s_ci) if self.tokens_per_s_ci else None
        d["p99_ci_ms"] = list(self.p99_ci_ms)
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> StepStats:
        d = dict(d)
        d["tokens_per_s_ci"] = tuple(d["tokens_per_s_ci"]) if d.get("tokens_per_s_ci") else None
        d["p99_ci_ms"] = tuple(d.get("p99_ci_ms") or (None, None))
        return cls(**d)


def step_stats(
    concurrency: int,
    requests: Sequence[Request],
    duration_s: float,
    slo_p99_ms: float,
    confidence: float = 0.95,
    phase: str = "",
    error_sample: str = "",
) -> StepStats:
    ok = [r for r in requests if r.ok]
    ms = sorted(r.latency_s * 1000.0 for r in ok)
    lo, hi = quantile_interval(ms, 0.99, confidence, clip=True)
    tokens = sum(r.tokens for r in ok)
    ci = None
    point = tokens / duration_s if duration_s > 0 else 0.0
    if duration_s > 0 and len(ok) >= 2 * SLICES:
        # batch means of the closed loop's rate: in completion order, SLICES runs of requests,
        # each giving concurrency * tokens / busy seconds (Little's law with clients that are
        # never idle); counting completions per span of time instead is coarse, since a
        # batching server answers in bursts of up to `concurrency`
        done = sorted(ok, key=lambda r: r.end_s)
        size = len(done) // SLICES
        rates = []
        for b in range(SLICES):
            run = done[b * size : (b + 1) * size if b < SLICES - 1 else len(done)]
            busy = sum(r.latency_s for r in run)
            rates.append(concurrency * sum(r.tokens for r in run) / busy if busy > 0 else 0.0)
        m, sd = statistics.fmean(rates), statistics.stdev(rates)
        half = _t(confidence, SLICES - 1) * sd / math.sqrt(SLICES)
        ci = (max(0.0, min(m - half, point)), max(m + half, point))
    good = sum(1 for x in ms if x <= slo_p99_ms)
    return StepStats(
        concurrency=concurrency,
        requests=len(requests),
        completed=len(ok),
        errors=len(requests) - len(ok),
        duration_s=duration_s,
        requests_per_s=len(ok) / duration_s if duration_s > 0 else 0.0,
        tokens_per_s=tokens / duration_s if duration_s > 0 else 0.0,
        tokens_per_s_ci=ci,
        p50_ms=percentile(ms, 50),
        p90_ms=percentile(ms, 90),
        p99_ms=percentile(ms, 99),
        p99_ci_ms=(lo, hi),
        mean_ms=statistics.fmean(ms) if ms else math.nan,
        goodput_rps=good / duration_s if duration_s > 0 else 0.0,
        slo_attainment=good / len(requests) if requests else 0.0,
        slo_p99_ms=slo_p99_ms,
        phase=phase,
        p99_bounded=quantile_interval(ms, 0.99, confidence)[1] is not None,
        error_sample=error_sample,
    )


# --------------------------------------------------------------------------- the knee


@dataclass
class Knee:
    """Where one config's p99 meets the SLO at the highest load."""

    concurrency: int | None  # the highest load that met (None: not even the lowest)
    broke_at: int | None  # the lowest load above it that broke (None: none broke up to max)
    tokens_per_s: float | None
    tokens_per_s_ci: tuple[float, float] | None
    requests_per_s: float | None
    p99_ms: float | None
    goodput_rps: float | None
    resolution: float  # (broke_at - concurrency) / concurrency at the end
    steps: int
    why: str = ""

    def to_json(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["tokens_per_s_ci"] = list(self.tokens_per_s_ci) if self.tokens_per_s_ci else None
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Knee:
        d = dict(d)
        d["tokens_per_s_ci"] = tuple(d["tokens_per_s_ci"]) if d.get("tokens_per_s_ci") else None
        return cls(**d)


def search_knee(
    measure: Callable[[int, str], StepStats],
    start: int,
    *,
    resolution: float = 0.1,
    max_concurrency: int = 512,
    first: StepStats | None = None,
) -> tuple[Knee, list[StepStats]]:
    """Double (or halve) from `start` until the SLO breaks (or holds), then bisect to
    `resolution`. `measure(c, phase)` runs one step; `first` is a step at `start` already
    measured (the screening step)."""
    steps: dict[int, StepStats] = {}

    def at(c: int, phase: str) -> StepStats:
        if c not in steps:
            steps[c] = measure(c, phase)
        return steps[c]

    if first is not None:
        steps[first.concurrency] = first
        start = first.concurrency
    lo: int | None = None
    hi: int | None = None
    c = max(1, min(start, max_concurrency))
    if at(c, "screen").meets:
        lo = c
        while c < max_concurrency:
            c = min(2 * c, max_concurrency)
            if at(c, "up").meets:
                lo = c
            else:
                hi = c
                break
    else:
        hi = c
        while c > 1:
            c = max(1, c // 2)
            if at(c, "down").meets:
                lo = c
                break
            hi = c
    if lo is not None and hi is not None:
        while hi - lo > 1 and (hi - lo) / lo > resolution:
            mid = (lo + hi) // 2
            if at(mid, "bisect").meets:
                lo = mid
            else:
                hi = mid
    ordered = [steps[k] for k in sorted(steps)]
    return knee_of(ordered, lo, hi, max_concurrency), ordered


def knee_of(steps: list[StepStats], lo: int | None, hi: int | None, max_concurrency: int) -> Knee:
    by = {s.concurrency: s for s in steps}
    if lo is None:
        return Knee(None, hi, None, None, None, None, None, math.nan, len(steps),
                    f"p99 above the SLO even at concurrency {min(by)}")  # fmt: skip
    k = by[lo]
    sure = [s for s in steps if s.concurrency <= lo and s.surely_meets]
    low = None
    if sure and sure[-1].tokens_per_s_ci:
        low = sure[-1].tokens_per_s_ci[0]
    elif sure:
        low = sure[-1].tokens_per_s
    # the true knee lies below the first load that broke: its throughput is at most the
    # larger of that step's and the knee step's upper bounds
    tops = [k] + ([by[hi]] if hi is not None else [])
    high = max(t.tokens_per_s_ci[1] if t.tokens_per_s_ci else t.tokens_per_s for t in tops)
    ci = (low if low is not None else 0.0, high)
    res = (hi - lo) / lo if hi is not None else math.nan
    why = (f"p99 {k.p99_ms:.1f} ms at {lo}, {by[hi].p99_ms:.1f} ms at {hi}" if hi is not None
           else f"p99 {k.p99_ms:.1f} ms at the largest load tried ({max_concurrency}): the SLO never broke")  # fmt: skip
    return Knee(lo, hi, k.tokens_per_s, ci, k.requests_per_s, k.p99_ms, k.goodput_rps, res, len(steps), why)


# --------------------------------------------------------------------------- screening


def screen_leader(step: StepStats, best: StepStats | None, tie_tolerance: float) -> tuple[bool, str]:
    """Whether a config screened at the shared load goes on to the knee search: its p99 there
    is not clearly worse than the best screened so far (its lower bound within the best's
    upper bound times 1 + tie_tolerance)."""
    if step.errors:
        return False, f"{step.errors} failed requests at the screening load"
    if best is None:
        return True, "the first screened"
    mine = step.p99_ci_ms[0] if step.p99_ci_ms[0] is not None else step.p99_ms
    theirs = best.p99_ci_ms[1] if best.p99_ci_ms[1] is not None else math.inf
    if mine <= theirs * (1 + tie_tolerance):
        return True, (f"p99 {step.p99_ms:.1f} ms at c={step.concurrency} is within reach of the best "
                      f"so far ({best.p99_ms:.1f} ms)")  # fmt: skip
    return False, (f"screened out: p99 {step.p99_ms:.1f} ms [{_b(step.p99_ci_ms[0])}, {_b(step.p99_ci_ms[1])}] "
                   f"at c={step.concurrency} vs the best's {best.p99_ms:.1f} ms "
                   f"[{_b(best.p99_ci_ms[0])}, {_b(best.p99_ci_ms[1])}]")  # fmt: skip


def _b(x: float | None) -> str:
    return "–" if x is None else f"{x:.1f}"


# --------------------------------------------------------------------------- deciding


@dataclass
class Contender:
    label: str
    knee: Knee
    order: tuple[Any, ...] = ()  # sorts a tie, lower first


@dataclass
class Verdict:
    winner: str | None
    leader: str | None
    runner_up: str | None
    ratio: float | None  # leader / runner-up tokens/s at the knee
    ratio_ci: tuple[float, float] | None
    tie: bool
    tied: list[str] = field(default_factory=list)
    why: str = ""

    def to_json(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["ratio_ci"] = list(self.ratio_ci) if self.ratio_ci else None
        return d


def ratio_interval(a: Knee, b: Knee) -> tuple[float, tuple[float, float]] | None:
    """a / b tokens/s at the knee, with the conservative interval (a's low over b's high,
    a's high over b's low)."""
    if not (a.tokens_per_s and b.tokens_per_s and a.tokens_per_s_ci and b.tokens_per_s_ci):
        return None
    lo = a.tokens_per_s_ci[0] / b.tokens_per_s_ci[1] if b.tokens_per_s_ci[1] > 0 else 0.0
    hi = a.tokens_per_s_ci[1] / b.tokens_per_s_ci[0] if b.tokens_per_s_ci[0] > 0 else math.inf
    return a.tokens_per_s / b.tokens_per_s, (lo, hi)


def decide(contenders: Sequence[Contender], tie_tolerance: float) -> Verdict:
    """The config with the highest knee, or a tie (see the module's docstring)."""
    ranked = sorted(
        (c for c in contenders if c.knee.tokens_per_s), key=lambda c: -(c.knee.tokens_per_s or 0.0)
    )
    if not ranked:
        return Verdict(None, None, None, None, None, False, [], "no config met the SLO at any load")
    lead = ranked[0]
    if len(ranked) == 1:
        return Verdict(
            lead.label, lead.label, None, None, None, False, [lead.label], "the only config with a knee"
        )
    tied = [lead]
    for c in ranked[1:]:
        r = ratio_interval(lead.knee, c.knee)
        if r is None or r[1][0] <= 1 + tie_tolerance:
            tied.append(c)
    second = ranked[1]
    r2 = ratio_interval(lead.knee, second.knee)
    ratio, ci = (r2[0], r2[1]) if r2 else (None, None)
    if len(tied) == 1:
        assert ci is not None and ratio is not None
        why = (f"{lead.label} serves {ratio:.2f}x the tokens/s of {second.label} at the SLO "
               f"[{ci[0]:.2f}, {ci[1]:.2f}], beyond the ±{tie_tolerance:.0%} tie band")  # fmt: skip
        return Verdict(lead.label, lead.label, second.label, ratio, ci, False, [lead.label], why)
    win = min(tied, key=lambda c: c.order)
    names = [win.label, *(c.label for c in tied if c is not win)]
    span = (
        f"{ratio:.2f}x [{ci[0]:.2f}, {ci[1]:.2f}]" if ratio is not None and ci is not None else "no interval"
    )
    why = (f"tie: {', '.join(names)} (the best knee, {lead.label}, vs {second.label}: {span}, "
           f"within the ±{tie_tolerance:.0%} band at these intervals); broken by accuracy, then recipe order")  # fmt: skip
    return Verdict(win.label, lead.label, second.label, ratio, ci, True, names, why)


# --------------------------------------------------------------------------- prediction


@dataclass
class Workload:
    """What the load sends and the model it is sent to (for the roofline)."""

    input_len: int
    texts_per_request: int
    params: float  # the model's parameter count
    weight_bytes: float
    slo_p99_ms: float


@dataclass
class Profile:
    fp16_tflops: float | None
    bandwidth_gbps: float | None


def gpu_seconds(
    c: int,
    w: Workload,
    prof: Profile,
    max_batched_tokens: int | None,
    max_seqs: int | None,
    fp8: bool = False,
) -> float:
    """Roofline time for the engine steps that `c` concurrent requests need: prefill of
    c * input_len tokens in steps of at most max_batched_tokens tokens and max_seqs sequences,
    each step bounded by max(FLOPs / peak, weights / bandwidth). `fp8`: FP8 weights and
    matmuls (twice the FLOP/s on Hopper, half the bytes)."""
    tflops = (prof.fp16_tflops or 400.0) * 1e12 * (2 if fp8 else 1)
    bw = (prof.bandwidth_gbps or 2000.0) * 1e9
    seqs = c * w.texts_per_request
    tokens = seqs * w.input_len
    steps = max(1, math.ceil(tokens / (max_batched_tokens or 8192)), math.ceil(seqs / (max_seqs or 256)))
    flops = 2.0 * w.params * tokens
    return max(flops / tflops, steps * w.weight_bytes * (0.5 if fp8 else 1) / bw)


def is_fp8(config: dict[str, Any]) -> bool:
    return "fp8" in str(config.get("qformat") or "") + str(config.get("quantization") or "")


def config_gpu_seconds(c: int, w: Workload, prof: Profile, config: dict[str, Any]) -> float:
    return gpu_seconds(
        c, w, prof, config.get("max_num_batched_tokens"), config.get("max_num_seqs"), is_fp8(config)
    )


@dataclass
class Prediction:
    knee_concurrency: int | None
    latency_ms_at: dict[int, float]
    source: str  # "history: this config" | "model fitted to N points" | "model, prior constants"
    overhead_s: float
    per_request_s: float
    gpu_factor: float = 1.0  # the engine's time over the roofline's, as fitted

    def to_json(self) -> dict[str, Any]:
        return {**self.__dict__, "latency_ms_at": {str(k): v for k, v in self.latency_ms_at.items()}}


def fit_overheads(points: Sequence[tuple[int, float, float]]) -> tuple[float, float, float] | None:
    """Least squares of mean latency = overhead + per_request * c + gpu_factor * roofline(c)
    over measured (c, mean latency s, roofline s) points: (overhead, per_request, gpu_factor),
    all >= 0; gpu_factor is how many times the roofline the engine really takes. With too few
    points (or rooflines that do not vary apart from c) gpu_factor stays 1 and two are fitted;
    None with fewer than two distinct loads."""
    if len({c for c, _, _ in points}) < 2:
        return None
    three = _lstsq([[1.0, float(c), g] for c, _, g in points], [lat for _, lat, _ in points])
    if three is not None and len(points) >= 6 and all(x >= 0 for x in three):
        return three[0], three[1], three[2]
    xs = [float(c) for c, _, _ in points]
    ys = [lat - g for _, lat, g in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    a = my - b * mx
    return max(a, 0.0), max(b, 0.0), 1.0


def _lstsq(rows: list[list[float]], ys: list[float]) -> list[float] | None:
    """Ordinary least squares by the normal equations (Gauss-Jordan); None if singular."""
    n = len(rows[0])
    ata = [[sum(r[i] * r[j] for r in rows) for j in range(n)] for i in range(n)]
    aty = [sum(r[i] * y for r, y in zip(rows, ys, strict=True)) for i in range(n)]
    m = [row[:] + [v] for row, v in zip(ata, aty, strict=True)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[piv][col]) < 1e-12 * max(1.0, abs(ata[col][col])):
            return None
        m[col], m[piv] = m[piv], m[col]
        for r in range(n):
            if r != col:
                f = m[r][col] / m[col][col]
                m[r] = [x - f * y for x, y in zip(m[r], m[col], strict=True)]
    return [m[i][n] / m[i][i] for i in range(n)]


def predict(
    config: dict[str, Any],
    w: Workload,
    prof: Profile,
    history: Sequence[dict[str, Any]] = (),
    max_concurrency: int = 512,
) -> Prediction:
    """The predicted knee of one config (see the module's docstring). `history`: earlier
    records of the same model, GPU and vLLM version ({"config_key", "knee_concurrency",
    "points": [[c, mean_latency_s], ...], "config": {...}})."""
    key = config_key(config)
    own = [h for h in history if h.get("config_key") == key and h.get("knee_concurrency")]
    points: list[tuple[int, float, float]] = []
    for h in history:
        hc = h.get("config") or {}
        for c, lat in h.get("points", []):
            points.append((int(c), float(lat), config_gpu_seconds(int(c), w, prof, hc)))
    fit = fit_overheads(points)
    a, b, k = fit if fit else (DEFAULT_OVERHEAD_S, DEFAULT_PER_REQUEST_S, 1.0)
    source = (
        f"model fitted to {len(points)} measured steps" if fit else "model with prior constants (no history)"
    )

    def lat(c: int) -> float:
        return a + b * c + k * config_gpu_seconds(c, w, prof, config)

    table = {c: round(lat(c) * P99_OVER_MEAN * 1000, 2) for c in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
             if c <= max_concurrency}  # fmt: skip
    knee = None
    if own:
        knee = round(statistics.fmean(int(h["knee_concurrency"]) for h in own))
        source = f"history: this config measured {len(own)}x"
    else:
        lo, hi = 1, max_concurrency
        if lat(1) * P99_OVER_MEAN * 1000 > w.slo_p99_ms:
            knee = None
        else:
            while lo < hi:  # the largest c whose predicted p99 meets the SLO (monotone in c)
                mid = (lo + hi + 1) // 2
                if lat(mid) * P99_OVER_MEAN * 1000 <= w.slo_p99_ms:
                    lo = mid
                else:
                    hi = mid - 1
            knee = lo
    return Prediction(knee, table, source, a, b, k)


def config_key(config: dict[str, Any]) -> str:
    """What identifies a served config across builds for the history: its tuning flags and
    its quantization."""
    keys = ("quantization", "qformat", "max_num_seqs", "max_num_batched_tokens", "max_model_len", "dtype",
            "enable_prefix_caching", "enable_chunked_prefill", "kv_cache_dtype", "gpu_memory_utilization")  # fmt: skip
    return ",".join(f"{k}={config.get(k)}" for k in keys)
