"""The local launcher (hydra/launcher=local, the default for -m sweeps): one run per core."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# evaluation off: these test the launcher; test_train runs the default
TINY = [
    "model=tiny-llama",
    "++task.digits=1",
    "rollout.prompts_per_step=2",
    "rollout.group_size=4",
    "rollout.max_new_tokens=6",
    "eval_n=4",
    "eval_every=0",
    "progress=false",
    "steps=2",
]


def _sweep(tmp_path, *overrides):
    cmd = [sys.executable, "-m", "harness.train", "-m", *TINY, f"hydra.sweep.dir={tmp_path}"]
    return subprocess.run([*cmd, *overrides], cwd=ROOT, capture_output=True, text=True)


@pytest.mark.slow
def test_a_sweep_runs_each_job_in_a_one_thread_worker(tmp_path):
    """Three jobs, two workers: every run completes in its own directory, in a worker process
    (not the driver), computing with one intra-op thread."""
    r = _sweep(tmp_path, "seed=0,1,2", "hydra.launcher.n_jobs=2")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "3 jobs, 2 at a time × 1 thread(s)" in r.stderr + r.stdout
    assert "[presubmit] 3 sweep points checked" in r.stdout
    metas = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("*/meta.json"))]
    assert len(metas) == 3
    for m in metas:
        assert m["status"] == "completed" and m["last_step"] == 2
        assert m["attempts"][-1]["threads"] == 1


APP = """
import json, os, time
import hydra

@hydra.main(version_base="1.3", config_path=None, config_name=None)
def main(cfg):
    import torch

    t0 = time.time()
    with open(os.path.join(cfg.out, f"{cfg.i}.pid"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(cfg.get("sleep", 4.0))
    rec = {"pid": os.getpid(), "t0": t0, "t1": time.time(), "threads": torch.get_num_threads(),
           "omp": os.environ.get("OMP_NUM_THREADS")}
    with open(os.path.join(cfg.out, f"{cfg.i}.json"), "w") as f:
        json.dump(rec, f)
    if cfg.i == cfg.fail:
        raise RuntimeError(f"job {cfg.i} failed on purpose")

if __name__ == "__main__":
    main()
"""


@pytest.mark.slow
@pytest.mark.parametrize("n_jobs,threads", [(2, 1), (1, 2)])
def test_jobs_run_n_at_a_time_with_their_threads(tmp_path, n_jobs, threads):
    """A 4-s job twice: with n_jobs=2 the two run at once in two workers, with n_jobs=1 one
    after the other; each computes with `threads` intra-op threads and OMP_NUM_THREADS set."""
    (tmp_path / "app.py").write_text(APP)
    cmd = [
        sys.executable,
        "app.py",
        "-m",
        "hydra/launcher=local",
        "+i=0,1",
        "+fail=-1",
        f"+out={tmp_path}",
        f"hydra.sweep.dir={tmp_path}/sweep",
        f"hydra.launcher.n_jobs={n_jobs}",
        f"hydra.launcher.threads={threads}",
    ]
    r = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    a, b = (json.loads((tmp_path / f"{i}.json").read_text()) for i in (0, 1))
    overlap = min(a["t1"], b["t1"]) - max(a["t0"], b["t0"])
    # overlap > 1 s of 4: the workers start their jobs within 3 s of each other (torch import)
    assert (a["pid"] != b["pid"] and overlap > 1.0) if n_jobs == 2 else overlap < 0
    assert a["threads"] == b["threads"] == threads and a["omp"] == str(threads)


@pytest.mark.slow
def test_a_failing_job_fails_the_sweep_and_the_others_still_run(tmp_path):
    (tmp_path / "app.py").write_text(APP)
    cmd = [
        sys.executable,
        "app.py",
        "-m",
        "hydra/launcher=local",
        "+i=0,1",
        "+fail=0",
        f"+out={tmp_path}",
        f"hydra.sweep.dir={tmp_path}/sweep",
    ]
    r = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode != 0 and "job 0 failed on purpose" in r.stderr
    assert (tmp_path / "1.json").exists()


def test_bad_launcher_settings_fail_before_any_run(tmp_path):
    r = _sweep(tmp_path, "seed=0", "hydra.launcher.n_jobs=0")
    assert r.returncode != 0
    assert "hydra.launcher.n_jobs=0: must be >= 1" in r.stderr
    assert not list(tmp_path.glob("*/meta.json"))


def test_a_bad_sweep_point_fails_the_sweep_before_any_run(tmp_path):
    """Every point is checked before any runs (harness.runs.presubmit.check_points, as before
    sbatch): one worker would run point 1 first, but point 2's group_size=1 fails the sweep
    first, naming it, and point 1 leaves no run folder."""
    r = _sweep(tmp_path, "rollout.group_size=4,1", "hydra.launcher.n_jobs=1")
    assert r.returncode != 0
    assert re.search(
        r"sweep point 2 of 2 \(.*rollout.group_size=1.*\): ValueError: rollout.group_size=1; "
        r"valid.*Nothing was launched",
        r.stderr,
    ), r.stderr[-2000:]
    assert [p.name for p in tmp_path.iterdir()] == ["multirun.yaml"]  # Hydra's, before launch


@pytest.mark.slow
def test_killing_the_driver_stops_its_workers(tmp_path):
    """SIGKILL the sweep's driver while its jobs run: the workers die with it (no orphaned runs
    competing for the cores)."""
    import signal
    import time

    (tmp_path / "app.py").write_text(APP)
    cmd = [
        sys.executable,
        "app.py",
        "-m",
        "hydra/launcher=local",
        "+i=0,1",
        "+fail=-1",
        "+sleep=60",
        f"+out={tmp_path}",
        f"hydra.sweep.dir={tmp_path}/sweep",
    ]
    driver = subprocess.Popen(cmd, cwd=tmp_path, stderr=subprocess.DEVNULL)
    pids = [tmp_path / f"{i}.pid" for i in (0, 1)]
    deadline = time.time() + 60
    while not all(p.exists() for p in pids) and time.time() < deadline:
        time.sleep(0.2)
    workers = [int(p.read_text()) for p in pids]
    driver.send_signal(signal.SIGKILL)
    driver.wait()

    def running(pid):  # a zombie (terminated, not yet reaped by init) counts as gone
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            return False

    deadline = time.time() + 20  # well under the jobs' 60 s
    while any(running(p) for p in workers) and time.time() < deadline:
        time.sleep(0.2)
    alive = [p for p in workers if running(p)]
    assert not alive, f"workers {alive} outlived the driver"
