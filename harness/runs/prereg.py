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
          test: paired_t | tost | fisher
          margin: 0.02            # tost: the equivalence margin
          where: {sigma: 1.0}     # optional: only runs whose summary columns equal these
          predicted: greater | less   # treatment vs control, as the seed predicts
          treatment: <arm>        # optional: this endpoint's own arms (a third arm, e.g. the
          control: <arm>          # seed's fix, against the control), else the registration's
      aa_offset: 100        # optional: control-arm seeds s + aa_offset, paired with s, are the
                            # A/A cell (the same arm twice: the noise floor of every endpoint)

harness.train validates a preset's node before its runs; analysis.claims computes each endpoint
exactly as registered.
"""

from __future__ import annotations

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
TESTS = ("paired_t", "tost", "fisher")
PREDICTED = ("greater", "less")


def check_prereg(prereg: Any) -> None:
    """A preset's `prereg` node, checked before any compute: each error names the key, the bad
    value and what is valid. An empty node (no pre-registration) passes."""
    if not prereg:
        return

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
        for key, valid in [("reduce", REDUCES), ("test", TESTS), ("predicted", PREDICTED)]:
            need(ep.get(key) in valid, at + key, ep.get(key), ", ".join(valid))
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
        if ep["test"] == "tost":
            m = ep.get("margin")
            need(isinstance(m, (int, float)) and m > 0, at + "margin", m, "> 0")
        if ep["reduce"] == "event":
            need(ep.get("event") in EVENTS, at + "event", ep.get("event"), ", ".join(EVENTS))
            w = ep.get("warmup", 20)
            need(isinstance(w, int) and w >= 0, at + "warmup", w, "an int >= 0")
        events = ep["reduce"] in ("final_any", "event")
        if ep["test"] == "fisher" or events:
            need(
                events and ep["test"] == "fisher",
                at + "reduce/test",
                f"{ep['reduce']}/{ep['test']}",
                "final_any or event with fisher (Fisher's test counts runs with an event)",
            )
        where = ep.get("where", {})
        need(isinstance(where, dict), at + "where", where, "a mapping of summary columns to values")
    aa = prereg.get("aa_offset")
    need(aa is None or (isinstance(aa, int) and aa >= 1), "aa_offset", aa, "an int >= 1")
