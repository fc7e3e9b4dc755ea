"""A Slurm sweep is checked point by point on the driver before sbatch: a bad value in one point
fails in seconds naming the point, and sbatch (a fake one on PATH, recording its calls) is never
called; a good sweep reaches it."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = ["model=tiny-llama", "++task.digits=1", "steps=2", "progress=false"]


def _sweep(tmp_path, *overrides):
    """The driver with a fake sbatch (recording its calls, then failing) and a fake srun on PATH
    (submitit's executor looks for srun before it submits): no Slurm cluster is needed."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, body in [
        ("sbatch", f"echo called >> {tmp_path}/sbatch-calls\nexit 1"),
        ("srun", "exit 1"),
    ]:
        fake = bin_dir / name
        fake.write_text(f"#!/bin/sh\n{body}\n")
        fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "OMP_NUM_THREADS": "1"}
    args = ["-m", "hydra/launcher=slurm", *TINY, f"hydra.sweep.dir={tmp_path}/sweep", *overrides]
    r = subprocess.run(
        [sys.executable, "-m", "harness.train", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return r, (tmp_path / "sbatch-calls").exists()


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["rollout.group_size=4,1"],
            "sweep point 2 of 2 (.*rollout.group_size=1.*): ValueError: "
            "rollout.group_size=1; valid",
        ),
        (
            ["task=hf", "~task.digits", "task.path=nope.jsonl,also-missing.parquet"],
            "sweep point 1 of 2 .*task.path='nope.jsonl': not a file or folder here",
        ),
        (["seed=0,1", "objective.eps_hgh=0.3"], "sweep point 1 of 2 .*eps_hgh"),
    ],
)
def test_a_bad_sweep_point_never_reaches_sbatch(tmp_path, overrides, message):
    r, submitted = _sweep(tmp_path, *overrides)
    assert r.returncode != 0 and not submitted
    assert "Nothing was submitted" in r.stderr
    assert re.search(message, r.stderr), r.stderr[-2000:]
    assert not (tmp_path / "sweep").exists()


def test_a_good_sweep_reaches_sbatch(tmp_path):
    r, submitted = _sweep(tmp_path, "rollout.group_size=2,4")
    assert "[presubmit] 2 sweep points checked" in r.stdout and submitted
