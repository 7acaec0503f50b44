"""The generation gates' maths on hand-made next-token distributions (numpy only)."""

from __future__ import annotations

import math

import pytest

np = pytest.importorskip("numpy")

from mopt_ml.genmetrics import (  # noqa: E402
    DEFAULT_GATES,
    GATES,
    OPTIONAL_GATES,
    RefDist,
    compare,
    gate,
    greedy_agreement,
    log_softmax,
    metrics,
    summarize,
)


def peaked_logits(positions: int = 400, vocab: int = 64, seed: int = 0) -> np.ndarray:
    """A trained-looking LM's logits: one clear favourite most of the time, a long tail."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(0.0, 1.0, size=(positions, vocab))
    fav = rng.integers(0, vocab, size=positions)
    logits[np.arange(positions), fav] += rng.uniform(2.0, 6.0, size=positions)
    return logits


def sample_targets(logits: np.ndarray, seed: int = 1) -> np.ndarray:
    rng = np.random.default_rng(seed)
    p = np.exp(log_softmax(logits))
    return np.array([rng.choice(p.shape[1], p=row) for row in p])


def run(ref_logits, cand_logits, targets, top_k=None, greedy=()):
    ref = summarize(ref_logits, targets, top_k or ref_logits.shape[1])
    return metrics([compare(ref, cand_logits, targets)], greedy)


def test_identical_distributions_agree_fully():
    logits = peaked_logits()
    t = sample_targets(logits)
    m = run(logits, logits.copy(), t, greedy=[([1, 2, 3], [1, 2, 3])])
    assert m["top1_agreement"] == 1.0
    assert m["kl_mean"] == pytest.approx(0.0, abs=1e-12) and m["kl_max"] == pytest.approx(0.0, abs=1e-12)
    assert m["ppl_ratio"] == 1.0 and m["ppl_reference"] == m["ppl_candidate"]
    assert m["greedy_prefix"] == 1.0 and m["greedy_match"] == 1.0
    _, failed = gate(m, DEFAULT_GATES)
    assert failed == []


def test_kl_of_a_two_token_distribution_is_the_textbook_value():
    p, q = np.log([[0.5, 0.5]]), np.log([[0.9, 0.1]])
    m = run(p, q, np.array([0]))
    assert m["kl_mean"] == pytest.approx(0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1), rel=1e-6)
    # ppl on the real next token 0: ref 1/0.5, cand 1/0.9
    assert m["ppl_reference"] == pytest.approx(2.0) and m["ppl_candidate"] == pytest.approx(1 / 0.9, rel=1e-6)
    assert m["ppl_ratio"] == pytest.approx(0.5 / 0.9, rel=1e-6)  # the candidate is "better" on this token


def test_uniform_model_has_perplexity_vocab_size():
    v = 50
    m = run(np.zeros((10, v)), np.zeros((10, v)), np.arange(10))
    assert m["ppl_reference"] == pytest.approx(v) and m["ppl_ratio"] == 1.0


def test_logit_shift_changes_nothing():
    logits = peaked_logits()
    t = sample_targets(logits)
    m = run(logits, logits + 7.5, t)  # softmax is shift-invariant per row
    assert m["top1_agreement"] == 1.0 and m["kl_mean"] < 1e-12 and m["ppl_ratio"] == pytest.approx(1.0)


def test_the_default_gates_are_the_kl_ones():
    assert DEFAULT_GATES == {"max_kl": 0.05, "max_kl_p99": 0.5}
    assert set(OPTIONAL_GATES) | set(DEFAULT_GATES) == set(GATES)


def test_a_quantized_model_fails_the_default_gates():
    """Logits of a coarsely quantized model: the weights' error shows as noise on the
    logits (here 1.5 logit units, typical of naive 3-4-bit weights on a small LLM). It must
    fail mean KL and its p99 at the default gates, with the numbers in the failures; top-1
    and perplexity are reported, and gate only where asked."""
    logits = peaked_logits(positions=2000)
    t = sample_targets(logits)
    noisy = logits + np.random.default_rng(7).normal(0.0, 1.5, size=logits.shape)
    m = run(logits, noisy, t)
    results, failed = gate(m, DEFAULT_GATES)
    assert m["kl_mean"] > DEFAULT_GATES["max_kl"] and m["kl_p99"] > DEFAULT_GATES["max_kl_p99"]
    assert failed == [f"kl_mean {m['kl_mean']:.4f} > 0.05", f"kl_p99 {m['kl_p99']:.4f} > 0.5"]
    assert set(results) == {"max_kl", "max_kl_p99"}
    assert not results["max_kl"]["passed"] and results["max_kl"]["value"] == m["kl_mean"]
    assert m["top1_agreement"] < 0.9 and m["ppl_ratio"] > 1.05  # reported, not gated by default
    _, asked = gate(m, {**DEFAULT_GATES, "min_top1": 0.9, "max_ppl_ratio": 1.05})
    assert {f.split()[0] for f in asked} == {"top1_agreement", "ppl_ratio", "kl_mean", "kl_p99"}
    assert f"top1_agreement {m['top1_agreement']:.4f} < 0.9" in asked


def test_a_careful_quantization_passes_the_default_gates():
    """Small logit noise (8-bit weights: ~0.1 logit units) keeps every gate, the optional
    ones too."""
    logits = peaked_logits(positions=2000)
    t = sample_targets(logits)
    noisy = logits + np.random.default_rng(7).normal(0.0, 0.1, size=logits.shape)
    m = run(logits, noisy, t, greedy=[(list(range(32)), list(range(32)))])
    _, failed = gate(m, {**DEFAULT_GATES, "min_top1": 0.9, "max_ppl_ratio": 1.05, "min_greedy": 0.5})
    assert failed == [], m
    assert 0 < m["kl_mean"] < 0.01 and m["kl_p99"] < 0.05 and m["top1_agreement"] > 0.97


def test_kl_p99_catches_the_tail_a_mean_hides():
    """1000 positions of a fair coin; the candidate is exact except at `bad` positions, where
    it says 0.99 / 0.01 (KL 1.614 nats each). The p99 is numpy's linear interpolation of the
    sorted per-position KL at rank 0.99 * 999 = 989.01: 0 below 10 bad positions, 1 % of the
    bad KL at exactly 10, the whole bad KL from 11 on."""
    bad_kl = 0.5 * math.log(0.5 / 0.99) + 0.5 * math.log(0.5 / 0.01)
    ref = np.log(np.full((1000, 2), 0.5))
    for bad, p99 in ((5, 0.0), (10, 0.01 * bad_kl), (15, bad_kl)):
        cand = ref.copy()
        cand[:bad] = np.log([0.99, 0.01])
        m = run(ref, cand, np.zeros(1000, dtype=int))
        assert m["kl_mean"] == pytest.approx(bad * bad_kl / 1000, rel=1e-6)
        assert m["kl_p99"] == pytest.approx(p99, rel=1e-6, abs=1e-12)
        assert m["kl_max"] == pytest.approx(bad_kl, rel=1e-6)
        results, failed = gate(m, DEFAULT_GATES)
        assert results["max_kl"]["passed"]  # mean 0.008-0.024: the mean gate never sees it
        assert failed == ([] if bad <= 10 else [f"kl_p99 {m['kl_p99']:.4f} > 0.5"])


def test_a_model_that_flattens_its_distribution_fails_kl_not_top1():
    """Temperature 3 keeps every argmax (top-1 agreement 1.0) but loses confidence: only the
    distribution gates catch it -- why top-1 alone is not a gate for generation."""
    logits = peaked_logits(positions=1000)
    t = sample_targets(logits)
    m = run(logits, logits / 3.0, t)
    _, failed = gate(m, {**DEFAULT_GATES, "min_top1": 0.9, "max_ppl_ratio": 1.05})
    assert m["top1_agreement"] == 1.0
    assert [f.split()[0] for f in failed] == ["kl_mean", "kl_p99", "ppl_ratio"]


def test_top_k_reference_gives_a_lower_bound_exact_at_full_vocab():
    logits = peaked_logits(positions=300, vocab=200)
    t = sample_targets(logits)
    cand = logits + np.random.default_rng(3).normal(0.0, 0.8, size=logits.shape)
    full = run(logits, cand, t)["kl_mean"]
    # direct computation over the whole vocabulary
    lp, lq = log_softmax(logits), log_softmax(cand)
    direct = float(np.mean(np.sum(np.exp(lp) * (lp - lq), axis=1)))
    assert full == pytest.approx(direct, rel=1e-6)
    coarse = [run(logits, cand, t, top_k=k)["kl_mean"] for k in (1, 8, 64, 199)]
    assert all(c <= full * (1 + 1e-9) for c in coarse)
    assert coarse == sorted(coarse)  # finer buckets: closer to the full KL
    assert coarse[-1] == pytest.approx(full, rel=0.02)
    # top-1 and perplexity do not depend on k
    assert run(logits, cand, t, top_k=4)["ppl_ratio"] == run(logits, cand, t)["ppl_ratio"]


def test_refdist_round_trips_through_arrays_and_concatenates():
    logits = peaked_logits(positions=20)
    t = sample_targets(logits)
    r = summarize(logits, t, 5)
    back = RefDist.from_arrays(r.to_arrays("x_"), "x_")
    assert np.array_equal(back.top_ids, r.top_ids) and np.array_equal(back.top_logp, r.top_logp)
    both = RefDist.concat([r, back])
    assert both.top_ids.shape == (40, 5) and np.array_equal(both.argmax[:20], np.argmax(logits, axis=1))


def test_argmax_ties_go_to_the_lowest_token_id():
    logits = np.array([[1.0, 3.0, 3.0, 0.0]])
    r = summarize(logits, [2], 4)
    assert r.argmax[0] == 1 == int(np.argmax(logits))
    assert compare(r, logits, [2]).agree[0]


def test_greedy_prefix_and_match():
    assert greedy_agreement([1, 2, 3, 4], [1, 2, 3, 4]) == (1.0, 1.0)
    assert greedy_agreement([1, 2, 3, 4], [1, 9, 3, 4]) == (0.25, 0.75)
    assert greedy_agreement([1, 2, 3, 4], [9, 2, 3, 4]) == (0.0, 0.75)
    assert greedy_agreement([1, 2, 3, 4], [1, 2]) == (0.5, 0.5)  # a short candidate: missing = different
    assert greedy_agreement([1, 2, 3, 4, 5, 6], [1, 2, 3, 9], n=4) == (0.75, 0.75)
    assert greedy_agreement([], []) == (1.0, 1.0)
    m = metrics(
        [compare(summarize(np.zeros((1, 3)), [0], 3), np.zeros((1, 3)), [0])],
        [([1, 2, 3, 4], [1, 2, 3, 4]), ([1, 2, 3, 4], [1, 9, 9, 9])],
    )
    assert m["greedy_prefix"] == pytest.approx(0.625) and m["greedy_identical"] == 1
    assert m["greedy_prompts"] == 2


def test_gate_failures_name_metric_value_and_limit():
    m = {"top1_agreement": 0.8, "ppl_ratio": 1.2, "kl_mean": 0.01, "greedy_prefix": 0.9}
    results, failed = gate(m, {"min_top1": 0.9, "max_ppl_ratio": 1.1, "max_kl": 0.05, "min_greedy": None})
    assert failed == ["top1_agreement 0.8000 < 0.9", "ppl_ratio 1.2000 > 1.1"]
    assert "min_greedy" not in results and results["max_kl"]["passed"]
    # a gate on a metric that was not measured fails, saying so
    _, failed = gate({"top1_agreement": 1.0}, {"min_greedy": 0.5})
    assert failed == ["greedy_prefix not measured (gate min_greedy = 0.5)"]


def test_bad_shapes_and_empty_inputs_raise_clearly():
    r = summarize(np.zeros((3, 4)), [0, 1, 2], 4)
    with pytest.raises(ValueError, match="3 positions"):
        compare(r, np.zeros((2, 4)), [0, 1])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        summarize(np.zeros((2, 4)), [0, 4], 4)
    with pytest.raises(ValueError, match=r"\[positions, vocab\]"):
        summarize(np.zeros(4), [0], 4)
    with pytest.raises(ValueError, match="no positions"):
        metrics([])


def test_extreme_logits_stay_finite():
    logits = np.array([[1000.0, -1000.0, 0.0], [-1e4, 1e4, 0.0]])
    cand = np.array([[-1000.0, 1000.0, 0.0], [1e4, -1e4, 0.0]])
    m = run(logits, cand, np.array([0, 1]))
    assert all(math.isfinite(m[k]) for k in ("kl_mean", "ppl_ratio", "ppl_reference"))
    assert m["top1_agreement"] == 0.0 and m["kl_mean"] > 100


def test_non_finite_candidate_logits_fail_whatever_the_gates():
    logits = peaked_logits(positions=50)
    t = sample_targets(logits)
    bad = logits.copy()
    bad[3, 5] = np.nan
    bad[7] = np.inf
    m = run(logits, bad, t)
    assert m["nonfinite_positions"] == 2 and math.isfinite(m["kl_mean"]) and math.isfinite(m["ppl_ratio"])
    assert m["top1_agreement"] == pytest.approx(48 / 50)
    _, failed = gate(m, {"min_top1": None})
    assert failed == ["candidate logits not finite at 2 of 50 positions"]
