"""Every check a run makes before any compute, in one place: the config's values, the swept
axes' nodes against their builders (names, kwargs, scalar types), the group-choice names, the
pre-registration, the model spec and the checks a run across ranks adds. Each error names the
key, the bad value and what is valid. `validate` runs once per job: `harness.train` (through
`run_task`), `harness.measure` (with its own keys' check), `harness.rl.mechanism` and
`harness.rl.drift` on their own, and the Slurm pre-submission check (`harness.runs.presubmit`)
on the driver for every sweep point."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from harness.base.batch import ADVANTAGES
from harness.base.models import BUILTIN_SPECS, DTYPES, resolve_device
from harness.base.registry import check_kwargs, lookup
from harness.runs.access import (
    GROUP_NODES,
    fsdp,
    group_option_name,
    noise_nodes,
    train_objective,
)
from harness.runs.prereg import check_prereg
from harness.runs.tracking import LOGGERS
from harness.sampling.logprobs import check_sampling
from harness.sampling.samplers import check_sampler
from harness.tasks import TASKS

_TYPES: dict[str, tuple[type, ...]] = {
    "float": (int, float),
    "int": (int,),
    "bool": (bool,),
    "str": (str,),
    "None": (type(None),),
}


def _type_ok(value: Any, annotation: Any) -> bool:
    """Scalar annotations only (`float | None`, `int`, ...); anything else is accepted."""
    if not isinstance(annotation, str):
        annotation = getattr(annotation, "__name__", "")
    allowed: tuple[type, ...] = ()
    for part in (p.strip() for p in annotation.split("|")):
        if part not in _TYPES:
            return True
        allowed += _TYPES[part]
    if isinstance(value, bool) and bool not in allowed:
        return False  # bool is an int subclass: `sigma: true` is a typo, not 1.0
    return isinstance(value, allowed)


def _check_node(table: dict[str, Callable], node: Any, what: str) -> None:
    d = OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else dict(node)
    if "name" not in d:
        raise ValueError(f"{what} node {d} needs a `name` (the registry key)")
    name = d.pop("name")
    if what == "noise" and name == "none":
        return
    fn = lookup(table, name, what)
    missing = [k for k, v in d.items() if v == "???"]
    if missing:
        raise ValueError(
            f"{what}.{missing[0]} must be set: {what} {name!r} has no default for it "
            f"(e.g. {what}.{missing[0]}=<value> on the command line)"
        )
    check_kwargs(fn, d, f"{what} {name!r}")
    params = inspect.signature(fn).parameters
    bad = {k: v for k, v in d.items() if k in params and not _type_ok(v, params[k].annotation)}
    if bad:
        expected = {k: str(params[k].annotation) for k in bad}
        raise TypeError(f"{what} {name!r}: wrong type for {bad}; expected {expected}")


def check_nodes(cfg: DictConfig) -> None:
    """Check the swept-axis nodes present in `cfg` (task, noise, extra_noise,
    objective, aggregation) against their registries and builders' signatures: unknown names,
    unknown keyword arguments and wrong scalar types raise here, before any model is loaded;
    each axis's name is its group file's (`check_group_names`)."""
    check_group_names(cfg)
    if "task" in cfg:
        _check_node(TASKS, cfg.task, "task")
    noise = [cfg.get("noise"), *(cfg.get("extra_noise") or [])]
    if any(n is not None for n in noise):
        from harness.noise import NOISE

        for node in noise:
            if node is not None:
                _check_node(NOISE, node, "noise")
    if "objective" in cfg or "aggregation" in cfg:
        from harness.objectives import OBJECTIVES

        if "objective" in cfg:
            _check_node(OBJECTIVES, cfg.objective, "objective")
        if "aggregation" in cfg:
            check_aggregation(cfg.aggregation)


def check_group_names(cfg: DictConfig) -> None:
    """Each swept axis's name is the one its chosen group file sets. Hydra merges `noise.name=X`
    into the node of the option chosen (noise=none), so the run would get that option's keys,
    not X's (noise=logit's `seed: ${seed}`, harness.runs.plugins.group_node: without it every
    run draws the noise field of the builder's seed 0, whatever its own seed). The group choice
    is read from the running Hydra job; a config composed outside one (a test's `compose`, a
    library call) records no choice and is not checked."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return
    choices = HydraConfig.get().runtime.choices
    for group in GROUP_NODES:
        option, node = choices.get(group), cfg.get(group)
        if option is None or not isinstance(node, DictConfig) or "name" not in node:
            continue
        expected = group_option_name(group, option)
        if expected is not None and node.name != expected:
            raise ValueError(
                f"{group}.name={node.name!r} with {group}={option}: the name alone keeps "
                f"{option}'s keys and drops those of the {group} file for {node.name!r}; "
                f"use {group}={node.name} (the group choice) instead"
            )


AGGREGATION_KEYS = ("rejected_in_denominator", "norm_len")


def check_aggregation(node) -> None:
    """The aggregation node: a registered name and only the keys the objectives take from it."""
    from harness.objectives import AGGREGATIONS

    d = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else node
    if not isinstance(d, dict) or "name" not in d:
        raise ValueError(f"aggregation must be a node {{name: ...}}, got {d!r}")
    fn = lookup(AGGREGATIONS, d["name"], "aggregation")
    bad = sorted(set(d) - {"name", *AGGREGATION_KEYS})
    if bad:
        raise TypeError(
            f"aggregation {d['name']!r}: unknown key(s) {bad}; valid: {list(AGGREGATION_KEYS)}"
        )
    if d.get("norm_len") is not None:
        check_kwargs(fn, {"norm_len": d["norm_len"]}, f"aggregation {d['name']!r}")


ATTENTIONS = ("sdpa", "eager")


def _bad(key: str, value: Any, valid: str) -> ValueError:
    return ValueError(f"{key}={value!r}; valid: {valid}")


def _check_choices(choices: list[tuple[str, Any, tuple]]) -> None:
    for key, value, valid in choices:
        if value not in valid:
            raise _bad(key, value, ", ".join(map(repr, valid)))


def validate(cfg: DictConfig, job: Callable[[DictConfig], None] | None = None) -> None:
    """Every check that needs no model, run once per job before anything is built or
    warm-started: the swept-axis nodes, the engine and rollout nodes every job shares, then the
    job's own checks (`job`: harness.train's, `check_train`, unless another job names its own,
    as harness.measure does). Each error names the key, the bad value and what is valid."""
    check_nodes(cfg)  # the swept-axis nodes' names and kwargs against their builders
    check_engine(cfg)
    (job or check_train)(cfg)


def check_engine(cfg: DictConfig) -> None:
    """The `engine` and `rollout` nodes as every job that samples and scores reads them: the
    precisions, attention path and replay source, the sampling settings, the micro-batch budget,
    the device, and the sampler against μ's injected noise."""
    eng, r = cfg.engine, cfg.rollout
    _check_choices(
        [
            ("engine.logp_old_source", eng.logp_old_source, ("trainer", "sampler")),
            ("engine.routing_replay_source", eng.routing_replay_source, ("sampler", "trainer")),
            ("engine.sampler_attention", eng.sampler_attention, ATTENTIONS),
            ("engine.sampler_dtype", eng.sampler_dtype, tuple(DTYPES)),
            ("engine.trainer_dtype", eng.trainer_dtype, tuple(DTYPES)),
        ]
    )
    check_sampling(r.temperature, r.top_k, r.top_p, prefix="rollout.")
    mb = eng.micro_batch_tokens
    if mb is not None and mb < 1:
        raise _bad(
            "engine.micro_batch_tokens",
            mb,
            ">= 1 (prompt + response tokens per micro-batch), or null (each minibatch in one pass)",
        )
    resolve_device(eng.device)  # a CUDA device must exist here
    check_sampler(eng, [n["name"] for n in noise_nodes(cfg)], r)


def check_train(cfg: DictConfig) -> None:
    """harness.train's own keys: the loop, the optimizer, the drivers, the pre-registration,
    the model spec and what the objective needs of the rest of the config."""
    _check_choices(
        [
            ("advantage", cfg.advantage, ADVANTAGES),
            ("resume", cfg.resume, ("strict", "override")),
            ("logger", cfg.logger, LOGGERS),
        ]
    )
    r, a = cfg.rollout, cfg.alpha
    checks = [
        (
            "rollout.max_new_tokens",
            r.max_new_tokens,
            r.max_new_tokens is None or r.max_new_tokens >= 1,
            ">= 1, or null for the task's own",
        ),
        ("rollout.prompts_per_step", r.prompts_per_step, r.prompts_per_step >= 1, ">= 1"),
        ("log_every", cfg.log_every, cfg.log_every >= 0, ">= 0 (0: no plain lines)"),
        (
            "rollout.group_size",
            r.group_size,
            r.group_size >= 2,
            ">= 2 (group-normalised advantages of a single response are 0: nothing would train)",
        ),
        ("alpha.staleness", a.staleness, a.staleness >= 0, ">= 0"),
        (
            "alpha.minibatches",
            a.minibatches,
            1 <= a.minibatches <= r.prompts_per_step * r.group_size,
            f"in [1, rollout.prompts_per_step × rollout.group_size = "
            f"{r.prompts_per_step * r.group_size}]",
        ),
        ("steps", cfg.steps, cfg.steps >= 1, ">= 1"),
        ("checkpoint_every", cfg.checkpoint_every, cfg.checkpoint_every >= 1, ">= 1"),
        ("keep_checkpoints", cfg.keep_checkpoints, cfg.keep_checkpoints >= 1, ">= 1"),
        ("eval_n", cfg.eval_n, cfg.eval_n >= 1 or not cfg.eval_every, ">= 1 when eval_every > 0"),
        ("optim.lr", cfg.optim.lr, cfg.optim.lr > 0, "> 0"),
        ("drivers.beta_growth", cfg.drivers.beta_growth, cfg.drivers.beta_growth > 0, "> 0"),
        (
            "drivers.harder_at",
            cfg.drivers.harder_at,
            0 <= cfg.drivers.harder_at <= cfg.steps,
            "in [0 (never), steps]",
        ),
        (
            "mechanism_batches",
            cfg.mechanism_batches,
            cfg.mechanism_batches >= 0,
            ">= 0 (0: no mechanism check)",
        ),
        # a full-length response alone would exceed every micro-batch: the budget bounds nothing
        (
            "engine.micro_batch_tokens",
            cfg.engine.micro_batch_tokens,
            None in (cfg.engine.micro_batch_tokens, r.max_new_tokens)
            or cfg.engine.micro_batch_tokens > r.max_new_tokens,
            f"> rollout.max_new_tokens = {r.max_new_tokens} (one whole sequence: its prompt and "
            "a full-length response), or null",
        ),
    ]
    for key, value, ok, valid in checks:
        if not ok:
            raise _bad(key, value, valid)
    if cfg.engine.sampler != "hf" and cfg.drivers.beta_growth != 1.0:
        why = "its β is the engine's own, not a σ that can grow"
        raise _bad(
            "drivers.beta_growth",
            cfg.drivers.beta_growth,
            f"1.0 with engine.sampler={cfg.engine.sampler} ({why})",
        )
    if cfg.drivers.harder_at:  # the harder task's kwargs against the task's builder
        if not cfg.drivers.harder:
            raise _bad(
                "drivers.harder",
                {},
                "the task kwargs that make it harder, e.g. "
                "{max_number: 20}, when drivers.harder_at > 0",
            )
        _check_node(TASKS, OmegaConf.merge(cfg.task, cfg.drivers.harder), "task")
    check_prereg(OmegaConf.to_container(cfg.prereg, resolve=True))  # the preset's endpoints
    spec = cfg.model.spec
    if spec == "task-model":
        from harness.tasks.warmstart import RECIPES, resolve_recipe

        if cfg.task.name not in RECIPES:
            raise ValueError(task_model_mismatch(cfg.task, tuple(RECIPES)))
        resolve_recipe(cfg.task.name, **OmegaConf.to_container(cfg.model.warmstart, resolve=True))
    elif spec not in BUILTIN_SPECS and not Path(spec).is_dir() and "/" not in spec:
        raise _bad(
            "model.spec",
            spec,
            f"task-model, {', '.join(BUILTIN_SPECS)}, a local HF folder "
            "or a Hugging Face hub id (org/name)",
        )
    elif Path(spec).is_dir() and not (Path(spec) / "config.json").exists():
        raise _bad(
            "model.spec",
            spec,
            "a Hugging Face model folder (it has no config.json; "
            "`python -m harness.base.models export <spec> <folder>` writes one)",
        )
    misplaced = sorted({"aggregation", *AGGREGATION_KEYS} & set(cfg.objective))
    if misplaced:
        raise ValueError(
            f"objective.{misplaced[0]} is the aggregation group's: set aggregation=<name> and "
            f"aggregation.{'|'.join(AGGREGATION_KEYS)}=<value> instead"
        )
    if cfg.engine.trainer_fp8 and cfg.noise.name != "fp8":
        raise ValueError(
            f"engine.trainer_fp8=true runs the trainer in the sampler's FP8 recipe, but "
            f"noise={cfg.noise.name!r}; valid: noise=fp8 (or engine.trainer_fp8=false)"
        )
    check_objective(cfg)


def check_objective(cfg: DictConfig) -> None:
    """What the objective declares it needs of the run (harness.objectives.core.Objective): a
    teacher exactly when it distils, the aggregation group only where it aggregates, a shadow
    pass that can tell the two precisions apart when it calibrates, and a run long enough."""
    name = cfg.objective.name
    aggregation = OmegaConf.to_container(cfg.aggregation, resolve=True)
    obj = train_objective(cfg)
    if cfg.distill.enabled != obj.needs_teacher:
        want = str(obj.needs_teacher).lower()
        if obj.needs_teacher:
            why = f"distils from a teacher (inputs={obj.inputs!r}); valid: distill.enabled={want}"
        else:
            why = (
                f"has no use for a teacher (inputs={obj.inputs!r}); valid: distill.enabled="
                f"{want}, or a distillation objective (inputs='logits', e.g. opsd_fkl)"
            )
        raise ValueError(
            f"distill.enabled={str(cfg.distill.enabled).lower()} with objective={name}, which {why}"
        )
    if not obj.aggregated and aggregation != {"name": "token-mean"}:
        raise ValueError(
            f"aggregation={aggregation} with objective={name}, which reduces its own loss "
            "(aggregated=False); valid: the default token-mean"
        )
    if obj.calibrations(cfg.steps):
        check_shadow_pass(cfg, name)
    obj.check(cfg.steps)


def check_shadow_pass(cfg: DictConfig, name: str) -> None:
    """An objective that calibrates on a high-precision shadow pass can calibrate: its two
    ratios differ, and π_θ has moved where it calibrates (the last minibatch)."""
    a = cfg.alpha
    if cfg.engine.logp_old_source == "trainer" and not cfg.engine.trainer_fp8:
        raise ValueError(
            f"objective={name} calibrates the low-precision π_old against the trainer's "
            "high-precision recompute, but engine.logp_old_source='trainer' makes them the same "
            "tensor (the calibration would see no difference); set engine.logp_old_source="
            "sampler or engine.trainer_fp8=true (the full FP8 pipeline)"
        )
    if a.minibatches == 1 and a.staleness == 0:
        raise ValueError(
            f"objective={name} with alpha.minibatches=1 and alpha.staleness=0: π_θ = "
            "π_old on every minibatch it could calibrate on, so the high-precision ratio is "
            "identically 1 and α_low ≡ 0; valid: alpha.minibatches ≥ 2 or alpha.staleness ≥ 1"
        )


def task_model_mismatch(task: DictConfig, recipe_tasks: tuple[str, ...]) -> str:
    """Why model=task-model cannot train `task`: a task model is trained from scratch for one
    built-in task (its recipe); a dataset needs a real model. A missing dataset file is named
    too, so that one run finds both."""
    msg = (
        f"task={task.name} with model=task-model (the default): a task model is trained only "
        f"for {', '.join(recipe_tasks)}; task={task.name} needs a real model: "
        "model.spec=<a Hugging Face folder or hub id>, e.g. model=smollm2-135m"
    )
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
        raise ValueError(
            f"engine.fsdp=False with {world} ranks; valid: true or null (ranks "
            "shard the trainer with FSDP2), or one rank"
        )
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
        (
            "objective.adaptive",
            cfg.objective.get("adaptive"),
            bool(cfg.objective.get("adaptive")),
            "false (its refresh pass is one process's)",
        ),
        (
            "noise.deterministic",
            False,
            bool(fresh),
            "true (fresh draws follow the batch layout, which the ranks split)",
        ),
        (
            "noise",
            "batch",
            "batch" in [n["name"] for n in noise_nodes(cfg)],
            "a noise that does not depend on which rows share the batch",
        ),
    ]
    for key, value, bad, valid in unsupported:
        if bad:
            raise ValueError(f"{key}={value!r} with {world} ranks; valid: {valid}")
