"""`fp8`: fake-quantised FP8 sampler and the public `fp8_qdq`.

Scales are dequant scales s (x ≈ s·q, the DeepGEMM / vLLM / MX convention); torchao and
TransformerEngine store the multiplier 1/s. Values are saturated to ±max *before* the cast: eager
casts differ across torch versions (e4m3fn saturates on 2.13, e5m2 overflows to inf, fnuz → NaN).
Granularities:
  tensor   one scale per tensor (current scaling; `amax=` for delayed scaling)
  row      one scale per row of the last dim: per token for activations, per output channel for
           weights W[N, K] (torchao ROWWISE, vLLM per-token)
  block    DeepSeek-V3: `block`=(1, 128) activation tiles, (128, 128) weight blocks over the last
           two dims; shapes that are not multiples are zero-padded (DeepGEMM)
  mxfp8    OCP MX: 32 elements along the last dim share an E8M0 scale; `mx_rounding` "floor"
           (OCP spec, torchao default: s = 2^(⌊log2 amax⌋ − emax_elem), may clip) or "rceil"
           (cuBLAS / Blackwell: s = 2^⌈log2(amax / max)⌉)
`pow2=True` rounds s up to a power of two (torchao rowwise, DeepGEMM UE8M0); never overflows.

Two kernels run a recipe (`Fp8Noise(kernel=...)`): "emulated" (fake quant: quantise-dequantise,
then the high-precision matmul) and "scaled_mm" (the real FP8 GEMM, `torch._scaled_mm`: E4M3
operands, fp32 accumulation, fp32 dequant scales applied in its epilogue; Ada/Hopper, or the CPU
where this torch build runs it). Both quantise with the same amax and scale rule, so the only
difference between them is the GEMM itself.
"""

from __future__ import annotations

import contextlib
import functools
from collections import deque
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from harness.base.models import decoder_layers
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
KERNELS = ("emulated", "scaled_mm")
SCALED_MM_GRANULARITIES = ("tensor", "row")
SCALED_MM_ALIGN = 16  # torch._scaled_mm on CUDA: K and N multiples of 16
_AMAX_EPS = 1e-12


def _fmt(fmt: str) -> tuple[torch.dtype, float, int]:
    if fmt not in FORMATS:
        raise ValueError(f"unknown FP8 format {fmt!r}; valid: {', '.join(FORMATS)}")
    return FORMATS[fmt]


def _quant(x: Tensor, s: Tensor, dtype8: torch.dtype, fmax: float) -> Tensor:
    return (x / s).clamp_(-fmax, fmax).to(dtype8)


def _cast(x: Tensor, s: Tensor, dtype8: torch.dtype, fmax: float) -> Tensor:
    return _quant(x, s, dtype8, fmax).float() * s


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
        a = (
            xf.abs().amax()
            if amax is None
            else torch.as_tensor(amax, dtype=torch.float32, device=xf.device)
        )
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


# --- the real FP8 GEMM ---------------------------------------------------------------------------


def fp8_quantise(
    x: Tensor, fmt: str = "e4m3", granularity: str = "tensor", *, pow2: bool = False
) -> tuple[Tensor, Tensor]:
    """x → (q, s): q in FP8 (x's shape), s the fp32 dequant scale (0-dim for "tensor", [..., 1]
    for "row"), with the amax and scale rule of `fp8_qdq`, so that
    fp8_qdq(x, fmt, granularity, pow2=pow2) == (q.float() * s).to(x.dtype) bit for bit."""
    dtype8, fmax, _ = _fmt(fmt)
    if granularity not in SCALED_MM_GRANULARITIES:
        raise ValueError(
            f"fp8_quantise: granularity={granularity!r}; valid: "
            f"{', '.join(SCALED_MM_GRANULARITIES)}"
        )
    xf = x.float()
    a = xf.abs().amax() if granularity == "tensor" else xf.abs().amax(dim=-1, keepdim=True)
    s = _dequant_scale(a, fmax, pow2)
    return _quant(xf, s, dtype8, fmax), s


def fp8_linear(
    q_x: Tensor, s_x: Tensor, q_w: Tensor, s_w: Tensor, out_dtype: torch.dtype
) -> Tensor:
    """(s_x·q_x) @ (s_w·q_w)ᵀ as one FP8 GEMM (`torch._scaled_mm`): q_x [M, K], q_w [N, K] in FP8;
    s_x 0-dim or [M, 1], s_w 0-dim or [N, 1] fp32 dequant scales; → [M, N] in `out_dtype`.
    The kernel takes two singletons or two row vectors (scale_a [M, 1], scale_b [1, N]); with
    one of each, the singleton is broadcast to a row vector (the same numbers). On the CPU both
    are: its tensor-wise kernel is a scalar loop (torch 2.13: 8.8 s for a 64×576×1536 GEMM,
    row-wise 0.01 s)."""
    scale_a, scale_b = s_x, s_w.reshape(1, -1) if s_w.dim() else s_w
    if s_x.dim() != s_w.dim() or q_x.device.type == "cpu":
        scale_a = s_x.reshape(-1, 1).expand(q_x.shape[0], 1).contiguous()
        scale_b = s_w.reshape(1, -1).expand(1, q_w.shape[0]).contiguous()
    return torch._scaled_mm(  # CUDA: a row-major, b column-major (q_w [N, K] row-major, .t())
        q_x.contiguous(), q_w.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype
    )


def fp8_kernel_available(
    device: torch.device | str,
    out_dtype: torch.dtype = torch.float32,
    granularity: str = "tensor",
    act_granularity: str = "tensor",
) -> bool:
    """Whether `fp8_linear` runs on `device` for this output dtype and these scalings: a CUDA
    device of capability >= (8, 9) (Ada, Hopper) or the CPU, confirmed by a 16×16 trial GEMM
    (cached). Some combinations are refused by the kernel itself: row-wise scaling with an fp32
    output needs cuBLAS on capability 9.0 (Ada: bf16/fp16 only)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            return False
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.get_device_capability(dev) < (8, 9):
            return False
    elif dev.type != "cpu":
        return False
    return _trial_gemm(str(dev), out_dtype, granularity, act_granularity)


@functools.cache
def _trial_gemm(
    device: str, out_dtype: torch.dtype, granularity: str, act_granularity: str
) -> bool:
    """ones(16, 16) @ ones(16, 16)ᵀ = 16 everywhere (to the scales' rounding) when it runs."""
    x = torch.ones(16, 16, device=device)
    try:
        q_x, s_x = fp8_quantise(x, "e4m3", act_granularity)
        q_w, s_w = fp8_quantise(x, "e4m3", granularity)
        y = fp8_linear(q_x, s_x, q_w, s_w, out_dtype)
    except (RuntimeError, ValueError, NotImplementedError):
        return False
    return bool(((y.float() - 16).abs() < 0.1).all())


_SCALED_MM_NEEDS = {  # kwarg: (its valid values with kernel="scaled_mm", why)
    "fmt": (("e4m3",), "E4M3 operands"),
    "weights": ((True,), "the GEMM takes an FP8 weight"),
    "activations": ((True,), "the GEMM takes an FP8 input"),
    "granularity": (SCALED_MM_GRANULARITIES, "the kernel's scalings"),
    "act_granularity": (SCALED_MM_GRANULARITIES, "the kernel's scalings"),
    "kv_cache": ((False,), "an FP8 KV cache needs FP8 attention kernels; use kernel='emulated'"),
}


def _check_scaled_mm(**kwargs) -> None:
    for key, value in kwargs.items():
        valid, why = _SCALED_MM_NEEDS[key]
        if value not in valid:
            raise ValueError(
                f"fp8: kernel='scaled_mm' does not take {key}={value!r} ({why}); valid: "
                f"{', '.join(map(repr, valid))}"
            )


# --- the noise model ----------------------------------------------------------------------------


class Fp8Noise(NoiseModel):
    """FP8 sampler: weights quantised once per attach / `on_weight_sync()` (not per forward),
    activations (inputs of the quantised linears) per forward, optionally the KV cache.

    Defaults follow vLLM online fp8 / the harness default: q/k/v/o + gate/up/down
    (and MoE expert weights) in FP8; lm_head, embeddings, norms and the router in high precision.
    `granularity` is the weight scaling; `act_granularity` (default: matching recipe — tensor,
    row → per token, block → 1×128, mxfp8) may also be "delayed" (per-tensor, amax history of
    `amax_history_len` forwards, TE DelayedScaling with amax_compute_algo='max').
    Expert activations stay high precision (the fused expert GEMMs are not hooked).
    `kv_cache`: K and V (post-RoPE, as cached) in FP8 with scale 1.0 (`kv_scale="one"`, vLLM's
    default) or per token and head (`"token"`); both are idempotent, so prefill and cached decode
    see the same values.

    `kernel="scaled_mm"` runs every targeted nn.Linear (`modules` in the decoder layers, and
    lm_head when `lm_head`) as a real FP8 GEMM (`fp8_linear`): the weight quantised once per
    attach / `on_weight_sync()` (kept as FP8 + scales, the parameter itself untouched), the input
    per call (current scaling), the bias added after, out in the input's dtype. It needs E4M3,
    weights and activations on, `granularity` and `act_granularity` in (tensor, row), no KV
    cache, and on the model: K and N multiples of 16 on every targeted linear, and a device that
    runs the kernel (`fp8_kernel_available`); all checked before any compute. The other weight
    targets (fused MoE experts, router, norms, embeddings) are quantised as in the emulation
    (weight swap, high-precision compute), so the two kernels differ only in the linears' GEMM.
    """

    uses_context = False

    def __init__(
        self,
        *,
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
        kernel: str = "emulated",
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
        if kernel not in KERNELS:
            raise ValueError(f"fp8: unknown kernel {kernel!r}; valid: {', '.join(KERNELS)}")
        if kernel == "scaled_mm":
            _check_scaled_mm(
                fmt=fmt,
                weights=weights,
                activations=activations,
                granularity=granularity,
                act_granularity=act_granularity,
                kv_cache=kv_cache,
            )
            if not (tuple(modules) or lm_head):
                raise ValueError(
                    "fp8: kernel='scaled_mm' needs a linear to run: modules=() with "
                    "lm_head=False leaves only weight targets (experts, router, norms); valid: "
                    f"modules from {', '.join(LINEARS)}, or lm_head=True"
                )
        self.kernel = kernel
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
        self._gemm: list[tuple[nn.Linear, Tensor, Tensor]] = []  # scaled_mm: (linear, q_w, s_w)

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

    def check_model(self, model: nn.Module) -> None:
        """The model-side requirements of `kernel="scaled_mm"` (a no-op for the emulation),
        raised before any compute: every targeted linear has K and N multiples of 16 (CUDA's
        requirement, enforced on every device so that a recipe fails alike on the CPU), and its
        device runs the kernel at the model's dtype and this recipe's scalings."""
        if self.kernel != "scaled_mm":
            return
        linears, _ = self._targets(model)
        if not linears:
            raise ValueError(
                f"fp8: kernel='scaled_mm' found no linear to run in {type(model).__name__} "
                f"(modules={list(self.modules)}, lm_head={self.lm_head})"
            )
        names = {id(m): name for name, m in model.named_modules()}
        for m in linears:
            N, K = m.weight.shape
            if N % SCALED_MM_ALIGN or K % SCALED_MM_ALIGN:
                raise ValueError(
                    f"fp8: kernel='scaled_mm' needs K and N multiples of {SCALED_MM_ALIGN}; "
                    f"layer {names[id(m)]} has weight [N, K] = [{N}, {K}] (use kernel='emulated', "
                    "or leave it out of modules / lm_head)"
                )
        for dev, dtype in {(m.weight.device, m.weight.dtype) for m in linears}:
            if not fp8_kernel_available(dev, dtype, self.granularity, self.act_granularity):
                cap = torch.cuda.get_device_capability(dev) if dev.type == "cuda" else None
                raise RuntimeError(
                    f"fp8: kernel='scaled_mm' cannot run on {dev}"
                    f"{f' (capability {cap[0]}.{cap[1]})' if cap else ''} with out dtype {dtype}, "
                    f"granularity={self.granularity!r}, act_granularity={self.act_granularity!r}: "
                    "torch._scaled_mm needs CUDA capability >= 8.9 or a CPU build that has it "
                    "(row-wise scaling with fp32 out: capability 9.0); use kernel='emulated'"
                )

    def _attach(self, model: nn.Module) -> None:
        linears, params = self._targets(model)
        if self.kernel == "scaled_mm":
            self.check_model(model)
            for m in linears:
                if "forward" in vars(m):
                    raise RuntimeError(
                        f"fp8: kernel='scaled_mm' cannot replace the forward of {m}: it already "
                        "has one of its own (an Fp8Trainer or another scaled_mm attached?)"
                    )
            for i, m in enumerate(linears):
                self._gemm.append((m, *self.quantise_weight(m.weight.data)))
                m.forward = self._gemm_forward(i)  # an instance attribute: shadows the class's
            gemm = {id(m) for m in linears}
            params = [(m, name) for m, name in params if id(m) not in gemm]
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
        if self.activations and self.kernel == "emulated":
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

    def quantise_weight(self, w: Tensor) -> tuple[Tensor, Tensor]:
        """scaled_mm: W [N, K] → (q_w, s_w), FP8 and its fp32 dequant scale, on W's device."""
        return fp8_quantise(w, self.fmt, self.granularity, pow2=self.pow2)

    def _gemm_forward(self, i: int):
        def forward(x: Tensor) -> Tensor:
            m, q_w, s_w = self._gemm[i]  # on_weight_sync replaces the entry
            q_x, s_x = fp8_quantise(
                x.reshape(-1, x.shape[-1]), self.fmt, self.act_granularity, pow2=self.pow2
            )
            y = fp8_linear(q_x, s_x, q_w, s_w, x.dtype)
            if m.bias is not None:
                y = y + m.bias
            return y.reshape(*x.shape[:-1], y.shape[-1])

        return forward

    def on_weight_sync(self) -> None:
        """Re-quantise from the model's current weights (the engine copied the trainer's weights
        in, in place or by replacing `.data`); weights still equal to our quantised copy keep the
        stored high-precision original. scaled_mm linears re-quantise their (untouched)
        parameter."""
        self._gemm = [(m, *self.quantise_weight(m.weight.data)) for m, _, _ in self._gemm]
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
        for m, _, _ in self._gemm:
            del m.forward
        self._gemm.clear()
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
# too, or the mask silently becomes None (non-causal attention).
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
    """Full-pipeline FP8 (Calibrated Clipping, arXiv 2609.22870; Jet-RL's unified precision
    flow): the trainer's forward runs the sampler's FP8 recipe `recipe` (an Fp8Noise: format,
    granularities, which linears) with a straight-through gradient. Each quantised linear
    computes F.linear(x̃, W̃) with W̃ = sg(qdq(W)) + (W − sg(W)) (value qdq(W) exactly, gradient
    1 into the high-precision master W), and x̃ likewise when `recipe.activations`. Linears
    only: fused MoE experts, norms, embeddings and the KV cache stay high precision on the
    trainer side (documented gap).
    The trainer always emulates (qdq + high-precision matmul, whatever `recipe.kernel`): with a
    scaled_mm sampler, the mismatch left at θ = θ_old is the real GEMM's against the emulation's.
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


def high_precision(engine):
    """A context in which a trainer-side engine (harness.sampling.engines.Engine) runs in high
    precision (engine.trainer_fp8: the shadow pass, evaluation); a no-op for every other
    engine."""
    fp8 = engine._noise_of(Fp8Trainer) if engine is not None else None
    return fp8.high_precision() if fp8 is not None else contextlib.nullcontext()


class ShadowPass:
    """engine.trainer_fp8: calibrated clipping's high-precision (π_θ, π_old) of rows of rollout
    `ro`. `behaviour(rows)` is π_old^hp: it must run before the batch's first update (at
    staleness 0 `old_policy` is `policy` itself or None, still at the behaviour weights then);
    `current(rows)` is π_θ^hp at the weights the calibrating minibatch trains."""

    def __init__(self, policy, old_policy, ro, mask_replay: bool):
        self.policy, self.ro, self.mask_replay = policy, ro, mask_replay
        self.old_policy = policy if old_policy is None else old_policy

    def _hp(self, engine, rows: Tensor) -> Tensor:
        with high_precision(engine):
            return engine.logp(self.ro, rows, stats=False, mask_replay=self.mask_replay)["logp"]

    def behaviour(self, rows: Tensor) -> Tensor:
        return self._hp(self.old_policy, rows)

    def current(self, rows: Tensor) -> Tensor:
        return self._hp(self.policy, rows)
