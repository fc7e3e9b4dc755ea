"""vLLM vs ratiolab's decoder vs HF `generate` as the sampler μ: rollout time, start-up, sync.

    python -m benchmarks.bench_vllm [--rounds 3 --threads 1]

SmolLM2-135M, the measurement job's prompts, 48 new tokens, T = 1, fp32, no noise, at two batch
sizes (16 prompts × 2 and × 8). Per round one rollout per sampler, interleaved: `hf_generate`
(transformers' `generate`, sampling), `ratiolab` (harness.sampling.engines.Engine: KV cache,
lean decode, pruning of finished rows), `vllm` (harness.sampling.vllm_engine.VllmEngine: the
worker under vLLM's own venv, `make vllm`). The ratio to hf_generate is taken within a round,
reported as min / median / max over rounds. Start-up is the VllmEngine's construction (weights
written, worker started, model loaded, one warm-up token); sync is one
`load_weights_from_state` with changed weights (write safetensors, reload, re-pack the tied head,
reset the prefix cache) — what `harness.train` pays per step with engine.sampler=vllm. Writes
results/bench/vllm.json.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch

from benchmarks.common import compare, cpu, parse_args, sync_cost
from harness.base.io import write_json_atomic
from harness.base.models import load_model
from harness.measure import PROMPTS, format_prompts
from harness.sampling.engines import Engine
from harness.sampling.rollout import encode_prompts
from harness.sampling.vllm_engine import VllmEngine


class HFGenerate:
    """transformers' own sampler, for scale: `generate` with do_sample, T = 1."""

    def __init__(self, model, tok):
        self.model, self.tok = model, tok

    @torch.no_grad()
    def generate(self, prompts, sampling, seed):
        ids, attn = encode_prompts(self.tok, prompts)
        torch.manual_seed(seed)
        out = self.model.generate(
            input_ids=ids,
            attention_mask=attn,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=sampling.max_new_tokens,
            num_return_sequences=sampling.n,
            pad_token_id=self.tok.pad_token_id,
        )
        return int((out[:, ids.shape[1] :] != self.tok.pad_token_id).sum())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    a = parse_args(ap)
    model, tok = load_model("smollm2-135m")
    model.eval().requires_grad_(False)
    prompts = format_prompts(tok, [p for p, _ in PROMPTS])
    t = time.perf_counter()
    vllm = VllmEngine(copy.deepcopy(model), tok)
    startup = time.perf_counter() - t
    engines = {
        "hf_generate": HFGenerate(copy.deepcopy(model), tok),
        "ratiolab": Engine(copy.deepcopy(model), tok),
        "vllm": vllm,
    }
    out = {
        "threads": a.threads,
        "rounds": a.rounds,
        "cpu": cpu(),
        "vllm_version": vllm.version,
        "vllm_startup_s": startup,
    }
    print(f"SmolLM2-135M, {len(prompts)} prompts, 48 new tokens, fp32, {a.threads} threads")
    print(f"  vLLM start-up (weights written, worker, model load, warm-up): {startup:.1f} s")
    for n in (2, 8):
        print(f"\n{len(prompts)} prompts × {n}")
        out[f"n{n}"] = compare(engines, prompts, n, 48, a.rounds, ref="hf_generate")
    out["sync_s"] = sync = sync_cost(vllm, model)
    print(f"\n  weight sync (write + reload + re-pack + cache reset): {sync['median']:.2f} s")
    vllm.close()
    print(f"wrote {write_json_atomic('results/bench/vllm.json', out)}")


if __name__ == "__main__":
    main()
