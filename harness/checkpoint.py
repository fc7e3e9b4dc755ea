"""A run's state on disk: checkpoints (atomic, rotated, loaded weights-only), the RNG states,
the metric lines, resume, roll-back after a non-finite step, and the config contract (a rerun in
a run directory must use that run's config, or say `resume=override`)."""

from __future__ import annotations

import json
import math
import pickle
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from harness.diagnostics import collapse_guard
from harness.io import write_text_atomic

if TYPE_CHECKING:
    from harness.setup import Setup


def checkpoints(run: Path) -> list[Path]:
    """The run's regular checkpoints, newest first (abort checkpoints are not among them)."""
    return sorted((run / "checkpoints").glob("step_*.pt"), key=lambda p: -int(p.stem[5:]))


def save_checkpoint(run: Path, step: int, state: dict, keep: int, aborted: bool = False) -> Path:
    """Atomic (temp file + rename). Regular checkpoints are known good (saved only after a
    finite step) and rotate, `keep` of them; an abort checkpoint (`abort_step_N.pt`) records the
    state at the abort for inspection and is never resumed from."""
    d = run / "checkpoints"
    d.mkdir(parents=True, exist_ok=True)
    name = f"{'abort_' if aborted else ''}step_{step}.pt"
    tmp = d / f".{name}.tmp"
    torch.save(state, tmp)
    dest = d / name
    tmp.replace(dest)  # a crash leaves at most a .tmp file, never a torn checkpoint
    if not aborted:
        for old in checkpoints(run)[keep:]:
            old.unlink()
    return dest


def read_metrics(path: Path) -> list[dict]:
    """The metric lines of a run; a torn line (a crash mid-write) is dropped with a warning."""
    rows = []
    for i, ln in enumerate(path.read_text().splitlines() if path.exists() else [], 1):
        if not ln.strip():
            continue
        try:
            rows.append(json.loads(ln))
        except json.JSONDecodeError:
            print(f"[train] warning: {path}:{i} is not a complete JSON line; dropped", flush=True)
    return rows


def truncate_metrics(path: Path, last_step: int) -> None:
    """On resume, drop metric lines written after the checkpoint (they will be recomputed)."""
    if path.exists():
        keep = [r for r in read_metrics(path) if r.get("step", math.inf) <= last_step]
        write_text_atomic(path, "".join(json.dumps(r) + "\n" for r in keep))


def rng_state() -> dict:
    """The three RNG states as tensors and plain containers (weights_only-loadable)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss],
    }


def set_rng_state(s: dict) -> None:
    torch.set_rng_state(s["torch"])
    version, internal, gauss = s["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, gauss = s["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))


class RefusedCheckpoint(RuntimeError):
    pass


def load_checkpoint(path: Path) -> dict:
    """A checkpoint's state, unpickled with weights_only=True: tensors and plain containers
    only, so a planted file cannot run code; anything else is refused, naming the file."""
    try:
        # on the CPU: a checkpoint resumes on any device (load_state_dict copies onto the
        # parameters' device, the optimizer casts its state to them)
        return torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as e:
        raise RefusedCheckpoint(
            f"refusing to load {path}: it holds objects other than tensors and plain containers "
            "(not a checkpoint this harness wrote; it could run code when unpickled). Delete it "
            "or move it out of the run directory."
        ) from e


def resume(s: Setup, run_dir: Path, metrics_path: Path, cfg: DictConfig) -> tuple[int, dict]:
    """(first step, guard state): from the newest checkpoint that loads (a damaged one is named
    in a warning and skipped), else a fresh start. The config's optimizer settings are applied
    to the restored optimizer (they equal the checkpoint's unless `resume=override`)."""
    for ck in checkpoints(run_dir):
        try:
            state = load_checkpoint(ck)
        except RefusedCheckpoint:
            raise
        except Exception as e:  # truncated or corrupt: the previous one is still good
            print(f"[train] warning: checkpoint {ck} is damaged ({type(e).__name__}: "
                  f"{str(e)[:120]}); trying the previous one", flush=True)  # fmt: skip
            continue
        s.policy.model.load_state_dict(state["model"])
        s.opt.load_state_dict(state["optim"])
        for group in s.opt.param_groups:
            group.update(lr=cfg.optim.lr, betas=(cfg.optim.beta1, cfg.optim.beta2),
                         weight_decay=cfg.optim.weight_decay)  # fmt: skip
        s.objective.load_state_dict(state["objective"])
        s.history.load_state_dict(state["history"])
        set_rng_state(state["rng"])
        truncate_metrics(metrics_path, state["step"])
        print(f"[train] resumed from {ck} (step {state['step']})", flush=True)
        return state["step"] + 1, state["guard"]
    metrics_path.unlink(missing_ok=True)  # a fresh run: never append to a previous log
    return 1, collapse_guard()


# may change between attempts: the length, the display, the folder, the resume rule, the arm labels
RESUME_FREE = {"steps", "progress", "out", "resume", "arms"}


def config_contract(run_dir: Path, cfg: DictConfig) -> dict[str, list]:
    """The run directory's config.yaml is the contract: the keys a rerun changes, {key: [old,
    new]}; raises before any compute when some differ and `resume` is not "override"."""
    path = run_dir / "config.yaml"
    if not path.exists() or not checkpoints(run_dir):
        return {}
    old = effective(flatten(OmegaConf.to_container(OmegaConf.load(path), resolve=True)))
    new = effective(flatten(OmegaConf.to_container(cfg, resolve=True)))
    changed = {
        k: [old.get(k), new.get(k)]
        for k in sorted(set(old) | set(new))
        if k.split(".")[0] not in RESUME_FREE and old.get(k) != new.get(k)
    }
    if changed and cfg.resume != "override":
        listing = "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in changed.items())
        raise ValueError(
            f"{run_dir} holds a run with a different config ({listing}). Resuming would mix "
            "two configs. Rerun with resume=override to apply the new values to the restored "
            "run (recorded in meta.json), or use a new out= directory."
        )
    return changed


def effective(flat: dict[str, Any]) -> dict[str, Any]:
    """A flattened config with what it leaves to defaults spelled out: the schema's defaults
    (harness.config: a field added after a run started is the value that run used) and, for the
    swept-axis nodes, their builders' keyword defaults (a group file that stops restating a
    default changes nothing). Only defaults that are plain values are filled in."""
    import inspect

    from harness.config import schema
    from harness.noise import NOISE
    from harness.objectives import OBJECTIVES
    from harness.tasks import TASKS

    out = {**flatten(OmegaConf.to_container(schema(), resolve=False)), **flat}
    for node, registry in (("noise", NOISE), ("objective", OBJECTIVES), ("task", TASKS)):
        builder = registry.get(flat.get(f"{node}.name"))
        if builder is None:
            continue
        for k, p in inspect.signature(builder).parameters.items():
            plain = p.default is None or isinstance(p.default, (bool, int, float, str))
            if p.default is not inspect.Parameter.empty and plain:
                out.setdefault(f"{node}.{k}", p.default)
    return {k: v for k, v in out.items() if not (isinstance(v, str) and "${" in v)}


def flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def roll_back(s: Setup) -> None:
    """After a step that made a weight non-finite: the previous weights back (and, for a
    bf16/fp16 trainer, its fp32 master weights re-seeded from them)."""
    s.policy.model.load_state_dict(s.history.newest())
    if hasattr(s.opt, "pull"):
        s.opt.pull()


def checkpoint_state(s: Setup, step: int, guard: dict) -> dict[str, Any]:
    return {
        "step": step,
        "model": s.policy.model.state_dict(),
        "optim": s.opt.state_dict(),
        "objective": s.objective.state_dict(),
        "history": s.history.state_dict(),
        "guard": guard,
        "rng": rng_state(),
    }
