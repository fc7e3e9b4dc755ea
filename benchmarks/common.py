"""What the benchmarks share: the record of a run (its command line, the CPU, peak RSS, the JSON
written atomically), `--threads` applied to torch, the models they load by name, interleaved
rounds and their min / median / max, the sampler comparison of bench_ct2 and bench_vllm, child
processes of a benchmark, and the settings of the loop's update that the step benchmarks run.

Light on purpose (the standard library and harness.base.io): torch and the model code are
imported by the functions that need them, so `bench_memory --table` and the benchmarks without a
model start fast.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from harness.base.io import write_text_atomic
from harness.sampling.rollout import Sampling

ROOT = Path(__file__).resolve().parents[1]

# the loop's update as the step benchmarks run it: ppo_clip's ε low / high, AdamW's learning
# rate, the gradient-norm clip
EPS_LOW, EPS_HIGH, LR, CLIP = 0.2, 0.28, 1e-6, 1.0
# SmolLM2: an instruction prefix so prompts are ~40 tokens (≤ 64, the benchmark's prompt length)
INSTRUCTION = (
    "You are a careful assistant. Solve the arithmetic problem below, showing the carries digit "
    "by digit, and finish with the final answer on its own line. Problem: "
)
TASK_MODELS = ("tiny", "task-model")  # `load`'s task models: their prompts need no instruction

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")


# --- the record of a run -----------------------------------------------------------------------


def command() -> str:
    """This benchmark's command line as it was typed: `python -m benchmarks.bench_x …` (the
    script's path instead of `-m …` when it was run as a file)."""
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    script = ["-m", spec.name] if spec is not None else sys.argv[:1]
    return " ".join([os.path.basename(sys.executable), *script, *sys.argv[1:]])


def cpu() -> str:
    """The CPU's name (the architecture where the platform gives none)."""
    return platform.processor() or platform.machine()


def machine() -> dict:
    """The machine a side-by-side benchmark ran on: its CPU, core count and load at the end (a
    ratio measured beside other work is still a ratio; its absolute times are not)."""
    return {"cpu": cpu(), "nproc": os.cpu_count(), "loadavg_end": os.getloadavg()}


def max_rss_mb() -> float:
    """This process's peak resident set so far, MB (getrusage's ru_maxrss: kB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def parse_args(ap: argparse.ArgumentParser) -> argparse.Namespace:
    """`ap`'s arguments, with torch's threads set to their `--threads`."""
    import torch

    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    return a


def write_json(path: str | Path, obj: Any) -> Path:
    """`obj` as indented JSON (keys in their order) to `path`, atomically (harness.base.io: a
    run cut short never leaves half a file), its folder made when missing."""
    return write_text_atomic(path, json.dumps(obj, indent=2) + "\n")


# --- models ------------------------------------------------------------------------------------


def load(name: str, *, task: str = "arithmetic", layers: int = 30, progress: bool = True):
    """(model, tokenizer) of a benchmark's model name: `tiny` (the arithmetic task model with 4
    layers, d = 128: SMALL_ARITHMETIC), `task-model` (the shipped task model of `task`),
    `smollm2-shaped` (SmolLM2-135M's shapes, `layers` of its 30, random init, the character
    tokenizer), or any `harness.base.models.load_model` spec (smollm2-135m, tiny-llama, …).
    `progress`: the task model's build progress, should it have to be trained."""
    if name in TASK_MODELS:
        from harness.tasks.warmstart import SMALL_ARITHMETIC, load_task_model

        if name == "tiny":
            return load_task_model("arithmetic", progress=progress, **SMALL_ARITHMETIC)
        return load_task_model(task, progress=progress)
    if name == "smollm2-shaped":
        from harness.base.models import smollm2_shaped

        return smollm2_shaped(n_layers=layers, seed=0)
    from harness.base.models import load_model

    return load_model(name)


# --- interleaved rounds ------------------------------------------------------------------------


def rounds(keys: Iterable[K], n: int, run: Callable[[K, int], T]) -> dict[K, list[T]]:
    """`run(key, round)` for every key in order, once per round, `n` rounds: interleaved, so the
    machine's drift (load, clock, caches) hits every key alike. Each key's results by round."""
    keys = list(keys)
    out: dict[K, list[T]] = {k: [] for k in keys}
    for r in range(n):
        for k in keys:
            out[k].append(run(k, r))
    return out


def ratios(xs: Sequence[float], ref: Sequence[float]) -> list[float]:
    """Each round's `xs` over the reference's in the same round."""
    return [x / y for x, y in zip(xs, ref)]


def spread(xs: Sequence[float]) -> dict[str, float]:
    """min / median / max."""
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs)}


def summary(xs: Sequence[float]) -> dict[str, float]:
    """min / median / max and the count n."""
    return {**spread(xs), "n": len(xs)}


# --- samplers side by side (bench_ct2, bench_vllm) ---------------------------------------------


def timed_rollout(engine, prompts, n, max_new, seed) -> tuple[float, int]:
    """Seconds for one rollout and its response tokens (an engine may return the count itself)."""
    t = time.perf_counter()
    ro = engine.generate(prompts, Sampling(n=n, max_new_tokens=max_new), seed=seed)
    tokens = ro if isinstance(ro, int) else int(ro.response_mask.sum())
    return time.perf_counter() - t, tokens


def compare(engines: dict, prompts, n, max_new, n_rounds, ref) -> dict:
    """One rollout per engine per round, interleaved (`rounds`); each time is divided by `ref`'s
    in the same round, reported as min / median / max."""
    for e in engines.values():  # warm-up
        timed_rollout(e, prompts[:2], 2, 4, 0)
    runs = rounds(
        engines, n_rounds, lambda k, r: timed_rollout(engines[k], prompts, n, max_new, seed=r)
    )
    times = {k: [s for s, _ in v] for k, v in runs.items()}
    rows = {}
    for k, v in runs.items():
        ratio = spread(ratios(times[k], times[ref]))
        rows[k] = {
            "median_s": statistics.median(times[k]),
            "tokens_per_rollout": statistics.median([t for _, t in v]),
            f"ratio_to_{ref}": ratio,
        }
        print(
            f"  {k:12s} {rows[k]['median_s']:7.2f} s  ({rows[k]['tokens_per_rollout']:.0f} "
            f"tokens)  ratio to {ref} {ratio['min']:.2f} / {ratio['median']:.2f} / "
            f"{ratio['max']:.2f}"
        )
    return rows


def sync_cost(engine, model, times: int = 3) -> dict[str, Any]:
    """Seconds of `load_weights_from_state` with changed weights (each call perturbs them by 1e-4
    Gaussian noise, so no engine can skip the work as unchanged): their median and all."""
    import torch

    moved = copy.deepcopy(model)
    for _ in range(times):
        with torch.no_grad():
            for p in moved.parameters():
                p.add_(1e-4 * torch.randn_like(p))
        engine.load_weights_from_state(moved.state_dict())
    sync = engine.sync_s[-times:]
    return {"median": statistics.median(sync), "all": sync}


# --- child processes ---------------------------------------------------------------------------


def run_module(module: str, *args: str, **kw) -> subprocess.CompletedProcess:
    """`python -m <module> <args>` in a fresh process started at the repository root (where
    `benchmarks` imports from), its output captured as text; `kw` go to subprocess.run."""
    cmd = [sys.executable, "-m", module, *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, **kw)


def last_json(stdout: str) -> Any:
    """The JSON a child printed on its last line."""
    return json.loads(stdout.strip().splitlines()[-1])
