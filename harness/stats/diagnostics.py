"""Diagnostics: every dial on a per-token log-ratio, one function each, one naming scheme.

A dial reads x = log(π_a/π_b) of the sampled tokens under a 0/1 `mask` ([B, T] tensors). The
training loop reads them on the training–inference ratio ρ = π_old/μ (Table 1 row 3, pure β at
staleness 0), the measurement job on Δ = log π_trainer − log μ, streamed (harness.stats.snr: the
same names, the same ESS formula). Names (the loop logs them as `dial/<name>`; Table 7's rows):

  identity check       E[r] = 1 for faithful log-probs (`identity_check`)
  uncapped_mean_ratio  E[r];  capped_mean_ratio  E[min(r, C)]  (C = CAP, verl's TIS threshold)
  kl_k1, kl_k3         E[−x], E[r − 1 − x]  (k3 ≥ 0: Schulman's estimator of KL(μ‖π))
  chi2                 E[(r − 1)²]
  ess_token, ess_seq   (Σw)² / (N Σw²) over tokens, over sequences (w = Π_t r_t)
  out_of_band_frac     share of tokens with r ∉ BAND
  fork_oob_share       share of the out-of-band tokens that sit on forks (p_t < FORK_P)
  mean_abs_delta, p99_abs_delta, mean_abs_delta_nonmatching (|x| > 1e-6 only)
  <key>/bin_<lo>-<hi>  the mean of a per-token quantity per confidence bin of p_t (CONF_EDGES)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from harness.base.batch import log_rho, masked_mean

# the confidence bins of trainer p_t, [lo, hi), the last closed (DERIVED: the SNR post bins by
# p_t without giving fixed edges)
CONF_EDGES = (0.0, 0.1, 0.3, 0.5, 0.7, 0.9, 0.99, 1.0)
CAP = 2.0  # C of capped_mean_ratio
BAND = (0.5, 2.0)  # the [1/2, 2] band of out_of_band_frac (the SNR post's reject/clamp band)
FORK_P = 0.5  # a fork token: trainer p_t < 0.5
MATCH_TOL = 1e-6  # |x| above this: a non-matching token
SAFETY = 20.0  # |x| cap before exp (verl's SAFETY_BOUND)


def gate(p_t: Tensor, p_sq_sum: Tensor) -> Tensor:
    """The softmax gate g = 1 − 2 p_t + ‖p‖²: to first order, Var Δ per unit of i.i.d. logit-error
    variance (the SNR post, §2)."""
    return 1 - 2 * p_t + p_sq_sum


def bin_index(conf, edges=CONF_EDGES):
    """Confidence bin of each p_t: b with edges[b] ≤ p < edges[b + 1] (p = 1 in the last bin).
    numpy in, numpy out; a tensor in, a tensor out."""
    inner = edges[1:-1]
    if isinstance(conf, Tensor):
        return torch.bucketize(
            conf, torch.tensor(inner, dtype=conf.dtype, device=conf.device), right=True
        )
    return np.searchsorted(np.asarray(inner, dtype=np.float64), conf, side="right")


def bin_label(lo: float, hi: float) -> str:
    return f"bin_{lo:g}-{hi:g}"


def _ratio(x: Tensor) -> Tensor:
    return x.double().clamp(-SAFETY, SAFETY).exp()


def mean_ratio(x: Tensor, m: Tensor, cap: float | None = None) -> float:
    r = _ratio(x)
    return float(masked_mean(r if cap is None else r.clamp(max=cap), m))


def kl_k1(x: Tensor, m: Tensor) -> float:
    return float(masked_mean(-x.double(), m))


def kl_k3(x: Tensor, m: Tensor) -> float:
    return float(masked_mean(_ratio(x) - 1 - x.double().clamp(-SAFETY, SAFETY), m))


def chi2(x: Tensor, m: Tensor) -> float:
    return float(masked_mean((_ratio(x) - 1) ** 2, m))


def ess_from_sums(s1: float, s2: float, n: float) -> float:
    """Normalised effective sample size (Σw)² / (N Σw²) ∈ (0, 1] from its sums (verl)."""
    return float(s1 * s1 / max(n * s2, 1e-300)) if n > 0 else float("nan")


def ess(w: Tensor, m: Tensor) -> float:
    """ESS/N of weights `w` over the entries `m` selects (tokens, or sequences)."""
    w, m = w.double(), m.double()
    return ess_from_sums(float((w * m).sum()), float((w * w * m).sum()), float(m.sum()))


def ess_seq(x: Tensor, m: Tensor) -> float:
    """ESS/N over sequences of the product weights w_i = Π_t r_t."""
    return ess(_ratio((x.double() * m).sum(-1)), (m.sum(-1) > 0).double())


def out_of_band(x: Tensor, band: tuple[float, float] = BAND) -> Tensor:
    return (x < math.log(band[0])) | (x > math.log(band[1]))


def out_of_band_frac(x: Tensor, m: Tensor, band: tuple[float, float] = BAND) -> float:
    return float(masked_mean(out_of_band(x, band).double(), m))


def fork_oob_share(x: Tensor, p_t: Tensor, m: Tensor, band: tuple[float, float] = BAND) -> float:
    """Share of out-of-band tokens on forks (p_t < FORK_P); nan when none is out of band."""
    oob = out_of_band(x, band) & m.bool()
    n = int(oob.sum())
    return float((oob & (p_t < FORK_P)).sum()) / n if n else float("nan")


def bin_means(v: Tensor, p_t: Tensor, m: Tensor, key: str, edges=CONF_EDGES) -> dict[str, float]:
    """{"<key>/bin_<lo>-<hi>": mean of v over the masked tokens in that p_t bin} (empty bins
    left out)."""
    sel = m.bool()
    b, v = bin_index(p_t[sel], edges), v[sel].double()
    out = {}
    for i, (lo, hi) in enumerate(zip(edges[:-1], edges[1:])):
        if (b == i).any():
            out[f"{key}/{bin_label(lo, hi)}"] = float(v[b == i].mean())
    return out


def dials(x: Tensor, m: Tensor, p_t: Tensor | None = None) -> dict[str, float]:
    """Every dial on the log-ratio x over mask m (p_t: the forks' share of the out-of-band)."""
    sel = m.bool()
    a = x[sel].double().abs()
    nonmatch = a > MATCH_TOL
    out = {
        "uncapped_mean_ratio": mean_ratio(x, m),
        "capped_mean_ratio": mean_ratio(x, m, CAP),
        "kl_k1": kl_k1(x, m),
        "kl_k3": kl_k3(x, m),
        "chi2": chi2(x, m),
        "ess_token": ess(_ratio(x), m),
        "ess_seq": ess_seq(x, m),
        "out_of_band_frac": out_of_band_frac(x, m),
        "mean_abs_delta": float(a.mean()) if a.numel() else 0.0,
        "mean_abs_delta_nonmatching": float(a[nonmatch].mean()) if nonmatch.any() else 0.0,
        "p99_abs_delta": float(a.quantile(0.99)) if a.numel() else 0.0,
        # NeMo-RL's multiplicative probability error, mean e^|Δ| (docs/adding-new-models.md)
        "token_mult_prob_error": float(a.exp().mean()) if a.numel() else 1.0,
    }
    if p_t is not None:
        out["fork_oob_share"] = fork_oob_share(x, p_t, m)
    return out


# --- identity check -------------------------------------------------------------------------


@dataclass
class IdentityCheck:
    mean_ratio: float  # uncapped mean of exp(logp_old − logp_mu) over all response tokens
    n_tokens: int
    tol: float

    @property
    def ok(self) -> bool:
        return abs(self.mean_ratio - 1.0) <= self.tol

    def explain(self) -> str:
        head = f"identity check: mean π_old/μ = {self.mean_ratio:.6f} over {self.n_tokens} tokens"
        if self.ok:
            return f"{head} (|·−1| ≤ {self.tol}: log-probs are faithful)"
        if self.mean_ratio < 1.0:
            why = (
                "< 1: the trainer puts less mass on sampled tokens than the sampler did — a "
                "support bug (sampler logp_mu renormalised over a truncated top-p/top-k support "
                "or a temperature the trainer does not replay)"
            )
        else:
            why = (
                "> 1: the sampler's recorded log-probs are not those of the distribution it "
                "sampled from (unfaithful logp_mu: wrong temperature, stale weights, or logits "
                "post-processed after recording)"
            )
        return f"{head}, outside ±{self.tol}. {why}"


def identity_check(
    logp_old: Tensor, logp_mu: Tensor, mask: Tensor, tol: float | None = None
) -> IdentityCheck:
    """E_μ[π_old/μ] = 1 whenever μ's recorded log-probs are those of the law it sampled from.

    Uncapped mean over all response tokens. Default tolerance: 4 standard errors of the mean
    (plus 1e-3), so that a faithful engine passes at any sample size.
    """
    m = mask.bool()
    r = torch.exp(log_rho(logp_old, logp_mu)[m].double())
    n = int(r.numel())
    if n == 0:
        raise ValueError("identity_check: the mask selects no tokens")
    mean = float(r.mean())
    if tol is None:
        se = float(r.std()) / math.sqrt(n) if n > 1 else 0.0
        tol = 1e-3 + 4.0 * se
    return IdentityCheck(mean_ratio=mean, n_tokens=n, tol=tol)


# --- the collapse guard -------------------------------------------------------------------------


def collapse_guard() -> dict:
    """The guard's state at step 1: the first 10 steps' entropies, the best 10-step reward mean,
    the events so far."""
    return {"entropy0": [], "best_reward": -math.inf, "events": 0}


def check_collapse(guard: dict, m: dict, g) -> dict[str, float]:
    """Entropy surge (entropy > surge × the first-10-step mean) and reward collapse (10-step
    reward mean < collapse × the best 10-step mean seen); each flags an event in the metrics."""
    guard["entropy0"] = (guard["entropy0"] + [m["entropy/mean"]])[:10]
    rewards = guard.setdefault("recent_reward", [])
    rewards.append(m["reward/mean"])
    del rewards[:-10]
    base = float(np.mean(guard["entropy0"]))
    recent = float(np.mean(rewards))
    if len(rewards) == 10:
        guard["best_reward"] = max(guard["best_reward"], recent)
    surge = len(guard["entropy0"]) == 10 and m["entropy/mean"] > g.entropy_surge * base
    collapse = guard["best_reward"] > 0 and recent < g.reward_collapse * guard["best_reward"]
    if surge or collapse:
        guard["events"] += 1
    return {
        "collapse/entropy_surge": float(surge),
        "collapse/reward_collapse": float(collapse),
        "collapse/events": float(guard["events"]),
    }


def rollout_dials(batch) -> dict[str, float]:
    """A step's dials on ρ = π_old/μ (the trainer at the behaviour weights vs the sampler: Table 1
    row 3) from a TokenBatch, the identity check on the trainer's recompute, and the trainer's
    entropy overall and per confidence bin: what the training loop logs each step."""
    m, x = batch.mask, batch.log_rho
    chk = identity_check(batch.logp_recompute, batch.logp_mu, m)
    return {
        "identity/mean_ratio": chk.mean_ratio,
        "identity/ok": float(chk.ok),
        **{f"dial/{k}": v for k, v in dials(x, m, batch.p_t).items()},
        "entropy/mean": float(batch.entropy[m.bool()].mean()),
        **bin_means(batch.entropy, batch.p_t, m, "entropy"),
    }
