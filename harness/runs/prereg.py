"""A preset's pre-registration (`prereg` node): its schema, checked before any compute.

    prereg:
      claim: ...            # what the seed document says happens
      source: ...           # where it says so
      seeds: 5              # pairs (one per seed) the test is planned on
      treatment: <arm>      # arm labels (the preset's `arms`)
      control: <arm>
      endpoints:
        - name: ...
          metric: <summary.csv column>
          reduce: final_any | window_mean | last_evals | event | slope
          window: [first, last]   # window_mean: steps averaged per run
          n: 3                    # last_evals: how many of the last evaluations
          event: surge            # event: one of EVENTS below (the run's
                                  # phenomenon, analysis.events; Fisher's test on the counts)
          warmup: 20              # event collapse: steps before the best reward counts
          test: sign | sign_flip | paired_t | tost | fisher   # optional: see below
          margin: 0.02            # tost: the equivalence margin
          where: {sigma: 1.0}     # optional: only runs whose summary columns equal these
          predicted: greater | less   # treatment vs control, as the seed predicts
          treatment: <arm>        # optional: this endpoint's own arms (a third arm, e.g. the
          control: <arm>          # seed's fix, against the control), else the registration's
      aa_offset: 100        # optional: control-arm seeds s + aa_offset, paired with s, are the
                            # A/A cell (the same arm twice: the noise floor of every endpoint)

Every design here pairs its arms by seed (one seed's runs share prompts and sampler noise), so
a registration that names no test gets a paired one (`test_of`): the exact sign test on the
discordant pairs for an event (one-sided, in the predicted direction), the paired t for a
continuous reduction (two-sided). Fisher's test, registered before, counts runs as if
unpaired; analysis.claims shows the exact paired test (`PAIRED_TEST`) beside every endpoint.

harness.train validates a preset's node before its runs (`check_prereg`, which also states the
smallest p each endpoint's test can reach at the registered seeds and warns where that is not
below α); analysis.claims computes each endpoint exactly as registered; `python -m
analysis.power <experiment>` simulates an event's power.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

REDUCES = ("final_any", "window_mean", "last_evals", "event", "slope")
# the in-kind events of analysis.events: did the phenomenon itself happen in a run
EVENTS = (
    "surge",
    "healthy_surge",
    "stall",
    "collapse",
    "entropy_guard",
    "guard_or_collapse",
    "loops",
    "kl_reversal",
)
TESTS = ("sign", "sign_flip", "paired_t", "tost", "fisher")
EVENT_REDUCES = ("final_any", "event")  # one 0/1 per run
EVENT_TESTS = ("sign", "fisher")  # tests that count runs with an event
PREDICTED = ("greater", "less")
# the paired test beside each registered one (analysis.claims), sided as it: Fisher's counts
# runs as if unpaired, so an event gets the exact sign test on the discordant pairs (one-sided
# in the predicted direction, as Fisher's); the others are paired already
PAIRED_TEST = {"fisher": "sign", "sign": "sign", "sign_flip": "sign_flip"}
PAIRED_TEST |= {"paired_t": "paired_t", "tost": "tost"}
ALPHA = 0.05


def test_of(ep: dict) -> str:
    """An endpoint's registered test: the one it names, else the paired design's (the exact
    sign test for an event, the paired t for a continuous reduction)."""
    return ep.get("test") or ("sign" if ep.get("reduce") in EVENT_REDUCES else "paired_t")


def smallest_p(test: str, pairs: int) -> float:
    """The smallest p `test` can give over `pairs` seed pairs, sided as analysis.claims sides
    it: the sign test (one-sided), every pair discordant the predicted way: 2^-n; the sign-flip
    test (two-sided), every difference of one sign: 2^(1-n); Fisher (one-sided, n vs n runs),
    every treatment run and no control run with the event: 1/C(2n, n); the paired t and TOST
    (continuous t tails): 0."""
    return {
        "sign": 2.0**-pairs,
        "sign_flip": 2.0 ** (1 - pairs),
        "fisher": 1 / math.comb(2 * pairs, pairs),
    }.get(test, 0.0)


def attainable(prereg: dict, alpha: float = ALPHA) -> list[str]:
    """One line per endpoint: the smallest p its registered test and its exact paired test can
    reach at the registered seeds, each against α and α/m (Holm's first step over the
    experiment's m endpoints), e.g. "endpoints[0] (loops), 4 pairs: smallest p fisher 0.0143
    (< α/3 = 0.0167), sign 0.0625 (cannot reach α = 0.05)"."""
    n, m = prereg["seeds"], len(prereg["endpoints"])

    def reach(p: float) -> str:
        if p < alpha / m:
            return f"< α/{m} = {alpha / m:.3g}"
        return f"< α = {alpha} only" if p < alpha else f"cannot reach α = {alpha}"

    out = []
    for i, ep in enumerate(prereg["endpoints"]):
        tests = dict.fromkeys([test_of(ep), PAIRED_TEST[test_of(ep)]])
        parts = [
            f"{t} {smallest_p(t, n):.3g} ({reach(smallest_p(t, n))})"
            if smallest_p(t, n)
            else f"{t} any (a continuous statistic)"
            for t in tests
        ]
        out.append(f"endpoints[{i}] ({ep['name']}), {n} pairs: smallest p {', '.join(parts)}")
    return out


def check_prereg(prereg: Any) -> list[str]:
    """A preset's `prereg` node, checked before any compute: each error names the key, the bad
    value and what is valid. Returns `attainable`'s lines (the smallest p per endpoint) and
    warns for each endpoint whose registered test cannot reach p < α at the registered seeds.
    An empty node (no pre-registration) passes."""
    if not prereg:
        return []

    def need(ok: bool, key: str, value: Any, valid: str) -> None:
        if not ok:
            raise ValueError(f"prereg.{key}={value!r}; valid: {valid}")

    for key in ("claim", "source", "treatment", "control"):
        need(isinstance(prereg.get(key), str) and prereg.get(key), key, prereg.get(key), "text")
    seeds = prereg.get("seeds")
    need(isinstance(seeds, int) and seeds >= 2, "seeds", seeds, "an int >= 2")
    eps = prereg.get("endpoints")
    need(isinstance(eps, list) and len(eps) > 0, "endpoints", eps, "a non-empty list")
    for i, ep in enumerate(eps):
        at = f"endpoints[{i}]."
        for key, valid in [("reduce", REDUCES), ("predicted", PREDICTED)]:
            need(ep.get(key) in valid, at + key, ep.get(key), ", ".join(valid))
        test = test_of(ep)
        need(test in TESTS, at + "test", ep.get("test"), ", ".join(TESTS))
        for key in ("name", "metric"):
            need(isinstance(ep.get(key), str), at + key, ep.get(key), "text")
        for key in ("treatment", "control"):
            if key in ep:
                need(isinstance(ep[key], str) and ep[key], at + key, ep[key], "an arm label")
        if ep["reduce"] == "window_mean":
            w = ep.get("window")
            need(
                isinstance(w, list) and len(w) == 2 and w[0] <= w[1],
                at + "window",
                w,
                "[first step, last step]",
            )
        if ep["reduce"] == "last_evals":
            need(isinstance(ep.get("n"), int) and ep["n"] >= 1, at + "n", ep.get("n"), ">= 1")
        if test == "tost":
            m = ep.get("margin")
            need(isinstance(m, (int, float)) and m > 0, at + "margin", m, "> 0")
        if ep["reduce"] == "event":
            need(ep.get("event") in EVENTS, at + "event", ep.get("event"), ", ".join(EVENTS))
            w = ep.get("warmup", 20)
            need(isinstance(w, int) and w >= 0, at + "warmup", w, "an int >= 0")
        events = ep["reduce"] in EVENT_REDUCES
        need(
            events == (test in EVENT_TESTS),
            at + "reduce/test",
            f"{ep['reduce']}/{test}",
            "final_any or event with sign or fisher (they count runs with an event); "
            "window_mean, last_evals or slope with sign_flip, paired_t or tost",
        )
        where = ep.get("where", {})
        need(isinstance(where, dict), at + "where", where, "a mapping of summary columns to values")
    aa = prereg.get("aa_offset")
    need(aa is None or (isinstance(aa, int) and aa >= 1), "aa_offset", aa, "an int >= 1")
    lines = attainable(prereg)
    for ep, line in zip(eps, lines):
        if smallest_p(test_of(ep), seeds) >= ALPHA:
            warnings.warn(
                f"prereg: {line}: its registered test cannot reach p < {ALPHA}", stacklevel=2
            )
    return lines
