"""Kernels below models and verifiers: the short-query attention (attention.py), linears on
prepacked oneDNN weights (packed.py) and on a GGUF's own blocks (blocks.py, blocks.cpp)."""

from __future__ import annotations

from ..config import Numerics
from .blocks import BlockKind, block_linears
from .packed import pack_linears


def lean_linears(model, numerics: Numerics = Numerics.FP32):
    """The model with its linear layers on a leaner form of the same weights, where that is exact
    here: prepacked for oneDNN in bf16/fp16 (packed.py), on the GGUF's own blocks in fp32
    (blocks.py, in `numerics`); else `model` itself."""
    out = pack_linears(model)
    return out if out is not model else block_linears(model, numerics=numerics)


def draft_linears(drafter):
    """A drafter's module on lean linears: as lean_linears, and in fp32 on CPU with its own weights
    (not a GGUF's) quantized to Q8_0 blocks. A drafter's weights change what it proposes, never the
    output, which the base verifies; in fp32 its layers read 4 bytes a weight a step, in Q8_0 1.06."""
    out = pack_linears(drafter)
    return out if out is not drafter else block_linears(drafter, lossy=BlockKind.Q8_0)
