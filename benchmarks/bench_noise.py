"""Overhead of the noise models: noisy forward / clean forward on SmolLM2-135M (fp32, CPU).

Every config runs once per round (interleaved, so machine load hits all alike); each ratio is
taken within a round and reported as min/median/max over rounds. Writes results/bench/noise.json.
Prefill = one forward over [B, S]; decode = one KV-cache step [B, 1] after that prefill.
Goals: `layer` on every layer ≤ 1.15×, FP8 weight-only ≈ 1.0× after the one-time
quantisation, routing ≤ 1.10× (on the upcycled MoE, against the clean MoE).

    .venv/bin/python -m benchmarks.bench_noise [--batch 4 --seq 128 --repeats 7 --threads 2]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from transformers import DynamicCache

from benchmarks.common import command, parse_args, ratios, rounds, spread, write_json
from harness.base.models import load_model, upcycle_to_moe
from harness.noise import build_noise, forward_context, prefix_hash


def timed_forward(model, x, noise, decode: bool) -> float:
    h = prefix_hash(x)
    if noise is not None:
        noise.attach(model)
    try:
        with torch.no_grad():
            if not decode:
                t = time.perf_counter()
                with forward_context(h):
                    model(x)
                return time.perf_counter() - t
            cache = DynamicCache()
            with forward_context(h[:, :-1]):
                model(x[:, :-1], cache=cache, use_cache=True)
            t = time.perf_counter()
            with forward_context(h[:, -1:]):
                model(x[:, -1:], cache=cache, use_cache=True)
            return time.perf_counter() - t
    finally:
        if noise is not None:
            if hasattr(noise, "take_record"):
                noise.take_record()
            noise.detach()


def bench(models: dict, x, configs: dict, repeats: int, decode: bool) -> dict[str, list[float]]:
    """Per-round times of each config (`rounds`); `models[name]` is the model it runs on."""
    for name in configs:  # warm-up
        timed_forward(models[name], x, None, decode)
    return rounds(
        configs, repeats, lambda name, _: timed_forward(models[name], x, configs[name](), decode)
    )


def report(title: str, times: dict[str, list[float]], base: str, out: dict) -> None:
    print(f"\n{title}")
    print(f"  {'':28s} {'median':>9s}   ratio to {base}: min / median / max")
    rows = {}
    for k, v in times.items():
        r = spread(ratios(v, times[base]))
        rows[k] = {"median_ms": statistics.median(v) * 1e3, **{f"ratio_{s}": r[s] for s in r}}
        print(
            f"  {k:28s} {rows[k]['median_ms']:9.1f} ms   "
            f"{r['min']:5.2f} / {r['median']:5.2f} / {r['max']:5.2f}x"
        )
    out[title] = rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    a = parse_args(ap)
    model, _ = load_model("smollm2-135m")
    x = torch.randint(100, 40000, (a.batch, a.seq), generator=torch.Generator().manual_seed(0))
    print(f"SmolLM2-135M fp32, B={a.batch} S={a.seq}, {a.threads} threads, median of {a.repeats}")

    fp8 = build_noise("fp8")
    t = time.perf_counter()
    fp8.attach(model)
    print(
        f"FP8 weight quantisation at attach (once per weight sync): {time.perf_counter() - t:.2f} s"
    )
    fp8.detach()

    dense = {
        "clean": lambda: None,
        "layer (all 30 layers)": lambda: build_noise("layer", sigma=2e-3),
        "batch (all layers)": lambda: build_noise("batch", sigma=1e-3),
        "logit gaussian": lambda: build_noise("logit", sigma=0.1),
        "logit student-t nu=3": lambda: build_noise("logit", sigma=0.1, nu=3.0),
        "layer fresh (not determ.)": lambda: build_noise("layer", sigma=2e-3, deterministic=False),
    }
    out: dict = {"command": command()}
    for decode in (False, True):
        times = bench(dict.fromkeys(dense, model), x, dense, a.repeats, decode)
        report(f"dense, {'decode step' if decode else 'prefill'}", times, "clean", out)

    # FP8: weights quantised once per weight sync, outside the timed region: one model copy per
    # config, kept attached, so the configs still interleave round by round
    fp8_kw = {
        "clean": None,
        "fp8 weight-only tensor": {},
        "fp8 W8A8 block 128": dict(granularity="block", activations=True),
        "fp8 W8A8 row + KV": dict(granularity="row", activations=True, kv_cache=True),
    }
    copies = {name: model if kw is None else copy.deepcopy(model) for name, kw in fp8_kw.items()}
    noises = [build_noise("fp8", **kw) for kw in fp8_kw.values() if kw is not None]
    for n, m in zip(noises, [m for m in copies.values() if m is not model]):
        n.attach(m)
    for decode in (False, True):
        times = bench(copies, x, dict.fromkeys(fp8_kw, lambda: None), a.repeats, decode)
        title = f"fp8 (attached once), {'decode step' if decode else 'prefill'}"
        report(title, times, "clean", out)
    for n in noises:
        n.detach()

    moe = upcycle_to_moe(model, n_experts=4, top_k=2, expert_jitter=0.02)
    rec_noise = build_noise("routing", sigma=0.1)
    with rec_noise.attached(moe), torch.no_grad():
        moe(x)
    rec = rec_noise.take_record()
    routing = {
        "clean MoE": lambda: None,
        "routing sigma=0.1 + record": lambda: build_noise("routing", sigma=0.1),
        "replay (R3)": lambda: build_noise("replay", indices=rec),
    }
    times = bench(dict.fromkeys(routing, moe), x, routing, a.repeats, decode=False)
    report("upcycled SmolLM2 MoE (4 experts, top-2), prefill", times, "clean MoE", out)
    print(f"\nwrote {write_json('results/bench/noise.json', out)}")


if __name__ == "__main__":
    main()
