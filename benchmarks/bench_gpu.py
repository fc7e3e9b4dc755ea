"""GRPO step time, CPU vs CUDA side by side in one run.

    python -m benchmarks.bench_gpu --devices cpu,cuda --dtype fp32,bf16 --steps 3 \\
        --json results/bench/gpu.json
    python -m benchmarks.bench_gpu --devices cpu --steps 1 --smollm2-layers 2   # CPU smoke

Models: `task-model` (the shipped arithmetic task model, `harness.tasks.warmstart.load_task_model`,
no training) and `smollm2-shaped` (SmolLM2-135M's architecture from its config: hidden 576,
intermediate 1536, 9 heads, 3 KV heads, vocab 49152, 30 layers, random init, the character
tokenizer: `harness.base.models.smollm2_shaped`). Work: arithmetic prompts,
`--prompts` × `--group` rows of `--new-tokens` tokens each (EOS off, so every device decodes the
same number of tokens whatever it samples).

A step is `benchmarks/bench_step.py`'s ratiolab step (`RatiolabStep`, variant `loop`): the
training loop's own `harness.train.train_step` at staleness 0 with one minibatch, `ppo_clip`
and the loop's optimizer (`harness.rl.step.adamw`: fp32 master weights for a bf16 model). An Engine
runs on its model's device, so each (model, device, dtype) gets the model moved there and cast.
CUDA is synchronised before and after each step. `--warmup` steps are run untimed first.
Prints the median step seconds per (model, device, dtype) and the CPU/CUDA ratio; the JSON
(rewritten after every configuration, so a run cut short keeps what it measured) holds every
step's time, its phases (collect / update / sync: host-timed, so on CUDA only their sum is exact)
and the versions.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.bench_step import RatiolabStep, work_for
from benchmarks.common import CLIP, LR, command, cpu, load, parse_args, write_json

MODELS = ("task-model", "smollm2-shaped")


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def time_steps(base, tok, work, dev: torch.device, dtype: str, warmup: int, steps: int) -> dict:
    """Warm-up + timed ratiolab steps of `base` (copied, moved to `dev`, cast to `dtype`)."""
    model = copy.deepcopy(base).to(dev)
    if dtype == "bf16":
        model = model.to(torch.bfloat16)
    rs = RatiolabStep(model, tok, work, "")  # the trainer on `model`, the sampler on its copy
    assert rs.s.policy.device.type == dev.type and rs.sampler.device.type == dev.type
    problems = work.task.sample(work.prompts * (warmup + steps), "train", 0)
    times, phases = [], []
    for i in range(warmup + steps):
        sel = problems[work.prompts * i : work.prompts * (i + 1)]
        sync(dev)
        t0 = time.perf_counter()
        ph = rs(sel, seed=i, variant="loop")
        sync(dev)
        dt = time.perf_counter() - t0
        if i >= warmup:
            times.append(dt)
            phases.append({k: round(v, 5) for k, v in ph.items()})
        print(f"  step {i}{' (warm-up)' if i < warmup else ''}: {dt:.3f} s", flush=True)
    out = {
        "median_s": statistics.median(times),
        "min_s": min(times),
        "max_s": max(times),
        "steps_s": times,
        "phases_s": phases,
        "params": sum(p.numel() for p in model.parameters()),
        "attn": getattr(model.config, "_attn_implementation", None),
        "max_memory_gb": (
            torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None
        ),
    }
    del rs, model
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
    return out


def versions() -> dict:
    cuda = torch.cuda.is_available()
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name(0) if cuda else None,
        "capability": list(torch.cuda.get_device_capability(0)) if cuda else None,
        "cpu": cpu(),
        "nproc": os.cpu_count(),
        "threads": torch.get_num_threads(),
    }


def ratios(results: list[dict]) -> dict[str, float]:
    """CPU median / CUDA median per (model, dtype) where both were measured."""
    med = {(r["model"], r["dtype"], r["device"]): r["median_s"] for r in results}
    out = {}
    for (m, d, dev), t in med.items():
        if dev == "cpu" and (m, d, "cuda") in med:
            out[f"{m}/{d}"] = t / med[(m, d, "cuda")]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--devices", default="cpu,cuda", help="comma list of cpu, cuda")
    ap.add_argument("--dtype", default="fp32", help="fp32 | bf16 | a comma list of both")
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma list of {MODELS}")
    ap.add_argument("--steps", type=int, default=5, help="timed steps (after --warmup)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=8, help="prompts per step")
    ap.add_argument("--group", type=int, default=4, help="samples per prompt")
    ap.add_argument("--new-tokens", type=int, default=32, help="tokens per row (EOS off)")
    ap.add_argument("--smollm2-layers", type=int, default=30, help="fewer for a CPU smoke run")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="CPU threads")
    ap.add_argument("--json", default="results/bench/gpu.json")
    a = parse_args(ap)
    # CUDA first: a run cut short by its timeout then loses a number of the slow (CPU) side
    devices = sorted(
        {torch.device(d) for d in a.devices.split(",") if d}, key=lambda d: d.type != "cuda"
    )
    if any(d.type == "cuda" for d in devices) and not torch.cuda.is_available():
        sys.exit("--devices names cuda, but torch sees no CUDA device here; use --devices cpu")
    models = a.models.split(",")
    if bad := set(models) - set(MODELS):
        sys.exit(f"--models {sorted(bad)}: valid {', '.join(MODELS)}")
    dtypes = a.dtype.split(",")
    if bad := set(dtypes) - {"fp32", "bf16"}:
        sys.exit(f"--dtype {sorted(bad)}: valid fp32, bf16")

    base_work = work_for("eos", "arithmetic", a.prompts, a.group)
    work = dataclasses.replace(base_work, new_tokens=a.new_tokens, eos=False)
    report = {
        "command": command(),
        "work": {
            "task": type(work.task).__name__,
            "prompts": work.prompts,
            "group": work.group,
            "new_tokens": work.new_tokens,
            "eos": False,
            "step": "bench_step.RatiolabStep variant loop (harness.train.train_step)",
            "grad_clip": CLIP,
            "lr": LR,
        },
        "warmup": a.warmup,
        "versions": versions(),
        "results": [],
        "ratio_cpu_over_cuda": {},
    }
    out = Path(a.json)
    for name in models:
        base, tok = load(name, layers=a.smollm2_layers, progress=False)
        for dtype in dtypes:
            for dev in devices:
                print(f"[{name} {dev.type} {dtype}]", flush=True)
                r = time_steps(base, tok, work, dev, dtype, a.warmup, a.steps)
                report["results"].append({"model": name, "device": dev.type, "dtype": dtype, **r})
                report["ratio_cpu_over_cuda"] = ratios(report["results"])
                write_json(out, report)  # cut short: kept
        del base
    print(f"\n{'model':16} {'dtype':5} {'device':6} {'median s':>9} {'min s':>8} {'max s':>8}")
    for r in report["results"]:
        print(
            f"{r['model']:16} {r['dtype']:5} {r['device']:6} {r['median_s']:9.3f} "
            f"{r['min_s']:8.3f} {r['max_s']:8.3f}"
        )
    for k, v in report["ratio_cpu_over_cuda"].items():
        print(f"CPU/CUDA step time {k}: {v:.1f}x")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
