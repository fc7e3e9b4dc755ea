"""The training figures' panels: one row of per-arm curves with each pre-registered test under
its panel and the mechanism check as the caption."""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import pandas as pd

from analysis.claims import endpoint_marks
from analysis.common import savefig, set_theme
from analysis.events import run_events
from analysis.runs import figure_arms, load_summary, mechanism_caption, smooth, without_aa

# two-sided 95% Student-t quantiles by degrees of freedom (1.96 beyond 9)
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def ci95(x) -> tuple[float, float]:
    """Student-t 95% interval of the mean over seeds (a bootstrap under-covers with 3 seeds)."""
    x = np.asarray(x, dtype=float)
    if len(x) < 2:
        return float(x.mean()), float(x.mean())
    h = T975.get(len(x) - 1, 1.96) * x.std(ddof=1) / np.sqrt(len(x))
    return float(x.mean() - h), float(x.mean() + h)


# the in-kind events each column's panel marks on its runs (analysis.events), and their markers
EVENT_MARKS = {
    "entropy_mean": (("surge", "^"), ("entropy_guard", "X")),
    "reward_mean": (("collapse", "v"),),
    "repetition_terminal_loop_rate": (("loops", "o"),),
}


def curve(
    ax, df: pd.DataFrame, col: str, order: list[str], legend: bool, events: pd.DataFrame
) -> None:
    """Mean over seeds of `col` per step and arm, with the t-interval band (eval points marked),
    over every run's own trajectory (thin) with its in-kind event marked where it fired (loops:
    at the run's last step)."""
    import seaborn as sns

    d = df.dropna(subset=[col])
    hue_order = [a for a in order if a in set(d.arm)]
    marker = "o" if col == "eval_acc" else None
    sns.lineplot(
        d,
        x="step",
        y=col,
        hue="arm",
        hue_order=hue_order,
        errorbar=ci95,
        ax=ax,
        marker=marker,
        legend=legend,
    )
    for arm, colour in zip(hue_order, sns.color_palette(n_colors=len(hue_order))):
        for run, g in d[d.arm == arm].groupby("run"):
            ax.plot(g.step, g[col], color=colour, lw=0.6, alpha=0.3, zorder=1)
            for name, symbol in EVENT_MARKS.get(col, ()):
                hit = events[(events.run == run) & (events.get(name, 0) == 1)]
                if len(hit):
                    at = g.step.max() if name == "loops" else hit[f"{name}_at"].iloc[0]
                    y = np.interp(at, g.step, g[col])
                    ax.plot(at, y, symbol, color=colour, mec="black", mew=0.6, ms=6, zorder=5)


def panel_row(
    df: pd.DataFrame,
    panels: list[tuple],
    xlabel: str,
    title: str,
    root: Path,
    exp: str,
    legend_on: tuple[int, ...] = (0,),
) -> None:
    """One row of `curve` panels of experiment `exp`, each (column, title, y label), over the
    arms its preset declares (`figure_arms`: in the preset's order; an undeclared arm raises);
    mean and 95% t-interval over seeds; the mechanism check of each arm shown as the caption
    (`mechanism_caption`), each pre-registered endpoint's test under its panel's title
    (analysis.claims.endpoint_marks); written as root/exp/fig_<exp>.png and .pdf (`savefig`).
    An arm that did not log a panel's column (calibrated bounds of a fixed clip) is left out of
    that panel only."""
    import matplotlib.pyplot as plt
    import seaborn as sns

    arms = figure_arms(exp, df)
    caption, marks = mechanism_caption(root, exp, df, arms), endpoint_marks(root, exp)
    raw = load_summary(root, exp)  # events on the unsmoothed steps
    events = run_events(raw[raw.complete & raw.run.isin(set(df.run))])

    fig, axes = plt.subplots(1, len(panels), figsize=(4.4 * len(panels), 4.2))
    for i, (ax, (col, panel_title, ylabel)) in enumerate(zip(axes, panels)):
        curve(ax, df, col, arms, legend=i in legend_on, events=events)
        ax.set(title=panel_title, xlabel=xlabel, ylabel=ylabel, ylim=(0, None))
        if col in marks:  # the registered tests: treatment − control, paired by seed
            text = "\n".join(line.replace("], ", "],\n", 1) for line in marks[col].split("\n"))
            ax.set_title(panel_title, pad=24 + 9 * max(0, text.count("\n") - 1))
            ax.text(
                0.5,
                1.01,
                text,
                transform=ax.transAxes,
                fontsize=6.5,
                ha="center",
                va="bottom",
            )
        if i in legend_on:
            sns.move_legend(ax, "best", ncol=2, fontsize=8, title=None)
        if df[col].isna().all():  # a metric these runs did not log
            ax.text(0.5, 0.5, "not recorded in these runs", transform=ax.transAxes, ha="center")
        elif df[col].max() == 0:  # a line on the axis is invisible: say it
            ax.text(0.5, 0.5, "0 in every run and step", transform=ax.transAxes, ha="center")
    n = df.groupby("arm").seed.nunique().min()
    head = (
        f"{title}; mean, 95% t-CI, {n} seeds; thin: each run "
        "(▲ entropy surge, ✖ entropy guard, ▼ reward collapse, ● terminal loops)"
    )
    # wrapped to the figure's width (~10 characters an inch at the suptitle's 12 pt): a long
    # setting line would otherwise run off both edges
    fig.suptitle(textwrap.fill(head, int(fig.get_figwidth() * 10)))
    bottom = 0.0
    if caption:  # the mechanism check under the panels: a null counts only beside it
        bottom = 0.03 + 0.035 * (caption.count("\n") + 1)
        fig.text(0.01, 0.01, caption, fontsize=7, va="bottom")
    savefig(fig, Path(root) / exp / f"fig_{exp}", bottom)


def trajectories(root: Path, exp: str, panels: list[tuple], title: str) -> None:
    """`panel_row` of the complete runs of `exp` over optimizer steps, the A/A cell left out
    (`without_aa`), every panel but held-out accuracy as a 5-step trailing mean (a step's
    metrics average 64 samples; an evaluation is one held-out set)."""
    df = without_aa(load_summary(root, exp), root, exp)
    runs = smooth(df[df.complete], [c for c, *_ in panels if c != "eval_acc"])
    set_theme()
    panel_row(runs, panels, "optimizer step", title, root, exp)
