"""Fault injection: SIGKILL a training run at 10 points — at random times, inside
checkpoint writes and inside metrics writes — resuming each time; the final metrics.jsonl equals
an uninterrupted run's line for line (timings aside), with no duplicated or missing step."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ARGS = [
    "model=tiny-llama",
    "++task.digits=1",
    "rollout.prompts_per_step=2",
    "rollout.group_size=4",
    "rollout.max_new_tokens=6",
    "eval_n=4",
    "eval_every=3",
    "progress=false",
    "steps=40",
    "checkpoint_every=1",
    "alpha.minibatches=2",
]

# Runs harness.train in a child that SIGKILLs itself in the middle of its k-th checkpoint
# write (half a file on disk) or k-th metrics append (half a line on disk), per FAULT=kind:k.
LAUNCHER = r"""
import os, pathlib, runpy, signal, sys
import torch
kind, k = os.environ["FAULT"].split(":")
k, n = int(k), [0]

def die():
    os.kill(os.getpid(), signal.SIGKILL)

if kind == "checkpoint":
    real_save = torch.save
    def save(obj, path, *a, **kw):
        n[0] += 1
        if n[0] == k:
            with open(path, "wb") as f:
                f.write(b"PK\x03\x04 a torn checkpoint")
            die()
        return real_save(obj, path, *a, **kw)
    torch.save = save
elif kind == "metrics":
    real_open = pathlib.Path.open
    class Torn:
        def __init__(self, f): self.f = f
        def __enter__(self): return self
        def __exit__(self, *exc): return self.f.__exit__(*exc)
        def write(self, s):
            self.f.write(s[: len(s) // 2]); self.f.flush(); die()
    def open_(self, mode="r", *a, **kw):
        f = real_open(self, mode, *a, **kw)
        if self.name == "metrics.jsonl" and mode == "a":
            n[0] += 1
            if n[0] == k:
                return Torn(f)
        return f
    pathlib.Path.open = open_
sys.argv = ["harness.train", *sys.argv[1:]]
runpy.run_module("harness.train", run_name="__main__")
"""


def child(out: Path, fault: str = "none:0") -> subprocess.Popen:
    env = {"FAULT": fault, "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    return subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, *ARGS, f"out={out}"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def lines(run: Path) -> list[str]:
    """The complete metric lines (a torn one, left by a kill, is not a step)."""
    path = run / "metrics.jsonl"
    return [ln for ln in path.read_text().splitlines() if ln.endswith("}")] if path.exists() else []


def metrics(run: Path) -> list[dict]:
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines() if ln]
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]


@pytest.mark.slow
def test_ten_sigkills_then_resume_equal_an_uninterrupted_run(tmp_path):
    ref = child(tmp_path / "ref")
    assert ref.wait(timeout=600) == 0, ref.stderr.read()[-3000:]
    rng = random.Random(0)
    faults = [
        "time",
        "checkpoint:2",
        "metrics:2",
        "time",
        "checkpoint:3",
        "metrics:3",
        "time",
        "checkpoint:2",
        "metrics:2",
        "time",
    ]
    run, survived = tmp_path / "faulty", 0
    for fault in faults:
        if fault == "time":  # one new step logged, then a random point inside the next
            n0 = len(lines(run))
            p = child(run)
            while p.poll() is None and len(lines(run)) <= n0:
                time.sleep(0.01)
            time.sleep(rng.uniform(0.0, 0.2))
            p.send_signal(signal.SIGKILL)
        else:
            p = child(run, fault)
        rc = p.wait(timeout=600)
        survived += rc == -signal.SIGKILL
        if fault != "time":  # a write fault always lands: each child makes progress before it
            assert rc == -signal.SIGKILL, (fault, p.stderr.read()[-3000:])
        assert rc in (0, -signal.SIGKILL), p.stderr.read()[-3000:]
    final = child(run)
    assert final.wait(timeout=600) == 0, final.stderr.read()[-3000:]
    print(f"\n[faults] {survived} of {len(faults)} SIGKILLs landed before the run finished")
    assert survived >= 8  # 6 write faults always land; the random-time kills almost always
    got, want = metrics(run), metrics(tmp_path / "ref")
    assert [r["step"] for r in got] == list(range(1, 41))  # no duplicated or missing step
    assert got == want
