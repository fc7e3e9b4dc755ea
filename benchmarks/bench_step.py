"""Step time of ratiolab's GRPO step vs TRL's GRPOTrainer on the same work.

    python -m benchmarks.bench_step --model tiny --pairs 7
    python -m benchmarks.bench_step --model task-model --pairs 7
    python -m benchmarks.bench_step --model smollm2-135m --pairs 5
    python -m benchmarks.bench_step --model task-model --work eos --task countdown --pairs 7

Same work on both sides. `--work fixed`: 8 prompts × 4 generations, 32 new tokens
(EOS disabled on both, so every row is 32 tokens). `--work eos`: the default training
config's 16 prompts × 8, the task's token budget, EOS on, so rows end at the task's own answer
lengths and each side pays for finished rows and padding as it really does; the report gives
the share of decode and trainer positions that are padding or finished rows. Both: T = 1, no
top-k/top-p, `ppo_clip` with ε = 0.2/0.28 and token-mean aggregation (TRL: loss_type="dapo", beta=0,
num_iterations=1), fp32, one AdamW step with grad-norm clip 1.0, no noise. TRL runs without
gradient checkpointing (its default is on, which is slower), so the comparison is against TRL's
fastest configuration for this work.

Both run in one process, interleaved: TRL's `train()` runs warm-up + pairs steps, and a callback
times each TRL step (on_step_begin → on_step_end) and then runs and times one ratiolab step per
variant. The ratiolab step is the training loop's own, `harness.train.train_step`, on a `Setup`
built from the training schema's defaults and the bench's work, whose task hands the loop the
pair's problems: μ samples on its own copy of the weights, rewards, group advantages, π_old, the
registered objective with fused AdamW, the weight sync, the step's metrics. Variant `loop` is the
default at staleness 0 with one minibatch: the training pass doubles as π_old, as TRL does when
each rollout batch is used once. Variant `recompute` scores π_old in a pass of its own, as the
loop does when α is configured. Both interleaved in the same run.
After the pairs, one `loop` step runs under the torch profiler: its time inside GEMM kernels over
TRL's median step is `gemm_floor_ratio`, the lowest ratio reachable without faster GEMMs (TRL runs
the same GEMMs). Writes results/bench/step_<model>[_eos_<task>].json
(every pair, phase medians) and refreshes results/bench/step.json (all models' ratios,
min/median/max).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import (
    CLIP,
    EPS_HIGH,
    EPS_LOW,
    INSTRUCTION,
    LR,
    TASK_MODELS,
    command,
    load,
    machine,
    parse_args,
    summary,
    write_json,
)
from harness.base.models import DTYPES
from harness.rl.alpha import WeightHistory
from harness.rl.setup import Setup, build_engines, step_options
from harness.rl.step import adamw
from harness.runs.access import train_objective
from harness.runs.config import schema
from harness.stats.diagnostics import collapse_guard
from harness.tasks import Task
from harness.tasks.arithmetic import arithmetic
from harness.train import train_step


@dataclass(frozen=True)
class Work:
    """What both sides do per step. `fixed`: 8 prompts × 4, 32 tokens, EOS off (every row runs
    32 tokens); `eos`: the default training config's 16 prompts × 8, the task's token budget,
    EOS on, so rows finish at the task's own answer lengths (what a real run pays for)."""

    prompts: int
    group: int
    new_tokens: int
    eos: bool
    task: Any


def work_for(kind: str, task_name: str, prompts: int | None = None, group: int | None = None):
    from harness.runs.config import RolloutCfg
    from harness.tasks import TASKS
    from harness.tasks.warmstart import resolve_recipe

    if kind == "fixed":
        return Work(8, 4, 32, False, arithmetic(digits=2, ops="+-"))
    task = TASKS[task_name](**resolve_recipe(task_name)["task_kwargs"])
    r = RolloutCfg()
    budget = r.max_new_tokens or task.max_new_tokens  # the loop's default: the task's own budget
    return Work(prompts or r.prompts_per_step, group or r.group_size, budget, True, task)


class PairProblems(Task):
    """The bench's task as the loop sees it: `sample` hands out the problems of the current pair
    (set by the caller, with the instruction prefix the TRL side's prompts carry); rewards are
    the task's own."""

    def __init__(self, task: Task, prefix: str):
        self.task, self.prefix, self.problems = task, prefix, []
        self.max_new_tokens = task.max_new_tokens

    def sample(self, n: int, split: str, seed: int):
        return [replace(p, prompt=self.prefix + p.prompt) for p in self.problems]

    def reward(self, problem, response: str) -> float:
        return self.task.reward(problem, response)


class Recording:
    """μ as the loop uses it, keeping the padding share of every rollout it samples."""

    def __init__(self, engine):
        self.engine, self.waste = engine, []

    def generate(self, *args, **kw):
        ro = self.engine.generate(*args, **kw)
        self.waste.append(waste(ro))
        return ro

    def __getattr__(self, name):
        return getattr(self.engine, name)


class RatiolabStep:
    """`harness.train.train_step` on the bench's problems. The variants share one model /
    optimizer / sampler state (the work does not depend on the weight values), which keeps
    SmolLM2 runs within a small machine's memory."""

    def __init__(self, model, tok, work: Work, prefix: str):
        # the training schema's defaults (clean μ on its own copy, one minibatch, staleness 0),
        # the model's dtype on both sides, and the bench's work, objective and optimizer
        cfg = schema()
        dtype = next(k for k, v in DTYPES.items() if v == next(model.parameters()).dtype)
        cfg.engine.sampler_dtype = cfg.engine.trainer_dtype = dtype
        cfg.rollout.prompts_per_step, cfg.rollout.group_size = work.prompts, work.group
        cfg.rollout.max_new_tokens = work.new_tokens
        cfg.objective = {"name": "ppo_clip", "eps_low": EPS_LOW, "eps_high": EPS_HIGH}
        cfg.aggregation = {"name": "token-mean"}
        cfg.optim.lr, cfg.optim.grad_clip = LR, CLIP
        policy, _, sampler, _ = build_engines(cfg, model, tok)
        if not work.eos:  # all rows run new_tokens tokens
            sampler.eos_ids = torch.empty(0, dtype=torch.long, device=sampler.device)
        self.cfg, self.sampler = cfg, Recording(sampler)
        self.s = Setup(
            task=PairProblems(work.task, prefix),
            harder_task=None,
            tok=tok,
            policy=policy,
            old_policy=policy,
            sampler=self.sampler,
            teacher=None,
            objective=train_objective(cfg),
            opt=adamw(model, lr=LR, betas=(cfg.optim.beta1, cfg.optim.beta2)),
            options=step_options(cfg),
            history=WeightHistory(0),
            identity={},
            sigma0=[],
        )
        self.s.push_weights()

    def __call__(self, problems, seed: int, variant: str) -> dict[str, float]:
        """One step on `problems` (π_old: the training pass for `loop`, its own pass for
        `recompute`): seconds in the loop's rollout (sampling, rewards, π_old) and update phases
        and in the step as a whole (the rest: the weight sync and the step's metrics)."""
        s = replace(self.s, old_policy=None if variant == "loop" else self.s.policy)
        s.task.problems = problems
        t0 = time.perf_counter()
        m, _ = train_step(s, self.cfg, seed + 1, collapse_guard())
        step = time.perf_counter() - t0
        return {"collect": m["time/rollout_s"], "update": m["time/update_s"], "step": step}


def waste(ro) -> dict[str, float]:
    """Share of the positions that are padding or finished rows: in decode (rows × decode steps
    run, when finished rows keep decoding) and in the trainer's [B, P + T] forward."""
    live = float(ro.response_mask.sum())
    real = live + float(ro.prompt_mask.sum())
    B, T, P = *ro.response_mask.shape, ro.prompt_ids.shape[1]
    return {"decode_padding": 1 - live / (B * T), "train_padding": 1 - real / (B * (P + T))}


def build_trl(model, tok, problems, prompts, steps: int, out_dir: str, grad_ckpt: bool, work):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    def reward(prompts, completions, idx, **_):
        return [work.task.reward(problems[i], c) for i, c in zip(idx, completions)]

    ds = Dataset.from_dict({"prompt": prompts, "idx": list(range(len(prompts)))})
    args = GRPOConfig(
        output_dir=out_dir,
        per_device_train_batch_size=work.prompts * work.group,
        gradient_accumulation_steps=1,
        num_generations=work.group,
        max_completion_length=work.new_tokens,
        # fixed work: EOS disabled, every row new_tokens long; eos: rows end at EOS
        generation_kwargs={} if work.eos else {"min_new_tokens": work.new_tokens},
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=0.0,
        num_iterations=1,
        loss_type="dapo",
        epsilon=EPS_LOW,
        epsilon_high=EPS_HIGH,
        scale_rewards="group",
        learning_rate=LR,
        lr_scheduler_type="constant",
        adam_beta2=0.99,
        weight_decay=0.0,
        max_grad_norm=CLIP,
        max_steps=steps,
        bf16=False,
        fp16=False,
        use_cpu=True,
        gradient_checkpointing=grad_ckpt,
        logging_steps=10_000,
        save_strategy="no",
        report_to="none",
        dataloader_num_workers=0,
        disable_tqdm=True,
        seed=0,
    )
    return GRPOTrainer(
        model=model, reward_funcs=reward, args=args, train_dataset=ds, processing_class=tok
    )


GEMM_OPS = ("aten::mm", "aten::bmm", "aten::addmm", "aten::addmm_", "aten::baddbmm")


def gemm_seconds(fn) -> float:
    """Self CPU time of the matrix-multiply kernels while `fn()` runs (torch profiler)."""
    from torch.profiler import profile

    with profile() as prof:
        fn()
    return sum(e.self_cpu_time_total for e in prof.key_averages() if e.key in GEMM_OPS) / 1e6


def write_summary(folder: Path) -> Path:
    """results/bench/step.json: per model, the command and every ratio's min/median/max, gathered
    from the step_<model>.json files of the latest run per model."""
    summary_ = {}
    for f in sorted(folder.glob("step_*.json")):
        r = json.loads(f.read_text())
        summary_[r.get("label", r["model"])] = {
            "command": r["command"],
            "file": str(f),
            "pairs": r["pairs"],
            "threads": r["threads"],
            "work": {k: v for k, v in r["work"].items() if k != "objective"},
            "trl_step_s": r["trl_step_s"],
            **{k: v for k, v in r.items() if k.startswith("ratio_")},
            **{k: v for k, v in r.items() if k.startswith("ratiolab_") and k.endswith("_step_s")},
            "gemm_floor_ratio": r.get("gemm_floor_ratio"),
            "gemm_share_of_loop_step": r.get("gemm_share_of_loop_step"),
        }
    return write_json(folder / "step.json", summary_)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--model",
        default="tiny",
        help="tiny (SMALL_ARITHMETIC: the arithmetic task model with 4 layers, d = 128) | "
        "task-model (the default arithmetic task model, 6 layers, d = 192) | smollm2-135m",
    )
    ap.add_argument(
        "--work",
        default="fixed",
        choices=("fixed", "eos"),
        help="fixed: 8 prompts × 4, 32 tokens, EOS off; eos: the default "
        "training config (16 × 8, the task's token budget), EOS on, the task's own answer lengths",
    )
    ap.add_argument("--task", default="arithmetic", choices=("arithmetic", "countdown"))
    ap.add_argument(
        "--prompts", type=int, default=None, help="eos work: prompts per step (default 16)"
    )
    ap.add_argument("--group", type=int, default=None, help="eos work: group size (default 8)")
    ap.add_argument("--pairs", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--variants",
        default="loop,recompute",
        help="ratiolab variants: loop (as harness.train runs at staleness 0 with one minibatch: "
        "the training pass doubles as π_old), recompute (a separate π_old pass, as with α "
        "configured)",
    )
    ap.add_argument("--trl-gradient-checkpointing", action="store_true")
    ap.add_argument("--out", default=None)
    a = parse_args(ap)
    torch.manual_seed(0)

    work = work_for(a.work, a.task, a.prompts, a.group)
    label = a.model + ("" if a.work == "fixed" else f"_eos_{a.task}")
    if a.work == "eos" and (a.prompts or a.group):
        label += f"_{work.prompts}x{work.group}"
    base, tok = load(a.model, task=a.task)
    prefix = "" if a.model in TASK_MODELS else INSTRUCTION
    steps = a.warmup + a.pairs
    problems = work.task.sample(work.prompts * steps, "train", 0)
    prompts = [prefix + p.prompt for p in problems]
    n_prompt_tok = [len(tok(p, add_special_tokens=False).input_ids) for p in prompts]
    assert max(n_prompt_tok) <= 64, max(n_prompt_tok)

    variants = a.variants.split(",")
    ratiolab = RatiolabStep(copy.deepcopy(base), tok, work, prefix)
    trl_model = copy.deepcopy(base).train()
    del base
    import tempfile

    from transformers import TrainerCallback

    trl_phase: dict[str, float] = {}
    rows: list[dict] = []

    with tempfile.TemporaryDirectory() as tmp:
        trainer = build_trl(
            trl_model, tok, problems, prompts, steps, tmp, a.trl_gradient_checkpointing, work
        )
        ckpt_active = bool(getattr(trl_model, "is_activation_checkpointing", False))
        for name in ("_generate_and_score_completions", "_compute_loss"):
            fn = getattr(trainer, name)

            def timed(*args, _fn=fn, _name=name, **kw):
                t = time.perf_counter()
                r = _fn(*args, **kw)
                trl_phase[_name] = time.perf_counter() - t
                return r

            setattr(trainer, name, timed)

        class Interleave(TrainerCallback):
            def on_step_begin(self, args, state, control, **kw):
                self.t0 = time.perf_counter()

            def on_step_end(self, args, state, control, **kw):
                dt = time.perf_counter() - self.t0
                i = state.global_step - 1
                row = {
                    "i": i,
                    "warmup": i < a.warmup,
                    "trl": {
                        "step": dt,
                        "generate+score": trl_phase.get("_generate_and_score_completions"),
                        "loss_forward": trl_phase.get("_compute_loss"),
                    },
                }
                sel = problems[work.prompts * i : work.prompts * (i + 1)]
                for v in variants:
                    row[v] = ratiolab(sel, seed=i, variant=v)
                rows.append(row)
                print(
                    json.dumps(
                        {
                            k: (round(x["step"], 3) if isinstance(x, dict) else x)
                            for k, x in row.items()
                        }
                    ),
                    flush=True,
                )

        trainer.add_callback(Interleave())
        trainer.train()
        ckpt_active = bool(getattr(trl_model, "is_activation_checkpointing", ckpt_active))

    timed_rows = [r for r in rows if not r["warmup"]]
    trl_t = [r["trl"]["step"] for r in timed_rows]
    report = {
        "command": command(),
        "model": a.model,
        "label": label,
        "work": {
            "kind": a.work,
            "task": type(work.task).__name__,
            "prompts": work.prompts,
            "group": work.group,
            "new_tokens": work.new_tokens,
            "eos": work.eos,
            # of the ratiolab rollouts (every variant samples the same rows)
            "padding_mean": {
                k: statistics.mean(w[k] for w in ratiolab.sampler.waste)
                for k in ratiolab.sampler.waste[0]
            },
            "prompt_tokens_max": max(n_prompt_tok),
            "prompt_tokens_mean": statistics.mean(n_prompt_tok),
            "objective": "ppo_clip eps 0.2/0.28 token-mean == TRL loss_type=dapo, beta=0",
        },
        "threads": a.threads,
        "trl_gradient_checkpointing": a.trl_gradient_checkpointing,
        "trl_checkpointing_active_after_train": ckpt_active,
        "versions": {
            "torch": torch.__version__,
            "trl": __import__("trl").__version__,
            "transformers": __import__("transformers").__version__,
        },
        "machine": machine(),
        "pairs": len(timed_rows),
        "trl_step_s": summary(trl_t),
        "trl_phases_median_s": {
            k: statistics.median(r["trl"][k] for r in timed_rows)
            for k in ("generate+score", "loss_forward")
        },
    }
    for v in variants:
        rt = [r[v]["step"] for r in timed_rows]
        report[f"ratiolab_{v}_step_s"] = summary(rt)
        report[f"ratiolab_{v}_phases_median_s"] = {
            k: statistics.median(r[v][k] for r in timed_rows) for k in timed_rows[0][v]
        }
        # per pair: each ratiolab step against the TRL step it was interleaved with
        report[f"ratio_{v}_over_trl"] = summary([x / y for x, y in zip(rt, trl_t)])
    # the floor: time inside GEMM kernels during one profiled `loop` step. The same GEMMs run on
    # TRL's side, so no overhead cut can take the ratio below gemm_floor_ratio.
    sel = problems[: work.prompts]
    gemm_s = gemm_seconds(lambda: ratiolab(sel, 0, "loop"))
    report["ratiolab_loop_gemm_s"] = gemm_s
    report["gemm_floor_ratio"] = gemm_s / report["trl_step_s"]["median"]
    # the most any overhead cut can speed ratiolab's own step up, at this GEMM speed
    loop = report.get("ratiolab_loop_step_s", {}).get("median")
    report["gemm_share_of_loop_step"] = gemm_s / loop if loop else float("nan")
    report["rows"] = rows
    out = write_json(a.out or f"results/bench/step_{label}.json", report)
    for v in variants:
        s = report[f"ratio_{v}_over_trl"]
        print(
            f"[{label}] ratiolab({v}) / TRL step time: median {s['median']:.3f} "
            f"(min {s['min']:.3f}, max {s['max']:.3f}, {s['n']} pairs); TRL median "
            f"{report['trl_step_s']['median']:.3f} s, ratiolab median "
            f"{report[f'ratiolab_{v}_step_s']['median']:.3f} s"
        )
    print(
        f"[{label}] GEMM time in one ratiolab(loop) step: {gemm_s:.3f} s = "
        f"{report['gemm_floor_ratio']:.3f} of TRL's median step (the ratio's floor at this "
        f"GEMM speed), {report['gemm_share_of_loop_step']:.3f} of ratiolab's"
    )
    pad = report["work"]["padding_mean"]
    print(
        f"[{label}] padding or finished rows: {pad['decode_padding']:.1%} of decode positions "
        f"(rows × steps), {pad['train_padding']:.1%} of the trainer's [B, P + T] positions"
    )
    print(f"wrote {out} and {write_summary(out.parent)}")


if __name__ == "__main__":
    main()
