"""One GRPO step, written once, around the three policies.

    batch, ro, rewards = collect(sampler, old_policy, prompts, reward, sampling, options, seed=..)
    batch, metrics, skipped = update(learner, objective, batch, ro, schedule, options)

`sampler` (μ), `old_policy` (π_old: the trainer's weights at the behaviour version) and
`learner.policy` (π_θ) are Engines, each with its own weights; `options` (`StepOptions`) holds
the step's settings, built once per run from its config (harness.rl.setup.step_options). At
staleness 0 π_old *is* the policy before the update, so the loop passes the policy itself; with
one minibatch it may pass `old_policy=None`: the update's only pass is then at θ = θ_old and
doubles as π_old (π_old := sg(π_θ), as TRL does; one forward fewer). `harness.train.run`,
`harness.measure` and `benchmarks/bench_step.py` all call these; `update_distill` is the
self-distillation (OPSD) update; `evaluate` the held-out accuracy the loop logs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

import torch
from torch import Tensor

from harness.base import distributed
from harness.base.batch import (
    TokenBatch,
    group_advantages,
    log_ratio_trust_region,
    masked_mean,
)
from harness.base.distributed import ONE, Ranks
from harness.noise.fp8 import ShadowPass
from harness.objectives.core import ObjectiveOutput
from harness.objectives.opsd import Teacher
from harness.sampling.engines import Engine, micro_batches
from harness.sampling.rollout import Rollout, Sampling
from harness.stats.repetition import token_places


@dataclass(frozen=True, kw_only=True)
class StepOptions:
    """The settings of a step that a run's config fixes, one object built once per run
    (harness.rl.setup.step_options); the defaults are the config's."""

    advantage: str = "grpo"  # group_advantages: grpo (mean and std) | drgrpo (mean only)
    logp_old_source: str = "trainer"  # π_old: the trainer's recompute | sampler (μ)
    mask_replay: bool = True  # π_old and π_θ score on μ's top-k / top-p support
    own_routes: bool = False  # R2: π_old's pass records the trainer's own MoE routes
    grad_clip: float = 1.0  # the gradient's global norm is clipped to this
    progress: bool = False  # a bar over μ's decoding (the training loop shows its own)


@dataclass(frozen=True, kw_only=True)
class Learner:
    """π_θ and what steps it: `opt` (AdamW, or MasterAdamW for a bf16/fp16 trainer), `on_step()`
    after each optimizer step (the loop's weight history), `restore()` after one that made a
    weight non-finite (see `optimizer_step`), and the ranks its weights are sharded over."""

    policy: Engine
    opt: Any
    on_step: Callable[[], None] | None = None
    restore: Callable[[], None] | None = None
    ranks: Ranks = ONE


def collect(
    sampler: Engine,
    old_policy: Engine | None,
    prompts: Sequence,
    reward: Callable[[Rollout], Tensor],
    sampling: Sampling,
    options: StepOptions,
    *,
    seed: int,
    batch_rows: tuple[int, int] | None = None,
) -> tuple[TokenBatch, Rollout, Tensor]:
    """μ samples `sampling.n` responses per prompt; `reward(ro)` → [B] rewards; group
    advantages; π_old scored by `old_policy` (with the sampler's support and routes for these
    rows). `options.own_routes` (R2): the rollout's routes become `old_policy`'s own at these
    weights, which π_old's pass and every later pass on the rollout then replay. Returns (batch,
    rollout, rewards); `batch.logp_old` is None when `old_policy` is.
    `batch_rows`: these rows' place in the step's batch (a rank's share; `Engine.generate`)."""
    ro = sampler.generate(
        list(prompts), sampling, seed=seed, progress=options.progress, batch_rows=batch_rows
    )
    rewards = reward(ro).to(ro.logp_mu.device)  # tasks score on the CPU; the batch lives on μ's
    adv = group_advantages(rewards, ro.prompt_index, options.advantage)
    batch = TokenBatch(
        tokens=ro.response_ids,
        mask=ro.response_mask,
        logp_old=None,
        logp_mu=ro.logp_mu,
        advantages=adv[:, None].expand_as(ro.logp_mu) * ro.response_mask,
        place=token_places(ro.response_ids, ro.response_mask, sampling.max_new_tokens),
    )
    if options.own_routes:
        if old_policy is None:
            raise ValueError("own_routes (R2) needs the engine at π_old's weights: old_policy")
        ro = dataclasses.replace(ro, routing=old_policy.own_routes(ro))
    if old_policy is not None:
        scores = old_policy.logp(ro, mask_replay=options.mask_replay)  # π_old's
        batch = batch.with_old(scores, options.logp_old_source)
    return batch, ro, rewards


def gather_batch(batch: TokenBatch) -> TokenBatch:
    """Every rank's rows of the step's batch, in rank order (the global batch), each field
    right-padded to the widest rank's tokens."""
    T = distributed.max_over_ranks(batch.mask.shape[1])
    fields = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}
    return TokenBatch(
        **{k: None if v is None else distributed.gather_rows(v, T) for k, v in fields.items()}
    )


def share_rows(
    ranks: Ranks, n_prompts: int, group_size: int
) -> tuple[slice, tuple[int, int] | None]:
    """This rank's prompts of a step's n_prompts and its rows' place in the step's batch: each
    rank samples whole groups with the draws the one-rank run gives those rows, so the gathered
    batch is the one-rank batch (None on one rank)."""
    own = ranks.share(n_prompts)
    rows = (own.start * group_size, n_prompts * group_size) if ranks.world > 1 else None
    return own, rows


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


# --- the backward of one minibatch: whole, or micro-batch by micro-batch ------------------------
#
# A `Backward` runs the minibatch's forward and backward passes, leaving the gradient of its loss
# in the parameters' .grad, and returns the loss (and metrics); None when the loss is non-finite
# (the step is then skipped). Micro-batches (engine.micro_batch_tokens) give the gradient of the
# minibatch's loss, not a mean of micro-batch losses: naive gradient accumulation averages
# per-micro-batch token means, which weights a token by 1/(its micro-batch's token count), the
# length bias of Dr. GRPO (Liu et al. 2025) and of the gradient-accumulation loss that
# transformers fixed ("Fixing Gradient Accumulation", Hugging Face blog, 2024), and would also
# split every minibatch-level quantity of an objective.

Backward = Callable[[], ObjectiveOutput | None]


def optimizer_step(
    model: torch.nn.Module, backward: Backward, opt, grad_clip: float, restore=None
) -> tuple[float, ObjectiveOutput] | None:
    """Zero the gradients, `backward()` (fills them; see `Backward`), clip, step: (gradient norm,
    the step's loss and metrics). None (and no step) when the loss or the gradient is non-finite,
    or when the step made a weight non-finite: then `restore()` puts the previous weights back
    (the optimizer's moments keep this step's finite gradient)."""
    opt.zero_grad(set_to_none=True)
    res = backward()
    if res is None:
        opt.zero_grad(set_to_none=True)  # what micro-batches before a non-finite one left
        return None
    gnorm = distributed.replicated(torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip))
    if not torch.isfinite(gnorm):
        opt.zero_grad(set_to_none=True)
        return None
    opt.step()
    if restore is not None and not distributed.all_true(  # one host sync for all parameters
        torch.stack([torch.isfinite(distributed.local(p)).all() for p in model.parameters()]).all()
    ):
        restore()
        return None
    return float(gnorm), res


def step_and_log(learner: Learner, backward: Backward, lag: int, grad_clip: float) -> dict | None:
    """One optimizer step on what `backward()` accumulates; its metrics, or None if skipped."""
    model = learner.policy.model
    out = optimizer_step(model, backward, learner.opt, grad_clip, learner.restore)
    if out is None:
        return None
    gnorm, res = out
    if learner.on_step is not None:
        learner.on_step()
    return {
        **res.metrics,
        "loss": float(res.loss.detach()),
        "grad/norm": gnorm,  # before clipping
        "grad/clipped": float(gnorm > grad_clip),  # clip_grad_norm_ rescaled this step
        "alpha/lag": float(lag),
    }


def backward_whole(objective, logp: Tensor, mb: TokenBatch) -> ObjectiveOutput | None:
    """The objective on the minibatch; backward unless its loss is non-finite."""
    res = objective(logp, mb)
    if not torch.isfinite(res.loss):
        return None
    res.loss.backward()
    return res


def backward_through_logp(
    objective,
    logp: Tensor,
    mb: TokenBatch,
    policy: Engine,
    ro: Rollout,
    parts: list[Tensor],
    mask_replay: bool,
    mine: Tensor | None = None,
) -> ObjectiveOutput | None:
    """A policy objective's loss L depends on θ only through log π_θ of the minibatch's tokens,
    so ∇_θ L = Σ_{i,t} (∂L/∂logp_it) ∇_θ logp_it (the chain rule; GradCache, Gao et al. 2021,
    "Scaling Deep Contrastive Learning Batch Size under Memory Limited Setup"). `logp` is the
    minibatch's log-probs from a pass without grad, as a leaf: the objective runs once on the
    whole minibatch (its denominators, quantiles, sequence-level ratios, random draws and state
    are the one-shot step's), its backward gives g = ∂L/∂logp [b, T]; then each micro-batch is
    scored again with grad and backpropagates its rows of g, the parameters' .grad summing them.
    `parts` are the micro-batches' rows of the rollout: consecutive runs of this rank's rows, in
    order. Across ranks `logp` and `mb` are the global minibatch's (every rank computes the same
    L and g) and `mine` this rank's rows' positions in the minibatch: each rank backpropagates
    its rows of g and the sharded gradient sums the ranks'."""
    res = backward_whole(objective, logp, mb)
    if res is None:
        return None
    g = logp.grad if mine is None else logp.grad[mine, : ro.response_ids.shape[1]]
    for rows, g_rows in zip(parts, g.split([len(r) for r in parts])):
        out = policy.logp(ro, rows, grad=True, stats=False, mask_replay=mask_replay)
        out["logp"].backward(g_rows)
    policy.idle_passes(ro, policy.passes(len(parts)) - len(parts), grad=True)
    return res


def trust_log_ratio(logp: Tensor, logp_old: Tensor, mask: Tensor) -> float:
    """Mean |log π_θ − log π_old| over response tokens: the policy movement the trust region (the
    PPO clip) sees at this minibatch's update; α alone when π_old is the trainer's recompute,
    α + β when π_old := μ."""
    return float(masked_mean(log_ratio_trust_region(logp, logp_old).abs(), mask))


def update(
    learner: Learner,
    objective,
    batch: TokenBatch,
    ro: Rollout,
    schedule: Sequence[tuple[Tensor, int]],
    options: StepOptions,
    *,
    calibrate: bool = False,
    shadow: ShadowPass | None = None,
) -> tuple[TokenBatch, list[dict[str, float]], int]:
    """One optimizer step of `learner` per (rows, lag) minibatch of `schedule`, in order.
    `batch.logp_old` None: the first pass's detached π_θ is the trainer's score at the behaviour
    weights (one minibatch only), and π_old is it or, with `logp_old_source="sampler"`, μ (as
    `collect` does for a separate recompute). `calibrate`: the last
    minibatch feeds the objective's calibration before its update (calibrated clipping: the
    trainer recompute `logp_recompute` is its high-precision π_old, `logp_old` the
    low-precision one; with a low-precision trainer, `shadow` gives the high-precision π_θ and
    π_old instead). The last minibatch, because the calibration compares where the two
    precisions clip α (arXiv 2609.22870's shadow pass: π_θ and π_old at BF16): at lag 0 the
    first minibatch has π_θ = π_old, so r_hp ≡ 1 and α_low ≡ 0 whatever the data; the last one
    has moved by every earlier update of the batch (validation refuses a schedule with none).
    With the policy's
    `micro_batch_tokens` a minibatch that needs more than one micro-batch is scored without grad
    first, micro-batch by micro-batch (that pass is π_old when the training pass doubles as it),
    and the gradient is accumulated by `backward_through_logp`: the step equals the one-shot
    step up to float rounding, at the cost of one forward without grad. Returns (the batch with
    π_old, per-minibatch metrics, number of minibatches skipped as non-finite).

    Across `learner.ranks`, `batch` and `schedule` are the global batch's (every rank holds all
    of it), `ro` is this rank's share of the rows (`Ranks.share`): each minibatch is scored
    without grad on each rank's rows, gathered, and trained through `backward_through_logp`."""
    if batch.logp_old is None and len(schedule) != 1:
        raise ValueError("π_old from the training pass needs exactly one minibatch")
    metrics: list[dict[str, float]] = []
    skipped = 0
    policy, ranks, mask_replay = learner.policy, learner.ranks, options.mask_replay
    policy.model.train()
    own = ranks.share(batch.mask.shape[0])
    last = len(schedule) - 1
    # π_old^hp of the calibrating rows: at the behaviour weights, so before the first update
    old_hp = shadow.behaviour(schedule[last][0].to(policy.device)) if calibrate and shadow else None
    for i, (rows, lag) in enumerate(schedule):
        rows = rows.to(policy.device)
        mine = None  # this rank's positions in the minibatch (all of them on one rank)
        local = rows
        if ranks.world > 1:
            mine = ((rows >= own.start) & (rows < own.stop)).nonzero()[:, 0]
            local = rows[mine] - own.start
        parts = [local[p] for p in policy.micro_batches(ro, local) if p.stop > p.start]
        whole = len(parts) == 1 and mine is None  # the pass with grad is the loss's input
        out = policy.logp(
            ro, local, grad=whole, stats=batch.logp_old is None, mask_replay=mask_replay
        )  # without grad: micro-batch by micro-batch
        if mine is not None:
            out = distributed.gather_scores(out, local, own, rows, batch.mask.shape[1])
        if batch.logp_old is None:  # the pass is in `rows` order (a permutation of all rows)
            order = torch.empty_like(rows)
            order[rows] = torch.arange(len(rows), device=rows.device)
            batch = batch.with_old({k: v[order] for k, v in out.items()}, options.logp_old_source)
        logp, mb = out["logp"], batch.index(rows)
        if whole:
            backward = partial(backward_whole, objective, logp, mb)
        else:
            logp = logp.detach().requires_grad_()
            backward = partial(
                backward_through_logp, objective, logp, mb, policy, ro, parts, mask_replay, mine
            )
        if calibrate and i == last:
            hp, hp_old = (shadow.current(rows), old_hp) if shadow else (logp, mb.logp_recompute)
            metrics.append(
                objective.calibrate(
                    hp.detach(), hp_old, logp.detach(), mb.logp_old, mb.advantages, mb.mask
                )
            )
        trust = trust_log_ratio(logp.detach(), mb.logp_old, mb.mask)
        m = step_and_log(learner, backward, lag, options.grad_clip)
        skipped += m is None
        metrics += [m | {"trust/mean_abs_log_ratio": trust}] if m is not None else []
    policy.model.eval()
    return batch, metrics, skipped


def student_teacher_logits(
    student: Engine, teacher: Teacher, ro: Rollout, rows: Tensor
) -> tuple[Tensor, Tensor]:
    """Full logits at the response positions: the student's (with grad) and the frozen teacher's
    conditioned on its privileged prompt (same response tokens, longer prompt)."""
    T = ro.response_ids.shape[1]
    s = student.model(input_ids=ro.tokens[rows], attention_mask=ro.attention_mask[rows]).logits
    t_ids = torch.cat([teacher.ids[rows], ro.response_ids[rows]], 1)
    t_mask = torch.cat([teacher.mask[rows], ro.response_mask[rows].long()], 1)
    with torch.no_grad():
        t = teacher.model(input_ids=t_ids, attention_mask=t_mask).logits
    return s[:, -T - 1 : -1], t[:, -T - 1 : -1]


class PartMetrics(Protocol):
    """A minibatch metric gathered micro-batch by micro-batch: `collect(s_logits, t_logits,
    rows)` keeps what it needs of one micro-batch (small), `reduce(collected)` gives the
    minibatch's metrics from all of them (e.g. harness.objectives.opsd.CopyExitMass)."""

    def collect(self, s_logits: Tensor, t_logits: Tensor, rows: Tensor) -> Any: ...

    def reduce(self, collected: list[Any]) -> dict[str, float]: ...


def weighted_sum(outs: list[ObjectiveOutput], weights: list[Tensor]) -> ObjectiveOutput:
    """Σ_p w_p · (loss_p, metrics_p): token means of micro-batches → the minibatch's token mean
    when w_p is micro-batch p's share of the minibatch's tokens."""
    loss = sum(w * o.loss.detach() for w, o in zip(weights, outs))
    keys = outs[0].metrics.keys()
    metrics = {k: sum(float(w) * o.metrics[k] for w, o in zip(weights, outs)) for k in keys}
    return ObjectiveOutput(loss, metrics)


def backward_distill(
    student: Engine,
    teacher: Teacher,
    objective,
    ro: Rollout,
    rows: Tensor,
    parts: list[slice],
    extra: PartMetrics | None,
) -> ObjectiveOutput | None:
    """OPSD's loss and metrics are token means over the minibatch, with a denominator N (its
    response tokens) that does not depend on θ: micro-batch p (n_p tokens) backpropagates
    (n_p/N)·mean_p, and Σ_p (n_p/N)·mean_p is the minibatch's mean (the gradient-accumulation
    normalisation of verl's and TRL's token-mean losses); its metrics merge with the same weights.
    The student's and the teacher's logits exist for one micro-batch at a time. Across ranks N is
    the global minibatch's (summed over the ranks), so each rank's loss and metrics are its share
    of the global ones and their sum over the ranks is the global minibatch's."""
    mask = ro.response_mask
    n_total = distributed.sum_over_ranks(mask[rows].sum()).to(mask.device)
    outs, weights, collected = [], [], []
    for k in range(student.passes(len(parts))):
        if k >= len(parts):  # a pass that adds nothing: FSDP's collectives stay paired
            r = torch.zeros(1, dtype=torch.long, device=rows.device)
            s, _ = student_teacher_logits(student, teacher, ro, r)
            (s.sum() * 0.0).backward()
            continue
        r = rows[parts[k]]
        s, t = student_teacher_logits(student, teacher, ro, r)
        res = objective(s, t, mask[r])
        if not distributed.all_true(torch.isfinite(res.loss)):
            return None
        w = mask[r].sum() / n_total
        (w * res.loss).backward()
        outs.append(res)
        weights.append(w)
        if extra is not None:
            collected.append(extra.collect(s.detach(), t, r))
    res = weighted_sum(outs, weights) if outs else None
    if distributed.active():
        res = sum_outputs(res)
        collected = [c for part in distributed.gather_objects(collected) for c in part]
    if extra is not None:
        res.metrics.update(extra.reduce(collected))
    return res


def sum_outputs(res):
    """Σ over the ranks of each rank's share of a loss and its metrics (an ObjectiveOutput;
    None from a rank without rows in the minibatch)."""
    parts = [
        p
        for p in distributed.gather_objects(None if res is None else distributed.to_cpu(res))
        if p is not None
    ]
    loss = sum(p.loss for p in parts)
    keys = parts[0].metrics.keys()
    return ObjectiveOutput(loss, {k: sum(p.metrics[k] for p in parts) for k in keys})


def update_distill(
    learner: Learner,
    teacher: Teacher,
    objective,
    ro: Rollout,
    schedule: Sequence[tuple[Tensor, int]],
    options: StepOptions,
    extra_metrics: PartMetrics | None = None,
) -> tuple[list[dict[str, float]], int]:
    """OPSD: the student (`learner.policy`) minimises `objective(student_logits, teacher_logits,
    mask)` on its own samples, one optimizer step per minibatch, in micro-batches of at most the
    student's `micro_batch_tokens` (a row counts its longer prompt, the teacher's privileged one,
    plus its response); `extra_metrics` adds per-minibatch metrics (the loop's exit mass at
    first-copy positions). Across `learner.ranks`, `schedule` holds global row ids, and `ro` and
    the teacher's prompts are this rank's share of the rows (`Ranks.share`)."""
    metrics: list[dict[str, float]] = []
    skipped = 0
    student, ranks = learner.policy, learner.ranks
    student.model.train()
    own = ranks.share(ranks.world * ro.response_mask.shape[0])
    for rows, lag in schedule:
        rows = rows.to(student.device)
        rows = rows[(rows >= own.start) & (rows < own.stop)] - own.start
        n_tokens = teacher.mask[rows].sum(1) + ro.response_mask[rows].sum(1)
        n_tokens = torch.maximum(ro.attention_mask[rows].sum(1), n_tokens)
        parts = micro_batches(n_tokens, student.micro_batch_tokens)
        backward = partial(
            backward_distill, student, teacher, objective, ro, rows, parts, extra_metrics
        )
        m = step_and_log(learner, backward, lag, options.grad_clip)
        skipped += m is None
        metrics += [m] if m is not None else []
    student.model.eval()
    return metrics, skipped


@torch.no_grad()
def evaluate(
    engine: Engine,
    task,
    problems,
    max_new_tokens: int,
    temperature: float,
    seed: int,
    ranks: Ranks = ONE,
) -> float:
    """Held-out accuracy: one sample per problem of the fixed set at `temperature` (no top-k /
    top-p), from the engine's current weights, seed `seed`; nan when the weights give a
    non-finite distribution. Across ranks each samples its share (with the whole set's draws)
    and the rewards are summed over the ranks."""
    mine = ranks.split(len(problems))
    try:
        ro = engine.generate(
            [p.prompt for p in problems[mine]],
            Sampling(n=1, max_new_tokens=max_new_tokens, temperature=temperature),
            seed=seed,
            batch_rows=(mine.start, len(problems)) if ranks.world > 1 else None,
        )
    except FloatingPointError as e:
        print(f"[train] eval skipped: {e}", flush=True)
        return float("nan")
    rewards = task.rollout_rewards(problems[mine], ro, engine.tokenizer)
    if ranks.world == 1:
        return float(rewards.mean())
    return float(distributed.sum_over_ranks(rewards.double().sum())) / len(problems)
