"""Figure 2 (SNR post): per confidence bin, the three-job bounds [l, u] on the weight, with the
noise (β quantiles), signal (e^{±2σ_α}) and ESS candidates; right: estimated vs true SNR per
bin (ground truth from the harness), the estimate with its 95% interval (sequence bootstrap of
both passes), one colour per run. A run without ground truth (harness.measure.logs on a user's
logs) draws its estimate and interval alone.

    python -m analysis.snr_table [results/snr_table]

With several runs under the folder it also writes coverage.csv: per bin, the share of runs whose
95% interval (Var β, Var α, SNR) holds the true value.
"""

from __future__ import annotations

import sys
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from analysis.common import RESULTS, bin_labels, load_runs, savefig, set_theme
from harness.base.io import write_text_atomic

FLOOR = 1e-3  # SNR = 0 (Var_r ≤ Var_β) is drawn here on the log axis


def coverage(truth: pd.DataFrame) -> pd.DataFrame:
    """Per confidence bin, over the runs: how many had a 95% interval, and the share of those
    whose interval holds the true value (the harness's α and β of every live token)."""
    cols = [c for c in ("var_beta", "var_alpha", "snr") if f"{c}_covered" in truth]
    rows = []
    for (lo, hi), d in truth.groupby(["bin_lo", "bin_hi"], sort=True):
        row = {
            "bin_lo": lo,
            "bin_hi": hi,
            "runs": d.run.nunique(),
            "n_live_median": d.n_live.median(),
        }
        for c in cols:
            v = d[f"{c}_covered"].dropna()
            row |= {f"{c}_runs": len(v), f"{c}_coverage": v.mean() if len(v) else np.nan}
        rows.append(row)
    return pd.DataFrame(rows)


def main(root: str | Path = RESULTS / "snr_table") -> Path | None:
    t6, truth = load_runs(root, "table6.csv"), load_runs(root, "truth.csv")
    if t6.empty:
        return None
    if truth.empty:  # the estimates alone, under the names of truth.csv
        names = {"snr": "snr_est", "snr_lo": "snr_est_lo", "snr_hi": "snr_est_hi"}
        truth = t6.rename(columns=names)
    elif truth.run.nunique() > 1 and any(c.endswith("_covered") for c in truth):
        cov = coverage(truth)
        write_text_atomic(Path(root) / "coverage.csv", cov.to_csv(index=False, float_format="%.4g"))
        print(cov.to_string(index=False))
    set_theme()
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.2))
    first = t6[t6.run == t6.run.iloc[0]]
    x = np.arange(len(first))
    ax.vlines(x, first.lower, first.upper, lw=10, alpha=0.3, color="C0", label="band [l, u]")
    for col, mk, c, name in [
        ("noise", "v", "C1", "β quantiles (noise)"),
        ("signal", "o", "C2", "e^{±2σ_α} (signal)"),
        ("ess", "x", "C3", "ESS floor (where binding)"),
    ]:
        up, lo = first[f"u_{col}"].where(np.isfinite(first[f"u_{col}"])), first[f"l_{col}"]
        ax.plot(x, up, mk, color=c, label=name)
        ax.plot(x, lo.where(lo > 0), mk, color=c, mfc="none")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(x, bin_labels(first), rotation=30)
    ax.set(
        yscale="log",
        xlabel="trainer confidence p_t (bin)",
        ylabel="weight bound (ratio)",
        title=f"Fig. 2: three-job bounds, {first.label.iloc[0].split(' | ')[0]}",
    )
    ax.legend(fontsize=7)
    # one colour per β model (the label's noise name), one line per run (seeds alike)
    kind = truth.label.str.split(" | ", regex=False).str[0].str.split("(").str[0]
    kinds, runs = list(dict.fromkeys(kind)), list(dict.fromkeys(truth.run))
    step = min(0.08, 0.6 / len(runs))
    for j, run in enumerate(runs):
        d = truth[truth.run == run]
        k = kind[d.index[0]]
        i, first = kinds.index(k), run == truth.run[kind == k].iloc[0]
        xs = np.arange(len(d)) + (j - (len(runs) - 1) / 2) * step
        who = f"{k}: " if len(kinds) > 1 else ""
        for col, style, what in (("snr_est", "o-", "estimated"), ("snr_true", "s--", "true")):
            if col not in d:
                continue
            bx.plot(
                xs,
                d[col].clip(lower=FLOOR),
                style,
                color=f"C{i}",
                ms=4,
                label=f"{who}{what}" if first else None,
            )
        if "snr_est_lo" in d and d.snr_est_lo.notna().any():  # the estimate's 95% interval
            y = d.snr_est.clip(lower=FLOOR)
            lo, hi = d.snr_est_lo.clip(lower=FLOOR), d.snr_est_hi.clip(lower=FLOOR)
            bx.errorbar(
                xs, y, yerr=[y - lo, hi - y], fmt="none", ecolor=f"C{i}", capsize=2, alpha=0.5
            )
        bx.set_xticks(np.arange(len(d)), bin_labels(d), rotation=30)
    bx.set(
        yscale="log",
        xlabel="trainer confidence p_t (bin)",
        ylabel=f"SNR = Var_α/Var_β (0 drawn at {FLOOR:g})",
        title=f"SNR per bin: procedure vs ground truth ({len(runs)} runs)",
    )
    bx.legend(fontsize=7)
    return savefig(fig, Path(root) / "fig2_snr_table")


if __name__ == "__main__":
    print(main(*sys.argv[1:2]))
