"""Base accuracy of a model on task=word_problems through the harness's own engine, as
`harness.rl.step.evaluate` samples it (clean trainer numerics, one sample per eval problem, seed
eval_seed=0), at each of the given temperatures and greedy (top_k=1); with the mean response
length and the fraction of responses that hit the token budget. Task kwargs as key=value.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/word_problems_base.py n=128 temperatures=1.0,0.7 \
        steps=1 max_number=10
"""

import sys
import time

import torch

from harness.base.models import load_model
from harness.base.registry import build
from harness.sampling.engines import Engine
from harness.sampling.rollout import Sampling
from harness.tasks import TASKS

STR_KWARGS = ("ops", "instruction")


def stats(task, problems, ro, engine, budget):
    """Per row: reward, response tokens (EOS included), and whether it hit the budget, no EOS."""
    rewards = task.rollout_rewards(problems, ro, engine.tokenizer)
    lengths = ro.response_mask.sum(1)
    last = ro.response_ids.gather(1, (lengths.long() - 1).clamp(min=0)[:, None])[:, 0]
    truncated = (lengths >= budget) & ~torch.isin(last, engine.eos_ids.cpu())
    return rewards, lengths, truncated


def main(argv: list[str]) -> None:
    kw = dict(a.split("=", 1) for a in argv)
    n, model_spec = int(kw.pop("n", 128)), kw.pop("model", "smollm2-135m")
    temps = [float(t) for t in kw.pop("temperatures", "1.0").split(",") if t]
    greedy, show = kw.pop("greedy", "true") == "true", int(kw.pop("show", 2))
    task_kw = {k: v if k in STR_KWARGS else float(v) if "." in v else int(v) for k, v in kw.items()}
    task = build(TASKS, "word_problems", "task", **task_kw)
    model, tok = load_model(model_spec)
    task.attach_tokenizer(tok)
    engine = Engine(model, tok)
    problems = task.sample(n, "eval", seed=0)
    budget = task.max_new_tokens
    modes = [(f"T={t:g}", t, 0) for t in temps] + ([("greedy", 1.0, 1)] if greedy else [])
    for label, temperature, top_k in modes:
        t0 = time.time()
        ro = engine.generate(
            [p.prompt for p in problems],
            Sampling(n=1, max_new_tokens=budget, temperature=temperature, top_k=top_k),
            seed=0,
        )
        r, length, trunc = stats(task, problems, ro, engine, budget)
        print(
            f"{task_kw} budget={budget} {label}: acc {r.mean():.3f} ({int(r.sum())}/{n}), mean "
            f"len {length.mean():.1f} tok, truncated {trunc.float().mean():.3f}, "
            f"{time.time() - t0:.0f} s",
            flush=True,
        )
        texts = tok.batch_decode(
            ro.response_ids * ro.response_mask.long(), skip_special_tokens=True
        )
        for i in range(min(show, n)):
            print(f"  [{problems[i].info['expr']}={problems[i].answer} r={r[i]:.0f}] {texts[i]!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
