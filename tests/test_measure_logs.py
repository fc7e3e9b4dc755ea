"""harness.measure.logs: the SNR procedure on per-token logs, checked on the dumps harness.measure
writes from its own run (measurement.dump_tokens=true), where the truth is known: its tables are
harness.measure's on the same tokens, and its per-bin SNR interval holds the true SNR."""

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from hydra import compose, initialize_config_dir

from harness import measure
from harness.measure import logs
from harness.stats.diagnostics import CONF_EDGES

CONFIG_DIR = str(Path(measure.__file__).resolve().parents[2] / "experiments")
# tiny-llama under logit noise σ = 0.3, α a relative weight perturbation of 0.3: ~1400 tokens a pass
RUN = ["model=tiny-llama", "rollout.group_size=4", "rollout.max_new_tokens=24"]
RUN += ["measurement.amp_rows=0", "engine.device=cpu", "noise=logit", "noise.sigma=0.3"]
RUN += ["live.mode=perturb", "live.rel_sigma=0.3", "measurement.dump_tokens=true"]
TABLES = ["table3.csv", "table6.csv", "table7.csv", "abs_delta_hist.csv", "snr_shrink.json"]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("measure")
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        measure.run(compose("measure", overrides=[f"out={out}", *RUN]))
    return out


def from_logs(run: Path, out: Path, *extra: str) -> dict:
    cal, live = run / "tokens_cal.parquet", run / "tokens_live.parquet"
    return logs.run(logs.parse([f"calibration={cal}", f"live={live}", f"out={out}", *extra]))


def test_the_tables_are_harness_measure_s_on_the_same_tokens(run, tmp_path):
    from_logs(run, tmp_path, "p_t=p_t", "gate=gate", "figures=false")
    for name in TABLES:
        assert (tmp_path / name).read_bytes() == (run / name).read_bytes(), name
    # per_bin too, but the gate's σ: the job knows its logit noise, the logs fit it
    a, b = (pd.read_csv(d / "per_bin.csv").drop(columns="gate_pred") for d in (run, tmp_path))
    pd.testing.assert_frame_equal(a, b)


def test_the_log_based_snr_interval_holds_the_true_snr(run, tmp_path):
    """The true per-bin SNR = Var α / Var β over the live tokens (a naive groupby of the dump's
    α and β columns); the interval is the one the logs give, p_t defaulting to exp(logp)."""
    from_logs(run, tmp_path)
    t6 = pd.read_csv(tmp_path / "table6.csv")
    live = pd.read_parquet(run / "tokens_live.parquet")
    b = np.clip(np.searchsorted(CONF_EDGES, live.p_t, side="right") - 1, 0, len(CONF_EDGES) - 2)
    true = live.groupby(b).alpha.var() / live.groupby(b).beta.var()
    n = live.groupby(b).size()
    checked = 0
    for k in true.index[n >= 100]:
        assert t6.snr_lo[k] <= true[k] <= t6.snr_hi[k], (k, t6.snr_lo[k], true[k], t6.snr_hi[k])
        checked += 1
    assert checked >= 1 and np.isfinite(t6.snr[true.index]).all()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["n_tokens"]["live"] == len(live)
    assert (tmp_path / "fig2_snr_table.png").exists() and (
        tmp_path / "fig1_noise_anatomy.png"
    ).exists()


def test_streaming_in_chunks_of_whole_sequences_keeps_the_moments(run, tmp_path, monkeypatch):
    from_logs(run, tmp_path / "one", "figures=false")
    monkeypatch.setattr(logs, "CHUNK_TOKENS", 40)
    from_logs(run, tmp_path / "chunks", "figures=false")
    a, b = (pd.read_csv(tmp_path / d / "table6.csv") for d in ("one", "chunks"))
    cols = ["n_cal", "n_live", "var_beta", "var_r", "var_alpha", "snr"]
    pd.testing.assert_frame_equal(a[cols], b[cols], rtol=1e-9)


def test_seq_chunks_by_hand():
    seq = np.array([0, 0, 1, 1, 1, 2, 3, 3])
    # sequences start at 0, 2, 5, 6; a new chunk at the first start in each block of 3 tokens
    assert logs.seq_chunks(seq, 3) == [slice(0, 5), slice(5, 6), slice(6, 8)]
    assert logs.seq_chunks(seq, 100) == [slice(0, 8)]


def test_a_missing_column_fails_before_compute_naming_it_and_the_valid_ones(tmp_path):
    good = pd.DataFrame({"seq": [0, 0, 1], "logp": [-1.0, -2.0, -0.5], "logp_mu": [-1.1, -2, -0.4]})
    good.to_parquet(tmp_path / "cal.parquet")
    good.drop(columns="logp_mu").to_json(tmp_path / "live.jsonl", orient="records", lines=True)
    out = tmp_path / "out"
    with pytest.raises(
        KeyError,
        match=r"live=.*live.jsonl: no column 'logp_mu' \(key logp_mu\); "
        r"its columns: 'seq', 'logp'; name the right one with logp_mu=<column>",
    ):
        logs.run(
            logs.parse(
                [
                    f"calibration={tmp_path / 'cal.parquet'}",
                    f"live={tmp_path / 'live.jsonl'}",
                    f"out={out}",
                ]
            )
        )
    with pytest.raises(KeyError, match="no column 'rollout_log_probs' .key logp_mu."):
        logs.run(
            logs.parse(
                [
                    f"calibration={tmp_path / 'cal.parquet'}",
                    f"live={tmp_path / 'cal.parquet'}",
                    "logp_mu=rollout_log_probs",
                ]
            )
        )
    assert not out.exists()
    with pytest.raises(ValueError, match="format '.csv'; valid: .parquet, .jsonl"):
        logs.file_columns(tmp_path / "x.csv")
    with pytest.raises(SystemExit, match="with a key in calibration, live, out, logp"):
        logs.parse(["calibraton=x.parquet"])
    good.assign(logp_mu=[-1.0, np.nan, -0.4]).to_parquet(tmp_path / "nan.parquet")
    cols = {"seq": "seq", "logp": "logp", "logp_mu": "logp_mu"}
    with pytest.raises(ValueError, match=r"'logp_mu' \(key logp_mu\) has 1 of 3 values not finite"):
        logs.read_tokens(tmp_path / "nan.parquet", cols)
