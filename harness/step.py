"""One GRPO step, written once, around the three policies.

    batch, ro = collect(sampler, old_policy, prompts, reward, sampling, seed=..)   # μ, r, A, π_old
    batch, metrics, skipped = update(policy, objective, batch, ro, schedule, opt, grad_clip)

`sampler` (μ), `old_policy` (π_old: the trainer's weights at the behaviour version) and `policy`
(π_θ) are Engines, each with its own weights. At staleness 0 π_old *is* the policy before the
update, so the loop passes the policy itself; with one minibatch it may pass `old_policy=None`:
the update's only pass is then at θ = θ_old and doubles as π_old (π_old := sg(π_θ), as TRL does;
one forward fewer). `harness.train.run`, `harness.measure` and `benchmarks/bench_step.py` all
call these; `update_distill` is the self-distillation (OPSD) update.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from harness.batch import TokenBatch
from harness.engines import Engine
from harness.rollout import Rollout

ADVANTAGES = ("grpo", "drgrpo")


@dataclass(frozen=True)
class Sampling:
    """What μ samples: n responses per prompt under temperature / top-k / top-p."""

    n: int
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0


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


def collect(
    sampler: Engine,
    old_policy: Engine | None,
    prompts: Sequence,
    reward: Callable[[Rollout], Tensor],
    sampling: Sampling,
    *,
    seed: int,
    advantage: str = "grpo",
    logp_old_source: str = "trainer",
    mask_replay: bool = True,
    progress: bool = False,
) -> tuple[TokenBatch, Rollout, Tensor]:
    """μ samples `sampling.n` responses per prompt; `reward(ro)` → [B] rewards; group
    advantages; π_old scored by `old_policy` (with the sampler's support and routes for these
    rows). Returns (batch, rollout, rewards); `batch.logp_old` is None when `old_policy` is."""
    ro = sampler.generate(
        list(prompts),
        n=sampling.n,
        max_new_tokens=sampling.max_new_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        seed=seed,
        progress=progress,
    )
    rewards = reward(ro).to(ro.logp_mu.device)  # tasks score on the CPU; the batch lives on μ's
    adv = group_advantages(rewards, ro.prompt_index, advantage)
    batch = TokenBatch(
        tokens=ro.response_ids,
        mask=ro.response_mask,
        logp_old=None,
        logp_mu=ro.logp_mu,
        advantages=adv[:, None].expand_as(ro.logp_mu) * ro.response_mask,
    )
    if old_policy is not None:
        batch = batch.with_old(old_policy.logp(ro, mask_replay=mask_replay), logp_old_source)
    return batch, ro, rewards


class MasterAdamW:
    """AdamW for a bf16/fp16 trainer as FSDP's mixed precision runs it: the model computes (and
    its gradients arrive) in its own dtype, the optimizer updates an fp32 master copy of every
    parameter, and the model gets the master rounded back after each step. Updating the bf16
    weights themselves would round away every update below half a bf16 ulp of its weight (lr
    1e-6 on weights of 1e-2: all of them; tests/test_train.py). Same interface as the optimizer
    the loop uses (zero_grad, step, param_groups, state_dict); `pull()` re-seeds the master from
    the model (after a roll-back to earlier weights)."""

    def __init__(self, model: torch.nn.Module, **kw: Any):
        self.params = list(model.parameters())  # all of them, as AdamW(model.parameters())
        self.master = [p.detach().float().clone().requires_grad_() for p in self.params]
        self.inner = torch.optim.AdamW(self.master, **kw)

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None
        self.inner.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(self) -> None:
        for m, p in zip(self.master, self.params):
            m.grad = None if p.grad is None else p.grad.float()
        self.inner.step()
        for m, p in zip(self.master, self.params):
            p.copy_(m)

    @torch.no_grad()
    def pull(self) -> None:
        for m, p in zip(self.master, self.params):
            m.copy_(p)

    def state_dict(self) -> dict:
        return {"adamw": self.inner.state_dict(), "master": [m.detach() for m in self.master]}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state["adamw"])
        for m, saved in zip(self.master, state["master"]):
            m.copy_(saved)


def adamw(model: torch.nn.Module, **kw: Any):
    """The trainer's optimizer: AdamW on the parameters of an fp32 model, `MasterAdamW` (fp32
    master weights) on a bf16/fp16 one. Fused (one kernel over all parameters: ~4× faster step
    on smollm2, CPU bench) unless `fused=False` is passed."""
    kw.setdefault("fused", True)
    if next(model.parameters()).dtype == torch.float32:
        return torch.optim.AdamW(model.parameters(), **kw)
    return MasterAdamW(model, **kw)


def optimizer_step(
    model: torch.nn.Module, loss: Tensor, opt, grad_clip: float, restore=None
) -> float | None:
    """backward, clip, step; None (and no step) when the loss or the gradient is non-finite, or
    when the step made a weight non-finite: then `restore()` puts the previous weights back
    (the optimizer's moments keep this step's finite gradient)."""
    opt.zero_grad(set_to_none=True)
    if not torch.isfinite(loss):
        return None
    loss.backward()
    gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    if not torch.isfinite(gnorm):
        opt.zero_grad(set_to_none=True)
        return None
    opt.step()
    if restore is not None and not bool(  # one host sync for all parameters
        torch.stack([torch.isfinite(p).all() for p in model.parameters()]).all()
    ):
        restore()
        return None
    return float(gnorm)


def step_and_log(model, res, lag: int, opt, grad_clip: float, restore, on_step) -> dict | None:
    """One optimizer step on `res.loss` (an ObjectiveOutput); its metrics, or None if skipped."""
    gnorm = optimizer_step(model, res.loss, opt, grad_clip, restore)
    if gnorm is None:
        return None
    if on_step is not None:
        on_step()
    return {
        **res.metrics, "loss": float(res.loss.detach()), "grad/norm": gnorm, "alpha/lag": float(lag)
    }  # fmt: skip


def trust_log_ratio(logp: Tensor, logp_old: Tensor, mask: Tensor) -> float:
    """Mean |log π_θ − log π_old| over response tokens: the policy movement the trust region (the
    PPO clip) sees at this minibatch's update; α alone when π_old is the trainer's recompute,
    α + β when π_old := μ."""
    return float(((logp - logp_old).abs() * mask).sum() / mask.sum().clamp_min(1.0))


def update(
    policy: Engine,
    objective,
    batch: TokenBatch,
    ro: Rollout,
    schedule: Sequence[tuple[Tensor, int]],
    opt,
    grad_clip: float,
    *,
    mask_replay: bool = True,
    logp_old_source: str = "trainer",
    calibrate: bool = False,
    on_step: Callable[[], None] | None = None,
    restore: Callable[[], None] | None = None,
    shadow: Callable[[Tensor], tuple[Tensor, Tensor]] | None = None,
) -> tuple[TokenBatch, list[dict[str, float]], int]:
    """One optimizer step per (rows, lag) minibatch of `schedule`, in order. `batch.logp_old`
    None: the first pass's detached π_θ is the trainer's score at the behaviour weights (one
    minibatch only), and π_old is it or, with `logp_old_source="sampler"`, μ (as `collect` does
    for a separate recompute). `calibrate`: the first
    minibatch feeds the objective's calibration first (calibrated clipping: the trainer
    recompute `logp_recompute` is its high-precision π_old, `logp_old` the low-precision one;
    with a low-precision trainer, `shadow(rows)` gives the high-precision (π_θ, π_old) instead).
    `on_step()` runs after each optimizer step (the loop's weight history); `restore()` after a
    step that made a weight non-finite (see `optimizer_step`). Returns (the batch with π_old,
    per-minibatch metrics, number of minibatches skipped as non-finite)."""
    if batch.logp_old is None and len(schedule) != 1:
        raise ValueError("π_old from the training pass needs exactly one minibatch")
    metrics: list[dict[str, float]] = []
    skipped = 0
    policy.model.train()
    for i, (rows, lag) in enumerate(schedule):
        rows = rows.to(policy.device)
        out = policy.logp(
            ro, rows, grad=True, stats=batch.logp_old is None, mask_replay=mask_replay
        )
        if batch.logp_old is None:  # the pass is in `rows` order (a permutation of all rows)
            order = torch.empty_like(rows)
            order[rows] = torch.arange(len(rows), device=rows.device)
            batch = batch.with_old({k: v[order] for k, v in out.items()}, logp_old_source)
        logp, mb = out["logp"], batch.index(rows)
        if calibrate and i == 0:
            hp, old_hp = shadow(rows) if shadow else (logp.detach(), mb.logp_recompute)
            metrics.append(
                objective.calibrate(hp, old_hp, logp.detach(), mb.logp_old, mb.advantages, mb.mask)
            )
        trust = trust_log_ratio(logp.detach(), mb.logp_old, mb.mask)
        m = step_and_log(policy.model, objective(logp, mb), lag, opt, grad_clip, restore, on_step)
        skipped += m is None
        metrics += [m | {"trust/mean_abs_log_ratio": trust}] if m is not None else []
    policy.model.eval()
    return batch, metrics, skipped


def student_teacher_logits(
    student: Engine, teacher: torch.nn.Module, ro: Rollout, rows, teacher_ids, teacher_mask
) -> tuple[Tensor, Tensor]:
    """Full logits at the response positions: the student's (with grad) and the frozen teacher's
    conditioned on its privileged prompt (same response tokens, longer prompt)."""
    T = ro.response_ids.shape[1]
    s = student.model(input_ids=ro.tokens[rows], attention_mask=ro.attention_mask[rows]).logits
    t_ids = torch.cat([teacher_ids, ro.response_ids[rows]], 1)
    t_mask = torch.cat([teacher_mask, ro.response_mask[rows].long()], 1)
    with torch.no_grad():
        t = teacher(input_ids=t_ids, attention_mask=t_mask).logits
    return s[:, -T - 1 : -1], t[:, -T - 1 : -1]


def update_distill(
    student: Engine,
    teacher: torch.nn.Module,
    objective,
    batch: TokenBatch,
    ro: Rollout,
    schedule: Sequence[tuple[Tensor, int]],
    opt,
    grad_clip: float,
    teacher_ids: Tensor,
    teacher_mask: Tensor,
    extra_metrics: Callable[[Tensor, Tensor, Tensor], dict[str, Any]] | None = None,
    on_step: Callable[[], None] | None = None,
    restore: Callable[[], None] | None = None,
) -> tuple[list[dict[str, float]], int]:
    """OPSD: the student minimises `objective(student_logits, teacher_logits, mask)` on its own
    samples, one optimizer step per minibatch; `extra_metrics(s_logits, t_logits, rows)` adds
    per-minibatch metrics (the loop's exit mass at first-copy positions)."""
    metrics: list[dict[str, float]] = []
    skipped = 0
    student.model.train()
    for rows, lag in schedule:
        rows = rows.to(student.device)
        s, t = student_teacher_logits(
            student, teacher, ro, rows, teacher_ids[rows], teacher_mask[rows]
        )
        res = objective(s, t, batch.mask[rows])
        if extra_metrics is not None:
            res.metrics.update(extra_metrics(s, t, rows))
        m = step_and_log(student.model, res, lag, opt, grad_clip, restore, on_step)
        skipped += m is None
        metrics += [m] if m is not None else []
    student.model.eval()
    return metrics, skipped
