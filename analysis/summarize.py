"""Reduce raw training run folders to the committed `results/<experiment>/summary.csv`.

    python -m analysis.summarize collapse_reject_vs_clamp fp8_entropy_surge ...  [--results DIR]

Per-step rows (run × step, selected metrics, arm/seed/config columns); runs that did not reach
their configured `steps` are kept and flagged `complete = False` (the figures drop them). Beside
it: `mechanism.csv` (every run's step-0 mechanism check, one row per run, mechanism-only runs
included) and `prereg.yaml` (the pre-registration the runs were made under; runs that disagree
on it are an error, not a merge).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import yaml

from analysis.claims import EXPERIMENTS as CLAIMED
from analysis.runs import load_mechanism, load_prereg, load_raw
from harness.io import write_text_atomic

EXPERIMENTS = [*CLAIMED, "alpha_calibration"]  # every experiment with training runs


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("experiments", nargs="*", default=EXPERIMENTS)
    p.add_argument("--results", default=os.environ.get("RATIOLAB_RESULTS", "results"))
    a = p.parse_args(argv)
    for exp in a.experiments:
        root = Path(a.results)
        mech = load_mechanism(root, exp)
        if not mech.empty:
            csv = mech.to_csv(index=False, float_format="%.5g")
            write_text_atomic(root / exp / "mechanism.csv", csv)
        prereg = load_prereg(root, exp)
        if prereg:
            write_text_atomic(root / exp / "prereg.yaml", yaml.safe_dump(prereg, sort_keys=False))
        df = load_raw(root, exp)
        if df.empty:
            print(f"[summarize] {exp}: no runs")
            continue
        last = df.groupby("run").step.transform("max")
        df["complete"] = last >= df.steps
        out = Path(a.results) / exp / "summary.csv"
        write_text_atomic(out, df.to_csv(index=False, float_format="%.5g"))
        n = df.groupby("run").complete.first()
        print(f"[summarize] {exp}: {n.sum()} complete / {len(n)} runs → {out}")


if __name__ == "__main__":
    main()
