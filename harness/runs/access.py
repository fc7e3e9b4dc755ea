"""Reading a composed config: the swept-axis nodes as (registry name, kwargs), μ's noise stack,
the objective it trains, the task's spec, whether the trainer is sharded, and the name a config
group's option sets. The builders (harness.rl.setup, harness.measure) read the config through
these; the checks made before compute are harness.runs.validate's."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

from harness import CONFIGS
from harness.base import distributed
from harness.objectives import Objective, run_objective

GROUP_NODES = ("task", "noise", "objective", "aggregation")  # node {name, **kwargs} = group file


def split_node(node: Any) -> tuple[str, dict[str, Any]]:
    """A swept-axis node {name, **kwargs} as (the registry key, the builder's kwargs)."""
    d = OmegaConf.to_container(node, resolve=True) if not isinstance(node, dict) else dict(node)
    if "name" not in d:
        raise ValueError(f"config node {d} needs a `name` (the registry key)")
    name = d.pop("name")
    return name, d


def train_objective(cfg: DictConfig) -> Objective:
    """The objective a run trains: its node's loss, with the aggregation group where it takes
    one (`run_objective`); what setup builds and validation asks."""
    name, kw = split_node(cfg.objective)
    return run_objective(name, kw, OmegaConf.to_container(cfg.aggregation, resolve=True))


def noise_nodes(cfg: DictConfig) -> list[dict[str, Any]]:
    """μ's injected noise: the `noise` group's node, then the `extra_noise` list (stacked in
    order); "none" nodes dropped."""
    nodes = [OmegaConf.to_container(n, resolve=True) for n in [cfg.noise, *cfg.extra_noise]]
    return [n for n in nodes if n["name"] != "none"]


def task_spec(cfg: DictConfig) -> tuple[str, dict[str, Any], dict | None]:
    """The task's registry name and kwargs (with model=task-model, the warm-start recipe's task
    kwargs under the node's) and the recipe (None for other models)."""
    from harness.tasks.warmstart import resolve_recipe

    task_name, task_kw = split_node(cfg.task)
    if cfg.model.spec != "task-model":
        return task_name, task_kw, None
    recipe = resolve_recipe(task_name, **OmegaConf.to_container(cfg.model.warmstart, resolve=True))
    return task_name, {**recipe["task_kwargs"], **task_kw}, recipe


def fsdp(cfg: DictConfig) -> bool:
    """Whether the trainer is sharded: engine.fsdp, else (null) when the world has > 1 rank."""
    if cfg.engine.fsdp is not None:
        return bool(cfg.engine.fsdp)
    return distributed.environment().world > 1


def group_option_name(group: str, option: str) -> str | None:
    """The `name` that option `option` of config group `group` sets: its file under
    experiments/, else the node harness code stored in Hydra's ConfigStore (harness.measure's
    fp8_block_w8a8); None for an option found in neither."""
    from hydra.core.config_store import ConfigStore
    from hydra.plugins.config_source import ConfigLoadError

    path = CONFIGS / group / f"{option}.yaml"
    if path.exists():
        return OmegaConf.load(path).get("name")
    try:
        return ConfigStore.instance().load(f"{group}/{option}.yaml").node.get("name")
    except ConfigLoadError:
        return None
