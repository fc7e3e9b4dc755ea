"""μ's inference engine (`engine.sampler`): one small table and its check.

hf    this process's transformers model (harness.engines.Engine), β injected by harness.noise
ct2   CTranslate2 (harness.ct2.Ct2Engine): a second engine whose β is its own kernels
"""

from __future__ import annotations

from harness.ct2 import Ct2Engine, check_compute_type, require_ct2
from harness.engines import Engine


def _hf(model, tokenizer, noise, kv_cache: bool, ct2_compute_type: str) -> Engine:
    return Engine(model, tokenizer, noise=noise, kv_cache=kv_cache)


def _ct2(model, tokenizer, noise, kv_cache: bool, ct2_compute_type: str) -> Ct2Engine:
    return Ct2Engine(model, tokenizer, compute_type=ct2_compute_type)


ENGINES = {"hf": _hf, "ct2": _ct2}  # μ: this process's HF model | CTranslate2 (harness.ct2)


def check_sampler(name: str, compute_type: str, noise: list[str], sampler_dtype: str) -> None:
    """`engine.sampler` and what it allows, before any compute: ct2 brings its own β (kernels,
    quantisation), so no noise is injected and its precision is `engine.ct2.compute_type`."""
    if name not in ENGINES:
        raise ValueError(f"engine.sampler={name!r}; valid: {', '.join(ENGINES)}")
    if name != "ct2":
        return
    check_compute_type(compute_type)
    if noise:
        raise ValueError(
            f"engine.sampler=ct2 with injected noise {noise}: CTranslate2's β is its own (its "
            "kernels, engine.ct2.compute_type); inject none (noise=none, extra_noise=[]), or "
            "use engine.sampler=hf with the noise"
        )
    if sampler_dtype != "fp32":
        raise ValueError(
            f"engine.sampler_dtype={sampler_dtype!r} with engine.sampler=ct2; valid: 'fp32' "
            "(CTranslate2's precision is engine.ct2.compute_type)"
        )
    require_ct2()
