"""Determinism context: noise as a deterministic function of (seed, layer, token prefix).

Real kernel differences are deterministic functions of the context, so the same prefix must get
the same perturbation in prefill and in KV-cache decode. The engine wraps every sampler forward in
`forward_context(prefix_hash(...))`; hooks read `current()` and key their noise on the hash of the
prefix ending at each position. Without an active context, `FallbackHashHook` derives the hashes
from the call's own `input_ids` (and `attention_mask`), so plain full-sequence forwards are
deterministic too (but a plain KV decode step then hashes only its own new token).

Positions. A context may also carry each token's position (`pos_BxS`, as `position_ids`: the
number of real tokens before it, left pads counting none), for noise whose size depends on where
in the sequence a token is. `positions(S)` returns them for the current forward, else an error.
The fallback hook fills them from the call's `position_ids`, else its `attention_mask`, else the
cache length (as the model itself does).

Random numbers are counter-based: splitmix64 (Steele et al., OOPSLA 2014) in wrapping int64 torch
ops, then Box–Muller; one 64-bit word gives two normals. No generator state, fully vectorised.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import Tensor, nn

_M64 = 1 << 64


def _s64(v: int) -> int:
    """Python int -> the int64 with the same low 64 bits (torch int64 arithmetic wraps)."""
    v %= _M64
    return v - _M64 if v >= 1 << 63 else v


GOLDEN = _s64(0x9E3779B97F4A7C15)
_C1 = _s64(0xBF58476D1CE4E5B9)
_C2 = _s64(0x94D049BB133111EB)
_P = 0x100000001B3  # FNV-64 prime (odd, so invertible mod 2^64)
_P_INV = pow(_P, -1, _M64)
_H0 = _s64(0xCBF29CE484222325)  # FNV offset basis: the hash of the empty prefix


def _srl(x: Tensor, k: int) -> Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def mix64(x: Tensor) -> Tensor:
    """splitmix64 finaliser: a bijective avalanche on int64 (wrapping arithmetic)."""
    x = x ^ _srl(x, 30)
    x = x * _C1
    x = x ^ _srl(x, 27)
    x = x * _C2
    return x ^ _srl(x, 31)


def mix_int(*vals: int) -> int:
    """Combine Python ints into one int64 key (same mixer, scalar)."""
    h = torch.tensor(_H0, dtype=torch.int64)
    for v in vals:
        h = mix64(h * _s64(_P) + _s64(v) + GOLDEN)
    return int(h)


@lru_cache(maxsize=8)
def _powers(base: int, n: int) -> Tensor:
    """[base^0, ..., base^(n-1)] mod 2^64 as int64; n is rounded up so the cache stays small."""
    out = torch.full((n,), _s64(base), dtype=torch.int64)
    out[0] = 1
    return out.cumprod(0)


def _pow_table(base: int, n: int) -> Tensor:
    return _powers(base, 1 << max(n, 1).bit_length())


def prefix_hash(ids: Tensor, mask: Tensor | None = None, prev: Tensor | None = None) -> Tensor:
    """Rolling hash h_s = h_{s-1}·P + (id_s + 1) over non-pad tokens; pads leave h unchanged.

    Closed form h_s = P^{n_s} (h_init + Σ_{t≤s} x_t P^{-r_t}) with n_s the number of real tokens
    up to s and r_t the rank of token t, so it is one cumsum (exact mod 2^64). `prev` [B] is the
    hash of an earlier part of the same sequences (decode steps continue the prefill's hash).
    """
    if ids.dim() != 2:
        raise ValueError(f"prefix_hash needs ids [B, S], got shape {tuple(ids.shape)}")
    B, S = ids.shape
    m = torch.ones_like(ids, dtype=torch.int64) if mask is None else (mask != 0).long()
    if m.shape != ids.shape:
        raise ValueError(f"mask shape {tuple(m.shape)} != ids shape {tuple(ids.shape)}")
    n = m.cumsum(1)  # real tokens up to and including s
    p_pow = _pow_table(_P, S + 1).to(ids.device)
    p_inv = _pow_table(_P_INV, S + 1).to(ids.device)
    x = (ids.long() + 1) * m * p_inv[n]
    h_init = torch.full((B,), _H0, dtype=torch.int64, device=ids.device) if prev is None else prev
    return p_pow[n] * (h_init.long()[:, None] + x.cumsum(1))


def position_ids(attention_mask: Tensor) -> Tensor:
    """Left padding: positions count real tokens only (pads get 0)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp_min(0)


# --- the active context -------------------------------------------------------------------------


@dataclass
class ForwardContext:
    """What the hooks of one sampler forward may read."""

    hash_BxS: Tensor  # prefix hash per position of this forward's input
    batch_key: int | None = None  # optional batch-composition key for the `batch` noise
    pos_BxS: Tensor | None = None  # optional position per token (`position_ids`)


_STACK: list[ForwardContext] = []


def current() -> ForwardContext | None:
    return _STACK[-1] if _STACK else None


@contextlib.contextmanager
def forward_context(
    hash_BxS: Tensor, batch_key: int | None = None, pos_BxS: Tensor | None = None
) -> Iterator[ForwardContext]:
    """Wrap one model forward (prefill [B,S] or decode step [B,1]); hooks read its prefix hashes
    (and positions, when given: `position_ids` of the same [B, S] tokens)."""
    if hash_BxS.dim() != 2 or hash_BxS.dtype != torch.int64:
        raise ValueError(
            f"forward_context needs int64 hashes [B, S], got {hash_BxS.dtype} "
            f"{tuple(hash_BxS.shape)}"
        )
    if pos_BxS is not None and (pos_BxS.shape != hash_BxS.shape or pos_BxS.dtype.is_floating_point):
        raise ValueError(
            f"forward_context: pos_BxS must be integer positions shaped like the hashes "
            f"{tuple(hash_BxS.shape)}, got {pos_BxS.dtype} {tuple(pos_BxS.shape)}"
        )
    ctx = ForwardContext(hash_BxS, batch_key, pos_BxS)
    _STACK.append(ctx)
    try:
        yield ctx
    finally:
        _STACK.pop()


def positions(S: int, what: str) -> Tensor:
    """Positions [B, S] of the last S tokens of the current forward (`logits_to_keep`)."""
    ctx = current()
    if ctx is None:
        raise RuntimeError(f"{what}: no forward context; wrap the call in forward_context")
    if ctx.pos_BxS is None:
        raise RuntimeError(
            f"{what}: the forward context carries no positions; pass "
            "forward_context(hashes, pos_BxS=position_ids(attention_mask)), or call the model "
            "with input_ids (and attention_mask or position_ids) so the fallback derives them"
        )
    return ctx.pos_BxS[:, ctx.pos_BxS.shape[1] - S :]


def call_positions(ids: Tensor, kwargs: dict) -> Tensor:
    """Positions [B, S] of a model call's `input_ids`: its `position_ids`, else those of its
    `attention_mask` (past + current tokens), else the cache length + 0..S−1 (the model's own)."""
    B, S = ids.shape
    pos = kwargs.get("position_ids")
    if isinstance(pos, Tensor) and pos.dim() == 2 and pos.shape[1] == S:
        return pos.long().expand(B, S)
    mask = kwargs.get("attention_mask")
    if isinstance(mask, Tensor) and mask.dim() == 2 and mask.shape[0] == B and mask.shape[1] >= S:
        return position_ids(mask)[:, mask.shape[1] - S :]
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    past = int(cache.get_seq_length()) if hasattr(cache, "get_seq_length") else 0
    return (torch.arange(S, device=ids.device) + past).expand(B, S)


class FallbackHashHook:
    """Pushes a context derived from `input_ids` when a model is called outside forward_context;
    inside one that carries no positions, pushes a copy with the call's positions."""

    def __init__(self, model: nn.Module):
        self._pushed: list[bool] = []
        self._handles = [
            model.register_forward_pre_hook(self._pre, with_kwargs=True),
            model.register_forward_hook(self._post, always_call=True),
        ]

    def _pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        ctx, push = current(), False
        if isinstance(ids, Tensor) and ids.dim() == 2:
            if ctx is None:
                mask = kwargs.get("attention_mask")
                if not (isinstance(mask, Tensor) and mask.shape == ids.shape):
                    mask = None
                ctx, push = ForwardContext(prefix_hash(ids, mask)), True
            elif ctx.pos_BxS is None and ctx.hash_BxS.shape == ids.shape:
                ctx, push = ForwardContext(ctx.hash_BxS, ctx.batch_key), True
            if push:
                ctx.pos_BxS = call_positions(ids, kwargs)
                _STACK.append(ctx)
        self._pushed.append(push)

    def _post(self, module: nn.Module, args: tuple, output: object) -> None:
        if self._pushed and self._pushed.pop():
            _STACK.pop()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def token_hashes(n_tokens: int, shape_hint: str) -> Tensor:
    """The context's hashes flattened to [T] for a hook that sees T = B·S tokens."""
    ctx = current()
    if ctx is None:
        raise RuntimeError(
            f"{shape_hint}: no forward context and no input_ids to derive one from; wrap the call "
            "in harness.noise.forward_context(prefix_hash(ids)) or pass input_ids"
        )
    h = ctx.hash_BxS.reshape(-1)
    if h.numel() != n_tokens:
        raise RuntimeError(
            f"{shape_hint}: forward context has {h.numel()} positions {tuple(ctx.hash_BxS.shape)} "
            f"but the hooked tensor has {n_tokens} tokens; the context must match this forward"
        )
    return h


# --- counter-based normals ----------------------------------------------------------------------


def _uniform24(bits: Tensor) -> Tensor:
    """24 random bits -> float32 in (0, 1]."""
    return ((bits & 0xFFFFFF).float() + 1.0) * (1.0 / (1 << 24))


def hashed_uniform_pairs(keys: Tensor, n_words: int) -> tuple[Tensor, Tensor]:
    """Two uniforms in (0, 1] per counter: [..., n_words] each, from keys [...]."""
    ctr = torch.arange(1, n_words + 1, dtype=torch.int64, device=keys.device) * GOLDEN
    w = mix64(keys[..., None] + ctr)
    return _uniform24(w), _uniform24(_srl(w, 32))


def hashed_normal(keys: Tensor, n: int) -> Tensor:
    """Standard normals [..., n] as a deterministic function of int64 keys [...] (Box–Muller)."""
    u1, u2 = hashed_uniform_pairs(keys, (n + 1) // 2)
    r = torch.sqrt(-2.0 * torch.log(u1))
    theta = (2.0 * math.pi) * u2
    z = torch.cat([r * torch.cos(theta), r * torch.sin(theta)], dim=-1)
    return z[..., :n]


def hashed_student_t(keys: Tensor, n: int, nu: float) -> Tensor:
    """Student-t(ν) variates [..., n], Bailey (1994): T = sqrt(ν(U1^(-2/ν) − 1))·cos(2πU2), exact.

    Only the cosine branch is used: unlike Box–Muller, the sine partner is not independent.
    """
    u1, u2 = hashed_uniform_pairs(keys, n)
    return torch.sqrt(nu * (u1.pow(-2.0 / nu) - 1.0)) * torch.cos((2.0 * math.pi) * u2)
