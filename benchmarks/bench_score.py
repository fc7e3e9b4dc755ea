"""Peak memory and time of chunked trainer scoring vs a naive full-vocabulary fp32 log-softmax.

    python benchmarks/bench_score.py [--model smollm2-135m] [--batch 32] [--tokens 256]

Each variant runs in its own subprocess; peak memory is the growth of the process's max RSS
over the scoring call itself (hidden states precomputed). Writes results/bench/score.json.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch


def child(variant: str, model_spec: str, B: int, T: int, grad: bool) -> dict:
    from harness.logprobs import chunked_logp, chunked_stats
    from harness.models import load_model

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
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child, a.model, a.batch, a.tokens, a.grad)))
        return
    rows = []
    for grad in (False, True):
        for variant in ("naive", "chunked", "naive", "chunked"):  # interleaved A/B; best of 2
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
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    report = {"command": " ".join(sys.argv), "model": a.model, "B": a.batch, "T": a.tokens}
    for grad in (False, True):
        sel = [r for r in rows if r["grad"] == grad]
        best = {
            v: {
                k: sorted(r[k] for r in sel if r["variant"] == v)[0] for k in ("seconds", "peak_mb")
            }
            for v in ("naive", "chunked")
        }
        key = "forward+backward" if grad else "forward (no grad: logp, entropy, Σp²)"
        report[key] = {
            **best,
            "memory_ratio_naive_over_chunked": best["naive"]["peak_mb"]
            / max(best["chunked"]["peak_mb"], 1),
            "time_ratio_chunked_over_naive": best["chunked"]["seconds"] / best["naive"]["seconds"],
        }
        ratio = report[key]["memory_ratio_naive_over_chunked"]
        print(
            f"{key}: peak MB naive {best['naive']['peak_mb']:.0f} vs chunked "
            f"{best['chunked']['peak_mb']:.0f} -> {ratio:.1f}x "
            f"less; time chunked/naive {report[key]['time_ratio_chunked_over_naive']:.2f}"
        )
    out = Path("results/bench/score.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
