"""Layer amplification (the SNR post's residual-stream compounding, §2): divergence per decoder
layer after one relative injection (σ) at layer 0 and at the embedding output. Left: relative
divergence ‖Δh_l‖/‖h_l‖ / σ; right: absolute growth ‖Δh_l‖ / ‖Δ injected‖ (the post's "×N" metric).

    python -m analysis.layer_amplification [results/measure]
"""

from __future__ import annotations

import sys
from pathlib import Path

import matplotlib.pyplot as plt

from analysis.common import RESULTS, find_runs, load_runs, savefig, set_theme, summary


def main(root: str | Path = RESULTS / "measure") -> Path | None:
    df = load_runs(root, "layer_amplification.csv")
    if df.empty:
        return None
    sigma = summary(find_runs(root)[0]).get("amp_sigma", float("nan"))
    set_theme()
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, ((run, where), d) in enumerate(df.groupby(["run", "inject_at"], sort=False)):
        lab = f"inject at {'layer 0' if where == '0' else 'embedding'}"
        lab += f" ({run})" if df.run.nunique() > 1 else ""
        d = d[d.rel > 0]
        ax.plot(d.layer, d.rel_growth, "o-", ms=3, color=f"C{i}", label=lab)
        bx.plot(d.layer, d.abs_growth, "o-", ms=3, color=f"C{i}", label=lab)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set(
        xlabel="decoder layer",
        ylabel="relative divergence / σ",
        title=f"Relative divergence after one injection (σ = {sigma:g}; 1 = none)",
    )
    bx.set(
        yscale="log",
        xlabel="decoder layer",
        ylabel="‖Δh_l‖ / ‖Δ injected‖ (×)",
        title="Absolute growth per layer",
    )
    ax.legend(fontsize=8)
    bx.legend(fontsize=8)
    return savefig(fig, Path(root) / "fig_layer_amplification")


if __name__ == "__main__":
    print(main(*sys.argv[1:2]))
