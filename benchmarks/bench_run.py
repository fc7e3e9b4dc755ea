"""Whole-run wall time: the default 300-step countdown run, today's code vs an earlier revision.

    python -m benchmarks.bench_run --before 328f94f --steps 300 --threads 1

Both sides run `python -m harness.train task=countdown seed=<s>` (this venv; the earlier
revision from a `git worktree` of it) at the same time, one thread each, so they see the same
machine load; `--pairs` repeats that. Reports each side's wall time, their ratio, and whether
every metric of every step is identical (time/step_s aside). Writes results/bench/run.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import ROOT, command, write_json


def start(cwd: Path, out: Path, steps: int, seed: int, threads: int) -> subprocess.Popen:
    # eval_n=256, 24 tokens, no mechanism check: settings an earlier revision runs too (it may
    # lack the fixed 512-problem eval set, the task's own token budget, mechanism.json), so both
    # sides do the same work
    cmd = [
        sys.executable,
        "-m",
        "harness.train",
        "task=countdown",
        f"steps={steps}",
        f"seed={seed}",
        "eval_n=256",
        "rollout.max_new_tokens=24",
        "++mechanism_batches=0",
        "progress=false",
        f"out={out}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(cwd)}
    return subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )


def metrics(run: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k != "time/step_s"} for r in rows]


def same(a: list[dict], b: list[dict]) -> bool:
    def eq(x, y):
        return x == y or (x != x and y != y)  # NaN == NaN

    return len(a) == len(b) and all(
        r.keys() == q.keys() and all(eq(r[k], q[k]) for k in r) for r, q in zip(a, b)
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", default="328f94f", help="the revision to compare against")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--pairs", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="results/bench/run.json")
    a = ap.parse_args()
    rev = subprocess.run(
        ["git", "rev-parse", "--short", a.before],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    pairs = []
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "before"
        subprocess.run(
            ["git", "worktree", "add", "--detach", str(tree), rev],
            cwd=ROOT,
            check=True,
            capture_output=True,
        )
        try:
            for i in range(a.pairs):
                outs = {"before": Path(tmp) / f"{i}-before", "after": Path(tmp) / f"{i}-after"}
                t0 = time.perf_counter()
                procs = {
                    "before": start(tree, outs["before"], a.steps, a.seed, a.threads),
                    "after": start(ROOT, outs["after"], a.steps, a.seed, a.threads),
                }
                wall = {}
                while len(wall) < 2:
                    for k, p in procs.items():
                        if k not in wall and p.poll() is not None:
                            if p.returncode:
                                raise SystemExit(f"{k} run failed:\n{p.stderr.read()[-3000:]}")
                            wall[k] = time.perf_counter() - t0
                    time.sleep(0.2)
                row = {
                    **wall,
                    "ratio_after_over_before": wall["after"] / wall["before"],
                    "metrics_identical": same(metrics(outs["before"]), metrics(outs["after"])),
                }
                pairs.append(row)
                print(
                    f"pair {i}: before ({rev}) {wall['before']:.1f} s, after ({head}) "
                    f"{wall['after']:.1f} s: after/before = {row['ratio_after_over_before']:.3f}; "
                    f"metrics identical: {row['metrics_identical']}",
                    flush=True,
                )
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT)
    report = {
        "command": command(),
        "before": rev,
        "after": head
        + (
            " + working tree"
            if subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=ROOT).returncode
            else ""
        ),
        "run": f"python -m harness.train task=countdown steps={a.steps} seed={a.seed} eval_n=256 "
        "rollout.max_new_tokens=24 ++mechanism_batches=0",
        "threads": a.threads,
        "concurrent": True,
        "pairs": pairs,
    }
    write_json(a.out, report)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
