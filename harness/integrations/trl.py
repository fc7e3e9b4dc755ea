"""ratiolab's objectives as TRL's GRPO loss (TRL 1.16: `GRPOTrainer._compute_loss`).

TRL's `loss_type` is a closed list; `RatiolabGRPOTrainer(..., objective="cis")` replaces the loss
with any ratiolab objective (harness.objectives) that needs no loop of its own, on TRL's tensors:

  logp        log π_θ(y_t)    TRL's per-token log-probs of this forward (with grad)
  logp_old    log π_old(y_t)  inputs["old_per_token_logps"]; TRL leaves it out when the batch is
                              on-policy (one optimizer step per generation): π_old = sg(π_θ)
  logp_mu     log μ(y_t)      inputs["sampling_per_token_logps"] (vLLM, or a `rollout_func`'s
                              `logprobs`); absent: μ = π_old (generate() samples from the
                              trainer); a NaN (vLLM without a logprob) reads π_old, ratio 1
  advantages  A               inputs["advantages"] [B], broadcast over the tokens
  mask                        completion_mask × tool_mask
  p_t = exp(logp_old); entropy = TRL's entropies of this forward (π_θ's: π_old's on a batch's
  first step), detached.

The loss is the objective's own aggregation over the micro-batch, divided by the gradient
accumulation steps (as TRL's `grpo` loss). It replaces TRL's loss whole: TRL's KL term (`beta`),
entropy mask, off-policy mask and vLLM importance weight are refused, not silently dropped (the
objective's own corrections act on μ). The objective's metrics are logged as `ratiolab/<name>`.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import torch
from torch import Tensor
from trl import GRPOTrainer

from harness.base.batch import TokenBatch
from harness.objectives import OBJECTIVES, Objective, build_objective

HORIZON = 10_000  # steps over which a loop hook is looked for when the run's length is not set


def loop_hooks(obj: Objective, steps: int = HORIZON) -> list[str]:
    """What `obj` asks of ratiolab's training loop that TRL's loop has no place for, in a run of
    `steps` optimizer steps."""
    needs = []
    if obj.inputs != "logp":
        needs.append(f"inputs={obj.inputs!r} (TRL's loss sees the sampled tokens' log-probs)")
    if obj.calibrations(steps):
        needs.append("a high-precision shadow pass (calibration_due)")
    if any(obj.refresh_due(s) for s in range(1, steps + 1)):
        needs.append("a calibration pass at the live weights (refresh_due)")
    return needs


@cache
def trl_objectives() -> tuple[str, ...]:
    """The objectives TRL can run with their default kwargs."""
    return tuple(sorted(n for n in OBJECTIVES if not loop_hooks(build_objective(n))))


def trl_objective(name: str, steps: int = HORIZON, **kwargs: Any) -> Objective:
    """build_objective(name, **kwargs) when TRL's loop can run it for `steps` steps; otherwise a
    ValueError naming what it needs and the valid names."""
    valid = ", ".join(trl_objectives())
    if name not in OBJECTIVES:
        raise ValueError(f"objective={name!r} is no ratiolab objective; valid in TRL: {valid}")
    obj = build_objective(name, **kwargs)
    if needs := loop_hooks(obj, steps):
        raise ValueError(
            f"objective={name!r}{f' with {kwargs}' if kwargs else ''} needs {'; '.join(needs)}, "
            f"which TRL's GRPOTrainer does not run; valid in TRL: {valid}"
        )
    return obj


def token_batch(inputs: dict[str, Tensor], logp: Tensor, entropy: Tensor | None) -> TokenBatch:
    """TRL's batch (`_generate_and_score_completions`' output) as ratiolab's TokenBatch; the
    mapping is the module docstring's."""
    mask = inputs["completion_mask"]
    if "tool_mask" in inputs:
        mask = mask * inputs["tool_mask"]
    logp_old = inputs.get("old_per_token_logps")
    logp_old = logp.detach() if logp_old is None else logp_old
    logp_mu = inputs.get("sampling_per_token_logps")
    logp_mu = logp_old if logp_mu is None else torch.where(logp_mu.isnan(), logp_old, logp_mu)
    adv = inputs["advantages"]
    return TokenBatch(
        tokens=inputs["completion_ids"],
        mask=mask.to(logp.dtype),
        logp_old=logp_old,
        logp_mu=logp_mu,
        advantages=(adv[:, None] if adv.dim() == 1 else adv).expand_as(logp).to(logp.dtype),
        p_t=logp_old.exp(),
        entropy=None if entropy is None else entropy.detach(),
        logp_recompute=logp_old,
    )


# TRL settings whose part of the loss the objective replaces: (name, the one valid value)
REPLACED = (
    ("beta", 0.0),
    ("top_entropy_quantile", 1.0),
    ("off_policy_mask_threshold", None),
    ("vllm_importance_sampling_correction", False),
)


def check_args(args: Any, objective: str) -> None:
    """Refuse a GRPOConfig that sets a part of TRL's loss the objective replaces."""
    for key, valid in REPLACED:
        if key == "vllm_importance_sampling_correction" and not args.use_vllm:
            continue
        if (value := getattr(args, key)) != valid:
            raise ValueError(
                f"GRPOConfig {key}={value!r}: the objective {objective!r} replaces TRL's loss "
                f"whole; valid with RatiolabGRPOTrainer: {valid!r}"
            )


class RatiolabGRPOTrainer(GRPOTrainer):
    """GRPOTrainer whose loss is ratiolab's `objective` (a name of harness.objectives, with
    `objective_kwargs`); every other argument is GRPOTrainer's. A bad name or a replaced TRL
    setting fails before any model is loaded."""

    def __init__(
        self,
        *args: Any,
        objective: str = "ppo_clip",
        objective_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ):
        trl_objective(objective, **(objective_kwargs or {}))
        grpo_args = kwargs.get("args", args[2] if len(args) > 2 else None)
        if grpo_args is not None:
            check_args(grpo_args, objective)
        super().__init__(*args, **kwargs)
        steps = self.args.max_steps if self.args.max_steps > 0 else HORIZON
        self.objective = trl_objective(objective, steps, **(objective_kwargs or {}))

    def _compute_loss(self, model, inputs):
        prompt_ids, completion_ids = inputs["prompt_ids"], inputs["completion_ids"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        logp, entropy, _ = self._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, completion_ids.size(1), compute_entropy=True
        )
        out = self.objective(logp, token_batch(inputs, logp, entropy))
        mode = "train" if self.model.training else "eval"
        for key, value in out.metrics.items():
            self._metrics[mode][f"ratiolab/{key}"].append(float(value))
        return out.loss / (self.current_gradient_accumulation_steps if mode == "train" else 1.0)
