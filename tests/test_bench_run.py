"""benchmarks/bench_run.py: the comparison of two runs' metrics names the first step and metric
that differ (hand-worked rows), treats NaN as equal to NaN, and counts a missing metric or row."""

from __future__ import annotations

from benchmarks.bench_run import first_difference, step_times

NAN = float("nan")


def test_identical_runs_have_no_difference():
    a = [{"loss": 1.0, "kl": NAN}, {"loss": 2.0, "kl": 3.0}]
    assert first_difference(a, [dict(r) for r in a]) is None


def test_first_differing_step_and_metric():
    a = [{"loss": 1.0, "kl": NAN}, {"loss": 2.0, "kl": 3.0}, {"loss": 9.0, "kl": 9.0}]
    b = [{"loss": 1.0, "kl": NAN}, {"loss": 2.0, "kl": 3.5}, {"loss": 8.0, "kl": 9.0}]
    assert first_difference(a, b) == {"row": 1, "key": "kl", "before": 3.0, "after": 3.5}


def test_missing_metric_or_rows_count_as_differences():
    assert first_difference([{"x": 1}], [{"x": 1, "z": 2}]) == {
        "row": 0, "key": "z", "before": None, "after": 2,
    }  # fmt: skip
    assert first_difference([{"x": 1}] * 3, [{"x": 1}] * 2) == {
        "row": 2, "key": "(rows)", "before": 3, "after": 2,
    }  # fmt: skip


def test_step_times_skip_the_first_step(tmp_path):
    rows = [
        '{"time/rollout_s": 100, "time/update_s": 50, "time/step_s": 160}',  # evaluates
        '{"time/rollout_s": 20, "time/update_s": 10, "time/step_s": 31}',
        '{"time/rollout_s": 30, "time/update_s": 12, "time/step_s": 43}',
        '{"time/rollout_s": 22, "time/update_s": 11, "time/step_s": 35}',
    ]
    (tmp_path / "metrics.jsonl").write_text("\n".join(rows) + "\n")
    assert step_times(tmp_path) == {
        "time/rollout_s": 22.0, "time/update_s": 11.0, "time/step_s": 35.0,
    }  # fmt: skip
