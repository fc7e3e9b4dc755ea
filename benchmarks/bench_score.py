"""Peak memory and time of chunked trainer scoring vs a naive full-vocabulary fp32 log-softmax.

    python -m benchmarks.bench_score [--model smollm2-135m] [--batch 32] [--tokens 256] [--rounds 3]

Each variant runs in its own subprocess; peak memory is the growth of the process's max RSS
over the scoring call itself (hidden states precomputed). Rounds interleave naive and chunked
(A/B); each metric and each per-round ratio is reported as min/median/max over the rounds.
Writes results/bench/score.json.
"""

from __future__ import annotations

import argparse
import json
import time
from functools import partial

import torch

from benchmarks.common import (
    command,
    last_json,
    max_rss_mb,
    ratios,
    rounds,
    run_module,
    spread,
    write_json,
)


def child(variant: str, model_spec: str, B: int, T: int, grad: bool) -> dict:
    from harness.base.models import load_model
    from harness.sampling.logprobs import chunked_logp, chunked_stats

    model, _ = load_model(model_spec)
    V, H = model.config.vocab_size, model.config.hidden_size
    g = torch.Generator().manual_seed(0)
    h = torch.randn(B * T, H, generator=g) * 3
    y = torch.randint(0, V, (B * T,), generator=g)
    W = model.lm_head.weight
    h.requires_grad_(grad)
    before = max_rss_mb()
    t0 = time.perf_counter()
    if variant == "naive":
        with torch.set_grad_enabled(grad):
            z = (h @ W.t()).float()
            logp_all = z.log_softmax(-1)
            logp = logp_all.gather(1, y[:, None])[:, 0]
            if grad:
                logp.sum().backward()
            else:
                p = logp_all.exp()
                _ = -(p * logp_all).sum(-1), (p * p).sum(-1)
    elif grad:
        chunked_logp(h, W, y).sum().backward()
    else:
        logp = chunked_stats(h, model.lm_head, y)["logp"]
    dt = time.perf_counter() - t0
    return {"variant": variant, "grad": grad, "seconds": dt, "peak_mb": max_rss_mb() - before}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--child", default=None)
    ap.add_argument("--grad", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child, a.model, a.batch, a.tokens, a.grad)))
        return

    def run(variant: str, _round: int, grad: bool) -> dict:
        args = ["--child", variant, "--model", a.model, "--batch", str(a.batch)]
        args += ["--tokens", str(a.tokens)] + (["--grad"] if grad else [])
        return last_json(run_module("benchmarks.bench_score", *args, check=True).stdout)

    # interleaved A/B, one pair per round: each variant's results by round
    variants = ("naive", "chunked")
    by_grad = {g: rounds(variants, a.rounds, partial(run, grad=g)) for g in (False, True)}
    report = {
        "command": command(),
        "model": a.model,
        "B": a.batch,
        "T": a.tokens,
        "rounds": a.rounds,
    }
    for grad, by in by_grad.items():
        mem = [n["peak_mb"] / max(c["peak_mb"], 1) for n, c in zip(by["naive"], by["chunked"])]
        tim = ratios([r["seconds"] for r in by["chunked"]], [r["seconds"] for r in by["naive"]])
        m, t = spread(mem), spread(tim)
        key = "forward+backward" if grad else "forward (no grad: logp, entropy, Σp²)"
        report[key] = {
            **{v: {k: spread([r[k] for r in by[v]]) for k in ("seconds", "peak_mb")} for v in by},
            "memory_ratio_naive_over_chunked": m,
            "time_ratio_chunked_over_naive": t,
        }
        print(
            f"{key}: peak memory naive/chunked median {m['median']:.1f}x "
            f"(min {m['min']:.1f}, max {m['max']:.1f}); time chunked/naive median "
            f"{t['median']:.2f} (min {t['min']:.2f}, max {t['max']:.2f}); {a.rounds} rounds"
        )
    print(f"wrote {write_json('results/bench/score.json', report)}")


if __name__ == "__main__":
    main()
