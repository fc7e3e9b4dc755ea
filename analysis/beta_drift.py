"""β drift over training, decomposed (harness.stats.drift): the mismatch dials the frameworks log
at each checkpoint's calibration pass, and the growth of β's sequence-level second moment split
into length, the softmax gate, the engine's logit error and the residual the first order leaves.

    python -m analysis.beta_drift [results/beta_drift]

reads every <root>/<series>/{drift.csv, seqs.csv} (harness.rl.drift's output; a series is one
run's checkpoints under one sampler) and writes <root>/parts.csv (each part's log growth against
step 0 with bootstrap 95% intervals over responses, the measured growth, and the fork-bin Var β
ratio), <root>/fig_beta_drift.{png,pdf} (the dense series) and, where series measure an
upcycled MoE (harness.rl.drift --set model.upcycle=...), <root>/fig_beta_drift_moe.{png,pdf}.
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from analysis.common import RESULTS, savefig, set_theme
from harness.base.io import write_text_atomic
from harness.stats.drift import PARTS, SEQ_COLUMNS, fork_var, growth, growth_intervals

DIALS = [  # drift.csv column, legend (each shown as its ratio to step 0)
    ("kl_k3", "k3 KL"),
    ("kl_k1", "k1 KL"),
    ("mean_abs_delta", "mean |Δ|"),
    ("p99_abs_delta", "p99 |Δ|"),
    ("out_of_band_frac", "outside [0.5, 2]"),
    ("token_mult_prob_error", "token_mult_prob_error − 1"),
    ("seq_d2", "Σ_t Δ² per response"),
]
COLORS = {"length": "C2", "gate": "C0", "engine": "C3", "residual": "0.6"}


def series(root: Path) -> list[Path]:
    return sorted(p.parent for p in root.glob("*/drift.csv"))


def sums_of(seqs: pd.DataFrame, step: int) -> dict[str, np.ndarray]:
    d = seqs[seqs.step == step]
    return {k: d[k].to_numpy(float) for k in SEQ_COLUMNS}


def parts_table(folder: Path, n_boot: int = 2000) -> pd.DataFrame:
    """Per checkpoint after step 0: each part and the measured growth (log ratios to step 0) with
    95% intervals, their sum, and the fork-bin Var β ratio."""
    seqs = pd.read_csv(folder / "seqs.csv")
    base = sums_of(seqs, 0)
    rows = []
    for step in sorted(set(seqs.step) - {0}):
        cur = sums_of(seqs, step)
        point, ci = growth(base, cur), growth_intervals(base, cur, n_boot=n_boot, seed=step)
        row = {"series": folder.name, "step": step}
        for k in (*PARTS, "measured"):
            row |= {k: point[k], f"{k}_lo": ci[k][0], f"{k}_hi": ci[k][1]}
        row["named_sum"] = point["length"] + point["gate"] + point["engine"]
        # the three named parts account for the measured growth when the residual's interval
        # holds 0
        row["parts_account"] = bool(ci["residual"][0] <= 0 <= ci["residual"][1])
        row["fork_var_ratio"] = fork_var(cur) / fork_var(base)
        row["fork_var_ratio_lo"], row["fork_var_ratio_hi"] = ci["fork_var_ratio"]
        rows.append(row)
    return pd.DataFrame(rows)


def run_config(folder: Path) -> dict:
    return json.loads((folder / "meta.json").read_text())["run_config"]


def mu_label(cfg: dict) -> str:
    """μ and the trainer's replay, as the series measured them."""
    eng = cfg["engine"]
    # each noise model with the kwargs the run set (its defaults: the model's signature)
    names = [
        n["name"] + "".join(f" {k}={v}" for k, v in n.items() if k != "name")
        for n in [cfg["noise"], *cfg.get("extra_noise", [])]
    ]
    mu = f"μ {eng['sampler_dtype']}, noise {' + '.join(names)}"
    if cfg["model"].get("upcycle"):
        up = cfg["model"]["upcycle"]
        mu += f", MoE {up['n_experts']}×top-{up['top_k']} jitter {up.get('expert_jitter', 0)}"
        if eng["routing_replay"]:
            mu += ", R2" if eng.get("routing_replay_source") == "trainer" else ", R3"
    return mu


def plot(root: Path, folders: list[Path], parts: pd.DataFrame, name: str) -> Path:
    set_theme()
    fig, axes = plt.subplots(2, len(folders), figsize=(5.2 * len(folders), 8), squeeze=False)
    for j, folder in enumerate(folders):
        d = pd.read_csv(folder / "drift.csv").sort_values("step")
        d["token_mult_prob_error"] -= 1
        ax = axes[0, j]
        for i, (col, label) in enumerate(DIALS):
            ax.plot(d.step, d[col] / d[col].iloc[0], "o-", ms=3, color=f"C{i}", label=label)
        ax.axhline(1, color="k", lw=0.8)
        ax.set(yscale="log", xlabel="training step (checkpoint)", ylabel="dial / its step-0 value")
        mu = textwrap.fill(mu_label(run_config(folder)), 60)
        title = f"{folder.name}: the dials at frozen weights\n({mu})"
        ends = d["mean_abs_delta"].iloc[[0, -1]]
        title += f"\nmean |Δ| {ends.iloc[0]:.4f} → {ends.iloc[1]:.4f}"
        if "eos_d2_share" in d and d["eos_d2_share"].notna().all():  # the stop decision's part
            eos = d["eos_d2_share"].iloc[[0, -1]] * 100
            title += f"; at EOS {eos.iloc[0]:.0f}% → {eos.iloc[1]:.0f}% of Σ Δ²"
        if "route_flips" in d and d["route_flips"].notna().all():  # an MoE series
            flips = d["route_flips"].iloc[[0, -1]] * 100
            title += f"; route flips {flips.iloc[0]:.1f}% → {flips.iloc[1]:.1f}%"
        ax.set_title(title, fontsize=9)
        p = parts[parts.series == folder.name].sort_values("step")
        bx = axes[1, j]
        x = np.arange(len(p))
        for sign in (1, -1):  # positive parts stack up from 0, negative ones down
            bottom = np.zeros(len(p))
            for k in PARTS:
                v = np.where(np.sign(p[k]) == sign, p[k], 0.0)
                bx.bar(x, v, 0.6, bottom=bottom, color=COLORS[k], label=k if sign == 1 else None)
                bottom += v
        err = np.abs(p[["measured_lo", "measured_hi"]].to_numpy().T - p.measured.to_numpy())
        bx.errorbar(x, p.measured, yerr=err, fmt="ko", ms=4, label="measured (95% CI)")
        bx.plot(x, p.named_sum, "kx", ms=6, label="length + gate + engine")
        bx.axhline(0, color="k", lw=0.8)
        bx.set_xticks(x, [str(s) for s in p.step])
        bx.set(xlabel="training step (checkpoint)", ylabel="log growth of Σ_t Δ² vs step 0")
        bx.set_title("its parts (log ratios; they sum to the measured growth)", fontsize=10)
    axes[0, 0].legend(fontsize=7)
    axes[1, 0].legend(fontsize=7)
    fig.text(0.01, 0.005, footer(folders[0]), fontsize=8, va="bottom")
    return savefig(fig, root / name, bottom=0.03)


def footer(folder: Path) -> str:
    """The setting every series shares: the model by weights checksum, the pass's size."""
    meta = json.loads((folder / "meta.json").read_text())
    cfg, ident = meta["run_config"], meta["identity"]
    return (
        f"{cfg['model']['spec']} (weights {ident.get('weights_sha', '?')} at step 0); each "
        f"checkpoint: {meta['prompts']} evaluation problems × {cfg['rollout']['group_size']} "
        f"samples, T = {cfg['rollout']['temperature']}, sampling seed {meta['seed']}; parts: "
        "harness.stats.drift; intervals: bootstrap over responses"
    )


def main(root: str | Path = RESULTS / "beta_drift") -> Path | None:
    root = Path(root)
    folders = series(root)
    if not folders:
        return None
    parts = pd.concat([parts_table(f) for f in folders], ignore_index=True)
    write_text_atomic(root / "parts.csv", parts.round(6).to_csv(index=False))
    moe = [f for f in folders if run_config(f)["model"].get("upcycle")]
    if moe:
        plot(root, moe, parts, "fig_beta_drift_moe")
    dense = [f for f in folders if f not in moe]
    return plot(root, dense, parts, "fig_beta_drift") if dense else None


if __name__ == "__main__":
    print(main(*sys.argv[1:2]))
