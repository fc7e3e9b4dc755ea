"""Each job checks its config once: harness.train's and harness.measure's entry points (the
function Hydra calls) run the swept-node check and the engine check exactly once, the harder
task's kwargs included, before any compute."""

from collections import Counter

import pytest
from hydra import compose, initialize_config_dir

from harness import measure, train
from harness.runs import validate

CONFIG_DIR = str(train.__file__.rsplit("/harness/", 1)[0] + "/experiments")


@pytest.fixture
def calls(monkeypatch) -> Counter:
    """How often each check of harness.runs.validate ran (validate calls them by module name)."""
    seen: Counter = Counter()
    for name in ("check_nodes", "check_engine", "check_train"):
        real = getattr(validate, name)

        def counted(*a, _real=real, _name=name, **k):
            seen[_name] += 1
            return _real(*a, **k)

        monkeypatch.setattr(validate, name, counted)
    return seen


def _compose(job: str, tmp_path, *overrides):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return compose(job, overrides=[f"out={tmp_path}", *overrides])


def test_a_train_job_validates_once(tmp_path, calls):
    cfg = _compose(
        "train",
        tmp_path,
        "model=tiny-llama",
        "++task.digits=1",
        "rollout.prompts_per_step=2",
        "rollout.group_size=2",
        "rollout.max_new_tokens=4",
        "steps=2",
        "eval_every=0",
        "mechanism_batches=1",  # the step-0 check builds a setup of its own: no second check
        "drivers.harder_at=2",  # the harder task's kwargs are checked inside the one check
        "+drivers.harder.digits=2",
        "progress=false",
        "engine.device=cpu",
    )
    train.main(cfg)  # Hydra's task function, called with the composed config
    assert calls == {"check_nodes": 1, "check_engine": 1, "check_train": 1}


def test_a_measure_job_validates_once(tmp_path, calls, monkeypatch):
    measured = Counter()
    real = measure.check_measure
    monkeypatch.setattr(measure, "check_measure", lambda cfg: measured.update([1]) or real(cfg))
    cfg = _compose(
        "measure",
        tmp_path,
        "model=tiny-llama",
        "rollout.prompts_per_step=2",
        "rollout.group_size=2",
        "rollout.max_new_tokens=4",
        "live.mode=none",
        "measurement.amp_rows=0",
        "engine.device=cpu",
    )
    measure.main(cfg)
    assert calls == {"check_nodes": 1, "check_engine": 1} and measured[1] == 1


def test_a_bad_value_stops_the_job_before_compute(tmp_path, calls):
    """The counted checks are the real ones: one bad key stops the job in its one check."""
    cfg = _compose("measure", tmp_path, "model=tiny-llama", "live.mode=random")
    with pytest.raises(ValueError, match=r"live.mode='random'; valid"):
        measure.main(cfg)
    assert calls == {"check_nodes": 1, "check_engine": 1}
