"""What every sampler engine hands the trainer, and what the loop asks of one: the `Rollout`, the
`Sampler` protocol (HF `Engine`, `Ct2Engine`, `VllmEngine`), `SecondEngine` (the part CTranslate2
and vLLM share: a timed weight sync, one process per batch) and the prompt, request and
weight-sync helpers."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from transformers import PreTrainedModel


@dataclass(frozen=True, kw_only=True)
class Sampling:
    """What μ samples: n responses per prompt, at most max_new_tokens each, under temperature /
    top-p / top-k (the law `logp_mu` is taken under)."""

    n: int = 1
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0


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
    ids: Tensor,
    attn: Tensor,
    toks: list[Tensor],
    mus: list[Tensor],
    sups: list[Tensor] | None,
    pad_id: int,
    sampling: Sampling,
    device: torch.device,
) -> Rollout:
    """The `Rollout` of an engine that samples row by row (CTranslate2, vLLM) under `sampling`:
    `ids`/`attn` the [B, P] prompts of the B = n_prompts × n rows, per row its sampled ids
    `toks` [L_b] and their log μ `mus` [L_b], and with a truncated law its kept support `sups`
    [L_b, K_b] (−1 padded; None: nothing truncated). Right-padded into [B, T] and [B, T, K],
    handed over on `device`."""
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
        prompt_index=torch.arange(B // sampling.n).repeat_interleave(sampling.n).to(device),
        temperature=sampling.temperature,
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


class Sampler:
    """μ as the loop uses it: sample G responses per prompt (`logp_mu` under the law it sampled
    from), take the trainer's new weights, release what it holds. The HF `Engine`, `Ct2Engine`
    and `VllmEngine` implement `sample` (the arguments of `generate`, positional),
    `load_weights_from_state` and `close`."""

    tokenizer: Any
    noise: list  # the injected β models (empty for an engine whose β is its own)

    @torch.no_grad()
    def generate(
        self,
        prompts: list[str] | list[list[int]],
        sampling: Sampling,
        *,
        seed: int = 0,
        progress: bool = False,
        batch_rows: tuple[int, int] | None = None,
    ) -> Rollout:
        """`sampling.n` samples of each prompt (text, or token ids) under `sampling`'s law, seeded
        by `seed`. `batch_rows` (first, total): this call's rows are rows first, first + 1, ...
        of a batch of `total` rows whose random draws it shares (a rank's share of the step's
        groups): row i gets the draws row first + i gets when one call samples the whole
        batch."""
        return self.sample(prompts, sampling, seed, progress, batch_rows)

    def sample(
        self,
        prompts: list[str] | list[list[int]],
        sampling: Sampling,
        seed: int,
        progress: bool,
        batch_rows: tuple[int, int] | None,
    ) -> Rollout:
        raise NotImplementedError

    def load_weights_from_state(self, state: dict[str, Tensor]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Release what the engine holds (a worker, temp folders); nothing by default."""


class SecondEngine(Sampler):
    """μ in an inference engine of its own (CTranslate2, vLLM). `self.model`, an HF model, holds
    the weights the engine converts or reloads; a weight sync copies the trainer's weights into
    it, lets the engine `reload`, and keeps the seconds that took in `sync_s`. One process
    samples the whole batch: a rank's share (`batch_rows`) is refused (several ranks are
    refused with these engines before any compute, harness.runs.validate.validate_ranks)."""

    name: str  # engine.sampler
    model: torch.nn.Module
    sync_s: list[float]

    def reload(self) -> None:
        raise NotImplementedError

    def load_weights_from_state(self, state: dict[str, Tensor]) -> None:
        t = time.perf_counter()
        copy_weights(self.model, state)
        self.reload()
        self.sync_s.append(time.perf_counter() - t)

    def whole_batch(self, batch_rows: tuple[int, int] | None) -> None:
        if batch_rows is not None:
            raise ValueError(f"engine.sampler={self.name} samples the whole batch in one process")
