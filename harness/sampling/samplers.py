"""μ's inference engine (`engine.sampler`): one small table and its check.

hf    this process's transformers model (harness.sampling.engines.Engine), β injected by
      harness.noise
ct2   CTranslate2 (harness.sampling.ct2.Ct2Engine): a second engine whose β is its own kernels
vllm  vLLM in a worker process (harness.sampling.vllm_engine.VllmEngine): the engine users
      deploy
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from omegaconf import DictConfig

from harness.sampling.ct2 import Ct2Engine, check_compute_type, require_ct2
from harness.sampling.engines import Engine
from harness.sampling.rollout import Sampler
from harness.sampling.vllm_engine import VllmEngine, VllmOptions, check_vllm


def _hf(model, tokenizer, noise, eng: DictConfig, log_dir: Path | None) -> Engine:
    return Engine(model, tokenizer, noise=noise, kv_cache=eng.kv_cache)


def _ct2(model, tokenizer, noise, eng: DictConfig, log_dir: Path | None) -> Ct2Engine:
    return Ct2Engine(model, tokenizer, compute_type=eng.ct2.compute_type)


def _vllm(model, tokenizer, noise, eng: DictConfig, log_dir: Path | None) -> VllmEngine:
    options = VllmOptions(
        dtype=eng.sampler_dtype,
        python=eng.vllm.python,
        start_timeout_s=eng.vllm.start_timeout_s,
        gpus=eng.vllm.gpus,
        gpu_memory_utilization=eng.vllm.gpu_memory_utilization,
    )
    log = None if log_dir is None else log_dir / "vllm_worker.log"
    return VllmEngine(model, tokenizer, options, log)


ENGINES: dict[str, Callable[..., Sampler]] = {"hf": _hf, "ct2": _ct2, "vllm": _vllm}


def check_sampler(eng: DictConfig, noise: list[str], rollout: DictConfig | None = None) -> None:
    """`engine.sampler` and what it allows, before any compute: ct2 and vllm bring their own β
    (kernels, quantisation, precision), so no noise is injected; ct2's precision is
    `engine.ct2.compute_type`, vllm's `engine.sampler_dtype`."""
    name = eng.sampler
    if name not in ENGINES:
        raise ValueError(f"engine.sampler={name!r}; valid: {', '.join(ENGINES)}")
    if name == "hf":
        return
    if noise:
        raise ValueError(
            f"engine.sampler={name} with injected noise {noise}: that engine's β is its own "
            "(its kernels and precision); inject none (noise=none, extra_noise=[]), or use "
            "engine.sampler=hf with the noise"
        )
    if eng.routing_replay and eng.routing_replay_source == "sampler":
        raise ValueError(
            f"engine.routing_replay=True with engine.sampler={name}; valid: false, or "
            "engine.routing_replay_source=trainer (R2); only the hf sampler records its MoE "
            "routes for R3"
        )
    if name == "vllm":
        r = rollout if rollout is not None else {"top_k": 0, "top_p": 1.0}
        check_vllm(eng.vllm.python, eng.sampler_dtype, r["top_k"], r["top_p"], eng.mask_replay)
        return
    check_compute_type(eng.ct2.compute_type)
    if eng.sampler_dtype != "fp32":
        raise ValueError(
            f"engine.sampler_dtype={eng.sampler_dtype!r} with engine.sampler=ct2; valid: 'fp32' "
            "(CTranslate2's precision is engine.ct2.compute_type)"
        )
    require_ct2()
