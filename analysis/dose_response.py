"""Figure: dose-response over β for the experiments whose single noise level gave a null.

python -m analysis.dose_response [--results DIR]   # reads results/<exp>/summary.csv, mechanism.csv

Per noise level σ (the base experiment's level and the dose preset's), the paired difference
treatment − control of each pre-registered endpoint with its interval (95% t; TOST endpoints 90%,
with the ±margin band) and p; beside it the mechanism that the endpoint tests, per σ: the step-0
check (out-of-band mass, negative-advantage tokens clipped low) and the in-run share it acted on.
The endpoints' specs are the dose preset's prereg.yaml, applied to every σ.
"""

from __future__ import annotations

import textwrap

import matplotlib.pyplot as plt
import pandas as pd
import yaml

from analysis.claims import endpoint_values, run_endpoint, stars
from analysis.common import savefig, set_theme
from analysis.runs import load_summary, results_root
from harness.runs.prereg import check_prereg

DOSES = {  # dose experiment -> base experiment, β label, in-run mechanism columns (name, label)
    "nsr_dose": (
        "nsr_vs_decay",
        "Gaussian logit-noise σ in μ",
        [("rescue_frac", "rescued (in run)"), ("clip_frac_low", "clipped low (in run)")],
    ),
    "cis_dose": (
        "cis_vs_tis",
        "Student-t (ν = 3) logit-noise σ in μ",
        [("dial_out_of_band_frac", "out of [0.5, 2] (in run)"), ("is_ess", "1 − ESS/N (in run)")],
    ),
}


def curve_points(df: pd.DataFrame, prereg: dict) -> pd.DataFrame:
    """One row per (endpoint, σ): the registered test of that endpoint at that σ."""
    rows = []
    seen = set()
    for ep in prereg["endpoints"]:
        base = {k: v for k, v in ep.items() if k != "where"}
        name = ep["name"].split(",")[0]  # "accuracy, σ 1.0" -> "accuracy"
        if name in seen:
            continue
        seen.add(name)
        for sigma in sorted(df.sigma.unique()):
            res = run_endpoint(
                endpoint_values(df, {**base, "where": {"sigma": float(sigma)}}),
                base,
                prereg["treatment"],
                prereg["control"],
            )
            rows.append({"endpoint": name, "sigma": sigma, "spec": base, **res})
    return pd.DataFrame(rows)


def mechanism_points(root, exps: list[str], df: pd.DataFrame, arm: str, cols) -> pd.DataFrame:
    """Per σ: the treatment arm's step-0 check (mean over its runs) and in-run shares."""
    frames = [
        pd.read_csv(root / e / "mechanism.csv")
        for e in exps
        if (root / e / "mechanism.csv").exists()
    ]
    step0 = ["oob_frac", "neg_low_clip"]
    m = pd.concat(frames) if frames else pd.DataFrame(columns=["arm", "trained", "sigma", *step0])
    m = m[(m.arm == arm) & m.trained.astype(bool)]
    out = m.groupby("sigma")[step0].mean().reindex(sorted(df.sigma.unique()))
    runs = df[df.arm == arm].groupby("sigma")
    for col, _ in cols:
        v = runs[col].mean()
        out[col] = 1 - v if col == "is_ess" else v
    return out.sort_index()


def draw(root, dose: str) -> None:
    base, xlabel, cols = DOSES[dose]
    prereg = yaml.safe_load((root / dose / "prereg.yaml").read_text())
    check_prereg(prereg)
    df = pd.concat([load_summary(root, e) for e in (base, dose)], ignore_index=True)
    df = df[df.complete & df.arm.isin([prereg["treatment"], prereg["control"]])]
    pts = curve_points(df, prereg)
    mech = mechanism_points(root, [base, dose], df, prereg["treatment"], cols)
    names = list(dict.fromkeys(pts.endpoint))
    fig, axes = plt.subplots(1, len(names) + 1, figsize=(5.2 * (len(names) + 1), 4.4))
    for ax, name in zip(axes, names):
        p = pts[pts.endpoint == name]
        spec = p.spec.iloc[0]
        lo, hi = p["diff"] - p.ci_lo, p.ci_hi - p["diff"]
        ax.errorbar(p.sigma, p["diff"], yerr=[lo, hi], marker="o", capsize=4)
        ax.axhline(0, color="0.3", lw=0.8)
        if spec["test"] == "tost":
            ax.axhspan(
                -spec["margin"],
                spec["margin"],
                color="0.85",
                zorder=0,
                label=f"equivalence ±{spec['margin']:g}",
            )
            ax.legend(loc="best", fontsize=8)
        for _, r in p.iterrows():
            if pd.notna(r.get("p")):
                text = f"p={r.p:.2g} {stars(r.p)}\nn={r.pairs}"
                if spec["test"] == "tost":  # equivalence, and whether a difference resolved
                    d = r.p_difference
                    text = f"TOST p={r.p:.2g}\nΔ≠0 p={d:.2g} {stars(d)}\nn={r.pairs}"
                ax.annotate(
                    text,
                    (r.sigma, r.ci_hi),
                    textcoords="offset points",
                    xytext=(0, 4),
                    ha="center",
                    fontsize=7,
                )
        ci = "90%" if spec["test"] == "tost" else "95%"
        ax.set(
            title=f"Δ {name} ({spec['test']}, {ci} CI)",
            xlabel=xlabel,
            ylabel=f"{prereg['treatment']} − {prereg['control']}",
        )
        ax.margins(y=0.25)
    ax = axes[-1]
    ax.plot(mech.index, mech.oob_frac, "o-", label="out of [0.5, 2] (step 0)")
    ax.plot(mech.index, mech.neg_low_clip, "s-", label="A<0 below 1−ε (step 0)")
    for col, label in cols:
        ax.plot(mech.index, mech[col], "^--", label=label)
    ax.set(
        title=f"Mechanism ({prereg['treatment']} arm)",
        xlabel=xlabel,
        ylabel="fraction of tokens",
        ylim=(0, None),
    )
    ax.legend(fontsize=8)
    n = df.groupby(["sigma", "arm"]).seed.nunique().groupby("sigma").min()
    title = (
        f"{prereg['claim']} ({prereg['source']}): countdown task model; seeds per σ "
        + ", ".join(f"{s:g}: {k}" for s, k in n.items())
    )
    fig.suptitle(textwrap.fill(title, 150))
    savefig(fig, root / dose / f"fig_{dose}")


def main(argv: list[str] | None = None) -> None:
    root = results_root(argv)
    set_theme()
    for dose in DOSES:
        if (root / dose / "summary.csv").exists():
            draw(root, dose)
        else:
            print(f"[dose_response] {dose}: no summary.csv yet")


if __name__ == "__main__":
    main()
