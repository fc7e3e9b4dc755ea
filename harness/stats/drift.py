"""Why the mismatch dials move over training: β's second moment split into response length, the
policy's softmax gate, and the engine's logit error.

At one position let z (trainer) and z_μ (sampler) be the logits at the sampling temperature,
p = softmax(z), μ = softmax(z_μ), and ε = z_μ − z the engine's logit error (a V-vector the
harness reads, since it runs both forwards). Token v's log-ratio is d_v = log μ_v − log p_v, and the
sampled token's Δ = d_y has E_{y~μ}[Δ²] = Σ_v μ_v d_v², exactly. To first order in ε,
d_y ≈ ε_y − Σ_v p_v ε_v, and for ε with i.i.d. components of variance σ² that expectation is
σ² (1 − 2⟨μ, p⟩ + ‖p‖²), the mean of the gate g = 1 − 2 p_y + ‖p‖² over y ~ μ (0 where π is sure
of y; ≈ 1 + ‖p‖² at a tail token of a peaked π). Over a checkpoint's response tokens:

    mean over responses of Σ_t Δ_t² = L̄ · ḡ · σ̄² · ρ

    L̄   mean response length                                           (ii) length
    ḡ   mean of g_t over the sampled tokens                              (i) the population's gate
    σ̄²  Σ_t E_μ[Δ_t²] / Σ_t E_μ[g_t]: the engine's error per unit of gate  (iii) the engine, σ
    ρ   the rest, mean Δ² / (ḡ σ̄²): the sampled tokens against their expectation, and the
        sampler's decode against its teacher-forced forward; ≈ 1 within sampling error

So the growth of the sequence-level second moment from a base checkpoint (a log ratio) is exactly
length + gate + engine + residual; a residual within its interval says the three named parts
account for the growth. σ̄² is exact for the two forwards (no first-order step); under i.i.d.
logit noise of variance σ² it reads σ² to first order (tests/test_drift.py). k3 ≈ Δ²/2 and the
other dials follow the second moment where Δ is small. The SNR post (seed 001, §3) reads Var β in
the fork bin; `fork_var` is that number.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor
from torch.nn import functional as F

from harness.stats.diagnostics import FORK_P, gate

PARTS = ("length", "gate", "engine", "residual")
# per-sequence sums the decomposition and its bootstrap need (one row per response)
SEQ_COLUMNS = ("n", "d2", "gate", "e2", "gate_mu", "fork_n", "fork_d", "fork_d2")


@torch.no_grad()
def logit_error(z_mu: Tensor, z: Tensor, targets: Tensor) -> dict[str, Tensor]:
    """Per position ([N, V] logits at the sampling temperature, [N] sampled tokens): `e2`, the
    expected Δ² over y ~ μ, Σ_v μ_v (log μ_v − log p_v)²; `gate_mu`, the expected gate over
    y ~ μ, 1 − 2⟨μ, p⟩ + ‖p‖²; `delta_tf`, log μ(y) − log π(y) of these two forwards; `z_std`,
    the spread of the trainer's logits over the vocabulary (a relative error such as FP8's
    scales with it)."""
    logmu, logp = F.log_softmax(z_mu.float(), -1), F.log_softmax(z.float(), -1)
    mu, p = logmu.exp(), logp.exp()
    d = logmu - logp
    return {
        "e2": (mu * d * d).sum(-1),
        "gate_mu": 1 - 2 * (mu * p).sum(-1) + (p * p).sum(-1),
        "delta_tf": d.gather(1, targets[:, None])[:, 0],
        "z_std": z.float().std(-1),
    }


def seq_sums(
    delta: Tensor, p_t: Tensor, p_sq_sum: Tensor, err: dict[str, Tensor], mask: Tensor
) -> dict[str, np.ndarray]:
    """Per response ([B, T] tensors, `delta` = log π − log μ as the dials read it, `err` the
    [B, T] `logit_error` of its positions): the sums of SEQ_COLUMNS over its masked tokens
    (forks: p_t < FORK_P, the diagnostics' fork)."""
    m = mask.double()
    fork = m * (p_t < FORK_P).double()
    d = delta.double()
    cols = {
        "n": m,
        "d2": d**2 * m,
        "gate": gate(p_t, p_sq_sum).double() * m,
        "e2": err["e2"].double() * m,
        "gate_mu": err["gate_mu"].double() * m,
        "fork_n": fork,
        "fork_d": d * fork,
        "fork_d2": d**2 * fork,
    }
    return {k: v.sum(1).cpu().numpy() for k, v in cols.items()}


def stop_share(
    delta: Tensor, mask: Tensor, response_mask: Tensor, response_ids: Tensor, eos: Tensor
) -> dict[str, float]:
    """The stop decision's part of β ([B, T] tensors, `delta` = log π − log μ of the sampled
    tokens, `mask` the tokens the dials read, `response_mask` 1 up to and including each row's
    last token; `eos` the model's EOS ids, `harness.sampling.rollout.eos_ids`): `eos_frac`, the
    share of responses that end in an EOS token (the rest ran out of budget); `eos_d2_share`,
    the masked EOS tokens' share of Σ Δ² over the masked tokens; and `eos_mean_delta`, their
    mean Δ (≪ 0: μ stops where π would go on). A β concentrated on the stop decision sets the
    response length, which every sequence-level weight multiplies over."""
    last = (response_mask.sum(-1).long() - 1).clamp(min=0)[:, None]
    ended = (response_mask.sum(-1) > 0) & torch.isin(
        response_ids.gather(1, last)[:, 0], eos.to(response_ids.device)
    )
    read = ended & (mask.gather(1, last)[:, 0] > 0)  # the EOS tokens the dials read
    d_end = delta.gather(1, last)[:, 0][read].double()
    d2 = (delta.double() ** 2 * mask).sum()
    return {
        "eos_frac": float(ended.double().mean()),
        "eos_d2_share": float((d_end**2).sum() / d2) if d2 > 0 else float("nan"),
        "eos_mean_delta": float(d_end.mean()) if len(d_end) else float("nan"),
    }


def factors(sums: dict[str, np.ndarray]) -> dict[str, float]:
    """(L̄, ḡ, σ̄², ρ) and the measured sequence second moment S = L̄ ḡ σ̄² ρ of one checkpoint
    from its per-sequence sums."""
    n = sums["n"].sum()
    m2 = sums["d2"].sum() / n
    g = sums["gate"].sum() / n
    s2 = sums["e2"].sum() / sums["gate_mu"].sum()
    return {
        "length": n / len(sums["n"]),
        "gate": g,
        "engine": s2,
        "residual": m2 / (g * s2),
        "seq_d2": sums["d2"].sum() / len(sums["n"]),
    }


def growth(base: dict[str, np.ndarray], cur: dict[str, np.ndarray]) -> dict[str, float]:
    """log(S/S₀) (`measured`) and its four parts log(x/x₀), which sum to it exactly."""
    f0, f1 = factors(base), factors(cur)
    out = {k: float(np.log(f1[k] / f0[k])) for k in PARTS}
    out["measured"] = float(np.log(f1["seq_d2"] / f0["seq_d2"]))
    return out


def fork_var(sums: dict[str, np.ndarray]) -> float:
    """Var Δ over the fork tokens (p_t < FORK_P) of a checkpoint; nan with fewer than two."""
    n = sums["fork_n"].sum()
    if n < 2:
        return float("nan")
    mean = sums["fork_d"].sum() / n
    return float((sums["fork_d2"].sum() - n * mean**2) / (n - 1))


def resample(sums: dict[str, np.ndarray], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """One bootstrap draw over sequences."""
    idx = rng.integers(0, len(sums["n"]), len(sums["n"]))
    return {k: v[idx] for k, v in sums.items()}


def growth_intervals(
    base: dict[str, np.ndarray],
    cur: dict[str, np.ndarray],
    n_boot: int = 2000,
    seed: int = 0,
    level: float = 0.95,
) -> dict[str, tuple[float, float]]:
    """Percentile bootstrap intervals of `growth`'s entries and of the fork-bin Var β ratio
    (`fork_var_ratio`), resampling each checkpoint's sequences independently."""
    rng = np.random.default_rng(seed)
    draws: dict[str, list[float]] = {}
    for _ in range(n_boot):
        b, c = resample(base, rng), resample(cur, rng)
        for k, v in growth(b, c).items():
            draws.setdefault(k, []).append(v)
        draws.setdefault("fork_var_ratio", []).append(fork_var(c) / fork_var(b))
    q = ((1 - level) / 2, (1 + level) / 2)
    return {k: tuple(float(x) for x in np.nanquantile(v, q)) for k, v in draws.items()}
