"""GRPO on verifiable tasks with controlled α and β — and on-policy self-distillation (OPSD).

    python -m harness.train                                  # clean GRPO, arithmetic task model
    python -m harness.train objective=cispo noise=logit      # any registered objective / noise
    python -m harness.train alpha.staleness=2 alpha.minibatches=4
    torchrun --nproc_per_node=N -m harness.train ...         # FSDP2 across N ranks

One step (`train_step`), in reading order:
  1. μ, the sampler (its own weights, with the configured noise β), samples G responses a prompt;
  2. rewards and group-normalised advantages (GRPO; `drgrpo` drops the std);
  3. π_old, the trainer at the behaviour weights (`Setup.old_scorer`: a copy under staleness, the
     policy before its update, or — one minibatch — the update's own first pass);
  4. m minibatch updates (α source 1), each an AdamW step on the registered objective;
     staleness k (α source 2) lags the behaviour weights k steps;
  5. the weight sync to μ (FP8 weights re-quantised there); 6. the step's metrics.
No KL term to a reference policy and no entropy bonus (they would blur what the corrections
do). With `distill.enabled` (OPSD, arXiv 2609.38995) the teacher is the frozen initial model
conditioned on the reference solution; the student minimises `opsd_fkl` on its own samples.

The run directory holds config.yaml, metrics.jsonl (one JSON line per step), meta.json and
checkpoints/ (atomic); re-running in the same directory resumes from the latest checkpoint.
Across ranks each rank samples its share of the step's groups; the objective, the metrics and the
evaluation see the global batch; rank 0 alone writes files and shows the progress bar.
"""

from __future__ import annotations

import json
import random
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import hydra
import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from harness import CONFIGS
from harness.base import distributed
from harness.base.io import write_json_atomic
from harness.base.models import resolve_device
from harness.noise.fp8 import ShadowPass, high_precision
from harness.objectives.opsd import teacher_inputs
from harness.rl import checkpoint, mechanism
from harness.rl.alpha import minibatch_schedule
from harness.rl.setup import Setup, build_setup, rollout_sampling, step_seed, token_budget
from harness.rl.step import collect, evaluate, gather_batch, share_rows, update, update_distill
from harness.runs import config, fingerprint, plugins
from harness.runs.access import fsdp
from harness.runs.launch import run_task, update_meta
from harness.runs.tracking import SIGNAL_STEPS, Tracker, no_signal, plain_line
from harness.runs.validate import validate, validate_ranks
from harness.stats.diagnostics import check_collapse, rollout_dials
from harness.stats.repetition import repetition_reports
from harness.tasks import Task


class TrainingAborted(RuntimeError):
    pass


def start(cfg: DictConfig, validated: bool = False) -> tuple[Path, Setup, int, dict]:
    """Validate (unless the launcher did), run the step-0 mechanism check (collective across
    ranks: each scores its share of the batches with the sharded trainer, as a step does; its
    draws cannot move the run's), build the setup, resume, and record the config when a step will
    run: (run dir, setup, first step, guard state)."""
    if not validated:
        validate(cfg)
    ranks = distributed.environment()
    validate_ranks(cfg, ranks.world)
    distributed.init(ranks, resolve_device(cfg.engine.device), always=fsdp(cfg))
    run_dir, lead = Path(cfg.out), ranks.rank == 0
    run_dir.mkdir(parents=True, exist_ok=True)
    changed = checkpoint.config_contract(run_dir, cfg)
    if cfg.mechanism_batches and distributed.all_true(not (run_dir / "mechanism.json").exists()):
        check = mechanism.run(cfg, validated=True, ranks=ranks)
        if lead:
            write_json_atomic(run_dir / "mechanism.json", check)
    distributed.barrier()
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    s = build_setup(cfg, ranks)
    first, guard = checkpoint.resume(s, run_dir, run_dir / "metrics.jsonl", cfg)
    distributed.barrier()
    if lead:
        fingerprint.record_machine(run_dir, first, ranks.world)
        update_meta(run_dir, model=s.identity, resumed_from_step=first - 1)
        if first <= cfg.steps:  # a rerun that trains no step keeps the record of the run it found
            checkpoint.record_config(run_dir, cfg, first, changed)
    s.sampler.load_weights_from_state(s.history.behaviour())
    return run_dir, s, first, guard


def train_step(s: Setup, cfg: DictConfig, step: int, guard: dict) -> tuple[dict, bool]:
    """One step (the module docstring's 1–6): its metrics, and whether every update was
    non-finite."""
    seed = step_seed(cfg.seed, step)
    if cfg.drivers.beta_growth != 1.0:  # σ_t a pure function of the step, on the same noise field
        for noise, sigma in s.sigma0:
            noise.sigma = sigma * beta_scale(cfg, step)
    harder = s.harder_task is not None and step >= cfg.drivers.harder_at
    task = s.harder_task if harder else s.task
    problems = task.sample(cfg.rollout.prompts_per_step, "train", seed)
    own, batch_rows = share_rows(s.ranks, len(problems), cfg.rollout.group_size)
    problems = problems[own]  # this rank's groups
    prompts = [p.prompt for p in problems]
    reward = partial(task.rollout_rewards, problems, tokenizer=s.tok)
    refresh = snr_refresh(s, cfg, task, step) if s.objective.refresh_due(step) else {}
    # 1–3: μ samples; rewards and advantages; π_old (collect)
    t0 = time.time()
    try:
        sampling = rollout_sampling(cfg, task)
        old = s.old_scorer()  # π_old's engine, loaded with the behaviour weights
        local, ro, rewards = collect(
            s.sampler, old, prompts, reward, sampling, s.options, seed=seed, batch_rows=batch_rows
        )
    except FloatingPointError as e:
        raise TrainingAborted(
            f"step {step}: {e}. The weights diverged (finite but huge) after step {step - 1}; "
            f"the checkpoints in {cfg.out}/checkpoints hold earlier steps. Lower optim.lr."
        ) from e
    t1 = time.time()
    if step == 1 and s.ranks.rank == 0:  # what pairs by seed must share (analysis.claims)
        fingerprint.record_batch(cfg.out, prompts, ro)
    batch = gather_batch(local) if s.ranks.world > 1 else local
    rewards = distributed.gather_rows(rewards) if s.ranks.world > 1 else rewards
    # 4: the minibatch updates (schedule: each minibatch's rows and lag)
    schedule = minibatch_schedule(len(rewards), cfg.alpha.minibatches, cfg.alpha.staleness, step)
    learner = s.learner(restore=partial(checkpoint.roll_back, s))
    reps = repetition_reports(ro.response_ids, ro.response_mask)
    if s.objective.needs_teacher:
        teacher, exit_metrics = teacher_inputs(
            s.policy, s.teacher, problems, cfg.distill.teacher_prompt, cfg.rollout.group_size, reps
        )
        updates, skipped = update_distill(
            learner, teacher, s.objective, ro, schedule, s.options, exit_metrics
        )
    else:
        shadow = ShadowPass(s.policy, s.old_policy, ro, cfg.engine.mask_replay)
        batch, updates, skipped = update(
            learner,
            s.objective,
            batch,
            ro,
            schedule,
            s.options,
            calibrate=s.objective.calibration_due(step, cfg.steps),
            shadow=shadow if cfg.engine.trainer_fp8 else None,
        )
    # 5: μ syncs to the behaviour weights (k steps old under staleness)
    t2 = time.time()
    s.sampler.load_weights_from_state(s.history.behaviour())
    t3 = time.time()
    # 6: metrics
    if s.ranks.world > 1:
        reps = [r for part in distributed.gather_objects(reps) for r in part]
    m = step_metrics(step, batch, rewards, reps, updates, skipped, guard, cfg) | refresh
    # rollout: sampling, rewards, the π_old pass; update: the minibatch optimizer steps
    m["time/rollout_s"], m["time/update_s"] = round(t1 - t0, 3), round(t2 - t1, 3)
    if cfg.engine.sampler != "hf":  # another engine reloads the weights: what that costs
        m["time/sync_s"] = round(t3 - t2, 4)
    if cfg.drivers.beta_growth != 1.0:
        m["drivers/beta_scale"] = beta_scale(cfg, step)
    if s.harder_task is not None:
        m["drivers/harder"] = float(harder)
    return m, bool(skipped and not updates)


def step_metrics(step, batch, rewards, reps, updates, skipped, guard, cfg) -> dict:
    """The step's line of metrics.jsonl: rewards, length, the dials on ρ = π_old/μ, the
    minibatches' objective metrics (their mean), repetition, and the collapse guard's state."""
    keys = sorted({k for u in updates for k in u})
    m = {
        "step": step,
        "reward/mean": float(rewards.mean()),
        "reward/acc": float((rewards > 0).double().mean()),
        "response/len": float(batch.mask.sum(1).mean()),
        "guard/nonfinite_skipped": skipped,
        **rollout_dials(batch),
        **{k: float(np.mean([u[k] for u in updates if k in u])) for k in keys},
        "repetition/terminal_loop_rate": float(np.mean([r["terminal_loop"] for r in reps])),
        "repetition/rate": float(np.mean([r["has_repetition"] for r in reps])),
    }
    return m | check_collapse(guard, m, cfg.guard)


@torch.no_grad()
def snr_refresh(s: Setup, cfg: DictConfig, task: Task, step: int) -> dict[str, float]:
    """snr_shrink adaptive=true: a calibration pass at the live weights (μ, with its noise, loaded
    with the trainer's current weights; the trainer scores at the same weights, so Δ = log π_old
    − log μ is β alone) on prompts of its own; the objective re-derives λ_b and its bounds."""
    t0 = time.time()
    seed = step_seed(cfg.seed, step) + 500_000  # prompts and draws apart from the training batches
    problems = task.sample(cfg.rollout.prompts_per_step, "train", seed)
    s.sampler.load_weights_from_state(s.history.newest())
    reward = partial(task.rollout_rewards, problems, tokenizer=s.tok)
    prompts, sampling = [p.prompt for p in problems], rollout_sampling(cfg, task)
    batch, _, _ = collect(s.sampler, s.policy, prompts, reward, sampling, s.options, seed=seed)
    s.sampler.load_weights_from_state(s.history.behaviour())
    m = batch.mask.bool()
    return s.objective.refresh(batch.log_rho[m], batch.p_t[m]) | {"snr/refresh_s": time.time() - t0}


def beta_scale(cfg: DictConfig, step: int) -> float:
    """drivers.beta_growth: 1 at step 1, linear to beta_growth at the last step."""
    return 1.0 + (cfg.drivers.beta_growth - 1.0) * (step - 1) / max(cfg.steps - 1, 1)


def run(cfg: DictConfig, validated: bool = False) -> dict[str, Any]:
    """Start (or resume), then steps first..cfg.steps: train, evaluate, log, checkpoint."""
    run_dir, s, first, guard = start(cfg, validated)
    eval_problems = s.task.sample(cfg.eval_n, "eval", cfg.eval_seed)
    budget, temperature = token_budget(cfg, s.task), cfg.rollout.temperature
    t_start, lead = time.time(), s.ranks.rank == 0
    shown = cfg.progress and lead and sys.stderr.isatty()  # a bar only where a person watches
    lines = lead and not shown and cfg.log_every > 0
    bar = tqdm(range(first, cfg.steps + 1), desc="train", disable=not shown)
    tracker = None
    if lead and cfg.logger != "none":
        container = OmegaConf.to_container(cfg, resolve=True)
        tracker = Tracker(cfg.logger, run_dir, container, project=f"ratiolab-{cfg.name}")
    nonfinite_run, last, rewards = 0, {}, []
    try:
        for step in bar:
            t0 = time.time()
            m, all_nonfinite = train_step(s, cfg, step, guard)
            nonfinite_run = nonfinite_run + 1 if all_nonfinite else 0
            if cfg.eval_every and (step % cfg.eval_every == 0 or step in (1, cfg.steps)):
                with high_precision(s.policy):  # θ itself, not its FP8 forward
                    acc = evaluate(
                        s.policy, s.task, eval_problems, budget, temperature, cfg.eval_seed, s.ranks
                    )
                m["eval/acc"] = acc
            m["time/step_s"] = round(time.time() - t0, 3)
            if lead:
                with (run_dir / "metrics.jsonl").open("a") as f:
                    f.write(json.dumps(m) + "\n")
                if tracker is not None:
                    tracker.log(m)
                if lines and step % cfg.log_every == 0:
                    print(plain_line(m, cfg.steps), flush=True)
                if first == 1 and step <= SIGNAL_STEPS:
                    rewards.append(m["reward/mean"])
                    if (warning := no_signal(rewards)) is not None:
                        print(warning, file=sys.stderr, flush=True)
            last = m
            postfix = {"reward": "reward/mean", "entropy": "entropy/mean", "eval": "eval/acc"}
            bar.set_postfix({k: round(m[v], 3) for k, v in postfix.items() if v in m})
            aborting = nonfinite_run >= cfg.guard.max_nonfinite
            due = step % cfg.checkpoint_every == 0 or step == cfg.steps
            if aborting or (nonfinite_run == 0 and due):
                checkpoint.save(run_dir, step, s, guard, cfg.keep_checkpoints, aborted=aborting)
            if aborting:
                raise TrainingAborted(
                    f"{nonfinite_run} consecutive steps with a non-finite loss, gradient or "
                    f"weights (limit guard.max_nonfinite={cfg.guard.max_nonfinite}); the state "
                    f"at the abort is {run_dir}/checkpoints/abort_step_{step}.pt; a rerun resumes "
                    "from the last known-good checkpoint. Lower the learning rate "
                    "(resume=override optim.lr=...) or check the objective's bounds."
                )
    finally:
        if tracker is not None:
            tracker.close()
    if lead and cfg.save_final:
        checkpoint.save_final(run_dir, s.policy.model, s.tok)
    if lead:
        update_meta(run_dir, last_step=cfg.steps)
        wall = time.time() - t_start
        print(checkpoint.end_line(run_dir, last, cfg.steps, first, wall), flush=True)
    s.sampler.close()
    del s  # the sharded trainer goes before its process group (distributed.close)
    distributed.close()
    return last


config.register()


@hydra.main(config_path=str(CONFIGS), config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> dict[str, Any]:
    return run_task(partial(run, validated=True), cfg, check=validate)  # validated once, first


if __name__ == "__main__":
    from harness.train import main as _main  # by reference: submitit pickles harness.train.main

    plugins.load(plugins.from_argv(sys.argv[1:]))  # before composition: objective=<a plugin's>
    _main()
