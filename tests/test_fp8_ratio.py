import torch

from harness.base.models import tiny_llama
from harness.noise import build_noise
from harness.rl.fp8_ratio import fp8_ratio, ratio_stats


def test_ratio_stats_by_hand():
    # r = [0.5, 1, 2]: mean |log r| = (log 2 + 0 + log 2)/3, one below 0.8, one above 1.28
    s = ratio_stats(torch.tensor([0.5, 1.0, 2.0]).log())
    assert abs(s["mean_abs_log_r"] - 2 * torch.tensor(2.0).log().item() / 3) < 1e-6
    assert s["share_below"] == s["share_above"] == 1 / 3


def test_a_small_step_moves_the_fp8_ratio_far_more_than_the_high_precision_one():
    """On the tiny model: scoring half the batch changes no FP8 log-prob (batch-invariant), and
    a step of 1e-6 per weight moves the FP8 ratio orders of magnitude more than the fp32 one
    (the re-rounding of the moved weights); a step of 0 moves neither (the ablation's zero)."""
    model, _ = tiny_llama(0)
    model.eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (8, 24), generator=g)
    mask = torch.ones_like(ids)
    recipe = build_noise("fp8", granularity="block", activations=True)
    out = fp8_ratio(model, ids, mask, recipe, lr=1e-6)
    assert out["batch"]["max_abs_delta"] == 0.0
    hp, lp = out["step_hp"]["mean_abs_log_r"], out["step_fp8"]["mean_abs_log_r"]
    assert lp > 20 * hp > 0, (lp, hp)
    still = fp8_ratio(model, ids, mask, recipe, lr=0.0)
    assert still["step_fp8"]["mean_abs_log_r"] == still["step_hp"]["mean_abs_log_r"] == 0.0
