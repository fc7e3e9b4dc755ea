"""Verifiable tasks with exact {0, 1} rewards: multi-digit arithmetic, countdown, a user dataset.

Every task draws `Problem`s deterministically from (seed, split). The procedural tasks assign
each problem to `train` or `eval` by a hash of its canonical key, so the two splits are disjoint
for every seed (about `eval_frac` of the problem space is held out). Prompts, answers and
solutions of the procedural tasks use only `harness.base.models.CHAR_ALPHABET`, so the character
tokenizer covers them. `solution` is a reference solver trace: the warm-start SFT target and the
privileged information of the self-distillation teacher (OPSD; arXiv 2609.38995).

    task = build(TASKS, "arithmetic", "task", digits=2, ops="+-")
    problems = task.sample(16, "train", seed=0)
    task.reward(problems[0], "12+30+4=42+4=46")  # 1.0 or 0.0

Countdown answers are parsed by a small recursive-descent parser over integers, + - * / and
parentheses with exact `Fraction` arithmetic; nothing is ever passed to `eval`.
"""

from collections.abc import Callable

from harness.tasks import arithmetic, countdown, hf, word_problems
from harness.tasks.base import TEACHER_PROMPT, Problem, Task, teacher_prompt

# name -> builder, from the modules that define them; a plugin adds its own with
# `harness.base.registry.register(TASKS, name)`
TASKS: dict[str, Callable[..., Task]] = {
    "arithmetic": arithmetic.arithmetic,
    "countdown": countdown.countdown,
    "hf": hf.hf,
    "word_problems": word_problems.word_problems,
}

__all__ = ["TASKS", "TEACHER_PROMPT", "Problem", "Task", "teacher_prompt"]
