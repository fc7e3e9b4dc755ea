"""Why the mismatch dials move over training: β's second moment split into response length, the
policy's softmax gate, and the engine's logit error.

At one position let z (trainer) and z_μ (sampler) be the logits at the sampling temperature,
p = softmax(z), and ε = z_μ − z the engine's logit error (a V-vector the harness can read, since it
runs both forwards). To first order in ε, the sampled token y's log-ratio is

    Δ = log μ(y) − log π(y) ≈ ε_y − Σ_v p_v ε_v,   so   E_{y~p}[Δ²] ≈ Var_p(ε),

and for ε with i.i.d. components of variance σ², E[Δ² | y] = σ² g with the gate
g = 1 − 2 p_y + ‖p‖² (0 where π is sure of y; ≈ 1 + ‖p‖² at a tail token of a peaked π;
E_{y~p} g = 1 − ‖p‖²). Over a checkpoint's response tokens:

    mean over sequences of Σ_t Δ_t² = L̄ · ḡ · σ̄² · ρ

    L̄   mean response length                                       (ii) length
    ḡ   token mean of g_t                                           (i) the token population's gate
    σ̄²  Σ_t Var_p(ε_t) / Σ_t (1 − ‖p_t‖²): the engine's logit error per unit of gate
                                                                    (iii) the engine, σ itself
    ρ   the rest: mean Δ² / (ḡ σ̄²); ≈ 1 where the first-order picture holds

So the growth of the sequence-level second moment from a base checkpoint (a log ratio) is exactly
length + gate + engine + residual; a residual within its interval says the three named parts
account for the growth. k3 ≈ Δ²/2 and the other dials follow the second moment where Δ is small.
The SNR post (seed 001, §3) reads Var β in the fork bin; `fork_var` is that number.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor
from torch.nn import functional as F

from harness.stats.diagnostics import FORK_P

PARTS = ("length", "gate", "engine", "residual")
# per-sequence sums the decomposition and its bootstrap need (one row per response)
SEQ_COLUMNS = ("n", "d2", "gate", "var_p", "gate_exp", "fork_n", "fork_d", "fork_d2")


def gate(p_t: Tensor, p_sq_sum: Tensor) -> Tensor:
    """g = 1 − 2 p_t + ‖p‖²: the variance of Δ per unit of i.i.d. logit-error variance."""
    return 1 - 2 * p_t + p_sq_sum


@torch.no_grad()
def logit_error(z_mu: Tensor, z: Tensor, targets: Tensor) -> dict[str, Tensor]:
    """Per position ([N, V] logits at the sampling temperature, [N] sampled tokens): `var_p`, the
    p-weighted variance of ε = z_μ − z under p = softmax(z); `delta_tf`, the exact log μ(y) −
    log π(y) of these two forwards; `delta_lin`, its first-order ε_y − E_p ε."""
    logp = F.log_softmax(z.float(), -1)
    p = logp.exp()
    eps = z_mu.float() - z.float()
    mean = (p * eps).sum(-1, keepdim=True)
    y = targets[:, None]
    return {
        "var_p": (p * (eps - mean) ** 2).sum(-1),
        "delta_tf": (F.log_softmax(z_mu.float(), -1).gather(1, y) - logp.gather(1, y))[:, 0],
        "delta_lin": (eps.gather(1, y) - mean)[:, 0],
    }


def seq_sums(
    delta: Tensor, p_t: Tensor, p_sq_sum: Tensor, var_p: Tensor, mask: Tensor
) -> dict[str, np.ndarray]:
    """Per response ([B, T] tensors, `delta` = log π − log μ as the dials read it): the sums of
    SEQ_COLUMNS over its masked tokens (forks: p_t < FORK_P, the diagnostics' fork)."""
    m = mask.double()
    fork = m * (p_t < FORK_P).double()
    d = delta.double()
    cols = {
        "n": m,
        "d2": d**2 * m,
        "gate": gate(p_t, p_sq_sum).double() * m,
        "var_p": var_p.double() * m,
        "gate_exp": (1 - p_sq_sum.double()) * m,  # E_{y~p} g
        "fork_n": fork,
        "fork_d": d * fork,
        "fork_d2": d**2 * fork,
    }
    return {k: v.sum(1).cpu().numpy() for k, v in cols.items()}


def factors(sums: dict[str, np.ndarray]) -> dict[str, float]:
    """(L̄, ḡ, σ̄², ρ) and the measured sequence second moment S = L̄ ḡ σ̄² ρ of one checkpoint
    from its per-sequence sums."""
    n = sums["n"].sum()
    m2 = sums["d2"].sum() / n
    g = sums["gate"].sum() / n
    s2 = sums["var_p"].sum() / sums["gate_exp"].sum()
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
