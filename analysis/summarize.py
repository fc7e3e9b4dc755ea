"""Reduce raw training run folders to the committed `results/<experiment>/summary.csv`.

    python -m analysis.summarize [EXPERIMENT ...] [--results DIR] [force=true | keep=true]

summarises the experiments named, else every experiment folder under DIR holding run folders.


Per-step rows (run × step, selected metrics, arm/seed/config columns); runs that did not reach
their configured `steps` are kept and flagged `complete = False` (the figures drop them). Beside
it: `meta/<run>.json` (each run's meta.json, for audit), `mechanism.csv` (every run's step-0
mechanism check, one row per run, mechanism-only runs included) and `prereg.yaml` (the
pre-registration the runs were made under; runs that disagree on it are an error, not a merge).

Nothing is replaced silently: without `force=true` it refuses, naming the runs, when the raw
runs are not one experiment (`analysis.runs.config_problems`: a key that differs although no
sweep varied it, duplicate runs) or when the new summary.csv would drop runs the one on disk
has (a toy sweep summarised into a folder of committed results).

`keep=true` continues a sweep whose finished runs' folders are gone (a new machine holds only
what was committed): the committed rows of every run with no folder here are kept as they are,
in summary.csv and mechanism.csv, and the runs here are added or replace theirs. It refuses when
the runs here were made under another pre-registration than the committed prereg.yaml, when an
arm's recipe columns (objective, noise, lr, steps, weights, ...) differ between kept and new runs,
or when a new run repeats a kept run's arm and seed under another folder name.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import yaml

from analysis.runs import (
    config_problems,
    doubled,
    load_mechanism,
    load_prereg,
    load_raw,
    names_and_root,
)
from harness.base.io import write_text_atomic


def refusals(root: Path, exp: str, df: pd.DataFrame) -> list[str]:
    """Why summarising `exp` would lose or misread results (empty: safe to write)."""
    problems = config_problems(root, exp)
    out = root / exp / "summary.csv"
    if out.exists():
        dropped = sorted(set(pd.read_csv(out, usecols=["run"]).run) - set(df.run))
        if dropped:
            problems.append(
                f"{out} holds {len(dropped)} runs that have no run folder here "
                f"(e.g. {dropped[0]}): the new summary would drop them"
            )
    return problems


# the summary's columns that define an arm's recipe: kept and new runs of one arm must agree
RECIPE_COLUMNS = [
    "objective",
    "noise",
    "sigma",
    "staleness",
    "minibatches",
    "lr",
    "logp_old_source",
    "steps",
    "weights_sha",
    "recipe_hash",
]


def _value(v) -> str:
    """A recipe value as text, alike whether it was read from a CSV or a run's config (1 and
    1.0, None and NaN)."""
    if pd.isna(v):
        return ""
    try:
        return repr(float(v))
    except (TypeError, ValueError):
        return str(v)


def keep_committed(
    root: Path, exp: str, df: pd.DataFrame, mech: pd.DataFrame, prereg: dict
) -> tuple[pd.DataFrame, pd.DataFrame, list[str]]:
    """`df` and `mech` (the runs here) joined, in run order, with the committed rows of the
    runs that have no folder here, and why the two sets are not one experiment (empty: safe to
    write)."""
    out = root / exp
    old = pd.read_csv(out / "summary.csv", dtype={"weights_sha": str, "recipe_hash": str})
    kept = old[~old.run.isin(df.run)]
    problems = []
    path = out / "prereg.yaml"
    committed = (yaml.safe_load(path.read_text()) or {}) if path.exists() else {}
    if committed != prereg:
        problems.append(f"the runs here were made under another pre-registration than {path}")
    both = pd.concat([kept.assign(kept=True), df.assign(kept=False)], ignore_index=True)
    for arm, g in both.groupby("arm"):
        for col in RECIPE_COLUMNS:
            values = {kept: sorted(set(g[g.kept == kept][col].map(_value))) for kept in (1, 0)}
            if all(values.values()) and values[1] != values[0]:
                problems.append(f"{arm}: {col} = {values[1]} in the kept runs, {values[0]} here")
    problems += [
        f"{arm}, seed {seed}: kept run and run here under other names ({', '.join(runs)})"
        for (arm, seed), runs in doubled(both).items()
    ]
    mech_path = out / "mechanism.csv"
    if mech_path.exists():
        old_mech = pd.read_csv(mech_path)
        mech = pd.concat([old_mech[~old_mech.run.isin(mech.run)], mech]).sort_values("run")
    # the columns in today's order (load_raw's), then any the committed summary alone has
    columns = [*df.columns, *(c for c in kept.columns if c not in df.columns)]
    df = pd.concat([kept, df])[columns].sort_values(["run", "step"], kind="stable")
    return df.reset_index(drop=True), mech.reset_index(drop=True), problems


def copy_meta(exp_dir: Path, runs) -> None:
    """Each run's meta.json (start and end times, host, threads, machines, git, overrides,
    fingerprints) beside the summary, as meta/<run>.json: small, committed, so a reader can
    check when a run ran against its registration commit. A run with no folder here (keep=true)
    keeps the copy committed before."""
    for run in runs:
        src = exp_dir / run / "meta.json"
        if src.exists():
            write_text_atomic(exp_dir / "meta" / f"{run}.json", src.read_text())


def main(argv: list[str] | None = None) -> None:
    names, root = names_and_root(argv)
    switches = {e for e in names if "=" in e}
    if bad := sorted(switches - {"force=true", "keep=true"}):
        raise SystemExit(f"[summarize] unknown switch {bad}: valid are force=true and keep=true")
    force, keep = "force=true" in switches, "keep=true" in switches
    exps = [e for e in names if e not in switches]
    exps = exps or sorted({p.parent.parent.name for p in root.glob("*/*/metrics.jsonl")})
    for exp in exps:
        df = load_raw(root, exp)
        if df.empty:
            print(f"[summarize] {exp}: no runs")
            continue
        last = df.groupby("run").step.transform("max")
        df["complete"] = last >= df.steps
        mech, prereg = load_mechanism(root, exp), load_prereg(root, exp)
        if keep and (root / exp / "summary.csv").exists():
            df, mech, problems = keep_committed(root, exp, df, mech, prereg)
            problems += config_problems(root, exp)
        else:
            problems = refusals(root, exp, df)
        if problems and not force:
            raise SystemExit(
                f"[summarize] {exp}: refused, nothing written:\n  - "
                + "\n  - ".join(problems)
                + "\nMove the stray runs out, or pass force=true to write the summary anyway."
            )
        if not mech.empty:
            csv = mech.to_csv(index=False, float_format="%.5g")
            write_text_atomic(root / exp / "mechanism.csv", csv)
        if prereg:
            write_text_atomic(root / exp / "prereg.yaml", yaml.safe_dump(prereg, sort_keys=False))
        out = root / exp / "summary.csv"
        write_text_atomic(out, df.to_csv(index=False, float_format="%.5g"))
        copy_meta(root / exp, df.run.unique())
        n = df.groupby("run").complete.first()
        print(f"[summarize] {exp}: {n.sum()} complete / {len(n)} runs → {out}")


if __name__ == "__main__":
    main()
