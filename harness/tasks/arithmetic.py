"""Multi-digit arithmetic `a op b=` with a place-value solver trace (the task model's task)."""

from __future__ import annotations

import random

from harness.tasks.base import Problem, ProceduralTask


def place_parts(b: int) -> list[int]:
    """Nonzero place-value parts of b ≥ 0, high to low: 405 -> [400, 5]; 0 -> [0]."""
    s = str(b)
    parts = [int(d) * 10 ** (len(s) - 1 - i) for i, d in enumerate(s) if d != "0"]
    return parts or [0]


def arithmetic_trace(a: int, op: str, b: int) -> str:
    """Solver trace splitting b into place values: 47+85 -> '47+80+5=127+5=132'."""
    parts = place_parts(b)
    if op == "*":
        prods = [a * p for p in parts]
        steps = ["+".join(f"{a}*{p}" for p in parts), "+".join(map(str, prods))]
        for k in range(1, len(prods)):
            steps.append("+".join([str(sum(prods[: k + 1]))] + [str(p) for p in prods[k + 1 :]]))
        return "=".join(steps)
    sign = 1 if op == "+" else -1
    steps, acc = [], a
    for k in range(len(parts) + 1):
        steps.append(f"{acc}" + "".join(f"{op}{p}" for p in parts[k:]))
        if k < len(parts):
            acc += sign * parts[k]
    return "=".join(steps)


class ArithmeticTask(ProceduralTask):
    """`a op b=`; operands have `digits` digits (no leading zero), op drawn from `ops`."""

    name = "arithmetic"

    def __init__(self, digits: int = 2, ops: str = "+-*", eval_frac: float = 0.1):
        if digits < 1 or not ops or set(ops) - set("+-*"):
            raise ValueError(
                f"arithmetic: need digits >= 1 and ops from '+-*', got {digits}, {ops}"
            )
        self.digits, self.ops, self.eval_frac = digits, ops, eval_frac
        self.max_new_tokens = 8 * digits * (digits + 1) + 8

    def draw(self, rng: random.Random) -> Problem:
        lo, hi = 10 ** (self.digits - 1), 10**self.digits - 1
        lo = 0 if self.digits == 1 else lo
        a, b, op = rng.randint(lo, hi), rng.randint(lo, hi), rng.choice(self.ops)
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        return Problem(f"{a}{op}{b}=", str(value), arithmetic_trace(a, op, b))

    def reward(self, problem: Problem, response: str) -> float:
        """1 iff the text after the last '=' of the response is exactly the answer."""
        if "=" not in response:
            return 0.0
        return float(response.rsplit("=", 1)[1].strip() == problem.answer)


def arithmetic(*, digits: int = 2, ops: str = "+-*", eval_frac: float = 0.1) -> ArithmeticTask:
    """Multi-digit arithmetic `a op b=` with a place-value solver trace."""
    return ArithmeticTask(digits, ops, eval_frac)
