"""Worked values for the rules of own_rule.py: `python -m pytest examples/own_rule` (from a copy
of this folder anywhere, with ratiolab installed)."""

import math

import own_rule  # noqa: F401  (registers own_clip, temperature_skew, plus_one)
import pytest
import torch
from torch import nn

from harness.base.batch import TokenBatch
from harness.base.registry import build
from harness.noise import build_noise
from harness.objectives import build_objective
from harness.tasks import TASKS, Problem


def test_own_clip_by_hand():
    """r = π_θ/μ of 0.25, 1 and 3 with A = −1, +1, +1 and [low, high] = [0.5, 2]:
    ℓ = max(−A·r, −A·clip(r)) = max(0.25, 0.5) = 0.5 (clipped), max(−1, −1) = −1, max(−3, −2) = −2
    (clipped); token-mean (0.5 − 1 − 2)/3 = −5/6. Only the middle token has a gradient:
    ∂ℓ/∂log π = −A·r = −1, over 3 tokens: −1/3."""
    logp_mu = torch.log(torch.tensor([[0.4, 0.2, 0.1]]))
    logp = (logp_mu + torch.log(torch.tensor([[0.25, 1.0, 3.0]]))).requires_grad_(True)
    batch = TokenBatch(
        tokens=torch.zeros(1, 3, dtype=torch.long),
        mask=torch.ones(1, 3),
        logp_old=logp_mu.clone(),
        logp_mu=logp_mu,
        advantages=torch.tensor([[-1.0, 1.0, 1.0]]),
    )
    out = build_objective("own_clip", low=0.5, high=2.0)(logp, batch)
    assert out.loss.item() == pytest.approx(-5 / 6)
    assert out.metrics["clip/frac"] == pytest.approx(2 / 3)
    out.loss.backward()
    assert logp.grad.tolist()[0] == pytest.approx([0.0, -1 / 3, 0.0])


def test_own_clip_declares_its_window_and_refuses_a_bad_one():
    assert build_objective("own_clip", low=0.7, high=1.5).window().clip == (0.7, 1.5)
    with pytest.raises(ValueError, match="low < 1 < high"):
        build_objective("own_clip", low=1.2, high=1.5)


class Head(nn.Module):
    """Logits [0, ln 2, ln 4] for any input: probabilities 1/7, 2/7, 4/7."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(1, 3, bias=False)
        self.head.weight.data = torch.tensor([[0.0], [math.log(2)], [math.log(4)]])

    def get_output_embeddings(self):
        return self.head

    def forward(self, x):
        return self.head(x)


def test_temperature_skew_by_hand():
    """skew = 1 doubles the logits: [0, 2 ln 2, 2 ln 4] → probabilities 1/21, 4/21, 16/21, so the
    third token's β = log((16/21)/(4/7)) = log(4/3); detaching restores the logits."""
    model, x = Head(), torch.ones(1, 1)
    clean = torch.log_softmax(model(x), -1)
    noise = build_noise("temperature_skew", skew=1.0)
    with noise.attached(model):
        noisy = torch.log_softmax(model(x), -1)
    assert noisy.exp().tolist()[0] == pytest.approx([1 / 21, 4 / 21, 16 / 21])
    assert (noisy - clean)[0, 2].item() == pytest.approx(math.log(4 / 3))
    assert torch.equal(torch.log_softmax(model(x), -1), clean)


def test_plus_one_by_hand():
    task = build(TASKS, "plus_one", "task", digits=3)
    problem = Problem("41+1=", "42", "41+1=42")
    assert task.reward(problem, "41+1=42") == 1.0
    assert task.reward(problem, "41+1=43") == 0.0
    assert task.reward(problem, "42") == 0.0  # no '=': no answer
    train, held_out = task.sample(20, "train", 0), task.sample(20, "eval", 0)
    for p in train + held_out:
        a = int(p.prompt.removesuffix("+1="))
        assert 100 <= a <= 999 and p.answer == str(a + 1)
    assert not {p.prompt for p in train} & {p.prompt for p in held_out}
