"""Verifiable tasks with exact {0, 1} rewards: multi-digit arithmetic, countdown, a user dataset.

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

import dataclasses
import hashlib
import json
import os
import random
import re
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

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


# --- a researcher's dataset: files or a cached hub id, through HF datasets -----------------------

# field layouts of the usual math RL datasets: (prompt, reference answer, solution) fields; a
# dotted field reads into a nested column, a list of chat messages gives its last user turn
LAYOUTS = {
    "gsm8k": ("question", "answer", "answer"),  # answer: the worked solution, '#### 72' at its end
    "math": ("problem", "solution", "solution"),  # MATH / MATH-500: the last \boxed{} of solution
    "dapo": ("prompt", "reward_model.ground_truth", None),  # DAPO-Math-17k (verl's parquet layout)
}
FORMATS = {
    ".jsonl": "json",
    ".json": "json",
    ".parquet": "parquet",
    ".arrow": "arrow",
    ".csv": "csv",
}
GRADERS = ("math_verify", "last_number")


def get_field(row: dict, name: str, where: str):
    """row[name], a dotted name reading into nested columns; chat messages → last user turn."""
    value: Any = row
    for part in name.split("."):
        if not isinstance(value, dict) or part not in value:
            have = sorted(value) if isinstance(value, dict) else type(value).__name__
            raise ValueError(f"{where}: no field {name!r} (it has {have}); set task.layout or "
                             "task.prompt_field / answer_field / solution_field")  # fmt: skip
        value = value[part]
    if isinstance(value, list) and value and isinstance(value[0], dict) and "content" in value[0]:
        user = [m["content"] for m in value if m.get("role", "user") == "user"]
        value = user[-1] if user else value[-1]["content"]
    return value


def read_jsonl(path: Path) -> list[dict]:
    """JSONL rows; a malformed line raises ValueError naming file and line."""
    rows = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
        rows.append(row)
    return rows


def read_rows(path: str, split: str) -> tuple[list[dict], list[str]]:
    """Rows of a dataset and where each came from: a .jsonl file (read here: errors name the
    line), a .json / .parquet / .arrow / .csv file or a folder of them, a `save_to_disk`
    folder, or a hub id already in the local HF cache (offline: nothing is downloaded)."""
    p = Path(path).expanduser()
    if p.is_file() and p.suffix == ".jsonl":
        rows = read_jsonl(p)
        return rows, [f"{p}:{i + 1}" for i in range(len(rows))]
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # read before datasets is first imported
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import datasets

    if p.is_dir() and ((p / "state.json").exists() or (p / "dataset_dict.json").exists()):
        ds = datasets.load_from_disk(str(p))
        ds = ds[split] if isinstance(ds, datasets.DatasetDict) else ds
    elif p.exists():
        files = [p] if p.is_file() else sorted(f for f in p.rglob("*") if f.suffix in FORMATS)
        kinds = {FORMATS.get(f.suffix) for f in files}
        if not files or None in kinds or len(kinds) > 1:
            raise ValueError(f"task.path={path!r}: expected one kind of {', '.join(FORMATS)} "
                             f"file(s), found {sorted(f.name for f in files)[:5]}")  # fmt: skip
        ds = datasets.load_dataset(kinds.pop(), data_files=[str(f) for f in files], split="train")
    else:
        try:
            ds = datasets.load_dataset(path, split=split)
        except Exception as e:  # noqa: BLE001 — datasets raises many types for "not there"
            raise ValueError(f"task.path={path!r}: not a file or folder here, and not a dataset "
                             f"in the local HF cache with a {split!r} split ({type(e).__name__}: "
                             f"{e}); valid: a jsonl/json/parquet/arrow/csv file or folder, a "
                             "save_to_disk folder, or a cached hub id") from None  # fmt: skip
    rows = list(ds)
    return rows, [f"{path} row {i}" for i in range(len(rows))]


def load_problems(path: str, split: str, prompt_field: str, answer_field: str,
                  solution_field: str | None) -> list[Problem]:  # fmt: skip
    """Problems with their reference answers; a row without one raises, naming it."""
    rows, where = read_rows(path, split)
    problems = []
    for row, at in zip(rows, where):
        ref = str(get_field(row, answer_field, at))
        answer = extract_answer(ref)
        if answer is None:
            raise ValueError(f"{at}: no reference answer in field {answer_field!r} "
                             r"(expected \boxed{...}, '#### <answer>' or a number)")  # fmt: skip
        solution = str(get_field(row, solution_field, at)) if solution_field else ref
        problems.append(Problem(str(get_field(row, prompt_field, at)), answer, solution))
    if not problems:
        raise ValueError(f"task.path={path!r}: no problems")
    return problems


def hash_split(problems: list[Problem], eval_frac: float) -> dict[str, list[Problem]]:
    """Train / eval by the prompt's hash: the eval split is the round(eval_frac·n) problems
    (at least one, and one fewer than n) whose prompts hash lowest, so it is never empty for a
    small file, stable when rows are added or reordered, and disjoint from train."""
    n = len(problems)
    if n < 2:
        raise ValueError(f"task.path: {n} problem; a train and an eval split need >= 2 "
                         "(or pass task.eval_path)")  # fmt: skip
    k = min(max(1, round(eval_frac * n)), n - 1)
    order = sorted(problems, key=lambda p: hashlib.sha256(p.prompt.encode()).hexdigest())
    return {"eval": order[:k], "train": order[k:]}


class DatasetTask(Task):
    r"""A researcher's math dataset (see `read_rows` for what loads). The reference answer is
    the answer field's `\boxed{}`, '####' part or last number; responses are graded by
    math-verify (Hugging Face's math answer checker: LaTeX and plain forms, fractions,
    thousands separators, units) or, with grader=last_number, on their last `\boxed{}` else
    last number, compared as normalised strings."""

    name = "hf"

    def __init__(self, path: str, eval_path: str | None, split: str, fields: tuple,
                 eval_frac: float, grader: str, max_new_tokens: int,
                 chat_template: bool):  # fmt: skip
        self.chat_template, self.render = chat_template, None
        rows = load_problems(path, split, *fields)
        if eval_path is not None:
            self.splits = {"train": rows, "eval": load_problems(eval_path, split, *fields)}
        else:
            self.splits = hash_split(rows, eval_frac)
        self.grader, self.max_new_tokens = grader, max_new_tokens

    def sample(self, n: int, split: str = "train", seed: int = 0) -> list[Problem]:
        """n problems from the split: a seeded permutation, repeated when n exceeds its size;
        the eval split is never repeated (a problem counted twice is no more evidence): n is
        capped at its size, with a warning."""
        check_split(split)
        pool = self.splits[split]
        if split == "eval" and n > len(pool):
            warnings.warn(f"eval_n={n} exceeds the eval split ({len(pool)} problems): evaluating "
                          f"on those {len(pool)}; set task.eval_path or task.eval_frac for more",
                          stacklevel=2)  # fmt: skip
            n = len(pool)
        rng, out = split_rng(self.name, split, seed), []
        while len(out) < n:
            out += rng.sample(pool, len(pool))
        if self.render is not None:
            return [dataclasses.replace(p, prompt=self.render(p.prompt)) for p in out[:n]]
        return out[:n]

    def attach_tokenizer(self, tokenizer) -> None:
        """With chat_template (the default) and a tokenizer that has one (an instruct model's),
        each prompt becomes one user turn in that template, ending in the assistant's turn
        (`add_generation_prompt`); a base model's tokenizer has none: prompts stay raw text."""
        if self.chat_template and getattr(tokenizer, "chat_template", None):
            self.render = lambda text: tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
            )

    def reward(self, problem: Problem, response: str) -> float:
        if self.grader == "math_verify":
            return math_verify_reward(problem.answer, response)
        boxed = last_boxed(response)
        got = boxed if boxed is not None else last_number(response)
        return float(got is not None and normalize_answer(got) == normalize_answer(problem.answer))


def math_verify_reward(answer: str, response: str) -> float:
    """1 when math-verify finds the response's final answer equal to the reference (parsed as
    `\boxed{answer}`), else 0 (also when nothing in the response parses)."""
    from math_verify import parse, verify

    gold = parse("\\boxed{" + answer + "}")
    return float(bool(gold) and verify(gold, parse(response)))


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


@register(TASKS, "hf")
def hf(
    *,
    path: str,
    eval_path: str | None = None,
    split: str = "train",
    layout: str = "gsm8k",
    prompt_field: str | None = None,
    answer_field: str | None = None,
    solution_field: str | None = None,
    eval_frac: float = 0.1,
    grader: str = "math_verify",
    max_new_tokens: int = 256,
    chat_template: bool = True,
) -> DatasetTask:
    """A math dataset from files or the local HF cache; fields from `layout` (gsm8k, math,
    dapo) unless named; graded by math-verify (or grader=last_number); prompts in the model's
    chat template when its tokenizer has one (chat_template=false: raw text)."""
    if layout not in LAYOUTS:
        raise ValueError(f"task.layout={layout!r}; valid: {', '.join(LAYOUTS)}")
    if grader not in GRADERS:
        raise ValueError(f"task.grader={grader!r}; valid: {', '.join(GRADERS)}")
    if not 0 < eval_frac < 1:
        raise ValueError(f"task.eval_frac={eval_frac}; valid: 0 < eval_frac < 1")
    named = (prompt_field, answer_field, solution_field)
    fields = tuple(f if f is not None else d for f, d in zip(named, LAYOUTS[layout]))
    return DatasetTask(
        path, eval_path, split, fields, eval_frac, grader, max_new_tokens, chat_template
    )


# --- grade-school word problems (GSM8K layout), for a real instruct model ----------------------

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
        return [dataclasses.replace(p, prompt=self.render(p.prompt)) for p in out]

    def reward(self, problem: Problem, response: str) -> float:
        return math_verify_reward(problem.answer, response)


@register(TASKS, "word_problems")
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
