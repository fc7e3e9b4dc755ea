"""Where a run's metrics go besides metrics.jsonl, which is always written and is the source of
truth: Weights & Biases or TensorBoard (`logger`), a plain line every `log_every` steps when no
progress bar is shown (a Slurm log is not a terminal: a bar there is carriage-return noise), and
one line when the run ends.

Each step is also logged under the names verl, TRL, slime and prime-rl give the same quantities
(ALIASES), so a ratiolab run can be plotted beside one of theirs. Only exact equivalents are
aliased; where a framework's statistic differs (verl's chi2_token = E[ρ²] − 1 against ratiolab's
E[(ρ − 1)²]; TRL's max of |log π_old − log μ| against our p99; NeMo-RL's is_oob_ratio, which
counts clamped tokens, masked tokens or masked sequences by its truncation type) there is none.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

LOGGERS = ("none", "wandb", "tensorboard")

# framework name -> ratiolab metric. The dials read ρ = π_old/μ of the sampled tokens, x = log ρ
# (harness.stats.diagnostics); the frameworks compute the same statistics on the same ratio.
ALIASES = {
    # verl, rollout_corr_helper.compute_offpolicy_metrics / compute_is_metrics
    "rollout_corr/kl": "dial/kl_k1",  # mean(log μ − log π_old)
    "rollout_corr/k3_kl": "dial/kl_k3",  # mean(ρ − log ρ − 1)
    "rollout_corr/rollout_is_mean": "is/weight_mean",
    "rollout_corr/rollout_is_max": "is/weight_max",
    "rollout_corr/rollout_is_min": "is/weight_min",
    "rollout_corr/rollout_is_eff_sample_size": "is/ess",  # 1 / mean[(w / mean w)²]
    # the share of response tokens rollout_rs rejects (compute_rollout_rejection_mask)
    "rollout_corr/rollout_rs_masked_fraction": "mask/frac",
    # TRL GRPOTrainer
    "sampling/sampling_logp_difference/mean": "dial/mean_abs_delta",  # mean |log π_old − log μ|
    "sampling/importance_sampling_ratio/mean": "is/weight_mean",
    "sampling/importance_sampling_ratio/max": "is/weight_max",
    "sampling/importance_sampling_ratio/min": "is/weight_min",
    "clip_ratio/low_mean": "clip/frac_low",  # A < 0 and r < 1 − ε
    "clip_ratio/high_mean": "clip/frac_high",  # A > 0 and r > 1 + ε
    "completions/mean_length": "response/len",
    "entropy": "entropy/mean",
    "reward": "reward/mean",
    # slime
    "train_rollout_logprob_abs_diff": "dial/mean_abs_delta",
    # NeMo-RL
    "token_mult_prob_error": "dial/token_mult_prob_error",  # mean exp|log π_old − log μ|
    # prime-rl
    "mismatch_kl": "dial/kl_k3",
    "is_masked": "mask/frac",
}


def aliased(metrics: dict[str, Any]) -> dict[str, Any]:
    """The step's metrics under the other frameworks' names (those the step logged)."""
    return {alias: metrics[name] for alias, name in ALIASES.items() if name in metrics}


def scalars(metrics: dict[str, Any]) -> dict[str, float]:
    """The numbers of a step, its own names and the aliases, without the step counter."""
    both = {**metrics, **aliased(metrics)}
    return {k: float(v) for k, v in both.items() if k != "step" and isinstance(v, (int, float))}


def plain_line(metrics: dict[str, Any], steps: int) -> str:
    """One step in one line: 'step 10/300  reward 0.125  entropy 0.341  eval 0.210  2.9 s/step'."""
    shown = [
        ("reward", "reward/mean"),
        ("entropy", "entropy/mean"),
        ("eval", "eval/acc"),
        ("|Δ|", "dial/mean_abs_delta"),
        ("clip↓", "clip/frac_low"),
    ]
    parts = [f"{label} {metrics[k]:.3f}" for label, k in shown if k in metrics]
    return "  ".join(
        [f"step {metrics['step']}/{steps}", *parts, f"{metrics['time/step_s']} s/step"]
    )


class Tracker:
    """`logger`'s sink for one run: wandb (offline unless WANDB_MODE says otherwise: a GPU node
    without a network still logs; `wandb sync <run dir>/wandb/offline-run-*` uploads later; one
    wandb run per run folder, resumed with it) or TensorBoard (<run dir>/tensorboard)."""

    def __init__(self, logger: str, run_dir: Path, config: dict[str, Any], project: str):
        self.logger, self.run, self.writer = logger, None, None
        if logger == "wandb":
            import wandb

            os.environ.setdefault("WANDB_MODE", "offline")
            run_id = hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:16]
            self.run = wandb.init(
                project=project,
                name=Path(run_dir).name,
                id=run_id,
                dir=str(run_dir),
                config=config,
                resume="allow",
            )
        elif logger == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"))

    def log(self, metrics: dict[str, Any]) -> None:
        values, step = scalars(metrics), int(metrics["step"])
        if self.run is not None:
            self.run.log(values, step=step)
        if self.writer is not None:
            for k, v in values.items():
                self.writer.add_scalar(k, v, step)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
        if self.writer is not None:
            self.writer.close()


SIGNAL_STEPS = 5  # a fresh run's first steps, read for a learning signal


def no_signal(rewards: list[float]) -> str | None:
    """Why the first steps trained nothing, or None: {0, 1} rewards whose step means are all 0
    (or all 1) leave every group's advantages 0, so the policy gradient is 0."""
    if len(rewards) < SIGNAL_STEPS or len(set(rewards)) > 1 or rewards[0] not in (0.0, 1.0):
        return None
    every = "wrong" if rewards[0] == 0 else "right"
    return (
        f"WARNING no learning signal: the mean reward of steps 1–{len(rewards)} is "
        f"{rewards[0]:g} in every step (every response {every}): group-normalised "
        "advantages are 0 and nothing trains. Check the task's grading against a few "
        "responses, or start from a model that solves some problems."
    )
