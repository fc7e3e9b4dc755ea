"""harness.stats.diagnostics: every dial by hand, and the streaming Table 7 agrees with it."""

import math

import numpy as np
import pytest
import torch

from harness.stats import diagnostics as D
from harness.stats.diagnostics import identity_check
from harness.stats.snr import DeltaStats

L = math.log


def test_dials_by_hand():
    # ρ = [3, 0.5] on one sequence, a third token masked out
    #   uncapped E[ρ] = 1.75; capped (C = 2) E[min(ρ, 2)] = 1.25
    #   k1 = E[−log ρ] = −log(1.5)/2 = −0.202733;  k3 = E[ρ − 1 − log ρ] = (0.901388 + 0.193147)/2
    #   χ² = E[(ρ − 1)²] = (4 + 0.25)/2 = 2.125;   ESS_token = 3.5² / (2 · 9.25) = 0.662162
    #   out of [0.5, 2]: only ρ = 3 (0.5 is on the band's edge) -> 0.5
    x = torch.tensor([[L(3), L(0.5), 7.0]])
    m = torch.tensor([[1.0, 1.0, 0.0]])
    d = D.dials(x, m, p_t=torch.tensor([[0.3, 0.9, 0.1]]))
    assert d["uncapped_mean_ratio"] == pytest.approx(1.75)
    assert d["capped_mean_ratio"] == pytest.approx(1.25)
    assert d["kl_k1"] == pytest.approx(-0.202733, abs=1e-6)
    assert d["kl_k3"] == pytest.approx(0.547268, abs=1e-6)
    assert d["chi2"] == pytest.approx(2.125)
    assert d["ess_token"] == pytest.approx(0.662162, abs=1e-6)
    assert d["out_of_band_frac"] == 0.5
    assert d["fork_oob_share"] == 1.0  # the one out-of-band token has p_t = 0.3 < 0.5
    assert d["mean_abs_delta"] == pytest.approx((L(3) + L(2)) / 2)
    assert d["ess_seq"] == 1.0  # one sequence


def test_ess_seq_uses_product_weights():
    # sequence weights Π ρ: [2·2, 1] = [4, 1]: ESS = 25 / (2 · 17) = 0.735294
    x = torch.tensor([[L(2), L(2)], [0.0, 0.0]])
    assert D.ess_seq(x, torch.ones(2, 2)) == pytest.approx(25 / 34)
    assert D.ess(torch.tensor([2.0, 1.0, 9.0]), torch.tensor([1.0, 1.0, 0.0])) == pytest.approx(0.9)
    assert math.isnan(D.ess_from_sums(0.0, 0.0, 0))


def test_bin_means_use_the_one_set_of_edges():
    p = torch.tensor([[0.05, 0.2, 0.25, 0.995, 1.0, 0.5]])
    v = torch.tensor([[1.0, 2.0, 4.0, 8.0, 16.0, 99.0]])
    m = torch.tensor([[1.0, 1, 1, 1, 1, 0]])
    out = D.bin_means(v, p, m, "entropy")
    assert out == {"entropy/bin_0-0.1": 1.0, "entropy/bin_0.1-0.3": 3.0, "entropy/bin_0.99-1": 12.0}


def test_streaming_table7_matches_the_tensor_dials():
    rng = np.random.default_rng(0)
    x = rng.normal(0, 0.7, (6, 40))
    conf = rng.uniform(0, 1, (6, 40))
    st = DeltaStats().add(x.ravel(), conf.ravel(), seq=np.repeat(np.arange(6), 40))
    streamed = st.dials()
    direct = D.dials(torch.tensor(x), torch.ones(6, 40))
    for k in (
        "uncapped_mean_ratio",
        "capped_mean_ratio",
        "kl_k1",
        "kl_k3",
        "chi2",
        "ess_token",
        "out_of_band_frac",
        "ess_seq",
    ):
        assert streamed[k] == pytest.approx(direct[k], rel=1e-9), k


def test_identity_check_by_hand():
    # ratios e^0, e^log2, e^log(0.5) and one masked token: mean (1 + 2 + 0.5) / 3 = 7/6
    lo = torch.tensor([[0.0, math.log(2.0), math.log(0.5), 5.0]])
    mu = torch.zeros(1, 4)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    c = identity_check(lo, mu, mask, tol=0.01)
    assert c.mean_ratio == pytest.approx(7 / 6)
    assert c.n_tokens == 3 and not c.ok and "> 1" in c.explain()
    c = identity_check(torch.log(torch.tensor([[0.5, 0.5]])), torch.zeros(1, 2), torch.ones(1, 2))
    assert not c.ok and "< 1" in c.explain() and "support" in c.explain()
    assert identity_check(mu, mu, mask).ok
