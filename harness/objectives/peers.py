"""What the peer frameworks ship (verl, TRL, SkyRL, NeMo-RL, slime), on the correction grid.

A peer's rejection or reweighting is a correction `(logp, batch) -> (weight, keep)` (and a grid
correction kind); a peer's surrogate that no `Term` treatment expresses is a `PolicyObjective`
whose `step` returns it. Where the grid already holds a peer's rule it is built from the grid's
parts: verl's k1 rejection is a ratio band (`RatioCorrection` mask), TRL's truncate / mask modes
are the TIS clamp / IcePop pop, SkyRL's sequence masks are ratio bands at the geometric or
sequence level, DPPO Binary-KL is `methods.TVMask` with divergence kl.

Every builder's defaults are the peer's (its file is cited). ε 0.2/0.2 is the symmetric PPO
window every one of them defaults to (verl actor.yaml clip_ratio_low/high, TRL GRPOConfig epsilon
with epsilon_high unset, SkyRL eps_clip_low/high, NeMo-RL ratio_clip_min/max, slime --eps-clip).
Notation: r = π_θ/π_old (ratio "trust"), ρ = π_old/μ ("ti"), π_θ/μ ("folded").
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from harness.base.batch import TokenBatch, masked_mean
from harness.objectives.core import (
    PolicyObjective,
    RatioCorrection,
    Step,
    Term,
    Window,
    at_level,
    choice,
    clamp,
    log_ratio,
)
from harness.objectives.methods import TVMask, clip_term

PEER_EPS = 0.2  # the peers' default PPO ε, both sides
Correction = Callable[[Tensor, TokenBatch], tuple[Tensor, Tensor]]


def positive(name: str, value: float | None, optional: bool = False) -> None:
    if optional and value is None:
        return
    if value is None or not value > 0:
        raise ValueError(
            f"{name}={value!r}; valid: a number > 0" + (" or None" if optional else "")
        )


def untouched(like: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(coef, keep, low, high, flip) of a Step that weights, rejects and clips nothing."""
    ones, no = torch.ones_like(like), torch.zeros_like(like, dtype=torch.bool)
    return ones, ones, no, no, torch.zeros_like(like)


# --- verl rollout correction: rejection on a KL estimate of log ρ (rollout_rs) --------------------

ESTIMATORS = ("k1", "k2", "k3")
RS_LEVELS = ("token", "sequence", "geometric", "max")


def kl_estimate(x: Tensor, estimator: str) -> Tensor:
    """Schulman's per-token estimates of KL(μ ‖ π_old) at x = log ρ, as verl's
    rollout_corr_helper.compute_rollout_rejection_mask forms them: k2 = x²/2, k3 = eˣ − 1 − x
    (both ≥ 0, 0 at ρ = 1). k1 = −x is signed; rollout_rs reads it as a ratio band instead."""
    choice("estimator", estimator, ("k2", "k3"))
    return 0.5 * x**2 if estimator == "k2" else x.exp() - 1 - x


def over_sequence(x: Tensor, mask: Tensor, level: str) -> Tensor:
    """token: x_t; sequence: Σ_t x_t (verl seq_sum); geometric: mean_t x_t (seq_mean); max:
    max_t x_t (seq_max; 0 on a row without tokens), broadcast over the row. Unlike `at_level`
    nothing is clamped: these are divergences held against a threshold, not logs to exponentiate."""
    if level == "token":
        return x
    if level == "max":
        s = x.masked_fill(mask <= 0, -math.inf).amax(-1, keepdim=True)
        s = torch.where(s == -math.inf, 0.0, s)
    else:
        s = (x * mask).sum(-1, keepdim=True)
        if level == "geometric":
            s = s / mask.sum(-1, keepdim=True).clamp_min(1.0)
    return s.expand_as(x)


@dataclass(frozen=True)
class DivergenceMask:
    """verl rollout_rs `<level>_k2` / `<level>_k3`: keep a token (level token) or its whole
    sequence iff the level's statistic of the estimate is ≤ threshold (inclusive, as verl). The
    defaults are verl's bypass_ppo_clip_k3_rs preset: seq_mean_k3 at 0.01."""

    ratio: str = "ti"  # ti: π_old/μ (verl decoupled mode); folded: π_θ/μ (bypass mode)
    estimator: str = "k3"
    level: str = "geometric"
    threshold: float = 0.01

    def __post_init__(self) -> None:
        choice("rs ratio", self.ratio, ("ti", "folded"))
        choice("rs estimator", self.estimator, ("k2", "k3"))
        choice("rs level", self.level, RS_LEVELS)
        positive("rs threshold", self.threshold)

    def __call__(self, logp: Tensor, batch: TokenBatch) -> tuple[Tensor, Tensor]:
        k = kl_estimate(log_ratio(logp.detach(), batch, self.ratio), self.estimator)
        keep = over_sequence(k, batch.mask, self.level) <= self.threshold
        return torch.ones_like(k), keep.to(k)


def rs_correction(
    estimator: str, level: str, threshold: float, threshold_low: float | None, ratio: str
) -> Correction:
    """verl's `<level>_<estimator>` rejection at `threshold`. k1: verl keeps log(lower) ≤ Σ or
    mean of −log ρ ≤ log(upper), i.e. lower ≤ μ/π_old ≤ upper at that level, one number u
    meaning [1/u, u]; that is the ratio band 1/upper ≤ ρ ≤ 1/lower of a RatioCorrection mask
    (upper = threshold, lower = threshold_low or 1/threshold). k2, k3: a DivergenceMask."""
    choice("estimator", estimator, ESTIMATORS)
    choice("level", level, RS_LEVELS)
    positive("threshold", threshold)
    if estimator != "k1":
        if threshold_low is not None:
            raise ValueError(
                f"threshold_low={threshold_low!r} with estimator={estimator!r}; valid: None "
                "(only k1 has a lower bound)"
            )
        return DivergenceMask(ratio, estimator, level, threshold)
    if level == "max":
        raise ValueError("level='max' with estimator='k1'; valid: estimator 'k2' or 'k3'")
    positive("threshold_low", threshold_low, optional=True)
    if threshold_low is not None and threshold_low > threshold:
        raise ValueError(f"threshold_low={threshold_low!r}; valid: <= threshold={threshold!r}")
    hi = threshold if threshold_low is None else 1 / threshold_low
    return RatioCorrection(ratio, level, "mask", 1 / threshold, hi)


def rollout_rs(
    *,
    estimator: str = "k1",
    level: str = "token",
    threshold: float = 2.0,
    threshold_low: float | None = None,
    ratio: str = "ti",
    rollout_is: str | None = None,
    rollout_is_threshold: float = 2.0,
    eps_low: float = PEER_EPS,
    eps_high: float = PEER_EPS,
    c: float | None = 3.0,
    aggregation: str = "token-mean",
    rejected_in_denominator: bool = False,
    norm_len: int | None = None,
) -> PolicyObjective:
    """verl rollout correction (rollout_corr_helper; algorithm/rollout_correction.yaml) under
    verl's vanilla loss (PPO ε 0.2/0.2, dual-clip clip_ratio_c 3): rejection `rollout_rs` on
    k1/k2/k3 of log ρ at token, sequence (seq_sum), geometric (seq_mean) or max (seq_max, k2/k3),
    times TIS `rollout_is` (None, token or sequence: min(ρ, rollout_is_threshold)). verl leaves
    the rejection threshold unset (required); 2.0 is its k1 presets' [0.5, 2]. Rejected tokens
    leave the normaliser: verl rewrites response_mask. ratio folded = bypass mode (π_θ/μ)."""
    corrections: tuple[Correction, ...] = (
        rs_correction(estimator, level, threshold, threshold_low, ratio),
    )
    if rollout_is is not None:
        choice("rollout_is", rollout_is, ("token", "sequence"))
        positive("rollout_is_threshold", rollout_is_threshold)
        corrections += (RatioCorrection("ti", rollout_is, "clamp", 0.0, rollout_is_threshold),)
    return PolicyObjective(
        clip_term("ppo_clip", eps_low, eps_high, c),
        corrections,
        aggregation=aggregation,
        rejected_in_denominator=rejected_in_denominator,
        norm_len=norm_len,
    )


# --- TRL vllm_importance_sampling_mode and the off-policy sequence mask (OPSM) ------------------

TRL_IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def trl_is_correction(
    mode: str, clip_min: float | None, clip_max: float | None, modes: tuple[str, ...] = TRL_IS_MODES
) -> RatioCorrection:
    """TRL GRPOTrainer._generate_and_score_completions on ρ = π_old/μ, per token or per sequence
    (Σ_t log ρ_t): truncate = clip(ρ, C_min, C_max), the TIS clamp; mask = ρ·1[C_min ≤ ρ ≤ C_max],
    the ratio kept inside and 0 outside, IcePop's pop. An unset bound is open."""
    choice("mode", mode, modes)
    positive("clip_min", clip_min, optional=True)
    positive("clip_max", clip_max, optional=True)
    level, how = mode.split("_")
    lo = 0.0 if clip_min is None else clip_min
    hi = math.inf if clip_max is None else clip_max
    return RatioCorrection("ti", level, "clamp" if how == "truncate" else "pop", lo, hi)


@dataclass(frozen=True)
class OffPolicySeqMask:
    """OPSM, DeepSeek-V3.2 eq. 9 (TRL GRPOTrainer.get_off_policy_mask, slime
    ppo_utils.compute_opsm_mask): drop sequence i iff A < 0 and mean_t (log q − log π_θ) > δ,
    q = π_old (trust: slime) or μ (folded: TRL with vLLM's log-probs). π_θ is read detached."""

    delta: float = 1e-4
    ratio: str = "trust"

    def __post_init__(self) -> None:
        choice("opsm ratio", self.ratio, ("trust", "folded"))

    def __call__(self, logp: Tensor, batch: TokenBatch) -> tuple[Tensor, Tensor]:
        kl = -at_level(log_ratio(logp.detach(), batch, self.ratio), batch.mask, "geometric")
        keep = (batch.advantages >= 0) | (kl <= self.delta)
        return torch.ones_like(kl), keep.to(kl)


def trl_is(
    *,
    mode: str | None = "sequence_mask",
    clip_min: float | None = None,
    clip_max: float | None = 3.0,
    off_policy_mask_threshold: float | None = None,
    eps_low: float = PEER_EPS,
    eps_high: float = PEER_EPS,
    c: float | None = None,
    aggregation: str = "token-mean",
    rejected_in_denominator: bool = True,
    norm_len: int | None = None,
) -> PolicyObjective:
    """TRL GRPOTrainer (grpo_config.py): loss_type dapo (PPO ε 0.2/0.2, token mean over the
    batch) × vllm_importance_sampling_mode (sequence_mask, C_max 3; None: correction off). `c` is
    TRL's `delta` (above 1 + ε_high, as TRL asks, its cap of r binds only where A < 0: the dual
    clip); off_policy_mask_threshold δ adds OPSM on μ. Masked tokens stay in the normaliser."""
    corrections: tuple[Correction, ...] = ()
    if mode is not None:
        corrections += (trl_is_correction(mode, clip_min, clip_max),)
    if off_policy_mask_threshold is not None:
        positive("off_policy_mask_threshold", off_policy_mask_threshold)
        corrections += (OffPolicySeqMask(off_policy_mask_threshold, "folded"),)
    return PolicyObjective(
        clip_term("ppo_clip", eps_low, eps_high, c),
        corrections,
        aggregation=aggregation,
        rejected_in_denominator=rejected_in_denominator,
        norm_len=norm_len,
    )


def opsm(
    *,
    delta: float = 1e-4,
    ratio: str = "trust",
    eps_low: float = PEER_EPS,
    eps_high: float = PEER_EPS,
    c: float | None = None,
    aggregation: str = "token-mean",
    rejected_in_denominator: bool = True,
    norm_len: int | None = None,
) -> PolicyObjective:
    """slime --use-opsm (utils/arguments.py: --opsm-delta 1e-4; --eps-clip 0.2, --eps-clip-high
    unset so 0.2 too, --eps-clip-c unset): PPO clip with the sequences of negative advantage
    masked where mean_t (log π_old − log π_θ) > δ (ratio folded: --use-rollout-logprobs, q = μ)."""
    return PolicyObjective(
        clip_term("ppo_clip", eps_low, eps_high, c),
        (OffPolicySeqMask(delta, ratio),),
        aggregation=aggregation,
        rejected_in_denominator=rejected_in_denominator,
        norm_len=norm_len,
    )


# --- SkyRL off-policy correction (and NeMo-RL seq-mask-tis) --------------------------------------


@dataclass(frozen=True)
class OutlierTokenMask:
    """SkyRL off_policy_correction_utils.compute_outlier_token_mask: drop a whole sequence when
    any of its tokens has ρ < lo or ρ > hi (bounds inclusive-kept; an unset bound is open)."""

    ratio: str = "ti"
    lo: float | None = None
    hi: float | None = None

    def __post_init__(self) -> None:
        choice("outlier ratio", self.ratio, ("ti", "folded"))
        positive("outlier lo", self.lo, optional=True)
        positive("outlier hi", self.hi, optional=True)

    def __call__(self, logp: Tensor, batch: TokenBatch) -> tuple[Tensor, Tensor]:
        rho = log_ratio(logp.detach(), batch, self.ratio).exp()  # padding reads ρ = 1
        out = torch.zeros_like(rho, dtype=torch.bool)
        if self.lo is not None:
            out |= rho < self.lo
        if self.hi is not None:
            out |= rho > self.hi
        keep = ~(out & (batch.mask > 0)).any(-1, keepdim=True)
        return torch.ones_like(rho), keep.expand_as(rho).to(rho)


# OffPolicyCorrectionConfig.sequence_mask_metric -> (level of log ρ, geo/product_mask_low, _high)
SEQUENCE_MASKS = {"geometric": ("geometric", 0.99, 1.01), "product": ("sequence", 0.5, 2.0)}
TIS_CAPS = {"token": 2.0, "sequence": 5.0}  # token_ / sequence_tis_ratio_clip_high


def geo_mask(
    *,
    metric: str | None = "geometric",
    lo: float | None = None,
    hi: float | None = None,
    outlier_low: float | None = None,
    outlier_high: float | None = None,
    tis: str | None = None,
    tis_cap: float | None = None,
    eps_low: float = PEER_EPS,
    eps_high: float = PEER_EPS,
    aggregation: str = "token-mean",
    rejected_in_denominator: bool = True,
    norm_len: int | None = None,
) -> PolicyObjective:
    """SkyRL off_policy_correction on ρ = π_old/μ (config.py OffPolicyCorrectionConfig) under
    its regular PPO loss (ε 0.2/0.2): sequence mask keeping lo ≤ ρ̄ ≤ hi, ρ̄ the geometric mean
    (0.99/1.01) or the product (metric product, 0.5/2; lo/hi None: those), metric None for none;
    outlier-token rejection; TIS `tis` token or sequence, min(ρ, tis_cap) (None: 2 / 5). NeMo-RL
    seq-mask-tis (loss_functions.ClippedPGLossFn) is lo/hi its bounds, tis=token, tis_cap=inf.
    SkyRL's normaliser is the loss mask before the corrections: rejected tokens stay in it."""
    choice("metric", metric, (*SEQUENCE_MASKS, None))
    corrections: list[Correction] = []
    if outlier_low is not None or outlier_high is not None:
        corrections.append(OutlierTokenMask("ti", outlier_low, outlier_high))
    if metric is not None:
        level, d_lo, d_hi = SEQUENCE_MASKS[metric]
        lo, hi = d_lo if lo is None else lo, d_hi if hi is None else hi
        corrections.append(RatioCorrection("ti", level, "mask", lo, hi))
    elif lo is not None or hi is not None:
        raise ValueError(f"lo={lo!r}, hi={hi!r} with metric=None; valid: None (no sequence mask)")
    if tis is not None:
        choice("tis", tis, tuple(TIS_CAPS))
        cap = TIS_CAPS[tis] if tis_cap is None else tis_cap
        positive("tis_cap", cap)
        corrections.append(RatioCorrection("ti", tis, "clamp", 0.0, cap))
    elif tis_cap is not None:
        raise ValueError(f"tis_cap={tis_cap!r} with tis=None; valid: None (no TIS)")
    return PolicyObjective(
        clip_term("ppo_clip", eps_low, eps_high),
        tuple(corrections),
        aggregation=aggregation,
        rejected_in_denominator=rejected_in_denominator,
        norm_len=norm_len,
    )


# --- surrogates: SAPO, GMPO (geo_mean), DPPO-KL, Clip-Cov, KL-Cov, LUSPO, VESPO -----------------


def sapo_gate(r: Tensor, tau: Tensor) -> Tensor:
    """SAPO's soft gate (2511.20347): f(r) = σ(τ(r − 1))·4/τ. Its slope in log r is
    4σ(1 − σ)·r: 1 at r = 1 (the plain policy gradient), decaying smoothly away from it where the
    PPO clip would cut to 0."""
    return torch.sigmoid(tau * (r - 1)) * (4 / tau)


class SoftGate(PolicyObjective):
    """SAPO: per-token loss −f_τ(r)·A, τ = τ_pos where A > 0 else τ_neg; nothing clipped or
    masked. r is the policy term's ratio at its level (token, or geometric = TRL's sequence)."""

    def __init__(self, policy: Term, tau_pos: float, tau_neg: float, **agg: Any) -> None:
        positive("tau_pos", tau_pos)
        positive("tau_neg", tau_neg)
        super().__init__(policy, **agg)
        self.tau_pos, self.tau_neg = tau_pos, tau_neg

    def step(self, logp: Tensor, batch: TokenBatch) -> Step:
        adv = batch.advantages
        r = at_level(log_ratio(logp, batch, "trust"), batch.mask, self.policy.level).exp()
        tau = torch.where(adv > 0, self.tau_pos, self.tau_neg).to(r)
        return Step(-sapo_gate(r, tau) * adv, *untouched(r))


def sapo(
    *,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    level: str = "token",
    aggregation: str = "seq-mean-token-mean",
    rejected_in_denominator: bool = True,
    norm_len: int | None = None,
) -> SoftGate:
    """SAPO (verl compute_policy_loss_sapo, actor.yaml tau_pos/tau_neg 1.0/1.05; TRL loss_type
    sapo, sapo_temperature_pos/neg; SkyRL sapo): −σ(τ(r − 1))·4/τ·A. verl forces and TRL uses
    seq-mean-token-mean; level geometric is TRL's importance_sampling_level=sequence."""
    choice("level", level, ("token", "geometric"))
    return SoftGate(
        Term("trust", level, "clip"),
        tau_pos,
        tau_neg,
        aggregation=aggregation,
        rejected_in_denominator=rejected_in_denominator,
        norm_len=norm_len,
    )


def gmpo_log_ratio(x: Tensor, adv: Tensor, eps_low: float, eps_high: float) -> Tensor:
    """GMPO's token clip in log space (2507.20673; verl compute_policy_loss_geo_mean):
    sgn(A)·min(sgn(A)·x, sgn(A)·clip(x, −ε_l, ε_h)). Where A > 0 it caps log r at ε_h, where
    A < 0 it floors log r at −ε_l, where A = 0 it is 0; the gradient flows only where the bound
    does not bind."""
    xc = clamp(x, -eps_low, eps_high)
    return torch.where(adv > 0, torch.minimum(x, xc), torch.where(adv < 0, torch.maximum(x, xc), 0))


class GeoMeanClip(PolicyObjective):
    """GMPO: s_i = exp(mean_t clip_A(log r_t)), per-token loss −A·s_i, so seq-mean-token-mean
    gives verl's mean_i(−Ā_i·s_i). clip/* flag the tokens where a bound binds."""

    def __init__(self, eps_low: float, eps_high: float, **agg: Any) -> None:
        positive("eps_low", eps_low)
        positive("eps_high", eps_high)
        super().__init__(Term("trust", "geometric", "clip"), **agg)
        self.eps_low, self.eps_high = eps_low, eps_high

    def window(self) -> Window:
        """verl's clip_ratio ε read as the ratio window [1 − ε_l, 1 + ε_h], as for the other
        peers' ε (the clip itself bounds log r by ±ε, a window of e^∓ε)."""
        return Window(self.band, (1 - self.eps_low, 1 + self.eps_high))

    def step(self, logp: Tensor, batch: TokenBatch) -> Step:
        adv = batch.advantages
        x = log_ratio(logp, batch, "trust")
        s = at_level(gmpo_log_ratio(x, adv, self.eps_low, self.eps_high), batch.mask, "geometric")
        coef, keep, _, _, flip = untouched(x)
        xd = x.detach()
        low, high = (adv < 0) & (xd < -self.eps_low), (adv > 0) & (xd > self.eps_high)
        return Step(-adv * s.exp(), coef, keep, low, high, flip)


def geo_mean(
    *,
    eps_low: float = PEER_EPS,
    eps_high: float = PEER_EPS,
    aggregation: str = "seq-mean-token-mean",
    rejected_in_denominator: bool = True,
    norm_len: int | None = None,
) -> GeoMeanClip:
    """GMPO (verl loss_mode geo_mean): −A·exp(mean_t clip(log r_t)), verl's clip_ratio 0.2/0.2 as
    log-ratio bounds; verl averages over sequences whatever its loss_agg_mode."""
    return GeoMeanClip(
        eps_low,
        eps_high,
        aggregation=aggregation,
        rejected_in_denominator=rejected_in_denominator,
        norm_len=norm_len,
    )


def dppo_kl(
    *,
    ratio: str = "trust",
    delta_low: float = 0.2,
    delta_high: float = 0.2,
    c: float | None = 3.0,
    aggregation: str = "token-mean",
    rejected_in_denominator: bool = True,
    norm_len: int | None = None,
) -> PolicyObjective:
    """DPPO Binary-KL (verl compute_policy_loss_dppo_kl: clip_ratio 0.2 as δ, clip_ratio_c 3 as
    the cap of r; SkyRL dppo binary_kl: ratio folded, c None): −sg(min(r, c))·A·log π, masked on
    the binary KL to π_old (trust) or μ (folded) in the advantage's direction."""
    choice("ratio", ratio, ("trust", "folded"))
    return PolicyObjective(
        Term(ratio, "token", "clamp", 0.0, math.inf if c is None else c),
        (TVMask(ratio, delta_low, delta_high, divergence="kl"),),
        aggregation=aggregation,
        rejected_in_denominator=rejected_in_denominator,
        norm_len=norm_len,
    )


def centred_cov(adv: Tensor, logp: Tensor, mask: Tensor) -> Tensor:
    """Per-token covariance term (A − Ā)·(log π − mean log π), both means over the response tokens
    (Cui et al. 2505.22617, the entropy mechanism; verl clip_cov / kl_cov)."""
    return (adv - masked_mean(adv, mask)) * (logp - masked_mean(logp, mask))


class ClipCov(PolicyObjective):
    """Clip-Cov (verl compute_policy_loss_clip_cov): the PPO clip, and among the tokens the clip
    leaves open whose covariance lies strictly in (lb, ub) a random max(⌊f·N⌋, 1) get their loss
    zeroed (they stay in the normaliser). The draw uses a seeded CPU generator, the state."""

    def __init__(self, policy: Term, frac: float, lb: float, ub: float, seed: int, **agg: Any):
        positive("clip_cov_ratio", frac)
        if not lb < ub:
            raise ValueError(f"clip_cov_lb={lb!r}, clip_cov_ub={ub!r}; valid: lb < ub")
        super().__init__(policy, **agg)
        self.frac, self.lb, self.ub = frac, lb, ub
        self.generator = torch.Generator().manual_seed(seed)

    def step(self, logp: Tensor, batch: TokenBatch) -> Step:
        s = super().step(logp, batch)
        adv, m = batch.advantages, batch.mask > 0
        r = log_ratio(logp.detach(), batch, "trust").exp()
        clipped = (-adv * clamp(r, self.policy.lo, self.policy.hi) > -adv * r) & m
        cov = centred_cov(adv, logp.detach(), batch.mask)
        cand = (m & ~clipped & (cov > self.lb) & (cov < self.ub)).flatten().nonzero().squeeze(1)
        keep = s.keep.clone()
        if len(cand):
            n = max(int(self.frac * int(m.sum())), 1)
            pick = cand[torch.randperm(len(cand), generator=self.generator)[:n].to(cand.device)]
            keep.view(-1)[pick] = 0.0
        return s._replace(keep=keep)

    def state_dict(self) -> dict[str, Any]:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.set_state(state["generator"])


def clip_cov(
    *,
    clip_cov_ratio: float = 2e-4,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
    seed: int = 0,
    eps_low: float = PEER_EPS,
    eps_high: float = PEER_EPS,
    aggregation: str = "token-mean",
    rejected_in_denominator: bool = True,
    norm_len: int | None = None,
) -> ClipCov:
    """Clip-Cov (verl actor.yaml policy_loss: clip_cov_ratio 2e-4, (lb, ub) = (1, 5); ε 0.2/0.2):
    the PPO clip with a random few high-covariance tokens' gradients cut."""
    return ClipCov(
        clip_term("ppo_clip", eps_low, eps_high),
        clip_cov_ratio,
        clip_cov_lb,
        clip_cov_ub,
        seed,
        aggregation=aggregation,
        rejected_in_denominator=rejected_in_denominator,
        norm_len=norm_len,
    )


class KLCov(PolicyObjective):
    """KL-Cov (verl compute_policy_loss_kl_cov): the unclipped −A·r, plus coef·|log r| on the
    max(⌊f·N⌋, 1) tokens of largest covariance."""

    def __init__(self, frac: float, coef: float, **agg: Any) -> None:
        positive("kl_cov_ratio", frac)
        super().__init__(Term("trust", "token", "clip", 0.0, math.inf), **agg)
        self.frac, self.coef = frac, coef

    def window(self) -> Window:
        """The [0, ∞) clip clips nothing: checked at the reference windows."""
        return Window(self.band)

    def step(self, logp: Tensor, batch: TokenBatch) -> Step:
        s = super().step(logp, batch)  # the clip to [0, ∞) leaves max(−A r, −A r) = −A r
        m = (batch.mask > 0).flatten()
        valid = m.nonzero().squeeze(1)
        cov = centred_cov(batch.advantages, logp.detach(), batch.mask).flatten()[valid]
        top = torch.zeros_like(m)
        if len(valid):
            top[valid[cov.topk(max(1, int(len(valid) * self.frac))).indices]] = True
        x = log_ratio(logp, batch, "trust")
        return s._replace(base=s.base + self.coef * x.abs() * top.view_as(x))


def kl_cov(
    *,
    kl_cov_ratio: float = 2e-4,
    ppo_kl_coef: float = 0.1,
    aggregation: str = "token-mean",
    rejected_in_denominator: bool = True,
    norm_len: int | None = None,
) -> KLCov:
    """KL-Cov (verl actor.yaml policy_loss: kl_cov_ratio 2e-4, ppo_kl_coef 0.1): −A·r +
    coef·|log r| on the highest-covariance tokens. (SkyRL's kl_cov defaults to 0.2 and 1.0.)"""
    return KLCov(
        kl_cov_ratio,
        ppo_kl_coef,
        aggregation=aggregation,
        rejected_in_denominator=rejected_in_denominator,
        norm_len=norm_len,
    )


def luspo(
    *,
    eps_low: float = PEER_EPS,
    eps_high: float = PEER_EPS,
    c: float | None = None,
    aggregation: str = "seq-mean-token-sum",
    rejected_in_denominator: bool = True,
    norm_len: int | None = None,
) -> PolicyObjective:
    """TRL loss_type luspo (2602.05261): the GSPO clip on s_i = exp(mean_t log r_t) at TRL's
    ε 0.2/0.2, each sequence's loss × |y_i|, the mean over sequences: seq-mean-token-sum of the
    per-token loss. `c` is TRL's delta (above 1 + ε_high)."""
    return PolicyObjective(
        clip_term("gspo", eps_low, eps_high, c),
        aggregation=aggregation,
        rejected_in_denominator=rejected_in_denominator,
        norm_len=norm_len,
    )


LOG_W_MIN = math.log(1e-8)  # TRL's lower clamp of log w


def vespo_weight(
    log_w: Tensor, adv: Tensor, k_pos: float, lam_pos: float, k_neg: float, lam_neg: float
) -> Tensor:
    """VESPO's gamma weight (2602.10693; TRL GRPOTrainer.get_gamma_weights): φ(w) = e^λ·w^k·e^{−λw},
    normalised to φ(1) = 1, with (k, λ) = (k_pos, λ_pos) where A ≥ 0 else (k_neg, λ_neg), computed
    in log space: log w clamped to [log 1e-8, 20], λ floored at 1e-4, a non-finite φ read as 0."""
    log_w = log_w.clamp(LOG_W_MIN, 20.0)
    pos = adv >= 0
    k = torch.where(pos, k_pos, k_neg).to(log_w)
    lam = torch.where(pos, lam_pos, lam_neg).to(log_w).clamp_min(1e-4)
    return (lam + k * log_w - lam * log_w.exp()).exp().nan_to_num(0.0, 0.0, 0.0)


class VESPO(PolicyObjective):
    """VESPO: −sg(φ(w_i))·A·log π with log w_i = Σ_t log r_t, plus Σ_t log g_t with g_t TRL's
    token-level vLLM IS ratio after truncate / mask (each log g_t clamped to [log 1e-8, 20], so a
    masked token drives w_i to ~0) when `is_correction` is set."""

    def __init__(
        self, gamma: tuple[float, float, float, float], is_correction: Correction | None, **agg: Any
    ) -> None:
        super().__init__(Term("trust", "sequence", "clamp", 0.0, math.inf), **agg)
        self.gamma, self.is_correction = gamma, is_correction

    def step(self, logp: Tensor, batch: TokenBatch) -> Step:
        m = batch.mask
        log_w = (log_ratio(logp.detach(), batch, "trust") * m).sum(-1, keepdim=True)
        if self.is_correction is not None:
            w, keep = self.is_correction(logp, batch)
            log_g = torch.log(w * keep).clamp(LOG_W_MIN, 20.0)
            log_w = log_w + (log_g * m).sum(-1, keepdim=True)
        phi = vespo_weight(log_w.expand_as(logp), batch.advantages, *self.gamma)
        _, keep, low, high, flip = untouched(logp.detach())
        return Step(-batch.advantages * logp, phi, keep, low, high, flip)


def vespo(
    *,
    k_pos: float = 2.0,
    lambda_pos: float = 3.0,
    k_neg: float = 3.0,
    lambda_neg: float = 2.0,
    is_mode: str | None = None,
    is_clip_min: float | None = None,
    is_clip_max: float | None = 3.0,
    aggregation: str = "token-mean",
    rejected_in_denominator: bool = True,
    norm_len: int | None = None,
) -> VESPO:
    """TRL loss_type vespo (grpo_config.py vespo_k/lambda_pos 2/3, _neg 3/2; token mean over the
    batch): −sg(φ(w))·A·log π, w = Π_t π_θ/π_old; is_mode token_truncate | token_mask folds TRL's
    vLLM IS ratio (vllm_importance_sampling_clip_max 3) into w (None: no vLLM correction)."""
    corr = None
    if is_mode is not None:
        corr = trl_is_correction(
            is_mode, is_clip_min, is_clip_max, ("token_truncate", "token_mask")
        )
    return VESPO(
        (k_pos, lambda_pos, k_neg, lambda_neg),
        corr,
        aggregation=aggregation,
        rejected_in_denominator=rejected_in_denominator,
        norm_len=norm_len,
    )
