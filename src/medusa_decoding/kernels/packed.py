"""The base's linear layers on weights prepacked for oneDNN, for the eager step in bf16/fp16 on CPU.

An eager bf16 `F.linear` on CPU hands its weight to oneDNN in the plain [out, in] layout, which
oneDNN reorders into its blocked layout on every call. Reordered once, at load (what inductor's
freezing does inside a frozen graph), the same weights give each row the output of a one-row
product, bit for bit, in less time (about half the time of a bf16 call on the CPUs measured:
docs/ENGINE.md, "Packed linears").

fp32 gains nothing this way (MKL's packed sgemm: the same time, and 1-row outputs differ in the
last bits), so only bf16 and fp16 are packed, and only where `check` finds every row of a packed
product, at several row counts, bit-identical to `F.linear` of that row alone: what a one-token
step computes. The packed step is then the model's own computation, each row as plain decoding
computes it, whatever the other rows, so exactness (plain vs speculative, exact mode) is untouched.
Stock `F.linear` need not be that: oneDNN picks its blocking by the row count, so on some CPUs its
rows of a large product differ from the one-row product past some row count, where the packed rows
do not (checked from 1 to 128 rows, every shape of SmolLM2).

`packed_copy(model)` is a copy of the model's module tree that shares every parameter and buffer
with it; only its `nn.Linear` modules are replaced by `PackedLinear` (which keeps the shared weight
beside the packed one). The model itself stays stock: transformers' generate in the bench, the
drafters and training read it as before. The packed weights cost one more copy of the linear
layers' weights in memory (SmolLM2-135M: ~270 MB in bf16).
"""

from __future__ import annotations

import copy
import itertools
import logging

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

PACKED_DTYPES = (torch.bfloat16, torch.float16)
CHECK_ROWS = (1, 2, 3, 8, 16, 33, 64)  # row counts at which a packed product's rows must equal F.linear row by row


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] -> the same weight in oneDNN's blocked layout (an opaque mkldnn tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in], packed (pack_weight) -> [..., out]."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [None], "")


class PackedLinear(nn.Module):
    """An nn.Linear whose forward runs on its weight prepacked; `weight` and `bias` are the
    original module's (shared)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.packed = pack_weight(linear.weight)  # a plain attribute: not state, not moved by .to()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self.packed, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed"


def supported(weight: torch.Tensor | None) -> str | None:
    """Why linears with this weight (a module's first parameter) cannot be packed here, or None
    when they can (before `check`)."""
    if weight is None:
        return "no weights"
    if weight.device.type != "cpu":
        return f"packed linears are for CPUs (the weights are on {weight.device.type})"
    if weight.dtype not in PACKED_DTYPES:
        return f"packed linears gain nothing in {str(weight.dtype).removeprefix('torch.')} (bf16 and fp16 only)"
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return "this torch build has no oneDNN linear kernels"
    return None


def check_weight(weight: torch.Tensor, bias: torch.Tensor | None = None, rows: tuple[int, ...] = CHECK_ROWS,
                 generator: torch.Generator | None = None, stock: bool = False) -> str | None:
    """Random values of `weight`'s (and `bias`'s) shape and dtype, packed (stock: F.linear itself),
    on inputs of `rows` rows, against F.linear of each row alone -> the first difference found, or
    None when every row is bit-identical (the product is row-invariant)."""
    generator = generator or torch.Generator().manual_seed(0)
    dtype, device = weight.dtype, weight.device
    w = torch.randn(weight.shape, generator=generator).to(device, dtype)
    b = None if bias is None else torch.randn(bias.shape, generator=generator).to(device, dtype)
    try:
        if stock:
            product = lambda x: F.linear(x, w, b)  # noqa: E731
        else:
            packed = pack_weight(w)
            product = lambda x: packed_linear(x, packed, b)  # noqa: E731
        x = torch.randn(1, max(rows), w.shape[1], generator=generator).to(device, dtype)
        with torch.inference_mode():
            alone = torch.cat([F.linear(x[:, i:i + 1], w, b) for i in range(x.shape[1])], dim=1)  # [1, rows, out]
            for n in rows:
                if not torch.equal(product(x[:, :n]), alone[:, :n]):
                    return f"{w.shape[0]} x {w.shape[1]} differs at {n} rows"
    except RuntimeError as e:  # a oneDNN build without this kernel for the dtype
        return f"{w.shape[0]} x {w.shape[1]}: {str(e).splitlines()[0]}"
    return None


def check(model, rows: tuple[int, ...] = CHECK_ROWS, stock: bool = False) -> str | None:
    """Each distinct linear shape of the model, packed (stock: as it is), against F.linear row by row
    (check_weight) -> the first difference found (naming the layer), or None when all are bit-identical."""
    generator = torch.Generator().manual_seed(0)
    seen = set()
    for name, module in model.named_modules():
        key = isinstance(module, nn.Linear) and (module.in_features, module.out_features, module.bias is not None)
        if not key or key in seen:
            continue
        seen.add(key)
        why = check_weight(module.weight, module.bias, rows, generator, stock)
        if why is not None:
            return f"{name}: {why}"
    return None


def packed_or_none(weight: torch.Tensor) -> torch.Tensor | None:
    """weight [out, in] packed where that is supported and checked exact here, else None (a
    weight outside a module: a drafter's shortlist of the LM head)."""
    if supported(weight) is not None or check_weight(weight) is not None:
        return None
    return pack_weight(weight)


def packed_copy(model) -> nn.Module:
    """The model with its nn.Linear modules on packed weights: a new module tree sharing every
    parameter, buffer and config object of `model` (so that an attention implementation set on
    the model holds for the copy), which is left as it was."""
    return shared_copy(model, PackedLinear)


def shared_copy(model, replace, share_config: bool = True) -> nn.Module:
    """A new module tree sharing every parameter, buffer and config object of `model`, with each
    nn.Linear replaced by replace(linear), or kept where that returns None (`model` itself, a lone
    nn.Linear included, is left as it was). share_config=False: the copy's config objects are its own
    (copies), so that it can run another attention implementation than `model`."""
    if isinstance(model, nn.Linear):  # a layer on its own (an LM head)
        new = replace(model)
        return model if new is None else new
    configs = [c for m in model.modules() for c in (getattr(m, "config", None), getattr(m, "generation_config", None))
               if c is not None and share_config]
    memo = {id(t): t for t in itertools.chain(model.parameters(), model.buffers(), configs)}
    out = copy.deepcopy(model, memo)
    for name, module in list(out.named_modules()):
        if isinstance(module, nn.Linear):
            new = replace(module)
            if new is not None:
                out.set_submodule(name, new)
    return out


def pack_linears(model) -> nn.Module:
    """The model to run: packed_copy(model) where that is supported and checked exact here, else
    `model` itself (logged when only the check kept it stock)."""
    if supported(next(model.parameters(), None)) is not None:
        return model
    why = check(model)
    if why is not None:
        log.info("linear layers left stock: packed, %s", why)
        return model
    return packed_copy(model)
