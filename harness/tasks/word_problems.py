"""Grade-school word problems (GSM8K layout), generated, for a real instruct model through its
chat template."""

from __future__ import annotations

import random

from harness.tasks.base import Problem, ProceduralTask, in_chat
from harness.tasks.graders import math_verify_reward
from harness.tasks.hf import DatasetTask

# Every event is the owner's own: with a second person who gives or takes, SmolLM2-135M-Instruct
# often mixes up who has what (T = 1: 8% vs 14% correct without such events, 128 eval problems).
WORD_NAMES = {
    "Tom": "he",
    "Anna": "she",
    "Ben": "he",
    "Lily": "she",
    "Sam": "he",
    "Mia": "she",
    "Jack": "he",
    "Emma": "she",
    "Leo": "he",
    "Zoe": "she",
    "Max": "he",
    "Ava": "she",
}


WORD_ITEMS = (
    "apples marbles stickers pencils cookies stamps books shells cards balloons crayons oranges"
)


WORD_EVENTS = {
    "+": ("{P} buys {b} more {item}.", "{P} finds {b} more {item}."),
    "-": ("{P} loses {b} {item}.", "{P} sells {b} {item}."),
}


class WordProblemTask(ProceduralTask):
    """Generated grade-school word problems in GSM8K's layout: a question, a worked reference
    ending '#### <answer>', graded by math-verify. One running quantity: a start in
    [2, max_number], then `steps` events that add or remove 1..max_number (every value stays
    >= 1). The split is by the arithmetic (`info['expr']`, e.g. '7+3'), not the wording, so no
    eval problem's numbers occur in train. Prompts are one user turn of the tokenizer's chat
    template, as in `DatasetTask`.

    Defaults are the setting measured for SmolLM2-135M-Instruct (128 eval problems, results/
    LOG.md 2026-12-04): asked to reason step by step it rambles past any short budget (5-10%
    correct, most responses truncated); asked for the number only, with one step and numbers
    <= 10, it answers in ~38 tokens and is right 10% of the time at T = 1, 25% at T = 0.5."""

    name = "word_problems"
    attach_tokenizer = DatasetTask.attach_tokenizer  # sets self.render: one user turn

    def __init__(self, steps, max_number, eval_frac, max_new_tokens, instruction, chat_template):
        self.steps, self.max_number, self.eval_frac = steps, max_number, eval_frac
        self.max_new_tokens, self.instruction = max_new_tokens, instruction
        self.chat_template, self.render = chat_template, None

    def key(self, problem: Problem) -> str:
        return problem.info["expr"]

    def draw(self, rng: random.Random) -> Problem:
        name, item = rng.choice(list(WORD_NAMES)), rng.choice(WORD_ITEMS.split())
        pronoun = WORD_NAMES[name]
        value = rng.randint(2, self.max_number)
        expr, sentences, lines = str(value), [f"{name} has {value} {item}."], []
        for _ in range(self.steps):
            op = "+" if value == 1 else rng.choice("+-")
            b = rng.randint(1, self.max_number if op == "+" else min(self.max_number, value - 1))
            new = value + b if op == "+" else value - b
            event = rng.choice(WORD_EVENTS[op])
            sentences.append(event.format(P=pronoun.capitalize(), b=b, item=item))
            lines.append(f"{value} {op} {b} = {new}")
            expr, value = f"{expr}{op}{b}", new
        question = " ".join(sentences + [f"How many {item} does {name} have now?"])
        prompt = f"{question} {self.instruction}".strip()
        solution = "\n".join(lines + [f"#### {value}"])
        return Problem(prompt, str(value), solution, {"expr": expr, "question": question})

    def sample(self, n: int, split: str = "train", seed: int = 0) -> list[Problem]:
        out = super().sample(n, split, seed)
        if self.render is None:
            return out
        return [in_chat(p, self.render) for p in out]

    def reward(self, problem: Problem, response: str) -> float:
        return math_verify_reward(problem.answer, response)


def word_problems(
    *,
    steps: int = 1,
    max_number: int = 10,
    eval_frac: float = 0.25,
    max_new_tokens: int = 48,
    instruction: str = "Answer with the number only.",
    chat_template: bool = True,
) -> WordProblemTask:
    """Generated grade-school word problems, GSM8K layout ('#### n'), graded by math-verify;
    prompts in the model's chat template when its tokenizer has one."""
    if steps < 1:
        raise ValueError(f"task.steps={steps}; valid: an integer >= 1")
    if max_number < 2:
        raise ValueError(f"task.max_number={max_number}; valid: an integer >= 2")
    if not 0 < eval_frac < 1:
        raise ValueError(f"task.eval_frac={eval_frac}; valid: 0 < eval_frac < 1")
    return WordProblemTask(steps, max_number, eval_frac, max_new_tokens, instruction, chat_template)
