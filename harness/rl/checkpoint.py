"""A run's state on disk: checkpoints (atomic, rotated, loaded weights-only), the RNG states,
the metric lines, resume, roll-back after a non-finite step, and the config contract (a rerun in
a run directory must use that run's config, or say `resume=override`).

One process writes `checkpoints/step_N.pt`; a sharded trainer (harness.base.distributed) writes the
folder `checkpoints/step_N/`: model and optimizer through torch.distributed.checkpoint (each rank
its shards), `state.pt` (step, objective, weight history, guard, rank 0's RNG) and `rng_R.pt`
per rank, into a hidden temp folder that rank 0 renames after every rank has written."""

from __future__ import annotations

import json
import math
import pickle
import random
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from harness.base import distributed
from harness.base.io import RefusedRerun, write_text_atomic
from harness.base.models import save_folder
from harness.runs.launch import checkpoints, read_json, update_meta
from harness.stats.diagnostics import collapse_guard

if TYPE_CHECKING:
    from harness.rl.setup import Setup


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


def save_sharded(run: Path, step: int, s: Setup, state: dict, keep: int, aborted: bool) -> Path:
    """`save_checkpoint` of a sharded trainer (every rank calls it): the model's and the
    optimizer's shards through torch.distributed.checkpoint, `state` (no model, no optimizer)
    by rank 0 and each rank's RNG, all into `.<name>.tmp/`, renamed by rank 0 once every rank
    has written (a barrier): a crash leaves a temp folder, never a folder read as complete."""
    import torch.distributed.checkpoint as dcp

    rank = torch.distributed.get_rank()
    d = run / "checkpoints"
    name = f"{'abort_' if aborted else ''}step_{step}"
    tmp, dest = d / f".{name}.tmp", d / name
    if rank == 0:
        d.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # a crashed save's
    distributed.barrier()
    dcp.save(sharded_state(s), checkpoint_id=tmp)
    torch.save({"rng": state["rng"]}, tmp / f"rng_{rank}.pt")
    if rank == 0:
        torch.save(
            {k: v for k, v in state.items() if k not in ("model", "optim")}, tmp / "state.pt"
        )
    distributed.barrier()
    if rank == 0:
        shutil.rmtree(dest, ignore_errors=True)
        tmp.replace(dest)
        if not aborted:
            for old in checkpoints(run)[keep:]:
                shutil.rmtree(old) if old.is_dir() else old.unlink()
    distributed.barrier()
    return dest


def sharded_state(s: Setup) -> dict:
    """The sharded trainer's model and optimizer state (this rank's shards)."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    model = s.policy.model
    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, s.opt)}


def load_sharded(path: Path, s: Setup) -> dict:
    """A sharded checkpoint into `s` (model and optimizer in place); returns `state.pt` with this
    rank's RNG. Everything is read weights-only: the shards by torch.distributed.checkpoint, its
    metadata through `SafeReader`, the rest by `load_checkpoint`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    state = sharded_state(s)
    dcp.load(state, storage_reader=SafeReader(path), planner=SafePlanner())
    set_model_state_dict(s.policy.model, state["model"])
    set_optimizer_state_dict(s.policy.model, s.opt, state["optim"])
    rank = torch.distributed.get_rank()
    return load_checkpoint(path / "state.pt") | load_checkpoint(path / f"rng_{rank}.pt")


# what torch.distributed.checkpoint's metadata file holds: its own dataclasses, sizes, dtypes
DCP_GLOBALS = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        ok = (module, name) in DCP_GLOBALS or module in (
            "torch.distributed.checkpoint.metadata",
            "torch.distributed.checkpoint.filesystem",
        )
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            ok = True
        if not ok:
            raise pickle.UnpicklingError(f"{module}.{name} is not checkpoint metadata")
        return super().find_class(module, name)


def _safe_reader():
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class SafeReader(FileSystemReader):
        """torch.distributed.checkpoint's reader whose metadata unpickler admits only the
        checkpoint's own dataclasses, sizes and dtypes (the stock one unpickles anything)."""

        def read_metadata(self, *args, **kwargs):
            path = Path(self.path) / ".metadata"
            try:
                with path.open("rb") as f:
                    md = _MetadataUnpickler(f).load()
            except pickle.UnpicklingError as e:
                raise RefusedCheckpoint(
                    f"refusing to load {path}: {e} (not a checkpoint this harness wrote; it "
                    "could run code when unpickled). Delete the folder or move it out of the run "
                    "directory."
                ) from e
            md.storage_meta = md.storage_meta or StorageMeta()
            md.storage_meta.load_id = self.load_id
            return md

    class SafePlanner(DefaultLoadPlanner):
        """Non-tensor entries (the optimizer's hyper-parameters) read weights-only."""

        def load_bytes(self, read_item, value) -> None:
            obj = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                from torch.distributed.checkpoint._nested_dict import set_element

                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    from torch.distributed.checkpoint.metadata import StorageMeta

    return SafeReader, SafePlanner


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


def refuse_lost_log(run_dir: Path) -> None:
    """A finished run (meta.json records its last step, written after its final checkpoint)
    with no checkpoint left, e.g. removed to free disk: a rerun would start afresh and erase its
    log, so refuse it before any compute. A run that died mid-write never recorded a last step
    and resumes or restarts as before."""
    meta = run_dir / "meta.json"
    last = json.loads(meta.read_text()).get("last_step") if meta.exists() else None
    if last is not None and not checkpoints(run_dir):
        raise RefusedRerun(
            f"{run_dir} holds a finished run (to step {last}) with no checkpoint left to resume "
            "from (were they removed?); starting afresh would erase its metrics.jsonl. To rerun "
            "it, move the folder aside or pass another out=; its summary, if made, is unaffected."
        )


def resume(s: Setup, run_dir: Path, metrics_path: Path, cfg: DictConfig) -> tuple[int, dict]:
    """(first step, guard state): from the newest checkpoint that loads (a damaged one is named
    in a warning and skipped), else a fresh start. The config's optimizer settings are applied
    to the restored optimizer (they equal the checkpoint's unless `resume=override`)."""
    for ck in checkpoints(run_dir):
        if ck.is_dir() != s.policy.sharded:
            raise ValueError(
                f"{ck} was written by a {'sharded' if ck.is_dir() else 'one-process'} trainer, "
                f"this run's is {'sharded' if s.policy.sharded else 'one process'}: resume with "
                "the world size and engine.fsdp the run started with, or use a new out= directory"
            )
        try:
            state = load_sharded(ck, s) if ck.is_dir() else load_checkpoint(ck)
        except RefusedCheckpoint:
            raise
        except Exception as e:  # truncated or corrupt: the previous one is still good
            print(
                f"[train] warning: checkpoint {ck} is damaged ({type(e).__name__}: "
                f"{str(e)[:120]}); trying the previous one",
                flush=True,
            )
            continue
        if not ck.is_dir():
            s.policy.model.load_state_dict(state["model"])
            s.opt.load_state_dict(state["optim"])
        for group in s.opt.param_groups:
            group.update(
                lr=cfg.optim.lr,
                betas=(cfg.optim.beta1, cfg.optim.beta2),
                weight_decay=cfg.optim.weight_decay,
            )
        s.objective.load_state_dict(state["objective"])
        s.history.load_state_dict(state["history"])
        set_rng_state(state["rng"])
        if distributed.rank() == 0:
            truncate_metrics(metrics_path, state["step"])
        print(f"[train] resumed from {ck} (step {state['step']})", flush=True)
        return state["step"] + 1, state["guard"]
    if distributed.rank() == 0:
        metrics_path.unlink(missing_ok=True)  # a fresh run: never append to a previous log
    return 1, collapse_guard()


# may change between attempts: the length, the display, the folder, the resume rule, the arm labels
RESUME_FREE = {"steps", "progress", "out", "resume", "arms", "logger", "log_every", "save_final"}


def config_contract(run_dir: Path, cfg: DictConfig) -> dict[str, list]:
    """The run directory's config.yaml is the contract: the keys a rerun changes, {key: [old,
    new]}; raises before any compute when some differ and `resume` is not "override", or when
    the folder's log outlived its checkpoints (`refuse_lost_log`)."""
    refuse_lost_log(run_dir)
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
        raise RefusedRerun(
            f"{run_dir} holds a run with a different config ({listing}). Resuming would mix "
            "two configs. Rerun with resume=override to apply the new values to the restored "
            "run (recorded in meta.json), or use a new out= directory."
        )
    return changed


def record_config(run_dir: Path, cfg: DictConfig, first: int, changed: dict[str, list]) -> None:
    """config.yaml, and under `resume=override` the keys `changed` with the step they govern
    from (meta.json's `config_overrides`, which analysis.runs reads per step). Called only when
    step `first` will run: the record says what the run trained under, not what a rerun asked."""
    write_text_atomic(run_dir / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
    if changed:
        past = read_json(run_dir / "meta.json").get("config_overrides", [])
        update_meta(run_dir, config_overrides=[*past, {"from_step": first, "changed": changed}])


def effective(flat: dict[str, Any]) -> dict[str, Any]:
    """A flattened config with what it leaves to defaults spelled out: the schema's defaults
    (harness.runs.config: a field added after a run started is the value that run used) and, for the
    swept-axis nodes, their builders' keyword defaults (a group file that stops restating a
    default changes nothing). Only defaults that are plain values are filled in."""
    import inspect

    from harness.noise import NOISE
    from harness.objectives import OBJECTIVES
    from harness.runs.config import schema
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
    if s.policy.sharded:
        distributed.load_full_state(s.policy.model, s.history.newest())
    else:
        s.policy.model.load_state_dict(s.history.newest())
    if hasattr(s.opt, "pull"):
        s.opt.pull()


def checkpoint_state(s: Setup, step: int, guard: dict) -> dict[str, Any]:
    """The run's state after `step`; a sharded trainer's model and optimizer are saved by
    `save_sharded`, not here."""
    sharded = s.policy.sharded
    return {
        "step": step,
        "model": None if sharded else s.policy.model.state_dict(),
        "optim": None if sharded else s.opt.state_dict(),
        "objective": s.objective.state_dict(),
        "history": s.history.state_dict(),
        "guard": guard,
        "rng": rng_state(),
    }


SafeReader, SafePlanner = _safe_reader()


def save(run_dir: Path, step: int, s: Setup, guard: dict, keep: int, aborted: bool = False) -> None:
    """Step `step`'s checkpoint: one file, or a folder of shards when the trainer is sharded."""
    state = checkpoint_state(s, step, guard)
    if s.policy.sharded:
        save_sharded(run_dir, step, s, state, keep, aborted=aborted)
    else:
        save_checkpoint(run_dir, step, state, keep, aborted=aborted)


def disk_bytes(path: Path) -> int:
    """A checkpoint's size on disk: a file, or a sharded run's folder."""
    return path.stat().st_size if path.is_file() else sum(f.stat().st_size for f in path.rglob("*"))


def end_line(run_dir: Path, last: dict, steps: int, first: int, wall_s: float) -> str:
    """The run's last words in a log: where it is, how far it got, its last numbers and the
    size of what resume reads (weights, optimizer state, the weight history of staleness)."""
    from harness.runs.tracking import plain_line

    if not last:  # resumed at its end: nothing ran
        return f"[train] {run_dir}: already at step {steps}; nothing to run"
    done = last["step"] - first + 1
    kept = checkpoints(run_dir)
    size = sum(disk_bytes(p) for p in kept) / 2**30
    return (
        f"[train] done {run_dir}: step {last['step']}/{steps} ({done} steps in "
        f"{wall_s:.0f} s); {len(kept)} checkpoint(s), {size:.2f} GiB; last step: "
        f"{plain_line(last, steps)}"
    )


def save_final(run_dir: Path, model: torch.nn.Module, tok) -> None:
    """`final/`, a Hugging Face folder of the trained weights (a rerun's replaces it), written
    beside it first so a crash while writing leaves no half folder under the name."""
    save_folder(model, tok, run_dir / "final.tmp-swap")
    shutil.rmtree(run_dir / "final", ignore_errors=True)
    (run_dir / "final.tmp-swap").rename(run_dir / "final")
