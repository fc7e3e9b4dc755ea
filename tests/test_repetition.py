"""Repetition detector (OPSD Table 2): hand-built sequences, expected reports worked out by hand."""

import math

import numpy as np
import pytest
import torch

from harness.stats.repetition import (
    MAX_PERIOD,
    MIN_PERIOD,
    copy_mask,
    copy_positions,
    copy_token_probs,
    exit_mass,
    exit_mass_split,
    periodic_segments,
    repetition_report,
    repetitions,
)


def spans(report):
    return [(r["period"], r["start"], r["end"]) for r in report["segments"]]


def test_no_repetition():
    r = repetition_report(list(range(40)))
    assert r["segments"] == [] and not r["has_repetition"] and not r["terminal_loop"]
    assert r["first_copy_positions"] == [] and r["n_tokens"] == 40


def test_periodic_segment_runs_give_start_and_end():
    # x = 9 1 2 3 1 2 3 7: x_t = x_{t-3} for t = 4, 5, 6 -> run [4, 6] -> s = 1, e = 6
    assert periodic_segments([9, 1, 2, 3, 1, 2, 3, 7], 3) == [(1, 6)]
    assert periodic_segments([1, 2], 3) == []


def test_two_full_periods_is_a_repetition_but_not_mature():
    # 9 | 1 2 3 1 2 3 | 7: period 3, L = 6, floor(6/3) = 2 -> repetition; < 3 copies, < 30 tokens
    r = repetition_report([9, 1, 2, 3, 1, 2, 3, 7])
    assert spans(r) == [(3, 1, 6)]
    seg = r["segments"][0]
    assert seg["copies"] == 2 and not seg["mature"] and not seg["terminal"]
    # first copy: s+l .. s+2l-1 = 4, 5, 6; copy tokens x_{t-3} = 1, 2, 3
    assert r["first_copy_positions"] == [4, 5, 6] and r["first_copy_tokens"] == [1, 2, 3]


def test_less_than_two_full_periods_is_not_a_repetition():
    # 1 2 3 1 2: a periodic segment (L = 5 > 3) but floor(5/3) = 1
    assert periodic_segments([1, 2, 3, 1, 2], 3) == [(0, 4)]
    assert repetition_report([1, 2, 3, 1, 2])["segments"] == []


def test_mature_needs_30_tokens():
    # (1 2) x 10: L = 20 copies 10 but L < 30 -> not mature; (1 2) x 15: L = 30 -> mature
    assert not repetition_report([1, 2] * 10)["has_mature"]
    r = repetition_report([1, 2] * 15)
    assert spans(r) == [(2, 0, 29)] and r["has_mature"] and r["terminal_loop"]


def test_mature_needs_three_periods():
    # 15 distinct tokens twice: L = 30 but floor(30/15) = 2 -> repetition only
    r = repetition_report(list(range(100, 115)) * 2)
    assert spans(r) == [(15, 0, 29)] and not r["has_mature"]
    # 10 distinct tokens three times: L = 30, floor(30/10) = 3 -> mature
    assert repetition_report(list(range(10)) * 3)["has_mature"]


def test_terminal_loop_and_loop_stopping_one_token_before_the_end():
    # 50 51 | (1 2 3) x 10: period 3, s = 2, e = 31 = n-1 -> terminal loop
    loop = [50, 51] + [1, 2, 3] * 10
    r = repetition_report(loop)
    assert spans(r) == [(3, 2, 31)] and r["terminal_loop"]
    # one extra token 99 (99 != x_{t-3} = 1): e = 31 = n-2 -> mature, not terminal
    r = repetition_report(loop + [99])
    assert spans(r) == [(3, 2, 31)] and r["has_mature"] and not r["terminal_loop"]


def test_period_bounds():
    # l = 1 is excluded: (7) x 40 is reported with period 2 (L = 40, 20 copies)
    assert spans(repetition_report([7] * 40)) == [(2, 0, 39)]
    assert spans(repetition_report(list(range(50)) * 2)) == [(50, 0, 99)]
    assert repetition_report(list(range(51)) * 3)["segments"] == []  # l = 51 > 50


def test_overlapping_multiples_keep_the_primitive_period():
    # (1 2) x 10 is also periodic with l = 4, 6, ..., 18 over subsets of [0, 19]: keep only l = 2
    assert spans(repetition_report([1, 2] * 10)) == [(2, 0, 19)]
    # (1 2 3) x 4 + 9: l = 3 gives [0, 11]; l = 6 gives [0, 11] as well -> dropped
    assert spans(repetition_report([1, 2, 3] * 4 + [9])) == [(3, 0, 11)]


def test_long_loop_containing_a_short_repetition_keeps_both():
    # unit 1 2 1 2 3 4 5 6 (l = 8) four times: one l = 8 loop over [0, 31] (L = 32, 4 copies,
    # mature, terminal); inside each unit the l = 2 repetition 1 2 1 2 at [8k, 8k+3];
    # l = 16, 24 segments lie inside [0, 31] -> dropped
    unit = [1, 2, 1, 2, 3, 4, 5, 6]
    r = repetition_report(unit * 4)
    assert spans(r) == [(2, 0, 3), (8, 0, 31), (2, 8, 11), (2, 16, 19), (2, 24, 27)]
    loop = r["segments"][1]
    assert loop["copies"] == 4 and loop["mature"] and loop["terminal"]
    assert r["terminal_loop"]


def test_first_copy_and_pre_mature_positions():
    # (1 2) x 15: first copy = 2, 3 (tokens 1, 2); mature once L >= max(3*2, 30) = 30, i.e. at
    # t = 29, so pre-maturity copied positions are t = 2 .. 28
    r = repetition_report(torch.tensor([1, 2] * 15))
    assert r["first_copy_positions"] == [2, 3] and r["first_copy_tokens"] == [1, 2]
    assert r["pre_mature_copy_positions"] == list(range(2, 29))
    assert r["pre_mature_copy_tokens"] == [1, 2] * 13 + [1]
    with pytest.raises(ValueError, match="first"):
        copy_positions(r["segments"][0], [1, 2] * 15, "last")


def test_copy_token_probs_gathers_p_t_copy():
    probs = torch.tensor([[0.1, 0.9, 0.0], [0.5, 0.2, 0.3], [0.6, 0.3, 0.1]])
    assert copy_token_probs(probs, [1, 2], [2, 0]).tolist() == pytest.approx([0.3, 0.6])


def test_exit_mass():
    # teacher exit 0.1 + 0.5 = 0.6; student 0.2 + 0.25 = 0.45; R = 0.75; q > p only at t = 2
    out = exit_mass([0.9, 0.5], [0.8, 0.75], p_active_mass=[0.5, 0.6])
    assert out["teacher"] == pytest.approx(0.6) and out["student"] == pytest.approx(0.45)
    assert out["ratio"] == pytest.approx(0.75) and out["frac_student_above"] == 0.5
    # reversed band p < q < p/P_A: t = 2 has 0.5 < 0.75 < 0.833 -> 1 of 2
    assert out["frac_reversed_band"] == 0.5
    assert exit_mass([0.9, 0.5], [0.8, 0.75], p_active_mass=[0.5, 0.8])["frac_reversed_band"] == 0


def test_random_responses_match_a_naive_all_periods_scan():
    """Random token strings (small alphabet, planted loops): the detector equals a naive scan
    of every period 2..50 that checks the definition position by position."""
    import random

    def naive(x):
        n, kept = len(x), []
        for ell in range(MIN_PERIOD, MAX_PERIOD + 1):
            t = ell
            while t < n:
                if x[t] != x[t - ell]:
                    t += 1
                    continue
                a = t
                while t < n and x[t] == x[t - ell]:
                    t += 1
                s, e = a - ell, t - 1
                L = e - s + 1
                if L // ell >= 2 and not any(k[1] <= s and e <= k[2] for k in kept):
                    kept.append((ell, s, e))
        return sorted(kept, key=lambda k: (k[1], k[0]))

    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(0, 120)
        x = [rng.randint(0, 3) for _ in range(n)]
        if n > 20 and rng.random() < 0.5:  # plant a loop
            ell = rng.randint(2, 12)
            i = rng.randint(0, n - 1)
            for t in range(i + ell, min(n, i + ell * rng.randint(2, 6))):
                x[t] = x[t - ell]
        got = [(r["period"], r["start"], r["end"]) for r in repetitions(x)]
        assert got == naive(x), x


# 5 | 1 2 3 1 2 3 1 2 | 9: period 3, x_t = x_{t-3} for t = 4..8 -> s = 1, e = 8 (L = 8, 2
# copies): copy positions 4..8, non-copy 0..3 and 9. Probability of each position's own token:
SPLIT_TOKENS = [5, 1, 2, 3, 1, 2, 3, 1, 2, 9]
SPLIT_P = [0.5, 0.8, 0.8, 0.8, 0.6, 0.6, 0.6, 0.6, 0.6, 0.5]  # teacher
SPLIT_Q = [0.5, 0.8, 0.8, 0.8, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9]  # student


def test_copy_mask_and_exit_mass_split_by_hand():
    """Copy: teacher exit 5 × 0.4 = 2.0, student 5 × 0.1 = 0.5, R = 0.25. Non-copy: teacher
    0.5 + 3 × 0.2 + 0.5 = 1.6, student 0.5 + 3 × 0.2 + 0.1 = 1.2, R = 0.75."""
    r = repetition_report(SPLIT_TOKENS)
    assert spans(r) == [(3, 1, 8)] and r["tokens"] == SPLIT_TOKENS
    assert r["copy_mask"] == [False] * 4 + [True] * 5 + [False]
    out = exit_mass_split(SPLIT_P, SPLIT_Q, r["copy_mask"])
    assert out["copy"]["n"] == 5 and out["noncopy"]["n"] == 5
    assert out["copy"]["teacher"] == pytest.approx(2.0)
    assert out["copy"]["student"] == pytest.approx(0.5)
    assert out["copy"]["ratio"] == pytest.approx(0.25)
    assert out["noncopy"]["teacher"] == pytest.approx(1.6)
    assert out["noncopy"]["student"] == pytest.approx(1.2)
    assert out["noncopy"]["ratio"] == pytest.approx(0.75)
    assert repetition_report([1, 2, 3])["copy_mask"] == [False] * 3
    # overlapping segments (s, e, ℓ) = (0, 5, 2) and (4, 9, 2): positions 2..9, each once
    assert (
        copy_mask([{"start": 0, "end": 5, "period": 2}, {"start": 4, "end": 9, "period": 2}], 10)
        == [False, False] + [True] * 8
    )
    assert np.isnan(exit_mass_split([0.5], [0.5], [False])["copy"]["ratio"])  # no copy position


def _own_token_logits(tokens, probs, V):
    """Logits [T, V] giving each position's own token probability `probs[t]`, the other V − 1
    tokens an equal share of the rest."""
    z = torch.empty(len(tokens), V)
    for t, (x, a) in enumerate(zip(tokens, probs)):
        z[t] = math.log((1 - a) / (V - 1))
        z[t, x] = math.log(a)
    return z


def test_copy_split_metrics_through_micro_batches():
    """The OPSD step's metric (harness.objectives.opsd.CopyExitMass) on two rows: the example
    above and a 3-token response without repetition (p = q = 0.5 on each token, padded to 10).
    Copy R = 0.25; non-copy R = (1.2 + 1.5) / (1.6 + 1.5); first-copy R (positions 4..6) =
    0.3 / 1.2; the student's entropy at T = 1 with own-token probability a is
    H(a) = −a ln a − (1 − a) ln((1 − a)/(V − 1)). One micro-batch or two: the same numbers."""
    from harness.objectives.opsd import CopyExitMass

    V = 10
    short = [7, 8, 9]
    reports = [repetition_report(SPLIT_TOKENS), repetition_report(short)]
    pad = [0] * 7

    def logits(probs_long):  # the short row: 0.5 on each own token (and on the padding's)
        rows = [(SPLIT_TOKENS, probs_long), (short + pad, [0.5] * 10)]
        return torch.stack([_own_token_logits(x, a, V) for x, a in rows])

    s, t = logits(SPLIT_Q), logits(SPLIT_P)

    def H(a):
        return -a * math.log(a) - (1 - a) * math.log((1 - a) / (V - 1))

    metric = CopyExitMass(reports)
    whole = metric.reduce([metric.collect(s, t, [0, 1])])
    parts = metric.reduce([metric.collect(s[:1], t[:1], [0]), metric.collect(s[1:], t[1:], [1])])
    for m in (whole, parts):
        assert m["repetition/copy_exit_mass_ratio"] == pytest.approx(0.25)
        assert m["repetition/noncopy_exit_mass_ratio"] == pytest.approx(2.7 / 3.1)
        assert m["repetition/exit_mass_ratio"] == pytest.approx(0.3 / 1.2)
        assert m["repetition/copy_frac"] == pytest.approx(5 / 13)
        assert m["repetition/copy_entropy"] == pytest.approx(H(0.9), rel=1e-5)
        noncopy = [H(0.5), H(0.8), H(0.8), H(0.8), H(0.9)] + [H(0.5)] * 3
        assert m["repetition/noncopy_entropy"] == pytest.approx(np.mean(noncopy), rel=1e-5)
    # no repetition anywhere: no copy ratio (not a 0/0), the non-copy half still reported
    none = CopyExitMass([reports[1]])
    m = none.reduce([none.collect(s[1:], t[1:], [0])])
    assert "repetition/copy_exit_mass_ratio" not in m and "repetition/exit_mass_ratio" not in m
    assert m["repetition/noncopy_exit_mass_ratio"] == pytest.approx(1.0)
    assert m["repetition/copy_frac"] == 0
