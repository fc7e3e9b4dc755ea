"""Data parallelism across ranks: the process group, FSDP2 sharding of the trainer, full weights
for the sampler, and the reductions the loop needs.

    torchrun --nproc_per_node=N -m harness.train ...          # one node, N ranks

A rank samples its share of the step's prompts (whole groups, so group-normalised advantages are
exact) with its own sampler copy, scores them with the sharded trainer, and all-gathers the
per-token tensors: every rank then holds the global batch, runs the objective on the global
minibatch (every denominator, quantile, random draw and state is the one-rank run's) and
backpropagates its own rows of ∂L/∂logp; FSDP sums the ranks' gradients. World size 1 makes no
process group: the one-process code path, unchanged.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from harness.base.models import decoder_layers


@dataclass(frozen=True)
class Ranks:
    """This process's place in the job, and the contiguous share of a batch's groups it owns."""

    rank: int = 0
    world: int = 1

    def share(self, n: int) -> slice:
        """Items [lo, hi) of n (n divisible by the world size: validated before compute)."""
        k = n // self.world
        return slice(self.rank * k, (self.rank + 1) * k)

    def split(self, n: int) -> slice:
        """Items of n split as evenly as possible, the first n % world ranks one more (the
        evaluation set, whose size need not divide)."""
        k, extra = divmod(n, self.world)
        lo = self.rank * k + min(self.rank, extra)
        return slice(lo, lo + k + (self.rank < extra))


ONE = Ranks()


def environment() -> Ranks:
    """torchrun's RANK and WORLD_SIZE; under a Slurm job of more than one task without them,
    submitit's distributed environment (exported as torchrun's: RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR, MASTER_PORT); else one rank."""
    if "RANK" not in os.environ and int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        from submitit.helpers import TorchDistributedEnvironment

        TorchDistributedEnvironment().export()
    return Ranks(int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)))


def init(ranks: Ranks, device: torch.device, always: bool = False) -> torch.device:
    """The process group (gloo on the CPU, nccl on CUDA) when the world has more than one rank
    or `always`; returns this rank's device (cuda:LOCAL_RANK on CUDA)."""
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    if (ranks.world > 1 or always) and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        kw = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(backend, rank=ranks.rank, world_size=ranks.world, **kw)
    return device


def active() -> bool:
    return dist.is_available() and dist.is_initialized()


def close() -> None:
    """End the process group cleanly: once every rank is here (no collective of any rank is in
    flight), the garbage of the sharded trainer (FSDP's communication state, whose gloo work
    holds tensors) is freed while the interpreter is whole, then the group is destroyed. Freed
    later, during interpreter shutdown, that state aborts the process (SIGABRT: "terminate
    called without an active exception") after a run that finished: a failed job to Slurm."""
    if active():
        dist.barrier()
        gc.collect()
        dist.destroy_process_group()
        gc.collect()


# --- FSDP2 -------------------------------------------------------------------------------------


def shard(model: nn.Module, spec: str, compute_dtype: torch.dtype) -> nn.Module:
    """fully_shard each decoder layer, then the root (embeddings, final norm, head). fp32
    parameters are the master weights; a bf16/fp16 `compute_dtype` computes in it through a
    MixedPrecisionPolicy and reduces gradients in fp32. Gradients are reduced as a sum, not
    FSDP's default mean: each rank backpropagates its rows of the global loss's gradient, so
    the sum over ranks is the one-rank gradient. The root runs `run` (Engine's scoring) as a
    forward, so its parameters are gathered around the decoder call and the chunked head."""
    from torch.distributed.fsdp import (
        FSDPModule,
        MixedPrecisionPolicy,
        fully_shard,
        register_fsdp_forward_method,
    )

    try:
        layers = decoder_layers(model)
    except ValueError as e:
        raise ValueError(
            f"model.spec={spec!r}: FSDP2 shards per decoder layer, but {e}; valid: a causal LM "
            "with a decoder-layer list (Llama, Qwen2, Qwen3, Mixtral, Qwen3-MoE, ...)"
        ) from e
    mp = None
    if compute_dtype != torch.float32:
        mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    kw = {"mp_policy": mp} if mp is not None else {}
    for layer in layers:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no PREMUL_SUM)
    model.run = run.__get__(model)
    register_fsdp_forward_method(model, "run")
    return model


def run(self: nn.Module, fn, *args: Any, **kwargs: Any) -> Any:
    """fn(*args, **kwargs) as a forward of the sharded root: FSDP gathers the root's parameters
    before and hooks the outputs for backward (bound onto the root by `shard`)."""
    return fn(*args, **kwargs)


def sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def full_state(model: nn.Module) -> dict[str, Tensor]:
    """The full weights on every rank (the sampler's and the weight history's copy)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


def load_full_state(model: nn.Module, state: dict[str, Tensor]) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))


class FullView:
    """`model` as harness.rl.alpha.WeightHistory reads it: `state_dict()` gives full tensors."""

    def __init__(self, model: nn.Module):
        self.model = model

    def state_dict(self) -> dict[str, Tensor]:
        return full_state(self.model)


def local(t: Tensor) -> Tensor:
    """A DTensor's shard on this rank (a plain tensor as is)."""
    return t.to_local() if hasattr(t, "to_local") else t


def replicated(t: Tensor) -> Tensor:
    """A DTensor's full value (the total gradient norm); a plain tensor as is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


# --- reductions --------------------------------------------------------------------------------


def max_over_ranks(n: int) -> int:
    """max of an int over the ranks: the number of sharded-model passes every rank runs (FSDP's
    collectives pair up pass by pass)."""
    if not active():
        return n
    t = torch.tensor([n], dtype=torch.long, device=_comm_device())
    dist.all_reduce(t, dist.ReduceOp.MAX)
    return int(t)


def all_true(flag: bool | Tensor) -> bool:
    if not active():
        return bool(flag)
    t = torch.tensor([float(bool(flag))], device=_comm_device())
    dist.all_reduce(t, dist.ReduceOp.MIN)
    return bool(t)


def sum_over_ranks(x: Tensor) -> Tensor:
    if not active():
        return x
    x = x.detach().clone().to(_comm_device())
    dist.all_reduce(x)
    return x


def gather_rows(x: Tensor, width: int | None = None, fill: float = 0.0) -> Tensor:
    """[b, T_r] per rank (equal b) → [world·b, width] in rank order, each rank's columns padded
    with `fill` to `width` (default: the widest rank's)."""
    if not active():
        return x
    pad = x
    if x.dim() == 2:
        T = max_over_ranks(x.shape[1]) if width is None else width
        pad = torch.nn.functional.pad(x, (0, T - x.shape[1]), value=fill)
    pad = pad.contiguous().to(_comm_device())
    out = [torch.empty_like(pad) for _ in range(dist.get_world_size())]
    dist.all_gather(out, pad)
    return torch.cat(out).to(x.device)


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's `obj` (CPU tensors and plain containers), in rank order."""
    if not active():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, to_cpu(obj))
    return out


def barrier() -> None:
    if active():
        dist.barrier()


def _comm_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def gather_scores(
    out: dict[str, Tensor], local: Tensor, own: slice, rows: Tensor, width: int
) -> dict[str, Tensor]:
    """A rank's scores of its rows `local` (of its share `own` of the batch) → every rank's,
    as the minibatch `rows` (global row ids) in order, `width` tokens wide."""
    full = {}
    for k, v in out.items():
        buf = v.new_zeros(own.stop - own.start, width)
        buf[local, : v.shape[1]] = v
        full[k] = gather_rows(buf, width)[rows]
    return full


def to_cpu(x: Any) -> Any:
    """Tensors in nested lists, tuples, dicts and ObjectiveOutputs moved to the CPU (detached)."""
    if isinstance(x, Tensor):
        return x.detach().cpu()
    if isinstance(x, (list, tuple)):
        return type(x)(to_cpu(v) for v in x)
    if isinstance(x, dict):
        return {k: to_cpu(v) for k, v in x.items()}
    if hasattr(x, "loss") and hasattr(x, "metrics"):
        return type(x)(to_cpu(x.loss), x.metrics)
    return x


def rank() -> int:
    return dist.get_rank() if active() else 0
