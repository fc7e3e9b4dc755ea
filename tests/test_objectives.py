"""Objectives: worked numbers by hand, invariants, naive-loop references.

Convention in the worked examples: A = advantage, r = π_θ/π_old, ρ = π_old/μ, N = response tokens;
gradients are d loss / d logp (logp = log π_θ), and every default window is DAPO's [0.8, 1.28].
"""

import math

import pytest
import torch

from harness.base.batch import TokenBatch
from harness.objectives import AGGREGATIONS, OBJECTIVES, build_objective
from harness.objectives.core import PolicyObjective, clamp, ppo_clip_loss
from harness.objectives.methods import cis_weight

L = math.log
POLICY = sorted(set(OBJECTIVES) - {"opsd_fkl"})
KEYS = {
    "clip/frac_low",
    "clip/frac_high",
    "mask/frac",
    "rescue/frac",
    "is/weight_mean",
    "is/weight_max",
    "is/weight_min",
    "is/ess",
    "is/ess_seq",
}


def t(x):
    return torch.as_tensor(x, dtype=torch.float32)


def make(logp_old, logp_mu, adv, mask=None, **kw) -> TokenBatch:
    logp_old, logp_mu, adv = t(logp_old), t(logp_mu), t(adv)
    mask = torch.ones_like(logp_old) if mask is None else t(mask)
    kw = {k: t(v) for k, v in kw.items()}
    tokens = torch.zeros_like(logp_old, dtype=torch.long)
    return TokenBatch(tokens, mask, logp_old, logp_mu, adv, **kw)


def run(obj, logp, batch):
    """(loss, d loss/d logp, metrics)."""
    logp = t(logp).clone().requires_grad_()
    out = obj(logp, batch)
    out.loss.backward()
    return out.loss.item(), logp.grad, out.metrics


def random_batch(B=6, T=9, seed=0, spread=0.3, n_pad=3, entropy=True):
    g = torch.Generator().manual_seed(seed)
    logp_old = torch.log(torch.rand(B, T, generator=g) * 0.9 + 0.05)
    logp_mu = logp_old + spread * torch.randn(B, T, generator=g)
    logp = logp_old + spread * torch.randn(B, T, generator=g)
    adv = torch.randn(B, 1, generator=g).expand(B, T).clone()
    mask = torch.ones(B, T)
    for i in range(B):  # ragged right padding
        mask[i, T - (i % (n_pad + 1)) :] = 0
    extra = {"entropy": torch.rand(B, T, generator=g) * 2} if entropy else {}
    return logp, make(logp_old, logp_mu, adv, mask, **extra)


# --- registry ------------------------------------------------------------------------------------


def test_registry_keys():
    assert set(OBJECTIVES) == {
        "ppo_clip",
        "gspo",
        "tis",
        "mis",
        "cispo",
        "band",
        "dppo_tv",
        "snr_shrink",
        "nsr",
        "calibrated_clip",
        "cis",
        "stapo",
        "opsd_fkl",
        "grid",
        # the peer frameworks' (harness/objectives/peers.py; tests/test_peers.py)
        "rollout_rs",
        "trl_is",
        "opsm",
        "geo_mask",
        "sapo",
        "geo_mean",
        "dppo_kl",
        "clip_cov",
        "kl_cov",
        "luspo",
        "vespo",
    }
    assert set(AGGREGATIONS) == {
        "token-mean",
        "token-sum",
        "seq-mean-token-mean",
        "seq-mean-token-sum",
        "seq-mean-token-sum-norm",
    }


def test_unknown_name_lists_valid_names():
    with pytest.raises(KeyError, match="unknown objective 'ppo_clp'.*ppo_clip"):
        build_objective("ppo_clp")
    with pytest.raises(KeyError, match="unknown aggregation 'token_mean'.*token-mean"):
        build_objective("ppo_clip", aggregation="token_mean")


def test_kwarg_typo_lists_valid_kwargs():
    with pytest.raises(TypeError, match=r"\['eps_hihg'\].*eps_high"):
        build_objective("ppo_clip", eps_hihg=0.3)
    with pytest.raises(TypeError, match="norm_len"):  # only Dr.GRPO takes a constant
        build_objective("ppo_clip", norm_len=512)
    with pytest.raises(ValueError, match="'geometric'"):
        build_objective("tis", level="geo")
    with pytest.raises(ValueError, match="'trust', 'folded'"):
        build_objective("grid", ratio="ti")  # the policy ratio must carry grad


# --- worked examples, one per method -------------------------------------------------------------


def test_ppo_clip_by_hand():
    # r = [1.5, 0.5, 1.1, 0.5], A = [+1, +1, -1, -1]
    #   1.5, A>0: max(-1.5, -1.28) = -1.28, clipped high, grad 0
    #   0.5, A>0: max(-0.5, -0.8)  = -0.5,  open quadrant, grad -A r = -0.5
    #   1.1, A<0: max(1.1, 1.1)    =  1.1,  grad -A r = 1.1
    #   0.5, A<0: max(0.5, 0.8)    =  0.8,  clipped low, grad 0
    # token-mean: (-1.28 - 0.5 + 1.1 + 0.8)/4 = 0.03; grads / 4
    r = [1.5, 0.5, 1.1, 0.5]
    b = make([[-1.0] * 4], [[-1.0] * 4], [[1, 1, -1, -1]])
    loss, grad, m = run(build_objective("ppo_clip"), [[-1 + L(x) for x in r]], b)
    assert loss == pytest.approx(0.03, abs=1e-6)
    torch.testing.assert_close(grad, t([[0.0, -0.125, 0.275, 0.0]]))
    assert (m["clip/frac_low"], m["clip/frac_high"]) == (0.25, 0.25)
    assert m["is/weight_mean"] == m["is/ess"] == 1.0


def test_clamp_bounds_are_exact_in_the_input_dtype():
    # float64 r below, at and above DAPO's [0.8, 1.28]: the clipped values are the float64 bounds
    # exactly. A bound rounded through float32 first reads 0.800000011920929 / 1.2799999713897705.
    r = torch.tensor([0.5, 0.8, 1.0, 1.28, 2.0], dtype=torch.float64)
    want = torch.tensor([0.8, 0.8, 1.0, 1.28, 1.28], dtype=torch.float64)
    assert torch.equal(clamp(r, 0.8, 1.28), want)
    lo, hi = torch.full_like(r, 0.8), torch.full_like(r, 1.28)  # per-token bounds
    assert torch.equal(clamp(r, lo, hi), want)
    # the PPO clip at the same bounds: A = +1 on r = 2.0 gives -1.28, A = -1 on r = 0.5 gives 0.8
    adv = torch.tensor([-1.0, 1.0], dtype=torch.float64)
    loss = ppo_clip_loss(torch.tensor([0.5, 2.0], dtype=torch.float64), adv, 0.8, 1.28)
    assert loss.tolist() == [0.8, -1.28]


def test_dual_clip_by_hand():
    # A = -1, r = 4: PPO term max(4, 1.28) = 4; dual-clip min(4, c=3) = 3 and no gradient.
    # A = -1, r = 2: max(2, 1.28) = 2 < 3, unchanged, grad -A r = 2. token-mean over 2.
    b = make([[0.0, 0.0]], [[0.0, 0.0]], [[-1, -1]])
    loss, grad, _ = run(build_objective("ppo_clip", c=3.0), [[L(4), L(2)]], b)
    assert loss == pytest.approx((3 + 2) / 2)
    torch.testing.assert_close(grad, t([[0.0, 1.0]]))


def test_gspo_by_hand():
    # seq 0: log r = [0.1, -0.3] -> s = e^{-0.1} = 0.904837, A = -1: inside [0.8, 1.28],
    #   per-token loss s; seq-mean-token-mean gives s; d s / d logp_t = s/2 = 0.452419
    # seq 1: log r = [-0.5, -0.5] -> s = 0.606531 < 0.8, A = -1: clipped, loss 0.8, grad 0
    # mean over sequences: (0.904837 + 0.8)/2 = 0.852419; grads / 2
    b = make([[0.0, 0.0], [0.0, 0.0]], [[0.0, 0.0]] * 2, [[-1, -1], [-1, -1]])
    obj = build_objective("gspo", eps_low=0.2, eps_high=0.28)
    loss, grad, m = run(obj, [[0.1, -0.3], [-0.5, -0.5]], b)
    assert loss == pytest.approx(0.852419, abs=1e-5)
    torch.testing.assert_close(grad, t([[0.226209, 0.226209], [0.0, 0.0]]))
    assert m["clip/frac_low"] == 0.5


def test_tis_by_hand():
    # ρ = π_old/μ = [3, 0.5], r = 1, A = +1.  Token: w = min(ρ, 2) = [2, 0.5];
    #   loss = mean(-w) = -1.25, grad = -w/2 = [-1, -0.25]
    #   is/ess = (2.5)^2 / (2 (4 + 0.25)) = 0.735294 (the dials on ρ: tests/test_diagnostics.py)
    # Sequence (product): 3 · 0.5 = 1.5 for both tokens -> loss -1.5.
    # Geometric: sqrt(1.5) = 1.224745 -> loss -1.224745.
    b = make([[0.0, 0.0]], [[-L(3), -L(0.5)]], [[1, 1]])
    loss, grad, m = run(build_objective("tis"), [[0.0, 0.0]], b)
    assert loss == pytest.approx(-1.25)
    torch.testing.assert_close(grad, t([[-1.0, -0.25]]))
    assert m["is/ess"] == pytest.approx(0.735294, abs=1e-6)
    assert (m["is/weight_max"], m["is/weight_min"]) == (2.0, pytest.approx(0.5))
    assert run(build_objective("tis", level="sequence"), [[0.0, 0.0]], b)[0] == pytest.approx(-1.5)
    geo = run(build_objective("tis", level="geometric"), [[0.0, 0.0]], b)[0]
    assert geo == pytest.approx(-1.224745, abs=1e-6)


def test_mis_by_hand_and_denominator_option():
    # ρ = [3, 1, 0.4], band [0.5, 2] keeps only the middle token; r = 1, A = +1.
    # rejected kept in the denominator: -1/3; rejected leave it: -1/1.
    # reweight (IcePop ρ·1[...]) with ρ = [3, 1.5, 0.4]: -1.5/3 = -0.5.
    b = make([[0.0] * 3], [[-L(3), 0.0, -L(0.4)]], [[1, 1, 1]])
    loss, grad, m = run(build_objective("mis"), [[0.0] * 3], b)
    assert loss == pytest.approx(-1 / 3)
    torch.testing.assert_close(grad, t([[0.0, -1 / 3, 0.0]]))
    assert m["mask/frac"] == pytest.approx(2 / 3)
    leave = build_objective("mis", rejected_in_denominator=False)
    assert run(leave, [[0.0] * 3], b)[0] == pytest.approx(-1.0)
    b2 = make([[0.0] * 3], [[-L(3), -L(1.5), -L(0.4)]], [[1, 1, 1]])
    assert run(build_objective("mis", reweight=True), [[0.0] * 3], b2)[0] == pytest.approx(-0.5)
    # folded π_θ/μ with μ = π_old: the band acts on r = π_θ/π_old = [3, 1, 0.4]
    folded = build_objective("mis", ratio="folded")
    on_policy = make([[0.0] * 3], [[0.0] * 3], [[1] * 3])
    assert run(folded, [[L(3), 0.0, L(0.4)]], on_policy)[2]["mask/frac"] == pytest.approx(2 / 3)


def test_cispo_by_hand():
    # r = [2, 0.5, 6], A = [+1, -1, +1], clamp [0, 5]: coef = [2, 0.5, 5]
    # loss = -sg(coef)·A·log π -> grad = -coef·A/3 = [-2/3, 0.5/3, -5/3]; only r = 6 hits the cap
    r = [2.0, 0.5, 6.0]
    b = make([[0.0] * 3], [[0.0] * 3], [[1, -1, 1]])
    _, grad, m = run(build_objective("cispo"), [[L(x) for x in r]], b)
    torch.testing.assert_close(grad, t([[-2 / 3, 0.5 / 3, -5 / 3]]))
    assert (m["clip/frac_high"], m["clip/frac_low"]) == (pytest.approx(1 / 3), 0.0)


def test_band_by_hand_is_sign_agnostic():
    # folded r = π_θ/μ = [0.5, 1, 7], band (0.7, 6): keep only r = 1, whatever the sign of A.
    # grad = -r·A/3 on the kept token: A = +1 -> -1/3; A = -1 -> +1/3
    b = lambda a: make([[0.0] * 3], [[-L(0.5), 0.0, -L(7)]], [[a] * 3])  # noqa: E731
    for a in (1, -1):
        _, grad, m = run(build_objective("band"), [[0.0] * 3], b(a))
        torch.testing.assert_close(grad, t([[0.0, -a / 3, 0.0]]))
        assert m["mask/frac"] == pytest.approx(2 / 3)


def test_dppo_tv_by_hand():
    # p_θ, μ, A -> Δp = p_θ - μ; keep A>0: Δp ≤ 0.2, A<0: Δp ≥ -0.2; coef = r = p_θ/μ
    #   0.9, 0.5, +1: Δp = +0.4 -> rejected
    #   0.9, 0.5, -1: kept, grad = -(-1)(1.8)/4 = 0.45
    #   0.2, 0.6, -1: Δp = -0.4 -> rejected
    #   0.2, 0.6, +1: kept, grad = -(1)(1/3)/4 = -0.083333
    p, mu = [0.9, 0.9, 0.2, 0.2], [0.5, 0.5, 0.6, 0.6]
    b = make([[L(x) for x in mu]], [[L(x) for x in mu]], [[1, -1, -1, 1]])
    _, grad, m = run(build_objective("dppo_tv"), [[L(x) for x in p]], b)
    torch.testing.assert_close(grad, t([[0.0, 0.45, 0.0, -1 / 12]]))
    assert m["mask/frac"] == 0.5
    _, grad, _ = run(build_objective("dppo_tv", two_sided=True), [[L(x) for x in p]], b)
    assert (grad == 0).all()  # |Δp| = 0.4 > 0.2 everywhere


def test_cis_properties():
    # cap = 1 + λ·max(1 - p, κ), λ = 2.3, κ = 5e-3
    p = t([0.1, 0.9, 0.999, 0.5, 0.5])
    k = t([10.0, 10.0, 10.0, 1.5, 0.3])
    f = cis_weight(p.log(), (p / k).log(), p, 2.3, 5e-3)
    # p = 0.1: 1 + 2.3·0.9 = 3.07; p = 0.9: 1.23; p = 0.999: floor κ -> 1 + 2.3·0.005 = 1.0115
    # (the cap tightens with confidence); k = 1.5 < cap 2.15: identity; k = 0.3: lower side kept
    torch.testing.assert_close(f, t([3.07, 1.23, 1.0115, 1.5, 0.3]))
    # non-finite log k (μ = 0 recorded as -inf, or NaN) -> weight 1
    bad = cis_weight(t([-1.0, -1.0]), t([-math.inf, math.nan]), t([0.3, 0.3]), 2.3, 5e-3)
    torch.testing.assert_close(bad, t([1.0, 1.0]))


def test_cis_lambda_zero_is_tis_cap_one_and_weight_is_detached():
    logp, b = random_batch(spread=0.5)
    l_cis, g_cis, _ = run(build_objective("cis", lam=0.0), logp, b)
    l_tis, g_tis, _ = run(build_objective("tis", cap=1.0), logp, b)
    assert l_cis == pytest.approx(l_tis, abs=1e-6)
    torch.testing.assert_close(g_cis, g_tis)
    logp_mu = b.logp_mu.clone().requires_grad_()
    b.logp_mu = logp_mu
    build_objective("cis")(logp.clone().requires_grad_(), b).loss.backward()
    assert logp_mu.grad is None  # no gradient reaches μ through the weight


def test_stapo_by_hand():
    # 4 positive tokens with p = 0.001 < τ_p and H = [0.1, 0.2, 0.3, 0.4]: τ_h = 0.75-quantile
    # = 0.325, so the first three are spurious; a 5th positive token with p = 0.5 and a negative
    # low-p token are kept. r = 1: kept losses [-1, -1, +1], normalised by Σ I = 3 (not 6).
    p = [0.001, 0.001, 0.001, 0.001, 0.5, 0.001]
    b = make(
        [[L(x) for x in p]],
        [[L(x) for x in p]],
        [[1, 1, 1, 1, 1, -1]],
        entropy=[[0.1, 0.2, 0.3, 0.4, 0.1, 0.1]],
    )
    loss, grad, m = run(build_objective("stapo"), [[L(x) for x in p]], b)
    assert m["mask/frac"] == pytest.approx(0.5)
    torch.testing.assert_close(grad, t([[0, 0, 0, -1 / 3, -1 / 3, 1 / 3]]))  # Σ I = 3 kept
    with pytest.raises(ValueError, match="entropy"):
        build_objective("stapo")(t([[0.0]]), make([[0.0]], [[0.0]], [[1.0]]))


def test_snr_shrink_by_hand_and_state():
    # bins on p_t: [0, .5) λ = 0.5, [l, u] = [0.5, 2];  [.5, 1] λ = 1, [0.9, 1.1]
    #   p = .2, r = 9:    9^.5 = 3 -> 2      p = .8, r = 1.05 -> 1.05
    #   p = .8, r = 1.5:  1.5 -> 1.1         p = .2, r = .16: .16^.5 = .4 -> 0.5
    # grad = -w·A/4 with A = +1
    p, r = [0.2, 0.8, 0.8, 0.2], [9.0, 1.05, 1.5, 0.16]
    lo = [[L(x) for x in p]]
    b = make(lo, [[L(x) - L(y) for x, y in zip(p, r)]], [[1] * 4])
    kw = dict(edges=[0, 0.5, 1], lam=[0.5, 1], lower=[0.5, 0.9], upper=[2, 1.1])
    obj = build_objective("snr_shrink", **kw)
    _, grad, m = run(obj, lo, b)
    torch.testing.assert_close(grad, t([[-2.0, -1.05, -1.1, -0.5]]) / 4)
    assert (m["clip/frac_high"], m["clip/frac_low"]) == (0.5, 0.25)
    fresh = build_objective("snr_shrink", edges=[0, 0.5, 1])
    fresh.load_state_dict(obj.state_dict())
    torch.testing.assert_close(run(fresh, lo, b)[1], grad)
    with pytest.raises(ValueError, match="2 per-bin"):
        build_objective("snr_shrink", edges=[0, 0.5, 1], lam=[1, 1, 1])


# every named method that is a PolicyObjective, rebuilt as a grid point
PPO = dict(lo=0.8, hi=1.28)
GRID_POINTS = [
    ("ppo_clip", {}, {}),
    ("ppo_clip", dict(c=3.0), dict(c=3.0)),
    (
        "gspo",
        {},
        dict(level="geometric", lo=1 - 3e-4, hi=1 + 4e-4, aggregation="seq-mean-token-mean"),
    ),
    (
        "tis",
        dict(level="sequence"),
        dict(corrections=[dict(kind="ratio", ratio="ti", level="sequence", hi=2.0)]),
    ),
    (
        "mis",
        dict(ratio="folded"),
        dict(corrections=[dict(kind="ratio", ratio="folded", treatment="mask", lo=0.5)]),
    ),
    ("mis", dict(reweight=True), dict(corrections=[dict(kind="ratio", treatment="pop", lo=0.5)])),
    ("cispo", {}, dict(treatment="clamp", lo=0.0, hi=5.0)),
    ("band", {}, dict(ratio="folded", treatment="band", lo=0.7, hi=6.0)),
    (
        "dppo_tv",
        {},
        dict(ratio="folded", treatment="clamp", lo=0.0, hi=math.inf, corrections=[dict(kind="tv")]),
    ),
    (
        "dppo_tv",
        dict(ratio="trust", c=2.0, two_sided=True),
        dict(
            treatment="clamp",
            lo=0.0,
            hi=2.0,
            corrections=[dict(kind="tv", ratio="trust", two_sided=True)],
        ),
    ),
    ("cis", dict(lam=1.5), dict(**PPO, corrections=[dict(kind="cis", lam=1.5)])),
    (
        "stapo",
        dict(tau_p=0.3),
        dict(**PPO, rejected_in_denominator=False, corrections=[dict(kind="s2t", tau_p=0.3)]),
    ),
]


@pytest.mark.parametrize("name, kw, grid_kw", GRID_POINTS)
def test_grid_rebuilds_every_named_method(name, kw, grid_kw):
    """Same loss and same gradient as the named method, on a batch where every mechanism acts
    (spread ratios, both advantage signs, low-p and high-p tokens)."""
    logp, b = random_batch(spread=0.6)
    a, g, m = run(build_objective(name, **kw), logp, b)
    a2, g2, m2 = run(build_objective("grid", **grid_kw), logp, b)
    assert a == pytest.approx(a2, abs=1e-6), name
    torch.testing.assert_close(g, g2)
    assert m == m2


def test_grid_corrections_fail_with_the_valid_names():
    with pytest.raises(ValueError, match="kind='tis'; valid: ratio, tv, cis, s2t"):
        build_objective("grid", corrections=[dict(kind="tis")])
    with pytest.raises(TypeError, match=r"unknown field\(s\) \['cap'\]; valid: \['lam', 'kappa'\]"):
        build_objective("grid", corrections=[dict(kind="cis", cap=2)])


def test_grid_new_points():
    # a new point: CISPO-style clamp of the geometric folded ratio. One sequence, log r = [0, L(4)]
    # -> s = 2 -> clip(2, 0, 1.5) = 1.5 on both tokens; grad = -1.5·A/2 with A = 1
    new = build_objective("grid", ratio="folded", level="geometric", treatment="clamp", hi=1.5)
    _, grad, _ = run(new, [[0.0, L(4)]], make([[0.0, 0.0]], [[0.0, 0.0]], [[1, 1]]))
    torch.testing.assert_close(grad, t([[-0.75, -0.75]]))


def test_aggregations_by_hand():
    # ℓ = [[1, 2, pad], [3, pad, pad]]
    # token-mean 6/3 = 2; seq-mean-token-mean (3/2 + 3/1)/2 = 2.25; Dr.GRPO 6/(2·3) = 1, L=4: 0.75
    loss = t([[1.0, 2.0, 0.0], [3.0, 0.0, 0.0]])
    den = t([[1, 1, 0], [1, 0, 0]])
    assert AGGREGATIONS["token-mean"](loss, den).item() == 2.0
    assert AGGREGATIONS["seq-mean-token-mean"](loss, den).item() == 2.25
    assert AGGREGATIONS["seq-mean-token-sum-norm"](loss, den).item() == 1.0
    assert AGGREGATIONS["seq-mean-token-sum-norm"](loss, den, norm_len=4).item() == 0.75


# --- invariants ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", POLICY)
def test_every_objective_returns_the_metrics_and_state(name):
    logp, b = random_batch()
    obj = build_objective(name)
    loss, grad, m = run(obj, logp, b)
    assert KEYS <= set(m) and all(isinstance(v, float) for v in m.values())
    assert math.isfinite(loss) and torch.isfinite(grad).all()
    state = obj.state_dict()
    assert isinstance(state, dict)
    obj.load_state_dict(state)


def test_mu_equals_pi_old_makes_every_is_weight_one():
    logp, b = random_batch()
    b.logp_mu = b.logp_old.clone()
    # π_θ moved: weights on the training-inference factor are exactly 1
    ti_corrected = [
        ("tis", {}),
        ("tis", dict(level="sequence")),
        ("mis", {}),
        ("cis", {}),
        ("calibrated_clip", dict(cap=2.0)),
        ("grid", dict(corrections=[dict(kind="ratio", ratio="ti")])),
    ]
    for name, kw in ti_corrected:
        m = run(build_objective(name, **kw), logp, b)[2]
        assert m["is/weight_min"] == m["is/weight_max"] == 1.0 and m["mask/frac"] == 0.0, name
    # and at minibatch 1 (π_θ = π_old = μ) every objective's weights are 1
    for name in POLICY:
        m = run(build_objective(name), b.logp_old, b)[2]
        assert m["is/weight_min"] == m["is/weight_max"] == 1.0, name


@pytest.mark.parametrize("name", POLICY)
def test_unit_ratio_gradient_is_vanilla_pg(name):
    # r ≡ 1 (π_θ = π_old = μ): every surrogate's gradient is -A/N, the vanilla policy gradient.
    # Clip-Cov cuts random high-covariance tokens whatever r (its point): an empty window here.
    _, b = random_batch(entropy=True)
    b.logp_mu = b.logp_old.clone()
    kw = dict(clip_cov_lb=1e9, clip_cov_ub=2e9) if name == "clip_cov" else {}
    _, grad, _ = run(build_objective(name, aggregation="token-mean", **kw), b.logp_old, b)
    torch.testing.assert_close(grad, -b.advantages * b.mask / b.mask.sum())


@pytest.mark.parametrize("name", POLICY)
def test_token_mean_invariant_to_extra_padding(name):
    logp, b = random_batch()
    kw = dict(mode="deterministic") if name == "nsr" else {}  # draws depend on the shape
    obj = lambda: build_objective(name, aggregation="token-mean", **kw)  # noqa: E731
    loss, grad, _ = run(obj(), logp, b)
    g = torch.Generator().manual_seed(1)
    pad = lambda x, v: torch.cat([x, v * torch.ones(x.shape[0], 4)], 1)  # noqa: E731
    junk = lambda x: torch.cat([x, torch.randn(x.shape[0], 4, generator=g)], 1)  # noqa: E731
    padded = make(
        junk(b.logp_old),
        pad(b.logp_mu, -math.inf),
        junk(b.advantages),
        pad(b.mask, 0.0),
        entropy=junk(b.entropy),
    )
    loss2, grad2, _ = run(obj(), junk(logp), padded)
    assert loss2 == pytest.approx(loss, abs=1e-6)
    torch.testing.assert_close(grad2[:, :-4], grad)
    assert (grad2[:, -4:] == 0).all()


# --- vectorised == naive loop --------------------------------------------------------------------


def naive(logp, b, name, eps_low=0.2, eps_high=0.28, c=None, cap=2.0):
    """Per-token Python loops: ppo_clip / gspo (seq-mean-token-mean) / tis-seq / cis / mis-geo."""
    lo, hi = 1 - eps_low, 1 + eps_high
    total, n_tok, seq_losses = 0.0, 0, []
    for i in range(logp.shape[0]):
        toks = [j for j in range(logp.shape[1]) if b.mask[i, j] > 0]
        log_r = [logp[i, j] - b.logp_old[i, j] for j in toks]
        log_rho = [float(b.logp_old[i, j] - b.logp_mu[i, j]) for j in toks]
        seq = 0.0
        for n, j in enumerate(toks):
            a = float(b.advantages[i, j])
            r = torch.exp(sum(log_r) / len(toks)) if name == "gspo" else torch.exp(log_r[n])
            ell = torch.maximum(-a * r, -a * r.clamp(lo, hi))
            if c is not None and a < 0:
                ell = torch.minimum(ell, torch.tensor(-c * a))
            if name == "tis":
                ell = ell * min(math.exp(sum(log_rho)), cap)
            if name == "cis":
                p = math.exp(float(b.logp_old[i, j]))
                ell = ell * min(math.exp(log_rho[n]), 1 + 2.3 * max(1 - p, 5e-3))
            if name == "mis" and not 0.5 <= math.exp(sum(log_rho) / len(toks)) <= 2.0:
                ell = ell * 0.0
            seq = seq + ell
        total, n_tok = total + seq, n_tok + len(toks)
        seq_losses.append(seq / len(toks))
    return sum(seq_losses) / len(seq_losses) if name == "gspo" else total / n_tok


@pytest.mark.parametrize(
    "name, kw",
    [
        ("ppo_clip", dict(c=3.0)),
        ("gspo", dict(eps_low=0.2, eps_high=0.28)),
        ("tis", dict(level="sequence")),
        ("cis", {}),
        ("mis", dict(level="geometric")),
    ],
)
def test_vectorised_equals_naive_loop(name, kw):
    logp, b = random_batch(spread=0.4, seed=3)
    loss, grad, _ = run(build_objective(name, **kw), logp, b)
    leaf = logp.clone().requires_grad_()
    ref = naive(leaf, b, name, c=kw.get("c"))
    ref.backward()
    assert loss == pytest.approx(ref.item(), abs=1e-5)
    torch.testing.assert_close(grad, leaf.grad)


# --- NSR ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "r, a, sigma, expected",
    [
        (1.6, 1, 1.0, 1.28 / 1.6),  # upper, σ = 1: (1+ε_h)/r = 0.8
        (0.6, -1, 1.0, 0.6 / 0.8),  # lower, σ = 1: r/(1-ε_l) = 0.75
        (1.5, 1, 0.2, (1.28 / 1.5 - 0.8) / 0.2),  # band: (x - (1-σ))/σ = 0.266667
        (0.5, -1, 0.5, (0.5 / 0.8 - 0.5) / 0.5),  # lower band: 0.25
        (2.0, 1, 0.2, 0.0),  # beyond the band x = 0.64 < 0.8: stays clipped
    ],
)
def test_nsr_rescue_rate_matches_closed_form(r, a, sigma, expected):
    B, T = 64, 2048
    b = make(torch.zeros(B, T), torch.zeros(B, T), torch.full((B, T), float(a)))
    obj = build_objective("nsr", sigma=sigma, seed=1)
    _, grad, m = run(obj, torch.full((B, T), L(r)), b)
    rate = (grad != 0).float().mean().item()  # a rescued token has the unclipped gradient
    assert rate == pytest.approx(expected, rel=0.02, abs=1e-9)
    assert m["rescue/frac"] == pytest.approx(rate)
    assert m["clip/frac_high" if a > 0 else "clip/frac_low"] == 1.0


def test_nsr_deterministic_by_hand():
    # r = 1.6, A = +1, σ = 1.  unclipped: w = P = 0.8, grad = -w·r = -1.28 = -A(1+ε_h) (a CISPO
    # clamp in expectation); perturbed: w = c²/2r² = 1.6384/5.12 = 0.32, grad = -0.512
    b = make([[0.0]], [[0.0]], [[1.0]])
    for weight, g in [("unclipped", -1.28), ("perturbed", -0.512)]:
        obj = build_objective("nsr", mode="deterministic", rescued_weight=weight)
        assert run(obj, [[L(1.6)]], b)[1].item() == pytest.approx(g)


@pytest.mark.parametrize("base", ["ppo_clip", "gspo"])
@pytest.mark.parametrize("weight", ["unclipped", "perturbed"])
@pytest.mark.parametrize("sigma", [1.0, 0.5])
def test_nsr_deterministic_gradient_is_mean_stochastic_gradient(base, weight, sigma):
    # Replicate one small batch K times: the stochastic gradient summed over replicas is the
    # Monte-Carlo mean gradient of one copy (token-mean over K·N tokens).
    K = 20000
    log_r = t([[L(1.6), L(1.2), L(0.7), L(0.75)], [L(1.45), L(0.5), L(1.0), L(1.35)]])
    adv = t([[1.0, 1.0, -1.0, -1.0], [1.0, -1.0, 1.0, 1.0]])
    if base == "gspo":  # one ratio per sequence: s = 1.6 (A > 0) and s = 0.6 (A < 0), both clipped
        log_r = t([[L(1.7), L(1.5), L(1.6), L(1.6)], [L(0.6)] * 4])
        adv = t([[1.0] * 4, [-1.0] * 4])
    kw = dict(base=base, rescued_weight=weight, sigma=sigma, eps_low=0.2, eps_high=0.28)
    small = make(torch.zeros(2, 4), torch.zeros(2, 4), adv)
    _, g_det, _ = run(build_objective("nsr", mode="deterministic", **kw), log_r, small)
    big = make(torch.zeros(2 * K, 4), torch.zeros(2 * K, 4), adv.repeat(K, 1))
    _, g_sto, _ = run(build_objective("nsr", seed=0, **kw), log_r.repeat(K, 1), big)
    g_mean = g_sto.view(K, 2, 4).sum(0)
    assert (g_det != 0).any()
    torch.testing.assert_close(g_mean, g_det, atol=0.03 / 8, rtol=0.0)


def test_nsr_push_negative_control():
    # In-bound A > 0 tokens at r = 1 are pushed out w.p. (x' - (1-σ))/σ with x' = r/1.28:
    # σ = 0.5 -> (0.78125 - 0.5)/0.5 = 0.5625. Clipped tokens are never rescued.
    B, T = 64, 2048
    b = make(torch.zeros(B, T), torch.zeros(B, T), torch.ones(B, T))
    _, grad, m = run(build_objective("nsr", mode="push", sigma=0.5), torch.zeros(B, T), b)
    assert (grad == 0).float().mean().item() == pytest.approx(0.5625, rel=0.02)
    _, grad, _ = run(build_objective("nsr", mode="push"), torch.full((B, T), L(1.6)), b)
    assert (grad == 0).all()


def test_nsr_gspo_draws_once_per_sequence():
    # s = 1.6 for every sequence, A = +1: each sequence is rescued (w.p. 0.8) as a whole
    B, T = 256, 8
    b = make(torch.zeros(B, T), torch.zeros(B, T), torch.ones(B, T))
    obj = build_objective("nsr", base="gspo", eps_low=0.2, eps_high=0.28)
    rescued = run(obj, torch.full((B, T), L(1.6)), b)[1] != 0
    assert (rescued.all(1) | ~rescued.any(1)).all()
    assert 0.7 < rescued[:, 0].float().mean().item() < 0.9


def test_nsr_seeded_and_checkpointable():
    logp, b = random_batch(spread=0.8)
    obj = build_objective("nsr", seed=7)
    state = obj.state_dict()
    first = run(obj, logp, b)[1]
    obj.load_state_dict(state)
    torch.testing.assert_close(run(obj, logp, b)[1], first)
    torch.testing.assert_close(run(build_objective("nsr", seed=7), logp, b)[1], first)


# --- calibrated clipping -------------------------------------------------------------------------


def test_calibrated_clip_by_hand():
    # hp: A<0 r = [0.7, 0.9, 1.0]; A>0 r = [1.0, 1.1, 1.4]. α = #{r < 0.8}/3 = 1/3
    # lp: A<0 r = [0.6, 0.75, 1.05] -> k = round(1/3·3) = 1 -> L* = 0.75
    # ρ* = G⁺_hp(1.28)/G⁻_hp(0.8) = (1.0 + 1.1)/(0.9 + 1.0) = 1.105263
    # lp: A>0 r = [0.95, 1.2, 1.5]; target = ρ*·G⁻_lp(0.75) = 1.105263·(0.75 + 1.05) = 1.989474
    #   cumsum [0.95, 2.15, 3.65] first ≥ target at 1.2 -> H* = 1.2
    # EMA 0.9 from the paper's [0.6, 1.8]: L = 0.54 + 0.075 = 0.615, H = 1.62 + 0.12 = 1.74.
    # Count balance: ρ* = 2/2, target 2 -> 1.2
    hp = t([[0.7, 0.9, 1.0, 1.0, 1.1, 1.4]]).log()
    lp = t([[0.6, 0.75, 1.05, 0.95, 1.2, 1.5]]).log()
    adv, mask, zero = t([[-1, -1, -1, 1, 1, 1]]), torch.ones(1, 6), torch.zeros(1, 6)
    obj = build_objective("calibrated_clip", ema=0.0)
    m = obj.calibrate(hp, zero, lp, zero, adv, mask)
    assert m["calib/alpha_low"] == pytest.approx(1 / 3)
    assert m["calib/lp_low_share"] == pytest.approx(2 / 3)  # 0.6, 0.75 < 0.8
    assert m["calib/hp_high_share"] == pytest.approx(1 / 3)  # 1.4 > 1.28
    assert m["calib/lp_high_share"] == pytest.approx(1 / 3)  # 1.5 > 1.28
    assert m["calib/rho_target"] == pytest.approx(2.1 / 1.9)
    assert (obj.low, obj.high) == (pytest.approx(0.75), pytest.approx(1.2))
    smooth = build_objective("calibrated_clip")
    smooth.calibrate(hp, zero, lp, zero, adv, mask)
    assert (smooth.low, smooth.high) == (pytest.approx(0.615), pytest.approx(1.74))
    count = build_objective("calibrated_clip", ema=0.0, balance="count")
    assert count.calibrate(hp, zero, lp, zero, adv, mask)["calib/high_target"] == pytest.approx(1.2)
    # the bounds are state, and they are what the clip uses: A<0, r = 0.78 is inside [0.75, 1.2]
    one = make([[0.0]], [[0.0]], [[-1.0]])
    assert run(build_objective("calibrated_clip"), [[L(0.78)]], one)[1].item() == pytest.approx(
        0.78
    )
    fresh = build_objective("calibrated_clip", init_low=None, init_high=None)
    assert run(fresh, [[L(0.78)]], one)[1].item() == 0.0  # the reference window [0.8, 1.28]
    fresh.load_state_dict(obj.state_dict())
    _, grad, m = run(fresh, [[L(0.78)]], one)
    assert grad.item() == pytest.approx(0.78) and m["clip/bound_low"] == pytest.approx(0.75)


def test_calibrated_low_reproduces_hp_negative_clip_fraction():
    # hp log-ratios ~ N(0, 0.15²), lp = hp × log-normal noise (σ = 0.1): the fixed 0.8 bound
    # clips ≈ Φ(log .8/.18) = 10.7% of negatives at lp vs Φ(log .8/.15) = 6.8% at hp.
    g = torch.Generator().manual_seed(0)
    n = 40000
    log_hp = 0.15 * torch.randn(1, n, generator=g, dtype=torch.float64)
    log_lp = log_hp + 0.1 * torch.randn(1, n, generator=g, dtype=torch.float64)
    adv = torch.where(torch.rand(1, n, generator=g) < 0.5, -1.0, 1.0)
    zero, mask = torch.zeros(1, n), torch.ones(1, n)
    obj = build_objective("calibrated_clip", ema=0.0)
    obj.calibrate(log_hp, zero, log_lp, zero, adv, mask)
    neg = adv < 0
    frac_hp = (log_hp.exp()[neg] < 0.8).float().mean().item()
    frac_lp = (log_lp.exp()[neg] < obj.low).float().mean().item()
    assert abs(frac_lp - frac_hp) < 0.01
    assert abs((log_lp.exp()[neg] < 0.8).float().mean().item() - frac_hp) > 0.02  # not vacuous
    assert obj.low < 0.8
    # H solves the balance: G⁺(H; lp) reaches ρ*·G⁻(L; lp), and would not just below H
    r_lp, a = log_lp.exp(), adv
    r_hp = log_hp.exp()
    rho = (r_hp * (a > 0) * (r_hp <= 1.28)).sum() / (r_hp * (a < 0) * (r_hp >= 0.8)).sum()
    target = rho * (r_lp * (a < 0) * (r_lp >= obj.low)).sum()
    g_pos = lambda h: (r_lp * (a > 0) * (r_lp <= h)).sum()  # noqa: E731
    assert g_pos(obj.high) >= target * (1 - 1e-6) and g_pos(obj.high * (1 - 1e-4)) < target


# --- OPSD -----------------------------------------------------------------------------------------


def test_opsd_by_hand():
    # V = 2, T = 1, full support. Teacher a = [0, 0] -> p = [.5, .5]; student b = [log 3, 0]
    # -> q = [.75, .25]. d = p log(p/q) = [-0.202733, 0.346574]; D_FKL = 0.143841
    # τ = 0.05: D_clip = -0.202733 + 0.05 = -0.152733 (negative: not a divergence)
    # Prop. 1, A = {0}, P_A = 0.5: ∂D_clip/∂z = [P_A q_0 - p_0, P_A q_1] = [-0.125, +0.125]
    #   exact ∂D_FKL/∂z = q - p = [0.25, -0.25]: the clipped entry's gradient is reversed
    a, mask = t([[[0.0, 0.0]]]), torch.ones(1, 1)
    out = {}
    for tau in (0.05, None):
        b = t([[[L(3), 0.0]]]).requires_grad_()
        o = build_objective("opsd_fkl", top_k=None, temperature=1.0, tau=tau)(b, a, mask)
        o.loss.backward()
        out[tau] = (o.loss.item(), b.grad[0, 0], o.metrics)
    assert out[None][0] == pytest.approx(0.143841, abs=1e-6)
    assert out[0.05][0] == pytest.approx(-0.152733, abs=1e-6)
    torch.testing.assert_close(out[0.05][1], t([-0.125, 0.125]))
    torch.testing.assert_close(out[None][1], t([0.25, -0.25]))
    assert out[0.05][2]["opsd/clip_frac"] == 0.5 and out[0.05][2]["opsd/clipped_mass"] == 0.5
    assert build_objective("opsd_fkl").inputs == "logits"


def test_opsd_prop1_sign_reversal_on_clipped_entries():
    g = torch.Generator().manual_seed(0)
    B, T, V, k, temp = 4, 16, 64, 16, 1.1
    teacher = 3 * torch.randn(B, T, V, generator=g)
    student = (teacher + 2 * torch.randn(B, T, V, generator=g)).requires_grad_()
    mask = torch.ones(B, T)
    grads = {}
    for tau in (0.05, None):
        student.grad = None
        build_objective("opsd_fkl", top_k=k, temperature=temp, tau=tau)(
            student, teacher, mask
        ).loss.backward()
        grads[tau] = student.grad.clone()
    idx = teacher.topk(k, -1).indices
    log_p = (teacher.gather(-1, idx) / temp).log_softmax(-1)
    log_q = (student.detach().gather(-1, idx) / temp).log_softmax(-1)
    d = log_p.exp() * (log_p - log_q)
    clipped = d > 0.05
    g_clip, g_fkl = grads[0.05].gather(-1, idx), grads[None].gather(-1, idx)
    assert clipped.sum() > 50
    assert (g_clip[clipped] > 0).all() and (g_fkl[clipped] < 0).all()
    # closed form: ∂D_clip/∂b_i = (P_A q_i - p_i 1[i ∈ A]) / T, averaged over B·T positions
    p, q = log_p.exp(), log_q.exp()
    p_a = (p * ~clipped).sum(-1, keepdim=True)
    torch.testing.assert_close(g_clip, (p_a * q - p * ~clipped) / temp / (B * T))
    outside = torch.ones_like(student, dtype=torch.bool).scatter(-1, idx, False)
    assert (grads[0.05][outside] == 0).all()  # only the teacher's top-k support gets gradient
    # an engine's top-k capture (log-probs on ids) gives the same loss as full teacher logits
    obj = build_objective("opsd_fkl", top_k=k, temperature=temp)
    captured = teacher.log_softmax(-1).gather(-1, idx)
    full, topk = obj(student, teacher, mask), obj(student, captured, mask, teacher_ids=idx)
    assert topk.loss.item() == pytest.approx(full.loss.item(), abs=1e-6)


def test_policy_objectives_share_the_composed_class():
    assert all(isinstance(build_objective(n), PolicyObjective) for n in POLICY)


def test_adaptive_snr_refresh_recovers_lambda_from_known_alpha_and_beta():
    """Ground truth: in the bin p_t ∈ [0.7, 0.9) Δ_cal ~ N(0, 0.1²) (β) and Δ_live ~ N(0, 0.1² +
    0.2²) (α + β): Var α / Var(α+β) = 0.04/0.05 = 0.8. Bins with no tokens keep their values."""
    from harness.objectives import build_objective

    obj = build_objective("snr_shrink", adaptive=True, every=5, edges=[0.0, 0.7, 0.9, 1.0])
    g = torch.Generator().manual_seed(0)
    n = 200_000
    obj.live_delta = torch.randn(n, generator=g) * (0.1**2 + 0.2**2) ** 0.5
    obj.live_conf = torch.full((n,), 0.8)
    out = obj.refresh(torch.randn(n, generator=g) * 0.1, torch.full((n,), 0.8))
    assert out["snr/lam_b1"] == pytest.approx(0.8, abs=0.01)
    assert out["snr/lam_b0"] == pytest.approx(0.85) and out["snr/lower_b0"] == 0.5  # no data
    assert out["snr/lower_b1"] < 1 < out["snr/upper_b1"] and out["snr/n_live"] == n
    assert len(obj.live_delta) == 0  # the live record starts afresh


def test_band_deletions_split_by_advantage_sign_and_weight_p99_by_hand():
    # band on π_θ/π_old, [0.8, 1.25]: r = [0.5, 1.0, 2.0, 1.1] with A = [−1, −1, +1, +1]
    # rejects r = 0.5 (A < 0) and r = 2.0 (A > 0): a quarter of the tokens each; the kept
    # weights sg(r) are [1.0, 1.1], whose 99th percentile (linear) is 1.0 + 0.99·0.1 = 1.099
    b = make([[0.0] * 4], [[0.0] * 4], [[-1.0, -1.0, 1.0, 1.0]])
    obj = build_objective("band", ratio="trust", lo=0.8, hi=1.25)
    m = run(obj, [[L(0.5), L(1.0), L(2.0), L(1.1)]], b)[2]
    assert m["mask/frac_neg"] == m["mask/frac_pos"] == pytest.approx(0.25)
    assert m["mask/frac"] == pytest.approx(0.5)
    assert m["is/weight_p99"] == pytest.approx(1.099, abs=1e-5)
    assert m["is/weight_max"] == pytest.approx(1.1, abs=1e-6)


def test_clip_shares_at_eos_and_at_a_loops_first_copy_by_hand():
    # row 0 stops at EOS (3 tokens < budget 6): place [0, 0, eos]; row 1 runs to the budget and
    # its repetition (7 8 9)×2 is not mature: place 0 everywhere. PPO clip [0.8, 1.28] on
    # π_θ/π_old with A = −1 (row 0) and +1 (row 1): r = 0.5 at row 0's EOS (clipped low) and at
    # row 1's first token (not clipped: A > 0 below the window)
    from harness.stats.repetition import token_places

    ids = torch.tensor([[4, 5, 2, 0, 0, 0], [7, 8, 9, 7, 8, 9]])
    mask = t([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1]])
    place = token_places(ids, mask, budget=6)
    assert place.tolist() == [[0, 0, 1, 0, 0, 0], [0] * 6]
    b = make([[0.0] * 6] * 2, [[0.0] * 6] * 2, [[-1.0] * 6, [1.0] * 6], mask)
    b.place = place
    logp = [[0.0, 0.0, L(0.5), 0.0, 0.0, 0.0], [L(0.5), 0.0, 0.0, 0.0, 0.0, 0.0]]
    m = run(build_objective("ppo_clip"), logp, b)[2]
    assert m["place/frac_eos"] == pytest.approx(1 / 9) and m["place/frac_loop"] == 0.0
    assert m["clip/frac_low_eos"] == pytest.approx(1 / 9) == m["clip/frac_low"]
    assert m["clip/frac_high_eos"] == 0.0 and m["clip/frac_low_loop"] == 0.0


def test_token_places_mark_the_first_copy_of_a_terminal_loop():
    # period 2 from t = 4 to the end (n = 34 ≥ 30, ⌊30/2⌋ ≥ 3 copies): s = 4, first copy 6..7
    from harness.stats.repetition import token_places

    tokens = [11, 12, 13, 14] + [5, 6] * 15
    n = len(tokens)
    place = token_places(torch.tensor([tokens]), torch.ones(1, n), budget=n)
    assert place[0].nonzero()[:, 0].tolist() == [6, 7] and set(place[0, [6, 7]].tolist()) == {2}


def test_gradient_coefficient_tail_by_hand():
    # PPO clip [0.8, 1.28], dual clip c = 3, on π_θ/π_old: r = [0.5, 1.0, 1.5, 1.1, 4.0] with
    # A = [−1, −1, +1, +1, −1]. ∇log π's coefficient per unit of A is r where the gradient
    # survives and 0 where the clip (0.5 below, 1.5 above) or the dual clip (4.0 > 3) holds it:
    # [0, 1.0, 0, 1.1, 0] → over the live ones p99 = 1.0 + 0.99·0.1 = 1.099, max 1.1
    b = make([[0.0] * 5], [[0.0] * 5], [[-1.0, -1.0, 1.0, 1.0, -1.0]])
    logp = [[L(0.5), 0.0, L(1.5), L(1.1), L(4.0)]]
    m = run(build_objective("ppo_clip", c=3.0), logp, b)[2]
    assert m["grad/coef_p99"] == pytest.approx(1.099, abs=1e-5)
    assert m["grad/coef_max"] == pytest.approx(1.1, abs=1e-6)
    # without the dual clip the A < 0 token at r = 4 keeps its gradient: its coefficient is 4
    assert run(build_objective("ppo_clip"), logp, b)[2]["grad/coef_max"] == pytest.approx(4.0)
    # TIS C = 2 multiplies by min(π_old/μ, 2): μ at half π_old's probability doubles every one
    tis = make([[0.0] * 5], [[L(0.5)] * 5], [[-1.0, -1.0, 1.0, 1.0, -1.0]])
    m = run(build_objective("tis", cap=2.0), logp, tis)[2]
    # live [2.0, 2.2, 8.0]: p99 at 0.99·2 = 1.98 of the sorted list, 2.2 + 0.98·5.8 = 7.884
    assert m["grad/coef_p99"] == pytest.approx(7.884, rel=1e-4)
    assert m["grad/coef_max"] == pytest.approx(8.0, rel=1e-6)


def test_one_sided_clips_of_the_dissection_by_hand():
    # upper clip only (ε_l = 1: window [0, 1.28]): A < 0 at r = 0.1 keeps its gradient 0.1
    # (the std clip deletes it), A > 0 at r = 1.5 is still clipped; lower clip only
    # (ε_h = ∞: [0.8, ∞)): A > 0 at r = 5 keeps its gradient 5, A < 0 at r = 0.5 is clipped
    b = make([[0.0] * 2], [[0.0] * 2], [[-1.0, 1.0]])
    _, g, m = run(build_objective("ppo_clip", eps_low=1.0), [[L(0.1), L(1.5)]], b)
    assert g[0].tolist() == pytest.approx([0.1 / 2, 0.0]) and m["clip/frac_high"] == 0.5
    _, g, m = run(build_objective("ppo_clip", eps_high=math.inf), [[L(0.5), L(5.0)]], b)
    assert g[0].tolist() == pytest.approx([0.0, -5.0 / 2]) and m["clip/frac_low"] == 0.5
    _, g, _ = run(build_objective("ppo_clip"), [[L(0.1), L(5.0)]], b)
    assert g[0].tolist() == [0.0, 0.0]  # the std clip deletes both
