"""A researcher's own rule, defined in a file outside the checkout and named only through
`plugins=`, runs by its name in every process that builds a run (harness.runs.plugins): one run,
a 2-job local sweep, a sweep on Slurm, a 2-rank torchrun with the stock config, harness.measure;
a bad keyword fails before compute naming the valid ones; a changed plugin refuses the resume.
The rule is examples/own_rule/own_rule.py, copied to tmp_path for each test; every run is a
subprocess, so nothing registered here leaks into the rest of the suite."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from harness.runs import plugins
from tests.test_fsdp import STOCK
from tests.test_slurm import cluster, driver, run_driver  # noqa: F401  (cluster: a fixture)

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "own_rule"
TINY = [
    "model=tiny-llama",
    "rollout.prompts_per_step=2",
    "rollout.group_size=2",
    "rollout.max_new_tokens=4",
    "eval_n=4",
    "eval_every=0",
    "steps=2",
    "progress=false",
    "engine.device=cpu",
]


@pytest.fixture
def rule(tmp_path) -> Path:
    """own_rule.py in a folder of its own, outside the checkout."""
    folder = tmp_path / "user"
    folder.mkdir()
    return Path(shutil.copy(EXAMPLE / "own_rule.py", folder))


def env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def run(args: list[str], cwd: Path = REPO, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env(), capture_output=True, text=True, timeout=timeout
    )


def ok(r: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    return r


def train(rule: Path, out: Path, *overrides: str) -> subprocess.CompletedProcess:
    args = ["-m", "harness.train", f"plugins=[{rule}]", "objective=own_clip", f"out={out}"]
    return run([*args, *TINY, *overrides])


# --- the loader --------------------------------------------------------------------------------


def test_from_argv_reads_the_plugins_override_as_hydra_parses_it():
    argv = ["seed=1", "plugins=[a.py,pkg.rules]", "objective=own_clip"]
    assert plugins.from_argv(argv) == ["a.py", "pkg.rules"]
    assert plugins.from_argv(["+plugins=b.py"]) == ["b.py"]
    assert plugins.from_argv(["plugins=a.py,b.py"]) == ["a.py", "b.py"]  # a sweep: every one
    assert plugins.from_argv(["objective=cispo"]) == []


def test_a_missing_file_and_an_import_error_name_the_plugin(tmp_path):
    with pytest.raises(plugins.PluginError, match=r"plugins: '.*nowhere\.py': no such file"):
        plugins.load([str(tmp_path / "nowhere.py")])
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(
        plugins.PluginError, match=r"broken\.py' failed to import: RuntimeError: boom"
    ):
        plugins.load([str(broken)])
    with pytest.raises(plugins.PluginError, match="'no_such_module_xyz' failed to import"):
        plugins.load(["no_such_module_xyz"])


# --- the acceptance runs -----------------------------------------------------------------------


def test_one_run_uses_the_rule_its_window_and_records_its_hash(rule, tmp_path):
    """objective=own_clip with its own keyword names: the mechanism check measures π_old/μ
    against the window the rule declares ([low, high] = [0.7, 1.5], not the reference [0.8,
    1.28]); meta.json records the plugin's file and sha256."""
    out = tmp_path / "run"
    ok(train(rule, out, "objective.low=0.7", "objective.high=1.5"))
    assert OmegaConf.load(out / "config.yaml").objective == {
        "name": "own_clip",
        "low": 0.7,
        "high": 1.5,
    }
    assert json.loads((out / "mechanism.json").read_text())["clip"] == [0.7, 1.5]
    [record] = json.loads((out / "meta.json").read_text())["plugins"]
    assert record["file"] == str(rule.resolve())
    assert record["sha256"] == hashlib.sha256(rule.read_bytes()).hexdigest()
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2


def test_a_changed_plugin_refuses_the_resume(rule, tmp_path):
    out = tmp_path / "run"
    ok(train(rule, out))
    before = hashlib.sha256(rule.read_bytes()).hexdigest()
    rule.write_text(rule.read_text().replace("low: float = 0.5", "low: float = 0.6"))
    r = train(rule, out, "steps=3")
    assert r.returncode != 0
    assert f"different config or plugin code (plugin {rule.resolve()}: '{before}' -> '" in r.stderr
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2  # nothing ran


def test_an_installed_plugin_s_entry_point_needs_no_key(rule, tmp_path):
    """A distribution that declares `[project.entry-points."ratiolab.plugins"]` is imported in
    every process without `plugins=`: here a dist-info folder beside the module on the path."""
    site = rule.parent
    info = site / "own_rule-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: own-rule\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[ratiolab.plugins]\nown = own_rule\n")
    out = tmp_path / "run"
    args = ["-m", "harness.train", "objective=own_clip", "objective.high=1.5", f"out={out}"]
    r = subprocess.run(
        [sys.executable, *args, *TINY],
        cwd=REPO,
        env={**env(), "PYTHONPATH": f"{REPO}{os.pathsep}{site}"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    ok(r)
    [record] = json.loads((out / "meta.json").read_text())["plugins"]
    assert record["plugin"] == "own_rule" and record["file"] == str(rule.resolve())


def test_a_bad_keyword_fails_before_compute_naming_the_valid_ones(rule, tmp_path):
    out = tmp_path / "run"
    r = train(rule, out, "objective.hgh=1.5")
    assert r.returncode != 0
    assert "objective 'own_clip': unknown argument(s) ['hgh']" in r.stderr
    assert "valid: ['low', 'high', 'aggregation']" in r.stderr
    assert not (out / "mechanism.json").exists() and not (out / "meta.json").exists()


@pytest.mark.slow
def test_a_two_job_local_sweep(rule, tmp_path):
    """The local launcher's spawned workers import the plugin from the composed config."""
    sweep = tmp_path / "sweep"
    args = ["-m", "harness.train", "-m", f"plugins=[{rule}]", "objective=own_clip"]
    args += ["objective.high=1.5,1.8", f"hydra.sweep.dir={sweep}", "hydra.launcher.n_jobs=2"]
    ok(run([*args, *TINY]))
    configs = sorted(sweep.glob("*/config.yaml"))
    assert [OmegaConf.load(c).objective.high for c in configs] == [1.5, 1.8]
    assert all(json.loads((c.parent / "meta.json").read_text())["plugins"] for c in configs)


def test_a_two_rank_torchrun_with_the_stock_config(rule, tmp_path):
    """Each rank composes from its own command line: the plugin is imported before Hydra."""
    out = tmp_path / "two"
    port = str(29500 + os.getpid() % 2000)
    args = ["-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}"]
    args += ["-m", "harness.train", f"plugins=[{rule}]", "objective=own_clip", f"out={out}"]
    ok(run([*args, *STOCK, f"hydra.run.dir={tmp_path / 'hydra'}"]))
    assert OmegaConf.load(out / "config.yaml").objective.name == "own_clip"
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [
        1,
        2,
    ]


def test_harness_measure_takes_the_rule_as_its_live_steps_loss(rule, tmp_path):
    out = tmp_path / "measure"
    args = ["-m", "harness.measure", f"plugins=[{rule}]", "objective=own_clip", f"out={out}"]
    args += ["model=tiny-llama", "rollout.group_size=2", "rollout.max_new_tokens=8"]
    args += ["measurement.amp_rows=2", "engine.device=cpu", "noise=temperature_skew"]
    args += ["live.mode=steps", "live.steps=1"]
    ok(run(args))
    summary = json.loads((out / "summary.json").read_text())
    assert summary  # the tables were computed
    cfg = OmegaConf.load(out / ".hydra" / "config.yaml")
    assert cfg.objective.name == "own_clip" and cfg.noise.name == "temperature_skew"


@pytest.mark.slurm
def test_a_sweep_on_slurm(cluster, rule, tmp_path):  # noqa: F811  (the fixture)
    """submitit's jobs import the plugin from the composed config (run_task)."""
    r = run_driver(
        driver(tmp_path, f"plugins=[{rule}]", "objective=own_clip", "seed=0,1", steps=2), 300
    )
    assert r.returncode == 0, r.stdout + r.stderr
    # the driver's own exclude_keys leave plugins=[<path>] in the folder names: a tree
    configs = sorted(p.parent / "config.yaml" for p in tmp_path.rglob("metrics.jsonl"))
    assert [OmegaConf.load(c).seed for c in configs] == [0, 1]
    assert {OmegaConf.load(c).objective.name for c in configs} == {"own_clip"}


# --- the example as a user meets it ------------------------------------------------------------


def test_the_example_s_own_tests_pass_in_a_copy_outside_the_checkout(tmp_path):
    """`python -m pytest .` in a copy of examples/own_rule (its worked values)."""
    user = Path(shutil.copytree(EXAMPLE, tmp_path / "own_rule"))
    r = run(["-m", "pytest", "-q", "-p", "no:cacheprovider", "."], cwd=user)
    assert r.returncode == 0 and "4 passed" in r.stdout, r.stdout[-3000:]


@pytest.mark.slow
def test_the_example_s_preset_runs_a_two_seed_sweep_into_the_user_s_folder(tmp_path):
    """The docs' commands (docs/own-hypothesis.md), shrunk: both arms × 2 seeds land under the
    user's results/, each run labelled by the preset's arms; its claims table and figure are
    written there, and the checkout's results/ is left as it was."""
    user = Path(shutil.copytree(EXAMPLE, tmp_path / "own_rule"))
    args = ["-m", "harness.train", "-m", "--config-dir", ".", "experiment=own_clip_vs_clamp"]
    args += ["plugins=[own_rule.py]", *[t for t in TINY if not t.startswith("eval_every")]]
    ok(run([*args, "eval_every=1"], cwd=user))
    runs = sorted(p.parent.name.split("-")[0] for p in user.glob("results/*/*/config.yaml"))
    assert runs == [f"objective={o},seed={s}" for o in ("cispo_folded", "own_clip") for s in (0, 1)]
    ok(run(["-m", "analysis.summarize", "own_clip_vs_clamp", "--results", "results"], cwd=user))
    import pandas as pd

    summary = pd.read_csv(user / "results" / "own_clip_vs_clamp" / "summary.csv")
    arms = summary[["arm", "seed"]].drop_duplicates().sort_values(["arm", "seed"])
    assert arms.values.tolist() == [
        ["clamp (CISPO [0.5, 2])", 0],
        ["clamp (CISPO [0.5, 2])", 1],
        ["own clip [0.5, 2]", 0],
        ["own clip [0.5, 2]", 1],
    ]
    claims = hashlib.sha256((REPO / "results" / "claims.md").read_bytes()).hexdigest()
    for job in ("analysis.claims", "analysis.figure"):
        ok(run(["-m", job, "--results", "results"], cwd=user))
    table = (user / "results" / "claims.md").read_text()
    assert "| own_clip_vs_clamp |" in table
    assert "own clip [0.5, 2] vs clamp (CISPO [0.5, 2])" in table
    assert (user / "results" / "own_clip_vs_clamp" / "fig_own_clip_vs_clamp.png").stat().st_size
    assert hashlib.sha256((REPO / "results" / "claims.md").read_bytes()).hexdigest() == claims
    assert not (REPO / "results" / "own_clip_vs_clamp").exists()
