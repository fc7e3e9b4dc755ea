"""vLLM as the sampler μ (harness.sampling.vllm_engine): in fp32 it samples with the trainer's
log-probs, `logp_mu` is the law it sampled from (chi-square, with a raw-law negative control), a
weight sync reaches its tied head and prefix cache, its rollouts are a function of the seed, a dead
worker is a clear error, bad configs fail before compute, and training runs with μ = vLLM.

Needs vLLM's venv (`make vllm`; `make test` builds it first)."""

from __future__ import annotations

import copy
import os
import signal

import pytest
import torch
from test_engines import _sharpened, assert_faithful_law

from harness.base.models import load_model, tiny_llama
from harness.sampling.engines import Engine
from harness.sampling.rollout import Sampling
from harness.sampling.vllm_engine import VllmEngine, WorkerDied, default_python

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not default_python().is_file(), reason=f"no vLLM venv at {default_python()} (make vllm)"
    ),
]


def vllm_tiny(seed: int = 0):
    """The tiny Llama with 32-wide heads: vLLM's CPU attention has no head_dim 16 kernel."""
    return tiny_llama(seed=seed, head_dim=32)


@pytest.fixture(scope="module")
def tiny():
    """One tiny model and one worker for the module (a worker takes ~15 s to start)."""
    model, tok = vllm_tiny()
    eng = VllmEngine(copy.deepcopy(model), tok)
    yield model, tok, eng
    eng.close()


def trainer_logp(model, tok, ro) -> torch.Tensor:
    return Engine(model, tok).logp(ro, stats=False)["logp"]


def test_fp32_samples_with_the_trainers_logprobs(tiny):
    model, tok, eng = tiny
    eng.load_weights_from_state(model.state_dict())
    ro = eng.generate([[5, 6, 7], [9, 10, 11, 12, 13]], Sampling(n=3, max_new_tokens=12), seed=3)
    m = ro.response_mask.bool()
    assert m.sum() > 20
    assert (trainer_logp(model, tok, ro) - ro.logp_mu)[m].abs().max() < 1e-4
    assert ro.logp_mu[~m].abs().sum() == 0 and (ro.response_ids[~m] == tok.pad_token_id).all()
    ends = ro.response_mask.sum(1).long() - 1  # a row that stopped early ends in EOS
    for b in torch.nonzero(ends < 11)[:, 0]:
        assert ro.response_ids[b, ends[b]] == tok.eos_token_id


def test_rollouts_are_a_function_of_the_seed(tiny):
    model, tok, eng = tiny
    a = eng.generate([[5, 6, 7]] * 2, Sampling(n=4, max_new_tokens=8), seed=11)
    b = eng.generate([[5, 6, 7]] * 2, Sampling(n=4, max_new_tokens=8), seed=11)
    c = eng.generate([[5, 6, 7]] * 2, Sampling(n=4, max_new_tokens=8), seed=12)
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.logp_mu, b.logp_mu)
    assert not torch.equal(a.response_ids, c.response_ids)


@pytest.mark.parametrize(
    "temperature,top_p,top_k", [(1.0, 1.0, 0), (0.7, 1.0, 0), (1.0, 0.8, 0), (1.3, 0.9, 12)]
)
def test_logp_mu_is_faithful_chi_square(tiny, temperature, top_p, top_k):
    model, tok, eng = tiny
    model, _ = _sharpened((copy.deepcopy(model), tok))
    eng.load_weights_from_state(model.state_dict())
    ro = eng.generate(
        [[5, 6, 7]],
        Sampling(n=6000, max_new_tokens=1, temperature=temperature, top_p=top_p, top_k=top_k),
        seed=1,
    )
    # vLLM reports the kept support under top-k, for mask replay
    assert_faithful_law(model, ro, temperature, top_p, top_k, atol=1e-4, support=bool(top_k))


def test_a_dead_worker_is_an_error_naming_the_engine_and_its_log():
    model, tok = vllm_tiny()
    eng = VllmEngine(model, tok)
    try:
        os.kill(eng.proc.pid, signal.SIGKILL)
        eng.proc.wait()
        with pytest.raises(WorkerDied, match=r"engine.sampler=vllm: the vLLM worker .* \(log: "):
            eng.generate([[5, 6, 7]], Sampling(n=2, max_new_tokens=4))
    finally:
        eng.close()


def test_a_model_vllm_cannot_run_fails_at_start_naming_the_model():
    model, tok = tiny_llama()  # head_dim 16: no CPU attention kernel in vLLM
    with pytest.raises(RuntimeError, match=r"model.spec.*head_dim=16"):
        VllmEngine(model, tok).close()


def test_weight_sync_reaches_the_tied_head_and_the_prefix_cache():
    """SmolLM2 ties lm_head to the embedding: after a reload vLLM's CPU GEMM keeps a packed copy
    of the old head unless it is re-packed, and prompts longer than one KV block reuse cached
    keys of the old weights unless the prefix cache is reset. One SGD step, then vLLM's
    logprobs equal the trainer's at the new weights; the old weights are far off (the check
    can fail)."""
    model, tok = load_model("smollm2-135m")
    eng = VllmEngine(copy.deepcopy(model), tok)
    try:
        prompt = tok(
            "Write a story about a dragon who lives in a cave by the sea, " * 12,
            add_special_tokens=False,
        ).input_ids
        assert len(prompt) > 128  # more than one KV-cache block (128 tokens on vLLM's CPU)
        eng.generate([prompt], Sampling(n=2, max_new_tokens=8), seed=0)  # fills the prefix cache
        old = copy.deepcopy(model)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        ids = torch.tensor([prompt])
        model(ids, labels=ids).loss.backward()
        opt.step()
        eng.load_weights_from_state(model.state_dict())
        ro = eng.generate([prompt], Sampling(n=2, max_new_tokens=8), seed=0)
        m = ro.response_mask.bool()
        assert (trainer_logp(model, tok, ro) - ro.logp_mu)[m].abs().max() < 1e-4
        assert (trainer_logp(old, tok, ro) - ro.logp_mu)[m].abs().max() > 1e-2
        assert len(eng.sync_s) == 1 and eng.sync_s[0] > 0
    finally:
        eng.close()


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    from harness.base.models import save_folder

    model, tok = vllm_tiny()
    return save_folder(model, tok, tmp_path_factory.mktemp("models") / "tiny-llama-hd32")


def test_training_with_vllm_as_the_sampler(tmp_path, tiny_folder):
    """GRPO through harness.train with μ = vLLM fp32: π_old recomputed by the trainer, the
    identity dial ≈ 1 every step, μ's β at fp32 rounding, the weight sync timed per step, and
    the worker's log in the run folder."""
    from test_train import _cfg, _metrics

    from harness import train

    # the check off: it would start a second vLLM worker (~30 s); the loop's dials are tested
    cfg = _cfg(
        tmp_path,
        "steps=3",
        f"model.spec={tiny_folder}",
        "engine.sampler=vllm",
        "mechanism_batches=0",
    )
    train.run(cfg)
    ms = _metrics(tmp_path)
    assert [m["step"] for m in ms] == [1, 2, 3]
    for m in ms:
        assert abs(m["identity/mean_ratio"] - 1) < 1e-3 and m["identity/ok"] == 1.0
        assert m["dial/mean_abs_delta"] < 1e-4  # fp32 vLLM: kernel rounding only
        assert m["time/sync_s"] > 0
    assert (tmp_path / "vllm_worker.log").stat().st_size > 0


@pytest.mark.parametrize(
    "override,match",
    [
        ("engine.vllm.python=/no/python", "engine.vllm.python='/no/python' does not exist"),
        ("engine.sampler_dtype=fp16", "sampler_dtype='fp16' with engine.sampler=vllm; valid: fp32"),
        ("noise=logit", r"engine.sampler=vllm with injected noise \['logit'\]"),
        ("rollout.top_p=0.9", r"rollout.top_p=0.9 with rollout.top_k=0, engine.sampler=vllm"),
        ("engine.routing_replay=true", "engine.routing_replay=True with engine.sampler=vllm"),
    ],
)
def test_a_bad_vllm_config_fails_before_compute(tmp_path, override, match):
    from test_train import _cfg

    from harness.runs.validate import validate

    with pytest.raises((ValueError, FileNotFoundError), match=match):
        validate(_cfg(tmp_path, "engine.sampler=vllm", override))


def test_a_worker_killed_mid_run_ends_the_run_and_the_rerun_resumes(tmp_path, tiny_folder):
    """The worker dies (SIGKILL) while the run is between checkpoints: the run ends with an
    error naming the engine, not a hang; the same command again resumes from the last
    checkpoint and finishes."""
    import subprocess
    import sys
    import time

    from test_train import TINY, _metrics

    out = tmp_path / "run"

    def cmd(steps: int) -> list[str]:  # the check off: a second vLLM worker; resume is tested
        return [
            sys.executable,
            "-m",
            "harness.train",
            f"out={out}",
            *TINY,
            f"steps={steps}",
            f"model.spec={tiny_folder}",
            "engine.sampler=vllm",
            "mechanism_batches=0",
            "checkpoint_every=1",
            "progress=false",
        ]

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen(cmd(40), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 240
    while not (out / "metrics.jsonl").exists() or len(_metrics(out)) < 2:
        assert p.poll() is None and time.monotonic() < deadline, p.stdout.read().decode()
        time.sleep(0.5)
    worker = subprocess.run(
        ["pgrep", "-P", str(p.pid), "-f", "vllm_worker"], capture_output=True, text=True
    ).stdout.split()
    assert len(worker) == 1
    os.kill(int(worker[0]), signal.SIGKILL)
    text = p.communicate(timeout=120)[0].decode()
    assert p.returncode != 0 and "engine.sampler=vllm: the vLLM worker" in text, text[-3000:]
    done = len(_metrics(out))
    assert done < 40
    rerun = subprocess.run(cmd(done + 2), env=env, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    assert "resumed from" in rerun.stdout + rerun.stderr
    assert [m["step"] for m in _metrics(out)] == list(range(1, done + 3))
