"""Figure: collapse under heavy-tailed β — reject vs clamp vs trust vs shrink (SNR post §4).

python -m analysis.collapse_reject_vs_clamp [--results DIR]   # reads results/<exp>/summary.csv
"""

from __future__ import annotations

from pathlib import Path

from analysis.panels import trajectories
from analysis.runs import results_root

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
    trajectories(root, exp, PANELS, title)


def main(argv: list[str] | None = None) -> None:
    title = "Student-t (ν=3, σ=0.5) logit noise in μ, countdown task model"
    draw(results_root(argv), EXP, title)


if __name__ == "__main__":
    main()
