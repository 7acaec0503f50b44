"""The benchmark's stopping rule: the confidence interval of the median, on hand-made timing
samples, and `measure` stopping early on steady calls but running to its cap on noisy ones."""

from __future__ import annotations

import math
import time

import pytest

from mopt_ml.benchworker import measure, median_ci, stable_ci


def _coverage(n: int, j: int) -> float:
    """P(x(j) <= median <= x(n+1-j)) for n samples of a continuous distribution."""
    return 1.0 - 2.0 * sum(math.comb(n, k) for k in range(j)) / 2.0**n


@pytest.mark.parametrize(("n", "j"), [(6, 1), (8, 1), (9, 2), (12, 3), (20, 6), (50, 18)])
def test_median_ci_is_the_sign_test_interval(n: int, j: int) -> None:
    xs = [float(i) for i in range(n, 0, -1)]  # unsorted on purpose
    lo, hi = median_ci(xs) or (None, None)
    assert (lo, hi) == (float(j), float(n + 1 - j))
    # the interval is the narrowest of its form that still has 95 % coverage
    assert _coverage(n, j) >= 0.95 > _coverage(n, j + 1)


def test_too_few_samples_give_no_interval() -> None:
    assert median_ci([1.0, 2.0, 3.0, 4.0, 5.0]) is None  # at most 93.75 % with 5
    assert median_ci([1.0, 2.0, 3.0, 4.0, 5.0], confidence=0.9) == (1.0, 5.0)


def test_stable_when_the_interval_is_within_the_tolerance() -> None:
    steady = [100.0, 101.0, 99.0, 100.5, 99.5, 100.2, 100.1, 99.8]
    ci = median_ci(steady)
    assert ci == (99.0, 101.0)
    assert stable_ci(100.05, ci, 0.03) and not stable_ci(100.05, ci, 0.005)
    # one slow outlier among 12 does not widen the interval of the median
    outlier = [*steady, 100.3, 99.9, 100.4, 180.0]
    assert stable_ci(100.15, median_ci(outlier) or (0.0, 0.0), 0.03)
    # a bimodal sample (a shared machine) is not stable however many calls
    bimodal = [50.0, 100.0] * 10
    assert not stable_ci(75.0, median_ci(bimodal) or (0.0, 0.0), 0.03)


def _timing(**kw: float) -> dict[str, float]:
    base = {"warmup": 1, "min_samples": 6, "max_samples": 40, "ci_rel": 0.25, "confidence": 0.95, "max_seconds": 5.0}
    return {**base, **kw}


def test_measure_stops_at_the_minimum_on_steady_calls() -> None:
    stats = measure(lambda: time.sleep(0.004), _timing())
    assert stats["stable"] is True
    assert 6 <= stats["samples"] < 40
    assert 3.5 <= stats["p50_ms"] <= 20
    lo, hi = stats["ci_ms"]
    assert lo <= stats["p50_ms"] <= hi


def test_measure_runs_to_the_cap_on_noisy_calls() -> None:
    calls = iter(range(10_000))

    def noisy() -> None:
        time.sleep(0.001 if next(calls) % 2 else 0.012)

    stats = measure(noisy, _timing(ci_rel=0.03, max_samples=20))
    assert stats["stable"] is False and stats["samples"] == 20
    t0 = time.perf_counter()
    capped = measure(noisy, _timing(ci_rel=0.03, max_samples=10_000, max_seconds=0.3))
    assert capped["stable"] is False and time.perf_counter() - t0 < 3.0
