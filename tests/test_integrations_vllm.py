"""harness.integrations.vllm_noise in vLLM's CPU build, loaded through the `vllm.logits_processors`
entry point pyproject.toml declares: the β it injects is recomputed exactly by the HF trainer with
the same noise model (ground truth from the seed and the tokens alone), under processed_logprobs
the recorded log-probs carry it with the gate law's variance per confidence bin, under
raw_logprobs they do not (same tokens, the clean model's log-probs), and a bad spec is a clear
error.

Needs vLLM's venv (`make vllm`; `make test` builds it first)."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import installed_entry_points

from harness.base.models import load_model
from harness.noise.position import PositionNoise
from harness.sampling.engines import Engine
from harness.sampling.rollout import Sampling
from harness.sampling.vllm_engine import VllmEngine, VllmOptions, default_python
from harness.stats.diagnostics import CONF_EDGES, bin_index, gate

KEY = "ratiolab_noise"  # harness.integrations.vllm_noise.KEY (that module imports vllm)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not default_python().is_file(), reason=f"no vLLM venv at {default_python()} (make vllm)"
    ),
]

PROMPTS = [
    "Write a short story about a fox who learns to count.",
    "List three facts about the moon and explain each one.",
    "What is 17 times 23? Think step by step.",
    "Describe your favourite city in a few sentences.",
]


@pytest.fixture(scope="module")
def smollm2():
    return load_model("smollm2-135m")


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return installed_entry_points(tmp_path_factory.mktemp("site"))


def prompt_ids(tok) -> list[list[int]]:
    chat = [[{"role": "user", "content": p}] for p in PROMPTS]
    return [tok.apply_chat_template(c, add_generation_prompt=True).input_ids for c in chat]


def sample(smollm2, path, mode: str, specs: list[dict], n: int = 8, T: int = 48) -> list:
    """One vLLM worker under `mode`, one rollout per noise spec (same prompts, seed 0)."""
    model, tok = smollm2
    eng = VllmEngine(copy.deepcopy(model), tok, VllmOptions(logprobs_mode=mode, pythonpath=path))
    try:
        out = []
        for spec in specs:
            eng.extra_args = {KEY: spec}
            out.append(eng.generate(prompt_ids(tok), Sampling(n=n, max_new_tokens=T), seed=0))
        return out
    finally:
        eng.close()


def noise_of(spec: dict) -> PositionNoise:
    """The HF sampler's noise model for a request's spec (the processor's default power 0)."""
    return PositionNoise(**{"power": 0.0, **spec})


GAUSS = {"sigma": 0.2, "seed": 7}
SHAPED = {"sigma": 0.05, "seed": 3, "nu": 5.0, "length": 16.0, "power": 1.0}


@pytest.fixture(scope="module")
def processed(smollm2, path):
    return sample(smollm2, path, "processed_logprobs", [GAUSS, SHAPED])


@pytest.mark.parametrize("which", [0, 1], ids=["gaussian", "student-t-position"])
def test_the_injected_noise_is_recomputed_from_the_seed_and_the_tokens(smollm2, processed, which):
    """vLLM's processed log-prob of every sampled token = the HF trainer's with the same noise
    model attached (fp32 both): ε is the HF sampler's own, keyed on (seed, prefix), σ(p) at the
    same positions. The clean trainer is far off (the check can fail)."""
    model, tok = smollm2
    ro, spec = processed[which], [GAUSS, SHAPED][which]
    m = ro.response_mask.bool()
    assert m.sum() > 500
    eng = Engine(model, tok, noise=[noise_of(spec)])
    try:
        noisy = eng.logp(ro, stats=False)["logp"]
    finally:
        eng.close()  # detaches the noise from the shared model
    clean = Engine(model, tok).logp(ro, stats=False)["logp"]
    assert (noisy - ro.logp_mu)[m].abs().max() < 2e-3
    assert (clean - ro.logp_mu)[m].abs().mean() > 10 * (noisy - ro.logp_mu)[m].abs().mean()


def test_processed_logprobs_carry_beta_with_the_gate_laws_variance(smollm2, processed):
    """β = log μ − log π (vLLM's processed log-prob − the clean trainer's) per confidence bin of
    the trainer's p_t: Var β ≈ σ²·mean(1 − 2p_t + ‖p‖²), the gate law, to first order in σ.
    Tolerance: a bin's variance of n ≥ 200 heavy-ish tokens has a relative SE ≈ √(2/n)·√(κ/3)
    ≲ 0.15; 0.7–1.4 is > 2 SE, and the law is first order (σ = 0.2)."""
    model, tok = smollm2
    ro = processed[0]
    m = ro.response_mask.bool()
    clean = Engine(model, tok).logp(ro)
    beta = (ro.logp_mu - clean["logp"])[m].double()
    g = gate(clean["p_t"], clean["p_sq_sum"])[m].double()
    b = bin_index(clean["p_t"][m])
    rows = []
    for k in range(len(CONF_EDGES) - 1):
        at = b == k
        if at.sum() >= 200:
            law = GAUSS["sigma"] ** 2 * g[at].mean()
            rows.append((CONF_EDGES[k], int(at.sum()), float(beta[at].var() / law)))
    print("bin lo, tokens, Var β / σ²ḡ:", rows)
    assert len(rows) >= 2
    assert all(0.7 < r < 1.4 for _, _, r in rows), rows


def test_raw_logprobs_report_the_clean_model_while_sampling_the_noisy_law(smollm2, path, processed):
    """raw_logprobs: the same seed samples the same tokens as under processed_logprobs (ε is
    still in the sampled law), yet the recorded log-prob is the clean model's: no β in it."""
    model, tok = smollm2
    (raw,) = sample(smollm2, path, "raw_logprobs", [GAUSS])
    m = raw.response_mask.bool()
    assert torch.equal(raw.response_ids, processed[0].response_ids)
    clean = Engine(model, tok).logp(raw, stats=False)["logp"]
    assert (clean - raw.logp_mu)[m].abs().max() < 2e-3
    assert (clean - processed[0].logp_mu)[m].abs().mean() > 0.02


def test_a_bad_noise_spec_is_an_error_naming_key_value_and_valid_keys(smollm2, path):
    model, tok = smollm2
    eng = VllmEngine(copy.deepcopy(model), tok, VllmOptions(pythonpath=path))
    try:
        eng.extra_args = {KEY: {"sigma": 0.1, "sgima": 0.2}}
        with pytest.raises(RuntimeError, match=r"unknown key\(s\) \['sgima'\]; valid: \['sigma'"):
            eng.generate(prompt_ids(tok)[:1], Sampling(n=1, max_new_tokens=2))
        eng.extra_args = {KEY: {"sigma": -1.0}}
        with pytest.raises(RuntimeError, match=r"sigma must be >= 0, got -1.0"):
            eng.generate(prompt_ids(tok)[:1], Sampling(n=1, max_new_tokens=2))
    finally:
        eng.close()
