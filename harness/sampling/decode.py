"""Lean KV-cache decoding for dense Llama models.

At the size of the task models (d = 128–192, 4–6 layers) a decode step of the Hugging Face model
is mostly Python and tensor bookkeeping: per step it builds a causal mask, concatenates every
layer's KV cache and calls ~30 modules. `LeanDecoder` runs the same arithmetic as
`LlamaForCausalLM` on the model's own weights with a preallocated (static) KV cache, and nothing
else. The prompt is still prefilled by the Hugging Face model (once per generate call), so only
the per-token decode steps take this path. It calls the same kernels in the same order as the
Hugging Face decode step, so rollouts are bit-identical to it, in fp32 and bf16
(tests/test_engines.py; also teacher-forced logits against the full forward).

Only used where it is exact: a plain `LlamaForCausalLM` (no biases, SiLU MLP) with no hooks on any
module, so attached noise models (which all work through hooks) always take the full model path.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import functional as F
from transformers import DynamicCache, LlamaForCausalLM, PreTrainedModel


def supports(model: PreTrainedModel) -> bool:
    """True when `LeanDecoder` computes exactly what `model` computes."""
    cfg = model.config
    if type(model) is not LlamaForCausalLM:
        return False
    if cfg.attention_bias or cfg.mlp_bias or cfg.hidden_act != "silu":
        return False
    if getattr(cfg, "pretraining_tp", 1) != 1:
        return False
    return not any(
        m._forward_hooks or m._forward_pre_hooks or m._backward_hooks for m in model.modules()
    )


def _rms(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """LlamaRMSNorm: normalise in fp32, scale in the model dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


class LeanDecoder:
    """Decode steps after a Hugging Face prefill.

    `cache`: the prefill's DynamicCache ([B, kv_heads, P, head_dim] per layer, keys after RoPE);
    `prompt_mask`: [B, P] (left padding); room is made for `max_new_tokens` more positions."""

    @torch.no_grad()
    def __init__(
        self, model: LlamaForCausalLM, cache: DynamicCache, prompt_mask: Tensor, max_new_tokens: int
    ):
        cfg = model.config
        m = model.model
        self.eps = cfg.rms_norm_eps
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.embed = m.embed_tokens.weight
        self.norm = m.norm.weight
        self.lm_head = model.lm_head.weight
        self.layers = [  # per layer: the weights in the order the step uses them
            (
                layer.input_layernorm.weight,
                layer.self_attn.q_proj.weight,
                layer.self_attn.k_proj.weight,
                layer.self_attn.v_proj.weight,
                layer.self_attn.o_proj.weight,
                layer.post_attention_layernorm.weight,
                layer.mlp.gate_proj.weight,
                layer.mlp.up_proj.weight,
                layer.mlp.down_proj.weight,
            )
            for layer in m.layers
        ]
        self.scale = self.head_dim**-0.5
        B, P = prompt_mask.shape
        L = P + max_new_tokens
        self.keys, self.values = [], []
        for layer in cache.layers:
            k = layer.keys.new_zeros(B, self.n_kv, L, self.head_dim)
            v = torch.zeros_like(k)
            k[:, :, :P], v[:, :, :P] = layer.keys, layer.values
            self.keys.append(k)
            self.values.append(v)
        self.key_mask = torch.ones(B, 1, 1, L, dtype=torch.bool, device=prompt_mask.device)
        self.key_mask[:, 0, 0, :P] = prompt_mask.bool()  # False: left padding
        self.padded = not bool(prompt_mask.bool().all())
        # RoPE tables from the model's own rotary module (its scaling rules included)
        pos = torch.arange(L, device=prompt_mask.device)[None]
        cos, sin = m.rotary_emb(self.embed[:1, None], pos)
        self.cos, self.sin = cos[0], sin[0]  # [L, head_dim]
        self.pos = prompt_mask.long().sum(1) - 1  # position of the last token written, per row
        self.t = P  # next cache slot

    @torch.no_grad()
    def keep(self, rows: Tensor) -> None:
        """Keep only the batch rows `rows` (finished rows leave the decode batch)."""
        self.keys = [k[rows] for k in self.keys]
        self.values = [v[rows] for v in self.values]
        self.key_mask, self.pos = self.key_mask[rows], self.pos[rows]

    def _attend(self, q: Tensor, K: Tensor, V: Tensor, mask: Tensor) -> Tensor:
        """SDPA called as transformers calls it for one query token, so the kernels (and the
        rounding, which matters in bf16) are the same: without padding no mask and native GQA;
        with padding the query heads of each KV group packed as query positions, plus the mask."""
        B, nh, d = q.shape
        nkv = K.shape[1]
        if not self.padded:
            return F.scaled_dot_product_attention(
                q[:, :, None], K, V, scale=self.scale, enable_gqa=nh != nkv
            )
        return F.scaled_dot_product_attention(
            q.view(B, nkv, nh // nkv, d), K, V, attn_mask=mask, scale=self.scale
        )

    @torch.no_grad()
    def step(self, tok: Tensor) -> Tensor:
        """Feed one token per row ([B]); return the next-token logits [B, V] (fp32)."""
        B, nh, nkv, d, t = tok.shape[0], self.n_heads, self.n_kv, self.head_dim, self.t
        if t >= self.keys[0].shape[2]:
            raise RuntimeError(f"LeanDecoder: cache full ({t} positions)")
        self.pos = self.pos + 1
        cos, sin = self.cos[self.pos][:, None], self.sin[self.pos][:, None]  # [B, 1, d]
        mask = self.key_mask[..., : t + 1]
        x = self.embed[tok]
        for (ln1, wq, wk, wv, wo, ln2, wg, wu, wd), K, V in zip(
            self.layers, self.keys, self.values
        ):
            h = _rms(x, ln1, self.eps)
            K[:, :, t] = _rotate(F.linear(h, wk).view(B, nkv, d), cos, sin)
            V[:, :, t] = F.linear(h, wv).view(B, nkv, d)
            q = _rotate(F.linear(h, wq).view(B, nh, d), cos, sin)
            a = self._attend(q, K[:, :, : t + 1], V[:, :, : t + 1], mask)
            x = x + F.linear(a.reshape(B, nh * d), wo)
            h = _rms(x, ln2, self.eps)
            x = x + F.linear(F.silu(F.linear(h, wg)) * F.linear(h, wu), wd)
        self.t = t + 1
        return F.linear(_rms(x, self.norm, self.eps), self.lm_head).float()
