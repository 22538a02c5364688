"""The sequential admission probe: sample in batches until M's interval clears the budget B, or a cost cap is hit.

A fixed number of batches wastes samples on candidates far from B and leaves candidates near B UNCERTAIN. Here,
after each batch j = 1, 2, ..., J (J = the cap), the candidate is judged on every sequence sampled so far:

    ADMIT      hi_j <= B_lo
    REJECT     lo_j >  B_hi
    UNCERTAIN  B_lo <= lo_j and hi_j <= B_hi (M's bounds inside B's own interval: more batches cannot decide it)
    continue   otherwise (UNCERTAIN once j = J)

[B_lo, B_hi] is B's own interval (the study's bootstrap over its seeds, `budget_interval` in budget.json), so a
verdict holds for every B the study's noise allows: a false ADMIT needs M above some plausible B while M's upper
bound is below all of them. A budget without an interval is the point B_lo = B_hi = B.

**Validity under optional stopping: alpha spending (a union bound over looks).** Look j uses one-sided bounds at
level alpha_j = alpha · 6 / (pi^2 · j^2) on each side, so sum_j alpha_j < alpha for any number of looks. A false
ADMIT needs some look with hi_j <= B while the true M > B, and each look's hi_j is below the true M with
probability at most alpha_j; hence P(false ADMIT) <= sum_j alpha_j < alpha whatever the stopping time, and the same
for a false REJECT. `alpha` is the user's risk (`admit --risk`): smaller means fewer false verdicts and more
UNCERTAIN or more batches.

**The per-look bound.** M is a ratio of sums over sequences, R = sum_i s_i / sum_i c_i (s_i: the sequence's summed
token terms, c_i: its token count). Its influence values z_i = (s_i - R c_i) / mean(c) give the delta-method
standard error SE = sd(z) / sqrt(n) over the n sequences so far. Token terms are right-skewed (k3 has a long upper
tail), and a plain t interval is then too short on the upper side exactly where a false ADMIT happens (on skewed
synthetic streams: 9% false admits at risk 5%). So each bound carries Hall's (1992) skewness correction
h = g (1 + 2 t^2) / (6 sqrt(n)), but only where it widens the bound:

    hi = R + SE · (t + max(h, 0))      lo = R - SE · (t + max(-h, 0))

with t = t_{1 - alpha_k, n - 1} and g the sample skewness of z; and no look before `min_sequences` (32) sequences.
Under right skew (h > 0) the plain t lower bound is already conservative, and the narrowing term is not safe: with a
few huge sequences it can lift the "lower" bound above R itself (seen on a real FP8 probe: M 0.0111, lower bound
0.0125), which would turn a candidate near B into a false REJECT.
Looks are counted from the first one taken (k = 1, 2, ...). `tests/admission/test_sequential.py` checks the error
rates on synthetic skewed streams with known truth (at risk 5%: false ADMITs 4.3–4.7% at M = B, 1.6–2.7% at
M = 1.05 B; false REJECTs 0.4% at M = 0.95 B).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import numpy as np
from scipy import stats

__all__ = ["SequentialResult", "explain", "look_alpha", "ratio_bounds", "judge", "run_sequential"]


def look_alpha(alpha: float, j: int) -> float:
    """alpha_j = alpha · 6 / (pi^2 j^2): the one-sided level of look j >= 1; sum over j of alpha_j = alpha."""
    if not 0 < alpha < 1:
        raise ValueError(f"alpha (the admission risk) must be in (0, 1), got {alpha!r}")
    if j < 1:
        raise ValueError(f"look index j must be >= 1, got {j!r}")
    return alpha * 6.0 / (math.pi ** 2 * j * j)


def ratio_bounds(sums_N: np.ndarray, counts_N: np.ndarray, alpha_one_sided: float) -> tuple[float, float, float]:
    """(R, lo, hi): R = sum s / sum c over sequences with c > 0, and one-sided t bounds widened by Hall's skew term at
    level `alpha_one_sided` each (see the module docstring).

    Fewer than 3 sequences give (R, -inf, inf): no verdict can be reached on so little.
    """
    rows = np.asarray(counts_N) > 0
    s, c = np.asarray(sums_N, np.float64)[rows], np.asarray(counts_N, np.float64)[rows]
    n = s.size
    if n == 0:
        return math.nan, -math.inf, math.inf
    r = float(s.sum() / c.sum())
    if n < 3:
        return r, -math.inf, math.inf
    z = (s - r * c) / c.mean()  # influence values of the ratio; mean 0 by construction
    m2 = float(np.mean(z ** 2))
    if m2 == 0.0:
        return r, r, r
    se = math.sqrt(m2 * n / (n - 1)) / math.sqrt(n)
    g = float(np.mean(z ** 3)) / m2 ** 1.5
    t = float(stats.t.ppf(1.0 - alpha_one_sided, n - 1))
    h = g * (1.0 + 2.0 * t * t) / (6.0 * math.sqrt(n))
    return r, r - se * (t + max(-h, 0.0)), r + se * (t + max(h, 0.0))


def judge(lo: float, hi: float, budget: float, budget_high: float | None = None) -> str | None:
    """"ADMIT" if hi <= budget (B's lower end), "REJECT" if lo > budget_high (B's upper end; default `budget`),
    "UNCERTAIN" if [lo, hi] lies inside [budget, budget_high] (undecidable: stop), else None (keep sampling)."""
    top = budget if budget_high is None else budget_high
    if hi <= budget:
        return "ADMIT"
    if lo > top:
        return "REJECT"
    if budget_high is not None and budget < budget_high and budget <= lo and hi <= budget_high:
        return "UNCERTAIN"
    return None


@dataclasses.dataclass(frozen=True)
class SequentialResult:
    """Where the sequential probe stopped: the verdict, M and its bounds at the last look, and why."""

    verdict: str            # ADMIT | REJECT | UNCERTAIN
    m: float
    ci_low: float
    ci_high: float
    batches: int            # batches sampled
    alpha: float            # the risk: P(false ADMIT) and P(false REJECT) are each below it
    reason: str             # one line: why this verdict


def run_sequential(next_batch: Callable[[int], tuple[np.ndarray, np.ndarray]], budget: float, *, alpha: float = 0.05,
                   max_batches: int = 16, min_sequences: int = 32, budget_high: float | None = None
                   ) -> SequentialResult:
    """Draw batches b = 0, 1, ... with `next_batch(b) -> (sums_B, counts_B)` (per-sequence metric sums and token
    counts); once `min_sequences` sequences are in, look after every batch and stop at the first look k whose
    alpha_k bounds `judge` decides against [budget, budget_high] (B's interval; None: the point `budget`), or after
    `max_batches` batches (UNCERTAIN; the cap is always a look)."""
    if budget_high is not None and not budget_high >= budget:
        raise ValueError(f"B's interval must have budget <= budget_high, got [{budget}, {budget_high}]")
    if max_batches < 1 or min_sequences < 3:
        raise ValueError(f"need max_batches >= 1 and min_sequences >= 3, got max_batches={max_batches}, "
                         f"min_sequences={min_sequences}")
    look_alpha(alpha, 1)  # validates the risk before any sampling
    sums, counts = [], []
    m, lo, hi = math.nan, -math.inf, math.inf
    k = 0
    for j in range(1, max_batches + 1):
        s_B, c_B = next_batch(j - 1)
        sums.append(np.asarray(s_B, np.float64))
        counts.append(np.asarray(c_B, np.float64))
        if sum(x.size for x in sums) < min_sequences and j < max_batches:
            continue  # too few sequences for a look yet (the cap always gets one)
        k += 1
        a_k = look_alpha(alpha, k)
        m, lo, hi = ratio_bounds(np.concatenate(sums), np.concatenate(counts), a_k)
        v = judge(lo, hi, budget, budget_high)
        if v is not None:
            return SequentialResult(v, m, lo, hi, j, alpha,
                                    explain(v, m, lo, hi, budget, j, max_batches, alpha, budget_high))
    return SequentialResult("UNCERTAIN", m, lo, hi, max_batches, alpha,
                            explain("UNCERTAIN", m, lo, hi, budget, max_batches, max_batches, alpha, budget_high))


def explain(verdict: str, m: float, lo: float, hi: float, budget: float, batches: int, max_batches: int,
            alpha: float, budget_high: float | None = None) -> str:
    """One line: why `verdict` (M, its bounds, B or B's interval [budget, budget_high], batches, the risk)."""
    at = f"M {m:.3e}, bounds [{lo:.3e}, {hi:.3e}] after {batches} batch(es), risk {alpha:g}"
    if budget_high is None or budget_high == budget:
        low = high = whole = f"B = {budget:.3e}"
    else:
        whole = f"B's interval [{budget:.3e}, {budget_high:.3e}]"
        low, high = f"the lower end of {whole}", f"the upper end of {whole}"
    if verdict == "ADMIT":
        return f"{at}: the upper bound is within {low}"
    if verdict == "REJECT":
        return f"{at}: the lower bound is beyond {high}"
    if low != whole and batches < max_batches and budget <= lo and hi <= budget_high:
        return (f"{at}: the bounds lie inside {whole}, so no number of batches can decide it: M is as large as "
                f"the budget's own uncertainty; treat it as not admitted, or narrow B with more study seeds")
    verb = "contain" if low == whole else "overlap"
    return (f"{at}: the bounds still {verb} {whole} at the cap of {max_batches} batches; probe longer "
            f"(--max-batches), accept more risk (--risk), or treat it as not admitted")
