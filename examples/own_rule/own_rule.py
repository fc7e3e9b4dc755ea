"""A researcher's own rules for ratiolab, outside its package: one objective, one noise model and
one task, each registered under its own name. Name this file in `plugins=` and choose them as
`objective=own_clip`, `noise=temperature_skew`, `task=plus_one` (docs/own-hypothesis.md).

    python -m harness.train plugins=[own_rule.py] objective=own_clip objective.high=1.5
"""

from __future__ import annotations

import random

import torch
from torch import Tensor, nn

from harness.base.batch import TokenBatch
from harness.base.registry import register
from harness.noise import NOISE, NoiseModel
from harness.objectives import OBJECTIVES, Objective, ObjectiveOutput
from harness.objectives.core import Window, aggregator
from harness.tasks import TASKS
from harness.tasks.arithmetic import arithmetic_trace
from harness.tasks.base import Problem, ProceduralTask


@register(OBJECTIVES, "own_clip")
class OwnClip(Objective):
    """PPO's clip on the folded ratio r = π_θ/μ (the sampler's log-probs, so β is inside r):
    max(−A·r, −A·clip(r, low, high)). Its window keywords are `low`/`high`, not ratiolab's
    eps_low/eps_high or lo/hi: `window()` declares them, so the step-0 mechanism check measures
    π_old/μ against [low, high]."""

    aggregated = True  # it takes the aggregation group: aggregation=seq-mean-token-mean works

    def __init__(self, *, low: float = 0.5, high: float = 2.0, aggregation: str = "token-mean"):
        if not 0.0 <= low < 1.0 < high:
            raise ValueError(f"own_clip: need 0 <= low < 1 < high; got low={low}, high={high}")
        self.low, self.high = low, high
        self.aggregate = aggregator(aggregation, None)

    def window(self) -> Window:
        return Window(clip=(self.low, self.high))

    def __call__(self, logp: Tensor, batch: TokenBatch) -> ObjectiveOutput:
        mask, adv = batch.mask, batch.advantages
        ratio = torch.where(mask > 0, logp - batch.logp_mu, 0.0).exp()
        clipped = ratio.clamp(self.low, self.high)
        per_token = torch.maximum(-adv * ratio, -adv * clipped) * mask
        # where the clipped branch is the max, the token's gradient is zero
        bound = ((adv < 0) & (ratio < self.low)) | ((adv > 0) & (ratio > self.high))
        n = mask.sum().clamp_min(1.0)
        metrics = {"clip/frac": float((bound * mask).sum() / n)}
        return ObjectiveOutput(self.aggregate(per_token, mask), metrics)


@register(NOISE, "temperature_skew")
class TemperatureSkew(NoiseModel):
    """An engine that applies its temperature slightly off: the sampler's logits z ← (1 + skew)·z.
    Deterministic, so β = log softmax((1 + skew)z) − log softmax(z) is known for every token."""

    uses_context = False  # no noise field: nothing keyed by the token prefix

    def __init__(self, skew: float = 0.05):
        super().__init__()
        if not skew > -1.0:
            raise ValueError(f"temperature_skew: skew must be > -1; got {skew}")
        self.skew = float(skew)

    @property
    def row_local(self) -> bool:  # a row's logits depend on its own tokens only
        return True

    def _attach(self, model: nn.Module) -> None:
        self._hook(model.get_output_embeddings(), self._on_logits)

    def _on_logits(self, module: nn.Module, args: tuple, z: Tensor) -> Tensor:
        return z * (1.0 + self.skew)


class PlusOne(ProceduralTask):
    """`a+1=` with `digits`-digit a: the answer a + 1, in the arithmetic task model's format."""

    name = "plus_one"

    def __init__(self, digits: int = 2, eval_frac: float = 0.1):
        if digits < 1:
            raise ValueError(f"plus_one: digits must be >= 1; got {digits}")
        self.digits, self.eval_frac = digits, eval_frac
        self.max_new_tokens = 8 * digits + 8

    def draw(self, rng: random.Random) -> Problem:
        a = rng.randint(10 ** (self.digits - 1), 10**self.digits - 1)
        return Problem(f"{a}+1=", str(a + 1), arithmetic_trace(a, "+", 1))

    def reward(self, problem: Problem, response: str) -> float:
        """1 iff the text after the response's last '=' is the answer."""
        return float("=" in response and response.rsplit("=", 1)[1].strip() == problem.answer)


@register(TASKS, "plus_one")
def plus_one(*, digits: int = 2, eval_frac: float = 0.1) -> PlusOne:
    """`a+1=`: a successor task in the arithmetic format."""
    return PlusOne(digits, eval_frac)
