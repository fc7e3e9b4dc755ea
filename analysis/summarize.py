"""Reduce raw training run folders to the committed `results/<experiment>/summary.csv`.

    python -m analysis.summarize collapse_reject_vs_clamp fp8_entropy_surge ...  [--results DIR]

Per-step rows (run × step, selected metrics, arm/seed/config columns); runs that did not reach
their configured `steps` are kept and flagged `complete = False` (the figures drop them).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from analysis.runs import load_raw

EXPERIMENTS = [
    "collapse_reject_vs_clamp", "fp8_entropy_surge", "opsd_repetition", "nsr_vs_decay",
    "phase_diagram",
]  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("experiments", nargs="*", default=EXPERIMENTS)
    p.add_argument("--results", default=os.environ.get("RATIOLAB_RESULTS", "results"))
    a = p.parse_args(argv)
    for exp in a.experiments:
        df = load_raw(Path(a.results), exp)
        if df.empty:
            print(f"[summarize] {exp}: no runs")
            continue
        last = df.groupby("run").step.transform("max")
        df["complete"] = last >= df.steps
        out = Path(a.results) / exp / "summary.csv"
        df.to_csv(out, index=False, float_format="%.5g")
        n = df.groupby("run").complete.first()
        print(f"[summarize] {exp}: {n.sum()} complete / {len(n)} runs → {out}")


if __name__ == "__main__":
    main()
