import json

import pytest
import torch
from hydra import compose, initialize_config_dir

from harness import train
from harness.objectives import OBJECTIVES

CONFIG_DIR = str(train.__file__.rsplit("/harness/", 1)[0] + "/experiments")
TINY = [
    "model=tiny-llama",
    "++task.digits=1",
    "rollout.prompts_per_step=2",
    "rollout.group_size=4",
    "rollout.max_new_tokens=6",
    "eval_n=4",
    "eval_every=2",
    "progress=false",
]


def _cfg(tmp_path, *overrides):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return compose("train", overrides=[f"out={tmp_path}", *TINY, *overrides])


def _metrics(path):
    return [json.loads(x) for x in (path / "metrics.jsonl").read_text().splitlines()]


def test_group_advantages_by_hand():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0])
    g = torch.tensor([0, 0, 0, 0, 1, 1])
    # group 0: mean 0.25, std sqrt(3/16) = 0.4330; group 1: all equal -> 0
    a = train.group_advantages(r, g, "grpo")
    assert a[0].item() == pytest.approx(0.75 / 0.4330127, rel=1e-4)
    assert a[1].item() == pytest.approx(-0.25 / 0.4330127, rel=1e-4)
    assert a[4:].abs().max() < 1e-6
    assert train.group_advantages(r, g, "drgrpo")[:4].tolist() == [0.75, -0.25, -0.25, -0.25]
    with pytest.raises(ValueError, match="valid"):
        train.group_advantages(r, g, "ppo")


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_every_objective_runs_three_steps(tmp_path, name):
    extra = ["distill.enabled=true", "objective.top_k=null"] if name == "opsd_fkl" else []
    extra += ["alpha.minibatches=2"] if name == "calibrated_clip" else []
    cfg = _cfg(tmp_path, f"objective={name}", "steps=3", *extra)
    last = train.run(cfg)
    rows = _metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3] and last["step"] == 3
    assert all(torch.isfinite(torch.tensor(r["reward/mean"])) for r in rows)
    assert (tmp_path / "checkpoints" / "step_3.pt").exists()


def test_distill_changes_the_student(tmp_path):
    cfg = _cfg(
        tmp_path,
        "objective=opsd_fkl",
        "objective.top_k=null",
        "distill.enabled=true",
        "steps=2",
        "checkpoint_every=1",
    )
    train.run(cfg)
    s1 = torch.load(tmp_path / "checkpoints" / "step_2.pt", weights_only=False)["model"]
    from harness.models import load_model

    m0, _ = load_model("tiny-llama")
    diff = max((s1[k] - v).abs().max().item() for k, v in m0.state_dict().items())
    assert diff > 0 and all(r["grad/norm"] > 0 for r in _metrics(tmp_path))


def test_resume_gives_the_same_metrics(tmp_path):
    """Run 4 steps straight; run 2, 'crash', resume to 4: identical metric lines (CPU, seeds)."""
    common = [
        "objective=opsd_fkl",
        "objective.top_k=null",
        "distill.enabled=true",
        "checkpoint_every=2",
        "alpha.minibatches=2",
    ]
    full = tmp_path / "full"
    train.run(_cfg(full, "steps=4", *common))
    part = tmp_path / "part"
    train.run(_cfg(part, "steps=2", *common))
    (part / "metrics.jsonl").open("a").write('{"step": 3, "junk": 1}\n')  # a torn step 3
    train.run(_cfg(part, "steps=4", *common))
    a, b = _metrics(full), _metrics(part)
    drop = {"time/step_s"}
    assert [{k: v for k, v in r.items() if k not in drop} for r in a] == [
        {k: v for k, v in r.items() if k not in drop} for r in b
    ]
    assert any(r["grad/norm"] > 0 for r in a)


def test_nonfinite_guard_saves_and_aborts(tmp_path, monkeypatch):
    from harness.objectives.core import ObjectiveOutput

    real = train.build_objective

    def nan_objective(name, **kw):
        obj = real(name, **kw)

        class Nan(type(obj)):
            def __call__(self, logp, batch):
                out = super().__call__(logp, batch)
                return ObjectiveOutput(out.loss * float("nan"), out.metrics)

        obj.__class__ = Nan
        return obj

    monkeypatch.setattr(train, "build_objective", nan_objective)
    cfg = _cfg(tmp_path, "steps=10", "guard.max_nonfinite=3", "checkpoint_every=100")
    with pytest.raises(train.TrainingAborted, match="3 consecutive steps"):
        train.run(cfg)
    assert (tmp_path / "checkpoints" / "step_3.pt").exists()
    assert [r["guard/nonfinite_skipped"] for r in _metrics(tmp_path)] == [1, 1, 1]


def test_staleness_and_minibatches_create_alpha(tmp_path):
    """With m=2 the second minibatch trains one step late: its trust-region ratio moved."""
    cfg = _cfg(
        tmp_path,
        "objective=opsd_fkl",
        "objective.top_k=null",
        "distill.enabled=true",
        "steps=3",
        "alpha.staleness=1",
        "alpha.minibatches=2",
    )
    train.run(cfg)
    rows = _metrics(tmp_path)
    assert rows[-1]["alpha/lag"] == pytest.approx(0.5)  # lags 0 and 1 over the two minibatches


def test_bad_config_fails_before_compute(tmp_path):
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException, match="ppo_clip"):
        _cfg(tmp_path, "objective=ppo_clipp")
    with pytest.raises(KeyError, match="valid"):
        train.run(_cfg(tmp_path, "objective.name=ppo_clipp", "steps=1"))
    with pytest.raises(TypeError, match="valid"):
        train.run(_cfg(tmp_path, "++objective.eps_hgh=0.3", "steps=1"))
    with pytest.raises(ValueError, match="valid: 'trainer', 'sampler'"):
        train.run(_cfg(tmp_path, "engine.logp_old_source=engine", "steps=1"))
    with pytest.raises(ValueError, match="distill"):
        train.run(_cfg(tmp_path, "objective=opsd_fkl", "steps=1"))


@pytest.mark.slow
def test_smollm2_three_steps(tmp_path):
    cfg = _cfg(
        tmp_path,
        "model=smollm2-135m",
        "steps=3",
        "rollout.max_new_tokens=8",
        "engine.sampler_dtype=bf16",
        "eval_every=0",
    )
    train.run(cfg)
    rows = _metrics(tmp_path)
    assert len(rows) == 3 and all(r["identity/ok"] for r in rows)
    assert rows[0]["dial/mean_abs_delta"] > 1e-3  # bf16 sampler vs fp32 trainer


def test_training_pass_doubles_as_logp_old_recompute(tiny_llama):
    """reuse_old_logp: the with-grad training pass gives the same π_old and stats as the
    separate no-grad recompute (score_rollout), including under top-p mask replay."""
    from harness.engines import Engine
    from harness.logprobs import replay_mask

    model, tok = tiny_llama
    eng = Engine(model, tok)
    ro = eng.generate(["12+3=", "ab"], n=3, max_new_tokens=7, top_p=0.9, seed=1)
    B, T = ro.response_ids.shape
    keep = replay_mask(ro.support, ro.response_ids, model.config.vocab_size)
    logp, st = train.trainer_logp(eng, ro, torch.arange(B), keep, with_stats=True)
    ref = eng.score_rollout(ro, mask_replay=True)
    m = ro.response_mask.bool()
    assert logp.requires_grad
    for k, v in {"logp": logp.detach(), **st}.items():
        assert (v - ref[k])[m].abs().max() <= 1e-5, k


def test_copy_exit_mass_by_hand():
    """One response 1 2 1 2 1 2: period 2, first copies at positions 2, 3 (tokens 1, 2). Teacher
    puts p = 0.5 on each copy token, student q = 0.75: R = (0.25 + 0.25) / (0.5 + 0.5) = 0.5."""
    from harness.repetition import repetition_report

    rep = repetition_report([1, 2, 1, 2, 1, 2])
    assert rep["first_copy_positions"] == [2, 3] and rep["first_copy_tokens"] == [1, 2]
    V = 4

    def logits(p_copy):  # copy token gets p_copy, the other 3 tokens share the rest
        z = torch.full((6, V), 0.0)
        for t, c in zip([2, 3], [1, 2]):
            z[t] = torch.log(torch.full((V,), (1 - p_copy) / (V - 1)))
            z[t, c] = torch.log(torch.tensor(p_copy))
        return z[None]

    m = train.copy_exit_mass(logits(0.75), logits(0.5), [rep])
    assert m["repetition/exit_mass_ratio"] == pytest.approx(0.5)
    assert m["repetition/copy_frac_student_above"] == 1.0
    assert train.copy_exit_mass(logits(0.75), logits(0.5), [repetition_report([1, 2, 3])]) == {}
