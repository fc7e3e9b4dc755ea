"""Per-token bookkeeping shared by every module: the three policies and the four ratios.

Names follow the math (SNR post, Table 1; notes/methods.md §2.4):
  logp      log π_θ(y_t)      trainer at the current weights (carries grad during training)
  logp_old  log π_old(y_t)    trainer recompute at the behaviour weights
  logp_mu   log μ(y_t)        the sampler (inference engine), as recorded at sampling time

All tensors of a `TokenBatch` are [B, T] over *response* tokens (right-padded), except the
per-sequence ids, which are [B]. `mask` is 1.0 on real response tokens, 0.0 on padding.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class TokenBatch:
    """Response tokens of B sequences and everything the objectives and diagnostics read."""

    tokens: Tensor  # [B, T] sampled token ids
    mask: Tensor  # [B, T] float, 1 on response tokens
    logp_old: Tensor  # [B, T] trainer at behaviour weights
    logp_mu: Tensor  # [B, T] sampler, distribution actually sampled from
    advantages: Tensor  # [B, T] (per-sequence advantage broadcast over tokens)
    p_t: Tensor | None = None  # [B, T] trainer probability of the sampled token (= exp(logp_old))
    entropy: Tensor | None = None  # [B, T] trainer entropy of the full next-token distribution
    p_sq_sum: Tensor | None = None  # [B, T] Σ_j p_j², the collision term that gates logit noise
    group_id: Tensor | None = None  # [B] prompt group (GRPO)
    seq_id: Tensor | None = None  # [B] sequence id (stable across minibatches)

    def __post_init__(self) -> None:
        shape = self.tokens.shape
        if self.tokens.dim() != 2:
            raise ValueError(f"TokenBatch.tokens must be [B, T], got shape {tuple(shape)}")
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v is None or f.name in ("group_id", "seq_id"):
                continue
            if v.shape != shape:
                raise ValueError(
                    f"TokenBatch.{f.name} has shape {tuple(v.shape)}, expected {tuple(shape)} "
                    "like `tokens`"
                )
        for name in ("group_id", "seq_id"):
            v = getattr(self, name)
            if v is not None and v.shape != shape[:1]:
                raise ValueError(f"TokenBatch.{name} must be [B]={shape[0]}, got {tuple(v.shape)}")

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

    def to(self, device: torch.device | str) -> TokenBatch:
        return TokenBatch(
            **{
                f.name: (
                    None if getattr(self, f.name) is None else getattr(self, f.name).to(device)
                )
                for f in dataclasses.fields(self)
            }
        )


# --- the four ratios of Table 1, in log space ------------------------------------------------


def log_ratio_trust_region(logp: Tensor, logp_old: Tensor) -> Tensor:
    """Row 1: log π_θ/π_old (trainer vs trainer): α since minibatch 1 + β′; 0 at minibatch 1."""
    return logp - logp_old


def log_ratio_staleness(logp_prox: Tensor, logp_behav: Tensor) -> Tensor:
    """Row 2: log π_prox/π_behav, trainer-side at two weight versions: α(staleness) + β′."""
    return logp_prox - logp_behav


def log_ratio_train_inference(logp_old: Tensor, logp_mu: Tensor) -> Tensor:
    """Row 3: log π_old/μ at the same weights, trainer vs sampler. Pure β."""
    return logp_old - logp_mu


def log_ratio_folded(logp: Tensor, logp_mu: Tensor) -> Tensor:
    """Row 4: log π_θ/μ_behav. α (all sources) + β, not decomposed."""
    return logp - logp_mu


# --- identity check ---------------------------------------------------------------------------


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
    r = torch.exp((logp_old - logp_mu)[m].double())
    n = int(r.numel())
    if n == 0:
        raise ValueError("identity_check: the mask selects no tokens")
    mean = float(r.mean())
    if tol is None:
        se = float(r.std()) / math.sqrt(n) if n > 1 else 0.0
        tol = 1e-3 + 4.0 * se
    return IdentityCheck(mean_ratio=mean, n_tokens=n, tol=tol)


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    return (x * mask).sum() / mask.sum().clamp_min(1.0)
