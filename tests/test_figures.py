"""Every training-figure script runs on a small synthetic results/ fixture (tmp dir), and
`analysis.summarize` turns raw run folders into the summary.csv those scripts read."""

from __future__ import annotations

import importlib
import json
import shutil

import numpy as np
import pandas as pd
import pytest
import yaml

from analysis.runs import METRICS, without_aa
from analysis.summarize import main as summarize

ARMS = {  # experiment -> arms as (objective, arm label)
    "collapse_reject_vs_clamp": [
        ("mis", "reject (mask [0.5, 2])"),
        ("cispo", "clamp (CISPO [0.5, 2])"),
    ],
    "fp8_entropy_surge": [("ppo_clip", "high precision"), ("ppo_clip", "FP8 (std clip)")],
    "nsr_vs_decay": [("nsr", "NSR"), ("ppo_clip", "hard clip")],
    "opsd_repetition": [
        ("opsd_fkl", "clipped FKL (τ = 0.05)"),
        ("opsd_fkl", "exact FKL (τ = none)"),
    ],
    "cis_vs_tis": [("cis", "CIS (λ = 2.3)"), ("tis", "TIS (C = 2)")],
    "collapse_drivers": [("band", "reject (band [0.5, 2])"), ("cispo", "clamp (CISPO [0.5, 2])")],
    "collapse_confirm": [("band", "reject (band [0.5, 2])"), ("cispo", "clamp (CISPO [0.5, 2])")],
    "surge_confirm": [
        ("ppo_clip", "π_old := μ (std clip)"),
        ("ppo_clip", "π_old recomputed (std clip)"),
    ],
    "fp8_full_pipeline": [
        ("calibrated_clip", "calibrated clip (every 5, EMA 0.5)"),
        ("ppo_clip", "std clip"),
    ],
}
COLS = [c.replace("/", "_") for c in METRICS]


def fake_summary(root, exp, runs, steps=12):
    rng = np.random.default_rng(0)
    rows = []
    for i, (obj, arm, sigma, k) in enumerate(runs):
        for seed in range(3):
            for s in range(1, steps + 1):
                m = dict(zip(COLS, rng.uniform(0, 0.5, len(COLS))))
                m["eval_acc"] = m["eval_acc"] if s % 4 == 0 or s == 1 else np.nan
                m["collapse_events"] = float(i == 0 and s > 8)
                rows.append(
                    {
                        "step": s,
                        **m,
                        "run": f"{i}-{seed}",
                        "arm": arm,
                        "seed": seed,
                        "objective": obj,
                        "sigma": sigma,
                        "staleness": k,
                        "lr": 1e-4,
                        "steps": steps,
                        "complete": True,
                    }
                )
    (root / exp).mkdir(parents=True)
    pd.DataFrame(rows).to_csv(root / exp / "summary.csv", index=False)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("results")
    for exp, arms in ARMS.items():
        fake_summary(root, exp, [(o, a, 0.5, 0) for o, a in arms])
    accuracy = {
        "name": "accuracy",
        "metric": "eval_acc",
        "reduce": "last_evals",
        "n": 2,
        "test": "paired_t",
        "predicted": "less",
    }
    prereg = {
        "claim": "c",
        "source": "s",
        "seeds": 3,
        "treatment": "reject (mask [0.5, 2])",
        "control": "clamp (CISPO [0.5, 2])",
        "endpoints": [accuracy],
    }
    (root / "collapse_reject_vs_clamp" / "prereg.yaml").write_text(yaml.safe_dump(prereg))
    arms = ("π_old := μ (std clip)", "π_old recomputed (std clip)")
    grid = [("ppo_clip", a, s, k) for a in arms for s in (0.0, 1.0) for k in (0, 2)]
    fake_summary(root, "phase_diagram", grid)
    fake_summary(root, "alpha_calibration", [("ppo_clip", "ppo_clip", 0.0, k) for k in (0, 2)])
    alpha = pd.read_csv(root / "alpha_calibration" / "summary.csv")
    alpha["minibatches"] = alpha.seed + 1  # seeds stand in for m = 1, 2, 3 here
    alpha.to_csv(root / "alpha_calibration" / "summary.csv", index=False)
    return root


def test_the_caption_quotes_each_arms_mechanism_check(tmp_path):
    from analysis.runs import mechanism_caption

    df = pd.DataFrame(
        {"run": ["r0", "r0"], "arm": ["A", "A"], "complete": [True, True], "mask_frac": [0.1, 0.3]}
    )
    (tmp_path / "x").mkdir()
    shown = {
        "run": "r0",
        "arm": "A",
        "trained": True,
        "oob_frac": 0.062,
        "fork_oob_share": 0.92,
        "forks_deleted": 0.28,
        "neg_low_clip": 0.15,
        "pos_high_clip": 0.056,
        "sampler_reward": 0.2,
    }
    left_out = {**shown, "run": "aa", "oob_frac": 0.5}  # a run the figure does not show
    pd.DataFrame([shown, left_out]).to_csv(tmp_path / "x" / "mechanism.csv", index=False)
    text = mechanism_caption(tmp_path, "x", df, ["A", "B"])
    assert text == (
        "A: step 0: 6.2% out of band, 92% of it on forks, 28% of forks outside; "
        "A<0 below 1−ε 15.0% vs A>0 above 1+ε 5.6%; μ reward 0.200; "
        "in run: 20.0% deleted"
    )
    no_signal = {**shown, "neg_low_clip": np.nan, "pos_high_clip": np.nan}  # no A < 0 token
    pd.DataFrame([no_signal]).to_csv(tmp_path / "x" / "mechanism.csv", index=False)
    assert "A<0 below 1−ε — vs A>0 above 1+ε —;" in mechanism_caption(tmp_path, "x", df, ["A"])
    mech = pd.read_csv(tmp_path / "x" / "mechanism.csv").assign(
        teacher_acc=0.9, student_acc=0.3, teacher_ref_logp=-0.01, student_ref_logp=-0.1
    )
    mech.to_csv(tmp_path / "x" / "mechanism.csv", index=False)
    assert "teacher acc 0.900 vs student 0.300, reference log-prob/token -0.010 vs -0.100" in (
        mechanism_caption(tmp_path, "x", df, ["A"])
    )


@pytest.mark.parametrize("exp", [*ARMS, "phase_diagram", "alpha_calibration"])
def test_figure_script_runs_on_fixture(exp, results):
    importlib.import_module(f"analysis.{exp}").main(["--results", str(results)])
    pngs = list((results / exp).glob("fig_*.png"))
    assert len(pngs) == 1 and pngs[0].stat().st_size > 10_000
    assert pngs[0].with_suffix(".pdf").exists()


def test_the_generic_figure_draws_any_registered_experiment_into_its_folder(tmp_path):
    """analysis.figure, run bare on a folder, draws each experiment there whose runs carry a
    prereg (here one no packaged preset names): accuracy, reward, entropy, then a panel for
    each other registered metric; a folder without prereg.yaml gets no figure."""
    from analysis import figure

    fake_summary(tmp_path, "mine", [("tis", "T", 0.5, 0), ("cis", "C", 0.5, 0)])
    fake_summary(tmp_path, "unregistered", [("tis", "T", 0.5, 0), ("cis", "C", 0.5, 0)])
    ess = {"name": "ess", "metric": "is_ess", "reduce": "window_mean", "window": [1, 12]}
    prereg = {"claim": "c", "source": "s", "seeds": 3, "treatment": "T", "control": "C"}
    prereg["endpoints"] = [{**ess, "predicted": "greater"}]
    (tmp_path / "mine" / "prereg.yaml").write_text(yaml.safe_dump(prereg))
    assert [c for c, *_ in figure.panels(prereg)] == [
        "eval_acc",
        "reward_mean",
        "entropy_mean",
        "is_ess",
    ]
    with pytest.warns(UserWarning, match="checksum"):  # the fixture names no weights
        figure.main(["--results", str(tmp_path)])
    assert (tmp_path / "mine" / "fig_mine.png").stat().st_size > 10_000
    assert not list((tmp_path / "unregistered").glob("fig_*"))


def test_a_named_pilot_gets_the_generic_figure_with_its_event_panels_and_no_test(tmp_path):
    """A named experiment without a prereg (a pilot) is drawn with the standard panels, then the
    loop rate and both clip shares, titled PILOT; no registered test is marked."""
    from analysis import figure, panels

    fake_summary(tmp_path, "pilot", [("tis", "T", 0.5, 0), ("cis", "C", 0.5, 0)])
    drawn = {}
    real = panels.panel_row

    def spy(df, cols, xlabel, title, root, exp, **kw):
        drawn.update(cols=[c for c, *_ in cols], title=title)
        return real(df, cols, xlabel, title, root, exp, **kw)

    with pytest.MonkeyPatch.context() as mp, pytest.warns(UserWarning, match="checksum"):
        mp.setattr(panels, "panel_row", spy)
        figure.main(["pilot", "--results", str(tmp_path)])
    assert drawn["cols"] == [
        "eval_acc",
        "reward_mean",
        "entropy_mean",
        "repetition_terminal_loop_rate",
        "clip_frac_low",
        "clip_frac_high",
    ]
    assert "PILOT" in drawn["title"]
    assert (tmp_path / "pilot" / "fig_pilot.png").stat().st_size > 10_000


def test_a_run_of_an_arm_its_preset_does_not_declare_fails_the_figure(tmp_path):
    """A figure draws the arms its preset declares (experiments/experiment/<exp>.yaml `arms`,
    in that order: the legend's and the colours'); a run whose arm the preset does not declare
    (an arm renamed after the runs) fails the figure, naming the arm, instead of vanishing."""
    fake_summary(
        tmp_path, "cis_vs_tis", [("tis", "TIS (cap 2)", 0.5, 0), ("cis", "CIS (λ = 2.3)", 0.5, 0)]
    )
    with pytest.raises(ValueError, match=r"'TIS \(cap 2\)'.*experiment/cis_vs_tis\.yaml"):
        importlib.import_module("analysis.cis_vs_tis").main(["--results", str(tmp_path)])
    from analysis.runs import figure_arms

    df = pd.read_csv(tmp_path / "cis_vs_tis" / "summary.csv").replace("TIS (cap 2)", "TIS (C = 2)")
    assert figure_arms("cis_vs_tis", df) == ["CIS (λ = 2.3)", "TIS (C = 2)"]


def _raw_run(root, name, cfg, steps_done=3, overrides=None, exp="nsr_vs_decay"):
    """A training run folder as harness.train writes it: config, mechanism check, metrics
    (reward 0.1·step), and Hydra's record of the command line's overrides."""
    run = root / exp / name
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    (run / "mechanism.json").write_text(json.dumps({"oob_frac": 0.1 * (cfg["seed"] + 1)}))
    lines = [{"step": s, "reward/mean": 0.1 * s, "clip/frac_low": 0.01} for s in range(1, 4)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines[:steps_done]))
    if overrides is not None:
        (run / ".hydra").mkdir()
        (run / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    return run


def _cfg(seed, steps=3, **objective):
    return {
        "seed": seed,
        "steps": steps,
        "objective": {"name": "nsr", "mode": "push", **objective},
        "noise": {"name": "logit", "sigma": 0.3, "seed": seed},
        "alpha": {"staleness": 0, "minibatches": 1},
        "optim": {"lr": 1e-4},
        "engine": {"logp_old_source": "sampler"},
        "prereg": {"claim": "c"},
    }


def test_summarize_reads_raw_runs(tmp_path):
    for seed, steps_done in [(0, 3), (1, 2)]:  # the second run stopped early: flagged incomplete
        run = _raw_run(tmp_path, f"objective.mode=push,seed={seed}", _cfg(seed), steps_done)
    summarize(["nsr_vs_decay", "--results", str(tmp_path)])
    df = pd.read_csv(tmp_path / "nsr_vs_decay" / "summary.csv")
    assert len(df) == 5 and set(df.arm) == {"push control"}
    assert df.groupby("seed").complete.all().to_dict() == {0: True, 1: False}
    assert df.reward_mean.max() == pytest.approx(0.3) and df.eval_acc.isna().all()
    mech = pd.read_csv(tmp_path / "nsr_vs_decay" / "mechanism.csv")
    assert mech.oob_frac.tolist() == [0.1, 0.2] and mech.trained.all()
    assert yaml.safe_load((tmp_path / "nsr_vs_decay" / "prereg.yaml").read_text()) == {"claim": "c"}
    assert not (tmp_path / "nsr_vs_decay" / "meta").exists()  # the runs wrote no meta.json
    meta = {"batch_fingerprint": "ab12", "machines": [{"hash": "m1"}, {"hash": "m2"}]}
    (run / "meta.json").write_text(json.dumps(meta))
    summarize(["nsr_vs_decay", "--results", str(tmp_path)])
    kept = tmp_path / "nsr_vs_decay" / "meta" / f"{run.name}.json"
    assert json.loads(kept.read_text()) == meta  # committed beside the summary, for audit
    df = pd.read_csv(tmp_path / "nsr_vs_decay" / "summary.csv")
    assert df[df.seed == 1][["fp_batch", "fp_machine"]].drop_duplicates().values.tolist() == [
        ["ab12", "m1+m2"]
    ]
    assert df[df.seed == 0].fp_batch.isna().all()
    # an amendment that adds a key (an A/A cell) governs the runs made under it and the earlier
    # ones together; one that changes a registered key is refused
    cfg = {**_cfg(1), "prereg": {"claim": "c", "aa_offset": 1000}}
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    summarize(["nsr_vs_decay", "--results", str(tmp_path)])
    prereg = yaml.safe_load((tmp_path / "nsr_vs_decay" / "prereg.yaml").read_text())
    assert prereg == {"claim": "c", "aa_offset": 1000}
    cfg = {**_cfg(1), "prereg": {"claim": "changed after the first run", "aa_offset": 1000}}
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    with pytest.raises(ValueError, match="different pre-registrations"):
        summarize(["nsr_vs_decay", "--results", str(tmp_path)])


def test_a_single_run_without_arms_takes_its_label_from_the_builders_defaults(tmp_path):
    cfg = _cfg(0)
    del cfg["objective"]["mode"]  # left to harness.objectives' default (stochastic: NSR)
    _raw_run(tmp_path, "objective=nsr", cfg)
    summarize(["nsr_vs_decay", "--results", str(tmp_path)])
    assert set(pd.read_csv(tmp_path / "nsr_vs_decay" / "summary.csv").arm) == {"NSR"}


def test_summarize_never_drops_committed_runs_without_force(tmp_path):
    out = tmp_path / "nsr_vs_decay" / "summary.csv"
    out.parent.mkdir()
    committed = pd.DataFrame({"run": ["a", "a", "b"], "step": [1, 2, 1]})
    committed.to_csv(out, index=False)
    _raw_run(tmp_path, "toy", _cfg(0), overrides=["seed=0"])  # a toy sweep into that folder
    with pytest.raises(SystemExit, match=r"holds 2 runs that have no run folder here \(e.g. a\)"):
        summarize(["nsr_vs_decay", "--results", str(tmp_path)])
    assert out.read_text() == committed.to_csv(index=False)  # untouched
    summarize(["nsr_vs_decay", "--results", str(tmp_path), "force=true"])
    assert set(pd.read_csv(out).run) == {"toy"}


def test_summarize_keep_continues_a_sweep_whose_run_folders_are_gone(tmp_path):
    exp = tmp_path / "nsr_vs_decay"
    for seed in (0, 1):
        _raw_run(tmp_path, f"seed={seed}", _cfg(seed), overrides=[f"seed={seed}"])
    summarize(["nsr_vs_decay", "--results", str(tmp_path)])
    committed = (exp / "summary.csv").read_text().splitlines()
    committed_mech = (exp / "mechanism.csv").read_text().splitlines()
    # a new machine: seed 0's folder is gone, seed 2 ran there; seed 1 ran again (replaced)
    for d in ("seed=0", "seed=1"):
        shutil.rmtree(exp / d)
    _raw_run(tmp_path, "seed=1", _cfg(1), steps_done=2, overrides=["seed=1"])
    _raw_run(tmp_path, "seed=2", _cfg(2), overrides=["seed=2"])
    with pytest.raises(SystemExit, match="holds 1 runs that have no run folder here"):
        summarize(["nsr_vs_decay", "--results", str(tmp_path)])
    with pytest.raises(SystemExit, match=r"unknown switch \['keep=yes'\]: valid are force=true"):
        summarize(["nsr_vs_decay", "--results", str(tmp_path), "keep=yes"])
    summarize(["nsr_vs_decay", "--results", str(tmp_path), "keep=true"])
    df = pd.read_csv(exp / "summary.csv")
    assert df.groupby("run").step.max().to_dict() == {"seed=0": 3, "seed=1": 2, "seed=2": 3}
    assert df.groupby("run").complete.first().to_dict() == {
        "seed=0": True,
        "seed=1": False,
        "seed=2": True,
    }
    lines = (exp / "summary.csv").read_text().splitlines()
    assert lines[0] == committed[0]
    assert lines[1:4] == [ln for ln in committed if ln.startswith("1,") or ln[0] in "23"][:3]
    assert [ln.split(",")[0] for ln in lines[1:4]] == ["1", "2", "3"]
    mech = pd.read_csv(exp / "mechanism.csv")
    assert mech.run.tolist() == ["seed=0", "seed=1", "seed=2"]
    assert (exp / "mechanism.csv").read_text().splitlines()[1] == committed_mech[1]
    # a new run that is not the kept runs' experiment is refused, naming why; nothing written
    before = (exp / "summary.csv").read_text()
    for d in ("seed=1", "seed=2"):
        shutil.rmtree(exp / d)
    cfg = {**_cfg(3), "optim": {"lr": 1e-3}, "prereg": {"claim": "other"}}
    _raw_run(tmp_path, "seed=3", cfg, overrides=["seed=3"])
    with pytest.raises(SystemExit) as e:
        summarize(["nsr_vs_decay", "--results", str(tmp_path), "keep=true"])
    assert "another pre-registration" in str(e.value)
    assert "push control: lr = ['0.0001'] in the kept runs, ['0.001'] here" in str(e.value)
    shutil.rmtree(exp / "seed=3")
    _raw_run(tmp_path, "seed=2 again", _cfg(2), overrides=["seed=2"])
    with pytest.raises(SystemExit, match="push control, seed 2: kept run and run here under"):
        summarize(["nsr_vs_decay", "--results", str(tmp_path), "keep=true"])
    assert (exp / "summary.csv").read_text() == before


def test_summarize_refuses_mixed_configs_and_duplicate_runs_naming_them(tmp_path):
    _raw_run(tmp_path, "seed=0", _cfg(0), overrides=["seed=0"])
    _raw_run(tmp_path, "seed=1", _cfg(1), overrides=["seed=1"])
    _raw_run(tmp_path, "seed=2,steps=4", _cfg(2, steps=4), overrides=["seed=2", "steps=4"])
    with pytest.raises(SystemExit) as e:
        summarize(["nsr_vs_decay", "--results", str(tmp_path)])
    assert "mixed configs: steps = 3 in 2 runs like seed=0; 4 in 1 runs like seed=2,steps=4" in str(
        e.value
    )
    assert not (tmp_path / "nsr_vs_decay" / "summary.csv").exists()
    # a swept axis (every run's command line sets it) and the arms' keys are not mixed configs
    for d in (tmp_path / "nsr_vs_decay").iterdir():
        o = d / ".hydra" / "overrides.yaml"
        o.write_text(yaml.safe_dump([*yaml.safe_load(o.read_text()), "steps=3"]))
    (tmp_path / "nsr_vs_decay" / "seed=2,steps=4" / ".hydra" / "overrides.yaml").write_text(
        yaml.safe_dump(["seed=2", "steps=4", "objective.mode=stochastic"])
    )
    cfg = yaml.safe_load((tmp_path / "nsr_vs_decay" / "seed=2,steps=4" / "config.yaml").read_text())
    cfg["objective"]["mode"] = "stochastic"
    (tmp_path / "nsr_vs_decay" / "seed=2,steps=4" / "config.yaml").write_text(yaml.safe_dump(cfg))
    summarize(["nsr_vs_decay", "--results", str(tmp_path)])
    df = pd.read_csv(tmp_path / "nsr_vs_decay" / "summary.csv")
    assert df.groupby("arm").seed.unique().map(list).to_dict() == {
        "push control": [0, 1],
        "NSR": [2],
    }
    # an arm that picks another objective brings that objective's own keys: not mixed configs,
    # though the other runs' command lines never named the objective
    hard = {**_cfg(3), "objective": {"name": "ppo_clip", "eps_low": 0.2}}
    _raw_run(
        tmp_path,
        "objective=ppo_clip,seed=3",
        hard,
        overrides=["seed=3", "steps=3", "objective=ppo_clip"],
    )
    summarize(["nsr_vs_decay", "--results", str(tmp_path)])
    df = pd.read_csv(tmp_path / "nsr_vs_decay" / "summary.csv")
    assert df.groupby("arm").seed.unique().map(list).to_dict() == {
        "push control": [0, 1],
        "NSR": [2],
        "hard clip": [3],
    }
    # a key outside the arm's group still is
    bad = {**_cfg(4), "objective": {"name": "ppo_clip"}, "optim": {"lr": 1e-3}}
    _raw_run(
        tmp_path,
        "objective=ppo_clip,seed=4",
        bad,
        overrides=["seed=4", "steps=3", "objective=ppo_clip"],
    )
    with pytest.raises(SystemExit, match=r"mixed configs: optim.lr = 0.0001 in 4 runs"):
        summarize(["nsr_vs_decay", "--results", str(tmp_path)])
    shutil.rmtree(tmp_path / "nsr_vs_decay" / "objective=ppo_clip,seed=4")
    _raw_run(tmp_path, "copy of seed=1", _cfg(1), overrides=["seed=1", "steps=3"])
    with pytest.raises(
        SystemExit, match="duplicate runs .one config, 2 folders.: copy of seed=1, seed=1"
    ):
        summarize(["nsr_vs_decay", "--results", str(tmp_path)])


def test_every_swept_key_is_a_column_and_part_of_the_arms_label(tmp_path):
    """`objective=band objective.hi=2.0,4.0`: the objective's own swept keyword becomes a column
    and tells the two arms apart, so no (arm, seed) holds two runs."""
    from analysis.runs import doubled

    for hi in (2.0, 4.0):
        cfg = {**_cfg(0), "objective": {"name": "band", "hi": hi}}
        overrides = ["objective=band", f"objective.hi={hi}", "seed=0"]
        _raw_run(tmp_path, f"objective.hi={hi}", cfg, overrides=overrides, exp="toy")
    summarize(["toy", "--results", str(tmp_path)])
    df = pd.read_csv(tmp_path / "toy" / "summary.csv")
    assert df.groupby("arm")["objective.hi"].first().to_dict() == {
        "band, objective.hi=2.0": 2.0,
        "band, objective.hi=4.0": 4.0,
    }
    assert doubled(df) == {}


def test_summaries_must_name_the_shipped_weights_of_their_recipe():
    import pandas as pd

    from analysis.runs import weights_problems
    from harness.tasks.warmstart import shipped_manifest

    h, entry = next(iter(shipped_manifest().items()))
    ok = pd.DataFrame({"recipe_hash": [h, h], "weights_sha": [entry["weights_sha"]] * 2})
    assert weights_problems(ok) == []
    assert "do not record the weights checksum" in weights_problems(pd.DataFrame({"x": [1]}))[0]
    other = ok.assign(weights_sha=["0123456789abcdef", entry["weights_sha"]])
    assert weights_problems(other) == [
        f"runs of recipe {h} used weights 0123456789abcdef, not the shipped {entry['weights_sha']}"
    ]


def test_load_raw_copies_the_model_checksum_from_meta(tmp_path):
    import json

    import yaml

    from analysis.runs import load_raw

    run = tmp_path / "exp" / "seed=0"
    run.mkdir(parents=True)
    cfg = {
        "objective": {"name": "ppo_clip"},
        "noise": {"name": "none"},
        "seed": 0,
        "steps": 1,
        "alpha": {"staleness": 0},
        "engine": {"logp_old_source": "trainer"},
    }
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/mean": 0.5}) + "\n")
    model = {"weights_sha": "abf264c4edf47066", "recipe_hash": "a814f17fcbcb"}
    (run / "meta.json").write_text(json.dumps({"model": model}))
    df = load_raw(tmp_path, "exp")
    assert df.weights_sha.tolist() == ["abf264c4edf47066"]
    assert df.recipe_hash.tolist() == ["a814f17fcbcb"]


def test_dose_response_tests_each_noise_level_as_registered(tmp_path):
    """The curve's points are the dose preset's endpoints applied at every σ (base experiment's
    level included); the paired differences equal the hand-computed mean of per-seed gaps."""
    from analysis.dose_response import curve_points, main, mechanism_points

    treat, ctrl = "NSR", "deterministic decay"
    gaps = {0.5: [0.01, 0.02, 0.03], 1.0: [0.05, 0.06, 0.10], 2.0: [-0.02, 0.0, 0.05]}
    for exp, sigmas in (("nsr_vs_decay", [0.5]), ("nsr_dose", [1.0, 2.0])):
        rows = []
        for sigma in sigmas:
            for seed, gap in enumerate(gaps[sigma]):
                for arm, extra in ((treat, gap), (ctrl, 0.0)):
                    for s in (1, 2, 3, 4):
                        acc = 0.2 + 0.01 * seed + extra if s >= 3 else np.nan
                        rows.append(
                            {
                                "run": f"{arm}{sigma}{seed}",
                                "arm": arm,
                                "seed": seed,
                                "sigma": sigma,
                                "step": s,
                                "eval_acc": acc,
                                "entropy_mean": 0.3,
                                "rescue_frac": 0.01 * sigma,
                                "clip_frac_low": 0.02,
                                "steps": 4,
                                "complete": True,
                            }
                        )
        (tmp_path / exp).mkdir()
        pd.DataFrame(rows).to_csv(tmp_path / exp / "summary.csv", index=False)
    ep = {
        "metric": "eval_acc",
        "reduce": "last_evals",
        "n": 2,
        "test": "paired_t",
        "predicted": "greater",
    }
    prereg = {
        "claim": "c",
        "source": "s",
        "seeds": 3,
        "treatment": treat,
        "control": ctrl,
        "endpoints": [
            {"name": f"accuracy, σ {s}", **ep, "where": {"sigma": s}} for s in (1.0, 2.0)
        ],
    }
    (tmp_path / "nsr_dose" / "prereg.yaml").write_text(yaml.safe_dump(prereg))
    df = pd.concat(
        [pd.read_csv(tmp_path / e / "summary.csv") for e in ("nsr_vs_decay", "nsr_dose")]
    )
    pts = curve_points(df, prereg).set_index("sigma")
    assert list(pts.endpoint) == ["accuracy"] * 3  # one curve, every σ
    for sigma, g in gaps.items():
        assert pts.loc[sigma, "diff"] == pytest.approx(np.mean(g), abs=1e-12)
        assert pts.loc[sigma, "pairs"] == 3
    mech = pd.DataFrame(
        {
            "arm": treat,
            "trained": True,
            "sigma": [1.0, 1.0, 2.0],
            "oob_frac": [0.07, 0.09, 0.2],
            "neg_low_clip": 0.1,
        }
    )
    mech.to_csv(tmp_path / "nsr_dose" / "mechanism.csv", index=False)
    m = mechanism_points(
        tmp_path, ["nsr_vs_decay", "nsr_dose"], df, treat, [("rescue_frac", "rescued")]
    )
    assert np.isnan(m.loc[0.5, "oob_frac"])  # no check recorded at σ 0.5 in this fixture
    assert m.loc[1.0, "oob_frac"] == pytest.approx(0.08) and m.loc[
        2.0, "rescue_frac"
    ] == pytest.approx(0.02)
    main(["--results", str(tmp_path)])
    assert (tmp_path / "nsr_dose" / "fig_nsr_dose.png").stat().st_size > 10_000


def test_figures_leave_out_the_aa_cell(tmp_path):
    df = pd.DataFrame({"seed": [0, 1, 100, 101], "arm": ["C"] * 4})
    (tmp_path / "exp").mkdir()
    assert without_aa(df, tmp_path, "exp").seed.tolist() == [0, 1, 100, 101]  # no prereg.yaml
    (tmp_path / "exp" / "prereg.yaml").write_text(yaml.safe_dump({"aa_offset": 100}))
    assert without_aa(df, tmp_path, "exp").seed.tolist() == [0, 1]


def test_smollm2_figures_run_on_fixture(tmp_path):
    """analysis.smollm2_clip draws the pilot and the confirmatory sweep, each where its summary
    exists, and writes each one's per-run shape."""
    from analysis import smollm2_clip

    arms = [("ppo_clip", "π_old := μ (std clip)"), ("ppo_clip", "π_old recomputed (std clip)")]
    fake_summary(tmp_path, "smollm2_clip_confirm", [(o, a, 0.0, 0) for o, a in arms])
    smollm2_clip.main(["--results", str(tmp_path)])
    assert (
        tmp_path / "smollm2_clip_confirm" / "fig_smollm2_clip_confirm.png"
    ).stat().st_size > 10_000
    shape = pd.read_csv(tmp_path / "smollm2_clip_confirm" / "shape.csv")
    assert len(shape) == 2 * 3  # a row per run: 2 arms × 3 seeds
    assert not (tmp_path / "smollm2_surge_pilot").exists()  # no summary, no figure


def _pilot_summary(root, exp, arms, steps=20, **cols):
    """A one-seed summary.csv: each arm's run with the given per-step columns (a function of
    the arm's index and the step) over the fake metrics."""
    fake_summary(root, exp, [(o, a, 0.0, 0) for o, a in arms], steps=steps)
    df = pd.read_csv(root / exp / "summary.csv")
    df = df[df.seed == 0].copy()
    index = df.arm.map({a: i for i, (_, a) in enumerate(arms)})
    for col, fn in cols.items():
        df[col] = fn(index, df.step)
    df.to_csv(root / exp / "summary.csv", index=False)


def test_smollm2_collapse_table_measures_escalation_and_collapse(tmp_path):
    """analysis.smollm2_collapse on 40 steps: the reject arm's deleted mass 0.01·step escalates
    at 1.0 per 100 steps with a last/first-quarter fold of 35.5/5.5 (means of steps 31–40 and
    1–10); its reward 0.8 to step 25 and 0.1 after ends below half its best and stays: a
    collapse; its entropy at 3× its start from step 15 is the guard's event. The clamp arm
    (nothing deleted, reward 0.5 throughout) has neither."""
    from analysis import smollm2_collapse

    arms = [("band", "reject (band [0.5, 2])"), ("cispo", "clamp (CISPO [0.5, 2])")]
    _pilot_summary(
        tmp_path,
        "smollm2_collapse_pilot",
        arms,
        steps=40,
        mask_frac=lambda i, s: 0.01 * s * (i == 0),
        entropy_mean=lambda i, s: 0.3 * (1 + 2 * ((s >= 15) & (i == 0))),
        reward_mean=lambda i, s: np.where(i == 0, np.where(s <= 25, 0.8, 0.1), 0.5),
    )
    smollm2_collapse.main(["--results", str(tmp_path)])
    table = pd.read_csv(tmp_path / "smollm2_collapse_pilot" / "events.csv").set_index("arm")
    reject, clamp = table.loc[arms[0][1]], table.loc[arms[1][1]]
    assert reject.mask_frac_slope_per_100 == pytest.approx(1.0)
    assert reject.mask_frac_fold == pytest.approx(35.5 / 5.5, rel=1e-3)
    assert clamp.mask_frac_slope_per_100 == pytest.approx(0.0, abs=1e-9)
    assert bool(reject.entropy_guard) and not bool(clamp.entropy_guard)
    assert bool(reject.collapse) and not clamp.collapse
    assert (tmp_path / "smollm2_collapse_pilot" / "fig_smollm2_collapse_pilot.png").exists()


def test_smollm2_opsd_table_reads_the_tail_loop_rate(tmp_path):
    """analysis.smollm2_opsd: a clipped run whose terminal-loop rate is 0 to step 15 and 0.5
    from step 16 (the last 20% of 20 steps: steps 17–20) loops at 0.5 there and 0 in its first
    10 steps, and its exact KL 0.05 to step 10 and 0.1 after reads 0.05 first and 0.1 in the
    tail; the exact run never loops and its KL stays at 0.05."""
    from analysis import smollm2_opsd

    arms = [("opsd_fkl", "clipped FKL (τ = 0.05)"), ("opsd_fkl", "exact FKL (τ = none)")]
    _pilot_summary(
        tmp_path,
        "smollm2_opsd_pilot",
        arms,
        repetition_terminal_loop_rate=lambda i, s: 0.5 * ((s > 15) & (i == 0)),
        opsd_fkl=lambda i, s: np.where((s > 10) & (i == 0), 0.1, 0.05),
    )
    smollm2_opsd.main(["--results", str(tmp_path)])
    table = pd.read_csv(tmp_path / "smollm2_opsd_pilot" / "loops.csv").set_index("arm")
    clipped, exact = table.loc[arms[0][1]], table.loc[arms[1][1]]
    assert bool(clipped.loops) and clipped.repetition_terminal_loop_rate_tail == pytest.approx(0.5)
    assert clipped.repetition_terminal_loop_rate_first10 == 0.0
    assert not exact.loops and exact.repetition_terminal_loop_rate_tail == 0.0
    assert (clipped.opsd_fkl_first10, clipped.opsd_fkl_tail) == (0.05, 0.1)  # the KL rose
    assert (exact.opsd_fkl_first10, exact.opsd_fkl_tail) == (0.05, 0.05)
    assert (tmp_path / "smollm2_opsd_pilot" / "fig_smollm2_opsd_pilot.png").exists()
