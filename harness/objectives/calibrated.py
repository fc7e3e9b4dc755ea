"""Calibrated Clipping for full-pipeline FP8 RL (arXiv 2609.22870).

A PPO/DAPO clip whose window [L, H] is state. Every `every` steps the training loop runs a
high-precision shadow pass (π_θ and π_old recomputed at BF16 on the step's last minibatch, where
π_θ has moved: on the first, at lag 0, r_hp ≡ 1 and α ≡ 0; harness.rl.step.update) and calls

    obj.calibrate(logp_hp, logp_old_hp, logp_lp, logp_old_lp, advantages, mask) -> metrics

(lp = the low-precision log-probs training uses). It moves [L, H] by an EMA toward
  L*  quantile matching (FOUND, secondary): α = F⁻_hp(1−ε_l), the fraction of A < 0 tokens the
      high-precision ratio clips; L* = the α-quantile of the low-precision ratio over A < 0.
  H*  rebalancing (contribution DERIVED): G⁺(H; r) = Σ_{A>0} |A|·r·1[r ≤ H] and
      G⁻(L; r) = Σ_{A<0} |A|·r·1[r ≥ L]; ρ* = G⁺(1+ε_h; r_hp)/G⁻(1−ε_l; r_hp);
      H* = the smallest H with G⁺(H; r_lp) ≥ ρ*·G⁻(L*; r_lp). balance="count" uses 1 for |A|·r.
These are the hooks of `Objective` (harness.objectives.core): the loop asks
`calibration_due(step, steps)`, validation `check(steps)`; [L, H] live in `state_dict()`.
Defaults are the paper's where known: initial window [0.6, 1.8], TIS C = 2 in every run, K = 20
steps for runs of ≥ 200 steps; shorter runs calibrate every steps // 10 (≥ 10 calibrations, so
the EMA can reach its target: 0.9^10 ≈ 0.35 of the start is left).
"""

from __future__ import annotations

import math
import sys
from typing import Any

import torch
from torch import Tensor

from harness.base.batch import TokenBatch
from harness.objectives.core import (
    SAFETY,
    ObjectiveOutput,
    PolicyObjective,
    RatioCorrection,
    Term,
    Window,
    choice,
)
from harness.objectives.methods import clip_term


def matched_low(r_hp: Tensor, r_lp: Tensor, lo_ref: float) -> tuple[float, float]:
    """(α, L*): α = mean 1[r_hp < lo_ref]; L* = k-th smallest r_lp (k = round(α·n))."""
    alpha = float((r_hp < lo_ref).double().mean())
    s = r_lp.sort().values
    k = round(alpha * s.numel())
    if k == 0:  # nothing to clip: never tighten past the reference
        return alpha, min(float(s[0]), lo_ref)
    if k == s.numel():
        return alpha, float(torch.nextafter(s[-1], s.new_tensor(math.inf)))
    return alpha, float(s[k])


def balanced_high(r_pos: Tensor, w_pos: Tensor, target: float, hi_ref: float) -> float:
    """Smallest H with Σ_{A>0} w·1[r ≤ H] ≥ target (monotone in H: sort + cumulative sum)."""
    order = r_pos.argsort()
    r_sorted, cum = r_pos[order], w_pos[order].cumsum(0)
    if target > float(cum[-1]):  # unreachable: any H ≥ max r is optimal; stay near the reference
        return max(float(r_sorted[-1]), hi_ref)
    return float(r_sorted[torch.searchsorted(cum, cum.new_tensor([target]))])


def update_mass(r: Tensor, adv: Tensor, balance: str) -> Tensor:
    """Per-token effective update on ∇log π: |A|·r (magnitude) or 1 (count)."""
    return adv.abs() * r if balance == "magnitude" else torch.ones_like(r)


PAPER_EVERY = 20  # K (App. A.5: 10, 20, 40 all beat vanilla FP8; 20 is the default)


def calibration_every(steps: int, every: int | None = None) -> int:
    """K: `every`, or for None the paper's 20 capped so a `steps`-step run gets ≥ 10."""
    return every if every is not None else max(1, min(PAPER_EVERY, steps // 10))


class CalibratedClip(PolicyObjective):
    """PPO clip with stateful [L, H]; `self.policy` keeps the reference window [1−ε_l, 1+ε_h]."""

    def __init__(
        self,
        policy: Term,
        low: float,
        high: float,
        ema: float,
        balance: str,
        every: int | None,
        **kw: Any,
    ) -> None:
        choice("balance", balance, ("magnitude", "count"))
        super().__init__(policy, **kw)
        self.low, self.high, self.ema, self.balance = low, high, ema, balance
        self.every = every

    def bounds(self, batch: TokenBatch) -> tuple[float, float, float]:
        return 1.0, self.low, self.high

    def calibration_due(self, step: int, steps: int) -> bool:
        return (step - 1) % calibration_every(steps, self.every) == 0

    def check(self, steps: int) -> None:
        """≥ 3 calibrations in the run (a warning below the ≥ 10 the default cadence gives: with
        EMA 0.9, 3 move [L, H] 27% of the way to its target). Steps 1, 1 + K, … calibrate."""
        default = calibration_every(steps)
        n = self.calibrations(steps)
        if n < min(3, steps):  # a run shorter than 3 steps calibrates every step at best
            raise ValueError(
                f"objective.every={self.every!r} gives {n} calibration(s) in steps={steps}; "
                f"valid: every ≤ {max(1, (steps - 1) // 2)} (≥ 3 calibrations), or null (every "
                f"{default} here: {len(range(1, steps + 1, default))} calibrations)"
            )
        if n < min(10, steps):
            print(
                f"[train] warning: objective.every={self.every} gives {n} calibrations in "
                f"steps={steps}; with EMA {self.ema} the window moves {1 - self.ema**n:.0%} of "
                "the way to its target",
                file=sys.stderr,
                flush=True,
            )

    def window(self) -> Window:
        """The clip acts on the current [L, H], not on the reference window `self.policy` keeps."""
        return Window(self.band, (self.low, self.high))

    def __call__(self, logp: Tensor, batch: TokenBatch) -> ObjectiveOutput:
        out = super().__call__(logp, batch)
        out.metrics.update({"clip/bound_low": self.low, "clip/bound_high": self.high})
        return out

    @torch.no_grad()
    def calibrate(
        self,
        logp_hp: Tensor,
        logp_old_hp: Tensor,
        logp_lp: Tensor,
        logp_old_lp: Tensor,
        advantages: Tensor,
        mask: Tensor,
    ) -> dict[str, float]:
        """One calibration from a shadow pass; EMA-moves [L, H] toward [L*, H*]."""
        m = mask > 0
        r_hp = (logp_hp - logp_old_hp)[m].double().clamp(-SAFETY, SAFETY).exp()
        r_lp = (logp_lp - logp_old_lp)[m].double().clamp(-SAFETY, SAFETY).exp()
        a = advantages[m].double()
        neg, pos = a < 0, a > 0
        if not (neg.any() and pos.any()):
            return {"calib/updated": 0.0, "calib/low": self.low, "calib/high": self.high}
        lo_ref, hi_ref = self.policy.lo, self.policy.hi
        alpha, low_t = matched_low(r_hp[neg], r_lp[neg], lo_ref)
        w_hp, w_lp = update_mass(r_hp, a, self.balance), update_mass(r_lp, a, self.balance)
        g_neg_hp = float(w_hp[neg & (r_hp >= lo_ref)].sum())
        g_pos_hp = float(w_hp[pos & (r_hp <= hi_ref)].sum())
        rho, high_t = math.inf, self.high  # no surviving negative mass: leave H alone
        if g_neg_hp > 0:
            rho = g_pos_hp / g_neg_hp
            target = rho * float(w_lp[neg & (r_lp >= low_t)].sum())
            high_t = balanced_high(r_lp[pos], w_lp[pos], target, hi_ref)
        self.low = self.ema * self.low + (1 - self.ema) * low_t
        self.high = self.ema * self.high + (1 - self.ema) * high_t
        return {
            "calib/updated": 1.0,
            "calib/alpha_low": alpha,
            # how much of the reference window each precision's ratio fills: the shares the
            # sign-conditioned clip [1−ε_l, 1+ε_h] would delete (A < 0 below, A > 0 above)
            "calib/lp_low_share": float((r_lp[neg] < lo_ref).double().mean()),
            "calib/hp_high_share": float((r_hp[pos] > hi_ref).double().mean()),
            "calib/lp_high_share": float((r_lp[pos] > hi_ref).double().mean()),
            "calib/rho_target": rho,
            "calib/low_target": low_t,
            "calib/high_target": high_t,
            "calib/low": self.low,
            "calib/high": self.high,
        }

    def state_dict(self) -> dict[str, Any]:
        return {"low": self.low, "high": self.high}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.low, self.high = float(state["low"]), float(state["high"])


def calibrated_clip(
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    init_low: float | None = 0.6,
    init_high: float | None = 1.8,
    ema: float = 0.9,
    balance: str = "magnitude",
    every: int | None = None,
    cap: float | None = 2.0,
    aggregation: str = "token-mean",
    rejected_in_denominator: bool = True,
    norm_len: int | None = None,
) -> CalibratedClip:
    """Calibrated Clipping: [L, H] from a shadow pass every K steps, from the paper's [0.6, 1.8].

    eps_low/eps_high: the high-precision reference window 1∓ε whose clip shares are matched.
    init_low/init_high None: start at that window. every None: `calibration_every(steps)`.
    cap: token TIS min(π_old/μ, cap), on in every run of the paper (C = 2); None: off.
    """
    policy = clip_term("ppo_clip", eps_low, eps_high)
    return CalibratedClip(
        policy,
        policy.lo if init_low is None else init_low,
        policy.hi if init_high is None else init_high,
        ema,
        balance,
        every,
        corrections=() if cap is None else (RatioCorrection("ti", "token", "clamp", 0.0, cap),),
        aggregation=aggregation,
        rejected_in_denominator=rejected_in_denominator,
        norm_len=norm_len,
    )
