"""Sweeps on a real Slurm cluster (with accounting) through `hydra/launcher=slurm`, and the task
wrapper `harness.runs.launch.run_task` they rely on.

The `slurm` tests need the single-node cluster of `scripts/slurm/up.sh` (CI starts it; here the
fixture starts it when root, and stops what it started). They are skipped with the reason where
Slurm cannot run (not root, no apt/dpkg, no cgroup file system). Each sweep is a tiny
`harness.train` configuration (tiny-llama, 2 prompts × 2 samples × 4 tokens per step).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from harness.runs.launch import run_task

REPO = Path(__file__).resolve().parents[1]
UP, DOWN = REPO / "scripts/slurm/up.sh", REPO / "scripts/slurm/down.sh"
TINY = {
    "model.spec": "tiny-llama",
    "rollout.prompts_per_step": 2,
    "rollout.group_size": 2,
    "rollout.max_new_tokens": 4,
    "eval_n": 4,
    "eval_every": 0,  # off: these test the launcher; evaluation runs in test_train's defaults
    "checkpoint_every": 1,
    "progress": "false",
}
LAUNCHER = [
    "hydra/launcher=slurm",
    "hydra.launcher.cpus_per_task=1",
    "hydra.launcher.mem_gb=2",
    "hydra.launcher.timeout_min=5",  # <= 10 min: submitit treats every USR2 as a timeout
]


# --- the cluster -------------------------------------------------------------------------------


def _cluster_up() -> bool:
    if not shutil.which("sinfo"):
        return False
    ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True)
    acct = subprocess.run(["sacct", "-n", "-X", "-S", "now-1minute"], capture_output=True)
    return "UP" in ping.stdout and acct.returncode == 0


def _cannot_run() -> str | None:
    if sys.platform != "linux":
        return "Slurm tests need Linux (scripts/slurm/up.sh starts a cluster there)"
    if os.geteuid() != 0:
        return "no running Slurm cluster, and starting one (scripts/slurm/up.sh) needs root"
    if not shutil.which("apt-get") or not shutil.which("dpkg-query"):
        return "no running Slurm cluster, and scripts/slurm/up.sh needs Debian's apt-get"
    if not os.path.isdir("/sys/fs/cgroup") or not os.listdir("/sys/fs/cgroup"):
        return (
            "no running Slurm cluster, and /sys/fs/cgroup is not mounted: the slurmd of "
            "scripts/slurm/up.sh cannot run here"
        )
    return None


@pytest.fixture(scope="module")
def cluster():
    started = False
    if not _cluster_up():
        reason = _cannot_run()
        if reason:
            pytest.skip(reason)
        r = subprocess.run(["bash", str(UP)], capture_output=True, text=True, timeout=900)
        if r.returncode != 0:
            pytest.fail(f"scripts/slurm/up.sh failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
        started = True
    yield
    if started:
        subprocess.run(["bash", str(DOWN)], capture_output=True, timeout=120)


def driver(sweep_dir: Path, *overrides: str, **tiny) -> list[str]:
    """`python -m harness.train -m` on the cluster; runs land in sweep_dir/<override_dirname>."""
    fixed = {**TINY, **tiny}
    return [
        sys.executable,
        "-m",
        "harness.train",
        "-m",
        *LAUNCHER,
        f"hydra.sweep.dir={sweep_dir}",
        "hydra.sweep.subdir=${hydra.job.override_dirname}",
        "out=${hydra:runtime.output_dir}",
        f"hydra.job.config.override_dirname.exclude_keys=[out,{','.join(fixed)}]",
        *(f"{k}={v}" for k, v in fixed.items()),
        *overrides,
    ]


def env() -> dict[str, str]:
    # inherited SLURM_* variables (pytest itself inside an allocation) break sbatch
    return {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}


def run_driver(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=timeout)


def meta(run: Path) -> dict:
    try:
        return json.loads((run / "meta.json").read_text())
    except (OSError, ValueError):
        return {}


def sacct_state(job: str) -> str:
    r = subprocess.run(
        ["sacct", "-n", "-X", "-P", "-j", job, "-o", "JobID,State"], capture_output=True, text=True
    )
    states = dict(ln.split("|", 1) for ln in r.stdout.splitlines() if "|" in ln)
    return states.get(job, "")


def final_state(job: str, timeout: float = 60) -> str:
    """The job's state once sacct records its end. The driver can return (submitit has read the
    result pickle) while the job is still RUNNING or COMPLETING in accounting."""
    unfinished = ("", "PENDING", "RUNNING", "COMPLETING")
    wait_for(
        f"sacct to record the end of {job}", lambda: sacct_state(job) not in unfinished, timeout
    )
    return sacct_state(job)


def stop(proc: subprocess.Popen, *runs: Path) -> None:
    """After a failed check: stop the driver and cancel the runs' jobs (the cluster is shared)."""
    if proc.poll() is None:
        proc.kill()
        jobs = [meta(r).get("slurm", {}).get("job") for r in runs]
        subprocess.run(["scancel", *filter(None, jobs)], capture_output=True)


def wait_for(what: str, cond, timeout: float, proc: subprocess.Popen | None = None):
    t0 = time.time()
    while time.time() - t0 < timeout:
        v = cond()
        if v:
            return v
        if proc is not None and proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"driver exited ({proc.returncode}) before {what}:\n{out}\n{err}")
        time.sleep(0.5)
    pytest.fail(f"timed out after {timeout} s waiting for {what}")


# --- (a) a sweep completes; every run's meta.json has a job id sacct knows ---------------------


@pytest.mark.slurm
def test_sweep_completes_and_sacct_knows_every_job(cluster, tmp_path):
    r = run_driver(driver(tmp_path, "seed=0,1", "objective=ppo_clip,cispo", steps=4), 300)
    assert r.returncode == 0, r.stdout + r.stderr
    runs = sorted(p.parent for p in tmp_path.glob("*/meta.json"))
    names = [p.name for p in runs]
    assert names == [f"objective={o},seed={s}" for o in ("cispo", "ppo_clip") for s in (0, 1)]
    for run in runs:
        m = meta(run)
        assert m["status"] == "completed" and m["end_time"], m
        job = m["slurm"]["job"]  # <array job id>_<task id>
        assert final_state(job) == "COMPLETED", (job, sacct_state(job))
        assert m["versions"]["submitit"] and "git" in m
        steps = [json.loads(ln)["step"] for ln in (run / "metrics.jsonl").read_text().splitlines()]
        assert steps == [1, 2, 3, 4]
        assert OmegaConf.load(run / "config.yaml").out == str(run)


# --- (b) a job killed with SIGKILL fails the driver within 60 s, naming it -------------------


@pytest.mark.slurm
def test_killed_job_fails_the_driver_fast_and_cancels_the_rest(cluster, tmp_path):
    cmd = driver(tmp_path, "seed=0,1", steps=5000)
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        victim, other = tmp_path / "seed=0", tmp_path / "seed=1"
        m = wait_for("job 0 to start", lambda: meta(victim).get("pid") and meta(victim), 240, proc)
        job = m["slurm"]["job"]
        os.kill(m["pid"], signal.SIGKILL)  # like the OOM killer: no Python cleanup, no result
        t_kill = time.time()
        out, err = proc.communicate(timeout=60)
        elapsed = time.time() - t_kill
    finally:
        stop(proc, victim, other)
    text = out + err
    assert proc.returncode != 0, text
    assert elapsed < 60, f"driver took {elapsed:.0f} s after the kill"
    assert job in text and "state: FAILED" in text, text
    assert "runs that did not complete" in text and str(victim) in text, text
    # the abort cancelled the rest of the array
    other_job = meta(other).get("slurm", {}).get("job") or job.split("_")[0] + "_1"
    wait_for(
        f"{other_job} cancelled",
        lambda: sacct_state(other_job).startswith(("CANCELLED", "COMPLETED")),
        30,
    )
    assert sacct_state(other_job).startswith("CANCELLED")


# --- a bad value in one sweep point: nothing reaches the cluster -----------------------------


@pytest.mark.slurm
def test_a_bad_sweep_point_is_refused_before_anything_is_submitted(cluster, tmp_path):
    # the jobs the driver would submit carry Hydra's job name; the cluster's own probe (--wrap,
    # from up.sh) can reach accounting late, and a sliding -S window drops old jobs mid-test
    since = time.strftime("%Y-%m-%dT%H:%M:%S")
    r = run_driver(driver(tmp_path, "advantage=grpo,bogus", steps=2), 120)
    assert r.returncode != 0 and "Nothing was submitted" in r.stderr, r.stdout + r.stderr
    assert "advantage='bogus'" in r.stderr and not list(tmp_path.glob("*/meta.json"))
    time.sleep(2)  # accounting lags submission by about a second
    rows = subprocess.run(
        ["sacct", "-n", "-X", "-P", "-o", "JobID,JobName,Submit", "-S", since],
        capture_output=True,
        text=True,
    ).stdout.split()
    new = [row for row in rows if row.split("|")[1] == "train" and row.split("|")[2] >= since]
    assert new == []  # no job, not even the good point's


# --- (c) a task that raises: traceback in the driver's output and in its run dir -------------


@pytest.mark.slurm
def test_task_traceback_reaches_driver_and_run_dir(cluster, tmp_path):
    # a value every check before submission accepts (harness.runs.presubmit) and training rejects:
    # lr 1e39 is inf in fp32, so the first step's weights are non-finite and the run aborts
    r = run_driver(
        driver(tmp_path, "optim.lr=0.0001,1e+39", steps=2, **{"guard.max_nonfinite": 1}), 300
    )
    text = r.stdout + r.stderr
    assert r.returncode != 0, text
    bad = tmp_path / "optim.lr=1e+39"
    # the traceback from inside the job: frames of the task (harness/train.py), not the driver's
    frame = 'harness/train.py", line'
    assert "Traceback (most recent call last)" in text and frame in text and "in run" in text, text
    assert "consecutive steps with a non-finite" in text and f"{bad}/traceback.txt" in text, text
    tb = (bad / "traceback.txt").read_text()
    assert frame in tb and "in run" in tb and "TrainingAborted" in tb
    m = meta(bad)
    assert m["status"] == "failed" and m["error"].startswith("TrainingAborted"), m
    # Slurm's view: the job itself ran fine (and the driver's abort did not cancel finished jobs);
    # accounting can lag the driver by a few seconds when the task fails fast
    assert final_state(m["slurm"]["job"]) == "COMPLETED"
    assert meta(tmp_path / "optim.lr=0.0001")["status"] == "completed"


# --- (d) scancel --signal=USR2 requeues the task and it resumes from its checkpoint -----------


@pytest.mark.slurm
@pytest.mark.slow
def test_usr2_requeues_and_resumes_from_checkpoint(cluster, tmp_path):
    steps = 60
    cmd = driver(tmp_path, "seed=0", steps=steps)
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        run = tmp_path / "seed=0"
        ck = run / "checkpoints"
        wait_for(
            "a checkpoint at step >= 3", lambda: len(list(ck.glob("step_*.pt"))) >= 2, 240, proc
        )
        job = meta(run)["slurm"]["job"]
        subprocess.run(["scancel", "--signal=USR2", job], check=True)
        out, err = proc.communicate(timeout=400)
    finally:
        stop(proc, run)
    text = out + err
    assert proc.returncode == 0, text
    m = meta(run)
    assert m["status"] == "completed" and len(m["attempts"]) == 2, m
    assert 0 < m["resumed_from_step"] < steps, m  # the second attempt started from a checkpoint
    logged = [json.loads(ln)["step"] for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert logged == list(range(1, steps + 1))  # no gap, no duplicate across the requeue


# --- run_task without a cluster -----------------------------------------------------------------


def test_run_task_records_meta(tmp_path):
    cfg = OmegaConf.create({"out": str(tmp_path / "run"), "noise": {"name": "none"}})
    assert run_task(lambda c: c.out, cfg) == str(tmp_path / "run")
    m = meta(tmp_path / "run")
    assert m["status"] == "completed" and m["end_time"] and len(m["attempts"]) == 1
    assert {"torch", "transformers", "hydra-core", "submitit"} <= set(m["versions"])
    assert {"sha", "dirty"} == set(m["git"]) and m["host"] and m["pid"] == os.getpid()
    run_task(lambda c: None, cfg)  # a re-run (requeue) adds an attempt
    assert len(meta(tmp_path / "run")["attempts"]) == 2


def test_run_task_failure_writes_traceback_and_attaches_it(tmp_path, capsys, monkeypatch):
    """The traceback goes to traceback.txt; locally the error is printed once (by Hydra, with a
    short note); under Slurm the note carries the traceback, which submitit would lose."""

    def boom(c):
        raise RuntimeError("step 3 exploded")

    cfg = OmegaConf.create({"out": str(tmp_path)})
    with pytest.raises(RuntimeError, match="step 3 exploded") as e:
        run_task(boom, cfg)
    note = "\n".join(getattr(e.value, "__notes__", []))
    assert "traceback.txt" in note and "in boom" not in note
    assert "in boom" in (tmp_path / "traceback.txt").read_text()
    assert "in boom" not in capsys.readouterr().err  # not printed a second and third time
    m = meta(tmp_path)
    assert m["status"] == "failed" and m["error"] == "RuntimeError: step 3 exploded"
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    with pytest.raises(RuntimeError) as e:
        run_task(boom, cfg)
    assert "in boom" in "\n".join(e.value.__notes__)


def test_a_killed_attempt_is_recorded_as_lost(tmp_path):
    cfg = OmegaConf.create({"out": str(tmp_path)})
    run_task(lambda c: None, cfg)
    m = meta(tmp_path)
    m["attempts"].append({"start_time": "t", "host": "h", "pid": 1, "slurm": {}})  # SIGKILLed
    m["status"] = "running"
    (tmp_path / "meta.json").write_text(json.dumps(m))
    run_task(lambda c: None, cfg)
    statuses = [a["status"] for a in meta(tmp_path)["attempts"]]
    assert statuses == ["completed", "lost", "completed"]


def test_run_task_checks_nodes_before_compute(tmp_path):
    called = []
    cfg = OmegaConf.create({"out": str(tmp_path), "objective": {"name": "cispo", "eps": 0.2}})
    with pytest.raises(TypeError, match="unknown argument"):
        run_task(called.append, cfg)
    assert not called and not (tmp_path / "meta.json").exists()  # refused: nothing recorded


def test_an_interrupted_run_says_where_it_stopped_in_one_line(tmp_path, capsys):
    """^C: one line (last step, last checkpoint, how to resume), exit code 130, no traceback;
    the record says interrupted."""

    def two_steps_then_ctrl_c(c):
        (tmp_path / "checkpoints").mkdir()
        (tmp_path / "checkpoints" / "step_2.pt").write_bytes(b"")
        lines = [json.dumps({"step": s}) for s in (1, 2, 3)]
        (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
        raise KeyboardInterrupt

    cfg = OmegaConf.create({"out": str(tmp_path)})
    with pytest.raises(SystemExit) as e:
        run_task(two_steps_then_ctrl_c, cfg)
    assert e.value.code == 130 and e.value.__cause__ is None
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == (
        f"[launch] interrupted after step 3 in {tmp_path}; rerun the same command to resume "
        "from the checkpoint of step 2"
    )
    assert meta(tmp_path)["status"] == "interrupted"
