"""Building a run: every check that needs no model, then the task, the three policies (π_θ the
trainer, π_old at the behaviour weights, μ the sampler with its noise β), the teacher (OPSD), the
objective and the optimizer. harness.train, harness.mechanism, harness.measure and the
benchmarks build through these functions, so a run, its step-0 mechanism check and a benchmark
of its step are the same objects.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from harness import distributed
from harness.alpha import WeightHistory
from harness.distributed import ONE, Ranks
from harness.engines import Engine
from harness.launch import AGGREGATION_KEYS, check_nodes
from harness.logprobs import check_sampling
from harness.models import (
    BUILTIN_SPECS,
    DTYPES,
    load_model,
    resolve_device,
    resolve_dtype,
    set_tf32,
    upcycle_to_moe,
)
from harness.noise import Fp8Trainer, build_noise
from harness.objectives import build_objective
from harness.prereg import check_prereg
from harness.registry import build
from harness.samplers import ENGINES, check_sampler
from harness.step import ADVANTAGES, Sampling, adamw
from harness.tasks import TASKS, Task
from harness.tracking import LOGGERS


def noise_nodes(cfg: DictConfig) -> list[dict[str, Any]]:
    """μ's injected noise: the `noise` group's node, then the `extra_noise` list (stacked in
    order); "none" nodes dropped."""
    nodes = [OmegaConf.to_container(n, resolve=True) for n in [cfg.noise, *cfg.extra_noise]]
    return [n for n in nodes if n["name"] != "none"]


def split_node(node: Any) -> tuple[str, dict[str, Any]]:
    d = OmegaConf.to_container(node, resolve=True) if not isinstance(node, dict) else dict(node)
    if "name" not in d:
        raise ValueError(f"config node {d} needs a `name` (the registry key)")
    name = d.pop("name")
    return name, d


def task_spec(cfg: DictConfig) -> tuple[str, dict[str, Any], dict | None]:
    """The task's registry name and kwargs (with model=task-model, the warm-start recipe's task
    kwargs under the node's) and the recipe (None for other models)."""
    from harness.warmstart import resolve_recipe

    task_name, task_kw = split_node(cfg.task)
    if cfg.model.spec != "task-model":
        return task_name, task_kw, None
    recipe = resolve_recipe(task_name, **OmegaConf.to_container(cfg.model.warmstart, resolve=True))
    return task_name, {**recipe["task_kwargs"], **task_kw}, recipe


def build_task_and_model(cfg: DictConfig) -> tuple[Task, torch.nn.Module, Any, dict]:
    """The task, the trainer's model (trainer dtype; fp32 master weights when it will be sharded,
    FSDP's mixed precision computing in the trainer dtype), its tokenizer and its identity (spec,
    weights checksum, recipe hash for task models: recorded in meta.json)."""
    from harness.warmstart import load_task_model, model_identity

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


def fsdp(cfg: DictConfig) -> bool:
    """Whether the trainer is sharded: engine.fsdp, else (null) when the world has > 1 rank."""
    if cfg.engine.fsdp is not None:
        return bool(cfg.engine.fsdp)
    return distributed.environment().world > 1


def build_sampler(cfg: DictConfig, model: torch.nn.Module, tok) -> Engine:
    """The sampler holds its own copy of the weights: engine, dtype, attention path and noise
    are μ's (engine.sampler: harness.samplers.ENGINES)."""
    smp = copy.deepcopy(model).to(resolve_dtype(cfg.engine.sampler_dtype))
    smp.config._attn_implementation = cfg.engine.sampler_attention
    noise = [build_noise(name, **kw) for name, kw in map(split_node, noise_nodes(cfg))]
    log_dir = Path(cfg.out) if cfg.get("out") else None
    return ENGINES[cfg.engine.sampler](smp, tok, noise, cfg.engine, log_dir)


ATTENTIONS = ("sdpa", "eager")


def validate(cfg: DictConfig) -> None:
    """Every check that needs no model, run before anything is built or warm-started: each error
    names the key, the bad value and what is valid."""

    def bad(key: str, value: Any, valid: str) -> ValueError:
        return ValueError(f"{key}={value!r}; valid: {valid}")

    for key, value, valid in [
        ("engine.logp_old_source", cfg.engine.logp_old_source, ("trainer", "sampler")),
        ("advantage", cfg.advantage, ADVANTAGES),
        ("engine.sampler_attention", cfg.engine.sampler_attention, ATTENTIONS),
        ("engine.sampler_dtype", cfg.engine.sampler_dtype, tuple(DTYPES)),
        ("engine.trainer_dtype", cfg.engine.trainer_dtype, tuple(DTYPES)),
        ("resume", cfg.resume, ("strict", "override")),
        ("logger", cfg.logger, LOGGERS),
    ]:
        if value not in valid:
            raise bad(key, value, ", ".join(map(repr, valid)))
    r, a = cfg.rollout, cfg.alpha
    check_sampling(r.temperature, r.top_k, r.top_p, prefix="rollout.")
    checks = [
        ("rollout.max_new_tokens", r.max_new_tokens,
         r.max_new_tokens is None or r.max_new_tokens >= 1, ">= 1, or null for the task's own"),
        ("rollout.prompts_per_step", r.prompts_per_step, r.prompts_per_step >= 1, ">= 1"),
        ("log_every", cfg.log_every, cfg.log_every >= 0, ">= 0 (0: no plain lines)"),
        ("rollout.group_size", r.group_size, r.group_size >= 2,
         ">= 2 (group-normalised advantages of a single response are 0: nothing would train)"),
        ("alpha.staleness", a.staleness, a.staleness >= 0, ">= 0"),
        ("alpha.minibatches", a.minibatches,
         1 <= a.minibatches <= r.prompts_per_step * r.group_size,
         f"in [1, rollout.prompts_per_step × rollout.group_size = "
         f"{r.prompts_per_step * r.group_size}]"),
        ("steps", cfg.steps, cfg.steps >= 1, ">= 1"),
        ("checkpoint_every", cfg.checkpoint_every, cfg.checkpoint_every >= 1, ">= 1"),
        ("keep_checkpoints", cfg.keep_checkpoints, cfg.keep_checkpoints >= 1, ">= 1"),
        ("eval_n", cfg.eval_n, cfg.eval_n >= 1 or not cfg.eval_every, ">= 1 when eval_every > 0"),
        ("optim.lr", cfg.optim.lr, cfg.optim.lr > 0, "> 0"),
        ("drivers.beta_growth", cfg.drivers.beta_growth, cfg.drivers.beta_growth > 0, "> 0"),
        ("drivers.harder_at", cfg.drivers.harder_at, 0 <= cfg.drivers.harder_at <= cfg.steps,
         "in [0 (never), steps]"),
        ("mechanism_batches", cfg.mechanism_batches, cfg.mechanism_batches >= 0,
         ">= 0 (0: no mechanism check)"),
        ("engine.micro_batch_tokens", cfg.engine.micro_batch_tokens,
         cfg.engine.micro_batch_tokens is None or cfg.engine.micro_batch_tokens >= 1,
         ">= 1 (prompt + response tokens per micro-batch), or null (each minibatch in one pass)"),
        # a full-length response alone would exceed every micro-batch: the budget bounds nothing
        ("engine.micro_batch_tokens", cfg.engine.micro_batch_tokens,
         None in (cfg.engine.micro_batch_tokens, r.max_new_tokens)
         or cfg.engine.micro_batch_tokens > r.max_new_tokens,
         f"> rollout.max_new_tokens = {r.max_new_tokens} (one whole sequence: its prompt and "
         "a full-length response), or null"),
    ]  # fmt: skip
    for key, value, ok, valid in checks:
        if not ok:
            raise bad(key, value, valid)
    resolve_device(cfg.engine.device)  # a CUDA device must exist here
    check_nodes(cfg)  # the swept-axis nodes' names and kwargs against their builders
    injected = [n["name"] for n in noise_nodes(cfg)]
    check_sampler(cfg.engine, injected, cfg.rollout)
    if cfg.engine.sampler != "hf" and cfg.drivers.beta_growth != 1.0:
        why = "its β is the engine's own, not a σ that can grow"
        raise bad("drivers.beta_growth", cfg.drivers.beta_growth,
                  f"1.0 with engine.sampler={cfg.engine.sampler} ({why})")  # fmt: skip
    if cfg.drivers.harder_at:  # the harder task's kwargs against the task's builder
        if not cfg.drivers.harder:
            raise bad("drivers.harder", {}, "the task kwargs that make it harder, e.g. "
                      "{max_number: 20}, when drivers.harder_at > 0")  # fmt: skip
        check_nodes(OmegaConf.create({"task": {**cfg.task, **cfg.drivers.harder}}))
    check_prereg(OmegaConf.to_container(cfg.prereg, resolve=True))  # the preset's endpoints
    spec = cfg.model.spec
    if spec == "task-model":
        from harness.warmstart import RECIPES, resolve_recipe

        if cfg.task.name not in RECIPES:
            raise ValueError(task_model_mismatch(cfg.task, tuple(RECIPES)))
        resolve_recipe(cfg.task.name, **OmegaConf.to_container(cfg.model.warmstart, resolve=True))
    elif spec not in BUILTIN_SPECS and not Path(spec).is_dir() and "/" not in spec:
        raise bad("model.spec", spec, f"task-model, {', '.join(BUILTIN_SPECS)}, a local HF folder "
                  "or a Hugging Face hub id (org/name)")  # fmt: skip
    elif Path(spec).is_dir() and not (Path(spec) / "config.json").exists():
        raise bad("model.spec", spec, "a Hugging Face model folder (it has no config.json; "
                  "`python -m harness.models export <spec> <folder>` writes one)")  # fmt: skip
    obj = cfg.objective.name
    misplaced = sorted({"aggregation", *AGGREGATION_KEYS} & set(cfg.objective))
    if misplaced:
        raise ValueError(
            f"objective.{misplaced[0]} is the aggregation group's: set aggregation=<name> and "
            f"aggregation.{'|'.join(AGGREGATION_KEYS)}=<value> instead"
        )
    if cfg.distill.enabled != (obj == "opsd_fkl"):
        raise ValueError(
            "distill.enabled=true needs objective=opsd_fkl, and opsd_fkl needs distill.enabled"
        )
    if cfg.engine.trainer_fp8 and cfg.noise.name != "fp8":
        raise ValueError(
            f"engine.trainer_fp8=true runs the trainer in the sampler's FP8 recipe, but "
            f"noise={cfg.noise.name!r}; valid: noise=fp8 (or engine.trainer_fp8=false)"
        )
    if obj == "calibrated_clip" and cfg.engine.logp_old_source == "trainer":
        raise ValueError(
            "objective=calibrated_clip calibrates the low-precision π_old against the trainer's "
            "high-precision recompute, but engine.logp_old_source='trainer' makes them the same "
            "tensor (the clip would silently equal ppo_clip); set engine.logp_old_source=sampler"
        )


def task_model_mismatch(task: DictConfig, recipe_tasks: tuple[str, ...]) -> str:
    """Why model=task-model cannot train `task`: a task model is trained from scratch for one
    built-in task (its recipe); a dataset needs a real model. A missing dataset file is named
    too, so that one run finds both."""
    msg = (f"task={task.name} with model=task-model (the default): a task model is trained only "
           f"for {', '.join(recipe_tasks)}; task={task.name} needs a real model: "
           "model.spec=<a Hugging Face folder or hub id>, e.g. model=smollm2-135m")  # fmt: skip
    path = task.get("path")
    if path is not None and not Path(str(path)).expanduser().exists():
        msg += f"; and task.path={str(path)!r} is not a file or folder here"
    return msg


def check_save_final(cfg: DictConfig) -> None:
    if cfg.save_final and fsdp(cfg):
        raise ValueError(
            "save_final=True with a sharded trainer (FSDP2); valid: false (the weights are "
            "in the last checkpoint's folder checkpoints/step_N/)"
        )


def validate_ranks(cfg: DictConfig, world: int) -> None:
    """The checks a run across `world` ranks adds, before any compute; each error names the key,
    the bad value and what is valid."""
    r = cfg.rollout
    check_save_final(cfg)
    if cfg.engine.fsdp is False and world > 1:
        raise ValueError(f"engine.fsdp=False with {world} ranks; valid: true or null (ranks "
                         "shard the trainer with FSDP2), or one rank")  # fmt: skip
    if world == 1:
        return
    if r.prompts_per_step % world:
        raise ValueError(
            f"rollout.prompts_per_step={r.prompts_per_step} with {world} ranks; valid: a "
            f"multiple of the world size {world} (each rank samples whole groups)"
        )
    if cfg.eval_every and cfg.eval_n < world:
        raise ValueError(f"eval_n={cfg.eval_n} with {world} ranks; valid: >= {world}")
    fresh = [n["name"] for n in noise_nodes(cfg) if n.get("deterministic") is False]
    unsupported = [
        ("engine.sampler", cfg.engine.sampler, cfg.engine.sampler != "hf", "'hf'"),
        ("engine.trainer_fp8", cfg.engine.trainer_fp8, cfg.engine.trainer_fp8, "false"),
        ("objective.adaptive", cfg.objective.get("adaptive"), bool(cfg.objective.get("adaptive")),
         "false (its refresh pass is one process's)"),
        ("noise.deterministic", False, bool(fresh),
         "true (fresh draws follow the batch layout, which the ranks split)"),
        ("noise", "batch", "batch" in [n["name"] for n in noise_nodes(cfg)],
         "a noise that does not depend on which rows share the batch"),
    ]  # fmt: skip
    for key, value, bad, valid in unsupported:
        if bad:
            raise ValueError(f"{key}={value!r} with {world} ranks; valid: {valid}")


@dataclass
class Setup:
    """What `run` builds: the task, the three policies and the optimizer state."""

    task: Task
    harder_task: Task | None  # drivers.harder: the training task from drivers.harder_at on
    tok: Any
    policy: Engine  # π_θ: the trainer
    old_policy: Engine | None  # π_old at the behaviour weights; None: the training pass is π_old
    sampler: Engine  # μ
    teacher: torch.nn.Module | None
    objective: Any
    opt: Any  # torch.optim.AdamW, or harness.step.MasterAdamW for a bf16/fp16 trainer
    history: WeightHistory
    identity: dict
    # (noise model, its configured σ): drivers.beta_growth scales σ from these each step
    sigma0: list[tuple[Any, float]]
    ranks: Ranks = ONE  # this process's rank and the world size (harness.distributed)

    @property
    def trainer(self) -> Any:
        """What the weight history copies: the trainer's model, its full weights when sharded."""
        m = self.policy.model
        return distributed.FullView(m) if self.policy.sharded else m


def build_policy(cfg: DictConfig, model: torch.nn.Module, tok) -> Engine:
    """A trainer-side policy (π_θ, π_old, the measurement job's reference) on `model`: R3 replays
    μ's routes (engine.routing_replay); engine.trainer_fp8 runs the sampler's FP8 recipe with a
    straight-through gradient."""
    noise = [build_noise("replay")] if cfg.engine.routing_replay else []
    if cfg.engine.trainer_fp8:
        name, kw = split_node(cfg.noise)
        noise.append(Fp8Trainer(build_noise(name, **kw)))
    return Engine(
        model, tok, noise=noise, micro_batch_tokens=cfg.engine.micro_batch_tokens,
        activation_checkpointing=cfg.engine.activation_checkpointing,
    )  # fmt: skip


def build_engines(cfg: DictConfig, model: torch.nn.Module, tok) -> tuple[Engine, Any, Any, Any]:
    """(π_θ on `model`, π_old, μ, the OPSD teacher). π_old is its own copy loaded with the
    behaviour weights under staleness, None when the training pass serves as π_old (staleness 0,
    one minibatch, `reuse_old_logp`), else π_θ itself; the teacher (distill.enabled) is a frozen
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
    elif cfg.alpha.minibatches == 1 and cfg.reuse_old_logp and not cfg.distill.enabled:
        old_policy = None
    else:
        old_policy = policy
    return policy, old_policy, sampler, teacher


def build_train_objective(cfg: DictConfig) -> Any:
    """The objective node's loss with the aggregation node's name and denominator convention
    (opsd_fkl, a distillation loss, takes none)."""
    name, kw = split_node(cfg.objective)
    if name != "opsd_fkl":
        agg_name, agg_kw = split_node(cfg.aggregation)
        kw.update(aggregation=agg_name, **agg_kw)
    return build_objective(name, **kw)


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
        task, harder, tok, policy, old_policy, sampler, teacher,
        build_train_objective(cfg), opt, history, identity,
        [(n, n.sigma) for n in sampler.noise if hasattr(n, "sigma")], ranks,
    )  # fmt: skip
    history.push(s.trainer)
    return s


def step_seed(seed: int, step: int) -> int:
    """The seed of step `step`'s prompts and samples in a run seeded `seed` (the mechanism check
    scores steps 1, 2, ... of the run; the measurement job's passes are steps of their own)."""
    return seed * 1_000_003 + step


def token_budget(cfg: DictConfig, task: Task) -> int:
    """rollout.max_new_tokens, else (null, the default) the task's own budget."""
    return cfg.rollout.max_new_tokens or task.max_new_tokens


def rollout_sampling(cfg: DictConfig, task: Task) -> Sampling:
    r = cfg.rollout
    return Sampling(r.group_size, token_budget(cfg, task), r.temperature, r.top_p, r.top_k)
