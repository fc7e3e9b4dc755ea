"""Figure: collapse under heavy-tailed β — reject vs clamp vs trust vs shrink (SNR post §2).

python -m analysis.collapse_reject_vs_clamp [--results DIR]   # reads results/<exp>/summary.csv
"""

from __future__ import annotations

from analysis.common import set_theme
from analysis.runs import load_summary, panel_row, results_root, smooth

EXP = "collapse_reject_vs_clamp"
ARMS = ["reject (band [0.5, 2])", "reject (mask [0.5, 2])", "trust-unbounded (raw r)"]
ARMS += ["clamp (CISPO [0.5, 2])"]
ARMS += ["shrink (snr_shrink)"]
PANELS = [  # column, title, y label
    ("eval_acc", "Held-out accuracy", "accuracy (128 problems)"),
    ("reward_mean", "Training reward (5-step mean)", "mean reward"),
    ("entropy_mean", "Policy entropy (5-step mean)", "entropy (nats/token)"),
    ("dial_out_of_band_frac", "Out-of-band ρ = π_old/μ ∉ [0.5, 2]", "fraction of tokens"),
    ("mask_frac", "Deleted mass (masked tokens)", "fraction of tokens"),
]


def main(argv: list[str] | None = None) -> None:
    root = results_root(argv)
    df = load_summary(root, EXP)
    runs = smooth(df[df.complete], [c for c, *_ in PANELS[1:]])
    set_theme()
    # one figure per horizon: the 40-step four-arm grid and the long reject-vs-clamp pair
    for steps, d in runs.groupby("steps"):
        title = "Student-t (ν=3, σ=0.5) logit noise in μ, task model"
        path = root / EXP / f"fig_collapse_reject_vs_clamp_{steps}steps"
        panel_row(d, PANELS, ARMS, "optimizer step", title, path)


if __name__ == "__main__":
    main()
