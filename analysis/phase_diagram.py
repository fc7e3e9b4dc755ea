"""Figure: phase diagram — final held-out reward (✗ = collapse) per objective over β × α size.

python -m analysis.phase_diagram [--results DIR]   # reads results/<exp>/summary.csv
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import seaborn as sns

from analysis.common import savefig, set_theme
from analysis.runs import load_summary, results_root

EXP = "phase_diagram"
LAST = (
    11  # final reward := held-out accuracy (clean policy) averaged over evals in the last 11 steps
)


def main(argv: list[str] | None = None) -> None:
    root = results_root(argv)
    df = load_summary(root, EXP)
    df = df[df.complete & (df.step > df.steps - LAST)]
    cell = df.groupby(["objective", "staleness", "sigma", "seed"]).agg(
        reward=("eval_acc", "mean"), collapsed=("collapse_events", lambda s: s.max() > 0)
    )
    cell = cell.groupby(level=[0, 1, 2]).agg(
        reward=("reward", "mean"), collapsed=("collapsed", "mean")
    )
    objs = sorted(cell.index.get_level_values(0).unique())
    set_theme()
    fig, axes = plt.subplots(1, len(objs), figsize=(5 * len(objs), 3.8), squeeze=False)
    for ax, obj in zip(axes[0], objs):
        c = cell.loc[obj]
        r, k = c.reward.unstack("sigma"), c.collapsed.unstack("sigma")
        txt = r.map("{:.2f}".format) + k.map(lambda v: " ✗" if v > 0 else "")
        sns.heatmap(r, annot=txt, fmt="", vmin=0.2, vmax=0.5, cmap="viridis", ax=ax,
                    cbar_kws={"label": "held-out accuracy, final evals"})  # fmt: skip
        ax.set(title=obj, xlabel="β: logit-noise σ in μ", ylabel="α: staleness k (steps)")
        ax.invert_yaxis()
    n = df.seed.nunique()
    fig.suptitle(
        f"Final held-out accuracy over β × α ({n} seed{'s' * (n > 1)}; ✗ = collapse guard fired)"
    )
    savefig(fig, root / EXP / "fig_phase_diagram")


if __name__ == "__main__":
    main()
