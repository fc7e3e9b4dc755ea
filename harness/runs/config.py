"""Typed config schema for `python -m harness.train` (Hydra structured config).

Swept axes (task, noise, objective, aggregation) are `{name: <registry key>, **kwargs}` nodes
whose kwargs are spelled like the builder's keyword arguments and checked against its signature
before any compute. Everything else is typed here, so typos and wrong types fail at composition
time.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from harness.tasks import TEACHER_PROMPT


@dataclass
class ModelCfg:
    spec: str = "task-model"  # task-model | smollm2-135m | tiny-llama | tiny-moe | HF path/id
    warmstart: dict[str, Any] = field(default_factory=dict)  # task-model recipe overrides
    upcycle: dict[str, Any] | None = None  # {n_experts, top_k, expert_jitter}: dense -> MoE


@dataclass
class Ct2Cfg:
    # float32: CTranslate2's kernels only (β from kernels); int8_float32 (= int8 on CPU): int8
    # GEMMs on int8 weights and dynamically quantised activations; int16 (harness.sampling.ct2)
    compute_type: str = "float32"


@dataclass
class VllmCfg:
    # vLLM's own Python (its venv; harness.sampling.vllm_engine); null: the venv `make vllm` builds
    python: str | None = None
    start_timeout_s: float = 600.0  # the worker's start-up (model load), then an error
    # GPU nodes only (a CUDA vLLM): the GPU the worker sees (CUDA_VISIBLE_DEVICES; null: the
    # launcher's) and the fraction of its memory vLLM takes (weights + KV cache); the default
    # leaves half of a GPU it shares with the trainer to the trainer
    gpus: str | None = None
    gpu_memory_utilization: float = 0.5


@dataclass
class EngineCfg:
    # μ's inference engine: hf (this process's model) | ct2 (CTranslate2) | vllm (a vLLM worker)
    sampler: str = "hf"
    # where trainer, sampler and teacher run: auto (CUDA when available, else CPU) | cpu | cuda
    # | cuda:N (harness.base.models.resolve_device)
    device: str = "auto"
    tf32: bool = False  # TF32 matmuls for fp32 on CUDA; off: the fp32 path is IEEE fp32 there too
    ct2: Ct2Cfg = field(default_factory=Ct2Cfg)
    vllm: VllmCfg = field(default_factory=VllmCfg)
    # precision (fp32 | bf16 | fp16). The SNR post's precision β (Table 2) is bf16 against bf16
    # across engines: sampler_dtype=bf16 trainer_dtype=bf16 (μ's KV-cache decode vs the trainer's
    # full forward); bf16 against fp32 is the larger mismatch
    sampler_dtype: str = "fp32"
    trainer_dtype: str = "fp32"  # bf16/fp16: computes in it, fp32 master weights (MasterAdamW)
    kv_cache: bool = True  # False: the sampler decodes by full recompute (`kv` difference)
    sampler_attention: str = "sdpa"  # sdpa | eager (`attention` difference)
    mask_replay: bool = True  # trainer replays the sampler's top-p/top-k support
    # MoE routing replay on the trainer's passes, of whose routes: sampler = μ's (R3, Ma et al.,
    # arXiv 2510.11370); trainer = its own, recorded at π_old's weights before π_old is scored
    # (R2, GSPO; one extra forward without grad a step)
    routing_replay: bool = False
    routing_replay_source: str = "sampler"
    logp_old_source: str = "trainer"  # trainer (recompute at behaviour weights) | sampler (μ)
    # full-pipeline FP8 (Calibrated Clipping, arXiv 2609.22870): every trainer-side forward (the
    # gradient pass and the π_old recompute) in the sampler's FP8 recipe (needs noise=fp8),
    # straight-through gradient into the high-precision weights; calibrated clipping's shadow
    # pass and evaluation stay high precision (harness.noise.Fp8Trainer)
    trainer_fp8: bool = False
    # the trainer's passes (π_θ with grad, the π_old recompute, the OPSD teacher) in micro-batches
    # of at most this many tokens: prompt + response tokens of whole sequences, padding not
    # counted; a longer sequence is a micro-batch alone. Gradients accumulate to the one-shot
    # step's (harness.rl.step). null: each minibatch in one pass
    micro_batch_tokens: int | None = None
    # the trainer's gradient pass keeps only each decoder layer's input and recomputes the layer
    # in backward (harness.sampling.engines.checkpoint_layers)
    activation_checkpointing: bool = False
    # shard the trainer with FSDP2 across the ranks of torchrun or a multi-task Slurm job
    # (harness.base.distributed): null shards when there is more than one rank; true also with one
    # (a process group of one: the GPU check's FSDP2 run)
    fsdp: bool | None = None


@dataclass
class RolloutCfg:
    prompts_per_step: int = 16
    group_size: int = 8  # G responses per prompt
    # None: the task's own budget (Task.max_new_tokens: enough for its longest reference
    # solution and EOS); an int caps every rollout and evaluation at that many tokens
    max_new_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0


@dataclass
class AlphaCfg:
    staleness: int = 0  # sampler weights lag the trainer by k optimizer steps
    minibatches: int = 1  # m optimizer steps per rollout batch (minibatch j trains j-1 late)


@dataclass
class OptimCfg:
    lr: float = 1e-4  # task model: 5e-4 collapses eval accuracy within 100 steps
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.99
    grad_clip: float = 1.0


@dataclass
class GuardCfg:
    max_nonfinite: int = 5  # consecutive non-finite losses/gradients before save + abort
    entropy_surge: float = 2.0  # entropy > surge × its first-10-step mean → collapse event
    reward_collapse: float = 0.5  # reward < collapse × its best 10-step mean → collapse event


@dataclass
class DistillCfg:
    enabled: bool = False  # on-policy self-distillation (OPSD) instead of GRPO
    teacher_prompt: str = TEACHER_PROMPT  # warm-start recipes' privileged_frac train on it


@dataclass
class DriversCfg:
    """The feedback loops' drivers: off by default."""

    # β that grows with training: every sampler noise σ (logit, layer) scaled linearly from 1× at
    # step 1 to beta_growth× at the last step, on the same noise field (the SNR post measured
    # fork-bin Var β ~5× at its trained checkpoint); 1: constant β
    beta_growth: float = 1.0
    # an entropy driver: from step `harder_at` on, training prompts come from the task rebuilt
    # with the `harder` kwargs (e.g. {max_number: 20}); the eval set stays the original task's;
    # 0: never
    harder_at: int = 0
    harder: dict[str, Any] = field(default_factory=dict)


@dataclass
class TrainConfig:
    name: str = "default"
    out: str = "results/${name}/run"
    seed: int = 0
    steps: int = 300
    model: ModelCfg = field(default_factory=ModelCfg)
    task: dict[str, Any] = field(default_factory=lambda: {"name": "arithmetic"})
    noise: dict[str, Any] = field(default_factory=lambda: {"name": "none"})  # sampler β
    extra_noise: list[dict[str, Any]] = field(default_factory=list)  # composed after `noise`
    objective: dict[str, Any] = field(default_factory=lambda: {"name": "ppo_clip"})
    aggregation: dict[str, Any] = field(default_factory=lambda: {"name": "token-mean"})
    advantage: str = "grpo"  # grpo (mean/std) | drgrpo (mean only)
    engine: EngineCfg = field(default_factory=EngineCfg)
    rollout: RolloutCfg = field(default_factory=RolloutCfg)
    alpha: AlphaCfg = field(default_factory=AlphaCfg)
    optim: OptimCfg = field(default_factory=OptimCfg)
    guard: GuardCfg = field(default_factory=GuardCfg)
    distill: DistillCfg = field(default_factory=DistillCfg)
    drivers: DriversCfg = field(default_factory=DriversCfg)
    eval_every: int = 25
    eval_n: int = 512
    # the evaluation set (problems and sampling seed) is fixed per task, independent of `seed`,
    # so seed-to-seed variance is the training's, not the eval set's difficulty
    eval_seed: int = 0
    # rollout batches the step-0 mechanism check scores (harness.rl.mechanism; every run writes
    # mechanism.json before step 1); 0: no check
    mechanism_batches: int = 2
    # an experiment's pre-registration, written into its preset before it runs (claim, seeds,
    # arms, endpoints and tests); read by analysis/claims.py from the runs' config.yaml, and part
    # of the resume contract, so it cannot change under a run
    prereg: dict[str, Any] = field(default_factory=dict)
    # the preset's arms: label -> {dotted config key: value} that selects the arm (the legend and
    # the prereg's treatment/control name them); read by analysis.runs.arm_label, outside the
    # resume contract (harness.rl.checkpoint.RESUME_FREE)
    arms: dict[str, Any] = field(default_factory=dict)
    checkpoint_every: int = 50
    keep_checkpoints: int = 2
    # at the end, the trained policy as a plain HF folder <run>/final (safetensors + tokenizer,
    # `model.spec=<run>/final` or any HF tool): off by default, a sweep of SmolLM2 runs would
    # keep 0.5 GB each
    save_final: bool = False
    progress: bool = True  # the tqdm bar, where stderr is a terminal
    # beside metrics.jsonl (always written): none | wandb (offline by default) | tensorboard
    logger: str = "none"
    # a plain line every this many steps when no bar is shown (progress=false, a Slurm log); 0: none
    log_every: int = 10
    # staleness 0, one minibatch: reuse the training pass as π_old instead of a separate
    # recompute (identical values; one forward fewer per step). False forces the recompute.
    reuse_old_logp: bool = True
    # rerunning in a run directory whose config.yaml differs (steps aside): "strict" fails
    # before compute and lists the keys; "override" applies the new values to the restored run
    # (optimizer settings included) and records them in meta.json
    resume: str = "strict"


RUN_NAME_MAX = 80  # characters of an override-derived directory name before it is hashed


def run_name(override_dirname: str, axes: str = "") -> str:
    """A run directory's name from Hydra's override_dirname: as is when short (long override
    lists overflowed the 255-byte name limit), else whole `key=value` items and 10 hex digits of
    the whole name's sha256: the items of `axes` (the comma-separated keys a sweep varies,
    `harness.runs.launch.SweepAxes`; every item outside a sweep) that fit, the seed whole at their
    end (runs are paired by it). So sweep points keep the keys that tell them apart, and no key
    is cut. A "/" in a value (model.spec=Qwen/Qwen2.5-0.5B, task.path=/data/x.jsonl) becomes
    "_", so a run is one folder, not a tree. Used as
    `${run_name:${hydra.job.override_dirname},<axes>}` in the job configs."""
    dirname = override_dirname.replace("/", "_")
    if len(dirname) <= RUN_NAME_MAX:
        return dirname
    tail = "-" + hashlib.sha256(dirname.encode()).hexdigest()[:10]
    varied = set(axes.split(",")) - {""}
    items = dirname.split(",")
    seed = [i for i in items if i.startswith("seed=")]
    kept: list[str] = []
    for item in items:
        if item in seed or (varied and item.split("=", 1)[0].lstrip("+~") not in varied):
            continue
        if len(",".join([*kept, item, *seed]) + tail) <= RUN_NAME_MAX:
            kept.append(item)
    return ",".join([*kept, *seed]) + tail


def hydra_record() -> str | None:
    """Where Hydra writes a job's record (`hydra.output_subdir`): ".hydra" on rank 0, nowhere on
    the other ranks of a torchrun job, which all compose the same config into the same folder
    (rank 0 keeps the run's record; two writers raced its move into `out=`)."""
    return ".hydra" if os.environ.get("RANK", "0") == "0" else None


def objective_aggregation(objective: str) -> str:
    """The aggregation group's default option for `objective=<objective>` (train.yaml's defaults
    list): the `aggregation` keyword default of the objective's builder, so that one objective
    name is one loss in harness.train and in harness.measure (which builds `alpha.objective`
    with the builder's defaults). GSPO's is seq-mean-token-mean: GSPO (2507.18071) averages its
    per-sequence objective over the group's responses, and verl runs it with that loss_agg_mode;
    the others' is token-mean. `aggregation=` on the command line, or a preset's
    `override /aggregation`, chooses another."""
    import inspect

    from harness.objectives import OBJECTIVES

    if objective not in OBJECTIVES:  # composition then fails naming the valid objectives
        return "token-mean"
    param = inspect.signature(OBJECTIVES[objective]).parameters.get("aggregation")
    return "token-mean" if param is None else param.default  # opsd_fkl: no aggregation


# The swept-axis nodes and the warm-start recipe are open: their keys are the builders' keyword
# arguments (defaults in Python only), set as `objective.lo=0.5` without a `+`, and checked
# against the builder's signature before any compute (harness.runs.validate.check_nodes).
OPEN_NODES = (
    "task",
    "noise",
    "objective",
    "aggregation",
    "model.warmstart",
    "prereg",
    "arms",
    "drivers.harder",
)


def open_schema(cls: type, open_nodes: tuple[str, ...]) -> DictConfig:
    """A structured config of `cls` whose `open_nodes` take keys the dataclass does not list."""
    node = OmegaConf.structured(cls)
    for key in open_nodes:
        OmegaConf.set_struct(OmegaConf.select(node, key), False)
    return node


def schema() -> DictConfig:
    return open_schema(TrainConfig, OPEN_NODES)


RESOLVERS = {
    "run_name": run_name,
    "hydra_record": hydra_record,
    "objective_aggregation": objective_aggregation,
}


def register() -> None:
    """What Hydra needs before it composes a job's config: the resolvers the job configs read
    (experiments/train.yaml, measure.yaml) and the structured schema train.yaml's defaults list
    names (`train_schema`). The entry points call it (harness.train, harness.rl.mechanism,
    harness.measure, analysis.runs); a spawned worker imports its entry point and so calls it
    before it resolves its job's config."""
    for name, fn in RESOLVERS.items():
        OmegaConf.register_new_resolver(name, fn, replace=True)
    ConfigStore.instance().store(name="train_schema", node=schema())
