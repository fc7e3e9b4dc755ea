"""Engines: a model + dtype + noise + sampling parameters.

The same class plays both roles. As the *sampler* μ it generates with a KV cache and records,
per response token, `logp_mu` (log-prob under the law actually sampled from: temperature, top-k,
top-p, renormalised), and the kept support (for mask replay). As a *policy* (π_θ, π_old) it
scores a rollout's tokens in chunks of positions (`logp`: with or without grad, the one entry
point the loop, the measurement job and the benchmarks use). Without grad, `logp` scores in
micro-batches of at most `micro_batch_tokens` tokens; `activation_checkpointing` recomputes each
decoder layer in backward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from functools import cache

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint
from tqdm.auto import trange
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from harness.base import distributed
from harness.base.models import decoder_layers
from harness.noise import (
    NoiseModel,
    RoutingNoise,
    RoutingReplay,
    current,
    forward_context,
    position_ids,
    prefix_hash,
)
from harness.sampling import decode
from harness.sampling.logprobs import (
    DEFAULT_CHUNK,
    check_sampling,
    chunked_logp,
    chunked_stats,
    kept_support,
    process_logits,
    replay_mask,
)
from harness.sampling.rollout import (
    Rollout,
    Sampler,
    Sampling,
    check_request,
    copy_weights,
    encode_prompts,
    eos_ids,
)


def sample_rows(probs: Tensor, rows: Tensor, B: int, g: torch.Generator) -> Tensor:
    """One token per row of `probs` ([n, V], the rows `rows` of a [B, V] batch), drawn exactly as
    `torch.multinomial(p, 1, generator=g)` draws them for the whole batch: argmax(p / q) with
    q ~ Exp(1) of shape [B, V] (its one-sample path), so leaving finished rows out of the batch
    changes no live row's token. Checked against torch.multinomial in tests/test_engines.py."""
    q = torch.empty(B, probs.shape[1], dtype=probs.dtype, device=probs.device)
    q.exponential_(1, generator=g)
    return (probs / q[rows]).argmax(-1)


PRUNE_SHAPES = ((192, 576), (576, 192), (576, 1536), (1536, 576))  # (K, N) of the models' GEMMs


def prune_floor(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> int:
    """The fewest rows a pruned decode batch keeps; 0: never prune. A pruned batch is exact only
    when a GEMM gives a row the same bits at every batch size M it may shrink to. MKL does from
    M = 16 up with one thread and from M = 64 up with two (below, it switches kernels and the last
    bits move); other BLAS libraries, CPUs and GPUs need not, so the property is checked here once
    per (device, dtype, threads), and pruning is off wherever it fails."""
    return _prune_floor(torch.device(device), dtype, torch.get_num_threads())


@cache
def _prune_floor(device: torch.device, dtype: torch.dtype, threads: int) -> int:
    floor = 16 if threads == 1 else 64
    if gemm_rows_batch_invariant(floor, device, dtype):
        return floor
    print(
        f"[engines] GEMM rows change bits with the batch size on {device} ({dtype}, {threads} "
        "threads): finished rows stay in the decode batch (no pruning)",
        flush=True,
    )
    return 0


def gemm_rows_batch_invariant(floor: int, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether F.linear gives the first rows of a batch the same bits at M = floor, floor + 1,
    floor + 7 and 2·floor + 8 rows (`PRUNE_SHAPES`; about 1 ms)."""
    g = torch.Generator().manual_seed(0)
    M = 2 * floor + 8
    for K, N in PRUNE_SHAPES:
        x = torch.randn(M, K, generator=g).to(device, dtype)
        w = torch.randn(N, K, generator=g).to(device, dtype)
        full = torch.nn.functional.linear(x, w)
        for m in (floor, floor + 1, floor + 7):
            if not torch.equal(torch.nn.functional.linear(x[:m].contiguous(), w), full[:m]):
                return False
    return True


def keep_rows(live: Tensor, floor: int, padded: Tensor | None = None) -> Tensor:
    """[n] bool: the live rows, topped up with finished ones (the first) to `floor` rows, and
    with one left-padded row (of `padded`, [n] bool) when the batch had one: transformers drops
    the attention mask of a batch without padding and then runs another SDPA kernel, whose last
    bits differ (tests/test_engines.py)."""
    keep = live.clone()
    short = floor - int(keep.sum())
    if short > 0:
        keep[(~keep).nonzero()[:short, 0]] = True
    if padded is not None and bool(padded.any()) and not bool((keep & padded).any()):
        keep[padded.nonzero()[0, 0]] = True
    return keep


def gather_rows(x: Tensor, inv: Tensor) -> Tensor:
    """x[inv] along dim 0. GRPO groups (each prompt's rows adjacent, equal in number) take an
    expand, whose backward is a sum over the group: the same gradient bits as index_select's
    index_add, ~3× faster on the trainer's strided [B, heads, P, d] keys
    (benchmarks/bench_step.py)."""
    U, B = x.shape[0], inv.shape[0]
    n = B // U
    if B == U * n and torch.equal(inv, torch.arange(U, device=inv.device).repeat_interleave(n)):
        return x[:, None].expand(U, n, *x.shape[1:]).reshape(B, *x.shape[1:])
    return x.index_select(0, inv)


def micro_batches(n_tokens: Tensor, budget: int | None) -> list[slice]:
    """Consecutive runs of rows, in order, each holding at most `budget` tokens (`n_tokens` [b]:
    each row's prompt + response tokens, padding not counted), filled greedily; a row above the
    budget is a micro-batch alone. `budget` None: one run of all rows. Whole rows only, so a
    sequence-level quantity is never split."""
    if budget is None:
        return [slice(0, len(n_tokens))]
    parts, start, used = [], 0, 0
    for i, n in enumerate(n_tokens.tolist()):
        if i > start and used + n > budget:
            parts.append(slice(start, i))
            start, used = i, 0
        used += n
    parts.append(slice(start, len(n_tokens)))
    return parts


# --- activation checkpointing ----------------------------------------------------------------


def checkpoint_layers(model: nn.Module, context_fn: Callable) -> list[nn.Module]:
    """Recompute each decoder layer's activations in backward instead of keeping them
    (Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost"): a pass with grad keeps
    only each layer's input. torch.utils.checkpoint, non-reentrant, per layer, with `context_fn`
    (what the recomputation runs inside). The wrapper is an instance attribute that shadows the
    class's `forward`, as the FP8 trainer's linears are patched: take copies of the model before.
    Returns the wrapped layers (`uncheckpoint_layers` undoes it)."""
    layers = list(decoder_layers(model))
    for layer in layers:
        layer.forward = _checkpointed(layer.forward, context_fn)
    return layers


def uncheckpoint_layers(layers: list[nn.Module]) -> None:
    for layer in layers:
        del layer.forward  # the class's forward again


def _checkpointed(forward: Callable, context_fn: Callable) -> Callable:
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():  # no backward to recompute for: scoring, sampling
            return forward(*args, **kwargs)
        # a layer that wrote a KV cache would write it again when recomputed; the gradient
        # passes need none (as transformers' own checkpointing, the cache is dropped)
        for key in ("cache", "past_key_values"):
            if kwargs.get(key) is not None:
                kwargs[key] = None
        return checkpoint(forward, *args, use_reentrant=False, context_fn=context_fn, **kwargs)

    return run


@contextlib.contextmanager
def _as_in_forward(ctx, routes: list[tuple[RoutingReplay, Tensor | None]]):
    """Re-enter what a layer's forward saw: its forward context (prefix hashes and positions,
    which trainer-side noise keys on) and R3's replayed routes; both belong to one scoring call
    and are gone when backward recomputes the layer."""
    before = [(replay, replay.indices) for replay, _ in routes]
    for replay, indices in routes:
        replay.indices = indices
    try:
        if ctx is None:
            yield
        else:
            with forward_context(ctx.hash_BxS, ctx.batch_key, ctx.pos_BxS):
                yield
    finally:
        for replay, indices in before:
            replay.indices = indices


class Engine(Sampler):
    """`model` is used as given (dtype, attention implementation, attached noise).

    kv_cache=False decodes by full recompute at every step (the `kv` natural difference).
    `noise` models are attached to `model` for the engine's lifetime (`close()` detaches them);
    every forward runs inside a determinism context keyed by the token prefix, so deterministic
    noise is the same in prefill, KV-cache decode and re-scoring. `micro_batch_tokens`: `logp`
    without grad scores at most that many tokens at a time (`micro_batches`; None: all rows at
    once); `activation_checkpointing`: a pass with grad recomputes each decoder layer in
    backward (`checkpoint_layers`).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        noise: Sequence[NoiseModel] = (),
        kv_cache: bool = True,
        chunk: int = DEFAULT_CHUNK,
        micro_batch_tokens: int | None = None,
        activation_checkpointing: bool = False,
    ):
        self.model = model
        self.noise: list[NoiseModel] = []
        for n in noise:  # attach in order; on failure detach what was attached, in reverse
            try:
                n.attach(model)
            except BaseException:
                self.close()
                raise
            self.noise.append(n)
        self.tokenizer = tokenizer
        self.kv_cache = kv_cache
        self.chunk = chunk
        self.pad_id = tokenizer.pad_token_id
        self.device = next(model.parameters()).device  # every tensor it makes lives here
        self.eos_ids = eos_ids(model).to(self.device)
        self.max_len = getattr(model.config, "max_position_embeddings", None)
        self.micro_batch_tokens = micro_batch_tokens
        # a model sharded across ranks (harness.base.distributed.shard): every forward is a
        # collective, so every rank runs the same number of passes and decode steps
        self.sharded = distributed.sharded(model)
        self._checkpointed: list[nn.Module] = []
        if activation_checkpointing:
            try:
                self._checkpointed = checkpoint_layers(model, self._recompute_context)
            except ValueError as e:
                self.close()
                raise ValueError(f"engine.activation_checkpointing=true: {e}") from e

    # --- prompts ---------------------------------------------------------------------------

    def encode_prompts(self, prompts: list[str] | list[list[int]]) -> tuple[Tensor, Tensor]:
        ids, mask = encode_prompts(self.tokenizer, prompts)
        return ids.to(self.device), mask.to(self.device)

    # --- sampler ---------------------------------------------------------------------------

    def close(self) -> None:
        """Detach the checkpointing and the noise models (reverse order): the model is
        bit-identical to before."""
        uncheckpoint_layers(self._checkpointed)
        self._checkpointed = []
        while self.noise:
            self.noise.pop().detach()

    def _noise_of(self, kind: type) -> NoiseModel | None:
        return next((n for n in self.noise if isinstance(n, kind)), None)

    def _recompute_context(self):
        """torch.utils.checkpoint's `context_fn`, called as a checkpointed layer runs forward:
        its recomputation in backward runs as that forward did (`_as_in_forward`)."""
        routes = [(n, n.indices) for n in self.noise if isinstance(n, RoutingReplay)]
        return contextlib.nullcontext(), _as_in_forward(current(), routes)

    def micro_batches(self, ro: Rollout, rows: Tensor) -> list[slice]:
        """`micro_batches` of rows `rows` of `ro` under this engine's `micro_batch_tokens`."""
        if self.micro_batch_tokens is None:
            return [slice(0, len(rows))]
        return micro_batches(ro.attention_mask[rows].sum(1), self.micro_batch_tokens)

    def _next_logits(self, ids, attn, cache, hash_BxS) -> Tensor:
        pos = position_ids(attn)[:, -ids.shape[1] :]
        with forward_context(hash_BxS, pos_BxS=pos):
            out = self.model(
                input_ids=ids,
                attention_mask=attn,
                position_ids=pos,
                cache=cache,
                use_cache=cache is not None,
                logits_to_keep=1,
            )
        return out.logits[:, -1].float()

    @torch.no_grad()
    def sample(self, prompts, sampling: Sampling, seed, progress, batch_rows) -> Rollout:
        """`Sampler.generate` on this process's transformers model: a shared prompt prefill, the
        KV cache, finished rows dropped from the decode batch, β injected by the noise hooks."""
        n, max_new_tokens = sampling.n, sampling.max_new_tokens
        temperature, top_p, top_k = sampling.temperature, sampling.top_p, sampling.top_k
        check_sampling(temperature, top_k, top_p)
        ids, attn = self.encode_prompts(prompts)
        check_request(n, max_new_tokens, ids.shape[1], self.max_len)
        cache = DynamicCache() if self.kv_cache else None
        if n > 1 and cache is not None and self._row_local():
            # shared prompt prefill: each prompt once, then its KV cache and next-token logits
            # are repeated for its n samples (the same numbers a per-row prefill computes)
            h = prefix_hash(ids, attn)
            logits = self._next_logits(ids, attn, cache, h)
            rep = torch.arange(ids.shape[0], device=self.device).repeat_interleave(n)
            cache.reorder_cache(rep)
            logits, h, ids, attn = logits[rep], h[rep], ids[rep], attn[rep]
        else:
            ids, attn = ids.repeat_interleave(n, 0), attn.repeat_interleave(n, 0)
            h = prefix_hash(ids, attn)
            logits = self._next_logits(ids, attn, cache, h)
        prompt_ids, prompt_mask = ids, attn
        B = ids.shape[0]
        first, total = batch_rows or (0, B)
        lean = (
            decode.LeanDecoder(self.model, cache, attn, max_new_tokens)
            if self._can_decode_lean()
            else None
        )
        # the sampler's draws come from a generator on the engine's device (CPU and CUDA streams
        # differ: a seed fixes the draws per device, as the numerics are per device anyway)
        g = torch.Generator(self.device).manual_seed(seed)
        truncated = top_k > 0 or top_p < 1.0
        dev = self.device
        done = torch.zeros(B, dtype=torch.bool, device=dev)
        # rows still decoding: finished rows leave the decode batch when the noise allows it
        # (`_row_local`), never below `prune_floor()` rows; the same numbers either way (the
        # sampler's random draws are made for all B rows)
        live = torch.arange(B, device=dev)
        floor = prune_floor(dev, next(self.model.parameters()).dtype)
        prune = self._row_local() and floor > 0
        toks, mus, masks, sups = [], [], [], []
        # the law sampled from is the raw one when T = 1 and nothing is truncated: one log-softmax
        plain = temperature == 1.0 and not truncated
        for step in trange(max_new_tokens, desc="sampling", disable=not progress, leave=False):
            logp = (
                logits.log_softmax(-1)
                if plain
                else process_logits(logits, temperature, top_k, top_p)
            )
            # a NaN or +inf logit, or a row with no finite logit, makes the log-softmax NaN
            if bool(torch.isnan(logp).any()):
                raise FloatingPointError(
                    f"sampler: non-finite next-token distribution at decode step {step} (NaN or "
                    "no finite logit): the weights or the noise produced NaN/inf; not sampling"
                )
            tok_live = sample_rows(logp.exp(), first + live, total, g)
            tok = torch.full((B,), self.pad_id, dtype=torch.long, device=dev)
            tok[live] = tok_live
            tok = torch.where(done, self.pad_id, tok)
            toks.append(tok)
            masks.append(~done)
            mu = torch.zeros(B, dtype=logp.dtype, device=dev)
            mu[live] = logp.gather(1, tok_live[:, None])[:, 0]
            mus.append(mu)
            if truncated:
                kept = kept_support(logp)
                sup = torch.full((B, kept.shape[1]), -1, dtype=torch.long, device=dev)
                sup[live] = kept
                sups.append(sup)
            done = done | torch.isin(tok, self.eos_ids)
            if self._all_done(done) or step == max_new_tokens - 1:
                break
            if prune and len(live) > floor and bool(done[live].any()):
                padded = None if lean is not None else ~prompt_mask[live].bool().all(1)
                sel = keep_rows(~done[live], floor, padded).nonzero()[:, 0]
                live = live[sel]
                logits, attn, ids, h = logits[sel], attn[sel], ids[sel], h[sel]
                if lean is not None:
                    lean.keep(sel)
                elif cache is not None:
                    cache.reorder_cache(sel)
            tok_live = tok[live]  # the pad token for finished rows, as before
            if lean is not None:
                logits = lean.step(tok_live)
                continue
            attn = torch.cat([attn, attn.new_ones(len(tok_live), 1)], 1)
            ids = torch.cat([ids, tok_live[:, None]], 1)
            if cache is not None:
                h = prefix_hash(tok_live[:, None], prev=h[:, -1])
                logits = self._next_logits(tok_live[:, None], attn, cache, h)
            else:
                h = prefix_hash(ids, attn)
                logits = self._next_logits(ids, attn, cache, h)
        mask = torch.stack(masks, 1).float()
        support = None
        if truncated:
            K = max(s.shape[1] for s in sups)
            support = torch.stack(
                [torch.nn.functional.pad(s, (0, K - s.shape[1]), value=-1) for s in sups], 1
            )
            support[mask == 0] = -1
        return Rollout(
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            response_ids=torch.stack(toks, 1),
            response_mask=mask,
            # where, not *: after EOS the pad token can lie outside a truncated support (−inf)
            logp_mu=torch.where(mask.bool(), torch.stack(mus, 1), 0.0),
            support=support,
            prompt_index=torch.arange(len(prompts), device=dev).repeat_interleave(n),
            temperature=temperature,
            routing=router.take_record() if (router := self._noise_of(RoutingNoise)) else None,
        )

    def _all_done(self, done: Tensor) -> bool:
        """Every row finished; sharded, on every rank (the ranks decode in lockstep)."""
        return distributed.all_true(done.all()) if self.sharded else bool(done.all())

    # --- trainer ---------------------------------------------------------------------------

    def _row_local(self) -> bool:
        """Whether every attached noise model is row-local (`NoiseModel.row_local`: keyed by
        each token's prefix, or FP8 scaled per row or tile), so that a row's numbers do not depend
        on which rows share its batch. Then a shared prompt prefill (one per distinct prompt, KV
        cache repeated) computes the per-row numbers up to float rounding, and finished rows may
        leave the decode batch without changing the live rows' (tests/test_engines.py). Noise
        that keys on rows or the batch's shape (fresh noise, `batch`, routing records and
        replay, per-tensor activation scales) makes every row run in full."""
        return all(n.row_local for n in self.noise)

    def _can_decode_lean(self) -> bool:
        """The lean decode loop (harness/sampling/decode.py) runs the plain model's arithmetic:
        only with a KV cache, no noise attached and a model it reproduces exactly."""
        return self.kv_cache and not self.noise and decode.supports(self.model)

    def hidden_states(self, tokens: Tensor, attention_mask: Tensor, n_prompt: int) -> Tensor:
        """Final-norm hidden states at the positions predicting tokens[:, n_prompt:]: [B, T, H].

        Rows that share a prompt (GRPO groups) run the prompt once: a prefix forward over the
        distinct prompts, its KV cache gathered per row (differentiable), then the responses.
        Same values as the full forward up to float rounding; gradients flow through both."""
        hash_BxS = prefix_hash(tokens, attention_mask)
        pos = position_ids(attention_mask)
        decoder = self.model.get_decoder()
        groups = self._prompt_groups(tokens, attention_mask, n_prompt)
        if groups is None:
            with forward_context(hash_BxS, pos_BxS=pos):
                h = decoder(input_ids=tokens, attention_mask=attention_mask, position_ids=pos)
            return h.last_hidden_state[:, n_prompt - 1 : -1]
        first, inv = groups
        cache = DynamicCache()
        with forward_context(hash_BxS[first, :n_prompt], pos_BxS=pos[first, :n_prompt]):
            h_pre = decoder(
                input_ids=tokens[first, :n_prompt],
                attention_mask=attention_mask[first, :n_prompt],
                position_ids=pos[first, :n_prompt],
                cache=cache,
                use_cache=True,
            ).last_hidden_state
        for layer in cache.layers:  # each row's copy of its prompt's keys and values
            layer.keys, layer.values = gather_rows(layer.keys, inv), gather_rows(layer.values, inv)
        with forward_context(hash_BxS[:, n_prompt:], pos_BxS=pos[:, n_prompt:]):
            h_resp = decoder(
                input_ids=tokens[:, n_prompt:],
                attention_mask=attention_mask,
                position_ids=pos[:, n_prompt:],
                cache=cache,
                use_cache=True,
            ).last_hidden_state
        return torch.cat([h_pre[inv, -1:], h_resp[:, :-1]], 1)

    def _prompt_groups(
        self, tokens: Tensor, attention_mask: Tensor, n_prompt: int
    ) -> tuple[Tensor, Tensor] | None:
        """(one row index per distinct prompt [U], each row's prompt index [B]), or None when no
        two rows share a prompt (or sharing is off). Off too in a pass with grad under activation
        checkpointing (the shared prefix reaches the rows through a KV cache, which a recomputed
        layer cannot write again) or sharding (FSDP runs each layer's backward once per forward)."""
        if not self._row_local() or tokens.shape[0] < 2:
            return None
        if (self._checkpointed or self.sharded) and torch.is_grad_enabled():
            return None
        m = attention_mask[:, :n_prompt].long()
        key = torch.cat([tokens[:, :n_prompt] * m, m], 1)
        uniq, inv = torch.unique(key, dim=0, return_inverse=True)
        if uniq.shape[0] == tokens.shape[0]:
            return None
        first = torch.empty(uniq.shape[0], dtype=torch.long, device=tokens.device)
        first.scatter_(0, inv, torch.arange(tokens.shape[0], device=tokens.device))
        return first, inv

    @torch.no_grad()
    def score(
        self,
        tokens: Tensor,
        attention_mask: Tensor,
        n_prompt: int,
        temperature: float = 1.0,
        support: Tensor | None = None,
    ) -> dict[str, Tensor]:
        """Per response token ([B, T], T = tokens.shape[1] − n_prompt): `logp`, `entropy`, `p_t`,
        `p_sq_sum`, under the law softmax(z/T), restricted to `support` when given (mask replay).
        No grad; the fp32 log-softmax is computed `chunk` positions at a time."""
        if not 0 < n_prompt < tokens.shape[1]:
            raise ValueError(f"n_prompt={n_prompt} must be in (0, {tokens.shape[1]})")
        h = self.hidden_states(tokens, attention_mask, n_prompt)
        B, T, H = h.shape
        targets = tokens[:, n_prompt:].reshape(-1)
        keep = None
        if support is not None:
            vocab = self.model.config.vocab_size
            keep = replay_mask(support, tokens[:, n_prompt:], vocab).view(B * T, vocab)
        hash_BxT = prefix_hash(tokens, attention_mask)[:, n_prompt - 1 : -1]
        pos_BxT = position_ids(attention_mask)[:, n_prompt - 1 : -1]
        stats = chunked_stats(
            h.reshape(B * T, H),
            self.model.get_output_embeddings(),
            targets,
            temperature,
            keep,
            self.chunk,
            hash_N=hash_BxT.reshape(-1),
            pos_N=pos_BxT.reshape(-1),
        )
        return {k: v.view(B, T) for k, v in stats.items()}

    def logp(
        self,
        ro: Rollout,
        rows: Tensor | None = None,
        *,
        grad: bool = False,
        stats: bool = True,
        mask_replay: bool = False,
    ) -> dict[str, Tensor]:
        """This policy's log-probs of the rollout's tokens, rows `rows` (all by default): [b, T]
        `logp` (with grad when `grad`: the fused chunked log-softmax of harness.sampling.logprobs)
        and, with `stats`, the detached `p_t`, `entropy`, `p_sq_sum` of the same pass. The law is
        softmax(z/T) at the rollout's temperature, restricted to the sampler's top-k/top-p
        support with `mask_replay`. An engine with a `replay` noise model replays the sampler's
        routes of exactly these rows (R3), for this call only: any other forward of the model
        (evaluation, generation, another rollout's rows) routes by its own gate. Without grad the
        rows run in `micro_batches` (concatenated in `rows` order); a pass with grad is one, as
        given (harness.rl.step.update splits a minibatch and accumulates the gradient)."""
        rows = torch.arange(ro.response_ids.shape[0]) if rows is None else rows
        rows = rows.to(ro.response_ids.device)
        if grad:
            return self._logp_rows(ro, rows, True, stats, mask_replay)
        parts = self.micro_batches(ro, rows)
        outs = [
            self._logp_rows(ro, rows[p], False, stats, mask_replay) for p in parts if len(rows[p])
        ]
        self.idle_passes(ro, self.passes(len(outs)) - len(outs), grad=False)
        if not outs:  # a rank without rows in this minibatch
            keys = ("logp", "p_t", "entropy", "p_sq_sum") if stats else ("logp",)
            return {k: ro.logp_mu.new_zeros(0, ro.logp_mu.shape[1]) for k in keys}
        return outs[0] if len(outs) == 1 else {k: torch.cat([o[k] for o in outs]) for k in outs[0]}

    @torch.no_grad()
    def own_routes(self, ro: Rollout) -> Tensor:
        """The experts this model's own routers choose for the rollout's tokens (prompt and
        response positions, one no-grad forward of all rows, every rank once when sharded):
        [B, S, n_moe_layers, k], what R2 replays. R2 (vanilla routing replay, Zheng et al., "Group
        Sequence Policy Optimization", arXiv 2507.18071; verl `router_replay.mode=R2`) records the
        trainer's routes at π_old's weights and forces them on π_θ's passes: the minibatch
        updates move the gate weights but not which experts a token reaches. R3 replays μ's.
        Under this engine's own routing noise the routes are the noisy ones, and its record of
        sampled routes is left as it was (this forward samples nothing)."""
        # attached after any routing noise of the engine, so it sees the experts actually used;
        # σ = 0: records the routers' choice and changes nothing
        recorder = RoutingNoise(sigma=0.0)
        noisy = self._noise_of(RoutingNoise)
        tokens, attn = ro.tokens, ro.attention_mask
        pos = position_ids(attn)
        with recorder.attached(self.model), forward_context(prefix_hash(tokens, attn), pos_BxS=pos):
            self.model(input_ids=tokens, attention_mask=attn, position_ids=pos, logits_to_keep=1)
            routes = recorder.take_record()
        if noisy is not None:  # the forward reached its record too; between rollouts it is empty
            noisy.take_record()
        return routes

    def passes(self, n: int) -> int:
        """The number of passes every rank runs when this one needs `n` (sharded: the most any
        rank needs, since FSDP's collectives pair up pass by pass)."""
        return distributed.max_over_ranks(n) if self.sharded else n

    def idle_passes(self, ro: Rollout, n: int, grad: bool) -> None:
        """`n` passes on the rollout's first row that add nothing (a zero gradient with grad):
        a rank with fewer micro-batches than another keeps FSDP's collectives paired."""
        for _ in range(n):
            out = self._logp_rows(
                ro, torch.zeros(1, dtype=torch.long, device=self.device), grad, False, False
            )
            if grad:
                (out["logp"] * 0.0).sum().backward()

    def _logp_rows(
        self, ro: Rollout, rows: Tensor, grad: bool, stats: bool, mask_replay: bool
    ) -> dict[str, Tensor]:
        """One scoring call of rows `rows`, with R3's routes of these rows set for it only."""
        with self.replaying(ro, rows):
            return self._forward(self._logp, ro, rows, grad, stats, mask_replay)

    @contextlib.contextmanager
    def replaying(self, ro: Rollout, rows: Tensor | None = None):
        """Inside, this engine's routing replay (R3, or R2 once `ro.routing` holds the trainer's
        routes) forces the rollout's routes of rows `rows` (all by default); a no-op without one."""
        replay = self._noise_of(RoutingReplay)
        if replay is None:
            yield
            return
        if ro.routing is None:
            raise ValueError(
                "routing replay (R3) needs the sampler's routes: the sampler must carry "
                "`routing` noise (noise=routing) on an MoE model"
            )
        replay.set_indices(ro.routing if rows is None else ro.routing[rows])
        try:
            yield
        finally:
            replay.indices = None

    def _forward(self, fn: Callable, *args):
        """fn(*args); sharded, as a forward of the root, whose parameters (embeddings, head) the
        scoring reads outside any module's forward."""
        return self.model.run(fn, *args) if self.sharded else fn(*args)

    def _logp(
        self, ro: Rollout, rows: Tensor, grad: bool, stats: bool, mask_replay: bool
    ) -> dict[str, Tensor]:
        tokens, attn = ro.tokens[rows], ro.attention_mask[rows]
        support = ro.support[rows] if mask_replay and ro.support is not None else None
        if not grad:
            sc = self.score(tokens, attn, ro.n_prompt, ro.temperature, support)
            return sc if stats else {"logp": sc["logp"]}
        with torch.enable_grad():
            h = self.hidden_states(tokens, attn, ro.n_prompt)
            b, T, H = h.shape
            targets = tokens[:, ro.n_prompt :]
            keep = None
            if support is not None:
                vocab = self.model.config.vocab_size
                keep = replay_mask(support, targets, vocab).view(b * T, vocab)
            w = self.model.get_output_embeddings().weight
            out = chunked_logp(
                h.reshape(b * T, H),
                w,
                targets.reshape(-1),
                ro.temperature,
                keep,
                self.chunk,
                with_stats=stats,
            )
        if not stats:
            return {"logp": out.view(b, T)}
        return {"logp": out[0].view(b, T), **{k: v.view(b, T) for k, v in out[1].items()}}

    @torch.no_grad()
    def load_weights_from_state(self, state: dict[str, Tensor]) -> None:
        """Weight sync from a state dict (e.g. a version k steps old, for staleness); noise
        models then refresh (FP8 re-quantises the new weights)."""
        copy_weights(self.model, state)
        for n in self.noise:
            n.on_weight_sync()
