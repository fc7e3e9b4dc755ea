"""The vLLM sampler's worker: runs under vLLM's own Python (engine.vllm.python), never imported by
the harness. vLLM pins its own transformers and ships torchvision/torchaudio wheels that break
beside ours, so it lives in a venv of its own and the harness drives it over a pipe (TRL's vLLM
server mode makes the same split on GPUs).

Protocol: one JSON object per line on the pipe the harness passes as fd `--fd-in` / `--fd-out`
(vLLM's own logging goes to stderr, which the harness sends to a log file). Every request has an
"op"; every reply is {"ok": true, ...} or {"ok": false, "error": "<type>: <message>"}.

  {"op": "init", "model": folder, "dtype": "float32"|"bfloat16", "max_model_len": int,
   "seed": int, "gpu_memory_utilization": float (CUDA only), "logprobs_mode": str}
      → {"ok", "version", "device"}
  {"op": "sample", "prompts": [[token ids]], "params": {vLLM's SamplingParams: "n",
   "temperature", "top_p", "top_k", "max_tokens", "stop_token_ids", "logprobs": int,
   "extra_args": dict | null}, "seed": int}
      → {"ok", "tokens": [[ids]], "logp": [[floats]], "support": [[[ids]]] | null}
        rows prompt-major (prompt i's n samples are rows i*n .. i*n+n-1). `logp` is the sampled
        token's log-probability under the processed law (logprobs_mode=processed_logprobs:
        after logits processors, temperature, top-k and top-p; raw_logprobs: before any of
        them); `support` (when "logprobs" > 0) the ids of the "logprobs" most likely tokens under
        that law that are kept (finite log-prob), per step. `extra_args` reach the logits processors
        (harness.integrations.vllm_noise reads its noise there).
  {"op": "load", "path": folder} → {"ok", "seconds"}   new weights from a safetensors folder
  {"op": "exit"}

Seeding: vLLM's per-request seed crashes on CPU once a batch's prompt tokens exceed the chunked
prefill limit ("CPU Generator does not use offset"), so the engine runs in this process
(VLLM_ENABLE_V1_MULTIPROCESSING=0) without per-request seeds and each sample call reseeds the
global torch generator its sampler draws from: a call's draws are a function of its `seed`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback


def repack_tied_head(model) -> None:
    """After reload_weights, vLLM's CPU GEMM keeps a packed copy of a tied lm_head's old matrix
    (the embedding is reloaded, the pack is not): pack it again from the new weights."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    head = getattr(model, "lm_head", None)
    if head is not None and hasattr(head, "cpu_linear"):
        dispatch_cpu_unquantized_gemm(head, remove_weight=False)


class Worker:
    def __init__(self):
        self.llm = None

    def init(
        self,
        model: str,
        dtype: str,
        max_model_len: int,
        seed: int,
        gpu_memory_utilization: float,
        logprobs_mode: str,
    ) -> dict:
        import torch
        import vllm

        torch.manual_seed(seed)
        kw = {"gpu_memory_utilization": gpu_memory_utilization} if torch.cuda.is_available() else {}
        self.llm = vllm.LLM(
            model=model,
            dtype=dtype,
            max_model_len=max_model_len,
            seed=seed,
            skip_tokenizer_init=True,
            enforce_eager=True,
            enable_prefix_caching=True,
            logprobs_mode=logprobs_mode,
            max_logprobs=-1,
            **kw,
        )
        # one token now: a model the engine loads but has no kernel for fails here, not mid-run
        self.llm.generate(
            [vllm.TokensPrompt(prompt_token_ids=[0])],
            vllm.SamplingParams(max_tokens=1),
            use_tqdm=False,
        )
        return {"version": vllm.__version__, "device": "cuda" if kw else "cpu"}

    def sample(self, prompts, params: dict, seed: int) -> dict:
        import torch
        from vllm import SamplingParams, TokensPrompt

        n, support = params["n"], params["logprobs"]
        params = SamplingParams(**params, detokenize=False, ignore_eos=False)
        torch.manual_seed(seed)
        outs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False
        )
        tokens, logp, kept = [], [], []
        for out in outs:
            if len(out.outputs) != n:
                raise RuntimeError(f"vLLM returned {len(out.outputs)} samples, asked for {n}")
            for c in sorted(out.outputs, key=lambda c: c.index):
                ids = list(c.token_ids)
                tokens.append(ids)
                logp.append([step[t].logprob for t, step in zip(ids, c.logprobs)])
                if support:
                    kept.append(
                        [
                            [t for t, lp in step.items() if lp.logprob > float("-inf")]
                            for step in c.logprobs
                        ]
                    )
        return {"tokens": tokens, "logp": logp, "support": kept if support else None}

    def load(self, path: str) -> dict:
        t = time.perf_counter()
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": path})
        self.llm.apply_model(repack_tied_head)
        # cached prefixes hold the old weights' keys and values
        self.llm.reset_prefix_cache()
        return {"seconds": time.perf_counter() - t}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fd-in", type=int, required=True)
    ap.add_argument("--fd-out", type=int, required=True)
    args = ap.parse_args()
    reader = os.fdopen(args.fd_in, "r")
    writer = os.fdopen(args.fd_out, "w")
    os.dup2(2, 1)  # anything vLLM prints goes to the log, never into the protocol
    worker = Worker()
    for line in reader:
        req = json.loads(line)
        op = req.pop("op")
        if op == "exit":
            break
        try:
            reply = {"ok": True, **getattr(worker, op)(**req)}
        except Exception as e:  # noqa: BLE001 — every failure goes back to the harness
            traceback.print_exc()
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        writer.write(json.dumps(reply) + "\n")
        writer.flush()


if __name__ == "__main__":
    sys.exit(main())
