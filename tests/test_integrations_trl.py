"""harness.integrations.trl: ratiolab's objectives as TRL's GRPO loss. Two real GRPO steps on the
CPU with a tiny model whose rollouts come from ratiolab's sampler with logit noise (μ ≠ π), and
each micro-batch's loss and gradient checked against ratiolab's direct call on tensors rebuilt
by hand from TRL's batch and a plain forward of the model."""

import copy

import pytest
import torch

trl = pytest.importorskip("trl", reason="the `trl` extra: pip install -e '.[trl]'")

from harness.base.batch import TokenBatch  # noqa: E402
from harness.base.models import load_model  # noqa: E402
from harness.integrations.trl import (  # noqa: E402
    RatiolabGRPOTrainer,
    token_batch,
    trl_objective,
    trl_objectives,
)
from harness.noise import build_noise  # noqa: E402
from harness.objectives import OBJECTIVES, build_objective  # noqa: E402
from harness.sampling.engines import Engine  # noqa: E402
from harness.sampling.rollout import Sampling  # noqa: E402


def test_the_valid_names_are_every_objective_but_those_needing_ratiolab_s_loop():
    # opsd_fkl takes logits, calibrated_clip a shadow pass: the rest run on TRL's tensors
    assert set(OBJECTIVES) - set(trl_objectives()) == {"opsd_fkl", "calibrated_clip"}
    for name, kw in (("opsd_fkl", {}), ("calibrated_clip", {}), ("cisp", {})):
        with pytest.raises(ValueError, match="valid in TRL: band, cis, cispo"):
            trl_objective(name, **kw)
    with pytest.raises(ValueError, match="calibration pass at the live weights"):
        trl_objective("snr_shrink", adaptive=True, every=3)
    assert trl_objective("snr_shrink", steps=3, adaptive=True, every=3)  # no refresh in 3 steps


def test_token_batch_maps_trl_s_tensors_by_hand():
    """μ from sampling_per_token_logps (a NaN reads π_old), π_old from old_per_token_logps, A
    broadcast per token, tool tokens masked; no old log-probs: π_old = sg(π_θ), no sampling
    log-probs: μ = π_old."""
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -0.1]], requires_grad=True)
    inputs = {
        "completion_ids": torch.tensor([[3, 4], [5, 6]]),
        "completion_mask": torch.tensor([[1, 1], [1, 0]]),
        "tool_mask": torch.tensor([[1, 0], [1, 1]]),
        "advantages": torch.tensor([0.5, -1.0]),
        "old_per_token_logps": torch.tensor([[-1.1, -2.2], [-0.4, -0.3]]),
        "sampling_per_token_logps": torch.tensor([[-1.3, float("nan")], [-0.6, 0.0]]),
    }
    b = token_batch(inputs, logp, None)
    assert b.mask.tolist() == [[1.0, 0.0], [1.0, 0.0]]
    assert b.advantages.tolist() == [[0.5, 0.5], [-1.0, -1.0]]
    assert torch.equal(b.logp_mu, torch.tensor([[-1.3, -2.2], [-0.6, 0.0]]))
    assert torch.equal(b.p_t, inputs["old_per_token_logps"].exp())
    bare = {k: v for k, v in inputs.items() if "logps" not in k}
    b = token_batch(bare, logp, None)
    assert torch.equal(b.logp_old, logp.detach()) and torch.equal(b.logp_mu, logp.detach())
    assert not b.logp_old.requires_grad


def plain_logp(model, inputs) -> torch.Tensor:
    """log π_θ of the completion tokens by a plain HF forward (not TRL's fused head)."""
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    att = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    T = inputs["completion_ids"].shape[1]
    logits = model(input_ids=ids, attention_mask=att).logits[:, -T - 1 : -1].float()
    return logits.log_softmax(-1).gather(-1, inputs["completion_ids"][..., None])[..., 0]


def grpo(tmp_path, objective: str, checks: list):
    """2 GRPO steps, 2 optimizer steps per generation (π_θ ≠ π_old on the second); μ is a frozen
    copy of the initial model with logit noise σ = 0.5 (ratiolab's Engine, via rollout_func)."""
    from datasets import Dataset

    model, tok = load_model("tiny-llama", seed=0)
    engine = Engine(copy.deepcopy(model), tok, noise=[build_noise("logit", sigma=0.5)])
    calls = iter(range(100))

    def rollout(prompts, trainer):
        ids = [tok(p, add_special_tokens=False).input_ids for p in prompts]
        ro = engine.generate(ids, Sampling(n=1, max_new_tokens=6), seed=next(calls))
        n = ro.response_mask.sum(1).long().tolist()
        return {
            "prompt_ids": ids,
            "completion_ids": [r[:k].tolist() for r, k in zip(ro.response_ids, n)],
            "logprobs": [r[:k].tolist() for r, k in zip(ro.logp_mu, n)],
        }

    def reward(completions, **_):
        return [float(len(c)) for c in completions]

    args = trl.GRPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        num_generations=4,
        steps_per_generation=2,
        max_completion_length=6,
        max_steps=2,
        learning_rate=1e-2,
        beta=0.0,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        seed=0,
    )
    ds = Dataset.from_dict({"prompt": ["ab", "cd", "ef", "gh"] * 4})
    trainer = RatiolabGRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=args,
        train_dataset=ds,
        processing_class=tok,
        rollout_func=rollout,
        objective=objective,
    )
    real, forward = trainer._compute_loss, trainer._get_per_token_logps_and_entropies
    seen = []

    def recorded(*a, **kw):
        out = forward(*a, **kw)
        seen.append(out[0])
        return out

    def direct(logp, inputs):
        old = inputs.get("old_per_token_logps")
        batch = TokenBatch(
            tokens=inputs["completion_ids"],
            mask=inputs["completion_mask"].float(),
            logp_old=logp.detach() if old is None else old,
            logp_mu=inputs["sampling_per_token_logps"],
            advantages=inputs["advantages"][:, None].expand_as(logp),
        )
        return build_objective(objective)(logp, batch).loss

    def checked(model, inputs):
        loss = real(model, inputs)
        # the value against a plain forward; the gradient against the direct call on TRL's own
        # log-probs (its fused LM head's backward differs from autograd's in the last digits)
        want = direct(plain_logp(model, inputs), inputs)
        w = model.get_input_embeddings().weight
        (g,) = torch.autograd.grad(loss, w, retain_graph=True)
        (g_want,) = torch.autograd.grad(direct(seen[-1], inputs), w, retain_graph=True)
        checks.append((loss.item(), want.item(), g, g_want, inputs))
        return loss

    trainer._compute_loss = checked
    trainer._get_per_token_logps_and_entropies = recorded
    trainer.train()
    return trainer


@pytest.mark.slow
@pytest.mark.parametrize("objective", ["cis", "tis", "ppo_clip"])
def test_two_grpo_steps_take_ratiolab_s_loss(tmp_path, objective):
    checks = []
    trainer = grpo(tmp_path, objective, checks)
    assert len(checks) == 2 and trainer.state.global_step == 2
    for loss, want, g, g_want, inputs in checks:
        assert loss == pytest.approx(want, rel=1e-5, abs=1e-7)
        torch.testing.assert_close(g, g_want, rtol=1e-4, atol=1e-7)
        m = inputs["completion_mask"].bool()  # μ is the noisy sampler, not the trainer
        assert (inputs["sampling_per_token_logps"] - inputs["old_per_token_logps"])[
            m
        ].abs().max() > 1e-2
    assert any(g.abs().sum() > 0 for *_, g, _, _ in checks)
    logged = trainer.state.log_history[0]
    assert "ratiolab/is/weight_max" in logged or "ratiolab/clip/frac_low" in logged


def test_trl_settings_the_objective_replaces_are_refused(tmp_path):
    from datasets import Dataset

    model, tok = load_model("tiny-llama", seed=0)
    args = trl.GRPOConfig(
        output_dir=str(tmp_path), beta=0.1, use_cpu=True, report_to="none", max_steps=1
    )
    ds = Dataset.from_dict({"prompt": ["ab"]})
    with pytest.raises(ValueError, match=r"beta=0.1: .* valid with RatiolabGRPOTrainer: 0.0"):
        RatiolabGRPOTrainer(
            model=model,
            reward_funcs=lambda completions, **_: [0.0] * len(completions),
            args=args,
            train_dataset=ds,
            processing_class=tok,
            objective="cis",
        )
