"""CTranslate2 as the sampler μ (harness.sampling.ct2): the converted model computes what the HF
trainer computes (float32), `logp_mu` is the law CTranslate2 sampled from (chi-square, as the HF
engine), the conversion cache is atomic, weight syncs reconvert, and training runs with μ =
CTranslate2."""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from test_engines import _sharpened, assert_faithful_law

from harness.base.models import weights_sha
from harness.sampling.ct2 import Ct2Engine, convert, require_ct2
from harness.sampling.engines import Engine
from harness.sampling.rollout import Sampling


@pytest.fixture
def ct2_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RATIOLAB_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "ct2"


def test_float32_engine_scores_and_samples_what_the_hf_trainer_computes(tiny_llama, ct2_cache):
    model, tok = tiny_llama
    eng = Ct2Engine(copy.deepcopy(model), tok, compute_type="float32")
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13]]
    ro = eng.generate(prompts, Sampling(n=3, max_new_tokens=8), seed=3)
    hf = Engine(model, tok).logp(ro, stats=False)["logp"]
    m = ro.response_mask.bool()
    assert m.sum() > 20
    assert (hf - ro.logp_mu)[m].abs().max() < 1e-5  # sampling path: μ's logits = the trainer's
    # score path: the converted model's full forward on the sampled sequences
    seqs = [
        p + ro.response_ids[i, : int(m[i].sum())].tolist()
        for i, p in enumerate(np.repeat(np.array(prompts, dtype=object), 3))
    ]
    z = np.asarray(eng.load().forward_batch(seqs[:1]))[0]
    with torch.no_grad():
        ref = model(torch.tensor(seqs[:1])).logits[0]
    assert np.abs(z - ref.numpy()).max() < 1e-5
    assert ro.logp_mu[~m].abs().sum() == 0 and (ro.response_ids[~m] == tok.pad_token_id).all()


@pytest.mark.parametrize(
    "temperature,top_p,top_k", [(1.0, 1.0, 0), (0.7, 1.0, 0), (1.0, 0.8, 0), (1.3, 0.9, 12)]
)
def test_logp_mu_is_faithful_chi_square(tiny_llama, ct2_cache, temperature, top_p, top_k):
    model, tok = _sharpened(tiny_llama)
    eng = Ct2Engine(copy.deepcopy(model), tok)
    ro = eng.generate(
        [[5, 6, 7]],
        Sampling(n=6000, max_new_tokens=1, temperature=temperature, top_p=top_p, top_k=top_k),
        seed=1,
    )
    # the kept support is recorded under any truncation, for mask replay
    assert_faithful_law(
        model, ro, temperature, top_p, top_k, atol=1e-5, support=bool(top_k or top_p < 1.0)
    )


def test_int8_is_a_real_second_engine(tiny_llama, ct2_cache):
    """int8 GEMMs (int8 weights × quantised activations): a β the float32 engine does not have,
    of ~1e-2 per token on the tiny Llama; `int8` and
    `int8_float32` are one computation on CPU."""
    model, tok = tiny_llama
    ro = Ct2Engine(copy.deepcopy(model), tok, compute_type="int8").generate(
        [[5, 6, 7]], Sampling(n=16, max_new_tokens=8), seed=0
    )
    m = ro.response_mask.bool()
    beta = (Engine(model, tok).logp(ro, stats=False)["logp"] - ro.logp_mu)[m].abs().mean()
    assert 1e-4 < float(beta) < 0.2
    same = Ct2Engine(copy.deepcopy(model), tok, compute_type="int8_float32").generate(
        [[5, 6, 7]], Sampling(n=16, max_new_tokens=8), seed=0
    )
    assert torch.equal(same.response_ids, ro.response_ids) and torch.equal(same.logp_mu, ro.logp_mu)


def test_sampling_is_seeded(tiny_llama, ct2_cache):
    model, tok = tiny_llama
    eng = Ct2Engine(copy.deepcopy(model), tok)
    a, b = (eng.generate([[5, 6, 7]], Sampling(n=8, max_new_tokens=6), seed=s) for s in (4, 4))
    c = eng.generate([[5, 6, 7]], Sampling(n=8, max_new_tokens=6), seed=5)
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.logp_mu, b.logp_mu)
    assert not torch.equal(a.response_ids, c.response_ids)


def test_weight_sync_reconverts_and_keeps_one_folder(tiny_llama, ct2_cache):
    model, tok = tiny_llama
    eng = Ct2Engine(copy.deepcopy(model), tok)
    first = eng.path
    assert first.parent == ct2_cache and first.name == weights_sha(model)
    eng.load_weights_from_state(model.state_dict())  # the same weights: nothing converted
    assert eng.path == first and list(eng._syncs.iterdir()) == []
    moved = copy.deepcopy(model)
    with torch.no_grad():
        moved.lm_head.weight.mul_(3.0)
    eng.load_weights_from_state(moved.state_dict())
    assert eng.path.name == weights_sha(moved) and len(eng.sync_s) == 2
    ro = eng.generate([[5, 6, 7]], Sampling(n=4, max_new_tokens=5), seed=0)
    m = ro.response_mask.bool()
    assert (Engine(moved, tok).logp(ro, stats=False)["logp"] - ro.logp_mu)[m].abs().max() < 1e-5
    again = copy.deepcopy(model)
    with torch.no_grad():
        again.lm_head.weight.mul_(2.0)
    previous = eng.path
    eng.load_weights_from_state(again.state_dict())
    assert not previous.exists() and first.exists()  # sync folders go; the cached one stays
    path = eng.path
    eng.load_weights_from_state(again.state_dict())  # unchanged: no reload
    assert eng.path == path and len(eng.sync_s) == 4 and path.exists()
    eng.close()
    assert not path.exists()


def test_a_killed_conversion_leaves_nothing_under_the_final_name(tiny_llama, tmp_path):
    """SIGKILL in the middle of writing the converted model: the checksum folder does not
    exist, and the next conversion succeeds."""
    model, tok = tiny_llama
    src = tmp_path / "model"
    model.save_pretrained(src)
    tok.save_pretrained(src)
    root = tmp_path / "ct2"
    script = textwrap.dedent(f"""
        import pathlib, time, ctranslate2
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from harness.sampling.ct2 import convert
        def stall(self, output_dir, **kw):
            pathlib.Path(output_dir).mkdir(parents=True)
            (pathlib.Path(output_dir) / "model.bin").write_bytes(b"half")
            print("writing", flush=True)
            time.sleep(60)
        ctranslate2.converters.TransformersConverter.convert = stall
        src = "{src}"
        convert(AutoModelForCausalLM.from_pretrained(src), AutoTokenizer.from_pretrained(src),
                "{root}")
    """)
    proc = subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    assert proc.stdout.readline().strip() == "writing"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (root / weights_sha(model)).exists()
    assert convert(model, tok, root) == root / weights_sha(model)
    assert (root / weights_sha(model) / "model.bin").stat().st_size > 1000


def test_a_failed_conversion_cleans_up(tiny_llama, tmp_path, monkeypatch):
    ct2 = require_ct2()
    model, tok = tiny_llama

    def boom(self, output_dir, **kw):
        raise RuntimeError("converter failed")

    monkeypatch.setattr(ct2.converters.TransformersConverter, "convert", boom)
    with pytest.raises(RuntimeError, match="converter failed"):
        convert(model, tok, tmp_path / "ct2")
    assert list((tmp_path / "ct2").iterdir()) == []


def test_missing_ctranslate2_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "ctranslate2", None)  # import ctranslate2 → ImportError
    with pytest.raises(ImportError, match=r"pip install -e '\.\[ct2\]'"):
        require_ct2()
    from omegaconf import OmegaConf

    from harness.runs.config import EngineCfg
    from harness.sampling.samplers import check_sampler

    eng = OmegaConf.structured(EngineCfg(sampler="ct2"))
    with pytest.raises(ImportError, match="pip install"):
        check_sampler(eng, [])


def test_bad_compute_type_names_the_key(tiny_llama):
    model, tok = tiny_llama
    with pytest.raises(ValueError, match="engine.ct2.compute_type='fp16'; valid: float32"):
        Ct2Engine(model, tok, compute_type="fp16")


def test_training_with_ct2_as_the_sampler(tmp_path, ct2_cache):
    """GRPO with μ = CTranslate2 int8 on the tiny model: π_old recomputed by the trainer, the
    identity dial ≈ 1 every step, and the int8 engine's β visible in the dials."""
    from test_train import _cfg, _metrics

    from harness import train

    # the check off: it would start a second CTranslate2 engine; the loop's dials are tested
    cfg = _cfg(
        tmp_path,
        "steps=3",
        "engine.sampler=ct2",
        "engine.ct2.compute_type=int8",
        "mechanism_batches=0",
    )
    train.run(cfg)
    ms = _metrics(tmp_path)
    assert [m["step"] for m in ms] == [1, 2, 3]
    for m in ms:
        assert abs(m["identity/mean_ratio"] - 1) < 0.05 and m["identity/ok"] == 1.0
        assert m["dial/mean_abs_delta"] > 1e-4  # int8 β, not zero


def test_measure_with_ct2_as_the_sampler(tmp_path, ct2_cache):
    """The measurement job with μ = CTranslate2: float32 β is kernel rounding (≤ 1e-5), int8 β is
    real and the identity check holds; injected noise with ct2 is refused before compute."""
    from test_measure import TINY
    from test_measure import _cfg as measure_cfg

    from harness import measure

    f32 = measure.run(
        measure_cfg(tmp_path / "f32", *TINY, "noise=none", "live.mode=none", "engine.sampler=ct2")
    )
    assert f32["table7"]["cal"]["max_abs_delta"] <= 1e-5 and f32["sampler"] == "ct2"
    assert f32["label"].startswith("CTranslate2 float32")
    i8 = measure.run(
        measure_cfg(
            tmp_path / "i8",
            *TINY,
            "noise=none",
            "live.mode=none",
            "engine.sampler=ct2",
            "engine.ct2.compute_type=int8",
        )
    )
    assert i8["table7"]["cal"]["mean_abs_delta"] > 1e-4
    assert abs(i8["identity_mean_ratio"]["cal"] - 1) < 0.05
    with pytest.raises(ValueError, match="engine.sampler=ct2 with injected noise"):
        measure.run(measure_cfg(tmp_path / "bad", *TINY, "engine.sampler=ct2"))
