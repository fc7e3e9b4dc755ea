"""Noise models: controlled engine noise β injected into the sampler μ. The observed
sampler/trainer log-ratio is α (policy movement) + β (the SNR post, §1).

Registry `NOISE` (name -> class; kwargs are the constructor's, checked at build time):
  layer    LayerNoise(sigma=2e-3, layers=None, inject_at=None, mode="norm", seed=0,
           deterministic=True)                          relative residual-stream noise
  logit    LogitNoise(sigma=0.1, nu=None, seed=0, deterministic=True)   Gaussian / Student-t
  position PositionNoise(sigma=0.1, length=32, power=1, nu=None, seed=0, deterministic=True)
           logit noise of scale sigma·(1 + p/length)^power at absolute position p
  fp8      Fp8Noise(fmt="e4m3", granularity="tensor", weights=True, activations=False, ...,
           kernel="emulated")   fake-quant FP8, or kernel="scaled_mm": the real FP8 GEMM
  routing  RoutingNoise(sigma=0.1, seed=0, deterministic=True)   MoE router noise + record
  replay   RoutingReplay(indices=None)                   R3 replay for the trainer
  batch    BatchNoise(sigma=1e-3, key="rows", layers=None, mode="norm", seed=0)
`precision`, `kv` and `attention` differences are engine settings (harness/sampling/engines.py),
not here.

Engine contract
  noise = build_noise(name, **kwargs)   # KeyError (valid names) / TypeError (valid kwargs)
  noise.attach(model) ... noise.detach()  or  `with noise.attached(model): ...`
      detach leaves the model bit-identical (hooks removed, FP8 weight swaps restored).
      Several compose: `Engine(model, tok, noise=[fp8, routing])` attaches them in order and
      `close()` detaches them in reverse.
  noise.on_weight_sync()                # after copying new weights into the sampler; FP8
                                        # re-quantises from them, the others do nothing
  Every sampler forward runs inside the determinism context:
      h = prefix_hash(ids_BxS, mask_BxS)              # prefill
      with forward_context(h): model(ids_BxS, attention_mask=..., past_key_values=cache)
      h1 = prefix_hash(new_ids_Bx1, prev=h[:, -1])    # each decode step
      with forward_context(h1): model(new_ids_Bx1, ...)
  Outside a context the hashes come from the call's own input_ids/attention_mask (full-sequence
  forwards stay deterministic; a plain decode step would hash only its own token).
  Deterministic noise is a function of (seed, layer, prefix hash): the same context gets the
  same perturbation in prefill and KV-cache decode; `deterministic=False` draws fresh noise.
  Routing: sampler `routing.take_record()` → [B, S_total, n_moe_layers, k] (prefill + decode
  steps appended along S); trainer `build_noise("replay", indices=rec)` (or `.set_indices`).
  A record shorter than the scored sequence is fine (the rest routes normally).
  `batch` reads `forward_context(h, batch_key=...)` if given, else keys on the batch shape.
  `position` reads `forward_context(h, pos_BxS=position_ids(mask))` (real tokens only; the
  engine passes them); without them, from an enclosing context by prefix hash, else from the
  model call's position_ids / attention_mask / cache length.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from harness.base.registry import build, register
from harness.noise.base import NoiseModel
from harness.noise.batch import BatchNoise
from harness.noise.context import (
    ForwardContext,
    current,
    forward_context,
    position_ids,
    prefix_hash,
)
from harness.noise.fp8 import Fp8Noise, Fp8Trainer, fp8_qdq
from harness.noise.layer import LayerNoise, layer_amplification
from harness.noise.logit import LogitNoise
from harness.noise.position import PositionNoise
from harness.noise.routing import RoutingNoise, RoutingReplay

NOISE: dict[str, Callable[..., NoiseModel]] = {}
register(NOISE, "layer")(LayerNoise)
register(NOISE, "logit")(LogitNoise)
register(NOISE, "position")(PositionNoise)
register(NOISE, "fp8")(Fp8Noise)
register(NOISE, "routing")(RoutingNoise)
register(NOISE, "replay")(RoutingReplay)
register(NOISE, "batch")(BatchNoise)


def build_noise(name: str, **kwargs: Any) -> NoiseModel:
    """Build a registered noise model; typos fail here with the valid names."""
    return build(NOISE, name, "noise", **kwargs)


__all__ = [
    "NOISE",
    "build_noise",
    "NoiseModel",
    "ForwardContext",
    "current",
    "forward_context",
    "position_ids",
    "prefix_hash",
    "Fp8Trainer",
    "fp8_qdq",
    "layer_amplification",
    "LayerNoise",
    "LogitNoise",
    "PositionNoise",
    "Fp8Noise",
    "RoutingNoise",
    "RoutingReplay",
    "BatchNoise",
]
