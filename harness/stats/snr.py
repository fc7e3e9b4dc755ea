"""Streaming statistics of the observed log-ratio and the SNR split (the SNR post, "Signal or
Noise? An SNR Criterion for Trusting Your Importance Ratio": §3's procedure, Tables 3, 6 and 7).

Δ = logp_trainer − logp_sampler per token. Every statistic accumulates in streaming form, so
memory is independent of the token count:
  - per confidence bin: count, mean, co-moments (Chan et al. parallel merge, float64);
  - per confidence bin: a signed log-spaced histogram of Δ (`bpd` buckets per decade over
    [1e-12, 1e3] in |Δ|, plus an exact-zero bucket) holding counts and Σ|Δ|; quantiles are
    interpolated geometrically inside a bucket, so their relative error is < 10^(1/bpd) − 1
    (0.9 % at the default bpd = 256; |Δ| < 1e-12 counts as 0);
  - scalar sums for the Table 7 dials, a log histogram of sampler confidence for the fork bin.

Public API
  token_columns(logp, logp_mu, p_t, seq, gate) -> the per-token inputs of DeltaStats.add
  snr_split(delta_cal, conf_cal, delta_live, conf_live, edges=CONF_EDGES) -> DataFrame
      bin_lo, bin_hi, n_cal, n_live, var_beta, var_r, var_alpha, snr, lam   (Table 6)
  SNRSplit(edges): streaming add_cal / add_live, .table() (with 95% intervals from a
      sequence-level Poisson bootstrap of each pass, `SeqBootstrap`), .bounds(...) (Figure 2)
  DeltaStats(edges): one stream; .anatomy() (Table 3), .dials() (Table 7), .per_bin()
  BinnedMoments(n_bins, k): per-bin means and co-moments of k variables (ground truth α, β)
  shrink_kwargs(table, bounds) -> kwargs of build_objective("snr_shrink", ...)
  snr_report(split, ...) -> Tables 3, 6 (with the bounds) and 7, per-bin statistics, |Δ| histograms

Three-job bound rule (SNR post §4, "Placement": the combination is the post's; the definition of
each bound is DERIVED, i.e. this harness's reading), per bin b:
  u = min(max(u_noise, u_signal), u_ESS),  l = max(min(l_noise, l_signal), l_ESS)
  u_noise = exp(q_{noise_q}(Δ_cal | b))          default noise_q = 0.995 (DERIVED: footnote 5
  l_noise = exp(q_{1−noise_q}(Δ_cal | b))         of the post is unknown)
  u_signal = exp(+signal_k σ_α), l_signal = exp(−signal_k σ_α), σ_α = √Var_α   (signal_k = 2)
  u_ESS, l_ESS = k, 1/k: the widest symmetric log band [1/k, k] for which the token-level
         ESS/N = (Σw)²/(N Σw²) of the clamped live weights w = clip(r^λ_b, 1/k, k) of the bin
         stays ≥ ess_floor (DERIVED 0.9; one dimension, so both tails are guarded together);
         k = ∞ when the unclamped weights pass. Searched on a log grid (401 points over
         (1, 1e4]); `ess_on="r_lambda"` (default: the weights snr_shrink clamps) or "r".
  A bin whose u_ESS < max(u_noise, u_signal) is flagged `ess_binding`: the post's *diagnosis*
  (reduce staleness or factor the ratio) rather than a band to tune.
Sequence-level ESS (product or geometric-mean weights) is reported as a dial, not per bin.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import numpy as np
import pandas as pd
from torch import Tensor

from harness.base.batch import log_rho
from harness.stats.diagnostics import BAND, CAP, CONF_EDGES, MATCH_TOL, bin_index, ess_from_sums

# Table 3's fixed thresholds: the share of tokens with |Δ| below SMALL, the tokens with trainer
# confidence p_t below LOW_CONF, and the fork tokens (the FORK_FRAC least confident under μ)
SMALL, LOW_CONF, FORK_FRAC = 1e-4, 0.3, 0.2

TABLE6_COLUMNS = [
    "bin_lo",
    "bin_hi",
    "n_cal",
    "n_live",
    "var_beta",
    "var_r",
    "var_alpha",
    "snr",
    "lam",
]
# SNRSplit.table's intervals (percentile, sequence bootstrap), after TABLE6_COLUMNS
CI_COLUMNS = [f"{k}_{e}" for k in ("var_beta", "var_alpha", "snr", "lam") for e in ("lo", "hi")]
CHUNK = 1 << 20


def token_columns(
    logp: Tensor, logp_mu: Tensor, p_t: Tensor, seq: Tensor, gate: Tensor | None = None
) -> dict[str, np.ndarray]:
    """Per token (1-d, any order), the inputs of DeltaStats.add from what a log records:
    Δ = log π_trainer − log μ in the precision the log-probs were recorded in, then float64;
    conf = p_t, the trainer's probability of the sampled token (the bins); q = μ(y_t) = exp(log μ)
    in float64 (the fork bin); gate = 1 − 2p_t + ‖p‖² (Figure 1; NaN when not recorded); seq."""
    out = {
        "delta": log_rho(logp, logp_mu).double(),
        "conf": p_t.double(),
        "q": logp_mu.double().exp(),
        "gate": gate.double() if gate is not None else p_t.double() * float("nan"),
        "seq": seq,
    }
    return {k: v.cpu().numpy() for k, v in out.items()}


# --- moments -------------------------------------------------------------------------------------


class BinnedMoments:
    """Per-bin count, mean and co-moment matrix of k variables; merged chunk by chunk."""

    def __init__(self, n_bins: int, k: int = 1):
        self.n_bins, self.k = n_bins, k
        self.n = np.zeros(n_bins)
        self.mean = np.zeros((n_bins, k))
        self.C = np.zeros((n_bins, k, k))

    def add(self, b: np.ndarray, X: np.ndarray) -> None:
        X = np.asarray(X, dtype=np.float64).reshape(len(b), self.k)
        nb = np.bincount(b, minlength=self.n_bins).astype(np.float64)
        sums = np.stack([np.bincount(b, X[:, i], self.n_bins) for i in range(self.k)], 1)
        mb = sums / np.maximum(nb, 1)[:, None]
        Xc = X - mb[b]
        Cb = np.zeros_like(self.C)
        for i in range(self.k):
            for j in range(i, self.k):
                Cb[:, i, j] = Cb[:, j, i] = np.bincount(b, Xc[:, i] * Xc[:, j], self.n_bins)
        n = self.n + nb
        d = mb - self.mean
        w = np.divide(nb, n, out=np.zeros_like(n), where=n > 0)
        self.C += Cb + d[:, :, None] * d[:, None, :] * (self.n * w)[:, None, None]
        self.mean += d * w[:, None]
        self.n = n

    def merge(self, other: BinnedMoments) -> None:
        n = self.n + other.n
        d = other.mean - self.mean
        w = np.divide(other.n, n, out=np.zeros_like(n), where=n > 0)
        self.C += other.C + d[:, :, None] * d[:, None, :] * (self.n * w)[:, None, None]
        self.mean += d * w[:, None]
        self.n = n

    def pooled(self) -> BinnedMoments:
        out = BinnedMoments(1, self.k)
        for b in range(self.n_bins):
            one = BinnedMoments(1, self.k)
            one.n, one.mean, one.C = self.n[b : b + 1], self.mean[b : b + 1], self.C[b : b + 1]
            out.merge(one)
        return out

    def cov(self, i: int = 0, j: int = 0, ddof: int = 1) -> np.ndarray:
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self.n > ddof, self.C[:, i, j] / (self.n - ddof), np.nan)

    def var(self, i: int = 0, ddof: int = 1) -> np.ndarray:
        return self.cov(i, i, ddof)

    def corr(self, i: int, j: int) -> np.ndarray:
        with np.errstate(invalid="ignore", divide="ignore"):
            return self.C[:, i, j] / np.sqrt(self.C[:, i, i] * self.C[:, j, j])


# --- log-spaced histograms -----------------------------------------------------------------------


class SeqBootstrap:
    """Per-bin variance of Δ under a streaming Poisson bootstrap over sequences: each sequence
    draws B independent Poisson(1) weights and its tokens carry them, so replicate j's weighted
    per-bin count, Σx and Σx² accumulate as the tokens arrive (memory 3·B·n_bins). Sequences are
    the resampling unit because tokens within one are correlated. Seeded: the same tokens give
    the same intervals."""

    def __init__(self, n_bins: int, B: int = 200, seed: int = 0):
        self.B, self.n_bins = B, n_bins
        self.rng = np.random.default_rng(seed)
        self.acc = np.zeros((3, B, n_bins))

    def add(self, b: np.ndarray, x: np.ndarray, seq: np.ndarray) -> None:
        seq = np.unique(seq, return_inverse=True)[1]
        w = self.rng.poisson(1.0, (self.B, int(seq.max()) + 1)).astype(np.float64)[:, seq]
        flat = (np.arange(self.B)[:, None] * self.n_bins + b[None, :]).ravel()
        size = self.B * self.n_bins
        for k, v in enumerate((np.ones_like(x), x, x * x)):
            self.acc[k] += np.bincount(flat, (w * v).ravel(), size).reshape(self.B, -1)

    def var(self) -> np.ndarray:
        """[B, n_bins]: each replicate's per-bin variance (weights as frequencies, ddof 1)."""
        n, s1, s2 = self.acc
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(n > 1, (s2 - s1 * s1 / n) / (n - 1), np.nan)


class LogBuckets:
    """Signed log-spaced buckets: index K ± (m + 1) for |x| in [10^(lo + m/bpd), 10^(lo+(m+1)/bpd)),
    K for x = 0 or |x| < 10^lo; K = bpd·(hi − lo) magnitude buckets per sign (clamped at 10^hi)."""

    def __init__(self, lo: int = -12, hi: int = 3, bpd: int = 256):
        self.lo, self.hi, self.bpd = lo, hi, bpd
        self.K = bpd * (hi - lo)
        self.size = 2 * self.K + 1

    def index(self, x: np.ndarray) -> np.ndarray:
        a = np.abs(x)
        with np.errstate(divide="ignore", invalid="ignore"):
            m = np.floor((np.log10(a) - self.lo) * self.bpd)
        nz = m >= 0  # False for 0, NaN and |x| < 10^lo
        m = np.clip(np.where(nz, m, 0), 0, self.K - 1).astype(np.int64)
        return self.K + (np.sign(x) * nz).astype(np.int64) * (m + 1)

    def value(self, j: np.ndarray, f: np.ndarray) -> np.ndarray:
        """The value at fraction f ∈ [0, 1] through bucket j (in increasing order of value)."""
        j, f = np.asarray(j), np.asarray(f, dtype=np.float64)
        s = np.sign(j - self.K)
        m = np.abs(j - self.K) - 1
        expo = np.where(s > 0, m + f, m + 1 - f) / self.bpd + self.lo
        return np.where(s == 0, 0.0, s * 10.0**expo)

    def mid(self) -> np.ndarray:
        j = np.arange(self.size)
        return self.value(j, np.full(self.size, 0.5))

    def quantile(self, counts: np.ndarray, q: float | np.ndarray) -> np.ndarray:
        """numpy's default ("linear") quantile of the histogrammed sample: order statistic k is
        placed at fraction (k − below + ½)/count through its bucket, geometrically."""
        q = np.atleast_1d(np.asarray(q, dtype=np.float64))
        cum = np.cumsum(counts)
        N = cum[-1] if len(cum) else 0.0
        if N <= 0:
            return np.full(q.shape, np.nan)

        def order_stat(k):
            t = k + 0.5
            j = np.clip(np.searchsorted(cum, t, side="right"), 0, self.size - 1)
            below = np.where(j > 0, cum[np.maximum(j - 1, 0)], 0.0)
            return self.value(j, np.clip((t - below) / np.maximum(counts[j], 1e-300), 0, 1))

        h = q * (N - 1)
        k0 = np.floor(h)
        v0, v1 = order_stat(k0), order_stat(np.minimum(k0 + 1, N - 1))
        return v0 + (h - k0) * (v1 - v0)

    def fold(self, hist: np.ndarray) -> np.ndarray:
        """Signed histogram → |x| histogram on the non-negative half (index K + m + 1, K for 0)."""
        out = hist.copy()
        out[self.K + 1 :] += hist[: self.K][::-1]
        out[: self.K] = 0
        return out


# --- one stream of per-token log-ratios ----------------------------------------------------------


class DeltaStats:
    """Streaming anatomy of Δ on one pass (calibration or live). `add` takes per-token arrays:
    delta (Δ), conf (trainer p_t, bins), optionally q (sampler confidence μ(y_t), fork bin), gate
    (1 − 2p_t + Σp², Figure 1) and seq (a sequence id per token, local to the call; sequences
    must not span calls) for the sequence-level ESS."""

    def __init__(
        self,
        edges: Sequence[float] = CONF_EDGES,
        *,
        cap: float = CAP,
        band: tuple[float, float] = BAND,
        boot: int = 200,
        boot_seed: int = 0,
    ):
        self.edges = [float(e) for e in edges]
        self.n_bins = len(self.edges) - 1
        self.cap, self.band = cap, (float(band[0]), float(band[1]))
        self.lb = LogBuckets()
        nb, S = self.n_bins, self.lb.size
        self.moments = BinnedMoments(nb, 1)
        self.boot = SeqBootstrap(nb, boot, boot_seed) if boot else None  # needs `seq`
        self.hist_n = np.zeros(nb * S)  # [bin, bucket] flattened
        self.hist_m = np.zeros(nb * S)  # Σ|Δ| per bucket
        self.gate_n, self.gate_sum, self.gate_sqrt = np.zeros(nb), np.zeros(nb), np.zeros(nb)
        # |logit p − logit q| per bin (CIS's displacement ε; needs q): Σ and count
        self.eps_n, self.eps_sum = np.zeros(nb), np.zeros(nb)
        self.corr = BinnedMoments(1, 2)  # (conf, |Δ|)
        self.q_n, self.q_m, self.q_out = np.zeros(S), np.zeros(S), np.zeros(S)
        self.s = dict.fromkeys(
            [
                "n",
                "r",
                "r_cap",
                "r2",
                "x",
                "k3",
                "chi2",
                "n_nonmatch",
                "m_nonmatch",
                "n_out",
                "n_low",
                "m_low",
                "n_seq",
                "w_prod",
                "w2_prod",
                "w_geo",
                "w2_geo",
            ],
            0.0,
        )
        self.max_abs = 0.0

    def add(self, delta, conf, q=None, gate=None, seq=None) -> DeltaStats:
        delta = np.asarray(delta, dtype=np.float64).ravel()
        conf = np.asarray(conf, dtype=np.float64).ravel()
        for s in range(0, len(delta), CHUNK):
            sl = slice(s, s + CHUNK)
            self._add(
                delta[sl],
                conf[sl],
                None if q is None else np.asarray(q, dtype=np.float64).ravel()[sl],
                None if gate is None else np.asarray(gate, dtype=np.float64).ravel()[sl],
            )
        if seq is not None:
            seq = np.asarray(seq).ravel()
            self._add_seq(delta, seq)
            if self.boot is not None and len(delta):
                self.boot.add(bin_index(conf, self.edges), delta, seq)
        return self

    def _add(self, d, conf, q, gate) -> None:
        if len(d) == 0:
            return
        S, nb = self.lb.size, self.n_bins
        b = bin_index(conf, self.edges)
        a = np.abs(d)
        self.moments.add(b, d)
        flat = b * S + self.lb.index(d)
        self.hist_n += np.bincount(flat, minlength=nb * S)
        self.hist_m += np.bincount(flat, a, nb * S)
        self.corr.add(np.zeros(len(d), dtype=np.int64), np.stack([conf, a], 1))
        if gate is not None:
            self.gate_n += np.bincount(b, minlength=nb)
            self.gate_sum += np.bincount(b, gate, nb)
            self.gate_sqrt += np.bincount(b, np.sqrt(np.clip(gate, 0, None)), nb)
        if q is not None:  # ε = Δ − log(1 − p) + log(1 − q), clipped away from p, q = 1
            tiny = 1e-12
            eps = d - np.log(np.clip(1 - conf, tiny, None)) + np.log(np.clip(1 - q, tiny, None))
            self.eps_n += np.bincount(b, minlength=nb)
            self.eps_sum += np.bincount(b, np.abs(eps), nb)
        lo, hi = np.log(self.band[0]), np.log(self.band[1])
        out = (d < lo) | (d > hi)
        qi = self.lb.index(conf if q is None else q)
        self.q_n += np.bincount(qi, minlength=S)
        self.q_m += np.bincount(qi, a, S)
        self.q_out += np.bincount(qi, out, S)
        r = np.exp(np.clip(d, -50, 50))
        nonmatch = a > MATCH_TOL
        low = conf < LOW_CONF
        s = self.s
        s["n"] += len(d)
        s["r"] += r.sum()
        s["r_cap"] += np.minimum(r, self.cap).sum()
        s["r2"] += (r * r).sum()
        s["x"] += np.clip(d, -50, 50).sum()
        s["k3"] += (r - 1 - np.clip(d, -50, 50)).sum()
        s["chi2"] += ((r - 1) ** 2).sum()
        s["n_nonmatch"] += nonmatch.sum()
        s["m_nonmatch"] += a[nonmatch].sum()
        s["n_out"] += out.sum()
        s["n_low"] += low.sum()
        s["m_low"] += a[low].sum()
        self.max_abs = max(self.max_abs, float(a.max()))

    def _add_seq(self, d, seq) -> None:
        if seq.dtype.kind not in "iu" or (len(seq) and seq.min() < 0):
            seq = np.unique(seq, return_inverse=True)[1]
        tot, cnt = np.bincount(seq, d), np.bincount(seq)
        tot, cnt = tot[cnt > 0], cnt[cnt > 0]
        for key, logw in (("prod", tot), ("geo", tot / cnt)):
            w = np.exp(np.clip(logw, -300, 300))
            self.s[f"w_{key}"] += w.sum()
            self.s[f"w2_{key}"] += (w * w).sum()
        self.s["n_seq"] += len(cnt)

    # --- reading the accumulators ---------------------------------------------------------------

    def hist(self, b: int | None = None, mass: bool = False) -> np.ndarray:
        h = (self.hist_m if mass else self.hist_n).reshape(self.n_bins, self.lb.size)
        return h.sum(0) if b is None else h[b]

    def quantile(self, q, b: int | None = None, absolute: bool = False) -> np.ndarray:
        h = self.hist(b)
        return self.lb.quantile(self.lb.fold(h) if absolute else h, q)

    def top_share(self, frac: float) -> float:
        """Share of Σ|Δ| carried by the top `frac` of tokens by |Δ| (partial bucket pro rata)."""
        n, m = self.lb.fold(self.hist()), self.lb.fold(self.hist(mass=True))
        total_m, k = m.sum(), frac * n.sum()
        if total_m <= 0:
            return float("nan")
        cn = np.cumsum(n[::-1])
        j = int(np.searchsorted(cn, k))  # buckets 0..j-1 (from the top) fully included
        full = m[::-1][:j].sum()
        rem = k - (cn[j - 1] if j > 0 else 0.0)
        part = m[::-1][j] * rem / n[::-1][j] if j < len(n) and n[::-1][j] > 0 else 0.0
        return float((full + part) / total_m)

    def cdf_abs(self, x: float) -> float:
        """Fraction of tokens with |Δ| < x, for x on a bucket edge (10^(k/bpd), e.g. 1e-4)."""
        n = self.lb.fold(self.hist())
        j = self.lb.index(np.array([x]))[0]
        return float(n[:j].sum() / max(n.sum(), 1))

    def _fork(self) -> tuple[float, float, float]:
        """(sampler-confidence threshold of the bottom FORK_FRAC, its share of Σ|Δ|, share of
        out-of-band tokens that are fork tokens); the threshold bucket is split pro rata."""
        thr = float(self.lb.quantile(self.q_n, FORK_FRAC)[0])
        cum = np.cumsum(self.q_n)
        j = int(
            np.clip(np.searchsorted(cum, FORK_FRAC * cum[-1], side="right"), 0, self.lb.size - 1)
        )
        frac = (FORK_FRAC * cum[-1] - (cum[j - 1] if j else 0.0)) / max(self.q_n[j], 1e-300)
        frac = float(np.clip(frac, 0, 1))

        def below(h):
            return h[:j].sum() + frac * h[j]

        mass = below(self.q_m) / max(self.q_m.sum(), 1e-300)
        band = below(self.q_out) / self.q_out.sum() if self.q_out.sum() > 0 else float("nan")
        return thr, float(mass), float(band)

    def anatomy(self) -> dict[str, float]:
        """Table 3: the |Δ| distribution at frozen weights (on the calibration stream)."""
        n = self.s["n"]
        mass = self.hist(mass=True).sum()
        qs = self.quantile([0.5, 0.9, 0.95, 0.99], absolute=True)
        thr, fork_mass, band_fork = self._fork()
        return {
            "n_tokens": int(n),
            "mean": mass / n,
            "median": qs[0],
            "p90": qs[1],
            "p95": qs[2],
            "p99": qs[3],
            "max": self.max_abs,
            f"frac_below_{SMALL:g}": self.cdf_abs(SMALL),
            "top1_share": self.top_share(0.01),
            "top10_share": self.top_share(0.10),
            "corr_conf_abs": float(self.corr.corr(0, 1)[0]),
            f"low_conf_token_share(p<{LOW_CONF:g})": self.s["n_low"] / n,
            f"low_conf_mass_share(p<{LOW_CONF:g})": self.s["m_low"] / max(mass, 1e-300),
            "fork_conf_threshold": thr,
            "fork_mass_share": fork_mass,
            f"band_fork_share[{self.band[0]:g},{self.band[1]:g}]": band_fork,
        }

    def dials(self) -> dict[str, float]:
        """Table 7: the dials of harness.stats.diagnostics (same names; cap C and band are this
        stream's `cap` and `band`), streamed, plus the |Δ| tail and the fork mass share."""
        s, n = self.s, self.s["n"]
        qs = self.quantile([0.95, 0.99], absolute=True)
        out = {
            "uncapped_mean_ratio": s["r"] / n,
            "capped_mean_ratio": s["r_cap"] / n,
            "kl_k1": -s["x"] / n,
            "kl_k3": s["k3"] / n,
            "chi2": s["chi2"] / n,
            "ess_token": ess_from_sums(s["r"], s["r2"], n),
            "out_of_band_frac": s["n_out"] / n,
            "mean_abs_delta": self.hist(mass=True).sum() / n,
            "mean_abs_delta_nonmatching": s["m_nonmatch"] / max(s["n_nonmatch"], 1),
            "nonmatching_frac": s["n_nonmatch"] / n,
            "max_abs_delta": self.max_abs,
            "p95_abs_delta": qs[0],
            "p99_abs_delta": qs[1],
            "fork_mass_share": self._fork()[1],
        }
        if s["n_seq"] > 0:  # product weights (diagnostics.ess_seq) and geometric-mean weights
            out["ess_seq"] = ess_from_sums(s["w_prod"], s["w2_prod"], s["n_seq"])
            out["ess_seq_geo"] = ess_from_sums(s["w_geo"], s["w2_geo"], s["n_seq"])
        return out

    def per_bin(self) -> pd.DataFrame:
        """Per confidence bin: n, mean and var of Δ, mean |Δ| and its p50 / p90 / p99, the
        logit-noise gate means and the mean log-odds displacement |logit p − logit q| (CIS's ε;
        NaN without q)."""
        m = self.hist_m.reshape(self.n_bins, -1).sum(1)
        n = self.moments.n
        with np.errstate(invalid="ignore", divide="ignore"):
            return pd.DataFrame(
                {
                    "bin_lo": self.edges[:-1],
                    "bin_hi": self.edges[1:],
                    "n": n.astype(np.int64),
                    "mean_delta": np.where(n > 0, self.moments.mean[:, 0], np.nan),
                    "var_delta": self.moments.var(),
                    "mean_abs_delta": m / n,
                    "mass_share": m / max(m.sum(), 1e-300),
                    "gate_mean": self.gate_sum / self.gate_n,
                    "gate_sqrt_mean": self.gate_sqrt / self.gate_n,
                    "mean_abs_logit_disp": self.eps_sum / self.eps_n,
                    # |Δ| quantiles per bin (streaming histogram; NaN in an empty bin)
                    **{
                        f"abs_delta_p{round(100 * q)}": [
                            float(self.quantile(q, b, absolute=True)[0]) for b in range(self.n_bins)
                        ]
                        for q in (0.5, 0.9, 0.99)
                    },
                }
            )


# --- the SNR split ------------------------------------------------------------------------------


def split_table(cal: BinnedMoments, live: BinnedMoments, edges: Sequence[float]) -> pd.DataFrame:
    """Table 6 from per-bin moments of Δ_cal and Δ_live (variable 0 of each)."""
    var_beta, var_r = cal.var(), live.var()
    var_alpha = np.maximum(var_r - var_beta, 0.0)
    var_alpha = np.where(np.isnan(var_r) | np.isnan(var_beta), np.nan, var_alpha)
    with np.errstate(invalid="ignore", divide="ignore"):
        snr = var_alpha / var_beta
        lam = var_alpha / (var_alpha + var_beta)
    return pd.DataFrame(
        {
            "bin_lo": list(edges[:-1]),
            "bin_hi": list(edges[1:]),
            "n_cal": cal.n.astype(np.int64),
            "n_live": live.n.astype(np.int64),
            "var_beta": var_beta,
            "var_r": var_r,
            "var_alpha": var_alpha,
            "snr": snr,
            "lam": lam,
        },
        columns=TABLE6_COLUMNS,
    )


def _clamped_ess(lb: LogBuckets, counts, lam: float, lower: float, upper: float) -> float:
    """ESS/N = (Σw)²/(N Σw²) of w = clip(exp(λ·Δ), lower, upper) over the histogram of Δ."""
    keep = counts > 0
    c = counts[keep]
    w = np.clip(np.exp(np.clip(lam * lb.mid()[keep], -50, 50)), lower, upper)
    return ess_from_sums(float(w @ c), float((w * w) @ c), float(c.sum()))


def _ess_band(lb: LogBuckets, counts, lam: float, floor: float) -> float:
    """The widest symmetric log band [1/k, k] whose clamped weights keep ESS/N ≥ floor, on a log
    grid of k over (1, 1e4] (401 points); ∞ when the unclamped weights pass, the grid's tightest
    k when nothing does."""
    if _clamped_ess(lb, counts, lam, 0.0, np.inf) >= floor:
        return float("inf")
    grid = np.exp(np.linspace(0.0, np.log(1e4), 401)[1:])
    ok = [k for k in grid if _clamped_ess(lb, counts, lam, 1 / k, k) >= floor]
    return float(max(ok)) if ok else float(grid[0])


class SNRSplit:
    """Streaming SNR procedure: calibration stream (α ≡ 0) and live stream (α + β)."""

    def __init__(self, edges: Sequence[float] = CONF_EDGES, **stats_kw):
        self.edges = [float(e) for e in edges]
        self.cal = DeltaStats(self.edges, boot_seed=0, **stats_kw)
        self.live = DeltaStats(self.edges, boot_seed=1, **stats_kw)

    def add_cal(self, delta, conf, **kw) -> SNRSplit:
        self.cal.add(delta, conf, **kw)
        return self

    def add_live(self, delta, conf, **kw) -> SNRSplit:
        self.live.add(delta, conf, **kw)
        return self

    def table(self, level: float = 0.95) -> pd.DataFrame:
        """Table 6, with percentile intervals (`level`) of Var_β, Var_α, SNR and λ from the two
        passes' sequence bootstraps (independent: the passes are different rollouts); NaN when
        a bin has too few replicates; absent when no tokens came with sequence ids."""
        df = split_table(self.cal.moments, self.live.moments, self.edges)
        boots = (self.cal.boot, self.live.boot)
        if any(b is None for b in boots) or not any(b.acc[0].any() for b in boots):
            return df
        vb, vr = self.cal.boot.var(), self.live.boot.var()
        va = np.where(np.isnan(vr) | np.isnan(vb), np.nan, np.maximum(vr - vb, 0.0))
        with np.errstate(invalid="ignore", divide="ignore"):
            reps = {"var_beta": vb, "var_alpha": va, "snr": va / vb, "lam": va / (va + vb)}
        q = [50 * (1 - level), 50 * (1 + level)]
        for name, r in reps.items():
            ok = np.isfinite(r).sum(0) >= 0.9 * r.shape[0]  # most replicates defined
            with np.errstate(invalid="ignore"), warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN bins
                lo, hi = np.nanpercentile(r, q, axis=0)
            df[f"{name}_lo"], df[f"{name}_hi"] = np.where(ok, lo, np.nan), np.where(ok, hi, np.nan)
        return df

    def bounds(
        self,
        noise_q: float = 0.995,
        signal_k: float = 2.0,
        ess_floor: float = 0.9,
        ess_on: str = "r_lambda",
    ) -> pd.DataFrame:
        """Table 6 plus the three-job bounds per bin (Figure 2); see the module docstring."""
        if ess_on not in ("r_lambda", "r"):
            raise ValueError(f"ess_on={ess_on!r}; valid: 'r_lambda', 'r'")
        df = self.table()
        lb = self.cal.lb
        rows = []
        for b in range(len(df)):
            hc, hl = self.cal.hist(b), self.live.hist(b)
            ql, qu = lb.quantile(hc, [1 - noise_q, noise_q]) if hc.sum() else (np.nan, np.nan)
            sa = np.sqrt(df.var_alpha[b])
            lam = 1.0 if ess_on == "r" else df.lam[b]
            u_sig, l_sig = np.exp(signal_k * sa), np.exp(-signal_k * sa)
            u_ns, l_ns = np.fmax(np.exp(qu), u_sig), np.fmin(np.exp(ql), l_sig)
            u_ess = l_ess = np.nan
            if hl.sum() > 0 and np.isfinite(lam):
                u_ess = _ess_band(lb, hl, lam, ess_floor)
                l_ess = 1 / u_ess
            upper, lower = np.fmin(u_ns, u_ess), np.fmax(l_ns, l_ess)
            by = "ess" if u_ess < u_ns else ("signal" if u_sig > np.exp(qu) else "noise")
            rows.append(
                {
                    "l_noise": np.exp(ql),
                    "u_noise": np.exp(qu),
                    "l_signal": l_sig,
                    "u_signal": u_sig,
                    "l_ess": l_ess,
                    "u_ess": u_ess,
                    "lower": lower,
                    "upper": upper,
                    "upper_set_by": by if np.isfinite(upper) else "",
                    "ess_binding": bool(u_ess < u_ns),
                }
            )
        return pd.concat([df, pd.DataFrame(rows)], axis=1)


def snr_split(
    delta_cal, conf_cal, delta_live, conf_live, edges: Sequence[float] = CONF_EDGES
) -> pd.DataFrame:
    """SNR post §3, steps 1–3 (Table 6): per bin of trainer confidence,
    Var_β = var(Δ_cal), Var_r = var(Δ_live), Var_α = max(Var_r − Var_β, 0), SNR = Var_α/Var_β,
    λ = SNR/(1 + SNR). Streaming underneath; arrays of any length."""
    s = SNRSplit(edges)
    return s.add_cal(delta_cal, conf_cal).add_live(delta_live, conf_live).table()


def shrink_kwargs(
    table: pd.DataFrame,
    bounds: pd.DataFrame | None = None,
    fill_lam: float = 0.0,
    fill_bounds: tuple[float, float] = (0.5, 2.0),
) -> dict:
    """kwargs for build_objective("snr_shrink", **kw): edges, lam, lower, upper per bin.

    `bounds` defaults to `table` (when it already holds lower/upper, e.g. SNRSplit.bounds()).
    DERIVED fills for bins without an estimate (too few tokens): λ = `fill_lam` (0: weight 1,
    "the ratio is mostly noise", Table 8) and `fill_bounds`."""
    bounds = table if bounds is None else bounds
    edges = [float(x) for x in table.bin_lo] + [float(table.bin_hi.iloc[-1])]
    lam = table.lam.to_numpy(dtype=float)
    lo = bounds.lower.to_numpy(dtype=float)
    hi = bounds.upper.to_numpy(dtype=float)
    lam = np.where(np.isfinite(lam), lam, fill_lam)
    lo = np.where(np.isfinite(lo), lo, fill_bounds[0])
    hi = np.where(np.isfinite(hi), hi, fill_bounds[1])
    return {"edges": edges, "lam": lam.tolist(), "lower": lo.tolist(), "upper": hi.tolist()}


def snr_report(
    split: SNRSplit,
    noise_q: float = 0.995,
    signal_k: float = 2.0,
    ess_floor: float = 0.9,
    ess_on: str = "r_lambda",
) -> dict[str, pd.DataFrame]:
    """The procedure's tables from the two streams: Table 3 (anatomy of Δ_cal), Table 6 with its
    intervals and the three-job bounds, Table 7 (dials, calibration vs live), the per-bin
    statistics of each pass and the |Δ| histograms (buckets holding tokens)."""
    per_bin = pd.concat(
        [
            split.cal.per_bin().assign(**{"pass": "cal"}),
            split.live.per_bin().assign(**{"pass": "live"}),
        ],
        ignore_index=True,
    )
    hist = []
    for name, st in (("cal", split.cal), ("live", split.live)):
        n, m = st.lb.fold(st.hist()), st.lb.fold(st.hist(mass=True))
        j = np.flatnonzero(n)
        lo, hi = st.lb.value(j, np.zeros(len(j))), st.lb.value(j, np.ones(len(j)))
        hist.append(pd.DataFrame({"pass": name, "lo": lo, "hi": hi, "count": n[j], "mass": m[j]}))
    dials = pd.DataFrame({"cal": split.cal.dials(), "live": split.live.dials()})
    dials.index.name = "dial"
    anatomy = pd.Series(split.cal.anatomy(), name="value")
    anatomy.index.name = "stat"
    return {
        "table3": anatomy.reset_index(),
        "table6": split.bounds(noise_q, signal_k, ess_floor, ess_on),
        "table7": dials.reset_index(),
        "per_bin": per_bin,
        "abs_delta_hist": pd.concat(hist, ignore_index=True),
    }
