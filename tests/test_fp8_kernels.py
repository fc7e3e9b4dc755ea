"""The real FP8 GEMM next to the emulation: `Fp8Noise(kernel="scaled_mm")`.

Tolerances, from torch 2.13 on a CPU (tiny-llama, 3 seeds, log-probs of all 99 tokens at
4×32 positions): in fp32 the two kernels agree exactly for every scaling (the CPU `_scaled_mm`
row-wise kernel dequantises and runs the fp32 GEMM; tensor-wise scales go through it too, see
`fp8_linear` — its own tensor-wise kernel differs by 4e-5 max / 1.4e-7 mean and is ~800× slower);
the FP8 noise itself is ~5e-3 mean, 3–5e-2 max.
In bf16 they differ by bf16 rounding (max 2.1e-2, mean 2.1–2.9e-3: the emulation rounds the
dequantised operands and each GEMM's output to bf16), while their |Δ| against the clean model
agree within 5 %.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from harness.base.models import load_model, smollm2_shaped, tiny_llama, tiny_moe, weights_sha
from harness.noise import Fp8Noise, fp8_qdq
from harness.noise import fp8 as fp8_module
from harness.noise.fp8 import fp8_kernel_available, fp8_quantise
from harness.sampling.engines import Engine
from harness.sampling.rollout import Sampling
from harness.stats import fp8_fidelity as fid
from harness.stats.diagnostics import bin_index

GRANS = [("tensor", "tensor"), ("row", "row"), ("tensor", "row"), ("row", "tensor")]
E4M3_MAX = 448.0

# as the `device` fixture's cuda ids (tests/conftest.py): deselected on CPU CI by the marker, and
# a skip with its reason where someone runs `-m gpu` without a GPU
NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def recipe(granularity="row", act_granularity="row", **kw) -> dict:
    return dict(granularity=granularity, act_granularity=act_granularity, activations=True, **kw)


def ids(B=4, S=32, seed=0, vocab=99) -> torch.Tensor:
    return torch.randint(3, vocab, (B, S), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def logprobs(model, x) -> torch.Tensor:
    return model(x.to(model.device)).logits.float().log_softmax(-1)


def naive_fp8(t: torch.Tensor, row: bool) -> torch.Tensor:
    """Dequantised E4M3 by hand: s = amax / 448 per tensor or per row, q = sat(t / s)."""
    a = t.abs().amax(-1, keepdim=True) if row else t.abs().amax()
    s = a / E4M3_MAX
    return (t / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() * s


# --- the kernel against the emulation and a hand reference ---------------------------------------


def three_ways(model, gran, act_gran):
    """Token log-probs of one batch: clean, under the emulated recipe, under the real GEMMs."""
    x = ids()
    out = [logprobs(model, x)]
    for kernel in ("emulated", "scaled_mm"):
        with Fp8Noise(kernel=kernel, **recipe(gran, act_gran)).attached(model):
            out.append(logprobs(model, x))
    return out


@pytest.mark.parametrize("gran,act_gran", GRANS)
def test_scaled_mm_equals_emulation_in_fp32_and_both_differ_from_clean(gran, act_gran):
    clean, emulated, real = three_ways(load_model("tiny-llama")[0], gran, act_gran)
    assert torch.equal(real, emulated)
    for noisy in (emulated, real):
        assert (noisy - clean).abs().mean() > 1e-3  # the FP8 noise acts (~5e-3)


@pytest.mark.parametrize("gran,act_gran", [("tensor", "tensor"), ("row", "row")])
def test_scaled_mm_and_emulation_in_bf16_differ_by_bf16_rounding(gran, act_gran):
    clean, emulated, real = three_ways(load_model("tiny-llama", dtype="bf16")[0], gran, act_gran)
    assert (real - emulated).abs().max() <= 0.05 and (real - emulated).abs().mean() <= 5e-3
    ratio = (real - clean).abs().mean() / (emulated - clean).abs().mean()
    assert 0.75 <= float(ratio) <= 1.33


@pytest.mark.parametrize("gran,act_gran", GRANS)
def test_one_linear_is_the_hand_dequantised_matmul_plus_bias(gran, act_gran):
    model, _ = tiny_llama(0, attention_bias=True)
    q_proj = model.model.layers[0].self_attn.q_proj
    with torch.no_grad():
        q_proj.bias.normal_()
    x = torch.randn(2, 5, 64)
    w, b = q_proj.weight.detach().clone(), q_proj.bias.detach().clone()
    ref = naive_fp8(x.reshape(-1, 64), act_gran == "row") @ naive_fp8(w, gran == "row").T + b
    with Fp8Noise(kernel="scaled_mm", **recipe(gran, act_gran)).attached(model):
        with torch.no_grad():
            y = q_proj(x)
    assert y.shape == (2, 5, 64) and y.dtype == x.dtype
    torch.testing.assert_close(y.reshape(-1, 64), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gran", ["tensor", "row"])
@pytest.mark.parametrize("pow2", [False, True])
def test_fp8_quantise_is_fp8_qdq_bit_for_bit(dtype, gran, pow2):
    x = (torch.randn(16, 48) * torch.logspace(-3, 2, 16)[:, None]).to(dtype)
    q, s = fp8_quantise(x, "e4m3", gran, pow2=pow2)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert s.shape == (() if gran == "tensor" else (16, 1))
    assert torch.equal((q.float() * s).to(dtype), fp8_qdq(x, "e4m3", gran, pow2=pow2))


def test_kernel_availability_is_probed_by_a_trial_gemm():
    assert fp8_kernel_available("cpu")  # torch 2.13 CPU runs _scaled_mm (tensor and row scales)
    assert fp8_kernel_available("cpu", torch.bfloat16, "row", "tensor")
    assert not fp8_kernel_available("meta")


# --- validation ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(kernel="cutlass"), r"kernel 'cutlass'; valid: emulated, scaled_mm"),
        (recipe(fmt="e5m2"), r"fmt='e5m2'.*valid: 'e4m3'"),
        (dict(recipe(), weights=False), r"weights=False.*valid: True"),
        (dict(recipe(), activations=False), r"activations=False.*valid: True"),
        (recipe(granularity="block"), r"granularity='block'.*valid: 'tensor', 'row'"),
        (recipe(act_granularity="delayed"), r"act_granularity='delayed'.*valid: 'tensor', 'row'"),
        (recipe(kv_cache=True), r"kv_cache=True.*valid: False"),
        (recipe(modules=()), r"modules=\(\) with lm_head=False.*valid: modules from q_proj"),
    ],
)
def test_scaled_mm_recipe_errors_name_the_key_the_value_and_what_is_valid(kw, match):
    kernel = kw.pop("kernel", "scaled_mm")
    with pytest.raises(ValueError, match=match):
        Fp8Noise(kernel=kernel, **kw)


def test_shapes_off_the_16_grid_are_refused_at_attach_naming_the_layer():
    model, _ = load_model("tiny-llama")  # vocab 99: lm_head [99, 64]
    sd = weights_sha(model)
    with pytest.raises(ValueError, match=r"layer lm_head has weight \[N, K\] = \[99, 64\]"):
        Fp8Noise(kernel="scaled_mm", lm_head=True, **recipe()).attach(model)
    assert weights_sha(model) == sd and "forward" not in vars(model.lm_head)


def test_a_device_without_the_kernel_is_refused_before_any_change(monkeypatch):
    model, _ = load_model("tiny-llama")
    q_proj = model.model.layers[0].self_attn.q_proj
    monkeypatch.setattr(fp8_module, "fp8_kernel_available", lambda *a: False)
    with pytest.raises(RuntimeError, match=r"cannot run on cpu .*use kernel='emulated'"):
        Fp8Noise(kernel="scaled_mm", **recipe()).attach(model)
    assert "forward" not in vars(q_proj)
    with pytest.raises(RuntimeError, match="cannot run on cpu"):
        fid.fp8_fidelity(model, load_model("tiny-llama")[1], ["12"], recipe(), 1, 2)


# --- life cycle ----------------------------------------------------------------------------------


def test_attach_detach_leaves_the_model_bit_identical():
    model, _ = load_model("tiny-llama")
    x = ids()
    sha, ref = weights_sha(model), logprobs(model, x)
    q_proj = model.model.layers[0].self_attn.q_proj
    noise = Fp8Noise(kernel="scaled_mm", **recipe())
    with noise.attached(model):
        assert weights_sha(model) == sha  # the parameters are not touched: FP8 copies are kept
        q_w, s_w = noise._gemm[0][1:]
        assert q_w.dtype == torch.float8_e4m3fn and q_w.device == q_proj.weight.device
        assert s_w.dtype == torch.float32 and s_w.shape == (q_proj.out_features, 1)
        assert not torch.equal(logprobs(model, x), ref)
    assert weights_sha(model) == sha and torch.equal(logprobs(model, x), ref)
    assert not any("forward" in vars(m) for m in model.modules())


def test_tied_lm_head_runs_fp8_while_the_embeddings_stay_high_precision():
    model, _ = tiny_llama(0, vocab_size=112, tie_word_embeddings=True)
    model.tie_weights()
    x = ids(vocab=112)
    emb = []
    model.model.embed_tokens.register_forward_hook(lambda m, a, o: emb.append(o.clone()))
    sha, ref = weights_sha(model), logprobs(model, x)
    noise = Fp8Noise(kernel="scaled_mm", modules=(), lm_head=True, **recipe())
    with noise.attached(model):
        out = logprobs(model, x)
    assert torch.equal(emb[0], emb[1]) and not torch.equal(out, ref)
    assert weights_sha(model) == sha and torch.equal(logprobs(model, x), ref)


def test_on_weight_sync_requantises_the_changed_weight():
    model, _ = load_model("tiny-llama")
    q_proj = model.model.layers[0].self_attn.q_proj
    w0 = q_proj.weight.detach().clone()
    x = torch.randn(6, 64)
    noise = Fp8Noise(kernel="scaled_mm", **recipe())
    with noise.attached(model), torch.no_grad():
        y0 = q_proj(x)
        noise.on_weight_sync()  # nothing changed: the same FP8 weight
        assert torch.equal(q_proj(x), y0)
        q_proj.weight.mul_(1.5)  # the engine's weight sync copies in place
        assert torch.equal(q_proj(x), y0)  # quantised once: the old FP8 copy until the sync
        noise.on_weight_sync()
        y1 = q_proj(x)
    assert not torch.allclose(y1, y0)
    torch.testing.assert_close(y1, naive_fp8(x, True) @ naive_fp8(1.5 * w0, True).T)
    assert torch.equal(q_proj.weight, 1.5 * w0)  # detach keeps the synced high-precision weight


def test_moe_experts_keep_the_emulated_weight_path():
    """Fused experts are quantised alike by both kernels (weight swap, high-precision compute):
    in fp32 with row scaling the two kernels then give the same logits on the CPU."""
    model, _ = tiny_moe(0)
    experts = model.model.layers[0].mlp.experts
    gate_up = experts.gate_up_proj.detach().clone()
    x = ids()
    sha = weights_sha(model)
    with Fp8Noise(kernel="emulated", **recipe()).attached(model):
        emulated = logprobs(model, x)
    noise = Fp8Noise(kernel="scaled_mm", **recipe())
    with noise.attached(model):
        assert torch.equal(experts.gate_up_proj, noise.qdq_weight(gate_up))
        real = logprobs(model, x)
    assert torch.isfinite(real).all() and torch.equal(real, emulated)
    assert weights_sha(model) == sha


# --- the measurement -----------------------------------------------------------------------------


@torch.no_grad()
def _row_logp(model, ro, b: int) -> torch.Tensor:
    """Row b's response log-probs by a plain forward of its own real tokens (no Engine)."""
    keep = ro.attention_mask[b].bool()
    toks = ro.tokens[b][keep]
    n_p = int(ro.prompt_mask[b].sum())
    lp = model(toks[None]).logits[0].float().log_softmax(-1)
    return lp[n_p - 1 : -1].gather(1, toks[n_p:, None])[:, 0]


def test_fp8_fidelity_bins_agree_with_a_naive_loop_over_tokens():
    model, tok = load_model("tiny-llama")
    prompts, n, T, seed = ["12+3=", "abc"], 2, 8, 0
    edges = (0.0, 0.009, 0.0105, 0.012, 1.0)  # near-uniform random model: p_t ≈ 1/99
    out = fid.fp8_fidelity(model, tok, prompts, recipe(), n, T, seed, edges=edges)
    json.dumps(out, allow_nan=False)  # strict JSON: empty bins are null, not NaN
    assert {"bins", "overall", "recipe", "n", "max_new_tokens", "seed"} <= set(out)
    assert [b["lo"] for b in out["bins"]] == list(edges[:-1])
    ro = Engine(model, tok).generate(prompts, Sampling(n=n, max_new_tokens=T), seed=seed)
    n_tok = int(ro.response_mask.sum())
    assert out["overall"]["n_tokens"] == n_tok == sum(b["n_tokens"] for b in out["bins"])
    assert sum(b["n_tokens"] > 0 for b in out["bins"]) >= 2
    rows = range(ro.response_ids.shape[0])
    clean = [_row_logp(model, ro, b) for b in rows]
    noisy = {}
    for path in ("emulated", "scaled_mm"):
        with Fp8Noise(kernel=path, **recipe()).attached(model):
            noisy[path] = [_row_logp(model, ro, b) for b in rows]
    sums = {}  # bin -> [count, Σ|Δ emulated|, Σ|Δ real|]
    for b in rows:
        for t in range(len(clean[b])):
            lp = float(clean[b][t])
            k = int(bin_index(math.exp(lp), edges))
            acc = sums.setdefault(k, [0, 0.0, 0.0])
            acc[0] += 1
            acc[1] += abs(float(noisy["emulated"][b][t]) - lp)
            acc[2] += abs(float(noisy["scaled_mm"][b][t]) - lp)
    for k, got in enumerate(out["bins"]):
        count, s_em, s_re = sums.get(k, [0, 0.0, 0.0])
        assert got["n_tokens"] == count
        if count:
            assert got["mean_abs_delta_emulated"] == pytest.approx(s_em / count, abs=1e-5)
            assert got["mean_abs_delta_scaled_mm"] == pytest.approx(s_re / count, abs=1e-5)
    # The two fp32 paths agree to rounding, not bit for bit: their summation order depends on
    # the thread count (0 at one thread, 1.5e-8 at two), 1e5× below the FP8 β itself.
    assert out["overall"]["mean_abs_scaled_mm_minus_emulated"] <= 1e-6
    assert out["overall"]["mean_abs_delta_emulated"] > 1e-3


def test_fp8_fidelity_refuses_a_recipe_that_sets_the_kernel():
    model, tok = load_model("tiny-llama")
    with pytest.raises(ValueError, match="recipe sets kernel='emulated'; leave it out"):
        fid.fp8_fidelity(model, tok, ["1"], {"kernel": "emulated", **recipe()})


def test_fp8_fidelity_cli_writes_the_json(tmp_path, capsys):
    args = "--model tiny-llama --device cpu --n 1 --max-new-tokens 4".split()
    fid.main([*args, "--out", str(tmp_path)])
    out = json.loads((tmp_path / "fp8_fidelity.json").read_text())
    assert out["model"] == "tiny-llama" and out["device"] == "cpu" and out["n_layers"] == 2
    assert out["overall"]["n_tokens"] == sum(b["n_tokens"] for b in out["bins"]) > 0
    assert "real/emu" in capsys.readouterr().out


# --- CUDA: the real FP8 GEMM (Ada / Hopper) ------------------------------------------------------


def _cuda_models():
    return {
        "tiny-llama": lambda: load_model("tiny-llama")[0],
        "smollm2-shaped": lambda: smollm2_shaped(n_layers=4, seed=0)[0],
    }


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["tiny-llama", "smollm2-shaped"])
@pytest.mark.parametrize("dtype,gran", [(torch.float32, "tensor"), (torch.bfloat16, "row")])
@NEEDS_CUDA
def test_cuda_scaled_mm_is_finite_and_as_noisy_as_the_emulation(name, dtype, gran):
    """On capability >= 8.9 the real FP8 GEMM runs, is finite, and its |Δ log π| against the
    clean model is of the emulation's order; below 8.9 attach refuses it clearly."""
    model = _cuda_models()[name]().to("cuda", dtype)
    rec = recipe(gran, gran)
    if torch.cuda.get_device_capability() < (8, 9):
        with pytest.raises(RuntimeError, match="cannot run on cuda"):
            Fp8Noise(kernel="scaled_mm", **rec).attach(model)
        return
    x = ids(B=4, S=64).cuda()
    y = x[:, 1:, None]
    clean = logprobs(model, x)[:, :-1].gather(-1, y)
    with Fp8Noise(kernel="emulated", **rec).attached(model):
        emulated = logprobs(model, x)[:, :-1].gather(-1, y)
    noise = Fp8Noise(kernel="scaled_mm", **rec)
    with noise.attached(model):
        assert all(q.device.type == "cuda" and s.device.type == "cuda" for _, q, s in noise._gemm)
        real = logprobs(model, x)[:, :-1].gather(-1, y)
    assert torch.isfinite(real).all()
    d_em, d_re = (emulated - clean).abs().mean(), (real - clean).abs().mean()
    assert d_em > 0 and 0.25 <= float(d_re / d_em) <= 4.0


@pytest.mark.gpu
@NEEDS_CUDA
def test_cuda_fp8_fidelity_on_the_smollm2_shaped_model():
    model, tok = smollm2_shaped(n_layers=4, seed=0)
    model = model.to("cuda", torch.bfloat16)
    if torch.cuda.get_device_capability() < (8, 9):
        with pytest.raises(RuntimeError, match="cannot run on cuda"):
            fid.fp8_fidelity(model, tok, fid.PROMPTS[:2], recipe(), 2, 8)
        return
    out = fid.fp8_fidelity(model, tok, fid.PROMPTS[:4], recipe(), 2, 16)
    o = out["overall"]
    assert o["n_tokens"] == sum(b["n_tokens"] for b in out["bins"]) > 0
    assert 0.25 <= o["ratio_scaled_mm_over_emulated"] <= 4.0
    assert math.isfinite(o["max_abs_scaled_mm_minus_emulated"])
