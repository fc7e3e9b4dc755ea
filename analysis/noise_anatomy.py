"""Figure 1 (SNR post): mean |Δ log π| per trainer-confidence bin at frozen weights, with the
gate prediction √(2/π)·σ·E√(1 − 2p_t + ‖p‖²) overlaid (σ of the logit noise, or fitted to the
overall mean for other noise); right: the |Δ| tail (CCDF) of each run.

    python -m analysis.noise_anatomy [results/noise_anatomy]
"""

from __future__ import annotations

import sys
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from analysis.common import RESULTS, bin_labels, load_runs, savefig, set_theme


def main(root: str | Path = RESULTS / "noise_anatomy") -> Path | None:
    per_bin = load_runs(root, "per_bin.csv")
    hist = load_runs(root, "abs_delta_hist.csv")
    if per_bin.empty:
        return None
    set_theme()
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.2))
    per_bin["label"] = per_bin.label.str.split(" | ", regex=False).str[0]  # α plays no part
    hist["label"] = hist.label.str.split(" | ", regex=False).str[0]
    cal = per_bin[per_bin["pass"] == "cal"]
    for i, (label, d) in enumerate(cal.groupby("label", sort=False)):
        c = f"C{i}"
        x = np.arange(len(d))
        ax.plot(x, d.mean_abs_delta, "o-", color=c, label=f"{label}: measured")
        ax.plot(x, d.gate_pred, "--", color=c, alpha=0.8, label=f"{label}: gate prediction")
        ax.set_xticks(x, bin_labels(d), rotation=30)
    ax.set(
        yscale="log",
        xlabel="trainer confidence p_t (bin)",
        ylabel="mean |Δ log π| (nats)",
        title="Fig. 1: noise is gated by confidence",
    )
    ax.legend(fontsize=7)
    for i, (label, d) in enumerate(hist[hist["pass"] == "cal"].groupby("label", sort=False)):
        ccdf = 1 - np.cumsum(d["count"].to_numpy()) / d["count"].sum()
        bx.step(d.hi, np.clip(ccdf, 1e-9, None), where="post", color=f"C{i}", label=label)
    bx.set(
        xscale="log",
        yscale="log",
        xlabel="|Δ log π| (nats)",
        ylabel="fraction of tokens > x",
        title="|Δ| tail at frozen weights (CCDF)",
    )
    bx.legend(fontsize=7)
    return savefig(fig, Path(root) / "fig1_noise_anatomy")


if __name__ == "__main__":
    print(main(*sys.argv[1:2]))
