"""Each figure script runs on a small synthetic results/ fixture (two runs) and writes PNG + PDF."""

import numpy as np
import pandas as pd
import pytest
from hydra import compose, initialize_config_dir

from analysis import common, layer_amplification, noise_anatomy, snr_table
from harness import measure
from harness.stats.diagnostics import bin_index
from harness.stats.snr import BinnedMoments, SNRSplit

CONFIG_DIR = str((measure.__file__.rsplit("/harness/", 1)[0]) + "/experiments")


def write_run(run, noise: str, sigma: float, seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = 20_000
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose("measure", overrides=[f"out={run}", f"noise={noise}", f"noise.sigma={sigma}"])
    split, truth = SNRSplit(), BinnedMoments(7, 2)
    for name in ("cal", "live"):
        conf = rng.beta(0.5, 0.3, n)
        gate = (1 - conf) ** 2 + 0.05 * (1 - conf)
        beta = rng.standard_t(4, n) * sigma * np.sqrt(gate)
        alpha = rng.normal(0, 0.5 * sigma, n) * (1 - conf) if name == "live" else 0 * beta
        kw = {"q": conf, "gate": gate, "seq": np.arange(n) // 50}
        if name == "cal":
            split.add_cal(beta, conf, **kw)
        else:
            split.add_live(alpha + beta, conf, **kw)
            truth.add(bin_index(conf, split.edges), np.stack([alpha, beta], 1))
    measure.write_report(run, measure.build_report(split, truth, cfg, {"alpha_label": "synthetic"}))
    L = 6
    amp = pd.concat(
        pd.DataFrame(
            {
                "layer": range(L),
                "rel": np.linspace(1, 0.8, L) * 1e-2,
                "rel_growth": np.linspace(1, 0.8, L),
                "abs_growth": 1.1 ** np.arange(L),
                "inject_at": where,
            }
        )
        for where in ("0", "embed")
    )
    amp.to_csv(run / "layer_amplification.csv", index=False)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("results")
    write_run(root / "logit", "logit", 0.1, 0)
    write_run(root / "layer", "layer", 1e-2, 1)
    return root


def test_load_runs_is_tidy(results):
    df = common.load_runs(results, "per_bin.csv")
    assert set(df.run) == {"logit", "layer"}
    assert df.label.str.contains("logit").any() and {"pass", "gate_pred"} <= set(df.columns)


@pytest.mark.parametrize("script", [noise_anatomy, snr_table, layer_amplification])
def test_figure_script_runs(results, script):
    png = script.main(results)
    assert png is not None and png.exists() and png.stat().st_size > 10_000
    assert png.with_suffix(".pdf").exists()


def test_figure_scripts_skip_empty_root(tmp_path):
    assert all(m.main(tmp_path) is None for m in (noise_anatomy, snr_table, layer_amplification))


def test_coverage_counts_runs_whose_interval_holds_the_truth():
    truth = pd.DataFrame(
        {
            "run": ["a", "b", "c", "a", "b", "c"],
            "bin_lo": [0, 0, 0, 0.5, 0.5, 0.5],
            "bin_hi": [0.5] * 3 + [1.0] * 3,
            "n_live": [10, 20, 30, 5, 5, 5],
            "snr_covered": [1.0, 0.0, 1.0, np.nan, 1.0, 1.0],
        }
    )
    cov = snr_table.coverage(truth)
    assert cov.snr_coverage.tolist() == [pytest.approx(2 / 3), 1.0]
    assert cov.snr_runs.tolist() == [3, 2] and cov.n_live_median.tolist() == [20, 5]


def test_real_engine_comparison_table_and_figure(results, tmp_path):
    from analysis import real_engine_beta

    other = tmp_path / "measure"
    write_run(other, "logit", 0.3, 2)
    png = real_engine_beta.main([str(results), "--compare", str(other)])
    assert png.exists() and png.stat().st_size > 10_000
    table = pd.read_csv(results / "comparison.csv")
    assert len(table) == 3
    t3 = pd.read_csv(other / "table3.csv").set_index("stat").value
    row = table[table.run == str(other.resolve())].iloc[0]  # outside the repository: absolute
    assert row["median/mean"] == pytest.approx(t3["median"] / t3["mean"], rel=1e-3)
    assert (table.logit_disp_range > 0).all()


def test_source_label_names_the_precisions_of_a_run_that_injects_nothing():
    from analysis.real_engine_beta import source_label

    assert source_label("none", {"sampler_dtype": "fp32", "trainer_dtype": "fp32"}) == "none"
    assert source_label("none", {}) == "none"  # runs written before the dtypes were recorded
    s = {"sampler_dtype": "bf16", "trainer_dtype": "fp32"}
    assert source_label("none", s) == "none, μ bf16 / π fp32"
