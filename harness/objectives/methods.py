"""Named methods of the grid, each a few parts of `core` (harness.objectives.grid composes new
points).

Windows of clip methods are given as eps_low/eps_high around 1; bands of mask/clamp methods as
absolute lo/hi. Every builder also takes aggregation / rejected_in_denominator / norm_len
(see `core`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from harness.base.batch import TokenBatch, log_ratio_folded, log_rho
from harness.objectives.core import (
    PolicyObjective,
    RatioCorrection,
    Term,
    choice,
)
from harness.stats.diagnostics import CONF_EDGES, bin_index

CLIP_BASES = {"ppo_clip": ("token", 0.2, 0.28), "gspo": ("geometric", 3e-4, 4e-4)}


def clip_term(
    base: str, eps_low: float | None, eps_high: float | None, c: float | None = None
) -> Term:
    """ppo_clip (token, DAPO 0.2/0.28) or gspo (geometric, 3e-4/4e-4); None → the base default."""
    choice("base", base, tuple(CLIP_BASES))
    level, d_low, d_high = CLIP_BASES[base]
    eps_low = d_low if eps_low is None else eps_low
    eps_high = d_high if eps_high is None else eps_high
    return Term("trust", level, "clip", 1 - eps_low, 1 + eps_high, c)


def trainer_prob(batch: TokenBatch) -> Tensor:
    """p_t = π_old(y_t), the trainer probability of the sampled token."""
    return batch.p_t if batch.p_t is not None else batch.logp_old.exp()


def ppo_clip(
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    c: float | None = None,
    aggregation: str = "token-mean",
    rejected_in_denominator: bool = True,
    norm_len: int | None = None,
) -> PolicyObjective:
    """PPO clip (Schulman 2017); DAPO clip-higher when eps_high ≠ eps_low; dual-clip c on A < 0."""
    return PolicyObjective(
        clip_term("ppo_clip", eps_low, eps_high, c),
        aggregation=aggregation,
        rejected_in_denominator=rejected_in_denominator,
        norm_len=norm_len,
    )


def gspo(
    *,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
    aggregation: str = "seq-mean-token-mean",
    rejected_in_denominator: bool = True,
    norm_len: int | None = None,
) -> PolicyObjective:
    """GSPO (2507.18071): clip s_i = exp(mean_t log r_t), one ratio per sequence (verl's agg)."""
    return PolicyObjective(
        clip_term("gspo", eps_low, eps_high),
        aggregation=aggregation,
        rejected_in_denominator=rejected_in_denominator,
        norm_len=norm_len,
    )


def tis(
    *,
    cap: float = 2.0,
    level: str = "token",
    base: str = "ppo_clip",
    eps_low: float | None = None,
    eps_high: float | None = None,
    aggregation: str = "token-mean",
    rejected_in_denominator: bool = True,
    norm_len: int | None = None,
) -> PolicyObjective:
    """TIS (Flash-RL): sg(min(ρ, C)) × base surrogate, ρ = π_old/μ at token/sequence/geometric."""
    return PolicyObjective(
        clip_term(base, eps_low, eps_high),
        (RatioCorrection("ti", level, "clamp", 0.0, cap),),
        aggregation=aggregation,
        rejected_in_denominator=rejected_in_denominator,
        norm_len=norm_len,
    )


def mis(
    *,
    ratio: str = "ti",
    level: str = "token",
    lo: float = 0.5,
    hi: float = 2.0,
    reweight: bool = False,
    base: str = "ppo_clip",
    eps_low: float | None = None,
    eps_high: float | None = None,
    aggregation: str = "token-mean",
    rejected_in_denominator: bool = True,
    norm_len: int | None = None,
) -> PolicyObjective:
    """MIS rejection band: keep 1[lo ≤ ρ ≤ hi] on π_old/μ or sg(π_θ/μ); reweight: IcePop ρ·1[…]."""
    return PolicyObjective(
        clip_term(base, eps_low, eps_high),
        (RatioCorrection(ratio, level, "pop" if reweight else "mask", lo, hi),),
        aggregation=aggregation,
        rejected_in_denominator=rejected_in_denominator,
        norm_len=norm_len,
        band=(lo, hi),
    )


def cispo(
    *,
    ratio: str = "trust",
    lo: float = 0.0,
    hi: float = 5.0,
    aggregation: str = "token-mean",
    rejected_in_denominator: bool = True,
    norm_len: int | None = None,
) -> PolicyObjective:
    """CISPO (MiniMax-M1 eq. 4): −sg(clip(r, lo, hi))·A·log π; default one-sided cap 5 (ScaleRL)."""
    return PolicyObjective(
        Term(ratio, "token", "clamp", lo, hi),
        aggregation=aggregation,
        rejected_in_denominator=rejected_in_denominator,
        norm_len=norm_len,
        band=(lo, hi),
    )


def band(
    *,
    ratio: str = "folded",
    lo: float = 0.7,
    hi: float = 6.0,
    aggregation: str = "token-mean",
    rejected_in_denominator: bool = True,
    norm_len: int | None = None,
) -> PolicyObjective:
    """Sign-agnostic band (Kimi K2.5 Eq. 1, GLM-5 DIS, SAO): −sg(r)·1[lo ≤ r ≤ hi]·A·log π."""
    return PolicyObjective(
        Term(ratio, "token", "band", lo, hi),
        aggregation=aggregation,
        rejected_in_denominator=rejected_in_denominator,
        norm_len=norm_len,
        band=(lo, hi),
    )


def binary_kl(logp_ref: Tensor, logp: Tensor) -> Tensor:
    """KL(Bern(p_ref) ‖ Bern(p)) of the sampled token, the Binary-KL divergence of DPPO
    (2602.04879 eq. 14): p_ref·log(p_ref/p) + (1 − p_ref)·log((1 − p_ref)/(1 − p)); the 1e-8 in
    the complement terms is verl's and SkyRL's (finite at p = 1)."""
    p_ref, p = logp_ref.exp(), logp.exp()
    return p_ref * (logp_ref - logp) + (1 - p_ref) * torch.log((1 - p_ref + 1e-8) / (1 - p + 1e-8))


@dataclass(frozen=True)
class TVMask:
    """DPPO binary masks (2602.04879; verl dppo_tv / dppo_kl, SkyRL dppo): a move of p = π_θ(y_t)
    away from p_ref is refused only in the advantage's direction. divergence tv: keep A > 0 iff
    p − p_ref ≤ δ_h, A ≤ 0 iff p − p_ref ≥ −δ_l; kl: keep A > 0 iff KL ≤ δ_h or p ≤ p_ref, A ≤ 0
    iff KL ≤ δ_l or p ≥ p_ref (KL = binary_kl(p_ref, p))."""

    ratio: str = "folded"  # folded: p_ref = μ (prime-rl, SkyRL); trust: p_ref = π_old (verl)
    delta_low: float = 0.2
    delta_high: float = 0.2
    two_sided: bool = False  # both bounds regardless of sign (prime-rl `ipo`)
    divergence: str = "tv"

    def __post_init__(self) -> None:
        choice("tv divergence", self.divergence, ("tv", "kl"))

    def __call__(self, logp: Tensor, batch: TokenBatch) -> tuple[Tensor, Tensor]:
        ref = batch.logp_mu if self.ratio == "folded" else batch.logp_old
        dp = logp.detach().exp() - ref.exp()
        if self.divergence == "tv":
            up_ok, down_ok = dp <= self.delta_high, dp >= -self.delta_low
        else:  # within the KL budget, or moved against the advantage (dp's sign is p vs p_ref)
            kl = binary_kl(ref, logp.detach())
            up_ok, down_ok = (kl <= self.delta_high) | (dp <= 0), (kl <= self.delta_low) | (dp >= 0)
        if self.two_sided:
            keep = up_ok & down_ok
        else:
            keep = torch.where(batch.advantages > 0, up_ok, down_ok)
        return torch.ones_like(dp), keep.to(dp)


def dppo_tv(
    *,
    ratio: str = "folded",
    delta_low: float = 0.2,
    delta_high: float = 0.2,
    two_sided: bool = False,
    c: float | None = None,
    aggregation: str = "token-mean",
    rejected_in_denominator: bool = True,
    norm_len: int | None = None,
) -> PolicyObjective:
    """DPPO-TV: −sg(min(r, c))·A·log π, masked on the probability gap to μ (or π_old)."""
    choice("ratio", ratio, ("folded", "trust"))
    return PolicyObjective(
        Term(ratio, "token", "clamp", 0.0, math.inf if c is None else c),
        (TVMask(ratio, delta_low, delta_high, two_sided),),
        aggregation=aggregation,
        rejected_in_denominator=rejected_in_denominator,
        norm_len=norm_len,
    )


def cis_weight(logp_old: Tensor, logp_mu: Tensor, p: Tensor, lam: float, kappa: float) -> Tensor:
    """CIS (2609.32444, CIS-RL Alg. 1): f = min(k, 1 + λ·max(1 − p, κ)), k = p/q; non-finite → 1."""
    log_k = log_rho(logp_old, logp_mu)
    k = torch.where(torch.isfinite(log_k), log_k.exp(), 1.0)
    return torch.minimum(k, 1 + lam * (1 - p).clamp_min(kappa))


@dataclass(frozen=True)
class CISWeight:
    lam: float = 2.3
    kappa: float = 5e-3

    def __call__(self, logp: Tensor, batch: TokenBatch) -> tuple[Tensor, Tensor]:
        f = cis_weight(batch.logp_old, batch.logp_mu, trainer_prob(batch), self.lam, self.kappa)
        return f, torch.ones_like(f)


def cis(
    *,
    lam: float = 2.3,
    kappa: float = 5e-3,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    aggregation: str = "token-mean",
    rejected_in_denominator: bool = True,
    norm_len: int | None = None,
) -> PolicyObjective:
    """CIS: f_t × decoupled PPO loss (clip 0.2/0.28 on π_θ/π_old), upper-side cap only."""
    return PolicyObjective(
        clip_term("ppo_clip", eps_low, eps_high),
        (CISWeight(lam, kappa),),
        aggregation=aggregation,
        rejected_in_denominator=rejected_in_denominator,
        norm_len=norm_len,
    )


def s2t_keep(
    adv: Tensor, p: Tensor, entropy: Tensor, mask: Tensor, tau_p: float, q: float
) -> Tensor:
    """STAPO S2T (2602.15620): drop A>0 ∧ p<τ_p ∧ H<τ_h, τ_h = q-quantile of H on {A>0, p<τ_p}."""
    cand = (mask > 0) & (adv > 0) & (p < tau_p)
    if not cand.any():
        return torch.ones_like(adv)
    tau_h = torch.quantile(entropy[cand].float(), q)
    return (~(cand & (entropy < tau_h))).to(adv)


@dataclass(frozen=True)
class S2TMask:
    tau_p: float = 0.002
    q: float = 0.75

    def __call__(self, logp: Tensor, batch: TokenBatch) -> tuple[Tensor, Tensor]:
        if batch.entropy is None:
            raise ValueError("stapo needs TokenBatch.entropy")
        p = trainer_prob(batch)
        keep = s2t_keep(batch.advantages, p, batch.entropy, batch.mask, self.tau_p, self.q)
        return torch.ones_like(keep), keep


def stapo(
    *,
    tau_p: float = 0.002,
    q: float = 0.75,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    aggregation: str = "token-mean",
    rejected_in_denominator: bool = False,
    norm_len: int | None = None,
) -> PolicyObjective:
    """STAPO: DAPO clip loss with spurious tokens masked, normalised by Σ I (rejected leave)."""
    return PolicyObjective(
        clip_term("ppo_clip", eps_low, eps_high),
        (S2TMask(tau_p, q),),
        aggregation=aggregation,
        rejected_in_denominator=rejected_in_denominator,
        norm_len=norm_len,
    )


def per_bin(x: float | Sequence[float], n_bins: int) -> Tensor:
    t = torch.as_tensor(x, dtype=torch.float32).flatten()
    if t.numel() not in (1, n_bins):
        raise ValueError(f"expected a scalar or {n_bins} per-bin values, got {t.numel()}")
    return t.expand(n_bins).clone()


class SNRShrink(PolicyObjective):
    """SNR post §4 (DERIVED): w = clip(r^λ_b, l_b, u_b) per bin b of p_t, clamp-style.

    State (lam, lower, upper, one value per bin) is what the measurement procedure fills: pass
    them as kwargs or `load_state_dict` them. `adaptive`: the post's method in training. The
    objective records every training token's Δ_live = log π_θ − log μ (α + β, at the update)
    and p_t; every `every` steps the loop runs a calibration pass at the live weights (θ on
    both sides, the deployed sampler with its noise: Δ_cal = β) and `refresh` re-derives λ_b and
    the three-job bounds [l_b, u_b] (harness.stats.snr.SNRSplit) from Δ_cal and the Δ_live recorded
    since the last refresh. Bins without an estimate keep their current values.
    """

    def __init__(
        self,
        ratio: str,
        edges: Sequence[float],
        lam: Any,
        lower: Any,
        upper: Any,
        adaptive: bool = False,
        every: int = 10,
        **agg: Any,
    ) -> None:
        super().__init__(Term(ratio, "token", "clamp"), **agg)
        if every < 1:
            raise ValueError(f"snr_shrink every={every}; valid: >= 1 (steps between refreshes)")
        self.edges = tuple(float(e) for e in edges)
        n_bins = len(edges) - 1
        self.lam, self.lower, self.upper = (per_bin(x, n_bins) for x in (lam, lower, upper))
        self.adaptive, self.every = adaptive, every
        self.live_delta, self.live_conf = torch.zeros(0), torch.zeros(0)

    def refresh_due(self, step: int) -> bool:
        return self.adaptive and step > 1 and (step - 1) % self.every == 0

    def bounds(self, batch: TokenBatch) -> tuple[Tensor, Tensor, Tensor]:
        p = trainer_prob(batch)
        b = bin_index(p, self.edges)
        return self.lam.to(p)[b], self.lower.to(p)[b], self.upper.to(p)[b]

    def __call__(self, logp: Tensor, batch: TokenBatch):
        if self.adaptive:  # the training tokens' α + β at the update
            m = batch.mask.bool()
            # the record is for the numpy SNR split: kept on the CPU whatever the device
            delta = log_ratio_folded(logp.detach(), batch.logp_mu)[m].float().cpu()
            self.live_delta = torch.cat([self.live_delta, delta])
            self.live_conf = torch.cat([self.live_conf, trainer_prob(batch)[m].float().cpu()])
        return super().__call__(logp, batch)

    @torch.no_grad()
    def refresh(self, delta_cal: Tensor, conf_cal: Tensor) -> dict[str, float]:
        """Re-derive λ_b, l_b, u_b from a calibration pass (Δ_cal, p_t) and the recorded Δ_live;
        the live record starts afresh. Returns the new values per bin as metrics."""
        from harness.stats.snr import SNRSplit, shrink_kwargs

        split = SNRSplit(self.edges)
        split.add_cal(delta_cal.double().cpu().numpy(), conf_cal.double().cpu().numpy())
        split.add_live(self.live_delta.double().numpy(), self.live_conf.double().numpy())
        table = split.bounds()
        kw = shrink_kwargs(table, fill_lam=math.nan, fill_bounds=(math.nan, math.nan))
        for name in ("lam", "lower", "upper"):
            new = torch.tensor(kw[name], dtype=getattr(self, name).dtype)
            setattr(self, name, torch.where(new.isfinite(), new, getattr(self, name)))
        out = {
            "snr/refreshed": 1.0,
            "snr/n_cal": float(len(delta_cal)),
            "snr/n_live": float(len(self.live_delta)),
        }
        for b in range(len(self.edges) - 1):
            out |= {
                f"snr/lam_b{b}": float(self.lam[b]),
                f"snr/lower_b{b}": float(self.lower[b]),
                f"snr/upper_b{b}": float(self.upper[b]),
            }
        self.live_delta, self.live_conf = torch.zeros(0), torch.zeros(0)
        return out

    def state_dict(self) -> dict[str, Any]:
        return {
            "lam": self.lam.clone(),
            "lower": self.lower.clone(),
            "upper": self.upper.clone(),
            "live_delta": self.live_delta.clone(),
            "live_conf": self.live_conf.clone(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        n_bins = len(self.edges) - 1
        self.lam, self.lower, self.upper = (
            per_bin(state[k], n_bins) for k in ("lam", "lower", "upper")
        )
        self.live_delta = state.get("live_delta", torch.zeros(0))
        self.live_conf = state.get("live_conf", torch.zeros(0))


def snr_shrink(
    *,
    ratio: str = "folded",
    edges: Sequence[float] = CONF_EDGES,
    lam: float | Sequence[float] = 0.85,
    lower: float | Sequence[float] = 0.5,
    upper: float | Sequence[float] = 2.0,
    adaptive: bool = False,
    every: int = 10,
    aggregation: str = "token-mean",
    rejected_in_denominator: bool = True,
    norm_len: int | None = None,
) -> SNRShrink:
    """SNR shrink: −sg(clip(r^λ_b, l_b, u_b))·A·log π; defaults λ = 0.85 (Table 6), [0.5, 2].
    adaptive=true: λ_b and [l_b, u_b] re-derived every `every` steps from a calibration pass at
    the live weights and the training tokens since the last refresh (the initial values until
    the first refresh)."""
    return SNRShrink(
        ratio,
        edges,
        lam,
        lower,
        upper,
        adaptive,
        every,
        aggregation=aggregation,
        rejected_in_denominator=rejected_in_denominator,
        norm_len=norm_len,
    )
