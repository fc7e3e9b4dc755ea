"""Policy objectives on the correction grid: `build_objective(name, **kwargs)`.

    obj = build_objective("tis", cap=2.0, level="sequence")
    out = obj(logp, batch)          # logp: log π_θ of the sampled tokens [B, T], with grad
    out.loss.backward(); log(out.metrics)

Registries: OBJECTIVES (ppo_clip, gspo, tis, mis, cispo, band, dppo_tv, snr_shrink, nsr,
calibrated_clip, cis, stapo, opsd_fkl, grid; the peer frameworks' rollout_rs, trl_is, opsm,
geo_mask, sapo, geo_mean, dppo_kl, clip_cov, kl_cov, luspo, vespo) and AGGREGATIONS (token-mean,
seq-mean-token-mean, seq-mean-token-sum, seq-mean-token-sum-norm). Unknown names raise KeyError
and unknown kwargs TypeError, both listing the valid ones.

Training-loop contract: `Objective` (harness.objectives.core) declares every hook the loop,
setup, validation and the mechanism check ask, with the plain policy loss's defaults, so a
subclass that defines only `__call__(logp, batch)` trains as it is:
  - `inputs`: "logp" (obj(logp, batch)) or "logits" (obj(student, teacher, mask)); a "logits"
    objective `needs_teacher` and validation asks for distill.enabled with it, and only with it;
  - `aggregated`: the builder takes the aggregation group (aggregation, rejected_in_denominator,
    norm_len); PolicyObjective does, the base reduces its own loss;
  - `window()`: the band and clip window the step-0 mechanism check (harness.rl.mechanism)
    measures r = π_old/μ against; the reference [0.5, 2] and [0.8, 1.28] unless it declares its own;
  - `calibration_due(step, steps)` / `calibrate(...)` (calibrated_clip): a high-precision shadow
    pass on that step's last minibatch (see harness.objectives.calibrated);
  - `refresh_due(step)` / `refresh(Δ_cal, p_t)` (snr_shrink adaptive): a calibration pass at the
    live weights before the step;
  - `check(steps)`: refuse a run too short for it, before any compute;
  - `state_dict()` / `load_state_dict()` (empty when stateless): checkpointed with the run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from harness.base.registry import build
from harness.objectives import calibrated, grid, methods, nsr, opsd, peers
from harness.objectives.core import AGGREGATIONS, Objective, ObjectiveOutput

# name -> builder, from the modules that define them (the aggregations are core's); a plugin adds
# its own with `harness.base.registry.register(OBJECTIVES, name)`
OBJECTIVES: dict[str, Callable[..., Objective]] = {
    "ppo_clip": methods.ppo_clip,
    "gspo": methods.gspo,
    "tis": methods.tis,
    "mis": methods.mis,
    "cispo": methods.cispo,
    "band": methods.band,
    "dppo_tv": methods.dppo_tv,
    "cis": methods.cis,
    "stapo": methods.stapo,
    "snr_shrink": methods.snr_shrink,
    "grid": grid.grid,
    "calibrated_clip": calibrated.calibrated_clip,
    "nsr": nsr.nsr,
    "opsd_fkl": opsd.opsd_fkl,
    "rollout_rs": peers.rollout_rs,
    "trl_is": peers.trl_is,
    "opsm": peers.opsm,
    "geo_mask": peers.geo_mask,
    "sapo": peers.sapo,
    "geo_mean": peers.geo_mean,
    "dppo_kl": peers.dppo_kl,
    "clip_cov": peers.clip_cov,
    "kl_cov": peers.kl_cov,
    "luspo": peers.luspo,
    "vespo": peers.vespo,
}

__all__ = [
    "AGGREGATIONS",
    "OBJECTIVES",
    "Objective",
    "ObjectiveOutput",
    "build_objective",
    "run_objective",
]


def build_objective(name: str, **kwargs: Any) -> Objective:
    return build(OBJECTIVES, name, "objective", **kwargs)


def run_objective(name: str, kwargs: dict[str, Any], aggregation: dict[str, Any]) -> Objective:
    """The objective a run trains: built from its node's kwargs and, where it takes the
    aggregation group (`Objective.aggregated`), the group's node {name, **keys} too."""
    obj = build_objective(name, **kwargs)
    if not obj.aggregated:
        return obj
    agg = dict(aggregation)
    return build_objective(name, **kwargs, aggregation=agg.pop("name"), **agg)
