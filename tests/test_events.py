"""In-kind events on hand-made trajectories: the step each fires at is worked out by hand."""

import numpy as np
import pandas as pd
import pytest

from analysis.events import (
    collapse,
    entropy_guard,
    escalation,
    guard_or_collapse,
    healthy_rise,
    healthy_surge,
    kl_reversal,
    loops,
    margins,
    run_events,
    stall,
    surge,
)


def _run(**cols) -> pd.DataFrame:
    n = len(next(iter(cols.values())))
    return pd.DataFrame({"step": np.arange(1, n + 1), **cols})


def test_surge_fires_when_the_running_mean_reaches_twice_the_first_ten_steps():
    """Entropy 1.0 for steps 1–10, then 3.0: the 10-step running mean at step 10 + k is
    (10 − k + 3k)/10 = 1 + 0.2k ≥ 2 first at k = 5 (step 15); a single spike is no surge."""
    ent = [1.0] * 10 + [3.0] * 20
    assert surge(_run(entropy_mean=ent)) == (True, 15.0)
    spike = [1.0] * 10 + [5.0] + [1.0] * 19  # running mean 1.4 at most
    assert surge(_run(entropy_mean=spike))[0] is False
    assert entropy_guard(_run(entropy_mean=spike)) == (True, 11.0)  # the guard sees the spike
    assert entropy_guard(_run(entropy_mean=[1.0] * 30))[0] is False


def test_a_healthy_surge_needs_the_reward_to_rise_before_the_surge_by_hand():
    """Entropy as in the surge test (surge at step 15). Reward 0.30 for steps 1–10: with 0.36
    from step 11 on, the running mean at step 14 is (6·0.30 + 4·0.36)/10 = 0.324, a rise of
    0.024 < 0.05: no healthy phase; with 0.50 from step 11 on, (6·0.30 + 4·0.50)/10 = 0.38 at
    step 14 (rise 0.08 ≥ 0.05): a healthy surge at step 15. A rise only after the surge (0.50
    from step 16) does not count."""
    ent = [1.0] * 10 + [3.0] * 30
    flat = [0.30] * 10 + [0.36] * 30
    rising = [0.30] * 10 + [0.50] * 30
    late = [0.30] * 15 + [0.50] * 25
    assert healthy_rise(_run(reward_mean=flat, entropy_mean=ent), until=15) == pytest.approx(0.024)
    assert healthy_surge(_run(reward_mean=flat, entropy_mean=ent))[0] is False
    assert healthy_surge(_run(reward_mean=rising, entropy_mean=ent)) == (True, 15.0)
    assert healthy_surge(_run(reward_mean=late, entropy_mean=ent))[0] is False
    assert healthy_surge(_run(reward_mean=rising, entropy_mean=[1.0] * 40))[0] is False


def test_a_stall_is_a_run_whose_reward_never_rose_by_hand():
    """Reward 0.30 for steps 1–10 then 0.34 for 30 steps: the running mean tops out at 0.34, a
    rise of 0.04 < 0.05: a stall, dated at the last step (40). With 0.36 from step 11 the top
    is 0.36, a rise of 0.06: no stall. A rise that comes and goes still counts as training (0.50
    for steps 11–20, then 0.20: the running mean reached 0.50). Fewer than 10 steps: no verdict."""
    assert stall(_run(reward_mean=[0.30] * 10 + [0.34] * 30)) == (True, 40.0)
    assert stall(_run(reward_mean=[0.30] * 10 + [0.36] * 30))[0] is False
    assert stall(_run(reward_mean=[0.30] * 10 + [0.50] * 10 + [0.20] * 20))[0] is False
    assert stall(_run(reward_mean=[0.30] * 5))[0] is False


def test_collapse_needs_the_fall_to_last_until_the_end():
    """Reward 0.4 for 40 steps, then 0.1: the running mean (best 0.4) first drops below 0.2 at
    step 40 + k with (10 − k)·0.4 + 0.1k < 2, i.e. k > 20/3: step 47; with a recovery to 0.4
    at the end it is no collapse; a drop inside the warm-up does not count."""
    r = [0.4] * 40 + [0.1] * 20
    assert collapse(_run(reward_mean=r), warmup=20) == (True, 47.0)
    back = [0.4] * 40 + [0.1] * 20 + [0.4] * 20
    assert collapse(_run(reward_mean=back), warmup=20)[0] is False
    early = [0.4] * 5 + [0.1] * 55  # the best 10-step mean after step 20 is 0.1
    assert collapse(_run(reward_mean=early), warmup=20)[0] is False


def test_guard_or_collapse_is_the_earlier_of_the_two_by_hand():
    """The collapse test's reward (collapse at step 47) with a flat entropy: the event at 47;
    with an entropy spike at step 30 as well (the guard fires there): at 30; a spike alone: at
    the spike; neither: no event. Through run_events, with the warm-up the prereg passes."""
    r = [0.4] * 40 + [0.1] * 20
    flat = [1.0] * 60
    spike = [1.0] * 29 + [3.0] + [1.0] * 30
    assert guard_or_collapse(_run(reward_mean=r, entropy_mean=flat)) == (True, 47.0)
    assert guard_or_collapse(_run(reward_mean=r, entropy_mean=spike)) == (True, 30.0)
    assert guard_or_collapse(_run(reward_mean=[0.4] * 60, entropy_mean=spike)) == (True, 30.0)
    assert guard_or_collapse(_run(reward_mean=[0.4] * 60, entropy_mean=flat))[0] is False
    df = _run(reward_mean=r, entropy_mean=flat).assign(run="a", arm="x", seed=0)
    assert run_events(df).loc[0, ["guard_or_collapse", "guard_or_collapse_at"]].tolist() == [
        1.0,
        47.0,
    ]


def test_kl_reversal_compares_the_tail_with_the_first_ten_steps_by_hand():
    """opsd_fkl 0.04 for steps 1–10, then 0.06 to step 40, then 0.08 for steps 41–50: the last
    20% (steps 41–50) over the first 10 is 0.08/0.04 = 2 ≥ 1.25, an event; 0.045 there is
    1.125, none; a falling KL (0.03) none. Through run_events, the column's absence gives NaN."""
    rising = [0.04] * 10 + [0.06] * 30 + [0.08] * 10
    assert kl_reversal(_run(opsd_fkl=rising)) == (True, pytest.approx(2.0))
    assert kl_reversal(_run(opsd_fkl=[0.04] * 40 + [0.045] * 10)) == (False, pytest.approx(1.125))
    assert kl_reversal(_run(opsd_fkl=[0.04] * 40 + [0.03] * 10))[0] is False
    df = _run(opsd_fkl=rising).assign(run="a", arm="x", seed=0)
    assert run_events(df).loc[0, "kl_reversal"] == 1.0
    assert np.isnan(run_events(df.drop(columns="opsd_fkl")).loc[0, "kl_reversal"])


def test_escalation_slope_and_fold_by_hand():
    """mask_frac = 0.01·step over 100 steps: slope 1.0 per 100 steps; quarters 1–25 and 76–100
    have means 0.13 and 0.88: fold 0.88/0.13."""
    run = _run(mask_frac=0.01 * np.arange(1, 101))
    slope, fold = escalation(run, "mask_frac")
    assert slope == pytest.approx(1.0) and fold == pytest.approx(0.88 / 0.13)
    assert escalation(_run(mask_frac=[0.05] * 40), "mask_frac") == pytest.approx((0.0, 1.0))


def test_loops_reads_the_last_fifth_of_the_steps():
    """100 steps, loops only in steps 50–60: none in steps 81–100; loops in 91–100 at rate
    0.5: mean over the last 20 steps 0.25."""
    rate = np.zeros(100)
    rate[49:60] = 1.0
    assert loops(_run(repetition_terminal_loop_rate=rate)) == (False, 0.0)
    rate[90:] = 0.5
    assert loops(_run(repetition_terminal_loop_rate=rate)) == (True, 0.25)


def test_run_events_one_row_per_run_and_nan_for_metrics_a_run_did_not_log():
    a = _run(entropy_mean=[1.0] * 10 + [3.0] * 20, reward_mean=[0.3] * 30)
    b = _run(entropy_mean=[1.0] * 30, reward_mean=[0.3] * 30)
    df = pd.concat([a.assign(run="a", arm="x", seed=0), b.assign(run="b", arm="y", seed=0)])
    ev = run_events(df).set_index("run")
    assert ev.loc["a", "surge"] == 1.0 and ev.loc["a", "surge_at"] == 15.0
    assert ev.loc["b", "surge"] == 0.0 and np.isnan(ev.loc["b", "surge_at"])
    assert np.isnan(ev.loc["a", "loops"])  # no repetition column in these runs


def test_margins_say_how_close_a_run_came_by_hand():
    """Entropy 1.0 for steps 1–10, 1.5 for 40, then 1.2: the running mean peaks at 1.5 → 1.5×
    (surge needs 2×). Reward 0.4 for 40 steps, 0.3 for 20, 0.36 for 20: running mean best 0.4,
    deepest 0.3 (0.75× the best), final 0.36 (0.9×)."""
    ent = [1.0] * 10 + [1.5] * 40 + [1.2] * 30
    rew = [0.4] * 40 + [0.3] * 20 + [0.36] * 20
    m = margins(_run(entropy_mean=ent, reward_mean=rew))
    assert m == pytest.approx({"entropy_peak": 1.5, "reward_final": 0.9, "reward_trough": 0.75})
    assert np.isnan(margins(_run(entropy_mean=ent))["reward_final"])


def test_how_close_table_one_row_per_run_with_events_margins_and_escalation():
    """Two runs of a dose: σ 1 surges at step 15 (entropy 1 → 3) with its deleted mass 0.01·step
    (slope 1.0 per 100 steps); σ 0.5 stays flat (peak 1×, no mechanism logged)."""
    from analysis.how_close import markdown, table

    n = 100
    late = [np.nan] * (n - 1)
    hot = _run(
        entropy_mean=[1.0] * 10 + [3.0] * (n - 10),
        reward_mean=[0.3] * n,
        mask_frac=0.01 * np.arange(1, n + 1),
        eval_acc=late + [0.2],
    )
    flat = _run(
        entropy_mean=[1.0] * n,
        reward_mean=[0.3] * n,
        mask_frac=[0.0] * n,
        eval_acc=[0.25] + late[1:] + [0.3],
    )
    df = pd.concat(
        [
            hot.assign(run="h", arm="reject", seed=0, sigma=1.0),
            flat.assign(run="f", arm="reject", seed=0, sigma=0.5),
        ]
    )
    t = table(df).set_index("sigma")
    assert t.loc[1.0, "surge"] == "step 15" and t.loc[0.5, "surge"] == "—"
    assert t.loc[1.0, "entropy_peak"] == 3.0 and t.loc[0.5, "entropy_peak"] == 1.0
    assert t.loc[1.0, "slope/100"] == pytest.approx(1.0) and t.loc[0.5, "mechanism"] == "none"
    assert t.loc[0.5, "eval first → last"] == "0.250 → 0.300"
    assert markdown(t.reset_index()).count("\n") == 3  # header, rule, 2 rows


def test_how_close_reports_loops_and_opsd_r_at_copy_positions_by_hand():
    """10 steps; the last 20% are steps 9 and 10. Loop rate 0.5 at step 3 only → tail rate 0,
    worst step 0.5. R copy 0.2 then 0.4 at steps 9, 10 → 0.30; non-copy 0.9 → 0.90; entropy copy
    1.0, non-copy 0.5 throughout."""
    from analysis.how_close import table

    n = 10
    run = _run(
        entropy_mean=[1.0] * n,
        reward_mean=[0.3] * n,
        repetition_terminal_loop_rate=[0, 0, 0.5] + [0] * 7,
        repetition_copy_exit_mass_ratio=[0.1] * 8 + [0.2, 0.4],
        repetition_noncopy_exit_mass_ratio=[0.9] * n,
        repetition_copy_entropy=[1.0] * n,
        repetition_noncopy_entropy=[0.5] * n,
    )
    row = table(run.assign(run="r", arm="clipped", seed=0)).iloc[0]
    assert row["loops (rate, last 20%)"] == "0.0000" and row["loops (max step)"] == "0.5000"
    assert row["R copy / non-copy (last 20%)"] == "0.30 / 0.90"
    assert row["entropy copy / non-copy"] == "1.00 / 0.50"
    grpo = run.assign(run="g", arm="grpo", seed=0, repetition_copy_exit_mass_ratio=np.nan)
    assert "R copy / non-copy (last 20%)" not in table(grpo)  # not logged: no column
