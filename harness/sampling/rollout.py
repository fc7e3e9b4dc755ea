"""What both sampler engines (harness.sampling.engines.Engine, harness.sampling.ct2.Ct2Engine) hand
the trainer: the `Rollout`, and the prompt, request and weight-sync helpers they share."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import PreTrainedModel


@dataclass
class Rollout:
    """B = n_prompts × n rows; row i*n + j is the j-th sample of prompt i."""

    prompt_ids: Tensor  # [B, P] left-padded
    prompt_mask: Tensor  # [B, P] 1 on prompt tokens
    response_ids: Tensor  # [B, T] right-padded with pad_token_id
    response_mask: Tensor  # [B, T] float, 1 up to and including EOS
    logp_mu: Tensor  # [B, T] log μ(y_t) under the processed sampling law
    support: Tensor | None  # [B, T, K] kept token ids (−1 padded); None when nothing truncated
    prompt_index: Tensor  # [B] index of the prompt each row answers
    temperature: float = 1.0
    routing: Tensor | None = None  # [B, S, n_moe_layers, k] experts the sampler chose (R3)

    @property
    def tokens(self) -> Tensor:
        return torch.cat([self.prompt_ids, self.response_ids], 1)

    @property
    def attention_mask(self) -> Tensor:
        return torch.cat([self.prompt_mask, self.response_mask.to(self.prompt_mask.dtype)], 1)

    @property
    def n_prompt(self) -> int:
        return self.prompt_ids.shape[1]


def encode_prompts(tokenizer, prompts: list[str] | list[list[int]]) -> tuple[Tensor, Tensor]:
    """Left-pad token lists (or raw strings, tokenized as is) into [N, P] ids and mask."""
    if not prompts:
        raise ValueError("generate: no prompts given")
    ids = [
        tokenizer(p, add_special_tokens=False).input_ids if isinstance(p, str) else list(p)
        for p in prompts
    ]
    if any(len(x) == 0 for x in ids):
        raise ValueError("generate: empty prompt")
    width = max(len(x) for x in ids)
    out = torch.full((len(ids), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(ids), width), dtype=torch.long)
    for i, x in enumerate(ids):
        out[i, width - len(x) :] = torch.tensor(x)
        mask[i, width - len(x) :] = 1
    return out, mask


def pack_rollout(
    ids: Tensor, attn: Tensor, toks: list[Tensor], mus: list[Tensor], sups: list[Tensor] | None,
    pad_id: int, n: int, temperature: float, device: torch.device,
) -> Rollout:  # fmt: skip
    """The `Rollout` of an engine that samples row by row (CTranslate2, vLLM): `ids`/`attn` the
    [B, P] prompts of the B = n_prompts × n rows, per row its sampled ids `toks` [L_b] and their
    log μ `mus` [L_b], and with a truncated law its kept support `sups` [L_b, K_b] (−1 padded;
    None: nothing truncated). Right-padded into [B, T] and [B, T, K], handed over on `device`."""
    B, T = len(toks), max(len(t) for t in toks)
    response = torch.full((B, T), pad_id, dtype=torch.long)
    mask = torch.zeros(B, T)
    logp_mu = torch.zeros(B, T)
    for b, (t, mu) in enumerate(zip(toks, mus)):
        response[b, : len(t)], mask[b, : len(t)], logp_mu[b, : len(t)] = t, 1.0, mu
    support = None
    if sups is not None:
        K = max(s.shape[1] for s in sups)
        support = torch.full((B, T, K), -1, dtype=torch.long)
        for b, s in enumerate(sups):
            support[b, : s.shape[0], : s.shape[1]] = s
        support = support.to(device)
    return Rollout(
        prompt_ids=ids.to(device),
        prompt_mask=attn.to(device),
        response_ids=response.to(device),
        response_mask=mask.to(device),
        logp_mu=logp_mu.to(device),
        support=support,
        prompt_index=torch.arange(B // n).repeat_interleave(n).to(device),
        temperature=temperature,
    )


def check_request(n: int, max_new_tokens: int, n_prompt: int, max_len: int | None) -> None:
    """A generate call's sizes, before any compute (both engines)."""
    if n < 1 or max_new_tokens < 1:
        raise ValueError(f"need n >= 1 and max_new_tokens >= 1, got n={n}, {max_new_tokens=}")
    if max_len is not None and n_prompt + max_new_tokens > max_len:
        raise ValueError(
            f"prompt of {n_prompt} tokens + max_new_tokens={max_new_tokens} exceeds the "
            f"model context of {max_len} tokens; shorten the prompt or max_new_tokens"
        )


def eos_ids(model: PreTrainedModel) -> Tensor:
    eos = model.config.eos_token_id if model.config.eos_token_id is not None else []
    return torch.tensor(eos if isinstance(eos, list) else [eos], dtype=torch.long)


@torch.no_grad()
def copy_weights(model: torch.nn.Module, state: dict[str, Tensor]) -> None:
    """Weight sync: every parameter of `model` from `state` (cast to the model's dtype)."""
    for name, p in model.named_parameters():
        if name not in state:
            raise KeyError(f"weight sync: parameter {name} missing from the source weights")
        p.copy_(state[name])
