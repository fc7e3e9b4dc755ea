import dataclasses
import json
import math
import shutil

import pytest
import torch
from hydra import compose, initialize_config_dir

from harness import train
from harness.base.batch import group_advantages
from harness.objectives import OBJECTIVES
from harness.objectives.opsd import copy_exit_mass
from harness.rl import setup
from harness.runs import validate
from harness.sampling.engines import Engine
from harness.sampling.rollout import Sampling

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
    "engine.device=cpu",  # the CPU numbers these tests pin, also on a machine with a GPU
]


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+")


def _cfg(tmp_path, *overrides):
    """The tiny config with `overrides`; an override replaces a TINY entry of the same key."""
    base = [o for o in TINY if _key(o) not in {_key(x) for x in overrides}]
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return compose("train", overrides=[f"out={tmp_path}", *base, *overrides])


def _metrics(path):
    return [json.loads(x) for x in (path / "metrics.jsonl").read_text().splitlines()]


def test_group_advantages_by_hand():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0])
    g = torch.tensor([0, 0, 0, 0, 1, 1])
    # group 0: mean 0.25, std sqrt(3/16) = 0.4330; group 1: all equal -> 0
    a = group_advantages(r, g, "grpo")
    assert a[0].item() == pytest.approx(0.75 / 0.4330127, rel=1e-4)
    assert a[1].item() == pytest.approx(-0.25 / 0.4330127, rel=1e-4)
    assert a[4:].abs().max() < 1e-6
    assert group_advantages(r, g, "drgrpo")[:4].tolist() == [0.75, -0.25, -0.25, -0.25]
    with pytest.raises(ValueError, match="valid"):
        group_advantages(r, g, "ppo")


@pytest.fixture
def alternating_reward(monkeypatch):
    """Rows alternate reward 0, 1 within every group: advantages ±1, so every policy objective
    has a gradient (the tiny untrained model never answers: its real reward is always 0)."""
    from harness.tasks import Task

    def reward(self, problems, ro, tokenizer):
        return (torch.arange(ro.response_ids.shape[0]) % 2).float()

    monkeypatch.setattr(Task, "rollout_rewards", reward)


def objective_overrides(name: str) -> list[str]:
    if name == "opsd_fkl":
        return ["objective=opsd_fkl", "distill.enabled=true", "objective.top_k=null"]
    if name == "calibrated_clip":  # its low-precision π_old is μ, its high-precision the trainer
        # two minibatches: it calibrates on the second, where π_θ has moved
        return [
            "objective=calibrated_clip",
            "engine.logp_old_source=sampler",
            "alpha.minibatches=2",
        ]
    if name == "snr_adaptive":  # refreshes at step 4 from steps 1-3's tokens (across a resume)
        return [
            "objective=snr_shrink",
            "objective.adaptive=true",
            "objective.every=3",
            "noise=logit",
            "++noise.sigma=0.5",
        ]
    if name == "bf16":  # a bf16 trainer and sampler: fp32 master weights in the checkpoint
        return ["engine.trainer_dtype=bf16", "engine.sampler_dtype=bf16"]
    return [f"objective={name}"]


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_every_objective_trains(tmp_path, name, alternating_reward):
    """Three steps of each objective: a finite loss and a non-zero gradient at every step (a
    broken loss — NaN, constant, detached — fails here)."""
    last = train.run(_cfg(tmp_path, *objective_overrides(name), "steps=3"))
    rows = _metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3] and last["step"] == 3
    for r in rows:
        assert r["guard/nonfinite_skipped"] == 0, r
        assert math.isfinite(r["loss"]) and r["grad/norm"] > 0, (name, r)
        if name != "opsd_fkl":
            assert r["reward/mean"] == 0.5
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
    s1 = torch.load(tmp_path / "checkpoints" / "step_2.pt", weights_only=True)["model"]
    from harness.base.models import load_model

    m0, _ = load_model("tiny-llama")
    diff = max((s1[k] - v).abs().max().item() for k, v in m0.state_dict().items())
    assert diff > 0 and all(r["grad/norm"] > 0 for r in _metrics(tmp_path))


@pytest.mark.parametrize("name", ["opsd_fkl", "nsr", "calibrated_clip", "snr_adaptive", "bf16"])
def test_resume_gives_the_same_metrics(tmp_path, name, alternating_reward, device):
    """Run 4 steps straight; run 2, 'crash', resume to 4: identical metric lines (seeds), also
    for the stateful objectives (NSR's generator, calibrated clipping's bounds); on each device
    (the checkpoint is read onto the CPU and copied back onto the device's parameters)."""
    common = [
        *objective_overrides(name),
        "checkpoint_every=2",
        "alpha.minibatches=2",
        f"engine.device={device.type}",
    ]
    if name == "calibrated_clip":
        # recalibrate every step; logit noise on μ makes the low-precision ratio differ
        common += ["++objective.every=1", "noise=logit", "++noise.sigma=0.5"]
    if name != "opsd_fkl":
        common += ["optim.lr=0.05"]  # the second minibatch's ratio leaves the clip window
    full = tmp_path / "full"
    train.run(_cfg(full, "steps=4", *common))
    part = tmp_path / "part"
    train.run(_cfg(part, "steps=2", *common))
    (part / "metrics.jsonl").open("a").write('{"step": 3, "junk": 1}\n')  # a torn step 3
    train.run(_cfg(part, "steps=4", *common))
    a, b = _metrics(full), _metrics(part)

    def keep(k):
        return not k.startswith("time/") and k != "snr/refresh_s"

    assert [{k: v for k, v in r.items() if keep(k)} for r in a] == [
        {k: v for k, v in r.items() if keep(k)} for r in b
    ]
    assert any(r["grad/norm"] > 0 for r in a)
    if name == "nsr":
        assert any(r["clip/frac_low"] + r["clip/frac_high"] > 0 for r in a)  # NSR had work
    if name == "calibrated_clip":
        assert len({r["calib/low"] for r in a}) > 1  # the bounds moved between steps
    if name == "snr_adaptive":  # one refresh, at step 4, from the tokens of steps 1-3
        assert [r["step"] for r in a if "snr/refreshed" in r] == [4]
        assert a[3]["snr/n_live"] == sum(r["response/len"] for r in a[:3]) * 8
        assert a[3]["snr/lam_b0"] != 0.85 and a[3]["snr/refresh_s"] > 0


def test_nonfinite_guard_saves_and_aborts(tmp_path, monkeypatch):
    from harness.objectives.core import ObjectiveOutput

    real = setup.train_objective

    def nan_objective(cfg):
        obj = real(cfg)

        class Nan(type(obj)):
            def __call__(self, logp, batch):
                out = super().__call__(logp, batch)
                return ObjectiveOutput(out.loss * float("nan"), out.metrics)

        obj.__class__ = Nan
        return obj

    monkeypatch.setattr(setup, "train_objective", nan_objective)
    cfg = _cfg(tmp_path, "steps=10", "guard.max_nonfinite=3", "checkpoint_every=100")
    with pytest.raises(train.TrainingAborted, match="3 consecutive steps"):
        train.run(cfg)
    assert (tmp_path / "checkpoints" / "abort_step_3.pt").exists()
    assert not list((tmp_path / "checkpoints").glob("step_*.pt"))  # no known-good state yet
    assert [r["guard/nonfinite_skipped"] for r in _metrics(tmp_path)] == [1, 1, 1]


@pytest.mark.parametrize("staleness", [0, 1])
def test_staleness_moves_the_trust_ratio_and_the_sampler_holds_the_stale_weights(
    tmp_path, staleness
):
    """One minibatch per step, so staleness is the only α. With k = 1 the PPO ratio π_θ/π_old
    moves off 1 once the weights have moved (mean |log π_θ − log π_old| > 0: the trainer is a
    step ahead of the weights that sampled), while π_old, the recompute at the behaviour
    weights, still equals μ: the sampler really holds those stale weights. With k = 0 the ratio
    is 1 up to rounding at every step."""
    # the arithmetic task model: rewards differ within groups, so the weights move
    over = ["model=task-model", "rollout.max_new_tokens=null", "steps=4"]
    train.run(_cfg(tmp_path, *over, f"alpha.staleness={staleness}", "alpha.minibatches=1"))
    rows = _metrics(tmp_path)
    moved = [r["trust/mean_abs_log_ratio"] for r in rows]
    assert all(r["dial/mean_abs_delta"] < 1e-5 for r in rows)  # π_old = μ at every step
    assert moved[0] < 1e-5  # step 1: no older weights yet
    if staleness:
        assert max(moved) > 1e-3, moved
    else:
        assert max(moved) < 1e-5, moved


def test_distillation_trains_each_minibatch_at_its_lag(tmp_path):
    """OPSD with staleness 1 and m = 2: the minibatches train 1 and 2 steps late."""
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
    assert _metrics(tmp_path)[-1]["alpha/lag"] == pytest.approx(1.5)


def test_step_options_are_the_configs_settings(tmp_path):
    """The step's settings travel as one object built from the config: each field is its key's
    value, and StepOptions' own defaults are the config's."""
    from harness.rl.step import StepOptions

    cfg = _cfg(
        tmp_path,
        "advantage=drgrpo",
        "engine.logp_old_source=sampler",
        "engine.mask_replay=false",
        "engine.routing_replay=true",
        "engine.routing_replay_source=trainer",
        "optim.grad_clip=0.25",
    )
    want = StepOptions(
        advantage="drgrpo",
        logp_old_source="sampler",
        mask_replay=False,
        own_routes=True,  # R2: routing replay from the trainer's own routes
        grad_clip=0.25,
        progress=False,  # the loop's bar is its own, whatever `progress` says
    )
    assert setup.step_options(cfg) == want
    assert setup.step_options(_cfg(tmp_path, "engine.routing_replay=true")).own_routes is False
    assert setup.step_options(_cfg(tmp_path)) == StepOptions()
    with pytest.raises(dataclasses.FrozenInstanceError):
        want.grad_clip = 1.0


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
        "eval_every=0",  # off: 3 steps of the real model; evaluation is tested on the tiny one
    )
    train.run(cfg)
    rows = _metrics(tmp_path)
    assert len(rows) == 3 and all(r["identity/ok"] for r in rows)
    assert rows[0]["dial/mean_abs_delta"] > 1e-3  # bf16 sampler vs fp32 trainer


def test_training_pass_doubles_as_logp_old_recompute(tiny_llama):
    """reuse_old_logp: the with-grad training pass gives the same π_old and stats as the
    separate no-grad recompute, including under top-p mask replay and for a subset of rows."""
    from harness.sampling.engines import Engine

    model, tok = tiny_llama
    eng = Engine(model, tok)
    ro = eng.generate(["12+3=", "ab"], Sampling(n=3, max_new_tokens=7, top_p=0.9), seed=1)
    rows = torch.tensor([4, 0, 2])
    out = eng.logp(ro, rows, grad=True, mask_replay=True)
    ref = eng.logp(ro, mask_replay=True)
    m = ro.response_mask[rows].bool()
    assert out["logp"].requires_grad and not ref["logp"].requires_grad
    for k, v in out.items():
        assert (v.detach() - ref[k][rows])[m].abs().max() <= 1e-5, k


def test_pi_old_from_the_sampler_is_honoured_when_the_training_pass_is_reused(
    tmp_path, alternating_reward
):
    """engine.logp_old_source=sampler with the default reuse path (staleness 0, one minibatch):
    π_old := μ, so under logit noise the PPO window clips at θ = θ_old, and the run equals the
    one with a separate recompute. Were the reuse path to take the training pass as π_old, the
    ratio would be 1 at θ = θ_old: nothing would clip and the setting would do nothing."""
    # evaluation and the mechanism check off: only the updates are compared
    common = [
        "steps=2",
        "eval_every=0",
        "engine.logp_old_source=sampler",
        "noise=logit",
        "noise.sigma=1.0",
        "mechanism_batches=0",
    ]
    runs = {}
    for reuse in ("true", "false"):
        train.run(_cfg(tmp_path / reuse, *common, f"reuse_old_logp={reuse}"))
        runs[reuse] = _metrics(tmp_path / reuse)
    assert runs["true"][0]["clip/frac_low"] + runs["true"][0]["clip/frac_high"] > 0.05
    for a, b in zip(runs["true"], runs["false"]):
        for k in {k for k in a if not k.startswith("time/")}:
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6, nan_ok=True), k
    train.run(
        _cfg(
            tmp_path / "trainer",
            *common[:-2],
            "noise=logit",
            "noise.sigma=1.0",
            "engine.logp_old_source=trainer",
            "mechanism_batches=0",
        )
    )
    assert _metrics(tmp_path / "trainer")[0]["clip/frac_low"] == 0  # θ = θ_old: r ≡ 1


def test_the_reused_training_pass_is_pi_old_row_for_row(tmp_path, alternating_reward):
    """Staleness 0, one (shuffled) minibatch, no noise: π_old from the training pass must equal
    μ token for token, so every ratio is 1 and nothing clips at θ = θ_old; and the run must equal
    one with the separate π_old recompute (reuse_old_logp=false). A misaligned π_old (rows in
    minibatch order written back in batch order) fails all three."""
    rows = {}
    for reuse in ("true", "false"):
        # evaluation off: only the updates are compared
        train.run(_cfg(tmp_path / reuse, "steps=2", f"reuse_old_logp={reuse}", "eval_every=0"))
        rows[reuse] = _metrics(tmp_path / reuse)
    for r in rows["true"]:
        assert r["dial/mean_abs_delta"] < 1e-5, r["dial/mean_abs_delta"]
        assert r["clip/frac_low"] == 0 and r["clip/frac_high"] == 0
    for a, b in zip(rows["true"], rows["false"]):
        for k in {k for k in a if not k.startswith("time/")}:
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6, nan_ok=True), k


def test_the_eval_set_is_the_same_for_every_training_seed(tmp_path, monkeypatch):
    """One fixed evaluation set per task (problems and sampling seed `eval_seed`), whatever
    the run's seed: seed-to-seed differences in eval accuracy are the training's."""
    seen = {0: [], 1: []}
    for seed in (0, 1):

        def spy(engine, task, problems, max_new_tokens, temperature, eval_seed, ranks=None):
            seen[seed].append(([p.prompt for p in problems], eval_seed))  # noqa: B023
            return 0.0

        monkeypatch.setattr(train, "evaluate", spy)
        train.run(_cfg(tmp_path / str(seed), "steps=2", f"seed={seed}", "eval_n=8"))
    assert seen[0] == seen[1] and len(seen[0][0][0]) == 8


def test_copy_exit_mass_by_hand():
    """One response 1 2 1 2 1 2: period 2, first copies at positions 2, 3 (tokens 1, 2). Teacher
    puts p = 0.5 on each copy token, student q = 0.75: R = (0.25 + 0.25) / (0.5 + 0.5) = 0.5."""
    from harness.stats.repetition import repetition_report

    rep = repetition_report([1, 2, 1, 2, 1, 2])
    assert rep["first_copy_positions"] == [2, 3] and rep["first_copy_tokens"] == [1, 2]
    V = 4

    def logits(p_copy):  # copy token gets p_copy, the other 3 tokens share the rest
        z = torch.full((6, V), 0.0)
        for t, c in zip([2, 3], [1, 2]):
            z[t] = torch.log(torch.full((V,), (1 - p_copy) / (V - 1)))
            z[t, c] = torch.log(torch.tensor(p_copy))
        return z[None]

    m = copy_exit_mass(logits(0.75), logits(0.5), [rep])
    assert m["repetition/exit_mass_ratio"] == pytest.approx(0.5)
    assert m["repetition/copy_frac_student_above"] == 1.0
    assert copy_exit_mass(logits(0.75), logits(0.5), [repetition_report([1, 2, 3])]) == {}


def test_routing_replay_through_the_loop_with_minibatches_and_staleness(tmp_path):
    """R3 with m = 2 and staleness 1: each minibatch replays its own rows' routes, and
    replay brings the trainer closer to μ than no replay does; R2 through the same loop."""
    # evaluation off: replay acts on the updates only
    common = [
        "model=tiny-moe",
        "noise=routing",
        "++noise.sigma=0.5",
        "steps=2",
        "alpha.minibatches=2",
        "alpha.staleness=1",
        "eval_every=0",
    ]
    train.run(_cfg(tmp_path / "r3", *common, "engine.routing_replay=true"))
    train.run(_cfg(tmp_path / "plain", *common))
    r2 = ["engine.routing_replay=true", "engine.routing_replay_source=trainer"]
    train.run(_cfg(tmp_path / "r2", *common, *r2))
    r3, plain = _metrics(tmp_path / "r3"), _metrics(tmp_path / "plain")
    assert [r["step"] for r in r3] == [1, 2] and all(r["grad/norm"] >= 0 for r in r3)
    assert r3[0]["dial/mean_abs_delta"] < 0.5 * plain[0]["dial/mean_abs_delta"]
    # R2 replays the trainer's own routes: at step 1 π_old routes as without replay, so the
    # mismatch μ sees is the plain run's (R2 acts on α, the updates, not on β)
    first = _metrics(tmp_path / "r2")[0]
    assert first["dial/mean_abs_delta"] == pytest.approx(plain[0]["dial/mean_abs_delta"], abs=1e-6)


def test_routing_replay_leaves_evaluation_to_the_trainers_own_routes(tmp_path):
    """The replayed routes belong to one scoring call: after the trainer scored rows of a
    rollout, its evaluation samples exactly as the same weights without R3 attached (routes left
    attached would not fit the evaluation batch at m ≥ 2, and be stale ones at m = 1)."""
    from harness.noise import build_noise
    from harness.rl.setup import build_setup

    s = build_setup(_cfg(tmp_path, "model=tiny-moe", "noise=routing", "engine.routing_replay=true"))
    ro = s.sampler.generate(["1+1=", "2+3="], Sampling(n=4, max_new_tokens=5), seed=0)
    s.policy.logp(ro, torch.tensor([0, 1, 2]))  # the rows of one minibatch
    replay = s.policy._noise_of(type(build_noise("replay")))
    assert replay is not None and replay.indices is None
    again = s.policy.generate(["1+1=", "2+3=", "4+4="], Sampling(n=1, max_new_tokens=5), seed=1)
    plain = Engine(s.policy.model, s.tok).generate(
        ["1+1=", "2+3=", "4+4="], Sampling(n=1, max_new_tokens=5), seed=1
    )  # same model object: R3's hooks pass through when no routes are set
    assert torch.equal(again.response_ids, plain.response_ids)
    assert torch.equal(again.logp_mu, plain.logp_mu)


def test_own_routes_are_the_routers_top_k():
    """`Engine.own_routes` (what R2 replays) against the model's own router logits, read by
    transformers' `output_router_logits`: the top-k experts of every position and layer."""
    from harness.base.models import load_model
    from harness.sampling.rollout import Rollout

    model, tok = load_model("tiny-moe")
    eng = Engine(model, tok)
    ro = eng.generate(["1+1=", "22+3="], Sampling(n=2, max_new_tokens=5), seed=0)
    routes = eng.own_routes(ro)
    B, S = ro.tokens.shape
    with torch.no_grad():
        out = model(
            input_ids=ro.tokens,
            attention_mask=ro.attention_mask,
            position_ids=(ro.attention_mask.cumsum(1) - 1).clamp(min=0),
            output_router_logits=True,
        )
    k = model.config.num_experts_per_tok
    naive = torch.stack([z.topk(k, -1).indices.view(B, S, k) for z in out.router_logits], 2)
    assert routes.shape == (B, S, model.config.num_hidden_layers, k)
    assert torch.equal(routes.sort(-1).values, naive.sort(-1).values)
    assert isinstance(ro, Rollout) and ro.routing is None  # a clean engine records nothing


def test_r2_replays_the_trainers_own_routes_at_pi_old_not_mus(tmp_path):
    """R2 (engine.routing_replay_source=trainer): the rollout's routes become the trainer's own at
    the behaviour weights; after the routers move (an update), π_θ's pass still reaches the
    recorded experts; at those weights its log-probs equal a pass without replay."""
    from functools import partial

    from harness.rl.step import collect

    cfg = _cfg(
        tmp_path, "model=tiny-moe", "noise=routing", "++noise.sigma=1.0",
        "engine.routing_replay=true", "engine.routing_replay_source=trainer", "alpha.minibatches=2",
    )  # fmt: skip
    s = setup.build_setup(cfg)
    problems = s.task.sample(2, "train", 0)
    args = (s.sampler, s.old_scorer(), [p.prompt for p in problems])
    kw = dict(
        reward=partial(s.task.rollout_rewards, problems, tokenizer=s.tok),
        sampling=setup.rollout_sampling(cfg, s.task),
        seed=0,
    )
    assert s.options.own_routes  # R2, from the config
    r3 = dataclasses.replace(s.options, own_routes=False)
    _, ro_mu, _ = collect(*args, **kw, options=r3)  # R3's routes: μ's, under routing noise
    s.sampler.own_routes(ro_mu)  # leaves μ's record of sampled routes as it was (empty)
    assert torch.equal(collect(*args, **kw, options=r3)[1].routing, ro_mu.routing)
    batch, ro, _ = collect(*args, **kw, options=s.options)
    own = s.policy.own_routes(ro)
    assert torch.equal(ro.routing[:, : own.shape[1]], own)
    assert not torch.equal(ro_mu.routing, own[:, : ro_mu.routing.shape[1]])  # μ's differ
    plain = Engine(s.policy.model, s.tok)  # the same model, no replay attached
    assert torch.allclose(batch.logp_old, plain.logp(ro)["logp"], atol=1e-6)
    plain.close()
    with torch.no_grad():  # move every router as an update would
        g = torch.Generator().manual_seed(0)
        for layer in s.policy.model.model.layers:
            w = layer.mlp.gate.weight
            w.add_(torch.randn(w.shape, generator=g) * 3 * w.std())
    assert not torch.equal(s.policy.own_routes(ro), own)
    used = []  # hooks registered after R2's: they see the experts the pass used
    hooks = [
        layer.mlp.gate.register_forward_hook(lambda m, a, out: used.append(out[2]))
        for layer in s.policy.model.model.layers
    ]
    s.policy.logp(ro, grad=True)
    for h in hooks:
        h.remove()
    B, S = ro.tokens.shape
    assert torch.equal(torch.stack([u.view(B, S, -1) for u in used], 2), own)


@pytest.mark.slow
def test_routing_replay_with_minibatches_and_staleness_through_the_cli_with_evaluation(tmp_path):
    """`python -m harness.train model=tiny-moe noise=routing engine.routing_replay=true` at
    m ∈ {2, 4} and staleness ∈ {0, 1}, evaluated at steps 1 and 2, as a user's sweep runs it."""
    import subprocess
    import sys

    root = CONFIG_DIR.rsplit("/experiments", 1)[0]
    # the check off: 4 runs of the launcher; it is tested on its own below
    args = [
        "model=tiny-moe",
        "noise=routing",
        "engine.routing_replay=true",
        "alpha.minibatches=2,4",
        "alpha.staleness=0,1",
        "rollout.group_size=4",
        "rollout.prompts_per_step=2",
        "rollout.max_new_tokens=6",
        "steps=2",
        "eval_n=8",
        "eval_every=1",
        "progress=false",
        "engine.device=cpu",
        f"hydra.sweep.dir={tmp_path}",
        "hydra.launcher.n_jobs=1",
        "mechanism_batches=0",
    ]
    r = subprocess.run(
        [sys.executable, "-m", "harness.train", "-m", *args],
        cwd=root,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    runs = sorted(p.parent for p in tmp_path.glob("*/metrics.jsonl"))
    assert len(runs) == 4, runs
    for run in runs:
        m = _metrics(run)
        assert [x["step"] for x in m] == [1, 2] and all("eval/acc" in x for x in m), run


def test_calibrated_clip_refuses_to_calibrate_a_ratio_against_itself(tmp_path):
    with pytest.raises(ValueError, match="logp_old_source='trainer' makes them the same tensor"):
        train.run(_cfg(tmp_path, "objective=calibrated_clip", "steps=1"))
    cal = ["objective=calibrated_clip", "engine.logp_old_source=sampler"]
    with pytest.raises(ValueError, match="identically 1 .* valid: alpha.minibatches ≥ 2"):
        train.run(_cfg(tmp_path, *cal, "steps=1"))
    with pytest.raises(
        ValueError, match=r"objective.every=20 gives 2 calibration\(s\) in steps=40"
    ):
        train.run(_cfg(tmp_path, *cal, "alpha.minibatches=2", "steps=40", "++objective.every=20"))


def test_calibrated_clip_calibrates_where_the_policy_moved(
    tmp_path, alternating_reward, monkeypatch
):
    """Two minibatches, a policy that moves (lr 0.2), logit noise on μ: the calibration sees the
    second minibatch, where π_θ^hp ≠ π_old^hp, so α_low > 0 and L* is a real quantile of r_lp,
    not its minimum (at the first minibatch r_hp ≡ 1, α_low ≡ 0 and L* = min r_lp)."""
    from harness.objectives.calibrated import CalibratedClip

    seen = []
    real = CalibratedClip.calibrate

    def spy(self, logp_hp, logp_old_hp, logp_lp, logp_old_lp, advantages, mask):
        m = mask > 0
        seen.append((logp_hp - logp_old_hp)[m].abs().max().item())
        r_lp = (logp_lp - logp_old_lp)[m & (advantages < 0)].exp()
        out = real(self, logp_hp, logp_old_hp, logp_lp, logp_old_lp, advantages, mask)
        seen.append((out["calib/alpha_low"], out["calib/low_target"], r_lp.min().item()))
        return out

    monkeypatch.setattr(CalibratedClip, "calibrate", spy)
    train.run(
        _cfg(
            tmp_path,
            *objective_overrides("calibrated_clip"),
            "noise=logit",
            "++noise.sigma=0.5",
            "optim.lr=0.2",
            "steps=3",
        )
    )
    assert len(seen) == 6  # a run of 3 steps calibrates every step (≥ 10 would need 30)
    moved, (alpha_low, low_target, min_r_lp) = seen[0], seen[1]
    assert moved > 1e-3 and alpha_low > 0 and low_target > min_r_lp
    assert [r["calib/alpha_low"] for r in _metrics(tmp_path)][0] == alpha_low


def test_readme_first_training_command_draws_the_noise_field_of_the_run_seed(tmp_path):
    """The README's `objective=cispo noise=logit noise.sigma=0.3`: the noise=logit option links
    the noise seed to the run seed (arms paired by seed share one field; the builder's default 0
    would give every run the same one)."""
    cfg = _cfg(tmp_path, "objective=cispo", "noise=logit", "noise.sigma=0.3", "seed=5", "steps=1")
    assert cfg.noise == {"name": "logit", "seed": 5, "sigma": 0.3}
    assert train.run(cfg)["step"] == 1


class _Planted:
    """A pickle that runs code when unpickled (what an attacker would plant)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


def test_a_planted_checkpoint_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "pwned"
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    torch.save({"step": 99, "x": _Planted(marker)}, tmp_path / "run" / "checkpoints" / "step_99.pt")
    with pytest.raises(RuntimeError, match=r"refusing to load .*step_99\.pt"):
        train.run(_cfg(tmp_path / "run", "steps=1"))
    assert not marker.exists()


def test_checkpoints_hold_only_tensors_and_plain_containers(tmp_path):
    train.run(_cfg(tmp_path, "steps=2", "alpha.staleness=1", "checkpoint_every=1"))
    state = torch.load(tmp_path / "checkpoints" / "step_2.pt", weights_only=True)
    assert set(state) == {"step", "model", "optim", "objective", "history", "guard", "rng"}
    assert state["history"]["staleness"] == 1 and len(state["history"]["versions"]) == 2


@pytest.mark.parametrize(
    "override, key",
    [
        ("rollout.top_p=1.5", "rollout.top_p"),
        ("rollout.temperature=0", "rollout.temperature"),
        ("rollout.top_k=-1", "rollout.top_k"),
        ("rollout.max_new_tokens=0", "rollout.max_new_tokens"),
        ("rollout.group_size=1", "rollout.group_size"),
        ("alpha.minibatches=0", "alpha.minibatches"),
        ("alpha.minibatches=999", "alpha.minibatches"),
        ("alpha.staleness=-1", "alpha.staleness"),
        ("engine.sampler_dtype=fp64", "engine.sampler_dtype"),
        ("engine.trainer_dtype=int8", "engine.trainer_dtype"),
        ("engine.sampler_attention=flash", "engine.sampler_attention"),
        ("optim.lr=0", "optim.lr"),
        ("mechanism_batches=-1", "mechanism_batches"),
        ("+prereg.seeds=1", "prereg.claim"),
        ("model.spec=smollm3", "model.spec"),
        ("task=hf", "task.path"),
        ("logger=mlflow", "logger"),
        ("log_every=-1", "log_every"),
        ("objective.eps_hgh=0.3", "eps_hgh"),
        ("engine.sampler=sglang", "engine.sampler"),
        ("engine.sampler=ct2 engine.ct2.compute_type=fp8", "engine.ct2.compute_type"),
        ("engine.sampler=ct2 noise=logit", "noise=none"),
        ("engine.sampler=ct2 engine.sampler_dtype=bf16", "engine.sampler_dtype"),
        ("engine.sampler=ct2 drivers.beta_growth=2", "drivers.beta_growth"),
        ("engine.device=tpu", "engine.device"),
        ("engine.device=cpu:1", "engine.device"),
        ("engine.device=cuda:99", "engine.device"),
    ],
)
def test_every_check_runs_before_any_model_is_built(tmp_path, monkeypatch, override, key):
    """Each bad value fails in < 5 s naming its key, before a model is built or warm-started
    (the task-model default would start a build on an empty cache)."""
    import time

    def no_build(cfg):
        raise AssertionError("a model was built before the config was checked")

    monkeypatch.setattr(setup, "build_task_and_model", no_build)
    cfg = _cfg(tmp_path, "model=task-model", *override.split(), "steps=1")
    t0 = time.time()
    with pytest.raises((ValueError, TypeError, KeyError)) as e:
        train.run(cfg)
    assert key in str(e.value) and time.time() - t0 < 5


def test_a_folder_that_is_not_a_model_fails_before_compute_naming_model_spec(tmp_path):
    (tmp_path / "not-a-model").mkdir()
    with pytest.raises(ValueError, match=r"model.spec=.*not-a-model.; valid: a Hugging Face"):
        validate.validate(_cfg(tmp_path, f"model.spec={tmp_path}/not-a-model"))


def test_a_dataset_that_is_not_there_fails_before_the_model_loads(tmp_path, monkeypatch):
    def no_load(*a, **k):
        raise AssertionError("the model loaded before the dataset was read")

    monkeypatch.setattr(setup, "load_model", no_load)
    cfg = _cfg(tmp_path, "model=smollm2-135m", "task=hf", f"task.path={tmp_path}/nope.jsonl")
    del cfg.task.digits  # TINY's arithmetic kwarg
    with pytest.raises(ValueError, match=r"task.path='.*nope.jsonl': not a file or folder here"):
        setup.build_task_and_model(cfg)


def test_nonfinite_weights_roll_back_and_abort_with_a_finite_checkpoint(
    tmp_path, alternating_reward
):
    """optim.lr=1e39 (inf in fp32) makes every update's weights non-finite: each step rolls the
    weights back, K in a row save and abort; the checkpoint holds finite weights."""
    cfg = _cfg(tmp_path, "optim.lr=1e39", "steps=10", "guard.max_nonfinite=2")
    with pytest.raises(train.TrainingAborted, match="2 consecutive steps"):
        train.run(cfg)
    rows = _metrics(tmp_path)
    assert [r["guard/nonfinite_skipped"] for r in rows] == [1, 1]
    state = torch.load(tmp_path / "checkpoints" / "abort_step_2.pt", weights_only=True)
    assert all(torch.isfinite(v).all() for v in state["model"].values())


def test_diverged_finite_weights_abort_cleanly(tmp_path, alternating_reward):
    """optim.lr=1e30: finite but huge weights; the next rollout's logits are NaN. This died with
    a raw RuntimeError inside torch.multinomial; now the sampler refuses and the run aborts."""
    with pytest.raises(train.TrainingAborted, match="non-finite next-token distribution"):
        train.run(_cfg(tmp_path, "optim.lr=1e30", "steps=5"))


def test_sampler_refuses_a_nonfinite_distribution(tiny_llama):
    from harness.sampling.engines import Engine

    model, tok = tiny_llama
    with torch.no_grad():
        model.lm_head.weight.fill_(float("nan"))
    with pytest.raises(FloatingPointError, match="non-finite next-token distribution"):
        Engine(model, tok).generate(["1+1="], Sampling(n=2, max_new_tokens=3))


def test_rerun_with_a_different_config_fails_before_compute_and_lists_the_keys(tmp_path):
    train.run(_cfg(tmp_path, "steps=2", "optim.lr=1e-3"))
    with pytest.raises(ValueError, match=r"optim.lr: 0.001 -> 0.0001.*resume=override"):
        train.run(_cfg(tmp_path, "steps=4", "optim.lr=1e-4"))
    assert [r["step"] for r in _metrics(tmp_path)] == [1, 2]  # nothing was lost or appended
    train.run(_cfg(tmp_path, "steps=3", "optim.lr=1e-3"))  # steps may change: extend the run


def test_a_refused_rerun_leaves_the_finished_runs_record_as_it_was(tmp_path):
    from harness.base.io import RefusedRerun
    from harness.runs.launch import run_task

    run_task(train.run, _cfg(tmp_path, "steps=2", "optim.lr=1e-3"))
    meta = (tmp_path / "meta.json").read_text()
    assert json.loads(meta)["status"] == "completed"
    with pytest.raises(RefusedRerun, match="optim.lr"):
        run_task(train.run, _cfg(tmp_path, "steps=2", "optim.lr=1e-4"))
    assert (tmp_path / "meta.json").read_text() == meta
    assert not (tmp_path / "traceback.txt").exists()


def test_a_rerun_refused_by_validation_leaves_the_finished_runs_record_as_it_was(tmp_path):
    """A typo'd keyword (check_nodes) or a bad value (validate, as harness.train's main checks)
    on the rerun of a finished run: refused before compute, naming the key; meta.json stays the
    finished run's, status `completed`."""
    from harness.runs.launch import run_task

    run_task(train.run, _cfg(tmp_path, "steps=2"))
    meta = (tmp_path / "meta.json").read_text()
    with pytest.raises(TypeError, match="eps"):
        run_task(train.run, _cfg(tmp_path, "steps=2", "objective.eps=0.2"))
    assert (tmp_path / "meta.json").read_text() == meta
    with pytest.raises(ValueError, match=r"optim.lr=-1.0; valid: > 0"):
        run_task(train.run, _cfg(tmp_path, "steps=2", "optim.lr=-1.0"), check=validate.validate)
    assert (tmp_path / "meta.json").read_text() == meta
    assert json.loads(meta)["status"] == "completed"
    assert not (tmp_path / "traceback.txt").exists()


def test_a_run_written_before_a_new_default_resumes_under_it(tmp_path):
    """A run folder whose config.yaml predates a schema field (written without it) or restated a
    builder default the group file no longer holds resumes strictly: missing keys read as the
    defaults the run used. A real change in such a key is still refused."""
    import yaml

    train.run(_cfg(tmp_path, "noise=logit", "steps=2"))
    cfg = yaml.safe_load((tmp_path / "config.yaml").read_text())
    del cfg["engine"]["tf32"]  # a field the schema gained later (default false)
    cfg["noise"]["nu"] = None  # the group file used to restate the builder default
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg))
    train.run(_cfg(tmp_path, "noise=logit", "steps=3"))
    assert [r["step"] for r in _metrics(tmp_path)] == [1, 2, 3]
    with pytest.raises(ValueError, match=r"noise.nu: None -> 3.0"):
        train.run(_cfg(tmp_path, "noise=logit", "++noise.nu=3.0", "steps=4"))


def test_resume_override_applies_the_new_learning_rate_and_records_it(tmp_path):
    train.run(_cfg(tmp_path, "steps=2", "optim.lr=1e-3", "checkpoint_every=1"))
    train.run(_cfg(tmp_path, "steps=3", "optim.lr=1e-4", "checkpoint_every=1", "resume=override"))
    state = torch.load(tmp_path / "checkpoints" / "step_3.pt", weights_only=True)
    assert [g["lr"] for g in state["optim"]["param_groups"]] == [1e-4]
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert meta["config_overrides"] == [{"from_step": 3, "changed": {"optim.lr": [1e-3, 1e-4]}}]


def test_the_summary_reports_each_steps_config_after_an_override(tmp_path):
    """A 3-step run at lr 1e-4 extended with `steps=5 optim.lr=1e-3 resume=override`: the
    summary's lr is 1e-4 for steps 1–3 and 1e-3 for steps 4–5 (meta.json's override record)."""
    from analysis.runs import load_raw

    run = tmp_path / "exp" / "run"
    train.run(_cfg(run, "steps=3", "optim.lr=1e-4"))
    train.run(_cfg(run, "steps=5", "optim.lr=1e-3", "resume=override"))
    df = load_raw(tmp_path, "exp")
    assert df.step.tolist() == [1, 2, 3, 4, 5]
    assert df.lr.tolist() == [1e-4, 1e-4, 1e-4, 1e-3, 1e-3]


def test_an_override_that_runs_no_step_leaves_the_runs_config_and_record(tmp_path):
    """`resume=override optim.lr=1e-5` on a finished run runs nothing: config.yaml keeps the lr
    the run used and meta.json records no override."""
    train.run(_cfg(tmp_path, "steps=2", "optim.lr=1e-4"))
    config = (tmp_path / "config.yaml").read_text()
    train.run(_cfg(tmp_path, "steps=2", "optim.lr=1e-5", "resume=override"))
    assert (tmp_path / "config.yaml").read_text() == config
    assert "config_overrides" not in json.loads((tmp_path / "meta.json").read_text())


def test_a_finished_run_whose_checkpoints_were_removed_is_refused_not_restarted(tmp_path):
    """A finished run's checkpoints removed to free disk: rerunning its folder would start
    afresh and erase its log, so it is refused before any compute, and the log is untouched.
    A run killed before it finished (no last step in meta.json) with no checkpoint starts over."""
    from harness.base.io import RefusedRerun

    train.run(_cfg(tmp_path, "steps=3"))  # checkpoint_every 50: the last step writes the one
    log = (tmp_path / "metrics.jsonl").read_text()
    shutil.rmtree(tmp_path / "checkpoints")
    with pytest.raises(RefusedRerun, match=r"finished run \(to step 3\) with no checkpoint"):
        train.run(_cfg(tmp_path, "steps=3"))
    assert (tmp_path / "metrics.jsonl").read_text() == log
    meta = json.loads((tmp_path / "meta.json").read_text())
    del meta["last_step"]  # as a run killed during its first checkpoint's write leaves it
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    train.run(_cfg(tmp_path, "steps=3"))
    assert len(_metrics(tmp_path)) == 3


def test_resume_after_a_nonfinite_abort_starts_from_the_last_good_checkpoint(
    tmp_path, alternating_reward, monkeypatch
):
    """Steps 1–2 train, then every loss is NaN: the abort checkpoint (step 4) is not resumed
    from; the rerun with a fixed config restarts from the known-good step 2."""
    from harness.objectives.core import ObjectiveOutput, PolicyObjective

    real = PolicyObjective.__call__
    calls = {"n": 0}

    def nan_after_two(self, logp, batch):
        out = real(self, logp, batch)
        calls["n"] += 1
        return ObjectiveOutput(out.loss * (float("nan") if calls["n"] > 2 else 1.0), out.metrics)

    monkeypatch.setattr(PolicyObjective, "__call__", nan_after_two)
    cfg = _cfg(tmp_path, "steps=6", "checkpoint_every=1", "guard.max_nonfinite=2")
    with pytest.raises(train.TrainingAborted, match="abort_step_4.pt"):
        train.run(cfg)
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("*.pt")) == [
        "abort_step_4.pt",
        "step_1.pt",
        "step_2.pt",
    ]
    monkeypatch.setattr(PolicyObjective, "__call__", real)
    train.run(_cfg(tmp_path, "steps=6", "checkpoint_every=1", "guard.max_nonfinite=2"))
    rows = _metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert all(r["guard/nonfinite_skipped"] == 0 for r in rows)


def test_a_damaged_latest_checkpoint_falls_back_and_a_torn_metrics_line_is_dropped(
    tmp_path, capsys
):
    common = ["checkpoint_every=1", "keep_checkpoints=2"]
    train.run(_cfg(tmp_path / "full", "steps=3", *common))
    part = tmp_path / "part"
    train.run(_cfg(part, "steps=2", *common))
    ck = part / "checkpoints" / "step_2.pt"
    ck.write_bytes(ck.read_bytes()[: ck.stat().st_size // 2])  # torn by a crash mid-copy
    with (part / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "reward/me')  # killed mid-write
    train.run(_cfg(part, "steps=3", *common))
    out = capsys.readouterr().out
    assert f"checkpoint {ck} is damaged" in out and "not a complete JSON line" in out
    clean = lambda rows: [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]  # noqa: E731
    assert clean(_metrics(part)) == clean(_metrics(tmp_path / "full"))


@pytest.mark.slow
def test_cli_run_in_a_log_prints_plain_lines_and_an_end_line_and_writes_no_empty_log(tmp_path):
    """`python -m harness.train` as a Slurm job runs it (stdout and stderr not terminals): no
    progress bar, a plain line per `log_every` steps naming reward and entropy, one end line
    naming the run folder; no empty train.log appears."""
    import subprocess
    import sys

    root = CONFIG_DIR.rsplit("/experiments", 1)[0]
    args = [a for a in TINY if not a.startswith("progress")]
    args += ["steps=2", "log_every=1", f"out={tmp_path}"]
    r = subprocess.run(
        [sys.executable, "-m", "harness.train", *args], cwd=root, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith(("step ", "[train] done"))]
    assert [ln.split()[1] for ln in lines[:2]] == ["1/2", "2/2"], r.stdout
    assert all("reward " in ln and "entropy " in ln for ln in lines)
    assert lines[2].startswith(f"[train] done {tmp_path}: step 2/2 (2 steps in ")
    assert " 1 checkpoint(s), " in lines[2] and " GiB; last step: step 2/2" in lines[2]
    assert "\r" not in r.stderr and "it/s" not in r.stderr  # no bar in a log
    assert not list(tmp_path.rglob("*.log"))


@pytest.mark.slow
def test_raising_steps_extends_the_run_in_its_folder_and_out_leaves_no_hydra_only_folder(tmp_path):
    """`steps` is not part of a run's folder name: a rerun with more steps resumes the finished
    run; with out=<dir> the job's Hydra record moves into <dir>."""
    import subprocess
    import sys

    root = CONFIG_DIR.rsplit("/experiments", 1)[0]
    # the default folder pattern, rooted in tmp_path
    where = f"hydra.run.dir='{tmp_path}/results/${{run_name:${{hydra.job.override_dirname}}}}'"
    for steps in (2, 3):
        r = subprocess.run(
            [sys.executable, "-m", "harness.train", *TINY, where, f"steps={steps}"],
            cwd=root,
            capture_output=True,
            text=True,
        )
        assert r.returncode == 0, r.stderr[-2000:]
    (run,) = (tmp_path / "results").iterdir()
    assert "steps" not in run.name and [m["step"] for m in _metrics(run)] == [1, 2, 3]
    hydra_dir, out = tmp_path / "hydra-output", tmp_path / "elsewhere"
    args = [*TINY, "steps=1", f"out={out}", f"hydra.run.dir={hydra_dir}"]
    r = subprocess.run(
        [sys.executable, "-m", "harness.train", *args], cwd=root, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert (out / ".hydra" / "overrides.yaml").exists() and not hydra_dir.exists()


def test_mechanism_check_by_hand():
    """Four tokens, band [0.5, 2], ε = 0.2/0.28: r = 0.4 (fork, A < 0), 1.0 (fork, A > 0),
    2.5 (confident, A > 0), 0.7 (confident, A < 0); the fifth position is padding."""
    from harness.objectives.core import Window
    from harness.rl.mechanism import check

    x = torch.log(torch.tensor([[0.4, 1.0, 2.5, 0.7, 9.0]]))
    p_t = torch.tensor([[0.2, 0.4, 0.9, 0.95, 0.1]])
    adv = torch.tensor([[-1.0, 1.0, 1.0, -1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
    out = check(x, p_t, adv, mask, Window())
    assert out["oob_frac"] == pytest.approx(2 / 4)  # 0.4 and 2.5
    assert out["mean_abs_delta"] == pytest.approx(
        sum(abs(math.log(r)) for r in [0.4, 1, 2.5, 0.7]) / 4
    )
    assert out["fork_oob_share"] == pytest.approx(1 / 2)  # 0.4 is a fork, 2.5 is not
    assert out["fork_frac"] == pytest.approx(2 / 4)
    assert out["forks_deleted"] == pytest.approx(1 / 2)
    assert out["neg_low_clip"] == pytest.approx(2 / 2)  # 0.4 and 0.7 < 0.8, both A < 0
    assert out["pos_high_clip"] == pytest.approx(1 / 2)  # 2.5 > 1.28; 1.0 is not


def test_mechanism_check_sees_no_mechanism_without_noise_and_some_with_it(
    tmp_path, alternating_reward
):
    """Ground truth the harness controls: with no noise r ≡ 1 (nothing out of band, nothing
    clipped); heavy logit noise puts tokens out of band and clips negative-advantage ones."""
    from harness.rl import mechanism

    clean = mechanism.run(_cfg(tmp_path / "a", "objective=cispo"))
    assert clean["oob_frac"] == 0 and clean["neg_low_clip"] == 0 and clean["pos_high_clip"] == 0
    assert clean["band"] == [1e-300, 5.0] and clean["n_tokens"] > 0
    noisy = mechanism.run(
        _cfg(tmp_path / "b", "objective=band", "noise=logit", "noise.sigma=2.0", "noise.nu=3")
    )
    assert noisy["band"] == [0.7, 6.0]
    assert noisy["oob_frac"] > 0.05 and noisy["neg_low_clip"] > 0.05
    assert 0 <= noisy["fork_oob_share"] <= 1 and 0 <= noisy["sampler_reward"] <= 1


def own_band(
    *,
    low: float = 0.5,
    high: float = 4.0,
    aggregation: str = "token-mean",
    rejected_in_denominator: bool = True,
    norm_len: int | None = None,
):
    """A user's rule whose bounds are named `low`/`high`: a sign-agnostic band on π_θ/μ, and
    the PPO clip at the same bounds."""
    from harness.objectives.core import PolicyObjective, Term

    return PolicyObjective(
        Term("folded", "token", "clip", low, high),
        aggregation=aggregation,
        rejected_in_denominator=rejected_in_denominator,
        norm_len=norm_len,
        band=(low, high),
    )


@pytest.mark.parametrize(
    "own, shared, band, clip",
    [
        # a user's rule under a name of its own, its window set through keywords named low/high
        (
            ["objective.name=own_band", "++objective.low=0.3", "++objective.high=3.0"],
            [],
            [0.3, 3.0],
            [0.3, 3.0],
        ),
        # calibrated_clip starts at the paper's [0.6, 1.8], not at its reference 1 ∓ 0.2/0.28
        (
            ["objective=calibrated_clip"],
            objective_overrides("calibrated_clip")[1:],
            [0.5, 2.0],
            [0.6, 1.8],
        ),
    ],
)
def test_the_mechanism_check_measures_the_objectives_own_window(
    tmp_path, monkeypatch, alternating_reward, own, shared, band, clip
):
    """The step-0 check asks the built objective for its window, whatever its keywords' names,
    and counts against it: beside ppo_clip's ([0.5, 2], [0.8, 1.28]) on the same tokens, a wider
    band leaves fewer out of it and a wider clip clips fewer."""
    from harness.rl import mechanism

    monkeypatch.setitem(OBJECTIVES, "own_band", own_band)
    noise = ["noise=logit", "noise.sigma=0.7", "noise.nu=3", *shared]
    out = mechanism.run(_cfg(tmp_path / "own", *noise, *own))
    ref = mechanism.run(_cfg(tmp_path / "ref", *noise))
    assert out["band"] == band and out["clip"] == clip
    assert ref["band"] == [0.5, 2.0] and ref["clip"] == [0.8, 1.28]
    assert out["n_tokens"] == ref["n_tokens"] and out["mean_abs_delta"] == ref["mean_abs_delta"]
    assert (out["oob_frac"] < ref["oob_frac"]) == (band != [0.5, 2.0])
    assert out["neg_low_clip"] < ref["neg_low_clip"]


def test_every_run_records_its_mechanism_check_and_it_does_not_move_the_run(tmp_path):
    """Fresh (non-deterministic) noise draws from a generator: the check must not advance the
    run's. The run with the check equals the run without it, metric for metric."""
    noise = ["noise=logit", "noise.sigma=0.5", "noise.deterministic=false", "steps=3"]
    train.run(_cfg(tmp_path / "a", *noise))
    train.run(_cfg(tmp_path / "b", *noise, "mechanism_batches=0"))
    mech = json.loads((tmp_path / "a" / "mechanism.json").read_text())
    assert mech["n_tokens"] > 0 and mech["oob_frac"] >= 0 and mech["batches"] == 2
    assert not (tmp_path / "b" / "mechanism.json").exists()
    drop = lambda rows: [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]  # noqa: E731
    assert drop(_metrics(tmp_path / "a")) == drop(_metrics(tmp_path / "b"))


def test_the_loop_honours_the_tasks_own_token_budget(tmp_path):
    """rollout.max_new_tokens=null (the default): rollouts run to the task's budget (1-digit
    arithmetic: 8·1·2 + 8 = 24 tokens), not to a fixed cap; an int still caps them."""
    from harness.tasks import TASKS

    assert TASKS["arithmetic"](digits=1).max_new_tokens == 24
    own = train.run(_cfg(tmp_path / "a", "rollout.max_new_tokens=null", "steps=1"))
    capped = train.run(_cfg(tmp_path / "b", "steps=1"))  # TINY caps at 6
    assert capped["response/len"] <= 6 < own["response/len"] <= 24


def test_beta_growth_scales_the_sampler_noise_linearly_over_the_run(tmp_path):
    """drivers.beta_growth=3 over 3 steps: σ × 1, 2, 3. Step 1 equals the constant-β run; by step
    3 the sampler's |log π_old − log μ| is ~3× the constant run's (logit noise on a near-uniform
    tiny model: |Δ| grows linearly with σ)."""
    noise = ["noise=logit", "noise.sigma=0.05", "steps=3"]
    train.run(_cfg(tmp_path / "grow", *noise, "drivers.beta_growth=3"))
    train.run(_cfg(tmp_path / "flat", *noise))
    grow, flat = _metrics(tmp_path / "grow"), _metrics(tmp_path / "flat")
    assert [r["drivers/beta_scale"] for r in grow] == [1.0, 2.0, 3.0]
    assert grow[0]["dial/mean_abs_delta"] == flat[0]["dial/mean_abs_delta"]
    ratio = grow[2]["dial/mean_abs_delta"] / flat[2]["dial/mean_abs_delta"]
    assert 2.4 < ratio < 3.6


def test_the_entropy_driver_switches_training_prompts_to_the_harder_task(tmp_path, monkeypatch):
    from harness.tasks.arithmetic import ArithmeticTask

    seen = []
    sample = ArithmeticTask.sample

    def spy(self, n, split="train", seed=0):
        seen.append((split, self.digits))
        return sample(self, n, split, seed)

    monkeypatch.setattr(ArithmeticTask, "sample", spy)
    # evaluation and the check off: both sample too, and the spy counts the loop's draws only
    train.run(
        _cfg(
            tmp_path,
            "steps=3",
            "drivers.harder_at=2",
            "+drivers.harder.digits=2",
            "eval_every=0",
            "mechanism_batches=0",
        )
    )
    assert [d for split, d in seen if split == "train"] == [1, 2, 2]
    assert {d for split, d in seen if split == "eval"} == {1}  # the eval set stays the task's
    assert [r["drivers/harder"] for r in _metrics(tmp_path)] == [0.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="drivers.harder"):
        validate.validate(_cfg(tmp_path / "b", "drivers.harder_at=2"))
    with pytest.raises((ValueError, TypeError), match="digts"):
        validate.validate(_cfg(tmp_path / "c", "drivers.harder_at=2", "+drivers.harder.digts=2"))


def test_opsd_with_the_student_as_its_own_teacher_has_zero_loss_and_gradient(tmp_path):
    """Ground truth for the teacher/student alignment in the training loop: with a teacher
    prompt that hides the solution ("{prompt}"), the teacher at step 1 is the student, so at
    every response position p = q, the exact FKL Σ p log(p/q) is 0 and its gradient q − p is 0
    (a teacher read one position off, or with another prompt, gives a positive loss)."""
    opsd = ["objective=opsd_fkl", "distill.enabled=true", "objective.top_k=null", "steps=1"]
    train.run(_cfg(tmp_path / "a", *opsd, "distill.teacher_prompt='{prompt}'"))
    (m,) = _metrics(tmp_path / "a")
    assert abs(m["loss"]) < 1e-6 and m["grad/norm"] < 1e-5, m
    train.run(_cfg(tmp_path / "b", *opsd))  # the privileged teacher differs from the student
    (m,) = _metrics(tmp_path / "b")
    assert m["loss"] > 1e-4 and m["grad/norm"] > 1e-4, m


def test_the_opsd_mechanism_check_compares_teacher_and_student(tmp_path):
    """Ground truth: with a teacher prompt that hides the solution ("{prompt}") the teacher is
    the student (a frozen copy of the same initial weights): equal accuracy and log-prob."""
    from harness.rl import mechanism

    opsd = ["objective=opsd_fkl", "distill.enabled=true", "objective.top_k=null"]
    same = mechanism.run(_cfg(tmp_path / "a", *opsd, "distill.teacher_prompt='{prompt}'"))
    assert same["teacher_ref_logp"] == pytest.approx(same["student_ref_logp"], abs=1e-6)
    assert same["teacher_acc"] == same["student_acc"]
    real = mechanism.run(_cfg(tmp_path / "b", *opsd))
    assert real["teacher_ref_logp"] != pytest.approx(real["student_ref_logp"], abs=1e-6)
    assert math.isfinite(real["teacher_ref_logp"]) and 0 <= real["teacher_acc"] <= 1


def test_full_pipeline_fp8_unifies_the_trainer_with_the_sampler(
    tmp_path, alternating_reward, monkeypatch
):
    """engine.trainer_fp8: the trainer scores in the sampler's FP8 recipe, so at θ = θ_old the
    measured mismatch log π_old − log μ collapses from the FP8 β of the half pipeline to float
    rounding (KV-cache decode vs one full forward); calibrated clipping then calibrates against
    the high-precision shadow pass, and the loop trains."""
    from harness.rl import mechanism

    fp8 = ["noise=fp8", "noise.fmt=e5m2", "engine.logp_old_source=sampler"]
    half = mechanism.run(_cfg(tmp_path / "a", "objective=ppo_clip", *fp8))
    full = mechanism.run(
        _cfg(tmp_path / "b", "objective=ppo_clip", *fp8, "engine.trainer_fp8=true")
    )
    assert half["mean_abs_delta"] > 1e-3 > 1e-5 > full["mean_abs_delta"]
    calls = []
    real = train.ShadowPass

    class Counted(real):  # which rows each pass scores: π_old^hp first, then π_θ^hp
        def behaviour(self, rows):
            calls.append(("behaviour", len(rows)))
            return super().behaviour(rows)

        def current(self, rows):
            calls.append(("current", len(rows)))
            return super().current(rows)

    monkeypatch.setattr(train, "ShadowPass", Counted)
    # the check off: it would run shadow passes of its own, and the spy counts the loop's;
    # π_old recomputed by the FP8 trainer: seed 002's own pipeline
    out = train.run(
        _cfg(
            tmp_path / "c",
            "objective=calibrated_clip",
            *fp8[:2],
            "engine.trainer_fp8=true",
            "alpha.minibatches=2",
            "optim.lr=0.2",
            "steps=2",
            "mechanism_batches=0",
        )
    )
    # step 1 calibrates (every max(1, 2 // 10) = 1 step: both), on the second minibatch's 4 rows
    assert out["step"] == 2 and calls == [("behaviour", 4), ("current", 4)] * 2
    m = _metrics(tmp_path / "c")
    assert all(math.isfinite(x["loss"]) for x in m) and m[0]["calib/updated"] == 1.0
    assert m[0]["calib/alpha_low"] > 0  # π_θ^hp has moved from π_old^hp: α carries movement
    with pytest.raises(
        ValueError, match="engine.trainer_fp8=true .* noise='none'; valid: noise=fp8"
    ):
        train.run(_cfg(tmp_path / "d", "engine.trainer_fp8=true", "steps=1"))


def test_bf16_trainer_updates_fp32_master_weights():
    """AdamW's first steps move a weight by ≈ lr each. At 1.0 a bf16 ulp is 2^-7: steps of 1e-3
    are below half an ulp, so AdamW on the bf16 weight itself never moves it; the fp32 master
    accumulates them (1 + 20·1e-3) and the model holds the master rounded to bf16."""
    from harness.rl.step import MasterAdamW, adamw

    def run(opt_of):
        lin = torch.nn.Linear(1, 1, bias=False).to(torch.bfloat16)
        torch.nn.init.ones_(lin.weight)
        opt = opt_of(lin)
        for _ in range(20):
            opt.zero_grad()
            lin.weight.grad = torch.full_like(lin.weight, -1.0)
            opt.step()
        return lin, opt

    lin, opt = run(lambda m: adamw(m, lr=1e-3, weight_decay=0.0))
    assert isinstance(opt, MasterAdamW)
    assert opt.master[0].item() == pytest.approx(1.02, abs=1e-6)
    assert lin.weight.item() == torch.tensor(1.02).to(torch.bfloat16).item() > 1.0
    naive, _ = run(lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.0))
    assert naive.weight.item() == 1.0
    assert type(adamw(torch.nn.Linear(1, 1), lr=1e-3)) is torch.optim.AdamW  # fp32: plain


def test_master_adamw_takes_frozen_parameters_as_adamw_does():
    """harness.measure builds the optimizer on a frozen model, then unfreezes it (the precision
    sweep's bf16 trainer failed with 'empty parameter list' when frozen ones were left out)."""
    from harness.rl.step import adamw

    lin = torch.nn.Linear(2, 2).to(torch.bfloat16).requires_grad_(False)
    opt = adamw(lin, lr=1e-2)
    lin.requires_grad_(True)
    lin(torch.ones(1, 2, dtype=torch.bfloat16)).sum().backward()
    before = lin.weight.detach().clone()
    opt.step()
    assert not torch.equal(before, lin.weight)


def test_no_signal_warns_only_when_every_step_is_all_wrong_or_all_right():
    assert train.no_signal([0.0] * train.SIGNAL_STEPS).startswith(
        "WARNING no learning signal: the mean reward of steps 1–5 is 0 in every step (every "
        "response wrong)"
    )
    assert "every response right" in train.no_signal([1.0] * 5)
    assert train.no_signal([0.0] * 4) is None  # too early to say
    assert train.no_signal([0.0, 0.0, 0.125, 0.0, 0.0]) is None  # one step had a signal
    assert train.no_signal([0.5] * 5) is None  # mixed groups: advantages are not 0


def test_a_run_that_never_rewards_says_so(tmp_path, capsys):
    """The untrained tiny model never answers 1-digit arithmetic: steps 1–5 all 0."""
    train.run(_cfg(tmp_path, "steps=5", "eval_every=0"))  # evaluation off: 5 quick steps
    rows = _metrics(tmp_path)
    assert [r["reward/mean"] for r in rows] == [0.0] * 5  # the premise
    assert "WARNING no learning signal" in capsys.readouterr().err


def test_save_final_writes_the_trained_policy_as_a_plain_hf_folder(tmp_path, alternating_reward):
    from harness.base.models import load_model, weights_sha

    cfg = _cfg(tmp_path, "steps=2", "save_final=true", "checkpoint_every=1")
    train.run(cfg)
    model, _ = load_model(str(tmp_path / "final"))
    state = torch.load(tmp_path / "checkpoints" / "step_2.pt", weights_only=True)["model"]
    ref, _ = load_model("tiny-llama")
    ref.load_state_dict(state)
    assert weights_sha(model) == weights_sha(ref)  # the step-2 weights, not the initial ones
    assert weights_sha(model) != weights_sha(load_model("tiny-llama")[0])
    with pytest.raises(ValueError, match="save_final=True with a sharded trainer"):
        train.run(_cfg(tmp_path / "b", "steps=1", "save_final=true", "engine.fsdp=true"))


def test_the_metrics_say_when_grad_clipping_acted(tmp_path, alternating_reward):
    """grad/clipped is 1 where clip_grad_norm_ rescaled the step (norm > optim.grad_clip)."""
    train.run(_cfg(tmp_path / "a", "steps=1", "optim.grad_clip=1e-9"))
    train.run(_cfg(tmp_path / "b", "steps=1", "optim.grad_clip=1e9"))
    (a,), (b,) = _metrics(tmp_path / "a"), _metrics(tmp_path / "b")
    assert a["grad/norm"] > 1e-9 and a["grad/clipped"] == 1.0
    assert b["grad/norm"] < 1e9 and b["grad/clipped"] == 0.0


def test_meta_records_the_step1_batch_and_the_machine(tmp_path):
    """Arms paired by seed share their step-1 batch fingerprint; another seed does not; a
    resume appends its machine (harness.runs.fingerprint)."""
    from harness.runs.fingerprint import batch_fingerprint, machine

    train.run(_cfg(tmp_path / "a", "steps=1", "objective=ppo_clip"))
    train.run(_cfg(tmp_path / "b", "steps=1", "objective=cispo"))  # paired by seed: same batch
    train.run(_cfg(tmp_path / "c", "steps=1", "seed=1"))
    fp = {k: json.loads((tmp_path / k / "meta.json").read_text()) for k in "abc"}
    assert fp["a"]["batch_fingerprint"] == fp["b"]["batch_fingerprint"]
    assert fp["a"]["batch_fingerprint"] != fp["c"]["batch_fingerprint"]
    assert fp["a"]["machines"] == [machine(1) | {"from_step": 1}]
    train.run(_cfg(tmp_path / "a", "steps=2", "objective=ppo_clip"))
    again = json.loads((tmp_path / "a" / "meta.json").read_text())
    assert [m["from_step"] for m in again["machines"]] == [1, 2]
    assert again["batch_fingerprint"] == fp["a"]["batch_fingerprint"]  # step 1's, kept
    ids, mask = torch.tensor([[5, 6, 0]]), torch.tensor([[1, 1, 0]])
    one = batch_fingerprint(["p"], ids, mask)
    assert one == batch_fingerprint(["p"], torch.tensor([[5, 6, 9]]), mask)  # padding is not
    assert one != batch_fingerprint(["p"], torch.tensor([[5, 7, 0]]), mask)  # a sampled token is
    assert one != batch_fingerprint(["q"], ids, mask)


def test_the_mechanism_check_takes_one_sided_clips(tmp_path, alternating_reward):
    """The dissection's arms: the upper clip alone (ε_l = 1: no lower bound, log 0 was a math
    domain error) and the lower clip alone (ε_h = ∞): nothing is clipped on the open side."""
    from harness.rl import mechanism

    upper = mechanism.run(_cfg(tmp_path / "a", "objective=ppo_clip", "objective.eps_low=1.0"))
    lower = mechanism.run(_cfg(tmp_path / "b", "objective=ppo_clip", "objective.eps_high=inf"))
    assert upper["neg_low_clip"] == 0.0 and lower["pos_high_clip"] == 0.0
