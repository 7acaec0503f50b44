"""Deciding between variants from timings: intervals, paired ratios, and a rule that says "tie".

Timings come in rounds (`mopt_ml.finals`): in each round every contestant ran a block of
calls, one after another, in a shuffled order, so a round's blocks saw the same machine. The
interval of a statistic (the median or the p99 of a contestant's calls) and of the ratio of two
contestants' statistics come from a paired bootstrap over rounds: resample the rounds with
replacement, pool each contestant's calls of the resampled rounds, take the statistic; rounds
stay whole, so what the machine did to one round it did to every contestant in it.

The rule (`decide`): the leader is the best point estimate. A winner is declared only when the
interval of the runner-up's ratio to the leader lies wholly beyond `1 + tie_tolerance` (the
runner-up is slower by more than the tolerance, at `confidence`). Otherwise every contestant
whose interval reaches into the band ties with the leader, and the tie goes to the first by a
declared order (accuracy, then size, then the recipe's order) and is reported as a tie.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

#: resamples of the bootstrap (its own error on a 95 % bound: well under 1 % of the ratio)
BOOT = 2000


def _stat(pooled: Any, statistic: str) -> Any:
    import numpy as np

    return np.median(pooled, axis=-1) if statistic == "p50" else np.percentile(pooled, 99, axis=-1)


@dataclass
class Contestant:
    """One variant's timings: `rounds[i]` are its calls' seconds in round i (same count in
    every round); `order` sorts a tie (lower first: e.g. (-mean cosine, bytes, recipe index))."""

    label: str
    rounds: list[list[float]]
    order: tuple[Any, ...] = ()


@dataclass
class Estimate:
    label: str
    value: float  # the statistic of all its calls (seconds)
    low: float
    high: float
    n: int  # calls


@dataclass
class Decision:
    """What `decide` concluded. Ratios are the runner-up's statistic over the winner's (> 1:
    the winner is faster), with their interval."""

    winner: str
    runner_up: str | None
    ratio: float | None
    ratio_ci: tuple[float, float] | None
    tie: bool
    tied: list[str] = field(default_factory=list)  # the tie's members, winner first
    leader: str = ""  # the best point estimate (the winner unless a tie went elsewhere)
    estimates: list[Estimate] = field(default_factory=list)  # best first
    ratios: dict[str, tuple[float, float, float]] = field(default_factory=dict)  # label → ratio to leader, ci
    why: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "winner": self.winner,
            "runner_up": self.runner_up,
            "ratio": self.ratio,
            "ratio_ci": list(self.ratio_ci) if self.ratio_ci else None,
            "tie": self.tie,
            "tied": self.tied,
            "leader": self.leader,
            "why": self.why,
        }


def bootstrap(
    contestants: Sequence[Contestant], statistic: str, confidence: float, seed: int = 0
) -> tuple[list[Estimate], dict[tuple[str, str], tuple[float, float, float]]]:
    """Each contestant's statistic with its interval, and for every ordered pair (a, b) the
    ratio stat(a) / stat(b) with its paired interval. Needs the same number of rounds for all."""
    import numpy as np

    rounds = {len(c.rounds) for c in contestants}
    if len(rounds) != 1 or 0 in rounds:
        raise ValueError("every contestant needs the same, non-zero number of rounds")
    r = rounds.pop()
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, r, size=(BOOT, r))
    tail = (1.0 - confidence) / 2.0
    point: dict[str, float] = {}
    boots: dict[str, Any] = {}
    estimates = []
    for c in contestants:
        arr = np.asarray(c.rounds, dtype=float)  # rounds × calls
        point[c.label] = float(_stat(arr.reshape(-1), statistic))
        boots[c.label] = _stat(arr[idx].reshape(BOOT, -1), statistic)
        lo, hi = np.quantile(boots[c.label], [tail, 1.0 - tail])
        estimates.append(Estimate(c.label, point[c.label], float(lo), float(hi), int(arr.size)))
    pairs = {}
    for a in contestants:
        for b in contestants:
            if a is b:
                continue
            ratio = boots[a.label] / boots[b.label]
            lo, hi = np.quantile(ratio, [tail, 1.0 - tail])
            pairs[(a.label, b.label)] = (point[a.label] / point[b.label], float(lo), float(hi))
    return estimates, pairs


def decide(
    contestants: Sequence[Contestant], statistic: str, tie_tolerance: float, confidence: float, seed: int = 0
) -> Decision:
    """The rule of the module docstring, on timings (lower is better)."""
    estimates, pairs = bootstrap(contestants, statistic, confidence, seed)
    estimates.sort(key=lambda e: e.value)
    if len(estimates) == 1:
        only = estimates[0].label
        return Decision(only, None, None, None, False, [only], only, estimates, {}, why="the only finalist")
    leader = estimates[0].label
    ratios = {e.label: pairs[(e.label, leader)] for e in estimates[1:]}
    band = 1.0 + tie_tolerance
    tied = [leader] + [e.label for e in estimates[1:] if ratios[e.label][1] <= band]
    by_label = {c.label: c for c in contestants}
    runner = estimates[1].label
    r, lo, hi = ratios[runner]
    if len(tied) == 1:
        why = (f"{leader} is faster than {runner} by {r:.3f}x [{lo:.3f}, {hi:.3f}] at {confidence:.0%}, "
               f"beyond the ±{tie_tolerance:.0%} tie band")  # fmt: skip
        return Decision(leader, runner, r, (lo, hi), False, [leader], leader, estimates, ratios, why)
    winner = min(tied, key=lambda label: by_label[label].order)
    others = [t for t in tied if t != winner]
    runner_up = leader if winner != leader else others[0]
    rr, rlo, rhi = pairs[(runner_up, winner)] if runner_up != winner else (1.0, 1.0, 1.0)
    why = (f"tie: {', '.join(tied)} within the ±{tie_tolerance:.0%} band ({runner} / {leader} = {r:.3f}x "
           f"[{lo:.3f}, {hi:.3f}] at {confidence:.0%}); broken by accuracy, size, recipe order → {winner}")  # fmt: skip
    return Decision(winner, runner_up, rr, (rlo, rhi), True, [winner, *others], leader, estimates, ratios, why)


def settled(d: Decision, tie_tolerance: float) -> bool:
    """Whether more rounds would not change the kind of answer: a winner beyond the band, or
    a tie whose members' intervals lie wholly inside it (the same speed, as far as the
    tolerance cares)."""
    if not d.tie:
        return True
    return all(d.ratios[t][2] <= 1.0 + tie_tolerance for t in d.tied if t != d.leader)
