"""Controlled β in a vLLM V1 sampler: ratiolab's logit noise as a vLLM logits processor.

A request opts in through `SamplingParams(extra_args={"ratiolab_noise": {...}})` with the keys of
`PositionNoise` (harness/noise/position.py): `sigma`, `seed`, `nu` (Student-t(ν); absent:
Gaussian), `length`, `power` (σ(p) = sigma·(1 + p/length)^power; `power` defaults to 0 here,
constant σ: plain `logit` noise). Requests without the key are left untouched, so the processor
can sit in every engine (it loads from the `vllm.logits_processors` entry point of an installed
ratiolab, or by name: `LLM(..., logits_processors=["harness.integrations.vllm_noise:LogitNoise"])`).

The law. At each decode step of a noisy request, z ← z + σ(p)·ε with ε = `logit_eps(h, V, seed,
nu)`, h the prefix hash of prompt + output so far and p = its length − 1: the noise the HF sampler's
`PositionNoise` (and, at power 0, `LogitNoise`) adds, keyed on (seed, token prefix) alone. So the ε
of every sampled token is recomputed afterwards from the seed and the tokens, with no side
channel: attach the same noise model to the trainer and score the rollout. To first order
Δlog p_y = σ(ε_y − Σ_j p_j ε_j), Var = σ²(1 − 2p_y + ‖p‖²) (the gate law; SNR post §2).

What vLLM records. vLLM V1 applies non-argmax-invariant processors before temperature and
top-k/top-p (vllm/v1/sample/sampler.py), so ε reaches the sampled law divided by T. With
`logprobs_mode="processed_logprobs"` (TRL and verl set it) the recorded log-prob is that of the law
sampled from, ε included: μ. With the default `raw_logprobs` it is the model's log-softmax before
any processor: the sampler draws from q but reports p, a bookkeeping mismatch on top of β that a
correction built on the reported log-probs never sees.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate
from vllm.v1.sample.logits_processor import LogitsProcessor as VllmLogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

from harness.noise.context import prefix_hash
from harness.noise.logit import logit_eps
from harness.noise.position import PositionNoise

KEY = "ratiolab_noise"
SPEC_KEYS = ("sigma", "seed", "nu", "length", "power")


def request_noise(params: SamplingParams) -> PositionNoise | None:
    """The request's noise model from `extra_args[KEY]`, None when it asks for none; a bad spec
    is a ValueError naming the key, the bad value and the valid ones (vLLM answers HTTP 400)."""
    spec = (params.extra_args or {}).get(KEY)
    if spec is None:
        return None
    if not isinstance(spec, dict):
        raise ValueError(f"extra_args[{KEY!r}]={spec!r}: a dict with keys {', '.join(SPEC_KEYS)}")
    bad = sorted(set(spec) - set(SPEC_KEYS))
    if bad:
        raise ValueError(f"extra_args[{KEY!r}]: unknown key(s) {bad}; valid: {list(SPEC_KEYS)}")
    try:
        return PositionNoise(**{"power": 0.0, **spec})
    except (TypeError, ValueError) as e:
        raise ValueError(f"extra_args[{KEY!r}]: {e}") from None


@dataclass
class Row:
    """A noisy request in the persistent batch: its noise, its tokens (vLLM appends to `output`
    in place) and the prefix hash of its first `n` tokens."""

    noise: PositionNoise
    prompt: list[int]
    output: list[int]
    n: int = 0
    h: Tensor | None = None

    def prefix(self) -> tuple[Tensor, int]:
        """(hash, position) of the last token so far; the hash continues from the last call."""
        ids = self.prompt + self.output
        new = torch.tensor(ids[self.n :], dtype=torch.long)[None]
        if new.shape[1]:
            self.h = prefix_hash(new, prev=self.h)[:, -1]
            self.n = len(ids)
        return self.h, self.n - 1


def new_row(params: SamplingParams, prompt: list[int] | None, output: list[int]) -> Row | None:
    noise = request_noise(params)
    if noise is None:
        return None
    if prompt is None:
        raise ValueError(f"extra_args[{KEY!r}] needs prompt token ids (not prompt embeddings)")
    return Row(noise, prompt, output)


class LogitNoise(VllmLogitsProcessor):
    """z ← z + σ(p)·ε on the rows of requests with `extra_args["ratiolab_noise"]`."""

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
        self.rows: dict[int, Row] = {}

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        request_noise(sampling_params)

    def is_argmax_invariant(self) -> bool:
        return False  # ε moves the argmax: greedy decoding must see it too

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.rows, batch_update, new_row)

    def apply(self, logits: Tensor) -> Tensor:
        V = logits.shape[-1]
        for i, row in self.rows.items():
            h, p = row.prefix()
            sigma = row.noise.sigma_at(torch.tensor([p]))
            eps = logit_eps(h, V, row.noise.seed, row.noise.nu)
            logits[i] += (sigma[:, None] * eps)[0].to(logits)
        return logits
