"""Figure and table: β from a real second engine (CTranslate2) beside injected FP8 β,
and the precision β of results/precision_beta (bf16/bf16, bf16/fp32, fp32/fp32).

    python -m analysis.real_engine_beta [results/real_engine_beta] [--compare results/measure]
    python -m analysis.real_engine_beta results/precision_beta --compare results/measure

Calibration pass (frozen weights, so Δ = β) of every run under the first folder and of the
comparison run(s): (a) mean |Δ log π| per trainer-confidence bin; (b) the CIS repository's shape
test — the log-odds displacement ε = logit p − logit q per bin against |log k| = |Δ|: a
confidence-invariant ε with |log k| falling toward confident bins is the premise of CIS's cap;
(c) the SNR post's anatomy numbers (Table 3): median / mean, the top 1% of tokens' share of
Σ|Δ|, corr(p_t, |Δ|). Writes comparison.csv and fig_real_engine_beta.png/.pdf into the first
folder (or --out). The main job (`make demo`) draws it into results/measure/: its FP8 run beside
the CTranslate2 runs of results/real_engine_beta.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from analysis.common import RESULTS, bin_labels, load_runs, savefig, set_theme, summary
from harness.base.io import write_text_atomic

SHAPE = [
    ("median/mean", "median / mean |Δ|"),
    ("top1_share", "top 1% share of Σ|Δ|"),
    ("corr_conf_abs", "corr(p_t, |Δ|)"),
]
MIN_N = 50  # bins with fewer calibration tokens are left out of the range ratios


def repo_relative(path: Path) -> str:
    """A run's folder as the table names it: relative to the repository when inside it, so the
    table does not depend on where the checkout lives."""
    path = path.resolve()
    repo = Path(__file__).resolve().parents[1]
    return str(path.relative_to(repo)) if path.is_relative_to(repo) else str(path)


def source_label(beta: str, s: dict) -> str:
    """A run's β source: what μ differs by, and its precisions when they are not fp32 (the
    precision_beta runs inject nothing: their β is the dtypes')."""
    dtypes = (s.get("sampler_dtype", "fp32"), s.get("trainer_dtype", "fp32"))
    return beta if dtypes == ("fp32", "fp32") else f"{beta}, μ {dtypes[0]} / π {dtypes[1]}"


def sources(roots: list[Path]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Calibration per-bin rows and one Table 3 row per run, labelled by its β source."""
    bins, rows = [], []
    for root in roots:
        pb = load_runs(root, "per_bin.csv")
        t3 = load_runs(root, "table3.csv")
        for run, d in pb[pb["pass"] == "cal"].groupby("run", sort=False):
            s = summary(Path(root) / run)
            label = source_label(d.label.iloc[0].split(" | ")[0], s)
            bins.append(d.assign(source=label))
            stats = t3[t3.run == run].set_index("stat").value
            ok = d[d.n >= MIN_N]
            rows.append(
                {
                    "source": label,
                    "run": repo_relative(Path(root) / run),
                    "model": s.get("model"),
                    "weights_sha": s.get("weights_sha"),
                    "n_tokens": stats["n_tokens"],
                    "mean": stats["mean"],
                    "median": stats["median"],
                    "median/mean": stats["median"] / stats["mean"],
                    "p99": stats["p99"],
                    "top1_share": stats["top1_share"],
                    "corr_conf_abs": stats["corr_conf_abs"],
                    "fork_mass_share": stats.get("fork_mass_share", np.nan),
                    "identity_cal": s.get("identity_mean_ratio", {}).get("cal"),
                    # fork bin over confident bin: how far each falls across confidence
                    "abs_delta_range": ok.mean_abs_delta.iloc[0] / ok.mean_abs_delta.iloc[-1],
                    "logit_disp_range": (
                        ok.mean_abs_logit_disp.iloc[0] / ok.mean_abs_logit_disp.iloc[-1]
                        if "mean_abs_logit_disp" in ok
                        else np.nan
                    ),
                }
            )
    return pd.concat(bins, ignore_index=True), pd.DataFrame(rows)


def main(argv: list[str] | None = None) -> Path | None:
    p = argparse.ArgumentParser()
    p.add_argument("root", nargs="?", default=RESULTS / "real_engine_beta", type=Path)
    p.add_argument("--compare", nargs="*", default=[RESULTS / "measure"], type=Path)
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="folder for the figure and table (default: the first folder)",
    )
    a = p.parse_args(argv)
    out = a.out or a.root
    roots = [a.root, *[c for c in a.compare if (c / "per_bin.csv").exists() or c.is_dir()]]
    if not any((r / "summary.json").exists() or list(r.glob("*/summary.json")) for r in roots):
        print(f"[real_engine_beta] no runs under {a.root}")
        return None
    bins, table = sources(roots)
    write_text_atomic(out / "comparison.csv", table.to_csv(index=False, float_format="%.4g"))
    print(table.drop(columns=["run"]).to_string(index=False, float_format="%.4g"))
    set_theme()
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.6))
    for i, (src, d) in enumerate(bins.groupby("source", sort=False)):
        x = np.arange(len(d))
        axes[0].plot(x, d.mean_abs_delta, "o-", color=f"C{i}", label=src)
        if d.mean_abs_logit_disp.notna().any():
            axes[1].plot(x, d.mean_abs_logit_disp, "o-", color=f"C{i}", label=f"{src}: |ε|")
            axes[1].plot(
                x, d.mean_abs_delta, "s--", color=f"C{i}", alpha=0.6, label=f"{src}: |log k|"
            )
        for ax in axes[:2]:
            ax.set_xticks(x, bin_labels(d), rotation=30)
    axes[0].set(
        yscale="log",
        xlabel="trainer confidence p_t (bin)",
        ylabel="mean |Δ log π|",
        title="β per confidence bin (calibration pass)",
    )
    axes[1].set(
        yscale="log",
        xlabel="trainer confidence p_t (bin)",
        ylabel="mean per token",
        title="CIS shape: log-odds displacement ε vs |log k|",
    )
    w = 0.8 / len(table)
    for i, r in table.iterrows():
        axes[2].bar(np.arange(len(SHAPE)) + i * w, [r[k] for k, _ in SHAPE], w, label=r.source)
    axes[2].set_xticks(np.arange(len(SHAPE)) + w * (len(table) - 1) / 2, [t for _, t in SHAPE])
    axes[2].axhline(0, color="0.3", lw=0.8)
    axes[2].set(title="SNR post's anatomy (Table 3)")
    for ax in axes:
        ax.legend(fontsize=7)
    models = ", ".join(sorted({f"{m} ({s})" for m, s in zip(table.model, table.weights_sha)}))
    fig.suptitle(
        f"β by source — a real engine or the precision (nothing injected) beside "
        f"injected noise: {models}"
    )
    return savefig(fig, out / "fig_real_engine_beta")


if __name__ == "__main__":
    print(main())
