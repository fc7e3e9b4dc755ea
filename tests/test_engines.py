import contextlib
import copy
from unittest import mock

import pytest
import torch

from harness.sampling.engines import Engine
from harness.sampling.logprobs import process_logits
from harness.sampling.rollout import Sampling


def _chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit; cells with expected < 5 are pooled."""
    n = counts.sum()
    exp = probs * n
    big = exp >= 5
    obs_c = torch.cat([counts[big], counts[~big].sum()[None]])
    exp_c = torch.cat([exp[big], exp[~big].sum()[None]])
    if exp_c[-1] < 5:  # merge the pooled tail into the last big cell
        obs_c = torch.cat([obs_c[:-2], obs_c[-2:].sum()[None]])
        exp_c = torch.cat([exp_c[:-2], exp_c[-2:].sum()[None]])
    stat = ((obs_c - exp_c) ** 2 / exp_c).sum()
    df = len(exp_c) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), stat / 2.0))


def _sharpened(tiny_llama):
    """Tiny random models are near-uniform; scale lm_head so the law has a head and a tail."""
    model, tok = tiny_llama
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model, tok


@pytest.mark.parametrize(
    "temperature,top_p,top_k", [(1.0, 1.0, 0), (0.7, 1.0, 0), (1.0, 0.8, 0), (1.3, 0.9, 12)]
)
def test_logp_mu_is_faithful_chi_square(tiny_llama, temperature, top_p, top_k):
    model, tok = _sharpened(tiny_llama)
    eng = Engine(model, tok)
    n = 6000
    ro = eng.generate(
        [[5, 6, 7]],
        Sampling(n=n, max_new_tokens=1, temperature=temperature, top_p=top_p, top_k=top_k),
        seed=1,
    )
    law = assert_faithful_law(model, ro, temperature, top_p, top_k, atol=1e-6)
    assert law.sum() == pytest.approx(1.0, abs=0.02)  # recorded probs of what was seen


def assert_faithful_law(model, ro, temperature, top_p, top_k, atol, support=False):
    """`ro`: one-token samples of the prompt [5, 6, 7] from an engine holding `model`'s weights.
    The per-token law implied by the recorded logp_mu is the processed law of the model's logits
    (within `atol`), nothing is sampled outside its support, the draws follow it (chi-square) and
    the raw T = 1 law is rejected when it differs (negative control); with `support`, the kept
    support the engine recorded for mask replay is the law's. Returns the recorded law."""
    V = model.config.vocab_size
    counts = torch.bincount(ro.response_ids[:, 0], minlength=V).double()
    law = torch.zeros(V, dtype=torch.float64)
    law[ro.response_ids[:, 0]] = ro.logp_mu[:, 0].double().exp()
    with torch.no_grad():
        z = model(torch.tensor([[5, 6, 7]])).logits[0, -1]
    probs = process_logits(z[None], temperature, top_k, top_p)[0].double().exp()
    assert torch.allclose(law[counts > 0], probs[counts > 0], atol=atol)
    assert counts[probs == 0].sum() == 0  # nothing sampled outside the support
    assert _chi2_pvalue(counts, probs) > 1e-3
    if temperature != 1.0 or top_p < 1.0:  # negative control: the raw T=1 law must be rejected
        assert _chi2_pvalue(counts, z.double().softmax(-1)) < 1e-6
    if support:
        kept = ro.support[0, 0]
        assert set(kept[kept >= 0].tolist()) == set(torch.nonzero(probs > 0)[:, 0].tolist())
    return law


def test_identical_numerics_reproduce_trainer_logprobs(tiny_llama, device):
    model, tok = tiny_llama
    model.to(device)
    eng = Engine(model, tok, chunk=7)
    ro = eng.generate(
        ["12+3=", "hello wo", "x"], Sampling(n=3, max_new_tokens=12, temperature=0.9), seed=3
    )
    sc = eng.logp(ro)
    m = ro.response_mask.bool()
    assert ro.logp_mu.device.type == sc["logp"].device.type == device.type
    assert (sc["logp"] - ro.logp_mu)[m].abs().max() <= 1e-5
    assert torch.allclose(sc["p_t"][m], sc["logp"][m].exp())


def test_mask_replay_reproduces_truncated_logprobs(tiny_llama, device):
    model, tok = _sharpened(tiny_llama)
    model.to(device)
    eng = Engine(model, tok)
    ro = eng.generate(["abc", "1+1="], Sampling(n=4, max_new_tokens=8, top_p=0.7, top_k=20), seed=0)
    assert ro.support is not None and ro.support.shape[:2] == ro.response_ids.shape
    m = ro.response_mask.bool()
    replay = eng.logp(ro, mask_replay=True)
    assert (replay["logp"] - ro.logp_mu)[m].abs().max() <= 1e-5
    # without replay the trainer renormalises over the full vocabulary: log π_old < log μ
    full = eng.logp(ro, mask_replay=False)
    assert ((full["logp"] - ro.logp_mu)[m] <= 1e-6).all()
    assert (full["logp"] - ro.logp_mu)[m].mean() < -1e-3


def test_kv_cache_equals_full_recompute(tiny_llama, device):
    model, tok = tiny_llama
    model.to(device)
    law = Sampling(n=2, max_new_tokens=10, temperature=1.0, top_p=0.95)
    a = Engine(model, tok, kv_cache=True).generate(["ab", "hello there"], law, seed=5)
    b = Engine(model, tok, kv_cache=False).generate(["ab", "hello there"], law, seed=5)
    assert torch.equal(a.response_ids, b.response_ids)
    assert (a.logp_mu - b.logp_mu).abs().max() <= 1e-5


def test_left_padding_does_not_change_logprobs(tiny_llama):
    model, tok = tiny_llama
    eng = Engine(model, tok)
    ro = eng.generate(["hi", "a much longer prompt"], Sampling(n=1, max_new_tokens=6), seed=2)
    # row 0 was sampled behind 18 left pads; re-score it alone, unpadded
    ids = torch.cat([torch.tensor(tok("hi").input_ids), ro.response_ids[0]])[None]
    sc = eng.score(ids, torch.ones_like(ids), n_prompt=2)
    assert (sc["logp"][0] - ro.logp_mu[0]).abs().max() <= 1e-5


@pytest.mark.parametrize("top_k", [0, 40])
def test_eos_ends_response_and_masks_the_rest(tiny_llama, top_k):
    model, tok = tiny_llama  # near-uniform over 99 tokens: EOS ends ~45% of rows within 60 steps
    eos, pad = tok.eos_token_id, tok.pad_token_id
    ro = Engine(model, tok).generate(["x"], Sampling(n=64, max_new_tokens=60, top_k=top_k), seed=0)
    lengths = ro.response_mask.sum(1).long()
    finished = ro.response_ids[torch.arange(64), lengths - 1] == eos
    assert 0 < int(finished.sum()) < 64
    for row, m, L, fin in zip(ro.response_ids, ro.response_mask, lengths, finished):
        assert (m[:L] == 1).all() and (m[L:] == 0).all()
        assert int((row[:L] == eos).sum()) == int(fin)  # one EOS, the last kept token
        if fin:
            assert row[L - 1] == eos and (row[L:] == pad).all()
    # the pad written after EOS may lie outside a top-k support: still 0, never NaN or −inf
    assert torch.isfinite(ro.logp_mu).all()
    assert (ro.logp_mu * (1 - ro.response_mask)).abs().sum() == 0


def test_bad_input(tiny_llama):
    model, tok = tiny_llama
    eng = Engine(model, tok)
    with pytest.raises(ValueError, match="exceeds the model context of 512"):
        eng.generate(["a" * 500], Sampling(max_new_tokens=20))
    with pytest.raises(ValueError, match="temperature"):
        eng.generate(["a"], Sampling(temperature=0.0))
    with pytest.raises(ValueError, match="no prompts"):
        eng.generate([], Sampling())


def test_weight_sync_copies_and_casts(tiny_llama):
    model, tok = tiny_llama
    sampler = Engine(copy.deepcopy(model).to(torch.bfloat16), tok)
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)
    sampler.load_weights_from_state(dict(model.named_parameters()))
    assert torch.equal(sampler.model.lm_head.weight, model.lm_head.weight.to(torch.bfloat16))


@pytest.mark.parametrize(
    "spec",
    [
        ("layer", {"sigma": 0.05}),
        ("logit", {"sigma": 0.5}),
        ("logit", {"sigma": 0.5, "nu": 3}),
        ("position", {"sigma": 0.2, "length": 4.0}),
    ],
)
def test_deterministic_noise_same_in_decode_and_rescore(tiny_llama, spec):
    """A noisy sampler re-scoring its own samples reproduces logp_mu: the noise is a function
    of the prefix, identical in KV-cache decode and full-sequence scoring."""
    from harness.noise import build_noise

    model, tok = tiny_llama
    clean = Engine(model, tok).generate(["12+3=", "ab"], Sampling(n=2, max_new_tokens=8), seed=4)
    noisy = Engine(copy.deepcopy(model), tok, noise=[build_noise(spec[0], **spec[1])])
    ro = noisy.generate(["12+3=", "ab"], Sampling(n=2, max_new_tokens=8), seed=4)
    m = ro.response_mask.bool()
    assert (noisy.logp(ro)["logp"] - ro.logp_mu)[m].abs().max() <= 1e-5
    delta = (Engine(model, tok).logp(ro)["logp"] - ro.logp_mu)[m]
    assert delta.abs().mean() > 1e-3  # and it really is noise w.r.t. the clean trainer
    noisy.close()
    again = Engine(noisy.model, tok).generate(
        ["12+3=", "ab"], Sampling(n=2, max_new_tokens=8), seed=4
    )
    assert torch.equal(clean.logp_mu, again.logp_mu)  # close() restored the model


def test_routing_record_and_replay_cut_the_mismatch(tiny_moe):
    from harness.noise import build_noise

    model, tok = tiny_moe
    sampler = Engine(copy.deepcopy(model), tok, noise=[build_noise("routing", sigma=0.5)])
    ro = sampler.generate(["hello", "1+2="], Sampling(n=4, max_new_tokens=10), seed=0)
    assert ro.routing is not None and ro.routing.shape[:2] == (8, ro.tokens.shape[1] - 1)
    m = ro.response_mask.bool()
    plain = Engine(model, tok).logp(ro)["logp"]
    replayed = Engine(model, tok, noise=[build_noise("replay")]).logp(ro)["logp"]
    err_plain = (plain - ro.logp_mu)[m].abs().mean()
    err_replay = (replayed - ro.logp_mu)[m].abs().mean()
    assert err_replay < 0.5 * err_plain, (err_plain, err_replay)


# --- fast path: a shared prompt prefix must not change the numbers --------------------------------


def _fast_paths_off(eng: Engine) -> Engine:
    eng._row_local = lambda: False
    eng._can_decode_lean = lambda: False
    return eng


def test_shared_prompt_prefill_equals_the_per_row_path(tiny_llama):
    model, tok = _sharpened(tiny_llama)  # GQA: 4 heads, 2 KV heads
    for law in (
        Sampling(n=3, max_new_tokens=10, temperature=1.0),
        Sampling(n=3, max_new_tokens=10, temperature=0.8, top_p=0.9, top_k=20),
    ):
        fast = Engine(model, tok).generate(["12+3=", "hello wo", "x"], law, seed=4)
        slow = _fast_paths_off(Engine(model, tok)).generate(["12+3=", "hello wo", "x"], law, seed=4)
        assert torch.equal(fast.response_ids, slow.response_ids)
        assert (fast.logp_mu - slow.logp_mu).abs().max() <= 1e-5
        assert torch.equal(fast.prompt_ids, slow.prompt_ids)
        assert torch.equal(fast.prompt_mask, slow.prompt_mask)


def test_shared_prompt_prefix_trainer_forward_and_grad_equal_full_forward(tiny_llama):
    model, tok = tiny_llama
    eng = Engine(model, tok)
    ro = eng.generate(["12+3=", "hello wo", "x"], Sampling(n=3, max_new_tokens=8), seed=3)
    assert eng._prompt_groups(ro.tokens, ro.attention_mask, ro.n_prompt)[0].numel() == 3
    w = torch.randn(ro.response_ids.shape + (model.config.hidden_size,))
    grads, hs = [], []
    for e in (eng, _fast_paths_off(Engine(model, tok))):
        model.zero_grad()
        h = e.hidden_states(ro.tokens, ro.attention_mask, ro.n_prompt)
        (h * w).sum().backward()
        hs.append(h.detach())
        grads.append({k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None})
    assert (hs[0] - hs[1]).abs().max() <= 1e-5
    assert grads[0].keys() == grads[1].keys() and len(grads[1]) > 10
    for k in grads[1]:
        scale = grads[1][k].abs().max().clamp_min(1e-8)
        assert (grads[0][k] - grads[1][k]).abs().max() / scale <= 1e-4, k
    # distinct prompts: no sharing, the plain full forward
    assert eng._prompt_groups(ro.tokens[::3], ro.attention_mask[::3], ro.n_prompt) is None


def test_fast_paths_under_noise(tiny_llama):
    """The lean decoder runs the plain model only; the shared prompt prefill runs under
    row-local noise (keyed by each token's prefix, FP8 per row or tile) and not under noise
    keyed by rows or the batch."""
    from harness.noise import build_noise

    model, tok = tiny_llama
    for name, kw, share in [
        ("layer", dict(sigma=1e-3), True),
        ("fp8", dict(granularity="row", activations=True), True),
        ("fp8", dict(activations=True), False),  # one activation scale for the whole batch
        ("batch", dict(sigma=1e-3), False),
        ("layer", dict(sigma=1e-3, deterministic=False), False),
    ]:
        eng = Engine(model, tok, noise=[build_noise(name, **kw)])
        try:
            assert eng._row_local() == share and not eng._can_decode_lean(), (name, kw)
            ro = eng.generate(["ab", "cd"], Sampling(n=2, max_new_tokens=3), seed=0)
            groups = eng._prompt_groups(ro.tokens, ro.attention_mask, ro.n_prompt)
            assert (groups is not None) == share, (name, kw)
        finally:
            eng.close()
    assert Engine(model, tok)._row_local() and Engine(model, tok)._can_decode_lean()
    assert not Engine(model, tok, kv_cache=False)._can_decode_lean()


@pytest.mark.parametrize(
    "name, kw",
    [("fp8", dict(granularity="row", activations=True)), ("logit", dict(sigma=0.5))],
)
def test_shared_prompt_prefill_under_row_local_noise_equals_the_per_row_path(tiny_llama, name, kw):
    from harness.noise import build_noise

    model, tok = _sharpened(tiny_llama)
    out = []
    for share in (True, False):
        eng = Engine(model, tok, noise=[build_noise(name, **kw)])
        if not share:
            eng._row_local = lambda: False
        out.append(
            eng.generate(["12+3=", "hello wo", "x"], Sampling(n=3, max_new_tokens=10), seed=4)
        )
        eng.close()
    fast, slow = out
    assert torch.equal(fast.response_ids, slow.response_ids)
    assert (fast.logp_mu - slow.logp_mu).abs().max() <= 1e-5


# --- lean decode loop: the model's own numbers, from a static KV cache ----------------------------


def _teacher_forced_lean_logits(model, tok, prompts, forced):
    """HF prefill of the left-padded prompts, then `LeanDecoder` fed `forced` [B, n] one column
    at a time; returns the logits before each forced token [B, n + 1, V], the padded prompt ids
    and mask, and the decoder."""
    from transformers import DynamicCache

    from harness.sampling.decode import LeanDecoder
    from harness.sampling.engines import position_ids

    ids, attn = Engine(model, tok).encode_prompts(prompts)
    cache = DynamicCache()
    with torch.no_grad():
        first = model(
            input_ids=ids, attention_mask=attn, position_ids=position_ids(attn), cache=cache
        ).logits[:, -1]
    lean = LeanDecoder(model, cache, attn, forced.shape[1])
    steps = [first] + [lean.step(forced[:, i]) for i in range(forced.shape[1])]
    return torch.stack(steps, 1), ids, attn, lean


@pytest.mark.parametrize(
    "spec", ["tiny-llama", pytest.param("smollm2-135m", marks=pytest.mark.slow)]
)
def test_lean_decode_logits_equal_the_full_forward(spec, device):
    """Teacher-forced: every decode step's logits equal the model's full forward over the whole
    left-padded sequence (GQA in both; SmolLM2: 9 query / 3 KV heads, tied embeddings)."""
    from harness.base.models import load_model
    from harness.sampling import decode
    from harness.sampling.engines import position_ids

    model, tok = load_model(spec)
    model.to(device)
    assert decode.supports(model)
    prompts = ["12+3=", "a longer prompt here", "x"]
    forced = torch.randint(3, 90, (3, 6)).to(device)
    lean, ids, attn, decoder = _teacher_forced_lean_logits(model, tok, prompts, forced)
    full_ids = torch.cat([ids, forced], 1)
    full_attn = torch.cat([attn, torch.ones_like(forced)], 1)
    with torch.no_grad():
        ref = model(
            input_ids=full_ids, attention_mask=full_attn, position_ids=position_ids(full_attn)
        ).logits[:, ids.shape[1] - 1 :]
    scale = ref.abs().max()
    assert (lean - ref).abs().max() / scale <= 1e-5, (lean - ref).abs().max()
    with pytest.raises(RuntimeError, match="cache full"):
        decoder.step(forced[:, 0])  # room was made for exactly forced.shape[1] tokens


@pytest.mark.parametrize(
    "spec,dtype",
    [
        ("tiny-llama", "fp32"),
        ("tiny-llama", "bf16"),
        pytest.param("smollm2-135m", "bf16", marks=pytest.mark.slow),
    ],
)
@pytest.mark.parametrize("prompts", [["12+3=", "hello wo"], ["12+3=", "45+6="]])
def test_lean_decode_rollouts_are_bit_identical_to_the_hf_path(spec, dtype, prompts, device):
    """Same kernels as transformers' SDPA path (packed GQA heads with padding, native GQA
    without), so even bf16 rollouts agree bit for bit, with and without left padding."""
    from harness.base.models import load_model

    model, tok = load_model(spec, dtype=dtype)
    if spec == "tiny-llama":
        model, tok = _sharpened((model, tok))
    model.to(device)
    lean, hf = Engine(model, tok), Engine(model, tok)
    hf._can_decode_lean = lambda: False  # only the decode loop differs (same shared prefill)
    assert lean._can_decode_lean()
    a = lean.generate(prompts, Sampling(n=2, max_new_tokens=12, temperature=0.9), seed=4)
    b = hf.generate(prompts, Sampling(n=2, max_new_tokens=12, temperature=0.9), seed=4)
    assert torch.equal(a.response_ids, b.response_ids)
    assert torch.equal(a.logp_mu, b.logp_mu)


def test_lean_decode_is_off_where_it_would_not_be_exact(tiny_llama, tiny_moe):
    from harness.sampling import decode

    model, _ = tiny_llama
    assert decode.supports(model)
    h = model.model.layers[0].mlp.register_forward_hook(lambda *a: None)
    assert not decode.supports(model)  # any hook (every noise model uses hooks)
    h.remove()
    assert decode.supports(model)
    assert not decode.supports(tiny_moe[0])  # not a dense Llama


# --- finished rows leave the decode batch, numbers unchanged --------------------------------------


@pytest.mark.parametrize("V", [7, 99, 49152])
def test_sample_rows_draws_what_torch_multinomial_draws(V):
    """argmax(p / Exp(1)) over the whole [B, V] draw is torch.multinomial's one-sample path:
    the same tokens for every row, and a subset of rows gets its rows' tokens."""
    from harness.sampling.engines import sample_rows

    B = 6
    for seed in range(20):
        p = torch.rand(B, V, generator=torch.Generator().manual_seed(100 + seed)) ** 4
        p[:, : V // 3] = 0.0  # truncated support
        p = p / p.sum(-1, keepdim=True)
        ref = torch.multinomial(p, 1, generator=torch.Generator().manual_seed(seed))[:, 0]
        rows = torch.arange(B)
        assert torch.equal(sample_rows(p, rows, B, torch.Generator().manual_seed(seed)), ref)
        sub = torch.tensor([1, 4, 5])
        got = sample_rows(p[sub], sub, B, torch.Generator().manual_seed(seed))
        assert torch.equal(got, ref[sub])


@contextlib.contextmanager
def _threads(n: int):
    """Run the block at `n` intra-op threads (the pruning floor depends on them)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _pruned_and_full(eng, prompts, law, seed, threads=1):
    """The same rollout with finished rows leaving the decode batch and with every row kept (a
    prune floor of 0: never prune), at `threads` intra-op threads."""
    assert eng._row_local()
    with _threads(threads):
        a = eng.generate(prompts, law, seed=seed)
        with mock.patch("harness.sampling.engines.prune_floor", return_value=0):
            b = eng.generate(prompts, law, seed=seed)
    return a, b


def _assert_same_rollout(a, b):
    assert torch.equal(a.response_ids, b.response_ids)
    assert torch.equal(a.response_mask, b.response_mask)
    assert torch.equal(a.logp_mu, b.logp_mu)
    assert (a.support is None) == (b.support is None)
    if a.support is not None:  # a set per token: topk's order among tied log-probs may differ
        K = max(a.support.shape[-1], b.support.shape[-1])  # and so may the −1 padding width

        def canon(x):
            x = torch.nn.functional.pad(x, (0, K - x.shape[-1]), value=-1)
            return torch.where(x < 0, 1 << 30, x).sort(-1).values

        assert torch.equal(canon(a.support), canon(b.support))


@pytest.mark.parametrize(
    "path,dtype,noise,top_p",
    [
        ("lean", "fp32", None, 1.0),
        ("lean", "bf16", None, 0.9),
        ("hf", "fp32", None, 0.9),
        ("recompute", "fp32", None, 1.0),
        ("hf", "fp32", "logit", 1.0),
        ("hf", "fp32", "layer", 0.9),
        ("hf", "fp32", "fp8-row", 1.0),
        ("hf", "fp32", "position", 0.9),
        ("recompute", "fp32", "position", 1.0),
    ],
)
def test_pruned_decode_is_bit_identical_to_decoding_every_row(
    tiny_llama, path, dtype, noise, top_p
):  # noqa: E501
    """Finished rows leave the decode batch (lean decoder, HF KV-cache path, full recompute,
    row-local noise): tokens, masks, logp_mu and support are bit-identical to keeping them.
    EOS is made frequent (three common token ids) so rows finish at many different steps."""
    from harness.noise import build_noise

    model, tok = _sharpened(tiny_llama)
    model = model.to(torch.bfloat16 if dtype == "bf16" else torch.float32)
    specs = {
        "logit": ("logit", {"sigma": 0.5}),
        "layer": ("layer", {"sigma": 1e-2}),
        "fp8-row": ("fp8", {"granularity": "row"}),
        "position": ("position", {"sigma": 0.2, "length": 4.0}),
    }
    nz = [build_noise(specs[noise][0], **specs[noise][1])] if noise else []
    eng = Engine(model, tok, noise=nz, kv_cache=path != "recompute")
    try:
        if path == "hf":
            eng._can_decode_lean = lambda: False
        probe = eng.generate(["12+3="], Sampling(n=64, max_new_tokens=4), seed=0)
        common = probe.response_ids.flatten().bincount().argsort(descending=True)[:3]
        eng.eos_ids = common
        prompts = ["12+3=", "hello wo", "x", "45-6=", "a b c"]  # 40 rows > the floor of 16
        a, b = _pruned_and_full(eng, prompts, Sampling(n=8, max_new_tokens=14, top_p=top_p), 3)
        lens = a.response_mask.sum(1)
        assert len(lens.unique()) >= 3 and lens.min() < a.response_mask.shape[1]  # rows did prune
        _assert_same_rollout(a, b)
    finally:
        eng.close()


@pytest.mark.parametrize("threads", [1, 2])
def test_pruned_decode_on_the_task_model_and_which_noise_may_prune(threads):
    """The shipped countdown task model (its own EOS), the default rollout shape (16 prompts × 8,
    24 tokens): bit-identical at one and two threads.
    Noise keyed by the batch (batch noise, per-tensor FP8 activations, fresh noise) keeps
    every row in the batch."""
    from harness.noise import build_noise
    from harness.tasks.countdown import countdown
    from harness.tasks.warmstart import load_task_model

    model, tok = load_task_model("countdown")
    eng = Engine(model, tok)
    prompts = [p.prompt for p in countdown().sample(16, "train", 5)]
    a, b = _pruned_and_full(eng, prompts, Sampling(n=8, max_new_tokens=24), 11, threads)
    assert a.response_mask.sum(1).min() < a.response_mask.shape[1]
    _assert_same_rollout(a, b)
    fresh = {"deterministic": False}
    for name, kw in [("batch", {}), ("fp8", {"activations": True}), ("logit", fresh)]:
        n = build_noise(name, **kw)
        assert not n.row_local, name
    assert build_noise("logit").row_local and build_noise("fp8").row_local  # weights only
    assert build_noise("position").row_local


@pytest.mark.parametrize("threads", [1, 2])
def test_gemm_rows_do_not_depend_on_the_batch_size_above_the_prune_floor(threads):
    """The premise of `prune_floor` wherever it turns pruning on: a row of F.linear(x, W) has
    the same bits in a batch of any M ≥ the floor (SmolLM2's and the task models' K, N). Below
    the floor MKL switches kernels. Where the start-up check fails (floor 0) pruning is off and
    there is no premise to check; the next test covers that branch."""
    from torch.nn import functional as F

    from harness.sampling.engines import prune_floor

    with _threads(threads):
        floor, g = prune_floor(), torch.Generator().manual_seed(0)
        if floor == 0:
            pytest.skip(f"GEMM rows move with the batch size at {threads} thread(s): no pruning")
        for K, N in [(192, 99), (192, 576), (576, 192), (576, 1536), (1536, 576), (576, 49152)]:
            M = 2 * floor + 8
            x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g)
            full = F.linear(x, w)
            for m in range(floor, M):
                assert torch.equal(F.linear(x[:m].contiguous(), w), full[:m]), (K, N, m)


def test_pruning_is_off_where_gemm_rows_depend_on_the_batch_size(tiny_llama, monkeypatch, capsys):
    """The start-up check of `prune_floor`: a GEMM whose rows' bits move with the batch size M
    (here F.linear plus 1e-7·M, as a BLAS that picks kernels by M would) fails it; pruning is
    then off, with a log line, and every decode step runs all B rows."""
    from torch.nn import functional as F

    from harness.sampling import engines

    real = F.linear
    monkeypatch.setattr(F, "linear", lambda x, w, b=None: real(x, w, b) + 1e-7 * x.shape[0])
    assert not engines.gemm_rows_batch_invariant(16, torch.device("cpu"), torch.float32)
    check = engines.gemm_rows_batch_invariant
    monkeypatch.setattr(engines, "gemm_rows_batch_invariant", lambda *a: False)
    engines._prune_floor.cache_clear()
    monkeypatch.setattr(F, "linear", real)
    try:
        assert engines.prune_floor() == 0
        assert "no pruning" in capsys.readouterr().out
        model, tok = _sharpened(tiny_llama)
        eng = Engine(model, tok)
        eng._can_decode_lean = lambda: False  # the HF path: batch sizes seen by the model
        sizes = []
        hook = model.register_forward_pre_hook(
            lambda m, args, kw: sizes.append(kw["input_ids"].shape[0]), with_kwargs=True
        )
        prompts = ["12+3=", "hello wo", "x"]  # 3 prompts × 8: a prefill of 3 rows, then 24
        try:
            probe = eng.generate(["12+3="], Sampling(n=64, max_new_tokens=4), seed=0)
            eng.eos_ids = probe.response_ids.flatten().bincount().argsort(descending=True)[:3]
            sizes.clear()
            ro = eng.generate(prompts, Sampling(n=8, max_new_tokens=10), seed=3)
            assert ro.response_mask.sum(1).min() < ro.response_mask.shape[1]  # rows finished
            assert sizes[0] == 3 and set(sizes[1:]) == {24}
            monkeypatch.setattr(engines, "gemm_rows_batch_invariant", check)
            engines._prune_floor.cache_clear()  # the real check, on this machine's GEMMs
            with _threads(1):
                passes = check(16, torch.device("cpu"), torch.float32)
                assert engines.prune_floor() == (16 if passes else 0)
                sizes.clear()
                eng.generate(prompts, Sampling(n=8, max_new_tokens=10), seed=3)
            # the same decode prunes where the check passes, and keeps every row where it fails
            assert (min(sizes[1:]) < 24) if passes else set(sizes[1:]) == {24}
        finally:
            hook.remove()
    finally:
        engines._prune_floor.cache_clear()


@pytest.mark.parametrize("inv", [[0, 0, 0, 1, 1, 1, 2, 2, 2], [0, 1, 0, 2, 1, 2, 0, 2, 1]])
def test_gather_rows_equals_index_select_with_its_gradient(inv):
    """The trainer's per-row copy of each prompt's keys: values and gradient bit-identical to
    index_select (expand path for adjacent GRPO groups, index_select otherwise)."""
    from harness.sampling.engines import gather_rows

    inv = torch.tensor(inv)
    base = torch.randn(3, 5, 4, 8, generator=torch.Generator().manual_seed(0))
    g = torch.randn(9, 5, 4, 8, generator=torch.Generator().manual_seed(1)).transpose(1, 2)
    grads = []
    for fn in (gather_rows, lambda x, i: x.index_select(0, i)):
        x = base.clone().requires_grad_(True)
        y = fn(x.transpose(1, 2), inv)  # strided, as the attention's keys are
        y.backward(g)
        grads.append((y.detach(), x.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


def test_keep_rows_tops_up_to_the_floor_and_keeps_a_padded_row():
    from harness.sampling.engines import keep_rows

    live = torch.tensor([True, False, False, True, False])
    assert keep_rows(live, 1).tolist() == live.tolist()
    assert keep_rows(live, 3).tolist() == [True, True, False, True, False]
    padded = torch.tensor([False, False, True, False, True])
    assert keep_rows(live, 1, padded).tolist() == [True, False, True, True, False]


def test_hf_decode_on_a_pruned_cache_equals_the_full_batch_while_a_padded_row_stays(tiny_llama):
    """The premise of keeping one padded row on the HF path: 20 unpadded + 20 left-padded rows,
    one decode step after pruning to 20 rows. With a padded row kept the live rows' logits equal
    the full batch's bit for bit (with only unpadded rows transformers drops the mask and the
    bits move, by ~9e-8 on the tiny Llama: why `keep_rows` keeps one)."""
    from transformers import DynamicCache

    from harness.sampling.engines import position_ids

    model, tok = tiny_llama
    ids, attn = Engine(model, tok).encode_prompts(["a much longer prompt here"] * 20 + ["x"] * 20)

    def step(rows):
        c = DynamicCache()
        with torch.no_grad():
            model(input_ids=ids, attention_mask=attn, position_ids=position_ids(attn), cache=c)
            c.reorder_cache(rows)
            a = torch.cat([attn[rows], torch.ones(len(rows), 1, dtype=attn.dtype)], 1)
            return model(
                input_ids=torch.full((len(rows), 1), 5),
                attention_mask=a,
                cache=c,
                position_ids=position_ids(a)[:, -1:],
                logits_to_keep=1,
            ).logits[:, -1]

    with _threads(1):  # the floor of one thread: 20 rows ≥ 16
        full = step(torch.arange(40))
        with_pad = torch.cat([torch.arange(18), torch.tensor([30, 31])])
        assert torch.equal(step(with_pad), full[with_pad])
