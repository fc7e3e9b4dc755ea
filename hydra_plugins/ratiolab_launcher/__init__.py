"""`hydra/launcher=local` (the default for `-m` sweeps): one single-threaded run per core.

Hydra's basic launcher runs a sweep's jobs one after another in the driver; this one runs them
in `n_jobs` spawned worker processes (default: every core this process may use), each with
`threads` intra-op threads (default 1: OMP_NUM_THREADS in the worker, torch.set_num_threads in
the job). benchmarks/bench_sweep.py measures it against one run at a time on every core (README →
Performance). Every job is checked before any starts, as a Slurm sweep is before sbatch
(harness.runs.presubmit.check_points): a bad value in the last point fails the sweep in seconds,
naming it, with no run begun. A job that raises later fails the sweep as with the basic
launcher, after the sweep's other jobs have run.

    python -m harness.train -m seed=0,1,2,3                         # 2 at a time on 2 cores
    python -m harness.train -m seed=0,1 hydra.launcher.n_jobs=1 hydra.launcher.threads=2
"""

import ctypes
import logging
import os
import signal
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path

import cloudpickle
from hydra.core.config_store import ConfigStore
from hydra.core.utils import JobReturn, configure_log, filter_overrides, run_job, setup_globals
from hydra.plugins.launcher import Launcher
from omegaconf import DictConfig, open_dict

from harness.runs.presubmit import check_points

log = logging.getLogger(__name__)


@dataclass
class LocalLauncherConf:
    _target_: str = "hydra_plugins.ratiolab_launcher.LocalLauncher"
    n_jobs: int | None = None  # concurrent runs; None: the cores this process may use
    threads: int = 1  # intra-op threads per run (OMP_NUM_THREADS, torch.set_num_threads)


ConfigStore.instance().store(group="hydra/launcher", name="local", node=LocalLauncherConf)


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def _init_worker(threads: int, parent: int) -> None:
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(threads)
    _die_with(parent)


def _die_with(parent: int) -> None:
    """SIGTERM this worker when the driver dies (Linux), so a killed sweep leaves no runs
    behind; a run so stopped resumes from its checkpoints when the sweep is launched again."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (AttributeError, OSError):  # not Linux: workers then finish their current job
        return
    if os.getppid() != parent:  # the driver died before the prctl
        os._exit(1)


def _run(payload: bytes) -> JobReturn:
    import torch

    hydra_context, task_function, config, threads = cloudpickle.loads(payload)
    torch.set_num_threads(threads)
    setup_globals()
    return run_job(
        hydra_context=hydra_context,
        task_function=task_function,
        config=config,
        job_dir_key="hydra.sweep.dir",
        job_subdir_key="hydra.sweep.subdir",
    )


class LocalLauncher(Launcher):
    def __init__(self, n_jobs: int | None = None, threads: int = 1) -> None:
        if n_jobs is not None and n_jobs < 1:
            raise ValueError(f"hydra.launcher.n_jobs={n_jobs}: must be >= 1 (or null: all cores)")
        if threads < 1:
            raise ValueError(f"hydra.launcher.threads={threads}: must be >= 1")
        self.n_jobs, self.threads = n_jobs or cores(), threads
        self.config = self.hydra_context = self.task_function = None

    def setup(self, *, hydra_context, task_function, config: DictConfig) -> None:
        self.config, self.hydra_context, self.task_function = config, hydra_context, task_function

    def launch(
        self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int
    ) -> Sequence[JobReturn]:
        setup_globals()
        if not job_overrides:
            return []
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        check_points(self.config, [list(o) for o in job_overrides], "was launched")
        Path(str(self.config.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)
        n = min(self.n_jobs, len(job_overrides))
        log.info(f"Launching {len(job_overrides)} jobs, {n} at a time × {self.threads} thread(s)")
        payloads = []
        for i, overrides in enumerate(job_overrides):
            idx = initial_job_idx + i
            log.info(f"\t#{idx} : {' '.join(filter_overrides(overrides))}")
            cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
            with open_dict(cfg):
                cfg.hydra.job.id = cfg.hydra.job.num = idx
            payloads.append(
                cloudpickle.dumps((self.hydra_context, self.task_function, cfg, self.threads))
            )
        ctx = get_context("spawn")  # no fork of a process whose OpenMP pool is running
        with ProcessPoolExecutor(
            n, mp_context=ctx, initializer=_init_worker, initargs=(self.threads, os.getpid())
        ) as pool:
            return list(pool.map(_run, payloads))
