"""The verification step compiled with torch.compile, its graphs kept on disk for the next process.

Glossary: B rows, n nodes of a step, S cache slots.

Shapes are static, one graph per (B, n, read width): the width is rounded up to a power of two
(at least MIN_WIDTH) and the rest is masked, so a handful of graphs cover a generation; the cache
is allocated once for the whole context, its size being part of every graph, and handed from one
verifier to the next. A symbolic size made the frozen graph ~20x slower here, hence static
shapes. The prefill stays eager. `warmup` compiles ahead of time.

Two modes (config.CompileMode): `on` compiles (or loads) a shape the first time a step needs it,
the run waiting; `auto` loads the shapes this machine has saved and runs the others eager, listing
them in FOLDER/wanted/: no run waits for a compiler. `medusa compile` builds the listed shapes (and
those a one-row run needs) in the foreground; a long-lived process (the server) sets `background`,
and a child process of its own (`builder.builder_main(FOLDER)`, nice 19, the same threads) builds
them while it is idle, the run picking each graph up when its file appears. That child ends with
the process that started it (killed at its exit; it also watches its parent): no process outlives
the command that started it.

Two ways to build a graph, chosen by `freeze` (default: where it pays; `auto` never freezes):
- cached (the default for fp32, and on GPUs): `torch.compile(...).aot_compile`, weights read as
  inputs; each graph is saved under $MEDUSA_CACHE/compiled/<machine and model key>/ and the next
  process loads it in seconds instead of compiling it again (about a minute a shape on 2 cores).
- frozen (bf16/fp16 on CPU): inductor freezing makes the weights constants of the graph and the
  linear layers run on prepacked oneDNN weights, about half their bf16 time (docs/ENGINE.md); a
  frozen graph cannot be serialized (aot_compile refuses it), so every process
  compiles its own.
A drafter with a drafting module (hydra's `draft_module()`: its first depth and EAGLE-2's rule at a
fixed width, depth and budget) drafts on graphs of its own, saved and built the same way, one per
(width, depth, budget), named by the drafter's config (`DraftGraphs`; the builder loads the
drafter from its folder). Its weights are inputs, as the base's are.

inductor keeps the C++ it built in its own cache (TORCHINDUCTOR_CACHE_DIR, default under /tmp):
with that cache gone a saved graph loads in ~17 s (gcc again) rather than ~2 s.
"""

from __future__ import annotations

import atexit
import dataclasses
import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
import weakref
from pathlib import Path

import torch

from ..kernels.attention import EXACT_ATTENTION_NAME, full_attention
from ..cache import SlotCache
from ..config import CompileMode, MedusaError, Numerics
from ..platform import cache_dir, processor_info
from ..kernels import blocks, packed
from .transformers import EagerBackend, forward

log = logging.getLogger(__name__)

MIN_WIDTH = 256
COMPILED_SLOTS = 2048  # slots of the compiled path's cache per row, more only where a sequence needs them
RECOMPILE_LIMIT = 64  # frozen graphs per process; torch's default of 8 is too few
GRAPH_VERSION = 3  # of what a saved graph computes or how it is generated (2: without size asserts; 3: C++ wrapper)
RECHECK_S = 2.0  # `auto`: how often a step whose graph is missing looks for its file again
BUILDER_IDLE_S = 30.0  # a background builder waits this long for more wanted shapes, then exits
# Mode auto loads a saved graph once its shape's eager steps have spent what loading it costs
# (rent, then buy): a run that ends sooner never pays for a load it would not win back, and one
# that goes on loses at most the load's time again. The load's expected seconds (the first load of a
# process also imports inductor) until one is measured, and a saved graph's share of the eager step:
FIRST_LOAD_S = 2.0
COMPILED_SHARE = 0.6
WANTED, SPEC, LOCK, BUILD_LOG = "wanted", "builder.json", "builder.pid", "builder.log"


def round_width(slots: int) -> int:
    """The read width of a compiled step: a power of two, at least MIN_WIDTH."""
    return max(MIN_WIDTH, 1 << (slots - 1).bit_length())


def graph_key(model, numerics: Numerics = Numerics.FP32) -> dict:
    """What a saved graph depends on besides its shape: the architecture (not the weights, which
    it reads as inputs), dtype, device, the CPU's instruction sets and threads (inductor's C++ is
    built for them), the linears' kernel and numerics, attention, and the versions of what generated it."""
    import transformers

    device = next(model.parameters()).device
    processor, isa = processor_info(device)
    return {"config": model.config.to_json_string(use_diff=False), "dtype": str(model.dtype), "device": device.type,
            "processor": processor, "isa": isa, "threads": torch.get_num_threads(), "linears": linears(model, numerics),
            "attention": model.config._attn_implementation, "torch": torch.__version__,
            "transformers": transformers.__version__, "version": GRAPH_VERSION}


def linears(model, numerics: Numerics = Numerics.FP32) -> str:
    """The linear layers a compiled step of this model calls: "blocks-<kernel tag>" where an fp32 model
    on CPU runs on its GGUF blocks (blocks.py, the kernel as an operator in the graph; "-int8" added in
    the int8 numerics), else "stock"."""
    if not blocks.on_blocks(model):
        return "stock"
    return f"blocks-{blocks.source_tag()}" + ("" if numerics is Numerics.FP32 else f"-{numerics.value}")


def compiles_by_default(model, numerics: Numerics = Numerics.FP32) -> bool:
    """Does compile mode auto compile this model's step? Where it runs on the slot cache, unless in
    exact mode (its row-invariant kernels are eager ones) or where the eager step runs on packed
    linears (bf16/fp16 on CPU, packed.py), which make it as fast as the saved graph for none of the
    graph's build time. An fp32 step on the GGUF's blocks (blocks.py) does compile: its saved graphs
    remove the per-operator overhead that dominates it (docs/ENGINE.md has the profiles). Not in the
    int8 numerics: there a graph's fused operators and the eager ones differ in the last bits, which
    int8 activations turn into other tokens, so a run must not mix eager and compiled steps (mode
    auto does, while graphs are missing); `--compile` compiles every shape."""
    return (numerics is Numerics.FP32 and full_attention(model.config) and model.config._attn_implementation != EXACT_ATTENTION_NAME
            and packed.supported(next(model.parameters())) is not None)


def graph_folder(model, graphs: Path | None = None, numerics: Numerics = Numerics.FP32) -> Path:
    """Where the saved graphs of this model on this machine live (graphs: default $MEDUSA_CACHE/compiled)."""
    key = hashlib.sha256(json.dumps(graph_key(model, numerics), sort_keys=True).encode()).hexdigest()[:16]
    return (graphs or cache_dir() / "compiled") / key


def graph_name(shape: tuple) -> str:
    """The file name of a step shape (rows, nodes, width, slots, cache rows, feature layers)."""
    return "-".join(str(d) for d in shape[:5]) + f"-{'_'.join(map(str, shape[5] or ()))}"


def dummy_args(model, shape: tuple) -> tuple:
    """Arguments of a step of `shape`, zeros: a graph depends on shapes, not values."""
    b, n, width, capacity, rows, layers = shape
    device = next(model.parameters()).device
    cache = SlotCache(model, capacity, rows)
    cache.reserve(slice(0, b), width - n, n, width)
    tokens = torch.zeros(b, n, dtype=torch.long, device=device)
    positions = torch.zeros(b, n, dtype=torch.long, device=device)
    mask = torch.zeros(b, 1, n, width, dtype=model.dtype, device=device)
    return model, tokens, positions, mask, cache, layers


def build_graph(args: tuple, path: Path, fn=None):
    """Compile `fn` (default: the verify step) for `args`' shapes ahead of time and save it at
    `path` -> the graph."""
    fn = fn or _forward
    if fn is _forward and args[-1] is not None:  # feature layers: transformers installs its output-capturing
        _forward(*args)  # hooks on the first such forward, under a lock dynamo cannot trace (a fresh builder failed)
    # keep only tensor-metadata guards: the rest (module identities) cannot be saved. No size asserts:
    # the wrapper would check every input's sizes and strides on each call, and a graph's inputs are
    # fixed by its shape. On CPU the wrapper that calls the graph's kernels is C++ (cpp_wrapper), not
    # Python: hundreds of calls a step, each paying the interpreter otherwise. Built apart from the
    # kernels (cpp_wrapper_build_separate): one translation unit at -O3 builds several times slower
    # for the same step time.
    cpu = next(args[0].parameters()).device.type == "cpu"
    compiler = torch.compile(fn, fullgraph=True, dynamic=False,
                             options={"guard_filter_fn": torch.compiler.keep_portable_guards_unsafe,
                                      "size_asserts": False, "cpp_wrapper": cpu, "cpp_wrapper_build_separate": cpu})
    graph = compiler.aot_compile((args, {}))
    path.parent.mkdir(parents=True, exist_ok=True)
    graph.save_compiled_function(str(path))  # written to a temporary file, then renamed
    return graph


def builder_pid(folder: Path) -> int | None:
    """The pid of the background builder at work on this folder (its lock names a live process), or None."""
    try:
        pid = int((folder / LOCK).read_text())
        os.kill(pid, 0)
    except (OSError, ValueError):
        return None
    return pid


def builder_alive(folder: Path) -> bool:
    return builder_pid(folder) is not None


def signal_builder(pid: int, sig: int) -> bool:
    """Stop or continue a builder and its compile workers (its own process group) -> sent."""
    try:
        os.killpg(os.getpgid(pid), sig)
    except OSError:
        return False
    return True


def _forward(model, tokens, positions, mask, cache, layers):
    return forward(model, tokens, positions, mask, cache, layers=layers)


def _draft(module, features, root, width: int, depth: int, budget: int):
    return module(features, root, width, depth, budget)


def draft_name(module, key: tuple[int, int, int]) -> str:
    """The file name of a drafting graph: the drafter's kind and shape (its config), width, depth, budget."""
    config = hashlib.sha256(json.dumps(dataclasses.asdict(module.config), sort_keys=True).encode()).hexdigest()[:12]
    return f"draft-{module.config.drafter}-{config}-" + "-".join(map(str, key))


class CompiledBackend(EagerBackend):
    compiled = True

    def __init__(self, model, freeze: bool | None = None, graphs: Path | None = None,
                 mode: CompileMode | str = CompileMode.ON, background: bool = False, like: EagerBackend | None = None,
                 numerics: Numerics = Numerics.FP32):
        """freeze: frozen graphs, compiled by every process (default: bf16/fp16 on CPU, in mode
        `on`); else saved ones. graphs: the folder of saved graphs (default $MEDUSA_CACHE/compiled).
        mode: `on` (compile a missing shape, waiting) or `auto` (run it eager and list it for
        `medusa compile`). background: in mode auto, a child process of this one builds the listed
        shapes while this one is idle (a server's choice; it ends when this process does). like: an
        eager backend on the same model whose lean layers this one shares. numerics: as EagerBackend's."""
        # its graphs hold the stock layers (freezing packs them itself), or in fp32 the GGUF's blocks
        super().__init__(model, packed=blocks.on_blocks(model), like=like, numerics=numerics)
        if not self.slots:
            raise MedusaError("--compile needs a model with full attention in every layer (no sliding window)")
        self.mode = CompileMode.parse(mode)
        if self.mode is CompileMode.OFF:
            raise MedusaError("CompiledBackend runs compiled steps: use EagerBackend for compile mode off")
        if self.mode is CompileMode.AUTO:
            if freeze:
                raise MedusaError("frozen graphs cannot be saved: compile mode auto builds saved ones")
            freeze = False
        self.freeze = (self.device.type == "cpu" and self.dtype in (torch.bfloat16, torch.float16)) if freeze is None else freeze
        # torch.compile imports inductor (~1.5 s): only where frozen graphs are compiled here
        self._frozen = torch.compile(_forward, dynamic=False) if self.freeze else None
        self.shapes: dict[tuple, object] = {}  # shape -> its graph (compiled or loaded so far)
        self.loaded = 0  # graphs loaded from disk rather than compiled
        self.folder = graph_folder(model, graphs, self.numerics)
        self._spare: SlotCache | None = None  # a released cache, for the next verifier
        # mode auto: shapes without a graph yet -> when their file was last looked for
        self.missing: dict[tuple, float] = {}
        self.deferred: set[str] = set()  # saved graphs not loaded (yet): their eager steps have not paid for it
        self.spent: dict[str, float] = {}  # shape -> seconds its steps ran eager here
        self.load_s = FIRST_LOAD_S  # what loading a graph is expected to take (the last load, once measured)
        self.eager_steps = 0  # steps run eager for want of a graph
        self.background = background
        self.builder_idle_s = BUILDER_IDLE_S
        self.builder: subprocess.Popen | None = None  # the background builder this backend started
        self._held: int | None = None  # the builder this process keeps paused while it decodes
        self._looked = -RECHECK_S  # when a step last looked for a builder to pause
        atexit.register(self.stop_builder)  # no builder outlives this process
        self._active = 0  # caches handed out and not released: decoding is going on
        self._drafting: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # drafter -> its DraftGraphs

    def width(self, slots: int) -> int:
        return round_width(slots)

    def drafting(self, drafter) -> DraftGraphs | None:
        """`drafter`'s drafting compiled as this backend's steps are (None: it has no drafting
        module, or graphs are frozen ones, which are not saved)."""
        if drafter is None or self.freeze:
            return None
        if drafter not in self._drafting:
            module = drafter.draft_module()
            self._drafting[drafter] = DraftGraphs(self, module, getattr(drafter, "source", None)) if module is not None else None
        return self._drafting[drafter]

    def new_cache(self, capacity: int, rows: int) -> SlotCache:
        # the buffers' size is part of every graph: allocate the context once (up to COMPILED_SLOTS)
        # rather than grow, which would recompile every shape
        capacity = round_width(max(capacity, min(self.context_length, COMPILED_SLOTS)))
        spare, self._spare = self._spare, None
        self._active += 1
        if spare is not None and spare.capacity >= capacity and spare.num_rows >= rows:
            return spare
        return SlotCache(self.model, capacity, rows)

    def release(self, cache) -> None:
        self._spare = cache
        self._active = max(self._active - 1, 0)
        if not self._active:  # nothing decoding here: the builder may have the CPU
            self.resume_builder()

    def hold_builder(self) -> None:
        """Mode auto: pause the background builder while this process decodes. Even at nice 19 a
        compiler on one of 2 cores made a 2-thread step ~20x slower here (the step's threads wait
        for each other), so it runs only while this process is idle, and after it exits."""
        now = time.perf_counter()
        if self._held is not None or now - self._looked < RECHECK_S:  # a read of the lock file, not every step
            return
        self._looked = now
        pid = builder_pid(self.folder)
        if pid is None and self.builder is not None and self.builder.poll() is None:
            pid = self.builder.pid  # ours, before it has taken the lock
        if pid is not None and signal_builder(pid, signal.SIGSTOP):
            self._held = pid

    def resume_builder(self) -> None:
        if self._held is not None:
            signal_builder(self._held, signal.SIGCONT)
            self._held = None

    def stop_builder(self, wait_s: float = 5.0) -> None:
        """End the builder this backend started, with its compile workers (its process group): at
        this process's exit, or when the owner closes. A graph half-written is never renamed into
        place (build_graph), so a stopped build leaves nothing to load."""
        self.resume_builder()  # a stopped process cannot act on SIGTERM
        builder, self.builder = self.builder, None
        if builder is None or builder.poll() is not None:
            return
        signal_builder(builder.pid, signal.SIGTERM)
        try:
            builder.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            signal_builder(builder.pid, signal.SIGKILL)
            builder.wait()

    def step(self, tokens, positions, mask, cache, layers: tuple[int, ...] | None = None):
        args = (self.model, tokens, positions, mask, cache, layers)
        shape = (*tokens.shape, mask.shape[-1], cache.capacity, cache.num_rows, layers)
        if self.freeze:
            return self._frozen_step(shape, args)
        graph = self.shapes.get(shape)
        if self.mode is CompileMode.AUTO:
            self.hold_builder()
        if graph is None:
            b, n, width, capacity, rows, layers = shape
            what = f"the verify step for {b} rows x {n} nodes, width {width}"
            record = {"shape": [b, n, width, capacity, rows, list(layers) if layers else None]}
            name = graph_name(shape)
            graph = self.saved_graph(name, what, record, args)
            if graph is None:  # auto: eager until it is saved and worth loading
                self.eager_steps += 1
                t0 = time.perf_counter()
                out = forward(*args[:5], layers=layers)
                self.ran_eager(name, time.perf_counter() - t0)
                return out
            self.shapes[shape] = graph
        return graph(*args)

    def saved_graph(self, name: str, what: str, record: dict, args: tuple, fn=None):
        """The saved graph `name` (of `fn`, default the verify step, on `args`; `record`: what the
        background builder reads to build it): mode on loads or compiles it, waiting; mode auto loads
        it once saved, else asks the builder and returns None (run it eager meanwhile)."""
        if self.mode is CompileMode.ON:
            return self._graph(name, what, args, fn)
        return self._saved(name, what, record)

    def ran_eager(self, name: str, seconds: float) -> None:
        """A step (or a drafting) of graph `name`'s shape ran eager for want of it, taking `seconds`."""
        self.spent[name] = self.spent.get(name, 0.0) + seconds

    def _saved(self, name: str, what: str, record: dict):
        """Mode auto: the saved graph `name`, loaded once its eager steps have paid for the load;
        else None (a shape not saved is listed for `medusa compile`, or this backend's builder)."""
        now = time.perf_counter()
        path = self.folder / (name + ".pt2")
        if name not in self.missing and name not in self.deferred:  # first sight
            if path.exists():
                self.deferred.add(name)
            else:
                self.missing[name] = now
                self._want(name, record)
        if self.spent.get(name, 0.0) * (1 - COMPILED_SHARE) < self.load_s:
            return None  # not worth loading yet
        seen = self.missing.get(name)
        if seen is not None and now - seen < RECHECK_S:
            return None
        if seen is not None:
            self.missing[name] = now
        graph = self._load(path) if path.exists() else None
        self.compile_s += time.perf_counter() - now
        if graph is not None:
            self.load_s = time.perf_counter() - now
            self.missing.pop(name, None)
            self.deferred.discard(name)
            log.info("loaded %s (%.1f s)", what, self.load_s)
        return graph

    def _want(self, name: str, record: dict) -> None:
        """List graph `name` in FOLDER/wanted/ (for `medusa compile`, or for this backend's own
        builder, started here if `background` and none is at work)."""
        wanted = self.folder / WANTED
        wanted.mkdir(parents=True, exist_ok=True)
        (wanted / (name + ".json")).write_text(json.dumps(record) + "\n")
        if not self.background:
            if len(self.missing) == 1:
                log.info("graphs missing here run eager; `medusa compile` builds them (listed in %s)", wanted)
            return
        source = self.model.config.name_or_path
        if not source or not Path(source).is_dir():
            if len(self.missing) == 1:
                log.info("no background builder: the model was not loaded from a folder it could load again")
            return
        if builder_alive(self.folder) or (self.builder is not None and self.builder.poll() is None):
            return
        spec = {"model": source, "dtype": str(self.dtype).removeprefix("torch."), "device": str(self.device),
                "attention": self.model.config._attn_implementation, "threads": torch.get_num_threads(),
                "idle_s": self.builder_idle_s, "parent": os.getpid(), "numerics": self.numerics.value}
        (self.folder / SPEC).write_text(json.dumps(spec, indent=1) + "\n")
        env = os.environ | {"OMP_NUM_THREADS": str(spec["threads"])}
        with (self.folder / BUILD_LOG).open("a") as out:
            main = "import sys; from medusa_decoding.builder import builder_main; builder_main(sys.argv[1])"
            self.builder = subprocess.Popen([sys.executable, "-c", main, str(self.folder)], stdin=subprocess.DEVNULL,
                                            stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self._looked = -RECHECK_S  # paused from the next step on
        log.info("building the compiled step's graphs in a child process while this one is idle (pid %d, log %s)",
                 self.builder.pid, self.folder / BUILD_LOG)

    def has_saved(self, rows: int, nodes: int) -> bool:
        """Has this machine saved a graph of a step of `rows` x `nodes` (any width)?"""
        return any(self.folder.glob(f"{rows}-{nodes}-*.pt2"))

    def has_listed(self, rows: int, nodes: int) -> bool:
        """Is a step of `rows` x `nodes` (any width) listed for `medusa compile`?"""
        return any((self.folder / WANTED).glob(f"{rows}-{nodes}-*.json"))

    def _load(self, path: Path):
        """A saved graph, or None where it cannot be loaded (another torch build, a truncated file)."""
        try:
            with path.open("rb") as f:
                graph = torch.compiler.load_compiled_function(f)
        except Exception as e:
            log.warning("cannot load the compiled step %s (%s: %s)", path, type(e).__name__, e)
            return None
        graph.disable_guard_check()
        self.loaded += 1
        return graph

    def _frozen_step(self, shape, args):
        new_shape = shape not in self.shapes
        t0 = time.perf_counter()
        # freezing as a scoped patch: `options={"freezing": True}` left the linears unpacked. Once a
        # shape is compiled, only the guards that tell the graphs apart are checked: the full guard set
        # (every layer's buffers, every weight) costs a noticeable share of a step. Safe here because
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

    def _graph(self, name: str, what: str, args: tuple, fn=None):
        """Graph `name`: loaded from the folder, else compiled and saved there. Its guards are not
        checked per call: the name picks the graph, and the model, weights, cache layout and
        attention are what the folder's key says (as the frozen path's, see above)."""
        path = self.folder / (name + ".pt2")
        t0 = time.perf_counter()
        how = "loaded"
        graph = self._load(path) if path.exists() else None  # unloadable: compiled anew
        if graph is None:
            how = "compiled"
            graph = build_graph(args, path, fn)
            graph.disable_guard_check()
        self.compile_s += time.perf_counter() - t0
        log.info("%s %s (%.1f s)", how, what, time.perf_counter() - t0)
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
        return {"backend": "compiled", "mode": self.mode.value, "cache": "slots", "graphs": len(self.shapes),
                "loaded": self.loaded, "frozen": self.freeze, "compile_s": self.compile_s,
                "eager_steps": self.eager_steps, "missing": len(self.missing), "deferred": len(self.deferred)}


class DraftGraphs:
    """One drafter's drafting as saved graphs, one per (width, depth, budget), built and loaded as
    the verify step's are (mode on: compiled when first needed, the run waiting; auto: built by the
    background builder, eager until then). The module (the drafter's `draft_module()`) is the
    graph's first input: its weights are read, not folded in."""

    def __init__(self, backend: CompiledBackend, module: torch.nn.Module, source: Path | None):
        self.backend, self.module = backend, module
        # where the builder loads the drafter from: absolute, as it may be another process's builder, elsewhere
        self.source = Path(source).resolve() if source is not None else None
        self.graphs: dict[tuple[int, int, int], object] = {}
        self.failed: set[tuple[int, int, int]] = set()  # keys whose graph did not compile here
        self.runs = 0  # drafting calls run on a graph

    def run(self, key: tuple[int, int, int], inputs: tuple) -> tuple | None:
        """inputs (the module's, after itself) at key (width, depth, budget) -> the module's outputs
        from its graph, or None where there is none yet (draft eager)."""
        graph = self.graphs.get(key)
        if graph is None:
            if key in self.failed or (self.backend.mode is CompileMode.AUTO and self.source is None):
                return None  # it did not compile, or no background builder could load the drafter
            name = draft_name(self.module, key)
            what = "the drafting of {} (width {}, depth {}, budget {})".format(self.module.config.drafter, *key)
            record = {"draft": {"folder": str(self.source), "width": key[0], "depth": key[1], "budget": key[2]}}
            try:
                graph = self.backend.saved_graph(name, what, record, (self.module, *inputs, *key), _draft)
            except Exception as e:  # noqa: BLE001 - drafting is an optimisation: eager drafts the same tree
                log.warning("%s does not compile (%s: %s): it drafts eager", what, type(e).__name__, e)
                self.failed.add(key)
                return None
            if graph is None:
                return None
            self.graphs[key] = graph
        self.runs += 1
        return graph(self.module, *inputs, *key)

    def ran_eager(self, key: tuple[int, int, int], seconds: float) -> None:
        """The drafting at `key` ran eager (no graph loaded), taking `seconds`."""
        self.backend.ran_eager(draft_name(self.module, key), seconds)
