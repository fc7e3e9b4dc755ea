"""CTranslate2 vs HF as the sampler μ: rollout time, and what a weight sync costs.

    python -m benchmarks.bench_ct2 [--rounds 5 --threads 1]

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
import statistics

from benchmarks.common import compare, cpu, parse_args, sync_cost
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    a = parse_args(ap)
    out = {"threads": a.threads, "rounds": a.rounds, "cpu": cpu()}
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
        rows["sync_s"] = sync = sync_cost(engines["ct2_int8"], model)
        print(f"  weight sync (checksum + save + convert): {sync['median']:.2f} s")
        out[name] = rows
        for e in engines.values():
            e.close()
    print(f"wrote {write_json_atomic('results/bench/ct2.json', out)}")


if __name__ == "__main__":
    main()
