"""`routing`: MoE router-logit noise with the family's own selection rule, recording the chosen
experts; `replay`: R3 for the trainer (Ma et al., arXiv 2510.11370) — forced recorded indices,
gate weights from the trainer's own logits.

transformers 5.x routers live at `layers[i].mlp.gate` and return (logits [T,E], weights [T,k],
indices [T,k]); a forward hook replaces that tuple, so no MoE block is patched. Families:
  softmax   Mixtral (always renormalised, weights fp32), Qwen2-MoE, Qwen3-MoE, OLMoE
            (renormalised iff `norm_topk_prob`, weights cast to the logits dtype)
  sigmoid   DeepSeek-V3: sigmoid + `e_score_correction_bias` for the choice only, group-limited
            top-k; weights = sigmoid scores (renormalised iff `norm_topk_prob`) × scaling factor
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from harness.base.models import decoder_layers
from harness.noise.base import NoiseModel
from harness.noise.context import current, token_hashes

_ROUTING_STREAM = 2_000_003


def find_routers(model: nn.Module, what: str) -> list[tuple[int, nn.Module]]:
    """(layer index, router) for every MoE layer; a clear error on a dense model."""
    out = []
    for i, layer in enumerate(decoder_layers(model)):
        gate = getattr(getattr(layer, "mlp", None), "gate", None)
        if isinstance(gate, nn.Module) and hasattr(gate, "top_k") and hasattr(gate, "weight"):
            out.append((i, gate))
    if not out:
        raise ValueError(
            f"{what} needs an MoE model (a router at layers[i].mlp.gate, transformers 5.x: "
            f"Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V3); {type(model).__name__} is dense"
        )
    return out


def family(router: nn.Module) -> str:
    if hasattr(router, "e_score_correction_bias"):
        return "sigmoid"
    if hasattr(router, "norm_topk_prob") or type(router).__name__.startswith("Mixtral"):
        return "softmax"
    raise ValueError(
        f"unsupported router {type(router).__name__}: supported are the Mixtral, "
        "Qwen2-MoE, Qwen3-MoE, OLMoE and DeepSeek-V3 routers"
    )


def _renorm(router: nn.Module) -> bool:
    return getattr(router, "norm_topk_prob", True)  # Mixtral has no flag and always renormalises


def _finish_softmax(router: nn.Module, w: Tensor, logits: Tensor) -> Tensor:
    if _renorm(router):
        w = w / w.sum(dim=-1, keepdim=True)
    return w if type(router).__name__.startswith("Mixtral") else w.to(logits.dtype)


def _finish_sigmoid(router: nn.Module, w: Tensor) -> Tensor:
    if router.norm_topk_prob:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return w * router.routed_scaling_factor


def select(router: nn.Module, logits: Tensor) -> tuple[Tensor, Tensor]:
    """(weights, indices) by the router's own rule from logits [T, E] (bit-exact re-application)."""
    if family(router) == "softmax":
        probs = F.softmax(logits, dim=-1, dtype=torch.float)
        w, idx = torch.topk(probs, router.top_k, dim=-1)
        return _finish_softmax(router, w, logits), idx
    scores = logits.sigmoid()
    choice = scores + router.e_score_correction_bias
    E, G = router.num_experts, router.num_group
    group_scores = choice.view(-1, G, E // G).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=router.topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(-1, G, E // G).reshape(-1, E)
    choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
    idx = torch.topk(choice, k=router.top_k, dim=-1, sorted=False)[1]
    return _finish_sigmoid(router, scores.gather(1, idx)), idx


def weights_at(router: nn.Module, logits: Tensor, idx: Tensor) -> Tensor:
    """Gate weights for forced experts `idx` [T, k] from (trainer) logits [T, E] — R3's rule."""
    if family(router) == "softmax":
        probs = F.softmax(logits, dim=-1, dtype=torch.float)
        return _finish_softmax(router, probs.gather(1, idx), logits)
    return _finish_sigmoid(router, logits.sigmoid().gather(1, idx))


def _batch_shape(n_tokens: int, what: str) -> tuple[int, int]:
    ctx = current()
    token_hashes(n_tokens, what)  # raises if the context does not match
    B, S = ctx.hash_BxS.shape
    return B, S


class RoutingNoise(NoiseModel):
    """Router logits + σ·std_token(logits)·ξ, re-selected by the family's rule; records the chosen
    experts. `take_record()` → [B, S_total, n_moe_layers, k] over the forwards since the last take
    (prefill, then each decode step appends along S)."""

    def __init__(self, sigma: float = 0.1, seed: int = 0, deterministic: bool = True):
        super().__init__(seed, deterministic)
        if sigma < 0:
            raise ValueError(f"routing noise: sigma must be >= 0, got {sigma}")
        self.sigma = float(sigma)
        self._record: list[Tensor] = []
        self._pending: dict[int, Tensor] = {}

    def _attach(self, model: nn.Module) -> None:
        self.routers = find_routers(model, "routing noise")
        for _, r in self.routers:
            family(r)  # unsupported router -> error now, not mid-rollout
        for pos, (layer, r) in enumerate(self.routers):
            self._hook(r, self._make_hook(pos, layer))
        self._hook(model, self._collect)

    def _make_hook(self, pos: int, layer: int):
        def hook(router: nn.Module, args: tuple, out: tuple) -> tuple | None:
            logits, w, idx = out
            B, S = _batch_shape(logits.shape[0], "routing noise")
            if self.sigma > 0:
                lf = logits.float()
                z = self._normal(
                    token_hashes(lf.shape[0], "routing noise"), lf.shape[1], _ROUTING_STREAM, layer
                )
                logits = (lf + self.sigma * lf.std(dim=-1, keepdim=True) * z).to(logits.dtype)
                w, idx = select(router, logits)
            self._pending[pos] = idx.reshape(B, S, -1)
            return (logits, w, idx) if self.sigma > 0 else None

        return hook

    def _collect(self, module: nn.Module, args: tuple, output: object) -> None:
        if len(self._pending) != len(self.routers):
            self._pending.clear()
            return
        step = torch.stack([self._pending[p] for p in range(len(self.routers))], dim=2)
        self._pending.clear()
        if self._record and self._record[0].shape[0] != step.shape[0]:
            raise RuntimeError(
                f"routing record: batch size changed from {self._record[0].shape[0]} to "
                f"{step.shape[0]} without take_record(); take the record after each batch"
            )
        self._record.append(step)

    def take_record(self) -> Tensor:
        """Chosen experts [B, S_total, n_moe_layers, k] (int64); clears the record."""
        if not self._record:
            raise RuntimeError("routing record is empty: no forward since the last take_record()")
        rec = torch.cat(self._record, dim=1)
        self._record.clear()
        return rec

    def _detach(self) -> None:
        self._pending.clear()


class RoutingReplay(NoiseModel):
    """R3 for the trainer: experts forced to `indices` [B, S_rec, n_moe_layers, k] at positions
    s < S_rec; gate weights from the trainer's own logits at those experts, renormalised by the
    family's rule (so gradients reach the router). Positions s ≥ S_rec route normally."""

    def __init__(self, indices: Tensor | None = None):
        super().__init__(seed=0, deterministic=True)
        self.indices: Tensor | None = None
        if indices is not None:
            self.set_indices(indices)

    def set_indices(self, indices: Tensor) -> None:
        if indices.dim() != 4:
            raise ValueError(
                f"replay indices must be [B, S, n_moe_layers, k], got {tuple(indices.shape)}"
            )
        self.indices = indices.long()

    def _attach(self, model: nn.Module) -> None:
        self.routers = find_routers(model, "routing replay")
        n = len(self.routers)
        if self.indices is not None and self.indices.shape[2] != n:
            raise ValueError(
                f"replay indices cover {self.indices.shape[2]} MoE layers, the model has {n}"
            )
        for pos, (_, r) in enumerate(self.routers):
            family(r)
            self._hook(r, self._make_hook(pos))

    def _make_hook(self, pos: int):
        def hook(router: nn.Module, args: tuple, out: tuple) -> tuple | None:
            if self.indices is None:
                return None
            logits, _, idx = out
            B, S = _batch_shape(logits.shape[0], "routing replay")
            rec = self.indices
            if rec.shape[0] != B or rec.shape[3] != idx.shape[-1]:
                raise RuntimeError(
                    f"replay indices {tuple(rec.shape)} do not fit batch [B={B}, "
                    f"S={S}] with top_k={idx.shape[-1]}"
                )
            n = min(S, rec.shape[1])
            idx = idx.reshape(B, S, -1).clone()
            idx[:, :n] = rec[:, :n, pos].to(idx.device)
            idx = idx.reshape(B * S, -1)
            return logits, weights_at(router, logits, idx), idx

        return hook
