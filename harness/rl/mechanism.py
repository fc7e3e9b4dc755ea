"""Mechanism check: is the mechanism an experiment tests acting at step 0?

A null result means something only where its mechanism was present. Before any update
(θ = θ_old), with the run's own sampler μ (its noise), trainer, task and rollout config, this
scores `batches` rollout batches and reports, on r = π_old/μ:

  mean_abs_delta    mean |log π_old − log μ| over response tokens (the size of β at step 0)
  oob_frac          share of response tokens with r outside the band [lo, hi]
  fork_oob_share    share of those out-of-band tokens that are forks (trainer p_t < 0.5)
  forks_deleted     share of fork tokens a reject rule with this band deletes
  neg_low_clip      share of A < 0 tokens with r below the clip window [L, H]: what the PPO
                    lower bound clips when π_old := μ (the FP8 mechanism of Calibrated Clipping,
                    arXiv 2609.22870)
  pos_high_clip     share of A > 0 tokens with r > H
  sampler_reward    μ's own mean reward (β so large that μ earns nothing is past usable)
  teacher_acc, student_acc, teacher_ref_logp, student_ref_logp   (OPSD runs, distill.enabled)
                    the teacher (reference solution in its prompt) must beat its student

The band and the clip window are what the run's objective declares (`Objective.window`): a
builder's band, a clip's bounds, calibrated_clip's current [L, H]; else [0.5, 2] and [0.8, 1.28].

    python -m harness.rl.mechanism experiment=collapse_reject_vs_clamp [mechanism_batches=4]

writes `mechanism.json` into the run's directory (the one `harness.train` would use) and prints it.
"""

from __future__ import annotations

import math
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import hydra
import torch
from omegaconf import DictConfig, OmegaConf
from torch import Tensor

from harness import CONFIGS
from harness.base import distributed
from harness.base.distributed import ONE, Ranks
from harness.base.io import write_json_atomic, write_text_atomic
from harness.objectives.core import Window
from harness.rl.setup import build_setup, rollout_sampling, step_seed
from harness.rl.step import collect, gather_batch, share_rows
from harness.runs import config
from harness.runs.validate import validate
from harness.stats.diagnostics import FORK_P, fork_oob_share, out_of_band, out_of_band_frac


def _share(hit: Tensor, among: Tensor) -> float:
    n = int(among.sum())
    return float((hit & among).sum()) / n if n else float("nan")


def bounded(window: tuple[float, float]) -> tuple[float, float]:
    """A lower bound 0 (none) as the smallest positive double, so its log is finite."""
    return max(window[0], 1e-300), window[1]


def check(x: Tensor, p_t: Tensor, adv: Tensor, mask: Tensor, window: Window) -> dict[str, float]:
    """The step-0 numbers on the log-ratio x = log π_old − log μ ([B, T]), the trainer's p_t,
    the per-token advantages and the response mask, against the objective's `window`."""
    band, (lo, hi) = bounded(window.band), bounded(window.clip)
    m = mask.bool()
    fork = m & (p_t < FORK_P)
    return {
        "mean_abs_delta": float(x[m].abs().mean()) if m.any() else float("nan"),
        "oob_frac": out_of_band_frac(x, mask, band),
        "fork_oob_share": fork_oob_share(x, p_t, mask, band),
        "fork_frac": _share(fork, m),
        "forks_deleted": _share(out_of_band(x, band), fork),
        "neg_low_clip": _share(x < math.log(lo), m & (adv < 0)),
        "pos_high_clip": _share(x > math.log(hi), m & (adv > 0)),
    }


@torch.no_grad()
def run(cfg: DictConfig, validated: bool = False, ranks: Ranks = ONE) -> dict[str, Any]:
    """Build the run's setup (harness.rl.setup), score `cfg.mechanism_batches` rollout batches at
    θ = θ_old and return the token-weighted check plus the sampler's reward. harness.train
    calls it before step 1 of every run (its mechanism.json). Across ranks every rank calls it
    (the trainer is sharded: its forwards are collectives): each samples and scores its share
    of every batch, and every rank returns the global batch's check, the one-rank run's."""
    if not validated:
        validate(cfg)  # every config check, the swept-axis nodes included
    if cfg.mechanism_batches < 1:
        raise ValueError(f"mechanism_batches={cfg.mechanism_batches}; valid: >= 1")
    s = build_setup(cfg, ranks)
    sampling = rollout_sampling(cfg, s.task)
    window = s.objective.window()
    parts, rewards, seen = [], [], []
    for step in range(1, cfg.mechanism_batches + 1):
        seed = step_seed(cfg.seed, step)  # the run's own first prompts and samples
        problems = s.task.sample(cfg.rollout.prompts_per_step, "train", seed)
        seen += problems
        own, batch_rows = share_rows(ranks, len(problems), cfg.rollout.group_size)
        reward = partial(s.task.rollout_rewards, problems[own], tokenizer=s.tok)
        batch, _, rew = collect(
            s.sampler,
            s.policy,
            [p.prompt for p in problems[own]],
            reward,
            sampling,
            s.options,
            seed=seed,
            batch_rows=batch_rows,
        )
        if ranks.world > 1:
            batch, rew = gather_batch(batch), distributed.gather_rows(rew)
        parts.append((batch.log_rho, batch.p_t, batch.advantages, batch.mask))
        rewards.append(rew)
    s.sampler.close()
    x, p_t, adv, mask = (torch.cat([p[k].flatten() for p in parts])[None] for k in range(4))
    out = check(x, p_t, adv, mask, window)
    if s.objective.needs_teacher:
        out |= opsd_check(s, cfg, seen, sampling.max_new_tokens)
    return {
        **out,
        "sampler_reward": float(torch.cat(rewards).mean()),
        "n_tokens": int(mask.sum()),
        "band": list(bounded(window.band)),
        "clip": list(bounded(window.clip)),
        "batches": cfg.mechanism_batches,
    }


def opsd_check(s, cfg: DictConfig, problems: list, budget: int) -> dict[str, float]:
    """OPSD (arXiv 2609.38995) needs a teacher better than its student: both policies' sampled
    accuracy on these problems (the teacher with the reference solution in its prompt, the
    student without; T = the rollout's) and the mean per-token log-prob each gives the reference
    solution + EOS, teacher-forced."""
    from harness.sampling.engines import Engine
    from harness.sampling.rollout import Sampling
    from harness.tasks import teacher_prompt
    from harness.tasks.warmstart import sft_batch, sft_loss

    privileged = [
        replace(p, prompt=teacher_prompt(p, cfg.distill.teacher_prompt)) for p in problems
    ]
    out = {}
    for who, model, probs in [
        ("teacher", s.teacher, privileged),
        ("student", s.policy.model, problems),
    ]:
        ro = Engine(model, s.tok).generate(
            [p.prompt for p in probs],
            Sampling(n=1, max_new_tokens=budget, temperature=cfg.rollout.temperature),
            seed=cfg.eval_seed,
        )
        out[f"{who}_acc"] = float(s.task.rollout_rewards(problems, ro, s.tok).mean())
        out[f"{who}_ref_logp"] = -float(sft_loss(model, *sft_batch(probs, s.tok)))
    return out


config.register()


@hydra.main(config_path=str(CONFIGS), config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> dict[str, Any]:
    out = run(cfg)
    # the folder describes itself: the config beside the numbers (analysis.summarize reads both)
    write_text_atomic(Path(cfg.out) / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
    path = write_json_atomic(Path(cfg.out) / "mechanism.json", out)
    print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in out.items()))
    print(f"[mechanism] wrote {path}")
    return out


if __name__ == "__main__":
    import sys

    from harness.runs import plugins

    plugins.load(plugins.from_argv(sys.argv[1:]))  # before composition: objective=<a plugin's>
    main()
