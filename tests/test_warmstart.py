"""Warm-start task models: recipe/hash, SFT batches, caching, atomic writes, reproducibility."""

import random
from pathlib import Path

import pytest
import torch

from harness import warmstart as W
from harness.models import char_tokenizer
from harness.tasks import Problem

# a few-thousand-parameter model trained for 3 steps: the real recipe, shrunk
TINY = dict(
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=2,
    max_position_embeddings=64,
    steps=3,
    batch_size=4,
    warmup=2,
)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RATIOLAB_CACHE", str(tmp_path))
    return tmp_path


def state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_resolve_recipe_merges_task_kwargs_and_rejects_unknown_fields():
    cfg = W.resolve_recipe("arithmetic", steps=5, task_kwargs={"digits": 3})
    assert cfg["steps"] == 5 and cfg["task"] == "arithmetic"
    assert cfg["task_kwargs"] == {"digits": 3, "ops": W.RECIPES["arithmetic"]["task_kwargs"]["ops"]}
    with pytest.raises(TypeError, match=r"unknown recipe field\(s\) \['step'\]"):
        W.resolve_recipe("arithmetic", step=5)
    with pytest.raises(KeyError, match="valid: arithmetic, countdown"):
        W.resolve_recipe("sudoku")


def test_recipe_hash_changes_with_every_field():
    base = W.resolve_recipe("arithmetic")
    h = W.recipe_hash(base)
    assert len(h) == 12 and h == W.recipe_hash(W.resolve_recipe("arithmetic"))
    for k, v in base.items():
        if k in ("task", "task_kwargs"):
            continue
        assert W.recipe_hash({**base, k: v * 2 + 1}) != h, k
    assert W.recipe_hash({**base, "task_kwargs": {"digits": 3, "ops": "+-"}}) != h


def test_sft_batch_masks_prompt_and_padding_and_appends_eos():
    tok = char_tokenizer()
    ids, attn, labels = W.sft_batch([Problem("1+2=", "3", "1+2=3"), Problem("9=", "9", "9")], tok)
    # row 0: 4 prompt chars + 5 solution chars + EOS = 10; row 1: 2 + 1 + EOS = 4 (6 pads)
    assert ids.shape == (2, 10) and attn.sum(1).tolist() == [10, 4]
    eos, pad = tok.eos_token_id, tok.pad_token_id
    assert tok.decode(ids[0, :9]) == "1+2=1+2=3" and ids[0, 9] == eos
    assert labels[0, :4].tolist() == [-100] * 4 and labels[0, 4:].tolist() == ids[0, 4:].tolist()
    assert labels[1].tolist() == [-100, -100, tok.convert_tokens_to_ids("9"), eos] + [-100] * 6
    assert ids[1, 4:].tolist() == [pad] * 6


def test_lr_warmup_then_constant():
    cfg = {"lr": 2e-3, "warmup": 50}
    assert W.lr_at(0, cfg) == pytest.approx(4e-5) and W.lr_at(49, cfg) == pytest.approx(2e-3)
    assert W.lr_at(500, cfg) == 2e-3


def test_corrupt_answer_changes_one_digit_of_the_final_answer():
    p = Problem("47+85=", "132", "47+80+5=127+5=132")
    q = W.corrupt_answer(p, random.Random(0))
    assert q.solution[:-3] == p.solution[:-3] and q.solution[-3:] != "132"
    assert sum(a != b for a, b in zip(q.solution[-3:], "132")) == 1


def test_load_task_model_trains_once_then_hits_the_cache(cache, monkeypatch):
    model, tok = W.load_task_model("arithmetic", progress=False, **TINY)
    dest = W.task_model_dir(W.resolve_recipe("arithmetic", **TINY))
    assert dest.parent == cache / "task-models" and dest.is_dir()
    assert {"config.json", "recipe.json", "model.safetensors", "tokenizer.json"} <= {
        p.name for p in dest.iterdir()
    }
    assert [p.name for p in dest.parent.iterdir()] == [dest.name]  # no .tmp-* left behind

    def no_training(*a, **k):
        raise AssertionError("cache miss")

    monkeypatch.setattr(W, "train_task_model", no_training)
    again, tok2 = W.load_task_model("arithmetic", progress=False, **TINY)
    assert same(state(model), state(again)) and len(tok2) == len(tok)
    with pytest.raises(AssertionError, match="cache miss"):
        W.load_task_model("arithmetic", progress=False, **{**TINY, "seed": 1})


def test_training_is_reproducible_by_seed():
    cfg = W.resolve_recipe("arithmetic", **TINY)
    a, _ = W.train_task_model(cfg, progress=False)
    b, _ = W.train_task_model(cfg, progress=False)
    c, _ = W.train_task_model({**cfg, "seed": 1}, progress=False)
    assert same(state(a), state(b)) and not same(state(a), state(c))
    init = W.init_model(cfg, char_tokenizer())
    assert not same(state(a), state(init))  # training changed the weights


def test_interrupted_save_leaves_nothing(cache, monkeypatch):
    def boom(self, path, **kw):
        (Path(path) / "config.json").write_text("{}")  # partial output, then the crash
        raise KeyboardInterrupt

    monkeypatch.setattr(W.LlamaForCausalLM, "save_pretrained", boom)
    with pytest.raises(KeyboardInterrupt):
        W.load_task_model("arithmetic", progress=False, **TINY)
    assert list((cache / "task-models").iterdir()) == []


def test_evaluate_policy_reports_rates(cache):
    model, tok = W.load_task_model("countdown", progress=False, **TINY)
    task = W.build_task(W.resolve_recipe("countdown"))
    out = W.evaluate_policy(model, tok, task, n=6, seed=0, batch=4)
    assert set(out) == {"acc", "fork_frac", "entropy", "response_len"}
    assert 0 <= out["acc"] <= 1 and 0 <= out["fork_frac"] <= 1 and out["entropy"] > 0


def test_cli_composes_and_runs(cache):
    from hydra import compose, initialize_config_dir

    overrides = [f"{k}={v}" for k, v in TINY.items()] + ["eval_n=4", "+task.digits=1"]
    config_dir = str(Path(__file__).parents[1] / "experiments")
    with initialize_config_dir(config_dir=config_dir, version_base="1.3"):
        cfg = compose("warmstart", overrides=overrides)
    report = W.main_cli(cfg)
    recipe = W.resolve_recipe("arithmetic", **TINY, task_kwargs={"digits": 1})
    assert report["path"] == str(W.task_model_dir(recipe)) and report["params"] < 20_000


@pytest.mark.slow
def test_recipe_base_policy_in_band(cache):
    """The full arithmetic recipe (~7 min): 10–60% eval accuracy and a minority of forks."""
    model, tok = W.load_task_model("arithmetic", progress=False)
    out = W.evaluate_policy(model, tok, W.build_task(W.resolve_recipe("arithmetic")), n=512)
    assert 0.10 <= out["acc"] <= 0.60
    assert 0.01 <= out["fork_frac"] <= 0.3


def test_small_arithmetic_recipe_keeps_its_hash():
    """The committed training figures name the model they used by this hash (results/README.md);
    a change to the recipe defaults or the hashing must not silently point it elsewhere."""
    recipe = W.resolve_recipe("arithmetic", **W.SMALL_ARITHMETIC)
    assert W.recipe_hash(recipe) == "2ba4eb992777"
    assert recipe["hidden_size"] == 128 and recipe["num_hidden_layers"] == 4
    assert W.recipe_hash(W.resolve_recipe("arithmetic")) != "2ba4eb992777"
