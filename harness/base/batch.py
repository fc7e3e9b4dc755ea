"""Per-token bookkeeping shared by every module: the three policies and the four ratios.

Names follow the math (SNR post, Table 1):
  logp      log π_θ(y_t)      trainer at the current weights (carries grad during training)
  logp_old  log π_old(y_t)    trainer recompute at the behaviour weights
  logp_mu   log μ(y_t)        the sampler (inference engine), as recorded at sampling time

All tensors of a `TokenBatch` are [B, T] over *response* tokens (right-padded). `mask` is 1.0 on
real response tokens, 0.0 on padding. The dials on these ratios live in harness.stats.diagnostics.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor


def log_rho(logp_old: Tensor, logp_mu: Tensor) -> Tensor:
    """log ρ = log π_old − log μ: the trainer at the behaviour weights against the sampler (SNR
    post, Table 1 row 3). At equal weights it is the engine mismatch β alone; the dials, the
    mechanism check and the SNR calibration all read it."""
    return logp_old - logp_mu


@dataclass
class TokenBatch:
    """Response tokens of B sequences and everything the objectives and diagnostics read."""

    tokens: Tensor  # [B, T] sampled token ids
    mask: Tensor  # [B, T] float, 1 on response tokens
    logp_old: Tensor | None  # [B, T] π_old the objective uses (None: not scored yet)
    logp_mu: Tensor  # [B, T] sampler, distribution actually sampled from
    advantages: Tensor  # [B, T] (per-sequence advantage broadcast over tokens)
    p_t: Tensor | None = None  # [B, T] trainer probability of the sampled token (= exp(logp_old))
    entropy: Tensor | None = None  # [B, T] trainer entropy of the full next-token distribution
    p_sq_sum: Tensor | None = None  # [B, T] Σ_j p_j², the collision term that gates logit noise
    # [B, T] the trainer at the behaviour weights; = logp_old unless logp_old := logp_mu
    # (engine.logp_old_source=sampler), when it is the high-precision π_old of calibrated clipping
    logp_recompute: Tensor | None = None
    # [B, T] long: where a token sits (harness.stats.repetition.PLACES: EOS, a loop's first copy)
    place: Tensor | None = None

    def __post_init__(self) -> None:
        shape = self.tokens.shape
        if self.tokens.dim() != 2:
            raise ValueError(f"TokenBatch.tokens must be [B, T], got shape {tuple(shape)}")
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v is not None and v.shape != shape:
                raise ValueError(
                    f"TokenBatch.{f.name} has shape {tuple(v.shape)}, expected {tuple(shape)} "
                    "like `tokens`"
                )

    @property
    def log_rho(self) -> Tensor:
        """log π_old − log μ with π_old the trainer's recompute at the behaviour weights."""
        return log_rho(self.logp_recompute, self.logp_mu)

    @property
    def n_tokens(self) -> int:
        return int(self.mask.sum().item())

    def index(self, rows: Tensor | slice) -> TokenBatch:
        """Select sequences (a minibatch), keeping every field aligned."""
        return TokenBatch(
            **{
                f.name: (None if getattr(self, f.name) is None else getattr(self, f.name)[rows])
                for f in dataclasses.fields(self)
            }
        )

    def with_old(self, scores: dict[str, Tensor], logp_old_source: str = "trainer") -> TokenBatch:
        """The batch with π_old filled in from the trainer's scores at the behaviour weights
        (`logp`, `p_t`, `entropy`, `p_sq_sum`); `logp_old_source="sampler"`: π_old := μ (stacks
        that skip the recompute), the trainer's scores kept as `logp_recompute` and the stats."""
        logp = scores["logp"].detach()
        return dataclasses.replace(
            self,
            logp_old=logp if logp_old_source == "trainer" else self.logp_mu,
            logp_recompute=logp,
            p_t=scores["p_t"].detach(),
            entropy=scores["entropy"].detach(),
            p_sq_sum=scores["p_sq_sum"].detach(),
        )

    def to(self, device: torch.device | str) -> TokenBatch:
        return TokenBatch(
            **{
                f.name: (
                    None if getattr(self, f.name) is None else getattr(self, f.name).to(device)
                )
                for f in dataclasses.fields(self)
            }
        )


# --- the other ratios of Table 1, in log space (row 3, π_old/μ, is `log_rho` above) ---------


def log_ratio_trust_region(logp: Tensor, logp_old: Tensor) -> Tensor:
    """Row 1: log π_θ/π_old (trainer vs trainer): α since minibatch 1 + β′; 0 at minibatch 1."""
    return logp - logp_old


def log_ratio_folded(logp: Tensor, logp_mu: Tensor) -> Tensor:
    """Row 4: log π_θ/μ_behav. α (all sources) + β, not decomposed."""
    return logp - logp_mu


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    return (x * mask).sum() / mask.sum().clamp_min(1.0)


ADVANTAGES = ("grpo", "drgrpo")


def group_advantages(rewards: Tensor, group: Tensor, kind: str = "grpo") -> Tensor:
    """GRPO: (r − mean_g) / (std_g + 1e-6); Dr.GRPO: r − mean_g (no std normalisation)."""
    if kind not in ADVANTAGES:
        raise ValueError(f"advantage={kind!r}; valid: {', '.join(map(repr, ADVANTAGES))}")
    adv = torch.empty_like(rewards)
    for g in group.unique():
        sel = group == g
        centred = rewards[sel] - rewards[sel].mean()
        std = rewards[sel].std(unbiased=False)
        adv[sel] = centred / (std + 1e-6) if kind == "grpo" else centred
    return adv
