"""Every ratiolab objective as a verl policy loss `ratiolab_<name>` (verl 0.9.1).

verl selects a policy loss by name (`actor_rollout_ref.actor.policy_loss.loss_mode`) from the
registry of `register_policy_loss` in verl/trainer/ppo/core_algos.py and calls it as
(verl/workers/utils/losses.py, `ppo_loss`)

    fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
       rollout_is_weights) -> (loss, metrics)

Importing this module (verl does, in every worker, through the `verl.plugins` entry point of an
installed ratiolab) registers `ratiolab_<name>` for each objective of harness.objectives at its
default kwargs; `register(name, objective, **kwargs)` adds one with other kwargs. The mapping:

  log_prob            → logp      π_θ (with grad)
  old_log_prob        → logp_old  π_old
  rollout_is_weights  → logp_mu   log μ = log π_old − log w, since verl's token weight is
                                  w = π_old/μ (rollout_corr_helper.compute_rollout_is_weights).
                                  Exact when verl hands it untruncated: rollout_is=token, a
                                  rollout_is_threshold no weight reaches, no batch normalisation.
                                  None (no correction, or bypass mode, where old_log_prob *is* the
                                  rollout's): μ = π_old, as verl's own losses assume.
  loss_agg_mode       → aggregation (ratiolab registers verl's five modes under verl's names);
                        config.global_batch_info rescales the aggregate of this micro-batch on
                        this rank onto verl's global normaliser (core_algos.agg_loss).

ratiolab's objective is the correction: it does not also multiply by verl's weights (verl's
vanilla loss does). verl's clip_ratio_* are not read: bounds are the objective's kwargs.
Objectives that need more than these tensors are not mappable (UNMAPPABLE, with the reason);
objectives fed by extra passes in ratiolab's loop (calibrated_clip's shadow pass, snr_shrink's
adaptive refresh) run at their static defaults here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from verl.trainer.ppo.core_algos import register_policy_loss

from harness.base.batch import TokenBatch
from harness.base.registry import check_kwargs
from harness.objectives import OBJECTIVES, Objective
from harness.objectives.core import n_sequences

PREFIX = "ratiolab_"
UNMAPPABLE = {
    "opsd_fkl": "it needs the student's and the teacher's logits over the vocabulary; a verl "
    "policy loss receives log-probs of the sampled tokens only",
    "stapo": "it needs the trainer's per-token entropy, which verl computes but does not pass "
    "to a policy loss",
}
MAPPABLE = tuple(n for n in OBJECTIVES if n not in UNMAPPABLE)


def logp_mu_of(logp_old: Tensor, rollout_is_weights: Tensor | None, mask: Tensor) -> Tensor:
    """log μ = log π_old − log w on response tokens, w = π_old/μ verl's token IS weight;
    π_old where verl passes no weights (μ = π_old) and on padding."""
    if rollout_is_weights is None:
        return logp_old
    w = rollout_is_weights.detach()
    if ((mask > 0) & ~(w > 0)).any():
        raise ValueError(
            "ratiolab policy loss: a response token has rollout_is_weights <= 0, so log μ "
            "cannot be recovered from it (IcePop or rejection zeroed it); set "
            "algorithm.rollout_correction.rollout_is=token with a rollout_is_threshold no "
            "weight reaches and no lower bound"
        )
    return torch.where(mask > 0, logp_old - w.clamp_min(1e-30).log(), logp_old)


def global_scale(mask: Tensor, loss_agg_mode: str, info: dict) -> Tensor | float:
    """The factor from ratiolab's aggregate of what this call sees (one micro-batch on one rank)
    to verl's agg_loss: local normaliser / global one, times dp_size (data-parallel gradient
    averaging divides by it again). 1 for one rank without global counts."""
    dp = info.get("dp_size") or 1
    if loss_agg_mode == "token-sum":
        return dp
    if loss_agg_mode == "token-mean":
        total, local = info.get("batch_num_tokens"), mask.sum().clamp_min(1.0)
    else:  # seq-mean-*: the number of sequences with a response token
        total, local = info.get("global_batch_size"), n_sequences(mask)
    return dp if total is None else dp * local / total


def policy_loss(objective: str, **kwargs: Any) -> Callable[..., tuple[Tensor, dict]]:
    """The verl policy loss of ratiolab's `objective` at `kwargs` (checked here, before any
    compute: an unknown or unmappable objective is a ValueError naming the mappable ones, an
    unknown kwarg a TypeError naming the valid ones)."""
    if objective not in MAPPABLE:
        why = UNMAPPABLE.get(objective, "ratiolab has no objective of that name")
        raise ValueError(
            f"objective={objective!r} cannot be a verl policy loss: {why}; "
            f"valid: {', '.join(MAPPABLE)}"
        )
    check_kwargs(OBJECTIVES[objective], kwargs, f"objective {objective!r}")
    if {"aggregation", "norm_len"} & set(kwargs):
        raise ValueError(
            f"objective {objective!r}: aggregation and norm_len come from verl "
            "(actor.loss_agg_mode, actor.loss_scale_factor), not from kwargs"
        )
    # one objective per (aggregation, norm_len): a stateful one keeps its state across calls
    built: dict[tuple[str, int | None], Objective] = {}

    def loss_fn(
        old_log_prob: Tensor,
        log_prob: Tensor,
        advantages: Tensor,
        response_mask: Tensor,
        loss_agg_mode: str = "token-mean",
        config: Any = None,
        rollout_is_weights: Tensor | None = None,
    ) -> tuple[Tensor, dict[str, Any]]:
        info = dict(getattr(config, "global_batch_info", None) or {})
        norm = info.get("loss_scale_factor") if loss_agg_mode == "seq-mean-token-sum-norm" else None
        if (loss_agg_mode, norm) not in built:
            extra = {} if norm is None else {"norm_len": norm}
            built[loss_agg_mode, norm] = OBJECTIVES[objective](
                **kwargs, aggregation=loss_agg_mode, **extra
            )
        obj = built[loss_agg_mode, norm]
        mask = response_mask.to(log_prob.dtype)
        logp_old = old_log_prob.detach()
        batch = TokenBatch(
            tokens=torch.zeros_like(response_mask, dtype=torch.long),
            mask=mask,
            logp_old=logp_old,
            logp_mu=logp_mu_of(logp_old, rollout_is_weights, mask),
            advantages=advantages,
        )
        out = obj(log_prob, batch)
        loss = out.loss * global_scale(mask, loss_agg_mode, info)
        return loss, {f"actor/ratiolab/{k}": v for k, v in out.metrics.items()}

    return loss_fn


def register(name: str, objective: str, **kwargs: Any) -> None:
    """Register ratiolab's `objective` at `kwargs` as verl's policy loss `name` (from a module
    verl imports: VERL_USE_EXTERNAL_MODULES=my_losses)."""
    register_policy_loss(name)(policy_loss(objective, **kwargs))


for _name in MAPPABLE:
    register(PREFIX + _name, _name)
