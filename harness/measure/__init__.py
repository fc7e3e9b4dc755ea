"""Main job: the SNR post's measurement procedure (§3, steps 1–3: a calibration pass at frozen
weights, then a live pass), validated against the ground truth the harness controls.

  1. Calibration (α ≡ 0): the same frozen weights θ_b in both engines; the sampler μ carries the
     configured noise and sampling config. Δ_cal = log π_trainer − log μ = β; identity check
     (abort when |mean ratio − 1| exceeds the tolerance); noise anatomy (Table 3, Figure 1).
  2. α: the trainer moves to θ, by `alpha.steps` optimizer steps of a real objective (default
     ppo_clip + AdamW) on the calibration rollouts with a verifiable reward, or by a controlled
     relative weight perturbation (`alpha.mode=perturb`, harness.rl.alpha.perturb_weights_).
  3. Live pass: new rollouts from μ at θ_b, scored by the trainer at θ: Δ_live = α + β.
  4. Per confidence bin of trainer p_t: the SNR split and the three-job bounds (Table 6,
     Figure 2, harness.stats.snr; the bounds' placement: §4), the Table 7 dials, layer amplification
     (the post's residual-stream compounding, §2: ‖Δh_l‖ per decoder layer after one injection
     of relative size σ).
  5. Ground truth per live token: β = log π_trainer(θ_b) − log μ(θ_b) (the engine mismatch at
     the same weights) and α = log π_trainer(θ) − log π_trainer(θ_b), so α + β = Δ_live exactly;
     per bin, estimated vs true Var_α, Var_β, SNR.

Everything accumulates in streaming form (`rounds` rollout batches per pass; memory does not grow
with the token count). The job writes data only, to `out` (default results/<name>/); the
analysis/ scripts draw the figures from it (the command is printed at the end of a run).

The config is MeasureConfig (below): μ's engine is the `engine` node of harness.train (EngineCfg),
μ's noise the `noise` group plus the `extra_noise` list, as in training; presets are the `measure`
group (experiments/measure/<name>.yaml).

    python -m harness.measure                                  # smollm2-135m, FP8 block W8A8
    python -m harness.measure model=tiny-llama n=2 alpha.mode=perturb
    python -m harness.measure noise=layer noise.sigma=1e-2 rounds=4
    python -m harness.measure -m measure=snr_table             # a preset's sweep
"""

from __future__ import annotations

import copy
import inspect
import io
import re
import subprocess
import time
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import hydra
import numpy as np
import pandas as pd
import torch
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from harness import CONFIGS
from harness.base.batch import TokenBatch, log_rho
from harness.base.io import write_json_atomic, write_text_atomic
from harness.base.models import load_model, resolve_device, set_tf32, weights_sha
from harness.noise import NOISE, layer_amplification
from harness.objectives import build_objective
from harness.rl.alpha import minibatch_schedule, perturb_weights_
from harness.rl.setup import build_policy, build_sampler, r2, rollout_sampling, step_seed
from harness.rl.step import Learner, StepOptions, adamw, collect, update
from harness.runs import config
from harness.runs.access import noise_nodes, split_node
from harness.runs.config import EngineCfg, ModelCfg, OptimCfg, RolloutCfg, open_schema
from harness.runs.launch import run_task
from harness.runs.validate import validate
from harness.sampling.engines import Engine, Rollout
from harness.sampling.rollout import Sampler
from harness.stats.diagnostics import CONF_EDGES, bin_index, gate, identity_check
from harness.stats.snr import (
    CI_COLUMNS,
    TABLE6_COLUMNS,
    BinnedMoments,
    SNRSplit,
    shrink_kwargs,
    snr_report,
    token_columns,
)

# --- config -------------------------------------------------------------------------------------


@dataclass
class LiveCfg:
    """θ_b → θ before the live pass: `steps` optimizer steps of the `objective` node with the
    `optim` node's AdamW on the calibration rollouts (verifiable reward), a relative weight
    perturbation (`perturb`: W ← W + rel_sigma·rms(W)·ξ per weight matrix,
    harness.rl.alpha.perturb_weights_), or `none`."""

    mode: str = "steps"  # steps | perturb | none
    steps: int = 2
    minibatches: int | None = None  # None: one minibatch per step (cycled when steps > minibatches)
    rel_sigma: float = 3e-3
    perturb_seed: int = 1


@dataclass
class MeasurementCfg:
    """What the measurement job alone has: passes, tolerances, bins, the three-job bounds, the
    Table 7 dials and the layer amplification."""

    rounds: int = 1  # rollout batches per pass; statistics stream, memory does not grow
    identity_tol: float | None = None  # None: 1e-3 + 4 standard errors (diagnostics.identity_check)
    # |α, β − the pristine θ_b reference| above this aborts (float rounding: ~1e-6)
    truth_tol: float = 1e-4
    edges: list[float] | None = None  # confidence bins on trainer p_t; None: diagnostics.CONF_EDGES
    # the three-job bounds (harness.stats.snr): u_noise / l_noise are the noise_q / (1 − noise_q)
    # quantiles of e^Δ_cal; u_signal, l_signal = e^{±k σ_α}; ESS/N floor of the clamped weights
    noise_q: float = 0.995
    signal_k: float = 2.0
    ess_floor: float = 0.9
    ess_on: str = "r_lambda"  # r_lambda (the weights snr_shrink clamps) | r (the raw ratio)
    # Table 7 dials: the capped mean ratio min(r, C); the out-of-band fraction and Table 3's band
    cap: float = 2.0
    band: list[float] = field(default_factory=lambda: [0.5, 2.0])
    # layer amplification: one injection of relative size amp_sigma at layer 0 and at the
    # embedding output, on amp_rows live rollouts (0: skip), amp_seeds noise draws
    amp_rows: int = 2
    amp_sigma: float = 1e-2
    amp_seeds: int = 2
    # write each pass's per-token columns (tokens_cal.parquet, tokens_live.parquet with the true
    # α and β): the input of `python -m harness.measure.logs`, checked here against the truth
    dump_tokens: bool = False


@dataclass
class MeasureConfig:
    """`python -m harness.measure`: typed, so a misspelt key fails at composition. The nodes it
    shares with harness.train mean what they mean there: `model`, `engine` (μ's engine and the
    precisions), `noise` (the group) then `extra_noise`, `rollout` (prompts_per_step of the 16
    built-in prompts, group_size samples of each, max_new_tokens, temperature, top_p, top_k),
    `objective` and `optim` (the live steps' loss and AdamW). Its own: `live` (how θ_b moves to
    θ) and `measurement`."""

    name: str = "measure"
    out: str = "results/${name}"
    force: bool = False  # overwrite a results folder that holds files tracked by git
    seed: int = 0
    progress: bool = False
    model: ModelCfg = field(default_factory=lambda: ModelCfg(spec="smollm2-135m"))
    noise: dict[str, Any] = field(default_factory=lambda: {"name": "none"})  # μ's injected β
    extra_noise: list[dict[str, Any]] = field(default_factory=list)  # after `noise` (e.g. routing)
    engine: EngineCfg = field(default_factory=EngineCfg)
    # 16 prompts × 4 samples, 48 tokens: ~2500 tokens per pass
    rollout: RolloutCfg = field(
        default_factory=lambda: RolloutCfg(prompts_per_step=16, group_size=4, max_new_tokens=48)
    )
    objective: dict[str, Any] = field(default_factory=lambda: {"name": "ppo_clip"})
    # torch's AdamW betas, no weight decay: the live steps' optimizer
    optim: OptimCfg = field(default_factory=lambda: OptimCfg(lr=5e-5, beta2=0.999))
    live: LiveCfg = field(default_factory=LiveCfg)
    measurement: MeasurementCfg = field(default_factory=MeasurementCfg)
    plugins: list[str] = field(default_factory=list)  # the user's own rules (harness.runs.plugins)


OPEN_NODES = ("noise", "objective")  # kwargs checked against the builders at start-up

# μ's noise in the default run: FP8 block-wise W8A8 (E4M3 128×128 weight blocks, 1×128 activation
# tiles, as DeepSeek-V3; the other kwargs are harness.noise.Fp8Noise's defaults). An option of the
# noise group of its own, so that noise=<name> replaces it whole: no kwarg leaks into another
# noise model, and noise=fp8 stays the registry's fp8.
DEFAULT_NOISE = {"name": "fp8", "granularity": "block", "activations": True}


def schema() -> DictConfig:
    return open_schema(MeasureConfig, OPEN_NODES)


def register() -> None:
    """What Hydra needs before it composes experiments/measure.yaml: the job configs' resolvers,
    this job's schema (`measure_schema`) and its default noise option (`fp8_block_w8a8`)."""
    config.register()
    ConfigStore.instance().store(name="measure_schema", node=schema())
    ConfigStore.instance().store(group="noise", name="fp8_block_w8a8", node=DEFAULT_NOISE)


def check_measure(cfg: DictConfig) -> None:
    """The measurement job's own keys, after the checks every job makes
    (harness.runs.validate.validate: the swept nodes, the engine and rollout nodes): each error
    names the key, the bad value and what is valid."""
    eng = cfg.engine
    for key, value, valid in [
        ("live.mode", cfg.live.mode, ("steps", "perturb", "none")),
        # Δ is the trainer's recompute against μ, in the trainer's own precision
        ("engine.logp_old_source", eng.logp_old_source, ("trainer",)),
        ("engine.trainer_fp8", eng.trainer_fp8, (False,)),
    ]:
        if value not in valid:
            raise ValueError(f"{key}={value!r}; valid: {', '.join(map(repr, valid))}")
    for key in ("upcycle", "warmstart"):  # harness.train's task models only
        if cfg.model[key]:
            raise ValueError(f"model.{key}={cfg.model[key]!r}; valid for harness.measure: unset")
    r = cfg.rollout
    if not 1 <= r.prompts_per_step <= len(PROMPTS):
        raise ValueError(
            f"rollout.prompts_per_step={r.prompts_per_step}; valid: 1..{len(PROMPTS)} "
            "(the built-in prompts)"
        )
    if r.max_new_tokens is None or r.max_new_tokens < 1:
        raise ValueError(
            f"rollout.max_new_tokens={r.max_new_tokens!r}; valid: >= 1 (no task sets a budget here)"
        )


def check(cfg: DictConfig) -> None:
    """The job's one check, before anything is written or loaded: every config check with the
    job's own keys, then the refusal to overwrite committed results."""
    validate(cfg, job=check_measure)
    guard_committed(cfg)


# the live pass's rollouts are steps LIVE_STEP0, LIVE_STEP0 + 1, ... of the run's seed stream
# (setup.step_seed); the calibration pass's are steps 0, 1, ...
LIVE_STEP0 = 7_919

BOUND_COLUMNS = ["l_noise", "u_noise", "l_signal", "u_signal", "l_ess", "u_ess", "lower", "upper"]
BOUND_COLUMNS += ["upper_set_by"]

# (prompt, regex the answer must match: the verifiable reward of alpha.mode=steps)
PROMPTS = [
    ("What is 17 + 25? Answer with a number.", r"\b42\b"),
    ("Compute 12 * 13 and explain briefly.", r"\b156\b"),
    ("If a train travels 60 km in 45 minutes, what is its speed in km/h?", r"\b80\b"),
    ("List three prime numbers greater than 50.", r"\b(53|59|61|67|71|73|79|83|89|97)\b"),
    ("What is the capital of Germany?", r"berlin"),
    ("Write one sentence about the ocean.", r"\b(ocean|sea|waves?)\b"),
    ("Explain what a derivative is in one sentence.", r"\b(rate|slope|change)\b"),
    ("Solve for x: 3x + 7 = 22.", r"x\s*=\s*5\b"),
    ("Name a fruit that is yellow.", r"\b(banana|lemon|pineapple|mango)"),
    ("What is the square root of 144?", r"\b12\b"),
    ("Give a synonym for 'happy'.", r"\b(joyful|cheerful|glad|content|delighted|pleased|elated)"),
    ("How many days are in a leap year?", r"\b366\b"),
    ("Translate 'good morning' into French.", r"bonjour"),
    ("What is 100 divided by 8?", r"\b12\.5\b"),
    ("Describe a cat in five words.", r"\b(furry|fluffy|cute|playful|curious|soft|independent)"),
    ("Is 91 a prime number? Explain.", r"\b(not|no)\b|7\s*[x×*]\s*13"),
]


def format_prompts(tokenizer, prompts: list[str]) -> list[list[int]]:
    """Chat-format each prompt when the tokenizer has a chat template, else tokenize raw."""
    if getattr(tokenizer, "chat_template", None):
        return [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True
            ).input_ids
            for p in prompts
        ]
    return [tokenizer(p, add_special_tokens=False).input_ids for p in prompts]


def _tup(v):
    return tuple(v) if isinstance(v, list) else v


def noise_label(nodes: list[dict]) -> str:
    """name(σ, then the kwargs that differ from the noise model's defaults), joined by +.
    σ is always shown (the dose), from the builder's default when the node leaves it out; the
    seed never is (it picks the noise field, not its shape)."""
    parts = []
    for n in nodes:
        sig = inspect.signature(NOISE[n["name"]]).parameters
        if (
            "sigma" in sig
            and "sigma" not in n
            and sig["sigma"].default is not inspect.Parameter.empty
        ):
            n = {"name": n["name"], "sigma": sig["sigma"].default, **n}
        kw = [
            f"{k}={v}"
            for k, v in n.items()
            if k == "sigma"
            or (k not in ("name", "seed") and (k not in sig or sig[k].default != _tup(v)))
        ]
        parts.append(f"{n['name']}({', '.join(kw)})")
    return " + ".join(parts) or "none"


def beta_label(cfg: DictConfig, nodes: list[dict]) -> str:
    """What μ differs by: the injected noise (HF sampler), or the inference engine itself."""
    if cfg.engine.sampler == "ct2":
        return f"CTranslate2 {cfg.engine.ct2.compute_type}"
    if cfg.engine.sampler == "vllm":
        return f"vLLM {cfg.engine.sampler_dtype}"
    return noise_label(nodes)


def model_spec(cfg: DictConfig) -> str:
    return cfg.model.spec


# --- passes -------------------------------------------------------------------------------------


def sample(engine: Engine, prompts, cfg: DictConfig, seed: int) -> Rollout:
    return engine.generate(prompts, rollout_sampling(cfg), seed=seed, progress=cfg.progress)


def token_log(ro: Rollout, sc: dict, logp_trainer: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per response token (flattened over the mask), the columns a training log records and
    harness.measure.logs reads: seq (the row), logp (the trainer), logp_mu (μ), p_t and the gate
    (`sc`: the trainer's bin statistics `p_t`, `p_sq_sum`)."""
    m = ro.response_mask.bool()
    rows = torch.arange(m.shape[0], device=m.device)[:, None].expand_as(m)
    return {
        "seq": rows[m],
        "logp": logp_trainer[m],
        "logp_mu": ro.logp_mu[m],
        "p_t": sc["p_t"][m],
        "gate": gate(sc["p_t"], sc["p_sq_sum"])[m],
    }


def dump_frame(
    cols: dict[str, torch.Tensor], first_seq: int, **truth: torch.Tensor
) -> pd.DataFrame:
    """One round's token columns as rows of a dump, in the dtypes they were computed in; sequence
    ids numbered on from `first_seq`, so they stay unique over the rounds."""
    df = pd.DataFrame({k: v.cpu().numpy() for k, v in {**cols, **truth}.items()})
    df["seq"] += first_seq
    return df


def write_parquet(path: Path, df: pd.DataFrame) -> None:
    buf = io.BytesIO()
    df.to_parquet(buf, index=False)
    write_text_atomic(path, buf.getvalue())


def check_identity(logp: torch.Tensor, ro: Rollout, tol: float | None, what: str) -> float:
    chk = identity_check(logp, ro.logp_mu, ro.response_mask, tol)
    print(f"[measure] {what}: {chk.explain()}", flush=True)
    if not chk.ok:
        raise SystemExit(
            f"[measure] aborting: {what} identity check failed — {chk.explain()}. The SNR split "
            "is meaningless on unfaithful log-probs: E_μ[π/μ] = 1 must hold at frozen weights."
        )
    return chk.mean_ratio


def rewards(tok, ro: Rollout) -> torch.Tensor:
    """1 when the response matches its prompt's answer regex (case-insensitive), else 0."""
    texts = tok.batch_decode(ro.response_ids * ro.response_mask.long(), skip_special_tokens=True)
    pats = [PROMPTS[i % len(PROMPTS)][1] for i in ro.prompt_index.tolist()]
    return torch.tensor([float(bool(re.search(p, t, re.I))) for p, t in zip(pats, texts)])


def train_steps(live: Engine, batch: TokenBatch, ro: Rollout, cfg: DictConfig) -> dict:
    """θ_b → θ: `live.steps` optimizer steps of the `objective` node (harness.rl.step.update)
    with the `optim` node's AdamW on the calibration rollout `ro` (sampled by μ at θ_b;
    logp_old = the trainer at θ_b), GRPO advantages, DAPO dynamic sampling (rows of
    uniform-reward groups dropped), minibatches cycled."""
    a = cfg.live
    nonzero = batch.advantages.abs().sum(1) > 0  # rows whose group's rewards differ
    informative = torch.nonzero(nonzero).flatten().cpu()  # rows index any device's batch
    if len(informative) == 0:
        print("[measure] warning: every reward group is uniform; the objective moves nothing")
        informative = torch.arange(batch.tokens.shape[0])
    m = min(a.minibatches or a.steps, len(informative))
    sched = [
        (informative[rows], lag)
        for rows, lag in minibatch_schedule(len(informative), m, seed=cfg.seed)
    ]
    schedule = [sched[k % len(sched)] for k in range(a.steps)]
    name, kw = split_node(cfg.objective)
    o = cfg.optim
    opt = adamw(
        live.model, lr=o.lr, betas=(o.beta1, o.beta2), weight_decay=o.weight_decay, fused=False
    )
    live.model.requires_grad_(True)
    options = StepOptions(mask_replay=cfg.engine.mask_replay, grad_clip=o.grad_clip)
    learner = Learner(policy=live, opt=opt)
    _, metrics, skipped = update(learner, build_objective(name, **kw), batch, ro, schedule, options)
    live.model.requires_grad_(False)
    return {
        "loss": [m["loss"] for m in metrics],
        "nonfinite_skipped": skipped,
        "frac_nonzero_adv": float(nonzero.float().mean()),
    }


@torch.no_grad()
def rel_weight_change(a: torch.nn.Module, b: torch.nn.Module) -> float:
    """‖θ − θ_b‖ / ‖θ_b‖ over the weight matrices (perturb_weights_'s definition)."""
    d2 = w2 = 0.0
    for pa, pb in zip(a.parameters(), b.parameters()):
        if pb.dim() < 2:
            continue
        d2 += (pa.float() - pb.float()).pow(2).sum().item()
        w2 += pb.float().pow(2).sum().item()
    return (d2 / w2) ** 0.5


# --- report -------------------------------------------------------------------------------------


def truth_table(split: SNRSplit, truth: BinnedMoments) -> pd.DataFrame:
    """Per bin: estimated (procedure) vs true (α, β of every live token) variances and SNR."""
    est = split.table()
    var_a, var_b = truth.var(0), truth.var(1)
    with np.errstate(invalid="ignore", divide="ignore"):
        snr_true = var_a / var_b
        return pd.DataFrame(
            {
                "bin_lo": est.bin_lo,
                "bin_hi": est.bin_hi,
                "n_cal": est.n_cal,
                "n_live": est.n_live,
                "var_beta_est": est.var_beta,
                "var_beta_true": var_b,
                "var_alpha_est": est.var_alpha,
                "var_alpha_true": var_a,
                "snr_est": est.snr,
                "snr_est_lo": est.get("snr_lo", np.nan),  # 95% interval (sequence bootstrap)
                "snr_est_hi": est.get("snr_hi", np.nan),
                "snr_true": snr_true,
                "snr_ratio": est.snr / snr_true,
                "lam_est": est.lam,
                "lam_true": var_a / (var_a + var_b),
                "corr_alpha_beta": truth.corr(0, 1),
                # is the true value inside the procedure's 95% interval (NaN: no interval)
                **{
                    f"{k}_covered": np.where(
                        np.isfinite(est[f"{k}_lo"]) & np.isfinite(t),
                        (est[f"{k}_lo"] <= t) & (t <= est[f"{k}_hi"]),
                        np.nan,
                    )
                    for k, t in (("var_beta", var_b), ("var_alpha", var_a), ("snr", snr_true))
                    if f"{k}_lo" in est
                },
            }
        )


def gate_prediction(per_bin: pd.DataFrame, nodes: list[dict], temperature: float):
    """Figure 1 overlay: mean |Δ| ≈ √(2/π)·σ·E√(1 − 2p_t + ‖p‖²) per bin (the softmax gate of
    Gaussian logit noise, SNR post §2: Δ ≈ (e_t − p)ᵀε).
    σ is the logit noise's own when the only noise is Gaussian logit noise, else fitted to the
    overall mean |Δ| (the gate's shape only)."""
    shape = np.sqrt(2 / np.pi) * per_bin.gate_sqrt_mean
    if len(nodes) == 1 and nodes[0]["name"] == "logit" and nodes[0].get("nu") is None:
        return shape * nodes[0].get("sigma", 0.1) / temperature, "logit σ"
    n, m = per_bin.n.to_numpy(float), per_bin.mean_abs_delta.to_numpy(float)
    ok = np.isfinite(m) & np.isfinite(shape.to_numpy(float)) & (n > 0)
    sigma = (n * m)[ok].sum() / max((n * shape)[ok].sum(), 1e-300)
    return shape * sigma, "fitted σ"


def fmt_table(df: pd.DataFrame) -> str:
    return df.to_string(index=False, float_format=lambda x: f"{x:.4g}")


def build_report(split: SNRSplit, truth: BinnedMoments | None, cfg: DictConfig, meta: dict) -> dict:
    """Everything the run writes: DataFrames and a JSON summary."""
    nodes = noise_nodes(cfg)
    report = report_tables(split, cfg.measurement)
    per_bin = report["per_bin"]
    pred, src = gate_prediction(per_bin[per_bin["pass"] == "cal"], nodes, cfg.rollout.temperature)
    per_bin["gate_pred"] = np.concatenate([pred.to_numpy(), np.full(len(pred), np.nan)])
    report["truth"] = truth_table(split, truth) if truth is not None else None
    report["summary"] = {
        **meta,
        "label": f"{beta_label(cfg, nodes)} | α: {meta.get('alpha_label', cfg.live.mode)}",
        "noise": nodes,
        "gate_sigma_source": src,
        **summary_tables(report),
    }
    return report


def new_split(m: MeasurementCfg) -> SNRSplit:
    """The two empty streams of the SNR procedure, with the node's bins, cap and band."""
    edges = CONF_EDGES if m.edges is None else m.edges
    return SNRSplit(list(edges), cap=m.cap, band=tuple(m.band))


def report_tables(split: SNRSplit, m: MeasurementCfg) -> dict:
    """harness.stats.snr.snr_report with the `measurement` node's bound settings."""
    return snr_report(split, m.noise_q, m.signal_k, m.ess_floor, m.ess_on)


def summary_tables(report: dict) -> dict:
    """Tables 3 and 7 and the shrink objective's kwargs, for summary.json."""
    t3, t7 = report["table3"], report["table7"]
    return {
        "table3": {k: float(v) for k, v in zip(t3.stat, t3.value)},
        "table7": {c: {k: float(v) for k, v in zip(t7.dial, t7[c])} for c in ("cal", "live")},
        "snr_shrink_kwargs": shrink_kwargs(report["table6"]),
    }


def write_report(out: Path, report: dict) -> None:
    for key in ("table3", "table6", "table7", "per_bin", "abs_delta_hist", "truth"):
        if report.get(key) is not None:
            write_text_atomic(out / f"{key}.csv", report[key].to_csv(index=False))
    write_json_atomic(out / "summary.json", report["summary"])
    write_json_atomic(out / "snr_shrink.json", report["summary"]["snr_shrink_kwargs"])


def tables_text(report: dict, header: str | None = None) -> str:
    """Tables 3, 6 (with the bounds), 7 and the ground truth as text; `header` (the first line)
    defaults to the model and its weights checksum."""
    t6, summary = report["table6"], report["summary"]
    parts = [
        header or f"model {summary['model']}, weights checksum {summary['weights_sha']}",
        "",
        "Table 3 — |Δ log π| at frozen weights (calibration pass)",
        fmt_table(report["table3"]),
        "",
        "Table 6 — per-bin SNR split, with the three-job bounds (Figure 2)",
        fmt_table(t6[[c for c in (*TABLE6_COLUMNS, *CI_COLUMNS) if c in t6]]),
        "",
        fmt_table(t6[["bin_lo", "bin_hi", *BOUND_COLUMNS]]),
        "",
        "Table 7 — dials (calibration vs live)",
        fmt_table(report["table7"]),
    ]
    if report.get("truth") is not None:
        tt = report["truth"]
        parts += [
            "",
            "Ground truth — estimated vs true per bin (live tokens)",
            fmt_table(tt.drop(columns=["n_cal", "lam_est", "lam_true"])),
        ]
    return "\n".join(parts) + "\n"


REAL_ENGINE = Path(__file__).resolve().parents[2] / "results" / "real_engine_beta"


def figure_commands(out: Path, spec: str) -> list[str]:
    """The analysis/ commands that draw this run's figures: Figures 1, 2 and layer amplification;
    on SmolLM2 also its β beside the committed real-engine β of the same model
    (results/real_engine_beta/, whose own runs `python -m analysis.real_engine_beta` draws)."""
    cmds = [
        f"python -m analysis.{m} {out}"
        for m in ("noise_anatomy", "snr_table", "layer_amplification")
    ]
    inside = REAL_ENGINE in (out.resolve(), *out.resolve().parents)
    if spec == "smollm2-135m" and not inside:
        cmds.append(f"python -m analysis.real_engine_beta --compare {out} --out {out}")
    return cmds


# --- the job ------------------------------------------------------------------------------------


def tracked_files(folder: Path) -> list[str]:
    """Files under `folder` that git tracks (committed results); [] outside a git checkout."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "--", str(folder)],
            cwd=folder.parent if folder.parent.exists() else None,
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    return out.stdout.split() if out.returncode == 0 else []


def explicit_out() -> bool:
    """True unless Hydra composed `out` from its default (no `out=` on the command line)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return True  # called from code with a composed config: the caller chose `out`
    return any(o.split("=", 1)[0].lstrip("+") == "out" for o in HydraConfig.get().overrides.task)


def guard_committed(cfg: DictConfig) -> None:
    """Refuse, before anything is written, to overwrite committed results by default."""
    out = Path(cfg.out)
    if not cfg.force and not explicit_out() and (tracked := tracked_files(out.absolute())):
        raise FileExistsError(
            f"{out} holds {len(tracked)} committed result file(s) (e.g. {tracked[0]}); "
            "refusing to overwrite them. Rerun with force=true to regenerate them, or out=<dir>."
        )


@dataclass
class Models:
    """The job's policies, every copy of θ_b taken before any noise or replay hook is attached
    (deepcopy copies hooks): μ (its own copy, dtype, engine and noise), π at θ_b (the trainer),
    the pristine θ_b (the truth check's reference) and the live policy's model (→ θ; None with
    live.mode=none)."""

    spec: str
    tok: Any
    trainer_model: torch.nn.Module
    weights_sha: str
    sampler: Sampler
    trainer: Engine
    reference: Engine
    live_model: torch.nn.Module | None


def load(cfg: DictConfig) -> Models:
    spec, eng = model_spec(cfg), cfg.engine
    device = resolve_device(eng.device)
    set_tf32(eng.tf32)
    print(
        f"[measure] loading {spec} on {device}; μ: {beta_label(cfg, noise_nodes(cfg))} ...",
        flush=True,
    )
    trainer_model, tok = load_model(spec, dtype=eng.trainer_dtype, seed=cfg.seed)
    trainer_model.to(device)
    trainer_model.requires_grad_(False)
    sha = weights_sha(trainer_model)  # before any α step: the weights measured
    print(f"[measure] {spec}: weights checksum {sha}", flush=True)
    sampler = build_sampler(cfg, trainer_model, tok)
    reference_model = copy.deepcopy(trainer_model)
    live_model = copy.deepcopy(trainer_model) if cfg.live.mode != "none" else None
    return Models(
        spec=spec,
        tok=tok,
        trainer_model=trainer_model,
        weights_sha=sha,
        sampler=sampler,
        trainer=build_policy(cfg, trainer_model, tok),
        reference=build_policy(cfg, reference_model, tok),
        live_model=live_model,
    )


@dataclass
class Pass:
    """What a pass leaves beside the SNR split's streams: each round's identity-check mean
    ratio and, with measurement.dump_tokens, its token columns."""

    identity: list[float] = field(default_factory=list)
    dumps: list[pd.DataFrame] = field(default_factory=list)


def calibration_pass(cfg: DictConfig, m: Models, prompts, split: SNRSplit) -> tuple[Pass, tuple]:
    """Step 1, α ≡ 0: μ samples and the trainer scores at θ_b (harness.rl.step.collect, as a
    training step collects), `measurement.rounds` times. Returns the pass and the first round's
    (batch, rollout, mean reward): the rollouts the α steps train on."""
    p, first, rounds = Pass(), None, cfg.measurement.rounds
    for i in range(rounds):
        print(f"[measure] calibration round {i + 1}/{rounds}: sampling ...", flush=True)
        batch, ro, r = collect(
            m.sampler,
            m.trainer,
            prompts,
            partial(rewards, m.tok),
            rollout_sampling(cfg),
            StepOptions(
                mask_replay=cfg.engine.mask_replay, own_routes=r2(cfg), progress=cfg.progress
            ),
            seed=step_seed(cfg.seed, i),
        )
        sc = {"p_t": batch.p_t, "p_sq_sum": batch.p_sq_sum}
        tol = cfg.measurement.identity_tol
        p.identity.append(check_identity(batch.logp_old, ro, tol, "calibration"))
        cols = token_log(ro, sc, batch.logp_old)
        split.add_cal(**token_columns(**cols))
        if cfg.measurement.dump_tokens:  # opt-in: the one thing here that grows with the tokens
            p.dumps.append(dump_frame(cols, i * len(ro.logp_mu)))
        if first is None:
            first = (batch, ro, float(r.mean()))
    return p, first


def move_to_theta(cfg: DictConfig, m: Models, first: tuple) -> tuple[Engine, dict]:
    """Step 2, θ_b → θ on the live policy's own copy (live.mode): the live policy and what
    moved it."""
    info: dict = {"mode": cfg.live.mode}
    if m.live_model is None:
        info["label"] = "none"
        return m.trainer, info
    live = build_policy(cfg, m.live_model, m.tok)
    if cfg.live.mode == "perturb":
        perturb_weights_(m.live_model, cfg.live.rel_sigma, seed=cfg.live.perturb_seed)
        info["label"] = f"perturb rel σ={cfg.live.rel_sigma:g}"
    else:
        steps, objective = cfg.live.steps, cfg.objective.name
        print(f"[measure] α: {steps} × {objective} steps ...", flush=True)
        info.update(train_steps(live, first[0], first[1], cfg), reward_mean=first[2])
        info["label"] = f"{steps} {objective} steps, lr={cfg.optim.lr:g}"
    info["rel_weight_change"] = rel_weight_change(m.live_model, m.trainer_model)
    return live, info


def live_pass(
    cfg: DictConfig, m: Models, live: Engine, prompts, split: SNRSplit
) -> tuple[Pass, BinnedMoments, float, tuple]:
    """Step 3, the live pass with ground truth: μ samples at θ_b, the trainer scores at θ_b and
    the live policy at θ. Per token β = log π(θ_b) − log μ and α = log π(θ) − log π(θ_b),
    binned (the truth); the truth check recomputes π at θ_b with the pristine reference (not the
    trainer object): it fails when the trainer drifted from θ_b or when α or β were measured
    against the wrong policy. Returns the pass, the truth, the largest disagreement with the
    reference and the first round's (tokens, attention mask) for the layer amplification."""
    replay, edges, rounds = (
        cfg.engine.mask_replay,
        list(cfg.measurement.edges),
        cfg.measurement.rounds,
    )
    p, truth, max_err, amp_tokens = Pass(), BinnedMoments(len(edges) - 1, 2), 0.0, None
    for i in range(rounds):
        print(f"[measure] live round {i + 1}/{rounds}: sampling ...", flush=True)
        ro = sample(m.sampler, prompts, cfg, seed=step_seed(cfg.seed, LIVE_STEP0 + i))
        if r2(cfg):  # the live policy replays the trainer's routes at θ_b
            ro = replace(ro, routing=m.trainer.own_routes(ro))
        sc_b = m.trainer.logp(ro, mask_replay=replay)
        sc_t = sc_b if live is m.trainer else live.logp(ro, mask_replay=replay)
        tol = cfg.measurement.identity_tol
        p.identity.append(check_identity(sc_t["logp"], ro, tol, "live"))
        cols = token_log(ro, sc_t, sc_t["logp"])
        arr = token_columns(**cols)
        split.add_live(**arr)
        mask = ro.response_mask.bool()
        beta = log_rho(sc_b["logp"], ro.logp_mu)[mask].double()
        alpha = (sc_t["logp"] - sc_b["logp"])[mask].double()
        if cfg.measurement.dump_tokens:
            p.dumps.append(dump_frame(cols, i * len(ro.logp_mu), alpha=alpha, beta=beta))
        truth.add(bin_index(arr["conf"], edges), torch.stack([alpha, beta], 1).cpu().numpy())
        ref = m.reference.logp(ro, stats=False, mask_replay=replay)["logp"][mask].double()
        err = torch.cat([beta - log_rho(ref, ro.logp_mu[mask]), alpha - (sc_t["logp"][mask] - ref)])
        max_err = max(max_err, float(err.abs().max()))
        if amp_tokens is None:
            rows = cfg.measurement.amp_rows
            amp_tokens = (ro.tokens[:rows], ro.attention_mask[:rows])
    return p, truth, max_err, amp_tokens


def check_truth(max_err: float, tol: float) -> None:
    if max_err > tol:
        raise RuntimeError(
            f"[measure] ground truth check failed: the per-token α, β differ from the pristine "
            f"θ_b reference by up to {max_err:.3g} (> measurement.truth_tol={tol:g}): the "
            "trainer moved away from the behaviour weights, or α/β were read against the wrong "
            "policy"
        )


def amplification(cfg: DictConfig, model: torch.nn.Module, amp_tokens: tuple) -> pd.DataFrame:
    """Step 4, layer amplification: ‖Δh_l‖ per decoder layer after one injection of relative
    size measurement.amp_sigma at layer 0 and at the embedding output."""
    rows = []
    for where in (0, "embed"):
        amp = layer_amplification(
            model,
            amp_tokens[0],
            inject_at=where,
            sigma=cfg.measurement.amp_sigma,
            seeds=tuple(range(cfg.measurement.amp_seeds)),
            attention_mask=amp_tokens[1],
        )
        rows.append(pd.DataFrame(amp).assign(inject_at=str(where)))
    return pd.concat(rows)


def run(cfg: DictConfig, validated: bool = False) -> dict:
    """The job (the module docstring's steps 1–5) into `cfg.out`; its summary. `validated`:
    the caller ran `check` (harness.measure's main, through run_task)."""
    if not validated:
        check(cfg)
    t_start = time.time()
    timings: dict[str, float] = {}
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    if cfg.measurement.edges is None:  # the one set of confidence bins, recorded in config.yaml
        cfg.measurement.edges = list(CONF_EDGES)
    write_text_atomic(out / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
    torch.manual_seed(cfg.seed)
    m = load(cfg)
    prompts = format_prompts(m.tok, [p for p, _ in PROMPTS[: cfg.rollout.prompts_per_step]])
    split = new_split(cfg.measurement)

    t = time.time()
    cal, first = calibration_pass(cfg, m, prompts, split)
    timings["calibration_s"] = time.time() - t
    t = time.time()
    live, alpha_info = move_to_theta(cfg, m, first)
    timings["alpha_s"] = time.time() - t
    del first  # the calibration rollouts: only the α steps train on them
    t = time.time()
    lp, truth, max_err, amp_tokens = live_pass(cfg, m, live, prompts, split)
    timings["live_s"] = time.time() - t
    check_truth(max_err, cfg.measurement.truth_tol)
    if cfg.measurement.amp_rows > 0:
        t = time.time()
        amp = amplification(cfg, m.trainer_model, amp_tokens)
        write_text_atomic(out / "layer_amplification.csv", amp.to_csv(index=False))
        timings["layer_amp_s"] = time.time() - t

    # step 5: tables and files
    eng = cfg.engine
    meta = {
        "model": m.spec,
        "weights_sha": m.weights_sha,
        "sampler": eng.sampler,  # μ's engine (ct2: its compute type is in the label)
        "sampler_dtype": eng.sampler_dtype,
        "trainer_dtype": eng.trainer_dtype,
        "alpha": alpha_info,
        "alpha_label": alpha_info["label"],
        "identity_mean_ratio": {
            "cal": float(np.mean(cal.identity)),
            "live": float(np.mean(lp.identity)),
        },
        "truth_max_abs_err": max_err,  # α, β vs the pristine θ_b reference: 0 up to rounding
        "amp_sigma": cfg.measurement.amp_sigma,
    }
    report = build_report(split, truth, cfg, meta)
    text = tables_text(report)
    print("\n" + text, flush=True)
    write_text_atomic(out / "tables.txt", text)
    timings["wall_s"] = time.time() - t_start
    report["summary"]["timings"] = {k: round(v, 1) for k, v in timings.items()}
    write_report(out, report)
    if cfg.measurement.dump_tokens:
        for name, frames in (("cal", cal.dumps), ("live", lp.dumps)):
            write_parquet(out / f"tokens_{name}.parquet", pd.concat(frames, ignore_index=True))
    print(f"[measure] wrote {out}/ ({time.time() - t_start:.0f} s); its figures:", flush=True)
    for cmd in figure_commands(out, m.spec):
        print(f"    {cmd}", flush=True)
    return report["summary"]


register()


@hydra.main(config_path=str(CONFIGS), config_name="measure", version_base="1.3")
def main(cfg: DictConfig) -> None:
    print(OmegaConf.to_yaml(cfg))
    return run_task(partial(run, validated=True), cfg, check=check)  # checked once, first


def check_argv(argv: list[str]) -> None:
    """`experiment=<name>` selects harness.train's presets; the measurement presets are the
    `measure` group (experiments/measure/)."""
    for arg in argv:
        key, _, value = arg.lstrip("+~").partition("=")
        if key == "experiment":
            raise SystemExit(
                f"[measure] {arg}: the measurement presets are the `measure` group "
                f"(experiments/measure/): use measure={value or '<name>'}"
            )
