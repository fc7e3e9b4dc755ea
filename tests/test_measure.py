import json
import subprocess
import sys
import time
from dataclasses import fields
from pathlib import Path

import pandas as pd
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException

from harness import measure
from harness.objectives import build_objective
from harness.rl.setup import rollout_sampling
from harness.runs.access import noise_nodes
from harness.runs.config import EngineCfg
from harness.stats.snr import TABLE6_COLUMNS

CONFIG_DIR = str((measure.__file__.rsplit("/harness/", 1)[0]) + "/experiments")
MEASURE = Path(CONFIG_DIR) / "measure"  # the presets: python -m harness.measure measure=<name>
FILES = ["table3.csv", "table6.csv", "table7.csv", "per_bin.csv", "truth.csv", "summary.json"]
FILES += ["abs_delta_hist.csv", "layer_amplification.csv", "tables.txt", "snr_shrink.json"]
TINY = ["model=tiny-llama", "rollout.group_size=2", "rollout.max_new_tokens=8"]
TINY += ["measurement.amp_rows=2"]
TINY += ["engine.device=cpu"]  # the CPU numbers these tests pin, also where a GPU is


def _cfg(tmp_path, *overrides):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return compose("measure", overrides=[f"out={tmp_path}", *overrides])


def test_default_config_is_fp8_block_w8a8_on_smollm2(tmp_path):
    cfg = _cfg(tmp_path)
    assert measure.model_spec(cfg) == "smollm2-135m"
    fp8 = {"name": "fp8", "granularity": "block", "activations": True}
    assert noise_nodes(cfg) == [fp8]
    assert noise_nodes(_cfg(tmp_path, "noise.kernel=scaled_mm")) == [{**fp8, "kernel": "scaled_mm"}]
    layer = noise_nodes(_cfg(tmp_path, "noise=layer"))  # replaced whole: no fp8 kwarg leaks
    assert measure.noise_label(layer) == "layer(sigma=0.002)"
    assert noise_nodes(_cfg(tmp_path, "noise=fp8")) == [
        {"name": "fp8"}
    ]  # the group file: builder defaults
    assert noise_nodes(_cfg(tmp_path, "noise=none")) == []
    stacked = noise_nodes(_cfg(tmp_path, "noise=logit", "extra_noise=[{name: layer, sigma: 0.01}]"))
    assert [n["name"] for n in stacked] == ["logit", "layer"]


def test_the_engine_node_is_harness_train_s(tmp_path):
    """μ's engine settings are EngineCfg's, typed: a misspelt key fails at composition."""
    cfg = _cfg(tmp_path, "engine.kv_cache=false", "engine.sampler_dtype=bf16")
    assert set(cfg.engine) == {f.name for f in fields(EngineCfg)}
    assert cfg.engine.kv_cache is False and cfg.engine.sampler_dtype == "bf16"
    for bad in ("engine.kv_cach=false", "n_samples=3", "live.step=3"):
        with pytest.raises(ConfigCompositionException):
            _cfg(tmp_path, bad)
    with pytest.raises(ConfigCompositionException):
        _cfg(tmp_path, "engine.kv_cache=maybe")


def test_the_nodes_shared_with_training_are_training_s(tmp_path):
    """One schema: `rollout`, `engine`, `model` and `optim` are harness.train's nodes (the same
    keys), the objective is the `objective` group's node, and the job's own keys live in `live`
    and `measurement`; the keys of earlier schemas (`n`, `alpha.*`, `amp_rows`, `kv_cache`,
    `sampler_noise`) are unknown, so a stale command fails at composition."""
    from harness.runs.config import OptimCfg, RolloutCfg

    cfg = _cfg(tmp_path, "rollout.group_size=3", "objective=cispo", "live.mode=none")
    assert set(cfg.rollout) == {f.name for f in fields(RolloutCfg)}
    assert set(cfg.optim) == {f.name for f in fields(OptimCfg)}
    assert cfg.rollout.group_size == 3 and cfg.objective.name == "cispo"
    assert rollout_sampling(cfg).n == 3
    for stale in (
        "n=2",
        "alpha.mode=none",
        "amp_rows=0",
        "kv_cache=false",
        "sampler_noise=[]",
        "rounds=2",
        "max_new_tokens=8",
    ):
        with pytest.raises(ConfigCompositionException):
            _cfg(tmp_path, stale)


def test_experiment_on_the_command_line_points_at_the_measure_group():
    measure.check_argv(["measure=snr_table", "noise=layer"])
    with pytest.raises(SystemExit, match="use measure=snr_table"):
        measure.check_argv(["-m", "experiment=snr_table"])


def test_presets_are_the_measure_group(tmp_path):
    presets = sorted(
        p.relative_to(MEASURE).with_suffix("").as_posix() for p in MEASURE.rglob("*.yaml")
    )
    assert presets == [
        "gpu/snr_table",
        "noise_anatomy",
        "precision_beta",
        "real_engine_beta",
        "real_engine_beta_vllm",
        "snr_table",
    ]
    for name in presets:
        assert not (MEASURE.parent / "experiment" / f"{name}.yaml").exists()
        text = (MEASURE / f"{name}.yaml").read_text()
        assert text.startswith("# @package _global_") and f"measure={name}" in text
        cfg = _cfg(tmp_path, f"measure={name}")
        assert cfg.name == name.removeprefix("gpu/")


def test_the_job_writes_data_and_prints_the_figure_commands(tmp_path):
    cmds = measure.figure_commands(tmp_path, "smollm2-135m")
    assert [c.split()[2] for c in cmds] == [
        "analysis.noise_anatomy",
        "analysis.snr_table",
        "analysis.layer_amplification",
        "analysis.real_engine_beta",
    ]
    assert len(measure.figure_commands(tmp_path, "tiny-llama")) == 3
    inside = measure.REAL_ENGINE / "engine.ct2.compute_type=float32"
    assert len(measure.figure_commands(inside, "smollm2-135m")) == 3  # drawn by real_engine_beta


def test_measure_tiny_no_noise_no_alpha_is_exact(tmp_path):
    """Same weights, same dtype, no noise, α ≡ 0: Δ ≡ 0 up to KV-cache vs recompute rounding."""
    s = measure.run(_cfg(tmp_path, *TINY, "noise=none", "live.mode=none"))
    assert s["table7"]["cal"]["max_abs_delta"] <= 1e-5
    assert s["table7"]["live"]["max_abs_delta"] <= 1e-5
    assert s["truth_max_abs_err"] == 0.0


def test_truth_check_catches_a_trainer_that_moved(tmp_path, monkeypatch):
    """A fault the algebra cannot see: the α step also moves the trainer (as shared weights
    would). α + β = Δ_live still holds per token, but α and β are read against the wrong θ_b:
    the pristine reference disagrees and the run stops."""
    models = []
    real_load, real_perturb = measure.load_model, measure.perturb_weights_

    def load(*a, **k):
        models.append(real_load(*a, **k)[0])
        return models[-1], real_load(*a, **k)[1]

    def perturb_both(model, rel_sigma, seed=0):
        real_perturb(models[0], rel_sigma, seed=seed + 1)  # the bug: the trainer moves too
        return real_perturb(model, rel_sigma, seed=seed)

    monkeypatch.setattr(measure, "load_model", load)
    monkeypatch.setattr(measure, "perturb_weights_", perturb_both)
    cfg = _cfg(tmp_path, *TINY, "noise=none", "live.mode=perturb", "live.rel_sigma=0.05")
    with pytest.raises(RuntimeError, match="ground truth check failed"):
        measure.run(cfg)


def test_measure_tiny_perturb_ground_truth(tmp_path):
    """Controlled α (weight perturbation) and β (layer noise): files, α + β = Δ_live, truth."""
    s = measure.run(
        _cfg(
            tmp_path,
            *TINY,
            "noise=layer",
            "noise.sigma=3e-2",
            "live.mode=perturb",
            "live.rel_sigma=0.05",
        )
    )
    for f in FILES:
        assert (tmp_path / f).exists(), f
    assert abs(s["identity_mean_ratio"]["cal"] - 1) < 0.05
    assert s["truth_max_abs_err"] < 1e-5  # α, β equal the pristine θ_b reference's
    assert 0.03 < s["alpha"]["rel_weight_change"] < 0.07
    t6 = pd.read_csv(tmp_path / "table6.csv")
    assert list(t6.columns[: len(TABLE6_COLUMNS)]) == TABLE6_COLUMNS
    truth = pd.read_csv(tmp_path / "truth.csv")
    full = truth[truth.n_live > 20]
    assert (full.var_alpha_true > 0).all() and (full.var_beta_true > 0).all()
    assert {"var_beta_lo", "var_beta_hi", "snr_lo", "snr_hi", "lam_lo", "lam_hi"} <= set(t6)
    ok = t6.var_beta_lo.notna()
    assert ok.any() and (t6.var_beta_lo[ok] <= t6.var_beta[ok]).all()
    assert (t6.var_beta[ok] <= t6.var_beta_hi[ok]).all()
    assert set(truth.snr_covered.dropna().unique()) <= {0.0, 1.0}
    kw = json.loads((tmp_path / "snr_shrink.json").read_text())
    build_objective("snr_shrink", **kw)  # Table 6 / Figure 2 feed the objective directly
    amp = pd.read_csv(tmp_path / "layer_amplification.csv")
    assert set(amp.inject_at.astype(str)) == {"0", "embed"}


def test_measure_moe_with_routing_replay(tmp_path):
    """No replay, R3 (μ's routes) and R2 (the trainer's own at θ_b) through the calibration and
    the live pass of a perturbed MoE. The truth check holds in each (α and β against the pristine
    θ_b replaying the same routes). R3 removes most of the calibration's β; R2's calibration is
    the no-replay one (at θ_b its own routes are what it chooses), and its live pass differs
    (the perturbed policy is held to θ_b's routes)."""
    tiny = [t for t in TINY if not t.startswith("model=")]
    base = ["model=tiny-moe", "noise=routing", "noise.sigma=0.5", "live.mode=perturb"]
    base.append("live.rel_sigma=0.05")
    arms = {
        "none": [],
        "r3": ["engine.routing_replay=true"],
        "r2": ["engine.routing_replay=true", "engine.routing_replay_source=trainer"],
    }
    out = {k: measure.run(_cfg(tmp_path / k, *tiny, *base, *v)) for k, v in arms.items()}
    assert all(s["truth_max_abs_err"] < 1e-5 for s in out.values())
    cal = {k: s["table7"]["cal"]["mean_abs_delta"] for k, s in out.items()}
    live = {k: s["table7"]["live"]["mean_abs_delta"] for k, s in out.items()}
    assert cal["r3"] < 0.5 * cal["none"]
    assert cal["r2"] == pytest.approx(cal["none"], rel=1e-6)
    assert live["r2"] != pytest.approx(live["none"], rel=1e-3)


def test_measure_tiny_steps_moves_weights(tmp_path, monkeypatch):
    """α by k = 2 ppo_clip steps: with mixed rewards the trainer moves; the tiny random model never
    answers, so the reward is patched to alternate within each prompt group."""
    monkeypatch.setattr(
        measure, "rewards", lambda tok, ro: (torch.arange(ro.response_ids.shape[0]) % 2).float()
    )
    s = measure.run(_cfg(tmp_path, *TINY, "live.mode=steps", "live.steps=2", "optim.lr=1e-3"))
    assert len(s["alpha"]["loss"]) == 2 and s["alpha"]["frac_nonzero_adv"] == 1.0
    assert s["alpha"]["rel_weight_change"] > 1e-4
    assert s["truth_max_abs_err"] < 1e-5


def test_measure_aborts_on_identity_failure(tmp_path):
    with pytest.raises(SystemExit, match="identity check failed"):
        measure.run(
            _cfg(tmp_path, *TINY, "noise=layer", "noise.sigma=0.1", "measurement.identity_tol=1e-9")
        )


@pytest.mark.slow
def test_measure_smollm2_fp8_default_small(tmp_path):
    """The default job (FP8 block W8A8, α by ppo_clip steps), shrunk: runs, writes the tables and
    the estimated-vs-true SNR table (values reported, not asserted); the commands it prints draw
    its figures, as `make demo` does."""
    s = measure.run(
        _cfg(
            tmp_path,
            "rollout.group_size=1",
            "rollout.max_new_tokens=16",
            "measurement.amp_rows=1",
            "measurement.amp_seeds=1",
        )
    )
    assert abs(s["identity_mean_ratio"]["cal"] - 1) < 0.05
    # FP8 block W8A8 on SmolLM2: mean |Δ| of 0.1–0.2 nats (the committed results/measure: 0.17)
    assert 0.02 < s["table3"]["mean"] < 0.5
    assert s["truth_max_abs_err"] < 1e-4
    truth = pd.read_csv(tmp_path / "truth.csv")
    assert {"snr_est", "snr_true"} <= set(truth.columns)
    assert not list(tmp_path.glob("*.png"))  # the job writes data only
    root = measure.__file__.rsplit("/harness/", 1)[0]
    for cmd in measure.figure_commands(tmp_path, "smollm2-135m"):
        subprocess.run([sys.executable, *cmd.split()[1:]], cwd=root, check=True)
    for f in (
        "fig1_noise_anatomy.png",
        "fig2_snr_table.png",
        "fig_layer_amplification.png",
        "fig_real_engine_beta.png",
    ):  # the last: this run beside the CTranslate2 runs
        assert (tmp_path / f).exists()
    sources = pd.read_csv(tmp_path / "comparison.csv").source
    assert sources.str.startswith("CTranslate2").sum() >= 2 and sources.str.startswith("fp8").any()


def test_measure_refuses_to_overwrite_committed_results(tmp_path):
    """`python -m harness.measure` with no out= would rewrite the committed results/measure/:
    it stops before loading any model (make demo passes force=true)."""
    root = measure.__file__.rsplit("/harness/", 1)[0]
    tracked = subprocess.run(["git", "ls-files", "results/measure"], cwd=root, capture_output=True)
    if not tracked.stdout.strip():
        pytest.skip("results/measure is not tracked by git here")
    t0 = time.time()
    r = subprocess.run(
        [sys.executable, "-m", "harness.measure"], cwd=root, capture_output=True, text=True
    )
    assert r.returncode != 0 and time.time() - t0 < 60
    assert "refusing to overwrite" in r.stderr and "force=true" in r.stderr


@pytest.mark.parametrize(
    "override, key",
    [
        ("engine.device=tpu", "engine.device"),
        ("engine.device=cuda:99", "engine.device"),
        ("engine.sampler_dtype=fp64", "engine.sampler_dtype"),
        ("engine.trainer_dtype=int8", "engine.trainer_dtype"),
        ("engine.sampler_attention=flash", "engine.sampler_attention"),
        ("engine.logp_old_source=sampler", "engine.logp_old_source"),
        ("live.mode=random", "live.mode"),
        ("rollout.prompts_per_step=17", "rollout.prompts_per_step"),
        ("engine.micro_batch_tokens=0", "engine.micro_batch_tokens"),
    ],
)
def test_device_and_dtype_errors_come_before_any_model_is_loaded(
    tmp_path, monkeypatch, override, key
):
    def no_load(*a, **k):
        raise AssertionError("a model was loaded before the config was checked")

    monkeypatch.setattr(measure, "load_model", no_load)
    with pytest.raises(ValueError, match=rf"{key}=.*valid"):
        measure.run(_cfg(tmp_path, *[t for t in TINY if "device" not in t], override))
