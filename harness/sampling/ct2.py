"""CTranslate2 as the sampler μ: a second inference engine with its own kernels and
quantisation, so β is what a real engine disagrees with the trainer on, not injected noise.

The current weights are converted (transformers → CTranslate2, float32 weights; `compute_type`
quantises them at load: float32 = kernel-only β, int8_float32 / int16 = quantisation β) into a
folder named by their checksum, written to a temp folder and renamed into place, so a folder that
exists is complete. CTranslate2 samples with its KV cache and returns, per step, the raw logits
of its decode path (`return_logits_vocab`); `logp_mu` is the log-prob of the sampled token under
the processed law of those logits (temperature, top-k, top-p:
`harness.sampling.logprobs.process_logits`, the HF engine's law), and the chi-square test in
tests/test_ct2.py shows that this is the law CTranslate2 sampled from. Only the sampler: π_θ and
π_old stay the HF trainer.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch import Tensor
from tqdm.auto import tqdm

from harness.base.io import make_temp_dir
from harness.base.models import cache_dir, weights_sha
from harness.sampling.logprobs import check_sampling, kept_support, process_logits
from harness.sampling.rollout import (
    Rollout,
    Sampling,
    SecondEngine,
    check_request,
    encode_prompts,
    eos_ids,
    pack_rollout,
)

# CPU compute types: int8_float32 = int8 GEMMs (int8 weights × dynamically quantised int8
# activations), float32 elsewhere; `int8` resolves to the same on CPU; int16 weights and GEMMs
COMPUTE_TYPES = ("float32", "int8_float32", "int8", "int16")
INSTALL = "pip install -e '.[ct2]'  (or: pip install ctranslate2==4.8.5)"
LOGITS_BYTES = 1 << 28  # per generate_batch call: rows × steps × vocab float32 logits held


def require_ct2():
    """The ctranslate2 module, or an ImportError that says how to install it."""
    try:
        import ctranslate2
    except ImportError as e:
        raise ImportError(
            f"engine.sampler=ct2 needs CTranslate2, which is not installed here: {INSTALL}"
        ) from e
    return ctranslate2


def check_compute_type(compute_type: str) -> None:
    if compute_type not in COMPUTE_TYPES:
        raise ValueError(
            f"engine.ct2.compute_type={compute_type!r}; valid: {', '.join(COMPUTE_TYPES)}"
        )


def convert(
    model: torch.nn.Module, tokenizer, root: str | Path | None = None, sha: str | None = None
) -> Path:
    """The CTranslate2 folder of `model`'s current weights, `root`/<weights checksum `sha`>
    (default root: the ratiolab cache's ct2/). Converted once: into a temp folder beside it,
    then renamed, so an interrupted conversion leaves no folder under the final name."""
    ct2 = require_ct2()
    root = Path(root) if root is not None else cache_dir() / "ct2"
    dest = root / (sha or weights_sha(model))
    if dest.is_dir():
        return dest
    root.mkdir(parents=True, exist_ok=True)
    tmp = make_temp_dir(f".{dest.name}.", root)
    try:
        model.save_pretrained(tmp / "hf")
        tokenizer.save_pretrained(tmp / "hf")
        ct2.converters.TransformersConverter(str(tmp / "hf")).convert(str(tmp / "ct2"))
        try:
            os.rename(tmp / "ct2", dest)
        except OSError:
            if not dest.is_dir():  # not another process finishing the same conversion first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


class Ct2Engine(SecondEngine):
    """The sampler μ on CTranslate2 (CPU). `model` (an HF causal LM, float32) holds the weights
    that are converted; a weight sync copies new weights into it and converts them again (the
    cost is kept in `sync_s`). Same `generate` contract as `harness.sampling.engines.Engine`; the
    rollout comes back on the device of `model`'s parameters (the trainer's). CTranslate2 itself
    runs on the CPU even then: its CUDA build is another wheel (CUDA 12), not the project's."""

    name = "ct2"

    def __init__(
        self, model, tokenizer, compute_type: str = "float32", cache: str | Path | None = None
    ):
        check_compute_type(compute_type)
        self.ct2 = require_ct2()
        self.model = model.float()
        self.tokenizer = tokenizer
        self.compute_type = compute_type
        self.noise: list = []  # β is the engine's own: nothing is injected
        self.pad_id = tokenizer.pad_token_id
        self.eos_ids = eos_ids(model)
        self.device = next(model.parameters()).device  # where the rollout is handed over
        self.max_len = getattr(model.config, "max_position_embeddings", None)
        self.sync_s: list[float] = []  # seconds per weight sync (conversion)
        self.load_s: list[float] = []  # seconds per generate call spent loading the Generator
        # weight syncs convert into a folder of this engine's own, removed as it moves on
        self._syncs = Path(tempfile.mkdtemp(prefix="ratiolab-ct2-"))
        self.path = convert(self.model, tokenizer, cache)

    def load(self, seed: int = 0):
        """A fresh CTranslate2 Generator on the current weights, its sampling seeded by `seed`.
        Fresh each time: CTranslate2 seeds a worker thread's random generator from the global
        seed when the thread starts, so a Generator that has sampled once would continue its
        stream instead of restarting at `seed` (tests/test_ct2.py)."""
        t = time.perf_counter()
        self.ct2.set_random_seed(seed)
        gen = self.ct2.Generator(
            str(self.path),
            device="cpu",
            compute_type=self.compute_type,
            intra_threads=torch.get_num_threads(),
            inter_threads=1,
        )
        self.load_s.append(time.perf_counter() - t)
        return gen

    def close(self) -> None:
        shutil.rmtree(self._syncs, ignore_errors=True)

    def reload(self) -> None:
        """The new weights are converted (nothing to do when unchanged)."""
        sha = weights_sha(self.model)
        if sha != self.path.name:
            old, self.path = self.path, convert(self.model, self.tokenizer, self._syncs, sha)
            if old.parent == self._syncs:
                shutil.rmtree(old, ignore_errors=True)

    def sample(self, prompts, sampling: Sampling, seed, progress, batch_rows) -> Rollout:
        n, max_new_tokens = sampling.n, sampling.max_new_tokens
        temperature, top_p, top_k = sampling.temperature, sampling.top_p, sampling.top_k
        self.whole_batch(batch_rows)
        check_sampling(temperature, top_k, top_p)
        ids, attn = encode_prompts(self.tokenizer, prompts)
        check_request(n, max_new_tokens, ids.shape[1], self.max_len)
        ids, attn = ids.repeat_interleave(n, 0), attn.repeat_interleave(n, 0)
        starts = [
            self.tokenizer.convert_ids_to_tokens(r[m.bool()].tolist()) for r, m in zip(ids, attn)
        ]
        truncated = top_k > 0 or top_p < 1.0
        V = self.model.config.vocab_size
        chunk = max(1, LOGITS_BYTES // (4 * V * max_new_tokens))
        # one generate_batch call per prompt length (and per `chunk` rows): in a batch of mixed
        # prompt lengths CTranslate2 4.8's logits for the longer prompts' rows are not the
        # model's (0.1–0.25 off on the tiny Llama; tests/test_ct2.py)
        lengths = attn.sum(1).tolist()
        calls = [
            rows[i : i + chunk]
            for L in sorted(set(lengths))
            for rows in [[b for b, x in enumerate(lengths) if x == L]]
            for i in range(0, len(rows), chunk)
        ]
        generator = self.load(seed)
        toks: list[Tensor] = [torch.empty(0)] * len(starts)
        mus: list[Tensor] = [torch.empty(0)] * len(starts)
        sups: list[Tensor] = [torch.empty(0)] * len(starts)
        for rows in tqdm(calls, desc="sampling (ct2)", disable=not progress):
            results = generator.generate_batch(
                [starts[b] for b in rows],
                max_length=max_new_tokens,
                sampling_topk=top_k,
                sampling_topp=top_p,
                sampling_temperature=temperature,
                return_logits_vocab=True,
                include_prompt_in_result=False,
                return_end_token=True,
                end_token=self.eos_ids.tolist(),
            )
            for b, r in zip(rows, results):
                tok = torch.tensor(r.sequences_ids[0], dtype=torch.long)
                z = torch.from_numpy(np.stack([np.asarray(x) for x in r.logits[0]]))
                logp = process_logits(z, temperature, top_k, top_p)  # [L, V], −inf off support
                mu = logp.gather(1, tok[:, None])[:, 0]
                if not torch.isfinite(mu).all():  # CTranslate2 drew outside the law we record
                    raise FloatingPointError(
                        "ct2 sampler: a sampled token has zero probability under the processed "
                        "law of the engine's own logits (non-finite logits, or a sampling rule "
                        "that differs from harness.sampling.logprobs.process_logits)"
                    )
                toks[b], mus[b] = tok, mu
                if truncated:
                    sups[b] = kept_support(logp)
        return pack_rollout(
            ids,
            attn,
            toks,
            mus,
            sups if truncated else None,
            self.pad_id,
            sampling,
            self.device,
        )
