"""The β-drift decomposition (harness.stats.drift) and its driver (harness.rl.drift): worked
numbers, the first-order theory against i.i.d. logit errors, and, on a tiny trained run with
Gaussian logit noise of known σ, the engine part recovering σ²/T² (the ground truth)."""

import math

import numpy as np
import pandas as pd
import pytest
import torch

from harness import train
from harness.rl import drift as driver
from harness.stats import drift
from harness.stats.diagnostics import dials, gate
from tests.test_train import _cfg


def test_gate_by_hand():
    # p = [0.5, 0.3, 0.2]: ‖p‖² = 0.38; y = token 0: 1 − 1 + 0.38; y = token 2: 1 − 0.4 + 0.38
    g = gate(torch.tensor([0.5, 0.2]), torch.tensor([0.38, 0.38]))
    assert g.tolist() == pytest.approx([0.38, 0.98])


def test_logit_error_by_hand():
    z = torch.zeros(1, 3)  # p uniform
    z_mu = torch.tensor([[0.3, 0.0, -0.3]])
    out = drift.logit_error(z_mu, z, torch.tensor([0]))
    mu = [math.exp(v) / (math.exp(0.3) + 1 + math.exp(-0.3)) for v in (0.3, 0.0, -0.3)]
    d = [math.log(m * 3) for m in mu]  # log μ_v − log (1/3)
    assert float(out["e2"]) == pytest.approx(sum(m * x * x for m, x in zip(mu, d)))
    assert float(out["gate_mu"]) == pytest.approx(1 - 2 / 3 + 1 / 3)
    assert float(out["delta_tf"]) == pytest.approx(d[0])


def test_the_expectations_against_sampling_and_the_first_order():
    """y ~ μ: the sampled mean of Δ² equals the mean of `e2` (exact, any size of error), and for
    i.i.d. ε ~ N(0, σ²) both equal σ² times the mean gate up to O(σ³)."""
    g = torch.Generator().manual_seed(0)
    n, v, sigma = 20000, 40, 0.05
    z = 2 * torch.randn(n, v, generator=g)
    z_mu = z + sigma * torch.randn(n, v, generator=g)
    y = torch.multinomial(z_mu.softmax(-1), 1, generator=g)[:, 0]
    out = drift.logit_error(z_mu, z, y)
    p = z.softmax(-1)
    g_y = gate(p.gather(1, y[:, None])[:, 0], (p * p).sum(-1))
    m2 = float((out["delta_tf"] ** 2).mean())
    assert m2 == pytest.approx(float(out["e2"].mean()), rel=0.04)
    assert m2 == pytest.approx(sigma**2 * float(g_y.mean()), rel=0.04)
    assert float(out["gate_mu"].mean()) == pytest.approx(float(g_y.mean()), rel=0.02)
    # σ = 1, far past the first order: `e2` is still the sampled mean's expectation
    z_big = z + torch.randn(n, v, generator=g)
    y_big = torch.multinomial(z_big.softmax(-1), 1, generator=g)[:, 0]
    big = drift.logit_error(z_big, z, y_big)
    assert float((big["delta_tf"] ** 2).mean()) == pytest.approx(float(big["e2"].mean()), rel=0.05)


def _sums(n, d2, gate, e2, gate_mu):
    z = np.zeros(len(n))
    cols = dict(n=n, d2=d2, gate=gate, e2=e2, gate_mu=gate_mu)
    return {k: np.asarray(v, float) for k, v in cols.items()} | dict(
        fork_n=z + 2, fork_d=z, fork_d2=np.asarray(d2, float)
    )


def test_growth_parts_by_hand():
    base = _sums([10, 20], [1.0, 3.0], [5.0, 10.0], [2.0, 4.0], [5.0, 10.0])
    # every token's engine error ×4 (Δ² and its expectation): the engine part alone, log 4
    cur = _sums([10, 20], [4.0, 12.0], [5.0, 10.0], [8.0, 16.0], [5.0, 10.0])
    out = drift.growth(base, cur)
    assert out["engine"] == pytest.approx(math.log(4))
    assert out["measured"] == pytest.approx(math.log(4))
    assert out["length"] == out["gate"] == out["residual"] == pytest.approx(0.0)
    # responses twice as long with the same per-token numbers: the length part alone, log 2
    longer = {k: 2 * v for k, v in base.items()}
    out = drift.growth(base, longer)
    assert out["length"] == pytest.approx(math.log(2)) == pytest.approx(out["measured"])
    # factors by hand: L̄ = 15, ḡ = 0.5, σ̄² = 6/15, ρ = (4/30) / (0.5 · 0.4)
    f = drift.factors(base)
    assert (f["length"], f["gate"], f["engine"]) == pytest.approx((15, 0.5, 0.4))
    assert f["residual"] == pytest.approx((4 / 30) / 0.2)


def test_parts_sum_to_the_measured_growth():
    rng = np.random.default_rng(0)

    def rand():
        return _sums(*(rng.uniform(1, 5, 30) for _ in range(5)))

    out = drift.growth(rand(), rand())
    assert sum(out[k] for k in drift.PARTS) == pytest.approx(out["measured"], abs=1e-12)


def test_fork_var_and_intervals():
    d = np.array([0.1, -0.3, 0.2, 0.4])
    sums = _sums([1, 1, 1, 1], d**2, [1] * 4, [1] * 4, [1] * 4)
    sums |= dict(fork_n=np.ones(4), fork_d=d, fork_d2=d**2)
    assert drift.fork_var(sums) == pytest.approx(float(np.var(d, ddof=1)))
    rng = np.random.default_rng(1)
    big = _sums(*(rng.uniform(1, 5, 40) for _ in range(5)))
    ci = drift.growth_intervals(big, big, n_boot=300)
    for k in (*drift.PARTS, "measured"):
        lo, hi = ci[k]
        assert lo < 0 < hi  # the same checkpoint against itself: no growth inside the interval


def test_stop_share_by_hand():
    # row 0 ends in EOS (id 2) with Δ = −3: μ stopped where π would not; row 1 ran out of
    # budget (its last token is not EOS); row 2 ends in the other EOS id (9) with Δ = 0.5.
    delta = torch.tensor([[-0.1, 0.2, -3.0], [0.5, 0.0, 0.0], [0.5, 0.0, 0.0]])
    resp = torch.tensor([[1.0, 1, 1], [1, 1, 0], [1, 0, 0]])
    ids = torch.tensor([[5, 6, 2], [7, 3, 0], [9, 0, 0]])
    mask = resp.clone()
    mask[0, 0] = 0  # a token the dials skip counts in neither sum
    out = drift.stop_share(delta, mask, resp, ids, torch.tensor([2, 9]))
    assert out["eos_frac"] == pytest.approx(2 / 3)
    # Σ Δ² over the mask: 0.04 + 9 + 0.25 + 0 + 0.25 = 9.54; at the two EOS tokens 9.25
    assert out["eos_d2_share"] == pytest.approx(9.25 / 9.54)
    assert out["eos_mean_delta"] == pytest.approx((-3.0 + 0.5) / 2)
    mask[2, 0] = 0  # an EOS the dials skip still ends its response, and counts in no sum
    skip = drift.stop_share(delta, mask, resp, ids, torch.tensor([2, 9]))
    assert skip["eos_frac"] == pytest.approx(2 / 3)
    assert skip["eos_d2_share"] == pytest.approx(9.0 / 9.29)
    assert skip["eos_mean_delta"] == pytest.approx(-3.0)
    none = drift.stop_share(delta, mask, resp, ids, torch.tensor([4]))  # an id no row ends in
    assert none["eos_frac"] == 0 and none["eos_d2_share"] == 0
    assert math.isnan(none["eos_mean_delta"])


def test_token_mult_prob_error_by_hand():
    # NeMo-RL's mean exp|log π − log μ| over response tokens
    x = torch.tensor([[0.1, -0.2, 5.0]])
    m = torch.tensor([[1.0, 1.0, 0.0]])
    got = dials(x, m)["token_mult_prob_error"]
    assert got == pytest.approx((math.exp(0.1) + math.exp(0.2)) / 2)


# tests.test_train's tiny config, with known logit noise and a checkpoint at every step
DRIFT_RUN = [
    "rollout.temperature=0.7",
    "noise=logit",
    "noise.sigma=0.15",
    "steps=2",
    "checkpoint_every=1",
    "optim.lr=1e-2",
]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """Two steps whose weights move: rewards alternate 0, 1 within each group (the untrained tiny
    model never answers, and all-zero rewards give no gradient)."""
    from harness.tasks import Task

    def reward(self, problems, ro, tokenizer):
        return (torch.arange(ro.response_ids.shape[0]) % 2).float()

    out = tmp_path_factory.mktemp("run")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Task, "rollout_rewards", reward)
        train.run(_cfg(out, *DRIFT_RUN))
    return out


def test_drift_recovers_the_injected_sigma(tiny_run):
    """Logit noise σ = 0.15 on raw logits is σ/T at the sampling temperature: the engine part
    must read σ²/T² at every checkpoint, the teacher-forced Δ must equal the decode's (the noise
    is keyed on prefixes), and the residual must sit near 1 (sampling error only)."""
    rows = driver.main([str(tiny_run), "--prompts", "8"])
    assert rows["step"].tolist() == [0, 1, 2]
    assert len(set(rows["weights_sha"])) == 3  # each checkpoint's own weights were measured
    # σ̄² is exact for the two forwards; σ²/T² its first order (here 1–5% below it)
    assert rows["engine"].to_numpy() == pytest.approx((0.15 / 0.7) ** 2, rel=0.06)
    assert rows["tf_abs_err"].max() < 1e-5
    assert rows["residual"].to_numpy() == pytest.approx(1.0, abs=0.35)
    seqs = pd.read_csv(tiny_run / "drift" / "seqs.csv")
    assert set(seqs["step"]) == {0, 1, 2}
    assert len(seqs) == 3 * 8 * 4


def test_drift_resumes_and_checks_its_input(tiny_run, tmp_path):
    out = tiny_run / "drift"
    before = (out / "drift.csv").read_text() if out.exists() else None
    if before is None:
        driver.main([str(tiny_run), "--prompts", "8"])
        before = (out / "drift.csv").read_text()
    driver.main([str(tiny_run), "--prompts", "8"])  # every step already there: nothing reruns
    assert (out / "drift.csv").read_text() == before
    with pytest.raises(ValueError, match="other prompts"):  # would mix two kinds of pass
        driver.main([str(tiny_run), "--prompts", "4"])
    assert (out / "drift.csv").read_text() == before
    with pytest.raises(ValueError, match="--checkpoints"):
        driver.main([str(tiny_run), "--checkpoints", str(tmp_path)])
    with pytest.raises(ValueError, match="engine.sampler=ct2"):
        driver.main([str(tiny_run), "--set", "engine.sampler=ct2"])
    with pytest.raises(FileNotFoundError, match="config.yaml"):
        driver.main([str(tmp_path)])


def test_drift_on_the_upcycled_moe_routing_noise_r3_r2(tiny_run, tmp_path):
    """The dense run's checkpoints measured as their upcycled MoE with router noise on μ: the
    teacher-forced forwards reproduce the decode (the noise re-selects the same routes), μ's
    routes differ from the trainer's; R3 removes the flips and shrinks the engine part; R2 at
    frozen weights replays what the trainer would choose anyway, so it equals no replay."""
    moe = ["model.upcycle={n_experts: 4, top_k: 2, expert_jitter: 0.3}", "noise=routing"]

    def rows(name, *sets):
        return driver.main(
            [str(tiny_run), "--prompts", "4", "--out", str(tmp_path / name), "--set", *moe, *sets]
        )

    plain = rows("plain", "noise.sigma=1.0")
    assert plain["step"].tolist() == [0, 1, 2] and len(set(plain["weights_sha"])) == 3
    assert plain["tf_abs_err"].max() < 1e-5
    assert (plain["route_flips"] > 0.05).all()
    r3 = rows("r3", "noise.sigma=1.0", "engine.routing_replay=true")
    assert (r3["route_flips"] == plain["route_flips"]).all()  # the same μ, the same trainer
    assert (r3["engine"] < 0.5 * plain["engine"]).all()
    r2 = rows("r2", "noise.sigma=1.0", "engine.routing_replay=true",
              "engine.routing_replay_source=trainer")  # fmt: skip
    for col in ("engine", "mean_abs_delta", "kl_k3", "gate"):
        assert r2[col].to_numpy() == pytest.approx(plain[col].to_numpy(), rel=1e-5, abs=1e-9)
    clean = rows("clean", "noise.sigma=0.0")  # no router noise: no flips, β at float rounding
    assert (clean["route_flips"] == 0).all() and clean["mean_abs_delta"].max() < 1e-4
    import shutil

    from analysis import beta_drift  # MoE series get a figure of their own, and parts rows

    shutil.rmtree(tmp_path / "clean")  # no β to decompose
    assert beta_drift.main(tmp_path) is None  # no dense series here
    assert (tmp_path / "fig_beta_drift_moe.png").exists()
    assert set(pd.read_csv(tmp_path / "parts.csv").series) == {"plain", "r3", "r2"}


def test_the_figure_and_parts_table(tiny_run):
    from analysis import beta_drift

    if not (tiny_run / "drift" / "seqs.csv").exists():
        driver.main([str(tiny_run), "--prompts", "8"])
    png = beta_drift.main(tiny_run)
    assert png.exists()
    parts = pd.read_csv(tiny_run / "parts.csv")
    assert parts["step"].tolist() == [1, 2]
    total = parts.named_sum + parts.residual
    assert total.to_numpy() == pytest.approx(parts.measured.to_numpy(), abs=1e-5)
    assert (parts.measured_lo <= parts.measured).all()
    assert (parts.measured <= parts.measured_hi).all()
