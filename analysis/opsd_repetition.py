"""Figure: repetition under on-policy self-distillation, clipped vs exact forward KL (OPSD §4).

python -m analysis.opsd_repetition [--results DIR]   # reads results/<exp>/summary.csv
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import seaborn as sns

from analysis.common import savefig, set_theme
from analysis.runs import curve, load_summary, results_root, smooth

EXP = "opsd_repetition"
PANELS = [  # column, title, y label
    ("repetition_terminal_loop_rate", "Terminal-loop rate (5-step mean)", "fraction of responses"),
    ("repetition_rate", "Any-repetition rate (5-step mean)", "fraction of responses"),
    ("response_len", "Response length (5-step mean)", "tokens"),
    ("eval_acc", "Held-out accuracy", "accuracy (128 problems)"),
]


def main(argv: list[str] | None = None) -> None:
    root = results_root(argv)
    df = load_summary(root, EXP)
    df = smooth(df[df.complete], [c for c, *_ in PANELS[:3]])
    set_theme()
    fig, axes = plt.subplots(1, len(PANELS), figsize=(18, 4.2))
    for ax, (col, title, ylabel) in zip(axes, PANELS):
        curve(ax, df, col, sorted(set(df.arm)), legend=ax is axes[0])
        ax.set(title=title, xlabel="distillation update", ylabel=ylabel, ylim=(0, None))
        if df[col].max() == 0:  # a line on the axis is invisible: say it
            ax.text(0.5, 0.5, "0 in every run and step", transform=ax.transAxes, ha="center")
    for ax in (axes[0],):
        sns.move_legend(ax, "best", ncol=2, fontsize=8, title=None)
    n = df.groupby("arm").seed.nunique().min()
    fig.suptitle(
        f"OPSD, task model (teacher: initial model + reference solution); 95% t-CI, {n} seeds"
    )
    savefig(fig, root / EXP / "fig_opsd_repetition")


if __name__ == "__main__":
    main()
