"""Countdown: reach the target from the given numbers with + - * / and parentheses. Answers are
parsed by a small recursive-descent parser with exact `Fraction` arithmetic; nothing is ever
passed to `eval`."""

from __future__ import annotations

import random
import re
from collections import Counter
from fractions import Fraction

from harness.tasks.base import Problem, ProceduralTask


class ExprError(ValueError):
    """Raised by `parse_expression` on text that is not an integer arithmetic expression."""


def tokenize_expression(text: str) -> list[str]:
    tokens = re.findall(r"\d+|[-+*/()]|\S", text)
    bad = [t for t in tokens if not (t.isdigit() or t in "+-*/()")]
    if bad:
        raise ExprError(f"unexpected character {bad[0]!r}")
    return tokens


def parse_expression(text: str, max_len: int = 200) -> tuple[Fraction, list[int]]:
    """Exact value and the integer literals of `text` (+ − × ÷, parentheses, no unary minus)."""
    if len(text) > max_len:
        raise ExprError(f"expression longer than {max_len} characters")
    tokens, pos, literals = tokenize_expression(text), 0, []

    def peek() -> str | None:
        return tokens[pos] if pos < len(tokens) else None

    def take() -> str:
        nonlocal pos
        if pos >= len(tokens):
            raise ExprError("unexpected end of expression")
        pos += 1
        return tokens[pos - 1]

    def atom() -> Fraction:
        t = take()
        if t == "(":
            v = expr()
            if take() != ")":
                raise ExprError("missing ')'")
            return v
        if t.isdigit():
            literals.append(int(t))
            return Fraction(int(t))
        raise ExprError(f"unexpected token {t!r}")

    def term() -> Fraction:
        v = atom()
        while peek() in ("*", "/"):
            op, w = take(), atom()
            if op == "/" and w == 0:
                raise ExprError("division by zero")
            v = v * w if op == "*" else v / w
        return v

    def expr() -> Fraction:
        v = term()
        while peek() in ("+", "-"):
            op, w = take(), term()
            v = v + w if op == "+" else v - w
        return v

    value = expr()
    if pos != len(tokens):
        raise ExprError(f"unexpected token {tokens[pos]!r}")
    return value, literals


def countdown_reward(numbers: list[int], target: int, response: str) -> float:
    """1 iff the response's last line (left of any '=') uses each given number at most once and
    evaluates exactly to the target."""
    lines = [ln for ln in response.strip().splitlines() if ln.strip()]
    if not lines:
        return 0.0
    try:
        value, used = parse_expression(lines[-1].split("=", 1)[0])
    except ExprError:
        return 0.0
    return float(value == target and not (Counter(used) - Counter(numbers)))


def render(tree) -> str:
    """Expression tree (int | (op, left, right)) to text; every non-leaf child is parenthesised."""
    if isinstance(tree, int):
        return str(tree)
    op, left, right = tree
    wrap = [render(t) if isinstance(t, int) else f"({render(t)})" for t in (left, right)]
    return f"{wrap[0]}{op}{wrap[1]}"


def combine(op: str, x: int, y: int) -> int | None:
    """x op y when it is a positive integer (countdown's rule for intermediate results)."""
    if op == "+":
        return x + y
    if op == "-":
        return x - y if x > y else None
    if op == "*":
        return x * y
    return x // y if y > 1 and x % y == 0 else None


class CountdownTask(ProceduralTask):
    """Make `target` from `n_numbers` numbers in [1, max_number] with + − × ÷ (each at most once).

    Problems are built backwards: a random expression over all the numbers (positive integer
    intermediates) gives the target, so every problem is solvable and that expression is the
    reference solution."""

    name = "countdown"

    def __init__(
        self,
        n_numbers: int = 3,
        max_number: int = 10,
        max_target: int = 100,
        ops: str = "+-*/",
        eval_frac: float = 0.1,
    ):
        if n_numbers < 2 or max_number < 1 or not ops or set(ops) - set("+-*/"):
            raise ValueError("countdown: need n_numbers >= 2, max_number >= 1, ops from '+-*/'")
        self.n_numbers, self.max_number, self.max_target = n_numbers, max_number, max_target
        self.ops, self.eval_frac = ops, eval_frac
        self.max_new_tokens = 8 * n_numbers + 8

    def key(self, problem: Problem) -> str:
        return f"{sorted(problem.info['numbers'])}->{problem.answer}"

    def draw(self, rng: random.Random) -> Problem:
        while True:
            numbers = [rng.randint(1, self.max_number) for _ in range(self.n_numbers)]
            items = [(n, n) for n in numbers]  # (value, tree)
            while len(items) > 1:
                i, j = rng.sample(range(len(items)), 2)
                value = combine(op := rng.choice(self.ops), items[i][0], items[j][0])
                if value is None:
                    break
                new = (value, (op, items[i][1], items[j][1]))
                items = [t for k, t in enumerate(items) if k not in (i, j)] + [new]
            if len(items) == 1 and 1 <= items[0][0] <= self.max_target:
                target, tree = items[0]
                prompt = f"make {target} from {' '.join(map(str, numbers))}:"
                return Problem(
                    prompt, str(target), f"{render(tree)}={target}", {"numbers": numbers}
                )

    def reward(self, problem: Problem, response: str) -> float:
        return countdown_reward(problem.info["numbers"], int(problem.answer), response)


def countdown(
    *,
    n_numbers: int = 3,
    max_number: int = 10,
    max_target: int = 100,
    ops: str = "+-*/",
    eval_frac: float = 0.1,
) -> CountdownTask:
    """Countdown (TinyZero-style): reach the target from the given numbers with + − × ÷."""
    return CountdownTask(n_numbers, max_number, max_target, ops, eval_frac)
