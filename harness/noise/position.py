"""`position`: logit noise whose scale grows along the sequence — long-context engine mismatch.

The law. At the token whose next-token logits sit at position p,

    z ← z + σ(p)·ε,    σ(p) = sigma · (1 + p / length)^power,    ε ~ N(0, 1) or Student-t(ν),

so σ(0) = sigma, σ(length) = 2^power·sigma, and the defaults (sigma 0.1, length 32, power 1)
grow linearly: a token 96 positions in is 4× noisier than the first. power = ½ is the √p shape
of independent per-token errors accumulating (a random walk); power = 0 is `logit` noise.

Why. Mismatch that grows with context is the shape of FP8 (and other low-precision) KV caches,
whose quantisation error enters every attended key and value, and of long-context kernel
differences; the SNR post ("Signal or Noise? An SNR Criterion for Trusting Your Importance
Ratio") names long sequences as where truncated importance sampling starts to break. This model
gives that β a known, controllable shape.

Which position. p is the absolute position: `position_ids` of the last context token, i.e. the
number of real tokens in the prefix (prompt + response so far) minus one; left pads count for
nothing. Absolute, not response-relative, because (1) long-context mismatch depends on how much
the attention reads, prompt included, and (2) the real-token count is a function of the prefix
alone, like the prefix hash that keys ε: the noise stays a function of (seed, prefix), the same
in prefill, KV-cache decode, full-recompute decode and the trainer's re-scoring, and unchanged by
left padding or by which other rows share the batch (`row_local`). The engine passes positions
in its forward contexts (harness/noise/context.py: `positions`); plain model calls get them from
their `position_ids`, `attention_mask` or cache length.

Same ε as `logit`. ε is LogitNoise's own draw (same seed and stream), so `position` and `logit`
at one seed share one noise field and differ only by the per-token scale σ(p)/sigma.

Sizes. To first order Δlog p_y = σ(p)(ε_y − Σ_j p_j ε_j): the gate law at each position,
Var(Δlog p_y) = σ(p)²(1 − 2p_y + ‖p‖²) (the SNR post's softmax gate, §2); at uniform logits
E|Δlog p_y| = √(2/π)·σ(p)·√(1 − 1/V). `drivers.beta_growth` scales `sigma`, hence σ(p) at every
position by the same factor (the shape along the sequence is kept).
"""

from __future__ import annotations

from torch import Tensor

from harness.noise.context import positions
from harness.noise.logit import LogitNoise


class PositionNoise(LogitNoise):
    """z ← z + σ(p)ε with σ(p) = sigma·(1 + p/length)^power, p the token's absolute position
    (real tokens only); ε as in LogitNoise (Gaussian, or Student-t with `nu`)."""

    what = "position noise"

    def __init__(
        self,
        sigma: float = 0.1,
        length: float = 32.0,
        power: float = 1.0,
        nu: float | None = None,
        seed: int = 0,
        deterministic: bool = True,
    ):
        super().__init__(sigma, nu, seed, deterministic)
        if not length > 0:
            raise ValueError(
                f"{self.what}: length must be > 0 (tokens over which σ grows by 2^power), "
                f"got {length}"
            )
        if not power >= 0:
            raise ValueError(
                f"{self.what}: power must be >= 0 (0: constant σ, 1: linear growth), got {power}"
            )
        self.length, self.power = float(length), float(power)

    def sigma_at(self, pos: Tensor) -> Tensor:
        """σ(p) = sigma·(1 + p/length)^power, float32, at integer positions `pos`."""
        return self.sigma * (1.0 + pos.float() / self.length).pow(self.power)

    def _scale(self, B: int, S: int) -> Tensor:
        pos = positions(S, self.what)
        if pos.shape != (B, S):
            raise RuntimeError(f"{self.what}: positions {tuple(pos.shape)} vs logits [{B}, {S}]")
        return self.sigma_at(pos)[..., None]
