"""The SmolLM2 presets' rollout under the FP8 block W8A8 sampler: one prompt prefill per distinct
prompt (its KV cache repeated for the group's samples) against a prefill per row, the same law.

The work of smollm2_clip_confirm's μ: 8 word problems × 4 samples through the chat template,
≤ 48 tokens, T = 0.5, FP8 E4M3 block W8A8 (harness.noise.Fp8Recipe: weights per 128×128 block,
activations per 1×128 tile, both per token, so a shared prompt gets the noise every row would).
The two paths run interleaved, once per round; each round's ratio shared / per-row, reported as
min / median / max, and whether both paths sampled the same tokens. Writes
results/bench/rollout_fp8.json.

    .venv/bin/python -m benchmarks.bench_rollout [--rounds 5 --threads 1]
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.common import command, parse_args, ratios, rounds, spread, write_json
from harness.base.models import load_model
from harness.base.registry import build
from harness.noise import build_noise
from harness.sampling.engines import Engine
from harness.sampling.rollout import Sampling
from harness.tasks import TASKS


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    a = parse_args(ap)
    model, tok = load_model("smollm2-135m")
    task = build(TASKS, "word_problems", "task")
    task.attach_tokenizer(tok)
    prompts = [p.prompt for p in task.sample(8, "train", 0)]
    eng = Engine(model, tok, noise=[build_noise("fp8", granularity="block", activations=True)])
    assert eng._can_share_prefix()
    paths = {"shared prefill": lambda: True, "per-row prefill": lambda: False}
    same: list[bool] = []

    def run(path: str, r: int) -> float:
        eng._can_share_prefix = paths[path]
        t = time.perf_counter()
        eng.generate(prompts, Sampling(n=4, max_new_tokens=48, temperature=0.5), seed=r)
        return time.perf_counter() - t

    run("shared prefill", -1)  # warm-up
    times = rounds(paths, a.rounds, run)
    for r in range(2):  # the two paths' samples: the same law, the same draws
        outs = []
        for path in paths:
            eng._can_share_prefix = paths[path]
            outs.append(
                eng.generate(prompts, Sampling(n=4, max_new_tokens=48, temperature=0.5), seed=r)
            )
        same.append(torch.equal(outs[0].response_ids, outs[1].response_ids))
    eng.close()
    ratio = spread(ratios(times["shared prefill"], times["per-row prefill"]))
    print(f"SmolLM2-135M fp32, FP8 block W8A8 μ, 8 × 4, ≤ 48 tokens, {a.threads} thread(s)")
    for path, ts in times.items():
        print(f"  {path:16s} " + "  ".join(f"{t:5.1f}" for t in ts) + " s")
    print(
        f"  shared / per-row: median {ratio['median']:.3f} (min {ratio['min']:.3f}, max "
        f"{ratio['max']:.3f}); the same tokens in {sum(same)}/{len(same)} checks"
    )
    out = {"command": command(), "seconds": times, "ratio": ratio, "same_tokens": same}
    print(f"wrote {write_json('results/bench/rollout_fp8.json', out)}")


if __name__ == "__main__":
    main()
