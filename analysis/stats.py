"""The tests the presets pre-register: paired t, TOST equivalence, Fisher's exact, and the
exact paired tests: the sign test and the sign-flip permutation test.

Small pure functions on arrays (no scipy in the project's dependencies): the Student-t
distribution through the regularised incomplete beta function (a continued fraction),
its quantiles by bisection, the hypergeometric sums of Fisher's test and the binomial sums of
the sign test by exact integers, and the sign-flip test by enumerating all 2^n sign
assignments. Every p is exact for its model; `tests/test_stats.py` checks them against closed
forms and brute force.
"""

from __future__ import annotations

import math

import numpy as np


def betainc(a: float, b: float, x: float) -> float:
    """The regularised incomplete beta I_x(a, b) by its continued fraction (modified Lentz),
    on the side of x where it converges fast (I_x(a, b) = 1 − I_{1−x}(b, a))."""
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"x={x}; valid: 0 <= x <= 1")
    if x in (0.0, 1.0):
        return x
    if x > (a + 1) / (a + b + 2):
        return 1.0 - betainc(b, a, 1.0 - x)
    log_front = a * math.log(x) + b * math.log1p(-x) - math.log(a) - _log_beta(a, b)
    tiny, f, c, d = 1e-300, 1.0, 1.0, 0.0
    for i in range(400):
        m = i // 2
        if i == 0:
            num = 1.0
        elif i % 2 == 0:
            num = m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m))
        else:
            num = -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))
        d = 1.0 + num * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + num / c
        c = c if abs(c) > tiny else tiny
        f *= c * d
        if abs(c * d - 1.0) < 1e-15:
            break
    return math.exp(log_front) * (f - 1.0)


def _log_beta(a: float, b: float) -> float:
    return math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b)


def t_sf(t: float, df: float) -> float:
    """P(T > t) for Student's t with `df` degrees of freedom."""
    tail = 0.5 * betainc(df / 2, 0.5, df / (df + t * t))
    return tail if t >= 0 else 1.0 - tail


def t_quantile(q: float, df: float) -> float:
    """The t with P(T ≤ t) = q, by bisection on t_sf over |t| < 1e4."""
    if not 0.0 < q < 1.0:
        raise ValueError(f"q={q}; valid: 0 < q < 1")
    lo, hi = -1e4, 1e4
    for _ in range(200):
        mid = (lo + hi) / 2
        if 1.0 - t_sf(mid, df) < q:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def paired_t(x, y, level: float = 0.95) -> dict[str, float]:
    """Paired t-test of mean(x − y) = 0 over pairs (one per seed): the mean difference, its
    `level` t-interval, t, df and the two-sided and both one-sided p-values."""
    d = np.asarray(x, float) - np.asarray(y, float)
    n = len(d)
    if n < 2:
        raise ValueError(f"a paired t-test needs >= 2 pairs; got {n}")
    mean, sd = float(d.mean()), float(d.std(ddof=1))
    se = sd / math.sqrt(n)
    half = t_quantile(0.5 + level / 2, n - 1) * se
    if se == 0:  # every pair differs by the same amount: no spread to test against
        t = 0.0 if mean == 0 else math.copysign(math.inf, mean)
    else:
        t = mean / se
    greater = t_sf(t, n - 1) if math.isfinite(t) else float(t < 0)
    less = 1.0 - greater if math.isfinite(t) else float(t > 0)
    return {
        "diff": mean,
        "ci_lo": mean - half,
        "ci_hi": mean + half,
        "t": t,
        "df": n - 1,
        "n": n,
        "p": min(1.0, 2 * min(greater, less)),
        "p_greater": greater,
        "p_less": less,
    }


def tost(x, y, margin: float, alpha: float = 0.05) -> dict[str, float]:
    """Two one-sided tests of equivalence, |mean(x − y)| < margin, over pairs: p = the larger of
    the two one-sided p-values; the (1 − 2α) interval lies inside ±margin exactly when p < α."""
    d = np.asarray(x, float) - np.asarray(y, float)
    lower = paired_t(d + margin, np.zeros_like(d))  # H0: diff <= −margin
    upper = paired_t(d - margin, np.zeros_like(d))  # H0: diff >= +margin
    ci = paired_t(d, np.zeros_like(d), level=1 - 2 * alpha)
    return {
        "diff": ci["diff"],
        "ci_lo": ci["ci_lo"],
        "ci_hi": ci["ci_hi"],
        "n": ci["n"],
        "margin": margin,
        "p": max(lower["p_greater"], upper["p_less"]),
    }


def fisher_exact(a: int, b: int, c: int, d: int) -> dict[str, float]:
    """Fisher's exact test on the 2×2 table [[a, b], [c, d]] (rows: treatment, control;
    columns: event, no event): the two-sided p (tables no more probable than the observed) and
    the one-sided p that the treatment has more events."""
    row1, col1, n = a + b, a + c, a + b + c + d
    lo, hi = max(0, col1 - (n - row1)), min(row1, col1)
    denom = math.comb(n, col1)
    prob = {
        k: math.comb(row1, k) * math.comb(n - row1, col1 - k) / denom for k in range(lo, hi + 1)
    }
    observed = prob[a]
    two = sum(p for p in prob.values() if p <= observed * (1 + 1e-9))
    return {
        "events_treatment": a,
        "n_treatment": row1,
        "events_control": c,
        "n_control": c + d,
        "p": min(1.0, two),
        "p_greater": sum(p for k, p in prob.items() if k >= a),
        "p_less": sum(p for k, p in prob.items() if k <= a),
    }


def sign_test(n_plus: int, n_minus: int) -> dict[str, float]:
    """The exact sign test on the discordant pairs of a paired binary outcome (McNemar's test in
    its exact, conditional form; McNemar 1947): pairs where only the treatment run had the
    event (n_plus) against pairs where only the control run had it (n_minus). Under H0 a
    discordant pair falls either way with probability 1/2, so n_plus ~ Binomial(n, 1/2) with
    n = n_plus + n_minus; p_greater = P(X ≥ n_plus), p_less = P(X ≤ n_plus), p (two-sided) =
    twice the smaller, capped at 1. Concordant pairs carry no information and are not counted;
    with no discordant pair every p is 1."""
    if min(n_plus, n_minus) < 0:
        raise ValueError(f"n_plus={n_plus}, n_minus={n_minus}; valid: counts >= 0")
    n = n_plus + n_minus
    greater = sum(math.comb(n, k) for k in range(n_plus, n + 1)) / 2**n
    less = sum(math.comb(n, k) for k in range(n_plus + 1)) / 2**n
    return {
        "n_plus": n_plus,
        "n_minus": n_minus,
        "p": min(1.0, 2 * min(greater, less)),
        "p_greater": greater,
        "p_less": less,
    }


SIGN_FLIP_MAX = 20  # pairs: 2^20 sums (8 MiB) to enumerate


def sign_flip(d) -> dict[str, float]:
    """The exact sign-flip permutation test of paired differences d (Fisher 1935, *The Design
    of Experiments* §21; Pitman 1937): under H0 each d_i is symmetric about 0, so given |d_i|
    its sign is a fair coin. The statistic is Σ d_i; its null distribution is the 2^n sums
    Σ ±|d_i|, enumerated. p_greater / p_less: the share of sums ≥ / ≤ the observed one; p
    (two-sided): the share with |sum| ≥ |observed|. Ties within 1e-9 of the total |d| count
    as at least as extreme. The smallest attainable p is 2^-n one-sided, 2^(1-n) two-sided."""
    d = np.asarray(d, float)
    if not 1 <= len(d) <= SIGN_FLIP_MAX:
        raise ValueError(f"sign_flip: {len(d)} pairs; valid: 1 to {SIGN_FLIP_MAX}")
    sums = np.zeros(1)
    for x in np.abs(d):  # all 2^n sums Σ ±|d_i|, one pair at a time
        sums = np.concatenate([sums + x, sums - x])
    s, tol = float(d.sum()), 1e-9 * max(1.0, float(np.abs(d).sum()))
    return {
        "diff": float(d.mean()),
        "n": len(d),
        "p": float(np.mean(np.abs(sums) >= abs(s) - tol)),
        "p_greater": float(np.mean(sums >= s - tol)),
        "p_less": float(np.mean(sums <= s + tol)),
    }


# --- multiplicity and power ----------------------------------------------------------------------


def holm(p) -> np.ndarray:
    """Holm's step-down adjusted p-values (family-wise error): sorted ascending, the i-th of m
    (0-based) is multiplied by m − i, made monotone, capped at 1. NaN stays NaN (not tested)."""
    p = np.asarray(p, float)
    out = np.full_like(p, np.nan)
    ok = np.flatnonzero(np.isfinite(p))
    order = ok[np.argsort(p[ok], kind="stable")]
    m, running = len(order), 0.0
    for i, j in enumerate(order):
        running = max(running, min(1.0, (m - i) * p[j]))
        out[j] = running
    return out


def benjamini_hochberg(p) -> np.ndarray:
    """Benjamini–Hochberg adjusted p-values (q-values; false-discovery rate): sorted ascending,
    the i-th of m (1-based) is p·m/i, made monotone from the largest down, capped at 1."""
    p = np.asarray(p, float)
    out = np.full_like(p, np.nan)
    ok = np.flatnonzero(np.isfinite(p))
    order = ok[np.argsort(p[ok], kind="stable")]
    m, running = len(order), 1.0
    for i in range(m - 1, -1, -1):
        running = min(running, p[order[i]] * m / (i + 1))
        out[order[i]] = running
    return out


def mde_paired(sd: float, n: int, alpha: float = 0.05, power: float = 0.8) -> float:
    """The smallest true mean difference a two-sided paired t-test at `alpha` detects with
    probability `power` over n pairs whose differences have standard deviation sd:
    (t_{1−α/2, n−1} + t_{power, n−1}) · sd/√n (the shifted-central-t approximation to the
    non-central t; a little conservative)."""
    if n < 2:
        return float("nan")
    df = n - 1
    return (t_quantile(1 - alpha / 2, df) + t_quantile(power, df)) * sd / math.sqrt(n)


def pairs_for(diff: float, sd: float, alpha: float = 0.05, power: float = 0.8) -> int:
    """The fewest pairs at which `mde_paired` falls to |diff| (the seeds an observed effect
    needs; mde decreases in n): doubling to a bracket, then bisection; capped at 2²⁰."""
    hi = 2
    while hi < 2**20 and mde_paired(sd, hi, alpha, power) > abs(diff):
        hi *= 2
    lo = max(2, hi // 2)
    while lo < hi:
        mid = (lo + hi) // 2
        if mde_paired(sd, mid, alpha, power) > abs(diff):
            lo = mid + 1
        else:
            hi = mid
    return lo


def fisher_min_events(n_t: int, n_c: int, alpha: float = 0.05) -> int | None:
    """The fewest treatment-arm events (of n_t runs) that reach one-sided Fisher p < alpha
    against no event in the n_c control runs; None when even n_t of n_t does not."""
    for a in range(n_t + 1):
        if fisher_exact(a, n_t - a, 0, n_c)["p_greater"] < alpha:
            return a
    return None


def power_fisher(n: int, q_t: float, q_c: float, alpha: float = 0.05) -> float:
    """The probability that one-sided Fisher (treatment has more events) gives p < alpha with n
    runs an arm whose events are independent Bernoulli(q_t) and Bernoulli(q_c): the sum over
    all (a, c) event counts of their binomial probabilities, exact."""
    return sum(
        math.comb(n, a)
        * q_t**a
        * (1 - q_t) ** (n - a)
        * math.comb(n, c)
        * q_c**c
        * (1 - q_c) ** (n - c)
        for a in range(n + 1)
        for c in range(n + 1)
        if fisher_exact(a, n - a, c, n - c)["p_greater"] < alpha
    )


def power_sign(n: int, q_t: float, q_c: float, alpha: float = 0.05) -> float:
    """The probability that the one-sided sign test (treatment has more events) gives p < alpha
    over n pairs whose two runs have the event independently, Bernoulli(q_t) and
    Bernoulli(q_c): a pair is + with probability q_t(1 − q_c), − with (1 − q_t)q_c, else
    concordant; the sum over the multinomial (n_plus, n_minus) counts, exact."""
    up, down = q_t * (1 - q_c), (1 - q_t) * q_c
    tie = 1 - up - down
    return sum(
        math.factorial(n)
        / (math.factorial(k) * math.factorial(j) * math.factorial(n - k - j))
        * up**k
        * down**j
        * tie ** (n - k - j)
        for k in range(n + 1)
        for j in range(n + 1 - k)
        if sign_test(k, j)["p_greater"] < alpha
    )
