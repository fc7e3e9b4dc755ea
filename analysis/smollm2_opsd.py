"""Figure and per-run loops: clipped vs exact forward KL in on-policy self-distillation (OPSD §4,
seed 003) on SmolLM2-135M-Instruct: the pilot (experiment=smollm2_opsd_pilot, one seed), each
experiment where its summary.csv exists.

python -m analysis.smollm2_opsd [--results DIR]   # reads results/<experiment>/summary.csv

Besides the figure it writes loops.csv: for every run (complete or not) the loop event and the
terminal-loop rate over the last 20% of its steps (analysis.events.loops), the exit-mass ratio
at first-copy positions and the response length over the same tail, and the first 10 steps'
loop rate beside it (where the run started).
"""

from __future__ import annotations

import pandas as pd

from analysis.events import WINDOW, loops, tail_mean
from analysis.opsd_repetition import draw
from analysis.runs import results_root, run_head, summaries, write_run_table

EXPERIMENTS = {  # experiment -> what its title says it is
    "smollm2_opsd_pilot": "PILOT, one seed",
}


def loop_table(df: pd.DataFrame) -> pd.DataFrame:
    """One row per run: how far it got, its loops at the start and over the tail."""
    rows = []
    for _, g in df.groupby("run", sort=True):
        event, rate = loops(g)
        rows.append(
            {
                **run_head(g),
                "loops": event,
                "terminal_loop_rate_tail": rate,
                "terminal_loop_rate_first10": g[
                    g.step <= WINDOW
                ].repetition_terminal_loop_rate.mean(),
                "repetition_rate_tail": tail_mean(g, "repetition_rate"),
                "exit_mass_ratio_tail": tail_mean(g, "repetition_exit_mass_ratio"),
                "response_len_tail": tail_mean(g, "response_len"),
            }
        )
    return pd.DataFrame(rows)


def main(argv: list[str] | None = None) -> None:
    root = results_root(argv)
    for exp, what, raw in summaries(root, EXPERIMENTS):
        write_run_table(root, exp, "loops.csv", loop_table(raw))
        title = (
            "OPSD on SmolLM2-135M-Instruct (teacher: the initial model + reference solution), "
            f"T = 1.1, top-128, 128 tokens, word problems ({what})"
        )
        draw(root, exp, title)


if __name__ == "__main__":
    main()
