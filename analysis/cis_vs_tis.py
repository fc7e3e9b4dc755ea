"""Figure: CIS (confidence-aware IS cap, arXiv 2609.32444) vs TIS (constant cap), heavy-tailed β.

python -m analysis.cis_vs_tis [--results DIR]   # reads results/<exp>/summary.csv
"""

from __future__ import annotations

from analysis.common import set_theme
from analysis.panels import panel_row
from analysis.runs import load_summary, results_root, smooth

EXP = "cis_vs_tis"
PANELS = [  # column, title, y label
    ("eval_acc", "Held-out accuracy", "accuracy (fixed 512-problem set)"),
    ("reward_mean", "Training reward (5-step mean)", "mean reward"),
    ("entropy_mean", "Policy entropy (5-step mean)", "entropy (nats/token)"),
    ("is_ess", "Mechanism: IS effective sample size", "ESS / N of the applied weight"),
    ("is_weight_mean", "Mean applied IS weight", "mean weight (kept tokens)"),
]


def main(argv: list[str] | None = None) -> None:
    root = results_root(argv)
    df = load_summary(root, EXP)
    df = smooth(df[df.complete], [c for c, *_ in PANELS[1:]])
    set_theme()
    title = "Student-t (ν=3, σ=0.5) logit noise in μ, π_old recomputed, countdown task model"
    panel_row(df, PANELS, "optimizer step", title, root, EXP)


if __name__ == "__main__":
    main()
