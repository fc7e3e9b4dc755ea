"""Forward + backward time of every objective on a [B, T] batch (target: ≤ 50 ms at 64×512).

    python -m benchmarks.bench_objectives [--batch 64] [--tokens 512] [--vocab 1024] [--reps 30]

Writes results/bench/objectives.json (min/median/max per objective).

Policy objectives take logp [B, T]; opsd_fkl takes student logits [B, T, V] and the teacher's,
either full (top-128 taken here: topk dominates) or as an engine's top-128 capture, so its time
grows with --vocab. calibrated_clip's shadow-pass `calibrate` is timed separately (it runs every
K steps, not every step). Default 1 thread: CPU time is reported next to wall time because the
machine may be shared.
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.common import command, parse_args, spread, write_json
from harness.base.batch import TokenBatch
from harness.objectives import OBJECTIVES, build_objective


def make_batch(B: int, T: int, g: torch.Generator) -> tuple[torch.Tensor, TokenBatch]:
    logp_old = torch.log(torch.rand(B, T, generator=g) * 0.98 + 0.01)
    logp_mu = logp_old + 0.1 * torch.randn(B, T, generator=g)
    logp = logp_old + 0.2 * torch.randn(B, T, generator=g)
    mask = (torch.arange(T) < torch.randint(T // 4, T + 1, (B, 1), generator=g)).float()
    adv = torch.randn(B, 1, generator=g).expand(B, T).contiguous()
    batch = TokenBatch(
        tokens=torch.zeros(B, T, dtype=torch.long),
        mask=mask,
        logp_old=logp_old,
        logp_mu=logp_mu,
        advantages=adv,
        p_t=logp_old.exp(),
        entropy=2 * torch.rand(B, T, generator=g),
    )
    return logp, batch


def time_ms(fn, reps: int) -> dict[str, dict[str, float]]:
    """min/median/max milliseconds, wall and CPU (CPU is the fairer number on a shared machine)."""
    for _ in range(3):
        fn()
    wall, cpu = [], []
    for _ in range(reps):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall.append((time.perf_counter() - t0) * 1e3)
        cpu.append((time.process_time() - c0) * 1e3)
    return {"wall_ms": spread(wall), "cpu_ms": spread(cpu)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="results/bench/objectives.json")
    args = parse_args(ap)
    g = torch.Generator().manual_seed(0)
    B, T = args.batch, args.tokens
    logp0, batch = make_batch(B, T, g)
    print(f"[{B}, {T}] batch, {torch.get_num_threads()} thread(s), {args.reps} reps")
    print(f"{'objective':36s} {'wall ms median':>14s} {'cpu ms min / median / max':>26s}")

    def policy_step(obj):
        logp = logp0.clone().requires_grad_()
        obj(logp, batch).loss.backward()

    rows = {}
    for name in sorted(set(OBJECTIVES) - {"opsd_fkl"}):
        obj = build_objective(name)
        rows[name] = time_ms(lambda: policy_step(obj), args.reps)  # noqa: B023 (called now)

    teacher = torch.randn(B, T, args.vocab, generator=g)
    student = (teacher + torch.randn(B, T, args.vocab, generator=g)).requires_grad_()
    opsd = build_objective("opsd_fkl")

    top_logits, top_ids = teacher.topk(128, dim=-1)

    def opsd_step(captured: bool):
        student.grad = None
        if captured:  # the engine returned the teacher's top-128
            out = opsd(student, top_logits, batch.mask, teacher_ids=top_ids)
        else:  # top-128 computed here from full teacher logits
            out = opsd(student, teacher, batch.mask)
        out.loss.backward()

    rows[f"opsd_fkl (V={args.vocab}, top-k here)"] = time_ms(lambda: opsd_step(False), args.reps)
    rows[f"opsd_fkl (V={args.vocab}, captured)"] = time_ms(lambda: opsd_step(True), args.reps)
    cc = build_objective("calibrated_clip")
    shadow = (logp0, batch.logp_old, logp0 + 0.01, batch.logp_old, batch.advantages, batch.mask)
    rows["calibrated_clip.calibrate"] = time_ms(lambda: cc.calibrate(*shadow), args.reps)
    for name, t in rows.items():
        c = t["cpu_ms"]
        verdict = "ok" if c["median"] <= 50 else "over 50 ms"
        print(
            f"{name:36s} {t['wall_ms']['median']:14.2f} "
            f"{c['min']:8.2f} / {c['median']:6.2f} / {c['max']:6.2f}  {verdict}"
        )
    report = {"command": command(), "batch": [B, T], "threads": args.threads, "reps": args.reps}
    print(f"wrote {write_json(args.out, {**report, 'objectives': rows})}")


if __name__ == "__main__":
    main()
