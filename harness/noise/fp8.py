"""`fp8`: fake-quantised FP8 sampler (notes/noise-models.md §1) and the public `fp8_qdq`.

Scales are dequant scales s (x ≈ s·q, the DeepGEMM / vLLM / MX convention); torchao and
TransformerEngine store the multiplier 1/s. Values are saturated to ±max *before* the cast: eager
casts differ across torch versions (e4m3fn saturates on 2.13, e5m2 overflows to inf, fnuz → NaN).
Granularities (notes §1.3):
  tensor   one scale per tensor (current scaling; `amax=` for delayed scaling)
  row      one scale per row of the last dim: per token for activations, per output channel for
           weights W[N, K] (torchao ROWWISE, vLLM per-token)
  block    DeepSeek-V3: `block`=(1, 128) activation tiles, (128, 128) weight blocks over the last
           two dims; shapes that are not multiples are zero-padded (DeepGEMM)
  mxfp8    OCP MX: 32 elements along the last dim share an E8M0 scale; `mx_rounding` "floor"
           (OCP spec, torchao default: s = 2^(⌊log2 amax⌋ − emax_elem), may clip) or "rceil"
           (cuBLAS / Blackwell: s = 2^⌈log2(amax / max)⌉)
`pow2=True` rounds s up to a power of two (torchao rowwise, DeepGEMM UE8M0); never overflows.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from harness.models import decoder_layers
from harness.noise.base import NoiseModel

FORMATS = {  # torch dtype, max finite, emax of the element format (MX)
    "e4m3": (torch.float8_e4m3fn, 448.0, 8),
    "e5m2": (torch.float8_e5m2, 57344.0, 15),
}
GRANULARITIES = ("tensor", "row", "block", "mxfp8")
ACT_GRANULARITIES = ("tensor", "delayed", "row", "block", "mxfp8")
MX_ROUNDING = ("floor", "rceil")
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
EXPERT_PARAMS = ("gate_up_proj", "down_proj")
KV_SCALES = ("one", "token")
_AMAX_EPS = 1e-12


def _fmt(fmt: str) -> tuple[torch.dtype, float, int]:
    if fmt not in FORMATS:
        raise ValueError(f"unknown FP8 format {fmt!r}; valid: {', '.join(FORMATS)}")
    return FORMATS[fmt]


def _cast(x: Tensor, s: Tensor, dtype8: torch.dtype, fmax: float) -> Tensor:
    return (x / s).clamp_(-fmax, fmax).to(dtype8).float() * s


def _dequant_scale(amax: Tensor, fmax: float, pow2: bool) -> Tensor:
    s = amax.clamp(min=_AMAX_EPS) / fmax
    return torch.exp2(torch.ceil(torch.log2(s))) if pow2 else s


def _blocked(x: Tensor, br: int, bc: int) -> tuple[Tensor, tuple[int, ...]]:
    """x [..., R, C] → zero-padded blocks [..., R/br, br, C/bc, bc]."""
    R, C = x.shape[-2], x.shape[-1]
    pr, pc = (-R) % br, (-C) % bc
    xp = F.pad(x, (0, pc, 0, pr)) if pr or pc else x
    lead = xp.shape[:-2]
    return xp.reshape(*lead, (R + pr) // br, br, (C + pc) // bc, bc), (R, C)


def fp8_qdq(
    x: Tensor,
    fmt: str = "e4m3",
    granularity: str = "tensor",
    *,
    block: tuple[int, int] = (1, 128),
    pow2: bool = False,
    mx_rounding: str = "floor",
    amax: Tensor | float | None = None,
) -> Tensor:
    """Quantise to FP8 and back (same shape and dtype as x); computed in fp32."""
    dtype8, fmax, emax = _fmt(fmt)
    if granularity not in GRANULARITIES:
        raise ValueError(
            f"unknown FP8 granularity {granularity!r}; valid: {', '.join(GRANULARITIES)}"
        )
    if mx_rounding not in MX_ROUNDING:
        raise ValueError(f"unknown mx_rounding {mx_rounding!r}; valid: {', '.join(MX_ROUNDING)}")
    if amax is not None and granularity != "tensor":
        raise ValueError("fp8_qdq: amax= (delayed scaling) only applies to granularity='tensor'")
    xf = x.float()
    if granularity == "tensor":
        a = xf.abs().amax() if amax is None else torch.as_tensor(amax, dtype=torch.float32)
        return _cast(xf, _dequant_scale(a, fmax, pow2), dtype8, fmax).to(x.dtype)
    if granularity == "row":
        a = xf.abs().amax(dim=-1, keepdim=True)
        return _cast(xf, _dequant_scale(a, fmax, pow2), dtype8, fmax).to(x.dtype)
    br, bc = (1, 32) if granularity == "mxfp8" else block
    x2 = xf.reshape(1, -1) if xf.dim() == 1 else xf
    xb, (R, C) = _blocked(x2, br, bc)
    a = xb.abs().amax(dim=(-3, -1), keepdim=True)
    if granularity == "block":
        s = _dequant_scale(a, fmax, pow2)
    elif mx_rounding == "floor":
        s = torch.exp2(torch.floor(torch.log2(a.clamp(min=1e-30))) - emax)
    else:
        s = torch.exp2(torch.ceil(torch.log2(a.clamp(min=1e-30) / fmax)))
    q = _cast(xb, s, dtype8, fmax).reshape(*xb.shape[:-4], -1, xb.shape[-2] * xb.shape[-1])
    return q[..., :R, :C].reshape(x.shape).to(x.dtype)


# --- the noise model ----------------------------------------------------------------------------


class Fp8Noise(NoiseModel):
    """FP8 sampler: weights quantised once per attach / `on_weight_sync()` (not per forward),
    activations (inputs of the quantised linears) per forward, optionally the KV cache.

    Defaults follow vLLM online fp8 / the harness default (notes §1.6): q/k/v/o + gate/up/down
    (and MoE expert weights) in FP8; lm_head, embeddings, norms and the router in high precision.
    `granularity` is the weight scaling; `act_granularity` (default: matching recipe — tensor,
    row → per token, block → 1×128, mxfp8) may also be "delayed" (per-tensor, amax history of
    `amax_history_len` forwards, TE DelayedScaling with amax_compute_algo='max').
    Expert activations stay high precision (the fused expert GEMMs are not hooked).
    `kv_cache`: K and V (post-RoPE, as cached) in FP8 with scale 1.0 (`kv_scale="one"`, vLLM's
    default) or per token and head (`"token"`); both are idempotent, so prefill and cached decode
    see the same values.
    """

    uses_context = False

    def __init__(
        self,
        fmt: str = "e4m3",
        granularity: str = "tensor",
        weights: bool = True,
        activations: bool = False,
        act_granularity: str | None = None,
        block_size: int = 128,
        pow2: bool = False,
        mx_rounding: str = "floor",
        amax_history_len: int = 16,
        modules: Sequence[str] = LINEARS,
        experts: bool = True,
        lm_head: bool = False,
        embeddings: bool = False,
        norms: bool = False,
        router: bool = False,
        kv_cache: bool = False,
        kv_scale: str = "one",
    ):
        super().__init__()
        _fmt(fmt)
        if granularity not in GRANULARITIES:
            raise ValueError(
                f"fp8: unknown granularity {granularity!r}; valid: {', '.join(GRANULARITIES)}"
            )
        act_granularity = act_granularity or granularity
        if act_granularity not in ACT_GRANULARITIES:
            raise ValueError(
                f"fp8: unknown act_granularity {act_granularity!r}; valid: "
                f"{', '.join(ACT_GRANULARITIES)}"
            )
        if mx_rounding not in MX_ROUNDING:
            raise ValueError(
                f"fp8: unknown mx_rounding {mx_rounding!r}; valid: {', '.join(MX_ROUNDING)}"
            )
        if kv_scale not in KV_SCALES:
            raise ValueError(f"fp8: unknown kv_scale {kv_scale!r}; valid: {', '.join(KV_SCALES)}")
        if not (weights or activations or kv_cache):
            raise ValueError("fp8: nothing to quantise (weights, activations and kv_cache all off)")
        self.fmt, self.granularity, self.act_granularity = fmt, granularity, act_granularity
        self.weights, self.activations, self.kv_cache = weights, activations, kv_cache
        self.block_size, self.pow2, self.mx_rounding = block_size, pow2, mx_rounding
        self.amax_history_len, self.kv_scale = amax_history_len, kv_scale
        self.modules, self.experts = tuple(modules), experts
        self.lm_head, self.embeddings, self.norms, self.router = lm_head, embeddings, norms, router
        self._permanent: list[tuple[nn.Parameter, Tensor, Tensor]] = []  # (param, hp, q)
        self._scoped: list[tuple[nn.Parameter, Tensor, Tensor]] = []
        self._amax_hist: dict[int, deque] = {}
        self._attn_impl: str | None = None

    @property
    def row_local(self) -> bool:
        """Weights and the KV cache quantise per row or statically; activations per tensor
        (current or delayed scaling) take their scale from the whole batch."""
        return not self.activations or self.act_granularity in ("row", "block", "mxfp8")

    # --- quantisers ------------------------------------------------------------------------

    def qdq_weight(self, w: Tensor) -> Tensor:
        if w.dim() == 3:  # fused experts [E, N, K]: one scaling problem per expert
            return torch.stack([self.qdq_weight(we) for we in w])
        g = self.granularity if w.dim() >= 2 else "tensor"
        b = self.block_size
        return fp8_qdq(w, self.fmt, g, block=(b, b), pow2=self.pow2, mx_rounding=self.mx_rounding)

    def qdq_act(self, x: Tensor, key: int) -> Tensor:
        g = self.act_granularity
        if g == "delayed":
            hist = self._amax_hist.setdefault(key, deque(maxlen=max(1, self.amax_history_len)))
            cur = x.detach().abs().amax().float()
            amax = torch.stack(list(hist)).amax() if hist else cur
            hist.append(cur)
            return fp8_qdq(x, self.fmt, "tensor", pow2=self.pow2, amax=amax)
        return fp8_qdq(
            x, self.fmt, g, block=(1, self.block_size), pow2=self.pow2, mx_rounding=self.mx_rounding
        )

    # --- targets ---------------------------------------------------------------------------

    def _targets(self, model: nn.Module) -> tuple[list[nn.Module], list[tuple[nn.Module, str]]]:
        """(linears whose input is quantised, (module, param name) whose weight is quantised)."""
        layers = decoder_layers(model)
        linears: list[nn.Module] = []
        params: list[tuple[nn.Module, str]] = []
        for layer in layers:
            for name, m in layer.named_modules():
                leaf = name.rsplit(".", 1)[-1]
                if isinstance(m, nn.Linear) and leaf in self.modules:
                    linears.append(m)
                    params.append((m, "weight"))
                elif self.experts and leaf == "experts":
                    params += [
                        (m, p)
                        for p in EXPERT_PARAMS
                        if isinstance(getattr(m, p, None), nn.Parameter)
                    ]
                elif (
                    self.router
                    and leaf == "gate"
                    and not isinstance(m, nn.Linear)
                    and hasattr(m, "top_k")
                ):
                    params.append((m, "weight"))
        if self.norms:
            params += [
                (m, "weight")
                for m in model.modules()
                if "Norm" in type(m).__name__
                and isinstance(getattr(m, "weight", None), nn.Parameter)
            ]
        if self.lm_head:
            head = model.get_output_embeddings()
            linears.append(head)
            params.append((head, "weight"))
        if self.embeddings:
            params.append((model.get_input_embeddings(), "weight"))
        return linears, params

    def _attach(self, model: nn.Module) -> None:
        linears, params = self._targets(model)
        if self.weights:
            # a parameter shared with a module kept in high precision (tied lm_head/embeddings)
            # is swapped in only while the chosen module runs; all others are swapped for good
            users: dict[int, set[int]] = {}
            for m in model.modules():
                for p in m.parameters(recurse=False):
                    users.setdefault(id(p), set()).add(id(m))
            chosen: dict[int, set[int]] = {}
            for m, name in params:
                chosen.setdefault(id(getattr(m, name)), set()).add(id(m))
            done: set[int] = set()
            for m, name in params:
                p = getattr(m, name)
                if id(p) in done:
                    continue
                done.add(id(p))
                hp = p.data
                entry = (p, hp, self.qdq_weight(hp))
                if users.get(id(p), set()) - chosen[id(p)]:
                    self._scoped.append(entry)
                    self._hook(m, self._swap(entry, 2), pre=True)
                    self._hook(m, self._swap(entry, 1), always_call=True)
                else:
                    self._permanent.append(entry)
                    p.data = entry[2]
        if self.activations:
            for i, m in enumerate(linears):
                self._hook(m, self._act_hook(i), pre=True)
        if self.kv_cache:
            self._attach_kv(model)

    def _swap(self, entry: tuple, which: int):
        def hook(module, *args):
            p = entry[0]
            cur = next(e for e in self._scoped if e[0] is p)  # on_weight_sync replaces entries
            p.data = cur[which]

        return hook

    def _act_hook(self, key: int):
        def pre(module, args):
            return (self.qdq_act(args[0], key), *args[1:])

        return pre

    def on_weight_sync(self) -> None:
        """Re-quantise from the model's current weights (the engine copied the trainer's weights
        in, in place or by replacing `.data`); weights still equal to our quantised copy keep the
        stored high-precision original."""
        for lst in (self._permanent, self._scoped):
            for i, (p, hp, q) in enumerate(lst):
                cur = p.data  # a fresh Tensor object each access: compare storage, not identity
                in_q = cur.data_ptr() == q.data_ptr()
                # an in-place copy also changed q, so "unchanged" means equal to qdq(kept hp)
                if in_q and torch.equal(cur, self.qdq_weight(hp)):
                    continue
                new_hp = cur.clone() if in_q else cur
                lst[i] = (p, new_hp, self.qdq_weight(new_hp))
                if lst is self._permanent:
                    p.data = lst[i][2]
                else:
                    p.data = new_hp
        self._amax_hist.clear()

    def _detach(self) -> None:
        for p, hp, _ in self._permanent + self._scoped:
            p.data = hp
        self._permanent.clear()
        self._scoped.clear()
        self._amax_hist.clear()
        if self._attn_impl is not None:
            _KV_QDQ.pop(id(self.model.config), None)
            self.model.config._attn_implementation = self._attn_impl
            self._attn_impl = None

    # --- KV cache ---------------------------------------------------------------------------

    def _attach_kv(self, model: nn.Module) -> None:
        base = model.config._attn_implementation or "eager"
        name = _register_fp8_kv_attention(base)
        self._attn_impl = base
        _KV_QDQ[id(model.config)] = self._qdq_kv
        model.config._attn_implementation = name

    def _qdq_kv(self, x: Tensor) -> Tensor:
        if self.kv_scale == "one":
            return fp8_qdq(x, self.fmt, "tensor", amax=FORMATS[self.fmt][1])
        return fp8_qdq(x, self.fmt, "row", pow2=self.pow2)


# Attention wrappers are registered globally by name (transformers' AttentionInterface); the
# quantiser is looked up per model config at call time. The mask interface must be registered
# too, or the mask silently becomes None (non-causal attention; notes §1.7 gotcha).
_KV_QDQ: dict[int, Callable[[Tensor], Tensor]] = {}


def _register_fp8_kv_attention(base: str) -> str:
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface
    from transformers.models.llama.modeling_llama import eager_attention_forward

    name = f"ratiolab_fp8kv_{base}"
    if name in ALL_ATTENTION_FUNCTIONS.valid_keys():
        return name
    base_fn = eager_attention_forward if base == "eager" else ALL_ATTENTION_FUNCTIONS[base]

    def attention(module, query, key, value, attention_mask, **kwargs):
        qdq = _KV_QDQ.get(id(module.config))
        if qdq is not None:
            key, value = qdq(key), qdq(value)
        return base_fn(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, AttentionMaskInterface._global_mapping[base])
    return name


# --- the trainer side of full-pipeline FP8 -------------------------------------------------------


class Fp8Trainer(NoiseModel):
    """Full-pipeline FP8 (seed 002, Jet-RL's unified precision flow): the trainer's forward runs
    the sampler's FP8 recipe `recipe` (an Fp8Noise: format, granularities, which linears) with a
    straight-through gradient. Each quantised linear computes F.linear(x̃, W̃) with
    W̃ = sg(qdq(W)) + (W − sg(W)) (value qdq(W) exactly, gradient 1 into the high-precision master
    W), and x̃ likewise when `recipe.activations`. Linears only: fused MoE experts, norms,
    embeddings and the KV cache stay high precision on the trainer side (documented gap).
    `high_precision()` lifts it for a shadow pass (calibrated clipping's r_hp, evaluation)."""

    uses_context = False

    def __init__(self, recipe: Fp8Noise):
        super().__init__()
        self.recipe = recipe
        self._patched: list[nn.Module] = []

    @property
    def row_local(self) -> bool:
        return self.recipe.row_local

    def _attach(self, model: nn.Module) -> None:
        linears, _ = self.recipe._targets(model)
        for key, m in enumerate(linears):
            m.forward = self._ste_forward(m, key)  # an instance attribute: shadows the class's
            self._patched.append(m)

    def _ste_forward(self, m: nn.Linear, key: int):
        r = self.recipe

        def forward(x: Tensor) -> Tensor:
            w = m.weight
            wq = r.qdq_weight(w.detach()) + (w - w.detach()) if r.weights else w  # exactly qdq(W)
            if r.activations:
                x = r.qdq_act(x.detach(), key) + (x - x.detach())
            return F.linear(x, wq, m.bias)

        return forward

    def _detach(self) -> None:
        for m in self._patched:
            del m.forward
        self._patched.clear()
        self.recipe._amax_hist.clear()

    @contextlib.contextmanager
    def high_precision(self) -> Iterator[None]:
        """The trainer in high precision for the duration (a shadow pass); FP8 again after."""
        model = self.model
        self.detach()
        try:
            yield
        finally:
            self.attach(model)
