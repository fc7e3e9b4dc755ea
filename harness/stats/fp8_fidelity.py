"""How faithful the FP8 emulation is to the real FP8 GEMM.

    python -m harness.stats.fp8_fidelity --model tiny-llama|smollm2-135m|smollm2-shaped|<spec> \
        --device auto|cpu|cuda --dtype fp32|bf16 --out DIR

Rollouts are sampled once from the clean model; the same tokens are then scored by the clean
model and under one FP8 recipe run two ways, `Fp8Noise(kernel="emulated")` (fake quant) and
`Fp8Noise(kernel="scaled_mm")` (the real FP8 GEMM, `torch._scaled_mm`). Both quantise alike, so
their difference is the GEMM's. Per confidence bin of the clean model's p_t
(harness.stats.diagnostics.CONF_EDGES): the token count, mean |Δ log π| of each path against the
clean model, their ratio real / emulated, and the mean |log π_real − log π_emulated|; the same
overall. Written to DIR/fp8_fidelity.json. `smollm2-shaped` is a random-init Llama of
SmolLM2-135M's shapes (`--n-layers` of its 30), so the GPU check needs no GGUF.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor, nn

from harness.base.io import write_json_atomic
from harness.base.models import (
    decoder_layers,
    load_model,
    resolve_device,
    resolve_dtype,
    smollm2_shaped,
    weights_sha,
)
from harness.noise import Fp8Noise, NoiseModel
from harness.sampling.engines import Engine
from harness.sampling.rollout import Sampling
from harness.stats.diagnostics import CONF_EDGES, bin_index, bin_label

PROMPTS = (
    "The capital of France is",
    "def add(a, b):\n    return",
    "Q: What is 12 + 7?\nA:",
    "Once upon a time, there was a",
    "The three primary colors are",
    "import numpy as np\nx = np.",
    "My favourite food is",
    "Water boils at a temperature of",
)
RECIPE = dict(fmt="e4m3", granularity="row", act_granularity="row", activations=True)
PATHS = ("emulated", "scaled_mm")


class _SamePasses(NoiseModel):
    """No noise. An engine without noise runs a shared prompt once and its responses after it;
    one with noise runs every row in full. Attached to the clean scorer, it gives the clean
    pass the noisy passes' structure, so that Δ holds no float rounding of the structure."""

    uses_context = False

    def _attach(self, model: nn.Module) -> None:
        pass


def _summary(d_emulated: Tensor, d_scaled_mm: Tensor, d_between: Tensor) -> dict:
    """Means over one set of tokens (None where the set is empty, ratio None where 0/0)."""
    n = int(d_emulated.numel())
    if n == 0:
        return {
            "n_tokens": 0,
            "mean_abs_delta_emulated": None,
            "mean_abs_delta_scaled_mm": None,
            "ratio_scaled_mm_over_emulated": None,
            "mean_abs_scaled_mm_minus_emulated": None,
        }
    em, re = float(d_emulated.mean()), float(d_scaled_mm.mean())
    return {
        "n_tokens": n,
        "mean_abs_delta_emulated": em,
        "mean_abs_delta_scaled_mm": re,
        "ratio_scaled_mm_over_emulated": re / em if em > 0 else None,
        "mean_abs_scaled_mm_minus_emulated": float(d_between.mean()),
    }


def binned_fidelity(
    logp: Tensor,
    p_t: Tensor,
    logp_emulated: Tensor,
    logp_scaled_mm: Tensor,
    mask: Tensor,
    edges: Sequence[float] = CONF_EDGES,
) -> dict:
    """Per bin of the clean p_t ([lo, hi), the last closed) and overall, over the tokens `mask`
    selects ([B, T] tensors): token count, mean |Δ| of each FP8 path against the clean `logp`,
    the ratio real / emulated and mean |logp_scaled_mm − logp_emulated|. Every bin is listed
    (empty ones with count 0), so the counts sum to the overall count."""
    sel = mask.bool()
    d_em = (logp_emulated - logp)[sel].double().abs()
    d_re = (logp_scaled_mm - logp)[sel].double().abs()
    d_2 = (logp_scaled_mm - logp_emulated)[sel].double().abs()
    b = bin_index(p_t[sel], tuple(edges))
    bins = []
    for i, (lo, hi) in enumerate(zip(edges[:-1], edges[1:])):
        k = b == i
        bins.append(
            {"bin": bin_label(lo, hi), "lo": lo, "hi": hi, **_summary(d_em[k], d_re[k], d_2[k])}
        )
    overall = _summary(d_em, d_re, d_2)
    overall["max_abs_scaled_mm_minus_emulated"] = float(d_2.max()) if d_2.numel() else None
    return {"bins": bins, "overall": overall}


@torch.no_grad()
def fp8_fidelity(
    model: nn.Module,
    tokenizer,
    prompts: Sequence[str],
    recipe: dict,
    n: int = 4,
    max_new_tokens: int = 32,
    seed: int = 0,
    edges: Sequence[float] | None = None,
) -> dict:
    """`binned_fidelity` of the FP8 recipe `recipe` (Fp8Noise kwargs but `kernel`) on rollouts
    of `model` itself: `n` samples per prompt, `max_new_tokens` each, sampler seed `seed`. Raises
    before any compute when the recipe does not run as a real FP8 GEMM on this model or device."""
    if "kernel" in recipe:
        raise ValueError(
            f"fp8_fidelity: recipe sets kernel={recipe['kernel']!r}; leave it out (both kernels "
            f"run: {', '.join(PATHS)})"
        )
    noises = {path: Fp8Noise(kernel=path, **recipe) for path in PATHS}
    noises["scaled_mm"].check_model(model)
    ro = Engine(model, tokenizer).generate(
        list(prompts), Sampling(n=n, max_new_tokens=max_new_tokens), seed=seed
    )
    batch = (ro.tokens, ro.attention_mask, ro.n_prompt)
    scores = {}
    for path, noise in {"clean": _SamePasses(), **noises}.items():
        engine = Engine(model, tokenizer, noise=[noise])
        try:
            scores[path] = engine.score(*batch)
        finally:
            engine.close()
    clean = scores["clean"]
    out = binned_fidelity(
        clean["logp"],
        clean["p_t"],
        scores["emulated"]["logp"],
        scores["scaled_mm"]["logp"],
        ro.response_mask,
        CONF_EDGES if edges is None else edges,
    )
    return {
        **out,
        "recipe": dict(recipe),
        "n": n,
        "max_new_tokens": max_new_tokens,
        "seed": seed,
        "n_prompts": len(prompts),
    }


# --- CLI ----------------------------------------------------------------------------------------


def _load(spec: str, dtype: str, n_layers: int, seed: int):
    if spec == "smollm2-shaped":
        model, tok = smollm2_shaped(n_layers, seed)
        model.config._attn_implementation = "sdpa"
        return model.to(resolve_dtype(dtype, "--dtype")), tok
    return load_model(spec, dtype=dtype, seed=seed)


def _device_name(dev: torch.device) -> str:
    if dev.type != "cuda":
        return "cpu"
    major, minor = torch.cuda.get_device_capability(dev)
    return f"{torch.cuda.get_device_name(dev)} (capability {major}.{minor})"


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.3g}"


def table(result: dict) -> str:
    """The per-bin numbers as text."""
    head = (
        f"{'bin':<14}{'tokens':>8}{'|Δ| emu':>11}{'|Δ| real':>11}{'real/emu':>10}{'|real−emu|':>12}"
    )
    rows = [head]
    for r in [*result["bins"], {"bin": "all", **result["overall"]}]:
        rows.append(
            f"{r['bin']:<14}{r['n_tokens']:>8}{_fmt(r['mean_abs_delta_emulated']):>11}"
            f"{_fmt(r['mean_abs_delta_scaled_mm']):>11}"
            f"{_fmt(r['ratio_scaled_mm_over_emulated']):>10}"
            f"{_fmt(r['mean_abs_scaled_mm_minus_emulated']):>12}"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--model",
        default="tiny-llama",
        help="tiny-llama | smollm2-135m | smollm2-shaped | a load_model spec",
    )
    p.add_argument("--n-layers", type=int, default=30, help="smollm2-shaped: decoder layers")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--granularity", default=RECIPE["granularity"], help="weights: tensor | row")
    p.add_argument(
        "--act-granularity", default=RECIPE["act_granularity"], help="activations: tensor | row"
    )
    p.add_argument("--n", type=int, default=4, help="samples per prompt")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--sharpen",
        type=float,
        default=1.0,
        help="scale the final norm's weight (the logits) "
        "by this: a random-init model's near-uniform law puts every token in the lowest "
        "confidence bin; smollm2-shaped with 4 layers spreads over all bins at 10",
    )
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    dev = resolve_device(a.device, "--device")
    resolve_dtype(a.dtype, "--dtype")
    recipe = {**RECIPE, "granularity": a.granularity, "act_granularity": a.act_granularity}
    t0 = time.perf_counter()
    model, tok = _load(a.model, a.dtype, a.n_layers, a.seed)
    if a.sharpen != 1.0:
        with torch.no_grad():
            model.get_decoder().norm.weight.mul_(a.sharpen)
    model = model.to(dev)
    result = fp8_fidelity(model, tok, PROMPTS, recipe, a.n, a.max_new_tokens, a.seed)
    result.update(
        model=a.model,
        weights_sha=weights_sha(model),  # the model by its weights (after --sharpen)
        n_layers=len(decoder_layers(model)),
        dtype=a.dtype,
        sharpen=a.sharpen,
        device=_device_name(dev),
        torch=torch.__version__,
        wall_s=round(time.perf_counter() - t0, 1),
    )
    path = write_json_atomic(a.out / "fp8_fidelity.json", result)
    print(
        f"{a.model} ({result['n_layers']} layers, {a.dtype}) on {result['device']}, recipe "
        f"{recipe}: {result['wall_s']} s -> {path}"
    )
    print(table(result))
    return result


if __name__ == "__main__":
    main()
