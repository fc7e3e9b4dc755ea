"""The claims table: every pre-registered endpoint computed exactly as registered.

    python -m analysis.claims [--results DIR]

reads, per experiment, the committed results/<exp>/{prereg.yaml, summary.csv, mechanism.csv}
(written by analysis.summarize) and writes results/claims.md and results/claims.csv: claim,
seed document, mechanism check, endpoint, test, statistic, p and interval, verdict.

The `prereg` schema is harness.runs.prereg's (validated before a preset's runs).

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

from analysis.events import escalation, run_events
from analysis.runs import doubled, load_summary, mechanism_summary, preset_config, results_root
from analysis.stats import (
    benjamini_hochberg,
    fisher_exact,
    fisher_min_events,
    holm,
    mde_paired,
    paired_t,
    pairs_for,
    tost,
)
from harness.base.io import write_text_atomic
from harness.runs.prereg import check_prereg

EXPERIMENTS = [
    "collapse_reject_vs_clamp",
    "collapse_drivers",
    "fp8_entropy_surge",
    "fp8_full_pipeline",
    "nsr_vs_decay",
    "opsd_repetition",
    "cis_vs_tis",
    "phase_diagram",
    "nsr_dose",
    "cis_dose",
    "surge_confirm",
    "nsr_confirm",
    "collapse_confirm",
    "smollm2_clip_confirm",
    "smollm2_collapse_confirm",
    "smollm2_opsd_confirm",
]
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
    if ep["reduce"] == "event":  # the phenomenon itself, per run (analysis.events)
        ev = run_events(runs, warmup=ep.get("warmup", 20))
        return ev.set_index(["arm", "seed"])[ep["event"]]
    if ep["reduce"] == "slope":  # escalation: least-squares slope per 100 steps
        return runs.groupby(["arm", "seed"]).apply(lambda g: escalation(g, col)[0])
    last = runs.sort_values("step").groupby(["arm", "seed"]).tail(1)  # final_any
    return (last.set_index(["arm", "seed"])[col] > 0).astype(float)


def summary_problems(df: pd.DataFrame, exp: str) -> list[str]:
    """Why a summary cannot give the registered tests: runs that stopped early, or that were
    configured shorter than the experiment's preset (a toy sweep's 4 steps of 100)."""
    last = df.groupby("run").agg(step=("step", "max"), steps=("steps", "first"))
    out = [
        f"{exp}: run {r} stopped at step {x.step} of {x.steps}"
        for r, x in last[last.step < last.steps].iterrows()
    ]
    planned = preset_config(exp).get("steps")
    if isinstance(planned, int):
        out += [
            f"{exp}: run {r} ran {x.steps} steps; the preset registers {planned}"
            for r, x in last[last.steps < planned].iterrows()
        ]
    return out


def endpoint_problems(df: pd.DataFrame, ep: dict) -> list[str]:
    """Why `df` cannot give endpoint `ep` as registered: its window lies beyond the last step,
    or its cell holds two runs of one arm and seed (their mean would count the seed twice)."""
    runs = select_cell(df[df.complete], ep.get("where"))
    out = []
    if ep["reduce"] == "window_mean" and (runs.empty or runs.step.max() < ep["window"][1]):
        last = "no runs" if runs.empty else f"the last step is {runs.step.max()}"
        out.append(f"{ep['name']}: window {list(ep['window'])} lies beyond the last step ({last})")
    out += [
        f"{ep['name']}: arm {arm!r} seed {seed} has {len(r)} runs in this cell ({', '.join(r)})"
        for (arm, seed), r in doubled(runs).items()
    ]
    return out


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
    out: dict[str, Any] = {
        "pairs": len(seeds),
        "treatment_mean": float(x.mean()),
        "control_mean": float(y.mean()),
    }
    if len(seeds) < 2:
        return {**out, "verdict": f"not testable ({len(seeds)} paired seed)"}
    sign = 1 if ep["predicted"] == "greater" else -1
    if ep["test"] == "fisher":
        a, cc = int(x.sum()), int(y.sum())
        f = fisher_exact(a, len(x) - a, cc, len(y) - cc)
        p = f[f"p_{ep['predicted']}"]
        need = fisher_min_events(len(x), len(y), ALPHA)
        mde = f">= {need}/{len(x)} vs 0/{len(y)}" if need is not None else "none"
        out.update(stat=f"{a}/{len(x)} vs {cc}/{len(y)} runs", p=p, mde=mde)
        if a + cc == 0:
            out["verdict"] = "not reproduced: no event in either arm"
        elif a + cc == len(x) + len(y):
            out["verdict"] = "not reproduced: an event in every run of both arms"
        else:
            out["verdict"] = "reproduced" if p < ALPHA else "not resolved"
        return out
    pt = paired_t(x, y)
    sd = float(np.std(x - y, ddof=1))
    out.update(diff=pt["diff"], ci_lo=pt["ci_lo"], ci_hi=pt["ci_hi"], sd=sd)
    if sd > 0:  # no spread (e.g. 0 in every run): no power statement
        out.update(mde=mde_paired(sd, len(seeds), ALPHA), seeds_needed=pairs_for(pt["diff"], sd))
    if ep["test"] == "tost":
        eq = tost(x, y, ep["margin"], ALPHA)
        stat = f"TOST ±{ep['margin']}; paired t = {pt['t']:.2f} (p = {pt['p']:.2g})"
        out.update(stat=stat, p=eq["p"], ci_lo=eq["ci_lo"], ci_hi=eq["ci_hi"], p_difference=pt["p"])
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
    return (
        f"{ep['name']}: Δ {res['diff']:+.3f}, {ci} [{res['ci_lo']:+.3f}, {res['ci_hi']:+.3f}]"
        f", {test} = {res['p']:.2g} ({stars(res['p'])})"
    )


def endpoint_marks(root: Path, exp: str) -> dict[str, str]:
    """The registered endpoints of `exp` that are not restricted to one cell, keyed by their
    summary.csv column, as figure annotations (treatment − control), one line per endpoint in
    registered order where several test one column (the primary and the fix's); {} before
    prereg.yaml."""
    path = Path(root) / exp / "prereg.yaml"
    if not path.exists():
        return {}
    prereg = yaml.safe_load(path.read_text())
    check_prereg(prereg)
    df = load_summary(root, exp)
    out = {}
    for ep in prereg["endpoints"]:
        if not ep.get("where"):
            problems = endpoint_problems(df, ep)
            tr, ct = arms_of(prereg, ep)
            res = run_endpoint(endpoint_values(df, ep), ep, tr, ct)
            line = problems[0] if problems else mark(res, ep)
            out[ep["metric"]] = "\n".join(filter(None, [out.get(ep["metric"]), line]))
    return out


def arms_of(prereg: dict, ep: dict) -> tuple[str, str]:
    """(treatment, control) of an endpoint: its own when it names them (a third arm against
    the control, e.g. the seed's fix), else the registration's."""
    return ep.get("treatment", prereg["treatment"]), ep.get("control", prereg["control"])


IN_KIND = ("event", "final_any")  # reductions that count runs in which the phenomenon happened


def seeds_run(df: pd.DataFrame, arms: list[str], aa_offset: int | None) -> int:
    """How many seeds have a run of every one of `arms` (the A/A cell's seeds left out): the
    seeds the sweep has run, whether or not each gives a value (an exit-mass ratio needs a
    repetition)."""
    d = df[df.seed < aa_offset] if aa_offset else df
    return len(set.intersection(*(set(d[d.arm == a].seed) for a in arms)))


def kind(ep: dict, verdict: str) -> str:
    """in kind: the registered phenomenon happened (events in the treatment arm, Fisher);
    in sign: a registered directional difference; neither."""
    if not verdict.startswith("reproduced"):
        return "neither"
    return "in kind" if ep["reduce"] in IN_KIND else "in sign"


def aa_values(values: pd.Series, control: str, offset: int) -> pd.Series:
    """The A/A cell: control-arm seeds s + offset relabelled "A/A" at seed s, beside the
    control arm's seeds s (the same arm twice on different seeds: the noise floor)."""
    c = values.xs(control, level="arm")
    twin = c[c.index >= offset]
    twin.index = twin.index - offset
    base = c[c.index < offset]
    return pd.concat({"A/A": twin, control: base}, names=["arm", "seed"])


def in_kind_counts(
    df: pd.DataFrame, arms: list[str], warmup: int = 20, aa_offset: int | None = None
) -> str:
    """Per arm, the runs in which each phenomenon happened (analysis.events), with the median
    step of the surge: "surge 2/5 (at 61) vs 0/5; collapse ...; guard ...; loops ...". With an
    A/A cell (`aa_offset`), the last arm's runs on seeds ≥ aa_offset are counted apart, last:
    "surge 7/8 (at 80) vs 0/8 vs A/A 0/8"."""
    ev = run_events(df[df.complete], warmup=warmup)
    if ev.empty:
        return "—"
    if aa_offset:
        ev.loc[(ev.arm == arms[-1]) & (ev.seed >= aa_offset), "arm"] = "A/A"
        arms = [*arms, "A/A"]
    parts = []
    for name in ("surge", "collapse", "entropy_guard", "loops"):
        if ev[name].isna().all():
            continue
        arm_txt = []
        for arm in arms:
            e = ev[ev.arm == arm][name].dropna()
            at = ev[(ev.arm == arm) & (ev[name] == 1)][f"{name}_at"]
            when = f" (at {at.median():.0f})" if name == "surge" and len(at) else ""
            arm_txt.append(f"{'A/A ' if arm == 'A/A' else ''}{int(e.sum())}/{len(e)}{when}")
        parts.append(f"{name.replace('_', ' ')} " + " vs ".join(arm_txt))
    return "; ".join(parts)


def load_audit(root: Path) -> dict:
    """results/audit.yaml: {experiment: {endpoint name: status}} for registered rows an audit
    found not confirmatory (e.g. "exploratory: its runs finished before the pre-registration
    commit"). Such rows stay in the table and leave the correction families."""
    path = root / "audit.yaml"
    return yaml.safe_load(path.read_text()) or {} if path.exists() else {}


def claims(root: Path) -> pd.DataFrame:
    """Every registered endpoint's row; refuses (ValueError naming every problem) when a
    summary holds runs that cannot give its tests as registered."""
    rows, problems = [], []
    audit = load_audit(root)
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
        problems += summary_problems(df, exp)
        for ep in prereg["endpoints"]:
            tr, ct = arms_of(prereg, ep)
            problems += [f"{exp}: {p}" for p in endpoint_problems(df, ep)]
            values = endpoint_values(df, ep)
            res = run_endpoint(values, ep, tr, ct)
            aa = None
            if prereg.get("aa_offset") and ct in values.index.get_level_values(0):
                aa = run_endpoint(aa_values(values, ct, prereg["aa_offset"]), ep, "A/A", ct)
            d_cell = select_cell(df, ep.get("where"))  # the mechanism of the endpoint's cell
            m_cell = None if mech is None else select_cell(mech, ep.get("where"), strict=False)
            status = audit.get(exp, {}).get(ep["name"], "confirmatory")
            ran = seeds_run(d_cell, [tr, ct], prereg.get("aa_offset"))
            if status == "confirmatory" and ran < prereg["seeds"]:
                # a sweep still running: its numbers so far are shown, but the registered test
                # is run once, on the registered seeds; a look at a part neither gives a
                # verdict nor enters the corrections
                status = f"interim ({ran}/{prereg['seeds']} seeds)"
                res = {**res, "verdict": f"interim, no verdict (so far: {res['verdict']})"}
            rows.append(
                {
                    "experiment": exp,
                    "claim": prereg["claim"],
                    "source": prereg["source"],
                    "treatment": tr,
                    "control": ct,
                    "endpoint": ep["name"],
                    "metric": ep["metric"],
                    "reduce": ep["reduce"],
                    "test": ep["test"],
                    "predicted": ep["predicted"],
                    "where": ", ".join(f"{k}={v}" for k, v in (ep.get("where") or {}).items()),
                    "seeds_planned": prereg["seeds"],
                    "status": status,
                    "kind": kind(ep, res["verdict"]),
                    "in_kind": in_kind_counts(
                        d_cell, [tr, ct], ep.get("warmup", 20), prereg.get("aa_offset")
                    ),
                    "aa": mark(aa, ep) if aa is not None else None,
                    "mechanism_treatment": mechanism_summary(m_cell, d_cell, tr),
                    "mechanism_control": mechanism_summary(m_cell, d_cell, ct),
                    **res,
                }
            )
    if problems:
        raise ValueError(
            "claims: refused, nothing written; the summaries hold runs that cannot "
            "give the registered tests:\n  - " + "\n  - ".join(problems)
        )
    return corrected(pd.DataFrame(rows))


def corrected(table: pd.DataFrame) -> pd.DataFrame:
    """Holm within each experiment and Benjamini–Hochberg across all confirmatory registered
    endpoints (exploratory rows and rows without a p leave both families); `survives`: the
    verdict holds at α after both, after BH only, or after neither."""
    if "p" not in table:
        return table
    family = (table.status == "confirmatory") & table.p.notna()
    table["p_holm"] = np.nan
    for _, idx in table[family].groupby("experiment").groups.items():
        table.loc[idx, "p_holm"] = holm(table.loc[idx, "p"])
    table["q_bh"] = np.nan
    table.loc[family, "q_bh"] = benjamini_hochberg(table.loc[family, "p"])
    hit = table.verdict.fillna("").str.startswith(("reproduced", "opposite"))
    holm_ok, bh_ok = table.p_holm < ALPHA, table.q_bh < ALPHA
    table["survives"] = np.select(
        [~family, ~hit, holm_ok & bh_ok, bh_ok, holm_ok],
        ["not in the family", "—", "Holm and BH", "BH only", "Holm only"],
        "no (nominal only)",
    )
    return table


def _fmt(v: Any, spec: str = ".3g") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "—"
    return format(v, spec) if isinstance(v, (int, float, np.floating)) else str(v)


def markdown(table: pd.DataFrame) -> str:
    head = [
        "experiment",
        "claim (source)",
        "endpoint (test)",
        "treatment vs control",
        "difference [CI]",
        "statistic",
        "p",
        "p Holm / q BH",
        "verdict",
        "kind",
        "survives correction",
        "MDE (80% power) · seeds for the observed effect",
        "in-kind events per arm (treatment vs control)",
        "A/A",
        "status",
        "mechanism (treatment arm)",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in table.to_dict("records"):
        if not isinstance(r.get("claim"), str):
            lines.append(f"| {r['experiment']} | | | | | | | | {r['verdict']} |" + " |" * 7)
            continue
        diff = (
            f"{_fmt(r.get('diff'), '+.4f')} [{_fmt(r.get('ci_lo'), '+.4f')}, "
            f"{_fmt(r.get('ci_hi'), '+.4f')}]"
            if "diff" in r
            else "—"
        )
        means = f"{_fmt(r.get('treatment_mean'), '.4f')} vs {_fmt(r.get('control_mean'), '.4f')}"
        pairs = f"{int(r['pairs'])}/{int(r['seeds_planned'])} seeds"
        cell = f" at {r['where']}" if r.get("where") else ""
        mde = r.get("mde")
        if isinstance(mde, float) and math.isfinite(mde):
            mde = f"{mde:.3g} · {_fmt(r.get('seeds_needed'), '.0f')} seeds"
        lines.append(
            f"| {r['experiment']} | {r['claim']} ({r['source']}) | {r['endpoint']}{cell}: "
            f"{r['metric']}, {r['reduce']} ({r['test']}, predicted {r['predicted']}) | "
            f"{r['treatment']} vs {r['control']}: {means} ({pairs}) | {diff} | "
            f"{_fmt(r.get('stat'))} | {_fmt(r.get('p'), '.3g')} | "
            f"{_fmt(r.get('p_holm'), '.3g')} / {_fmt(r.get('q_bh'), '.3g')} | {r['verdict']} | "
            f"{_fmt(r.get('kind'))} | {_fmt(r.get('survives'))} | {_fmt(mde)} | "
            f"{_fmt(r.get('in_kind'))} | {_fmt(r.get('aa'))} | {_fmt(r.get('status'))} | "
            f"{r['mechanism_treatment']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    root = results_root(argv)
    table = claims(root)
    write_text_atomic(root / "claims.csv", table.to_csv(index=False, float_format="%.5g"))
    text = (
        "# Claims table (generated by `python -m analysis.claims`; do not edit)\n\n"
        "Each row is one pre-registered endpoint (the experiment's preset, `prereg`), "
        "computed from the committed summary.csv exactly as registered; arms paired by "
        "seed. Tests two-sided at α = 0.05 except Fisher's (one-sided, predicted "
        "direction); intervals 95% (TOST: 90%). *kind*: **in kind** when the registered "
        "phenomenon itself happened (runs with the event, Fisher), **in sign** when a "
        "registered directional difference did, else neither. Corrections: Holm within "
        "each experiment, Benjamini–Hochberg across every confirmatory endpoint; rows "
        "an audit marks exploratory (results/audit.yaml) leave both, as do the rows of a "
        "sweep that has not yet run every registered seed (*interim*: its numbers so far, "
        "no verdict). MDE: the smallest "
        "true difference the test detects with 80% power at this many pairs and the "
        "observed SD of the paired differences (Fisher: the fewest treatment events that "
        "reach p < 0.05 against none). In-kind events (analysis.events): surge = 10-step "
        "mean entropy ≥ 2× steps 1–10; collapse = 10-step mean reward < 0.5× its best "
        "after step 20, to the end; entropy guard = a step's entropy > 2× steps 1–10; "
        "loops = a terminal loop in the last 20% of steps.\n\n"
    ) + markdown(table)
    write_text_atomic(root / "claims.md", text)
    print(text)


if __name__ == "__main__":
    main()
