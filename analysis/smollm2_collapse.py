"""Figure and per-run events: reject vs clamp (the SNR post §2, seed 001) on SmolLM2-135M-Instruct
with the FP8 block W8A8 sampler: the pilot (experiment=smollm2_collapse_pilot, one seed) and the
confirmatory sweep (experiment=smollm2_collapse_confirm, seeds 710–713), each where its
summary.csv exists.

python -m analysis.smollm2_collapse [--results DIR]   # reads results/<experiment>/summary.csv

Besides the figure it writes events.csv: for every run (complete or not) the collapse and
entropy-guard events (analysis.events), how close it came to them (`margins`), the escalation
of the deleted mass (mask_frac: the band's out-of-band tokens; clamp deletes nothing) and of
the out-of-band share of the ratio, and the held-out accuracy at the first and last evaluation.
"""

from __future__ import annotations

import pandas as pd

from analysis.collapse_reject_vs_clamp import draw
from analysis.events import collapse, entropy_guard, escalation, guard_or_collapse, margins
from analysis.runs import results_root, run_head, summaries, write_run_table

FP8 = "FP8 block W8A8 E4M3 μ"
EXPERIMENTS = {  # experiment -> (its sampler μ, what it is), for its title
    "smollm2_collapse_pilot": (FP8, "PILOT, one seed"),
    "smollm2_collapse_confirm": (FP8, "CONFIRMATORY, seeds 710–713"),
    "smollm2_collapse_dose_pilot": ("MXFP8 E4M3 W8A8 μ (FLOOR scales)", "PILOT, one seed"),
}


def events(df: pd.DataFrame) -> pd.DataFrame:
    """One row per run: how far it got, its events, margins and escalations."""
    rows = []
    for _, g in df.groupby("run", sort=True):
        evals = g.dropna(subset=["eval_acc"]).sort_values("step")
        row = {
            **run_head(g),
            "collapse": collapse(g)[0],
            "entropy_guard": entropy_guard(g)[0],
            "guard_or_collapse": guard_or_collapse(g)[0],
            **margins(g),
            "eval_first": evals.eval_acc.iloc[0] if len(evals) else float("nan"),
            "eval_last": evals.eval_acc.iloc[-1] if len(evals) else float("nan"),
        }
        for col in ("mask_frac", "dial_out_of_band_frac"):
            row[f"{col}_slope_per_100"], row[f"{col}_fold"] = escalation(g, col)
        rows.append(row)
    return pd.DataFrame(rows)


def main(argv: list[str] | None = None) -> None:
    root = results_root(argv)
    for exp, (mu, what), raw in summaries(root, EXPERIMENTS):
        write_run_table(root, exp, "events.csv", events(raw))
        title = (
            f"SmolLM2-135M-Instruct, {mu}, folded ratio π_θ/μ, band [0.5, 2], "
            f"2 minibatches, lr 3e-6, word problems ({what})"
        )
        draw(root, exp, title)


if __name__ == "__main__":
    main()
