"""The config tree `experiments/`: presets compose against the schema (every point of their sweep
grid), group files match the registries, and bad input fails at composition or at the start-up
check (`harness.runs.validate.check_nodes`), never on the cluster."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import ConfigCompositionException, MissingConfigException
from omegaconf import OmegaConf, open_dict

from harness import measure as _measure
from harness.noise import NOISE
from harness.objectives import AGGREGATIONS, OBJECTIVES
from harness.runs.config import TrainConfig
from harness.runs.plugins import group_node, registries
from harness.runs.validate import check_nodes, validate
from harness.tasks import TASKS

ROOT = Path(__file__).resolve().parents[1]
EXP = ROOT / "experiments"
# harness.measure's presets: the `measure` group (python -m harness.measure measure=<name>)
MEASURE_PRESETS = sorted(p.stem for p in (EXP / "measure").glob("*.yaml"))
MODEL_SPECS = {"task-model", "smollm2-135m", "tiny-llama", "tiny-moe"}  # ModelCfg.spec names
# a file named _* in the experiment group is a base the presets inherit, not a preset
PRESETS = sorted(p.stem for p in (EXP / "experiment").glob("*.yaml") if not p.stem.startswith("_"))
GROUPS = {
    "task": set(TASKS),
    "noise": set(NOISE) | {"none"},
    "objective": set(OBJECTIVES),
    "aggregation": set(AGGREGATIONS),
    "model": MODEL_SPECS,
}
REQUIRED = {("task", "hf"): ["task.path=data.jsonl"]}  # options with a mandatory value


def load(config_name: str, overrides: list[str], tmp: Path):
    """Compose like `python -m harness.<job> overrides`, resolve and convert to the schema."""
    with initialize_config_dir(config_dir=str(EXP), version_base="1.3"):
        cfg = compose(config_name, overrides=overrides, return_hydra_config=True)
    cfg.hydra.runtime.output_dir = str(tmp)  # what ${hydra:runtime.output_dir} resolves to
    HydraConfig.instance().set_config(cfg)
    with open_dict(cfg):
        params = cfg.hydra.sweeper.params
        sweep = OmegaConf.to_container(params) if params is not None else {}
        del cfg["hydra"]
    return cfg, OmegaConf.to_object(cfg), sweep


def grid(sweep: dict) -> list[list[str]]:
    """Points of a `hydra.sweeper.params` grid as override lists: the full product of the group
    axes (they select config files) × each value of each other axis once (seeds: the first)."""
    parsed = OverridesParser.create().parse_overrides([f"{k}={v}" for k, v in sweep.items()])
    groups, values = [], []
    for o in parsed:
        vals = list(o.sweep_string_iterator()) if o.is_sweep_override() else [o.value()]
        key = o.get_key_element()
        axis = [f"{key}={v}" for v in vals[: 1 if key == "seed" else None]]
        (groups if key in GROUPS else values).append(axis)
    firsts = [a[0] for a in values]
    variants = [firsts] + [
        firsts[:i] + [v] + firsts[i + 1 :] for i, a in enumerate(values) for v in a[1:]
    ]
    return [[*g, *v] for g in itertools.product(*groups) for v in variants]


def test_every_preset_exists():
    assert set(MEASURE_PRESETS) == {
        "noise_anatomy",
        "snr_table",
        "real_engine_beta",
        "real_engine_beta_vllm",
        "precision_beta",
    }
    assert set(PRESETS) == {
        "collapse_reject_vs_clamp",
        "fp8_entropy_surge",
        "opsd_repetition",
        "nsr_vs_decay",
        "phase_diagram",
        "alpha_calibration",
        "cis_vs_tis",
        "collapse_drivers",
        "fp8_full_pipeline",
        "surge_pilot",
        "surge_confirm",
        "surge_position",
        "nsr_confirm",
        "collapse_confirm",
        "collapse_pilot",
        "opsd_long_pilot",
        "opsd_long_topp",
        "nsr_dose",
        "cis_dose",
        "smollm2_surge_pilot",
        "smollm2_clip_confirm",
        "smollm2_collapse_pilot",
        "smollm2_collapse_confirm",
        "smollm2_collapse_dose_pilot",
        "smollm2_opsd_pilot",
        "smollm2_opsd_confirm",
        "smollm2_clip_dissect",
        "smollm2_fp8_full_pilot",
    }
    for name in PRESETS:
        assert (EXP / "experiment" / f"{name}.yaml").read_text().startswith("# @package _global_")
    for name in MEASURE_PRESETS:
        assert (EXP / "measure" / f"{name}.yaml").read_text().startswith("# @package _global_")


@pytest.mark.parametrize("name", PRESETS + MEASURE_PRESETS)
def test_preset_composes_over_its_grid(name, tmp_path):
    job = "measure" if name in MEASURE_PRESETS else "train"
    group = "measure" if job == "measure" else "experiment"  # the presets' config group
    cfg, obj, sweep = load(job, [f"{group}={name}"], tmp_path)
    assert cfg.name == name and cfg.out == str(tmp_path)
    assert sweep, f"{name}: no hydra.sweeper.params grid"
    assert isinstance(obj, TrainConfig if job == "train" else _measure.MeasureConfig)
    if job == "train" and cfg.prereg:  # a registered comparison (not a table, not a pilot)
        seeds = OverridesParser.create().parse_overrides([f"seed={sweep['seed']}"])[0]
        assert len(list(seeds.sweep_string_iterator())) >= 3, f"{name}: fewer than 3 seeds"
    for point in grid(sweep):
        cfg, _, _ = load(job, [f"{group}={name}", *point], tmp_path)
        check_nodes(cfg)  # what every job runs first: kwargs and types against the builders
        if job == "measure":
            validate(cfg, job=_measure.check_measure)


@pytest.mark.parametrize("group", sorted(GROUPS))
def test_group_options_match_registry(group, tmp_path):
    """Every registry name is an option of its group: a file of its own name where it sets more
    than the name (task=hf's required path; the task files harness.tasks.warmstart composes
    below harness.runs), else the registry's own entry (harness.runs.plugins.store_groups). Every
    other file is (noise only) an instance of a registered noise that harness.stats.fit_noise
    wrote (its header says so), or noise=none."""
    files = {p.stem: p for p in (EXP / group).glob("*.yaml")}
    fitted = {
        s for s, p in files.items() if "(harness.stats.fit_noise)" in p.read_text().split("\n")[0]
    }
    assert group == "noise" or not fitted
    assert set(files) - fitted <= GROUPS[group]
    for option in sorted(fitted):
        node = load("train", [f"{group}={option}"], tmp_path)[0][group]
        assert node.name in GROUPS[group], f"{option}: name {node.name!r} is not a noise model"
    for option in sorted(GROUPS[group]):
        cfg, _, _ = load(
            "train", [f"{group}={option}", *REQUIRED.get((group, option), [])], tmp_path
        )
        check_nodes(cfg)
        node = cfg[group]
        if group == "model":
            assert node.spec == option
        else:
            assert node.name == option


@pytest.mark.parametrize("group", ["objective", "aggregation", "noise"])
def test_no_group_file_restates_the_registry(group):
    """One source of truth: the registry gives each name its option (`plugins.group_node`: the
    name, and for a noise with a seed `seed: ${seed}`), so no file under experiments/<group>/
    says only that; the keyword defaults are the builder's signature."""
    table = registries()[group]
    for path in sorted((EXP / group).glob("*.yaml")):
        node = OmegaConf.to_container(OmegaConf.load(path))  # unresolved: ${seed} stays a string
        if path.stem in table:
            assert node != group_node(group, path.stem, table[path.stem]), path


def test_noise_files_state_only_what_differs_from_the_builder():
    """A noise file names its builder, links the noise seed to the run seed (so arms paired by
    seed share one noise field) and states only values that differ from the builder's
    signature: a fitted σ (harness.stats.fit_noise) is a value, a restated default is a second
    source of truth."""
    import inspect

    from harness.noise import NOISE

    for path in sorted((EXP / "noise").glob("*.yaml")):
        node = OmegaConf.to_container(OmegaConf.load(path))  # unresolved: ${seed} stays a string
        name = node.pop("name")
        if name == "none":
            assert node == {}, path
            continue
        params = inspect.signature(NOISE[name]).parameters
        if "seed" in params:
            assert node.pop("seed") == "${seed}", path
        for key, value in node.items():
            assert key in params, (path, key)
            assert value != params[key].default, f"{path}: {key}={value!r} restates the default"


@pytest.mark.parametrize(
    "job, overrides, key, option",
    [
        ("train", ["noise.name=logit", "noise.sigma=0.3"], "noise.name", "noise=logit"),
        ("train", ["objective.name=cispo"], "objective.name", "objective=cispo"),
        (
            "train",
            ["aggregation.name=seq-mean-token-mean"],
            "aggregation.name",
            "aggregation=seq-mean-token-mean",
        ),
        ("train", ["task.name=countdown"], "task.name", "task=countdown"),
        (
            "train",
            ["experiment=collapse_reject_vs_clamp", "objective.name=band"],
            "objective.name",
            "objective=band",
        ),
        ("measure", ["noise.name=logit"], "noise.name", "noise=logit"),
    ],
)
def test_a_group_name_set_as_a_key_is_refused_naming_the_group_choice(
    job, overrides, key, option, tmp_path
):
    """`noise.name=logit` renames the node of the file chosen (noise=none) and so skips
    logit.yaml's keys (its `seed: ${seed}`: every run would draw the noise field of seed 0):
    refused before compute, naming the key, the value and the group choice to use."""
    cfg, _, _ = load(job, overrides, tmp_path)
    with pytest.raises(ValueError, match=rf"{key}=.*; use {option} \(the group choice\)"):
        check_nodes(cfg)


@pytest.mark.parametrize(
    "job, overrides",
    [
        ("train", ["noise=logit", "noise.name=logit"]),
        ("train", ["noise=ct2_int8_smollm2"]),
        ("train", ["objective=cispo", "objective.lo=0.3"]),
        ("measure", []),
        ("measure", ["noise=fp8"]),
    ],
)
def test_a_group_choice_passes_the_name_check(job, overrides, tmp_path):
    """A file whose stem is not its builder's name (a fitted noise, measure's default
    fp8_block_w8a8) and a name restated as the chosen file's own both pass."""
    cfg, _, _ = load(job, overrides, tmp_path)
    check_nodes(cfg)


def test_docs_choose_swept_axes_as_groups():
    """The README's and the docs' commands choose a swept axis as `noise=logit`, never by
    `noise.name=` (which the start-up check refuses)."""
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    pattern = re.compile(r"\b(task|noise|objective|aggregation)\.name=")
    hits = [
        f"{p.name}:{i}"
        for p in docs
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert hits == []


@pytest.mark.parametrize("name", sorted(set(OBJECTIVES) - {"opsd_fkl"}))
def test_an_objective_trains_the_loss_harness_measure_builds(name, tmp_path):
    """`objective=X` trains with the aggregation X's builder defaults to (gspo:
    seq-mean-token-mean, each sequence's token mean averaged over sequences, as GSPO and verl
    aggregate), the loss harness.measure builds for objective=X (`build_objective(X)`):
    equal on a batch of ragged lengths, where token-mean and seq-mean-token-mean differ."""
    import torch

    from harness.objectives import build_objective
    from harness.runs.access import train_objective
    from tests.test_objectives import random_batch

    cfg, _, _ = load("train", [f"objective={name}"], tmp_path)
    logp, batch = random_batch()
    losses = []
    for obj in (train_objective(cfg), build_objective(name)):
        torch.manual_seed(0)  # nsr draws its rescues
        losses.append(obj(logp, batch).loss.item())
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)


def test_an_aggregation_chosen_on_the_command_line_replaces_the_objectives_own(tmp_path):
    cfg, _, _ = load("train", ["objective=gspo"], tmp_path)
    assert cfg.aggregation == {"name": "seq-mean-token-mean"}
    cfg, _, _ = load("train", ["objective=gspo", "aggregation=token-mean"], tmp_path)
    assert cfg.aggregation == {"name": "token-mean"}
    cfg, _, _ = load("train", ["aggregation=seq-mean-token-sum-norm", "objective=gspo"], tmp_path)
    assert cfg.aggregation == {"name": "seq-mean-token-sum-norm"}
    cfg, _, _ = load("train", ["experiment=collapse_reject_vs_clamp", "objective=gspo"], tmp_path)
    assert cfg.aggregation == {"name": "seq-mean-token-mean"}


def test_swept_nodes_take_keys_without_a_plus(tmp_path):
    cfg, _, _ = load(
        "train",
        [
            "objective=cispo",
            "objective.lo=0.3",
            "task.digits=3",
            "noise=logit",
            "noise.sigma=0.2",
            "aggregation=seq-mean-token-sum-norm",
            "aggregation.norm_len=24",
            "model.warmstart.steps=5",
        ],
        tmp_path,
    )
    check_nodes(cfg)
    assert cfg.objective.lo == 0.3 and cfg.task.digits == 3 and cfg.noise.sigma == 0.2
    assert cfg.aggregation == {"name": "seq-mean-token-sum-norm", "norm_len": 24}
    assert cfg.model.warmstart.steps == 5


def test_launchers_compose(tmp_path):
    with initialize_config_dir(config_dir=str(EXP), version_base="1.3"):
        cfg = compose("train", ["hydra/launcher=slurm"], return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    assert launcher.max_num_timeout > 0 and launcher.partition
    assert cfg.hydra.callbacks.slurm_guard._target_ == "harness.runs.launch.SlurmGuard"
    with initialize_config_dir(config_dir=str(EXP), version_base="1.3"):
        cfg = compose("train", ["hydra/launcher=submitit_local"], return_hydra_config=True)
    assert cfg.hydra.launcher._target_.endswith("LocalLauncher")
    assert cfg.hydra.launcher.cpus_per_task is None  # submitit's own local launcher
    with initialize_config_dir(config_dir=str(EXP), version_base="1.3"):
        cfg = compose("train", [], return_hydra_config=True)  # the default: one run per core
    assert cfg.hydra.launcher._target_ == "hydra_plugins.ratiolab_launcher.LocalLauncher"
    assert cfg.hydra.launcher.threads == 1 and cfg.hydra.launcher.n_jobs is None
    with initialize_config_dir(config_dir=str(EXP), version_base="1.3"):
        cfg = compose("train", ["hydra/launcher=slurm"], return_hydra_config=True)
    assert cfg.hydra.launcher.cpus_per_task == 1


@pytest.mark.parametrize("noise", ["logit", "layer", "batch", "routing", "position"])
def test_the_noise_field_follows_the_run_seed(noise, tmp_path):
    """Arms paired by seed share a noise field; different seeds draw different fields (the
    builders' default seed, 0, would give every run one field); noise.seed=<n> still pins it."""
    with initialize_config_dir(config_dir=str(EXP), version_base="1.3"):
        a = compose("train", [f"noise={noise}", "seed=3", f"out={tmp_path}"])
        b = compose("train", [f"noise={noise}", "seed=3", "noise.seed=7", f"out={tmp_path}"])
    assert a.noise.seed == 3 and b.noise.seed == 7


@pytest.mark.parametrize(
    "override, valid",
    [("objective=cispoo", "cispo"), ("noise=gauss", "logit"), ("experiment=collapse", "phase")],
)
def test_unknown_option_lists_the_valid_ones(override, valid, tmp_path):
    with pytest.raises(MissingConfigException) as e:
        load("train", [override], tmp_path)
    assert valid in str(e.value)


@pytest.mark.parametrize(
    "overrides",
    [["steps=ten"], ["stepz=10"], ["rollout.group_size=1.5"], ["engine.kv_cache=maybe"]],
)
def test_schema_rejects_typos_and_types_at_compose(overrides, tmp_path):
    with pytest.raises(ConfigCompositionException):
        load("train", overrides, tmp_path)


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["objective=cispo", "+objective.eps_lowe=0.1"], r"unknown argument.*eps_lowe.*valid"),
        (["objective=cispo", "objective.hi=big"], r"wrong type.*hi"),
        (["noise=logit", "noise.sigma=true"], r"wrong type.*sigma"),
        (["noise=logit", "+noise.sigmaa=0.1"], r"unknown argument.*sigmaa"),
        (["task=arithmetic", "+task.digit=3"], r"unknown argument.*digit"),
        (["+extra_noise=[{name: fp9}]"], r"unknown noise 'fp9'; valid: batch, fp8"),
        (["aggregation.norm_len=3"], r"aggregation 'token-mean': unknown argument.*norm_len"),
        (["aggregation.denominator=1"], r"unknown key.*denominator.*rejected_in_denominator"),
    ],
)
def test_node_typos_fail_before_compute(overrides, match, tmp_path):
    cfg, _, _ = load("train", overrides, tmp_path)
    with pytest.raises((TypeError, KeyError), match=match):
        check_nodes(cfg)


def test_run_names_are_hashed_when_long_and_never_hold_out_or_progress(tmp_path):
    from harness.runs.config import RUN_NAME_MAX, run_name

    assert run_name("objective=cispo,seed=1") == "objective=cispo,seed=1"
    assert run_name("model.spec=Qwen/Qwen2.5-0.5B,seed=1") == "model.spec=Qwen_Qwen2.5-0.5B,seed=1"
    long = ",".join(f"rollout.group_size={i}" for i in range(40))
    name = run_name(long)
    assert len(name) <= RUN_NAME_MAX and name.startswith(long[:40]) and name == run_name(long)
    assert set(name[:-11].split(",")) <= set(long.split(","))  # whole items, none cut
    assert run_name(long + "0") != name
    seeded = run_name(f"noise.sigma=1.5,objective.lo=0.5,optim.lr=0.0004,{long},seed=1207")
    assert len(seeded) <= RUN_NAME_MAX and seeded.startswith("noise.sigma=1.5,objective.lo=0.5")
    assert seeded[:-11].endswith(",seed=1207")  # the seed whole, before the hash of the rest
    overrides = [f"+task.k{i}={i}" for i in range(30)] + ["out=/tmp/x", "progress=false"]
    with initialize_config_dir(config_dir=str(EXP), version_base="1.3"):
        cfg = compose("train", overrides=overrides, return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)
    dirname = cfg.hydra.job.override_dirname
    assert "out=" not in dirname and "progress" not in dirname
    run_dir = OmegaConf.to_container(cfg.hydra.run, resolve=True)["dir"]
    assert len(Path(run_dir).name) <= RUN_NAME_MAX


def test_sweep_folders_keep_the_keys_the_sweep_varies_whole(tmp_path):
    """`-m objective=band,cispo objective.lo=0.5` with a long command line: each folder names its
    objective whole (the sweep's axis, from the driver's SweepAxes callback) and the seed, with a
    hash of the rest; a constant key is hashed, never cut mid-key."""
    from hydra._internal.callbacks import Callbacks
    from hydra.core.global_hydra import GlobalHydra
    from hydra.types import RunMode

    from harness.runs.presubmit import sweep_points

    tiny = ["model=tiny-llama", "++task.digits=1", "rollout.prompts_per_step=2", "eval_n=4"]
    tiny += ["rollout.group_size=4", "rollout.max_new_tokens=6", "engine.device=cpu"]
    sweep = [*tiny, "objective=band,cispo", "objective.lo=0.5", "seed=0"]
    with initialize_config_dir(config_dir=str(EXP), version_base="1.3"):
        loader = GlobalHydra.instance().config_loader()
        cfg = loader.load_configuration("train", sweep, run_mode=RunMode.MULTIRUN)
        Callbacks(cfg).on_multirun_start(config=cfg)  # on the driver, as `-m` calls it
        jobs = [loader.load_sweep_config(cfg, point) for point in sweep_points(cfg)]
    names = [OmegaConf.select(job, "hydra.sweep.subdir") for job in jobs]
    assert len(jobs[0].hydra.job.override_dirname) > 80  # long: the name is shortened
    assert [n[:-11] for n in names] == ["objective=band,seed=0", "objective=cispo,seed=0"]
    assert all(re.fullmatch(r"-[0-9a-f]{10}", n[-11:]) for n in names)


@pytest.mark.parametrize(
    "overrides, out",
    [
        ([], "results/measure/"),
        (["model=tiny-llama"], "results/measure/model=tiny-llama"),
        (["model=tiny-llama", "force=true", "progress=true"], "results/measure/model=tiny-llama"),
    ],
)
def test_measure_writes_to_a_folder_named_after_its_overrides(overrides, out):
    with initialize_config_dir(config_dir=str(EXP), version_base="1.3"):
        cfg = compose("measure", overrides=overrides, return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)
    assert cfg.out == out


TRAIN_PRESETS = [p for p in PRESETS if p not in MEASURE_PRESETS] + [
    f"gpu/{p.stem}"
    for p in sorted((EXP / "experiment" / "gpu").glob("*.yaml"))
    if not p.stem.startswith("_") and p.stem not in MEASURE_PRESETS
]


def full_grid(sweep: dict) -> list[list[str]]:
    """Every point of a `hydra.sweeper.params` grid (seeds: the first), as override lists."""
    parsed = OverridesParser.create().parse_overrides([f"{k}={v}" for k, v in sweep.items()])
    axes = []
    for o in parsed:
        vals = list(o.sweep_string_iterator()) if o.is_sweep_override() else [o.value()]
        key = o.get_key_element()
        axes.append([f"{key}={v}" for v in vals[: 1 if key == "seed" else None]])
    return [list(p) for p in itertools.product(*axes)]


def as_override(key: str, value) -> str:
    """An arm's value as a command-line override; a name (`objective.name: X`) as the group
    choice `objective=X`, as a user chooses it."""
    text = "null" if value is None else str(value).lower() if isinstance(value, bool) else value
    group, _, leaf = key.rpartition(".")
    return f"{group}={text}" if leaf == "name" and group in GROUPS else f"{key}={text}"


@pytest.mark.parametrize("name", TRAIN_PRESETS)
def test_arms_are_declared_once_and_name_every_run(name, tmp_path):
    """Each arm's label is declared once, in its preset (`arms`: label -> the config values, as
    dotted keys, that select it; analysis.runs.arm_label reads it). The pre-registration's
    treatment and control are declared arms; every point of the sweep grid is exactly one arm;
    an arm's own values set on the preset make a run that arm_label names by that arm (no arm
    listed before it takes the run)."""
    from analysis.runs import arm_label, matching_arms

    extra = ["task.path=/data/x.jsonl"] if name.startswith("gpu/") else []
    cfg, _, sweep = load("train", [f"experiment={name}", *extra], tmp_path)
    arms, prereg = OmegaConf.to_container(cfg.arms), OmegaConf.to_container(cfg.prereg)
    if not arms:
        assert not prereg, f"{name}: pre-registered arms must be declared in `arms`"
        return
    if prereg:
        assert {prereg["treatment"], prereg["control"]} <= set(arms), name
    for point in full_grid(sweep):
        run, _, _ = load("train", [f"experiment={name}", *extra, *point], tmp_path)
        matched = matching_arms(OmegaConf.to_container(run, resolve=True), arms)
        assert len(matched) == 1, f"{name} {point}: arms {matched}"
    for label, values in arms.items():
        overrides = [as_override(k, v) for k, v in values.items()]
        run, _, _ = load("train", [f"experiment={name}", *extra, *overrides], tmp_path)
        assert arm_label(cfg.name, OmegaConf.to_container(run, resolve=True)) == label, overrides


@pytest.mark.parametrize("name", ["opsd_long_pilot", "opsd_long_topp"])
def test_opsd_long_presets_use_the_shipped_opsd_long_model(name, tmp_path):
    """The long-response OPSD testbed's recipe (the preset's model.warmstart) is the shipped
    `opsd-long` model's: no 41-minute build on a fresh machine."""
    from harness.tasks.warmstart import recipe_hash, resolve_recipe, shipped_manifest

    cfg, _, _ = load("train", [f"experiment={name}"], tmp_path)
    recipe = resolve_recipe(cfg.task.name, **OmegaConf.to_container(cfg.model.warmstart))
    assert shipped_manifest()[recipe_hash(recipe)]["name"] == "opsd-long"
