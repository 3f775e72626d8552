"""The base's linear layers on the GGUF's own blocks, for the eager step in fp32 on CPU.

A model loaded from a GGUF file is dequantized to fp32: a Q4_1 weight is fl(fl(d q) + m) for 4-bit
codes q and fp16 block scales d and mins m (blocks of 32 along the input), a Q8_0 weight fl(d q) for
8-bit codes. An fp32 step then reads 4 bytes a weight where the file held 0.5 or 1, and on a CPU
without bf16 hardware (AVX2 only) that is the whole step: the built-in SmolLM2's linears read 540 MB
of fp32 a token. `recover` finds the codes and scales back from the fp32 values, and keeps a layer
only where fl(fl(d q) + m) gives every fp32 weight back bit for bit; `blocks.cpp` multiplies on
the blocks (dequantizing 16 output rows at a time into a small buffer; on an AVX-512 CPU, up to 8
input rows take the weights straight from registers, 4 panels side by side), so the layer computes
with the model's own weights, only read in a fifth of the bytes. The AVX2 and AVX-512 builds give
the same bits (`tests/test_blocks.py` builds both where it can). On a CPU with AMX tiles every layer
runs on the tile unit instead (`amx_ready`): x split exactly into three bf16 pieces, the codes exact
in bf16, so only the fp32 sums round (other last bits than the AVX paths; each row still alone).

Each output is one chain y = fma(w[k], x[k], y) over k in order, whatever the number of rows and
threads: each row of a product is the one-row product (checked by `check`), so plain and speculative
decoding on these layers give the same tokens, as on stock fp32 layers. The order of the sum is not
MKL's, so outputs differ from stock fp32 in the last bits (relative ~1e-6), as another BLAS would.

Measured costs per CPU kind: docs/ENGINE.md, "Linears on the GGUF's blocks".
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import statistics
import time
from collections import Counter
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..config import Numerics
from .attention import register_rowwise_attention
from .packed import shared_copy

log = logging.getLogger(__name__)

BLOCK = 32  # weights per block along the input (Q4_1 and Q8_0)
PANEL = 16  # output rows the kernel dequantizes together
FEW_ROWS = 8  # a stream_rows that keeps the AVX-512 path to few rows, the AVX2 path above
ALL_ROWS = 1 << 30  # a stream_rows that sends every row count down the AVX-512 path (chunks of <= 16)
CHECK_ROWS = (1, 2, 3, 5, 8, 9, 13, 33)  # row counts at which each row must equal the one-row product
TOLERANCE = 1e-5  # relative difference to F.linear on the same fp32 weights that `check` accepts
INT8_TOLERANCE = 2e-2  # the same in the int8 numerics (8-bit activations: ~6e-3 measured on random rows)
SOURCE = Path(__file__).with_name("blocks.cpp")


class BlockKind(str, Enum):
    Q4_1 = "q4_1"  # fl(fl(d q) + m), q in 0..15
    Q8_0 = "q8_0"  # fl(d q), q in -128..127

    @property
    def bits(self) -> int:
        return 4 if self is BlockKind.Q4_1 else 8


@dataclass
class Blocks:
    """A weight [N, K] as the kernel reads it: codes by panels of 16 output rows, k-major (q4_1:
    [N/16, K, 8] bytes, low nibble row i, high nibble row 8 + i; q8_0: [N/16, K, 16] int8), scales d
    and mins m [N/16, K/32, 16] fp32 (m empty for q8_0). stream_rows: the most rows the kernel's
    AVX-512 path takes (`stream_rows()`, set where a model's layers are put on blocks; the same bits
    either way). amx: the kernel's AMX path takes every row count, q4_1 codes in its layout (its
    sums differ from the AVX paths' in the last bits; `amx_ready()` decides, per machine)."""

    kind: BlockKind
    codes: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor
    shape: tuple[int, int]
    stream_rows: int = FEW_ROWS
    amx: bool = False  # multiplied on the tile unit (`to_amx`; q4_1 codes then in the AMX layout [N/16, K/2, 16])
    int8: bool = False  # in the int8 numerics (`to_int8`; codes then in that path's layout [N/16, K/4, 32 or 64])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.d, self.m))


def _fp16_neighbours(x: torch.Tensor) -> list[torch.Tensor]:
    """x [B] fp32 -> the nearest fp16 value and the one on each side, as fp32."""
    h = x.half()
    bits = h.view(torch.int16)
    return [h.float(), (bits - 1).view(torch.float16).float(), (bits + 1).view(torch.float16).float()]


def _solve(v: torch.Tensor, kind: BlockKind) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """v [B, 32] fp32 blocks -> (q [B, 32] int, d [B], m [B]) with every value rebuilt bit for bit,
    or None where some block has no such codes. blocks.cpp's `blocks_recover` computes the same in
    one pass; this one decides on a weight's first block whether that pass (and the kernel's build)
    is worth it, and tests compare the two."""
    if kind is BlockKind.Q4_1:
        m = v.amin(-1)
        if not torch.equal(m.half().float(), m):
            return None
        span, top = v.amax(-1) - m, 15
    else:
        m = torch.zeros_like(v[:, 0])
        span, top = v.abs().amax(-1), 127
    q = d = None
    ok = torch.zeros(v.shape[0], dtype=torch.bool)
    for cand in _fp16_neighbours(span / top):
        cand = torch.where(torch.isfinite(cand) & (cand > 0), cand, torch.zeros_like(cand))
        safe = torch.where(cand > 0, cand, torch.ones_like(cand))
        lo, hi = (0, 15) if kind is BlockKind.Q4_1 else (-128, 127)
        qc = torch.round((v - m[:, None]) / safe[:, None]).clamp(lo, hi) * (cand > 0)[:, None]
        back = cand[:, None] * qc  # two roundings, as the GGUF reader dequantizes
        if kind is BlockKind.Q4_1:
            back = back + m[:, None]
        hit = (back == v).all(-1) & ~ok
        q = qc if q is None else torch.where(hit[:, None], qc, q)
        d = cand if d is None else torch.where(hit, cand, d)
        ok |= hit
        if bool(ok.all()):
            return q.to(torch.int16), d, m
    return None


def recover(weight: torch.Tensor) -> Blocks | None:
    """An fp32 weight [N, K] whose every value is a Q4_1 (tried first) or Q8_0 block value -> its
    Blocks (blocks.cpp's `blocks_recover`, one pass over the weight), or None (the layer stays stock;
    also where the kernel does not build, the only thing that multiplies on blocks)."""
    if weight.dtype != torch.float32 or weight.dim() != 2:
        return None
    n, k = weight.shape
    if n % PANEL or k % BLOCK:
        return None
    v = weight.detach().to("cpu").reshape(-1, BLOCK).contiguous()
    for kind in BlockKind:
        if _solve(v[:1], kind) is None:  # not even the first block: no pass, no kernel build
            continue
        module = kernel()
        if module is None:
            return None
        q, d, m, ok = module.blocks_recover(v, kind.bits)
        if not ok:
            continue
        p, nb = n // PANEL, k // BLOCK
        qp = q.reshape(p, PANEL, k).transpose(1, 2)  # [P, K, 16] uint8
        if kind is BlockKind.Q4_1:
            codes = (qp[..., :8] | (qp[..., 8:] << 4)).contiguous()
        else:
            codes = qp.contiguous().view(torch.int8)
        d, m = (t.reshape(p, PANEL, nb).transpose(1, 2).contiguous() for t in (d, m))  # [P, K/32, 16]
        return Blocks(kind, codes, d, m if kind is BlockKind.Q4_1 else torch.empty(0), (n, k))
    return None


def quantize(weight: torch.Tensor, kind: BlockKind = BlockKind.Q4_1) -> torch.Tensor:
    """weight [N, K] -> the fp32 values a GGUF of `kind` would load as (llama.cpp's reference
    quantizer: min/max per block, fp16 scales). For tests and probes: a lossy change of weights."""
    v = weight.detach().float().reshape(-1, BLOCK)
    if kind is BlockKind.Q4_1:
        lo, hi = v.amin(-1), v.amax(-1)
        d, m = ((hi - lo) / 15).half().float(), lo.half().float()
        safe = torch.where(d > 0, d, torch.ones_like(d))
        q = torch.round((v - m[:, None]) / safe[:, None]).clamp(0, 15) * (d > 0)[:, None]
        out = d[:, None] * q + m[:, None]
    else:
        d = (v.abs().amax(-1) / 127).half().float()
        safe = torch.where(d > 0, d, torch.ones_like(d))
        out = d[:, None] * torch.round(v / safe[:, None]).clamp(-128, 127)
    return out.reshape(weight.shape)


def supported(weight: torch.Tensor | None) -> str | None:
    """Why linears with this weight cannot run on blocks here, or None when they may (before
    `recover` and `check`)."""
    if weight is None:
        return "no weights"
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        return "block linears are for fp32 on CPUs"
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return f"block linears need AVX2 (this CPU: {torch.backends.cpu.get_cpu_capability()})"
    return None


ISA_FLAGS = {"AVX2": ["-mavx2", "-mfma"], "AVX512": ["-mavx2", "-mfma", "-mavx512f"],  # blocks.cpp's paths
             "AMX": ["-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512bf16", "-mamx-tile",
                     "-mamx-bf16", "-DMEDUSA_AMX"]}


def isa() -> str:
    """The kernel's instruction set on this CPU: AMX where torch finds AVX-512, AVX-512 bf16 and the AMX
    tiles, AVX512 where it finds AVX-512 (and the OS enables it), else AVX2."""
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        return "AVX2"
    amx = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
    return "AMX" if amx and getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)() else "AVX512"


FALLBACK = {"AMX": "AVX512", "AVX512": "AVX2"}  # the build to try next where one does not build


def source_tag(target: str | None = None) -> str:
    """What the built kernel depends on: its source, torch's version and the instruction set (default:
    the one this process runs, `kernel_target()`)."""
    target = target or kernel_target() or isa()
    return hashlib.sha256((SOURCE.read_text() + torch.__version__ + target).encode()).hexdigest()[:12]


@functools.cache
def kernel_target() -> str | None:
    """The instruction set of the kernel this process runs: `isa()`, or the next one down (FALLBACK)
    where that build fails (a compiler older than gcc 11 has no AMX), or None where none builds."""
    target = isa()
    while target is not None:
        if build(target) is not None:
            return target
        target = FALLBACK.get(target)
    log.warning("block linears off: the kernel did not build here (the stock layers stay)")
    return None


def kernel():
    """The compiled blocks.cpp for this CPU (built once per machine and source, ~45 s, under
    $MEDUSA_CACHE/kernels), registered as the operator torch.ops.medusa_blocks.linear; or None, with the
    reason logged, where it cannot be built."""
    target = kernel_target()
    return None if target is None else build(target)


@functools.cache
def build(target: str, op: bool = True):
    """blocks.cpp built for `target` (a key of ISA_FLAGS); op=False: without registering the operator
    (a second build in one process, to compare the paths through its `blocks_linear`)."""
    from torch.utils import cpp_extension

    from ..platform import cache_dir

    tag = source_tag(target) + ("" if op else "-noop")
    folder = cache_dir() / "kernels" / f"blocks-{tag}"
    folder.mkdir(parents=True, exist_ok=True)
    name = f"medusa_blocks_{tag.replace('-', '_')}"
    try:
        if not (folder / f"{name}.so").is_file():
            log.warning("building the block-linear kernel for this machine (once, ~45 s)")
        module = cpp_extension.load_inline(
            name, cpp_sources=SOURCE.read_text(), functions=["blocks_linear", "blocks_recover", "amx_ready"], build_directory=str(folder),
            extra_cflags=["-O3", "-ffp-contract=off", "-fopenmp", *ISA_FLAGS[target],
                          *([] if op else ["-DMEDUSA_NO_OP"])],
            extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as e:  # no compiler, no ninja, no headers, no AMX in the compiler
        log.warning("the %s block-linear kernel did not build (%s)", target, str(e).splitlines()[0] if str(e) else e)
        return None
    if op:
        torch.library.register_fake("medusa_blocks::linear")(_linear_shape)
        torch.library.register_fake("medusa_blocks::linear_int8")(_linear_shape)
        torch.library.register_fake("medusa_blocks::rowwise_attention")(_attention_shape)
    return module


@functools.cache
def stream_rows() -> int:
    """The most rows the kernel's AVX-512 path takes (in chunks of <= 16) before its AVX2 path: 8, or
    all of them, whichever multiplies 16 rows faster on this CPU, timed once a process (~0.1 s). Both
    give the same bits, so the choice changes speed only: which is faster depends on the CPU's
    AVX-512 units (docs/ENGINE.md)."""
    if kernel_target() not in ("AVX512", "AMX"):
        return FEW_ROWS  # an AVX2 build has one path
    g = torch.Generator().manual_seed(0)
    found = recover(quantize(torch.randn(1536, 576, generator=g) * 0.02))  # an MLP up-projection's shape
    x = torch.randn(16, 576, generator=g)
    times: dict[int, list[float]] = {FEW_ROWS: [], ALL_ROWS: []}
    for _ in range(5):  # interleaved rounds
        for limit in times:
            start = time.perf_counter()
            for _ in range(10):
                torch.ops.medusa_blocks.linear(x, found.codes, found.d, found.m, found.kind.bits, limit, False)
            times[limit].append(time.perf_counter() - start)
    best = min(times, key=lambda limit: statistics.median(times[limit]))
    log.info("block linears: the AVX-512 path takes %s rows (16 rows: %.0f us, AVX2 past 8: %.0f us)",
             "all" if best == ALL_ROWS else f"up to {FEW_ROWS}", statistics.median(times[ALL_ROWS]) / 10 * 1e6,
             statistics.median(times[FEW_ROWS]) / 10 * 1e6)
    return best


@functools.cache
def amx_ready() -> bool:
    """Whether layers go to the kernel's AMX path here: the CPU has the tiles (`isa()`), the kernel built
    with them, and the OS grants this process the tile state. A deterministic choice per machine (not
    timed), because the AMX sums are not the AVX paths' bits. A tile product costs about the same for
    1 row as for 16, so trees verify at nearly the cost of one token (docs/ENGINE.md)."""
    return kernel_target() == "AMX" and bool(kernel().amx_ready())


def to_amx(blocks: Blocks) -> Blocks:
    """Blocks -> the same blocks for the kernel's AMX path: Q4_1 codes in the AMX layout [P, K/2, 16]
    (byte n of k-pair i: q[n, 2i] | q[n, 2i + 1] << 4), Q8_0 codes as they are."""
    if blocks.amx or blocks.kind is BlockKind.Q8_0:
        return dataclasses.replace(blocks, amx=True)
    q = torch.cat([blocks.codes & 15, blocks.codes >> 4], -1)  # [P, K, 16]: output rows 0-7, then 8-15
    q = q.reshape(q.shape[0], -1, 2, PANEL)
    return dataclasses.replace(blocks, codes=(q[:, :, 0] | (q[:, :, 1] << 4)).contiguous(), amx=True)


def to_int8(blocks: Blocks) -> Blocks:
    """Blocks -> the same blocks for the kernel's int8 path: codes in k-groups of 4 (q4_1 [P, K/4, 32] bytes,
    byte 4o + j: q[o, 4g + j] | q[8 + o, 4g + j] << 4; q8_0 [P, K/4, 64] int8, outputs 0-7 then 8-15)."""
    p, k = blocks.codes.shape[:2]
    def groups(q: torch.Tensor) -> torch.Tensor:  # [P, K, 8] -> [P, K/4, 8 outputs x 4 k]
        return q.reshape(p, k // 4, 4, 8).transpose(2, 3).reshape(p, k // 4, 32)
    if blocks.kind is BlockKind.Q4_1:
        codes = groups(blocks.codes & 15) | (groups(blocks.codes >> 4) << 4)
    else:
        codes = torch.cat([groups(blocks.codes[..., :8]), groups(blocks.codes[..., 8:])], -1)
    return dataclasses.replace(blocks, codes=codes.contiguous(), int8=True)


def for_this_machine(blocks: Blocks, numerics: Numerics = Numerics.FP32) -> Blocks:
    """Blocks as this machine's kernel runs them fastest in `numerics`: int8 on its own path; fp32 on the
    AMX path where `amx_ready()`, else with `stream_rows()` (timed on the AVX-512 path, which an AMX
    machine does not run)."""
    if numerics is Numerics.INT8:
        return to_int8(blocks)
    return to_amx(blocks) if amx_ready() else dataclasses.replace(blocks, stream_rows=stream_rows())


def _linear_shape(x, codes, *blocks):
    """The linear operators' output for torch.compile's tracing: x [M, K] -> [M, 16 P]."""
    return x.new_empty(x.shape[0], codes.shape[0] * PANEL)


def _attention_shape(q, k, v, attend, scaling):
    """The row-invariant attention's output for torch.compile's tracing: q [B, H, n, d] -> [B, n, H, d]."""
    return q.new_empty(q.shape[0], q.shape[2], q.shape[1], q.shape[3])


def block_linear(x: torch.Tensor, blocks: Blocks, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] fp32 -> [..., N], through the operators `kernel()` registered."""
    flat = x.reshape(-1, x.shape[-1]).contiguous()
    if blocks.int8:
        y = torch.ops.medusa_blocks.linear_int8(flat, blocks.codes, blocks.d, blocks.m, blocks.kind.bits)
    else:
        y = torch.ops.medusa_blocks.linear(flat, blocks.codes, blocks.d, blocks.m, blocks.kind.bits,
                                           blocks.stream_rows, blocks.amx)
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], blocks.shape[0])


class BlockLinear(nn.Module):
    """An nn.Linear whose forward reads its weight's GGUF blocks; `weight` and `bias` are the
    original module's (shared; for a lossy block_copy, the weight before it was quantized)."""

    def __init__(self, linear: nn.Linear, blocks: Blocks):
        super().__init__()
        if kernel() is None:
            raise RuntimeError("block linears need the kernel, which did not build here")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.blocks = blocks  # a plain attribute: not state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return block_linear(x, self.blocks, self.bias)

    def extra_repr(self) -> str:
        int8 = ", int8 activations" if self.blocks.int8 else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.blocks.kind.value} blocks{int8}"


def check(weight: torch.Tensor, blocks: Blocks, bias: torch.Tensor | None = None,
          rows: tuple[int, ...] = CHECK_ROWS) -> str | None:
    """The kernel on `blocks` against F.linear on `weight` (within TOLERANCE, INT8_TOLERANCE in the int8
    numerics) and each row of a product against the one-row product (bit for bit), on random inputs
    -> the first failure, or None."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(max(rows), weight.shape[1], generator=g)
    with torch.inference_mode():
        alone = torch.cat([block_linear(x[i:i + 1], blocks, bias) for i in range(x.shape[0])])
        ref = F.linear(x, weight, bias)
        err = float((alone - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
        if not err <= (INT8_TOLERANCE if blocks.int8 else TOLERANCE):
            return f"{weight.shape[0]} x {weight.shape[1]} is off by {err:.1e} (relative)"
        for n in rows:
            if not torch.equal(block_linear(x[:n], blocks, bias), alone[:n]):
                return f"{weight.shape[0]} x {weight.shape[1]}: rows differ at {n} rows"
    return None


def block_copy(model, lossy: BlockKind | None = None,
               numerics: Numerics = Numerics.FP32) -> tuple[nn.Module, dict[str, int]]:
    """The model with every nn.Linear whose weight `recover`s and passes `check` on its blocks: a new
    module tree sharing every parameter, buffer and config object of `model` (left as it was; in the
    int8 numerics a config of its own, which names the row-invariant attention)
    -> (copy, layers by kind and "stock" for those left as they were). No layer recovers, or the
    kernel does not build -> (model, {"stock": n}).

    lossy: a weight that does not recover is quantized to this kind instead (counted as
    "<kind> of fp32"): a change of the weights, only for a drafter, whose output the base verifies.
    numerics: the arithmetic of the layers on blocks (config.Numerics)."""
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    found: dict[int, Blocks | None] = {}  # by weight: a tied LM head is the embedding's blocks
    weights: dict[int, torch.Tensor] = {}  # by weight: the values its blocks hold
    for _, module in linears:
        w = module.weight
        if id(w) not in found:
            found[id(w)], weights[id(w)] = recover(w), w
            if found[id(w)] is None and lossy is not None:
                weights[id(w)] = quantize(w, lossy)
                found[id(w)] = recover(weights[id(w)])
    if not any(found.values()) or kernel() is None:
        return model, {"stock": len(linears)}
    found = {key: None if blocks is None else for_this_machine(blocks, numerics) for key, blocks in found.items()}
    # `recover` rebuilt every value bit for bit: what `check` tests is the kernel's arithmetic, which
    # depends on the shape, the kind and the bias, not the values: once per such layout
    checked: dict[tuple, str | None] = {}
    for name, module in linears:
        blocks = found[id(module.weight)]
        if blocks is None:
            continue
        layout = (blocks.shape, blocks.kind, blocks.amx, blocks.int8, module.bias is not None)
        if layout not in checked:
            checked[layout] = check(weights[id(module.weight)], blocks, module.bias)
        if checked[layout] is not None:
            log.info("%s left stock: %s", name, checked[layout])
            found[id(module.weight)] = None
    def label(w: torch.Tensor) -> str:
        blocks = found[id(w)]
        if blocks is None:
            return "stock"
        return (blocks.kind.value + (" of fp32" if weights[id(w)] is not w else "") + (" on AMX" if blocks.amx else "")
                + (" int8" if blocks.int8 else ""))
    counts = Counter(label(m.weight) for _, m in linears)
    def replace(linear: nn.Linear) -> BlockLinear | None:
        blocks = found[id(linear.weight)]
        return None if blocks is None else BlockLinear(linear, blocks)
    if numerics is Numerics.FP32 or not hasattr(model, "set_attn_implementation"):
        return shared_copy(model, replace), counts
    # int8: the copy's attention is row-invariant too (attention.rowwise_attention), on a config of its own
    out = shared_copy(model, replace, share_config=False)
    out.set_attn_implementation(register_rowwise_attention())
    return out, counts


def blocks_or_none(weight: torch.Tensor) -> Blocks | None:
    """weight [N, K] on blocks where that is supported, recovered and checked here, else None (a
    weight outside a module: a drafter's shortlist of the LM head)."""
    if supported(weight) is not None:
        return None
    blocks = recover(weight)
    if blocks is None or kernel() is None:
        return None
    blocks = for_this_machine(blocks)
    return blocks if check(weight, blocks) is None else None


def recoverable(model) -> bool:
    """Would block_linears run this model's layers on blocks? (Cheap: its first linear layer only.)"""
    if supported(next(model.parameters(), None)) is not None:
        return False
    first = next((m for m in model.modules() if isinstance(m, nn.Linear)), None)
    return first is not None and recover(first.weight) is not None


def block_linears(model, lossy: BlockKind | None = None, numerics: Numerics = Numerics.FP32) -> nn.Module:
    """The model to run: block_copy(model, lossy, numerics) where it is fp32 on an AVX2 CPU, at least one
    layer is on blocks and the kernel builds, else `model` itself."""
    if supported(next(model.parameters(), None)) is not None:
        return model
    out, counts = block_copy(model, lossy, numerics)
    if out is not model:
        what = "linear layers on GGUF blocks" if lossy is None else "drafter linears on blocks"
        log.info("%s: %s", what, ", ".join(f"{v} {k}" for k, v in sorted(counts.items())))
    return out


def on_blocks(model) -> bool:
    """Do this model's linears run on its GGUF's blocks here: fp32, its weights recoverable as blocks,
    and the kernel built for this CPU?"""
    return next(model.parameters()).dtype == torch.float32 and recoverable(model) and kernel() is not None


if __name__ == "__main__":  # `python -m medusa_decoding.kernels.blocks`: build the kernel ahead of time
    logging.basicConfig(level=logging.INFO)
    print("block-linear kernel:", "built" if kernel() is not None else "not available")
