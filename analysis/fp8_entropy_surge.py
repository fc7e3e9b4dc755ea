"""Figure: entropy surge, clip on π_θ/μ with π_old := μ (Calibrated Clipping, arXiv 2609.22870).

python -m analysis.fp8_entropy_surge [--results DIR]   # reads results/<exp>/summary.csv
"""

from __future__ import annotations

from analysis.common import set_theme
from analysis.panels import panel_row
from analysis.runs import load_summary, results_root, smooth

EXP = "fp8_entropy_surge"
PANELS = [  # column, title, y label
    ("entropy_mean", "Policy entropy (5-step mean)", "entropy (nats/token)"),
    ("reward_mean", "Training reward (5-step mean)", "mean reward"),
    ("eval_acc", "Held-out accuracy", "accuracy (fixed 512-problem set)"),
    ("clip_frac_low", "Mechanism: A<0 clipped at 1−ε", "fraction of tokens"),
]


def main(argv: list[str] | None = None) -> None:
    root = results_root(argv)
    df = load_summary(root, EXP)
    df = smooth(df[df.complete], ["entropy_mean", "reward_mean", "clip_frac_low"])
    set_theme()
    title = "Student-t (ν=3, σ=0.5) logit noise in μ (FP8 stand-in), countdown task model"
    panel_row(df, PANELS, "optimizer step", title, root, EXP, legend_on=(0, len(PANELS) - 1))


if __name__ == "__main__":
    main()
