"""OPSD pointwise-clipped forward KL (Huang et al., arXiv 2609.38995 §2).

Unlike the policy objectives this one takes logits, so its call signature differs:

    obj = build_objective("opsd_fkl", top_k=128, temperature=1.1, tau=0.05)  # inputs "logits"
    out = obj(student_logits, teacher_logits, mask)  # [B, T, V], [B, T, V] (frozen), [B, T]
    out = obj(student_logits, teacher_topk, mask, teacher_ids=ids)  # an engine's top-k capture

With `teacher_ids` [B, T, k], `teacher_logits` are the teacher's logits (or log-probs: the
renormalisation removes the shift) on those ids, and S_t = the ids. Otherwise S_t = the
teacher's top-k tokens (top_k None: full vocabulary). Both distributions are
renormalised on S_t at temperature T; d_i = p_i log(p_i/q_i); the loss is the token mean of
Σ_{S_t} min(d_i, τ) (τ = None: exact forward KL). Prop. 1: on clipped entries (d_i > τ) the
clipped objective's logit gradient P_A·q_i has the opposite sign to the exact q_i − p_i.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from harness.base.batch import masked_mean
from harness.objectives.core import Objective, ObjectiveOutput
from harness.stats.repetition import copy_token_probs, exit_mass, exit_mass_split
from harness.tasks import teacher_prompt


def opsd_pointwise(
    student_logits: Tensor,
    teacher_logits: Tensor,
    top_k: int | None,
    temperature: float,
    teacher_ids: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """(d, p): d_i = p_i log(p_i/q_i) on the teacher's top-k support renormalised at T."""
    a = teacher_logits.detach()
    b = student_logits
    if teacher_ids is None and top_k is not None and top_k < a.shape[-1]:
        a, teacher_ids = a.topk(top_k, dim=-1)
    if teacher_ids is not None:
        b = b.gather(-1, teacher_ids)
    log_p = F.log_softmax(a.float() / temperature, dim=-1)
    log_q = F.log_softmax(b.float() / temperature, dim=-1)
    p = log_p.exp()
    return p * (log_p - log_q), p


def opsd_fkl_loss(
    student_logits: Tensor,
    teacher_logits: Tensor,
    mask: Tensor,
    top_k: int | None = 128,
    temperature: float = 1.1,
    tau: float | None = 0.05,
    teacher_ids: Tensor | None = None,
) -> ObjectiveOutput:
    """OPSD loss: mean_t Σ_{S_t} min(d_i, τ) (Eq. D_clip), or the exact D_FKL when τ is None."""
    d, p = opsd_pointwise(student_logits, teacher_logits, top_k, temperature, teacher_ids)
    per_pos = d.sum(-1) if tau is None else d.clamp(max=tau).sum(-1)
    with torch.no_grad():
        clipped = (d > tau) if tau is not None else torch.zeros_like(d, dtype=torch.bool)
        metrics = {
            "opsd/fkl": masked_mean(d.sum(-1), mask),
            "opsd/clip_frac": masked_mean(clipped.float().mean(-1), mask),
            "opsd/clipped_mass": masked_mean((p * clipped).sum(-1), mask),
        }
    return ObjectiveOutput(masked_mean(per_pos, mask), {k: float(v) for k, v in metrics.items()})


class OPSDForwardKL(Objective):
    """Stateless; obj(student_logits, teacher_logits, mask) -> ObjectiveOutput."""

    inputs = "logits"

    def __init__(self, top_k: int | None, temperature: float, tau: float | None) -> None:
        self.top_k, self.temperature, self.tau = top_k, temperature, tau

    def __call__(
        self,
        student_logits: Tensor,
        teacher_logits: Tensor,
        mask: Tensor,
        teacher_ids: Tensor | None = None,
    ) -> ObjectiveOutput:
        return opsd_fkl_loss(
            student_logits,
            teacher_logits,
            mask,
            self.top_k,
            self.temperature,
            self.tau,
            teacher_ids,
        )


def opsd_fkl(
    *, top_k: int | None = 128, temperature: float = 1.1, tau: float | None = 0.05
) -> OPSDForwardKL:
    """OPSD forward KL on the teacher's top-k at T, pointwise clipped at τ (None: exact FKL)."""
    return OPSDForwardKL(top_k, temperature, tau)


# --- the distillation step's inputs and its repetition metric ------------------------------------


@torch.no_grad()
def copy_probs(s_logits, t_logits, reports: list[dict]) -> tuple[list[Tensor], list[Tensor]]:
    """The teacher's p and the student's q of each row's copy tokens at its first-copy
    positions (T = 1 softmax); rows without a copy give nothing."""
    p, q = [], []
    for s, t, rep in zip(s_logits, t_logits, reports):
        pos, tok = rep["first_copy_positions"], rep["first_copy_tokens"]
        if pos:
            p.append(copy_token_probs(t.float().softmax(-1), pos, tok))
            q.append(copy_token_probs(s.float().softmax(-1), pos, tok))
    return p, q


def exit_mass_metrics(p: list[Tensor], q: list[Tensor]) -> dict[str, float]:
    """OPSD Table 2 at first-copy positions: exit mass 1 − p(copy token) under the teacher and
    1 − q under the student; ratio R = Σ(1−q)/Σ(1−p) < 1 means the student is more willing than
    its teacher to continue the loop."""
    if not p:
        return {}
    em = exit_mass(torch.cat(p), torch.cat(q))
    return {
        "repetition/exit_mass_ratio": em["ratio"],
        "repetition/copy_frac_student_above": em["frac_student_above"],
        "repetition/first_copy_positions": float(em["n"]),
    }


@torch.no_grad()
def token_probs(s_logits, t_logits, reports: list[dict]) -> list[tuple[Tensor, ...]]:
    """Per row, at every response position (T = 1 softmax, as `copy_probs`): the teacher's p and
    the student's q of the response's own token, the student's entropy, and the copy mask."""
    rows = []
    for s, t, rep in zip(s_logits, t_logits, reports):
        n = rep["n_tokens"]
        if not n:
            continue
        ids = torch.as_tensor(rep["tokens"], device=s.device)[:, None]
        log_q, log_p = s[:n].float().log_softmax(-1), t[:n].float().log_softmax(-1)
        entropy = -(log_q.exp() * log_q).sum(-1)
        copy = torch.as_tensor(rep["copy_mask"], dtype=torch.bool, device=s.device)
        rows.append(
            (log_p.gather(1, ids)[:, 0].exp(), log_q.gather(1, ids)[:, 0].exp(), entropy, copy)
        )
    return rows


def copy_split_metrics(rows: list[tuple[Tensor, ...]]) -> dict[str, float]:
    """R = Σ(1−q)/Σ(1−p) at copy positions (every token that continues a repeated segment) and
    at the other response positions, the student's mean entropy at each, and the copy positions'
    share of the response tokens. A student that is merely sharper than its teacher lowers both
    ratios; OPSD's loop mechanism (clipping reverses the correction inside repetitions) lowers
    R at copy positions below R elsewhere."""
    if not rows:
        return {}
    p, q, entropy, copy = (torch.cat(x) for x in zip(*rows))
    split = exit_mass_split(p, q, copy)
    out = {
        "repetition/noncopy_exit_mass_ratio": split["noncopy"]["ratio"],
        "repetition/noncopy_entropy": float(entropy[~copy].mean()),
        "repetition/copy_frac": float(copy.double().mean()),
    }
    if copy.any():  # no copy position: no ratio, rather than a 0/0
        out["repetition/copy_exit_mass_ratio"] = split["copy"]["ratio"]
        out["repetition/copy_entropy"] = float(entropy[copy].mean())
    return out


def copy_exit_mass(s_logits, t_logits, reports: list[dict]) -> dict[str, float]:
    """`exit_mass_metrics` of these rows' logits."""
    return exit_mass_metrics(*copy_probs(s_logits, t_logits, reports))


class CopyExitMass:
    """The exit mass of a minibatch, gathered micro-batch by micro-batch (harness.rl.step's
    `PartMetrics`): `collect` keeps the copy tokens' probabilities of rows `rows` (of the
    rollout whose repetition `reports` these are) and every response token's, `reduce` is
    `exit_mass_metrics` and `copy_split_metrics` of them all."""

    def __init__(self, reports: list[dict]):
        self.reports = reports

    def collect(self, s_logits, t_logits, rows):
        reports = [self.reports[r] for r in rows]
        return copy_probs(s_logits, t_logits, reports), token_probs(s_logits, t_logits, reports)

    def reduce(self, collected: list) -> dict[str, float]:
        p = [x for (part_p, _), _ in collected for x in part_p]
        q = [x for (_, part_q), _ in collected for x in part_q]
        tokens = [row for _, part in collected for row in part]
        return exit_mass_metrics(p, q) | copy_split_metrics(tokens)


@dataclass(frozen=True)
class Teacher:
    """OPSD's teacher on a rollout: the frozen model and, per row, the privileged prompt it
    conditions on in place of the student's (left-padded `ids` and `mask`)."""

    model: torch.nn.Module
    ids: Tensor
    mask: Tensor


def teacher_inputs(
    policy, teacher: torch.nn.Module, problems, prompt: str, group_size: int, reps: list[dict]
) -> tuple[Teacher, CopyExitMass]:
    """The teacher with its privileged prompts (`prompt` with each problem's reference solution;
    one per rollout row, as `policy` encodes them) and the per-minibatch exit-mass metric."""
    t_ids, t_mask = policy.encode_prompts([teacher_prompt(p, prompt) for p in problems])
    g = group_size
    rows = Teacher(teacher, t_ids.repeat_interleave(g, 0), t_mask.repeat_interleave(g, 0))
    return rows, CopyExitMass(reps)
