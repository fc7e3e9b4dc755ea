"""`batch`: batch-composition-dependent β′ (Thinking Machines, "Defeating Nondeterminism in LLM
Inference", 2025). GPU kernels pick their reduction strategy (split-K, split-KV) by batch shape,
so one sequence's numerics depend on what it is batched with. The CPU kernels are batch-invariant
at model level (a sequence's log-probs are bitwise equal alone and in a padded batch), so the
effect is injected: relative residual-stream noise as in `layer`, keyed by (seed, layer, prefix
hash, batch key). The same batch gives the same β′; the same sequence in a different batch gets a
different β′.
"""

from __future__ import annotations

from collections.abc import Sequence

from harness.noise.context import current, mix64
from harness.noise.layer import LayerNoise

KEYS = ("rows", "tokens", "content")


class BatchNoise(LayerNoise):
    """Batch key: `rows` = B (batch size), `tokens` = B·S of this forward (what GEMM kernel
    selection sees), `content` = the set of sequences in the batch (order-free). An explicit
    `batch_key` in the forward context overrides it."""

    def __init__(
        self,
        sigma: float = 1e-3,
        key: str = "rows",
        layers: Sequence[int] | None = None,
        mode: str = "norm",
        seed: int = 0,
    ):
        if key not in KEYS:
            raise ValueError(f"batch noise: unknown key {key!r}; valid: {', '.join(KEYS)}")
        super().__init__(sigma, layers=layers, mode=mode, seed=seed, deterministic=True)
        self.key = key

    @property
    def row_local(self) -> bool:  # its noise is keyed by the batch shape: never
        return False

    def batch_key(self) -> int:
        ctx = current()
        if ctx is None:
            raise RuntimeError("batch noise: no forward context")
        if ctx.batch_key is not None:
            return int(ctx.batch_key)
        B, S = ctx.hash_BxS.shape
        if self.key == "rows":
            return B
        if self.key == "tokens":
            return B * S
        return int(mix64(ctx.hash_BxS[:, -1]).sum())  # int64 sum wraps: order-free, exact

    def _stream(self, layer: int) -> tuple[int, ...]:
        return (layer, 7_777_777, self.batch_key())
