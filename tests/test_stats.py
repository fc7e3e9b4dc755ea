"""The pre-registered tests against closed forms and hand-worked tables."""

import math

import numpy as np
import pytest

from analysis.stats import betainc, fisher_exact, paired_t, t_quantile, t_sf, tost


@pytest.mark.parametrize("t", [-3.0, -0.5, 0.0, 0.7, 2.0, 10.0])
def test_t_tails_match_the_closed_forms_for_one_and_two_degrees_of_freedom(t):
    assert t_sf(t, 1) == pytest.approx(0.5 - math.atan(t) / math.pi, abs=1e-12)  # Cauchy
    assert t_sf(t, 2) == pytest.approx(0.5 - t / (2 * math.sqrt(t * t + 2)), abs=1e-12)


def test_betainc_by_hand_and_the_tabled_t_quantiles():
    assert betainc(1, 1, 0.3) == pytest.approx(0.3)  # uniform
    assert betainc(2, 1, 0.5) == pytest.approx(0.25)  # x^2
    assert betainc(1, 3, 0.2) == pytest.approx(1 - 0.8**3)
    for df, t975 in [(4, 2.776), (5, 2.571), (9, 2.262), (30, 2.042)]:  # printed t tables
        assert t_quantile(0.975, df) == pytest.approx(t975, abs=1e-3)
        assert 2 * t_sf(t975, df) == pytest.approx(0.05, abs=2e-4)
    assert t_quantile(0.5, 7) == pytest.approx(0.0, abs=1e-6)


def test_paired_t_by_hand():
    """Differences 1, 2, 3: mean 2, sd 1, t = 2√3, df 2; P(T > t) = 1/2 − t/(2√(t² + 2))."""
    out = paired_t([3, 5, 7], [2, 3, 4])
    t = 2 * math.sqrt(3)
    assert out["diff"] == 2 and out["t"] == pytest.approx(t) and out["df"] == 2
    one = 0.5 - t / (2 * math.sqrt(t * t + 2))
    assert out["p_greater"] == pytest.approx(one) and out["p"] == pytest.approx(2 * one)
    half = t_quantile(0.975, 2) / math.sqrt(3)
    assert (out["ci_lo"], out["ci_hi"]) == pytest.approx((2 - half, 2 + half))
    assert paired_t([1, 2], [1, 2])["p"] == 1.0  # no difference, no spread
    with pytest.raises(ValueError, match="2 pairs"):
        paired_t([1], [0])


def test_tost_declares_equivalence_only_inside_the_margin():
    rng = np.random.default_rng(0)
    y = rng.normal(size=8)
    close = tost(y + rng.normal(0, 0.002, 8), y, margin=0.02)
    assert close["p"] < 0.05 and -0.02 < close["ci_lo"] < close["ci_hi"] < 0.02
    far = tost(y + 0.05 + rng.normal(0, 0.002, 8), y, margin=0.02)
    assert far["p"] > 0.5
    # the p of TOST is the larger one-sided p: by hand for differences 0.01, 0.02, 0.03
    d = np.array([0.01, 0.02, 0.03])
    by_hand = max(paired_t(d + 0.02, 0 * d)["p_greater"], paired_t(d - 0.02, 0 * d)["p_less"])
    assert tost(d, 0 * d, 0.02)["p"] == pytest.approx(by_hand)


def test_fisher_exact_by_hand():
    """Lady tasting tea: [[3, 1], [1, 3]]: P(a = 3) = 16/70, P(a = 4) = 1/70, two-sided 34/70;
    [[4, 0], [0, 4]]: one-sided 1/70, two-sided 2/70; [[5, 0], [0, 5]] one-sided 1/252."""
    tea = fisher_exact(3, 1, 1, 3)
    assert tea["p_greater"] == pytest.approx(17 / 70) and tea["p"] == pytest.approx(34 / 70)
    assert fisher_exact(4, 0, 0, 4)["p"] == pytest.approx(2 / 70)
    five = fisher_exact(5, 0, 0, 5)
    assert five["p_greater"] == pytest.approx(1 / 252) and five["p_less"] == pytest.approx(1.0)
    assert fisher_exact(0, 5, 0, 5)["p"] == pytest.approx(1.0)  # no events anywhere


def test_holm_and_benjamini_hochberg_by_hand():
    """p = 0.01, 0.04, 0.03, 0.005 (m = 4). Holm, ascending 0.005, 0.01, 0.03, 0.04: ×4, ×3, ×2,
    ×1 → 0.02, 0.03, 0.06, 0.04 → monotone 0.02, 0.03, 0.06, 0.06. BH: ×4/1, ×4/2, ×4/3, ×4/4 →
    0.02, 0.02, 0.04, 0.04 (already monotone from the top)."""
    from analysis.stats import benjamini_hochberg, holm

    p = [0.01, 0.04, 0.03, 0.005]
    assert holm(p) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert benjamini_hochberg(p) == pytest.approx([0.02, 0.04, 0.04, 0.02])
    assert np.isnan(holm([0.01, np.nan])[1]) and holm([0.01, np.nan])[0] == pytest.approx(0.01)
    assert holm([0.6, 0.7]) == pytest.approx([1.0, 1.0])  # capped at 1


def test_mde_and_seeds_needed_by_hand():
    """n = 5, sd 1: (t_.975,4 + t_.8,4)/√5 = (2.776 + 0.941)/2.236 = 1.662; at n = 10 the
    effect mde(10) needs exactly 10 pairs; Fisher: 4/5 vs 0/5 is the first p < 0.05
    (p = C(5,4)/C(10,4) = 5/210 = 0.0238; 3/5 vs 0/5 gives 10/120 = 1/12)."""
    from analysis.stats import fisher_min_events, mde_paired, pairs_for

    assert mde_paired(1.0, 5) == pytest.approx((2.776 + 0.941) / math.sqrt(5), abs=2e-3)
    assert mde_paired(2.0, 5) == pytest.approx(2 * mde_paired(1.0, 5))
    assert pairs_for(mde_paired(1.0, 10), 1.0) == 10
    assert pairs_for(mde_paired(1.0, 10) + 1e-9, 1.0) == 10
    assert pairs_for(mde_paired(1.0, 10) - 1e-9, 1.0) == 11
    assert fisher_exact(4, 1, 0, 5)["p_greater"] == pytest.approx(5 / 210)
    assert fisher_min_events(5, 5) == 4
    assert fisher_exact(3, 2, 0, 5)["p_greater"] == pytest.approx(1 / 12)
    assert fisher_min_events(2, 2) is None  # 2/2 vs 0/2: p = 1/6


def _brute_sign_p(n_plus: int, n_minus: int) -> tuple[float, float]:
    """(p_greater, p_less) of the sign test by listing every one of the 2^n ways the n discordant
    pairs can fall (+ or −), each equally likely under H0."""
    import itertools

    n = n_plus + n_minus
    ups = [sum(signs) for signs in itertools.product((0, 1), repeat=n)]
    return np.mean([u >= n_plus for u in ups]), np.mean([u <= n_plus for u in ups])


@pytest.mark.parametrize("n_plus, n_minus", [(5, 0), (4, 0), (4, 1), (3, 3), (0, 2), (7, 2)])
def test_sign_test_matches_the_enumeration_of_every_sign_assignment(n_plus, n_minus):
    from analysis.stats import sign_test

    greater, less = _brute_sign_p(n_plus, n_minus)
    out = sign_test(n_plus, n_minus)
    assert out["p_greater"] == pytest.approx(greater) and out["p_less"] == pytest.approx(less)
    assert out["p"] == pytest.approx(min(1.0, 2 * min(greater, less)))


def test_sign_test_by_hand():
    """5 discordant pairs all one way: one-sided 1/32 = 0.031 (the clip confirm's stall), two-
    sided 1/16; 4 all one way: 1/16 = 0.0625 (no 4-pair test reaches 0.05); 4+/1−: 6/32; none
    discordant: 1."""
    from analysis.stats import sign_test

    assert sign_test(5, 0)["p_greater"] == 1 / 32 and sign_test(5, 0)["p"] == 1 / 16
    assert sign_test(4, 0)["p_greater"] == 1 / 16 and sign_test(0, 4)["p_less"] == 1 / 16
    assert sign_test(4, 1)["p_greater"] == 6 / 32
    assert sign_test(0, 0)["p"] == sign_test(0, 0)["p_greater"] == 1.0
    with pytest.raises(ValueError, match="n_plus=-1"):
        sign_test(-1, 2)


@pytest.mark.parametrize(
    "d", [[0.3, 0.1, 0.2, 0.4], [1.0, -2.0, 3.0, 0.5, -0.25], [0.0, 1.0, 1.0, -1.0], [2.0, 2.0]]
)
def test_sign_flip_matches_the_enumeration_of_every_sign_assignment(d):
    import itertools

    from analysis.stats import sign_flip

    obs = sum(d)
    sums = [
        sum(s * abs(x) for s, x in zip(signs, d))
        for signs in itertools.product((1, -1), repeat=len(d))
    ]
    out = sign_flip(d)
    assert out["p_greater"] == pytest.approx(np.mean([s >= obs - 1e-12 for s in sums]))
    assert out["p_less"] == pytest.approx(np.mean([s <= obs + 1e-12 for s in sums]))
    assert out["p"] == pytest.approx(np.mean([abs(s) >= abs(obs) - 1e-12 for s in sums]))


def test_sign_flip_by_hand():
    """d = 1, 2, 3 (sum 6): only + + + reaches 6 → p_greater 1/8, two-sided 2/8 (− − − too);
    d = 1, 2, −3 (sum 0): every |sum| ≥ 0 → p 1; the sums ≥ 0 are 6, 4, 2, 0, 0 of the 8 → 5/8.
    d = 1.5, −0.5, 1.5, −0.5 (sum 2): only the 4 sums with both 1.5 positive reach 2 → 4/16."""
    from analysis.stats import sign_flip

    assert sign_flip([1, 2, 3])["p_greater"] == 1 / 8 and sign_flip([1, 2, 3])["p"] == 2 / 8
    assert sign_flip([1, 2, -3])["p"] == 1.0 and sign_flip([1, 2, -3])["p_greater"] == 5 / 8
    assert sign_flip([1.5, -0.5, 1.5, -0.5])["p_greater"] == 4 / 16
    with pytest.raises(ValueError, match="valid: 1 to 20"):
        sign_flip(np.ones(21))


def test_exact_power_by_hand():
    """Fisher 6 vs 6 with no control event: p < 0.05 needs ≥ 4 events (4/6 vs 0/6: C(6,4)/C(12,4)
    = 15/495), so at q_t = 0.9 power = P(Bin(6, 0.9) ≥ 4) = 0.9842. The sign test over 6 pairs
    (q_c = 0) needs ≥ 5 of 5+ discordant, i.e. P(Bin(6, 0.9) ≥ 5) = 0.8857; over 4 pairs it can
    never reach 0.05 (1/16): power 0; certain events give power 1 once 2^-n < α."""
    from analysis.stats import power_fisher, power_sign

    assert fisher_exact(4, 2, 0, 6)["p_greater"] == pytest.approx(15 / 495)
    assert power_fisher(6, 0.9, 0.0) == pytest.approx(
        sum(math.comb(6, k) * 0.9**k * 0.1 ** (6 - k) for k in (4, 5, 6))
    )
    assert power_sign(6, 0.9, 0.0) == pytest.approx(0.9**6 + 6 * 0.9**5 * 0.1)
    assert power_sign(4, 1.0, 0.0) == 0.0 and power_sign(5, 1.0, 0.0) == pytest.approx(1.0)
