"""The `llama.cpp` bench method: plain greedy decoding of the same GGUF through llama-cpp-python,
the reference a CPU user would pick instead of us. An optional extra (`pip install
"medusa-decoding[llamacpp]"`, which builds llama.cpp from source in ~6-9 min on 2 cores).

It runs llama.cpp's own C API (llama_decode one token at a time, argmax of the last logits) on
the token ids our tokenizer made, with the threads torch uses, so both decode the same prompt
with the same cores. On a CPU with AMX, llama.cpp's default repack path for quantized weights
dies with SIGILL in some VMs: there the method loads the
model with `use_extra_bufts = False`, and says so.
"""

from __future__ import annotations

import ctypes
import logging
import time
from pathlib import Path

import numpy as np
import torch

from ..config import MedusaError
from ..models import BUILTIN_MODELS, builtin_gguf
from ..platform import cpu_info
from .records import Generate, Turn

log = logging.getLogger("medusa_decoding.bench")

INSTALL = 'pip install "medusa-decoding[llamacpp]" (builds llama.cpp from source, ~6-9 min)'
NAME = "llama.cpp"


def gguf_file(model: str) -> Path:
    """The GGUF behind a model name: a built-in alias or a .gguf path (an HF folder has none)."""
    if model in BUILTIN_MODELS:
        return builtin_gguf(model)
    path = Path(model).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return path
    raise MedusaError(f"method {NAME} decodes a GGUF file: pass --model FILE.gguf or a built-in alias, not {model!r}")


def _import():
    try:
        import llama_cpp
    except ImportError:
        raise MedusaError(f"method {NAME} needs llama-cpp-python: {INSTALL}") from None
    return llama_cpp


def amx_cpu() -> bool:
    return any(f.startswith("amx") for f in cpu_info()[1])


class LlamaCpp:
    """One llama.cpp model and context: greedy decoding of token ids."""

    def __init__(self, gguf: Path, n_ctx: int = 4096, threads: int | None = None, extra_bufts: bool | None = None):
        lib = self.lib = _import()
        lib.llama_log_set(_QUIET, ctypes.c_void_p())  # its loader prints hundreds of lines otherwise
        lib.llama_backend_init()
        params = lib.llama_model_default_params()
        self.extra_bufts = not amx_cpu() if extra_bufts is None else extra_bufts
        params.use_extra_bufts = self.extra_bufts
        self.model = lib.llama_model_load_from_file(str(gguf).encode(), params)
        if not self.model:
            raise MedusaError(f"llama.cpp could not load {gguf}")
        ctx = lib.llama_context_default_params()
        threads = threads or torch.get_num_threads()
        ctx.n_ctx, ctx.n_batch, ctx.n_threads, ctx.n_threads_batch = n_ctx, 512, threads, threads
        self.ctx = lib.llama_init_from_model(self.model, ctx)
        if not self.ctx:
            lib.llama_model_free(self.model)
            raise MedusaError(f"llama.cpp could not make a context of {n_ctx} tokens for {gguf}")
        vocab = lib.llama_model_get_vocab(self.model)
        self.vocab_size = lib.llama_vocab_n_tokens(vocab)
        self.n_ctx, self.threads = lib.llama_n_ctx(self.ctx), threads

    def _decode(self, tokens: list[int]) -> np.ndarray:
        """Feed tokens (in n_batch pieces) -> the logits after the last one [V]."""
        lib = self.lib
        for start in range(0, len(tokens), 512):
            piece = tokens[start:start + 512]
            array = (lib.llama_token * len(piece))(*piece)
            if lib.llama_decode(self.ctx, lib.llama_batch_get_one(array, len(piece))) != 0:
                raise MedusaError(f"llama.cpp could not decode {len(piece)} tokens")
        logits = lib.llama_get_logits_ith(self.ctx, -1)
        return np.ctypeslib.as_array(logits, shape=(self.vocab_size,))

    def greedy(self, input_ids: list[int], max_new_tokens: int, eos: set[int]) -> list[int]:
        """Plain greedy decoding -> the new tokens, up to and including the first EOS."""
        lib = self.lib
        lib.llama_memory_clear(lib.llama_get_memory(self.ctx), True)
        max_new_tokens = min(max_new_tokens, self.n_ctx - len(input_ids))
        if max_new_tokens < 1:
            raise MedusaError(f"the prompt has {len(input_ids)} tokens: no room in llama.cpp's {self.n_ctx}-token context")
        new = []
        logits = self._decode(input_ids)
        while True:
            token = int(logits.argmax())
            new.append(token)
            if token in eos or len(new) >= max_new_tokens:
                return new
            logits = self._decode([token])

    def close(self) -> None:
        if getattr(self, "ctx", None):
            self.lib.llama_free(self.ctx)
            self.ctx = None
        if getattr(self, "model", None):
            self.lib.llama_model_free(self.model)
            self.model = None

    def __del__(self):
        self.close()


@ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
def _QUIET(level, text, user_data):
    pass


def llamacpp_method(model, gguf: Path) -> Generate:
    """model: our MedusaModel on the same GGUF (its tokenizer makes the ids, its EOS ids stop)."""
    ctx = model.base.config.get_text_config().max_position_embeddings
    runner = LlamaCpp(gguf, n_ctx=min(ctx, 4096))
    if not runner.extra_bufts:
        log.info("llama.cpp: this CPU has AMX; its AMX repack path is off (use_extra_bufts=False), as it dies "
                 "with SIGILL on some AMX machines")
    if runner.vocab_size != model.base.config.get_text_config().vocab_size:
        raise MedusaError(f"{gguf.name}: llama.cpp sees {runner.vocab_size} tokens, our tokenizer "
                          f"{model.base.config.get_text_config().vocab_size}: not the same model")

    def generate(input_ids, max_new_tokens, seed):
        t0 = time.perf_counter()
        new = runner.greedy(input_ids[0].tolist(), max_new_tokens, model.eos_token_ids)
        wall = time.perf_counter() - t0
        return Turn(new, model.tokenizer.decode(new, skip_special_tokens=True), wall)

    return generate
