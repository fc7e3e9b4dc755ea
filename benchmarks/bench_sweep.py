"""Sweep throughput: one 1-thread run per core vs one run at a time with every core.

    python -m benchmarks.bench_sweep --steps 60 --rounds 2

Each round launches the same 2-run sweep (`task=countdown seed=0,1`, the default training config)
through the local Hydra launcher twice, back to back: `hydra.launcher.n_jobs=<cores>
hydra.launcher.threads=1` (the default) and `n_jobs=1 threads=<cores>`, alternating which goes
first. Prints runs per hour of each and their ratio per round; writes results/bench/sweep.json.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import ROOT, command, write_json
from hydra_plugins.ratiolab_launcher import cores as launcher_cores


def sweep(n_jobs: int, threads: int, steps: int, runs: int, out: Path) -> float:
    """Wall seconds of one `runs`-run sweep into the fresh folder `out`."""
    cmd = [
        sys.executable,
        "-m",
        "harness.train",
        "-m",
        "task=countdown",
        f"steps={steps}",
        "progress=false",
        "checkpoint_every=1000",
        f"seed={','.join(map(str, range(runs)))}",
        f"hydra.launcher.n_jobs={n_jobs}",
        f"hydra.launcher.threads={threads}",
        f"hydra.sweep.dir={out}",
    ]
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="results/bench/sweep.json")
    a = ap.parse_args()
    cores = launcher_cores()
    settings = {"per_core": (cores, 1), "all_threads": (1, cores)}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            order = list(settings) if r % 2 == 0 else list(settings)[::-1]
            row = {k: sweep(*settings[k], a.steps, cores, Path(tmp) / f"{r}-{k}") for k in order}
            row["ratio_runs_per_hour"] = row["all_threads"] / row["per_core"]
            rows.append(row)
            print(
                f"round {r}: {cores} runs × {a.steps} steps — {cores} at a time × 1 thread "
                f"{row['per_core']:.1f} s, 1 at a time × {cores} threads {row['all_threads']:.1f} "
                f"s: {row['ratio_runs_per_hour']:.2f}× the runs per hour",
                flush=True,
            )
    ratios = [r["ratio_runs_per_hour"] for r in rows]
    report = {
        "command": command(),
        "cores": cores,
        "runs_per_sweep": cores,
        "steps": a.steps,
        "settings": {k: {"n_jobs": v[0], "threads": v[1]} for k, v in settings.items()},
        "rounds": rows,
        "ratio_runs_per_hour_median": statistics.median(ratios),
    }
    write_json(a.out, report)
    print(f"median: {report['ratio_runs_per_hour_median']:.2f}× the runs per hour; wrote {a.out}")


if __name__ == "__main__":
    main()
