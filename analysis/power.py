"""Power of a registered event by simulating it, not by assuming its rate.

    python -m analysis.power EXPERIMENT [--base 0.3] [--gain 0.3] [--runs 2000] [--seed 0]

For each registered event endpoint that reads the training reward alone (analysis.events: stall,
collapse), simulates runs of the preset's length and batch (rollout.prompts_per_step ×
group_size rewards a step, each Bernoulli) and finds the event with analysis.events, under
  no learning   every step's success probability is `base`
  learning      it rises linearly from `base` at step 1 to `base + gain` at the last step.
From the two event rates, the exact power (analysis.stats) of the registered test and of the
paired sign test at the registered seeds, the arm predicted to have more events taking the
likelier model. E.g. smollm2_clip_confirm's stall (32 rewards a step, 50 steps, base 0.3): a run
that does not learn still rises 0.05 above its start about a third of the time, so the line
calls a flat run a stall only about two times in three, not the 0.9 the preset assumed.
"""

from __future__ import annotations

import argparse

import numpy as np
import pandas as pd

from analysis.events import NEEDS, run_events
from analysis.runs import preset_config
from analysis.stats import power_fisher, power_sign
from harness.runs.prereg import ALPHA, attainable, check_prereg, test_of

REWARD_ONLY = tuple(e for e, cols in NEEDS.items() if cols == ["reward_mean"])


def reward_runs(
    rng: np.random.Generator, runs: int, steps: int, batch: int, base: float, gain: float
) -> pd.DataFrame:
    """`runs` simulated summaries (run, arm, seed, step, reward_mean): each step's reward_mean
    the mean of `batch` Bernoulli rewards whose probability rises linearly from `base` to
    `base + gain` over the steps (gain 0: a run that does not learn)."""
    for key, value, ok, valid in [
        ("base", base, 0 <= base <= 1, "a probability in [0, 1]"),
        ("base + gain", base + gain, 0 <= base + gain <= 1, "a probability in [0, 1]"),
        ("steps", steps, steps >= 2, "an int >= 2"),
        ("batch", batch, batch >= 1, "an int >= 1"),
    ]:
        if not ok:
            raise ValueError(f"{key}={value}; valid: {valid}")
    prob = base + gain * np.arange(steps) / (steps - 1)
    reward = rng.binomial(batch, np.broadcast_to(prob, (runs, steps))) / batch
    return pd.DataFrame(
        {
            "run": np.repeat(np.arange(runs), steps),
            "arm": "sim",
            "seed": np.repeat(np.arange(runs), steps),
            "step": np.tile(np.arange(1, steps + 1), runs),
            "reward_mean": reward.ravel(),
        }
    )


def event_rate(ep: dict, sims: pd.DataFrame) -> float:
    """The share of simulated runs in which the endpoint's event happened (analysis.events)."""
    if ep.get("event") not in REWARD_ONLY:
        raise ValueError(
            f"event={ep.get('event')!r}; valid: {', '.join(REWARD_ONLY)} (reward only)"
        )
    return float(run_events(sims, warmup=ep.get("warmup", 20))[ep["event"]].mean())


def simulate(exp: str, base: float, gain: float, runs: int, seed: int = 0) -> list[str]:
    """One line per registered endpoint of `exp`: its event's rate without and with learning,
    and the power of its registered and paired tests at the registered seeds."""
    cfg = preset_config(exp)
    prereg = cfg.get("prereg")
    if not prereg:
        raise ValueError(f"experiment={exp!r}; valid: a training preset with a prereg node")
    check_prereg(prereg)
    steps, n = cfg["steps"], prereg["seeds"]
    batch = cfg["rollout"]["prompts_per_step"] * cfg["rollout"]["group_size"]
    rng = np.random.default_rng(seed)
    flat = reward_runs(rng, runs, steps, batch, base, 0.0)
    rising = reward_runs(rng, runs, steps, batch, base, gain)
    out = attainable(prereg)
    for ep in prereg["endpoints"]:
        if ep.get("reduce") != "event" or ep.get("event") not in REWARD_ONLY:
            out.append(f"{ep['name']}: not simulated (not an event of the reward alone)")
            continue
        q_flat, q_rise = event_rate(ep, flat), event_rate(ep, rising)
        hi, lo = max(q_flat, q_rise), min(q_flat, q_rise)
        registered = power_fisher if test_of(ep) == "fisher" else power_sign
        out.append(
            f"{ep['name']}: {ep['event']} in {q_flat:.0%} of {runs} runs that do not learn "
            f"(reward Bernoulli({base:g}), {batch} a step, {steps} steps) and {q_rise:.0%} of "
            f"runs that learn ({base:g} → {base + gain:g}); at {n} seeds, "
            f"{q_flat if q_flat == hi else q_rise:.0%} vs {lo:.0%}: power "
            f"{test_of(ep)} {registered(n, hi, lo, ALPHA):.2f}, "
            f"paired sign test {power_sign(n, hi, lo, ALPHA):.2f} (α = {ALPHA})"
        )
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("experiment")
    ap.add_argument("--base", type=float, default=0.3, help="success probability at step 1")
    ap.add_argument("--gain", type=float, default=0.3, help="its rise over a learning run")
    ap.add_argument("--runs", type=int, default=2000, help="simulated runs per model")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    print("\n".join(simulate(a.experiment, a.base, a.gain, a.runs, a.seed)))


if __name__ == "__main__":
    main()
