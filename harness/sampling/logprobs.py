"""Log-probabilities of chosen tokens from hidden states, in chunks of positions.

The full-vocabulary fp32 log-softmax of a whole batch ([N, V] with V = 49,152 for SmolLM2) is
never materialised: `chunked_logp` computes logits chunk by chunk in the forward and recomputes
them chunk by chunk in the backward (a fused linear + log-softmax + gather).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import functional as F

from harness.noise.context import forward_context

DEFAULT_CHUNK = 1024  # positions per chunk: 1024 × 49,152 fp32 logits ≈ 200 MB


def support_mask(support: Tensor, vocab: int) -> Tensor:
    """[N, K] token ids (−1 = padding) → [N, V] bool, True on the sampler's support."""
    keep = torch.zeros(support.shape[0], vocab + 1, dtype=torch.bool, device=support.device)
    keep.scatter_(1, torch.where(support < 0, vocab, support), True)
    return keep[:, :vocab]


def kept_support(logp: Tensor) -> Tensor:
    """[N, V] processed log-probs (−inf off the support) → [N, K] kept token ids, −1 padded:
    the support a sampler records for mask replay (the inverse of `support_mask`)."""
    k = int(torch.isfinite(logp).sum(-1).max())
    val, idx = torch.topk(logp, k, dim=-1)
    return torch.where(torch.isfinite(val), idx, -1)


def replay_mask(support: Tensor, targets: Tensor, vocab: int) -> Tensor:
    """Mask replay for B × T sampled tokens: [B, T, K] support ids → [B, T, V] bool, with each
    sampled token kept (so padding and post-EOS rows, which have no support, stay finite)."""
    B, T = targets.shape
    keep = support_mask(support.reshape(B * T, -1), vocab)
    keep[torch.arange(B * T), targets.reshape(-1)] = True
    return keep.view(B, T, vocab)


def check_sampling(temperature: float, top_k: int, top_p: float, prefix: str = "") -> None:
    """The sampling law's parameters, checked once for the engine and for configs (`prefix`
    names the config node, e.g. "rollout.")."""
    if temperature <= 0:
        raise ValueError(
            f"{prefix}temperature must be > 0, got {temperature} (greedy is not a sampler)"
        )
    if not 0 < top_p <= 1:
        raise ValueError(f"{prefix}top_p must be in (0, 1], got {top_p}")
    if top_k < 0:
        raise ValueError(f"{prefix}top_k must be >= 0 (0 = off), got {top_k}")


def process_logits(
    logits: Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0
) -> Tensor:
    """Log-probs of the law actually sampled from: logits/T, then top-k, then top-p (as HF applies
    them), renormalised over the kept support; −inf outside it. `logits` is [N, V]."""
    check_sampling(temperature, top_k, top_p)
    z = logits.float() / temperature
    if top_k and top_k < z.shape[-1]:
        kth = torch.topk(z, top_k, dim=-1).values[..., -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    if top_p < 1.0:
        sorted_z, order = torch.sort(z, dim=-1, descending=True)
        cum = sorted_z.softmax(-1).cumsum(-1)
        # drop a token once the mass strictly before it already reaches top_p (keeps ≥ 1 token)
        drop_sorted = (cum - sorted_z.softmax(-1)) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        z = z.masked_fill(drop, float("-inf"))
    return z.log_softmax(-1)


class _ChunkedLogp(torch.autograd.Function):
    """log softmax(h W^T / T)[y] in position chunks; the backward recomputes each chunk's logits.

    When all positions fit in one chunk, the forward keeps that chunk's softmax for the backward
    instead (memory: one chunk, the forward's own transient), which saves the recompute matmul."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk, keep, stats):
        n = hidden.shape[0]
        out = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(out)
        ent = torch.empty(n if stats else 0, dtype=torch.float32, device=hidden.device)
        psq = torch.empty_like(ent)
        keep_p = n <= chunk and any(ctx.needs_input_grad[:2])
        p = None
        for s in range(0, n, chunk):
            z = _chunk_logits(hidden[s : s + chunk], weight, temperature, keep, s, chunk)
            lse[s : s + chunk] = torch.logsumexp(z, -1)
            out[s : s + chunk] = (
                z.gather(1, targets[s : s + chunk, None])[:, 0] - lse[s : s + chunk]
            )
            if keep_p or stats:
                logp_all = z.sub_(lse[s : s + chunk, None])
                if stats:  # the same formulas as chunked_stats (−inf outside a kept support)
                    q = logp_all.exp()
                    ent[s : s + chunk] = -(q * logp_all.nan_to_num(neginf=0.0)).sum(-1)
                    psq[s : s + chunk] = (q * q).sum(-1)
                if keep_p:
                    p = logp_all.exp_()
        ctx.save_for_backward(hidden, weight, targets, lse, keep, p)
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.mark_non_differentiable(ent, psq)
        return out, ent, psq

    @staticmethod
    def backward(ctx, grad_out, *_):
        hidden, weight, targets, lse, keep, p = ctx.saved_tensors
        t, chunk = ctx.temperature, ctx.chunk
        grad_h = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        for s in range(0, hidden.shape[0], chunk):
            h = hidden[s : s + chunk]
            g = grad_out[s : s + chunk, None]
            # d logp_y / d z = onehot(y) − softmax(z); then / T for the temperature
            if p is not None:
                dz = p.mul(-g)
            else:
                z = _chunk_logits(h, weight, t, keep, s, chunk)
                dz = torch.exp(z - lse[s : s + chunk, None]).mul_(-g)
            dz.scatter_add_(1, targets[s : s + chunk, None], g)
            dz.div_(t)
            if grad_h is not None:
                grad_h[s : s + chunk] = (dz.to(weight.dtype) @ weight).to(hidden.dtype)
            if grad_w is not None:
                grad_w.addmm_(dz.t(), h.float())
        if grad_w is not None:
            grad_w = grad_w.to(weight.dtype)
        return grad_h, grad_w, None, None, None, None, None


def _chunk_logits(h, weight, temperature, keep, s, chunk):
    z = (h @ weight.t()).float() / temperature
    if keep.numel():
        z = z.masked_fill(~keep[s : s + chunk], float("-inf"))
    return z


def chunked_logp(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    temperature: float = 1.0,
    keep: Tensor | None = None,
    chunk: int = DEFAULT_CHUNK,
    with_stats: bool = False,
) -> Tensor | tuple[Tensor, dict[str, Tensor]]:
    """log π(y) for [N, H] hidden states under lm_head `weight` [V, H]; differentiable in both.

    `keep` ([N, V] bool) restricts the softmax to the sampler's support (top-k/top-p mask replay).
    `with_stats`: also return {"entropy", "p_sq_sum", "p_t"} (detached, as `chunked_stats`
    computes them) from the same forward, so a trainer pass that doubles as π_old (staleness 0,
    one minibatch) needs no separate scoring pass.
    """
    keep_t = keep if keep is not None else torch.empty(0, dtype=torch.bool, device=hidden.device)
    logp, ent, psq = _ChunkedLogp.apply(
        hidden, weight, targets, float(temperature), int(chunk), keep_t, bool(with_stats)
    )
    if not with_stats:
        return logp
    return logp, {"entropy": ent, "p_sq_sum": psq, "p_t": logp.detach().exp()}


@torch.no_grad()
def chunked_stats(
    hidden: Tensor,
    lm_head: torch.nn.Module,
    targets: Tensor,
    temperature: float = 1.0,
    keep: Tensor | None = None,
    chunk: int = DEFAULT_CHUNK,
    hash_N: Tensor | None = None,
    pos_N: Tensor | None = None,
) -> dict[str, Tensor]:
    """Per position: logp of the target, p_t, entropy and Σ_j p_j² of the (processed) next-token
    law. Calls the `lm_head` module per chunk so that hooks on it (logit noise) fire, inside a
    determinism context built from the positions' prefix hashes `hash_N` (and their positions
    `pos_N`, for position-dependent noise) when given."""
    n = hidden.shape[0]
    out = {
        k: torch.empty(n, dtype=torch.float32, device=hidden.device)
        for k in ("logp", "entropy", "p_sq_sum")
    }
    for s in range(0, n, chunk):
        if hash_N is None:
            z = lm_head(hidden[s : s + chunk])
        else:
            pos = None if pos_N is None else pos_N[s : s + chunk][None]
            with forward_context(hash_N[s : s + chunk][None], pos_BxS=pos):
                z = lm_head(hidden[s : s + chunk][None])[0]
        z = z.float() / temperature
        if keep is not None:
            z = z.masked_fill(~keep[s : s + chunk], float("-inf"))
        logp_all = F.log_softmax(z, -1)
        p = logp_all.exp()
        out["logp"][s : s + chunk] = logp_all.gather(1, targets[s : s + chunk, None])[:, 0]
        out["entropy"][s : s + chunk] = -(p * logp_all.nan_to_num(neginf=0.0)).sum(-1)
        out["p_sq_sum"][s : s + chunk] = (p * p).sum(-1)
    out["p_t"] = out["logp"].exp()
    return out
