"""Main job: how far apart are the sampler μ and the trainer π on the same tokens?

Samples responses to a fixed built-in prompt set with the sampler engine, re-scores them on the
trainer, and reports the identity check, the |Δ log π| distribution and mean |Δ| per confidence
bin (SNR post, Table 3 / Figure 1 inputs). Δ = logp_old − logp_mu (row 3 of Table 1: pure β,
since both engines hold the same weights).

    python -m harness.measure                      # smollm2-135m, bf16 sampler vs fp32 trainer
    python -m harness.measure model=tiny-llama n=2
"""

from __future__ import annotations

import copy
import time
from pathlib import Path

import hydra
import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from harness.batch import identity_check
from harness.engines import Engine
from harness.io import write_json_atomic, write_text_atomic
from harness.models import load_model, resolve_dtype

PROMPTS = [
    "What is 17 + 25? Answer with a number.",
    "Compute 12 * 13 and explain briefly.",
    "If a train travels 60 km in 45 minutes, what is its speed in km/h?",
    "List three prime numbers greater than 50.",
    "What is the capital of Germany?",
    "Write one sentence about the ocean.",
    "Explain what a derivative is in one sentence.",
    "Solve for x: 3x + 7 = 22.",
    "Name a fruit that is yellow.",
    "What is the square root of 144?",
    "Give a synonym for 'happy'.",
    "How many days are in a leap year?",
    "Translate 'good morning' into French.",
    "What is 100 divided by 8?",
    "Describe a cat in five words.",
    "Is 91 a prime number? Explain.",
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


def delta_summary(delta: np.ndarray, p_t: np.ndarray, bins: list[float]) -> dict:
    a = np.abs(delta)
    per_bin = []
    for lo, hi in zip(bins[:-1], bins[1:]):
        sel = (p_t >= lo) & ((p_t < hi) if hi < 1.0 else (p_t <= hi))
        per_bin.append(
            {
                "bin_lo": lo,
                "bin_hi": hi,
                "n": int(sel.sum()),
                "mean_abs_delta": float(a[sel].mean()) if sel.any() else float("nan"),
            }
        )
    return {
        "n_tokens": int(a.size),
        "mean_abs_delta": float(a.mean()),
        "median_abs_delta": float(np.median(a)),
        "p99_abs_delta": float(np.quantile(a, 0.99)),
        "max_abs_delta": float(a.max()),
        "per_bin": per_bin,
    }


def run(cfg: DictConfig) -> dict:
    t0 = time.time()
    print(f"[measure] loading {cfg.model} ...", flush=True)
    trainer_model, tok = load_model(cfg.model, dtype=cfg.trainer_dtype)
    sampler_model = copy.deepcopy(trainer_model).to(resolve_dtype(cfg.sampler_dtype))
    sampler, trainer = Engine(sampler_model, tok), Engine(trainer_model, tok)

    prompts = format_prompts(tok, PROMPTS)
    print(
        f"[measure] sampling {len(prompts)} prompts x {cfg.n} on the {cfg.sampler_dtype} sampler "
        f"({cfg.max_new_tokens} new tokens) ...",
        flush=True,
    )
    ro = sampler.generate(
        prompts,
        n=cfg.n,
        max_new_tokens=cfg.max_new_tokens,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        top_k=cfg.top_k,
        seed=cfg.seed,
        progress=True,
    )
    print(f"[measure] re-scoring on the {cfg.trainer_dtype} trainer ...", flush=True)
    sc = trainer.score_rollout(ro, mask_replay=cfg.mask_replay)
    mask = ro.response_mask.bool()
    check = identity_check(sc["logp"], ro.logp_mu, ro.response_mask)
    delta = (sc["logp"] - ro.logp_mu)[mask].numpy()
    summary = {
        "model": cfg.model,
        "sampler_dtype": cfg.sampler_dtype,
        "trainer_dtype": cfg.trainer_dtype,
        "n_responses": int(mask.shape[0]),
        "identity_mean_ratio": check.mean_ratio,
        "identity_ok": check.ok,
        "identity_tol": check.tol,
        **delta_summary(delta, sc["p_t"][mask].numpy(), list(cfg.bins)),
        "wall_s": round(time.time() - t0, 1),
    }

    print("\n" + check.explain())
    print(
        f"|Δ log π| over {summary['n_tokens']} tokens: mean {summary['mean_abs_delta']:.4g}  "
        f"median {summary['median_abs_delta']:.4g}  p99 {summary['p99_abs_delta']:.4g}  "
        f"max {summary['max_abs_delta']:.4g}"
    )
    print(f"{'p_t bin':>14} {'n':>7} {'mean |Δ|':>10}")
    for b in summary["per_bin"]:
        print(f"  [{b['bin_lo']:.2f}, {b['bin_hi']:.2f}) {b['n']:>7} {b['mean_abs_delta']:>10.4g}")

    out = Path(cfg.out)
    write_json_atomic(out / "summary.json", summary)
    rows = ["p_t,logp_old,logp_mu,delta"] + [
        f"{p:.6g},{lo:.6g},{lm:.6g},{d:.6g}"
        for p, lo, lm, d in zip(
            sc["p_t"][mask].tolist(),
            sc["logp"][mask].tolist(),
            ro.logp_mu[mask].tolist(),
            delta.tolist(),
        )
    ]
    write_text_atomic(out / "tokens.csv", "\n".join(rows) + "\n")
    print(f"\nwrote {out}/summary.json and tokens.csv ({summary['wall_s']} s)")
    return summary


@hydra.main(config_path="../experiments", config_name="measure", version_base="1.3")
def main(cfg: DictConfig) -> None:
    print(OmegaConf.to_yaml(cfg))
    run(cfg)


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
