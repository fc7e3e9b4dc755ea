"""The task interface: a `Problem`, the deterministic train/eval split, `Task` and the
procedural tasks' base class and the OPSD teacher's prompt (the `TASKS` registry is the
package's, harness.tasks)."""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field, replace

import torch

SPLITS = ("train", "eval")


@dataclass(frozen=True)
class Problem:
    """One prompt with its reference answer and solver trace (`info`: task-specific data)."""

    prompt: str
    answer: str
    solution: str
    info: dict = field(default_factory=dict, compare=False)


# OPSD's teacher sees the reference solution (arXiv 2609.38995); warm-start recipes with
# privileged_frac > 0 train on this format too, so the teacher is in distribution
TEACHER_PROMPT = "Reference solution: {solution}\n{prompt}"


def teacher_prompt(problem: Problem, template: str = TEACHER_PROMPT) -> str:
    """The teacher's privileged prompt; a prompt rendered as a chat template's user turn
    (`in_chat`) keeps the template around the privileged text, so the reference solution sits
    inside the user's turn, not before the template's first token."""
    prefix, user, suffix = problem.info.get("chat", ("", problem.prompt, ""))
    return prefix + template.format(prompt=user, solution=problem.solution) + suffix


def in_chat(problem: Problem, render) -> Problem:
    """`problem` with its prompt rendered by `render` (one user turn of a chat template), and the
    text around the user's words kept in info["chat"] = (prefix, user text, suffix)."""
    text = render(problem.prompt)
    i = text.rfind(problem.prompt)
    if i < 0:  # a template that rewrites the content: the teacher's text goes in front
        return replace(problem, prompt=text)
    chat = (text[:i], problem.prompt, text[i + len(problem.prompt) :])
    return replace(problem, prompt=text, info={**problem.info, "chat": chat})


def check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; valid: {', '.join(SPLITS)}")


def key_split(key: str, eval_frac: float) -> str:
    """Split of a problem by a stable hash of its canonical key (independent of any seed)."""
    h = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2.0**64
    return "eval" if h < eval_frac else "train"


def split_rng(name: str, split: str, seed: int) -> random.Random:
    """A Python RNG seeded from (task, split, seed): same inputs, same problems on any machine."""
    return random.Random(f"{name}/{split}/{seed}")


class Task:
    """Base class: `sample(n, split, seed) -> list[Problem]`, `reward(problem, text) -> 0/1`."""

    name = "task"
    max_new_tokens = 64  # enough for any reference solution + EOS

    def sample(self, n: int, split: str = "train", seed: int = 0) -> list[Problem]:
        raise NotImplementedError

    def reward(self, problem: Problem, response: str) -> float:
        raise NotImplementedError

    def attach_tokenizer(self, tokenizer) -> None:
        """The policy's tokenizer, for a task that formats its prompts with it (task=hf)."""

    def rollout_rewards(self, problems: list[Problem], ro, tokenizer) -> torch.Tensor:
        """[B] reward of each rollout row (an `engines.Rollout`) against the problem its prompt
        came from (`problems[ro.prompt_index[i]]`); text after the response mask is dropped."""
        texts = tokenizer.batch_decode(
            ro.response_ids * ro.response_mask.long(), skip_special_tokens=True
        )
        return torch.tensor(
            [self.reward(problems[i], t) for i, t in zip(ro.prompt_index.tolist(), texts)]
        )


class ProceduralTask(Task):
    """Rejection-samples `draw(rng)` until the problem's key hashes into the requested split."""

    eval_frac = 0.1

    def draw(self, rng: random.Random) -> Problem:
        raise NotImplementedError

    def key(self, problem: Problem) -> str:
        return problem.prompt

    def sample(self, n: int, split: str = "train", seed: int = 0) -> list[Problem]:
        check_split(split)
        rng = split_rng(self.name, split, seed)
        out = []
        for _ in range(1000 * max(n, 1)):
            if len(out) == n:
                break
            p = self.draw(rng)
            if key_split(self.key(p), self.eval_frac) == split:
                out.append(p)
        if len(out) < n:
            raise RuntimeError(f"{self.name}: could not draw {n} {split} problems")
        return out
