"""Peak memory of one policy update, over rows × tokens per row, with and without micro-batching
(engine.micro_batch_tokens) and activation checkpointing (engine.activation_checkpointing).

    python -m benchmarks.bench_memory                  # CPU, SmolLM2-135M, the default grid
    python -m benchmarks.bench_memory --device cuda --model smollm2-shaped --dtype bf16
    python -m benchmarks.bench_memory --device cuda --model smollm2-shaped --big   # a GPU's grid
    python -m benchmarks.bench_memory --table          # the per-model table from the CPU JSON

One point is one `harness.rl.step.update` — the loop's path at staleness 0 with one minibatch: the
training pass doubles as π_old, `ppo_clip` (ε 0.2/0.28) with token-mean aggregation, the loop's
AdamW (`harness.rl.step.adamw`: fused; fp32 master weights for a bf16 model), gradient-norm clip —
on a synthetic rollout of `rows` rows of `--prompt` prompt tokens and `tokens` response tokens
each (random ids, every row its own prompt so no prefix is shared, no padding; advantages ±1).
Sampling is not part of the update and is not run. Modes: `full` (one pass with grad over all
rows), `ckpt` (the same with activation checkpointing), `mb` (micro-batches of at most
`--micro-batch-tokens` prompt + response tokens), `mb+ckpt`.

What is measured. A warm-up update on one short row first allocates what every later update
reuses (AdamW's moments, lazily built buffers); its gradients are then released. The baseline is
the memory after that (runtime, weights, optimizer state); the peak is the highest memory during
the measured update; the figure reported is peak − baseline, what one update adds: gradients,
saved activations, logits and transient buffers.

- CPU: every point runs in a fresh subprocess, so no point inherits another's heap; `--jobs`
  of them at a time (each its own process and its own peak). Memory is the resident set (RSS):
  tracemalloc sees Python's allocator only, not torch's tensor storage. Linux's peak RSS (VmHWM,
  = getrusage's ru_maxrss) is reset to the current RSS right before the update by writing 5 to
  /proc/self/clear_refs, so the model's load (which peaks above the baseline) cannot hide the
  update's peak. glibc's malloc runs with a fixed mmap threshold (MALLOC_MMAP_THRESHOLD_=65536):
  every tensor of ≥ 64 KiB is its own mapping, returned to the OS when freed, so RSS follows the
  live tensors. With glibc's default (a threshold that rises to 32 MiB as large blocks are freed)
  freed tensors stay in the heap and the peak would add allocator slack that depends on the order
  of the frees. The baseline is read after malloc_trim(0).
- CUDA: the points run in this process, each on a fresh copy of the model:
  `torch.cuda.reset_peak_memory_stats` before the update, then `max_memory_allocated` minus the
  `memory_allocated` before it (the caching allocator's free reserved blocks are not counted).

Why gradients and activations do not simply add. A pass with grad keeps its activations A until
backward frees them layer by layer, while the parameter gradients G appear layer by layer; one
pass peaks near max(A, G) + the head's buffers. With micro-batches, G exists in full from the
first micro-batch's backward on, so every later micro-batch peaks at G + its own activations.
The peak of a micro-batched update is then G + the largest later micro-batch's activations +
the [rows, tokens] per-token tensors, and only the last grows with the rows. The growth target
compares updates whose micro-batches are alike: the default 128 tokens hold 2 rows of 16 + 32 or
1 row of 16 + 64 tokens, so 4 rows are 2 or 4 full micro-batches, as 64 rows are 32 or 64 of
them. (With 160 tokens, 4 rows of 48 tokens split 3 + 1, the second micro-batch a third of the
others, and the 4-row peak sits ~110 MB below the 16- and 64-row ones, which are equal.)

Reported: a table rows × tokens → MB per mode; the growth of the micro-batched modes' peak from
the fewest to the most rows at each token length (target ≤ 10%); and the bytes per token, from
the `full` and `ckpt` points, by least squares on

    peak − baseline = a + b · N + c · min(n, chunk)

N = rows × (prompt + tokens) positions through the decoder (saved activations per position), n =
rows × tokens scored positions (logits), chunk = the chunked log-softmax's positions per chunk
(1024): up to one chunk the fp32 [n, vocab] logits are held (the softmax kept for the backward),
beyond it one chunk at a time. The fit takes the points that are activation-bound (peak ≥ 1.25 G:
A dominates); with fewer than two such token counts it takes all points and says so (`bound`:
"gradients": b is then the growth of a gradient-bound peak, one recomputed layer and transients
for `ckpt`, not the asymptotic cost per position). c needs three activation-bound designs, else
it is left out (None). The JSON (rewritten after every point) holds every point, the fits, the
gradient bytes and the machine. `--table` turns the CPU fits into docs/gpu-and-clusters.md's
memory table for larger models (`memory_table`; the rule and its assumptions are there).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import copy
import ctypes
import datetime
import gc
import json
import math
import os
import platform
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import (
    CLIP,
    EPS_HIGH,
    EPS_LOW,
    LR,
    command,
    cpu,
    last_json,
    load,
    run_module,
    write_json,
)

MODES = {  # name → (micro-batching, activation checkpointing)
    "full": (False, False),
    "ckpt": (False, True),
    "mb": (True, False),
    "mb+ckpt": (True, True),
}
MODELS = ("smollm2-135m", "smollm2-shaped", "tiny-llama")
DEFAULT_OUT = {
    "cpu": "results/bench_memory/bench_memory_cpu.json",
    "cuda": "results/bench_memory/bench_memory_cuda.json",
}
DEFAULT_GRID = {"rows": "4,16,64", "tokens": "32,64"}
BIG_GRID = {"rows": "4,16,64,128", "tokens": "64,128,256,512"}
TARGET_GROWTH = 0.10  # the micro-batched peak may grow ≤ 10% from the fewest to the most rows
ACTIVATION_BOUND = 1.25  # a point is activation-bound when peak − baseline ≥ 1.25 × gradients
MB = 2**20
GIB = 2**30


def parse_ints(text: str, flag: str) -> list[int]:
    try:
        xs = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        xs = []
    if not xs or xs[0] < 1:
        raise SystemExit(f"{flag}={text!r}: expected comma-separated integers >= 1, e.g. 4,16,64")
    return xs


def parse_modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise SystemExit(f"--modes={text!r}: unknown {bad}; valid: {', '.join(MODES)}")
    return [m for m in MODES if m in modes]


# --- one point ---------------------------------------------------------------------------------


def load_as(name: str, layers: int, dtype: str, device: str):
    """(model `name` (`benchmarks.common.load`) on `device` in `dtype`, tokenizer)."""
    import torch

    from harness.base.models import resolve_dtype

    if name not in MODELS:
        raise SystemExit(f"--model={name!r}; valid: {', '.join(MODELS)}")
    model, tok = load(name, layers=layers)
    return model.to(device=torch.device(device), dtype=resolve_dtype(dtype)).eval(), tok


def synthetic_rollout(rows: int, tokens: int, prompt: int, vocab: int, device, seed: int = 0):
    """A rollout of `rows` rows, each its own random prompt of `prompt` tokens and `tokens`
    random response tokens (no padding), with a sampler log-prob per token; and its TokenBatch
    (advantages +1/−1 by row, π_old not yet scored: the update's pass supplies it)."""
    import torch

    from harness.base.batch import TokenBatch
    from harness.sampling.rollout import Rollout

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (rows, prompt + tokens), generator=g)  # 0..2: special ids
    ro = Rollout(
        prompt_ids=ids[:, :prompt].to(device),
        prompt_mask=torch.ones(rows, prompt, dtype=torch.long, device=device),
        response_ids=ids[:, prompt:].to(device),
        response_mask=torch.ones(rows, tokens, device=device),
        logp_mu=(-torch.rand(rows, tokens, generator=g) * 3 - 0.05).to(device),
        support=None,
        prompt_index=torch.arange(rows, device=device),
    )
    adv = (1.0 - 2.0 * (torch.arange(rows) % 2)).to(device)
    batch = TokenBatch(
        tokens=ro.response_ids,
        mask=ro.response_mask,
        logp_old=None,
        logp_mu=ro.logp_mu,
        advantages=adv[:, None] * ro.response_mask,
    )
    return ro, batch


class RssProbe:
    """CPU: this process's resident set (module docstring)."""

    def __init__(self) -> None:
        self.page = os.sysconf("SC_PAGE_SIZE")
        try:
            self._libc = ctypes.CDLL("libc.so.6")
        except OSError:
            self._libc = None
        self.hwm_reset = False

    def rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self.page

    def start(self) -> int:
        gc.collect()
        if self._libc is not None:
            self._libc.malloc_trim(0)  # freed heap pages back to the OS before the baseline
        base = self.rss()
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # peak RSS := current RSS (Linux ≥ 4.0)
            self.hwm_reset = True
        except OSError:
            self.hwm_reset = False  # ru_maxrss may then be an earlier, higher peak
        return base

    def peak(self) -> int:
        if self.hwm_reset:
            m = re.search(r"VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text())
            if m:
                return int(m.group(1)) * 1024
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux


class CudaProbe:
    def __init__(self, device) -> None:
        self.device = device
        self.hwm_reset = True

    def start(self) -> int:
        import torch

        gc.collect()
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        return torch.cuda.memory_allocated(self.device)

    def peak(self) -> int:
        import torch

        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device)


def run_point(
    model,
    tok,
    *,
    rows: int,
    tokens: int,
    prompt: int,
    micro_batch_tokens: int | None,
    checkpointing: bool,
    probe,
) -> dict:
    """One measured `harness.rl.step.update` of `model` after a warm-up update (the model is left
    with its gradients released): baseline and peak bytes, peak − baseline, seconds and the
    number of micro-batches."""
    import torch

    from harness.objectives import build_objective
    from harness.rl.step import Learner, StepOptions, adamw, update
    from harness.sampling.engines import Engine

    device = next(model.parameters()).device
    vocab = model.config.vocab_size
    policy = Engine(
        model, tok, micro_batch_tokens=micro_batch_tokens, activation_checkpointing=checkpointing
    )
    try:
        objective = build_objective(
            "ppo_clip", eps_low=EPS_LOW, eps_high=EPS_HIGH, aggregation="token-mean"
        )
        opt = adamw(model, lr=LR, betas=(0.9, 0.99))
        learner, options = Learner(policy=policy, opt=opt), StepOptions(grad_clip=CLIP)
        ro, batch = synthetic_rollout(1, 4, min(prompt, 4), vocab, device, seed=1)
        update(learner, objective, batch, ro, [(torch.arange(1), 0)], options)  # warm-up
        opt.zero_grad(set_to_none=True)
        ro, batch = synthetic_rollout(rows, tokens, prompt, vocab, device)
        parts = len(policy.micro_batches(ro, torch.arange(rows, device=device)))
        base = probe.start()
        t0 = time.perf_counter()
        _, metrics, skipped = update(
            learner, objective, batch, ro, [(torch.arange(rows), 0)], options
        )
        peak = probe.peak()
        seconds = time.perf_counter() - t0
        opt.zero_grad(set_to_none=True)
    finally:
        policy.close()
    if skipped or not metrics:
        raise RuntimeError("the measured update was skipped (non-finite loss or gradient)")
    return {
        "positions": rows * (prompt + tokens),
        "response_tokens": rows * tokens,
        "micro_batches": parts,
        "baseline_mb": base / MB,
        "peak_mb": peak / MB,
        "delta_mb": (peak - base) / MB,
        "update_s": seconds,
        "hwm_reset": probe.hwm_reset,
    }


def child(spec: dict) -> dict:
    """A CPU point in this (fresh) process."""
    import torch

    torch.set_num_threads(spec["threads"])
    torch.manual_seed(0)
    model, tok = load_as(spec["model"], spec["layers"], spec["dtype"], "cpu")
    return run_point(
        model,
        tok,
        rows=spec["rows"],
        tokens=spec["tokens"],
        prompt=spec["prompt"],
        micro_batch_tokens=spec["micro_batch_tokens"],
        checkpointing=spec["checkpointing"],
        probe=RssProbe(),
    )


def child_env(threads: int) -> dict:
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS=str(threads),
        MKL_NUM_THREADS=str(threads),
        MALLOC_MMAP_THRESHOLD_="65536",  # RSS follows the live tensors (module docstring)
        TOKENIZERS_PARALLELISM="false",
    )
    return env


def run_cpu_point(spec: dict, timeout: float) -> dict:
    """`child(spec)` in a fresh subprocess: its result, or {"error": why}."""
    try:
        p = run_module(
            "benchmarks.bench_memory",
            "--child",
            json.dumps(spec),
            timeout=timeout,
            env=child_env(spec["threads"]),
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s (--point-timeout)"}
    if p.returncode != 0:
        tail = " | ".join((p.stderr or p.stdout).strip().splitlines()[-3:])
        why = "killed (out of memory?)" if p.returncode in (-9, 137) else f"rc {p.returncode}"
        return {"error": f"{why}: {tail}"}
    return last_json(p.stdout)


# --- analysis ----------------------------------------------------------------------------------


def fit_bytes(points: list[dict], chunk: int, grad_bytes: float) -> dict | None:
    """Least squares of peak − baseline on (1, N, min(n, chunk)) in bytes (module docstring):
    `const_bytes` a, `bytes_per_position` b, `logit_bytes_per_response_token` c (None unless
    three activation-bound designs determine it); `bound` "activations" or "gradients"."""
    import numpy as np

    pts = [p for p in points if "delta_mb" in p]
    act = [p for p in pts if p["delta_mb"] * MB >= ACTIVATION_BOUND * grad_bytes]
    bound = "activations" if len({p["positions"] for p in act}) >= 2 else "gradients"
    use = act if bound == "activations" else pts
    if len({p["positions"] for p in use}) < 2:
        return None
    X = np.array([[1.0, p["positions"], min(p["response_tokens"], chunk)] for p in use])
    y = np.array([p["delta_mb"] * MB for p in use])
    cols = [0, 1, 2] if bound == "activations" and np.linalg.matrix_rank(X) == 3 else [0, 1]
    if len(use) == len(cols) == 3:  # an exact solve leaves no check of the model: drop c
        cols = [0, 1]
    coef, *_ = np.linalg.lstsq(X[:, cols], y, rcond=None)
    resid = y - X[:, cols] @ coef
    c = float(coef[2]) if 2 in cols else None
    return {
        "bound": bound,
        "const_bytes": float(coef[0]),
        "bytes_per_position": float(coef[1]),
        "logit_bytes_per_response_token": c,
        "max_abs_residual_mb": float(np.abs(resid).max() / MB),
        "points": [[p["rows"], p["tokens"]] for p in use],
    }


def growth(points: list[dict], mode: str) -> list[dict]:
    """Peak − baseline at the most rows over that at the fewest, per token length."""
    out = []
    for t in sorted({p["tokens"] for p in points if p["mode"] == mode}):
        sel = sorted(
            (p for p in points if p["mode"] == mode and p["tokens"] == t and "delta_mb" in p),
            key=lambda p: p["rows"],
        )
        if len(sel) < 2:
            continue
        lo, hi = sel[0], sel[-1]
        g = hi["delta_mb"] / lo["delta_mb"] - 1
        out.append(
            {
                "mode": mode,
                "tokens": t,
                "rows_from": lo["rows"],
                "rows_to": hi["rows"],
                "micro_batches_from": lo["micro_batches"],
                "micro_batches_to": hi["micro_batches"],
                "growth": g,
                "pass": g <= TARGET_GROWTH,
                # the same rows per micro-batch at both ends (else the fewer rows' last micro-batch
                # may be a partial one, and its peak below the bound the target is about)
                "alike": lo["rows"] * hi["micro_batches"] == hi["rows"] * lo["micro_batches"],
            }
        )
    return out


def report(points: list[dict], args, meta: dict) -> dict:
    import torch

    from harness.sampling.logprobs import DEFAULT_CHUNK

    grad_bytes = meta["params"] * {"fp32": 4, "bf16": 2}[args.dtype]
    fits = {
        m: fit_bytes([p for p in points if p["mode"] == m], DEFAULT_CHUNK, grad_bytes)
        for m in ("full", "ckpt")
    }
    return {
        "command": meta["command"],
        "date": meta["date"],
        "model": args.model,
        "dtype": args.dtype,
        "device": args.device,
        "micro_batch_tokens": args.micro_batch_tokens,
        "prompt": args.prompt,
        "chunk": DEFAULT_CHUNK,
        "threads": args.threads,
        "jobs": args.jobs,
        "model_config": meta["config"],
        "params": meta["params"],
        "grad_bytes": grad_bytes,
        "target_growth": TARGET_GROWTH,
        "fits": fits,
        "growth": [g for m in MODES for g in growth(points, m)],
        "points": sorted(
            points, key=lambda p: (list(MODES).index(p["mode"]), p["tokens"], p["rows"])
        ),
        "machine": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": __import__("transformers").__version__,
            "cpu": cpu(),
            "nproc": os.cpu_count(),
            "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else None,
        },
        "wall_s": meta.get("wall_s"),
    }


def format_grid(rep: dict) -> str:
    """One table per mode: rows × response tokens → peak − baseline in MB."""
    points = rep["points"]
    rows = sorted({p["rows"] for p in points})
    tokens = sorted({p["tokens"] for p in points})
    lines = []
    for mode in [m for m in MODES if any(p["mode"] == m for p in points)]:
        lines.append(
            f"\n{mode}: peak − baseline, MB (rows × response tokens; {rep['prompt']} "
            f"prompt tokens per row)"
        )
        lines.append(f"{'rows':>6} | " + " | ".join(f"{t:>7}" for t in tokens))
        for r in rows:
            cells = []
            for t in tokens:
                p = next(
                    (p for p in points if (p["mode"], p["rows"], p["tokens"]) == (mode, r, t)), None
                )
                cell = "—" if p is None else "error" if "error" in p else round(p["delta_mb"])
                cells.append(f"{cell:>7}")
            lines.append(f"{r:>6} | " + " | ".join(cells))
    return "\n".join(lines)


def format_summary(rep: dict) -> str:
    lines = [
        f"\ngrowth of peak − baseline from the fewest to the most rows (target ≤ "
        f"{rep['target_growth']:.0%} for the micro-batched modes, "
        f"{rep['micro_batch_tokens']}-token micro-batches):"
    ]
    for g in rep["growth"]:
        verdict = ("PASS" if g["pass"] else "FAIL") if g["mode"].startswith("mb") else "(no target)"
        lines.append(
            f"  {g['mode']:>8}, {g['tokens']:>4} tokens: {g['rows_from']} → {g['rows_to']} rows "
            f"({g['micro_batches_from']} → {g['micro_batches_to']} micro-batches) "
            f"{g['growth']:+8.1%}  {verdict}"
            + (
                ""
                if g["alike"] or not g["mode"].startswith("mb")
                else "  (micro-batches unlike: see the module docstring)"
            )
        )
    lines.append(f"bytes per token (gradients: {rep['grad_bytes'] / MB:.0f} MB):")
    for mode, f in rep["fits"].items():
        if f is None:
            lines.append(f"  {mode}: too few points for the fit")
            continue
        c = f["logit_bytes_per_response_token"]
        lines.append(
            f"  {mode}: {f['bytes_per_position'] / 1024:.1f} KiB per position"
            + (f", {c / 1024:.1f} KiB per scored token up to a chunk" if c is not None else "")
            + f", constant {f['const_bytes'] / MB:.0f} MB ({f['bound']}-bound fit of "
            f"{len(f['points'])} points, max |residual| {f['max_abs_residual_mb']:.0f} MB)"
        )
    return "\n".join(lines)


# --- the per-model table -----------------------------------------------------------------------

# Architectures from each model's card and config.json on the Hugging Face hub:
# HuggingFaceTB/SmolLM2-135M-Instruct (the measured reference), Qwen/Qwen2.5-0.5B-Instruct,
# Qwen/Qwen2.5-1.5B-Instruct, Qwen/Qwen2.5-7B-Instruct, Qwen/Qwen3-30B-A3B. q and kv: query and
# key/value widths (heads × head_dim); intermediate: the dense MLP width; for the MoE, `experts`
# routed experts per token of width `intermediate` (moe_intermediate_size) out of `n_experts`;
# qk_norm: RMSNorm on q and k (Qwen3). params: all parameters (a tied embedding counted once);
# active: per token.
ARCH = {
    "SmolLM2-135M": dict(layers=30, hidden=576, q=576, kv=192, intermediate=1536, vocab=49152,
                         params=134.5e6, active=134.5e6),
    "Qwen2.5-0.5B": dict(layers=24, hidden=896, q=896, kv=128, intermediate=4864, vocab=151936,
                         params=0.494e9, active=0.494e9),
    "Qwen2.5-1.5B": dict(layers=28, hidden=1536, q=1536, kv=256, intermediate=8960,
                         vocab=151936, params=1.54e9, active=1.54e9),
    "Qwen2.5-7B": dict(layers=28, hidden=3584, q=3584, kv=512, intermediate=18944, vocab=152064,
                       params=7.62e9, active=7.62e9),
    "Qwen3-30B-A3B": dict(layers=48, hidden=2048, q=4096, kv=512, intermediate=768, experts=8,
                          n_experts=128, qk_norm=True, vocab=151936, params=30.5e9,
                          active=3.3e9),
}  # fmt: skip
REFERENCE = "SmolLM2-135M"


def layer_width(a: dict) -> float:
    """Values a decoder layer saves for its backward, per position (`saved_layer_bytes`).

    Counted with torch.autograd.graph.saved_tensors_hooks on transformers' Llama, Qwen2 and
    Qwen3-MoE layers (SDPA attention, which saves no [S, S] scores): 6·hidden (the two RMSNorms'
    inputs, normalised values and outputs), 2·q + 2·kv (q and k around RoPE, v, the attention
    output), 4·intermediate (gate, up, SiLU(gate), their product); Qwen3's q/k norms add 2·q +
    2·kv; a MoE layer keeps per routed expert a copy of the token's hidden state and the expert's
    output (2·hidden) besides its 4·intermediate, and the router's logits."""
    attn = 6 * a["hidden"] + 2 * a["q"] + 2 * a["kv"]
    if a.get("qk_norm"):
        attn += 2 * a["q"] + 2 * a["kv"]
    k = a.get("experts")
    mlp = 4 * a["intermediate"] if k is None else k * (2 * a["hidden"] + 4 * a["intermediate"])
    return attn + mlp + a.get("n_experts", 0)


def saved_layer_bytes(a: dict, dtype_bytes: int) -> float:
    """Bytes per position per layer: `layer_width` values of `dtype_bytes`; in a 16-bit model the
    RMSNorms compute in fp32 and keep fp32 copies of their inputs (+ 2 bytes × 2 norms × hidden;
    the same hook count, bf16)."""
    extra = 2 * 2 * a["hidden"] if dtype_bytes == 2 else 0
    return layer_width(a) * dtype_bytes + extra


def per_position_bytes(fits: dict, a: dict, dtype_bytes: int, ref: dict, ref_bytes: int) -> dict:
    """Activation bytes per position of architecture `a` in `dtype_bytes`, from the reference's
    fits (measured in `ref_bytes`).

    full: κ · L · saved_layer_bytes(a), κ = the measured bytes per position over
    L_ref · saved_layer_bytes(ref) (κ ≥ 1: what the autograd hooks do not see — the embedding and
    final norm, backward transients, allocator rounding). ckpt: each layer keeps its input
    (L · hidden values) and one layer is recomputed at a time: L · hidden · bytes + κ_ckpt ·
    saved_layer_bytes(a), κ_ckpt = the measured ckpt slope (less the reference's L · hidden
    inputs when the fit is activation-bound) over saved_layer_bytes(ref), at least 1 (the
    recomputed layer's own activations)."""
    ref_layer = saved_layer_bytes(ref, ref_bytes)
    kappa = fits["full"]["bytes_per_position"] / (ref["layers"] * ref_layer)
    ck = fits["ckpt"]
    slope = ck["bytes_per_position"]
    if ck["bound"] == "activations":
        slope -= ref["layers"] * ref["hidden"] * ref_bytes
    kappa_ckpt = max(slope / ref_layer, 1.0)
    layer = saved_layer_bytes(a, dtype_bytes)
    return {
        "full": kappa * a["layers"] * layer,
        "ckpt": a["layers"] * a["hidden"] * dtype_bytes + kappa_ckpt * layer,
        "kappa": kappa,
        "kappa_ckpt": kappa_ckpt,
    }


def logit_bytes(fits: dict, a: dict, ref: dict, scored: int, chunk: int) -> float:
    """The head's memory in one pass: min(scored, chunk) fp32 vocabulary rows (c, measured, or
    two rows — the kept softmax and its gradient — when the fit has no c) scaled by vocab/vocab_ref,
    plus the fp32 [vocab, hidden] head gradient the chunked backward accumulates in."""
    c = fits["full"]["logit_bytes_per_response_token"]
    c = 2 * 4 * ref["vocab"] if c is None or c <= 0 else c
    return min(scored, chunk) * c * a["vocab"] / ref["vocab"] + 4 * a["vocab"] * a["hidden"]


def memory_table(
    rep: dict,
    rows: int = 32,
    tokens=(1024, 4096, 16384),
    gpu_gib: float = 80,
    reserve: float = 0.10,
    micro_tokens: int | None = None,
    max_ranks: int = 64,
    models: dict | None = None,
) -> list[dict]:
    """Memory per GPU of a bf16 trainer (fp32 master weights, AdamW) and its bf16 sampler copy at
    `rows` rows of `tokens` tokens each (prompt included), from a CPU fp32 bench_memory report
    `rep` (its `fits`). One dict per (model, tokens), in GiB:

    - weights 2P (bf16), master 4P, grads 2P (bf16), Adam 8P (two fp32 moments) —
      `harness.rl.step.MasterAdamW`; its step also makes an fp32 copy of the gradients (4P) after
      the activations are gone;
    - sampler 2P (its own bf16 copy) and its KV cache while it samples: 2 (k, v) · L · kv ·
      2 bytes per position, every row;
    - act_<mode>: activations of the update (`per_position_bytes`, bf16) for all rows (`full`,
      `ckpt`) or one micro-batch (`mb`, `mb+ckpt`: `micro_tokens`, at least one row), + the head
      (`logit_bytes`);
    - peak_<mode>: weights + master + grads + Adam + sampler + max(act, fp32 gradient copy, KV
      cache) — the update, the optimizer step and sampling are not simultaneous; gradients and
      activations are added (exact for ≥ 2 micro-batches, conservative for one pass);
    - fits_one: the modes whose peak ≤ (1 − `reserve`) · `gpu_gib` (the reserve: CUDA context,
      allocator fragmentation, communication buffers);
    - ranks: the smallest FSDP2 world size W (a power of two up to `max_ranks`) at which
      `mb+ckpt` fits: weights, master, grads and Adam divided by W; the sampler copy, its KV
      cache (⌈rows/W⌉ rows: each rank samples its share) and the activations per rank (one
      micro-batch, whatever the rows); plus two layers of
      bf16 weights and one layer of fp32 gradients in flight (all-gather, reduce-scatter; none
      at W = 1, a plain one-GPU run). None: no W fits (the unsharded sampler copy alone is too
      large); ranks_sampler_elsewhere: the same with the sampler on other GPUs (no sampler copy
      or KV cache on the trainer's ranks).
    """
    models = models or {k: v for k, v in ARCH.items() if k != REFERENCE}
    ref = ARCH[REFERENCE]
    ref_bytes = {"fp32": 4, "bf16": 2}[rep["dtype"]]
    chunk = rep["chunk"]
    usable = (1 - reserve) * gpu_gib * GIB
    out = []
    for name, a in models.items():
        P, L = a["params"], a["layers"]
        per = per_position_bytes(rep["fits"], a, 2, ref, ref_bytes)
        for T in tokens:
            mb = max(micro_tokens or T, T)

            def act(n_rows, ckpt, micro, T=T, mb=mb, per=per, a=a):
                pos = mb if micro else n_rows * T
                return pos * per["ckpt" if ckpt else "full"] + logit_bytes(
                    rep["fits"], a, ref, pos, chunk
                )

            def kv(n_rows, T=T, a=a):
                return n_rows * T * 2 * a["layers"] * a["kv"] * 2

            static = {"weights": 2 * P, "master": 4 * P, "grads": 2 * P, "adam": 8 * P}
            sampler = 2 * P
            acts = {m: act(rows, MODES[m][1], MODES[m][0]) for m in MODES}
            peaks = {
                m: sum(static.values()) + sampler + max(acts[m], 4 * P, kv(rows)) for m in MODES
            }
            in_flight = P / L * (2 * 2 + 4)

            def world(with_sampler, in_flight=in_flight, kv=kv, act=act, P=P, static=static):
                for w in (2**i for i in range(int(math.log2(max_ranks)) + 1)):
                    r = math.ceil(rows / w)
                    buffers = in_flight if w > 1 else 0.0  # one GPU: no FSDP, nothing gathered
                    samp = (2 * P, kv(r)) if with_sampler else (0.0, 0.0)
                    per_rank = samp[0] + buffers + max(act(r, True, True), 4 * P / w, samp[1])
                    if sum(static.values()) / w + per_rank <= usable:
                        return w
                return None

            out.append(
                {
                    "model": name,
                    "rows": rows,
                    "tokens": T,
                    "micro_tokens": mb,
                    **{k: v / GIB for k, v in static.items()},
                    "sampler": sampler / GIB,
                    "kv_cache": kv(rows) / GIB,
                    **{f"act_{m}": v / GIB for m, v in acts.items()},
                    **{f"peak_{m}": v / GIB for m, v in peaks.items()},
                    "fits_one": [m for m in MODES if peaks[m] <= usable],
                    "ranks": world(True),
                    "ranks_sampler_elsewhere": world(False),
                    "max_ranks": max_ranks,
                }
            )
    return out


def largest_micro_batch(
    rep: dict, model: str, gpu_gib: float = 80, reserve: float = 0.10, checkpointing: bool = False
) -> int | None:
    """The largest engine.micro_batch_tokens (a power of two) at which `model`'s update fits one
    GPU (`memory_table`'s accounting: static + sampler + max(one micro-batch's activations, the
    fp32 gradient copy) ≤ (1 − reserve) · gpu_gib); None if not even 1024 tokens fit."""
    a, ref = ARCH[model], ARCH[REFERENCE]
    per = per_position_bytes(rep["fits"], a, 2, ref, {"fp32": 4, "bf16": 2}[rep["dtype"]])
    per = per["ckpt" if checkpointing else "full"]
    room = (1 - reserve) * gpu_gib * GIB - 20 * a["params"]  # weights … Adam 16P, sampler 2P
    best = None
    m = 1024
    while m <= 2**24:
        act = m * per + logit_bytes(rep["fits"], a, ref, m, rep["chunk"])
        if max(act, 4 * a["params"]) > room:
            break
        best, m = m, 2 * m
    return best


def format_table(table: list[dict]) -> str:
    """Markdown of `memory_table`."""
    lines = [
        "| model | tokens/row | weights | master | grads | Adam | sampler (+ KV cache) | "
        "activations full / ckpt / mb / mb+ckpt | peak full / mb+ckpt | fits one GPU | "
        "FSDP2 ranks, mb+ckpt (sampler elsewhere) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in table:
        acts = " / ".join(f"{r[f'act_{m}']:,.1f}" for m in MODES)
        fits = ", ".join(r["fits_one"]) or "no"
        ranks = (
            " (".join(
                str(w) if w is not None else f"> {r['max_ranks']}"
                for w in (r["ranks"], r["ranks_sampler_elsewhere"])
            )
            + ")"
        )
        lines.append(
            f"| {r['model']} | {r['tokens'] // 1024}k | {r['weights']:.1f} | {r['master']:.1f} | "
            f"{r['grads']:.1f} | {r['adam']:.1f} | {r['sampler']:.1f} (+ {r['kv_cache']:.1f}) | "
            f"{acts} | {r['peak_full']:,.0f} / {r['peak_mb+ckpt']:,.0f} | {fits} | {ranks} |"
        )
    return "\n".join(lines)


# --- main --------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(
        description="Peak memory of one policy update (see the module docstring)."
    )
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--model", default="smollm2-135m", choices=MODELS)
    ap.add_argument("--layers", type=int, default=30, help="smollm2-shaped: its layers (30)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    ap.add_argument("--rows", default=None, help=f"rows per update ({DEFAULT_GRID['rows']})")
    ap.add_argument(
        "--tokens", default=None, help=f"response tokens per row ({DEFAULT_GRID['tokens']})"
    )
    ap.add_argument(
        "--big",
        action="store_true",
        help=f"the bigger grid: rows {BIG_GRID['rows']} × tokens {BIG_GRID['tokens']} (for a "
        "GPU: its largest one-pass point holds ~90 GB of fp32 activations, ~45 GB in bf16)",
    )
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens per row (16)")
    ap.add_argument(
        "--micro-batch-tokens",
        type=int,
        default=128,
        help="engine.micro_batch_tokens of the mb modes (128)",
    )
    ap.add_argument("--modes", default=",".join(MODES), help=f"a subset of {','.join(MODES)}")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per point (1)")
    ap.add_argument(
        "--jobs",
        type=int,
        default=min(2, os.cpu_count() or 1),
        help="CPU: points run at once, each in its own process (min(2, cores))",
    )
    ap.add_argument("--point-timeout", type=float, default=1800, help="seconds per CPU point")
    ap.add_argument("--out", default=None, help="the JSON (default results/bench_memory/...)")
    ap.add_argument(
        "--table",
        action="store_true",
        help="print the per-model table from the JSON (--out) and exit",
    )
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(json.loads(a.child))))
        return
    out = Path(a.out or DEFAULT_OUT[a.device])
    if a.table:
        if not out.exists():
            raise SystemExit(f"--table: {out} not found: run the benchmark first, or pass --out")
        rep = json.loads(out.read_text())
        ref, cfg = ARCH[REFERENCE], rep.get("model_config") or {}
        if (cfg.get("num_hidden_layers"), cfg.get("hidden_size")) != (ref["layers"], ref["hidden"]):
            raise SystemExit(
                f"--table: {out} is not of SmolLM2-135M's architecture (30 layers, "
                f"hidden 576), which the scaling rule is calibrated on"
            )
        if not (rep["fits"].get("full") and rep["fits"].get("ckpt")):
            raise SystemExit(
                f"--table: {out} has no full and ckpt fits: run both modes on "
                f"at least two row counts"
            )
        print(format_table(memory_table(rep)))
        print(
            "\nlargest engine.micro_batch_tokens (a power of two) that fits one 80 GB GPU, "
            "without / with activation checkpointing:"
        )
        for name in ARCH:
            if name != REFERENCE:
                sizes = [largest_micro_batch(rep, name, checkpointing=c) for c in (False, True)]
                print(f"  {name}: " + " / ".join(f"{s:,}" if s else "none" for s in sizes))
        return
    if a.big and (a.rows or a.tokens):
        raise SystemExit("--big sets --rows and --tokens: give either --big or those")
    for flag, v in (
        ("--prompt", a.prompt),
        ("--micro-batch-tokens", a.micro_batch_tokens),
        ("--threads", a.threads),
        ("--layers", a.layers),
        ("--jobs", a.jobs),
    ):
        if v < 1:
            raise SystemExit(f"{flag}={v}: must be >= 1")
    grid = BIG_GRID if a.big else DEFAULT_GRID
    rows = parse_ints(a.rows or grid["rows"], "--rows")
    tokens = parse_ints(a.tokens or grid["tokens"], "--tokens")
    modes = parse_modes(a.modes)
    import torch

    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
    if a.model == "smollm2-135m":
        from harness.base.models import smollm2_gguf_path

        try:
            smollm2_gguf_path()
        except FileNotFoundError as e:
            raise SystemExit(f"--model smollm2-135m: {e} (or use --model smollm2-shaped)") from None
    torch.set_num_threads(a.threads)
    base, tok = load_as(a.model, a.layers, "fp32", "cpu")
    meta = {
        "command": command(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "params": sum(p.numel() for p in base.parameters()),
        "config": {
            k: getattr(base.config, k, None)
            for k in (
                "num_hidden_layers",
                "hidden_size",
                "intermediate_size",
                "num_attention_heads",
                "num_key_value_heads",
                "vocab_size",
                "tie_word_embeddings",
            )
        },
    }
    if a.device == "cpu":
        del base  # each point loads its own copy in its own process
        gc.collect()
    # the largest points first: with --jobs 2 the long ones overlap, not the tail
    specs = sorted(
        ({"mode": m, "rows": r, "tokens": t} for m in modes for t in tokens for r in rows),
        key=lambda s: -s["rows"] * (a.prompt + s["tokens"]) * (1.5 if MODES[s["mode"]][0] else 1),
    )
    print(
        f"bench_memory: {a.model} ({meta['params'] / 1e6:.1f}M parameters, {a.dtype}) on "
        f"{a.device}: {len(specs)} points (modes {', '.join(modes)}; rows {rows}; response "
        f"tokens {tokens}; prompt {a.prompt}; micro-batch {a.micro_batch_tokens} tokens"
        + (f"; {a.jobs} at a time" if a.device == "cpu" else "")
        + ")",
        flush=True,
    )
    points: list[dict] = []
    t_all = time.perf_counter()

    def done(s: dict, res: dict, wall: float) -> None:
        point = {**s, **res, "wall_s": wall}
        points.append(point)
        if "error" in res:
            what = f"ERROR {res['error']}"
        else:
            n = res["micro_batches"]
            what = (
                f"+{res['delta_mb']:.0f} MB ({n} micro-batch{'es' if n > 1 else ''}, update "
                f"{res['update_s']:.0f} s)"
            )
        print(
            f"[{len(points)}/{len(specs)}] {s['mode']:>8} {s['rows']:>4} rows × "
            f"{s['tokens']:>4} tokens: {what}; {wall:.0f} s, "
            f"{time.perf_counter() - t_all:.0f} s in all",
            flush=True,
        )
        write_json(out, report(points, a, meta))

    def spec_of(s: dict) -> dict:
        micro, ckpt = MODES[s["mode"]]
        return {
            **s,
            "model": a.model,
            "layers": a.layers,
            "dtype": a.dtype,
            "prompt": a.prompt,
            "threads": a.threads,
            "checkpointing": ckpt,
            "micro_batch_tokens": a.micro_batch_tokens if micro else None,
        }

    if a.device == "cpu":

        def timed(s):
            t0 = time.perf_counter()
            return s, run_cpu_point(spec_of(s), a.point_timeout), time.perf_counter() - t0

        with concurrent.futures.ThreadPoolExecutor(a.jobs) as pool:
            for fut in concurrent.futures.as_completed([pool.submit(timed, s) for s in specs]):
                done(*fut.result())
    else:
        from harness.base.models import resolve_dtype

        dev = torch.device("cuda")
        for s in specs:
            spec = spec_of(s)
            t0 = time.perf_counter()
            model = copy.deepcopy(base).to(device=dev, dtype=resolve_dtype(a.dtype))
            try:
                res = run_point(
                    model,
                    tok,
                    rows=s["rows"],
                    tokens=s["tokens"],
                    prompt=a.prompt,
                    micro_batch_tokens=spec["micro_batch_tokens"],
                    checkpointing=spec["checkpointing"],
                    probe=CudaProbe(dev),
                )
            except torch.cuda.OutOfMemoryError as e:
                res = {"error": f"CUDA out of memory: {str(e).splitlines()[0]}"}
            del model
            gc.collect()
            torch.cuda.empty_cache()
            done(s, res, time.perf_counter() - t0)
    meta["wall_s"] = time.perf_counter() - t_all
    rep = report(points, a, meta)
    write_json(out, rep)
    print(format_grid(rep))
    print(format_summary(rep))
    print(f"\nwrote {out} ({meta['wall_s'] / 60:.1f} min)")
    if any("error" in p for p in points):
        sys.exit(1)


if __name__ == "__main__":
    main()
