"""The GPU presets (`experiments/experiment/gpu/`, `experiments/measure/gpu/`): composition
only, on the CPU, no model loaded. Each composes over its sweep grid, asks for a real model in
bf16 on CUDA with a JSONL task whose path the user supplies, keeps its CPU preset's name
(results/gpu/<name>/, so analysis/ labels the arms as for the CPU runs) and pre-registration
shape, passes the harness's no-model start-up checks with engine.device=cpu (the presets say
cuda: a CPU machine would fail there, which is the point of cuda), and composes with the Slurm
GPU launcher (hydra/launcher=slurm_gpu) and the one-GPU local sweep."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf
from omegaconf.errors import MissingMandatoryValue
from test_configs import EXP, MODEL_SPECS, grid, load

from harness.noise import build_noise
from harness.runs.config import TrainConfig
from harness.runs.prereg import check_prereg

GPU = EXP / "experiment" / "gpu"
BASE = GPU / "_base.yaml"  # the GPU scale the training presets inherit: not a preset
TRAIN = sorted(p.stem for p in GPU.glob("*.yaml") if not p.stem.startswith("_"))
MEASURE = sorted(p.stem for p in (EXP / "measure" / "gpu").glob("*.yaml"))  # measure=gpu/<name>
PRESETS = sorted(TRAIN + MEASURE)
DATA = ["task.path=/data/train.jsonl", "engine.device=cpu"]  # what a CPU check must supply
ARMS = {  # presets whose arms are separate launcher calls, not a sweep axis
    "fp8_full_pipeline": [
        ["objective=calibrated_clip", "objective.every=5", "objective.ema=0.5"],
        ["objective=ppo_clip"],
    ],
}


def preset(name: str) -> str:
    """The override that selects GPU preset `name`: harness.measure's are the `measure` group."""
    return f"{'measure' if name in MEASURE else 'experiment'}=gpu/{name}"


def points(name: str, job: str, tmp: Path) -> list[list[str]]:
    """Every override list the preset's runs use (grid × launcher-call arms), as test_configs."""
    extra = DATA if job == "train" else ["engine.device=cpu"]
    _, _, sweep = load(job, [preset(name), *extra], tmp)
    return [[*p, *a] for p in grid(sweep) for a in ARMS.get(name, [[]])]


def launcher(name: str, job: str, overrides: list[str]):
    with initialize_config_dir(config_dir=str(EXP), version_base="1.3"):
        cfg = compose(job, [preset(name), *overrides], return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)
    return OmegaConf.to_container(cfg.hydra, resolve=True)


def test_one_gpu_preset_per_seed_experiment():
    # seeds 000 NSR, 001 SNR (collapse; the SNR table), 002 FP8 (two), 003 OPSD, 004 CIS
    assert set(PRESETS) == {
        "nsr_vs_decay",
        "collapse_reject_vs_clamp",
        "snr_table",
        "fp8_entropy_surge",
        "fp8_full_pipeline",
        "opsd_repetition",
        "cis_vs_tis",
    }
    for name in PRESETS:
        group = EXP / preset(name).split("=")[0]
        assert (group / "gpu" / f"{name}.yaml").read_text().startswith("# @package _global_")
        assert (group / f"{name}.yaml").exists(), f"{name}: no CPU preset"


@pytest.mark.parametrize("name", TRAIN)
def test_train_preset_inherits_the_gpu_base(name, tmp_path):
    """The scale is written once (gpu/_base.yaml): each training preset lists it in its defaults
    and restates none of its keys' values (opsd_repetition's smaller group_size aside)."""
    node = OmegaConf.load(GPU / f"{name}.yaml")
    assert "/experiment/gpu/_base" in node.defaults, name
    assert node.defaults.index("/experiment/gpu/_base") < node.defaults.index("_self_")
    base = OmegaConf.to_container(OmegaConf.load(BASE))
    own = OmegaConf.to_container(node)
    for key in ("model", "steps", "eval_every", "optim", "engine"):
        assert key not in own, f"{name} restates the base's {key}"
    assert set(own.get("rollout", {})) <= {"group_size"}, name
    assert "run" not in own.get("hydra", {}) and "job" not in own.get("hydra", {}), name
    cfg, _, _ = load("train", [f"experiment=gpu/{name}", "task.path=/data/x.jsonl"], tmp_path)
    assert cfg.model.spec == base["model"]["spec"] and cfg.steps == base["steps"]


@pytest.mark.parametrize("name", TRAIN)
def test_train_preset_composes_and_passes_start_up_checks(name, tmp_path):
    from harness.runs.validate import validate

    with pytest.raises(MissingMandatoryValue, match="task.path"):  # the user's data, no default
        load("train", [f"experiment=gpu/{name}"], tmp_path)
    cfg, obj, sweep = load("train", [f"experiment=gpu/{name}", "task.path=/data/x.jsonl"], tmp_path)
    assert isinstance(obj, TrainConfig)
    assert cfg.name == name  # the CPU preset's: analysis.runs.arm_label keys on it
    assert cfg.engine.device == "cuda"
    assert cfg.engine.trainer_dtype == cfg.engine.sampler_dtype == "bf16"
    assert not cfg.engine.tf32
    assert cfg.model.spec not in MODEL_SPECS | {"task-model"} and "/" in cfg.model.spec
    assert cfg.task.name == "hf" and cfg.task.path == "/data/x.jsonl"
    assert 512 <= cfg.rollout.max_new_tokens <= 1024
    assert 100 <= cfg.steps < 1000 and cfg.optim.lr <= 1e-5
    if cfg.noise.name == "fp8":
        assert cfg.noise.kernel == "scaled_mm"
    if name.startswith("fp8_"):
        assert cfg.noise.name == "fp8"
    # the pre-registration: valid, planned on the sweep's seeds, windows inside the run
    prereg = OmegaConf.to_container(cfg.prereg, resolve=True)
    check_prereg(prereg)
    assert prereg["seeds"] == len(str(sweep["seed"]).split(","))
    for ep in prereg["endpoints"]:
        if ep["reduce"] == "window_mean":
            assert 1 <= ep["window"][0] <= ep["window"][1] == cfg.steps, ep["name"]
        if ep["reduce"] == "last_evals":
            assert ep["n"] * cfg.eval_every <= cfg.steps, ep["name"]
    for point in points(name, "train", tmp_path):
        cfg, _, _ = load("train", [f"experiment=gpu/{name}", *DATA, *point], tmp_path)
        validate(cfg)  # every check that needs no model: nodes, sampler, prereg, model spec
        for node in [cfg.noise, *cfg.extra_noise]:  # the constructors' checks (scaled_mm's kwargs)
            kw = OmegaConf.to_container(node, resolve=True)
            if kw.pop("name") != "none":
                build_noise(node.name, **kw)


@pytest.mark.parametrize("name", MEASURE)
def test_measure_preset_composes_and_passes_start_up_checks(name, tmp_path):
    from harness.measure import check_measure
    from harness.runs.access import noise_nodes
    from harness.runs.validate import validate

    cfg, _, _ = load("measure", [preset(name)], tmp_path)
    assert cfg.name == name and cfg.engine.device == "cuda" and not cfg.engine.tf32
    assert cfg.engine.trainer_dtype == cfg.engine.sampler_dtype == "bf16"
    assert cfg.model.spec not in MODEL_SPECS and "/" in cfg.model.spec
    assert 512 <= cfg.rollout.max_new_tokens <= 1024
    for point in points(name, "measure", tmp_path):
        cfg, _, _ = load("measure", [preset(name), "engine.device=cpu", *point], tmp_path)
        validate(cfg, job=check_measure)  # every check that needs no model: nodes, dtypes, device
        nodes = noise_nodes(cfg)
        assert [n["kernel"] for n in nodes if n["name"] == "fp8"] == ["scaled_mm"]
        for n in nodes:
            build_noise(n["name"], **{k: v for k, v in n.items() if k != "name"})


@pytest.mark.parametrize("name", PRESETS)
def test_launchers_for_the_gpu_presets(name):
    job = "measure" if name in MEASURE else "train"
    data = ["task.path=/data/train.jsonl"] if job == "train" else []
    h = launcher(name, job, [*data, "hydra/launcher=slurm_gpu"])
    la = h["launcher"]
    assert la["_target_"].endswith("SlurmLauncher")
    assert la["gpus_per_node"] == 1 and la["gres"] is None
    assert la["cpus_per_task"] == 8 and la["mem_gb"] >= 32 and la["timeout_min"] >= 240
    assert "export OMP_NUM_THREADS=8" in la["setup"] and la["max_num_timeout"] > 0
    assert h["callbacks"]["slurm_guard"]["_target_"] == "harness.runs.launch.SlurmGuard"
    typed = launcher(
        name,
        job,
        [
            *data,
            "hydra/launcher=slurm_gpu",
            "hydra.launcher.gres=gpu:h100:1",
            "hydra.launcher.gpus_per_node=null",
        ],
    )["launcher"]
    assert typed["gres"] == "gpu:h100:1" and typed["gpus_per_node"] is None
    # one GPU, no Slurm: the local launcher one run at a time
    la = launcher(name, job, [*data, "hydra/launcher=local", "hydra.launcher.n_jobs=1"])["launcher"]
    assert la["_target_"].endswith("ratiolab_launcher.LocalLauncher") and la["n_jobs"] == 1
    # the presets leave the launcher to the command line (train.yaml's override wins over theirs)
    assert launcher(name, job, data)["launcher"]["_target_"].endswith("LocalLauncher")


@pytest.mark.parametrize("name", PRESETS)
def test_run_folders_are_flat_under_results_gpu(name):
    """Data paths and hub ids hold a "/": they are kept out of the run folder's name."""
    job = "measure" if name in MEASURE else "train"
    data = ["task.path=/data/train.jsonl", "task.eval_path=/data/test.jsonl"]
    h = launcher(name, job, [*(data if job == "train" else []), "model.spec=Org/Model", "seed=1"])
    assert h["sweep"]["dir"] == f"results/gpu/{name}"
    assert "/" not in h["sweep"]["subdir"] and h["sweep"]["subdir"] == "seed=1"
    assert h["run"]["dir"] == f"results/gpu/{name}/seed=1"


def test_real_fp8_entropy_surge_arms_are_told_apart(tmp_path):
    """The GPU preset's two arms (real FP8 GEMMs, std clip) differ only in π_old's source: the
    analysis must label them as the pre-registration names them, from the arms the run's config
    declares or (a run made before configs held them) the CPU preset's."""
    from analysis.runs import arm_label

    for source, label in [
        ("sampler", "π_old := μ (std clip)"),
        ("trainer", "π_old recomputed (std clip)"),
    ]:
        overrides = [
            "experiment=gpu/fp8_entropy_surge",
            "task.path=/data/x.jsonl",
            f"engine.logp_old_source={source}",
        ]
        run = OmegaConf.to_container(load("train", overrides, tmp_path)[0], resolve=True)
        assert arm_label("fp8_entropy_surge", run) == label
        del run["arms"]
        assert arm_label("fp8_entropy_surge", run) == label
