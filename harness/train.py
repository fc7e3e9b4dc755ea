"""GRPO on verifiable tasks with controlled α and β — and on-policy self-distillation.

    python -m harness.train                              # clean GRPO, arithmetic task model
    python -m harness.train objective=cispo noise=logit      # any registered objective / noise
    python -m harness.train alpha.staleness=2 alpha.minibatches=4

Per step: the sampler μ (its own copy of the weights, with the configured noise β) samples G
responses per prompt; rewards; group-normalised advantages (GRPO; `drgrpo` drops the std); the
trainer recomputes `logp_old` at the behaviour weights; m minibatches (α source 1), optional
staleness k (α source 2); objective from the registry; AdamW with gradient clipping; weight sync
to the sampler (FP8 weights re-quantised there). Departures from the named algorithms: no KL
term to a reference policy, no entropy bonus (those would blur what the corrections do).

With `distill.enabled` (OPSD, arXiv 2609.38995), the teacher is the frozen initial model
conditioned on the reference solution, and the student minimises `opsd_fkl` (clipped or exact)
on its own samples.

The run directory holds config.yaml, metrics.jsonl (one JSON line per step), meta.json and
checkpoints/ (atomic); re-running in the same directory resumes from the latest checkpoint.

    torchrun --nproc_per_node=N -m harness.train ...   # FSDP2 across N ranks
    (harness.base.distributed)

Across ranks each rank samples its share of the step's groups; the objective, the metrics and
the evaluation see the global batch; rank 0 alone writes files and shows the progress bar.
"""

from __future__ import annotations

import json
import random
import shutil
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

from harness.base import distributed
from harness.base.batch import TokenBatch
from harness.base.io import write_json_atomic, write_text_atomic
from harness.base.models import save_folder
from harness.noise.fp8 import high_precision, shadow_pass
from harness.objectives.opsd import teacher_inputs
from harness.rl.alpha import minibatch_schedule
from harness.rl.checkpoint import (
    checkpoint_state,
    checkpoints,
    config_contract,
    resume,
    roll_back,
    save_checkpoint,
    save_sharded,
)
from harness.rl.setup import Setup, build_setup, rollout_sampling, step_seed, token_budget
from harness.rl.step import collect, gather_batch, share_rows, update, update_distill
from harness.runs import config as _schema  # noqa: F401  (registers the structured-config schema)
from harness.runs.launch import read_json, run_task, update_meta
from harness.runs.tracking import Tracker, plain_line
from harness.runs.validate import validate, validate_ranks
from harness.sampling.engines import Engine
from harness.stats.diagnostics import bin_means, check_collapse, dials, identity_check
from harness.stats.repetition import repetition_reports
from harness.tasks import Task


class TrainingAborted(RuntimeError):
    pass


# --- metrics -----------------------------------------------------------------------------------


def rollout_dials(batch: TokenBatch) -> dict[str, float]:
    """The dials of harness.stats.diagnostics on ρ = π_old/μ (the trainer at the behaviour weights
    vs
        the sampler: Table 1 row 3) and the identity check, plus the trainer's entropy per bin."""
    m, x = batch.mask, batch.log_rho
    chk = identity_check(batch.logp_recompute, batch.logp_mu, m)
    return {
        "identity/mean_ratio": chk.mean_ratio,
        "identity/ok": float(chk.ok),
        **{f"dial/{k}": v for k, v in dials(x, m, batch.p_t).items()},
        "entropy/mean": float(batch.entropy[m.bool()].mean()),
        **bin_means(batch.entropy, batch.p_t, m, "entropy"),
    }


def mean_dicts(ds: list[dict[str, float]]) -> dict[str, float]:
    keys = {k for d in ds for k in d}
    return {k: float(np.mean([d[k] for d in ds if k in d])) for k in sorted(keys)}


@torch.no_grad()
def evaluate(engine: Engine, task: Task, problems, cfg: DictConfig, ranks=distributed.ONE) -> float:
    """Accuracy on the fixed held-out set: one sample per problem at the rollout temperature,
    from the trainer's current weights (clean numerics), seed `eval_seed`; nan when the weights
    give a non-finite distribution (the next rollout then aborts the run). Across ranks each
    samples its share of the problems (with the draws of the whole set's rows) and the rewards
    are summed over the ranks."""
    mine = ranks.split(len(problems))
    try:
        ro = engine.generate(
            [p.prompt for p in problems[mine]],
            n=1,
            max_new_tokens=token_budget(cfg, task),
            temperature=cfg.rollout.temperature,
            seed=cfg.eval_seed,
            batch_rows=(mine.start, len(problems)) if ranks.world > 1 else None,
        )
    except FloatingPointError as e:
        print(f"[train] eval skipped: {e}", flush=True)
        return float("nan")
    rewards = task.rollout_rewards(problems[mine], ro, engine.tokenizer)
    if ranks.world == 1:
        return float(rewards.mean())
    return float(distributed.sum_over_ranks(rewards.double().sum())) / len(problems)


# --- the loop ----------------------------------------------------------------------------------


def step_metrics(step, batch, rewards, reps, updates, skipped, guard, cfg) -> dict:
    m = {
        "step": step,
        "reward/mean": float(rewards.mean()),
        "reward/acc": float((rewards > 0).double().mean()),
        "response/len": float(batch.mask.sum(1).mean()),
        "guard/nonfinite_skipped": skipped,
        **rollout_dials(batch),
        **mean_dicts(updates),
        "repetition/terminal_loop_rate": float(np.mean([r["terminal_loop"] for r in reps])),
        "repetition/rate": float(np.mean([r["has_repetition"] for r in reps])),
    }
    return m | check_collapse(guard, m, cfg.guard)


@torch.no_grad()
def snr_refresh(s: Setup, cfg: DictConfig, task: Task, step: int) -> dict[str, float]:
    """snr_shrink adaptive=true: a calibration pass at the live weights (the sampler, with its
    noise, loaded with the trainer's current weights; the trainer scores at the same weights,
    so Δ = log π_old − log μ is β alone) on prompts of its own, then the objective re-derives
    λ_b and its bounds. Returns the new values and the pass's cost (snr/refresh_s)."""
    t0 = time.time()
    seed = step_seed(cfg.seed, step) + 500_000  # prompts and draws apart from the training batches
    problems = task.sample(cfg.rollout.prompts_per_step, "train", seed)
    s.sampler.load_weights_from_state(s.history.newest())
    reward = partial(task.rollout_rewards, problems, tokenizer=s.tok)
    batch, _, _ = collect(
        s.sampler, s.policy, [p.prompt for p in problems], reward, rollout_sampling(cfg, task),
        seed=seed, advantage=cfg.advantage, mask_replay=cfg.engine.mask_replay,
    )  # fmt: skip
    s.sampler.load_weights_from_state(s.history.behaviour())
    m = batch.mask.bool()
    out = s.objective.refresh(batch.log_rho[m], batch.p_t[m])
    return out | {"snr/refresh_s": time.time() - t0}


def beta_scale(cfg: DictConfig, step: int) -> float:
    """drivers.beta_growth: 1 at step 1, linear to beta_growth at the last step."""
    frac = (step - 1) / max(cfg.steps - 1, 1)
    return 1.0 + (cfg.drivers.beta_growth - 1.0) * frac


def start(cfg: DictConfig) -> tuple[Path, Setup, int, dict]:
    """Validate, write config.yaml, run the step-0 mechanism check, build the setup and resume:
    (run directory, setup, first step, collapse-guard state). Across ranks, rank 0 writes the
    files and runs the mechanism check while the others wait."""
    from harness.base.models import resolve_device
    from harness.runs.validate import fsdp

    validate(cfg)
    ranks = distributed.environment()
    validate_ranks(cfg, ranks.world)
    distributed.init(ranks, resolve_device(cfg.engine.device), always=fsdp(cfg))
    run_dir = Path(cfg.out)
    run_dir.mkdir(parents=True, exist_ok=True)
    changed = config_contract(run_dir, cfg)
    lead = ranks.rank == 0
    if lead:
        write_text_atomic(run_dir / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
    # every rank takes the same decision (rank 0's view of the folder): the check is collective
    if cfg.mechanism_batches and distributed.all_true(not (run_dir / "mechanism.json").exists()):
        # the step-0 mechanism check on a setup of its own, before the run's seeds are set:
        # its draws (fresh noise, model init) cannot move the run's (tested); across ranks each
        # scores its share of the batches with the sharded trainer, as a training step does
        from harness.rl import mechanism

        check = mechanism.run(cfg, validated=True, ranks=ranks)
        if lead:
            write_json_atomic(run_dir / "mechanism.json", check)
    distributed.barrier()
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    s = build_setup(cfg, ranks)
    first, guard = resume(s, run_dir, run_dir / "metrics.jsonl", cfg)
    distributed.barrier()
    if lead:
        update_meta(run_dir, model=s.identity)
    if lead and changed:
        history = read_json(run_dir / "meta.json").get("config_overrides", [])
        update_meta(run_dir, config_overrides=[*history, {"from_step": first, "changed": changed}])
    s.sampler.load_weights_from_state(s.history.behaviour())
    if lead:
        update_meta(run_dir, resumed_from_step=first - 1)
    return run_dir, s, first, guard


def train_step(s: Setup, cfg: DictConfig, step: int, guard: dict) -> tuple[dict, bool]:
    """One step: μ samples, π_old scores, the objective trains on m minibatches, μ syncs to the
    behaviour weights. Returns the step's metrics and whether every update was non-finite."""
    seed = step_seed(cfg.seed, step)
    if cfg.drivers.beta_growth != 1.0:  # a pure function of the step, on the same noise field
        for noise, sigma in s.sigma0:
            noise.sigma = sigma * beta_scale(cfg, step)
    harder = s.harder_task is not None and step >= cfg.drivers.harder_at
    task = s.harder_task if harder else s.task
    problems = task.sample(cfg.rollout.prompts_per_step, "train", seed)
    own, batch_rows = share_rows(s.ranks, len(problems), cfg.rollout.group_size)
    problems = problems[own]  # this rank's groups
    snr = {}
    if getattr(s.objective, "adaptive", False) and step > 1 and (step - 1) % s.objective.every == 0:
        snr = snr_refresh(s, cfg, task, step)
    if s.old_policy is not None and s.old_policy is not s.policy:
        s.old_policy.load_weights_from_state(s.history.behaviour())
    reward = partial(task.rollout_rewards, problems, tokenizer=s.tok)
    t_rollout = time.time()
    try:
        batch, ro, rewards = collect(
            s.sampler, s.old_policy, [p.prompt for p in problems], reward,
            rollout_sampling(cfg, task), seed=seed, advantage=cfg.advantage,
            logp_old_source=cfg.engine.logp_old_source, mask_replay=cfg.engine.mask_replay,
            batch_rows=batch_rows,
        )  # fmt: skip
    except FloatingPointError as e:
        raise TrainingAborted(
            f"step {step}: {e}. The weights diverged (finite but huge) after step {step - 1}; "
            f"the checkpoints in {cfg.out}/checkpoints hold earlier steps. Lower optim.lr."
        ) from e
    rollout_s, t_update = time.time() - t_rollout, time.time()
    local = batch
    if s.ranks.world > 1:
        batch, rewards = gather_batch(batch), distributed.gather_rows(rewards)
    schedule = minibatch_schedule(
        len(rewards), cfg.alpha.minibatches, cfg.alpha.staleness, seed=step
    )
    on_step, restore = (lambda: s.history.push(s.trainer)), partial(roll_back, s)
    reps = repetition_reports(ro.response_ids, ro.response_mask)
    if s.teacher is not None:
        t_ids, t_mask, exit_metrics = teacher_inputs(
            s.policy, problems, cfg.distill.teacher_prompt, cfg.rollout.group_size, reps
        )
        updates, skipped = update_distill(
            s.policy, s.teacher, s.objective, local, ro, schedule, s.opt, cfg.optim.grad_clip,
            t_ids, t_mask, exit_metrics, on_step=on_step, restore=restore, ranks=s.ranks,
        )  # fmt: skip
    else:
        calibrate = hasattr(s.objective, "calibrate") and (
            (step - 1) % s.objective.calibrate_every == 0
        )
        shadow = shadow_pass(s.policy, s.old_policy, ro, cfg.engine.mask_replay)
        batch, updates, skipped = update(
            s.policy, s.objective, batch, ro, schedule, s.opt, cfg.optim.grad_clip,
            mask_replay=cfg.engine.mask_replay, logp_old_source=cfg.engine.logp_old_source,
            calibrate=calibrate, on_step=on_step, restore=restore,
            shadow=shadow if cfg.engine.trainer_fp8 else None, ranks=s.ranks,
        )  # fmt: skip
    t_sync = time.time()
    s.sampler.load_weights_from_state(s.history.behaviour())  # staleness: k steps old
    sync_s, update_s = time.time() - t_sync, t_sync - t_update
    if s.ranks.world > 1:
        reps = [r for part in distributed.gather_objects(reps) for r in part]
    m = step_metrics(step, batch, rewards, reps, updates, skipped, guard, cfg) | snr
    # rollout: sampling, rewards, the π_old pass; update: the minibatch optimizer steps
    m["time/rollout_s"], m["time/update_s"] = round(rollout_s, 3), round(update_s, 3)
    if cfg.engine.sampler != "hf":  # another engine reloads the weights: what that costs
        m["time/sync_s"] = round(sync_s, 4)
    if cfg.drivers.beta_growth != 1.0:
        m["drivers/beta_scale"] = beta_scale(cfg, step)
    if s.harder_task is not None:
        m["drivers/harder"] = float(harder)
    return m, bool(skipped and not updates)


def run(cfg: DictConfig) -> dict[str, Any]:
    run_dir, s, first, guard = start(cfg)
    eval_problems = s.task.sample(cfg.eval_n, "eval", cfg.eval_seed)
    t_start, lead = time.time(), s.ranks.rank == 0
    shown = cfg.progress and lead and sys.stderr.isatty()  # a bar only where a person watches
    lines = lead and not shown and cfg.log_every > 0
    bar = tqdm(range(first, cfg.steps + 1), desc="train", disable=not shown)
    tracker = None
    if lead and cfg.logger != "none":
        container = OmegaConf.to_container(cfg, resolve=True)
        tracker = Tracker(cfg.logger, run_dir, container, project=f"ratiolab-{cfg.name}")
    try:
        last = train_loop(cfg, s, run_dir, bar, first, guard, eval_problems, tracker, lines)
    finally:
        if tracker is not None:
            tracker.close()
    if lead and cfg.save_final:
        save_folder(s.policy.model, s.tok, run_dir / "final.tmp-swap")
        shutil.rmtree(run_dir / "final", ignore_errors=True)  # a rerun's final replaces it
        (run_dir / "final.tmp-swap").rename(run_dir / "final")
    if lead:
        update_meta(run_dir, last_step=cfg.steps)
        print(end_line(run_dir, last, cfg.steps, first, time.time() - t_start), flush=True)
    s.sampler.close()
    del s  # the sharded trainer goes before its process group (distributed.close)
    distributed.close()
    return last


def disk_bytes(path: Path) -> int:
    """A checkpoint's size on disk: a file, or a sharded run's folder."""
    return path.stat().st_size if path.is_file() else sum(f.stat().st_size for f in path.rglob("*"))


def end_line(run_dir: Path, last: dict, steps: int, first: int, wall_s: float) -> str:
    """The run's last words in a log: where it is, how far it got, its last numbers and the
    size of what resume reads (weights, optimizer state, the weight history of staleness)."""
    if not last:  # resumed at its end: nothing ran
        return f"[train] {run_dir}: already at step {steps}; nothing to run"
    done = last["step"] - first + 1
    kept = checkpoints(run_dir)
    size = sum(disk_bytes(p) for p in kept) / 2**30
    return (f"[train] done {run_dir}: step {last['step']}/{steps} ({done} steps in "
            f"{wall_s:.0f} s); {len(kept)} checkpoint(s), {size:.2f} GiB; last step: "
            f"{plain_line(last, steps)}")  # fmt: skip


SIGNAL_STEPS = 5  # a fresh run's first steps, read for a learning signal


def no_signal(rewards: list[float]) -> str | None:
    """Why the first steps trained nothing, or None: {0, 1} rewards whose step means are all 0
    (or all 1) leave every group's advantages 0, so the policy gradient is 0."""
    if len(rewards) < SIGNAL_STEPS or len(set(rewards)) > 1 or rewards[0] not in (0.0, 1.0):
        return None
    every = "wrong" if rewards[0] == 0 else "right"
    return (f"WARNING no learning signal: the mean reward of steps 1–{len(rewards)} is "
            f"{rewards[0]:g} in every step (every response {every}): group-normalised "
            "advantages are 0 and nothing trains. Check the task's grading against a few "
            "responses, or start from a model that solves some problems.")  # fmt: skip


def train_loop(cfg, s, run_dir, bar, first, guard, eval_problems, tracker, lines) -> dict:
    """Steps `first`..`cfg.steps`: train, evaluate, write metrics (rank 0), checkpoint."""
    nonfinite_run, last, lead, rewards = 0, {}, s.ranks.rank == 0, []
    for step in bar:
        t0 = time.time()
        m, all_nonfinite = train_step(s, cfg, step, guard)
        nonfinite_run = nonfinite_run + 1 if all_nonfinite else 0
        if cfg.eval_every and (step % cfg.eval_every == 0 or step == cfg.steps or step == 1):
            with high_precision(s.policy):  # θ itself, not its FP8 forward
                m["eval/acc"] = evaluate(s.policy, s.task, eval_problems, cfg, s.ranks)
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
        shown = {"reward": "reward/mean", "entropy": "entropy/mean", "eval": "eval/acc"}
        bar.set_postfix({k: round(m[v], 3) for k, v in shown.items() if v in m})
        aborting = nonfinite_run >= cfg.guard.max_nonfinite
        if aborting or (
            nonfinite_run == 0 and (step % cfg.checkpoint_every == 0 or step == cfg.steps)
        ):
            state = checkpoint_state(s, step, guard)
            if s.policy.sharded:
                save_sharded(run_dir, step, s, state, cfg.keep_checkpoints, aborted=aborting)
            else:
                save_checkpoint(run_dir, step, state, cfg.keep_checkpoints, aborted=aborting)
        if aborting:
            raise TrainingAborted(
                f"{nonfinite_run} consecutive steps with a non-finite loss, gradient or weights "
                f"(limit guard.max_nonfinite={cfg.guard.max_nonfinite}); the state at the abort is "
                f"{run_dir}/checkpoints/abort_step_{step}.pt; a rerun resumes from the last "
                "known-good checkpoint. Lower the learning rate (resume=override optim.lr=...) "
                "or check the objective's bounds."
            )
    return last


CONFIGS = str(Path(__file__).resolve().parents[1] / "experiments")


@hydra.main(config_path=CONFIGS, config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> dict[str, Any]:
    return run_task(run, cfg)


if __name__ == "__main__":
    from harness.train import main as _main  # by reference: submitit pickles harness.train.main

    _main()
