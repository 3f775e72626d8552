"""The verification step compiled with torch.compile: the same forward, with the weights frozen
into the graph (inductor freezing: on CPU the linear layers then run on prepacked oneDNN weights,
the main gain).

Glossary: B rows, n nodes of a step, S cache slots.

Shapes are static, one graph per (B, n, read width): the width is rounded up to a power of two
(at least MIN_WIDTH) and the rest is masked, so a handful of graphs cover a generation; the cache
is allocated once for the whole context, its size being part of every graph, and handed from one
verifier to the next. A symbolic size made the frozen graph ~20x slower here, hence static
shapes. The prefill stays eager (one call, any length). `warmup` compiles ahead of time.
"""

from __future__ import annotations

import logging
import time

import torch

from ..cache import SlotCache
from ..config import MedusaError
from .transformers import EagerBackend, forward

log = logging.getLogger(__name__)

MIN_WIDTH = 256
COMPILED_SLOTS = 8192  # slots of the compiled path's cache (SmolLM2: 189 MB in bf16), more only if needed
RECOMPILE_LIMIT = 64  # graphs per process; torch's default of 8 is too few


def round_width(slots: int) -> int:
    """The read width of a compiled step: a power of two, at least MIN_WIDTH."""
    return max(MIN_WIDTH, 1 << (slots - 1).bit_length())


class CompiledBackend(EagerBackend):
    compiled = True

    def __init__(self, model):
        super().__init__(model)
        if not self.slots:
            raise MedusaError("--compile needs a model with full attention in every layer (no sliding window)")
        self._compiled = torch.compile(self._forward, dynamic=False)
        self.shapes: set[tuple[int, ...]] = set()  # graphs compiled so far
        self._spare: SlotCache | None = None  # a released cache, for the next verifier

    def _forward(self, tokens, positions, mask, cache, layers=None):
        return forward(self.model, tokens, positions, mask, cache, layers=layers)

    def width(self, slots: int) -> int:
        return round_width(slots)

    def new_cache(self, capacity: int, rows: int) -> SlotCache:
        # the buffers' size is part of every graph: allocate the context once (up to COMPILED_SLOTS)
        # rather than grow, which would recompile every shape
        capacity = round_width(max(capacity, min(self.context_length, COMPILED_SLOTS)))
        spare, self._spare = self._spare, None
        if spare is not None and spare.capacity >= capacity and spare.num_rows >= rows:
            return spare
        return SlotCache(self.model, capacity, rows)

    def release(self, cache) -> None:
        self._spare = cache

    def step(self, tokens, positions, mask, cache, layers: tuple[int, ...] | None = None):
        shape = (*tokens.shape, mask.shape[-1], cache.capacity, cache.num_rows, layers)
        new_shape = shape not in self.shapes
        t0 = time.perf_counter()
        # freezing as a scoped patch: `options={"freezing": True}` left the linears unpacked (16 vs 12 ms).
        # Once a shape is compiled, only the guards that tell the graphs apart are checked: the full
        # guard set (every layer's buffers, every weight) cost ~0.9 ms a step. Safe here because
        # nothing else changes between steps: same model, weights, cache layout and attention.
        with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT), torch._inductor.config.patch(freezing=True), \
                torch.compiler.set_stance(skip_guard_eval_unsafe=not new_shape):
            out = self._compiled(tokens, positions, mask, cache, layers)
        if new_shape:
            self.shapes.add(shape)
            self.compile_s += time.perf_counter() - t0
            log.info("compiled the verify step for %d rows x %d nodes, width %d (%.0f s)", shape[0], shape[1],
                     shape[2], time.perf_counter() - t0)
        return out

    def warmup(self, sizes: list[int], max_slots: int) -> float:
        """Compile the one-row step for every tree size in `sizes` and every width up to
        round_width(max_slots), on dummy tokens -> seconds spent."""
        from ..tree import build_tree
        from . import Row
        from .transformers import TransformersVerifier

        t0 = time.perf_counter()
        widths = sorted({round_width(w) for w in range(MIN_WIDTH, round_width(max_slots) + 1, MIN_WIDTH)})
        with torch.inference_mode():
            for n in sorted(set(sizes)):
                tree = build_tree([], n - 1)  # any tree of n nodes: the graph depends on shapes only
                for width in widths:
                    # a row of `prefix` tokens, without its prefill: the cache's zeros stand for them
                    verifier = TransformersVerifier(self)
                    verifier.cache = self.new_cache(max_slots, 1)
                    row = Row(index=0, length=width - n if width > MIN_WIDTH else 0)
                    verifier.rows = [row]
                    verifier.verify([row], [torch.zeros(n, dtype=torch.long, device=self.device)], [tree])
                    verifier.release(row)
        return time.perf_counter() - t0

    def stats(self) -> dict:
        return {"backend": "compiled", "cache": "slots", "graphs": len(self.shapes), "compile_s": self.compile_s}
