"""The claims table: every pre-registered endpoint computed exactly as registered.

    python -m analysis.claims [--results DIR]

reads, per experiment, the committed results/<exp>/{prereg.yaml, summary.csv, mechanism.csv}
(written by analysis.summarize) and writes results/claims.md and results/claims.csv: claim,
seed document, mechanism check, endpoint, test, statistic, p and interval, verdict.

The `prereg` schema is harness.prereg's (validated before a preset's runs).

Tests are two-sided at α = 0.05 (Fisher: one-sided in the predicted direction, the seed's
prediction being directional); intervals 95% (TOST: 90%, its equivalence interval).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import yaml

from analysis.runs import load_summary, mechanism_summary, results_root
from analysis.stats import fisher_exact, paired_t, tost
from harness.io import write_text_atomic
from harness.prereg import check_prereg

EXPERIMENTS = ["collapse_reject_vs_clamp", "collapse_drivers", "fp8_entropy_surge",
               "fp8_full_pipeline", "nsr_vs_decay", "opsd_repetition", "cis_vs_tis",
               "phase_diagram", "nsr_dose", "cis_dose"]  # fmt: skip
ALPHA = 0.05


def select_cell(frame: pd.DataFrame, where: dict | None, strict: bool = True) -> pd.DataFrame:
    """The rows of one cell of a grid (`where`: column → value); `strict=False` skips columns
    `frame` lacks (mechanism.csv has σ but no staleness: the step-0 check has no α)."""
    for key, value in (where or {}).items():
        if key not in frame:
            if strict:
                raise ValueError(f"prereg where: {key!r} is not a summary.csv column")
            continue
        col = frame[key]
        frame = frame[np.isclose(col, value) if isinstance(value, float) else col == value]
    return frame


def endpoint_values(df: pd.DataFrame, ep: dict) -> pd.Series:
    """One number per complete run, indexed by (arm, seed), reduced as registered."""
    runs = select_cell(df[df.complete], ep.get("where"))
    col = ep["metric"]
    if ep["reduce"] == "window_mean":
        lo, hi = ep["window"]
        sel = runs[(runs.step >= lo) & (runs.step <= hi)]
        return sel.groupby(["arm", "seed"])[col].mean()
    if ep["reduce"] == "last_evals":
        sel = runs.dropna(subset=[col]).sort_values("step")
        return sel.groupby(["arm", "seed"])[col].apply(lambda s: s.tail(ep["n"]).mean())
    last = runs.sort_values("step").groupby(["arm", "seed"]).tail(1)  # final_any
    return (last.set_index(["arm", "seed"])[col] > 0).astype(float)


def run_endpoint(values: pd.Series, ep: dict, treatment: str, control: str) -> dict[str, Any]:
    """The registered test on the paired values, and its verdict."""
    t = values.xs(treatment, level="arm") if treatment in values.index.get_level_values(0) else None
    c = values.xs(control, level="arm") if control in values.index.get_level_values(0) else None
    if t is None or c is None:
        missing = treatment if t is None else control
        return {"verdict": f"not run (no complete runs of arm {missing!r})", "pairs": 0}
    # pairs where both arms have a value (e.g. an exit-mass ratio needs repetitions to exist)
    seeds = sorted(s for s in set(t.index) & set(c.index) if np.isfinite([t[s], c[s]]).all())
    x, y = t.loc[seeds].to_numpy(), c.loc[seeds].to_numpy()
    out: dict[str, Any] = {"pairs": len(seeds), "treatment_mean": float(x.mean()),
                           "control_mean": float(y.mean())}  # fmt: skip
    if len(seeds) < 2:
        return {**out, "verdict": f"not testable ({len(seeds)} paired seed)"}
    sign = 1 if ep["predicted"] == "greater" else -1
    if ep["test"] == "fisher":
        a, cc = int(x.sum()), int(y.sum())
        f = fisher_exact(a, len(x) - a, cc, len(y) - cc)
        p = f[f"p_{ep['predicted']}"]
        out.update(stat=f"{a}/{len(x)} vs {cc}/{len(y)} runs", p=p)
        if a + cc == 0:
            out["verdict"] = "not reproduced: no event in either arm"
        elif a + cc == len(x) + len(y):
            out["verdict"] = "not reproduced: an event in every run of both arms"
        else:
            out["verdict"] = "reproduced" if p < ALPHA else "not resolved"
        return out
    pt = paired_t(x, y)
    out.update(diff=pt["diff"], ci_lo=pt["ci_lo"], ci_hi=pt["ci_hi"])
    if ep["test"] == "tost":
        eq = tost(x, y, ep["margin"], ALPHA)
        stat = f"TOST ±{ep['margin']}; paired t = {pt['t']:.2f} (p = {pt['p']:.2g})"
        out.update(stat=stat, p=eq["p"], ci_lo=eq["ci_lo"], ci_hi=eq["ci_hi"],
                   p_difference=pt["p"])  # fmt: skip
        if eq["p"] < ALPHA:
            out["verdict"] = f"not reproduced: equivalent within ±{ep['margin']}"
        elif pt["p"] < ALPHA:  # the paired t resolves a difference: in which direction
            out["verdict"] = "reproduced" if sign * pt["diff"] > 0 else "opposite to the prediction"
        else:
            out["verdict"] = "not resolved: neither equivalent nor different"
        return out
    out.update(stat=f"paired t = {pt['t']:.2f}, df {pt['df']}", p=pt["p"])
    if not (x.any() or y.any()):  # e.g. no terminal loop in any run of either arm
        out["verdict"] = "not reproduced: 0 in every run of both arms"
    elif pt["p"] >= ALPHA:
        out["verdict"] = "not resolved"
    else:
        out["verdict"] = "reproduced" if sign * pt["diff"] > 0 else "opposite to the prediction"
    return out


def stars(p: float) -> str:
    """The usual significance marks: *** p < 0.001, ** p < 0.01, * p < 0.05, n.s. otherwise."""
    return next((m for cut, m in ((0.001, "***"), (0.01, "**"), (ALPHA, "*")) if p < cut), "n.s.")


def mark(res: dict[str, Any], ep: dict) -> str:
    """One endpoint's result as a figure annotation: difference [CI], p and its marks."""
    if "p" not in res or res["p"] is None or math.isnan(res["p"]):
        return f"{ep['name']}: {res['verdict']}"
    if ep["test"] == "fisher":
        return f"{ep['name']}: {res['stat']}, Fisher p = {res['p']:.2g} ({stars(res['p'])})"
    ci = "90% CI" if ep["test"] == "tost" else "95% CI"
    test = f"TOST ±{ep['margin']:g} p" if ep["test"] == "tost" else "p"
    return (f"{ep['name']}: Δ {res['diff']:+.3f}, {ci} [{res['ci_lo']:+.3f}, {res['ci_hi']:+.3f}]"
            f", {test} = {res['p']:.2g} ({stars(res['p'])})")  # fmt: skip


def endpoint_marks(root: Path, exp: str) -> dict[str, str]:
    """The registered endpoints of `exp` that are not restricted to one cell, keyed by their
    summary.csv column, as figure annotations (treatment − control); {} before prereg.yaml."""
    path = Path(root) / exp / "prereg.yaml"
    if not path.exists():
        return {}
    prereg = yaml.safe_load(path.read_text())
    check_prereg(prereg)
    df = load_summary(root, exp)
    out = {}
    for ep in prereg["endpoints"]:
        if not ep.get("where"):
            res = run_endpoint(endpoint_values(df, ep), ep, prereg["treatment"], prereg["control"])
            out[ep["metric"]] = mark(res, ep)
    return out


def claims(root: Path) -> pd.DataFrame:
    rows = []
    for exp in EXPERIMENTS:
        path = root / exp / "prereg.yaml"
        if not path.exists():
            rows.append(
                {
                    "experiment": exp,
                    "verdict": "not yet run on the pre-registered testbed (no prereg.yaml)",
                }
            )
            continue
        prereg = yaml.safe_load(path.read_text())
        check_prereg(prereg)
        df = load_summary(root, exp)
        mech_path = root / exp / "mechanism.csv"
        mech = pd.read_csv(mech_path) if mech_path.exists() else None
        tr, ct = prereg["treatment"], prereg["control"]
        for ep in prereg["endpoints"]:
            res = run_endpoint(endpoint_values(df, ep), ep, tr, ct)
            d_cell = select_cell(df, ep.get("where"))  # the mechanism of the endpoint's cell
            m_cell = None if mech is None else select_cell(mech, ep.get("where"), strict=False)
            rows.append({
                "experiment": exp, "claim": prereg["claim"], "source": prereg["source"],
                "treatment": tr, "control": ct, "endpoint": ep["name"], "metric": ep["metric"],
                "reduce": ep["reduce"], "test": ep["test"], "predicted": ep["predicted"],
                "where": ", ".join(f"{k}={v}" for k, v in (ep.get("where") or {}).items()),
                "seeds_planned": prereg["seeds"],
                "mechanism_treatment": mechanism_summary(m_cell, d_cell, tr),
                "mechanism_control": mechanism_summary(m_cell, d_cell, ct), **res,
            })  # fmt: skip
    return pd.DataFrame(rows)


def _fmt(v: Any, spec: str = ".3g") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "—"
    return format(v, spec) if isinstance(v, (int, float, np.floating)) else str(v)


def markdown(table: pd.DataFrame) -> str:
    head = ["experiment", "claim (source)", "endpoint (test)", "treatment vs control",
            "difference [CI]", "statistic", "p", "verdict",
            "mechanism (treatment arm)"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in table.to_dict("records"):
        if not isinstance(r.get("claim"), str):
            lines.append(f"| {r['experiment']} | | | | | | | {r['verdict']} | |")
            continue
        diff = (f"{_fmt(r.get('diff'), '+.4f')} [{_fmt(r.get('ci_lo'), '+.4f')}, "
                f"{_fmt(r.get('ci_hi'), '+.4f')}]") if "diff" in r else "—"  # fmt: skip
        means = f"{_fmt(r.get('treatment_mean'), '.4f')} vs {_fmt(r.get('control_mean'), '.4f')}"
        pairs = f"{int(r['pairs'])}/{int(r['seeds_planned'])} seeds"
        cell = f" at {r['where']}" if r.get("where") else ""
        lines.append(
            f"| {r['experiment']} | {r['claim']} ({r['source']}) | {r['endpoint']}{cell}: "
            f"{r['metric']}, {r['reduce']} ({r['test']}, predicted {r['predicted']}) | "
            f"{r['treatment']} vs {r['control']}: {means} ({pairs}) | {diff} | "
            f"{_fmt(r.get('stat'))} | {_fmt(r.get('p'), '.3g')} | {r['verdict']} | "
            f"{r['mechanism_treatment']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    root = results_root(argv)
    table = claims(root)
    write_text_atomic(root / "claims.csv", table.to_csv(index=False, float_format="%.5g"))
    text = ("# Claims table (generated by `python -m analysis.claims`; do not edit)\n\n"
            "Each row is one pre-registered endpoint (the experiment's preset, `prereg`), "
            "computed from the committed summary.csv exactly as registered; arms paired by "
            "seed. Tests two-sided at α = 0.05 except Fisher's (one-sided, predicted "
            "direction); intervals 95% (TOST: 90%).\n\n") + markdown(table)  # fmt: skip
    write_text_atomic(root / "claims.md", text)
    print(text)


if __name__ == "__main__":
    main()
