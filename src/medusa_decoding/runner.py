"""How the decode loop runs the base model: the cache it fills and the forward it calls.

Glossary: T prompt length, n tokens of one forward (tree nodes), S cache slots, D hidden, V vocabulary.

- eager (default): the model's own forward. On a `SlotCache` when every layer is full attention
  (no concatenation per step, one copy to commit a path), else on transformers' DynamicCache.
- compiled (`compile=True`, `--compile`): torch.compile of the same forward with the weights
  frozen into the graph (inductor freezing: on CPU the linear layers then run on prepacked oneDNN
  weights, the main gain). Shapes are static, one graph per (nodes n, read width): the width is
  rounded up to a power of two (at least MIN_WIDTH) and the rest is masked, so a handful of graphs
  cover a generation; the cache is allocated once for the whole context, its size being part of
  every graph. A symbolic size made the frozen graph ~20x slower here, hence static shapes.
  The prefill stays eager (one call, any length). `warmup` compiles ahead of time.
"""

from __future__ import annotations

import logging
import time

import torch

from .attention import fits_short_query_attention
from .cache import SlotCache, new_cache
from .config import MedusaError

log = logging.getLogger(__name__)

MIN_WIDTH = 256
COMPILED_SLOTS = 8192  # slots of the compiled path's cache (SmolLM2: 189 MB in bf16), more only if needed
RECOMPILE_LIMIT = 64  # graphs per process: (nodes, width) pairs; torch's default of 8 is too few


def forward(model, input_ids, position_ids, mask, cache, last_only: bool = False):
    """One base forward through its public decoder: input_ids [1, n], position_ids [1, n],
    mask [1, 1, n, S] additive float or None (causal) -> logits [n, V] (or [1, V]), hidden [n, D].
    """
    out = model.get_decoder()(
        input_ids=input_ids, attention_mask=mask, position_ids=position_ids, cache=cache, use_cache=True
    )
    hidden = out.last_hidden_state[0]  # [n, D], after the final norm
    return lm_logits(model, hidden[-1:] if last_only else hidden), hidden


def lm_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """hidden [..., D] -> logits [..., V] through the base LM head (and its soft-capping, if any)."""
    logits = model.get_output_embeddings()(hidden)
    cap = getattr(model.config.get_text_config(), "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


def round_width(slots: int) -> int:
    """The read width of a compiled step: a power of two, at least MIN_WIDTH."""
    return max(MIN_WIDTH, 1 << (slots - 1).bit_length())


class Runner:
    """The base model's prefill and verification steps, eager or compiled; one per base model
    (compiled graphs and the compiled path's cache are shared by every generation)."""

    def __init__(self, model, compile: bool = False, slots: bool | None = None):
        self.model = model
        self.device = next(model.parameters()).device
        self.slots = fits_short_query_attention(model.config) if slots is None else slots
        if compile and not self.slots:
            raise MedusaError("--compile needs a model with full attention in every layer (no sliding window)")
        self.compiled = None
        if compile:
            self.compiled = torch.compile(self._step, dynamic=False)
        self.cache: SlotCache | None = None  # compiled: reused, its shape is part of every graph
        self.shapes: set[tuple[int, int, int]] = set()  # (nodes, width, cache slots) graphs compiled so far
        self.compile_s = 0.0  # time spent in steps that compiled a new graph

    def new_cache(self, slots: int):
        """An empty cache for a generation that needs about `slots` slots (it grows if not)."""
        if not self.slots:
            return new_cache(self.model)
        if self.compiled is None:
            return SlotCache(self.model, slots)
        # the buffers' size is part of every graph: allocate the context once (up to COMPILED_SLOTS)
        # rather than grow, which would recompile every shape
        context = self.model.config.get_text_config().max_position_embeddings
        capacity = round_width(max(slots, min(context, COMPILED_SLOTS)))
        if self.cache is not None and self.cache.busy:  # another generation is still running
            return SlotCache(self.model, capacity)
        if self.cache is None:
            self.cache = SlotCache(self.model, capacity)
        self.cache.grow(capacity)
        self.cache.length, self.cache.busy = 0, True
        return self.cache

    def release(self, cache) -> None:
        """The generation that used `cache` has ended."""
        if cache is self.cache:
            cache.busy = False

    def prefill(self, input_ids: torch.Tensor, cache):
        """input_ids [1, T] -> logits [1, V] of the last position, hidden [T, D] (always eager)."""
        t = input_ids.shape[1]
        if isinstance(cache, SlotCache):
            cache.grow(t)
            cache.reserve(0, t)
        positions = torch.arange(t, device=input_ids.device)[None]
        out = forward(self.model, input_ids, positions, None, cache, last_only=True)
        if isinstance(cache, SlotCache):
            cache.length = t
        return out

    def step(self, tokens: torch.Tensor, positions: torch.Tensor, bias: torch.Tensor | None, prefix: int, cache):
        """One verification forward: tokens [n] at positions [n], written at slots prefix .. prefix+n-1;
        bias [n, n] additive (among the n tokens) or None (a single token) -> logits [n, V], hidden [n, D]."""
        n = tokens.numel()
        bias = bias if n > 1 else None
        if self.compiled is None:
            mask = None
            if bias is not None:
                mask = torch.cat([bias.new_zeros(n, prefix), bias], dim=1)[None, None]  # [1, 1, n, prefix + n]
            if isinstance(cache, SlotCache):
                cache.grow(prefix + n)
                cache.reserve(prefix, n)
            return forward(self.model, tokens[None], positions[None], mask, cache)
        width = round_width(prefix + n)
        cache.grow(width)
        cache.reserve(prefix, n, width)
        mask = torch.full((n, width), torch.finfo(self.model.dtype).min, dtype=self.model.dtype, device=tokens.device)
        mask[:, :prefix] = 0
        mask[:, prefix : prefix + n] = 0 if bias is None else bias
        shape = (n, width, cache.capacity)
        new_shape = shape not in self.shapes
        t0 = time.perf_counter()
        # freezing as a scoped patch: `options={"freezing": True}` left the linears unpacked (16 vs 12 ms).
        # Once a shape is compiled, only the guards that tell the graphs apart are checked: the full
        # guard set (every layer's buffers, every weight) cost ~0.9 ms a step. Safe here because
        # nothing else changes between steps: same model, weights, cache object and attention.
        with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT), torch._inductor.config.patch(freezing=True), \
                torch.compiler.set_stance(skip_guard_eval_unsafe=not new_shape):
            out = self.compiled(tokens[None], positions[None], mask[None, None], cache)
        if new_shape:
            self.shapes.add(shape)
            self.compile_s += time.perf_counter() - t0
            log.info("compiled the verify step for %d nodes, width %d (%.0f s)", n, width, time.perf_counter() - t0)
        return out

    def _step(self, input_ids, position_ids, mask, cache):
        return forward(self.model, input_ids, position_ids, mask, cache)

    def warmup(self, sizes: list[int], max_slots: int) -> float:
        """Compile the step for every tree size in `sizes` and every width up to round_width(max_slots)
        on dummy tokens -> seconds spent. Nothing to do when eager."""
        if self.compiled is None:
            return 0.0
        t0 = time.perf_counter()
        cache = self.new_cache(max_slots)
        widths = sorted({round_width(w) for w in range(MIN_WIDTH, round_width(max_slots) + 1, MIN_WIDTH)})
        with torch.inference_mode():
            for n in sorted(set(sizes)):
                for width in widths:
                    prefix = width - n if width > MIN_WIDTH else 0
                    tokens = torch.zeros(n, dtype=torch.long, device=self.device)
                    positions = torch.arange(prefix, prefix + n, device=self.device)
                    bias = None if n == 1 else torch.zeros(n, n, dtype=self.model.dtype, device=self.device)
                    self.step(tokens, positions, bias, prefix, cache)
        self.release(cache)
        return time.perf_counter() - t0
