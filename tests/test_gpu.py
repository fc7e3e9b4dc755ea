"""CUDA-only behaviour: `gpu`-marked, deselected on CPU CI (`-m "not gpu"`), run by
`pytest -m gpu` and scripts/gpu_check.sh. The device-parametrised equivalence tests (the `device`
fixture of conftest.py) run their CUDA half there too; this file holds what has no CPU half:
parity of numbers across devices, the noise field's identity across devices, and the training and
measurement jobs end to end on CUDA."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from hydra import compose, initialize_config_dir

from harness import measure, train
from harness.base.models import load_model
from harness.noise import build_noise, prefix_hash
from harness.noise.context import hashed_normal, hashed_student_t, mix64
from harness.sampling.engines import Engine
from harness.sampling.rollout import Sampling

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
CUDA = torch.device("cuda")
CONFIG_DIR = str(train.__file__.rsplit("/harness/", 1)[0] + "/experiments")


def _ids(B=3, S=16, seed=0):
    return torch.randint(3, 97, (B, S), generator=torch.Generator().manual_seed(seed))


def test_prefix_hash_and_hashed_draws_are_the_same_on_cpu_and_cuda():
    """The deterministic noise is a function of (seed, layer, token prefix): its integer hashes
    are bit-identical across devices, its normals and Student-t draws equal up to the last bits
    of log/cos/sqrt (the field is the same noise on both)."""
    x = _ids()
    mask = torch.ones_like(x)
    mask[0, :4] = 0
    h_cpu, h_cuda = prefix_hash(x, mask), prefix_hash(x.to(CUDA), mask.to(CUDA))
    assert torch.equal(h_cpu, h_cuda.cpu())
    keys = mix64(h_cpu.reshape(-1))
    z_cpu, z_cuda = hashed_normal(keys, 64), hashed_normal(keys.to(CUDA), 64).cpu()
    assert (z_cpu - z_cuda).abs().max() <= 1e-5
    t_cpu, t_cuda = hashed_student_t(keys, 64, 3.0), hashed_student_t(keys.to(CUDA), 64, 3.0)
    assert torch.allclose(t_cpu, t_cuda.cpu(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("nu", [None, 3.0])
def test_logit_noise_field_is_the_same_on_cpu_and_cuda(nu):
    """A zero lm_head makes the logits exactly σ·ε: the injected field itself, compared across
    devices (the model's own numerics drop out)."""
    model, _ = load_model("tiny-llama")
    with torch.no_grad():
        model.lm_head.weight.zero_()
    x = _ids()
    fields = []
    for dev in ("cpu", "cuda"):
        m = copy.deepcopy(model).to(dev)
        with build_noise("logit", sigma=0.3, nu=nu).attached(m), torch.no_grad():
            fields.append(m(x.to(dev)).logits.cpu())
    assert fields[0].abs().max() > 0.1  # the noise is there
    assert (fields[0] - fields[1]).abs().max() <= 1e-5


@pytest.mark.parametrize("dtype,tol_mean,tol_max", [("fp32", 1e-5, 1e-4), ("bf16", 2e-2, 0.25)])
def test_trainer_logprobs_cpu_vs_cuda(dtype, tol_mean, tol_max):
    """The same model and tokens scored on CPU and on CUDA. fp32 (TF32 off): agreement to float
    rounding; bf16: within the stated tolerance (per-token mean and max |Δ log π|) — the two
    devices' bf16 kernels round differently: the SNR post's precision β (Table 2)."""
    model, tok = load_model("tiny-llama", dtype=dtype)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # a peaked law, as the trained models have
    ro = Engine(model, tok).generate(
        ["12+3=", "hello wo"], Sampling(n=4, max_new_tokens=16), seed=1
    )
    cpu = Engine(model, tok).logp(ro)["logp"]
    cuda_model = copy.deepcopy(model).to(CUDA)
    ro_cuda = copy.copy(ro)
    for f in ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "logp_mu"):
        setattr(ro_cuda, f, getattr(ro, f).to(CUDA))
    ro_cuda.prompt_index = ro.prompt_index.to(CUDA)
    cuda = Engine(cuda_model, tok).logp(ro_cuda)["logp"].cpu()
    m = ro.response_mask.bool()
    d = (cpu - cuda)[m].abs()
    assert d.mean() <= tol_mean and d.max() <= tol_max, (float(d.mean()), float(d.max()))


def test_rollout_lives_on_cuda_and_its_seed_reproduces_it():
    model, tok = load_model("tiny-llama")
    eng = Engine(model.to(CUDA), tok)
    law = Sampling(n=4, max_new_tokens=12, temperature=0.9, top_p=0.9)
    a, b = (eng.generate(["12+3=", "x"], law, seed=7) for _ in range(2))
    for f in ("prompt_ids", "response_ids", "response_mask", "logp_mu", "support"):
        assert getattr(a, f).device.type == "cuda", f
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.logp_mu, b.logp_mu)


def test_nsr_rescue_draws_do_not_depend_on_the_device():
    """NSR's generator stays on the CPU: the same rescued tokens on CPU and CUDA."""
    from harness.base.batch import TokenBatch
    from harness.objectives import build_objective

    g = torch.Generator().manual_seed(0)
    B, T = 8, 12
    logp = torch.randn(B, T, generator=g) * 0.3 - 1
    batch = TokenBatch(
        tokens=torch.zeros(B, T, dtype=torch.long),
        mask=torch.ones(B, T),
        logp_old=logp + 0.4 * torch.randn(B, T, generator=g),
        logp_mu=logp,
        advantages=torch.randn(B, 1, generator=g).expand(B, T).clone(),
    )
    outs = []
    for dev in ("cpu", "cuda"):
        obj = build_objective("nsr", seed=3)
        res = obj(logp.to(dev).requires_grad_(), batch.to(dev))
        outs.append({k: v for k, v in res.metrics.items()} | {"loss": float(res.loss.detach())})
    assert outs[0].keys() == outs[1].keys()
    for k in outs[0]:
        assert outs[0][k] == pytest.approx(outs[1][k], rel=1e-5, abs=1e-6), k


TINY = [
    "model=tiny-llama",
    "++task.digits=1",
    "rollout.prompts_per_step=2",
    "rollout.group_size=4",
    "rollout.max_new_tokens=6",
    "eval_n=4",
    "eval_every=2",
    "progress=false",
    "engine.device=cuda",
    "steps=2",
]


@pytest.mark.parametrize(
    "extra",
    [
        [],
        ["engine.trainer_dtype=bf16", "engine.sampler_dtype=bf16"],
        ["noise=logit", "++noise.sigma=0.3", "objective=nsr"],
        ["noise=fp8", "alpha.staleness=1", "alpha.minibatches=2"],
        ["objective=opsd_fkl", "distill.enabled=true", "objective.top_k=null"],
    ],
    ids=["fp32", "bf16", "logit-nsr", "fp8-stale", "opsd"],
)
def test_train_runs_on_cuda(tmp_path, extra):
    """The GRPO/OPSD loop end to end on CUDA: no tensor left on the CPU breaks a step, the
    identity check holds where μ = π_old numerically (fp32, no noise), and it resumes."""
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose("train", overrides=[f"out={tmp_path}", *TINY, *extra])
    last = train.run(cfg)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and last["step"] == 2
    if not extra:
        assert all(abs(r["identity/mean_ratio"] - 1) < 1e-3 for r in rows)
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        more = compose("train", overrides=[f"out={tmp_path}", *TINY, *extra, "steps=3"])
    assert train.run(more)["step"] == 3


def test_measure_runs_on_cuda(tmp_path):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(
            "measure",
            overrides=[
                f"out={tmp_path}",
                "model=tiny-llama",
                "rollout.group_size=2",
                "rollout.max_new_tokens=8",
                "measurement.amp_rows=2",
                "engine.device=cuda",
                "live.steps=1",
                "optim.lr=1e-3",
            ],
        )
    measure.run(cfg)
    assert (tmp_path / "table6.csv").exists() and (tmp_path / "summary.json").exists()
