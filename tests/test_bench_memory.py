"""benchmarks/bench_memory.py: the per-point runner (a fresh subprocess, peak RSS over the update)
sees the activations grow with the rows; the bytes-per-token fit recovers known coefficients; the
per-model memory table's arithmetic on a hand-worked case."""

from __future__ import annotations

import concurrent.futures
from pathlib import Path

import pytest

from benchmarks import bench_memory as bm

MB, GIB = 2**20, 2**30


@pytest.mark.slow  # two subprocesses (~7 s on 2 idle cores)
@pytest.mark.skipif(
    not Path("/proc/self/clear_refs").exists(), reason="needs Linux's resettable peak RSS"
)
def test_point_peak_grows_with_rows_without_micro_batching():
    """tiny-llama keeps ~10 KiB per position for its backward: 4 → 64 rows of 8 + 64 tokens add
    ~4300 positions, ~40 MB, far above the few MB of a 4-row update."""
    base = dict(
        mode="full",
        model="tiny-llama",
        layers=2,
        dtype="fp32",
        prompt=8,
        tokens=64,
        threads=1,
        checkpointing=False,
        micro_batch_tokens=None,
    )
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        small, big = pool.map(lambda r: bm.run_cpu_point({**base, "rows": r}, timeout=300), (4, 64))
    for p in (small, big):
        assert "error" not in p, p
        assert p["hwm_reset"] and p["micro_batches"] == 1
        assert p["peak_mb"] >= p["baseline_mb"] + p["delta_mb"] - 1e-6
    assert (small["positions"], big["positions"]) == (4 * 72, 64 * 72)
    assert small["delta_mb"] < 15
    assert big["delta_mb"] > small["delta_mb"] + 25


def _points(mode, a, b, c, chunk, grad_mb=0.0):
    """Synthetic points on peak − baseline = max(a + b·N + c·min(n, chunk), gradients)."""
    out = []
    for rows in (4, 16, 64):
        for tokens in (32, 64, 128):
            N, n = rows * (16 + tokens), rows * tokens
            delta = max(a + b * N + c * min(n, chunk), grad_mb * MB)
            out.append(
                {
                    "mode": mode,
                    "rows": rows,
                    "tokens": tokens,
                    "positions": N,
                    "response_tokens": n,
                    "delta_mb": delta / MB,
                }
            )
    return out


def test_fit_recovers_bytes_per_position_and_logits():
    a, b, c = 300e6, 1.4e6, 0.4e6
    f = bm.fit_bytes(_points("full", a, b, c, 1024), 1024, grad_bytes=100e6)
    assert f["bound"] == "activations"
    assert f["const_bytes"] == pytest.approx(a, rel=1e-6)
    assert f["bytes_per_position"] == pytest.approx(b, rel=1e-9)
    assert f["logit_bytes_per_response_token"] == pytest.approx(c, rel=1e-6)
    # gradient-bound points (the peak is the gradients) are left out of the fit
    pts = _points("full", a, b, c, 1024, grad_mb=2000)
    f = bm.fit_bytes(pts, 1024, grad_bytes=2000 * MB)
    assert f["bound"] == "activations" and len(f["points"]) < len(pts)
    assert f["bytes_per_position"] == pytest.approx(b, rel=1e-6)
    # every point gradient-bound: fitted on all of them and flagged
    f = bm.fit_bytes(_points("ckpt", 0, 1e3, 0, 1024, grad_mb=500), 1024, grad_bytes=500 * MB)
    assert f["bound"] == "gradients" and f["logit_bytes_per_response_token"] is None


def test_growth_compares_the_fewest_and_the_most_rows():
    pts = [
        {"mode": "mb", "tokens": 32, "rows": r, "delta_mb": d, "micro_batches": m}
        for r, d, m in ((4, 100.0, 2), (16, 104.0, 8), (64, 109.0, 32))
    ]
    (g,) = bm.growth(pts, "mb")
    assert (g["rows_from"], g["rows_to"]) == (4, 64)
    assert g["growth"] == pytest.approx(0.09) and g["pass"] and g["alike"]
    pts[-1]["delta_mb"] = 111.0
    assert not bm.growth(pts, "mb")[0]["pass"]
    pts[0]["micro_batches"] = 2
    pts[-1]["micro_batches"] = 22  # 4 rows split 3 + 1, 64 rows into 22 of ≤ 3
    assert not bm.growth(pts, "mb")[0]["alike"]


def test_memory_table_hand_worked():
    """Model X: 2 layers, hidden 100, q 100, kv 50, intermediate 200, vocab 1000, 1e9 parameters;
    the reference's fits: 2× its hook count per position (κ = 2), a gradient-bound ckpt slope of 3
    layers (κ_ckpt = 3), two fp32 vocabulary rows per scored token.

    layer_width = 6·100 + 2·100 + 2·50 + 4·200 = 1700 values; bf16 bytes 2·1700 + 4·100 = 3800
    full per position 2 · 2 layers · 3800 = 15200 B; ckpt 2·100·2 + 3·3800 = 11800 B
    head: min(n, 1024) · 8·49152·(1000/49152) = 8000 B per scored token + 4·1000·100 = 400000 B
    2 rows × 1024 tokens: full 2048·15200 + 1024·8000 + 400000 = 39 721 600 B
    mb (one row, 1024 tokens): 1024·15200 + 1024·8000 + 400000 = 24 156 800 B
    mb+ckpt: 1024·11800 + 8 592 000 = 20 675 200 B
    static 16P = 16e9 B + sampler 2P = 2e9 B; the fp32 gradient copy 4P = 4e9 B outweighs the
    activations: every peak = 22e9 B = 20.49 GiB > 0.9 · 20 GiB = 19.33e9 B: none fits one GPU.
    FSDP2 W = 2: 16e9/2 + 2e9 (sampler) + 5e8·8 (in flight: 4e9) + max(20.7e6,
    4e9/2, KV 409600) = 16e9 B ≤ 19.33e9 B."""
    ref = bm.ARCH[bm.REFERENCE]
    ref_layer = bm.saved_layer_bytes(ref, 4)
    assert bm.layer_width(ref) == 11136 and ref_layer == 44544
    rep = {
        "dtype": "fp32",
        "chunk": 1024,
        "fits": {
            "full": {
                "bytes_per_position": 2 * 30 * ref_layer,
                "bound": "activations",
                "logit_bytes_per_response_token": 8 * 49152,
            },
            "ckpt": {
                "bytes_per_position": 3 * ref_layer,
                "bound": "gradients",
                "logit_bytes_per_response_token": None,
            },
        },
    }
    x = dict(
        layers=2, hidden=100, q=100, kv=50, intermediate=200, vocab=1000, params=1e9, active=1e9
    )
    assert bm.layer_width(x) == 1700 and bm.saved_layer_bytes(x, 2) == 3800
    (row,) = bm.memory_table(rep, rows=2, tokens=(1024,), gpu_gib=20, models={"X": x})
    assert row["act_full"] * GIB == pytest.approx(39_721_600)
    assert row["act_mb"] * GIB == pytest.approx(24_156_800)
    assert row["act_mb+ckpt"] * GIB == pytest.approx(20_675_200)
    assert row["act_ckpt"] * GIB == pytest.approx(2048 * 11800 + 8_592_000)
    assert row["kv_cache"] * GIB == pytest.approx(2 * 1024 * 2 * 2 * 50 * 2)
    assert (row["weights"], row["master"], row["grads"], row["adam"], row["sampler"]) == (
        pytest.approx(2e9 / GIB),
        pytest.approx(4e9 / GIB),
        pytest.approx(2e9 / GIB),
        pytest.approx(8e9 / GIB),
        pytest.approx(2e9 / GIB),
    )
    assert row["peak_full"] * GIB == pytest.approx(22e9)
    assert row["fits_one"] == [] and row["ranks"] == 2
    # on a 24 GiB GPU (21.6 GiB usable) every mode fits one GPU
    (row,) = bm.memory_table(rep, rows=2, tokens=(1024,), gpu_gib=24, models={"X": x})
    assert row["fits_one"] == list(bm.MODES) and row["ranks"] == 1
