"""The claims table: every pre-registered endpoint computed exactly as registered.

    python -m analysis.claims [EXPERIMENT ...] [--results DIR]

reads, per experiment, DIR/<exp>/{prereg.yaml, summary.csv, mechanism.csv} (written by
analysis.summarize from the runs in DIR/<exp>/) and writes DIR/claims.md and DIR/claims.csv:
claim, seed document, mechanism check, endpoint, test, statistic, p and interval, verdict;
beside them the exact paired test, and whether each pair saw one batch at step 1. DIR defaults
to results/ (the project's table, `make figures`); any other DIR (a sweep of one's own preset,
`hydra.sweep.dir=DIR/<name>`) gets its own table and leaves results/ as it is.

The experiments are those named, else every experiment under DIR whose runs carry a `prereg`
(their preset's pre-registration, which each run's config.yaml records and summarize copies to
prereg.yaml): a registration belongs to the table by being run, wherever its preset lives. A
named experiment with no prereg.yaml gets a row saying it has not run.

The `prereg` schema is harness.runs.prereg's (validated before a preset's runs).

Tests are two-sided at α = 0.05 (Fisher and the sign test: one-sided in the predicted
direction, the seed's prediction being directional); intervals 95% (TOST: 90%, its
equivalence interval). Arms are paired by seed (one seed's runs share prompts and sampler
noise), so every endpoint also gets the paired test of harness.runs.prereg.PAIRED_TEST, sided
as its registered test: an event's exact sign test on the discordant pairs (one-sided, as
Fisher's); a continuous endpoint's registered paired t or TOST, paired already. A pair whose
step-1 batch differs (`broken_pairs`) stays in the registered test, reported as registered,
and leaves the paired one.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import yaml

from analysis.events import escalation, run_events
from analysis.runs import (
    doubled,
    load_summary,
    mechanism_summary,
    names_and_root,
    preset_config,
)
from analysis.stats import (
    benjamini_hochberg,
    fisher_exact,
    fisher_min_events,
    holm,
    mde_paired,
    paired_t,
    pairs_for,
    sign_flip,
    sign_test,
    tost,
)
from harness.base.io import write_text_atomic
from harness.runs.prereg import EVENT_TESTS, PAIRED_TEST, check_prereg, smallest_p, test_of

ALPHA = 0.05


def registered(root: Path) -> list[str]:
    """The experiments under `root` whose runs carry a pre-registration (prereg.yaml), in the
    row order of the claims.csv already there (a regenerated table's rows do not move), then
    the experiments new to it by name."""
    found = sorted(p.parent.name for p in Path(root).glob("*/prereg.yaml"))
    path = Path(root) / "claims.csv"
    shown = pd.read_csv(path, usecols=["experiment"]).experiment if path.exists() else []
    return [e for e in dict.fromkeys(shown) if e in found] + sorted(set(found) - set(shown))


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
    test = test_of(ep)
    if test in EVENT_TESTS:
        a, cc = int(x.sum()), int(y.sum())
        stat = f"{a}/{len(x)} vs {cc}/{len(y)} runs"
        if test == "fisher":
            p = fisher_exact(a, len(x) - a, cc, len(y) - cc)[f"p_{ep['predicted']}"]
            need = fisher_min_events(len(x), len(y), ALPHA)
            mde = f">= {need}/{len(x)} vs 0/{len(y)}" if need is not None else "none"
        else:  # the sign test: the fewest discordant pairs, all one way, that reach α
            d = x - y
            st = sign_test(int((d > 0).sum()), int((d < 0).sum()))
            p = st[f"p_{ep['predicted']}"]
            stat += f"; discordant pairs {st['n_plus']}+ / {st['n_minus']}−"
            need = next((k for k in range(len(d) + 1) if smallest_p("sign", k) < ALPHA), None)
            mde = f">= {need} discordant pairs, all one way" if need is not None else "none"
        out.update(stat=stat, p=p, mde=mde)
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
    if test == "tost":
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
    if test == "sign_flip":
        out.update(stat=f"sign-flip over {len(x)} pairs", p=sign_flip(x - y)["p"])
    else:
        out.update(stat=f"paired t = {pt['t']:.2f}, df {pt['df']}", p=pt["p"])
    if not (x.any() or y.any()):  # e.g. no terminal loop in any run of either arm
        out["verdict"] = "not reproduced: 0 in every run of both arms"
    elif out["p"] >= ALPHA:
        out["verdict"] = "not resolved"
    else:
        out["verdict"] = "reproduced" if sign * pt["diff"] > 0 else "opposite to the prediction"
    return out


def paired_test(
    values: pd.Series, ep: dict, treatment: str, control: str, drop: frozenset = frozenset()
) -> dict[str, Any]:
    """The paired test beside the registered one (harness.runs.prereg.PAIRED_TEST), run as a
    registered test is, on the pairs left after `drop` (seeds whose step-1 batches differ):
    for an event the exact sign test on the discordant pairs, one-sided in the predicted
    direction as Fisher's is (5 of 5 the predicted way: 1/32); a continuous endpoint's paired
    t or TOST is paired already, and is recomputed on those pairs. {} where it gives no p."""
    kept = values[~values.index.get_level_values("seed").isin(drop)]
    test = PAIRED_TEST[test_of(ep)]
    res = run_endpoint(kept, {**ep, "test": test}, treatment, control)
    if "p" not in res:
        return {}
    label = f"sign test, {res['stat']}" if test == "sign" else res["stat"]
    return {"paired_test": label, "p_paired": res["p"]}


FINGERPRINTS = ("fp_batch", "fp_machine")  # hashes each run records (analysis.runs.fingerprints)
STEP1 = ("reward_mean", "response_len", "entropy_mean")  # with the dial_* columns present
# summary.csv keeps 5 significant digits; differences below 1e-6 are float32 roundoff (the dials
# of a noise-free sampler are ~1e-6 themselves), not another batch
RTOL, ATOL = 1e-4, 1e-6


def broken_pairs(runs: pd.DataFrame, control: str) -> dict[tuple[int, str], str]:
    """{(seed, arm): why} for each run whose step 1 differs from the `control` arm's run of its
    seed. Step 1 is sampled before any update, so runs paired by seed see one batch whatever
    their objective: their fingerprints (FINGERPRINTS) agree where both recorded them; for runs
    without, their step-1 reward, length, entropy and dials agree to the summary's precision
    (smollm2_clip_confirm: seed 603's calibrated run, step-1 reward 0.375 vs 0.281, ran on
    another machine)."""
    first = runs[runs.step == 1].set_index(["seed", "arm"])
    out = {}
    for (seed, arm), row in first.iterrows():
        if arm == control or (seed, control) not in first.index:
            continue
        ref = first.loc[(seed, control)]
        fps = [k for k in FINGERPRINTS if k in first and pd.notna(row[k]) and pd.notna(ref[k])]
        if fps:
            diff = [f"{k} {row[k]} vs {ref[k]}" for k in fps if row[k] != ref[k]]
        else:
            cols = [c for c in first if c in STEP1 or c.startswith("dial_")]
            diff = [
                f"{c} {row[c]:.4g} vs {ref[c]:.4g}"
                for c in cols
                if not np.isclose(row[c], ref[c], rtol=RTOL, atol=ATOL, equal_nan=True)
            ]
        if diff:
            out[(seed, arm)] = f"seed {seed}: {arm}'s step 1 differs from {control}'s: " + (
                ", ".join(diff)
            )
    return out


def stars(p: float) -> str:
    """The usual significance marks: *** p < 0.001, ** p < 0.01, * p < 0.05, n.s. otherwise."""
    return next((m for cut, m in ((0.001, "***"), (0.01, "**"), (ALPHA, "*")) if p < cut), "n.s.")


def mark(res: dict[str, Any], ep: dict) -> str:
    """One endpoint's result as a figure annotation: difference [CI], p and its marks."""
    if "p" not in res or res["p"] is None or math.isnan(res["p"]):
        return f"{ep['name']}: {res['verdict']}"
    if test_of(ep) in EVENT_TESTS:
        name = "Fisher" if test_of(ep) == "fisher" else "sign test"
        return f"{ep['name']}: {res['stat']}, {name} p = {res['p']:.2g} ({stars(res['p'])})"
    ci = "90% CI" if test_of(ep) == "tost" else "95% CI"
    test = f"TOST ±{ep['margin']:g} p" if test_of(ep) == "tost" else "p"
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


def load_audit(root: Path, name: str = "audit.yaml") -> dict:
    """results/audit.yaml: {experiment: {endpoint name: status}} for registered rows an audit
    found not confirmatory (e.g. "exploratory: its runs finished before the pre-registration
    commit"). Such rows stay in the table and leave the correction families.
    results/caveats.yaml, same shape: what an audit found wrong with a confirmatory row's design
    after its runs; the row keeps its test, its verdict and its families, and the caveat is
    printed beside the verdict."""
    path = root / name
    return yaml.safe_load(path.read_text()) or {} if path.exists() else {}


def claims(root: Path, experiments: list[str] | None = None) -> pd.DataFrame:
    """Every registered endpoint's row of `experiments` (default: `registered(root)`); refuses
    (ValueError naming every problem) when a summary holds runs that cannot give its tests as
    registered."""
    rows, problems = [], []
    audit, caveats = load_audit(root), load_audit(root, "caveats.yaml")
    for exp in experiments or registered(root):
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
            runs = d_cell[d_cell.complete & d_cell.arm.isin([tr, ct])]
            broken = broken_pairs(runs, ct)
            paired = paired_test(values, ep, tr, ct, frozenset(seed for seed, _ in broken))
            pairing = (
                "; ".join(broken.values()) + " (left out of the paired test)"
                if broken
                else "every pair matches at step 1"
            )
            m_cell = None if mech is None else select_cell(mech, ep.get("where"), strict=False)
            status = audit.get(exp, {}).get(ep["name"], "confirmatory")
            ran = seeds_run(d_cell, [tr, ct], prereg.get("aa_offset"))
            if status == "confirmatory" and ran < prereg["seeds"]:
                # a sweep still running: its numbers so far are shown, but the registered test
                # is run once, on the registered seeds; a look at a part neither gives a
                # verdict nor enters the corrections
                status = f"interim ({ran}/{prereg['seeds']} seeds)"
                res = {**res, "verdict": f"interim, no verdict (so far: {res['verdict']})"}
            if ep["name"] in caveats.get(exp, {}):
                res = {**res, "verdict": f"{res['verdict']}; caveat: {caveats[exp][ep['name']]}"}
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
                    "test": test_of(ep),
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
                    **paired,
                    "pairing": pairing,
                }
            )
    if problems:
        raise ValueError(
            "claims: refused, nothing written; the summaries hold runs that cannot "
            "give the registered tests:\n  - " + "\n  - ".join(problems)
        )
    return corrected(pd.DataFrame(rows))


def corrected(table: pd.DataFrame) -> pd.DataFrame:
    """The corrections, in the families the presets register ("Holm and BH over the five"):
    Holm (family-wise error) and Benjamini–Hochberg (false-discovery rate) within each
    experiment's endpoints, for the registered p; Holm within the experiment for the exact
    paired p. A project-wide BH over every confirmatory endpoint stays beside them as its own
    column (q_bh_project; it moves whenever an unrelated sweep finishes). Exploratory rows and
    rows without a p leave every family. `survives`: the verdict holds at α after the
    experiment's Holm and BH, after BH only, Holm only, or neither."""
    if "p" not in table:
        return table
    family = (table.status == "confirmatory") & table.p.notna()
    for col in ("p_holm", "q_bh", "p_paired_holm", "q_bh_project"):
        table[col] = np.nan
    for _, idx in table[family].groupby("experiment").groups.items():
        table.loc[idx, "p_holm"] = holm(table.loc[idx, "p"])
        table.loc[idx, "q_bh"] = benjamini_hochberg(table.loc[idx, "p"])
        if "p_paired" in table:
            table.loc[idx, "p_paired_holm"] = holm(table.loc[idx, "p_paired"])
    table.loc[family, "q_bh_project"] = benjamini_hochberg(table.loc[family, "p"])
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
        "p Holm / q BH (experiment) · q BH (project)",
        "paired test: p · Holm (experiment)",
        "verdict",
        "kind",
        "survives correction",
        "MDE (80% power) · seeds for the observed effect",
        "in-kind events per arm (treatment vs control)",
        "A/A",
        "status",
        "mechanism (treatment arm)",
        "pairing (step 1)",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in table.to_dict("records"):
        if not isinstance(r.get("claim"), str):
            lines.append(f"| {r['experiment']} |" + " |" * 8 + f" {r['verdict']} |" + " |" * 8)
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
        paired = (
            f"{r['paired_test']}: p = {r['p_paired']:.3g} · {_fmt(r.get('p_paired_holm'), '.3g')}"
            if isinstance(r.get("paired_test"), str)
            else "—"
        )
        mde = r.get("mde")
        if isinstance(mde, float) and math.isfinite(mde):
            mde = f"{mde:.3g} · {_fmt(r.get('seeds_needed'), '.0f')} seeds"
        lines.append(
            f"| {r['experiment']} | {r['claim']} ({r['source']}) | {r['endpoint']}{cell}: "
            f"{r['metric']}, {r['reduce']} ({r['test']}, predicted {r['predicted']}) | "
            f"{r['treatment']} vs {r['control']}: {means} ({pairs}) | {diff} | "
            f"{_fmt(r.get('stat'))} | {_fmt(r.get('p'), '.3g')} | "
            f"{_fmt(r.get('p_holm'), '.3g')} / {_fmt(r.get('q_bh'), '.3g')} · "
            f"{_fmt(r.get('q_bh_project'), '.3g')} | {paired} | {r['verdict']} | "
            f"{_fmt(r.get('kind'))} | {_fmt(r.get('survives'))} | {_fmt(mde)} | "
            f"{_fmt(r.get('in_kind'))} | {_fmt(r.get('aa'))} | {_fmt(r.get('status'))} | "
            f"{r['mechanism_treatment']} | {_fmt(r.get('pairing'))} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    experiments, root = names_and_root(argv)
    table = claims(root, experiments)
    write_text_atomic(root / "claims.csv", table.to_csv(index=False, float_format="%.5g"))
    text = (
        "# Claims table (generated by `python -m analysis.claims`; do not edit)\n\n"
        "Each row is one pre-registered endpoint (the experiment's preset, `prereg`), "
        "computed from the committed summary.csv exactly as registered; arms paired by "
        "seed. Tests two-sided at α = 0.05 except Fisher's and the sign test's (one-sided, "
        "predicted direction); intervals 95% (TOST: 90%). *kind*: **in kind** when the "
        "registered phenomenon itself happened (runs with the event, Fisher), **in sign** "
        "when a registered directional difference did, else neither. *Paired test*: beside "
        "the registered one, sided as it: an event's exact sign test on the discordant pairs "
        "(one-sided, as Fisher's), a continuous endpoint's paired t or TOST (paired "
        "already), over the pairs whose step-1 batch matches. *Pairing*: a pair whose "
        "step-1 fingerprints (fp_batch, "
        "fp_machine) differ, or for runs without them whose step-1 reward, length, entropy "
        "and dials differ, is named and left out of the paired test; the registered test "
        "keeps every run, as registered. Corrections, in the families the presets register: "
        "Holm and Benjamini–Hochberg within each experiment's endpoints (Holm for the paired "
        "p too); a project-wide BH over every confirmatory endpoint is its own column (q BH "
        "project), not a verdict's family. Rows an audit marks exploratory "
        "(results/audit.yaml) leave every family, as do the rows of a sweep that has not yet "
        "run every registered seed (*interim*: its numbers so far, no verdict). MDE: the "
        "smallest "
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
