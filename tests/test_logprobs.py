import pytest
import torch

from harness.sampling.logprobs import (
    chunked_logp,
    chunked_stats,
    process_logits,
    replay_mask,
    support_mask,
)


def test_process_logits_by_hand():
    # logits log([0.5, 0.3, 0.15, 0.05]); top-p 0.7 keeps {0.5, 0.3} (0.5 < 0.7 ≤ 0.8)
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    lp = process_logits(p.log(), top_p=0.7)
    assert torch.allclose(lp.exp(), torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    # top-k 3 renormalises over the three largest: 0.5 / 0.95
    assert process_logits(p.log(), top_k=3)[0, 0].exp().item() == pytest.approx(0.5 / 0.95)
    # temperature 0.5 squares the probabilities before renormalising
    sq = p**2 / (p**2).sum()
    assert torch.allclose(process_logits(p.log(), temperature=0.5).exp(), sq, atol=1e-6)
    with pytest.raises(ValueError, match="temperature"):
        process_logits(p, temperature=0.0)
    with pytest.raises(ValueError, match="top_p"):
        process_logits(p, top_p=1.5)


def test_support_mask():
    m = support_mask(torch.tensor([[2, 0, -1], [1, -1, -1]]), vocab=4)
    assert m.tolist() == [[True, False, True, False], [False, True, False, False]]


def test_replay_mask_keeps_the_sampled_token():
    # row 0: support {2, 0}, sampled 2; row 1: a pad position (empty support), "sampled" 3
    m = replay_mask(torch.tensor([[[2, 0], [-1, -1]]]), torch.tensor([[2, 3]]), vocab=4)
    assert m.tolist() == [[[True, False, True, False], [False, False, False, True]]]


def _logp_case(use_keep: bool, N: int = 37, H: int = 8, V: int = 50, device="cpu"):
    """float64 hidden states and head (with grad), targets, an optional support mask that keeps
    each target, and an upstream gradient (drawn on the CPU, then placed on `device`)."""
    h = torch.randn(N, H, dtype=torch.float64).to(device).requires_grad_()
    W = torch.randn(V, H, dtype=torch.float64).to(device).requires_grad_()
    y = torch.randint(0, V, (N,)).to(device)
    keep = (torch.rand(N, V) < 0.5).to(device) if use_keep else None
    if keep is not None:
        keep[torch.arange(N), y] = True
    return h, W, y, keep, torch.randn(N, dtype=torch.float64).to(device)


def _naive_logp(h, W, y, temperature, keep):
    """The full-vocabulary log-softmax the chunked path must equal."""
    z = (h @ W.t()) / temperature
    if keep is not None:
        z = z.masked_fill(~keep, float("-inf"))
    return z.log_softmax(-1).gather(1, y[:, None])[:, 0]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("use_keep", [False, True])
def test_chunked_logp_matches_naive_value_and_grad(temperature, use_keep, device):
    h, W, y, keep, g = _logp_case(use_keep, device=device)
    out = chunked_logp(h, W, y, temperature, keep, chunk=8)
    (out * g).sum().backward()
    gh, gW = h.grad.clone(), W.grad.clone()
    h.grad = W.grad = None
    ref = _naive_logp(h, W, y, temperature, keep)
    (ref * g).sum().backward()
    assert torch.allclose(out.double(), ref, atol=1e-5)
    assert torch.allclose(gh, h.grad, atol=1e-5)
    assert torch.allclose(gW, W.grad, atol=1e-5)


def test_chunked_stats_by_hand():
    # identity lm_head on logits log([0.5, 0.25, 0.25]): entropy 1.5 ln2, Σp² = 0.375
    head = torch.nn.Identity()
    h = torch.tensor([[0.5, 0.25, 0.25]]).log()
    s = chunked_stats(h, head, torch.tensor([1]))
    assert s["p_t"].item() == pytest.approx(0.25)
    assert s["entropy"].item() == pytest.approx(1.5 * torch.log(torch.tensor(2.0)).item())
    assert s["p_sq_sum"].item() == pytest.approx(0.375)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("use_keep", [False, True])
def test_chunked_logp_single_chunk_keeps_softmax_same_value_and_grad(temperature, use_keep, device):
    """N ≤ chunk: the backward reuses the forward's softmax; equal to the recompute path and to
    the naive log-softmax, and a second backward (retain_graph) gives the same gradient."""
    h, W, y, keep, g = _logp_case(use_keep, device=device)
    grads = []
    for chunk in (64, 8):  # single chunk (kept softmax), then several (recompute)
        out = chunked_logp(h, W, y, temperature, keep, chunk=chunk)
        loss = (out * g).sum()
        loss.backward(retain_graph=True)
        grads.append((out.detach(), h.grad.clone(), W.grad.clone()))
        h.grad = W.grad = None
        loss.backward()
        assert torch.allclose(h.grad, grads[-1][1]) and torch.allclose(W.grad, grads[-1][2])
        h.grad = W.grad = None
    ref = _naive_logp(h, W, y, temperature, keep)
    (ref * g).sum().backward()
    for out, gh, gW in grads:
        assert torch.allclose(out.double(), ref, atol=1e-5)
        assert torch.allclose(gh, h.grad, atol=1e-5)
        assert torch.allclose(gW, W.grad, atol=1e-5)
    with torch.no_grad():  # no grad needed: nothing kept
        assert torch.allclose(chunked_logp(h, W, y, temperature, keep, chunk=64).double(), ref)


@pytest.mark.parametrize("chunk", [8, 64])
@pytest.mark.parametrize("use_keep", [False, True])
def test_chunked_logp_with_stats_equals_chunked_stats(chunk, use_keep):
    """The trainer pass's detached stats are the scoring pass's numbers (so a trainer forward at
    staleness 0 can stand in for the π_old recompute); asking for them leaves logp/grad as is."""
    N, H, V, temperature = 37, 8, 50, 0.8
    head = torch.nn.Linear(H, V, bias=False)
    h = torch.randn(N, H, requires_grad=True)
    y = torch.randint(0, V, (N,))
    keep = torch.rand(N, V) < 0.5 if use_keep else None
    if keep is not None:
        keep[torch.arange(N), y] = True
    logp, st = chunked_logp(h, head.weight, y, temperature, keep, chunk=chunk, with_stats=True)
    ref = chunked_stats(h.detach(), head, y, temperature, keep, chunk=chunk)
    for k in ("entropy", "p_sq_sum", "p_t"):
        assert not st[k].requires_grad
        assert torch.allclose(st[k], ref[k], atol=1e-6), k
    assert torch.allclose(logp.detach(), ref["logp"], atol=1e-6)
    logp.sum().backward()
    g_stats = h.grad.clone()
    h.grad = None
    chunked_logp(h, head.weight, y, temperature, keep, chunk=chunk).sum().backward()
    assert torch.equal(g_stats, h.grad)


@pytest.mark.parametrize("chunk", [8, 64])
def test_chunked_logp_accumulates_in_fp32_for_bf16_inputs(chunk, device):
    """bf16 hidden states and head (a bf16 trainer): the logits are upcast before the
    log-softmax, so log π and its gradients are the fp32 computation on the bf16 values, not a
    bf16 log-softmax (whose rounding alone is ~1e-2 at these logit sizes). Entries in {−1, 0, 1}
    make every logit an integer in [−16, 16], exact in bf16 whatever GEMM kernel (chunk size,
    CPU, CUDA) computes it, so the reference is exact on any machine."""
    gen = torch.Generator().manual_seed(0)
    N, H, V = 37, 16, 500
    h = torch.randint(-1, 2, (N, H), generator=gen).to(device, torch.bfloat16).requires_grad_()
    W = torch.randint(-1, 2, (V, H), generator=gen).to(device, torch.bfloat16).requires_grad_()
    y = torch.randint(0, V, (N,), generator=gen).to(device)
    out = chunked_logp(h, W, y, 1.0, None, chunk=chunk)
    assert out.dtype == torch.float32
    ref = _naive_logp(h.detach().double(), W.detach().double(), y, 1.0, None)
    assert (out.double() - ref).abs().max() <= 1e-4
    bf16_softmax = (h.detach() @ W.detach().t()).log_softmax(-1).gather(1, y[:, None])[:, 0]
    assert (bf16_softmax.double() - ref).abs().max() > 10 * (out.double() - ref).abs().max()
    (out * torch.randn(N, generator=gen).to(device)).sum().backward()
    assert h.grad.dtype == W.grad.dtype == torch.bfloat16
    assert torch.isfinite(h.grad.float()).all() and torch.isfinite(W.grad.float()).all()
