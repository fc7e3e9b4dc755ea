"""Verifiable tasks with exact {0, 1} rewards: multi-digit arithmetic, countdown, user JSONL.

Every task draws `Problem`s deterministically from (seed, split). The procedural tasks assign
each problem to `train` or `eval` by a hash of its canonical key, so the two splits are disjoint
for every seed (about `eval_frac` of the problem space is held out). Prompts, answers and
solutions of the procedural tasks use only `harness.models.CHAR_ALPHABET`, so the character
tokenizer covers them. `solution` is a reference solver trace: the warm-start SFT target and the
privileged information of the self-distillation teacher (OPSD; arXiv 2609.38995).

    task = build(TASKS, "arithmetic", "task", digits=2, ops="+-")
    problems = task.sample(16, "train", seed=0)
    task.reward(problems[0], "12+30+4=42+4=46")  # 1.0 or 0.0

Countdown answers are parsed by a small recursive-descent parser over integers, + - * / and
parentheses with exact `Fraction` arithmetic; nothing is ever passed to `eval`.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path

import torch

from harness.registry import register

TASKS: dict[str, Callable] = {}
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
    return template.format(prompt=problem.prompt, solution=problem.solution)


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


# --- answer extraction ---------------------------------------------------------------------------

NUMBER_RE = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def last_number(text: str) -> str | None:
    """The last number in `text` (commas dropped), GSM8K-style; None when there is none."""
    found = NUMBER_RE.findall(text)
    return found[-1].replace(",", "") if found else None


def last_boxed(text: str) -> str | None:
    r"""Content of the last `\boxed{...}` (balanced braces); None when absent or unclosed."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i, depth = start + len("\\boxed{"), 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j].strip()
    return None


def extract_answer(text: str) -> str | None:
    r"""`\boxed{}` content if present, else the text after the last `####`, else the last number."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    if "####" in text:
        tail = text.rsplit("####", 1)[1].strip()
        return tail.replace(",", "") if NUMBER_RE.fullmatch(tail) else tail
    return last_number(text)


def normalize_answer(ans: str) -> str:
    """Canonical form for comparison: numbers as reduced fractions/integers, else stripped text."""
    s = ans.strip().strip("$").replace(",", "").rstrip(".").strip()
    try:
        v = Fraction(s)
    except (ValueError, ZeroDivisionError):
        return s
    return str(v)


# --- multi-digit arithmetic ----------------------------------------------------------------------


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


# --- countdown -----------------------------------------------------------------------------------


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


# --- user JSONL datasets (GSM8K-style) -----------------------------------------------------------


def load_jsonl(
    path: str | Path, prompt_field: str, answer_field: str, solution_field: str | None
) -> list[Problem]:
    """Read problems from JSONL; a malformed line raises ValueError naming file, line and field."""
    problems = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(
                    f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}"
                )
            needed = [prompt_field, answer_field] + ([solution_field] if solution_field else [])
            missing = [k for k in needed if k not in row]
            if missing:
                raise ValueError(
                    f"{path}:{lineno}: missing field(s) {missing}; the line has {sorted(row)}"
                )
            ref = str(row[answer_field])
            answer = extract_answer(ref)
            if answer is None:
                raise ValueError(
                    f"{path}:{lineno}: no reference answer in field {answer_field!r} "
                    r"(expected \boxed{...}, '#### <answer>' or a number)"
                )
            solution = str(row[solution_field]) if solution_field else ref
            problems.append(Problem(str(row[prompt_field]), answer, solution))
    if not problems:
        raise ValueError(f"{path}: no problems")
    return problems


class JsonlTask(Task):
    r"""Problems from JSONL with reference answers. The answer field may hold a whole solution
    (GSM8K: '... #### 72'): the reference answer is its `\boxed{}`, '####' part or last number.
    Responses are graded on their last `\boxed{}`, else their last number. Without `eval_path`
    the eval split is the `eval_frac` of lines whose prompt hashes there."""

    name = "jsonl"

    def __init__(
        self,
        path: str,
        eval_path: str | None = None,
        prompt_field: str = "question",
        answer_field: str = "answer",
        solution_field: str | None = None,
        eval_frac: float = 0.1,
        max_new_tokens: int = 256,
    ):
        rows = load_jsonl(path, prompt_field, answer_field, solution_field)
        if eval_path is not None:
            self.splits = {
                "train": rows,
                "eval": load_jsonl(eval_path, prompt_field, answer_field, solution_field),
            }
        else:
            self.splits = {
                s: [p for p in rows if key_split(p.prompt, eval_frac) == s] for s in SPLITS
            }
        self.max_new_tokens = max_new_tokens

    def sample(self, n: int, split: str = "train", seed: int = 0) -> list[Problem]:
        """n problems from the split: a seeded permutation, repeated when n exceeds its size."""
        check_split(split)
        pool = self.splits[split]
        if not pool:
            raise ValueError(f"jsonl: the {split} split is empty; pass eval_path or more lines")
        rng, out = split_rng(self.name, split, seed), []
        while len(out) < n:
            out += rng.sample(pool, len(pool))
        return out[:n]

    def reward(self, problem: Problem, response: str) -> float:
        boxed = last_boxed(response)
        got = boxed if boxed is not None else last_number(response)
        return float(got is not None and normalize_answer(got) == normalize_answer(problem.answer))


# --- registry ------------------------------------------------------------------------------------


@register(TASKS, "arithmetic")
def arithmetic(*, digits: int = 2, ops: str = "+-*", eval_frac: float = 0.1) -> ArithmeticTask:
    """Multi-digit arithmetic `a op b=` with a place-value solver trace."""
    return ArithmeticTask(digits, ops, eval_frac)


@register(TASKS, "countdown")
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


@register(TASKS, "jsonl")
def jsonl(
    *,
    path: str,
    eval_path: str | None = None,
    prompt_field: str = "question",
    answer_field: str = "answer",
    solution_field: str | None = None,
    eval_frac: float = 0.1,
    max_new_tokens: int = 256,
) -> JsonlTask:
    """User dataset with reference answers (GSM8K-style; last-number or \\boxed{} grading)."""
    return JsonlTask(
        path, eval_path, prompt_field, answer_field, solution_field, eval_frac, max_new_tokens
    )
