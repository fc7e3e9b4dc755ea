"""Fit injected logit noise to a measured real-engine β, and check the fit.

    python -m harness.stats.fit_noise fit RUN [--name NAME] [--out DIR]   # RUN: a measure folder
    python -m harness.stats.fit_noise check RUN FITTED_RUN         # per-bin fit quality

`fit` reads the calibration pass of RUN (per_bin.csv: per confidence bin the measured mean |Δ| and
the trainer's gate E√(1 − 2p_t + ‖p‖²)) and fits Gaussian logit noise z ← z + σε to it. To first
order Δ_t ≈ (e_t − p)ᵀε, a Gaussian of variance σ²(1 − 2p_t + ‖p‖²) (the SNR post's softmax gate,
§2), so |Δ| per bin is ≈ √(2/π)·σ·E√(gate) and σ is the token-weighted least-squares fit of the
measured per-bin means. It writes DIR/<NAME>.yaml (default: the checkout's experiments/noise/,
where `noise=<NAME>` finds it), a noise config any preset can use (`noise=<NAME>`, scaled as
`noise.sigma=...`), with the run it came from in its header. `check`
compares a measurement with that noise (FITTED_RUN: the same job, `noise=<NAME>`, the HF sampler)
against RUN per bin: the ratios fitted / real of mean |Δ| and of its p50, p90, p99 — 1 where the
injected noise reproduces the real engine's; the p99 ratio says whether the tail is as heavy.
Written to FITTED_RUN/fit_quality.csv.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pandas as pd

from harness.base.io import write_text_atomic

NOISE_DIR = Path(__file__).resolve().parents[2] / "experiments" / "noise"
QUANTILES = ("abs_delta_p50", "abs_delta_p90", "abs_delta_p99")


def calibration_bins(run: Path) -> pd.DataFrame:
    path = Path(run) / "per_bin.csv"
    if not path.exists():
        raise FileNotFoundError(f"{path}: not a harness.measure run folder (no per_bin.csv)")
    df = pd.read_csv(path)
    return df[(df["pass"] == "cal") & (df.n > 0)].reset_index(drop=True)


def fit_logit_sigma(bins: pd.DataFrame) -> tuple[float, pd.DataFrame]:
    """σ minimising Σ_b n_b (m_b − σ·s_b)², s_b = √(2/π)·E√gate_b; and per bin the prediction."""
    n = bins.n.to_numpy(float)
    m = bins.mean_abs_delta.to_numpy(float)
    s = np.sqrt(2 / np.pi) * bins.gate_sqrt_mean.to_numpy(float)
    ok = np.isfinite(m) & np.isfinite(s) & (s > 0)
    if not ok.any():
        raise ValueError("fit: no confidence bin has both a measured |Δ| and a gate")
    sigma = float((n * m * s)[ok].sum() / (n * s * s)[ok].sum())
    table = bins[["bin_lo", "bin_hi", "n", "mean_abs_delta"]].assign(
        predicted=sigma * s, ratio=sigma * s / m
    )
    return sigma, table


def write_config(out: Path, name: str, sigma: float, run: Path, table: pd.DataFrame) -> Path:
    summary = json.loads((Path(run) / "summary.json").read_text())
    rows = "\n".join(
        f"#   p_t [{r.bin_lo:g}, {r.bin_hi:g}): n {r.n:.0f}, measured {r.mean_abs_delta:.3g}, "
        f"fitted {r.predicted:.3g} (ratio {r.ratio:.2f})"
        for r in table.itertuples()
    )
    text = (
        f"# noise={name}: Gaussian logit noise fitted (harness.stats.fit_noise) to the β "
        "measured in\n"
        f"#   {run} ({summary.get('label', '?')}; model {summary.get('model', '?')}, weights\n"
        f"#   {summary.get('weights_sha', '?')}). Per-bin mean |Δ| of the calibration pass:\n"
        f"{rows}\n"
        "# The fit is for that model: another model's gate differs. Scale it as noise.sigma=...\n"
        "name: logit\n"
        f"sigma: {sigma:.6g}\n"
        "seed: ${seed}\n"
    )
    return write_text_atomic(Path(out) / f"{name}.yaml", text)


def fit_quality(real: pd.DataFrame, fitted: pd.DataFrame) -> pd.DataFrame:
    """Per bin: fitted / real of mean |Δ| and of its quantiles (bins both runs populated)."""
    key = ["bin_lo", "bin_hi"]
    cols = ["n", "mean_abs_delta", *QUANTILES]
    both = real[key + cols].merge(fitted[key + cols], on=key, suffixes=("_real", "_fitted"))
    out = both[key + ["n_real", "n_fitted"]].copy()
    for c in cols[1:]:
        out[f"ratio_{c}"] = both[f"{c}_fitted"] / both[f"{c}_real"]
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fit")
    f.add_argument("run", type=Path)
    f.add_argument("--name", default="fitted")
    f.add_argument(
        "--out",
        type=Path,
        default=NOISE_DIR,
        help=f"folder for <NAME>.yaml (default: {NOISE_DIR}, the noise group `noise=<NAME>` reads)",
    )
    c = sub.add_parser("check")
    c.add_argument("run", type=Path)
    c.add_argument("fitted_run", type=Path)
    a = p.parse_args(argv)
    if a.cmd == "fit":
        sigma, table = fit_logit_sigma(calibration_bins(a.run))
        path = write_config(a.out, a.name, sigma, a.run, table)
        print(table.to_string(index=False, float_format="%.4g"))
        print(f"[fit_noise] logit σ = {sigma:.4g} → {path} (noise={a.name})")
        return
    q = fit_quality(calibration_bins(a.run), calibration_bins(a.fitted_run))
    write_text_atomic(a.fitted_run / "fit_quality.csv", q.to_csv(index=False, float_format="%.4g"))
    print(q.to_string(index=False, float_format="%.3g"))
    print(f"[fit_noise] wrote {a.fitted_run / 'fit_quality.csv'}")


if __name__ == "__main__":
    main()
