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

import contextlib
import copy
import json
import math
import pickle
import random
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import hydra
import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from harness import config as _schema  # noqa: F401  (registers the structured-config schema)
from harness.alpha import WeightHistory, minibatch_schedule
from harness.batch import TokenBatch
from harness.diagnostics import bin_means, dials, identity_check
from harness.engines import ENGINES, Engine, Rollout, check_sampler
from harness.io import write_json_atomic, write_text_atomic
from harness.launch import AGGREGATION_KEYS, check_nodes, read_json, run_task, update_meta
from harness.logprobs import check_sampling
from harness.models import (
    BUILTIN_SPECS,
    DTYPES,
    load_model,
    resolve_device,
    resolve_dtype,
    set_tf32,
    upcycle_to_moe,
)
from harness.noise import Fp8Trainer, build_noise
from harness.objectives import build_objective
from harness.registry import build
from harness.repetition import copy_token_probs, exit_mass, repetition_report
from harness.step import ADVANTAGES, Sampling, adamw, collect, update, update_distill
from harness.tasks import TASKS, Task, teacher_prompt


class TrainingAborted(RuntimeError):
    pass


# --- set-up ------------------------------------------------------------------------------------


def split_node(node: Any) -> tuple[str, dict[str, Any]]:
    d = OmegaConf.to_container(node, resolve=True) if not isinstance(node, dict) else dict(node)
    if "name" not in d:
        raise ValueError(f"config node {d} needs a `name` (the registry key)")
    name = d.pop("name")
    return name, d


def task_spec(cfg: DictConfig) -> tuple[str, dict[str, Any], dict | None]:
    """The task's registry name and kwargs (with model=task-model, the warm-start recipe's task
    kwargs under the node's) and the recipe (None for other models)."""
    from harness.warmstart import resolve_recipe

    task_name, task_kw = split_node(cfg.task)
    if cfg.model.spec != "task-model":
        return task_name, task_kw, None
    recipe = resolve_recipe(task_name, **OmegaConf.to_container(cfg.model.warmstart, resolve=True))
    return task_name, {**recipe["task_kwargs"], **task_kw}, recipe


def build_task_and_model(cfg: DictConfig) -> tuple[Task, torch.nn.Module, Any, dict]:
    """The task, the trainer's model (trainer dtype), its tokenizer and its identity (spec,
    weights checksum, recipe hash for task models: recorded in meta.json)."""
    from harness.warmstart import load_task_model, model_identity

    task_name, task_kw, recipe = task_spec(cfg)
    if recipe is not None:
        warm = OmegaConf.to_container(cfg.model.warmstart, resolve=True)
        model, tok = load_task_model(task_name, progress=cfg.progress, **warm)
    else:
        model, tok = load_model(cfg.model.spec, dtype="fp32", seed=cfg.seed)
    if cfg.model.upcycle:
        model = upcycle_to_moe(model, **OmegaConf.to_container(cfg.model.upcycle, resolve=True))
    task = build(TASKS, task_name, "task", **task_kw)
    # weights are built (and warm-started) on the CPU, then placed: every copy (sampler, π_old,
    # teacher) is a deepcopy of this model, so all three policies share its device
    model = model.to(resolve_device(cfg.engine.device), resolve_dtype(cfg.engine.trainer_dtype))
    return task, model, tok, model_identity(model, cfg.model.spec, recipe)


def build_sampler(cfg: DictConfig, model: torch.nn.Module, tok) -> Engine:
    """The sampler holds its own copy of the weights: engine, dtype, attention path and noise
    are μ's (engine.sampler: harness.engines.ENGINES)."""
    smp = copy.deepcopy(model).to(resolve_dtype(cfg.engine.sampler_dtype))
    smp.config._attn_implementation = cfg.engine.sampler_attention
    specs = [split_node(n) for n in [cfg.noise, *cfg.extra_noise]]
    noise = [build_noise(name, **kw) for name, kw in specs if name != "none"]
    return ENGINES[cfg.engine.sampler](
        smp, tok, noise, cfg.engine.kv_cache, cfg.engine.ct2.compute_type
    )


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


def checkpoints(run: Path) -> list[Path]:
    """The run's regular checkpoints, newest first (abort checkpoints are not among them)."""
    return sorted((run / "checkpoints").glob("step_*.pt"), key=lambda p: -int(p.stem[5:]))


def save_checkpoint(run: Path, step: int, state: dict, keep: int, aborted: bool = False) -> Path:
    """Atomic (temp file + rename). Regular checkpoints are known good (saved only after a
    finite step) and rotate, `keep` of them; an abort checkpoint (`abort_step_N.pt`) records the
    state at the abort for inspection and is never resumed from."""
    d = run / "checkpoints"
    d.mkdir(parents=True, exist_ok=True)
    name = f"{'abort_' if aborted else ''}step_{step}.pt"
    tmp = d / f".{name}.tmp"
    torch.save(state, tmp)
    dest = d / name
    tmp.replace(dest)  # a crash leaves at most a .tmp file, never a torn checkpoint
    if not aborted:
        for old in checkpoints(run)[keep:]:
            old.unlink()
    return dest


def read_metrics(path: Path) -> list[dict]:
    """The metric lines of a run; a torn line (a crash mid-write) is dropped with a warning."""
    rows = []
    for i, ln in enumerate(path.read_text().splitlines() if path.exists() else [], 1):
        if not ln.strip():
            continue
        try:
            rows.append(json.loads(ln))
        except json.JSONDecodeError:
            print(f"[train] warning: {path}:{i} is not a complete JSON line; dropped", flush=True)
    return rows


def truncate_metrics(path: Path, last_step: int) -> None:
    """On resume, drop metric lines written after the checkpoint (they will be recomputed)."""
    if path.exists():
        keep = [r for r in read_metrics(path) if r.get("step", math.inf) <= last_step]
        write_text_atomic(path, "".join(json.dumps(r) + "\n" for r in keep))


def rng_state() -> dict:
    """The three RNG states as tensors and plain containers (weights_only-loadable)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss],
    }


def set_rng_state(s: dict) -> None:
    torch.set_rng_state(s["torch"])
    version, internal, gauss = s["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, gauss = s["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))


class RefusedCheckpoint(RuntimeError):
    pass


def load_checkpoint(path: Path) -> dict:
    """A checkpoint's state, unpickled with weights_only=True: tensors and plain containers
    only, so a planted file cannot run code; anything else is refused, naming the file."""
    try:
        # on the CPU: a checkpoint resumes on any device (load_state_dict copies onto the
        # parameters' device, the optimizer casts its state to them)
        return torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as e:
        raise RefusedCheckpoint(
            f"refusing to load {path}: it holds objects other than tensors and plain containers "
            "(not a checkpoint this harness wrote; it could run code when unpickled). Delete it "
            "or move it out of the run directory."
        ) from e


# --- metrics -----------------------------------------------------------------------------------


def rollout_dials(batch: TokenBatch) -> dict[str, float]:
    """The dials of harness.diagnostics on ρ = π_old/μ (the trainer at the behaviour weights vs
    the sampler: Table 1 row 3) and the identity check, plus the trainer's entropy per bin."""
    m = batch.mask
    x = batch.logp_recompute - batch.logp_mu
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
    """Accuracy on the fixed held-out set: one sample per problem at the rollout temperature,
    from the trainer's current weights (clean numerics), seed `eval_seed`; nan when the weights
    give a non-finite distribution (the next rollout then aborts the run)."""
    try:
        ro = engine.generate(
            [p.prompt for p in problems],
            n=1,
            max_new_tokens=token_budget(cfg, task),
            temperature=cfg.rollout.temperature,
            seed=cfg.eval_seed,
        )
    except FloatingPointError as e:
        print(f"[train] eval skipped: {e}", flush=True)
        return float("nan")
    return float(task.rollout_rewards(problems, ro, engine.tokenizer).mean())


# --- the loop ----------------------------------------------------------------------------------


ATTENTIONS = ("sdpa", "eager")


def validate(cfg: DictConfig) -> None:
    """Every check that needs no model, run before anything is built or warm-started: each error
    names the key, the bad value and what is valid."""

    def bad(key: str, value: Any, valid: str) -> ValueError:
        return ValueError(f"{key}={value!r}; valid: {valid}")

    for key, value, valid in [
        ("engine.logp_old_source", cfg.engine.logp_old_source, ("trainer", "sampler")),
        ("advantage", cfg.advantage, ADVANTAGES),
        ("engine.sampler_attention", cfg.engine.sampler_attention, ATTENTIONS),
        ("engine.sampler_dtype", cfg.engine.sampler_dtype, tuple(DTYPES)),
        ("engine.trainer_dtype", cfg.engine.trainer_dtype, tuple(DTYPES)),
        ("resume", cfg.resume, ("strict", "override")),
    ]:
        if value not in valid:
            raise bad(key, value, ", ".join(map(repr, valid)))
    r, a = cfg.rollout, cfg.alpha
    check_sampling(r.temperature, r.top_k, r.top_p, prefix="rollout.")
    checks = [
        ("rollout.max_new_tokens", r.max_new_tokens,
         r.max_new_tokens is None or r.max_new_tokens >= 1, ">= 1, or null for the task's own"),
        ("rollout.prompts_per_step", r.prompts_per_step, r.prompts_per_step >= 1, ">= 1"),
        ("rollout.group_size", r.group_size, r.group_size >= 2,
         ">= 2 (group-normalised advantages of a single response are 0: nothing would train)"),
        ("alpha.staleness", a.staleness, a.staleness >= 0, ">= 0"),
        ("alpha.minibatches", a.minibatches,
         1 <= a.minibatches <= r.prompts_per_step * r.group_size,
         f"in [1, rollout.prompts_per_step × rollout.group_size = "
         f"{r.prompts_per_step * r.group_size}]"),
        ("steps", cfg.steps, cfg.steps >= 1, ">= 1"),
        ("checkpoint_every", cfg.checkpoint_every, cfg.checkpoint_every >= 1, ">= 1"),
        ("keep_checkpoints", cfg.keep_checkpoints, cfg.keep_checkpoints >= 1, ">= 1"),
        ("eval_n", cfg.eval_n, cfg.eval_n >= 1 or not cfg.eval_every, ">= 1 when eval_every > 0"),
        ("optim.lr", cfg.optim.lr, cfg.optim.lr > 0, "> 0"),
        ("drivers.beta_growth", cfg.drivers.beta_growth, cfg.drivers.beta_growth > 0, "> 0"),
        ("drivers.harder_at", cfg.drivers.harder_at, 0 <= cfg.drivers.harder_at <= cfg.steps,
         "in [0 (never), steps]"),
        ("mechanism_batches", cfg.mechanism_batches, cfg.mechanism_batches >= 0,
         ">= 0 (0: no mechanism check)"),
    ]  # fmt: skip
    for key, value, ok, valid in checks:
        if not ok:
            raise bad(key, value, valid)
    resolve_device(cfg.engine.device)  # a CUDA device must exist here
    check_nodes(cfg)  # the swept-axis nodes' names and kwargs against their builders
    injected = [n["name"] for n in [cfg.noise, *cfg.extra_noise] if n["name"] != "none"]
    check_sampler(cfg.engine.sampler, cfg.engine.ct2.compute_type, injected,
                  cfg.engine.sampler_dtype)  # fmt: skip
    if cfg.engine.sampler == "ct2" and cfg.drivers.beta_growth != 1.0:
        raise bad("drivers.beta_growth", cfg.drivers.beta_growth, "1.0 with engine.sampler=ct2 "
                  "(its β is the engine's own, not a σ that can grow)")  # fmt: skip
    if cfg.drivers.harder_at:  # the harder task's kwargs against the task's builder
        if not cfg.drivers.harder:
            raise bad("drivers.harder", {}, "the task kwargs that make it harder, e.g. "
                      "{max_number: 20}, when drivers.harder_at > 0")  # fmt: skip
        check_nodes(OmegaConf.create({"task": {**cfg.task, **cfg.drivers.harder}}))
    from analysis.claims import check_prereg

    check_prereg(OmegaConf.to_container(cfg.prereg, resolve=True))  # the preset's endpoints
    spec = cfg.model.spec
    if spec == "task-model":
        from harness.warmstart import resolve_recipe

        resolve_recipe(cfg.task.name, **OmegaConf.to_container(cfg.model.warmstart, resolve=True))
    elif spec not in BUILTIN_SPECS and not Path(spec).is_dir() and "/" not in spec:
        raise bad("model.spec", spec, f"task-model, {', '.join(BUILTIN_SPECS)}, a local HF folder "
                  "or a Hugging Face hub id (org/name)")  # fmt: skip
    obj = cfg.objective.name
    misplaced = sorted({"aggregation", *AGGREGATION_KEYS} & set(cfg.objective))
    if misplaced:
        raise ValueError(
            f"objective.{misplaced[0]} is the aggregation group's: set aggregation=<name> and "
            f"aggregation.{'|'.join(AGGREGATION_KEYS)}=<value> instead"
        )
    if cfg.distill.enabled != (obj == "opsd_fkl"):
        raise ValueError(
            "distill.enabled=true needs objective=opsd_fkl, and opsd_fkl needs distill.enabled"
        )
    if cfg.engine.trainer_fp8 and cfg.noise.name != "fp8":
        raise ValueError(
            f"engine.trainer_fp8=true runs the trainer in the sampler's FP8 recipe, but "
            f"noise={cfg.noise.name!r}; valid: noise=fp8 (or engine.trainer_fp8=false)"
        )
    if obj == "calibrated_clip" and cfg.engine.logp_old_source == "trainer":
        raise ValueError(
            "objective=calibrated_clip calibrates the low-precision π_old against the trainer's "
            "high-precision recompute, but engine.logp_old_source='trainer' makes them the same "
            "tensor (the clip would silently equal ppo_clip); set engine.logp_old_source=sampler"
        )


@dataclass
class Setup:
    """What `run` builds: the task, the three policies and the optimizer state."""

    task: Task
    harder_task: Task | None  # drivers.harder: the training task from drivers.harder_at on
    tok: Any
    policy: Engine  # π_θ: the trainer
    old_policy: Engine | None  # π_old at the behaviour weights; None: the training pass is π_old
    sampler: Engine  # μ
    teacher: torch.nn.Module | None
    objective: Any
    opt: Any  # torch.optim.AdamW, or harness.step.MasterAdamW for a bf16/fp16 trainer
    history: WeightHistory
    identity: dict


def build_setup(cfg: DictConfig) -> Setup:
    set_tf32(cfg.engine.tf32)  # process-wide; the run's one setting
    task, model, tok, identity = build_task_and_model(cfg)
    a = cfg.alpha
    # every copy of the weights before any noise or replay hook is attached (deepcopy copies hooks)
    sampler = build_sampler(cfg, model, tok)
    old_model = copy.deepcopy(model).requires_grad_(False) if a.staleness > 0 else None
    teacher = copy.deepcopy(model).eval().requires_grad_(False) if cfg.distill.enabled else None

    def engine(m: torch.nn.Module) -> Engine:  # a trainer-side policy: R3 replays μ's routes
        noise = [build_noise("replay")] if cfg.engine.routing_replay else []
        if cfg.engine.trainer_fp8:  # full-pipeline FP8: the sampler's recipe, straight-through
            name, kw = split_node(cfg.noise)
            noise.append(Fp8Trainer(build_noise(name, **kw)))
        return Engine(m, tok, noise=noise)

    policy = engine(model)
    if old_model is not None:  # π_old: its own copy of the weights, loaded with the behaviour
        old_policy = engine(old_model)
    elif a.minibatches == 1 and cfg.reuse_old_logp and not cfg.distill.enabled:
        old_policy = None
    else:
        old_policy = policy
    obj_name, obj_kw = split_node(cfg.objective)
    if obj_name != "opsd_fkl":  # the aggregation node: the name and the denominator convention
        agg_name, agg_kw = split_node(cfg.aggregation)
        obj_kw.update(aggregation=agg_name, **agg_kw)
    opt = adamw(  # fp32 master weights when the trainer is bf16/fp16
        model,
        lr=cfg.optim.lr,
        betas=(cfg.optim.beta1, cfg.optim.beta2),
        weight_decay=cfg.optim.weight_decay,
    )
    history = WeightHistory(a.staleness)
    history.push(model)
    harder = None
    if cfg.drivers.harder_at:
        task_name, task_kw, _ = task_spec(cfg)
        kw = {**task_kw, **OmegaConf.to_container(cfg.drivers.harder, resolve=True)}
        harder = build(TASKS, task_name, "task", **kw)
    return Setup(
        task, harder, tok, policy, old_policy, sampler, teacher,
        build_objective(obj_name, **obj_kw), opt, history, identity,
    )  # fmt: skip


def resume(s: Setup, run_dir: Path, metrics_path: Path, cfg: DictConfig) -> tuple[int, dict]:
    """(first step, guard state): from the newest checkpoint that loads (a damaged one is named
    in a warning and skipped), else a fresh start. The config's optimizer settings are applied
    to the restored optimizer (they equal the checkpoint's unless `resume=override`)."""
    guard = {"entropy0": [], "best_reward": -math.inf, "events": 0}
    for ck in checkpoints(run_dir):
        try:
            state = load_checkpoint(ck)
        except RefusedCheckpoint:
            raise
        except Exception as e:  # truncated or corrupt: the previous one is still good
            print(f"[train] warning: checkpoint {ck} is damaged ({type(e).__name__}: "
                  f"{str(e)[:120]}); trying the previous one", flush=True)  # fmt: skip
            continue
        s.policy.model.load_state_dict(state["model"])
        s.opt.load_state_dict(state["optim"])
        for group in s.opt.param_groups:
            group.update(lr=cfg.optim.lr, betas=(cfg.optim.beta1, cfg.optim.beta2),
                         weight_decay=cfg.optim.weight_decay)  # fmt: skip
        s.objective.load_state_dict(state["objective"])
        s.history.load_state_dict(state["history"])
        set_rng_state(state["rng"])
        truncate_metrics(metrics_path, state["step"])
        print(f"[train] resumed from {ck} (step {state['step']})", flush=True)
        return state["step"] + 1, state["guard"]
    metrics_path.unlink(missing_ok=True)  # a fresh run: never append to a previous log
    return 1, guard


RESUME_FREE = {"steps", "progress", "out", "resume"}  # may change between attempts


def config_contract(run_dir: Path, cfg: DictConfig) -> dict[str, list]:
    """The run directory's config.yaml is the contract: the keys a rerun changes, {key: [old,
    new]}; raises before any compute when some differ and `resume` is not "override"."""
    path = run_dir / "config.yaml"
    if not path.exists() or not checkpoints(run_dir):
        return {}
    old = flatten(OmegaConf.to_container(OmegaConf.load(path), resolve=True))
    new = flatten(OmegaConf.to_container(cfg, resolve=True))
    changed = {
        k: [old.get(k), new.get(k)]
        for k in sorted(set(old) | set(new))
        if k.split(".")[0] not in RESUME_FREE and old.get(k) != new.get(k)
    }
    if changed and cfg.resume != "override":
        listing = "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in changed.items())
        raise ValueError(
            f"{run_dir} holds a run with a different config ({listing}). Resuming would mix "
            "two configs. Rerun with resume=override to apply the new values to the restored "
            "run (recorded in meta.json), or use a new out= directory."
        )
    return changed


def flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def repetition_reports(ro: Rollout) -> list[dict]:
    return [
        repetition_report(row[: int(n)].tolist())
        for row, n in zip(ro.response_ids, ro.response_mask.sum(1))
    ]


def distill_inputs(cfg: DictConfig, s: Setup, problems, reps: list[dict]):
    """The teacher's privileged prompts (one per row) and the per-minibatch exit-mass metrics."""
    t_prompts = [teacher_prompt(p, cfg.distill.teacher_prompt) for p in problems]
    t_ids, t_mask = s.policy.encode_prompts(t_prompts)
    g = cfg.rollout.group_size
    exit_metrics = lambda st, te, rows: copy_exit_mass(st, te, [reps[r] for r in rows])  # noqa: E731
    return t_ids.repeat_interleave(g, 0), t_mask.repeat_interleave(g, 0), exit_metrics


def step_metrics(step, batch, ro, rewards, reps, updates, skipped, guard, cfg) -> dict:
    m = {
        "step": step,
        "reward/mean": float(rewards.mean()),
        "reward/acc": float((rewards > 0).double().mean()),
        "response/len": float(ro.response_mask.sum(1).mean()),
        "guard/nonfinite_skipped": skipped,
        **rollout_dials(batch),
        **mean_dicts(updates),
        "repetition/terminal_loop_rate": float(np.mean([r["terminal_loop"] for r in reps])),
        "repetition/rate": float(np.mean([r["has_repetition"] for r in reps])),
    }
    return m | check_collapse(guard, m, cfg.guard)


def step_seed(cfg: DictConfig, step: int) -> int:
    """The seed of step `step`'s prompts and samples (harness.mechanism scores steps 1, 2, ...)."""
    return cfg.seed * 1_000_003 + step


@torch.no_grad()
def snr_refresh(s: Setup, cfg: DictConfig, task: Task, step: int) -> dict[str, float]:
    """snr_shrink adaptive=true: a calibration pass at the live weights (the sampler, with its
    noise, loaded with the trainer's current weights; the trainer scores at the same weights,
    so Δ = log π_old − log μ is β alone) on prompts of its own, then the objective re-derives
    λ_b and its bounds. Returns the new values and the pass's cost (snr/refresh_s)."""
    t0 = time.time()
    seed = step_seed(cfg, step) + 500_000  # prompts and draws apart from the training batches
    problems = task.sample(cfg.rollout.prompts_per_step, "train", seed)
    s.sampler.load_weights_from_state(s.history.newest())
    reward = partial(task.rollout_rewards, problems, tokenizer=s.tok)
    batch, _, _ = collect(
        s.sampler, s.policy, [p.prompt for p in problems], reward, rollout_sampling(cfg, task),
        seed=seed, advantage=cfg.advantage, mask_replay=cfg.engine.mask_replay,
    )  # fmt: skip
    s.sampler.load_weights_from_state(s.history.behaviour())
    m = batch.mask.bool()
    out = s.objective.refresh((batch.logp_recompute - batch.logp_mu)[m], batch.p_t[m])
    return out | {"snr/refresh_s": time.time() - t0}


def high_precision(engine: Engine | None):
    """A context in which a trainer-side engine runs in high precision (engine.trainer_fp8: the
    shadow pass); a no-op for every other engine."""
    fp8 = engine._noise_of(Fp8Trainer) if engine is not None else None
    return fp8.high_precision() if fp8 is not None else contextlib.nullcontext()


def shadow_pass(s: Setup, ro: Rollout, mask_replay: bool):
    """engine.trainer_fp8: calibrated clipping's high-precision (π_θ, π_old) of rows `rows`,
    before the first update of a batch (θ = the weights that batch's first minibatch trains; at
    staleness 0 these are the behaviour weights, so π_old^hp = π_θ^hp)."""

    def shadow(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with high_precision(s.policy):
            hp = s.policy.logp(ro, rows, stats=False, mask_replay=mask_replay)["logp"]
        if s.old_policy is None or s.old_policy is s.policy:
            return hp, hp
        with high_precision(s.old_policy):
            old = s.old_policy.logp(ro, rows, stats=False, mask_replay=mask_replay)["logp"]
        return hp, old

    return shadow


def beta_scale(cfg: DictConfig, step: int) -> float:
    """drivers.beta_growth: 1 at step 1, linear to beta_growth at the last step."""
    frac = (step - 1) / max(cfg.steps - 1, 1)
    return 1.0 + (cfg.drivers.beta_growth - 1.0) * frac


def token_budget(cfg: DictConfig, task: Task) -> int:
    """rollout.max_new_tokens, else (null, the default) the task's own budget."""
    return cfg.rollout.max_new_tokens or task.max_new_tokens


def rollout_sampling(cfg: DictConfig, task: Task) -> Sampling:
    r = cfg.rollout
    return Sampling(r.group_size, token_budget(cfg, task), r.temperature, r.top_p, r.top_k)


def run(cfg: DictConfig) -> dict[str, Any]:
    validate(cfg)
    run_dir = Path(cfg.out)
    run_dir.mkdir(parents=True, exist_ok=True)
    changed = config_contract(run_dir, cfg)
    write_text_atomic(run_dir / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
    if cfg.mechanism_batches and not (run_dir / "mechanism.json").exists():
        # the step-0 mechanism check on a setup of its own, before the run's seeds are set:
        # its draws (fresh noise, model init) cannot move the run's (tested)
        from harness import mechanism

        write_json_atomic(run_dir / "mechanism.json", mechanism.run(cfg, validated=True))
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    s = build_setup(cfg)
    update_meta(run_dir, model=s.identity)
    metrics_path = run_dir / "metrics.jsonl"
    start, guard = resume(s, run_dir, metrics_path, cfg)
    if changed:
        history = read_json(run_dir / "meta.json").get("config_overrides", [])
        update_meta(run_dir, config_overrides=[*history, {"from_step": start, "changed": changed}])
    s.sampler.load_weights_from_state(s.history.behaviour())
    update_meta(run_dir, resumed_from_step=start - 1)
    eval_problems = s.task.sample(cfg.eval_n, "eval", cfg.eval_seed)
    calibrated = hasattr(s.objective, "calibrate")
    adaptive_snr = getattr(s.objective, "adaptive", False)
    nonfinite_run, last = 0, {}
    sigma0 = [(n, n.sigma) for n in s.sampler.noise if hasattr(n, "sigma")]
    bar = tqdm(range(start, cfg.steps + 1), desc="train", disable=not cfg.progress)
    for step in bar:
        t0 = time.time()
        seed = step_seed(cfg, step)
        for noise, sigma in sigma0:  # drivers.beta_growth: a pure function of the step
            noise.sigma = sigma * beta_scale(cfg, step)
        harder = s.harder_task is not None and step >= cfg.drivers.harder_at
        task = s.harder_task if harder else s.task
        problems = task.sample(cfg.rollout.prompts_per_step, "train", seed)
        sampling = rollout_sampling(cfg, task)
        snr = {}
        if adaptive_snr and step > 1 and (step - 1) % s.objective.every == 0:
            snr = snr_refresh(s, cfg, task, step)
        if s.old_policy is not None and s.old_policy is not s.policy:
            s.old_policy.load_weights_from_state(s.history.behaviour())
        reward = partial(task.rollout_rewards, problems, tokenizer=s.tok)
        try:
            batch, ro, rewards = collect(
                s.sampler, s.old_policy, [p.prompt for p in problems], reward, sampling,
                seed=seed, advantage=cfg.advantage, logp_old_source=cfg.engine.logp_old_source,
                mask_replay=cfg.engine.mask_replay,
            )  # fmt: skip
        except FloatingPointError as e:
            raise TrainingAborted(
                f"step {step}: {e}. The weights diverged (finite but huge) after step {step - 1}; "
                f"the checkpoints in {run_dir}/checkpoints hold earlier steps. Lower optim.lr."
            ) from e
        schedule = minibatch_schedule(
            len(rewards), cfg.alpha.minibatches, cfg.alpha.staleness, seed=step
        )
        push = lambda: s.history.push(s.policy.model)  # noqa: E731
        restore = partial(roll_back, s)
        reps = repetition_reports(ro)
        if s.teacher is not None:
            t_ids, t_mask, exit_metrics = distill_inputs(cfg, s, problems, reps)
            updates, skipped = update_distill(
                s.policy, s.teacher, s.objective, batch, ro, schedule, s.opt,
                cfg.optim.grad_clip, t_ids, t_mask, exit_metrics, on_step=push, restore=restore,
            )  # fmt: skip
        else:
            calibrate = calibrated and (step - 1) % s.objective.calibrate_every == 0
            batch, updates, skipped = update(
                s.policy, s.objective, batch, ro, schedule, s.opt, cfg.optim.grad_clip,
                mask_replay=cfg.engine.mask_replay, logp_old_source=cfg.engine.logp_old_source,
                calibrate=calibrate, on_step=push, restore=restore,
                shadow=shadow_pass(s, ro, cfg.engine.mask_replay) if cfg.engine.trainer_fp8
                else None,
            )  # fmt: skip
        nonfinite_run = nonfinite_run + 1 if skipped and not updates else 0
        s.sampler.load_weights_from_state(s.history.behaviour())  # staleness: k steps old
        m = step_metrics(step, batch, ro, rewards, reps, updates, skipped, guard, cfg)
        m |= snr
        if cfg.drivers.beta_growth != 1.0:
            m["drivers/beta_scale"] = beta_scale(cfg, step)
        if s.harder_task is not None:
            m["drivers/harder"] = float(harder)
        if cfg.eval_every and (step % cfg.eval_every == 0 or step == cfg.steps or step == 1):
            with high_precision(s.policy):  # θ itself, not its FP8 forward
                m["eval/acc"] = evaluate(s.policy, s.task, eval_problems, cfg)
        m["time/step_s"] = round(time.time() - t0, 3)
        with metrics_path.open("a") as f:
            f.write(json.dumps(m) + "\n")
        last = m
        shown = {"reward": "reward/mean", "entropy": "entropy/mean", "eval": "eval/acc"}
        bar.set_postfix({k: round(m[v], 3) for k, v in shown.items() if v in m})
        aborting = nonfinite_run >= cfg.guard.max_nonfinite
        if aborting or (
            nonfinite_run == 0 and (step % cfg.checkpoint_every == 0 or step == cfg.steps)
        ):
            state = checkpoint_state(s, step, guard)
            save_checkpoint(run_dir, step, state, cfg.keep_checkpoints, aborted=aborting)
        if aborting:
            raise TrainingAborted(
                f"{nonfinite_run} consecutive steps with a non-finite loss, gradient or weights "
                f"(limit guard.max_nonfinite={cfg.guard.max_nonfinite}); the state at the abort is "
                f"{run_dir}/checkpoints/abort_step_{step}.pt; a rerun resumes from the last "
                "known-good checkpoint. Lower the learning rate (resume=override optim.lr=...) "
                "or check the objective's bounds."
            )
    update_meta(run_dir, last_step=cfg.steps)
    s.sampler.close()
    return last


def roll_back(s: Setup) -> None:
    """After a step that made a weight non-finite: the previous weights back (and, for a
    bf16/fp16 trainer, its fp32 master weights re-seeded from them)."""
    s.policy.model.load_state_dict(s.history.newest())
    if hasattr(s.opt, "pull"):
        s.opt.pull()


def checkpoint_state(s: Setup, step: int, guard: dict) -> dict[str, Any]:
    return {
        "step": step,
        "model": s.policy.model.state_dict(),
        "optim": s.opt.state_dict(),
        "objective": s.objective.state_dict(),
        "history": s.history.state_dict(),
        "guard": guard,
        "rng": rng_state(),
    }


CONFIGS = str(Path(__file__).resolve().parents[1] / "experiments")


@hydra.main(config_path=CONFIGS, config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> dict[str, Any]:
    return run_task(run, cfg)


if __name__ == "__main__":
    from harness.train import main as _main  # by reference: submitit pickles harness.train.main

    _main()
