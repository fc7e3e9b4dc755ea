"""Figure: NSR vs hard clip vs deterministic decay vs push-zone control (NSR, arXiv 2605.22703).

python -m analysis.nsr_vs_decay [--results DIR]   # reads results/<exp>/summary.csv
"""

from __future__ import annotations

from analysis.common import set_theme
from analysis.panels import panel_row
from analysis.runs import load_summary, results_root, smooth

EXP = "nsr_vs_decay"
PANELS = [  # column, title, y label
    ("eval_acc", "Held-out accuracy", "accuracy (fixed 512-problem set)"),
    ("reward_mean", "Training reward (5-step mean)", "mean reward"),
    ("entropy_mean", "Policy entropy (5-step mean)", "entropy (nats/token)"),
    ("clip_frac", "Clipped tokens (low + high)", "fraction of tokens"),
    ("rescue_frac", "Rescued / pushed tokens", "fraction of tokens"),
]


def main(argv: list[str] | None = None) -> None:
    root = results_root(argv)
    df = load_summary(root, EXP)
    df = df[df.complete].assign(clip_frac=lambda d: d.clip_frac_low + d.clip_frac_high)
    df = smooth(df, [c for c, *_ in PANELS[1:]])
    set_theme()
    title = "Gaussian logit noise σ=0.5, π_old := μ, countdown task model"
    panel_row(df, PANELS, "optimizer step", title, root, EXP)


if __name__ == "__main__":
    main()
