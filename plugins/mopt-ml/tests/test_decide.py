"""The decision rule on timings in rounds (mopt_ml.decide): paired intervals, and "tie"."""

from __future__ import annotations

import random

import pytest

from mopt_ml.decide import Contestant, bootstrap, decide, settled


def _rounds(rng: random.Random, base: float, load: list[float], calls: int = 5, jitter: float = 0.03) -> list[list[float]]:
    """`calls` timings per round: `base` seconds × that round's machine slowdown × noise."""
    return [[base * f * (1 + rng.uniform(-jitter, jitter)) for _ in range(calls)] for f in load]


def _load(rng: random.Random, n: int) -> list[float]:
    # the machine's speed changes from round to round by up to 2.5x (another tenant's bursts)
    return [rng.choice([1.0, 1.0, 1.4, 2.5]) for _ in range(n)]


def test_a_clear_winner_is_declared_under_round_to_round_load() -> None:
    rng = random.Random(1)
    load = _load(rng, 20)
    a = Contestant("a", _rounds(rng, 0.100, load), (0,))
    b = Contestant("b", _rounds(rng, 0.125, load), (1,))
    d = decide([b, a], "p50", tie_tolerance=0.03, confidence=0.95)
    assert (d.winner, d.tie, d.runner_up) == ("a", False, "b")
    assert d.ratio == pytest.approx(1.25, rel=0.03)
    assert d.ratio_ci is not None and 1.03 < d.ratio_ci[0] <= d.ratio <= d.ratio_ci[1] < 1.35
    assert settled(d, 0.03)


def test_the_same_speed_is_a_tie_broken_by_the_declared_order() -> None:
    rng = random.Random(2)
    load = _load(rng, 20)
    # "b" is first by the declared order (say, more accurate); both run at the same speed
    a = Contestant("a", _rounds(rng, 0.100, load), (1,))
    b = Contestant("b", _rounds(rng, 0.100, load), (0,))
    d = decide([a, b], "p50", tie_tolerance=0.03, confidence=0.95)
    assert d.tie and d.winner == "b" and set(d.tied) == {"a", "b"}
    assert d.why.startswith("tie:") and "→ b" in d.why
    assert settled(d, 0.03)  # both inside the band: more rounds would not change the answer


def test_pairing_by_round_cancels_the_load_that_unpaired_numbers_cannot() -> None:
    rng = random.Random(3)
    load = _load(rng, 16)
    a = Contestant("a", _rounds(rng, 0.100, load), (0,))
    b = Contestant("b", _rounds(rng, 0.110, load), (1,))
    estimates, pairs = bootstrap([a, b], "p50", 0.95)
    ea, eb = sorted(estimates, key=lambda e: e.label)
    # each one's own interval is wide (the load), and the two overlap ...
    assert ea.high > eb.low
    # ... but the paired ratio is tight around the true 1.10
    _, lo, hi = pairs[("b", "a")]
    assert 1.05 < lo < 1.10 < hi < 1.15


def test_a_small_difference_with_too_few_rounds_is_a_tie_not_a_winner() -> None:
    rng = random.Random(4)
    load = _load(rng, 4)
    a = Contestant("a", _rounds(rng, 0.100, load, calls=2, jitter=0.15), (1,))
    b = Contestant("b", _rounds(rng, 0.104, load, calls=2, jitter=0.15), (0,))
    d = decide([a, b], "p50", tie_tolerance=0.03, confidence=0.95)
    assert d.tie and not settled(d, 0.03)


def test_p99_is_decided_on_the_pooled_tail() -> None:
    rng = random.Random(5)
    load = [1.0] * 12
    a = Contestant("a", _rounds(rng, 0.100, load, calls=10), (0,))
    b_rounds = _rounds(rng, 0.095, load, calls=10)
    for r in b_rounds[::3]:  # b: a faster median but a slow call in every third round
        r[0] = 0.300
    b = Contestant("b", b_rounds, (1,))
    assert decide([a, b], "p50", 0.03, 0.95).winner == "b"
    assert decide([a, b], "p99", 0.03, 0.95).winner == "a"


def test_contestants_need_the_same_rounds() -> None:
    with pytest.raises(ValueError, match="same, non-zero number of rounds"):
        bootstrap([Contestant("a", [[1.0]]), Contestant("b", [[1.0], [1.0]])], "p50", 0.95)
