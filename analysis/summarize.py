"""Reduce raw training run folders to the committed `results/<experiment>/summary.csv`.

    python -m analysis.summarize collapse_reject_vs_clamp fp8_entropy_surge ...  [--results DIR]
                                 [force=true]


Per-step rows (run × step, selected metrics, arm/seed/config columns); runs that did not reach
their configured `steps` are kept and flagged `complete = False` (the figures drop them). Beside
it: `mechanism.csv` (every run's step-0 mechanism check, one row per run, mechanism-only runs
included) and `prereg.yaml` (the pre-registration the runs were made under; runs that disagree
on it are an error, not a merge).

Nothing is replaced silently: without `force=true` it refuses, naming the runs, when the raw
runs are not one experiment (`analysis.runs.config_problems`: a key that differs although no
sweep varied it, duplicate runs) or when the new summary.csv would drop runs the one on disk
has (a toy sweep summarised into a folder of committed results).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pandas as pd
import yaml

from analysis.claims import EXPERIMENTS as CLAIMED
from analysis.runs import config_problems, load_mechanism, load_prereg, load_raw
from harness.base.io import write_text_atomic

EXPERIMENTS = [*CLAIMED, "alpha_calibration"]  # every experiment with training runs


def refusals(root: Path, exp: str, df: pd.DataFrame) -> list[str]:
    """Why summarising `exp` would lose or misread results (empty: safe to write)."""
    problems = config_problems(root, exp)
    out = root / exp / "summary.csv"
    if out.exists():
        dropped = sorted(set(pd.read_csv(out, usecols=["run"]).run) - set(df.run))
        if dropped:
            problems.append(
                f"{out} holds {len(dropped)} runs that have no run folder here "
                f"(e.g. {dropped[0]}): the new summary would drop them"
            )
    return problems


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("experiments", nargs="*", default=EXPERIMENTS)
    p.add_argument("--results", default=os.environ.get("RATIOLAB_RESULTS", "results"))
    a = p.parse_intermixed_args(argv)
    force = "force=true" in a.experiments
    exps = [e for e in a.experiments if not e.startswith("force=")] or EXPERIMENTS
    root = Path(a.results)
    for exp in exps:
        df = load_raw(root, exp)
        if df.empty:
            print(f"[summarize] {exp}: no runs")
            continue
        problems = refusals(root, exp, df)
        if problems and not force:
            raise SystemExit(
                f"[summarize] {exp}: refused, nothing written:\n  - "
                + "\n  - ".join(problems)
                + "\nMove the stray runs out, or pass force=true to write the summary anyway."
            )
        mech = load_mechanism(root, exp)
        if not mech.empty:
            csv = mech.to_csv(index=False, float_format="%.5g")
            write_text_atomic(root / exp / "mechanism.csv", csv)
        prereg = load_prereg(root, exp)
        if prereg:
            write_text_atomic(root / exp / "prereg.yaml", yaml.safe_dump(prereg, sort_keys=False))
        last = df.groupby("run").step.transform("max")
        df["complete"] = last >= df.steps
        out = root / exp / "summary.csv"
        write_text_atomic(out, df.to_csv(index=False, float_format="%.5g"))
        n = df.groupby("run").complete.first()
        print(f"[summarize] {exp}: {n.sum()} complete / {len(n)} runs → {out}")


if __name__ == "__main__":
    main()
