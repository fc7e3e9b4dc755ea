"""Shared parts of every policy objective: ratio → level → treatment → correction → aggregation.

One token's loss is `base · sg(coef · w) · keep` (SNR post, Table 9):
  base   the surrogate that carries the gradient: the PPO clip on r (gradient through r), or
         −A·log π (CISPO form, gradient through log π)
  coef   the detached coefficient of a CISPO-form treatment (clamp, band); 1 for the PPO clip
  w      detached correction weights on a second ratio (TIS, IcePop, CIS); 1 when none
  keep   0/1 rejection (MIS band, sign-agnostic band, DPPO-TV, STAPO)
The ratios are the rows of Table 1 (harness.base.batch): trust = π_θ/π_old (row 1), ti = π_old/μ
(row 3, pure engine noise β), folded = π_θ/μ (row 4). Levels: token, sequence (product) and
geometric (length-normalised mean of log r, as GSPO and Geo-RS).

Denominator convention (frameworks disagree): with
`rejected_in_denominator=True` (default: TRL, slime, NeMo-RL, OpenRLHF) a rejected token adds 0
to the numerator but still counts in the normaliser; with False (verl RS as read, STAPO) it
leaves the normaliser too. Clipped tokens are never "rejected": they always count.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar, Literal, NamedTuple

import torch
from torch import Tensor

from harness.base.batch import (
    TokenBatch,
    log_ratio_folded,
    log_ratio_trust_region,
    log_rho,
    masked_mean,
)
from harness.base.registry import check_kwargs, lookup, register
from harness.stats.diagnostics import BAND, SAFETY, ess
from harness.stats.repetition import PLACES

AGGREGATIONS: dict[str, Callable] = {}

RATIOS = ("trust", "ti", "folded")
LEVELS = ("token", "sequence", "geometric")


def choice(name: str, value: Any, options: tuple[Any, ...]) -> None:
    if value not in options:
        raise ValueError(f"{name}={value!r}; valid: {', '.join(map(repr, options))}")


@dataclass
class ObjectiveOutput:
    loss: Tensor  # scalar, with grad
    metrics: dict[str, float]


class Window(NamedTuple):
    """The ratio windows an objective acts on, as the step-0 mechanism check reads them
    (harness.rl.mechanism): `band` is sign-agnostic (a band, mask or clamp acts outside it),
    `clip` sign-conditioned (the PPO clip binds where A < 0 below clip[0], A > 0 above clip[1]).
    A bound 0 or ∞ is no bound."""

    band: tuple[float, float] = BAND
    clip: tuple[float, float] = (0.8, 1.28)  # DAPO's 1 − 0.2, 1 + 0.28


class Objective(ABC):
    """The contract the training loop holds every objective to. A subclass defines `__call__`;
    every other hook has the plain case's default: a policy loss on log π_θ of the sampled tokens
    that aggregates on its own, the reference window, no calibration, no refresh, no state.

    inputs           what `__call__` takes: "logp", obj(logp, batch) -> ObjectiveOutput (logp
                     [B, T] with grad); "logits", obj(student_logits, teacher_logits, mask): a
                     distillation loss, so the run needs a teacher (`needs_teacher`,
                     distill.enabled)
    aggregated       whether its builder takes the aggregation group (aggregation=<name>, its
                     rejected_in_denominator and norm_len); False: `__call__` returns the loss
                     already reduced, and the group is left at its default
    window()         the band and clip window the step-0 mechanism check measures against
    calibration_due(step, steps), calibrate(...)
                     a high-precision shadow pass on the due step's last minibatch
    refresh_due(step), refresh(Δ_cal, p_t)
                     a calibration pass at the live weights before the due step
    check(steps)     refuse, before any compute, a run too short for it to do its job
    state_dict(), load_state_dict(state)      what a checkpoint keeps of it
    """

    inputs: ClassVar[Literal["logp", "logits"]] = "logp"
    aggregated: ClassVar[bool] = False

    @abstractmethod
    def __call__(self, *args: Tensor) -> ObjectiveOutput: ...

    @property
    def needs_teacher(self) -> bool:
        """A loss on the student's and a teacher's logits distils: the run builds the teacher."""
        return self.inputs == "logits"

    def window(self) -> Window:
        """The windows the mechanism check measures r = π_old/μ against. The default is the
        reference pair, [0.5, 2] and DAPO's clip: what a standard rule would act on, for an
        objective with no window of its own."""
        return Window()

    def calibration_due(self, step: int, steps: int) -> bool:
        """Whether step `step` of a `steps`-step run feeds its last minibatch to `calibrate`."""
        return False

    def calibrations(self, steps: int) -> int:
        """How many of steps 1..steps calibrate."""
        return sum(self.calibration_due(step, steps) for step in range(1, steps + 1))

    def calibrate(
        self,
        logp_hp: Tensor,
        logp_old_hp: Tensor,
        logp_lp: Tensor,
        logp_old_lp: Tensor,
        advantages: Tensor,
        mask: Tensor,
    ) -> dict[str, float]:
        """One calibration from the shadow pass: π_θ and π_old recomputed at high precision
        (hp) beside the low-precision log-probs training uses (lp); returns its metrics."""
        raise NotImplementedError(
            f"{type(self).__name__} is due a calibration but has no calibrate"
        )

    def refresh_due(self, step: int) -> bool:
        """Whether the loop runs a calibration pass at the live weights before `step` and hands
        it to `refresh`."""
        return False

    def refresh(self, delta_cal: Tensor, conf_cal: Tensor) -> dict[str, float]:
        """Re-derive the objective's state from a calibration pass at the live weights: per
        token Δ_cal = log π_θ − log μ (β alone) and p_t = π_θ(y_t); returns its metrics."""
        raise NotImplementedError(f"{type(self).__name__} is due a refresh but has no refresh")

    def check(self, steps: int) -> None:
        """Refuse a `steps`-step run before any compute (ValueError naming the key, the bad
        value and what is valid); the plain objective fits any length."""
        return None

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            raise KeyError(f"{type(self).__name__} is stateless; got keys {sorted(state)}")


# --- ratios and levels -------------------------------------------------------------------------


def log_ratio(logp: Tensor, batch: TokenBatch, ratio: str) -> Tensor:
    """Table 1 rows 1/3/4 in log space; padding and non-finite entries read 0 (ratio 1, as CIS)."""
    if ratio == "trust":
        x = log_ratio_trust_region(logp, batch.logp_old)
    elif ratio == "ti":
        x = log_rho(batch.logp_old, batch.logp_mu)
    else:
        x = log_ratio_folded(logp, batch.logp_mu)
    return torch.where((batch.mask > 0) & torch.isfinite(x), x, 0.0).clamp(-SAFETY, SAFETY)


def at_level(log_r: Tensor, mask: Tensor, level: str) -> Tensor:
    """token: log r_t; sequence: Σ_t log r_t (product); geometric: mean_t log r_t (GSPO, Geo-RS)."""
    if level == "token":
        return log_r
    s = (log_r * mask).sum(-1, keepdim=True)
    if level == "geometric":
        s = s / mask.sum(-1, keepdim=True).clamp_min(1.0)
    return s.clamp(-SAFETY, SAFETY).expand_as(log_r)


def clamp(x: Tensor, lo: float | Tensor, hi: float | Tensor) -> Tensor:
    """clip(x, lo, hi) for float or per-token bounds, each bound in x's dtype and device.

    A float bound is rounded once, from the Python float to x's dtype, so it is exact where that
    dtype holds it: 0.8 stays 0.8 in float64 (through float32 it would read 0.800000011920929).
    """
    if isinstance(lo, Tensor) or isinstance(hi, Tensor):  # torch.clamp takes two of a kind
        lo, hi = (torch.as_tensor(b, dtype=x.dtype, device=x.device) for b in (lo, hi))
    return x.clamp(lo, hi)


# --- surrogates and treatments -----------------------------------------------------------------


def ppo_clip_loss(
    ratio: Tensor, adv: Tensor, lo: float | Tensor, hi: float | Tensor, c: float | None = None
) -> Tensor:
    """PPO/DAPO: max(−A r, −A clip(r, lo, hi)); dual-clip min(·, −c A) on A < 0 (Ye et al. 2020)."""
    loss = torch.maximum(-adv * ratio, -adv * clamp(ratio, lo, hi))
    if c is not None:
        loss = torch.where(adv < 0, torch.minimum(loss, -c * adv), loss)
    return loss


def clip_flags(
    ratio: Tensor, adv: Tensor, lo: float | Tensor, hi: float | Tensor
) -> tuple[Tensor, Tensor]:
    """Where the sign-conditioned clip zeroes the gradient: (A < 0, r < lo) and (A > 0, r > hi)."""
    return (adv < 0) & (ratio < lo), (adv > 0) & (ratio > hi)


@dataclass(frozen=True)
class Term:
    """The policy term of a grid point: which ratio, at which level, which treatment, bounds.

    treatment: clip  PPO sign-conditioned clip to [lo, hi], gradient through r; c = dual-clip
               clamp CISPO: −sg(clip(r^λ, lo, hi))·A·log π (λ < 1 shrinks, SNR post)
               band  sign-agnostic mask: −sg(r^λ)·1[lo ≤ r^λ ≤ hi]·A·log π (Kimi K2.5, GLM-5,
                     SAO); i.e. a mask of the log-ratio on [log lo, log hi] when λ = 1
    """

    ratio: str = "trust"
    level: str = "token"
    treatment: str = "clip"
    lo: float = 0.8
    hi: float = 1.28
    c: float | None = None
    lam: float = 1.0

    def __post_init__(self) -> None:
        choice("ratio", self.ratio, ("trust", "folded"))  # the policy ratio must carry grad
        choice("level", self.level, LEVELS)
        choice("treatment", self.treatment, ("clip", "clamp", "band"))


class Step(NamedTuple):
    base: Tensor  # per-token surrogate with grad
    coef: Tensor  # detached CISPO-form coefficient (1 for the PPO clip)
    keep: Tensor  # 0/1 float
    low: Tensor  # bool: lower bound binds
    high: Tensor  # bool: upper bound binds
    flip: Tensor  # float: NSR decisions flipped (expected value in deterministic mode)


def policy_step(
    term: Term,
    logp: Tensor,
    batch: TokenBatch,
    lam: float | Tensor,
    lo: float | Tensor,
    hi: float | Tensor,
) -> Step:
    """Apply `term`'s treatment to its ratio; bounds are passed in so subclasses can calibrate."""
    log_r = at_level(log_ratio(logp, batch, term.ratio), batch.mask, term.level)
    adv = batch.advantages
    ones, zeros = torch.ones_like(adv), torch.zeros_like(adv)
    if term.treatment == "clip":
        r = log_r.exp()
        low, high = clip_flags(r.detach(), adv, lo, hi)
        return Step(ppo_clip_loss(r, adv, lo, hi, term.c), ones, ones, low, high, zeros)
    coef = (lam * log_r.detach()).exp()
    base = -adv * logp
    if term.treatment == "clamp":
        return Step(base, clamp(coef, lo, hi), ones, coef < lo, coef > hi, zeros)
    keep = ((coef >= lo) & (coef <= hi)).to(adv)
    return Step(base, coef, keep, zeros.bool(), zeros.bool(), zeros)


# --- corrections: (logp, batch) -> (detached weight, keep) ---------------------------------------


@dataclass(frozen=True)
class RatioCorrection:
    """TIS (clamp, lo=0: min(ρ, C)), MIS/RS (mask: keep 1[lo ≤ ρ ≤ hi]), IcePop (pop: ρ·1[…])."""

    ratio: str = "ti"
    level: str = "token"
    treatment: str = "clamp"
    lo: float = 0.0
    hi: float = 2.0

    def __post_init__(self) -> None:
        choice("correction ratio", self.ratio, RATIOS)
        choice("correction level", self.level, LEVELS)
        choice("correction treatment", self.treatment, ("clamp", "mask", "pop"))

    def __call__(self, logp: Tensor, batch: TokenBatch) -> tuple[Tensor, Tensor]:
        rho = at_level(log_ratio(logp.detach(), batch, self.ratio), batch.mask, self.level).exp()
        if self.treatment == "clamp":
            return clamp(rho, self.lo, self.hi), torch.ones_like(rho)
        inside = ((rho >= self.lo) & (rho <= self.hi)).to(rho)
        return (rho if self.treatment == "pop" else torch.ones_like(rho)), inside


# --- aggregation ---------------------------------------------------------------------------------
# `loss` is already zero outside the kept tokens; `den` is the 0/1 mask of counted tokens.


def n_sequences(den: Tensor) -> Tensor:
    return (den.sum(-1) > 0).sum().clamp_min(1)


@register(AGGREGATIONS, "token-mean")
def token_mean(loss: Tensor, den: Tensor) -> Tensor:
    """DAPO token-mean: Σ_{i,t} ℓ / Σ_{i,t} M (one global token count)."""
    return loss.sum() / den.sum().clamp_min(1.0)


@register(AGGREGATIONS, "token-sum")
def token_sum(loss: Tensor, den: Tensor) -> Tensor:
    """verl token-sum: Σ_{i,t} ℓ over the whole minibatch, no normaliser (verl scales each rank's
    local sum by the data-parallel size so that the mean-reduced gradient is this global sum; the
    harness aggregates the gathered minibatch). The step grows with the batch's token count."""
    return loss.sum()


@register(AGGREGATIONS, "seq-mean-token-mean")
def seq_mean_token_mean(loss: Tensor, den: Tensor) -> Tensor:
    """GRPO: mean over sequences of Σ_t ℓ / |y_i|."""
    return (loss.sum(-1) / den.sum(-1).clamp_min(1.0)).sum() / n_sequences(den)


@register(AGGREGATIONS, "seq-mean-token-sum")
def seq_mean_token_sum(loss: Tensor, den: Tensor) -> Tensor:
    """verl seq-mean-token-sum (core_algos.agg_loss): mean over sequences of Σ_t ℓ, no length
    normaliser (LUSPO's ℓ_i·|y_i| when ℓ is constant along the sequence)."""
    return loss.sum() / n_sequences(den)


@register(AGGREGATIONS, "seq-mean-token-sum-norm")
def seq_mean_token_sum_norm(loss: Tensor, den: Tensor, norm_len: int | None = None) -> Tensor:
    """Dr.GRPO: Σ_{i,t} ℓ / (B · L), constant L = norm_len (default: the padded length T)."""
    return loss.sum() / (n_sequences(den) * (norm_len or loss.shape[-1]))


def aggregator(name: str, norm_len: int | None) -> Callable[[Tensor, Tensor], Tensor]:
    fn = lookup(AGGREGATIONS, name, "aggregation")
    if norm_len is None:
        return fn
    check_kwargs(fn, {"norm_len": norm_len}, f"aggregation {name!r}")
    return partial(fn, norm_len=norm_len)


# --- metrics -------------------------------------------------------------------------------------


@torch.no_grad()
def policy_metrics(
    batch: TokenBatch, weight: Tensor, keep: Tensor, low: Tensor, high: Tensor, flip: Tensor
) -> dict[str, float]:
    """The namespaced metrics every policy objective returns.

    clip/* and mask/* and rescue/* are fractions of response tokens; under the sign-conditioned
    clip, clip/frac_low is all A < 0 and clip/frac_high all A > 0 (`clip_flags`), and
    mask/frac_neg + mask/frac_pos split the rejected tokens by the advantage's sign (a
    sign-agnostic band deletes both). is/* describe the applied detached weight sg(coef · w) over
    kept tokens (is/ess_seq on per-sequence mean weights; is/weight_p99 its 99th percentile).
    The dials on ρ = π_old/μ are the batch's, not the objective's: harness.stats.diagnostics (the
    loop logs them as dial/*).
    """
    m = batch.mask
    k = m * keep
    per_seq = k.sum(-1)
    w_seq = (weight * k).sum(-1) / per_seq.clamp_min(1.0)
    vals = {
        "clip/frac_low": masked_mean(low, m),
        "clip/frac_high": masked_mean(high, m),
        "mask/frac": masked_mean(1 - keep, m),
        "mask/frac_neg": masked_mean((1 - keep) * (batch.advantages < 0), m),
        "mask/frac_pos": masked_mean((1 - keep) * (batch.advantages > 0), m),
        "rescue/frac": masked_mean(flip, m),
        "is/weight_mean": masked_mean(weight, k),
        "is/weight_max": weight.masked_fill(k == 0, -math.inf).max(),
        "is/weight_min": weight.masked_fill(k == 0, math.inf).min(),
    }
    if batch.place is not None:  # shares of response tokens at EOS and at a loop's first copy
        for name, code in PLACES.items():
            at = m * (batch.place == code)
            vals[f"place/frac_{name}"] = masked_mean(at, m)
            vals[f"clip/frac_low_{name}"] = masked_mean(low * at, m)
            vals[f"clip/frac_high_{name}"] = masked_mean(high * at, m)
            vals[f"mask/frac_{name}"] = masked_mean((1 - keep) * at, m)
    kept = weight[k > 0].float()
    vals["is/weight_p99"] = kept.quantile(0.99) if kept.numel() else weight.new_tensor(math.nan)
    out = dict(zip(vals, torch.stack([v.float() for v in vals.values()]).tolist()))
    return out | {"is/ess": ess(weight, k), "is/ess_seq": ess(w_seq, (per_seq > 0).to(w_seq))}


@torch.no_grad()
def _tail(x: Tensor) -> dict[str, float]:
    if not x.numel():
        return {"grad/coef_p99": math.nan, "grad/coef_max": math.nan}
    return {"grad/coef_p99": float(x.quantile(0.99)), "grad/coef_max": float(x.max())}


def gradient_coefficient_tail(per_token: Tensor, logp: Tensor, batch: TokenBatch) -> dict:
    """The coefficient each token's ∇log π_θ gets per unit of advantage, whatever the objective:
    c_t = −(∂Σℓ/∂log π_t)/A_t (r_t for an unclipped PPO token, 0 for a clipped one, sg(clip(r))
    for CISPO, times a correction's weight; for a sequence-level ratio, the token's share of
    it). Its 99th percentile and maximum over the tokens whose gradient survives (c ≠ 0): how
    far the update's weights reach on the unclipped side. One backward from the per-token
    losses to log π only (the surrogate, not the model)."""
    (g,) = torch.autograd.grad(per_token.sum(), logp, retain_graph=True)
    adv = batch.advantages
    live = (batch.mask > 0) & (adv != 0)
    c = torch.where(live, -g / torch.where(live, adv, 1.0), 0.0).detach().float()
    return _tail(c[live & (c != 0)])


# --- the composed objective ----------------------------------------------------------------------


class PolicyObjective(Objective):
    """obj(logp, batch) -> ObjectiveOutput for one grid point: policy term × corrections."""

    aggregated = True

    def __init__(
        self,
        policy: Term,
        corrections: tuple[Callable[[Tensor, TokenBatch], tuple[Tensor, Tensor]], ...] = (),
        *,
        aggregation: str = "token-mean",
        rejected_in_denominator: bool = True,
        norm_len: int | None = None,
        band: tuple[float, float] = BAND,
    ) -> None:
        self.policy = policy
        self.corrections = corrections
        self.aggregate = aggregator(aggregation, norm_len)
        self.rejected_in_denominator = rejected_in_denominator
        self.band = band

    def window(self) -> Window:
        """`band` as the builder declares it (which of a rule's bounds is its band, a clamp's cap
        or a correction's mask, is the builder's to say); the clip window is the policy Term's
        bounds where its treatment is the clip."""
        if self.policy.treatment == "clip":
            return Window(self.band, (self.policy.lo, self.policy.hi))
        return Window(self.band)

    def bounds(self, batch: TokenBatch) -> tuple[Any, Any, Any]:
        """(λ, lo, hi) of the policy treatment; calibrated objectives override this."""
        return self.policy.lam, self.policy.lo, self.policy.hi

    def step(self, logp: Tensor, batch: TokenBatch) -> Step:
        return policy_step(self.policy, logp, batch, *self.bounds(batch))

    def __call__(self, logp: Tensor, batch: TokenBatch) -> ObjectiveOutput:
        s = self.step(logp, batch)
        weight, keep = s.coef, s.keep
        for correction in self.corrections:
            w, k = correction(logp, batch)
            weight, keep = weight * w, keep * k
        num = batch.mask * keep
        den = batch.mask if self.rejected_in_denominator else num
        per_token = torch.where(num > 0, s.base * weight.detach(), 0.0)
        metrics = policy_metrics(batch, weight, keep, s.low, s.high, s.flip)
        if logp.requires_grad:
            metrics |= gradient_coefficient_tail(per_token, logp, batch)
        return ObjectiveOutput(self.aggregate(per_token, den), metrics)
