"""The verification step compiled with torch.compile, its graphs kept on disk for the next process.

Glossary: B rows, n nodes of a step, S cache slots.

Shapes are static, one graph per (B, n, read width): the width is rounded up to a power of two
(at least MIN_WIDTH) and the rest is masked, so a handful of graphs cover a generation; the cache
is allocated once for the whole context, its size being part of every graph, and handed from one
verifier to the next. A symbolic size made the frozen graph ~20x slower here, hence static
shapes. The prefill stays eager. `warmup` compiles ahead of time.

Two ways to build a graph, chosen by `freeze` (default: where it pays):
- cached (the default for fp32, and on GPUs): `torch.compile(...).aot_compile`, weights read as
  inputs; each graph is saved under $MEDUSA_CACHE/compiled/<machine and model key>/ and the next
  process loads it in ~2 s instead of compiling it again (~70 s for SmolLM2 on a 2-core EPYC).
  Measured there in fp32: 69-79 ms a 1-node step, frozen 71 ms, eager 94-103 ms.
- frozen (bf16/fp16 on CPU): inductor freezing makes the weights constants of the graph and the
  linear layers run on prepacked oneDNN weights, which halves them in bf16 (34 vs 71 us a call,
  docs/ENGINE.md); a frozen graph cannot be serialized (aot_compile refuses it), so every process
  compiles its own.
inductor keeps the C++ it built in its own cache (TORCHINDUCTOR_CACHE_DIR, default under /tmp):
with that cache gone a saved graph loads in ~17 s (gcc again) rather than ~2 s.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path

import torch

from ..cache import SlotCache
from ..config import MedusaError
from ..models import cache_dir, processor_info
from .transformers import EagerBackend, forward

log = logging.getLogger(__name__)

MIN_WIDTH = 256
COMPILED_SLOTS = 8192  # slots of the compiled path's cache (SmolLM2: 189 MB in bf16), more only if needed
RECOMPILE_LIMIT = 64  # frozen graphs per process; torch's default of 8 is too few
GRAPH_VERSION = 1  # of what a saved graph computes (bump when forward or the cache layout changes)


def round_width(slots: int) -> int:
    """The read width of a compiled step: a power of two, at least MIN_WIDTH."""
    return max(MIN_WIDTH, 1 << (slots - 1).bit_length())


def graph_key(model) -> dict:
    """What a saved graph depends on besides its shape: the architecture (not the weights, which
    it reads as inputs), dtype, device, the CPU's instruction sets and threads (inductor's C++ is
    built for them), attention, and the versions of what generated it."""
    import transformers

    device = next(model.parameters()).device
    processor, isa = processor_info(device)
    return {"config": model.config.to_json_string(use_diff=False), "dtype": str(model.dtype), "device": device.type,
            "processor": processor, "isa": isa, "threads": torch.get_num_threads(),
            "attention": model.config._attn_implementation, "torch": torch.__version__,
            "transformers": transformers.__version__, "version": GRAPH_VERSION}


def _forward(model, tokens, positions, mask, cache, layers):
    return forward(model, tokens, positions, mask, cache, layers=layers)


class CompiledBackend(EagerBackend):
    compiled = True

    def __init__(self, model, freeze: bool | None = None, graphs: Path | None = None):
        """freeze: frozen graphs, compiled by every process (default: bf16/fp16 on CPU); else
        cached ones. graphs: the folder of saved graphs (default $MEDUSA_CACHE/compiled)."""
        super().__init__(model)
        if not self.slots:
            raise MedusaError("--compile needs a model with full attention in every layer (no sliding window)")
        self.freeze = (self.device.type == "cpu" and self.dtype in (torch.bfloat16, torch.float16)) if freeze is None else freeze
        self._frozen = torch.compile(_forward, dynamic=False)
        self.shapes: dict[tuple, object] = {}  # shape -> its graph (compiled or loaded so far)
        self.loaded = 0  # graphs loaded from disk rather than compiled
        key = hashlib.sha256(json.dumps(graph_key(model), sort_keys=True).encode()).hexdigest()[:16]
        self.folder = (graphs or cache_dir() / "compiled") / key
        self._spare: SlotCache | None = None  # a released cache, for the next verifier

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
        args = (self.model, tokens, positions, mask, cache, layers)
        shape = (*tokens.shape, mask.shape[-1], cache.capacity, cache.num_rows, layers)
        if self.freeze:
            return self._frozen_step(shape, args)
        graph = self.shapes.get(shape)
        if graph is None:
            graph = self.shapes[shape] = self._graph(shape, args)
        return graph(*args)

    def _frozen_step(self, shape, args):
        new_shape = shape not in self.shapes
        t0 = time.perf_counter()
        # freezing as a scoped patch: `options={"freezing": True}` left the linears unpacked (16 vs 12 ms).
        # Once a shape is compiled, only the guards that tell the graphs apart are checked: the full
        # guard set (every layer's buffers, every weight) cost ~0.9 ms a step. Safe here because
        # nothing else changes between steps: same model, weights, cache layout and attention.
        with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT), torch._inductor.config.patch(freezing=True), \
                torch.compiler.set_stance(skip_guard_eval_unsafe=not new_shape):
            out = self._frozen(*args)
        if new_shape:
            self.shapes[shape] = self._frozen
            self.compile_s += time.perf_counter() - t0
            log.info("compiled the verify step for %d rows x %d nodes, width %d (%.0f s)", shape[0], shape[1],
                     shape[2], time.perf_counter() - t0)
        return out

    def _graph(self, shape, args):
        """The graph of `shape`: loaded from the folder, else compiled and saved there. Its guards
        are not checked per call: the shape picks the graph, and the model, weights, cache layout
        and attention are what the folder's key says (as the frozen path's, see above)."""
        path = self.folder / ("-".join(str(d) for d in shape[:5]) + f"-{'_'.join(map(str, shape[5] or ()))}.pt2")
        t0 = time.perf_counter()
        graph, how = None, "loaded"
        if path.exists():
            try:
                with path.open("rb") as f:
                    graph = torch.compiler.load_compiled_function(f)
                self.loaded += 1
            except Exception as e:  # a graph from another torch build, a truncated file: compile anew
                log.warning("cannot load the compiled step %s (%s: %s); compiling it again", path, type(e).__name__, e)
        if graph is None:
            how = "compiled"
            # keep only tensor-metadata guards: the rest (module identities) cannot be saved
            compiler = torch.compile(_forward, fullgraph=True, dynamic=False,
                                     options={"guard_filter_fn": torch.compiler.keep_portable_guards_unsafe})
            graph = compiler.aot_compile((args, {}))
            self.folder.mkdir(parents=True, exist_ok=True)
            graph.save_compiled_function(str(path))  # written to a temporary file, then renamed
        graph.disable_guard_check()
        self.compile_s += time.perf_counter() - t0
        log.info("%s the verify step for %d rows x %d nodes, width %d (%.1f s)", how, shape[0], shape[1], shape[2],
                 time.perf_counter() - t0)
        return graph

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
        return {"backend": "compiled", "cache": "slots", "graphs": len(self.shapes), "loaded": self.loaded,
                "frozen": self.freeze, "compile_s": self.compile_s}
