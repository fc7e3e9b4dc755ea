"""Figure and per-run loops: clipped vs exact forward KL in on-policy self-distillation (OPSD §4,
seed 003) on SmolLM2-135M-Instruct: the pilot (experiment=smollm2_opsd_pilot, one seed) and the
confirmatory sweep (experiment=smollm2_opsd_confirm, seeds 810–813), each where its summary.csv
exists.

python -m analysis.smollm2_opsd [--results DIR]   # reads results/<experiment>/summary.csv

Besides the figure it writes loops.csv: for every run (complete or not) the loop event and the
terminal-loop rate over the last 20% of its steps (analysis.events.loops), the exit-mass ratio
at first-copy positions and the response length over the same tail, and the first 10 steps'
loop rate beside it (where the run started); and the exact forward KL on S_t and the student's
entropy over the first 10 steps and the tail (the clipped objective can lower its own loss
while the exact KL rises: OPSD Prop. 1).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from analysis.events import WINDOW, loops, tail_mean
from analysis.opsd_repetition import draw
from analysis.runs import results_root, run_head, summaries, write_run_table

EXPERIMENTS = {  # experiment -> what its title says it is
    "smollm2_opsd_pilot": "PILOT, one seed",
    "smollm2_opsd_confirm": "CONFIRMATORY, seeds 810–813",
}


PANELS = [  # column, title, y label
    ("repetition_terminal_loop_rate", "Terminal-loop rate (5-step mean)", "fraction of responses"),
    ("entropy_mean", "Student entropy (5-step mean)", "entropy (nats/token)"),
    ("opsd_fkl", "Exact forward KL on S_t (5-step mean)", "Σ p log(p/q), mean per token"),
    ("opsd_clipped_mass", "Teacher mass on clipped entries (d_i > τ)", "Σ p over clipped i"),
    ("response_len", "Response length (5-step mean)", "tokens"),
]


def loop_table(df: pd.DataFrame) -> pd.DataFrame:
    """One row per run: how far it got, its loop event, and each column's mean over its first
    10 steps and over the last 20% of its steps (NaN where the summary lacks the column)."""
    rows = []
    for _, g in df.groupby("run", sort=True):
        row = {**run_head(g), "loops": loops(g)[0]}
        for col in ("repetition_terminal_loop_rate", "opsd_fkl", "entropy_mean"):
            row[f"{col}_first10"] = g[g.step <= WINDOW][col].mean() if col in g else np.nan
        for col in (
            "repetition_terminal_loop_rate",
            "opsd_fkl",
            "entropy_mean",
            "repetition_rate",
            "repetition_exit_mass_ratio",
            "response_len",
        ):
            row[f"{col}_tail"] = tail_mean(g, col) if col in g else np.nan
        rows.append(row)
    return pd.DataFrame(rows)


def main(argv: list[str] | None = None) -> None:
    root = results_root(argv)
    for exp, what, raw in summaries(root, EXPERIMENTS):
        write_run_table(root, exp, "loops.csv", loop_table(raw))
        title = f"OPSD, SmolLM2-135M-Instruct, teacher + solution, T 1.1, top-128 ({what})"
        draw(root, exp, title, PANELS)


if __name__ == "__main__":
    main()
