"""Micro-batches by token budget (engine.micro_batch_tokens) and activation checkpointing
(engine.activation_checkpointing): the optimizer step equals the one-shot step.

Tolerances. Both sides are fp32 computations of the same sums in a different order: other GEMM
batch shapes per micro-batch, the no-grad scoring kernel for the loss's input instead of the
gradient pass's, and the gradient summed over micro-batches. fp32's unit roundoff is 6e-8; over
the whole matrix below the first minibatch's gradients differ by ≤ 6e-7 of their norm (per
parameter tensor), the second minibatch's — one large SGD step later, from parameters that differ
by lr × the first difference — by ≤ 9e-6; the parameters by ≤ 1e-6 of their norm; the metrics by
≤ 2e-6 relative, except the loss where its ± terms nearly cancel (1e-5 relative, 1e-7 absolute);
1 and 2 threads alike. The tests allow 2e-5: norm-relative for gradients and parameters, relative
for metrics, with 1e-6 absolute for metrics that are themselves rounding noise or cancellations
(|log π_θ − log π_old| at θ = θ_old, the loss). A per-micro-batch denominator is off by 0.5–0.7
of the gradient's norm (`test_a_per_micro_batch_denominator_is_far_outside_the_tolerance`).

The optimizer in the step comparisons is plain SGD: a parameter difference is then lr × the
gradient difference. AdamW's first step is lr · g / (|g| + ε) entry by entry, which turns an
entry whose gradient is at rounding-noise level (a cancellation) into an O(lr) step of arbitrary
sign, for any change of batch shape, micro-batched or not.
"""

import copy
import math

import pytest
import torch
from hydra import compose, initialize_config_dir

import harness.rl.step
import harness.sampling.engines
from harness import train
from harness.noise import build_noise
from harness.objectives import OBJECTIVES
from harness.objectives.core import ObjectiveOutput, PolicyObjective
from harness.rl import setup
from harness.sampling.engines import Engine, micro_batches
from harness.sampling.rollout import Sampling
from harness.stats.diagnostics import collapse_guard

CONFIG_DIR = str(train.__file__.rsplit("/harness/", 1)[0] + "/experiments")
TOL = 2e-5
LR = 2.0  # SGD: the second minibatch's trust ratio leaves the clip window (clips are tested)
# tokens: prompts are 4, responses ≤ 12 (most rows) or 3–4 (EOS early): 1–3 rows per
# micro-batch, so the micro-batches differ in sequences and in tokens
BUDGET = 40
BASE = [
    "model=tiny-llama",
    "++task.digits=1",
    "rollout.prompts_per_step=2",
    "rollout.group_size=8",
    "rollout.max_new_tokens=12",  # the tiny model ends some rows early: uneven lengths
    "progress=false",
    "engine.device=cpu",
    "mechanism_batches=0",  # off: these compare one update's gradients; the check is tested
    "eval_every=0",  # in test_train and test_fsdp (stock config), evaluation likewise
    "optim.grad_clip=1e9",  # the raw gradient reaches the optimizer
    "noise=logit",  # π_old ≠ μ: the ti/folded ratios and the rejection bands have work
    "++noise.sigma=0.5",
]


def _cfg(tmp_path, *overrides):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return compose("train", overrides=[f"out={tmp_path}", *BASE, *overrides])


@pytest.fixture
def alternating_reward(monkeypatch):
    """Rewards 0, 1, 0, 1 within every group: advantages ±1, every objective has a gradient."""
    from harness.tasks import Task

    def reward(self, problems, ro, tokenizer):
        return (torch.arange(ro.response_ids.shape[0]) % 2).float()

    monkeypatch.setattr(Task, "rollout_rewards", reward)


@pytest.fixture
def parts_seen(monkeypatch):
    """The sizes (rows) of the micro-batches of every split (trainer passes, OPSD minibatches)."""
    seen: list[list[int]] = []

    def spy(n_tokens, budget):
        parts = micro_batches(n_tokens, budget)
        seen.append([p.stop - p.start for p in parts])
        return parts

    monkeypatch.setattr(harness.sampling.engines, "micro_batches", spy)
    monkeypatch.setattr(harness.rl.step, "micro_batches", spy)
    return seen


def objective_overrides(name: str) -> list[str]:
    """Each objective set so that its decisions (clip, clamp, rejection) bind on some tokens."""
    if name == "opsd_fkl":
        return [
            "objective=opsd_fkl",
            "distill.enabled=true",
            "objective.top_k=null",
            "objective.tau=5e-4",
        ]
    if name == "calibrated_clip":  # calibrates at step 1 (every 20 steps)
        return ["objective=calibrated_clip", "engine.logp_old_source=sampler"]
    if name == "snr_adaptive":  # records the training tokens' α + β (its state)
        return ["objective=snr_shrink", "objective.adaptive=true"]
    if name == "stapo":  # a threshold the tiny model's tokens cross: S2T rejects some
        return ["objective=stapo", "objective.tau_p=0.05"]
    if name == "mis":  # the band on π_θ/μ: `keep` depends on π_θ
        return ["objective=mis", "objective.ratio=folded", "objective.lo=0.8", "objective.hi=1.25"]
    if name == "dppo_tv":
        return ["objective=dppo_tv", "objective.delta_low=0.01", "objective.delta_high=0.01"]
    if name == "cispo":
        return ["objective=cispo", "objective.hi=1.1"]
    return [f"objective={name}"]


def one_step(cfg):
    """One training step of the loop (`train.train_step`) from the seeded initial state, with
    SGD: (the gradient of every optimizer step, the parameters after, the step's metrics, the
    objective's state after)."""
    torch.manual_seed(0)
    s = setup.build_setup(cfg)
    params = list(s.policy.model.parameters())
    s.opt = torch.optim.SGD(params, lr=LR)
    grads, sgd_step = [], s.opt.step

    def step():
        grads.append([torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in params])
        sgd_step()

    s.opt.step = step
    metrics, _ = train.train_step(s, cfg, 1, collapse_guard())
    s.sampler.close()
    return grads, [p.detach().clone() for p in params], metrics, s.objective.state_dict()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def assert_same_step(micro, whole):
    g1, p1, m1, st1 = micro
    g0, p0, m0, st0 = whole
    assert len(g1) == len(g0) > 0
    for step1, step0 in zip(g1, g0):
        for a, b in zip(step1, step0):
            assert rel_err(a, b) <= TOL or (a - b).abs().max() <= 1e-9
    for a, b in zip(p1, p0):
        assert rel_err(a, b) <= TOL
    assert m1.keys() == m0.keys()
    for k in {k for k in m0 if not k.startswith("time/")}:
        assert m1[k] == pytest.approx(m0[k], rel=TOL, abs=1e-6, nan_ok=True), k
    for k, v in st0.items():  # NSR's generator, calibrated bounds, SNR's records
        w = st1[k]
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            assert w.shape == v.shape and torch.allclose(w, v, rtol=TOL, atol=1e-6), k
        elif isinstance(v, torch.Tensor):
            assert torch.equal(w, v), k
        else:
            assert w == pytest.approx(v, rel=TOL), k


def assert_uneven_splits(seen: list[list[int]]) -> None:
    """Every split has ≥ 3 micro-batches and one has micro-batches of different numbers of
    sequences: naive accumulation is exact when all hold as many sequences and tokens."""
    assert seen and all(len(sizes) >= 3 for sizes in seen), seen
    assert any(len(set(sizes)) > 1 for sizes in seen), seen


SOFT = ("sapo", "vespo", "kl_cov")  # objectives with no hard clip or mask
AGGREGATIONS = [
    ("token-mean", True),
    ("token-mean", False),
    ("seq-mean-token-mean", False),
    ("seq-mean-token-sum-norm", False),
]
CASES = [
    (name, agg, rid)
    for name in [*sorted(OBJECTIVES), "snr_adaptive"]
    for agg, rid in ([(None, None)] if name == "opsd_fkl" else AGGREGATIONS)
]


@pytest.mark.parametrize("name, agg, rid", CASES, ids=[f"{n}-{a}-{r}" for n, a, r in CASES])
def test_micro_batched_step_equals_the_one_shot_step(
    tmp_path, alternating_reward, parts_seen, name, agg, rid
):
    """Every objective × aggregation (rejected tokens in or out of the denominator), two
    minibatches (the second trains a step late, so its trust ratio clips), π_old recomputed in
    micro-batches: gradients, parameters, metrics and the objective's state equal the one-shot
    step's, with ≥ 3 micro-batches per minibatch."""
    over = [*objective_overrides(name), "alpha.minibatches=2"]
    if agg is not None:
        over += [f"aggregation={agg}", f"aggregation.rejected_in_denominator={rid}"]
    whole = one_step(_cfg(tmp_path / "whole", *over))
    assert all(len(sizes) == 1 for sizes in parts_seen)
    parts_seen.clear()
    micro = one_step(_cfg(tmp_path / "micro", *over, f"engine.micro_batch_tokens={BUDGET}"))
    assert_uneven_splits(parts_seen)
    assert_same_step(micro, whole)
    decided = ("clip/frac_low", "clip/frac_high", "mask/frac", "opsd/clip_frac")
    # the objective's clip or mask bound on this batch, so the equality covers its decisions;
    # SAPO, VESPO and KL-Cov shape weights and neither clip nor mask, and LUSPO's sequence
    # clip does not bind on this batch under Dr. GRPO's constant-length aggregation
    if name not in SOFT and (name, agg) != ("luspo", "seq-mean-token-sum-norm"):
        assert sum(whole[2].get(k, 0.0) for k in decided) > 0
    if name in ("band", "dppo_tv", "mis", "stapo"):
        assert whole[2]["mask/frac"] > 0  # rejected tokens: the denominators differ


@pytest.mark.parametrize("name", ["ppo_clip", "gspo", "stapo", "nsr", "calibrated_clip"])
def test_micro_batched_pass_doubles_as_pi_old(tmp_path, alternating_reward, parts_seen, name):
    """Staleness 0, one minibatch: π_old (and p_t, entropy: STAPO's quantile) come from the
    training pass, here the no-grad pass micro-batch by micro-batch."""
    over = objective_overrides(name)
    whole = one_step(_cfg(tmp_path / "whole", *over))
    parts_seen.clear()
    micro = one_step(_cfg(tmp_path / "micro", *over, f"engine.micro_batch_tokens={BUDGET}"))
    assert_uneven_splits(parts_seen)
    assert_same_step(micro, whole)


# --- the budget and its failure modes -----------------------------------------------------------


def test_micro_batches_pack_whole_rows_within_the_budget():
    n = torch.tensor([5, 3, 4, 10, 2, 2])
    assert micro_batches(n, 8) == [slice(0, 2), slice(2, 3), slice(3, 4), slice(4, 6)]
    assert micro_batches(n, 100) == [slice(0, 6)]
    assert micro_batches(n, 1) == [slice(i, i + 1) for i in range(6)]  # longer rows: alone
    assert micro_batches(n, None) == [slice(0, 6)]


@pytest.mark.parametrize("value", [0, -3])
def test_a_bad_budget_fails_before_any_model_is_built(tmp_path, monkeypatch, value):
    def no_build(cfg):
        raise AssertionError("a model was built before the config was checked")

    monkeypatch.setattr(setup, "build_task_and_model", no_build)
    cfg = _cfg(tmp_path, f"engine.micro_batch_tokens={value}", "steps=1")
    with pytest.raises(ValueError, match=rf"engine.micro_batch_tokens={value}; valid: >= 1"):
        train.run(cfg)


def test_a_budget_below_one_full_length_sequence_fails_before_any_model_is_built(
    tmp_path, monkeypatch
):
    def no_build(cfg):
        raise AssertionError("a model was built before the config was checked")

    monkeypatch.setattr(setup, "build_task_and_model", no_build)
    cfg = _cfg(tmp_path, "engine.micro_batch_tokens=12", "steps=1")  # max_new_tokens=12
    with pytest.raises(ValueError, match=r"micro_batch_tokens=12; valid: > rollout.max_new_tokens"):
        train.run(cfg)


def naive_accumulation(objective, logp, mb, parts):
    """The variant the equality test must reject: each micro-batch's loss with its own
    denominator, averaged over micro-batches (the gradient-accumulation bug)."""
    return sum(objective(logp[p], mb.index(p)).loss for p in parts) / len(parts)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_a_per_micro_batch_denominator_is_far_outside_the_tolerance(tmp_path, agg):
    """The equality tests can fail: on one rollout the naive accumulation's gradient is off by
    far more than TOL from the minibatch loss's, which `backward_through_logp` reproduces."""
    from harness.rl.step import collect
    from harness.tasks.arithmetic import ArithmeticTask

    cfg = _cfg(tmp_path, "objective=stapo", "objective.tau_p=0.05", f"aggregation={agg}")
    s = setup.build_setup(cfg)
    prompts = [p.prompt for p in ArithmeticTask(digits=1).sample(2, "train", 0)]
    reward = lambda ro: (torch.arange(ro.response_ids.shape[0]) % 2).float()  # noqa: E731
    sampling = setup.rollout_sampling(cfg, s.task)
    batch, ro, _ = collect(s.sampler, s.policy, prompts, reward, sampling, s.options, seed=0)
    rows = torch.arange(len(batch.mask))
    parts = micro_batches(ro.attention_mask.sum(1), BUDGET)
    assert len(parts) >= 3 and len(set(batch.mask.sum(1).tolist())) > 1  # uneven lengths
    model = s.policy.model

    def grad(loss_of):
        model.zero_grad()
        logp = s.policy.logp(ro, rows, grad=True, stats=False)["logp"]
        loss_of(logp).backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    whole = grad(lambda logp: s.objective(logp, batch).loss)
    naive = grad(lambda logp: naive_accumulation(s.objective, logp, batch, parts))
    assert rel_err(naive, whole) > 100 * TOL


# --- the non-finite guard -----------------------------------------------------------------------


def test_a_nonfinite_gradient_in_micro_batches_skips_the_step(
    tmp_path, alternating_reward, monkeypatch
):
    """A finite loss with a non-finite ∂L/∂logp: the micro-batch passes carry it into the
    parameters' gradient, the guard skips the step and leaves no gradient behind."""
    real = PolicyObjective.__call__

    def nan_grad(self, logp, batch):
        out = real(self, logp, batch)
        zero = (logp - logp.detach()).sum()  # 0, its gradient 1 everywhere
        return ObjectiveOutput(out.loss + 0.0 * zero.sqrt(), out.metrics)  # d√x at 0: inf·0

    monkeypatch.setattr(PolicyObjective, "__call__", nan_grad)
    cfg = _cfg(tmp_path, f"engine.micro_batch_tokens={BUDGET}")
    s = setup.build_setup(cfg)
    before = [p.detach().clone() for p in s.policy.model.parameters()]
    m, all_nonfinite = train.train_step(s, cfg, 1, collapse_guard())
    assert m["guard/nonfinite_skipped"] == 1 and all_nonfinite
    assert math.isfinite(m["reward/mean"])
    for p, q in zip(s.policy.model.parameters(), before):
        assert torch.equal(p, q) and p.grad is None


def test_a_nonfinite_opsd_micro_batch_skips_the_step(tmp_path, alternating_reward, monkeypatch):
    """OPSD backpropagates micro-batch by micro-batch: a non-finite loss in the second one stops
    the step, and the first one's gradient is cleared."""
    from harness.objectives.opsd import OPSDForwardKL

    real, calls = OPSDForwardKL.__call__, []

    def nan_second(self, s, t, mask, teacher_ids=None):
        out = real(self, s, t, mask, teacher_ids)
        calls.append(1)
        return ObjectiveOutput(out.loss * (math.nan if len(calls) == 2 else 1.0), out.metrics)

    monkeypatch.setattr(OPSDForwardKL, "__call__", nan_second)
    cfg = _cfg(tmp_path, *objective_overrides("opsd_fkl"), f"engine.micro_batch_tokens={BUDGET}")
    s = setup.build_setup(cfg)
    before = [p.detach().clone() for p in s.policy.model.parameters()]
    m, all_nonfinite = train.train_step(s, cfg, 1, collapse_guard())
    assert len(calls) == 2 and m["guard/nonfinite_skipped"] == 1 and all_nonfinite
    for p, q in zip(s.policy.model.parameters(), before):
        assert torch.equal(p, q) and p.grad is None


# --- activation checkpointing -------------------------------------------------------------------


def grads_of(engine: Engine, ro, rows=None) -> list[torch.Tensor]:
    """∇ of a fixed weighting of the rows' log-probs (uneven weights over tokens)."""
    engine.model.zero_grad()
    logp = engine.logp(ro, rows, grad=True, stats=False, mask_replay=True)["logp"]
    mask = ro.response_mask if rows is None else ro.response_mask[rows]
    (logp * torch.linspace(-1.0, 2.0, logp.numel()).view_as(logp) * mask).sum().backward()
    return [p.grad.clone() for p in engine.model.parameters()]


def counted_calls(module: torch.nn.Module) -> list[int]:
    """Calls of `module` (a pre-hook: the recomputation stops once it has what backward needs)."""
    calls = [0]
    module.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def assert_same_grads(a, b):
    for x, y in zip(a, b):
        assert rel_err(x, y) <= TOL or (x - y).abs().max() <= 1e-9


def test_activation_checkpointing_gives_the_same_gradient_dense(tiny_llama):
    """Prompts shared by 4 rows: the plain pass runs each prompt once through a KV cache, the
    checkpointed one the full rows (a recomputed layer cannot write a cache again); the layer's
    forward runs twice per pass (forward, recomputation), the gradients agree."""
    model, tok = tiny_llama
    sampler = Engine(copy.deepcopy(model), tok)
    ro = sampler.generate(["1+2=", "7-3="], Sampling(n=4, max_new_tokens=10, top_p=0.9), seed=0)
    plain = Engine(copy.deepcopy(model).train(), tok)
    ckpt = Engine(copy.deepcopy(model).train(), tok, activation_checkpointing=True)
    calls = counted_calls(ckpt.model.model.layers[0].mlp)
    assert plain._prompt_groups(ro.tokens, ro.attention_mask, ro.n_prompt) is not None
    assert_same_grads(grads_of(ckpt, ro), grads_of(plain, ro))
    assert calls[0] == 2
    ckpt.close()
    assert "forward" not in vars(ckpt.model.model.layers[0])  # the class's forward again


def routed(tiny_moe):
    model, tok = tiny_moe
    sampler = Engine(copy.deepcopy(model), tok, noise=[build_noise("routing", sigma=0.5)])
    ro = sampler.generate(["1+2=", "7-3=", "4+4="], Sampling(n=2, max_new_tokens=8), seed=0)
    return model, tok, ro


def test_activation_checkpointing_replays_the_routes_in_the_recomputation(tiny_moe):
    """R3: the routes are set for one scoring call and gone when backward recomputes a layer;
    the checkpoint's recomputation re-enters them (`_as_in_forward`): same gradients as without
    checkpointing, for a minibatch's rows."""
    model, tok, ro = routed(tiny_moe)
    rows = torch.tensor([4, 1, 2])
    plain = Engine(copy.deepcopy(model).train(), tok, noise=[build_noise("replay")])
    ckpt = Engine(
        copy.deepcopy(model).train(),
        tok,
        noise=[build_noise("replay")],
        activation_checkpointing=True,
    )
    calls = counted_calls(ckpt.model.model.layers[0].mlp.gate)
    assert_same_grads(grads_of(ckpt, ro, rows), grads_of(plain, ro, rows))
    assert calls[0] == 2 and ckpt._noise_of(type(build_noise("replay"))).indices is None


def test_the_replayed_routes_are_what_makes_the_recomputation_right(tiny_moe, monkeypatch):
    """The same comparison with the routes left out of the recomputation fails: it would route
    by the trainer's own gate, a different function of θ."""
    model, tok, ro = routed(tiny_moe)
    plain = Engine(copy.deepcopy(model).train(), tok, noise=[build_noise("replay")])
    ckpt = Engine(
        copy.deepcopy(model).train(),
        tok,
        noise=[build_noise("replay")],
        activation_checkpointing=True,
    )
    real = harness.sampling.engines._as_in_forward
    monkeypatch.setattr(
        harness.sampling.engines, "_as_in_forward", lambda ctx, routes: real(ctx, [])
    )
    try:
        g = grads_of(ckpt, ro)
    except torch.utils.checkpoint.CheckpointError:
        return  # other routes, other expert batch shapes: caught by the checkpoint itself
    assert max(rel_err(x, y) for x, y in zip(g, grads_of(plain, ro))) > 100 * TOL


def test_activation_checkpointing_with_the_fp8_trainer(tiny_llama):
    """Full-pipeline FP8 (the trainer's linears quantised, straight-through): the recomputed
    layers quantise the same way."""
    from harness.noise import Fp8Trainer

    model, tok = tiny_llama
    ro = Engine(copy.deepcopy(model), tok).generate(
        ["1+2=", "7-3="], Sampling(n=3, max_new_tokens=8)
    )

    def fp8():
        return [Fp8Trainer(build_noise("fp8", fmt="e5m2"))]

    plain = Engine(copy.deepcopy(model).train(), tok, noise=fp8())
    ckpt = Engine(copy.deepcopy(model).train(), tok, noise=fp8(), activation_checkpointing=True)
    assert_same_grads(grads_of(ckpt, ro), grads_of(plain, ro))


def test_checkpointing_and_micro_batches_through_the_loop(tmp_path, alternating_reward):
    """engine.activation_checkpointing with micro-batches on tiny-moe with R3, as a run sets
    them: the step equals the plain one-shot step."""
    over = [
        "model=tiny-moe",
        "noise=routing",
        "++noise.sigma=0.5",
        "engine.routing_replay=true",
        "alpha.minibatches=2",
    ]
    whole = one_step(_cfg(tmp_path / "whole", *over))
    micro = one_step(
        _cfg(
            tmp_path / "micro",
            *over,
            f"engine.micro_batch_tokens={BUDGET}",
            "engine.activation_checkpointing=true",
        )
    )
    assert_same_step(micro, whole)
