"""The correction grid from config: `grid` composes any point of Table 9 from a policy `Term` and
the corrections the methods and the peer frameworks define (CORRECTIONS, assembled here from the
modules that define them)."""

from __future__ import annotations

import dataclasses
from typing import Any

from harness.objectives.core import PolicyObjective, RatioCorrection, Term
from harness.objectives.methods import CISWeight, S2TMask, TVMask
from harness.objectives.peers import DivergenceMask, OffPolicySeqMask, OutlierTokenMask

# the corrections a grid point can multiply in: name -> dataclass (its fields are the kwargs);
# the peers' too: verl's k1 rejection is kind ratio (treatment mask), DPPO Binary-KL kind tv
# (divergence kl)
CORRECTIONS = {
    "ratio": RatioCorrection,
    "tv": TVMask,
    "cis": CISWeight,
    "s2t": S2TMask,
    "rs": DivergenceMask,
    "opsm": OffPolicySeqMask,
    "outlier": OutlierTokenMask,
}


def build_correction(spec: dict[str, Any]):
    """{"kind": a CORRECTIONS name, **fields} -> the correction; bad names list the valid."""
    spec = dict(spec)
    kind = spec.pop("kind", None)
    if kind not in CORRECTIONS:
        raise ValueError(f"grid correction kind={kind!r}; valid: {', '.join(CORRECTIONS)}")
    cls = CORRECTIONS[kind]
    fields = [f.name for f in dataclasses.fields(cls)]
    bad = sorted(set(spec) - set(fields))
    if bad:
        raise TypeError(f"grid correction {kind!r}: unknown field(s) {bad}; valid: {fields}")
    return cls(**spec)


def grid(
    *,
    ratio: str = "trust",
    level: str = "token",
    treatment: str = "clip",
    lo: float = 0.8,
    hi: float = 1.28,
    c: float | None = None,
    lam: float = 1.0,
    corrections: list[dict[str, Any]] | None = None,
    aggregation: str = "token-mean",
    rejected_in_denominator: bool = True,
    norm_len: int | None = None,
) -> PolicyObjective:
    """Any Table 9 point from config: a policy Term (ratio, level, treatment, bounds) times any
    corrections, e.g. `corrections=[{kind: ratio, ratio: ti, hi: 2}, {kind: cis}]`: a ratio
    correction (TIS clamp, MIS mask, IcePop pop), the DPPO-TV mask, CIS weights, STAPO's S2T."""
    return PolicyObjective(
        Term(ratio, level, treatment, lo, hi, c, lam),
        tuple(build_correction(x) for x in corrections or ()),
        aggregation=aggregation,
        rejected_in_denominator=rejected_in_denominator,
        norm_len=norm_len,
        band=(lo, hi),
    )
