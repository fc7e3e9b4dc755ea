"""Repetition detector and exit-mass metrics of OPSD (arXiv 2609.38995, Table 2).

Definitions, for a response x_0..x_{n-1} and a period 2 ≤ ℓ ≤ 50:
- periodic segment: a maximal x_s..x_e with x_t = x_{t−ℓ} for s+ℓ ≤ t ≤ e, length L = e−s+1 > ℓ;
- repetition: ⌊L/ℓ⌋ ≥ 2;  mature: ⌊L/ℓ⌋ ≥ 3 and L ≥ 30;
- terminal loop: a mature repetition that reaches the last token (e = n−1);
- copy token c_t = x_{t−ℓ}; first copy: positions s+ℓ..s+2ℓ−1; exit mass 1 − p_{t,copy}.
- copy positions (all of them): s+ℓ..e, the tokens that continue a repeated segment; every other
  response position is a non-copy position (DERIVED: the split of R into these two sets is this
  project's, to tell a student that is sharper than its teacher everywhere from one that is
  sharper inside loops).

Detector (DERIVED: the paper defines the segments, not how to find them): for each ℓ, a maximal
run [a, b] of x_t = x_{t−ℓ} gives s = a−ℓ, e = b. Overlaps are resolved toward the smallest
(primitive) period: a segment of period ℓ' lying inside a kept segment of a smaller period ℓ is
dropped. (Inside an ℓ-repetition every multiple kℓ yields a segment within [s, e], never beyond
it; a longer-period loop that merely contains a short inner repetition is kept, as a distinct
repetition.)
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

MIN_PERIOD, MAX_PERIOD = 2, 50
MATURE_COPIES, MATURE_LENGTH = 3, 30


def periodic_segments(tokens: Sequence[int], period: int) -> list[tuple[int, int]]:
    """Maximal periodic segments (s, e) of one period: runs [a, b] of x_t = x_{t−ℓ} → (a−ℓ, b)."""
    x = np.asarray(tokens)
    if len(x) <= period:
        return []
    eq = np.concatenate([[False], x[period:] == x[:-period], [False]])
    edges = np.flatnonzero(np.diff(eq.astype(np.int8)))
    starts, ends = edges[::2], edges[1::2] - 1  # run [a, b] in eq-index; t = index − 1 + ℓ
    return [(int(a), int(b) + period) for a, b in zip(starts, ends)]


def is_repetition(length: int, period: int) -> bool:
    """⌊L/ℓ⌋ ≥ 2."""
    return length // period >= 2


def is_mature(length: int, period: int) -> bool:
    """⌊L/ℓ⌋ ≥ 3 and L ≥ 30."""
    return length // period >= MATURE_COPIES and length >= MATURE_LENGTH


def repetitions(
    tokens: Sequence[int], min_period: int = MIN_PERIOD, max_period: int = MAX_PERIOD
) -> list[dict]:
    """All repetitions, primitive periods only, sorted by start: dicts with period, start, end,
    length, copies (⌊L/ℓ⌋), mature and terminal."""
    n = len(tokens)
    x = np.asarray(tokens)
    kept: list[dict] = []
    # a repetition has L ≥ 2ℓ and L ≤ n: no period above n // 2 can hold one
    for period in range(min_period, min(max_period, n // 2) + 1):
        for s, e in periodic_segments(x, period):
            length = e - s + 1
            if not is_repetition(length, period):
                continue
            if any(k["start"] <= s and e <= k["end"] for k in kept):
                continue  # a multiple of a smaller kept period
            mature = is_mature(length, period)
            kept.append(
                dict(
                    period=period,
                    start=s,
                    end=e,
                    length=length,
                    copies=length // period,
                    mature=mature,
                    terminal=mature and e == n - 1,
                )
            )
    return sorted(kept, key=lambda k: (k["start"], k["period"]))


def copy_positions(segment: dict, tokens: Sequence[int], which: str = "first") -> list[int]:
    """Positions t with their copy token x_{t−ℓ}: 'first' = s+ℓ..s+2ℓ−1; 'pre_mature' = every
    copied position before the segment's prefix becomes mature (t < s + max(3ℓ, 30) − 1)."""
    s, e, ell = segment["start"], segment["end"], segment["period"]
    if which == "first":
        stop = s + 2 * ell - 1
    elif which == "pre_mature":
        stop = s + max(MATURE_COPIES * ell, MATURE_LENGTH) - 2
    else:
        raise ValueError(f"which must be 'first' or 'pre_mature', got {which!r}")
    return list(range(s + ell, min(stop, e) + 1))


def copy_mask(segments: Sequence[dict], n_tokens: int) -> list[bool]:
    """Per position of a response of `n_tokens` tokens: whether it continues a repeated segment
    (s+ℓ ≤ t ≤ e for some repetition in `segments`, where x_t = x_{t−ℓ} is the copy token)."""
    mask = np.zeros(n_tokens, dtype=bool)
    for seg in segments:
        mask[seg["start"] + seg["period"] : seg["end"] + 1] = True
    return mask.tolist()


def repetition_report(tokens: Sequence[int] | Tensor) -> dict:
    """Table 2 report of one response: its tokens, its repetitions, the copy positions/tokens for
    the exit-mass metrics (positions index `tokens`; copy token = tokens[t − ℓ]) and the copy
    mask of every position (`copy_mask`)."""
    if isinstance(tokens, Tensor):
        tokens = tokens.tolist()
    tokens = list(tokens)
    reps = repetitions(tokens)
    out = {
        "n_tokens": len(tokens),
        "tokens": tokens,
        "segments": reps,
        "has_repetition": bool(reps),
        "has_mature": any(r["mature"] for r in reps),
        "terminal_loop": any(r["terminal"] for r in reps),
        "copy_mask": copy_mask(reps, len(tokens)),
    }
    for which in ("first", "pre_mature"):
        pos = sorted(
            {(t, tokens[t - r["period"]]) for r in reps for t in copy_positions(r, tokens, which)}
        )
        out[f"{which}_copy_positions"] = [t for t, _ in pos]
        out[f"{which}_copy_tokens"] = [c for _, c in pos]
    return out


def copy_token_probs(
    probs_TxV: Tensor, positions: Sequence[int], copy_tokens: Sequence[int]
) -> Tensor:
    """p_{t, c_t} at the given positions: probs_TxV[t, c_t]."""
    return probs_TxV[torch.as_tensor(positions, dtype=torch.long), torch.as_tensor(copy_tokens)]


def exit_mass(
    p_copy: Tensor | Sequence[float],
    q_copy: Tensor | Sequence[float],
    p_active_mass: Tensor | Sequence[float] | None = None,
) -> dict[str, float]:
    """Exit mass at copy positions (OPSD Table 2): teacher Σ(1−p_copy), student Σ(1−q_copy), ratio
    R = Σ(1−q)/Σ(1−p), the fraction with q > p, and with P_A the reversed band p < q < p/P_A."""
    p = torch.as_tensor(p_copy, dtype=torch.float64)
    q = torch.as_tensor(q_copy, dtype=torch.float64)
    teacher, student = (1 - p).sum().item(), (1 - q).sum().item()
    n = max(p.numel(), 1)
    out = {
        "n": p.numel(),
        "teacher": teacher,
        "student": student,
        "ratio": student / teacher if teacher > 0 else float("nan"),
        "frac_student_above": (q > p).sum().item() / n,
    }
    if p_active_mass is not None:
        pa = torch.as_tensor(p_active_mass, dtype=torch.float64)
        out["frac_reversed_band"] = ((p < q) & (q < p / pa)).sum().item() / n
    return out


def exit_mass_split(
    p_token: Tensor | Sequence[float],
    q_token: Tensor | Sequence[float],
    copy: Tensor | Sequence[bool],
) -> dict[str, dict[str, float]]:
    """`exit_mass` at copy and at non-copy positions: p_token, q_token are the teacher's and the
    student's probability of the response's own token at each position (at a copy position that
    token is the copy token x_{t−ℓ}, so the copy half is Table 2's exit mass over every
    continuing position, not only the first copy), `copy` the positions' `copy_mask`. Returns
    {"copy": ..., "noncopy": ...}; each ratio R = Σ(1−q)/Σ(1−p) over its positions (nan when
    they hold no teacher exit mass, e.g. none). R_copy < R_noncopy: relative to its teacher, the
    student leaves a repetition less readily than it leaves its other sampled tokens."""
    p = torch.as_tensor(p_token, dtype=torch.float64)
    q = torch.as_tensor(q_token, dtype=torch.float64)
    c = torch.as_tensor(copy, dtype=torch.bool)
    return {"copy": exit_mass(p[c], q[c]), "noncopy": exit_mass(p[~c], q[~c])}


def repetition_reports(response_ids: Tensor, response_mask: Tensor) -> list[dict]:
    """`repetition_report` of every response row (its tokens up to and including EOS)."""
    return [
        repetition_report(row[: int(n)].tolist())
        for row, n in zip(response_ids, response_mask.sum(1))
    ]


PLACES = {"eos": 1, "loop": 2}  # TokenBatch.place codes; 0: every other response token


def token_places(response_ids: Tensor, response_mask: Tensor, budget: int) -> Tensor:
    """[B, T] place of each response token: "eos", the last token of a response that stopped
    before the token budget (only EOS stops one early); "loop", the first copy s+ℓ..s+2ℓ−1 of
    a terminal loop (where the policy first repeats instead of going on); 0 elsewhere."""
    place = torch.zeros_like(response_ids, dtype=torch.long)
    for i, (row, n) in enumerate(zip(response_ids, response_mask.sum(1).long().tolist())):
        tokens = row[:n].tolist()
        for seg in repetitions(tokens):
            if seg["terminal"]:
                place[i, copy_positions(seg, tokens, "first")] = PLACES["loop"]
        if 0 < n < budget:
            place[i, n - 1] = PLACES["eos"]
    return place
