"""Building a run: every check that needs no model, then the task, the three policies (π_θ the
trainer, π_old at the behaviour weights, μ the sampler with its noise β), the teacher (OPSD), the
objective and the optimizer. harness.train, harness.rl.mechanism, harness.measure and the
benchmarks build through these functions, so a run, its step-0 mechanism check and a benchmark
of its step are the same objects.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from harness.base import distributed
from harness.base.distributed import ONE, Ranks
from harness.base.models import (
    load_model,
    resolve_device,
    resolve_dtype,
    set_tf32,
    upcycle_to_moe,
)
from harness.base.registry import build
from harness.noise import Fp8Trainer, build_noise
from harness.objectives import Objective
from harness.rl.alpha import WeightHistory
from harness.rl.step import Learner, StepOptions, adamw
from harness.runs.access import fsdp, noise_nodes, split_node, task_spec, train_objective
from harness.sampling.engines import Engine
from harness.sampling.rollout import Sampler, Sampling
from harness.sampling.samplers import ENGINES
from harness.tasks import TASKS, Task


def build_task_and_model(cfg: DictConfig) -> tuple[Task, torch.nn.Module, Any, dict]:
    """The task, the trainer's model (trainer dtype; fp32 master weights when it will be sharded,
    FSDP's mixed precision computing in the trainer dtype), its tokenizer and its identity (spec,
    weights checksum, recipe hash for task models: recorded in meta.json)."""
    from harness.tasks.warmstart import load_task_model, model_identity

    task_name, task_kw, recipe = task_spec(cfg)
    task = build(TASKS, task_name, "task", **task_kw)  # a bad dataset fails before a model loads
    if recipe is not None:
        warm = OmegaConf.to_container(cfg.model.warmstart, resolve=True)
        model, tok = load_task_model(task_name, progress=cfg.progress, **warm)
    else:
        model, tok = load_model(cfg.model.spec, dtype="fp32", seed=cfg.seed)
    task.attach_tokenizer(tok)
    if cfg.model.upcycle:
        model = upcycle_to_moe(model, **OmegaConf.to_container(cfg.model.upcycle, resolve=True))
    # weights are built (and warm-started) on the CPU, then placed: every copy (sampler, π_old,
    # teacher) is a deepcopy of this model, so all three policies share its device
    dtype = "fp32" if fsdp(cfg) else cfg.engine.trainer_dtype
    model = model.to(resolve_device(cfg.engine.device), resolve_dtype(dtype))
    return task, model, tok, model_identity(model, cfg.model.spec, recipe)


def build_sampler(cfg: DictConfig, model: torch.nn.Module, tok) -> Sampler:
    """The sampler holds its own copy of the weights: engine, dtype, attention path and noise
    are μ's (engine.sampler: harness.sampling.samplers.ENGINES)."""
    smp = copy.deepcopy(model).to(resolve_dtype(cfg.engine.sampler_dtype))
    smp.config._attn_implementation = cfg.engine.sampler_attention
    noise = [build_noise(name, **kw) for name, kw in map(split_node, noise_nodes(cfg))]
    log_dir = Path(cfg.out) if cfg.get("out") else None
    return ENGINES[cfg.engine.sampler](smp, tok, noise, cfg.engine, log_dir)


@dataclass(kw_only=True)
class Setup:
    """What `run` builds: the task, the three policies and the optimizer state."""

    task: Task
    harder_task: Task | None  # drivers.harder: the training task from drivers.harder_at on
    tok: Any
    policy: Engine  # π_θ: the trainer
    old_policy: Engine | None  # π_old at the behaviour weights; None: the training pass is π_old
    sampler: Sampler  # μ: HF Engine, Ct2Engine or VllmEngine (harness.sampling.samplers)
    teacher: torch.nn.Module | None
    objective: Objective
    opt: Any  # torch.optim.AdamW, or harness.rl.step.MasterAdamW for a bf16/fp16 trainer
    options: StepOptions  # the step's settings from the config
    history: WeightHistory
    identity: dict
    # (noise model, its configured σ): drivers.beta_growth scales σ from these each step
    sigma0: list[tuple[Any, float]]
    ranks: Ranks = ONE  # this process's rank and the world size (harness.base.distributed)

    def old_scorer(self) -> Engine | None:
        """What scores π_old this step, at the behaviour weights; the choice is `build_engines`'s:
        a copy of its own (staleness > 0, loaded here with the behaviour weights), the policy
        before its update, or None (one minibatch: the update's first pass is π_old)."""
        if self.old_policy is not None and self.old_policy is not self.policy:
            self.old_policy.load_weights_from_state(self.history.behaviour())
        return self.old_policy

    def learner(self, restore: Callable[[], None]) -> Learner:
        """π_θ as the update steps it: the weight history's push after each optimizer step,
        `restore()` (a roll-back) after one that made a weight non-finite."""
        return Learner(
            policy=self.policy,
            opt=self.opt,
            on_step=self.push_weights,
            restore=restore,
            ranks=self.ranks,
        )

    def push_weights(self) -> None:
        """The trainer's current weights into the weight history."""
        self.history.push(self.trainer)

    @property
    def trainer(self) -> Any:
        """What the weight history copies: the trainer's model, its full weights when sharded."""
        m = self.policy.model
        return distributed.FullView(m) if self.policy.sharded else m


def r2(cfg: DictConfig) -> bool:
    """R2: the trainer replays its own routes at π_old (engine.routing_replay_source=trainer)."""
    return cfg.engine.routing_replay and cfg.engine.routing_replay_source == "trainer"


def step_options(cfg: DictConfig) -> StepOptions:
    """The step's settings from the run's config (harness.rl.step.StepOptions)."""
    return StepOptions(
        advantage=cfg.advantage,
        logp_old_source=cfg.engine.logp_old_source,
        mask_replay=cfg.engine.mask_replay,
        own_routes=r2(cfg),
        grad_clip=cfg.optim.grad_clip,
    )


def build_policy(cfg: DictConfig, model: torch.nn.Module, tok) -> Engine:
    """A trainer-side policy (π_θ, π_old, the measurement job's reference) on `model`: R3 replays
    μ's routes (engine.routing_replay); engine.trainer_fp8 runs the sampler's FP8 recipe with a
    straight-through gradient."""
    noise = [build_noise("replay")] if cfg.engine.routing_replay else []
    if cfg.engine.trainer_fp8:
        name, kw = split_node(cfg.noise)
        noise.append(Fp8Trainer(build_noise(name, **kw)))
    return Engine(
        model,
        tok,
        noise=noise,
        micro_batch_tokens=cfg.engine.micro_batch_tokens,
        activation_checkpointing=cfg.engine.activation_checkpointing,
    )


def build_engines(cfg: DictConfig, model: torch.nn.Module, tok) -> tuple[Engine, Any, Any, Any]:
    """(π_θ on `model`, π_old, μ, the OPSD teacher). π_old is its own copy loaded with the
    behaviour weights under staleness, None when the training pass serves as π_old (staleness 0,
    one minibatch, `reuse_old_logp`, no R2: R2 records its routes in π_old's pass), else π_θ
    itself; the teacher (distill.enabled) is a frozen
    copy, None otherwise. Every copy is taken before any noise or replay hook is attached
    (deepcopy copies hooks)."""
    sampler = build_sampler(cfg, model, tok)
    dtype = resolve_dtype(cfg.engine.trainer_dtype)  # the copies compute as the trainer does
    old_model = (
        copy.deepcopy(model).to(dtype).requires_grad_(False) if cfg.alpha.staleness > 0 else None
    )
    teacher = (
        copy.deepcopy(model).to(dtype).eval().requires_grad_(False) if cfg.distill.enabled else None
    )
    if fsdp(cfg):  # after the copies: each rank keeps its own full sampler, π_old and teacher
        model = distributed.shard(model, cfg.model.spec, dtype)
    policy = build_policy(cfg, model, tok)
    if old_model is not None:
        old_policy = build_policy(cfg, old_model, tok)
    elif (
        cfg.alpha.minibatches == 1
        and cfg.reuse_old_logp
        and not cfg.distill.enabled
        and not r2(cfg)
    ):
        old_policy = None
    else:
        old_policy = policy
    return policy, old_policy, sampler, teacher


def build_setup(cfg: DictConfig, ranks: Ranks = ONE) -> Setup:
    set_tf32(cfg.engine.tf32)  # process-wide; the run's one setting
    task, model, tok, identity = build_task_and_model(cfg)
    policy, old_policy, sampler, teacher = build_engines(cfg, model, tok)
    model = policy.model
    opt = adamw(  # fp32 master weights when the trainer is bf16/fp16
        model,
        lr=cfg.optim.lr,
        betas=(cfg.optim.beta1, cfg.optim.beta2),
        weight_decay=cfg.optim.weight_decay,
    )
    history = WeightHistory(cfg.alpha.staleness)
    harder = None
    if cfg.drivers.harder_at:
        task_name, task_kw, _ = task_spec(cfg)
        kw = {**task_kw, **OmegaConf.to_container(cfg.drivers.harder, resolve=True)}
        harder = build(TASKS, task_name, "task", **kw)
    s = Setup(
        task=task,
        harder_task=harder,
        tok=tok,
        policy=policy,
        old_policy=old_policy,
        sampler=sampler,
        teacher=teacher,
        objective=train_objective(cfg),
        opt=opt,
        options=step_options(cfg),
        history=history,
        identity=identity,
        sigma0=[(n, n.sigma) for n in sampler.noise if n.sigma is not None],
        ranks=ranks,
    )
    s.push_weights()
    return s


def step_seed(seed: int, step: int) -> int:
    """The seed of step `step`'s prompts and samples in a run seeded `seed` (the mechanism check
    scores steps 1, 2, ... of the run; the measurement job's passes are steps of their own)."""
    return seed * 1_000_003 + step


def token_budget(cfg: DictConfig, task: Task | None) -> int:
    """rollout.max_new_tokens, else (null, the default) the task's own budget (harness.measure
    has no task: its budget is always set)."""
    return cfg.rollout.max_new_tokens or task.max_new_tokens


def rollout_sampling(cfg: DictConfig, task: Task | None = None) -> Sampling:
    """The `rollout` node as the samplers read it, the budget `token_budget`'s."""
    r = cfg.rollout
    return Sampling(
        n=r.group_size,
        max_new_tokens=token_budget(cfg, task),
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
    )
