"""CTranslate2 vs HF as the sampler μ: rollout time, and what a weight sync costs.

    python benchmarks/bench_ct2.py [--rounds 5 --threads 1]

Per model (the countdown task model: 16 prompts × 8, the task's token budget; SmolLM2-135M: the
measurement job's 16 prompts × 2, 48 new tokens), one rollout per engine per round, interleaved
(HF fp32 with its KV cache, lean decode and pruning; ct2 float32; ct2 int8), T = 1, no noise; the
ratio ct2 / HF is taken within a round, reported as min / median / max over rounds. The ct2 time
includes the fresh Generator it loads per call (how it is seeded; `load_s` alone beside it). The
sync cost is one `load_weights_from_state` with changed weights (checksum, save, convert) —
what `harness.train` pays per step with engine.sampler=ct2. Writes results/bench/ct2.json.
"""

from __future__ import annotations

import argparse
import copy
import platform
import statistics
import time
from pathlib import Path

import torch

from harness.base.io import write_json_atomic
from harness.base.models import load_model
from harness.base.registry import build
from harness.measure import PROMPTS, format_prompts
from harness.sampling.ct2 import Ct2Engine
from harness.sampling.engines import Engine
from harness.tasks import TASKS
from harness.tasks.warmstart import load_task_model


def workloads():
    model, tok = load_task_model("countdown", progress=False)
    task = build(TASKS, "countdown", "task")
    prompts = [p.prompt for p in task.sample(16, "train", 0)]
    yield "task-model", model, tok, prompts, 8, task.max_new_tokens
    model, tok = load_model("smollm2-135m")
    yield "smollm2-135m", model, tok, format_prompts(tok, [p for p, _ in PROMPTS]), 2, 48


def timed(engine, prompts, n, max_new, seed) -> tuple[float, int]:
    """Seconds for one rollout and its response tokens (an engine may return the count itself)."""
    t = time.perf_counter()
    ro = engine.generate(prompts, n=n, max_new_tokens=max_new, seed=seed)
    tokens = ro if isinstance(ro, int) else int(ro.response_mask.sum())
    return time.perf_counter() - t, tokens


def compare(engines: dict, prompts, n, max_new, rounds, ref) -> dict:
    """One rollout per engine per round, interleaved so the machine's drift hits every engine
    alike; each time is divided by `ref`'s in the same round, reported as min / median / max."""
    for e in engines.values():  # warm-up
        timed(e, prompts[:2], 2, 4, 0)
    times = {k: [] for k in engines}
    tokens = {k: [] for k in engines}
    for r in range(rounds):
        for k, e in engines.items():
            s, t = timed(e, prompts, n, max_new, seed=r)
            times[k].append(s)
            tokens[k].append(t)
    rows = {}
    for k in engines:
        ratio = sorted(t / h for t, h in zip(times[k], times[ref]))
        rows[k] = {
            "median_s": statistics.median(times[k]),
            "tokens_per_rollout": statistics.median(tokens[k]),
            f"ratio_to_{ref}": {"min": ratio[0], "median": statistics.median(ratio),
                                "max": ratio[-1]},
        }  # fmt: skip
        print(f"  {k:12s} {rows[k]['median_s']:7.2f} s  ({rows[k]['tokens_per_rollout']:.0f} "
              f"tokens)  ratio to {ref} {ratio[0]:.2f} / {statistics.median(ratio):.2f} / "
              f"{ratio[-1]:.2f}")  # fmt: skip
    return rows


def sync_cost(engine, model, times: int = 3) -> list[float]:
    """Seconds of `load_weights_from_state` with changed weights (each call perturbs them by 1e-4
    Gaussian noise, so no engine can skip the work as unchanged)."""
    moved = copy.deepcopy(model)
    for _ in range(times):
        with torch.no_grad():
            for p in moved.parameters():
                p.add_(1e-4 * torch.randn_like(p))
        engine.load_weights_from_state(moved.state_dict())
    return engine.sync_s[-times:]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    cpu = platform.processor() or platform.machine()
    out = {"threads": a.threads, "rounds": a.rounds, "cpu": cpu}
    for name, model, tok, prompts, n, max_new in workloads():
        model.eval().requires_grad_(False)
        engines = {
            "hf": Engine(copy.deepcopy(model), tok),
            "ct2_float32": Ct2Engine(copy.deepcopy(model), tok, "float32"),
            "ct2_int8": Ct2Engine(copy.deepcopy(model), tok, "int8"),
        }
        print(f"\n{name}: {len(prompts)} prompts × {n}, {max_new} new tokens, {a.threads} threads")
        rows = compare(engines, prompts, n, max_new, a.rounds, ref="hf")
        for k in engines:
            if k != "hf":
                rows[k]["load_s_median"] = statistics.median(engines[k].load_s)
                print(f"  {k:12s} Generator load {rows[k]['load_s_median']:.2f} s (in its time)")
        sync = sync_cost(engines["ct2_int8"], model)
        rows["sync_s"] = {"median": statistics.median(sync), "all": sync}
        print(f"  weight sync (checksum + save + convert): {statistics.median(sync):.2f} s")
        out[name] = rows
        for e in engines.values():
            e.close()
    path = Path("results/bench/ct2.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
