import math

import pytest
import torch

from harness.batch import (
    TokenBatch,
    identity_check,
    log_ratio_folded,
    log_ratio_train_inference,
    log_ratio_trust_region,
    masked_mean,
)


def _batch(B=2, T=3, **kw):
    z = torch.zeros(B, T)
    fields = dict(tokens=z.long(), mask=torch.ones(B, T), logp_old=z, logp_mu=z, advantages=z)
    return TokenBatch(**{**fields, **kw})


def test_shapes_validated():
    with pytest.raises(ValueError, match="logp_mu has shape"):
        _batch(logp_mu=torch.zeros(2, 4))
    with pytest.raises(ValueError, match="group_id must be"):
        _batch(group_id=torch.zeros(3))


def test_index_keeps_fields_aligned():
    b = _batch(B=4, logp_old=torch.arange(12.0).view(4, 3), group_id=torch.arange(4))
    sub = b.index(torch.tensor([1, 3]))
    assert sub.logp_old[:, 0].tolist() == [3.0, 9.0]
    assert sub.group_id.tolist() == [1, 3]
    assert sub.entropy is None


def test_ratios_by_hand():
    logp, logp_old, logp_mu = torch.tensor([-1.0]), torch.tensor([-1.5]), torch.tensor([-2.0])
    assert log_ratio_trust_region(logp, logp_old).item() == 0.5
    assert log_ratio_train_inference(logp_old, logp_mu).item() == 0.5
    assert log_ratio_folded(logp, logp_mu).item() == 1.0


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


def test_masked_mean_ignores_padding():
    x = torch.tensor([[1.0, 3.0, 100.0]])
    assert masked_mean(x, torch.tensor([[1.0, 1.0, 0.0]])).item() == 2.0
