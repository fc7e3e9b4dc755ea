"""How much of a clip window the full-pipeline FP8 training ratio fills, and why.

    python -m harness.rl.fp8_ratio --model smollm2-135m --out DIR [--lr 3e-6] [--rows 32]

In full-pipeline FP8 (seed 002; `engine.trainer_fp8=true`) π_θ and π_old are both the FP8
trainer's, so at θ = θ_old their ratio is exactly 1, and it carries only what an update changes.
The paper's reading is that FP8 noise "compounds" there. Two ablations on the same tokens (word
problems through the chat template, teacher-forced) separate the candidates:
  batch   the same weights scored in a batch of `rows` and of rows/2: does the FP8 forward
          depend on what else is in the batch? (|Δ log π| max; 0 means no)
  step    one Adam-sized step, every weight moved by lr·sign(u), u ~ N(0, 1) (Adam's first
          step is lr·sign(g)): the high-precision ratio carries that movement only (α); the FP8
          ratio carries α plus whatever the re-rounding of the moved weights and their block
          scales adds.
For each ratio: mean |log r| and the shares a PPO clip [1−ε_l, 1+ε_h] = [0.8, 1.28] would
delete on either side (sign-agnostic here: a token's advantage sign is a coin flip under GRPO
at the start, so each side's share halves for the sign-conditioned clip). Written to
DIR/fp8_ratio.json.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch import Tensor, nn

from harness.base.io import write_json_atomic
from harness.base.models import load_model, weights_sha
from harness.base.registry import build
from harness.noise import Fp8Trainer, build_noise
from harness.objectives.core import Window
from harness.tasks import TASKS

WINDOW = Window().clip  # the reference clip, the clip confirm's [1 − 0.2, 1 + 0.28]


@torch.no_grad()
def token_logp(model: nn.Module, ids: Tensor, mask: Tensor) -> Tensor:
    """log π(x_t | x_<t) of every next token [B, T−1] (padding masked out by the caller)."""
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
    return logits.log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]


def ratio_stats(log_r: Tensor, window: tuple[float, float] = WINDOW) -> dict[str, float]:
    """Mean |log r| and the shares below and above the window, over the given tokens."""
    r = log_r.exp()
    return {
        "mean_abs_log_r": float(log_r.abs().mean()),
        "share_below": float((r < window[0]).double().mean()),
        "share_above": float((r > window[1]).double().mean()),
    }


def sign_step(model: nn.Module, lr: float, seed: int) -> None:
    """Every parameter moved by lr·sign(u), u ~ N(0, 1): the size of Adam's first step."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(lr * torch.randn(p.shape, generator=g).sign().to(p))


def fp8_ratio(
    model: nn.Module, ids: Tensor, mask: Tensor, recipe, lr: float, seed: int = 0
) -> dict[str, dict]:
    """The two ablations (module docstring) on the tokens `ids` (mask: 1 on real tokens).
    Moves `model`'s weights by one sign step."""
    fp8 = Fp8Trainer(recipe)
    on = mask[:, 1:] > 0  # the scored next tokens
    half = ids.shape[0] // 2
    with fp8.attached(model):
        lp_old = token_logp(model, ids, mask)
        lp_half = token_logp(model, ids[:half], mask[:half])
    hp_old = token_logp(model, ids, mask)
    sign_step(model, lr, seed)
    hp_new = token_logp(model, ids, mask)
    with fp8.attached(model):
        lp_new = token_logp(model, ids, mask)
    return {
        "batch": {"max_abs_delta": float((lp_old[:half] - lp_half)[on[:half]].abs().max())},
        "step_hp": ratio_stats((hp_new - hp_old)[on]),
        "step_fp8": ratio_stats((lp_new - lp_old)[on]),
    }


def prompt_tokens(tok, rows: int, seed: int) -> tuple[Tensor, Tensor]:
    """`rows` word problems (the clip confirm's task) through the chat template, right-padded."""
    task = build(TASKS, "word_problems", "task")
    texts = [
        tok.apply_chat_template([{"role": "user", "content": p.prompt}], tokenize=False)
        for p in task.sample(rows, "train", seed)
    ]
    enc = tok(texts, return_tensors="pt", padding=True)
    return enc["input_ids"], enc["attention_mask"]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--granularity", default="block", help="the FP8 recipe's (harness.noise.fp8)")
    ap.add_argument("--fmt", default="e4m3")
    ap.add_argument("--lr", type=float, default=3e-6, help="the clip confirm's")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    if a.rows < 2 or a.lr <= 0:
        raise SystemExit(f"--rows={a.rows} --lr={a.lr}; valid: rows ≥ 2, lr > 0")
    model, tok = load_model(a.model)
    model.eval()
    recipe = build_noise("fp8", fmt=a.fmt, granularity=a.granularity, activations=True)
    ids, mask = prompt_tokens(tok, a.rows, a.seed)
    result = {
        "model": a.model,
        "weights_sha": weights_sha(model),
        "recipe": {"fmt": a.fmt, "granularity": a.granularity, "activations": True},
        "lr": a.lr,
        "rows": a.rows,
        "tokens": int(mask[:, 1:].sum()),
        "window": list(WINDOW),
        **fp8_ratio(model, ids, mask, recipe, a.lr, a.seed),
    }
    a.out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(a.out / "fp8_ratio.json", result)
    print(result)
    return result


if __name__ == "__main__":
    main()
