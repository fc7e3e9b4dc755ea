"""Streaming SNR statistics throughput: 1e7 synthetic tokens through the calibration
stream (Table 3 / 7 accumulators, fork histogram, gate, sequence ESS) and through the live stream
with the ground-truth α/β moments, fed in rollout-sized batches. Goal: ≤ 10 s per 1e7 tokens on
the 2-core CPU; memory independent of the token count.

    .venv/bin/python -m benchmarks.bench_measure [--tokens 1e7 --batch 1e6]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from benchmarks.common import max_rss_mb
from harness.stats.diagnostics import bin_index
from harness.stats.snr import BinnedMoments, SNRSplit


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=float, default=1e7)
    ap.add_argument("--batch", type=float, default=1e6)
    args = ap.parse_args()
    n, B = int(args.tokens), int(args.batch)
    rng = np.random.default_rng(0)
    conf = rng.beta(0.5, 0.3, B)
    beta = rng.standard_t(3, B) * 0.2 * (1 - conf)
    alpha = rng.normal(0, 0.05, B) * (1 - conf)
    q = np.clip(conf * np.exp(rng.normal(0, 0.1, B)), 1e-9, 1.0)
    gate = (1 - conf) ** 2
    seq = np.repeat(np.arange(B // 256 + 1), 256)[:B]
    split = SNRSplit()
    truth = BinnedMoments(7, 2)
    times = {}
    for name in ("cal", "live"):
        t = time.perf_counter()
        for _ in range(n // B):
            if name == "cal":
                split.add_cal(beta, conf, q=q, gate=gate, seq=seq)
            else:
                split.add_live(alpha + beta, conf, q=q, gate=gate, seq=seq)
                truth.add(bin_index(conf, split.edges), np.stack([alpha, beta], 1))
        times[name] = time.perf_counter() - t
    t = time.perf_counter()
    split.bounds()
    split.cal.anatomy()
    times["tables"] = time.perf_counter() - t
    rss = max_rss_mb()
    print(f"{n:.0e} tokens, batches of {B:.0e}")
    print(f"  calibration stream (Δ, p_t, q, gate, seq):   {times['cal']:.2f} s")
    print(f"  live stream + ground-truth α/β moments:      {times['live']:.2f} s")
    print(f"  Table 3 + Table 6 + three-job bounds:        {times['tables']:.2f} s")
    print(f"  peak RSS {rss:.0f} MB (inputs: {5 * B * 8 / 2**20:.0f} MB per batch)")
    ok = max(times["cal"], times["live"]) * 1e7 / n <= 10
    print(f"  goal ≤ 10 s per 1e7 tokens per stream: {'PASS' if ok else 'FAIL'}")


if __name__ == "__main__":
    main()
