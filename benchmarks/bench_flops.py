"""Achieved FLOP/s of a trainer forward+backward on SmolLM2-135M vs this CPU's fp32 matmul peak.

    python -m benchmarks.bench_flops [--threads 1 --pairs 5]

The trainer pass is the loop's: `Engine.logp(grad=True)` (hidden states + chunked fused log-softmax
on the response positions) on 32 rows = 8 prompts × 4 samples, ~40 prompt + 32 response tokens,
then backward. FLOPs are counted by `torch.utils.flop_counter.FlopCounterMode` on one untimed
pass (every matmul, attention and the chunked backward's recompute: the work actually executed),
and also as "dense-equivalent" FLOPs: 6 · params · tokens for the full-sequence model (what a
trainer without prompt sharing would execute). Peak = the best of large fp32 `torch.mm` runs.
Peak and trainer runs are interleaved (machine load hits both); the fraction is per pair.
Writes results/bench/flops.json.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.common import INSTRUCTION, command, parse_args, summary, write_json
from harness.base.models import load_model
from harness.sampling.engines import Engine
from harness.sampling.rollout import Sampling
from harness.tasks.arithmetic import arithmetic


def matmul_peak(n: int, reps: int) -> float:
    """Best fp32 GFLOP/s of an n×n×n torch.mm over `reps` runs."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    best = 0.0
    for _ in range(reps):
        t = time.perf_counter()
        torch.mm(a, b)
        best = max(best, 2 * n**3 / (time.perf_counter() - t) / 1e9)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--n", type=int, default=2048, help="peak matmul size")
    a = parse_args(ap)

    model, tok = load_model("smollm2-135m")
    eng = Engine(model, tok)
    task = arithmetic(digits=2, ops="+-")
    prompts = [INSTRUCTION + p.prompt for p in task.sample(8, "train", 0)]
    ro = eng.generate(prompts, Sampling(n=4, max_new_tokens=32), seed=0)
    rows = torch.arange(ro.response_ids.shape[0])
    model.train()

    def step() -> None:
        model.zero_grad(set_to_none=True)
        logp = eng.logp(ro, rows, grad=True, stats=False)["logp"]
        (logp * ro.response_mask).sum().backward()

    step()  # warm-up
    with FlopCounterMode(display=False) as fc:
        step()
    executed = fc.get_total_flops()
    n_params = sum(p.numel() for p in model.parameters())  # tied lm_head/embedding counted once
    n_tok = ro.tokens.numel()
    dense = 6 * n_params * n_tok  # the standard 6·N·D estimate (embedding lookup is not a matmul)

    peaks, times, fracs = [], [], []
    for _ in range(a.pairs):
        peaks.append(matmul_peak(a.n, 3))
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
        fracs.append(executed / times[-1] / 1e9 / peaks[-1])
        print(
            f"peak {peaks[-1]:.1f} GFLOP/s, trainer fwd+bwd {times[-1]:.2f} s "
            f"({executed / times[-1] / 1e9:.1f} GFLOP/s executed) -> {fracs[-1]:.2f}",
            flush=True,
        )
    report = {
        "command": command(),
        "threads": a.threads,
        "rows": int(ro.tokens.shape[0]),
        "seq_len": int(ro.tokens.shape[1]),
        "response_tokens": int(ro.response_ids.shape[1]),
        "params": n_params,
        "executed_gflop": executed / 1e9,
        "dense_equivalent_gflop": dense / 1e9,
        "flops_by_op": {str(k): v / 1e9 for k, v in fc.get_flop_counts()["Global"].items()},
        "peak_matmul_gflops": summary(peaks),
        "trainer_fwd_bwd_s": summary(times),
        "achieved_gflops_executed": summary([executed / t / 1e9 for t in times]),
        "fraction_of_peak_executed": summary(fracs),
        "fraction_of_peak_dense_equivalent": summary(
            [dense / t / 1e9 / p for t, p in zip(times, peaks)]
        ),
        "loadavg_end": os.getloadavg(),
    }
    out = write_json("results/bench/flops.json", report)
    f = report["fraction_of_peak_executed"]
    print(
        f"trainer fwd+bwd: {executed / 1e9:.0f} GFLOP executed ({dense / 1e9:.0f} dense-equiv.), "
        f"fraction of fp32 matmul peak: median {f['median']:.2f} "
        f"(min {f['min']:.2f}, max {f['max']:.2f}); peak median "
        f"{report['peak_matmul_gflops']['median']:.1f} GFLOP/s"
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
