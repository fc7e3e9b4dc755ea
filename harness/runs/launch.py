"""What a task needs to be robust under Slurm.

Inside a job (`train.main`, `measure.main`):

    @hydra.main(...)
    def main(cfg):
        return run_task(run, cfg)

`run_task` resolves the run directory (`cfg.out`, made absolute), checks the config before any
compute (`check`: the swept-axis nodes against their builders, or the task's own validation), then
records `meta.json` (git SHA and dirty flag, package versions, host, Slurm job / array ids, start
and end time, status): a config refused there or by the resume contract (`RefusedRerun`) leaves
the folder's record as it was (a finished run stays `completed`). On an
exception writes the traceback to `<run>/traceback.txt` and stderr and attaches it to the
exception (`add_note`), because Hydra and submitit hand the driver the exception without its
traceback. Requeued jobs re-run the task from the top in the same directory: the task resumes from
its own checkpoints; `meta.json` keeps one entry per attempt.

On the driver, the `SlurmGuard` Hydra callback (`hydra/launcher=slurm` installs it) caps
submitit's sacct poll interval, so a job killed outside Python (SIGKILL, OOM, node loss) fails
the sweep within ~15 s; on an abnormal exit it names the runs that did not complete and cancels
the Slurm jobs of the sweep that are still queued or running.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import importlib.metadata
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, read_write

from harness.base.io import RefusedRerun, write_json_atomic, write_text_atomic
from harness.runs.presubmit import sweep_points
from harness.runs.validate import check_nodes

T = TypeVar("T")
PACKAGES = (
    "torch",
    "transformers",
    "hydra-core",
    "omegaconf",
    "submitit",
    "hydra-submitit-launcher",
)
SLURM_ENV = {
    "job_id": "SLURM_JOB_ID",
    "array_job_id": "SLURM_ARRAY_JOB_ID",
    "array_task_id": "SLURM_ARRAY_TASK_ID",
    "restart_count": "SLURM_RESTART_COUNT",
    "node": "SLURMD_NODENAME",
}
__all__ = ["run_task", "update_meta", "SlurmGuard", "SweepAxes"]


def _now() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


# --- run record --------------------------------------------------------------------------------


REPO = Path(__file__).resolve().parents[2]


def git_state(repo: Path = REPO) -> dict[str, Any]:
    """{"sha", "dirty"} of the checkout holding this package; None where git or .git is absent."""

    def git(*args: str) -> str:
        # --no-optional-locks: reading status must not rewrite the index under a running edit
        cmd = ["git", "--no-optional-locks", "-C", str(repo), *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=True).stdout

    try:
        sha = git("rev-parse", "HEAD").strip()
        dirty = bool(git("status", "--porcelain", "--untracked-files=no").strip())
    except (OSError, subprocess.SubprocessError):
        return {"sha": None, "dirty": None}
    return {"sha": sha, "dirty": dirty}


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": sys.version.split()[0]}
    for p in PACKAGES:
        try:
            out[p] = importlib.metadata.version(p)
        except importlib.metadata.PackageNotFoundError:
            out[p] = None
    return out


def slurm_ids() -> dict[str, str] | None:
    ids = {k: os.environ[v] for k, v in SLURM_ENV.items() if v in os.environ}
    if not ids:
        return None
    # the id sacct, squeue and submitit print: <array job id>_<task id> for array tasks
    array = "array_job_id" in ids and "array_task_id" in ids
    ids["job"] = f"{ids['array_job_id']}_{ids['array_task_id']}" if array else ids.get("job_id", "")
    return ids


def update_meta(run: str | Path, **fields: Any) -> dict[str, Any]:
    """Merge `fields` into `<run>/meta.json` (atomic); returns the merged record."""
    path = Path(run) / "meta.json"
    meta = read_json(path)
    meta.update(fields)
    write_json_atomic(path, meta)
    return meta


def read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


# --- the task wrapper --------------------------------------------------------------------------


def run_dir(cfg: DictConfig) -> Path:
    """`cfg.out` when set, else Hydra's output directory; absolute."""
    out = cfg.get("out")
    if out is None:
        from hydra.core.hydra_config import HydraConfig

        out = HydraConfig.get().runtime.output_dir
    return Path(str(out)).absolute()


def adopt_hydra_record(run: Path, keep: bool = True) -> None:
    """With out=<dir>, Hydra still makes its own output folder for the job's record (.hydra):
    move the record into the run folder (`keep`: rank 0 only) and leave no folder behind."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return
    hydra_dir = Path(HydraConfig.get().runtime.output_dir).absolute()
    if hydra_dir == run:
        return
    if keep and (hydra_dir / ".hydra").is_dir():
        shutil.copytree(hydra_dir / ".hydra", run / ".hydra", dirs_exist_ok=True)
        shutil.rmtree(hydra_dir / ".hydra")
    with contextlib.suppress(OSError):  # not empty: someone else's files stay
        hydra_dir.rmdir()


def checkpoint_step(path: Path) -> int:
    """N of a checkpoint `step_N.pt` (a file) or `step_N` (a sharded run's folder)."""
    return int(path.stem[len("step_") :])


def checkpoints(run: Path) -> list[Path]:
    """The run's regular checkpoints (files, or folders of a sharded run), newest first (abort
    checkpoints and temp folders are not among them)."""
    return sorted((run / "checkpoints").glob("step_*"), key=lambda p: -checkpoint_step(p))


def stopped_line(run: Path) -> str:
    """One line for a run a person interrupted: its last logged step, its last checkpoint, and
    how to go on (rerunning the same command resumes from the checkpoint)."""
    lines = (
        (run / "metrics.jsonl").read_text().split("\n") if (run / "metrics.jsonl").exists() else []
    )
    steps = [json.loads(ln)["step"] for ln in lines if ln.startswith("{") and ln.endswith("}")]
    saved = checkpoints(run)
    done = f"after step {steps[-1]}" if steps else "before its first step"
    if not saved:
        return f"[launch] interrupted {done} in {run}; no checkpoint yet: a rerun starts over"
    return (
        f"[launch] interrupted {done} in {run}; rerun the same command to resume from the "
        f"checkpoint of step {checkpoint_step(saved[0])}"
    )


def run_task(
    fn: Callable[[DictConfig], T],
    cfg: DictConfig,
    check: Callable[[DictConfig], None] = check_nodes,
) -> T:
    """Run `fn(cfg)` as one recorded task in its run directory (see the module docstring), after
    `check(cfg)`. Sets `cfg.out` to the absolute run directory before calling `fn`."""
    run = run_dir(cfg)
    run.mkdir(parents=True, exist_ok=True)
    if "out" in cfg:
        cfg.out = str(run)
    from harness.base.distributed import environment

    if environment().rank != 0:  # rank 0 keeps the run's record
        adopt_hydra_record(run, keep=False)
        check(cfg)
        return fn(cfg)
    adopt_hydra_record(run)
    check(cfg)  # before the attempt is recorded: a refused rerun leaves the run's meta.json as is
    attempt = {
        "start_time": _now(),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "slurm": slurm_ids(),
        "threads": _threads(),  # intra-op threads this run computed with
    }
    before = (run / "meta.json").read_text() if (run / "meta.json").exists() else None
    previous = read_json(run / "meta.json").get("attempts", [])
    if previous and "status" not in previous[-1]:  # it never finished: killed (SIGKILL, OOM)
        previous[-1] = {**previous[-1], "status": "lost", "end_time": None}
    meta = {
        **attempt,
        "run_dir": str(run),
        "git": git_state(),
        "versions": versions(),
        "overrides": _overrides(),
        "status": "running",
        "end_time": None,
        "error": None,
        "attempts": [*previous, attempt],
    }
    update_meta(run, **meta)
    job = f" (slurm job {_job_label(attempt['slurm'])})" if attempt["slurm"] else ""
    where = f"run {run}{job}"
    print(f"[launch] {where}", file=sys.stderr, flush=True)
    (run / "traceback.txt").unlink(missing_ok=True)
    t0 = time.time()
    try:
        result = fn(cfg)
    except RefusedRerun:  # nothing ran: the folder's record stays the finished run's
        if before is None:
            (run / "meta.json").unlink(missing_ok=True)
        else:
            write_text_atomic(run / "meta.json", before)
        raise
    except Exception as e:
        tb = traceback.format_exc()
        (run / "traceback.txt").write_text(tb)
        # Hydra prints the exception with its notes once; under Slurm the driver receives it
        # without its traceback (submitit pickles it), so the note carries the traceback there
        note = f"[launch] task failed in {where}; traceback in {run}/traceback.txt"
        if attempt["slurm"]:
            note += f":\n{tb}"
        _finish(run, attempt, "failed", t0, error=f"{type(e).__name__}: {e}")
        _attach(e, note)
        raise
    except BaseException as e:  # SystemExit from submitit's requeue handler, KeyboardInterrupt
        _finish(run, attempt, "interrupted", t0, error=type(e).__name__)
        if isinstance(e, KeyboardInterrupt) and not attempt["slurm"]:  # a person pressed ^C
            print(stopped_line(run), file=sys.stderr, flush=True)
            raise SystemExit(130) from None  # the shell's code for ^C, without the traceback
        raise
    _finish(run, attempt, "completed", t0)
    return result


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def _overrides() -> list[str]:
    """The run's Hydra overrides (what distinguishes it in its sweep), or argv outside Hydra."""
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        return list(HydraConfig.get().overrides.task)
    return sys.argv[1:]


def _job_label(ids: dict[str, str]) -> str:
    return ids.get("job") or "?"


def _finish(run: Path, attempt: dict, status: str, t0: float, error: str | None = None) -> None:
    attempt.update(end_time=_now(), status=status)
    meta = read_json(run / "meta.json")  # the task may have written its own keys meanwhile
    attempts = meta.get("attempts") or [attempt]
    attempts[-1] = attempt
    update_meta(
        run,
        status=status,
        end_time=attempt["end_time"],
        wall_s=round(time.time() - t0, 1),
        error=error,
        attempts=attempts,
        **{k: attempt[k] for k in ("host", "pid", "slurm")},
    )


def _attach(e: BaseException, note: str) -> None:
    if hasattr(e, "add_note"):  # Python >= 3.11: printed after the driver's traceback
        e.add_note(note)
    else:
        e.args = (f"{e.args[0] if e.args else ''}\n{note}", *e.args[1:])


# --- the driver side ---------------------------------------------------------------------------


class SlurmGuard(Callback):
    """Hydra callback for submitit sweeps (driver side; a no-op inside jobs).

    - caps submitit's sacct poll interval at `poll_s` (default growth: up to 600 s) and its wait
      for a dead job's result file at `result_wait_s` (15 s), so a killed job fails the driver
      within ~poll_s + result_wait_s;
    - on an abnormal driver exit (a failed or killed run, SIGTERM, Ctrl-C): prints the runs of
      this sweep that did not complete (from their meta.json) and `scancel`s the sweep's jobs that
      are still pending or running.
    """

    def __init__(self, poll_s: float = 5.0, result_wait_s: int = 5, cancel_on_abort: bool = True):
        self.poll_s = poll_s
        self.result_wait_s = result_wait_s
        self.cancel_on_abort = cancel_on_abort
        self._sweep_dir: str | None = None
        self._submitit_folder = ""
        self._t0 = 0.0
        self._done = False

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        from submitit.slurm.slurm import SlurmJob

        SlurmJob.watcher._delay_s = min(SlurmJob.watcher._delay_s, self.poll_s)
        SlurmJob._results_timeout_s = min(SlurmJob._results_timeout_s, self.result_wait_s)
        self._sweep_dir = str(config.hydra.sweep.dir)
        self._submitit_folder = str(config.hydra.launcher.get("submitit_folder", ""))
        self._t0 = time.time()
        atexit.register(self._on_exit)
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            # default SIGTERM skips atexit; SystemExit unwinds the driver and runs it
            signal.signal(signal.SIGTERM, _exit_on_signal)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        self._done = True

    def _on_exit(self) -> None:
        if self._done or self._sweep_dir is None:
            return
        bad = []
        for meta_path in sorted(Path(self._sweep_dir).glob("**/meta.json")):
            m = read_json(meta_path)
            if m.get("status") != "completed" and meta_path.stat().st_mtime >= self._t0 - 1:
                job = _job_label(m["slurm"]) if m.get("slurm") else "-"
                line = f"  {meta_path.parent}  status={m.get('status')}  slurm job {job}"
                bad.append(line + (f"  {m['error']}" if m.get("error") else ""))
        if bad:
            print("[launch] runs that did not complete:\n" + "\n".join(bad), file=sys.stderr)
        if self.cancel_on_abort:
            self._cancel()

    def _cancel(self) -> None:
        """scancel the sweep's array tasks still queued or running whose result file does not
        exist yet (a task that has written its result is finishing: leave it COMPLETED)."""
        from submitit.slurm.slurm import SlurmJob

        arrays = sorted({j.split("_")[0] for j in SlurmJob.watcher._registered})
        if not arrays:
            return
        q = subprocess.run(
            ["squeue", "-h", "-r", "-o", "%i", "-j", ",".join(arrays)],
            capture_output=True,
            text=True,
            check=False,
        )
        live = [
            j
            for j in q.stdout.split()
            if not any(Path(self._submitit_folder.replace("%j", j)).glob("*_result.pkl"))
        ]
        if live:
            r = subprocess.run(["scancel", *live], capture_output=True, text=True, check=False)
            print(
                f"[launch] sweep aborted: scancel {' '.join(live)} (rc {r.returncode})",
                file=sys.stderr,
            )


AXES_ENV = "RATIOLAB_SWEEP_AXES"  # hydra.job.env_set key: the sweep's axes, for run_name


def sweep_axes(points: list[list[str]]) -> list[str]:
    """The keys whose value differs between a sweep's points (their override lists)."""
    values: dict[str, set[str]] = {}
    for point in points:
        for override in point:
            key, _, value = override.partition("=")
            values.setdefault(key.lstrip("+~"), set()).add(value)
    return sorted(key for key, seen in values.items() if len(seen) > 1)


class SweepAxes(Callback):
    """Run folders named by what tells a sweep's points apart (train.yaml installs it; a no-op
    outside `-m`): on the driver, before any job is composed, the keys the sweep varies become
    `hydra.job.env_set.RATIOLAB_SWEEP_AXES` of every job (a Hydra override, which the launchers
    re-apply to each job's config), and `harness.runs.config.run_name` keeps their items whole in
    a long folder name, hashing the rest. Only the driver sees the whole sweep: a job's own
    overrides do not say which of its keys the sweep varied."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        axes = sweep_axes(sweep_points(config))
        if axes:
            with read_write(config.hydra.overrides):
                override = f"++hydra.job.env_set.{AXES_ENV}='{','.join(axes)}'"
                config.hydra.overrides.hydra.append(override)


def _exit_on_signal(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)
