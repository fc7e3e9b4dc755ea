"""A researcher's dataset: files or a cached hub id, through HF datasets, in the layouts of the
usual math RL datasets (GSM8K, MATH, DAPO), graded by math-verify."""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from pathlib import Path
from typing import Any

from harness.tasks.base import Problem, Task, check_split, in_chat, split_rng
from harness.tasks.graders import (
    GRADERS,
    extract_answer,
    last_boxed,
    last_number,
    math_verify_reward,
    normalize_answer,
)

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


def get_field(row: dict, name: str, where: str):
    """row[name], a dotted name reading into nested columns; chat messages → last user turn."""
    value: Any = row
    for part in name.split("."):
        if not isinstance(value, dict) or part not in value:
            have = sorted(value) if isinstance(value, dict) else type(value).__name__
            raise ValueError(
                f"{where}: no field {name!r} (it has {have}); set task.layout or "
                "task.prompt_field / answer_field / solution_field"
            )
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
            raise ValueError(
                f"task.path={path!r}: expected one kind of {', '.join(FORMATS)} "
                f"file(s), found {sorted(f.name for f in files)[:5]}"
            )
        ds = datasets.load_dataset(kinds.pop(), data_files=[str(f) for f in files], split="train")
    else:
        try:
            ds = datasets.load_dataset(path, split=split)
        except Exception as e:  # noqa: BLE001 — datasets raises many types for "not there"
            raise ValueError(
                f"task.path={path!r}: not a file or folder here, and not a dataset "
                f"in the local HF cache with a {split!r} split ({type(e).__name__}: "
                f"{e}); valid: a jsonl/json/parquet/arrow/csv file or folder, a "
                "save_to_disk folder, or a cached hub id"
            ) from None
    rows = list(ds)
    return rows, [f"{path} row {i}" for i in range(len(rows))]


def load_problems(
    path: str, split: str, prompt_field: str, answer_field: str, solution_field: str | None
) -> list[Problem]:
    """Problems with their reference answers; a row without one raises, naming it."""
    rows, where = read_rows(path, split)
    problems = []
    for row, at in zip(rows, where):
        ref = str(get_field(row, answer_field, at))
        answer = extract_answer(ref)
        if answer is None:
            raise ValueError(
                f"{at}: no reference answer in field {answer_field!r} "
                r"(expected \boxed{...}, '#### <answer>' or a number)"
            )
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
        raise ValueError(
            f"task.path: {n} problem; a train and an eval split need >= 2 (or pass task.eval_path)"
        )
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

    def __init__(
        self,
        path: str,
        eval_path: str | None,
        split: str,
        fields: tuple,
        eval_frac: float,
        grader: str,
        max_new_tokens: int,
        chat_template: bool,
    ):
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
            warnings.warn(
                f"eval_n={n} exceeds the eval split ({len(pool)} problems): evaluating "
                f"on those {len(pool)}; set task.eval_path or task.eval_frac for more",
                stacklevel=2,
            )
            n = len(pool)
        rng, out = split_rng(self.name, split, seed), []
        while len(out) < n:
            out += rng.sample(pool, len(pool))
        if self.render is not None:
            return [in_chat(p, self.render) for p in out[:n]]
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
