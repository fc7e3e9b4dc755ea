"""NSR: Near-boundary Stochastic Rescue (arXiv 2605.22703) over ppo_clip or gspo.

Formulation DERIVED: the mechanism is the paper's as secondary readings of its full text give it
(multiply the ratio by uniform noise; keep the token if it falls back inside the window, else keep
it clipped; expected gradient decay ≈ O(1/r²)); the noise law and hyperparameters are not public.
On the clipped set C = {A > 0, r > hi} ∪ {A < 0, r < lo} let x = hi/r (upper) or r/lo (lower),
the distance factor in (0, 1). Draw u ~ U(1−σ, 1] and rescue iff u ≤ x (u·r ≤ hi, or
r/u ≥ lo): P = clip((x − (1−σ))/σ, 0, 1), = (1+ε_h)/r and r/(1−ε_l) for σ = 1. A rescued token
takes the unclipped loss −A·sg(w)·r with w = 1 (`unclipped`) or w = u (`perturbed`; on the lower
side u is the log-mirror of the upper u·r, because the literal r/u has infinite mean for σ = 1);
E[u·1{u ≤ x}] = (x² − (1−σ)²)₊/2σ. Modes: `stochastic`; `deterministic` uses the expected weight
(same mean gradient, no draws); `push` is the negative control: in-bound tokens of the
gradient-carrying side are clipped iff u < x' with x' = r/hi (A > 0) or lo/r (A < 0) (use σ < 1 so
only near-edge tokens move). Draws come from a seeded CPU generator (same decisions on any device;
its state is checkpointed); gspo draws once per sequence.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from harness.base.batch import TokenBatch
from harness.objectives.core import (
    PolicyObjective,
    Step,
    Term,
    at_level,
    choice,
    clip_flags,
    log_ratio,
    ppo_clip_loss,
)
from harness.objectives.methods import clip_term


def rescue_prob(x: Tensor, sigma: float) -> Tensor:
    """P(u ≤ x), u ~ U(1−σ, 1]: clip((x − (1−σ))/σ, 0, 1)."""
    return ((x - (1 - sigma)) / sigma).clamp(0.0, 1.0)


def perturbed_weight(x: Tensor, sigma: float) -> Tensor:
    """E[u·1{u ≤ x}] = (min(x, 1)² − (1−σ)²)₊ / 2σ; = x²/2 = c²/2r² on the upper side for σ = 1."""
    return ((x.clamp(max=1.0) ** 2 - (1 - sigma) ** 2) / (2 * sigma)).clamp_min(0.0)


def nsr_loss(
    ratio: Tensor,
    adv: Tensor,
    lo: float,
    hi: float,
    u: Tensor | None,
    mode: str,
    rescued_weight: str,
    sigma: float,
) -> tuple[Tensor, Tensor]:
    """Per-token NSR loss and the flipped clip decisions (expected in deterministic mode)."""
    loss = ppo_clip_loss(ratio, adv, lo, hi)
    r = ratio.detach()
    down, up = clip_flags(r, adv, lo, hi)
    if mode == "push":
        inside = ((adv > 0) & ~up) | ((adv < 0) & ~down)
        pushed = inside & (u < torch.where(adv > 0, r / hi, lo / r))
        return torch.where(pushed, loss.detach(), loss), pushed.to(r)
    clipped = up | down
    x = torch.where(up, hi / r, r / lo)
    if mode == "deterministic":
        flip = torch.where(clipped, rescue_prob(x, sigma), 0.0)
        w = flip if rescued_weight == "unclipped" else perturbed_weight(x, sigma)
        chosen = clipped
    else:
        chosen = clipped & (u <= x)
        flip = chosen.to(r)
        w = torch.ones_like(r) if rescued_weight == "unclipped" else u.expand_as(r)
    return torch.where(chosen, -adv * w * ratio, loss), flip


class NSR(PolicyObjective):
    """NSR over the sign-conditioned clip; the generator state is the objective's state."""

    def __init__(
        self, policy: Term, mode: str, rescued_weight: str, sigma: float, seed: int, **agg: Any
    ) -> None:
        choice("mode", mode, ("stochastic", "deterministic", "push"))
        choice("rescued_weight", rescued_weight, ("unclipped", "perturbed"))
        if not 0.0 < sigma <= 1.0:
            raise ValueError(f"sigma={sigma}; need 0 < sigma <= 1")
        super().__init__(policy, **agg)
        self.mode, self.rescued_weight, self.sigma = mode, rescued_weight, sigma
        # on the CPU whatever the device: the same rescue draws on CPU and CUDA ([B, T] per
        # step, cheap to move), and a CPU generator state resumes anywhere
        self.generator = torch.Generator().manual_seed(seed)

    def step(self, logp: Tensor, batch: TokenBatch) -> Step:
        term, adv = self.policy, batch.advantages
        r = at_level(log_ratio(logp, batch, "trust"), batch.mask, term.level).exp()
        u = None
        if self.mode != "deterministic":
            shape = r.shape if term.level == "token" else (r.shape[0], 1)
            u = 1 - self.sigma * torch.rand(shape, generator=self.generator).to(r)
        loss, flip = nsr_loss(
            r, adv, term.lo, term.hi, u, self.mode, self.rescued_weight, self.sigma
        )
        low, high = clip_flags(r.detach(), adv, term.lo, term.hi)
        ones = torch.ones_like(r)
        return Step(loss, ones, ones, low, high, flip)

    def state_dict(self) -> dict[str, Any]:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.set_state(state["generator"])


def nsr(
    *,
    base: str = "ppo_clip",
    mode: str = "stochastic",
    rescued_weight: str = "unclipped",
    sigma: float = 1.0,
    seed: int = 0,
    eps_low: float | None = None,
    eps_high: float | None = None,
    aggregation: str = "token-mean",
    rejected_in_denominator: bool = True,
    norm_len: int | None = None,
) -> NSR:
    """NSR (2605.22703): stochastically rescue clipped tokens near the boundary (σ = 1 default)."""
    return NSR(
        clip_term(base, eps_low, eps_high),
        mode,
        rescued_weight,
        sigma,
        seed,
        aggregation=aggregation,
        rejected_in_denominator=rejected_in_denominator,
        norm_len=norm_len,
    )
