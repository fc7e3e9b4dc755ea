"""Peak memory and time of chunked trainer scoring vs a naive full-vocabulary fp32 log-softmax.

    python benchmarks/bench_score.py [--model smollm2-135m] [--batch 32] [--tokens 256] [--rounds 3]

Each variant runs in its own subprocess; peak memory is the growth of the process's max RSS
over the scoring call itself (hidden states precomputed). Rounds interleave naive and chunked
(A/B); each metric and each per-round ratio is reported as min/median/max over the rounds.
Writes results/bench/score.json.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch


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
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
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
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"variant": variant, "grad": grad, "seconds": dt, "peak_mb": (peak - before) / 1024}


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
    rows = []
    for grad in (False, True):
        for r in range(a.rounds):
            for variant in ("naive", "chunked"):  # interleaved A/B, one pair per round
                cmd = [
                    sys.executable,
                    __file__,
                    "--child",
                    variant,
                    "--model",
                    a.model,
                    "--batch",
                    str(a.batch),
                    "--tokens",
                    str(a.tokens),
                ] + (["--grad"] if grad else [])
                out = subprocess.run(cmd, capture_output=True, text=True, check=True)
                rows.append({**json.loads(out.stdout.strip().splitlines()[-1]), "round": r})
    report = {
        "command": " ".join(["python", *sys.argv]),
        "model": a.model,
        "B": a.batch,
        "T": a.tokens,
        "rounds": a.rounds,
    }

    def mmm(xs: list[float]) -> dict[str, float]:
        return {"min": min(xs), "median": statistics.median(xs), "max": max(xs)}

    for grad in (False, True):
        sel = [r for r in rows if r["grad"] == grad]
        by = {
            v: sorted((r for r in sel if r["variant"] == v), key=lambda r: r["round"])
            for v in ("naive", "chunked")
        }
        mem = [n["peak_mb"] / max(c["peak_mb"], 1) for n, c in zip(by["naive"], by["chunked"])]
        tim = [c["seconds"] / n["seconds"] for n, c in zip(by["naive"], by["chunked"])]
        key = "forward+backward" if grad else "forward (no grad: logp, entropy, Σp²)"
        report[key] = {
            **{v: {k: mmm([r[k] for r in by[v]]) for k in ("seconds", "peak_mb")} for v in by},
            "memory_ratio_naive_over_chunked": mmm(mem),
            "time_ratio_chunked_over_naive": mmm(tim),
        }
        m, t = mmm(mem), mmm(tim)
        print(
            f"{key}: peak memory naive/chunked median {m['median']:.1f}x "
            f"(min {m['min']:.1f}, max {m['max']:.1f}); time chunked/naive median "
            f"{t['median']:.2f} (min {t['min']:.2f}, max {t['max']:.2f}); {a.rounds} rounds"
        )
    out = Path("results/bench/score.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
