"""NoiseModel: the attach / detach / weight-sync life cycle shared by every noise model."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from harness.noise.context import FallbackHashHook, hashed_normal, mix64, mix_int


class NoiseModel:
    """Hooks into a model; `detach()` removes every hook and restores every swapped tensor.

    Subclasses implement `_attach(model)` (register hooks with `self._hook`) and optionally
    `_detach()` and `on_weight_sync()`. `uses_context` models also install the fallback that
    derives prefix hashes from `input_ids` when the caller set no `forward_context`.
    """

    uses_context = True
    # β's scale, where the model has one: drivers.beta_growth grows it over a run (harness.train);
    # None for a model without one (fp8, replay), which the driver leaves alone
    sigma: float | None = None

    @property
    def row_local(self) -> bool:
        """True when a row's noise depends only on that row's own tokens (deterministic noise
        keyed by the token prefix), so the sampler may drop finished rows from its batch."""
        return False

    def __init__(self, seed: int = 0, deterministic: bool = True):
        self.seed = int(seed)
        self.deterministic = bool(deterministic)
        self.model: nn.Module | None = None
        self._handles: list[RemovableHandle] = []
        self._fallback: FallbackHashHook | None = None
        self._gen = torch.Generator().manual_seed(self.seed)  # fresh noise when not deterministic

    # --- life cycle --------------------------------------------------------------------------

    def attach(self, model: nn.Module) -> None:
        if self.model is not None:
            raise RuntimeError(f"{type(self).__name__} is already attached; detach() it first")
        self.model = model
        try:
            if self.uses_context:
                self._fallback = FallbackHashHook(model)
            self._attach(model)
        except BaseException:
            self.detach()
            raise

    def detach(self) -> None:
        for h in reversed(self._handles):
            h.remove()
        self._handles.clear()
        if self._fallback is not None:
            self._fallback.remove()
            self._fallback = None
        if self.model is not None:
            self._detach()
        self.model = None

    @contextlib.contextmanager
    def attached(self, model: nn.Module) -> Iterator[NoiseModel]:
        self.attach(model)
        try:
            yield self
        finally:
            self.detach()

    def on_weight_sync(self) -> None:
        """Called by the engine after it copied new weights into the sampler model."""

    def _attach(self, model: nn.Module) -> None:
        raise NotImplementedError

    def _detach(self) -> None:
        pass

    # --- helpers -----------------------------------------------------------------------------

    def _hook(self, module: nn.Module, fn: Callable, pre: bool = False, **kw) -> None:
        reg = module.register_forward_pre_hook if pre else module.register_forward_hook
        self._handles.append(reg(fn, **kw))

    def _normal(self, hash_T: Tensor, n: int, *stream: int) -> Tensor:
        """[T, n] standard normals keyed by (seed, stream, prefix hash), or fresh ones."""
        if not self.deterministic:
            return torch.randn(hash_T.shape[0], n, generator=self._gen).to(hash_T.device)
        return hashed_normal(mix64(hash_T ^ mix_int(self.seed, *stream)), n)
