"""Figure: phase diagram — what a clip that sees β costs, over β size × α size (SNR criterion).

python -m analysis.phase_diagram [--results DIR]   # reads results/<exp>/summary.csv

Per cell (α row: staleness k and learning rate; β column: logit-noise σ in μ) the two arms'
held-out accuracy (mean of the last 3 evaluations), then the paired differences π_old := μ minus
π_old recomputed in accuracy and in entropy (steps 76–100), each with its paired t-test over seeds
(* p < 0.05, ** p < 0.01, *** p < 0.001); ✗ marks a cell where a collapse guard fired.
"""

from __future__ import annotations

import textwrap

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns

from analysis.claims import endpoint_values, run_endpoint, stars
from analysis.common import savefig, set_theme
from analysis.runs import load_summary, results_root, share

EXP = "phase_diagram"
TREATMENT, CONTROL = "π_old := μ (std clip)", "π_old recomputed (std clip)"
ACC = {
    "metric": "eval_acc",
    "reduce": "last_evals",
    "n": 3,
    "test": "paired_t",
    "predicted": "less",
}


def entropy_ep(steps: int) -> dict:
    return {
        "metric": "entropy_mean",
        "reduce": "window_mean",
        "test": "paired_t",
        "window": [max(1, steps - 24), steps],
        "predicted": "greater",
    }


def cells(df: pd.DataFrame) -> pd.DataFrame:
    """One row per (α, σ) cell: each arm's mean accuracy, the paired differences and their p."""
    rows = []
    for (k, lr, sigma), d in df.groupby(["staleness", "lr", "sigma"]):
        row = {"alpha": f"k = {k}, lr {lr:g}", "sigma": sigma}
        for name, ep in (("acc", ACC), ("entropy", entropy_ep(int(d.steps.max())))):
            vals = endpoint_values(d, ep)
            res = run_endpoint(vals, ep, TREATMENT, CONTROL)
            row |= {
                f"{name}_{arm}": vals.xs(arm, level="arm").mean()
                for arm in (TREATMENT, CONTROL)
                if arm in vals.index.get_level_values(0)
            }
            row |= {f"d_{name}": res.get("diff", np.nan), f"p_{name}": res.get("p", np.nan)}
        last = d.sort_values("step").groupby("run").tail(1)
        row["collapsed"] = bool((last.collapse_events > 0).any())
        for arm in (TREATMENT, CONTROL):
            a = d[d.arm == arm]
            row["clip_" + arm] = (a.clip_frac_low + a.clip_frac_high).mean()
        rows.append(row)
    return pd.DataFrame(rows)


def heat(ax, c: pd.DataFrame, col: str, title: str, label: str, p: str | None = None, **kw):
    grid = c.pivot(index="alpha", columns="sigma", values=col)
    text = grid.map("{:+.3f}".format if p else "{:.3f}".format)
    if p:
        pv = c.pivot(index="alpha", columns="sigma", values=p)
        text = text + "\n" + pv.map(lambda v: "—" if np.isnan(v) else f"p={v:.2g} {stars(v)}")
    ko = c.pivot(index="alpha", columns="sigma", values="collapsed")
    text = text + ko.map(lambda v: " ✗" if v else "")
    sns.heatmap(grid, annot=text, fmt="", ax=ax, cbar_kws={"label": label}, **kw)
    ax.set(title=title, xlabel="β: Gaussian logit-noise σ in μ", ylabel="α: staleness, lr")


def main(argv: list[str] | None = None) -> None:
    root = results_root(argv)
    df = load_summary(root, EXP)
    df = df[df.complete]
    c = cells(df)
    set_theme()
    fig, axes = plt.subplots(1, 4, figsize=(22, 4.6))
    acc = {"vmin": 0.0, "vmax": 0.5, "cmap": "viridis"}
    heat(axes[0], c, "acc_" + TREATMENT, TREATMENT, "held-out accuracy", **acc)
    heat(axes[1], c, "acc_" + CONTROL, CONTROL, "held-out accuracy", **acc)
    heat(
        axes[2],
        c,
        "d_acc",
        "Δ accuracy (:= μ − recomputed)",
        "Δ accuracy",
        "p_acc",
        cmap="vlag",
        center=0.0,
    )
    heat(
        axes[3],
        c,
        "d_entropy",
        "Δ entropy, last 25 steps",
        "Δ entropy (nats/token)",
        "p_entropy",
        cmap="vlag",
        center=0.0,
    )
    for ax in axes:
        ax.invert_yaxis()
    n = df.groupby("arm").seed.nunique().min()
    fig.suptitle(
        f"Cost of a clip that sees β: countdown task model, {n} seeds paired per cell "
        "(accuracy: mean of the last 3 evaluations; paired t; ✗ = collapse guard fired)"
    )
    caption = "in-run clipped fraction (low + high), " + "; ".join(
        f"{r.alpha}, σ {r.sigma:g}: := μ {r['clip_' + TREATMENT]:.1%} vs recomputed "
        f"{r['clip_' + CONTROL]:.1%}"
        for _, r in c.iterrows()
    )
    caption = "\n".join(textwrap.wrap(mechanism_lines(root), 230) + textwrap.wrap(caption, 230))
    fig.text(0.01, 0.01, caption, fontsize=7, va="bottom")
    savefig(fig, root / EXP / "fig_phase_diagram", bottom=0.04 + 0.03 * (caption.count("\n") + 1))


def mechanism_lines(root) -> str:
    """The step-0 check per β level (θ = θ_old: α is 0 there, so it depends on σ alone)."""
    path = root / EXP / "mechanism.csv"
    if not path.exists():
        return "no mechanism check recorded"
    m = pd.read_csv(path)
    m = m[m.trained & (m.arm == TREATMENT)].groupby("sigma").mean(numeric_only=True)
    return "step-0 check (π_old := μ): " + "; ".join(
        f"σ {s:g}: {r.oob_frac:.1%} out of [0.5, 2] ({share(r.fork_oob_share)} on forks), A<0 "
        f"below 1−ε {r.neg_low_clip:.1%} vs A>0 above 1+ε {r.pos_high_clip:.1%}, μ reward "
        f"{r.sampler_reward:.3f}"
        for s, r in m.iterrows()
    )


if __name__ == "__main__":
    main()
