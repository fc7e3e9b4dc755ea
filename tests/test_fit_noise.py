"""harness.stats.fit_noise: the fit recovers the σ of injected logit noise (ground truth the harness
controls), writes a noise config that composes, and the check compares per bin."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import yaml
from test_measure import TINY
from test_measure import _cfg as measure_cfg

from harness import measure
from harness.stats import fit_noise
from harness.tasks.warmstart import SHIPPED

TASK_MODEL = str(SHIPPED / "1d46e5429706")  # the shipped countdown task model


def test_fit_is_the_weighted_least_squares_of_the_gate():
    s = np.sqrt(2 / np.pi) * np.array([0.9, 0.5, 0.1])
    bins = pd.DataFrame(
        {
            "bin_lo": [0, 0.3, 0.7],
            "bin_hi": [0.3, 0.7, 1.0],
            "n": [10, 30, 60],
            "mean_abs_delta": 0.2 * s,
            "gate_sqrt_mean": s / np.sqrt(2 / np.pi),
        }
    )
    sigma, table = fit_noise.fit_logit_sigma(bins)
    assert sigma == pytest.approx(0.2) and table.ratio.to_numpy() == pytest.approx(1.0)
    bins.loc[2, "mean_abs_delta"] *= 2  # by hand: Σ n m s / Σ n s²
    want = (bins.n * bins.mean_abs_delta * s).sum() / (bins.n * s * s).sum()
    assert fit_noise.fit_logit_sigma(bins)[0] == pytest.approx(want)


@pytest.mark.slow
def test_fit_recovers_injected_logit_noise_and_the_check_reads_one(tmp_path):
    """β = Gaussian logit noise σ = 0.05 in the HF sampler of the shipped countdown task model
    (its tokens spread over the confidence bins, unlike the tiny random model's): the fitted σ
    is within 15% of it; a measurement with the fitted noise reproduces the per-bin mean |Δ|
    (ratios ≈ 1) in every bin with enough tokens."""
    common = [
        *TINY,
        f"model.spec={TASK_MODEL}",
        "rollout.group_size=24",
        "live.mode=none",
        "measurement.amp_rows=0",
        "rollout.max_new_tokens=16",
    ]
    real = tmp_path / "real"
    measure.run(measure_cfg(real, *common, "noise=logit", "noise.sigma=0.05"))
    fit_noise.main(["fit", str(real), "--name", "fitted_test", "--out", str(tmp_path / "noise")])
    cfg = yaml.safe_load((tmp_path / "noise" / "fitted_test.yaml").read_text())
    assert cfg["name"] == "logit" and cfg["sigma"] == pytest.approx(0.05, rel=0.15)
    again = tmp_path / "again"
    measure.run(measure_cfg(again, *common, "noise=logit", f"noise.sigma={cfg['sigma']}", "seed=1"))
    fit_noise.main(["check", str(real), str(again)])
    q = pd.read_csv(again / "fit_quality.csv")
    big = q[q.n_real > 200]  # an independent sample (seed 1): per-bin means within ×1.5,
    assert len(big) >= 3 and big.ratio_mean_abs_delta.between(0.67, 1.5).all(), q
    assert np.median(big.ratio_mean_abs_delta) == pytest.approx(1.0, abs=0.1)  # typical ≈ 1
    assert json.loads((real / "summary.json").read_text())["weights_sha"] in (
        (tmp_path / "noise" / "fitted_test.yaml").read_text()
    )


def test_fit_refuses_a_folder_that_is_not_a_measurement(tmp_path):
    with pytest.raises(FileNotFoundError, match="per_bin.csv"):
        fit_noise.main(["fit", str(tmp_path)])
