import pytest
import torch

from harness.base.batch import (
    TokenBatch,
    log_ratio_folded,
    log_ratio_trust_region,
    log_rho,
    masked_mean,
)


def _batch(B=2, T=3, **kw):
    z = torch.zeros(B, T)
    fields = dict(tokens=z.long(), mask=torch.ones(B, T), logp_old=z, logp_mu=z, advantages=z)
    return TokenBatch(**{**fields, **kw})


def test_shapes_validated():
    with pytest.raises(ValueError, match="logp_mu has shape"):
        _batch(logp_mu=torch.zeros(2, 4))
    with pytest.raises(ValueError, match="logp_recompute has shape"):
        _batch(logp_recompute=torch.zeros(3))


def test_index_keeps_fields_aligned():
    b = _batch(B=4, logp_old=torch.arange(12.0).view(4, 3), p_t=torch.arange(12.0).view(4, 3))
    sub = b.index(torch.tensor([1, 3]))
    assert sub.logp_old[:, 0].tolist() == [3.0, 9.0]
    assert sub.p_t[:, 0].tolist() == [3.0, 9.0]
    assert sub.entropy is None


def test_with_old_fills_pi_old_from_the_trainer_or_from_mu():
    b = _batch(B=1, T=2, logp_mu=torch.tensor([[-1.0, -2.0]]), logp_old=None)
    sc = {"logp": torch.tensor([[-0.5, -0.25]]), "p_t": torch.zeros(1, 2)}
    sc |= {"entropy": torch.ones(1, 2), "p_sq_sum": torch.ones(1, 2)}
    t = b.with_old(sc, "trainer")
    assert torch.equal(t.logp_old, sc["logp"]) and torch.equal(t.logp_recompute, sc["logp"])
    s = b.with_old(sc, "sampler")
    assert torch.equal(s.logp_old, b.logp_mu) and torch.equal(s.logp_recompute, sc["logp"])
    assert torch.equal(s.entropy, sc["entropy"]) and b.logp_old is None


def test_ratios_by_hand():
    logp, logp_old, logp_mu = torch.tensor([-1.0]), torch.tensor([-1.5]), torch.tensor([-2.0])
    assert log_ratio_trust_region(logp, logp_old).item() == 0.5
    assert log_rho(logp_old, logp_mu).item() == 0.5
    assert log_ratio_folded(logp, logp_mu).item() == 1.0


def test_masked_mean_ignores_padding():
    x = torch.tensor([[1.0, 3.0, 100.0]])
    assert masked_mean(x, torch.tensor([[1.0, 1.0, 0.0]])).item() == 2.0
