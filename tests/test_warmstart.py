"""Warm-start task models: recipe/hash, SFT batches, caching, atomic writes, reproducibility,
shipped weights and their checksums."""

import copy
import json
import random
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from harness.base.models import char_tokenizer
from harness.tasks import Problem
from harness.tasks import warmstart as W

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
# The default arithmetic recipe's base policy (eval n = 512, seed 123, T = 1): 99% prediction
# intervals for one new build, mean ± t(0.995, 4)·sd·sqrt(1 + 1/5), from the 5 rebuilds (seeds
# 0–4) in results/warmstart/arithmetic-rebuilds/ (results/LOG.md): acc 0.307, 0.264,
# 0.385, 0.281, 0.291 (mean 0.306, sd 0.047); fork fraction 0.064, 0.073, 0.055, 0.059, 0.064
# (mean 0.063, sd 0.0066). Seeds change the init and the data order, so their spread bounds what
# last-bit kernel differences between machines can do to one seed.
ACC_BAND = (0.068, 0.543)
FORK_BAND = (0.030, 0.096)


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
        changed = v + "x" if isinstance(v, str) else v * 2 + 1
        assert W.recipe_hash({**base, k: changed}) != h, k
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


def test_lr_warmup_then_cosine_to_zero_or_constant():
    cfg = {"lr": 2e-3, "warmup": 50, "steps": 1050, "decay": "cosine"}
    assert W.lr_at(0, cfg) == pytest.approx(4e-5) and W.lr_at(48, cfg) == pytest.approx(1.96e-3)
    assert W.lr_at(49, cfg) == pytest.approx(2e-3)
    # step 549 is half-way through the 1000 decay steps: cos(pi/2) = 0 -> lr/2; the last is 0
    assert W.lr_at(549, cfg) == pytest.approx(1e-3) and W.lr_at(1049, cfg) == pytest.approx(0)
    lrs = [W.lr_at(i, cfg) for i in range(49, 1050)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))
    const = {**cfg, "decay": "constant"}
    assert W.lr_at(49, const) == W.lr_at(1049, const) == 2e-3
    with pytest.raises(ValueError, match="decay='linear'; valid: cosine, constant"):
        W.lr_at(0, {**cfg, "decay": "linear"})


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


@pytest.mark.recipe
def test_recipe_rebuild_lands_in_the_measured_band(cache, capsys):
    """Rebuild the default arithmetic recipe from scratch (~8 min on one core) and check the
    base policy against the band set from the measured spread over 5 seeds (results/LOG.md);
    report whether this machine reproduced the shipped weights bit for bit."""
    recipe = W.resolve_recipe("arithmetic")
    model, tok = W.load_task_model("arithmetic", progress=False, rebuild=True)
    out = W.evaluate_policy(model, tok, W.build_task(recipe), n=512, seed=123)
    same = W.rebuild_report(model, recipe)
    with capsys.disabled():
        print(f"\n[recipe] rebuild: {out}; reproduces the shipped weights: {same}")
    assert ACC_BAND[0] <= out["acc"] <= ACC_BAND[1], out
    assert FORK_BAND[0] <= out["fork_frac"] <= FORK_BAND[1], out


def test_small_arithmetic_recipe_keeps_its_hash():
    """results/README.md names the archived training figures' model by this hash; a change to
    the recipe defaults or the hashing must not silently point it elsewhere."""
    recipe = W.resolve_recipe("arithmetic", **W.SMALL_ARITHMETIC)
    assert W.recipe_hash(recipe) == "2ba4eb992777"
    assert recipe["hidden_size"] == 128 and recipe["num_hidden_layers"] == 4
    assert W.recipe_hash(W.resolve_recipe("arithmetic")) != "2ba4eb992777"


@pytest.fixture
def shipped(tmp_path, monkeypatch):
    """An empty harness/tasks/task_models/ stand-in."""
    d = tmp_path / "shipped"
    monkeypatch.setattr(W, "SHIPPED", d)
    return d


def test_weights_sha_names_the_values_not_the_dtype_or_the_object():
    from harness.base.models import tiny_llama, weights_sha

    a, _ = tiny_llama(seed=0)
    b, _ = tiny_llama(seed=0)
    assert weights_sha(a) == weights_sha(b) and len(weights_sha(a)) == 16
    assert weights_sha(a) != weights_sha(tiny_llama(seed=1)[0])
    half = copy.deepcopy(a).half()
    assert weights_sha(half) == weights_sha(half.float())  # fp16 -> fp32 is exact
    assert weights_sha(half) != weights_sha(a)  # rounding changed the values
    with torch.no_grad():  # one bit of one weight
        w = b.model.layers[0].mlp.up_proj.weight
        w.view(torch.int32)[0, 0] ^= 1
    assert weights_sha(a) != weights_sha(b)


def test_shipped_model_loads_without_training_and_its_checksum_is_enforced(
    cache, shipped, monkeypatch
):
    entry = W.ship_task_model("tiny", "arithmetic", eval_n=4, **TINY)
    h = W.recipe_hash(W.resolve_recipe("arithmetic", **TINY))
    assert W.shipped_manifest()[h] == entry and (shipped / h / "model.safetensors").exists()
    assert json.loads((shipped / h / "config.json").read_text())["dtype"] == "float16"
    assert set(entry["base"]) >= {"acc", "fork_frac", "eval_n"} and entry["params"] < 20_000

    other, _ = W.train_task_model(W.resolve_recipe("arithmetic", **{**TINY, "seed": 5}), False)

    def no_training(*a, **k):
        raise AssertionError("trained although the recipe ships")

    monkeypatch.setattr(W, "train_task_model", no_training)
    shutil.rmtree(cache / "task-models")  # only the shipped copy is left
    model, _ = W.load_task_model("arithmetic", progress=False, **TINY)
    from harness.base.models import weights_sha

    assert weights_sha(model) == entry["weights_sha"]
    assert next(model.parameters()).dtype == torch.float32
    ident = W.model_identity(model, "task-model", W.resolve_recipe("arithmetic", **TINY))
    assert ident == {
        "spec": "task-model",
        "weights_sha": entry["weights_sha"],
        "recipe_hash": h,
        "shipped_weights_sha": entry["weights_sha"],
        "shipped": True,
    }
    # a replaced weights file is refused, naming both checksums and the fix
    other.half().save_pretrained(shipped / h)
    with pytest.raises(RuntimeError, match=f"names {entry['weights_sha']}.*git checkout"):
        W.load_task_model("arithmetic", progress=False, **TINY)


def test_rebuild_reports_whether_it_reproduced_the_shipped_weights(cache, shipped):
    W.ship_task_model("tiny", "arithmetic", eval_n=4, **TINY)
    recipe = W.resolve_recipe("arithmetic", **TINY)
    again, _ = W.train_task_model(recipe, progress=False)  # same machine, same kernels
    rep = W.rebuild_report(again, recipe)
    assert rep["fp32_equal_to_shipped_build"] and rep["fp16_equal_to_shipped"]
    other, _ = W.train_task_model({**recipe, "seed": 1}, progress=False)
    rep = W.rebuild_report(other, recipe)
    assert not rep["fp32_equal_to_shipped_build"] and not rep["fp16_equal_to_shipped"]
    assert W.rebuild_report(other, {**recipe, "seed": 1}) == {"shipped": None}


def test_the_default_recipes_ship_and_match_their_manifest():
    """The canonical task models are in the repository (no build on a fresh machine), each is
    the fp16 rounding of its recipe's build and loads to the checksum its results cite."""
    from harness.base.models import weights_sha

    manifest = W.shipped_manifest()
    wanted = {
        "arithmetic": W.resolve_recipe("arithmetic"),
        "countdown": W.resolve_recipe("countdown"),
        "arithmetic-small": W.resolve_recipe("arithmetic", **W.SMALL_ARITHMETIC),
    }
    for name, recipe in wanted.items():
        h = W.recipe_hash(recipe)
        assert manifest[h]["name"] == name, (name, h)
        assert json.loads((W.SHIPPED / h / "recipe.json").read_text()) == recipe
    for h, entry in manifest.items():  # every shipped model loads: these and the OPSD testbed's
        assert (W.SHIPPED / h / "model.safetensors").exists(), entry["name"]  # else: a build
        model, _ = W.load_task_model(entry["task"], progress=False, **entry["overrides"])
        assert weights_sha(model) == entry["weights_sha"], entry["name"]


def test_privileged_frac_trains_on_the_teacher_format_and_keeps_the_shipped_hashes(monkeypatch):
    """privileged_frac=0.5: about half the SFT prompts carry the reference solution
    (tasks.TEACHER_PROMPT); 0 (the default) draws nothing, so shipped recipes hash as before."""
    from harness.tasks import teacher_prompt

    seen = []
    batch = W.sft_batch

    def spy(problems, tok):
        seen.extend(problems)
        return batch(problems, tok)

    monkeypatch.setattr(W, "sft_batch", spy)
    recipe = W.resolve_recipe(
        "arithmetic", **{**TINY, "steps": 8}, privileged_frac=0.5, task_kwargs={"digits": 1}
    )
    W.train_task_model(recipe, progress=False)
    privileged = [p for p in seen if p.prompt.startswith("Reference solution: ")]
    assert 0.3 < len(privileged) / len(seen) < 0.7
    assert all(
        p.prompt == teacher_prompt(replace(p, prompt=p.prompt.split("\n", 1)[1]))
        for p in privileged
    )
    for task, h in [("arithmetic", "a814f17fcbcb"), ("countdown", "1d46e5429706")]:
        assert W.recipe_hash(W.resolve_recipe(task)) == h
    assert W.recipe_hash(W.resolve_recipe("arithmetic", privileged_frac=0.4)) != "a814f17fcbcb"
