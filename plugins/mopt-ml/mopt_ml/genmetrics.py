"""Accuracy of a text-generation model against its reference, from next-token distributions.

Pure numpy, so the maths is tested on hand-made distributions (plugins/mopt-ml/tests/
test_genmetrics.py). `validate` feeds it teacher-forced logits of held-out texts and greedy
continuations from `mopt_ml.genruntime` generators.

Definitions (positions t of every held-out text, pooled over texts, token-weighted):

top-1 agreement  fraction of positions where the candidate's most likely next token is the
                 reference's (ties: the lowest token id, as numpy's argmax).
perplexity       exp(mean over positions of -log p(x[t+1] | x[..t])), on the text's real
                 next tokens; `ppl_ratio` = candidate / reference (1.0: as good; > 1: worse).
KL               mean over positions of KL(ref || cand) = sum_v p_ref(v) (log p_ref(v) -
                 log p_cand(v)), in nats. The reference is kept as its `top_k` most likely
                 tokens plus one "rest" bucket (so a cached reference stays small for a
                 152k-token vocabulary): the KL is then that of the two distributions
                 coarsened to those k + 1 outcomes, a lower bound of the full KL (data
                 processing inequality) and exact when top_k covers the vocabulary.
greedy           per prompt, the reference's and the candidate's own greedy continuations of
                 N tokens (each free-running on its own output):
                 `greedy_prefix` = mean over prompts of (tokens equal before the first
                 divergence) / N -- 1.0 when every continuation is identical;
                 `greedy_match` = mean over prompts of the fraction of the N positions whose
                 tokens are equal, before and after the first divergence (after it the two
                 continue different texts, so it says less). The gate `min_greedy` reads
                 `greedy_prefix`.

Default gates: the KL ones (`DEFAULT_GATES`); the others only where a recipe sets them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

#: gates a text-generation `validate` (and a generation serve-check) applies when the recipe
#: leaves them unset: distribution distance only. Top-1, perplexity ratio and greedy agreement
#: are reported and gated only where a recipe sets their limit (`OPTIONAL_GATES`): on a random
#: or flat-logit model argmax agreement measures how flat the logits are, not the quantizer.
#: Sources (docs/recipes.md, "Accuracy gates for text generation"): llama.cpp's
#: `perplexity --kl-divergence` on LLaMA-3-8B (tools/perplexity/README.md): mean KLD q8_0
#: 0.0014, q6_K 0.0055, q5_K_M 0.011, q4_K_M 0.031, q4_0 0.072, q3_K_M 0.10, q2_K 0.45; 99th
#: percentiles of an 8B model (a Llama-3.1-8B fine-tune's logs): q8_0 0.0017, q5_K_M 0.036,
#: q3_K_M 0.44 (mean 0.051), IQ3_M 0.52 (mean 0.066). 0.05 passes 4-bit K-quants and fails
#: q4_0 and below; 0.5 is the p99 that comes with a mean of ~0.05.
DEFAULT_GATES: dict[str, float] = {
    "max_kl": 0.05,  # mean KL(ref || cand), nats per token
    "max_kl_p99": 0.5,  # its 99th percentile over positions: the bad tokens a mean hides
}
#: the gates a recipe can add (their keys exist, null by default): what each would take
OPTIONAL_GATES = ("min_top1", "max_ppl_ratio", "min_greedy")
#: KL and negative log-likelihood (nats) charged at a position whose logits are not finite
NONFINITE_PENALTY = 50.0
#: gate name → (metric it reads, comparison)
GATES: dict[str, tuple[str, str]] = {
    "min_top1": ("top1_agreement", ">="),
    "max_ppl_ratio": ("ppl_ratio", "<="),
    "max_kl": ("kl_mean", "<="),
    "max_kl_p99": ("kl_p99", "<="),
    "min_greedy": ("greedy_prefix", ">="),
}


def log_softmax(logits: Any) -> np.ndarray:
    """log p over the last axis (stable: max subtracted), in the logits' float32 / float64
    (others: float64); the normalising sum is accumulated in float64. float32 keeps a
    152k-token vocabulary fast (20x here than float64) at ~1e-6 nats of error."""
    import numpy as np

    x = np.asarray(logits)
    if x.dtype not in (np.float32, np.float64):
        x = x.astype(np.float64)
    z = x - np.max(x, axis=-1, keepdims=True)
    lse = np.log(np.sum(np.exp(z), axis=-1, keepdims=True, dtype=np.float64))
    return z - lse.astype(x.dtype)


@dataclass
class RefDist:
    """The reference's next-token distributions at P positions, kept small: the top-k token
    ids and log-probs (most likely first), and the log-prob of the real next token."""

    top_ids: np.ndarray  # [P, k] int64
    top_logp: np.ndarray  # [P, k] float64
    target_logp: np.ndarray  # [P] float64, log p(real next token)

    @property
    def argmax(self) -> np.ndarray:
        return self.top_ids[:, 0]

    def to_arrays(self, prefix: str = "") -> dict[str, np.ndarray]:
        """Arrays to save (token ids as int32: a vocabulary fits, the cache halves)."""
        return {f"{prefix}top_ids": self.top_ids.astype("int32"), f"{prefix}top_logp": self.top_logp,
                f"{prefix}target_logp": self.target_logp}  # fmt: skip

    @classmethod
    def from_arrays(cls, arrays: Any, prefix: str = "") -> RefDist:
        import numpy as np

        return cls(
            np.asarray(arrays[f"{prefix}top_ids"], dtype=np.int64),
            np.asarray(arrays[f"{prefix}top_logp"], dtype=np.float64),
            np.asarray(arrays[f"{prefix}target_logp"], dtype=np.float64),
        )

    @classmethod
    def concat(cls, parts: Sequence[RefDist]) -> RefDist:
        import numpy as np

        return cls(
            np.concatenate([p.top_ids for p in parts]),
            np.concatenate([p.top_logp for p in parts]),
            np.concatenate([p.target_logp for p in parts]),
        )


def next_token_targets(input_ids: Sequence[int]) -> np.ndarray:
    """The real next token of every position but the last: input_ids[1:]."""
    import numpy as np

    return np.asarray(list(input_ids)[1:], dtype=np.int64)


def summarize(logits: Any, targets: Any, top_k: int) -> RefDist:
    """`logits` [P, V] (positions whose next token is `targets` [P]) as a `RefDist`.
    Ties are ordered by token id (a stable sort), so the top-1 is numpy's argmax."""
    import numpy as np

    lp = log_softmax(logits)
    tgt = np.asarray(targets, dtype=np.int64)
    _check_shapes(lp, tgt)
    k = max(1, min(int(top_k), lp.shape[1]))
    if k < lp.shape[1]:  # a 152k vocabulary: partition first, sort only the k kept (row by
        # row: numpy's 2-D argpartition along axis 1 is ~10x slower here)
        order = np.empty((lp.shape[0], k), dtype=np.int64)
        for r, row in enumerate(lp):
            cand = np.argpartition(-row, k - 1)[:k]
            order[r] = cand[np.lexsort((cand, -row[cand]))]
        order[:, 0] = np.argmax(lp, axis=1)  # the top-1 is numpy's argmax even among ties
    else:
        order = np.argsort(-lp, axis=1, kind="stable")
    top = np.take_along_axis(lp, order, axis=1).astype(np.float64)
    return RefDist(order.astype(np.int64), top, lp[np.arange(len(tgt)), tgt].astype(np.float64))


def _check_shapes(lp: np.ndarray, targets: np.ndarray) -> None:
    if lp.ndim != 2:
        raise ValueError(f"logits must be [positions, vocab], got shape {lp.shape}")
    if targets.shape != (lp.shape[0],):
        raise ValueError(f"{lp.shape[0]} positions of logits but {targets.shape} targets")
    if len(targets) and (targets.min() < 0 or targets.max() >= lp.shape[1]):
        raise ValueError(f"a target token id is outside the vocabulary of {lp.shape[1]}")


@dataclass
class Compared:
    """Per-position numbers of a candidate against the reference (see `compare`)."""

    agree: np.ndarray  # [P] bool: same top-1
    finite: np.ndarray  # [P] bool: the candidate's logits are all finite there
    kl: np.ndarray  # [P] float64, nats
    ref_nll: np.ndarray  # [P] -log p_ref(real next token)
    cand_nll: np.ndarray  # [P]


def compare(ref: RefDist, cand_logits: Any, targets: Any) -> Compared:
    """The candidate's logits [P, V] at the same positions as `ref`."""
    import numpy as np

    raw = np.asarray(cand_logits)
    if raw.dtype not in (np.float32, np.float64):
        raw = raw.astype(np.float64)
    finite = np.isfinite(raw).all(axis=-1) if raw.ndim == 2 else np.ones(0, bool)
    # a NaN / inf row (a broken graph or kernel) is scored as the worst candidate: a uniform
    # distribution over a shifted argmax would hide it, so its KL and nll become large and
    # it never agrees; `metrics` counts such positions and `gate` fails on them
    lq = log_softmax(raw if finite.all() else np.where(np.isfinite(raw), raw, 0.0).astype(raw.dtype))
    tgt = np.asarray(targets, dtype=np.int64)
    _check_shapes(lq, tgt)
    if ref.top_ids.shape[0] != lq.shape[0]:
        raise ValueError(f"reference has {ref.top_ids.shape[0]} positions, candidate {lq.shape[0]}")
    rows = np.arange(lq.shape[0])
    agree = np.argmax(lq, axis=1) == ref.argmax
    p = np.exp(ref.top_logp)
    q_logp = np.take_along_axis(lq, ref.top_ids, axis=1).astype(np.float64)
    kl = np.sum(p * (ref.top_logp - q_logp), axis=1)
    if ref.top_ids.shape[1] < lq.shape[1]:  # the rest bucket: mass outside the reference's top-k
        rest_p = np.clip(1.0 - p.sum(axis=1), 0.0, 1.0)
        rest_q = np.clip(1.0 - np.exp(q_logp).sum(axis=1), 1e-300, 1.0)
        with np.errstate(divide="ignore", invalid="ignore"):
            term = np.where(rest_p > 0, rest_p * (np.log(np.maximum(rest_p, 1e-300)) - np.log(rest_q)), 0.0)
        kl = kl + term
    kl = np.maximum(kl, 0.0)  # rounding: KL is never negative
    cand_nll = -lq[rows, tgt].astype(np.float64)
    if not finite.all():
        bad = ~finite
        agree = agree & finite
        kl = np.where(bad, NONFINITE_PENALTY, kl)
        cand_nll = np.where(bad, NONFINITE_PENALTY, cand_nll)
    return Compared(agree, finite, kl, -ref.target_logp, cand_nll)


def greedy_agreement(ref: Sequence[int], cand: Sequence[int], n: int | None = None) -> tuple[float, float]:
    """(prefix, match) of two greedy continuations over their first `n` tokens (default:
    the reference's length): the fraction equal before the first divergence, and the
    fraction of positions equal. A candidate shorter than `n` counts its missing tokens as
    different."""
    r = list(ref)
    c = list(cand)
    n = len(r) if n is None else n
    if n <= 0:
        return 1.0, 1.0
    r, c = r[:n], c[:n]
    same = [i < len(c) and i < len(r) and r[i] == c[i] for i in range(n)]
    prefix = next((i for i, s in enumerate(same) if not s), n)
    return prefix / n, sum(same) / n


def metrics(parts: Sequence[Compared], greedy: Sequence[tuple[Sequence[int], Sequence[int]]] = (),
            greedy_tokens: int | None = None) -> dict[str, Any]:  # fmt: skip
    """The validate numbers of per-text `compare` results and (reference, candidate) greedy
    continuations: top-1 agreement, perplexities and their ratio, KL mean / p99 / max, greedy
    prefix / match. Raises on zero positions (nothing was compared)."""
    import numpy as np

    agree = np.concatenate([p.agree for p in parts]) if parts else np.zeros(0, bool)
    if agree.size == 0:
        raise ValueError("no positions to compare: the held-out texts are shorter than 2 tokens")
    kl = np.concatenate([p.kl for p in parts])
    finite = np.concatenate([p.finite for p in parts])
    ref_nll = np.concatenate([p.ref_nll for p in parts])
    cand_nll = np.concatenate([p.cand_nll for p in parts])
    ppl_ref = _exp(ref_nll.mean())
    ppl_cand = _exp(cand_nll.mean())
    out: dict[str, Any] = {
        "positions": int(agree.size),
        "nonfinite_positions": int((~finite).sum()),
        "top1_agreement": _sig(agree.mean()),
        "kl_mean": _sig(kl.mean()),
        "kl_p99": _sig(np.quantile(kl, 0.99)),
        "kl_max": _sig(kl.max()),
        "ppl_reference": _sig(ppl_ref),
        "ppl_candidate": _sig(ppl_cand),
        # exp(mean nll_c - mean nll_r): computed as one exponent, no overflow for huge ppl
        "ppl_ratio": _sig(_exp(cand_nll.mean() - ref_nll.mean())),
    }
    if greedy:
        pairs = [greedy_agreement(r, c, greedy_tokens) for r, c in greedy]
        out["greedy_prefix"] = _sig(np.mean([p for p, _ in pairs]))
        out["greedy_match"] = _sig(np.mean([m for _, m in pairs]))
        out["greedy_prompts"] = len(pairs)
        out["greedy_identical"] = sum(1 for p, _ in pairs if p == 1.0)
    return out


def gate(numbers: dict[str, Any], limits: dict[str, float | None]) -> tuple[dict[str, Any], list[str]]:
    """Apply `limits` (gate name → threshold; None: off) to `numbers`: the per-gate results
    and the failures as `top1_agreement 0.8123 < 0.9` lines."""
    results: dict[str, Any] = {}
    failed: list[str] = []
    bad = numbers.get("nonfinite_positions") or 0
    if bad:  # whatever the thresholds: a model that emits NaN / inf is broken
        failed.append(f"candidate logits not finite at {bad} of {numbers.get('positions')} positions")
    for name, limit in limits.items():
        if limit is None:
            continue
        metric, op = GATES[name]
        value = numbers.get(metric)
        if value is None:  # e.g. no greedy prompts: the gate cannot be evaluated
            results[name] = {"limit": limit, "value": None, "passed": False}
            failed.append(f"{metric} not measured (gate {name} = {limit})")
            continue
        ok = value >= limit if op == ">=" else value <= limit
        results[name] = {"limit": limit, "value": value, "passed": bool(ok)}
        if not ok:
            failed.append(f"{metric} {value:.4f} {'<' if op == '>=' else '>'} {limit}")
    return results, failed


def _exp(x: float) -> float:
    """exp(x), capped at exp(700) (~1e304) so that reports stay finite JSON."""
    import math

    return math.exp(min(float(x), 700.0))


def _sig(value: Any, digits: int = 7) -> float:
    """7 significant digits: reports keep their bytes when the last float bits differ."""
    return float(f"{float(value):.{digits}g}")
