"""harness.integrations.verl_losses in verl 0.9.1's own venv (`make verl`), loaded through the
`verl.plugins` entry point pyproject.toml declares: `get_policy_loss_fn("ratiolab_<name>")` returns
it for every mappable objective, and on the same tensors (verl's rollout_is_weights built as verl
builds them from π_old and μ) its loss and gradient equal ratiolab's direct call in this venv,
for each of verl's loss_agg_modes; two data-parallel ranks with verl's global counts give the
full batch's loss and gradient; an objective verl cannot map is a clear error naming the valid
ones."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import installed_entry_points

from harness.base.batch import TokenBatch
from harness.base.models import cache_dir
from harness.objectives import AGGREGATIONS, OBJECTIVES, build_objective

VERL_PYTHON = Path(
    os.environ.get("RATIOLAB_VERL_PYTHON", cache_dir() / "verl-0.9.1" / "bin" / "python")
)
UNMAPPABLE = ("opsd_fkl", "stapo")  # harness.integrations.verl_losses.UNMAPPABLE (imports verl)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not VERL_PYTHON.is_file(), reason=f"no verl venv at {VERL_PYTHON}"),
]

# Run under verl's Python: import verl (its plugin discovery imports ratiolab's losses), call each
# requested loss as verl's ppo_loss does, save loss, grad and metrics; then the error messages.
SCRIPT = r"""
import sys
from types import SimpleNamespace

import torch
import verl  # noqa: F401  (loads the verl.plugins entry points)
from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY, get_policy_loss_fn

case = torch.load(sys.argv[1])
out = {"registered": sorted(POLICY_LOSS_REGISTRY), "calls": [], "errors": {}}
for name, mode, info, rows in case["calls"]:
    logp = case["logp"][rows].clone().requires_grad_()
    loss, metrics = get_policy_loss_fn(name)(
        old_log_prob=case["logp_old"][rows],
        log_prob=logp,
        advantages=case["adv"][rows],
        response_mask=case["mask"][rows],
        loss_agg_mode=mode,
        config=SimpleNamespace(global_batch_info=info),
        rollout_is_weights=case["w"][rows],
    )
    loss.backward()
    out["calls"].append((loss.detach(), logp.grad, metrics))
from harness.integrations.verl_losses import policy_loss

for what, call in [
    ("verl", lambda: get_policy_loss_fn("ratiolab_opsd_fkl")),
    ("opsd_fkl", lambda: policy_loss("opsd_fkl")),
    ("unknown", lambda: policy_loss("cisp")),
    ("kwarg", lambda: policy_loss("cis", capp=2.0)),
    ("aggregation", lambda: policy_loss("cis", aggregation="token-sum")),
]:
    try:
        call()
    except (ValueError, TypeError) as e:
        out["errors"][what] = f"{type(e).__name__}: {e}"
torch.save(out, sys.argv[2])
"""

MAPPABLE = [n for n in OBJECTIVES if n not in UNMAPPABLE]
B, T = 6, 7


def tensors() -> dict:
    """A batch with padding and a sizeable mismatch: μ ≠ π_old ≠ π_θ on every token, so every
    ratio, clip and correction is exercised. w is verl's token weight (rollout_corr_helper):
    exp(clamp(log π_old − log μ, ±20)) × response_mask."""
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(B, T)
    mask[0, 4:], mask[3, 2:] = 0, 0
    logp_old = -torch.rand(B, T, generator=g) * 3
    logp_mu = logp_old + 0.4 * torch.randn(B, T, generator=g)
    logp = logp_old + 0.3 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, 1, generator=g).expand(B, T).contiguous()
    w = (logp_old - logp_mu).clamp(-20, 20).exp() * mask
    return dict(mask=mask, logp_old=logp_old, logp_mu=logp_mu, logp=logp, adv=adv, w=w)


def direct(case: dict, name: str, mode: str, rows: list[int], **kw) -> tuple:
    """ratiolab's own call: loss and gradient of build_objective(name, aggregation=mode)."""
    logp = case["logp"][rows].clone().requires_grad_()
    batch = TokenBatch(
        tokens=torch.zeros(len(rows), T, dtype=torch.long),
        mask=case["mask"][rows],
        logp_old=case["logp_old"][rows],
        logp_mu=case["logp_mu"][rows],
        advantages=case["adv"][rows],
    )
    loss = build_objective(name, aggregation=mode, **kw)(logp, batch).loss
    loss.backward()
    return loss.detach(), logp.grad


ALL = list(range(B))
MODES = list(AGGREGATIONS)  # verl's five loss_agg_modes, under verl's names
# two ranks of three rows each, with the global counts verl's ppo_loss puts in global_batch_info
SHARDED = ("ppo_clip", "cis", "tis")


def calls(case: dict) -> list:
    one = [(f"ratiolab_{n}", mode, {}, ALL) for n in MAPPABLE for mode in MODES]
    info = {
        "dp_size": 2,
        "batch_num_tokens": case["mask"].sum(),
        "global_batch_size": B,
        "loss_scale_factor": T,
    }
    dp = [
        (f"ratiolab_{n}", mode, info, rows)
        for n in SHARDED
        for mode in MODES
        for rows in (ALL[:3], ALL[3:])
    ]
    return one + dp


@pytest.fixture(scope="module")
def verl_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("verl")
    case = tensors()
    case["calls"] = calls(case)
    torch.save(case, tmp / "case.pt")
    env = {**os.environ, "PYTHONPATH": installed_entry_points(tmp / "site")}
    cmd = [str(VERL_PYTHON), "-c", SCRIPT, str(tmp / "case.pt"), str(tmp / "out.pt")]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return case, torch.load(tmp / "out.pt", weights_only=False)


def test_every_mappable_objective_is_registered_through_the_entry_point(verl_run):
    _, out = verl_run
    ours = {n for n in out["registered"] if n.startswith("ratiolab_")}
    assert ours == {f"ratiolab_{n}" for n in MAPPABLE}
    assert {"vanilla", "ratiolab_cis"} <= set(out["registered"])


def test_verl_loss_and_gradient_equal_ratiolabs_direct_call(verl_run):
    """Each objective × each loss_agg_mode, one rank, no global counts: verl's call = ratiolab's,
    loss and gradient, to float32 rounding; the gradient is not zero (the check can fail)."""
    case, out = verl_run
    for (name, mode, info, rows), (loss, grad, metrics) in zip(case["calls"], out["calls"]):
        if info:
            continue
        ref_loss, ref_grad = direct(case, name.removeprefix("ratiolab_"), mode, rows)
        assert torch.allclose(loss, ref_loss, rtol=1e-5, atol=1e-6), (name, mode, loss, ref_loss)
        assert torch.allclose(grad, ref_grad, rtol=1e-5, atol=1e-6), (name, mode)
        assert grad.abs().sum() > 0, (name, mode)
        assert "actor/ratiolab/clip/frac_low" in metrics


def test_two_ranks_with_verls_global_counts_give_the_full_batchs_loss_and_gradient(verl_run):
    """Data parallel: each rank's loss is scaled to the global normaliser × dp_size, and the
    gradient all-reduce averages over ranks, so mean(rank losses) = the full batch's loss and each
    row's gradient / dp_size = its full-batch gradient (seq-mean-token-sum-norm with verl's
    loss_scale_factor as norm_len)."""
    case, out = verl_run
    dp = [(c, o) for c, o in zip(case["calls"], out["calls"]) if c[2]]
    assert len(dp) == 2 * len(SHARDED) * len(MODES)
    for (c0, o0), (_, o1) in zip(dp[::2], dp[1::2]):
        name, mode = c0[0].removeprefix("ratiolab_"), c0[1]
        kw = {"norm_len": T} if mode == "seq-mean-token-sum-norm" else {}
        ref_loss, ref_grad = direct(case, name, mode, ALL, **kw)
        assert torch.allclose((o0[0] + o1[0]) / 2, ref_loss, rtol=1e-5, atol=1e-6), (name, mode)
        grad = torch.cat([o0[1], o1[1]]) / 2
        assert torch.allclose(grad, ref_grad, rtol=1e-5, atol=1e-6), (name, mode)


def test_an_objective_verl_cannot_map_is_an_error_naming_the_valid_ones(verl_run):
    _, out = verl_run
    err = out["errors"]
    assert err["verl"].startswith("ValueError: Unsupported loss mode: ratiolab_opsd_fkl")
    assert "'ratiolab_cis'" in err["verl"]
    assert (
        "objective='opsd_fkl' cannot be a verl policy loss: it needs the student's"
        in (err["opsd_fkl"])
    )
    assert err["opsd_fkl"].endswith(", ".join(MAPPABLE))
    assert (
        "objective='cisp' cannot be a verl policy loss: ratiolab has no objective"
        in (err["unknown"])
    )
    assert err["kwarg"].startswith("TypeError: objective 'cis': unknown argument(s) ['capp']")
    assert "aggregation and norm_len come from verl" in err["aggregation"]
