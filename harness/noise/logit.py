"""`logit`: additive noise on the final logits, Gaussian or heavy-tailed Student-t.

To first order Δlog p_y = ε_y − Σ_j p_j ε_j, so Var(Δlog p_y) = σ²(1 − 2p_y + ‖p‖²) — the gate
law (the SNR post's softmax gate, §2): confident tokens are almost immune.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from harness.noise.base import NoiseModel
from harness.noise.context import current, hashed_normal, hashed_student_t, mix64, mix_int

_LOGIT_STREAM = 1_000_003


def logit_eps(hash_T: Tensor, V: int, seed: int, nu: float | None = None) -> Tensor:
    """ε [T, V] of deterministic logit noise: N(0, 1), or Student-t(ν) with `nu`, as a function of
    (seed, prefix hash) alone, so whoever knows the seed and the tokens recomputes it (the HF
    sampler's hook and the vLLM logits processor of harness.integrations share it)."""
    key = mix64(hash_T ^ mix_int(seed, _LOGIT_STREAM))
    return hashed_normal(key, V) if nu is None else hashed_student_t(key, V, nu)


class LogitNoise(NoiseModel):
    """z ← z + σε, ε ~ N(0, 1) or, with `nu`, Student-t(ν) (scale σ; std σ√(ν/(ν−2)) for ν > 2)."""

    what = "logit noise"  # names the model in its errors

    def __init__(
        self, sigma: float = 0.1, nu: float | None = None, seed: int = 0, deterministic: bool = True
    ):
        super().__init__(seed, deterministic)
        if not sigma >= 0:
            raise ValueError(f"{self.what}: sigma must be >= 0, got {sigma}")
        if nu is not None and not nu > 0:
            raise ValueError(f"{self.what}: nu (degrees of freedom) must be > 0, got {nu}")
        self.sigma, self.nu = float(sigma), nu

    @property
    def row_local(self) -> bool:  # keyed by each row's prefix hash unless fresh noise
        return self.deterministic

    def _attach(self, model: nn.Module) -> None:
        head = model.get_output_embeddings()
        if head is None:
            raise ValueError(f"logit noise: {type(model).__name__} has no output embeddings")
        self._hook(head, self._on_logits)

    def _scale(self, B: int, S: int) -> float | Tensor:
        """σ for the [B, S] positions whose logits are hooked: one number here; a subclass may
        return a [B, S, 1] tensor (`position` noise)."""
        return self.sigma

    def _on_logits(self, module: nn.Module, args: tuple, z: Tensor) -> Tensor:
        ctx = current()
        if ctx is None:
            raise RuntimeError(f"{self.what}: no forward context; wrap the call in forward_context")
        # logits_to_keep=k keeps the last k positions: key them by the last k prefix hashes
        B, S, V = z.shape
        h = ctx.hash_BxS[:, ctx.hash_BxS.shape[1] - S :].reshape(-1)
        if h.numel() != B * S:
            raise RuntimeError(
                f"{self.what}: context {tuple(ctx.hash_BxS.shape)} vs logits {tuple(z.shape)}"
            )
        if self.deterministic:
            eps = logit_eps(h, V, self.seed, self.nu)
        elif self.nu is None:
            eps = self._normal(h, V, _LOGIT_STREAM)
        else:
            u1 = 1.0 - torch.rand(B * S, V, generator=self._gen)
            u2 = torch.rand(B * S, V, generator=self._gen)
            r = torch.sqrt(self.nu * (u1.pow(-2.0 / self.nu) - 1.0))
            eps = (r * torch.cos((2.0 * math.pi) * u2)).to(z.device)
        return (z.float() + self._scale(B, S) * eps.reshape(B, S, V)).to(z.dtype)
