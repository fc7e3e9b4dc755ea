"""The phenomena themselves, per run: did the entropy surge, did training collapse, did the
clipped/deleted mass escalate, did responses loop? Small pure functions on one run's per-step
summary rows (a frame with `step` and the summary.csv columns), used by analysis.claims (the
in-kind endpoints) and the figures (each run's event marked on its trajectory).

  surge          the 10-step running mean of entropy reaches ≥ 2× its steps 1–10 mean
                 (Calibrated Clipping's entropy surge; the event and its first step)
  healthy_surge  a surge after a healthy phase (seed 002's shape: the run trains, then fails):
                 before the surge's first step the 10-step running mean of training reward
                 rose ≥ 0.05 above its steps 1–10 mean (with 32 rows a step, ~2 standard
                 errors of a 10-step mean at reward 0.3)
  collapse       the 10-step running mean of training reward falls below 0.5× its best
                 after the warm-up and stays there to the end (the SNR post §2's collapse)
  stall          the run never trained: the 10-step running mean of training reward never rose
                 ≥ 0.05 above its steps 1–10 mean (no healthy phase at all)
  entropy_guard  the training loop's own entropy guard: some step's entropy > 2× the steps
                 1–10 mean (reported apart from `collapse`: the reward guard alone was
                 confounded by a task switch)
  guard_or_collapse  either of the two: the run's entropy blew up or its reward collapsed
                 (the SNR post §2's failure, which it describes by both)
  escalation     the slope of the deleted or clipped mass over training, per 100 steps, and
                 its last-quarter / first-quarter fold (the SNR post §2: the reject arm's
                 deleted mass grows several-fold while clamp's does not)
  loops          the terminal-loop rate over the last 20% of steps (OPSD §4); an event when
                 any response there ends in a loop
  kl_reversal    the exact forward KL on S_t over the last 20% of steps is ≥ 1.25× its steps
                 1–10 mean: distillation moved the student away from its teacher (OPSD Prop. 1:
                 the clipped objective can lower its own loss while the exact KL rises)
  margins        how close a run came to the surge and collapse thresholds (for nulls)
"""

from __future__ import annotations

import numpy as np
import pandas as pd

WINDOW = 10  # steps in a running mean and in the baseline (steps 1–10)


def running_mean(run: pd.DataFrame, col: str, window: int = WINDOW) -> pd.Series:
    """The trailing `window`-step mean of `col`, indexed by step (NaN before a full window)."""
    s = run.sort_values("step").set_index("step")[col]
    return s.rolling(window, min_periods=window).mean()


def surge(run: pd.DataFrame, factor: float = 2.0, window: int = WINDOW) -> tuple[bool, float]:
    """(event, first step): the running mean of entropy_mean ≥ factor × its steps 1–10 mean."""
    s = run.sort_values("step").set_index("step")["entropy_mean"]
    base = s[s.index <= window].mean()
    hit = running_mean(run, "entropy_mean", window) >= factor * base
    return _first(hit)


HEALTHY_RISE = 0.05  # the registered rise of the reward's running mean over its start


def healthy_rise(run: pd.DataFrame, until: float = np.inf, window: int = WINDOW) -> float:
    """The largest rise of the 10-step running mean of reward_mean over its steps 1–10 mean,
    at steps before `until` (NaN when no full window precedes it)."""
    s = run.sort_values("step").set_index("step")["reward_mean"]
    r = running_mean(run, "reward_mean", window)
    r = r[r.index < until].dropna()
    return float(r.max() - s[s.index <= window].mean()) if len(r) else float("nan")


def healthy_surge(run: pd.DataFrame, rise: float = HEALTHY_RISE, window: int = WINDOW):
    """(event, surge step): a surge whose run first trained, i.e. `healthy_rise` before the
    surge's first step is ≥ `rise` (seed 002: training proceeds normally, then entropy surges)."""
    event, at = surge(run, window=window)
    if event and healthy_rise(run, until=at, window=window) >= rise:
        return True, at
    return False, float("nan")


def stall(run: pd.DataFrame, rise: float = HEALTHY_RISE, window: int = WINDOW):
    """(event, last step): the run never trained: the 10-step running mean of training reward
    never rose `rise` above its steps 1–10 mean (the complement of `healthy_surge`'s healthy
    phase; the SNR post §2 and seed 002: deleting the fork tokens' gradient, where β lands,
    removes the learning signal)."""
    r = healthy_rise(run, window=window)
    return bool(r < rise), float(run.step.max()) if r < rise else float("nan")


def entropy_guard(run: pd.DataFrame, factor: float = 2.0, window: int = WINDOW):
    """(event, first step): some step's entropy_mean > factor × its steps 1–10 mean (the
    loop's guard, `guard.entropy_surge`)."""
    s = run.sort_values("step").set_index("step")["entropy_mean"]
    return _first((s > factor * s[s.index <= window].mean()) & (s.index > window))


def collapse(run: pd.DataFrame, warmup: int = 20, factor: float = 0.5, window: int = WINDOW):
    """(event, step): after `warmup` steps, the running mean of reward_mean falls below
    factor × its best running mean so far and never climbs back above it; the step is the
    first of that final stretch below."""
    r = running_mean(run, "reward_mean", window)
    r = r[r.index > warmup].dropna()
    if r.empty:
        return False, float("nan")
    below = r < factor * r.cummax()
    if not below.iloc[-1]:
        return False, float("nan")
    above = np.flatnonzero(~below.to_numpy())
    return True, float(r.index[above[-1] + 1] if len(above) else r.index[0])


def guard_or_collapse(run: pd.DataFrame, warmup: int = 20, window: int = WINDOW):
    """(event, first step): an entropy_guard or a collapse event, whichever came first."""
    hits = [
        at
        for hit, at in (entropy_guard(run, window=window), collapse(run, warmup, window=window))
        if hit
    ]
    return (True, float(min(hits))) if hits else (False, float("nan"))


def escalation(run: pd.DataFrame, col: str) -> tuple[float, float]:
    """(slope of `col` per 100 steps by least squares, last-quarter mean / first-quarter mean)."""
    s = run.sort_values("step").dropna(subset=[col])
    x, y = s.step.to_numpy(float), s[col].to_numpy(float)
    if len(x) < 2:
        return float("nan"), float("nan")
    slope = float(np.polyfit(x, y, 1)[0] * 100)
    q = max(1, len(y) // 4)
    first = y[:q].mean()
    return slope, float(y[-q:].mean() / first) if first > 0 else float("nan")


def tail_mean(run: pd.DataFrame, col: str, tail: float = 0.2) -> float:
    """The mean of `col` over the last `tail` of the steps (steps > (1 − tail)·last step)."""
    s = run.sort_values("step")
    return float(s[s.step > s.step.max() * (1 - tail)][col].mean())


def loops(run: pd.DataFrame, tail: float = 0.2) -> tuple[bool, float]:
    """(event, rate): the mean terminal-loop rate over the last `tail` of the steps; an event
    when it is > 0."""
    rate = tail_mean(run, "repetition_terminal_loop_rate", tail)
    return rate > 0, rate


KL_RISE = 1.25  # chosen on the smollm2_opsd_pilot seed: clipped arm 2.1×, exact arm 0.74×


def kl_reversal(run: pd.DataFrame, factor: float = KL_RISE, tail: float = 0.2):
    """(event, ratio): the tail mean of opsd_fkl over its steps 1–10 mean; an event at ≥ factor."""
    first = run[run.step <= WINDOW].opsd_fkl.mean()
    ratio = tail_mean(run, "opsd_fkl", tail) / first if first > 0 else float("nan")
    return bool(ratio >= factor), ratio


def margins(run: pd.DataFrame, warmup: int = 20, window: int = WINDOW) -> dict:
    """How close a run came to each event, as the ratio its threshold is stated in (for a null:
    the dose-response of a phenomenon that did not happen):
      entropy_peak   max running mean of entropy / its steps 1–10 mean   (surge at ≥ 2)
      reward_final   final running mean of reward / its best after the warm-up (collapse < 0.5)
      reward_trough  the deepest fall of that running mean below its best so far (collapse
                     needs < 0.5 and no recovery)
    NaN where the run did not log the metric."""
    out = {"entropy_peak": np.nan, "reward_final": np.nan, "reward_trough": np.nan}
    s = run.sort_values("step").set_index("step")
    if "entropy_mean" in s and s.entropy_mean.notna().any():
        base = s.entropy_mean[s.index <= window].mean()
        out["entropy_peak"] = float(running_mean(run, "entropy_mean", window).max() / base)
    if "reward_mean" in s and s.reward_mean.notna().any():
        r = running_mean(run, "reward_mean", window)
        after = r[r.index > warmup].dropna()
        if not after.empty and after.max() > 0:
            out["reward_final"] = float(after.iloc[-1] / after.max())
            out["reward_trough"] = float((after / after.cummax()).min())
    return out


def _first(hit: pd.Series) -> tuple[bool, float]:
    steps = hit.index[hit.fillna(False).to_numpy(bool)]
    return (True, float(steps[0])) if len(steps) else (False, float("nan"))


EVENTS = {
    "surge": surge,
    "healthy_surge": healthy_surge,
    "stall": stall,
    "collapse": collapse,
    "entropy_guard": entropy_guard,
    "guard_or_collapse": guard_or_collapse,
    "loops": loops,
    "kl_reversal": kl_reversal,
}
NEEDS = {  # the summary columns each event reads (entropy_mean where not listed)
    "stall": ["reward_mean"],
    "collapse": ["reward_mean"],
    "healthy_surge": ["entropy_mean", "reward_mean"],
    "guard_or_collapse": ["entropy_mean", "reward_mean"],
    "loops": ["repetition_terminal_loop_rate"],
    "kl_reversal": ["opsd_fkl"],
}
WARMUP = ("collapse", "guard_or_collapse")  # events that take the warm-up


def run_events(df: pd.DataFrame, warmup: int = 20) -> pd.DataFrame:
    """One row per run of a summary: arm, seed, complete, and for each event whether it
    happened and when (loops: the tail's rate instead of a step)."""
    rows = []
    for run, g in df.groupby("run", sort=True):
        row = {"run": run, "arm": g.arm.iloc[0], "seed": g.seed.iloc[0]}
        row["complete"] = bool(g.complete.iloc[0]) if "complete" in g else True
        for name, fn in EVENTS.items():
            if any(n not in g or g[n].isna().all() for n in NEEDS.get(name, ["entropy_mean"])):
                row[name], row[f"{name}_at"] = np.nan, np.nan
                continue
            event, at = fn(g, warmup=warmup) if name in WARMUP else fn(g)
            row[name], row[f"{name}_at"] = float(event), at
        rows.append(row)
    return pd.DataFrame(rows, columns=None if rows else ["run", "arm", "seed", "complete"])
