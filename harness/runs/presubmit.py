"""A sweep is checked on the driver before anything is submitted: every point of the sweep is
composed as its job will be and run through the checks a training run makes before it builds a
model (`harness.runs.validate.validate`: every key, value and swept node, and the dataset itself,
which `task=hf` reads in seconds). A bad value in one point then fails the sweep in seconds on the
login node, naming the point, instead of queueing an array of GPU jobs that each fail.

Installed as a Hydra callback by hydra/launcher=slurm (and slurm_gpu): `on_multirun_start`
runs on the driver only, before the launcher calls sbatch. The local launcher
(hydra_plugins/ratiolab_launcher) runs `check_points` on its jobs before it starts any.
"""

from __future__ import annotations

from typing import Any

from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict

from harness.base.registry import build
from harness.runs.access import task_spec
from harness.runs.validate import validate
from harness.tasks import TASKS


def sweep_points(config: DictConfig) -> list[list[str]]:
    """The override lists of the sweep's jobs, as Hydra's basic sweeper expands them: the
    preset's `hydra.sweeper.params`, then the command line's overrides (the later wins)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

    # unresolved: an override may hold an interpolation only a job resolves (out=${hydra:...})
    params = config.hydra.sweeper.get("params")
    params = OmegaConf.to_container(params, resolve=False) if params else {}
    task = OmegaConf.to_container(config.hydra.overrides.task, resolve=False)
    overrides = [*(f"{k}={v}" for k, v in params.items()), *task]
    parsed = OverridesParser.create().parse_overrides(overrides)
    return BasicSweeper.split_arguments(parsed, None)[0]


def check_point(config: DictConfig, overrides: list[str]) -> None:
    """One sweep point composed as its job will be, checked as `harness.train` checks a run
    before any model is built, and its task built (a dataset that is not there fails here)."""
    loader = GlobalHydra.instance().config_loader()
    job = loader.load_sweep_config(config, overrides)
    with open_dict(job):
        del job["hydra"]
    validate(job)
    name, kw, _ = task_spec(job)
    build(TASKS, name, "task", **kw)


def check_points(config: DictConfig, points: list[list[str]], nothing: str) -> None:
    """Every point of a `harness.train` sweep checked (`check_point`) before any is launched;
    SystemExit naming the first bad point and that `nothing` (e.g. "was submitted") happened.
    Sweeps of other entry points pass (harness.measure checks its own)."""
    if config.hydra.job.config_name != "train":
        return
    for i, overrides in enumerate(points):
        try:
            check_point(config, overrides)
        except Exception as e:  # noqa: BLE001 — any failure stops the whole sweep
            # SystemExit: Hydra turns a callback's exceptions into warnings and goes on
            raise SystemExit(
                f"[presubmit] sweep point {i + 1} of {len(points)} ({' '.join(overrides)}): "
                f"{type(e).__name__}: {e}. Nothing {nothing}."
            ) from None
    print(f"[presubmit] {len(points)} sweep points checked", flush=True)


class PreSubmitCheck(Callback):
    """Every sweep point checked before submission (see the module docstring)."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        if config.hydra.job.config_name != "train":  # harness.measure checks its own
            return
        try:
            points = sweep_points(config)
        except Exception as e:  # noqa: BLE001 — fail closed: an unchecked sweep is not submitted
            raise SystemExit(
                f"[presubmit] could not expand the sweep: {type(e).__name__}: {e}. "
                "Nothing was submitted."
            ) from None
        check_points(config, points, "was submitted")
