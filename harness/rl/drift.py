"""β drift over a training run: a calibration pass (frozen weights, α = 0) at the run's start and
at each of its checkpoints, the mismatch dials the frameworks log, and their growth split into
length, the softmax gate and the engine's logit error (harness.stats.drift).

At each checkpoint the sampler μ (the run's engine, dtype and noise) and the trainer load the same
weights; μ samples the same prompts (the task's evaluation problems) with the same seed; the
trainer scores them (the dials on log π − log μ), and both forwards, teacher-forced over the
responses, give the engine's logit error ε = z_μ − z at every position: the ground truth behind
each part. Where the first-order picture holds, the parts sum to the measured growth.

    python -m harness.rl.drift results/<exp>/<run>                   # base + its checkpoints
    python -m harness.rl.drift RUN --checkpoints DIR_OR_FILES ... --out results/beta_drift/x
    python -m harness.rl.drift RUN --set noise=none engine.sampler_dtype=bf16   # another μ
    python -m harness.rl.drift RUN --set 'model.upcycle={n_experts: 4, top_k: 2}' \
        'extra_noise=[{name: routing, sigma: 0.1}]' engine.routing_replay=true   # MoE, R3

writes <out>/drift.csv (a row per checkpoint), <out>/seqs.csv (per-response sums, what the
bootstrap resamples) and <out>/meta.json; a rerun skips the checkpoints already written.
"""

from __future__ import annotations

import argparse
import json
import re
from functools import partial
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from omegaconf import DictConfig, OmegaConf

from harness.base.io import write_json_atomic, write_text_atomic
from harness.base.models import upcycle_state, weights_sha
from harness.noise import forward_context, position_ids, prefix_hash
from harness.noise.routing import find_routers
from harness.rl.setup import (
    build_policy,
    build_sampler,
    build_task_and_model,
    rollout_sampling,
    step_options,
)
from harness.rl.step import collect
from harness.runs import plugins
from harness.runs.config import schema
from harness.runs.validate import validate
from harness.sampling.engines import Engine
from harness.sampling.rollout import eos_ids
from harness.stats.diagnostics import dials
from harness.stats.drift import SEQ_COLUMNS, factors, fork_var, logit_error, seq_sums, stop_share

STEP_FILE = re.compile(r"step_(\d+)\.pt$")
CHUNK = 256  # positions per logit chunk: 256 × 49,152 fp32 ≈ 50 MB a tensor


def checkpoint_files(paths: list[str]) -> list[tuple[int, Path]]:
    """(step, file) for every step_N.pt given or inside a given folder, by step; an error names
    a path that is neither."""
    found = []
    for p in map(Path, paths):
        files = sorted(p.glob("step_*.pt")) if p.is_dir() else [p]
        if not files or not all(f.is_file() and STEP_FILE.search(f.name) for f in files):
            raise ValueError(
                f"--checkpoints {p}: not a step_<N>.pt file or a folder holding some; valid: "
                "the files harness.train writes into <run>/checkpoints"
            )
        found += [(int(STEP_FILE.search(f.name).group(1)), f) for f in files]
    return sorted(set(found))


def run_config(run: Path, sets: list[str]) -> DictConfig:
    """The run's config.yaml with `--set` overrides (`noise=<name>` replaces the noise node),
    validated as harness.train validates."""
    path = run / "config.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no config.yaml; valid: a run folder harness.train wrote")
    cfg = OmegaConf.merge(schema(), OmegaConf.load(path))
    plugins.load_config(cfg)  # the run's own rules, before its objective and noise are built
    for item in sets:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set {item!r}: valid: KEY=VALUE (e.g. engine.sampler_dtype=bf16)")
        if key == "noise":
            cfg.noise, cfg.extra_noise = {"name": value}, []
        else:
            cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist([item]))
    if cfg.engine.sampler != "hf":
        raise ValueError(
            f"engine.sampler={cfg.engine.sampler}: the engine part needs μ's logits at every "
            "position; valid: hf (the harness's own engine, its noise or dtype)"
        )
    validate(cfg)
    return cfg


@torch.no_grad()
def logit_errors(sampler: Engine, trainer: Engine, ro) -> dict[str, torch.Tensor]:
    """`logit_error` at every response position of `ro` ([B, T] each): both engines' forwards,
    teacher-forced, the sampler's noise keyed on the positions' prefixes as in its scoring (MoE
    routing noise re-selects the decode's routes), the trainer replaying routes as in its
    scoring (R3, R2)."""
    tokens, attn, n = ro.tokens, ro.attention_mask, ro.n_prompt
    h_mu = sampler.hidden_states(tokens, attn, n)
    with trainer.replaying(ro):
        h = trainer.hidden_states(tokens, attn, n).float()
    B, T, H = h.shape
    hash_N = prefix_hash(tokens, attn)[:, n - 1 : -1].reshape(-1)
    pos_N = position_ids(attn)[:, n - 1 : -1].reshape(-1)
    h_mu, h, targets = h_mu.reshape(B * T, H), h.reshape(B * T, H), tokens[:, n:].reshape(-1)
    head_mu, head = sampler.model.get_output_embeddings(), trainer.model.get_output_embeddings()
    parts = []
    for s in range(0, B * T, CHUNK):
        e = slice(s, s + CHUNK)
        with forward_context(hash_N[e][None], pos_BxS=pos_N[e][None]):
            z_mu = head_mu(h_mu[e][None])[0]
        z = head(h[e])
        parts.append(logit_error(z_mu / ro.temperature, z / ro.temperature, targets[e]))
    return {k: torch.cat([p[k] for p in parts]).view(B, T) for k in parts[0]}


@torch.no_grad()
def route_flips(sampler: Engine, trainer: Engine, ro) -> float:
    """The fraction of router decisions (response token × MoE layer) where μ's top-k set differs
    from the set the trainer's own routers choose at the same weights: the flips R3 removes (Ma et
    al., arXiv 2510.11370, report ~10% between SGLang and Megatron). NaN on a dense model."""
    try:
        find_routers(trainer.model, "route flips")
    except ValueError:  # a dense model
        return float("nan")
    mu = sampler.own_routes(ro)  # under μ's routing noise: the decode's routes, teacher-forced
    own = trainer.own_routes(ro)
    n = ro.n_prompt
    differ = (mu.sort(-1).values != own.sort(-1).values).any(-1)[:, n - 1 : -1]  # [B, T, L]
    return float(differ[ro.response_mask.bool()].float().mean())


def calibration_pass(cfg, task, tok, sampler, trainer, problems, seed: int):
    """One checkpoint: μ samples, the trainer scores (the dials), both forwards give ε. Returns
    (the row of drift.csv, the per-response sums)."""
    batch, ro, rewards = collect(
        sampler,
        trainer,
        [p.prompt for p in problems],
        partial(task.rollout_rewards, problems, tokenizer=tok),
        rollout_sampling(cfg, task),
        step_options(cfg),
        seed=seed,
    )
    x, m = batch.log_rho, batch.mask
    err = logit_errors(sampler, trainer, ro)
    sums = seq_sums(x, batch.p_t, batch.p_sq_sum, err, m)
    sel = m.bool()
    d_decode = -x[sel]  # log μ − log π, as ε's Δ reads it
    row = {
        **dials(x, m, batch.p_t),
        **factors(sums),
        "fork_var": fork_var(sums),
        **stop_share(x, m, ro.response_mask, ro.response_ids, eos_ids(trainer.model)),
        "fork_frac": float(sums["fork_n"].sum() / sums["n"].sum()),
        "entropy": float(batch.entropy[sel].mean()),
        "reward": float(rewards.float().mean()),
        "n_tokens": int(sel.sum()),
        # how much of the decode's Δ the teacher-forced forwards reproduce: the same Δ under
        # noise keyed on prefixes; FP8 rounding can flip between the decode and the full forward
        "tf_abs_err": float((d_decode - err["delta_tf"][sel]).abs().mean()),
        "tf_corr": float(np.corrcoef(d_decode.cpu(), err["delta_tf"][sel].cpu())[0, 1]),
        # the expected Δ² of the teacher-forced forwards (no sampling noise) beside the measured
        "e2_mean": float(sums["e2"].sum() / sums["n"].sum()),
        "d2_tf": float((err["delta_tf"][sel] ** 2).mean()),  # the same tokens, teacher-forced
        "logit_std": float(err["z_std"][sel].mean()),
        "route_flips": route_flips(sampler, trainer, ro),
    }
    return row, sums


def measure(
    cfg: DictConfig, files: list[tuple[int, Path]], out: Path, prompts: int, seed: int
) -> pd.DataFrame:
    """The base weights (step 0) and each checkpoint, skipping the steps `out` already holds."""
    # what every row shares; each row names its own weights (step, weights_sha). A rerun into a
    # folder measured under other settings would mix two kinds of pass: refused before compute.
    setting = {
        "run_config": OmegaConf.to_container(cfg, resolve=True),
        "prompts": prompts,
        "seed": seed,
    }
    meta_path = out / "meta.json"
    if meta_path.exists():
        old = json.loads(meta_path.read_text())
        changed = [k for k in setting if json.loads(json.dumps(setting[k])) != old.get(k)]
        if changed:
            raise ValueError(
                f"{out}: measured with other {', '.join(changed)} (its meta.json); valid: the "
                "same run config, --prompts and --seed, or another --out"
            )
    out.mkdir(parents=True, exist_ok=True)
    rows_path, seqs_path = out / "drift.csv", out / "seqs.csv"
    rows = pd.read_csv(rows_path) if rows_path.exists() else pd.DataFrame()
    seqs = pd.read_csv(seqs_path) if seqs_path.exists() else pd.DataFrame()
    done = set(rows["step"]) if len(rows) else set()
    todo = [(0, None)] + files
    task, model, tok, ident = build_task_and_model(cfg)
    model.requires_grad_(False)
    sampler, trainer = build_sampler(cfg, model, tok), build_policy(cfg, model, tok)
    problems = task.sample(prompts, "eval", cfg.eval_seed)  # the same prompts at every step
    write_json_atomic(meta_path, {**setting, "identity": ident})
    for step, path in todo:
        if step in done:
            continue
        if path is not None:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)["model"]
            if state is None:
                raise ValueError(f"{path}: a sharded run's checkpoint; valid: a one-rank run's")
            if cfg.model.upcycle and any(".mlp.gate_proj." in k for k in state):
                # a dense run's checkpoint measured as its upcycled MoE (--set model.upcycle=...)
                up = OmegaConf.to_container(cfg.model.upcycle, resolve=True)
                up.pop("top_k", None)
                state = upcycle_state(state, **up)
            trainer.load_weights_from_state(state)
            sampler.load_weights_from_state(state)
        print(f"[drift] step {step}: calibration pass on {prompts} prompts ...", flush=True)
        row, sums = calibration_pass(cfg, task, tok, sampler, trainer, problems, seed)
        row = {"step": step, "weights_sha": weights_sha(trainer.model), **row}
        per_seq = pd.DataFrame({"step": step, **{k: sums[k] for k in SEQ_COLUMNS}})
        rows = pd.concat([rows, pd.DataFrame([row])]).sort_values("step")
        seqs = pd.concat([seqs, per_seq]).sort_values("step", kind="stable")
        write_text_atomic(seqs_path, seqs.to_csv(index=False))
        write_text_atomic(rows_path, rows.to_csv(index=False))
        print(
            f"[drift] step {step}: mean|Δ| {row['mean_abs_delta']:.4f}  k3 {row['kl_k3']:.2e}  "
            f"gate {row['gate']:.3f}  σ̄² {row['engine']:.3g}  ρ {row['residual']:.3f}  "
            f"len {row['length']:.1f}",
            flush=True,
        )
    return rows


def main(argv: list[str] | None = None) -> pd.DataFrame:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("run", type=Path, help="a run folder harness.train wrote (its config.yaml)")
    ap.add_argument(
        "--checkpoints",
        nargs="+",
        help="step_N.pt files or folders (default: the run's checkpoints/)",
    )
    ap.add_argument("--out", type=Path, help="default: <run>/drift")
    ap.add_argument("--set", nargs="*", default=[], dest="sets", metavar="KEY=VALUE")
    ap.add_argument("--prompts", type=int, default=16, help="evaluation problems per pass")
    ap.add_argument("--seed", type=int, default=0, help="the passes' sampling seed")
    a = ap.parse_args(argv)
    if a.prompts < 2:
        raise ValueError(f"--prompts {a.prompts}; valid: >= 2 (the bootstrap resamples responses)")
    cfg = run_config(a.run, a.sets)
    files = checkpoint_files(a.checkpoints or [str(a.run / "checkpoints")])
    return measure(cfg, files, a.out or a.run / "drift", a.prompts, a.seed)


if __name__ == "__main__":
    main()
