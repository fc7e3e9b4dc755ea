"""Figure: collapse under heavy-tailed β — reject vs clamp vs trust vs shrink (SNR post §4).

python -m analysis.collapse_reject_vs_clamp [--results DIR]   # reads results/<exp>/summary.csv
"""

from __future__ import annotations

from pathlib import Path

from analysis.common import set_theme
from analysis.panels import panel_row
from analysis.runs import load_summary, results_root, smooth, without_aa

EXP = "collapse_reject_vs_clamp"
PANELS = [  # column, title, y label
    ("eval_acc", "Held-out accuracy", "accuracy (fixed held-out set)"),
    ("reward_mean", "Training reward (5-step mean)", "mean reward"),
    ("entropy_mean", "Policy entropy (5-step mean)", "entropy (nats/token)"),
    ("dial_out_of_band_frac", "Out-of-band ρ = π_old/μ ∉ [0.5, 2]", "fraction of tokens"),
    ("mask_frac", "Deleted mass (masked tokens)", "fraction of tokens"),
]


def draw(root: Path, exp: str, title: str) -> None:
    """The collapse figure of `exp` (this experiment, collapse_drivers or collapse_confirm: the
    same panels, each over the arms its own preset declares)."""
    df = without_aa(load_summary(root, exp), root, exp)
    runs = smooth(df[df.complete], [c for c, *_ in PANELS[1:]])
    set_theme()
    panel_row(runs, PANELS, "optimizer step", title, root, exp)


def main(argv: list[str] | None = None) -> None:
    title = "Student-t (ν=3, σ=0.5) logit noise in μ, countdown task model"
    draw(results_root(argv), EXP, title)


if __name__ == "__main__":
    main()
