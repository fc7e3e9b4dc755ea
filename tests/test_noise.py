"""Noise models: determinism, attach/detach, gate law, FP8 numerics, routing replay."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import (
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    DynamicCache,
    OlmoeConfig,
    OlmoeForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from harness.base.models import load_model, tiny_llama, upcycle_to_moe
from harness.noise import (
    NOISE,
    build_noise,
    forward_context,
    fp8_qdq,
    layer_amplification,
    prefix_hash,
)
from harness.noise.context import hashed_normal, hashed_student_t, mix64
from harness.noise.routing import find_routers, select
from harness.sampling.rollout import Sampling


@pytest.fixture(scope="module")
def llama():
    return load_model("tiny-llama")[0]


@pytest.fixture(scope="module")
def moe():
    return load_model("tiny-moe")[0]


def ids(B=2, S=12, seed=0):
    return torch.randint(3, 97, (B, S), generator=torch.Generator().manual_seed(seed))


def logits(model, x, **kw):
    with torch.no_grad():
        return model(x, **kw).logits


def token_logp(model, x):
    lp = torch.log_softmax(logits(model, x).double(), -1)
    return lp[:, :-1].gather(-1, x[:, 1:, None])[..., 0]


def cached_decode(model, x, prefill: int):
    """Prefill x[:, :prefill], then one KV-cache step per token, each in its forward_context."""
    h = prefix_hash(x)
    cache = DynamicCache()
    outs = []
    with torch.no_grad():
        with forward_context(h[:, :prefill]):
            outs.append(model(x[:, :prefill], cache=cache, use_cache=True).logits)
        for s in range(prefill, x.shape[1]):
            prev = prefix_hash(x[:, :s])[:, -1]
            with forward_context(prefix_hash(x[:, s : s + 1], prev=prev)):
                outs.append(model(x[:, s : s + 1], cache=cache, use_cache=True).logits)
    return torch.cat(outs, 1)


def state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def same_state(model, ref):
    sd = model.state_dict()
    return sd.keys() == ref.keys() and all(torch.equal(sd[k], ref[k]) for k in ref)


# --- context -----------------------------------------------------------------------------------


def naive_hash(row, mask):
    P, M, h, out = 0x100000001B3, 1 << 64, 0xCBF29CE484222325, []
    for t, m in zip(row.tolist(), mask.tolist()):
        if m:
            h = (h * P + t + 1) % M
        out.append(h - M if h >= 1 << 63 else h)
    return out


def test_prefix_hash_matches_naive_loop_and_skips_pads():
    x = ids(3, 10)
    mask = torch.ones_like(x)
    mask[0, :4] = 0  # left padding
    h = prefix_hash(x, mask)
    assert all(h[b].tolist() == naive_hash(x[b], mask[b]) for b in range(3))
    assert torch.equal(h[0, 4:], prefix_hash(x[:1, 4:])[0])  # padding does not change hashes
    prev = prefix_hash(x[:, :6], mask[:, :6])[:, -1]
    assert torch.equal(prefix_hash(x[:, 6:], mask[:, 6:], prev=prev), h[:, 6:])


def test_hashed_normal_and_student_t_moments():
    keys = mix64(torch.arange(4000, dtype=torch.int64))
    z = hashed_normal(keys, 64)
    assert torch.equal(z, hashed_normal(keys, 64))
    assert abs(z.mean()) < 0.01 and abs(z.std() - 1) < 0.01
    t = hashed_student_t(keys, 64, nu=5.0)  # Var = ν/(ν−2) = 5/3
    assert abs(t.var() - 5 / 3) < 0.1
    assert (t.abs() > 6).float().mean() > 10 * (z.abs() > 6).float().mean()  # heavy tail


# --- registry and bad input --------------------------------------------------------------------


def test_registry_errors_name_valid_choices(llama):
    assert set(NOISE) == {"layer", "logit", "position", "fp8", "routing", "replay", "batch"}
    with pytest.raises(KeyError, match="valid: batch, fp8, layer"):
        build_noise("gaussian")
    with pytest.raises(TypeError, match="valid:.*sigma"):
        build_noise("layer", sigam=0.1)
    with pytest.raises(TypeError, match="granularity"):
        build_noise("fp8", granulrity="row")
    with pytest.raises(ValueError, match="valid: tensor, row, block, mxfp8"):
        build_noise("fp8", granularity="channel")
    with pytest.raises(ValueError, match="needs an MoE model.*LlamaForCausalLM is dense"):
        build_noise("routing").attach(llama)
    with pytest.raises(ValueError, match="valid: e4m3, e5m2"):
        fp8_qdq(torch.ones(3), fmt="e4m4")
    with pytest.raises(IndexError, match="out of range"):
        build_noise("layer", layers=[5]).attach(llama)
    assert not llama._forward_hooks and not llama._forward_pre_hooks  # failed attach cleaned up


def test_context_shape_mismatch_is_an_error(llama):
    with build_noise("layer").attached(llama):
        with forward_context(prefix_hash(ids(2, 5))), pytest.raises(RuntimeError, match="match"):
            logits(llama, ids(2, 12))


# --- attach / detach / determinism ---------------------------------------------------------------

SPECS = [
    ("layer", dict(sigma=0.05)),
    ("layer", dict(sigma=0.05, mode="mult", layers=[1])),
    ("logit", dict(sigma=0.5)),
    ("logit", dict(sigma=0.5, nu=3.0)),
    ("position", dict(sigma=0.2, length=4.0)),
    ("position", dict(sigma=0.2, power=0.5, nu=3.0)),
    ("batch", dict(sigma=0.05)),
    ("fp8", dict(activations=True, granularity="row")),
    (
        "fp8",
        dict(
            granularity="block",
            act_granularity="block",
            activations=True,
            kv_cache=True,
            kv_scale="token",
        ),
    ),
]


@pytest.mark.parametrize("name,kw", SPECS)
def test_attach_detach_bit_identical_and_deterministic(llama, name, kw, device):
    llama = copy.deepcopy(llama).to(device)
    x = ids().to(device)
    ref, sd = logits(llama, x), state(llama)
    noise = build_noise(name, **kw)
    with noise.attached(llama):
        a, b = logits(llama, x), logits(llama, x)
    assert not torch.equal(a, ref)
    assert torch.equal(a, b)  # two runs of the same engine agree
    assert same_state(llama, sd) and torch.equal(logits(llama, x), ref)
    assert llama.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("name,kw", SPECS)
def test_prefill_matches_kv_cache_decode(llama, name, kw, device):
    llama = copy.deepcopy(llama).to(device)
    x = ids(2, 14, seed=1).to(device)
    with build_noise(name, **kw).attached(llama):
        full = logits(llama, x)
        dec = cached_decode(llama, x, prefill=6)
    assert (full - dec).abs().max() < 1e-4


def test_fresh_noise_when_not_deterministic(llama):
    x = ids()
    with build_noise("layer", sigma=0.05, deterministic=False).attached(llama):
        assert not torch.equal(logits(llama, x), logits(llama, x))


def test_noise_follows_prefix_not_batch_or_padding(llama):
    x = ids(2, 10)
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), x[:1]], 1)
    mask = torch.cat([torch.zeros(1, 3), torch.ones(1, 10)], 1).long()
    with build_noise("layer", sigma=0.05).attached(llama):
        alone = logits(llama, x[:1])
        in_batch = logits(llama, x)[:1]
        left_padded = logits(llama, padded, attention_mask=mask)[:, 3:]
    assert (alone - in_batch).abs().max() < 1e-5
    assert (alone - left_padded).abs().max() < 1e-5


def test_batch_noise_depends_on_batch_composition(llama):
    x = ids(3, 10)
    with build_noise("batch", sigma=0.05).attached(llama):
        alone, pair, again = logits(llama, x[:1]), logits(llama, x[:2]), logits(llama, x[:2])
        with forward_context(prefix_hash(x[:1]), batch_key=2):  # explicit key = "as in a pair"
            keyed = logits(llama, x[:1])
    assert torch.equal(pair, again)
    assert (alone - pair[:1]).abs().max() > 1e-3
    assert (keyed - pair[:1]).abs().max() < 1e-5


def test_layer_noise_has_exact_relative_size(llama):
    x, out = ids(), []
    with torch.no_grad(), build_noise("layer", sigma=0.01, inject_at=0).attached(llama):
        # registered after the noise hook, so it sees the perturbed output
        h = llama.model.layers[0].register_forward_hook(lambda m, a, o: out.append(o.clone()))
        llama(x)
    h.remove()
    with torch.no_grad():
        h = llama.model.layers[0].register_forward_hook(lambda m, a, o: out.insert(0, o.clone()))
        llama(x)
    h.remove()
    rel = (out[1] - out[0]).norm(dim=-1) / out[0].norm(dim=-1)
    assert torch.allclose(rel, torch.full_like(rel, 0.01), rtol=1e-3)


# --- layer amplification ------------------------------------------------------------------------


def test_layer_amplification_tiny_llama():
    model = tiny_llama(0, num_hidden_layers=4)[0]
    x = ids(2, 16)
    r = layer_amplification(model, x, inject_at=1, sigma=1e-3, seeds=(0, 1))
    assert r["rel"][0] == 0 and r["abs"][0] == 0
    assert r["rel"][1] == pytest.approx(1e-3, rel=1e-2)
    assert r["abs_growth"][1] == pytest.approx(1.0, rel=1e-2)
    assert all(v > 0 for v in r["rel"][1:])
    lin = layer_amplification(model, x, inject_at=1, sigma=1e-2, seeds=(0, 1))  # linear response
    assert lin["rel_growth"] == pytest.approx(r["rel_growth"], rel=0.05)
    emb = layer_amplification(model, x, inject_at="embed", sigma=1e-3, seeds=(0,))
    assert emb["rel"][0] > 0 and len(emb["rel"]) == 4
    sink = layer_amplification(model, x, inject_at=1, sigma=1e-3, seeds=(0, 1), include_sink=True)
    assert sink["h_norm"] != r["h_norm"]


# --- logit noise: the gate law -------------------------------------------------------------------


def gate_law_bins(clean_BxSxV, noisy_NxBxSxV, sigma, edges):
    """Per confidence bin: (Monte-Carlo Var(Δ log p_j), σ²(1 − 2p_j + ‖p‖²)) summed over pairs."""
    lp0 = torch.log_softmax(clean_BxSxV.double(), -1)
    p = lp0.exp()
    d = torch.log_softmax(noisy_NxBxSxV.double(), -1) - lp0
    var = d.var(0)
    pred = sigma**2 * (1 - 2 * p + p.pow(2).sum(-1, keepdim=True))
    out = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        m = (p >= lo) & (p < hi)
        out.append((int(m.sum()), var[m].sum().item(), pred[m].sum().item()))
    return out


def test_gate_law_tiny_model_sharpened_logits():
    model = tiny_llama(3)[0]
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)  # spread confidence over (0, 1)
    x, N, sigma = ids(4, 32, seed=3), 400, 0.01
    clean = logits(model, x)
    with build_noise("logit", sigma=sigma, deterministic=False).attached(model):
        noisy = logits(model, x.repeat(N, 1)).reshape(N, *clean.shape)
    for n, var, pred in gate_law_bins(clean, noisy, sigma, [0, 0.1, 0.4, 0.7, 0.9, 0.99, 1.01]):
        assert n >= 5, "bin too empty: sharpen the logits more"
        assert var == pytest.approx(pred, rel=0.10)


# --- FP8 -----------------------------------------------------------------------------------------


def gaussian(shape=(256, 1024), seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    "gran,kw",
    [
        ("tensor", {}),
        ("row", {}),
        ("row", {"pow2": True}),
        ("block", {}),
        ("block", {"block": (128, 128)}),
        ("mxfp8", {"mx_rounding": "rceil"}),
    ],
)
def test_fp8_e4m3_error_on_gaussian(gran, kw):
    x = gaussian()
    q = fp8_qdq(x, "e4m3", gran, **kw)
    rel = (x - q).abs() / x.abs()
    normal = x.abs() >= 2 * x.abs().max() / 448 * 2**-6  # normal range (pow2 scales: ≤ 2× up)
    assert rel.mean() == pytest.approx(0.0225, abs=0.001)  # 2^-5·½/ln 2 (log-uniform mantissas)
    assert rel[normal].max() <= 2**-4
    q5 = fp8_qdq(x, "e5m2", gran, **kw)
    assert ((x - q5).abs() / x.abs()).mean() / rel.mean() == pytest.approx(2.0, rel=0.05)


def test_fp8_mx_floor_clips_block_max():
    x = gaussian()
    floor = (fp8_qdq(x, granularity="mxfp8") - x).norm() / x.norm()
    rceil = (fp8_qdq(x, granularity="mxfp8", mx_rounding="rceil") - x).norm() / x.norm()
    # ‖x − q‖/‖x‖ on Gaussian data: ≈ 0.029 (FLOOR clips the block max to 448) vs ≈ 0.0266, the
    # e4m3 RMS rounding error 2^-4/√3 · √(3/(8 ln 2)) that RCEIL keeps
    assert floor > rceil * 1.05


def test_fp8_per_tensor_vs_per_row_when_rows_differ_by_orders_of_magnitude():
    g = torch.Generator().manual_seed(1)
    x = gaussian() * torch.exp(2 * torch.randn(256, 1, generator=g))
    p99 = {
        gran: ((x - fp8_qdq(x, granularity=gran)).abs() / x.abs()).quantile(0.99).item()
        for gran in ("tensor", "row")
    }
    assert p99["tensor"] > 0.2  # small rows underflow into subnormals
    assert p99["row"] < 0.06


def test_fp8_saturates_zero_pads_and_is_idempotent():
    big = torch.tensor([1.0, 1000.0, -1e6, float("inf")])
    for fmt in ("e4m3", "e5m2"):  # e5m2 casts overflow to inf unless clamped first
        assert torch.equal(fp8_qdq(big, fmt, amax=1.0), torch.tensor([1.0, 1.0, -1.0, 1.0]))
    assert torch.equal(fp8_qdq(torch.zeros(4, 8)), torch.zeros(4, 8))
    x = torch.randn(3, 5, 130)
    for gran, block in [("block", (1, 128)), ("block", (128, 128)), ("mxfp8", (1, 32))]:
        q = fp8_qdq(x, granularity=gran, block=block)
        assert q.shape == x.shape
        assert torch.equal(fp8_qdq(q, granularity=gran, block=block), q)
    w = torch.randn(200, 130)  # 128×128 blocks: a value's scale comes from its own block only
    q = fp8_qdq(w, granularity="block", block=(128, 128))
    assert torch.equal(q[:128, :128], fp8_qdq(w[:128, :128], granularity="tensor"))


def test_fp8_weights_quantised_once_and_resynced(llama):
    sd = state(llama)
    x = ids()
    noise = build_noise("fp8", granularity="row")
    q_proj = llama.model.layers[0].self_attn.q_proj
    with noise.attached(llama):
        noise.on_weight_sync()  # nothing copied in: keeps the high-precision originals
    assert same_state(llama, sd)
    with noise.attached(llama):
        w_q = q_proj.weight.data
        assert torch.equal(
            w_q, fp8_qdq(sd["model.layers.0.self_attn.q_proj.weight"], "e4m3", "row")
        )
        logits(llama, x)
        assert q_proj.weight.data_ptr() == w_q.data_ptr()  # no per-forward re-quantisation
        assert torch.equal(llama.lm_head.weight, sd["lm_head.weight"])  # head stays high precision
        new = {k: v * 1.01 for k, v in sd.items()}
        llama.load_state_dict(new)  # the engine's weight sync copies in place
        noise.on_weight_sync()
        assert torch.equal(
            q_proj.weight.data,
            fp8_qdq(new["model.layers.0.self_attn.q_proj.weight"], "e4m3", "row"),
        )
    assert same_state(llama, new)  # detach restores the *synced* high-precision weights
    llama.load_state_dict(sd)


def test_fp8_tied_lm_head_keeps_embeddings_high_precision():
    model = tiny_llama(0, tie_word_embeddings=True)[0]
    model.tie_weights()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    sd, x = state(model), ids()
    emb = []
    model.model.embed_tokens.register_forward_hook(lambda m, a, o: emb.append(o.clone()))
    ref = logits(model, x)
    with build_noise("fp8", weights=True, modules=(), lm_head=True).attached(model):
        out = logits(model, x)
        assert torch.equal(model.lm_head.weight, sd["lm_head.weight"])  # swapped only in forward
    assert torch.equal(emb[0], emb[1]) and not torch.equal(out, ref)
    assert same_state(model, sd)


def test_fp8_delayed_scaling_saturates_when_amax_grows():
    noise = build_noise("fp8", activations=True, act_granularity="delayed", amax_history_len=4)
    x = gaussian((64, 64))
    noise.qdq_act(x, key=0)
    y = noise.qdq_act(4 * x, key=0)  # scale from the history (amax of x): 4x saturates
    assert y.abs().max() == pytest.approx(x.abs().max().item(), rel=1e-3)
    assert torch.isfinite(y).all()


# --- routing -------------------------------------------------------------------------------------


def test_routing_replay_zero_noise_is_exact(moe):
    x = ids(2, 16)
    ref = logits(moe, x)
    r = build_noise("routing", sigma=0.0)
    with r.attached(moe):
        assert torch.equal(logits(moe, x), ref)
    rec = r.take_record()
    assert rec.shape == (2, 16, 2, 2)
    with build_noise("replay", indices=rec).attached(moe):
        assert torch.equal(logits(moe, x), ref)


def test_routing_replay_removes_route_flips(moe):
    x = ids(4, 32, seed=2)
    clean = token_logp(moe, x)
    r = build_noise("routing", sigma=0.3)
    with r.attached(moe):
        mu = token_logp(moe, x)  # sampler μ
    rec = r.take_record()
    with build_noise("replay", indices=rec).attached(moe):
        replayed = token_logp(moe, x)  # trainer with R3
    with build_noise("replay", indices=rec[:, :20]).attached(moe):
        partial = token_logp(moe, x)  # record shorter than the scored sequence
    plain = (mu - clean).abs().mean()
    r3 = (mu - replayed).abs().mean()
    assert r3 < plain / 3
    # same routes up to 19; expert GEMMs see other row counts, so equal only to fp32 rounding
    assert (partial[:, :19] - replayed[:, :19]).abs().max() < 1e-5
    assert (partial[:, 19:] - clean[:, 19:]).abs().max() < (mu - clean).abs().max()


def test_routing_record_concatenates_prefill_and_decode_steps(moe):
    x = ids(2, 14)
    r = build_noise("routing", sigma=0.3)
    with r.attached(moe):
        logits(moe, x)
        full = r.take_record()
        cached_decode(moe, x, prefill=5)
        stepped = r.take_record()
    assert stepped.shape == full.shape == (2, 14, 2, 2)
    assert torch.equal(stepped.sort(-1).values, full.sort(-1).values)


def tiny_family_models():
    c = dict(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts_per_tok=2,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    return [
        Qwen2MoeForCausalLM(
            Qwen2MoeConfig(
                **c, num_experts=8, moe_intermediate_size=32, shared_expert_intermediate_size=32
            )
        ),
        Qwen3MoeForCausalLM(
            Qwen3MoeConfig(**c, num_experts=8, moe_intermediate_size=32, norm_topk_prob=True)
        ),
        OlmoeForCausalLM(OlmoeConfig(**c, num_experts=8)),
        DeepseekV3ForCausalLM(
            DeepseekV3Config(
                **c,
                n_routed_experts=8,
                moe_intermediate_size=32,
                n_group=2,
                topk_group=1,
                first_k_dense_replace=1,
                kv_lora_rank=16,
                q_lora_rank=None,
                qk_rope_head_dim=8,
                qk_nope_head_dim=8,
                v_head_dim=16,
                n_shared_experts=1,
            )
        ),
    ]


def test_routing_selection_rule_exact_for_every_family():
    for model in tiny_family_models():
        model.eval()
        for _, router in find_routers(model, "test"):
            torch.nn.init.normal_(router.weight, std=0.5)
            if hasattr(router, "e_score_correction_bias"):
                router.e_score_correction_bias.normal_(0, 0.1)
            logits_, w, idx = router(torch.randn(10, 64))
            w2, idx2 = select(router, logits_)
            assert torch.equal(w, w2) and torch.equal(idx, idx2), type(router).__name__
        x = torch.randint(3, 64, (2, 12))
        ref = logits(model, x)
        r = build_noise("routing", sigma=0.0)
        with r.attached(model):
            logits(model, x)
        with build_noise("replay", indices=r.take_record()).attached(model):
            assert torch.equal(logits(model, x), ref), type(model).__name__
        with build_noise("routing", sigma=0.5).attached(model):
            assert not torch.equal(logits(model, x), ref)


def test_fp8_and_routing_compose(moe):
    x, sd = ids(), state(moe)
    ref = logits(moe, x)
    fp8 = build_noise("fp8", granularity="block", activations=True)
    routing = build_noise("routing", sigma=0.2)
    with fp8.attached(moe), routing.attached(moe):  # attached in order, detached in reverse
        assert not torch.equal(logits(moe, x), ref)
        assert not torch.equal(
            moe.model.layers[0].mlp.experts.down_proj, sd["model.layers.0.mlp.experts.down_proj"]
        )  # expert weights are FP8 too
        assert torch.equal(
            moe.model.layers[0].mlp.gate.weight, sd["model.layers.0.mlp.gate.weight"]
        )  # router stays high precision
    assert same_state(moe, sd) and torch.equal(logits(moe, x), ref)


# --- slow: SmolLM2 -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2():
    return load_model("smollm2-135m")


@pytest.mark.slow
def test_gate_law_smollm2(smollm2):
    model, tok = smollm2
    text = [
        "The capital of France is Paris. The capital of Germany is",
        "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    ]
    x = tok(text, return_tensors="pt", padding=True).input_ids[:, :16]
    sigma, N = 0.02, 120
    clean = logits(model, x)
    edges = [0, 0.1, 0.4, 0.7, 0.9, 1.01]
    acc = torch.zeros(len(edges) - 1, 3)
    with build_noise("logit", sigma=sigma, deterministic=False).attached(model):
        noisy = torch.stack([logits(model, x) for _ in range(N)])
    acc = gate_law_bins(clean, noisy, sigma, edges)
    for n, var, pred in acc:
        if n >= 5:
            assert var == pytest.approx(pred, rel=0.10)


@pytest.mark.slow
def test_routing_replay_upcycled_smollm2(smollm2):
    model, tok = smollm2
    moe = upcycle_to_moe(model, n_experts=4, top_k=2, expert_jitter=0.02, seed=0)
    x = tok(["Once upon a time, in a land far away, there lived a"], return_tensors="pt").input_ids
    clean = token_logp(moe, x)
    r = build_noise("routing", sigma=0.2)
    with r.attached(moe):
        mu = token_logp(moe, x)
    with build_noise("replay", indices=r.take_record()).attached(moe):
        replayed = token_logp(moe, x)
    assert (mu - replayed).abs().mean() < (mu - clean).abs().mean() / 5


@pytest.mark.parametrize(
    "kw", [{"granularity": "row"}, {"granularity": "row", "activations": True}]
)
def test_fp8_trainer_forward_equals_the_fp8_sampler_and_its_gradient_goes_straight_through(kw):
    """Full-pipeline FP8: the trainer's forward is the sampler's FP8 forward (same recipe, same
    weights: bit-identical log-probs, per-token activation scales), its gradient w.r.t. the
    high-precision weights is the gradient of a model holding the quantised weights (straight
    through), and `high_precision()` / detach give the plain model back."""
    import copy

    from harness.noise import Fp8Trainer

    model = load_model("tiny-llama")[0].float()
    x = ids()
    sampler = copy.deepcopy(model)
    with build_noise("fp8", **kw).attached(sampler):
        lp_mu = token_logp(sampler, x)
        quantised = state(sampler)  # the sampler's FP8 weights, as a plain model's weights
    ref = copy.deepcopy(model)
    ref.load_state_dict(quantised)
    lp_hp = token_logp(model, x)
    trainer = Fp8Trainer(build_noise("fp8", **kw))
    with trainer.attached(model):
        assert torch.equal(token_logp(model, x), lp_mu)
        with trainer.high_precision():
            assert torch.equal(token_logp(model, x), lp_hp)
        assert torch.equal(token_logp(model, x), lp_mu)  # FP8 again after the shadow pass
        model.zero_grad()
        model(x).logits.square().mean().backward()
    hooks = []
    if kw.get("activations"):  # the reference quantises its linears' inputs, straight through
        acts = build_noise("fp8", **kw)

        def ste(module, args):
            return (acts.qdq_act(args[0].detach(), 0) + (args[0] - args[0].detach()),)

        hooks = [
            m.register_forward_pre_hook(ste)
            for name, m in ref.named_modules()
            if name.rsplit(".", 1)[-1] in acts.modules
        ]
    ref(x).logits.square().mean().backward()
    for h in hooks:
        h.remove()
    q_proj = "model.layers.0.self_attn.q_proj.weight"
    grads = dict(model.named_parameters())
    ref_grads = dict(ref.named_parameters())
    for name in (q_proj, "model.layers.1.mlp.down_proj.weight", "lm_head.weight"):
        torch.testing.assert_close(grads[name].grad, ref_grads[name].grad, rtol=1e-5, atol=1e-7)
    assert not torch.equal(grads[q_proj].detach(), quantised[q_proj])  # master stays high precision
    assert torch.equal(token_logp(model, x), lp_hp)  # detached: the plain model


# --- position noise: σ(p) = sigma·(1 + p/length)^power at absolute position p --------------------


def uniform_llama():
    """tiny-llama with a zero lm_head: every logit is 0, so a forward returns the noise itself."""
    model, tok = load_model("tiny-llama", seed=0)
    with torch.no_grad():
        model.lm_head.weight.zero_()
    return model, tok


def left_padded(x, pads):
    """Row b: pads[b] left pads, then x[b, :S − pads[b]]: (ids, mask), both [B, S]."""
    mask = (torch.arange(x.shape[1])[None] >= torch.tensor(pads)[:, None]).long()
    out = torch.stack([x[b].roll(n) for b, n in enumerate(pads)]) * mask
    return out, mask


def test_position_noise_is_sigma_of_p_times_the_logit_noise_field():
    """At zero logits the perturbation is σ(p)·ε exactly, ε the `logit` noise's own field (same
    seed, same draw), p counting real tokens only: a left-padded row gets what it gets alone,
    through the fallback (attention_mask) and through an explicit context with positions."""
    from harness.noise import position_ids

    model, _ = uniform_llama()
    x = ids(3, 20, seed=5)
    for kw in [{}, {"nu": 3.0}, {"power": 0.5, "length": 7.0}]:
        pos_noise = build_noise("position", sigma=0.3, seed=4, **kw)
        unit = build_noise("logit", sigma=1.0, seed=4, nu=kw.get("nu"))
        with unit.attached(model):
            eps = logits(model, x)
        with pos_noise.attached(model):
            d = logits(model, x)
            xp, mask = left_padded(x, [0, 2, 5])
            padded = logits(model, xp, attention_mask=mask)
            with forward_context(prefix_hash(xp, mask), pos_BxS=position_ids(mask)):
                explicit = logits(model, xp, attention_mask=mask)
        sig = 0.3 * (1 + torch.arange(20.0) / kw.get("length", 32.0)) ** kw.get("power", 1.0)
        torch.testing.assert_close(d, sig[None, :, None] * eps, rtol=1e-6, atol=0)
        for b, n in enumerate([0, 2, 5]):  # to an ulp: vectorised pow/cos see other batches
            torch.testing.assert_close(padded[b, n:], d[b, : 20 - n], rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(explicit[b, n:], d[b, : 20 - n], rtol=1e-6, atol=1e-6)
    power0 = build_noise("position", sigma=0.3, power=0.0)  # power 0: plain `logit` noise
    with power0.attached(model):
        flat = logits(model, x)
    with build_noise("logit", sigma=0.3).attached(model):
        assert torch.equal(flat, logits(model, x))


def test_position_noise_std_at_position_p_is_sigma_of_p():
    """The law, measured: at zero logits the perturbation's std over B rows × V logits at
    position p is σ(p) = sigma·(1 + p/length). Its relative standard error is 1/√(2N) (N = B·V
    Gaussian draws), and the tolerance is 4 of them."""
    model, _ = uniform_llama()
    B, S, sigma, length = 64, 48, 0.1, 16.0
    with build_noise("position", sigma=sigma, length=length).attached(model):
        d = logits(model, ids(B, S, seed=6))
    std = d.double().pow(2).mean((0, 2)).sqrt()  # ε has mean 0: the RMS is the std
    law = sigma * (1 + torch.arange(S, dtype=torch.float64) / length)
    tol = 4 / (2 * B * d.shape[-1]) ** 0.5
    assert ((std / law - 1).abs() < tol).all(), (std / law - 1).abs().max()
    assert std[-1] / std[0] > 3.5  # σ(47)/σ(0) = 3.94: the tail is clearly noisier


def test_position_noise_delta_logp_between_clean_trainer_and_noisy_sampler_follows_the_law():
    """End to end: a noisy sampler at uniform logits samples (prompts of four lengths, so left
    padding); the clean trainer re-scores. Per absolute position p, to first order
    Δ = log π − log μ is Gaussian with std σ(p)·√(1 − 1/V) (the gate law at p_j = 1/V), so
    mean |Δ| = √(2/π)·σ(p)·√(1 − 1/V). Tolerances from the sample: per position 5 standard
    errors (sd(|Δ|)/mean|Δ| = √(π/2 − 1)) + 3% for the second-order terms; the late/early ratio
    within 10% of σ(late)/σ(early)."""
    from harness.noise import position_ids
    from harness.sampling.engines import Engine

    model, tok = uniform_llama()
    sigma, length, T = 0.05, 8.0, 24
    noisy = Engine(model, tok, noise=[build_noise("position", sigma=sigma, length=length)])
    noisy.eos_ids = noisy.eos_ids[:0]  # no EOS: every row runs T tokens
    prompts = ["1", "12+3=", "hello there you", "a much longer prompt than that"]
    ro = noisy.generate(prompts, Sampling(n=96, max_new_tokens=T), seed=1)
    clean = Engine(uniform_llama()[0], tok).logp(ro)["logp"]
    assert torch.equal(clean, torch.full_like(clean, -torch.log(torch.tensor(99.0)).item()))
    delta = (clean - ro.logp_mu).abs().double()
    pos = position_ids(ro.attention_mask)[:, ro.n_prompt - 1 : -1]  # the logits' positions
    V, c = 99, (2 / torch.pi) ** 0.5
    rel_sd = (torch.pi / 2 - 1) ** 0.5
    ratios = {}
    for p in pos.unique().tolist():
        m = pos == p
        law = c * sigma * (1 + p / length) * (1 - 1 / V) ** 0.5
        ratios[p] = (delta[m].mean().item() / law, int(m.sum()))
        assert abs(ratios[p][0] - 1) < 5 * rel_sd / m.sum().item() ** 0.5 + 0.03, (p, ratios[p])
    early, late = pos < pos.min() + 6, pos > pos.max() - 6
    sig = sigma * (1 + pos.double() / length)
    measured = delta[late].mean() / delta[early].mean()
    assert measured == pytest.approx((sig[late].mean() / sig[early].mean()).item(), rel=0.10)
    assert measured > 2  # and it does grow along the response


def test_position_noise_same_in_prefill_kv_decode_recompute_and_rescore():
    """With left padding (prompts of different lengths), a noisy sampler decoding with its KV
    cache and one decoding by full recompute sample the same tokens with the same logp_mu; a
    noisy trainer re-scoring them reproduces logp_mu; a padded row re-scored alone, unpadded,
    gets the same numbers (positions count real tokens only)."""
    from harness.sampling.engines import Engine

    model, tok = load_model("tiny-llama", seed=0)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    noise = dict(sigma=0.2, length=4.0)
    kv = Engine(copy.deepcopy(model), tok, noise=[build_noise("position", **noise)])
    rc = Engine(copy.deepcopy(model), tok, noise=[build_noise("position", **noise)], kv_cache=False)
    prompts, law = ["hi", "a much longer prompt"], Sampling(n=2, max_new_tokens=12)
    a, b = kv.generate(prompts, law, seed=2), rc.generate(prompts, law, seed=2)
    assert torch.equal(a.response_ids, b.response_ids)
    m = a.response_mask.bool()
    assert (a.logp_mu - b.logp_mu)[m].abs().max() <= 1e-5
    assert (kv.logp(a)["logp"] - a.logp_mu)[m].abs().max() <= 1e-5
    assert ~a.prompt_mask[0].bool().all()  # row 0 was sampled behind left pads
    alone = torch.cat([torch.tensor(tok("hi").input_ids), a.response_ids[0]])[None]
    sc = kv.score(alone, torch.ones_like(alone), n_prompt=alone.shape[1] - a.response_ids.shape[1])
    assert (sc["logp"][0] - a.logp_mu[0])[m[0]].abs().max() <= 1e-5
    delta = (Engine(model, tok).logp(a)["logp"] - a.logp_mu)[m]
    assert delta.abs().mean() > 1e-3  # it is noise w.r.t. the clean trainer
    assert build_noise("position").row_local
    assert not build_noise("position", deterministic=False).row_local


def test_position_noise_sigma_zero_is_bit_identical_and_sigma_scales_every_position():
    """sigma = 0: the logits and the sampler's rollouts are bit-identical to no noise.
    drivers.beta_growth sets `sigma`: doubling it doubles σ(p) at every position, exactly."""
    from harness.sampling.engines import Engine

    model, tok = load_model("tiny-llama", seed=0)
    x = ids(2, 16)
    ref = logits(model, x)
    with build_noise("position", sigma=0.0).attached(model):
        assert torch.equal(logits(model, x), ref)
    law = Sampling(n=2, max_new_tokens=10)
    plain = Engine(model, tok)
    # the decode path an engine with row-local noise attached takes (the shared prompt prefill,
    # no lean decoder): the lean decoder rounds differently with two threads
    plain._can_decode_lean = lambda: False
    clean = plain.generate(["12+3=", "hello"], law, seed=3)
    zero = Engine(model, tok, noise=[build_noise("position", sigma=0.0)])
    ro = zero.generate(["12+3=", "hello"], law, seed=3)
    zero.close()
    assert torch.equal(ro.response_ids, clean.response_ids)
    assert torch.equal(ro.logp_mu, clean.logp_mu)
    u = uniform_llama()[0]
    noise = build_noise("position", sigma=0.1)
    with noise.attached(u):
        d1 = logits(u, x)
        noise.sigma *= 2  # what drivers.beta_growth does each step
        d2 = logits(u, x)
    assert torch.equal(d2, 2 * d1)


@pytest.mark.parametrize(
    "kw,match",
    [
        (
            {"lenght": 3},
            r"noise 'position': unknown argument\(s\) \['lenght'\]; valid: \['sigma', "
            r"'length', 'power', 'nu', 'seed', 'deterministic'\]",
        ),
        ({"length": 0}, r"position noise: length must be > 0 \(tokens.*\), got 0"),
        ({"power": -1}, r"position noise: power must be >= 0 .*got -1"),
        ({"sigma": -0.1}, r"position noise: sigma must be >= 0, got -0.1"),
        ({"sigma": float("nan")}, r"position noise: sigma must be >= 0, got nan"),
        ({"nu": 0}, r"position noise: nu \(degrees of freedom\) must be > 0, got 0"),
    ],
)
def test_position_noise_bad_kwargs_name_the_key_the_value_and_what_is_valid(kw, match):
    with pytest.raises((TypeError, ValueError), match=match):
        build_noise("position", **kw)


def test_position_noise_needs_positions(llama):
    """A hooked lm_head call in a context without positions fails, saying how to pass them, also
    inside an outer context that has some (each forward's context carries its own); with them it
    runs."""
    h = llama.model.norm(llama.model.embed_tokens(ids(1, 4)))
    with build_noise("position").attached(llama):
        with forward_context(prefix_hash(ids(1, 4))), pytest.raises(RuntimeError, match="pos_BxS"):
            llama.lm_head(h)
        hx, pos = prefix_hash(ids(1, 4)), torch.tensor([[0, 1, 2, 3]])
        with forward_context(hx, pos_BxS=pos), forward_context(hx[:, 1:]):
            with pytest.raises(RuntimeError, match="pos_BxS"):
                llama.lm_head(h[:, 1:])
        with forward_context(hx[:, 1:], pos_BxS=pos[:, 1:]):
            assert llama.lm_head(h[:, 1:]).shape == (1, 3, 99)
