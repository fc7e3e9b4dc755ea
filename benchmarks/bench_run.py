"""Whole-run wall time: the default 300-step countdown run (or any run: `--overrides`), today's
code vs an earlier revision.

    python -m benchmarks.bench_run --before 328f94f --steps 300 --threads 1
    python -m benchmarks.bench_run --before a8af88e --steps 6 --out results/bench/run_smollm2.json \
        --overrides experiment=smollm2_clip_confirm seed=0      # the SmolLM2 FP8 step

Both sides run `python -m harness.train <overrides> steps=<n> seed=<s>` (this venv; the earlier
revision from a `git worktree` of it) at the same time, one thread each, so they see the same
machine load; `--pairs` repeats that. Reports each side's wall time, their ratio, the median
rollout, update and step time of the steps after the first (the first evaluates), and whether
every metric of every step is identical (timings aside); where not, the first step and metric
that differ. Writes results/bench/run.json.
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

import numpy as np
import torch

from benchmarks.common import ROOT, command, machine, write_json

# eval_n=256, 24 tokens, no mechanism check: settings an earlier revision runs too (it may lack
# the fixed 512-problem eval set, the task's own token budget, mechanism.json), so both sides do
# the same work
COUNTDOWN = ["task=countdown", "eval_n=256", "rollout.max_new_tokens=24", "++mechanism_batches=0"]
TIMES = ("time/rollout_s", "time/update_s", "time/step_s")


def start(
    cwd: Path, out: Path, overrides: list[str], steps: int, seed: int, threads: int
) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "harness.train",
        *overrides,
        f"steps={steps}",
        f"seed={seed}",
        "progress=false",
        f"out={out}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(cwd)}
    return subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )


def rows(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def metrics(run: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows(run)]


def step_times(run: Path) -> dict:
    """The median of each of TIMES over the steps after the first (NaN where not logged)."""
    later = rows(run)[1:]
    return {
        k: float(np.median([r[k] for r in later])) if later and k in later[0] else np.nan
        for k in TIMES
    }


def first_difference(a: list[dict], b: list[dict]) -> dict | None:
    """The first step (row) and metric where two runs' metrics differ, with both values; None
    when every metric of every step is identical (NaN equals NaN). A metric one side lacks
    counts as a difference (its value None)."""
    if len(a) != len(b):
        return {"row": min(len(a), len(b)), "key": "(rows)", "before": len(a), "after": len(b)}
    for i, (r, q) in enumerate(zip(a, b)):
        for k in sorted(r.keys() | q.keys()):
            x, y = r.get(k), q.get(k)
            if not (x == y or (x != x and y != y)):
                return {"row": i, "key": k, "before": x, "after": y}
    return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", default="328f94f", help="the revision to compare against")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--pairs", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="results/bench/run.json")
    ap.add_argument("--overrides", nargs="*", default=COUNTDOWN, help="the run's Hydra overrides")
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
                    k: start(cwd, outs[k], a.overrides, a.steps, a.seed, a.threads)
                    for k, cwd in (("before", tree), ("after", ROOT))
                }
                wall = {}
                while len(wall) < 2:
                    for k, p in procs.items():
                        if k not in wall and p.poll() is not None:
                            if p.returncode:
                                raise SystemExit(f"{k} run failed:\n{p.stderr.read()[-3000:]}")
                            wall[k] = time.perf_counter() - t0
                    time.sleep(0.2)
                times = {k: step_times(outs[k]) for k in outs}
                diff = first_difference(metrics(outs["before"]), metrics(outs["after"]))
                row = {
                    **wall,
                    "ratio_after_over_before": wall["after"] / wall["before"],
                    "step_medians": times,
                    "metrics_identical": diff is None,
                    "first_difference": diff,
                }
                pairs.append(row)
                print(
                    f"pair {i}: before ({rev}) {wall['before']:.1f} s, after ({head}) "
                    f"{wall['after']:.1f} s: after/before = {row['ratio_after_over_before']:.3f}; "
                    f"metrics identical: {row['metrics_identical']}",
                    flush=True,
                )
                if diff is not None:
                    print(f"  first difference: {diff}")
                for k in TIMES:
                    b, f = times["before"][k], times["after"][k]
                    print(f"  median {k}: before {b:.2f} s, after {f:.2f} s, ratio {f / b:.3f}")
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
        "run": f"python -m harness.train {' '.join(a.overrides)} steps={a.steps} seed={a.seed}",
        "threads": a.threads,
        "concurrent": True,
        "machine": machine(),
        "versions": {"torch": torch.__version__},
        "pairs": pairs,
    }
    write_json(a.out, report)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
