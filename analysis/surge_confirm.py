"""Figure: the entropy surge in kind, PPO clip on π_θ/μ with π_old := μ vs π_old recomputed
(Calibrated Clipping §3, arXiv 2609.22870), the confirmatory sweep of experiment=surge_confirm.

python -m analysis.surge_confirm [--results DIR]   # reads results/surge_confirm/summary.csv
"""

from __future__ import annotations

from analysis.common import set_theme
from analysis.panels import panel_row
from analysis.runs import load_summary, results_root, smooth, without_aa

EXP = "surge_confirm"
PANELS = [  # column, title, y label
    ("entropy_mean", "Policy entropy (5-step mean)", "entropy (nats/token)"),
    ("reward_mean", "Training reward (5-step mean)", "mean reward"),
    ("eval_acc", "Held-out accuracy", "accuracy (fixed 512-problem set)"),
    ("response_len", "Response length (5-step mean)", "tokens"),
    ("clip_frac_low", "Mechanism: A<0 clipped at 1−ε", "fraction of tokens"),
]


def main(argv: list[str] | None = None) -> None:
    root = results_root(argv)
    df = without_aa(load_summary(root, EXP), root, EXP)
    df = smooth(df[df.complete], ["entropy_mean", "reward_mean", "response_len", "clip_frac_low"])
    set_theme()
    title = "Gaussian logit noise σ = 2 in μ, staleness 2, lr 4e-4, countdown task model"
    panel_row(df, PANELS, "optimizer step", title, root, EXP, legend_on=(0,))


if __name__ == "__main__":
    main()
