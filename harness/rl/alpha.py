"""α controls: policy movement between the weights that sampled (μ's weights) and the weights
that train (π_θ), kept separate from engine noise β (SNR post, Table 2: α from staleness and
from the minibatch index).

  staleness k   the sampler's weights lag the trainer's by k optimizer steps (`WeightHistory`)
  m minibatches one rollout batch trained as m minibatches: minibatch j (1-based) trains
                j − 1 steps after sampling (`minibatch_lags`, `minibatch_schedule`)
  perturbation  a controlled relative weight perturbation of known size (`perturb_weights_`)
"""

from __future__ import annotations

from collections import deque

import torch
from torch import Tensor, nn


@torch.no_grad()
def perturb_weights_(
    model: nn.Module, rel_sigma: float, seed: int = 0, include_1d: bool = False
) -> float:
    """W ← W + rel_sigma·(‖W‖_F/√n)·ξ per parameter tensor, ξ ~ N(0, I), in place.

    1-D parameters (norm gains, biases) are skipped unless `include_1d`. Returns the realised
    relative size sqrt(Σ‖ΔW‖²) / sqrt(Σ‖W‖²) over the perturbed tensors (≈ rel_sigma).
    """
    if rel_sigma < 0:
        raise ValueError(f"rel_sigma must be >= 0, got {rel_sigma}")
    g = torch.Generator().manual_seed(seed)
    d2 = w2 = 0.0
    for p in model.parameters():  # deduplicated: tied weights are perturbed once
        if not p.is_floating_point() or (p.dim() < 2 and not include_1d):
            continue
        w = p.detach().float().clone()  # .float() of an fp32 tensor is a view, not a copy
        rms = w.norm() / w.numel() ** 0.5
        new = w + rel_sigma * rms * torch.randn(w.shape, generator=g).to(w.device)
        p.copy_(new)
        d2 += (p.float() - w).pow(2).sum().item()  # realised after casting to p's dtype
        w2 += w.pow(2).sum().item()
    if w2 == 0.0:
        raise ValueError("perturb_weights_: no parameter tensor to perturb")
    return (d2 / w2) ** 0.5


class WeightHistory:
    """The last `staleness` + 1 weight versions: `push(model)` after every optimizer step;
    `behaviour()` is the version `staleness` steps old (the oldest kept while fewer exist), which
    the engine loads into the sampler for staleness-k off-policy sampling."""

    def __init__(self, staleness: int):
        if staleness < 0:
            raise ValueError(f"staleness must be >= 0, got {staleness}")
        self.staleness = staleness
        self._versions: deque[dict[str, Tensor]] = deque(maxlen=staleness + 1)

    def push(self, model: nn.Module) -> None:
        self._versions.append({k: v.detach().clone() for k, v in model.state_dict().items()})

    def __len__(self) -> int:
        return len(self._versions)

    def behaviour(self) -> dict[str, Tensor]:
        if not self._versions:
            raise RuntimeError("WeightHistory is empty: push(model) the initial weights first")
        return self._versions[0]

    def state_dict(self) -> dict:
        """Tensors and plain containers only (checkpoints load with weights_only=True)."""
        return {"staleness": self.staleness, "versions": list(self._versions)}

    def load_state_dict(self, state: dict) -> None:
        if state["staleness"] != self.staleness:
            raise ValueError(
                f"checkpoint weight history has staleness {state['staleness']}, the run has "
                f"alpha.staleness={self.staleness}"
            )
        self._versions = deque(state["versions"], maxlen=self.staleness + 1)

    def newest(self) -> dict[str, Tensor]:
        """The weights after the latest push (the last finite state the loop kept)."""
        return self._versions[-1]

    def lag(self) -> int:
        """How many optimizer steps the behaviour weights are behind the newest push."""
        return len(self._versions) - 1


def minibatch_lags(m: int, staleness: int = 0) -> list[int]:
    """Optimizer steps between sampling and training for each of m minibatches: minibatch j
    (1-based) trains j − 1 steps after sampling, on top of the sampler's staleness."""
    if m < 1:
        raise ValueError(f"need m >= 1 minibatches, got {m}")
    return [staleness + j for j in range(m)]


def minibatch_schedule(
    n_seqs: int, m: int, staleness: int = 0, seed: int | None = None
) -> list[tuple[Tensor, int]]:
    """Split n_seqs sequences into m minibatches (shuffled when `seed` is given):
    [(row indices, lag in optimizer steps)] in training order."""
    if not 1 <= m <= n_seqs:
        raise ValueError(f"need 1 <= m <= n_seqs, got m={m}, n_seqs={n_seqs}")
    order = torch.arange(n_seqs)
    if seed is not None:
        order = torch.randperm(n_seqs, generator=torch.Generator().manual_seed(seed))
    return list(zip(torch.tensor_split(order, m), minibatch_lags(m, staleness)))
