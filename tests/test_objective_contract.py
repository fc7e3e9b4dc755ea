"""The objective contract as a type (harness.objectives.core.Objective): a subclass that defines
only `__call__` is a plain logp objective; the loop calls the hooks an objective declares, on its
cadence; validation asks the objective what the run needs, never its name."""

import json

import pytest
import torch

from harness import train
from harness.base.batch import TokenBatch
from harness.noise import build_noise
from harness.objectives import OBJECTIVES, Objective, ObjectiveOutput
from harness.objectives.core import Window
from harness.runs import validate
from tests.test_train import _cfg, _metrics, alternating_reward, objective_overrides  # noqa: F401  (a fixture)


class Reinforce(Objective):
    """−A·log π, token mean: the whole of a user's objective, nothing else declared."""

    def __call__(self, logp: torch.Tensor, batch: TokenBatch) -> ObjectiveOutput:
        loss = -(batch.advantages * logp * batch.mask).sum() / batch.mask.sum()
        return ObjectiveOutput(loss, {})


class Recorded(Reinforce):
    """Reinforce that keeps what it was called with, for the by-hand loss."""

    def __init__(self) -> None:
        self.seen: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]] = []

    def __call__(self, logp, batch):
        out = super().__call__(logp, batch)
        m = batch.mask
        self.seen.append((logp.detach(), batch.advantages, m, float(out.loss.detach())))
        return out


class Cadenced(Reinforce):
    """Declares a calibration every second step and a refresh before step 3."""

    def __init__(self) -> None:
        self.calls, self.calibrated_after, self.refreshed = 0, [], []

    def __call__(self, logp, batch):
        self.calls += 1
        return super().__call__(logp, batch)

    def calibration_due(self, step: int, steps: int) -> bool:
        return step % 2 == 0

    def calibrate(self, logp_hp, logp_old_hp, logp_lp, logp_old_lp, advantages, mask):
        self.calibrated_after.append(self.calls)
        return {"own/calibrated": 1.0}

    def refresh_due(self, step: int) -> bool:
        return step == 3

    def refresh(self, delta_cal, conf_cal):
        self.refreshed.append(len(delta_cal))
        return {"own/refreshed": 1.0}


class Distils(Objective):
    """A distillation loss of the user's: mean KL(teacher ‖ student) per position."""

    inputs = "logits"

    def __call__(self, student_logits, teacher_logits, mask):
        p = teacher_logits.log_softmax(-1)
        kl = (p.exp() * (p - student_logits.log_softmax(-1))).sum(-1)
        return ObjectiveOutput((kl * mask).sum() / mask.sum(), {})


def test_the_base_defaults_are_the_plain_logp_objective():
    obj = Reinforce()
    assert obj.inputs == "logp" and not obj.needs_teacher and not obj.aggregated
    assert obj.window() == Window() == ((0.5, 2.0), (0.8, 1.28))
    assert obj.calibrations(100) == 0 and not any(obj.refresh_due(s) for s in range(1, 100))
    assert obj.state_dict() == {}
    obj.check(1)  # any run length
    # −A·log π token mean: A = (1, −1), log π = (−1, −2): −(1·(−1) + (−1)·(−2)) / 2 = −0.5
    batch = TokenBatch(
        tokens=torch.zeros(1, 2, dtype=torch.long),
        mask=torch.ones(1, 2),
        logp_old=None,
        logp_mu=torch.zeros(1, 2),
        advantages=torch.tensor([[1.0, -1.0]]),
    )
    assert obj(torch.tensor([[-1.0, -2.0]]), batch).loss.item() == -0.5
    assert Distils().needs_teacher
    with pytest.raises(TypeError, match="abstract"):
        Objective()  # the loss itself has no default
    with pytest.raises(NotImplementedError, match="Reinforce is due a calibration"):
        obj.calibrate(*[torch.zeros(1)] * 6)


@pytest.mark.usefixtures("alternating_reward")
def test_a_minimal_subclass_trains(tmp_path, monkeypatch):
    """Registered as it is (the class its own builder, no aggregation keys): a step trains with
    the loss it computes, the mechanism check reads the default window, the checkpoint keeps its
    empty state."""
    obj = Recorded()
    monkeypatch.setitem(OBJECTIVES, "reinforce", lambda: obj)
    last = train.run(_cfg(tmp_path, "objective.name=reinforce", "steps=1"))
    assert len(obj.seen) == 1  # one minibatch
    logp, adv, mask, loss = obj.seen[0]
    # rewards 0, 1, 0, 1: A = ∓0.5 / (0.5 + ε)
    assert torch.allclose(adv[mask > 0].abs(), torch.tensor(1.0), atol=1e-5)
    assert loss == pytest.approx(float(-(adv * logp * mask).sum() / mask.sum()))
    assert last["loss"] == pytest.approx(loss) and last["grad/norm"] > 0
    mech = json.loads((tmp_path / "mechanism.json").read_text())
    assert mech["band"] == [0.5, 2.0] and mech["clip"] == [0.8, 1.28]
    saved = torch.load(tmp_path / "checkpoints" / "step_1.pt", weights_only=True)
    assert saved["objective"] == {}


@pytest.mark.usefixtures("alternating_reward")
def test_the_loop_calls_a_declared_calibration_and_refresh_on_their_cadence(tmp_path, monkeypatch):
    """Two minibatches a step, a calibration on even steps before the last minibatch's update:
    after 2·1 + 1 = 3 and 2·3 + 1 = 7 loss calls; the refresh before step 3 on a pass of its own
    (the update's calls are unchanged by it); both hooks' metrics reach their steps' lines."""
    obj = Cadenced()
    monkeypatch.setitem(OBJECTIVES, "cadenced", lambda: obj)
    cal = ["objective.name=cadenced", "engine.logp_old_source=sampler", "alpha.minibatches=2"]
    train.run(_cfg(tmp_path, *cal, "steps=4"))
    assert obj.calibrated_after == [3, 7] and obj.calls == 8
    assert len(obj.refreshed) == 1 and obj.refreshed[0] > 0
    rows = _metrics(tmp_path)
    assert [r.get("own/calibrated") for r in rows] == [None, 1.0, None, 1.0]
    assert [r.get("own/refreshed") for r in rows] == [None, None, 1.0, None]


def test_validation_asks_the_objective_what_the_run_needs(tmp_path, monkeypatch):
    monkeypatch.setitem(OBJECTIVES, "reinforce", Reinforce)
    monkeypatch.setitem(OBJECTIVES, "distils", Distils)
    monkeypatch.setitem(OBJECTIVES, "cadenced", Cadenced)
    with pytest.raises(ValueError, match="distill.enabled=true with objective=ppo_clip, which has"):
        validate.validate(_cfg(tmp_path, "distill.enabled=true"))
    with pytest.raises(
        ValueError,
        match=r"distill.enabled=false with objective=opsd_fkl, which distils from a teacher "
        r"\(inputs='logits'\); valid: distill.enabled=true",
    ):
        validate.validate(_cfg(tmp_path, "objective=opsd_fkl"))
    # a distillation loss under a name of the user's: asked, not looked up by name
    with pytest.raises(ValueError, match="objective=distils, which distils"):
        validate.validate(_cfg(tmp_path, "objective.name=distils"))
    validate.validate(_cfg(tmp_path, "objective.name=distils", "distill.enabled=true"))
    # the aggregation group reaches only an objective that takes it
    with pytest.raises(ValueError, match="which reduces its own loss"):
        validate.validate(_cfg(tmp_path, "objective.name=reinforce", "aggregation=token-sum"))
    validate.validate(_cfg(tmp_path, "objective.name=reinforce"))
    # a calibrating objective needs two precisions that differ, and a policy that moved
    with pytest.raises(ValueError, match="objective=cadenced calibrates the low-precision"):
        validate.validate(_cfg(tmp_path, "objective.name=cadenced", "steps=2"))
    sampler = ["objective.name=cadenced", "engine.logp_old_source=sampler", "steps=2"]
    with pytest.raises(ValueError, match="objective=cadenced with alpha.minibatches=1"):
        validate.validate(_cfg(tmp_path, *sampler))
    # …which one that never calibrates in the run does not need
    validate.validate(_cfg(tmp_path, "objective.name=cadenced", "steps=1"))


def test_an_objectives_own_check_refuses_a_run_too_short_for_it(tmp_path):
    """calibrated_clip's cadence: every=20 in 40 steps calibrates at steps 1 and 21."""
    cal = objective_overrides("calibrated_clip")
    with pytest.raises(ValueError, match=r"objective.every=20 gives 2 calibration\(s\) in steps"):
        validate.validate(_cfg(tmp_path, *cal, "steps=40", "++objective.every=20"))


def test_a_noise_model_declares_the_scale_beta_growth_grows():
    assert build_noise("logit", sigma=0.3).sigma == 0.3
    assert build_noise("layer", sigma=2e-3).sigma == 2e-3
    assert build_noise("fp8").sigma is None and build_noise("replay").sigma is None
