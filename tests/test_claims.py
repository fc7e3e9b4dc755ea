"""Pre-registered endpoints: the presets' blocks validate, reductions and verdicts by hand."""

import copy

import numpy as np
import pandas as pd
import pytest
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from analysis.claims import (
    corrected,
    endpoint_marks,
    endpoint_values,
    markdown,
    run_endpoint,
    select_cell,
    stars,
)
from analysis.stats import paired_t
from harness import train
from harness.runs.prereg import check_prereg

CONFIG_DIR = str(train.__file__.rsplit("/harness/", 1)[0] + "/experiments")
PREREG = {
    "claim": "c",
    "source": "s",
    "seeds": 3,
    "treatment": "T",
    "control": "C",
    "endpoints": [
        {
            "name": "e",
            "metric": "m",
            "reduce": "window_mean",
            "window": [3, 4],
            "test": "paired_t",
            "predicted": "greater",
        }
    ],
}


@pytest.mark.parametrize(
    "exp, least",
    [
        ("collapse_reject_vs_clamp", 5),
        ("fp8_entropy_surge", 5),
        ("nsr_vs_decay", 5),
        ("opsd_repetition", 5),
        ("cis_vs_tis", 5),
        ("phase_diagram", 3),
        ("collapse_drivers", 5),
        ("fp8_full_pipeline", 5),
        ("nsr_dose", 3),
        ("cis_dose", 3),
        ("surge_confirm", 8),
        ("nsr_confirm", 10),
        ("collapse_confirm", 10),
        ("smollm2_clip_confirm", 6),
        ("smollm2_collapse_confirm", 4),
        ("smollm2_opsd_confirm", 4),
    ],
)
def test_the_presets_preregistrations_validate_and_their_sweeps_cover_the_planned_seeds(exp, least):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose("train", overrides=[f"experiment={exp}"], return_hydra_config=True)
    prereg = OmegaConf.to_container(cfg.prereg, resolve=True)
    check_prereg(prereg)
    seeds = str(cfg.hydra.sweeper.params.seed).split(",")
    assert len(seeds) == prereg["seeds"] >= least


@pytest.mark.parametrize(
    "path, value, key",
    [
        (("seeds",), 1, "prereg.seeds"),
        (("endpoints", 0, "test"), "wilcoxon", "prereg.endpoints[0].test"),
        (("endpoints", 0, "window"), [4, 3], "prereg.endpoints[0].window"),
        (("endpoints", 0, "predicted"), "up", "prereg.endpoints[0].predicted"),
        (("treatment",), None, "prereg.treatment"),
    ],
)
def test_a_bad_preregistration_names_its_key(path, value, key):
    bad = copy.deepcopy(PREREG)
    node = bad
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    with pytest.raises(ValueError, match=key.replace("[", r"\[").replace("]", r"\]")):
        check_prereg(bad)
    fisher = copy.deepcopy(PREREG)
    fisher["endpoints"][0]["test"] = "fisher"  # Fisher counts runs with an event
    with pytest.raises(ValueError, match="final_any"):
        check_prereg(fisher)


def _summary(values):
    """Four steps per run; metric m = the given per-step values; eval at steps 2 and 4."""
    rows = []
    for (arm, seed), ms in values.items():
        for step, m in enumerate(ms, 1):
            rows.append(
                dict(
                    run=f"{arm}{seed}",
                    arm=arm,
                    seed=seed,
                    step=step,
                    m=m,
                    complete=True,
                    eval_acc=m if step % 2 == 0 else None,
                )
            )
    return pd.DataFrame(rows)


def test_reductions_by_hand():
    df = _summary({("T", 0): [0, 1, 2, 3], ("C", 0): [0, 0, 0, 5]})
    window = endpoint_values(df, {"metric": "m", "reduce": "window_mean", "window": [3, 4]})
    assert window[("T", 0)] == 2.5 and window[("C", 0)] == 2.5
    evals = endpoint_values(df, {"metric": "eval_acc", "reduce": "last_evals", "n": 1})
    assert evals[("T", 0)] == 3 and evals[("C", 0)] == 5
    anyev = endpoint_values(df, {"metric": "m", "reduce": "final_any"})
    assert anyev[("T", 0)] == 1.0
    incomplete = df.assign(complete=df.arm == "C")
    assert list(endpoint_values(incomplete, {"metric": "m", "reduce": "final_any"}).index) == [
        ("C", 0)
    ]


def test_verdicts_follow_the_registered_test_and_direction():
    ep = PREREG["endpoints"][0]
    up = {("T", s): [0, 0, 1 + 0.1 * s, 1 + 0.1 * s] for s in range(4)}
    up |= {("C", s): [0, 0, 0.05 * s, 0.05 * s] for s in range(4)}
    vals = endpoint_values(_summary(up), ep)
    res = run_endpoint(vals, ep, "T", "C")
    by_hand = paired_t([1 + 0.1 * s for s in range(4)], [0.05 * s for s in range(4)])
    assert res["p"] == pytest.approx(by_hand["p"]) and res["pairs"] == 4
    assert res["verdict"] == "reproduced"
    assert run_endpoint(vals, {**ep, "predicted": "less"}, "T", "C")["verdict"].startswith(
        "opposite"
    )
    zeros = endpoint_values(_summary({(a, s): [0] * 4 for a in "TC" for s in range(3)}), ep)
    assert (
        run_endpoint(zeros, ep, "T", "C")["verdict"]
        == "not reproduced: 0 in every run of both arms"
    )
    same = endpoint_values(_summary({(a, s): [0, 0, s, s] for a in "TC" for s in range(3)}), ep)
    assert run_endpoint(same, ep, "T", "C")["verdict"] == "not resolved"
    tost_ep = {**ep, "test": "tost", "margin": 0.5}
    assert run_endpoint(same, tost_ep, "T", "C")["verdict"].startswith("not reproduced: equiv")
    assert run_endpoint(vals, tost_ep, "T", "C")["verdict"] == "reproduced"
    opposite = {**tost_ep, "predicted": "less"}  # a resolved difference the other way
    assert run_endpoint(vals, opposite, "T", "C")["verdict"] == "opposite to the prediction"
    none = endpoint_values(
        _summary({(a, s): [0] * 4 for a in "TC" for s in range(3)}),
        {"metric": "m", "reduce": "final_any"},
    )
    fisher = run_endpoint(none, {**ep, "test": "fisher", "reduce": "final_any"}, "T", "C")
    assert fisher["verdict"] == "not reproduced: no event in either arm"
    every = endpoint_values(
        _summary({(a, s): [1] * 4 for a in "TC" for s in range(3)}),
        {"metric": "m", "reduce": "final_any"},
    )
    fisher = run_endpoint(every, {**ep, "test": "fisher", "reduce": "final_any"}, "T", "C")
    assert fisher["verdict"] == "not reproduced: an event in every run of both arms"
    assert fisher["p"] == pytest.approx(1.0) and fisher["stat"] == "3/3 vs 3/3 runs"
    assert run_endpoint(vals, ep, "T", "X")["verdict"].startswith("not run")
    table = pd.DataFrame(
        [
            {
                "experiment": "x",
                "claim": "c",
                "source": "s",
                "treatment": "T",
                "control": "C",
                "endpoint": "e",
                "metric": "m",
                "reduce": "r",
                "test": "paired_t",
                "predicted": "greater",
                "seeds_planned": 4,
                "mechanism_treatment": "mm",
                "status": "confirmatory",
                "kind": "in sign",
                **res,
            }
        ]
    )
    text = markdown(corrected(table))
    assert "| reproduced | in sign | Holm and BH |" in text and "| confirmatory | mm |" in text


def test_where_selects_one_cell_of_a_grid():
    df = _summary({(a, s): [0, 0, s, s] for a in "TC" for s in range(3)})
    df["sigma"] = [0.5 if seed == 2 else 1.0 for seed in df.seed]
    ep = {"metric": "m", "reduce": "window_mean", "window": [3, 4], "where": {"sigma": 1.0}}
    assert sorted(endpoint_values(df, ep).index) == [("C", 0), ("C", 1), ("T", 0), ("T", 1)]
    with pytest.raises(ValueError, match="'noise' is not a summary.csv column"):
        endpoint_values(df, {**ep, "where": {"noise": "logit"}})
    # the step-0 mechanism table has σ but no staleness: a lax selection skips what it lacks
    mech = pd.DataFrame({"sigma": [1.0, 0.5], "oob_frac": [0.1, 0.2]})
    assert select_cell(mech, {"sigma": 0.5, "staleness": 2}, strict=False).oob_frac.tolist() == [
        0.2
    ]


def test_a_seed_without_a_value_in_either_arm_is_left_out_of_the_pairs():
    ep = PREREG["endpoints"][0]
    vals = {("T", s): [0, 0, 1 + s, 1 + s] for s in range(3)} | {
        ("C", s): [0, 0, s, s] for s in range(3)
    }
    vals[("C", 2)] = [0, 0, float("nan"), float("nan")]  # no exit-mass value in this run
    res = run_endpoint(endpoint_values(_summary(vals), ep), ep, "T", "C")
    assert res["pairs"] == 2 and res["diff"] == pytest.approx(1.0)


def test_figure_marks_carry_the_registered_test_worked_by_hand(tmp_path):
    # paired differences 1, 2, 3: mean 2, SD 1, t = 2√3 = 3.464 on 2 df; the t(2) CDF is
    # 1/2 + t / (2√(2 + t²)), so p = 2(1/2 − 3.464/(2√14)) = 0.0742; CI 2 ± 4.303/√3
    vals = {("T", s): [0, 0, 1 + s, 1 + s] for s in range(3)} | {
        ("C", s): [0, 0, 0, 0] for s in range(3)
    }
    (tmp_path / "x").mkdir()
    _summary(vals).to_csv(tmp_path / "x" / "summary.csv", index=False)
    cell = {
        **PREREG["endpoints"][0],
        "name": "one cell",
        "metric": "eval_acc",
        "where": {"seed": 0},
    }
    # a second endpoint on the same column (a fix against the treatment): C − T, the same
    # numbers negated; both lines are marked, in registered order
    fix = {**PREREG["endpoints"][0], "name": "fix", "treatment": "C", "control": "T"}
    prereg = {**PREREG, "endpoints": [PREREG["endpoints"][0], cell, fix]}
    (tmp_path / "x" / "prereg.yaml").write_text(yaml.safe_dump(prereg, allow_unicode=True))
    with pytest.warns(UserWarning, match="weights checksum"):
        marks = endpoint_marks(tmp_path, "x")
    assert marks == {
        "m": "e: Δ +2.000, 95% CI [-0.484, +4.484], p = 0.074 (n.s.)\n"
        "fix: Δ -2.000, 95% CI [-4.484, +0.484], p = 0.074 (n.s.)"
    }
    assert endpoint_marks(tmp_path, "absent") == {}
    assert [stars(p) for p in (0.0009, 0.009, 0.049, 0.05)] == ["***", "**", "*", "n.s."]


def _entropy_runs(surging: dict[str, int], n: int = 5, steps: int = 30) -> pd.DataFrame:
    """Per arm, `surging[arm]` of n runs whose entropy triples after step 10 (a surge at step
    15), the rest flat; reward flat."""
    rows = []
    for arm, k in surging.items():
        for seed in range(n):
            for step in range(1, steps + 1):
                ent = 3.0 if seed < k and step > 10 else 1.0
                rows.append(
                    dict(
                        run=f"{arm}{seed}",
                        arm=arm,
                        seed=seed,
                        step=step,
                        entropy_mean=ent,
                        reward_mean=0.3,
                        complete=True,
                    )
                )
    return pd.DataFrame(rows)


def test_an_in_kind_endpoint_counts_runs_in_which_the_entropy_surged():
    """4/5 surges against 0/5: one-sided Fisher p = C(5,4)/C(10,4) = 5/210; the row is in kind;
    the same difference as a window mean would only be in sign."""
    from analysis.claims import in_kind_counts, kind

    df = _entropy_runs({"T": 4, "C": 0})
    ep = {
        "name": "surge",
        "metric": "entropy_mean",
        "reduce": "event",
        "event": "surge",
        "test": "fisher",
        "predicted": "greater",
    }
    check_prereg({**PREREG, "endpoints": [ep]})
    res = run_endpoint(endpoint_values(df, ep), ep, "T", "C")
    assert res["stat"] == "4/5 vs 0/5 runs" and res["p"] == pytest.approx(5 / 210)
    assert res["verdict"] == "reproduced" and kind(ep, res["verdict"]) == "in kind"
    assert res["mde"] == ">= 4/5 vs 0/5"
    assert in_kind_counts(df, ["T", "C"]).startswith("surge 4/5 (at 15) vs 0/5")
    # an A/A cell (the control again on seeds + 100, one of them surging) is counted apart
    aa = _entropy_runs({"C": 1}).assign(seed=lambda d: d.seed + 100, run=lambda d: d.run + "aa")
    both = pd.concat([df, aa])
    assert in_kind_counts(both, ["T", "C"], aa_offset=100).startswith(
        "surge 4/5 (at 15) vs 0/5 vs A/A 1/5 (at 15)"
    )
    assert in_kind_counts(both, ["T", "C"]).startswith("surge 4/5 (at 15) vs 1/10")  # pooled
    win = {
        "name": "w",
        "metric": "entropy_mean",
        "reduce": "window_mean",
        "window": [20, 30],
        "test": "paired_t",
        "predicted": "greater",
    }
    assert kind(win, "reproduced") == "in sign" and kind(ep, "not resolved") == "neither"
    with pytest.raises(ValueError, match=r"endpoints\[0\].event"):
        check_prereg({**PREREG, "endpoints": [{**ep, "event": "spike"}]})


def test_corrections_by_hand_and_exploratory_rows_leave_the_families():
    """Experiment a: p 0.01, 0.04 → Holm 0.02, 0.04, BH 0.02, 0.04; b: 0.03 → 0.03 and an
    exploratory 0.001. The project-wide BH over the three confirmatory p (0.01, 0.03, 0.04):
    0.03, 0.04, 0.04. Paired p of a: 0.03125, 0.001 → Holm 0.03125, 0.002. The OPSD confirm's
    three registered p (1, 0.014286, 0.045419): BH within it gives the reversal 3 × 0.014286
    = 0.043."""
    t = pd.DataFrame(
        {
            "experiment": ["a", "a", "b", "b"],
            "p": [0.01, 0.04, 0.03, 0.001],
            "p_paired": [1 / 32, 0.001, 0.5, 0.001],
            "verdict": ["reproduced", "reproduced", "not resolved", "reproduced"],
            "status": ["confirmatory"] * 3 + ["exploratory: ran before its prereg"],
        }
    )
    out = corrected(t)
    assert out.p_holm[:3].tolist() == pytest.approx([0.02, 0.04, 0.03])
    assert out.q_bh[:3].tolist() == pytest.approx([0.02, 0.04, 0.03]) and np.isnan(out.q_bh[3])
    assert out.q_bh_project[:3].tolist() == pytest.approx([0.03, 0.04, 0.04])
    assert out.p_paired_holm[:3].tolist() == pytest.approx([1 / 32, 0.002, 0.5])
    assert np.isnan(out.q_bh_project[3]) and np.isnan(out.p_paired_holm[3])
    opsd = pd.DataFrame({"experiment": "o", "p": [1.0, 0.014286, 0.045419]})
    opsd = corrected(opsd.assign(verdict="reproduced", status="confirmatory"))
    assert opsd.q_bh[1] == pytest.approx(0.042858) and round(opsd.q_bh[1], 3) == 0.043
    assert out.survives.tolist() == ["Holm and BH", "Holm and BH", "—", "not in the family"]


def test_the_aa_cell_pairs_the_control_arm_with_itself_on_other_seeds():
    """Control seeds 0–2 and 100–102 (aa_offset 100): the A/A pairs are (100, 0), (101, 1),
    (102, 2); the treatment is not used."""
    from analysis.claims import aa_values

    idx = pd.MultiIndex.from_tuples(
        [("C", 0), ("C", 1), ("C", 2), ("C", 100), ("C", 101), ("C", 102), ("T", 0)],
        names=["arm", "seed"],
    )
    vals = pd.Series([1.0, 2.0, 3.0, 1.5, 2.5, 3.5, 9.0], index=idx)
    aa = aa_values(vals, "C", 100)
    assert aa.xs("A/A", level="arm").to_dict() == {0: 1.5, 1: 2.5, 2: 3.5}
    assert aa.xs("C", level="arm").to_dict() == {0: 1.0, 1: 2.0, 2: 3.0}
    ep = PREREG["endpoints"][0]
    res = run_endpoint(aa, ep, "A/A", "C")
    assert res["diff"] == pytest.approx(0.5) and res["pairs"] == 3


def test_claims_refuses_runs_that_cannot_give_the_registered_tests(tmp_path):
    """The toy sweep case: a summary of 4-step runs where the preset registers 100 steps (a
    window [76, 100]) gives no verdict; nor do a run that stopped early or a seed twice."""
    from analysis.claims import claims

    exp = tmp_path / "nsr_vs_decay"
    exp.mkdir()
    from analysis.runs import preset_config

    prereg = preset_config("nsr_vs_decay")["prereg"]
    (exp / "prereg.yaml").write_text(yaml.safe_dump(prereg, allow_unicode=True))
    vals = {
        (arm, s): [0.1, 0.2, 0.3, 0.4] for arm in ("NSR", "deterministic decay") for s in range(2)
    }
    toy = _summary(vals).assign(steps=4, entropy_mean=0.3)
    toy.to_csv(exp / "summary.csv", index=False)
    with pytest.raises(ValueError) as e, pytest.warns(UserWarning, match="checksum"):
        claims(tmp_path)
    msg = str(e.value)
    assert "nsr_vs_decay: run NSR0 ran 4 steps; the preset registers 100" in msg
    assert "entropy: window [76, 100] lies beyond the last step (the last step is 4)" in msg
    full = _summary({k: [0.1] * 100 for k in vals}).assign(steps=100, entropy_mean=0.3)
    stopped = full[~((full.run == "NSR1") & (full.step > 60))]
    stopped.to_csv(exp / "summary.csv", index=False)
    with pytest.raises(ValueError, match="run NSR1 stopped at step 60 of 100"):
        with pytest.warns(UserWarning, match="checksum"):
            claims(tmp_path)
    twice = pd.concat([full, full[full.run == "NSR1"].assign(run="NSR1-again")])
    twice.to_csv(exp / "summary.csv", index=False)
    with pytest.raises(
        ValueError, match=r"arm 'NSR' seed 1 has 2 runs in this cell \(NSR1, NSR1-again\)"
    ):
        with pytest.warns(UserWarning, match="checksum"):
            claims(tmp_path)
    full.to_csv(exp / "summary.csv", index=False)
    with pytest.warns(UserWarning, match="checksum"):
        table = claims(tmp_path)
    assert (table[table.experiment == "nsr_vs_decay"].pairs == 2).all()


def test_a_sweep_short_of_its_registered_seeds_gives_no_verdict(tmp_path):
    """nsr_vs_decay registers 5 seeds. With 3 run, every row is interim: the numbers so far,
    no verdict, outside both corrections, though the difference is plain (NSR 1.0 vs 0.1)."""
    from analysis.claims import claims
    from analysis.runs import preset_config

    exp = tmp_path / "nsr_vs_decay"
    exp.mkdir()
    prereg = preset_config("nsr_vs_decay")["prereg"]
    (exp / "prereg.yaml").write_text(yaml.safe_dump(prereg, allow_unicode=True))

    def write(n_seeds):
        vals = {("NSR", s): [1.0 + 0.01 * s] * 100 for s in range(n_seeds)}
        vals |= {("deterministic decay", s): [0.1] * 100 for s in range(n_seeds)}
        df = _summary(vals).assign(steps=100, entropy_mean=lambda d: d.m, reward_mean=0.5)
        df.to_csv(exp / "summary.csv", index=False)

    write(3)
    with pytest.warns(UserWarning, match="checksum"):
        t = claims(tmp_path)
    t = t[t.experiment == "nsr_vs_decay"]
    assert (t.status == "interim (3/5 seeds)").all() and (t.kind == "neither").all()
    assert t.verdict.str.startswith("interim, no verdict (so far: ").all()
    assert (t.survives == "not in the family").all() and t.p_holm.isna().all()
    write(5)
    with pytest.warns(UserWarning, match="checksum"):
        t = claims(tmp_path)
    t = t[t.experiment == "nsr_vs_decay"]
    assert (t.status == "confirmatory").all() and t.p_holm.notna().any()
    assert not t.verdict.str.startswith("interim").any()


def test_an_endpoint_can_name_its_own_arms_and_a_stall_is_an_event():
    """A third arm against the control (the seed's fix): `arms_of` reads the endpoint's own
    treatment/control, else the registration's; an arm label must be text. `stall` is a
    registered event."""
    from analysis.claims import arms_of

    ep = {
        "name": "fix matches control",
        "metric": "reward_mean",
        "reduce": "event",
        "event": "stall",
        "test": "fisher",
        "predicted": "less",
        "treatment": "fix",
    }
    check_prereg({**PREREG, "endpoints": [ep]})
    assert arms_of(PREREG, ep) == ("fix", PREREG["control"])
    plain = {k: v for k, v in ep.items() if k != "treatment"}
    assert arms_of(PREREG, plain) == (PREREG["treatment"], PREREG["control"])
    with pytest.raises(ValueError, match=r"endpoints\[0\].control"):
        check_prereg({**PREREG, "endpoints": [{**ep, "control": 3}]})


def test_a_paired_design_registers_a_paired_test_and_states_its_smallest_p():
    """No `test` named: an event gets the exact sign test, a continuous reduction the paired t.
    Smallest p by hand: sign over 4 pairs 1/16 = 0.0625 (cannot reach 0.05: a warning), over 6
    1/64; sign-flip (two-sided) over 4: 2/16; Fisher 4 vs 4: 1/C(8, 4) = 1/70."""
    from harness.runs.prereg import smallest_p, test_of

    loops = {"name": "loops", "metric": "m", "reduce": "event", "event": "loops"}
    loops["predicted"] = "greater"
    cont = {k: v for k, v in PREREG["endpoints"][0].items() if k != "test"}
    assert test_of(loops) == "sign" and test_of(cont) == "paired_t"
    assert smallest_p("sign", 4) == 1 / 16 and smallest_p("sign", 6) == 1 / 64
    assert smallest_p("sign_flip", 4) == 2 / 16 and smallest_p("fisher", 4) == 1 / 70
    assert smallest_p("paired_t", 4) == 0.0
    four = {**PREREG, "seeds": 4, "endpoints": [loops, cont]}
    with pytest.warns(UserWarning, match=r"endpoints\[0\] \(loops\), 4 pairs: smallest p sign"):
        lines = check_prereg(four)
    assert lines[0].endswith("sign 0.0625 (cannot reach α = 0.05)")
    assert lines[1] == "endpoints[1] (e), 4 pairs: smallest p paired_t any (a continuous statistic)"
    six = check_prereg({**four, "seeds": 6})  # no warning: 1/64 < 0.05
    assert six[0].endswith("sign 0.0156 (< α/2 = 0.025)")  # Holm's first step of 2
    with pytest.raises(ValueError, match=r"endpoints\[0\].reduce/test='event/paired_t'"):
        check_prereg({**four, "endpoints": [{**loops, "test": "paired_t"}]})
    with pytest.raises(ValueError, match=r"reduce/test='window_mean/sign'"):
        check_prereg({**four, "endpoints": [{**cont, "test": "sign"}]})


def _step1(rows):
    """Step-1 summary rows: (arm, seed, reward, entropy, dial, extra columns)."""
    return pd.DataFrame(
        [
            dict(arm=a, seed=s, step=1, reward_mean=r, entropy_mean=e, dial_kl_k3=k, **x)
            for a, s, r, e, k, x in rows
        ]
    )


def test_a_pair_whose_step_1_differs_is_named_with_why():
    """Seed 1's fix run saw another batch (reward 0.375 vs 0.28125, as seed 603's calibrated
    run); roundoff-level dials (2.9e-6 vs 2.6e-6) and the 5-digit rounding are no difference;
    a seed without a control run is not compared; fingerprints, where both runs have them,
    decide (a differing fp_machine is named even when the metrics agree)."""
    from analysis.claims import broken_pairs

    runs = _step1(
        [
            ("C", 0, 0.28125, 0.34380, 0.0476, {}),
            ("T", 0, 0.28125, 0.343801, 0.0476, {}),
            ("fix", 0, 0.28125, 0.3438, 2.9e-6 + 0.0476, {}),
            ("C", 1, 0.28125, 0.3438, 0.0476, {}),
            ("T", 1, 0.28125, 0.3438, 0.0476, {}),
            ("fix", 1, 0.375, 0.3462, 0.0476, {}),
            ("T", 2, 0.5, 0.5, 0.5, {}),
        ]
    )
    assert broken_pairs(runs, "C") == {
        (1, "fix"): "seed 1: fix's step 1 differs from C's: reward_mean 0.375 vs 0.2812, "
        "entropy_mean 0.3462 vs 0.3438"
    }
    fp = {"fp_batch": "ab12", "fp_machine": "m1"}
    signed = _step1(
        [
            ("C", 0, 0.3, 0.3, 0.3, fp),
            ("T", 0, 0.9, 0.3, 0.3, fp),  # the fingerprints agree: the metrics are not read
            ("C", 1, 0.3, 0.3, 0.3, fp),
            ("T", 1, 0.3, 0.3, 0.3, {**fp, "fp_machine": "m2"}),
        ]
    )
    assert broken_pairs(signed, "C") == {
        (1, "T"): "seed 1: T's step 1 differs from C's: fp_machine m2 vs m1"
    }


def test_the_paired_test_leaves_out_broken_pairs_and_is_sided_as_the_registered_one():
    """Events on 6 seeds: the treatment alone on seeds 0–4, neither on 5 → 5 discordant pairs
    all the predicted way: sign test 1/32 (Fisher 5/6 vs 0/6: C(6,5)/C(12,5) = 6/792 = 0.0076);
    seed 0 left out → 1/16; predicted less → p_less of 5+ / 0− = 1. A continuous endpoint's
    paired test is its registered paired t on the kept pairs."""
    from analysis.claims import paired_test

    ev = {"name": "stall", "metric": "reward_mean", "reduce": "event", "event": "stall"}
    ev |= {"test": "fisher", "predicted": "greater"}
    idx = pd.MultiIndex.from_product([["T", "C"], range(6)], names=["arm", "seed"])
    vals = pd.Series([1, 1, 1, 1, 1, 0] + [0] * 6, index=idx, dtype=float)
    assert run_endpoint(vals, ev, "T", "C")["p"] == pytest.approx(6 / 792)
    res = paired_test(vals, ev, "T", "C")
    assert res["p_paired"] == 1 / 32
    assert res["paired_test"] == "sign test, 5/6 vs 0/6 runs; discordant pairs 5+ / 0−"
    assert paired_test(vals, ev, "T", "C", frozenset({0}))["p_paired"] == 1 / 16
    assert paired_test(vals, {**ev, "predicted": "less"}, "T", "C")["p_paired"] == 1.0
    cont = PREREG["endpoints"][0]
    x = pd.Series([0.3, 0.5, 0.2, 0.9, 0.1, 0.4, 0.1, 0.2, 0.0, 0.1, 0.3, 0.2], index=idx)
    kept = paired_test(x, cont, "T", "C", frozenset({3}))
    by_hand = paired_t([0.3, 0.5, 0.2, 0.1, 0.4], [0.1, 0.2, 0.0, 0.3, 0.2])
    assert kept["p_paired"] == pytest.approx(by_hand["p"])
    assert paired_test(x.loc[["T"]], cont, "T", "C") == {}  # no control arm: no p


def test_the_committed_clip_confirm_gives_its_paired_numbers():
    """From the committed summary: the primary (stall, failure vs control) 5/6 vs 0/6, all five
    discordant pairs the predicted way: sign test 1/32 = 0.031 beside Fisher's 0.0076; seed
    603's calibrated run did not see its pair's step-1 batch and is the only one marked."""
    from pathlib import Path

    from analysis.claims import broken_pairs, paired_test
    from analysis.runs import load_summary

    root = Path(__file__).resolve().parents[1] / "results"
    prereg = yaml.safe_load((root / "smollm2_clip_confirm" / "prereg.yaml").read_text())
    df = load_summary(root, "smollm2_clip_confirm")
    primary, fix = prereg["endpoints"][0], prereg["endpoints"][3]
    vals = endpoint_values(df, primary)
    tr, ct = prereg["treatment"], prereg["control"]
    assert run_endpoint(vals, primary, tr, ct)["p"] == pytest.approx(0.0075758, rel=1e-4)
    assert paired_test(vals, primary, tr, ct)["p_paired"] == 1 / 32
    assert broken_pairs(df[df.arm.isin([tr, ct])], ct) == {}
    marked = broken_pairs(df[df.arm.isin([fix["treatment"], fix["control"]])], fix["control"])
    assert list(marked) == [(603, "calibrated clip")]
    assert "reward_mean 0.375 vs 0.2812" in marked[(603, "calibrated clip")]


def test_power_simulates_the_registered_event_against_a_naive_reference():
    """Runs that do not learn (32 Bernoulli(0.3) rewards a step, 50 steps): the stall event
    (analysis.events) agrees run by run with a direct reading of its definition (the 10-step
    running mean never rises 0.05 above the steps 1–10 mean), and happens in about two thirds
    of them (a flat run crosses the 0.05 rise about a third of the time); runs whose reward
    rises 0.3 → 0.6 hardly ever stall."""
    from analysis.power import event_rate, reward_runs

    rng = np.random.default_rng(0)
    flat = reward_runs(rng, 300, 50, 32, 0.3, 0.0)
    r = flat.reward_mean.to_numpy().reshape(300, 50)
    rolling = np.stack([r[:, i - 10 : i].mean(1) for i in range(10, 51)], axis=1)
    naive = (rolling.max(1) - r[:, :10].mean(1)) < 0.05
    stall = {"name": "stall", "reduce": "event", "event": "stall"}
    assert event_rate(stall, flat) == pytest.approx(naive.mean())
    assert 0.55 < naive.mean() < 0.77
    assert event_rate(stall, reward_runs(rng, 100, 50, 32, 0.3, 0.3)) < 0.05
    with pytest.raises(ValueError, match="event='loops'; valid: stall, collapse"):
        event_rate({**stall, "event": "loops"}, flat)
    with pytest.raises(ValueError, match=r"base \+ gain=1.2"):
        reward_runs(rng, 1, 50, 32, 0.9, 0.3)


def test_a_caveat_is_printed_beside_the_verdict_and_moves_no_family(tmp_path):
    """results/caveats.yaml annotates a confirmatory row after its runs: same test, same
    verdict, same Holm/BH values; the caveat's text follows the verdict."""
    import shutil
    from pathlib import Path

    from analysis.claims import claims

    src = Path(__file__).resolve().parents[1] / "results" / "smollm2_clip_confirm"
    shutil.copytree(src, tmp_path / "smollm2_clip_confirm")
    plain = claims(tmp_path).set_index("endpoint")
    (tmp_path / "caveats.yaml").write_text(
        yaml.safe_dump({"smollm2_clip_confirm": {"fix, stall": "a design flaw"}})
    )
    noted = claims(tmp_path).set_index("endpoint")
    assert noted.loc["fix, stall", "verdict"] == plain.loc["fix, stall", "verdict"] + (
        "; caveat: a design flaw"
    )
    cols = ["p", "p_holm", "q_bh", "kind", "survives"]
    pd.testing.assert_frame_equal(noted[cols], plain[cols])


def test_the_table_lists_every_registered_experiment_its_rows_where_they_were(tmp_path):
    """Without names, the experiments under the folder whose runs carry a prereg: those the
    claims.csv there shows, in its order, then the new ones by name; a folder without one is
    not an experiment of the table."""
    from analysis.claims import registered

    for exp in ("a", "b", "c", "pilot"):
        (tmp_path / exp).mkdir()
    for exp in ("a", "b", "c"):
        (tmp_path / exp / "prereg.yaml").write_text(yaml.safe_dump(PREREG))
    assert registered(tmp_path) == ["a", "b", "c"]
    pd.DataFrame({"experiment": ["c", "c", "gone", "a"]}).to_csv(tmp_path / "claims.csv")
    assert registered(tmp_path) == ["c", "a", "b"]


USER_PRESET = """# @package _global_
name: own_hypothesis
steps: 4
eval_every: 2
arms:
  long: {rollout.max_new_tokens: 6}
  short: {rollout.max_new_tokens: 4}
prereg:
  claim: longer responses are longer
  source: a user's own hypothesis
  seeds: 2
  treatment: long
  control: short
  endpoints:
    - {name: length, metric: response_len, reduce: window_mean, window: [1, 4],
       test: paired_t, predicted: greater}
    - {name: any reward, metric: reward_mean, reduce: final_any, test: sign,
       predicted: greater}
hydra:
  sweeper:
    params:
      seed: 0,1
      rollout.max_new_tokens: 6,4
"""


def tree_hash(root) -> str:
    """One hash of every file's path and bytes under `root`."""
    import hashlib

    h = hashlib.sha256()
    for p in sorted(q for q in root.rglob("*") if q.is_file()):
        h.update(str(p.relative_to(root)).encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


@pytest.mark.slow
def test_a_users_own_preset_gets_its_claims_and_figure_in_its_own_folder(tmp_path):
    """A preset outside the package (--config-dir), a 2-seed sweep of the tiny model into the
    user's folder, then summarize, claims and figure on that folder: the table and the figure
    are written there, results/ is untouched. Worked by hand: the tiny model never ends a
    response before its cap, so every `long` run's mean length over steps 1-4 is 6 and every
    `short` run's 4; each pair differs by +2 with no spread: t = +inf, p = 0, reproduced in
    sign. Its reward is 0 at every step: no run of either arm has the event (0/2 vs 0/2), the
    sign test has no discordant pair (p = 1): not reproduced."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from analysis import claims, figure, summarize

    root = Path(__file__).resolve().parents[1]
    presets = tmp_path / "presets" / "experiment"
    presets.mkdir(parents=True)
    (presets / "own_hypothesis.yaml").write_text(USER_PRESET)
    mine = tmp_path / "mine"
    before = tree_hash(root / "results")
    tiny = ["model=tiny-llama", "++task.digits=1", "rollout.prompts_per_step=2"]
    tiny += ["rollout.group_size=4", "eval_n=4", "progress=false"]
    cmd = [sys.executable, "-m", "harness.train", "-m", f"--config-dir={presets.parent}"]
    cmd += ["experiment=own_hypothesis", f"hydra.sweep.dir={mine}/own_hypothesis", *tiny]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root)}
    r = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]

    lengths = {}  # the premise, from the raw runs: every response ran to its cap
    for m in sorted((mine / "own_hypothesis").glob("*/metrics.jsonl")):
        steps = [json.loads(line) for line in m.read_text().splitlines()]
        cap = 6 if "max_new_tokens=6" in m.parent.name else 4
        lengths[m.parent.name] = (cap, np.mean([s["response/len"] for s in steps]))
        assert max(s["reward/mean"] for s in steps) == 0.0
    assert len(lengths) == 4 and all(cap == mean for cap, mean in lengths.values())

    summarize.main(["own_hypothesis", "--results", str(mine)])
    with pytest.warns(UserWarning, match="cannot reach p < 0.05"):  # the sign test at 2 seeds
        claims.main(["--results", str(mine)])
    with pytest.warns(UserWarning, match="cannot reach p < 0.05"):
        figure.main(["--results", str(mine)])
    table = pd.read_csv(mine / "claims.csv").set_index("endpoint")
    length, reward = table.loc["length"], table.loc["any reward"]
    assert (length.treatment_mean, length.control_mean, length["diff"]) == (6.0, 4.0, 2.0)
    assert (length.p, length.verdict, length.kind) == (0.0, "reproduced", "in sign")
    assert reward.stat.startswith("0/2 vs 0/2 runs") and reward.p == 1.0
    assert reward.verdict == "not reproduced: no event in either arm"
    assert "| own_hypothesis | longer responses are longer" in (mine / "claims.md").read_text()
    assert (mine / "own_hypothesis" / "fig_own_hypothesis.png").stat().st_size > 10_000
    assert tree_hash(root / "results") == before
