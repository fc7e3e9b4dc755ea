"""The peer frameworks' objectives and corrections (harness/objectives/peers.py) against the
peers' formulas: worked numbers, naive reference loops, and the cases of the peers' own tests
(verl tests/trainer/ppo/test_rollout_corr.py, TRL tests/test_grpo_trainer.py, SkyRL
tests/train/algorithms/test_losses.py and test_off_policy_correction.py, NeMo-RL
tests/unit/algorithms/test_loss_functions.py) as worked numbers.

Convention as in tests/test_objectives.py: A = advantage, r = π_θ/π_old, ρ = π_old/μ, N = response
tokens; gradients are d loss / d logp. Where a case sets logp = logp_old (r = 1) every kept
token's PPO loss is −A, so the gradient shows which tokens a correction keeps and weights.
"""

import inspect
import math

import pytest
import torch

from harness.objectives import AGGREGATIONS, OBJECTIVES, build_objective
from harness.objectives.methods import TVMask
from harness.objectives.peers import OffPolicySeqMask, vespo_weight
from harness.runs.tracking import aliased
from tests.test_objectives import make, random_batch, run, t

L = math.log
E = math.exp


def sigmoid(z: float) -> float:
    return 1 / (1 + E(-z))


def kept_grad(keep: list[list[int]], n: float, a: float = 1.0) -> torch.Tensor:
    """The gradient at r = 1 of PPO with advantage a where `keep` selects the kept tokens and n
    is the normaliser: −a/n on each kept token, 0 elsewhere."""
    return t(keep) * (-a / n)


# --- aggregation ---------------------------------------------------------------------------------


def test_seq_mean_token_sum_by_hand():
    # verl agg_loss seq-mean-token-sum: ℓ = [[1, 2, pad], [3, pad, pad]] -> (3 + 3) / 2 = 3
    # (token-mean gives 2, seq-mean-token-mean 2.25); a row without counted tokens leaves the mean
    f = AGGREGATIONS["seq-mean-token-sum"]
    assert f(t([[1.0, 2.0, 0.0], [3.0, 0.0, 0.0]]), t([[1, 1, 0], [1, 0, 0]])).item() == 3.0
    assert f(t([[1.0, 2.0, 0.0], [0.0, 0.0, 0.0]]), t([[1, 1, 0], [0, 0, 0]])).item() == 3.0


def test_token_sum_by_hand():
    # verl agg_loss token-sum: ℓ = [[1, 2, pad], [3, pad, pad]] -> 1 + 2 + 3 = 6, whatever the
    # counts (token-mean 2); a rejected token (ℓ = 0, still counted) changes nothing
    f = AGGREGATIONS["token-sum"]
    assert f(t([[1.0, 2.0, 0.0], [3.0, 0.0, 0.0]]), t([[1, 1, 0], [1, 0, 0]])).item() == 6.0
    assert f(t([[1.0, 2.0, 0.0], [3.0, 0.0, 0.0]]), t([[1, 1, 1], [1, 1, 0]])).item() == 6.0
    # through an objective: PPO at r = 1, A = +1 on 3 counted tokens -> −3, gradient −1 per token
    # (token-mean: −1/3); micro-batching reaches every aggregation through the same global loss
    # (harness.rl.step.backward_through_logp), tested with the normalised ones
    b = make([[-1.0] * 3], [[-1.0] * 3], [[1.0] * 3])
    loss, grad, _ = run(build_objective("ppo_clip", aggregation="token-sum"), [[-1.0] * 3], b)
    assert loss == pytest.approx(-3.0) and grad.tolist() == [[-1.0] * 3]


# --- verl rollout_rs -----------------------------------------------------------------------------


def test_rollout_rs_k1_bounds_read_mu_over_pi_old():
    # verl token_k1 with "0.5_1.5" (a case of its test_each_supported_rollout_rs_option): k1 =
    # −log ρ = log μ/π_old, kept iff 0.5 ≤ μ/π_old ≤ 1.5, i.e. ρ ∈ [2/3, 2].
    #   ρ = 1.8 kept (μ/π_old 0.556), 0.6 rejected (1.667), 2.5 rejected (0.4), 1.0 kept.
    # A band on ρ itself ([0.5, 1.5]) would keep 0.6 and reject 1.8. Rejected tokens leave verl's
    # normaliser: r = 1, A = +1 -> loss −1, gradient −1/2 on the two kept tokens.
    rho = [1.8, 0.6, 2.5, 1.0]
    b = make([[-1.0] * 4], [[-1.0 - L(x) for x in rho]], [[1] * 4])
    obj = build_objective("rollout_rs", threshold=1.5, threshold_low=0.5)
    loss, grad, m = run(obj, [[-1.0] * 4], b)
    assert loss == pytest.approx(-1.0)
    torch.testing.assert_close(grad, kept_grad([[1, 0, 0, 1]], 2))
    assert m["mask/frac"] == 0.5


# log ρ of two sequences, the second one token long: [0, 0, 0.9] and [0.5]
#   k1 = −x; k2 = x²/2 = [0, 0, 0.405], [0.125]; k3 = eˣ − 1 − x = [0, 0, 0.5596031], [0.1487213]
#   seq sums (verl seq_sum): k1 −0.9, −0.5; k2 0.405, 0.125; k3 0.5596, 0.1487
#   seq means (seq_mean): k1 −0.3, −0.5; k2 0.135, 0.125; k3 0.18653, 0.1487
#   seq max (seq_max): k2 0.405, 0.125; k3 0.5596, 0.1487
LEVEL_CASES = [
    # estimator, level, threshold -> keep of the four tokens [s0t0, s0t1, s0t2, s1t0]
    ("k1", "token", 1.5, [1, 1, 0, 0]),  # ρ ∈ [2/3, 1.5]: e^0.9 = 2.46 and e^0.5 = 1.65 out
    ("k1", "sequence", 2.0, [0, 0, 0, 1]),  # Π ρ: e^0.9 > 2, e^0.5 ≤ 2
    ("k1", "geometric", 1.5, [1, 1, 1, 0]),  # geometric mean: e^0.3 ≤ 1.5 < e^0.5
    ("k2", "token", 0.2, [1, 1, 0, 1]),
    ("k2", "sequence", 0.2, [0, 0, 0, 1]),
    ("k2", "geometric", 0.13, [0, 0, 0, 1]),
    ("k2", "geometric", 0.14, [1, 1, 1, 1]),
    ("k2", "max", 0.14, [0, 0, 0, 1]),  # max 0.405 where the mean 0.135 passes
    ("k3", "token", 0.3, [1, 1, 0, 1]),
    ("k3", "sequence", 0.3, [0, 0, 0, 1]),
    ("k3", "geometric", 0.17, [0, 0, 0, 1]),
    ("k3", "geometric", 0.3, [1, 1, 1, 1]),
    ("k3", "max", 0.3, [0, 0, 0, 1]),
]


@pytest.mark.parametrize("estimator, level, threshold, keep", LEVEL_CASES)
def test_rollout_rs_levels_and_estimators_by_hand(estimator, level, threshold, keep):
    x = [[0.0, 0.0, 0.9], [0.5, 0.0, 0.0]]
    mask = [[1, 1, 1], [1, 0, 0]]
    b = make([[-1.0] * 3] * 2, [[-1.0 - v for v in row] for row in x], [[1] * 3] * 2, mask)
    obj = build_objective("rollout_rs", estimator=estimator, level=level, threshold=threshold)
    _, grad, m = run(obj, [[-1.0] * 3] * 2, b)
    k = [keep[:3], [keep[3], 0, 0]]
    torch.testing.assert_close(grad, kept_grad(k, sum(keep)))
    assert m["mask/frac"] == pytest.approx(1 - sum(keep) / 4)


def test_rollout_rs_with_token_is_is_verl_mask_mode():
    # verl test_mask_mode: π_old = e^-2; μ = e^-1 on sequence 0 (ρ = e^-1 = 0.368), e^-2.5 on
    # sequence 1 (ρ = e^0.5 = 1.649); rollout_is token at 2.0, rollout_rs token_k1 "0.5_2.0".
    # Sequence 0 is rejected (0.368 < 0.5), half the tokens; sequence 1 keeps its IS weight
    # 1.649 untruncated. r = 1, A = +1, normaliser the 5 kept tokens: loss −1.649.
    b = make([[-2.0] * 5] * 2, [[-1.0] * 5, [-2.5] * 5], [[1] * 5] * 2)
    kw = dict(threshold=2.0, threshold_low=0.5, rollout_is="token")
    loss, grad, m = run(build_objective("rollout_rs", **kw), [[-2.0] * 5] * 2, b)
    assert loss == pytest.approx(-E(0.5), rel=1e-6)
    torch.testing.assert_close(grad, t([[0.0] * 5, [-E(0.5) / 5] * 5]))
    assert m["mask/frac"] == 0.5
    assert m["is/weight_max"] == pytest.approx(E(0.5), rel=1e-6)
    # sequence IS: Π ρ = e^2.5 = 12.18 truncated at 2
    kw["rollout_is"] = "sequence"
    assert run(build_objective("rollout_rs", **kw), [[-2.0] * 5] * 2, b)[0] == pytest.approx(-2.0)


def test_rollout_rs_is_verl_vanilla_ppo():
    # verl's vanilla loss: ε 0.2/0.2 and dual-clip clip_ratio_c = 3. μ = π_old (nothing rejected)
    #   r = 4, A = −1: max(4, 1.2) = 4, dual clip min(4, 3) = 3, no gradient
    #   r = 2, A = −1: 2, gradient −A r = 2
    #   r = 1.25, A = +1: clipped at 1.2 (DAPO's 1.28 would leave it open), no gradient
    # token-mean: (3 + 2 − 1.2) / 3
    r = [4.0, 2.0, 1.25]
    b = make([[0.0] * 3], [[0.0] * 3], [[-1, -1, 1]])
    loss, grad, _ = run(build_objective("rollout_rs"), [[L(x) for x in r]], b)
    assert loss == pytest.approx((3 + 2 - 1.2) / 3, rel=1e-6)
    torch.testing.assert_close(grad, t([[0.0, 2 / 3, 0.0]]))


def test_rollout_rs_refuses_what_verl_refuses():
    with pytest.raises(ValueError, match="'max' with estimator='k1'"):
        build_objective("rollout_rs", level="max")  # verl has no seq_max_k1
    with pytest.raises(ValueError, match="only k1 has a lower bound"):
        build_objective("rollout_rs", estimator="k3", threshold_low=0.5)
    with pytest.raises(ValueError, match="threshold=-1"):
        build_objective("rollout_rs", threshold=-1.0)


# --- TRL -----------------------------------------------------------------------------------------

# ρ per token: sequence 0 [2, 2] (Π 4), sequence 1 [0.5, 3.5] (Π 1.75); C_max 3 (TRL's default)
TRL_MODES = [
    ("token_truncate", None, [2, 2, 0.5, 3]),
    ("token_mask", None, [2, 2, 0.5, 0]),  # 3.5 > 3: 0; the ratio itself inside
    ("sequence_truncate", None, [3, 3, 1.75, 1.75]),
    ("sequence_mask", None, [0, 0, 1.75, 1.75]),  # Π 4 > 3: the whole sequence 0
    ("token_truncate", 0.6, [2, 2, 0.6, 3]),
    ("token_mask", 0.6, [2, 2, 0, 0]),
]


@pytest.mark.parametrize("mode, clip_min, w", TRL_MODES)
def test_trl_vllm_importance_sampling_modes_by_hand(mode, clip_min, w):
    # r = 1, A = +1: per-token loss −w; masked tokens stay in TRL's normaliser (4 tokens)
    b = make([[0.0] * 2] * 2, [[-L(2), -L(2)], [-L(0.5), -L(3.5)]], [[1] * 2] * 2)
    obj = build_objective("trl_is", mode=mode, clip_min=clip_min)
    loss, grad, _ = run(obj, [[0.0] * 2] * 2, b)
    assert loss == pytest.approx(-sum(w) / 4, rel=1e-6)
    torch.testing.assert_close(grad, -t([w[:2], w[2:]]) / 4)


def test_trl_off_policy_mask_cases():
    # TRL test_get_off_policy_mask: μ = 1 (log 0) everywhere, π_θ per row e^-2, e^-0.5, e^-2;
    # A = +1, −1, −1; δ = 1. KL = mean(log μ − log π_θ) = 2, 0.5, 2: row 0 kept (A ≥ 0), row 1
    # kept (0.5 ≤ 1), row 2 dropped. r = 1; the dropped row stays in the normaliser (12).
    logp = [[-2.0] * 4, [-0.5] * 4, [-2.0] * 4]
    b = make(logp, [[0.0] * 4] * 3, [[1] * 4, [-1] * 4, [-1] * 4])
    obj = build_objective("trl_is", mode=None, off_policy_mask_threshold=1.0)
    _, grad, m = run(obj, logp, b)
    torch.testing.assert_close(grad, t([[-1 / 12] * 4, [1 / 12] * 4, [0.0] * 4]))
    assert m["mask/frac"] == pytest.approx(1 / 3)
    # test_get_off_policy_mask_padding: two tokens at KL 2 and absurd padding -> dropped; at
    # KL 0.5 -> kept. The keep itself, as TRL returns it, broadcast over the row.
    mask = [[1, 1, 0, 0]]
    for row, kept in (([-2.0, -2.0, -1e4, 1e4], 0.0), ([-0.5, -0.5, -1e4, 1e4], 1.0)):
        b = make([row], [[0.0] * 4], [[-1] * 4], mask)
        w, keep = OffPolicySeqMask(1.0, "folded")(t([row]), b)
        torch.testing.assert_close(keep, t([[kept] * 4]))
        assert (w == 1).all()


def test_trl_delta_is_its_two_sided_clip():
    # TRL dapo with delta δ: −min(min(r, δ)·A, clip(r, 1 − ε, 1 + ε)·A) per token, token mean.
    # Naive loop against trl_is(mode=None, c=δ) on a batch with both signs and wide ratios.
    logp, b = random_batch(spread=0.8, seed=5)
    delta, lo, hi = 1.5, 0.8, 1.2
    leaf = logp.clone().requires_grad_()
    total, n = 0.0, 0
    for i in range(logp.shape[0]):
        for j in range(logp.shape[1]):
            if b.mask[i, j] > 0:
                r = torch.exp(leaf[i, j] - b.logp_old[i, j])
                a = float(b.advantages[i, j])
                total = total - torch.minimum(r.clamp(max=delta) * a, r.clamp(lo, hi) * a)
                n += 1
    (total / n).backward()
    loss, grad, _ = run(build_objective("trl_is", mode=None, c=delta), logp, b)
    assert loss == pytest.approx((total / n).item(), abs=1e-5)
    torch.testing.assert_close(grad, leaf.grad)


def test_slime_opsm_reads_pi_old():
    # slime compute_opsm_mask: KL = mean(log π_old − log π_θ). π_old = 1 (log 0), μ = e^-5 (not
    # read), π_θ per row e^-2, e^-0.5, e^-2, A = +1, −1, −1, δ = 1: row 2 dropped.
    #   row 0: r = e^-2, A > 0: open, loss −e^-2 per token, gradient −e^-2/12
    #   row 1: r = e^-0.5 = 0.607 < 0.8, A < 0: clipped at 0.8, no gradient
    #   row 2: would be clipped at 0.8 too: only the loss shows the drop
    # loss = (4·(−e^-2) + 4·0.8 + 0) / 12 (with row 2 kept: + 3.2 / 12)
    logp = [[-2.0] * 4, [-0.5] * 4, [-2.0] * 4]
    b = make([[0.0] * 4] * 3, [[-5.0] * 4] * 3, [[1] * 4, [-1] * 4, [-1] * 4])
    loss, grad, m = run(build_objective("opsm", delta=1.0), logp, b)
    assert loss == pytest.approx((-4 * E(-2) + 3.2) / 12, rel=1e-5)
    torch.testing.assert_close(grad, t([[-E(-2) / 12] * 4, [0.0] * 4, [0.0] * 4]))
    assert m["mask/frac"] == pytest.approx(1 / 3)
    # q = μ (--use-rollout-logprobs): mean(log μ − log π_θ) = −3 or −4.5 ≤ 1, nothing dropped
    folded = build_objective("opsm", delta=1.0, ratio="folded")
    assert run(folded, logp, b)[2]["mask/frac"] == 0.0


def test_vespo_gamma_weight_by_hand():
    # φ(w) = exp(λ + k·log w − λ·w); (k, λ) = (2, 3) where A ≥ 0, (3, 2) where A < 0 (TRL's)
    # seq 0: log r = [0.2, 0.3] -> log w = 0.5, A = +1; seq 1: log r = [−0.5, 0] -> −0.5, A = −1
    # loss −sg(φ)·A·log π, token mean over 4: gradient −φ_i·A_i/4
    phi0 = E(3 + 2 * 0.5 - 3 * E(0.5))  # 0.388223
    phi1 = E(2 + 3 * -0.5 - 2 * E(-0.5))  # 0.490170
    old = [[-1.0, -1.0], [-1.0, -1.0]]
    logp = [[-0.8, -0.7], [-1.5, -1.0]]
    b = make(old, old, [[1, 1], [-1, -1]])
    _, grad, m = run(build_objective("vespo"), logp, b)
    torch.testing.assert_close(grad, t([[-phi0 / 4] * 2, [phi1 / 4] * 2]))
    assert m["is/weight_min"] == pytest.approx(phi0, rel=1e-5)
    # φ(1) = 1, and log w is clamped to [log 1e-8, 20] first: log w = −30 reads log 1e-8,
    # φ = exp(3 + 2·log 1e-8 − 3·1e-8) = 2.0e-15 (unclamped it would be e^-57 = 1.8e-25)
    one = vespo_weight(t([0.0, 0.0]), t([1.0, -1.0]), 2.0, 3.0, 3.0, 2.0)
    torch.testing.assert_close(one, t([1.0, 1.0]))
    low = vespo_weight(t([-30.0]), t([1.0]), 2.0, 3.0, 3.0, 2.0)
    assert low.item() == pytest.approx(E(3 + 2 * L(1e-8) - 3e-8), rel=1e-4, abs=0.0)
    # vLLM token IS: ρ = 4 on seq 0's first token. token_truncate folds log 3 into log w;
    # token_mask folds log 1e-8 (the masked token), which drives φ to ~0
    b.logp_mu = t([[-1.0 - L(4), -1.0], [-1.0, -1.0]])
    lw = 0.5 + L(3)
    _, grad, _ = run(build_objective("vespo", is_mode="token_truncate"), logp, b)
    torch.testing.assert_close(grad[0], t([-E(3 + 2 * lw - 3 * E(lw)) / 4] * 2))
    _, grad, _ = run(build_objective("vespo", is_mode="token_mask"), logp, b)
    assert grad[0].abs().max() < 1e-12
    torch.testing.assert_close(grad[1], t([phi1 / 4] * 2))


def test_luspo_by_hand():
    # TRL luspo: the GSPO clip (ε 0.2/0.2) on s_i, loss_i·|y_i|, mean over sequences
    # seq 0: log r = [0.1, −0.3] -> s = e^-0.1 = 0.904837, A = −1, open: 2·s = 1.809675
    #        d/dlogp_t = 2·s/2 = s, / 2 sequences = 0.452419
    # seq 1: log r = [0.5], A = +1: s = 1.6487 clipped at 1.2: −1.2·1, no gradient
    # loss (1.809675 − 1.2) / 2 = 0.304837
    b = make([[0.0, 0.0], [0.0, 0.0]], [[0.0, 0.0]] * 2, [[-1, -1], [1, 1]], [[1, 1], [1, 0]])
    loss, grad, _ = run(build_objective("luspo"), [[0.1, -0.3], [0.5, 0.0]], b)
    assert loss == pytest.approx((2 * E(-0.1) - 1.2) / 2, rel=1e-6)
    torch.testing.assert_close(grad, t([[E(-0.1) / 2] * 2, [0.0, 0.0]]))


# --- SkyRL off-policy correction, NeMo-RL seq-mask-tis ------------------------------------------


def test_skyrl_sequence_masks_cases():
    # SkyRL test_compute_sequence_mask_geometric(_rejects), bounds [0.9, 1.1]:
    #   log ρ [0.1, −0.1, 0] -> geometric mean 1.0, kept; [0.5, 0.5, 0.5] -> 1.6487, rejected
    # r = 1, A = +1; rejected tokens stay in SkyRL's normaliser (6)
    old = [[-1.0, -1.1, -1.0], [-1.0] * 3]
    b = make(old, [[-1.1, -1.0, -1.0], [-1.5] * 3], [[1] * 3] * 2)
    _, grad, m = run(build_objective("geo_mask", lo=0.9, hi=1.1), old, b)
    torch.testing.assert_close(grad, kept_grad([[1] * 3, [0] * 3], 6))
    assert m["mask/frac"] == 0.5
    # test_compute_sequence_mask_product(_rejects_by_seq_ratio), default product bounds
    # [0.5, 2]: log ρ [0.2, 0.1, 0] -> Π 1.35, kept; [1, 1, 1] -> Π 20.09, rejected
    old = [[-1.0, -1.1, -1.2], [-1.0] * 3]
    b = make(old, [[-1.2] * 3, [-2.0] * 3], [[1] * 3] * 2)
    _, grad, _ = run(build_objective("geo_mask", metric="product"), old, b)
    torch.testing.assert_close(grad, kept_grad([[1] * 3, [0] * 3], 6))
    # SkyRL's default geometric bounds [0.99, 1.01]: e^0.005 kept, e^0.02 = 1.0202 rejected
    b = make([[-1.0] * 2] * 2, [[-1.005] * 2, [-1.02] * 2], [[1] * 2] * 2)
    _, grad, _ = run(build_objective("geo_mask"), [[-1.0] * 2] * 2, b)
    torch.testing.assert_close(grad, kept_grad([[1] * 2, [0] * 2], 4))


def test_skyrl_outlier_token_mask_cases():
    # SkyRL test_compute_outlier_token_mask_*: bounds [1e-4, 100] on every token's ρ
    #   row 0: log ρ [0, 0, 5]: 148.4 > 100 -> the whole sequence rejected
    #   row 1: [0.5, −0.5, 0] -> kept
    #   row 2: row 0 with its outlier token padded -> kept (padding is not read)
    #   row 3: [0, 0, −10]: 4.5e-5 < 1e-4 -> rejected
    # normaliser 11 response tokens
    old = [[-1.0] * 3, [-1.0, -1.5, -1.0], [-1.0] * 3, [-1.0, -1.0, -11.0]]
    mu = [[-1.0, -1.0, -6.0], [-1.5, -1.0, -1.0], [-1.0, -1.0, -6.0], [-1.0] * 3]
    mask = [[1] * 3, [1] * 3, [1, 1, 0], [1] * 3]
    b = make(old, mu, [[1] * 3] * 4, mask)
    cases = [
        (dict(outlier_low=1e-4, outlier_high=100.0), [0, 1, 1, 0]),
        (dict(outlier_high=100.0), [0, 1, 1, 1]),  # only the upper bound
        (dict(outlier_low=1e-4), [1, 1, 1, 0]),  # only the lower bound
    ]
    for kw, rows in cases:
        _, grad, _ = run(build_objective("geo_mask", metric=None, **kw), old, b)
        keep = [[k * x for x in row] for k, row in zip(rows, mask)]
        torch.testing.assert_close(grad, kept_grad(keep, 11))


def test_skyrl_tis_with_masks_cases():
    # SkyRL test_compute_off_policy_correction_both_enabled: log ρ 0.1 on every token, token TIS
    # cap 2, geometric mask [0.8, 1.2], outliers [1e-4, 100]: kept, weight e^0.1 = 1.105171
    old = [[-1.0] * 3]
    b = make(old, [[-1.1] * 3], [[1] * 3])
    kw = dict(lo=0.8, hi=1.2, tis="token", outlier_low=1e-4, outlier_high=100.0)
    loss, grad, _ = run(build_objective("geo_mask", **kw), old, b)
    assert loss == pytest.approx(-E(0.1), rel=1e-6)
    torch.testing.assert_close(grad, t([[-E(0.1) / 3] * 3]))
    # sequence TIS: Π ρ = e^0.3 under SkyRL's cap 5; e^2.1 = 8.17 truncated at 5; token cap 2
    seq = build_objective("geo_mask", metric=None, tis="sequence")
    assert run(seq, old, b)[0] == pytest.approx(-E(0.3), rel=1e-6)
    assert run(seq, old, make(old, [[-1.7] * 3], [[1] * 3]))[0] == pytest.approx(-5.0)
    tok = build_objective("geo_mask", metric=None, tis="token")
    assert run(tok, old, make(old, [[-2.0] * 3], [[1] * 3]))[0] == pytest.approx(-2.0)
    # test_ppo_policy_loss_with_off_policy_correction: A = [1, −1, 0.5], π_old = e^-1,
    # π_θ = [e^-1.1, e^-0.9, e^-1], μ = e^-1.05 (ρ = e^0.05): PPO ε 0.2 losses
    # [−e^-0.1, e^0.1, −0.5] (all inside [0.8, 1.2]) × ρ, token mean
    logp = [[-1.1, -0.9, -1.0]]
    b = make(old, [[-1.05] * 3], [[1.0, -1.0, 0.5]])
    kw = dict(metric=None, tis="token", outlier_low=1e-4, outlier_high=100.0)
    loss = run(build_objective("geo_mask", **kw), logp, b)[0]
    assert loss == pytest.approx(E(0.05) * (-E(-0.1) + E(0.1) - 0.5) / 3, rel=1e-5)
    plain = run(build_objective("geo_mask", metric=None), logp, b)[0]
    assert plain == pytest.approx((-E(-0.1) + E(0.1) - 0.5) / 3, rel=1e-5)


def test_nemo_rl_seq_mask_tis_cases():
    # NeMo-RL test_clipped_pg_loss_seq_mask_tis, bounds [0.999, 1.002], raw token IS:
    # log ρ = 0.0005 -> geometric mean 1.0005, kept, weight e^0.0005; with log ρ = 0.003
    # (1.003 > 1.002) the second sequence is rejected and stays in the token normaliser.
    # r = 1, A = [1, −1, 2]: loss = Σ −A·w / 6 = −2·e^0.0005 / 6
    kw = dict(lo=0.999, hi=1.002, tis="token", tis_cap=math.inf)
    old = [[-1.0] * 3] * 2
    b = make(old, [[-1.0005] * 3, [-1.003] * 3], [[1.0, -1.0, 2.0]] * 2)
    loss, grad, m = run(build_objective("geo_mask", **kw), old, b)
    assert loss == pytest.approx(-2 * E(0.0005) / 6, rel=1e-4)
    assert m["mask/frac"] == 0.5 and (grad[1] == 0).all()
    # a −inf log μ: the loss stays finite
    b.logp_mu = t([[-1.0005, -1.0005, -math.inf], [-1.003] * 3])
    assert math.isfinite(run(build_objective("geo_mask", **kw), old, b)[0])


def test_geo_mask_refuses_bounds_without_their_switch():
    with pytest.raises(ValueError, match="metric=None"):
        build_objective("geo_mask", metric=None, lo=0.9)
    with pytest.raises(ValueError, match="tis=None"):
        build_objective("geo_mask", tis_cap=3.0)
    with pytest.raises(ValueError, match="'geometric', 'product', None"):
        build_objective("geo_mask", metric="geo")


# --- surrogates ----------------------------------------------------------------------------------


def test_sapo_case():
    # SkyRL test_sapo_policy_loss_basic: A = [1, −1, 0.5], π_old = e^-1,
    # π_θ = [e^-1.5, e^-0.8, e^-1.1], τ_pos = 1, τ_neg = 2 (τ_neg where A ≤ 0).
    # per-token loss −A·σ(τ(r − 1))·4/τ; gradient in log π: −A·4σ(1 − σ)·r
    adv, x, tau = [1.0, -1.0, 0.5], [-0.5, 0.2, -0.1], [1.0, 2.0, 1.0]
    sig = [sigmoid(k * (E(v) - 1)) for k, v in zip(tau, x)]
    want_loss = sum(-a * s * 4 / k for a, s, k in zip(adv, sig, tau)) / 3
    want_grad = [-a * 4 * s * (1 - s) * E(v) / 3 for a, s, v in zip(adv, sig, x)]
    b = make([[-1.0] * 3], [[-1.0] * 3], [adv])
    loss, grad, m = run(build_objective("sapo", tau_neg=2.0), [[-1.5, -0.8, -1.1]], b)
    assert loss == pytest.approx(want_loss, rel=1e-5)
    torch.testing.assert_close(grad, t([want_grad]))
    assert m["clip/frac_low"] == m["clip/frac_high"] == 0.0
    # TRL importance_sampling_level=sequence: one r = exp(mean log r) for every token
    s = E(sum(x) / 3)
    sig = [sigmoid(k * (s - 1)) for k in tau]
    want = sum(-a * g * 4 / k for a, g, k in zip(adv, sig, tau)) / 3
    geo = build_objective("sapo", tau_neg=2.0, level="geometric")
    assert run(geo, [[-1.5, -0.8, -1.1]], b)[0] == pytest.approx(want, rel=1e-5)


def test_gmpo_by_hand():
    # verl geo_mean, ε 0.2/0.2 in log space, the clip by the sign of A:
    # seq 0, A = +1: log r [0.3, −0.1, −0.4] -> [0.2, −0.1, −0.4] (only the cap at 0.2 binds),
    #   mean −0.1, s = e^-0.1, loss −s; gradient −s/3/2 on the two open tokens
    # seq 1, A = −1: log r [−0.3, 0.1] -> [−0.2, 0.1] (only the floor binds), mean −0.05,
    #   s = e^-0.05, loss +s; gradient +s/2/2 on the open token
    # mean over sequences: (−e^-0.1 + e^-0.05) / 2
    b = make([[0.0] * 3] * 2, [[0.0] * 3] * 2, [[1] * 3, [-1] * 3], [[1, 1, 1], [1, 1, 0]])
    loss, grad, m = run(build_objective("geo_mean"), [[0.3, -0.1, -0.4], [-0.3, 0.1, 0.0]], b)
    assert loss == pytest.approx((-E(-0.1) + E(-0.05)) / 2, rel=1e-5)
    s0, s1 = E(-0.1), E(-0.05)
    torch.testing.assert_close(grad, t([[0.0, -s0 / 6, -s0 / 6], [0.0, s1 / 4, 0.0]]))
    assert m["clip/frac_high"] == m["clip/frac_low"] == pytest.approx(0.2)


def test_dppo_binary_kl_cases():
    # verl dppo_kl / SkyRL dppo binary_kl, δ = 0.05, p_ref = π_old = e^-1 = 0.3679 (trust):
    #   π_θ e^-0.1 = 0.905, A = +1: KL = 0.866 > δ and p > p_ref -> masked (SkyRL "kl_masked")
    #   π_θ e^-0.95 = 0.387, A = +1: KL = 0.00076 ≤ δ -> kept
    #   π_θ e^-3, A = +1: KL large but p < p_ref (against A) -> kept
    #   π_θ e^-3, A = −1: KL large and p < p_ref (with A) -> masked
    #   π_old e^-3, π_θ e^-1.5, A = −1: p > p_ref, against A -> kept; r = e^1.5 = 4.48 capped at
    #   verl's clip_ratio_c 3
    # loss −sg(min(r, 3))·A·log π, token mean over 5: gradient −min(r, 3)·A·keep/5
    old = [[-1.0, -1.0, -1.0, -1.0, -3.0]]
    logp = [[-0.1, -0.95, -3.0, -3.0, -1.5]]
    b = make(old, [[-5.0] * 5], [[1, 1, 1, -1, -1]])
    _, grad, m = run(build_objective("dppo_kl", delta_low=0.05, delta_high=0.05), logp, b)
    torch.testing.assert_close(grad, t([[0.0, -E(0.05) / 5, -E(-2) / 5, 0.0, 3 / 5]]))
    assert m["mask/frac"] == pytest.approx(2 / 5)
    # the binary KL by its formula (the 1e-8 terms aside)
    p, q = E(-0.1), E(-1.0)
    kl = q * L(q / p) + (1 - q) * L((1 - q) / (1 - p))
    assert kl == pytest.approx(0.865825, abs=1e-6)
    # SkyRL "kl_no_masking_within_delta": δ = 0.5, π_θ e^-1.01 / e^-0.99, A = +1 / −1: kept
    b2 = make([[-1.0] * 2], [[-1.0] * 2], [[1, -1]])
    _, grad, m = run(
        build_objective("dppo_kl", delta_low=0.5, delta_high=0.5), [[-1.01, -0.99]], b2
    )
    torch.testing.assert_close(grad, t([[-E(-0.01) / 2, E(0.01) / 2]]))
    assert m["mask/frac"] == 0.0
    # p_ref = μ (folded, SkyRL's reference) reads μ = e^-5: the second token is now far above it
    folded = build_objective("dppo_kl", ratio="folded", delta_low=0.05, delta_high=0.05)
    assert run(folded, logp, b)[1][0, 1] == 0.0
    with pytest.raises(ValueError, match="'tv', 'kl'"):
        TVMask(divergence="js")


def token_cov(logp, b):
    """(A − Ā)(log π − mean log π) per response token, the means over the response tokens."""
    toks = [(i, j) for i in range(logp.shape[0]) for j in range(logp.shape[1]) if b.mask[i, j]]
    a_bar = sum(float(b.advantages[k]) for k in toks) / len(toks)
    l_bar = sum(float(logp[k]) for k in toks) / len(toks)
    return {k: (float(b.advantages[k]) - a_bar) * (float(logp[k]) - l_bar) for k in toks}


def test_clip_cov_by_hand():
    # A = [3, −3, 3, −3, 0] (Ā = 0), log π = [−0.5, −1.5, −1.5, −0.5, −1] (mean −1)
    # cov = [1.5, 1.5, −1.5, −1.5, 0]; token 0 has r = 1.5 with A > 0: clipped, so not a
    # candidate; token 1 (r = 1) is the one candidate in (1, 5); ratio 0.5 -> n = 2 ≥ 1: cut.
    # losses [−3.6, 0 (cut), −3, 3, 0], token mean over 5 (the cut token stays counted)
    logp = [[-0.5, -1.5, -1.5, -0.5, -1.0]]
    old = [[-0.5 - L(1.5), -1.5, -1.5, -0.5, -1.0]]
    b = make(old, old, [[3, -3, 3, -3, 0]])
    loss, grad, m = run(build_objective("clip_cov", clip_cov_ratio=0.5), logp, b)
    assert loss == pytest.approx(-3.6 / 5, rel=1e-6)
    torch.testing.assert_close(grad, t([[0.0, 0.0, -0.6, 0.6, 0.0]]))
    assert m["mask/frac"] == pytest.approx(0.2)
    # covariance window above 1.5: nothing cut, token 1 has its gradient −A r / 5 = 0.6
    _, grad, _ = run(build_objective("clip_cov", clip_cov_ratio=0.5, clip_cov_lb=1.6), logp, b)
    torch.testing.assert_close(grad, t([[0.0, 0.6, -0.6, 0.6, 0.0]]))


def test_clip_cov_skyrl_case():
    # SkyRL test_clip_cov_policy_loss data (ratio 0.5, window (−5, 5), ε 0.2/0.2). The loop
    # finds the candidates (left open by the clip, covariance inside the window): tokens (0, 3)
    # and (1, 0), no more than n = ⌊0.5·7⌋ = 3, so both are cut whatever the draw.
    adv = [[2.0, -1.0, 1.5, 0.8], [1.0, 0.5, -2.0, 1.2]]
    logp = t([[-0.5, -1.5, -0.8, -1.2], [-1.3, -0.7, -1.8, -0.9]])
    b = make([[-1.0] * 4] * 2, [[-1.0] * 4] * 2, adv, [[1, 1, 1, 1], [1, 1, 1, 0]])
    total, cut = 0.0, []
    for (i, j), c in token_cov(logp, b).items():
        r, a = E(float(logp[i, j]) + 1.0), adv[i][j]
        pg1, pg2 = -a * r, -a * min(max(r, 0.8), 1.2)
        if not pg2 > pg1 and -5 < c < 5:
            cut.append((i, j))
        else:
            total += max(pg1, pg2)
    assert cut == [(0, 3), (1, 0)]
    obj = build_objective("clip_cov", clip_cov_ratio=0.5, clip_cov_lb=-5.0, clip_cov_ub=5.0)
    loss, _, m = run(obj, logp, b)
    assert loss == pytest.approx(total / 7, rel=1e-5)
    assert m["mask/frac"] == pytest.approx(2 / 7)


def test_clip_cov_draws_n_tokens_and_checkpoints_its_generator():
    # a wide window leaves many candidates: exactly max(⌊f·N⌋, 1) are cut; a fresh objective
    # loaded with the state draws the same tokens as the original's next draw
    logp, b = random_batch(B=8, T=10, spread=0.1)
    kw = dict(clip_cov_ratio=0.1, clip_cov_lb=-100.0, clip_cov_ub=100.0)
    obj = build_objective("clip_cov", **kw)
    n = b.mask.sum()
    assert run(obj, logp, b)[2]["mask/frac"] == pytest.approx(int(0.1 * n) / n)
    fresh = build_objective("clip_cov", seed=7, **kw)
    fresh.load_state_dict(obj.state_dict())
    torch.testing.assert_close(run(fresh, logp, b)[1], run(obj, logp, b)[1])


def test_kl_cov_by_hand():
    # A = [2, −2, 1, −1] (Ā = 0), log π = [−0.5, −1.6, −1.2, −0.7] (mean −1):
    # cov = [1.0, 1.2, −0.2, −0.3]; kl_cov_ratio 0.25 -> max(⌊0.25·4⌋, 1) = 1 token: token 1.
    # r = [1.5, e^0.3, 1, 1]; no clip at all (token 0, A > 0, r = 1.5, stays −A r = −3).
    # losses [−3, 2e^0.3 + 0.1·0.3, −1, 1], token mean; the |log r| term adds 0.1·sign(0.3)
    logp = [[-0.5, -1.6, -1.2, -0.7]]
    old = [[-0.5 - L(1.5), -1.9, -1.2, -0.7]]
    b = make(old, old, [[2, -2, 1, -1]])
    loss, grad, _ = run(build_objective("kl_cov", kl_cov_ratio=0.25), logp, b)
    assert loss == pytest.approx((-3 + 2 * E(0.3) + 0.03 - 1 + 1) / 4, rel=1e-5)
    torch.testing.assert_close(grad, t([[-0.75, (2 * E(0.3) + 0.1) / 4, -0.25, 0.25]]))
    # ratio 0.5: the top two (tokens 1 and 0); token 0 adds 0.1·|log 1.5| and 0.1 to its gradient
    loss2, grad2, _ = run(build_objective("kl_cov", kl_cov_ratio=0.5), logp, b)
    assert loss2 == pytest.approx(loss + 0.1 * L(1.5) / 4, rel=1e-5)
    assert grad2[0, 0].item() == pytest.approx(-0.75 + 0.1 / 4, rel=1e-5)


def test_kl_cov_skyrl_case():
    # SkyRL test_kl_cov_policy_loss data (frac 0.5, coef 1): the loop ranks the 7 response
    # tokens by covariance, takes the top ⌊0.5·7⌋ = 3 and adds |log r| there to −A r
    adv = [[1.5, -0.5, 2.0, 0.8], [0.5, 1.0, -1.5, 1.2]]
    logp = t([[-0.8, -1.2, -0.6, -1.1], [-1.1, -0.9, -1.4, -0.7]])
    b = make([[-1.0] * 4] * 2, [[-1.0] * 4] * 2, adv, [[1, 1, 1, 1], [1, 1, 1, 0]])
    cov = token_cov(logp, b)
    top = sorted(cov, key=cov.get, reverse=True)[:3]
    assert top == [(1, 2), (0, 2), (0, 0)]
    total = 0.0
    for i, j in cov:
        x = float(logp[i, j]) + 1.0
        total += -adv[i][j] * E(x) + (abs(x) if (i, j) in top else 0.0)
    obj = build_objective("kl_cov", kl_cov_ratio=0.5, ppo_kl_coef=1.0)
    assert run(obj, logp, b)[0] == pytest.approx(total / 7, rel=1e-5)


# --- the grid composes the peers' corrections --------------------------------------------------

PEER_GRID_POINTS = [
    ("rollout_rs", {}, dict(lo=0.8, hi=1.2, c=3.0, rejected_in_denominator=False,
                            corrections=[dict(kind="ratio", treatment="mask", lo=0.5)])),
    ("rollout_rs", dict(estimator="k3", level="max", threshold=0.5, rollout_is="sequence"),
     dict(lo=0.8, hi=1.2, c=3.0, rejected_in_denominator=False,
          corrections=[dict(kind="rs", level="max", threshold=0.5),
                       dict(kind="ratio", level="sequence", hi=2.0)])),
    ("opsm", dict(delta=0.05), dict(lo=0.8, hi=1.2, corrections=[dict(kind="opsm", delta=0.05)])),
    ("geo_mask", dict(metric="product", outlier_high=3.0),
     dict(lo=0.8, hi=1.2, corrections=[dict(kind="outlier", hi=3.0),
                                       dict(kind="ratio", level="sequence", treatment="mask",
                                            lo=0.5)])),
    ("dppo_kl", {}, dict(treatment="clamp", lo=0.0, hi=3.0,
                         corrections=[dict(kind="tv", ratio="trust", divergence="kl")])),
    ("trl_is", {}, dict(lo=0.8, hi=1.2, corrections=[dict(kind="ratio", level="sequence",
                                                          treatment="pop", hi=3.0)])),
]  # fmt: skip


@pytest.mark.parametrize("name, kw, grid_kw", PEER_GRID_POINTS)
def test_grid_rebuilds_the_peer_objectives(name, kw, grid_kw):
    logp, b = random_batch(spread=0.6)
    a, g, m = run(build_objective(name, **kw), logp, b)
    a2, g2, m2 = run(build_objective("grid", **grid_kw), logp, b)
    assert a == pytest.approx(a2, abs=1e-6), name
    torch.testing.assert_close(g, g2)
    assert m == m2
    assert 0 < m["mask/frac"] < 1 or m["is/weight_min"] < m["is/weight_max"], "nothing acted"


# --- defaults and metric names ---------------------------------------------------------------

PEER_DEFAULTS = {
    # verl: actor.yaml clip_ratio_low/high 0.2, clip_ratio_c 3, tau_pos/neg 1.0/1.05,
    # policy_loss clip_cov_ratio 2e-4, clip_cov_lb/ub 1/5, kl_cov_ratio 2e-4, ppo_kl_coef 0.1;
    # rollout_correction.yaml rollout_is null, rollout_is_threshold 2.0
    "rollout_rs": dict(eps_low=0.2, eps_high=0.2, c=3.0, rollout_is=None,
                       rollout_is_threshold=2.0, rejected_in_denominator=False),
    "sapo": dict(tau_pos=1.0, tau_neg=1.05, aggregation="seq-mean-token-mean"),
    "geo_mean": dict(eps_low=0.2, eps_high=0.2),
    "dppo_kl": dict(ratio="trust", delta_low=0.2, delta_high=0.2, c=3.0),
    "clip_cov": dict(clip_cov_ratio=2e-4, clip_cov_lb=1.0, clip_cov_ub=5.0, eps_low=0.2,
                     eps_high=0.2),
    "kl_cov": dict(kl_cov_ratio=2e-4, ppo_kl_coef=0.1),
    # TRL grpo_config.py: epsilon 0.2, epsilon_high None, delta None, loss_type dapo,
    # vllm_importance_sampling_mode sequence_mask, clip_max 3.0, clip_min None,
    # off_policy_mask_threshold None, vespo k/λ 2/3 and 3/2
    "trl_is": dict(mode="sequence_mask", clip_min=None, clip_max=3.0, eps_low=0.2, eps_high=0.2,
                   c=None, off_policy_mask_threshold=None, aggregation="token-mean"),
    "luspo": dict(eps_low=0.2, eps_high=0.2, c=None, aggregation="seq-mean-token-sum"),
    "vespo": dict(k_pos=2.0, lambda_pos=3.0, k_neg=3.0, lambda_neg=2.0, is_clip_max=3.0),
    # slime arguments.py: --opsm-delta 1e-4, --eps-clip 0.2, --eps-clip-high None (= --eps-clip),
    # --eps-clip-c None
    "opsm": dict(delta=1e-4, eps_low=0.2, eps_high=0.2, c=None),
    # SkyRL config.py: eps_clip_low/high 0.2, geo_mask 0.99/1.01 (via lo/hi None), outliers None
    "geo_mask": dict(eps_low=0.2, eps_high=0.2, outlier_low=None, outlier_high=None, tis=None),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(PEER_DEFAULTS))
def test_builder_defaults_are_the_peers(name):
    params = inspect.signature(OBJECTIVES[name]).parameters
    assert {k: params[k].default for k in PEER_DEFAULTS[name]} == PEER_DEFAULTS[name]


def test_verl_rejection_fraction_is_aliased_to_mask_frac():
    assert aliased({"mask/frac": 0.25})["rollout_corr/rollout_rs_masked_fraction"] == 0.25


@pytest.mark.parametrize("name", sorted(PEER_DEFAULTS))
def test_the_mechanism_check_reads_each_peer_objective(name):
    """harness.train's step-0 check asks the objective for its window: no peer declares a band
    (geo_mask's is a sequence mask), and the peers' clip is 1 ∓ 0.2 (DAPO's 0.2/0.28 where none)."""
    band, clip = build_objective(name).window()
    assert band == (0.5, 2.0) and clip in ((0.8, 1.2), (0.8, 1.28))
    if name in ("geo_mask", "opsm", "rollout_rs"):
        assert clip == (0.8, 1.2)
