"""Fingerprints that let an analysis check a pairing instead of assuming it.

Arms paired by seed must see the same step-1 batch (same prompts, same sampled tokens: the same
noise field and sampler numerics). A different CPU, thread count or torch build can change the
float summation order and with it the sampled tokens, silently unpairing the pair. Each run
records both in meta.json; analysis.summarize copies them into summary.csv (fp_batch,
fp_machine) and analysis.claims leaves out of the paired tests any pair whose fingerprints differ.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from harness.runs.launch import read_json, update_meta
from harness.tasks.warmstart import cpu_name


def digest(*parts: bytes) -> str:
    """A short hex SHA-256 of the parts, in order (12 hex digits: 48 bits)."""
    h = hashlib.sha256()
    for p in parts:
        h.update(len(p).to_bytes(8, "little") + p)  # length-prefixed: no two splits collide
    return h.hexdigest()[:12]


def batch_fingerprint(prompts: list[str], response_ids: Tensor, response_mask: Tensor) -> str:
    """The batch: its prompts and the sampled token ids (padding excluded, it is not sampled)."""
    ids = response_ids.masked_fill(response_mask == 0, -1).to(torch.int64).cpu().numpy()
    return digest(*(p.encode() for p in prompts), ids.tobytes())


def machine(world: int) -> dict[str, Any]:
    """What can change a run's floats: the CPU, the threads, the torch build, the world size
    (and the GPU where there is one); `hash` is the fingerprint of the rest."""
    fields = {
        "cpu": cpu_name(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "world": world,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }
    return fields | {"hash": digest(repr(sorted(fields.items())).encode())}


def record_machine(run: str | Path, first: int, world: int) -> None:
    """Append this start's machine to meta.json's `machines` (a resume may run elsewhere)."""
    past = read_json(Path(run) / "meta.json").get("machines", [])
    update_meta(run, machines=[*past, machine(world) | {"from_step": first}])


def record_batch(run: str | Path, prompts: list[str], ro) -> None:
    """meta.json's `batch_fingerprint`: step 1's batch (`ro`, a harness.sampling Rollout)."""
    update_meta(
        run, batch_fingerprint=batch_fingerprint(prompts, ro.response_ids, ro.response_mask)
    )
