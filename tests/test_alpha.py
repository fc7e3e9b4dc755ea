"""α controls: staleness, minibatch lags, controlled weight perturbation."""

from __future__ import annotations

import pytest
import torch

from harness.base.models import tiny_llama
from harness.rl.alpha import WeightHistory, minibatch_lags, minibatch_schedule, perturb_weights_


def test_perturb_weights_has_the_requested_relative_size():
    model = tiny_llama(0)[0]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    realised = perturb_weights_(model, rel_sigma=0.01, seed=3)
    assert realised == pytest.approx(0.01, rel=0.02)
    d2 = w2 = 0.0
    for k, v in model.state_dict().items():
        if v.dim() >= 2:
            d2 += (v - before[k]).pow(2).sum().item()
            w2 += before[k].pow(2).sum().item()
        else:  # norm gains untouched by default
            assert torch.equal(v, before[k])
    assert (d2 / w2) ** 0.5 == pytest.approx(realised, rel=1e-6)


def test_perturb_weights_is_seeded():
    a, b = tiny_llama(0)[0], tiny_llama(0)[0]
    perturb_weights_(a, 0.05, seed=1)
    perturb_weights_(b, 0.05, seed=1)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    with pytest.raises(ValueError, match="rel_sigma"):
        perturb_weights_(a, -1.0)


def test_weight_history_lags_by_staleness():
    model = tiny_llama(0)[0]
    p = model.lm_head.weight
    hist = WeightHistory(staleness=2)
    with pytest.raises(RuntimeError, match="empty"):
        hist.behaviour()
    for step in range(5):  # weights after optimizer step `step` are filled with `step`
        with torch.no_grad():
            p.fill_(step)
        hist.push(model)
        expected = max(0, step - 2)
        assert hist.behaviour()["lm_head.weight"][0, 0].item() == expected
        assert hist.lag() == min(step, 2)
    sampler = tiny_llama(1)[0]
    sampler.load_state_dict(hist.behaviour())
    assert sampler.lm_head.weight[0, 0].item() == 2
    assert len(hist) == 3
    assert WeightHistory(0).staleness == 0  # k = 0: on-policy sampler
    with pytest.raises(ValueError):
        WeightHistory(-1)


def test_minibatch_lags_and_schedule():
    assert minibatch_lags(1) == [0]
    assert minibatch_lags(4) == [0, 1, 2, 3]  # minibatch j trains j − 1 steps after sampling
    assert minibatch_lags(3, staleness=2) == [2, 3, 4]
    sched = minibatch_schedule(10, 3, seed=0)
    rows = torch.cat([r for r, _ in sched])
    assert sorted(rows.tolist()) == list(range(10))
    assert [lag for _, lag in sched] == [0, 1, 2]
    assert [len(r) for r, _ in sched] == [4, 3, 3]
    assert minibatch_schedule(4, 2)[0][0].tolist() == [0, 1]
    with pytest.raises(ValueError):
        minibatch_schedule(2, 3)
