"""harness.stats.snr: streaming moments / quantiles and the SNR split, against exact numpy
answers."""

import numpy as np
import pytest

from harness.base.batch import TokenBatch
from harness.objectives import build_objective
from harness.stats.diagnostics import bin_index
from harness.stats.snr import (
    TABLE6_COLUMNS,
    BinnedMoments,
    DeltaStats,
    SeqBootstrap,
    SNRSplit,
    shrink_kwargs,
    snr_split,
)

EDGES = (0.0, 0.1, 0.3, 0.5, 0.7, 0.9, 0.99, 1.0)


def synthetic(rng, var_beta, var_alpha, n_per_bin, live: bool):
    """Per bin b: conf uniform in the bin, Δ = β (+ α when live), independent Gaussians."""
    conf, delta = [], []
    for b, (vb, va) in enumerate(zip(var_beta, var_alpha)):
        conf.append(rng.uniform(EDGES[b], EDGES[b + 1], n_per_bin))
        d = rng.normal(0, np.sqrt(vb), n_per_bin)
        delta.append(d + rng.normal(0, np.sqrt(va), n_per_bin) if live else d)
    return np.concatenate(delta), np.concatenate(conf)


def test_snr_split_recovers_known_snr_within_10pct():
    """Acceptance: known per-bin Var_α, Var_β, 1e5 tokens per bin → SNR within 10%."""
    rng = np.random.default_rng(0)
    var_beta = np.array([0.3, 0.1, 0.05, 0.02, 5e-3, 1e-3, 1e-6])  # fork → confident, ~1e5×
    snr = np.array([0.25, 0.5, 1.0, 2.0, 4.0, 3.8, 12.0])  # the post's 3.8 and 12
    n = 100_000
    dc, cc = synthetic(rng, var_beta, 0 * snr, n, live=False)
    dl, cl = synthetic(rng, var_beta, snr * var_beta, n, live=True)
    df = snr_split(dc, cc, dl, cl, edges=EDGES)
    assert list(df.columns) == TABLE6_COLUMNS
    assert (df.n_cal == n).all() and (df.n_live == n).all()
    np.testing.assert_allclose(df.snr, snr, rtol=0.10)
    np.testing.assert_allclose(df.lam, snr / (1 + snr), rtol=0.03)
    np.testing.assert_allclose(df.var_beta, var_beta, rtol=0.02)


def test_snr_split_clamps_negative_var_alpha_and_handles_empty_bins():
    rng = np.random.default_rng(1)
    dc, dl = rng.normal(0, 1, 1000), rng.normal(0, 0.5, 1000)  # Var_r < Var_β: α := 0
    df = snr_split(dc, np.full(1000, 0.05), dl, np.full(1000, 0.05), edges=EDGES)
    assert df.var_alpha[0] == 0 and df.snr[0] == 0 and df.lam[0] == 0
    assert df.n_cal[1:].sum() == 0 and df.var_beta[1:].isna().all()


def test_bins_are_the_same_for_numpy_and_torch_and_snr_shrink():
    """p_t = 1 goes to the last bin; edges are [lo, hi); the streaming job (numpy), the loop and
    SNRShrink.bounds (torch) bin alike."""
    import torch

    p = np.array([0.0, 0.0999, 0.1, 0.3, 0.98999, 0.99, 1.0])
    assert bin_index(p, EDGES).tolist() == [0, 0, 1, 2, 5, 6, 6]
    tp = torch.tensor(p, dtype=torch.float32)
    np.testing.assert_array_equal(bin_index(tp, EDGES).numpy(), bin_index(p, EDGES))
    obj = build_objective("snr_shrink", edges=EDGES, lam=list(range(7)))
    z, lp = torch.zeros(1, 7), tp.log()[None]
    batch = TokenBatch(z.long(), torch.ones(1, 7), lp, lp, z, p_t=tp[None])
    assert obj.bounds(batch)[0][0].tolist() == [0, 0, 1, 2, 5, 6, 6]  # lam = bin index


def test_binned_moments_match_numpy_and_chunking():
    rng = np.random.default_rng(2)
    b = rng.integers(0, 3, 50_000)
    X = np.stack([rng.normal(5, 2, 50_000), rng.normal(-1, 0.1, 50_000)], 1)
    X[:, 1] += 0.3 * X[:, 0]
    one, many = BinnedMoments(3, 2), BinnedMoments(3, 2)
    one.add(b, X)
    for s in range(0, 50_000, 7_001):
        many.add(b[s : s + 7_001], X[s : s + 7_001])
    for k in range(3):
        ref = np.cov(X[b == k].T)
        for m in (one, many):
            np.testing.assert_allclose(m.var(0)[k], ref[0, 0], rtol=1e-10)
            np.testing.assert_allclose(m.cov(0, 1)[k], ref[0, 1], rtol=1e-10)
            np.testing.assert_allclose(m.corr(0, 1)[k], np.corrcoef(X[b == k].T)[0, 1], rtol=1e-9)
    pooled = one.pooled()
    np.testing.assert_allclose(pooled.var(1)[0], X[:, 1].var(ddof=1), rtol=1e-10)


def test_streaming_quantiles_within_1pct_of_exact():
    """Acceptance: |Δ| spans 8 decades (log-normal, random sign); quantiles within 1% relative."""
    rng = np.random.default_rng(3)
    n = 300_000
    a = np.exp(rng.normal(np.log(1e-3), 3.0, n))
    d = a * rng.choice([-1.0, 1.0], n)
    conf = rng.uniform(0, 1, n)
    st = DeltaStats(EDGES)
    for s in range(0, n, 40_000):  # streamed in chunks
        st.add(d[s : s + 40_000], conf[s : s + 40_000])
    qs = [0.001, 0.01, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 0.999]
    np.testing.assert_allclose(st.quantile(qs, absolute=True), np.quantile(a, qs), rtol=0.01)
    sq = [0.005, 0.05, 0.3, 0.7, 0.95, 0.995]
    np.testing.assert_allclose(st.quantile(sq), np.quantile(d, sq), rtol=0.01)
    b = bin_index(conf, EDGES)
    for k in (0, 3, 6):
        np.testing.assert_allclose(st.quantile(sq, b=k), np.quantile(d[b == k], sq), rtol=0.01)


def test_anatomy_and_dials_match_brute_force():
    rng = np.random.default_rng(4)
    n = 200_000
    conf = rng.beta(0.5, 0.3, n)
    d = rng.standard_t(3, n) * 0.3 * (1 - conf) ** 2
    d[rng.random(n) < 0.2] = 0.0  # exact matches
    q = np.clip(conf * np.exp(rng.normal(0, 0.1, n)), 1e-9, 1)
    seq = np.repeat(np.arange(n // 50), 50)
    st = DeltaStats(EDGES).add(d, conf, q=q, seq=seq)
    a = np.abs(d)
    an, di = st.anatomy(), st.dials()
    srt = np.sort(a)[::-1]
    assert an["n_tokens"] == n and an["max"] == a.max()
    assert an["mean"] == pytest.approx(a.mean(), rel=1e-9)
    assert an["frac_below_0.0001"] == pytest.approx((a < 1e-4).mean(), abs=2e-4)
    assert an["top1_share"] == pytest.approx(srt[: n // 100].sum() / a.sum(), rel=0.01)
    assert an["top10_share"] == pytest.approx(srt[: n // 10].sum() / a.sum(), rel=0.01)
    assert an["corr_conf_abs"] == pytest.approx(np.corrcoef(conf, a)[0, 1], rel=1e-6)
    assert an["low_conf_token_share(p<0.3)"] == pytest.approx((conf < 0.3).mean())
    assert an["low_conf_mass_share(p<0.3)"] == pytest.approx(a[conf < 0.3].sum() / a.sum())
    fork = q < np.quantile(q, 0.2)
    assert an["fork_mass_share"] == pytest.approx(a[fork].sum() / a.sum(), rel=0.02)
    out = (d < np.log(0.5)) | (d > np.log(2.0))
    assert an["band_fork_share[0.5,2]"] == pytest.approx(fork[out].mean(), rel=0.02)
    r = np.exp(d)
    assert di["uncapped_mean_ratio"] == pytest.approx(r.mean(), rel=1e-9)
    assert di["capped_mean_ratio"] == pytest.approx(np.minimum(r, 2).mean(), rel=1e-9)
    assert di["ess_token"] == pytest.approx(r.sum() ** 2 / (n * (r * r).sum()), rel=1e-9)
    assert di["out_of_band_frac"] == pytest.approx(out.mean())
    assert di["mean_abs_delta_nonmatching"] == pytest.approx(a[a > 1e-6].mean(), rel=1e-9)
    w = np.exp(d.reshape(-1, 50).sum(1))
    assert di["ess_seq"] == pytest.approx(w.sum() ** 2 / (len(w) * (w * w).sum()), rel=1e-9)


def ess(w):
    return w.sum() ** 2 / (len(w) * (w * w).sum())


def test_three_job_bounds():
    """Noise-bound bin, signal-bound bin, and an ESS-binding bin, each checked by brute force."""
    rng = np.random.default_rng(5)
    n = 100_000
    edges = (0.0, 0.3, 0.6, 1.0)
    conf = np.repeat([0.1, 0.5, 0.9], n)
    sd_beta = np.repeat([0.3, 0.01, 0.3], n)
    sd_alpha = np.repeat([0.0, 0.1, 0.0], n)
    dc = rng.normal(0, sd_beta)
    dl = rng.normal(0, sd_beta) + rng.normal(0, sd_alpha)
    dl[2 * n :] = rng.standard_t(1.5, n) * 0.5  # heavy live tail in the last bin
    sp = SNRSplit(edges).add_cal(dc, conf).add_live(dl, conf)
    t = sp.bounds(noise_q=0.995, signal_k=2.0, ess_floor=0.9, ess_on="r")
    # bin 0: no α → noise-bound at the β quantiles
    assert t.upper_set_by[0] == "noise"
    assert t.upper[0] == pytest.approx(np.exp(np.quantile(dc[:n], 0.995)), rel=0.01)
    assert t.lower[0] == pytest.approx(np.exp(np.quantile(dc[:n], 0.005)), rel=0.01)
    # bin 1: σ_α = 0.1 ≫ σ_β = 0.01 → signal-bound at e^{±2σ_α}
    assert t.upper_set_by[1] == "signal"
    assert t.upper[1] == pytest.approx(np.exp(0.2), rel=0.01)
    assert t.lower[1] == pytest.approx(np.exp(-0.2), rel=0.01)
    # bin 2: the ESS floor binds; at u_ESS the clamped weights pass, 10% above they fail
    assert t.ess_binding[2] and t.upper_set_by[2] == "ess"
    r = np.exp(np.clip(dl[2 * n :], -50, 50))
    k = t.u_ess[2]
    assert t.l_ess[2] == pytest.approx(1 / k)
    assert ess(np.clip(r, 1 / k, k)) >= 0.9 - 0.005  # histogram vs exact weights
    assert ess(np.clip(r, 1 / (1.1 * k), 1.1 * k)) < 0.9
    assert t.upper[2] == k < max(t.u_noise[2], t.u_signal[2])


def test_shrink_kwargs_feed_snr_shrink():
    rng = np.random.default_rng(6)
    conf = rng.uniform(0, 0.9, 20_000)  # the top two bins stay empty → filled
    sp = SNRSplit(EDGES).add_cal(rng.normal(0, 0.1, 20_000), conf)
    sp.add_live(rng.normal(0, 0.2, 20_000), conf)
    kw = shrink_kwargs(sp.table(), sp.bounds())
    assert kw["edges"] == list(EDGES)
    assert kw["lam"][-1] == 0.0 and kw["lower"][-1] == 0.5 and kw["upper"][-1] == 2.0
    assert 0.6 < kw["lam"][0] < 0.9 and kw["lower"][0] < 1 < kw["upper"][0]
    obj = build_objective("snr_shrink", **kw)
    assert obj.lam.shape == (7,)


def test_logit_displacement_per_bin_by_hand():
    """CIS's ε = logit p − logit q per confidence bin, from (Δ = log p − log q, p, q)."""
    p = np.array([0.05, 0.2, 0.6, 0.95, 0.97])
    q = np.array([0.1, 0.1, 0.5, 0.9, 0.99])
    d = np.log(p) - np.log(q)
    st = DeltaStats(edges=[0.0, 0.5, 1.0]).add(d, p, q=q)
    logit = lambda x: np.log(x / (1 - x))  # noqa: E731
    eps = np.abs(logit(p) - logit(q))
    got = st.per_bin().mean_abs_logit_disp.to_numpy()
    assert got == pytest.approx([eps[:2].mean(), eps[2:].mean()], rel=1e-12)
    assert np.isnan(DeltaStats(edges=[0.0, 1.0]).add(d, p).per_bin().mean_abs_logit_disp[0])
    med = st.per_bin().abs_delta_p50.to_numpy()  # numpy's median of |Δ| per bin, within 1%
    assert med == pytest.approx([np.median(np.abs(d[:2])), np.median(np.abs(d[2:]))], rel=0.01)


def test_sequence_bootstrap_matches_the_analytic_standard_error():
    """Independent Gaussian tokens (one per sequence): the bootstrap spread of the sample
    variance equals the analytic SE σ²·√(2/(n − 1)) within 15%."""
    rng = np.random.default_rng(3)
    n = 4000
    x = rng.normal(0, 1.5, n)
    boot = SeqBootstrap(1, B=400, seed=0)
    boot.add(np.zeros(n, dtype=np.int64), x, np.arange(n))
    se = 1.5**2 * np.sqrt(2 / (n - 1))
    assert boot.var()[:, 0].std() == pytest.approx(se, rel=0.15)
    assert boot.var()[:, 0].mean() == pytest.approx(x.var(ddof=1), rel=0.01)


def test_snr_intervals_cover_the_truth_at_about_their_level():
    """Ground truth the test controls: per-bin Var_α, Var_β; tokens in sequences of 8 that share
    a per-sequence offset (correlated tokens, as real responses). Over 60 repetitions the 95%
    intervals of Var_β and SNR cover the true values ≥ 85% of the time; an interval that
    ignored the sequences (each token its own) would be too narrow and cover less."""
    var_beta = np.array([0.2, 0.05, 0.01])
    var_alpha = np.array([0.1, 0.05, 0.03])
    edges = [0.0, 0.3, 0.7, 1.0]
    L, n_seq = 8, 60  # per bin

    def draw(rng, live):
        conf, delta, seq = [], [], []
        for b, (vb, va) in enumerate(zip(var_beta, var_alpha)):
            v = vb + (va if live else 0.0)
            shared = rng.normal(0, np.sqrt(v / 2), n_seq).repeat(L)  # half the variance per seq
            delta.append(shared + rng.normal(0, np.sqrt(v / 2), n_seq * L))
            conf.append(rng.uniform(edges[b], edges[b + 1], n_seq * L))
            seq.append(b * n_seq + np.arange(n_seq).repeat(L))
        return np.concatenate(delta), np.concatenate(conf), np.concatenate(seq)

    hits = {"var_beta": [], "snr": [], "naive": []}
    for rep in range(60):
        rng = np.random.default_rng(100 + rep)
        split = SNRSplit(edges)
        (dc, cc, sc), (dl, cl, sl) = draw(rng, False), draw(rng, True)
        split.add_cal(dc, cc, seq=sc).add_live(dl, cl, seq=sl)
        t = split.table()
        hits["var_beta"] += list((t.var_beta_lo <= var_beta) & (var_beta <= t.var_beta_hi))
        snr = var_alpha / var_beta
        hits["snr"] += list((t.snr_lo <= snr) & (snr <= t.snr_hi))
        naive = SNRSplit(edges)
        naive.add_cal(dc, cc, seq=np.arange(len(dc))).add_live(dl, cl, seq=np.arange(len(dl)))
        tn = naive.table()
        hits["naive"] += list((tn.var_beta_lo <= var_beta) & (var_beta <= tn.var_beta_hi))
    cover = {k: float(np.mean(v)) for k, v in hits.items()}
    assert cover["var_beta"] >= 0.85 and cover["snr"] >= 0.85, cover
    assert cover["naive"] < cover["var_beta"] - 0.05, cover  # per-token resampling undercovers


def test_split_without_sequence_ids_has_no_intervals():
    rng = np.random.default_rng(0)
    split = SNRSplit(EDGES).add_cal(rng.normal(size=100), np.full(100, 0.05))
    assert list(split.table().columns) == TABLE6_COLUMNS
