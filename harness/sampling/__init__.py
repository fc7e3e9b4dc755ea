"""The sampler μ and the trainer's scoring passes: `engines.Engine` (HF: sampling as μ, chunked
scoring as a policy), the `rollout.Rollout` they return, the lean KV-cache decode loop, the
sampling law's log-probs (`logprobs`), and the two other engines μ can be (`ct2`, `vllm_engine`,
whose worker `vllm_worker` runs in vLLM's own venv); `samplers.ENGINES` is the table."""
