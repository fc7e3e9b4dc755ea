"""Figure and per-run shape: Calibrated Clipping's entropy surge (seed 002 §3) on SmolLM2-135M-
Instruct with the FP8 block W8A8 sampler: the pilot (experiment=smollm2_surge_pilot, one seed) and
the confirmatory sweep (experiment=smollm2_clip_confirm, seeds 600–605), each where its
summary.csv exists.

python -m analysis.smollm2_clip [--results DIR]   # reads results/<experiment>/summary.csv

Besides the figure it writes shape.csv: for every run (complete or not) the healthy phase (the
largest rise of the 10-step mean training reward over its steps 1–10 mean, and the step where
it peaked), the surge, healthy-surge and stall events (analysis.events) and the held-out
accuracy at the first and last evaluation, so the seed's shape — trains, then fails — is
reported per run whatever the verdict.
"""

from __future__ import annotations

import pandas as pd

from analysis.common import set_theme
from analysis.events import WINDOW, healthy_rise, healthy_surge, running_mean, stall, surge
from analysis.panels import panel_row
from analysis.runs import results_root, run_head, smooth, summaries, write_run_table

EXPERIMENTS = {  # experiment -> what its title says it is
    "smollm2_surge_pilot": "PILOT, one seed",
    "smollm2_clip_confirm": "CONFIRMATORY, seeds 600–605",
}
PANELS = [  # column, title, y label
    ("entropy_mean", "Policy entropy (5-step mean)", "entropy (nats/token)"),
    ("reward_mean", "Training reward (5-step mean)", "mean reward"),
    ("eval_acc", "Held-out accuracy", "accuracy (fixed 128-problem set)"),
    ("response_len", "Response length (5-step mean)", "tokens"),
    # not registered: how the failure degenerated here (every confirmatory failure run looped)
    ("repetition_terminal_loop_rate", "Terminal loops (5-step mean)", "share of responses"),
    ("clip_frac_low", "Mechanism: A<0 clipped at 1−ε", "fraction of tokens"),
]


def shape(df: pd.DataFrame) -> pd.DataFrame:
    """One row per run: how far it got, its healthy phase and its events."""
    rows = []
    for _, g in df.groupby("run", sort=True):
        r = running_mean(g, "reward_mean")
        evals = g.dropna(subset=["eval_acc"]).sort_values("step")
        s_event, s_at = surge(g)
        h_event, h_at = healthy_surge(g)
        rows.append(
            {
                **run_head(g),
                "healthy_rise": healthy_rise(g),
                "healthy_peak_step": float(r.idxmax()) if r.notna().any() else float("nan"),
                "surge": s_event,
                "surge_at": s_at,
                "healthy_surge": h_event,
                "healthy_surge_at": h_at,
                "stall": stall(g)[0],
                "eval_first": evals.eval_acc.iloc[0] if len(evals) else float("nan"),
                "eval_last": evals.eval_acc.iloc[-1] if len(evals) else float("nan"),
                "eval_last_step": int(evals.step.iloc[-1]) if len(evals) else -1,
                "entropy_first10": g[g.step <= WINDOW].entropy_mean.mean(),
                "entropy_last10": g[g.step > g.step.max() - WINDOW].entropy_mean.mean(),
            }
        )
    return pd.DataFrame(rows)


def main(argv: list[str] | None = None) -> None:
    root = results_root(argv)
    for exp, what, raw in summaries(root, EXPERIMENTS):
        write_run_table(root, exp, "shape.csv", shape(raw))
        df = smooth(raw, [c for c, _, _ in PANELS if c != "eval_acc"])
        set_theme()
        title = (
            "SmolLM2-135M-Instruct, FP8 block W8A8 E4M3 μ, 2 minibatches, lr 3e-6, word problems "
            f"({what})"
        )
        panel_row(df, PANELS, "optimizer step", title, root, exp, legend_on=(0,))


if __name__ == "__main__":
    main()
