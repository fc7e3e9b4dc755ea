"""Task models: a small Llama trained from scratch by SFT on prompt + solver trace.

The base policy should be partly competent (10–60% eval accuracy when sampled at T = 1) with a
minority of uncertain "fork" tokens, so that GRPO has signal and noise has forks to hit.

The default recipes ship with the project: `harness/tasks/task_models/<recipe hash>/` holds
the fp16 weights, and `manifest.json` their weights checksum (`weights_sha`) and base
evaluation. Those files are the canonical models that results cite: the same recipe trained on
another CPU can differ in its last bits (kernels differ), so a recipe hash alone does not pin a
model. Loading a shipped recipe verifies its checksum and never trains. Any other recipe (or
`rebuild=True`) is trained into `$RATIOLAB_CACHE/task-models/<hash>/` (a standard HF folder,
written to a temp dir and renamed), reproducible by seed on one machine.

    python -m harness.tasks.warmstart task=arithmetic               # load (or build), evaluate
    python -m harness.tasks.warmstart task=arithmetic rebuild=true  # from the recipe; bit-equal?
    python -m harness.tasks.warmstart task=countdown steps=600      # override any recipe field
    python -m harness.tasks.warmstart +task.digits=3                # and any task kwarg
    python -m harness.tasks.warmstart task=arithmetic ship=arithmetic   # maintainers: re-ship
    model, tok = load_task_model("arithmetic")               # from code
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import platform
import random
import shutil
import time
from dataclasses import replace
from pathlib import Path

import torch
from torch.nn import functional as F
from tqdm.auto import trange
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel, PreTrainedTokenizerFast

from harness import CONFIGS
from harness.base.io import make_temp_dir, write_json_atomic
from harness.base.models import cache_dir, char_tokenizer, weights_sha
from harness.base.registry import build
from harness.sampling.engines import Engine
from harness.sampling.rollout import Sampling
from harness.tasks import TASKS, Problem, Task, teacher_prompt

SHIPPED = Path(__file__).parent / "task_models"  # the canonical task models
RECIPE_VERSION = 1  # bump when the training code changes what a recipe produces

COMMON = dict(
    hidden_size=192,
    intermediate_size=576,
    num_hidden_layers=6,
    num_attention_heads=6,
    num_key_value_heads=6,
    max_position_embeddings=256,
    steps=1000,
    batch_size=64,
    lr=2e-3,
    warmup=50,
    decay="cosine",
    weight_decay=0.01,
    wrong_frac=0.0,
    # share of SFT examples whose prompt carries the reference solution (tasks.TEACHER_PROMPT):
    # an OPSD teacher in distribution; 0 for the shipped recipes
    privileged_frac=0.0,
    seed=0,
)
# The step count puts the base policy inside the 10–60% band with forks left to hit: with 2.9M
# params and the LR decayed to 0, arithmetic's SFT reaches eval acc ≈ 0.31 at T = 1 with ~6% fork
# tokens at 400 steps (0.10 at 300; 0.61 and ~3% forks at 600); countdown (3 numbers ≤ 10), same
# shape, ≈ 0.24 with ~18% forks at 600 steps (seed spread: results/LOG.md).
RECIPES = {
    "arithmetic": dict(COMMON, steps=400, task_kwargs=dict(digits=2, ops="+-")),
    "countdown": dict(COMMON, steps=600, task_kwargs=dict(n_numbers=3, max_number=10)),
}
# A smaller arithmetic model (0.88M params: 4 layers, d = 128, constant LR), recipe hash
# 2ba4eb992777: `bench_step --model tiny` uses it, and results/README.md names it for the archived
# training figures. load_task_model("arithmetic", **SMALL_ARITHMETIC) rebuilds it.
SMALL_ARITHMETIC = dict(
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    steps=650,
    decay="constant",
)
# Fields added after recipe version 1, with the value version 1 implied: a recipe that keeps that
# value hashes as a version-1 recipe (so "2ba4eb992777" names SMALL_ARITHMETIC's recipe).
V1_IMPLIED = {"decay": "constant", "privileged_frac": 0.0}
DECAYS = ("cosine", "constant")
MODEL_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "max_position_embeddings",
)


def resolve_recipe(task: str, **overrides) -> dict:
    """The task's default recipe with `overrides` applied (`task_kwargs` merged key by key)."""
    if task not in RECIPES:
        raise KeyError(f"no warm-start recipe for task {task!r}; valid: {', '.join(RECIPES)}")
    cfg = copy.deepcopy(RECIPES[task])
    bad = sorted(set(overrides) - set(cfg))
    if bad:
        raise TypeError(f"warm-start: unknown recipe field(s) {bad}; valid: {sorted(cfg)}")
    task_kwargs = {**cfg["task_kwargs"], **(overrides.pop("task_kwargs", None) or {})}
    return {**cfg, **overrides, "task": task, "task_kwargs": task_kwargs}


def recipe_hash(cfg: dict) -> str:
    """12 hex digits of sha256 over the canonical JSON of the recipe and RECIPE_VERSION (fields at
    their V1_IMPLIED value left out)."""
    cfg = {k: v for k, v in cfg.items() if not (k in V1_IMPLIED and V1_IMPLIED[k] == v)}
    blob = json.dumps({"cfg": cfg, "version": RECIPE_VERSION}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def task_model_dir(cfg: dict) -> Path:
    return cache_dir() / "task-models" / recipe_hash(cfg)


def build_task(cfg: dict) -> Task:
    return build(TASKS, cfg["task"], "task", **cfg["task_kwargs"])


def init_model(cfg: dict, tok: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    """Fresh Llama from the recipe's shape, seeded by cfg['seed']."""
    torch.manual_seed(cfg["seed"])
    config = LlamaConfig(
        vocab_size=len(tok),
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        tie_word_embeddings=False,
        **{k: cfg[k] for k in MODEL_KEYS},
    )
    return LlamaForCausalLM(config)


def corrupt_answer(problem: Problem, rng: random.Random) -> Problem:
    """The same trace with one digit of its final answer changed (a plausible wrong solution)."""
    sol, ans = problem.solution, problem.answer
    cut = sol.rfind(ans)
    digits = [i for i, c in enumerate(ans) if c.isdigit()]
    if cut < 0 or not digits:
        return problem
    i = rng.choice(digits)
    wrong = ans[:i] + rng.choice([d for d in "0123456789" if d != ans[i]]) + ans[i + 1 :]
    return Problem(problem.prompt, problem.answer, sol[:cut] + wrong + sol[cut + len(ans) :])


def sft_batch(
    problems: list[Problem], tok: PreTrainedTokenizerFast
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded (input_ids, attention_mask, labels): prompt + solution + EOS, loss on the
    response only (labels −100 on prompt and padding)."""
    rows = []
    for p in problems:
        prompt = tok(p.prompt, add_special_tokens=False).input_ids
        response = tok(p.solution, add_special_tokens=False).input_ids + [tok.eos_token_id]
        rows.append((prompt + response, len(prompt)))
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), tok.pad_token_id, dtype=torch.long)
    attn = torch.zeros_like(input_ids)
    labels = torch.full_like(input_ids, -100)
    for i, (ids, n_prompt) in enumerate(rows):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        attn[i, : len(ids)] = 1
        labels[i, n_prompt : len(ids)] = input_ids[i, n_prompt : len(ids)]
    return input_ids, attn, labels


def sft_loss(model: PreTrainedModel, input_ids, attn, labels) -> torch.Tensor:
    """Token-mean next-token cross-entropy on the response tokens (on the model's device)."""
    dev = next(model.parameters()).device
    input_ids, attn, labels = input_ids.to(dev), attn.to(dev), labels.to(dev)
    logits = model(input_ids=input_ids, attention_mask=attn).logits[:, :-1]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))


def lr_at(step: int, cfg: dict) -> float:
    """Linear warm-up, then cosine decay to 0 at the last step (`decay="cosine"`: the model ends
    where the updates are tiny, so last-bit kernel differences cannot move it far) or constant
    (`decay="constant"`, recipe version 1)."""
    if cfg["decay"] not in DECAYS:
        raise ValueError(f"warm-start: decay={cfg['decay']!r}; valid: {', '.join(DECAYS)}")
    warm = min(1.0, (step + 1) / cfg["warmup"])
    if cfg["decay"] == "constant" or step < cfg["warmup"]:
        return cfg["lr"] * warm
    frac = (step + 1 - cfg["warmup"]) / max(1, cfg["steps"] - cfg["warmup"])
    return cfg["lr"] * 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))


def train_task_model(
    cfg: dict, progress: bool = True
) -> tuple[LlamaForCausalLM, PreTrainedTokenizerFast]:
    """SFT from scratch on fresh train-split problems each step (problems seeded by seed, step)."""
    tok = char_tokenizer()
    task = build_task(cfg)
    model = init_model(cfg, tok).train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=cfg["weight_decay"])
    rng = random.Random(f"wrong/{cfg['seed']}")
    privileged = random.Random(f"privileged/{cfg['seed']}")  # drawn only when the share is > 0
    bar = trange(cfg["steps"], desc=f"warm-start {cfg['task']}", disable=not progress)
    for step in bar:
        problems = task.sample(cfg["batch_size"], "train", seed=cfg["seed"] * 1_000_003 + step)
        problems = [
            corrupt_answer(p, rng) if rng.random() < cfg["wrong_frac"] else p for p in problems
        ]
        if cfg["privileged_frac"] > 0:
            problems = [
                replace(p, prompt=teacher_prompt(p))
                if privileged.random() < cfg["privileged_frac"]
                else p
                for p in problems
            ]
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        loss = sft_loss(model, *sft_batch(problems, tok))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 20 == 0 or step == cfg["steps"] - 1:
            bar.set_postfix(loss=f"{loss.item():.3f}")
    return model.eval(), tok


def save_atomic(model: PreTrainedModel, tok, cfg: dict, dest: Path) -> Path:
    """Write model, tokenizer and recipe.json to a temp dir beside `dest`, then rename it."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = make_temp_dir(dest.name + ".tmp-", dest.parent)
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / "recipe.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        try:
            os.replace(tmp, dest)
        except OSError:  # another process finished first: keep its copy
            if not (dest / "recipe.json").exists():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def shipped_manifest() -> dict[str, dict]:
    """recipe hash -> the shipped model's record (name, recipe, weights_sha, base evaluation)."""
    path = SHIPPED / "manifest.json"
    return json.loads(path.read_text()) if path.exists() else {}


def model_source(cfg: dict, rebuild: bool = False) -> tuple[Path, dict | None]:
    """Where a recipe's model lives: (shipped folder, its manifest entry) when it ships and
    `rebuild` is false, else (its cache folder, None)."""
    h = recipe_hash(cfg)
    entry = None if rebuild else shipped_manifest().get(h)
    return (SHIPPED / h if entry else task_model_dir(cfg)), entry


def load_task_model(
    task: str, progress: bool = True, rebuild: bool = False, **overrides
) -> tuple[LlamaForCausalLM, PreTrainedTokenizerFast]:
    """The task model for `task` (recipe defaults + overrides). A recipe that ships with the
    project loads its shipped weights (harness/tasks/task_models/<recipe hash>/, checked against the
    manifest's checksum); any other recipe, or `rebuild=True`, is trained from the recipe into
    $RATIOLAB_CACHE/task-models/<hash>/ when not cached there."""
    cfg = resolve_recipe(task, **overrides)
    path, entry = model_source(cfg, rebuild)
    if not entry and not (path / "recipe.json").exists():
        model, tok = train_task_model(cfg, progress)
        save_atomic(model, tok, cfg, path)
    model = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if entry and (sha := weights_sha(model)) != entry["weights_sha"]:
        h = recipe_hash(cfg)
        raise RuntimeError(
            f"shipped task model {path} has weights checksum {sha}, but the manifest (and "
            f"every result that cites recipe {h}) names {entry['weights_sha']}: the file is "
            "damaged or was replaced; restore it with "
            f"`git checkout -- harness/tasks/task_models/{h}`"
        )
    return model, PreTrainedTokenizerFast.from_pretrained(path)


def model_identity(model: PreTrainedModel, spec: str, recipe: dict | None = None) -> dict:
    """What a run records about its model: the spec, the weights checksum and, for task models,
    the recipe hash and whether the weights are the shipped ones for that recipe."""
    out = {"spec": spec, "weights_sha": weights_sha(model)}
    if recipe is not None:
        h = recipe_hash(recipe)
        shipped = shipped_manifest().get(h, {}).get("weights_sha")
        out.update(
            recipe_hash=h, shipped_weights_sha=shipped, shipped=shipped == out["weights_sha"]
        )
    return out


def cpu_name() -> str:
    """The CPU model (the kernels' last bits depend on it), from /proc/cpuinfo where present."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def ship_task_model(name: str, task: str, eval_n: int = 512, eval_seed: int = 123, **overrides):
    """Build the recipe (or take it from the cache), round it to fp16, write it to
    harness/tasks/task_models/<hash>/ and record its checksum and base evaluation in the
    manifest."""
    cfg = resolve_recipe(task, **overrides)
    h = recipe_hash(cfg)
    model, tok = load_task_model(task, rebuild=True, **overrides)
    built_sha = weights_sha(model)
    shutil.rmtree(SHIPPED / h, ignore_errors=True)  # re-shipping replaces the old weights
    save_atomic(model.half(), tok, cfg, SHIPPED / h)
    model = LlamaForCausalLM.from_pretrained(SHIPPED / h, dtype=torch.float32).eval()
    base = evaluate_policy(model, tok, build_task(cfg), eval_n, seed=eval_seed)
    manifest = shipped_manifest()
    manifest[h] = {
        "name": name,
        "task": task,
        "overrides": overrides,
        "weights_sha": weights_sha(model),
        "fp32_build_weights_sha": built_sha,
        "params": sum(p.numel() for p in model.parameters()),
        "base": {**base, "eval_n": eval_n, "eval_seed": eval_seed, "temperature": 1.0},
        "built_with": {"torch": torch.__version__, "cpu": cpu_name()},
    }
    write_json_atomic(SHIPPED / "manifest.json", manifest)
    return manifest[h]


@torch.no_grad()
def evaluate_policy(
    model: PreTrainedModel,
    tok: PreTrainedTokenizerFast,
    task: Task,
    n: int = 256,
    temperature: float = 1.0,
    seed: int = 0,
    batch: int = 128,
    privileged: bool = False,
) -> dict[str, float]:
    """Sampled accuracy on `n` held-out problems, plus the fork fraction (response tokens with
    p_t < 0.5 under the T = 1 policy) and the mean per-token entropy. `privileged`: the prompts
    carry the reference solution (OPSD's teacher format, tasks.TEACHER_PROMPT)."""
    engine = Engine(model.eval(), tok)
    problems = task.sample(n, "eval", seed)
    rewards, forks, ents, lens = [], [], [], []
    for i in range(0, n, batch):
        chunk = problems[i : i + batch]
        prompts = [teacher_prompt(p) if privileged else p.prompt for p in chunk]
        ro = engine.generate(
            prompts,
            Sampling(n=1, max_new_tokens=task.max_new_tokens, temperature=temperature),
            seed=seed + i,
        )
        stats = engine.score(ro.tokens, ro.attention_mask, ro.n_prompt)
        mask = ro.response_mask.bool()
        forks.append(stats["p_t"][mask] < 0.5)
        ents.append(stats["entropy"][mask])
        lens.append(ro.response_mask.sum(1))
        rewards += task.rollout_rewards(chunk, ro, tok).tolist()
    return {
        "acc": sum(rewards) / n,
        "fork_frac": torch.cat(forks).float().mean().item(),
        "entropy": torch.cat(ents).mean().item(),
        "response_len": torch.cat(lens).mean().item(),
    }


def rebuild_report(model: PreTrainedModel, recipe: dict) -> dict:
    """Whether a model trained here from `recipe` is the shipped one bit for bit: its fp32
    checksum against the shipped build's, and its fp16 rounding against the shipped weights."""
    entry = shipped_manifest().get(recipe_hash(recipe))
    if entry is None:
        return {"shipped": None}
    return {
        "shipped_weights_sha": entry["weights_sha"],
        "fp32_equal_to_shipped_build": weights_sha(model) == entry["fp32_build_weights_sha"],
        "fp16_equal_to_shipped": weights_sha(copy.deepcopy(model).half()) == entry["weights_sha"],
        "shipped_base": entry["base"],
    }


def main_cli(cfg) -> dict:
    """Find (shipped or cached) or build the task model for cfg.task.name (other cfg.task keys:
    task kwargs) with the non-null recipe overrides, and evaluate it. `rebuild=true` trains from
    the recipe even when the model ships and says whether it reproduced the shipped weights;
    `ship=<name>` writes the build into harness/tasks/task_models/ (maintainers); `out=<file.json>`
    also writes the report there."""
    from omegaconf import OmegaConf

    raw = OmegaConf.to_container(cfg, resolve=True)
    eval_n, eval_seed = raw.pop("eval_n"), raw.pop("eval_seed")
    rebuild, ship, out = raw.pop("rebuild"), raw.pop("ship"), raw.pop("out")
    task_kwargs = raw.pop("task")
    task = task_kwargs.pop("name")
    overrides = {k: v for k, v in raw.items() if v is not None and k != "hydra"}
    if task_kwargs:
        overrides["task_kwargs"] = task_kwargs
    recipe = resolve_recipe(task, **overrides)
    t0 = time.time()
    if ship:
        entry = ship_task_model(ship, task, eval_n, eval_seed, **overrides)
        print(json.dumps(entry, indent=2), flush=True)
        return entry
    model, tok = load_task_model(task, rebuild=rebuild, **overrides)
    h = recipe_hash(recipe)
    where = model_source(recipe, rebuild)[0]
    print(f"[warmstart] {where} ({time.time() - t0:.0f} s)", flush=True)
    report = {
        "path": str(where),
        "recipe_hash": h,
        "recipe": recipe,
        "weights_sha": weights_sha(model),
    }
    report["params"] = sum(p.numel() for p in model.parameters())
    report.update(evaluate_policy(model, tok, build_task(recipe), eval_n, seed=eval_seed))
    if recipe["privileged_frac"] > 0:  # the OPSD teacher: the same model, solution in the prompt
        report["teacher"] = evaluate_policy(
            model, tok, build_task(recipe), eval_n, seed=eval_seed, privileged=True
        )
    report.update(eval_n=eval_n, eval_seed=eval_seed, build_s=round(time.time() - t0, 1))
    if rebuild:
        report["rebuild"] = rebuild_report(model, recipe)
    print(json.dumps(report, indent=2), flush=True)
    if out:
        write_json_atomic(out, report)
    return report


if __name__ == "__main__":
    import hydra

    hydra.main(config_path=str(CONFIGS), config_name="warmstart", version_base="1.3")(main_cli)()
