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

With `distill.enabled` (seed 003), the teacher is the frozen initial model conditioned on the
reference solution, and the student minimises `opsd_fkl` (clipped or exact) on its own samples.

The run directory holds config.yaml, metrics.jsonl (one JSON line per step), meta.json and
checkpoints/ (atomic); re-running in the same directory resumes from the latest checkpoint.
"""

from __future__ import annotations

import copy
import json
import math
import random
import time
from pathlib import Path
from typing import Any

import hydra
import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from harness import config as _schema  # noqa: F401  (registers the structured-config schema)
from harness.alpha import WeightHistory, minibatch_schedule
from harness.batch import TokenBatch, identity_check
from harness.engines import Engine, Rollout
from harness.io import write_text_atomic
from harness.launch import run_task, update_meta
from harness.logprobs import chunked_logp, replay_mask
from harness.models import load_model, resolve_dtype, upcycle_to_moe
from harness.noise import build_noise
from harness.objectives import build_objective
from harness.registry import build
from harness.repetition import copy_token_probs, exit_mass, repetition_report
from harness.tasks import TASKS, Task

CONF_BINS = (0.0, 0.1, 0.3, 0.5, 0.7, 0.9, 0.99, 1.0)


class TrainingAborted(RuntimeError):
    pass


# --- set-up ------------------------------------------------------------------------------------


def split_node(node: Any) -> tuple[str, dict[str, Any]]:
    d = OmegaConf.to_container(node, resolve=True) if not isinstance(node, dict) else dict(node)
    if "name" not in d:
        raise ValueError(f"config node {d} needs a `name` (the registry key)")
    name = d.pop("name")
    return name, d


def build_task_and_model(cfg: DictConfig) -> tuple[Task, torch.nn.Module, Any]:
    task_name, task_kw = split_node(cfg.task)
    if cfg.model.spec == "task-model":
        from harness.warmstart import load_task_model, resolve_recipe

        warm = OmegaConf.to_container(cfg.model.warmstart, resolve=True)
        task_kw = {**resolve_recipe(task_name, **warm)["task_kwargs"], **task_kw}
        model, tok = load_task_model(task_name, progress=cfg.progress, **warm)
    else:
        model, tok = load_model(cfg.model.spec, dtype="fp32", seed=cfg.seed)
    if cfg.model.upcycle:
        model = upcycle_to_moe(model, **OmegaConf.to_container(cfg.model.upcycle, resolve=True))
    task = build(TASKS, task_name, "task", **task_kw)
    return task, model.to(resolve_dtype(cfg.engine.trainer_dtype)), tok


def build_sampler(cfg: DictConfig, model: torch.nn.Module, tok) -> Engine:
    """The sampler holds its own copy of the weights: dtype, attention path and noise are μ's."""
    smp = copy.deepcopy(model).to(resolve_dtype(cfg.engine.sampler_dtype))
    smp.config._attn_implementation = cfg.engine.sampler_attention
    specs = [split_node(n) for n in [cfg.noise, *cfg.extra_noise]]
    noise = [build_noise(name, **kw) for name, kw in specs if name != "none"]
    return Engine(smp, tok, noise=noise, kv_cache=cfg.engine.kv_cache)


def group_advantages(rewards: torch.Tensor, group: torch.Tensor, kind: str) -> torch.Tensor:
    """GRPO: (r − mean_g) / (std_g + 1e-6); Dr.GRPO: r − mean_g (no std normalisation)."""
    if kind not in ("grpo", "drgrpo"):
        raise ValueError(f"advantage={kind!r}; valid: 'grpo', 'drgrpo'")
    adv = torch.empty_like(rewards)
    for g in group.unique():
        sel = group == g
        centred = rewards[sel] - rewards[sel].mean()
        adv[sel] = (
            centred / (rewards[sel].std(unbiased=False) + 1e-6) if kind == "grpo" else centred
        )
    return adv


def trainer_logp(
    engine: Engine,
    ro: Rollout,
    rows: torch.Tensor,
    keep: torch.Tensor | None,
    with_stats: bool = False,
):
    """log π_θ of the sampled tokens with grad (chunked fused log-softmax), [b, T]; with_stats
    also returns the detached per-token `p_t`, `entropy`, `p_sq_sum` of the same pass."""
    h = engine.hidden_states(ro.tokens[rows], ro.attention_mask[rows], ro.n_prompt)
    b, T, H = h.shape
    targets = ro.response_ids[rows].reshape(-1)
    k = keep.view(-1, T, keep.shape[-1])[rows].reshape(b * T, -1) if keep is not None else None
    w = engine.model.get_output_embeddings().weight
    out = chunked_logp(h.reshape(b * T, H), w, targets, ro.temperature, k, with_stats=with_stats)
    if not with_stats:
        return out.view(b, T)
    return out[0].view(b, T), {key: v.view(b, T) for key, v in out[1].items()}


def student_teacher_logits(student: Engine, teacher, ro: Rollout, rows, teacher_ids, teacher_mask):
    """Full logits at the response positions: the student's (with grad) and the frozen teacher's
    conditioned on its privileged prompt (same response tokens, longer prompt)."""
    T = ro.response_ids.shape[1]
    s = student.model(input_ids=ro.tokens[rows], attention_mask=ro.attention_mask[rows]).logits
    t_ids = torch.cat([teacher_ids, ro.response_ids[rows]], 1)
    t_mask = torch.cat([teacher_mask, ro.response_mask[rows].long()], 1)
    with torch.no_grad():
        t = teacher(input_ids=t_ids, attention_mask=t_mask).logits
    return s[:, -T - 1 : -1], t[:, -T - 1 : -1]


@torch.no_grad()
def copy_exit_mass(s_logits, t_logits, reports: list[dict]) -> dict[str, float]:
    """OPSD Table 2 at first-copy positions: exit mass 1 − p(copy token) under the teacher and
    1 − q under the student (T = 1 softmax); ratio R = Σ(1−q)/Σ(1−p) < 1 means the student is
    more willing than its teacher to continue the loop."""
    p, q = [], []
    for s, t, rep in zip(s_logits, t_logits, reports):
        pos, tok = rep["first_copy_positions"], rep["first_copy_tokens"]
        if pos:
            p.append(copy_token_probs(t.float().softmax(-1), pos, tok))
            q.append(copy_token_probs(s.float().softmax(-1), pos, tok))
    if not p:
        return {}
    em = exit_mass(torch.cat(p), torch.cat(q))
    return {
        "repetition/exit_mass_ratio": em["ratio"],
        "repetition/copy_frac_student_above": em["frac_student_above"],
        "repetition/first_copy_positions": float(em["n"]),
    }


# --- checkpoints -------------------------------------------------------------------------------


def latest_checkpoint(run: Path) -> Path | None:
    cks = sorted((run / "checkpoints").glob("step_*.pt"), key=lambda p: int(p.stem[5:]))
    return cks[-1] if cks else None


def save_checkpoint(run: Path, step: int, state: dict, keep: int) -> Path:
    d = run / "checkpoints"
    d.mkdir(parents=True, exist_ok=True)
    tmp = d / f".step_{step}.pt.tmp"
    torch.save(state, tmp)
    dest = d / f"step_{step}.pt"
    tmp.replace(dest)  # atomic: a crash leaves at most a .tmp file, never a torn checkpoint
    for old in sorted(d.glob("step_*.pt"), key=lambda p: int(p.stem[5:]))[:-keep]:
        old.unlink()
    return dest


def truncate_metrics(path: Path, last_step: int) -> None:
    """On resume, drop metric lines written after the checkpoint (they will be recomputed)."""
    if not path.exists():
        return
    keep = [
        ln for ln in path.read_text().splitlines() if ln and json.loads(ln)["step"] <= last_step
    ]
    write_text_atomic(path, "".join(ln + "\n" for ln in keep))


def rng_state() -> dict:
    return {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
    }


def set_rng_state(s: dict) -> None:
    torch.set_rng_state(s["torch"])
    random.setstate(s["python"])
    np.random.set_state(s["numpy"])


# --- metrics -----------------------------------------------------------------------------------


def confidence_bin_means(x: torch.Tensor, p_t: torch.Tensor, mask: torch.Tensor, key: str) -> dict:
    out = {}
    m = mask.bool()
    for lo, hi in zip(CONF_BINS[:-1], CONF_BINS[1:]):
        sel = m & (p_t >= lo) & ((p_t < hi) if hi < 1 else (p_t <= hi))
        if sel.any():
            out[f"{key}/bin_{lo:g}-{hi:g}"] = float(x[sel].mean())
    return out


def rollout_dials(logp_old, ro: Rollout, entropy, p_t) -> dict[str, float]:
    """Table 7 dials on the training–inference ratio (row 3) and the identity check."""
    m = ro.response_mask.bool()
    d = (logp_old - ro.logp_mu)[m]
    r = d.double().clamp(-20, 20).exp()
    chk = identity_check(logp_old, ro.logp_mu, ro.response_mask)
    nonmatch = d.abs() > 1e-6
    return {
        "identity/mean_ratio": chk.mean_ratio,
        "identity/ok": float(chk.ok),
        "dial/capped_mean_ratio": float(r.clamp(max=2.0).mean()),
        "dial/uncapped_mean_ratio": float(r.mean()),
        "dial/mean_abs_delta": float(d.abs().mean()),
        "dial/mean_abs_delta_nonmatching": float(d[nonmatch].abs().mean()) if nonmatch.any() else 0,
        "dial/p99_abs_delta": float(d.abs().quantile(0.99)) if d.numel() else 0.0,
        "dial/ess_token": float(r.sum() ** 2 / (r.numel() * (r * r).sum())),
        "dial/out_of_band_frac": float(((r < 0.5) | (r > 2.0)).double().mean()),
        "entropy/mean": float(entropy[m].mean()),
        **confidence_bin_means(entropy, p_t, ro.response_mask, "entropy"),
    }


def mean_dicts(ds: list[dict[str, float]]) -> dict[str, float]:
    keys = {k for d in ds for k in d}
    return {k: float(np.mean([d[k] for d in ds if k in d])) for k in sorted(keys)}


def check_collapse(guard: dict, m: dict, g) -> dict[str, float]:
    """Entropy surge (entropy > surge × the first-10-step mean) and reward collapse (10-step
    reward mean < collapse × the best 10-step mean seen); each flags an event in the metrics."""
    guard["entropy0"] = (guard["entropy0"] + [m["entropy/mean"]])[:10]
    rewards = guard.setdefault("recent_reward", [])
    rewards.append(m["reward/mean"])
    del rewards[:-10]
    base = float(np.mean(guard["entropy0"]))
    recent = float(np.mean(rewards))
    if len(rewards) == 10:
        guard["best_reward"] = max(guard["best_reward"], recent)
    surge = len(guard["entropy0"]) == 10 and m["entropy/mean"] > g.entropy_surge * base
    collapse = guard["best_reward"] > 0 and recent < g.reward_collapse * guard["best_reward"]
    if surge or collapse:
        guard["events"] += 1
    return {
        "collapse/entropy_surge": float(surge),
        "collapse/reward_collapse": float(collapse),
        "collapse/events": float(guard["events"]),
    }


@torch.no_grad()
def evaluate(engine: Engine, task: Task, problems, cfg: DictConfig) -> float:
    """Accuracy on the held-out split: one sample per problem at the rollout temperature, from
    the trainer's current weights (clean numerics), fixed seed."""
    ro = engine.generate(
        [p.prompt for p in problems],
        n=1,
        max_new_tokens=cfg.rollout.max_new_tokens,
        temperature=cfg.rollout.temperature,
        seed=cfg.seed,
    )
    return float(task.rollout_rewards(problems, ro, engine.tokenizer).mean())


# --- the loop ----------------------------------------------------------------------------------


def run(cfg: DictConfig) -> dict[str, Any]:
    for key, value, valid in [
        ("engine.logp_old_source", cfg.engine.logp_old_source, ("trainer", "sampler")),
        ("advantage", cfg.advantage, ("grpo", "drgrpo")),
    ]:
        if value not in valid:  # fail before any model is loaded
            raise ValueError(f"{key}={value!r}; valid: {', '.join(map(repr, valid))}")
    run_dir = Path(cfg.out)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(run_dir / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)

    task, model, tok = build_task_and_model(cfg)
    trainer = Engine(model, tok)
    sampler = build_sampler(cfg, model, tok)
    replay = None
    if cfg.engine.routing_replay:
        replay = build_noise("replay")
        trainer.noise.append(replay)
        replay.attach(model)
    obj_name, obj_kw = split_node(cfg.objective)
    if obj_name != "opsd_fkl":
        obj_kw.setdefault("aggregation", cfg.aggregation)
    objective = build_objective(obj_name, **obj_kw)
    if cfg.distill.enabled != (objective.inputs == "logits"):
        raise ValueError(
            "distill.enabled=true needs objective=opsd_fkl, and opsd_fkl needs distill.enabled"
        )
    teacher = copy.deepcopy(model).eval().requires_grad_(False) if cfg.distill.enabled else None
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=cfg.optim.lr,
        betas=(cfg.optim.beta1, cfg.optim.beta2),
        weight_decay=cfg.optim.weight_decay,
        fused=True,  # one kernel over all parameters: ~4× faster step on smollm2 (CPU, bench)
    )
    history = WeightHistory(cfg.alpha.staleness)
    history.push(model)

    start, nonfinite_run, guard = 1, 0, {"entropy0": [], "best_reward": -math.inf, "events": 0}
    metrics_path = run_dir / "metrics.jsonl"
    ck = latest_checkpoint(run_dir)
    if ck is not None:
        state = torch.load(ck, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        objective.load_state_dict(state["objective"])
        history = state["history"]
        guard = state["guard"]
        set_rng_state(state["rng"])
        start = state["step"] + 1
        truncate_metrics(metrics_path, state["step"])
        print(f"[train] resumed from {ck} (step {state['step']})", flush=True)
    elif metrics_path.exists():
        metrics_path.unlink()  # a fresh run: never append to a previous run's log
    sampler.load_weights_from_state(history.behaviour())

    update_meta(run_dir, resumed_from_step=start - 1)
    eval_problems = task.sample(cfg.eval_n, "eval", cfg.seed)
    bar = tqdm(range(start, cfg.steps + 1), desc="train", disable=not cfg.progress)
    last: dict[str, Any] = {}
    reuse_old = (
        cfg.reuse_old_logp
        and cfg.alpha.staleness == 0
        and cfg.alpha.minibatches == 1
        and cfg.engine.logp_old_source == "trainer"
        and teacher is None
        and not cfg.engine.routing_replay  # score_rollout is what sets the replay indices
    )
    for step in bar:
        t0 = time.time()
        # --- rollout: μ samples G responses per prompt -----------------------------------------
        problems = task.sample(cfg.rollout.prompts_per_step, "train", cfg.seed * 1_000_003 + step)
        ro = sampler.generate(
            [p.prompt for p in problems],
            n=cfg.rollout.group_size,
            max_new_tokens=cfg.rollout.max_new_tokens,
            temperature=cfg.rollout.temperature,
            top_p=cfg.rollout.top_p,
            top_k=cfg.rollout.top_k,
            seed=cfg.seed * 1_000_003 + step,
        )
        rewards = task.rollout_rewards(problems, ro, tok)
        adv = group_advantages(rewards, ro.prompt_index, cfg.advantage)

        keep = None
        if cfg.engine.mask_replay and ro.support is not None:
            keep = replay_mask(ro.support, ro.response_ids, model.config.vocab_size)

        # --- trainer recompute of logp_old at the behaviour weights -----------------------------
        # With staleness the trainer's current weights are ahead of the behaviour weights; π_old
        # is the trainer at the weights the sampler used (decoupled PPO's behaviour policy).
        # At staleness 0 with one minibatch θ = θ_old, so the training pass doubles as the
        # recompute (π_old := sg(π_θ), as TRL does): one trainer forward fewer per step.
        all_rows = torch.arange(ro.response_ids.shape[0])
        logp_first = None
        if reuse_old:
            logp_first, sc = trainer_logp(trainer, ro, all_rows, keep, with_stats=True)
            sc["logp"] = logp_first.detach()
        else:
            cur = None
            if history.lag() > 0:
                cur = {k: v.detach().clone() for k, v in model.state_dict().items()}
                model.load_state_dict(history.behaviour())
            sc = trainer.score_rollout(ro, mask_replay=cfg.engine.mask_replay)
            if cur is not None:
                model.load_state_dict(cur)
        batch = TokenBatch(
            tokens=ro.response_ids,
            mask=ro.response_mask,
            # "sampler": no recompute, π_old := μ (frameworks that bypass the trainer recompute);
            # the clip then acts on π_θ/μ = α + β
            logp_old=sc["logp"] if cfg.engine.logp_old_source == "trainer" else ro.logp_mu,
            logp_mu=ro.logp_mu,
            advantages=adv[:, None].expand_as(ro.logp_mu).contiguous() * ro.response_mask,
            p_t=sc["p_t"],
            entropy=sc["entropy"],
            p_sq_sum=sc["p_sq_sum"],
            group_id=ro.prompt_index,
            seq_id=torch.arange(ro.response_ids.shape[0]),
        )
        if teacher is not None:
            t_prompts = [
                cfg.distill.teacher_prompt.format(prompt=p.prompt, solution=p.solution)
                for p in problems
            ]
            t_ids, t_mask = trainer.encode_prompts(t_prompts)
            t_ids = t_ids.repeat_interleave(cfg.rollout.group_size, 0)
            t_mask = t_mask.repeat_interleave(cfg.rollout.group_size, 0)

        reps = [
            repetition_report(row[: int(L)].tolist())
            for row, L in zip(ro.response_ids, ro.response_mask.sum(1))
        ]

        # --- m minibatches: optimizer steps on one rollout batch (α source 1) ------------------
        step_metrics: list[dict[str, float]] = []
        skipped = 0
        model.train()
        schedule = minibatch_schedule(len(rewards), cfg.alpha.minibatches, seed=step)
        if reuse_old:
            schedule = [(all_rows, 0)]
        for rows, lag in schedule:
            if teacher is not None:
                s_logits, t_logits = student_teacher_logits(
                    trainer, teacher, ro, rows, t_ids[rows], t_mask[rows]
                )
                out = objective(s_logits, t_logits, batch.mask[rows])
                out.metrics.update(copy_exit_mass(s_logits, t_logits, [reps[r] for r in rows]))
            else:
                logp = logp_first if reuse_old else trainer_logp(trainer, ro, rows, keep)
                if (
                    hasattr(objective, "calibrate")
                    and lag == 0
                    and step % objective.calibrate_every == 1 % objective.calibrate_every
                ):
                    # shadow pass: the clean trainer recompute is the high-precision π_old; the
                    # low-precision π_old is what training uses (μ when logp_old_source=sampler)
                    step_metrics.append(
                        objective.calibrate(
                            logp.detach(),
                            sc["logp"][rows],
                            logp.detach(),
                            batch.logp_old[rows],
                            batch.advantages[rows],
                            batch.mask[rows],
                        )
                    )
                out = objective(logp, batch.index(rows))
            opt.zero_grad(set_to_none=True)
            if not torch.isfinite(out.loss):
                skipped += 1
                continue
            out.loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
            if not torch.isfinite(gnorm):
                opt.zero_grad(set_to_none=True)
                skipped += 1
                continue
            opt.step()
            history.push(model)
            step_metrics.append({**out.metrics, "grad/norm": float(gnorm), "alpha/lag": lag})
        model.eval()
        nonfinite_run = nonfinite_run + 1 if skipped and not step_metrics else 0

        # --- weight sync to the sampler (staleness: it gets the version k steps old) ------------
        sampler.load_weights_from_state(history.behaviour())

        # --- metrics ---------------------------------------------------------------------------
        m = {
            "step": step,
            "reward/mean": float(rewards.mean()),
            "reward/acc": float((rewards > 0).double().mean()),
            "response/len": float(ro.response_mask.sum(1).mean()),
            "guard/nonfinite_skipped": skipped,
            **rollout_dials(sc["logp"], ro, sc["entropy"], sc["p_t"]),
            **mean_dicts(step_metrics),
        }
        m["repetition/terminal_loop_rate"] = float(np.mean([r["terminal_loop"] for r in reps]))
        m["repetition/rate"] = float(np.mean([r["has_repetition"] for r in reps]))
        m.update(check_collapse(guard, m, cfg.guard))
        if cfg.eval_every and (step % cfg.eval_every == 0 or step == cfg.steps or step == 1):
            m["eval/acc"] = evaluate(trainer, task, eval_problems, cfg)
        m["time/step_s"] = round(time.time() - t0, 3)
        with metrics_path.open("a") as f:
            f.write(json.dumps(m) + "\n")
        last = m
        bar.set_postfix(
            {k.split("/")[-1]: round(m[k], 3) for k in ("reward/mean", "entropy/mean") if k in m}
            | ({"eval": m["eval/acc"]} if "eval/acc" in m else {})
        )

        # --- checkpoint / guards ---------------------------------------------------------------
        aborting = nonfinite_run >= cfg.guard.max_nonfinite
        if aborting or step % cfg.checkpoint_every == 0 or step == cfg.steps:
            save_checkpoint(
                run_dir,
                step,
                {
                    "step": step,
                    "model": model.state_dict(),
                    "optim": opt.state_dict(),
                    "objective": objective.state_dict(),
                    "history": history,
                    "guard": guard,
                    "rng": rng_state(),
                },
                cfg.keep_checkpoints,
            )
        if aborting:
            raise TrainingAborted(
                f"{nonfinite_run} consecutive steps with non-finite loss or gradient (limit "
                f"guard.max_nonfinite={cfg.guard.max_nonfinite}); state saved at step {step} in "
                f"{run_dir}/checkpoints. Lower the learning rate or check the objective's bounds."
            )
    update_meta(run_dir, last_step=cfg.steps)
    sampler.close()
    return last


CONFIGS = str(Path(__file__).resolve().parents[1] / "experiments")


@hydra.main(config_path=CONFIGS, config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> dict[str, Any]:
    return run_task(run, cfg)


if __name__ == "__main__":
    from harness.train import main as _main  # by reference: submitit pickles harness.train.main

    _main()
