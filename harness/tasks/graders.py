"""Answer extraction and grading: the last number, the last `\\boxed{}`, the canonical form of a
number, and math-verify's equivalence."""

from __future__ import annotations

import re
from fractions import Fraction

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


GRADERS = ("math_verify", "last_number")


def math_verify_reward(answer: str, response: str) -> float:
    """1 when math-verify finds the response's final answer equal to the reference (parsed as
    `\boxed{answer}`), else 0 (also when nothing in the response parses)."""
    from math_verify import parse, verify

    gold = parse("\\boxed{" + answer + "}")
    return float(bool(gold) and verify(gold, parse(response)))
