"""The machine's side of calibration: what verifying and drafting cost where the model runs.

Glossary: n nodes verified in one step (root included), b a drafter's budget (the nodes of its
tree, root included), L nodes of the n-gram chain, t(n) the wall time of verifying n nodes.

A budget's expected speed-up over plain decoding is

    tau(b) / (t(b + L) / t(1) + draft(b) / t(1))

tau(b), the expected accepted length, belongs to the drafter: it is measured on held-out data
by `medusa calibrate` and ships with the checkpoint (`Drafter.acceptance`). The two costs belong
to the machine (CPU model and its instruction sets, threads, device, dtype, verifier): they are
measured here, the first time this machine meets a model and a drafter, in seconds, and cached
under $MEDUSA_CACHE/calibration, one file per machine fingerprint. The checkpoint's own budget
is only the fallback, for a drafter without acceptance statistics.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .kernels.attention import fits_short_query_attention
from .config import CompileMode, Numerics
from .models import use_fast_attention
from .platform import OtherLoad, cache_dir, processor_info
from .tree import build_tree
from .kernels import blocks, packed
from .verifiers.transformers import EagerBackend, TransformersVerifier

BUDGETS = (2, 3, 4, 6, 8, 12, 16, 24, 32)  # the drafter budgets a calibration chooses among
PREFIX = 300  # cached tokens before the measured steps: a typical chat prompt (not a multiple of exact
# mode's 64-key chunks: at 256 its partial chunk is empty and t(1) reads 20% low)
REPEATS = 5  # timed rounds, interleaved over sizes (one more warms up)
VERSION = 2  # of the cached file's layout and of what it measures (2: PREFIX 300)
EXACT_MAX_COST = 0.10  # exact mode is the default where it costs at most this share of tokens/s
CONTENDED_CORES = 0.3  # other processes' CPU use (cores) during a measurement above which it is not cached


def fingerprint(model, backend=None) -> dict:
    """What a cost curve depends on. model: a MedusaModel; backend: what runs its steps (default: the
    model's). On GGUF blocks: the kernel's source tag too (its source, torch's version and the
    instruction set it was built for)."""
    backend = backend or model.backend
    linears = getattr(backend, "linears", "stock")  # "blocks-int8": the int8 numerics
    device = model.device
    cpu, isa = processor_info(device)
    return {"model": model.name, "dtype": str(model.base.dtype).removeprefix("torch."), "device": device.type,
            "processor": cpu, "isa": isa, "threads": torch.get_num_threads(),
            "verifier": backend.stats()["backend"], "attention": model.base.config._attn_implementation,
            "kernel": blocks.source_tag() + linears.removeprefix("blocks") if linears.startswith("blocks") else None,
            "torch": torch.__version__, "version": VERSION}


def drafter_key(drafter) -> str:
    """A drafter's cost depends on its architecture, drafting options and the form its linears run
    in (stock, packed, blocks), not on its weights."""
    config = getattr(drafter.weights, "config", None)
    described = asdict(config) if config is not None and hasattr(config, "__dataclass_fields__") else {}
    net = getattr(drafter, "net", None)
    linears = sorted({type(m).__name__ for m in net.modules() if hasattr(m, "in_features")}) if net is not None else []
    described.update(kind=drafter.kind, depth=getattr(drafter, "depth", None), width=getattr(drafter, "width", None),
                     linears=linears)
    return hashlib.sha256(json.dumps(described, sort_keys=True, default=str).encode()).hexdigest()[:12]


@dataclass
class CostCurve:
    """One machine's costs, relative to a one-token verification step."""

    fingerprint: dict
    step_s: float  # t(1) in seconds
    verify: dict[int, float]  # n -> t(n) / t(1)
    draft: dict[str, dict[int, float]] = field(default_factory=dict)  # drafter_key -> b -> draft(b) / t(1)
    measured_s: float = 0.0  # seconds the measurements took, all together
    varies_at: dict[str, str | None] = field(default_factory=dict)  # step sizes checked ("1,6,14") -> the first step that changed a row's logits, or None
    compiled: float | None = None  # t(1) of the saved compiled graph / t(1) eager (compile mode auto), once measured

    @classmethod
    def from_json(cls, data: dict) -> CostCurve:
        return cls(fingerprint=data["fingerprint"], step_s=data["step_s"],
                   verify={int(n): v for n, v in data["verify"].items()},
                   draft={k: {int(b): v for b, v in d.items()} for k, d in data.get("draft", {}).items()},
                   measured_s=data.get("measured_s", 0.0),
                   varies_at=dict(data.get("varies_at", {})), compiled=data.get("compiled"))


def cache_path(fp: dict, root: Path | None = None) -> Path:
    digest = hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:16]
    return (root or cache_dir() / "calibration") / f"{digest}.json"


def load_curve(path: Path, fp: dict) -> CostCurve | None:
    """The cached curve, if it was measured on this very fingerprint (else None: measure again)."""
    try:
        curve = CostCurve.from_json(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return curve if curve.fingerprint == fp else None


def save_curve(curve: CostCurve, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(curve), indent=1) + "\n")
    tmp.replace(path)


def timed(fn, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def verify_sizes(chain: int, budgets=BUDGETS) -> list[int]:
    """The node counts a calibration measures: one token, and every budget with and without the
    chain (and the chain alone)."""
    return sorted({1, 1 + chain} | set(budgets) | {b + chain for b in budgets})


@torch.inference_mode()
def measure(backend, drafter, sizes: list[int], budgets=BUDGETS, repeats: int = REPEATS, progress=None,
            verify: bool = True, prefix: int = PREFIX, setups: Sequence[Callable[[], None]] = ()
            ) -> tuple[float, dict[int, float], dict[int, float]] | list[tuple[float, dict[int, float], dict[int, float]]]:
    """-> (t(1) s, {n: t(n)/t(1)}, {b: draft(b)/t(1)}): medians over `repeats` interleaved rounds,
    after a warm-up round, on a random prefix of `prefix` tokens, through the verifier backend and
    the drafter (None: none) the engine uses; nothing is committed. verify=False: t(1) and the
    drafting only. progress(k): called after each timed call. setups: functions that each put
    the base in one mode (e.g. its attention kernel); each round then times every size in each
    mode in turn, so that a load that comes and goes weighs on all modes alike, and the result is
    one such tuple per mode (the drafting, which no mode changes, timed once, against each t(1))."""
    device = backend.device
    verifier = TransformersVerifier(backend, feature_layers=getattr(drafter, "feature_layers", None))
    vocab = backend.model.config.get_text_config().vocab_size
    prefix = min(prefix, verifier.context_length - max(sizes) - 4)  # a short context leaves room for the trees
    ids = torch.randint(0, vocab, (prefix,), device=device)
    row, _, hidden = verifier.add(ids, max(sizes) + 2)
    proposer = drafter.proposer() if drafter is not None else None
    root = ids[-1]
    if proposer is not None:
        proposer.start(ids)
    modes = list(setups) or [lambda: None]
    chains = {n: build_tree([], n - 1).to(device) for n in (sizes if verify else [1])}
    times: list[dict[int, list[float]]] = [{n: [] for n in chains} for _ in modes]
    drafting: dict[int, list[float]] = {b: [] for b in (budgets if proposer is not None else ())}

    def draft(b):  # what a step's drafting does: read the verified positions, then propose
        proposer.observe(hidden[-2:], ids[-2:], None)
        proposer.propose(root, b)

    try:
        for rep in range(repeats + 1):
            for setup, mode_times in zip(modes, times):
                setup()
                for n, tree in chains.items():
                    tokens = torch.randint(0, vocab, (n,), device=device)
                    t = timed(lambda: verifier.verify([row], [tokens], [tree]), device)
                    if rep:  # the first round warms up
                        mode_times[n].append(t)
                        progress and progress(1)
            for b in drafting:
                t = timed(lambda: draft(b), device)
                if rep:
                    drafting[b].append(t)
                    progress and progress(1)
    finally:
        verifier.release(row)
    results = []
    for mode_times in times:
        step = statistics.median(mode_times[1])
        results.append((step, {n: statistics.median(t) / step for n, t in mode_times.items()},
                        {b: statistics.median(t) / step for b, t in drafting.items()}))
    return results if setups else results[0]


@torch.inference_mode()
def compiled_ratio(eager, compiled, layers: tuple[int, ...] | None = None, repeats: int = 3 * REPEATS,
                   prefix: int = PREFIX) -> float | None:
    """t(1) of the compiled backend's one-node step over the eager backend's, the two timed
    alternately after the same prefix (a one-node step is cheap: more rounds than the curve's, as
    this one ratio reshapes the whole curve) -> that ratio, or None where the compiled backend has no
    graph for the step yet (compile mode auto then lists it for `medusa compile` and runs the
    step eager). Nothing is committed."""
    device = eager.device
    vocab = eager.model.config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (min(prefix, eager.context_length - 8),), device=device)
    tree = build_tree([]).to(device)
    if not compiled.has_saved(1, 1):  # nothing to time: the step runs once, to list its shape, then no more
        if not compiled.has_listed(1, 1):
            verifier = TransformersVerifier(compiled, feature_layers=layers)
            row = verifier.add(ids, 4)[0]
            try:
                verifier.verify([row], [torch.randint(0, vocab, (1,), device=device)], [tree])
            finally:
                verifier.release(row)
        return None
    runs, times = [], ([], [])
    before = compiled.eager_steps
    try:
        for backend in (eager, compiled):
            verifier = TransformersVerifier(backend, feature_layers=layers)
            runs.append((verifier, verifier.add(ids, 4)[0]))
        for rep in range(repeats + 1):
            for (verifier, row), out in zip(runs, times):
                tokens = torch.randint(0, vocab, (1,), device=device)
                t = timed(lambda: verifier.verify([row], [tokens], [tree]), device)
                if rep:  # the first round warms up (and loads the graph)
                    out.append(t)
            if compiled.eager_steps != before:  # no graph yet: the step ran eager
                return None
    finally:
        for verifier, row in runs:
            verifier.release(row)
    return statistics.median(times[1]) / statistics.median(times[0])


def compiled_costs(curve: CostCurve) -> tuple[dict[int, float], dict[str, dict[int, float]]]:
    """The curve as the saved compiled graphs run it -> (verify, draft) relative to their t(1).
    Compiling removes per-operator overhead, about the same at every size (measured: docs/ENGINE.md),
    so with r = curve.compiled = t_c(1) / t(1): t_c(n) = t(n) - (1 - r) t(1); the drafter
    runs eager either way, so its share grows by 1 / r."""
    r = curve.compiled
    return ({n: (v - (1 - r)) / r for n, v in curve.verify.items()},
            {k: {b: v / r for b, v in d.items()} for k, d in curve.draft.items()})


@torch.inference_mode()
def varies_at(backend, sizes: list[int], prefixes: Sequence[int] = (70, PREFIX)) -> str | None:
    """The first step ("5 nodes", "2 rows") whose logits are not bit-identical to the same
    tokens' logits in another layout, or None where none is: a chain's root against a one-token
    step (the linear layers at n rows against 1), and the largest chain beside a longer row (its
    nodes then sit past a gap, in a wider step) against itself alone, after each prefix length.
    What exact mode promises, checked on this machine's kernels (a GEMM that picks its blocking
    by the number of rows, as oneDNN may, would break it). Nothing is committed."""
    device = backend.device
    verifier = TransformersVerifier(backend, rows_hint=2)
    vocab = backend.model.config.get_text_config().vocab_size
    n = max(sizes)
    chain = torch.randint(0, vocab, (n,), device=device)

    def step(rows, tokens):  # each row's tokens as a chain -> logits [B, N, V]
        return verifier.verify(rows, tokens, [build_tree([], t.numel() - 1).to(device) for t in tokens])[0]

    gap = min(37, (verifier.context_length - n - 4) // 2)  # the longer row's extra tokens
    if gap < 1:  # no room for the check: exact mode is not promised
        return f"{n} nodes (a context of {verifier.context_length} is too short to check)"
    for prefix in prefixes:
        prefix = min(prefix, verifier.context_length - n - gap - 4)
        row, _, _ = verifier.add(torch.randint(0, vocab, (prefix,), device=device), n + 2)
        try:
            alone = step([row], [chain[:1]])[0, 0]
            for m in sorted(set(sizes) - {1}):
                if not torch.equal(step([row], [chain[:m]])[0, 0], alone):
                    return f"{m} nodes"
            longest = step([row], [chain])[0]
            other, _, _ = verifier.add(torch.randint(0, vocab, (prefix + gap,), device=device), n + 2)
            try:
                if not torch.equal(step([row, other], [chain, chain[:2]])[0], longest):
                    return "2 rows"
            finally:
                verifier.release(other)
        finally:
            verifier.release(row)
    return None


def interpolate(curve: dict[int, float], n: int) -> float:
    """curve at n: linear between measured sizes, proportional past the largest."""
    sizes = sorted(curve)
    if n <= sizes[0]:
        return curve[sizes[0]]
    for a, b in zip(sizes, sizes[1:]):
        if a <= n <= b:
            return curve[a] + (curve[b] - curve[a]) * (n - a) / (b - a)
    return curve[sizes[-1]] * n / sizes[-1]


def choose_budget(acceptance: dict[int, float], verify: dict[int, float], draft: dict[int, float],
                  chain: int = 0, chained: dict[int, float] | None = None) -> tuple[int, int, list[dict]]:
    """The budget and n-gram chain of highest expected speed-up -> (budget, chain, table of every
    option; budget 1 without a chain is plain decoding, speed-up 1). acceptance: b -> tau(b);
    verify: n -> t(n)/t(1); draft: b -> draft(b)/t(1); chain: nodes of the n-gram chain. Without
    `chained` every tree carries the chain, whose own gain is not in tau(b), and a budget >= 2 is
    chosen; with chained (b -> tau(b) with the chain beside the tree, b = 1: the chain alone) each
    budget is weighed with and without the chain, plain decoding included."""
    table = [{"budget": 1, "chain": 0, "expected_tau": 1.0, "cost": 1.0, "expected_speedup": 1.0}]
    options = [(b, 0 if chained is not None else chain, tau) for b, tau in sorted(acceptance.items())]
    options += [(b, chain, tau) for b, tau in sorted((chained or {}).items())]
    for b, c, tau in options:
        if b < 1 or (b > 1 and b not in draft) or (b == 1 and not c):
            continue
        cost = interpolate(verify, b + c) + (draft[b] if b > 1 else 0.0)
        table.append({"budget": b, "chain": c, "expected_tau": tau, "cost": cost, "expected_speedup": tau / cost})
    best = max(table if chained is not None else table[1:], key=lambda r: r["expected_speedup"])
    return best["budget"], best["chain"], table


@dataclass
class Fit:
    """What a calibration chose, and from what."""

    budget: int | None  # None: the drafter keeps its own (nothing to choose from)
    source: str  # "measured", "contended" (measured while other processes ran: not cached), "cached", "shipped", "given"
    line: str  # the one line saying which calibration is in use
    table: list[dict] = field(default_factory=list)
    path: Path | None = None
    step_s: float | None = None  # t(1) of the curve it was chosen on
    chain: int | None = None  # nodes of the n-gram chain chosen (0: off); None: not chosen

    @property
    def keeps_chain(self) -> bool:
        """Does the n-gram chain asked for run beside the chosen tree (chain not chosen, or > 0)?"""
        return self.chain is None or self.chain > 0

    @property
    def speedup(self) -> float:
        """The chosen budget's expected speed-up over plain decoding (1 when nothing was chosen)."""
        return next((r["expected_speedup"] for r in self.table if r["budget"] == self.budget
                     and self.chain in (None, r["chain"])), 1.0)


def machine_curves(model, sizes: list[int], drafter=None, budgets=(), setups: dict | None = None,
                   root: Path | None = None, progress: bool = True, refresh: bool = False,
                   backend=None) -> dict:
    """This machine's cost curves for the model in each mode of `setups` (key -> a function putting
    the base in that mode; None: as it runs now), each holding t(n) for `sizes` and, with a
    drafter, its drafting cost at `budgets`: from the cache, or measured now, every mode in one
    interleaved run (a progress bar on stderr), and cached -> {key: (curve, its file, "cached",
    "measured", or "contended": measured while other processes used more than CONTENDED_CORES, so
    not cached)}. backend: what runs the measured steps (default: the model's). The model is left in
    the last mode of `setups`."""
    backend = backend or model.backend
    setups = setups or {None: lambda: None}
    key = drafter_key(drafter) if drafter is not None else None
    found = {}
    for mode, setup in setups.items():
        setup()
        fp = fingerprint(model, backend)
        path = cache_path(fp, root)
        found[mode] = (fp, path, None if refresh else load_curve(path, fp))
    missing_sizes = any(c is None or not set(sizes) <= set(c.verify) for _, _, c in found.values())
    missing_draft = key is not None and any(c is None or key not in c.draft or not set(budgets) <= set(c.draft[key])
                                            for _, _, c in found.values())
    if not (missing_sizes or missing_draft):
        return {mode: (c, path, "cached") for mode, (_, path, c) in found.items()}
    timed_budgets = list(budgets) if key is not None else []
    calls = REPEATS * (len(setups) * (len(sizes) if missing_sizes else 1) + len(timed_budgets))
    bar = _bar(calls, "calibrating for this machine") if progress else None
    t0 = time.perf_counter()
    try:
        with OtherLoad() as load:
            results = measure(backend, drafter if key is not None else None, sizes, timed_budgets,
                              progress=bar.update if bar else None, verify=missing_sizes, setups=list(setups.values()))
    finally:
        if bar:
            bar.close()
    contended = load.above(CONTENDED_CORES)
    seconds = (time.perf_counter() - t0) / len(setups)
    out = {}
    for (mode, (fp, path, curve)), (step, verify, draft) in zip(found.items(), results):
        if missing_sizes:  # a new curve: drafting measured against another t(1) is dropped with the old one
            curve = CostCurve(fp, step, verify)
        if key is not None:  # drafting was timed against this run's t(1): rescale to the curve's own
            curve.draft[key] = {b: v * step / curve.step_s for b, v in draft.items()}
        curve.measured_s += seconds
        if not contended:
            save_curve(curve, path)
        out[mode] = (curve, path, "contended" if contended else "measured")
    return out


def unfitted(model) -> Fit | None:
    """Why the model's drafter budget cannot be fitted here (a Fit saying so), or None when it can."""
    drafter = model.drafter
    if drafter is None:
        return Fit(None, "given", "calibration: none needed (plain decoding)")
    if not drafter.acceptance():
        return Fit(None, "shipped", f"calibration: the checkpoint's own ({drafter.describe()}): it ships no "
                   "acceptance statistics to choose a budget from (`medusa calibrate --heads DIR` measures them)")
    # int8 compiles every shape (compiled.compiles_by_default): fitted to the eager int8 step, as mode auto is
    fp32 = model.backend.numerics is Numerics.FP32
    if model.backend.compiled and model.backend.mode is not CompileMode.AUTO and fp32:
        return Fit(None, "shipped", f"calibration: the checkpoint's own ({drafter.describe()}): timing a compiled "
                   "step at every size would compile each one (~30 s); fit the budget without --compile "
                   "(compile mode auto, the default, fits it to the eager step's costs)")
    return None


def fit_sizes(model) -> tuple[list[int], list[int]]:
    """What fitting the model's drafter budget measures -> (verify sizes, drafter budgets)."""
    budgets = [b for b in BUDGETS if b in model.drafter.acceptance()]
    ngram = model.ngram_asked
    return verify_sizes(ngram.length if ngram else 0, budgets), budgets


def fit_budget(model, curve: CostCurve, path: Path, source: str, compiled: bool = False) -> Fit:
    """Choose the drafter's budget, and whether the n-gram chain the model was given runs beside it
    (where the checkpoint measured its gain), from its acceptance and this machine's curve -> the Fit
    (MedusaModel.apply_fit sets it); compiled: on the costs of the saved compiled graphs
    (compiled_costs), else the eager step's."""
    drafter, ngram = model.drafter, model.ngram_asked
    chain = ngram.length if ngram else 0
    chained = drafter.acceptance(ngram) if ngram else None
    verify, draft = compiled_costs(curve) if compiled else (curve.verify, curve.draft)
    budget, chain, table = choose_budget(drafter.acceptance(), verify, draft[drafter_key(drafter)], chain, chained)
    best = next(r for r in table if r["budget"] == budget and r["chain"] == chain)
    fp = curve.fingerprint
    where = {"measured": "measured now", "cached": "cached",
             "contended": "measured now while other processes ran (not cached: measured again next run)"}[source]
    step = "compiled" if compiled else fp["verifier"]
    if budget == 1 and not chain:
        what = f"plain decoding ({drafter.kind} resting, no n-gram chain: none is expected to pay here)"
    elif budget == 1:
        what = f"the {chain}-token n-gram chain alone ({drafter.kind} resting)"
    else:
        what = f"{drafter.kind} budget {budget}" + (f", {'with the' if chain else 'no'} n-gram chain" if chained else "")
    line = (f"calibration: {where} for {fp['processor']} ({fp['threads']} threads, {fp['dtype']}, {step}): {what} "
            f"(expected tau {best['expected_tau']:.2f}, x{best['expected_speedup']:.2f} of plain) [{path}]")
    if chain and chained is None:  # what the chain's copies add is not in tau(b): it depends on the prompt
        line = line.replace(" of plain)", " of plain before the n-gram branch's own gain)")
    elif best["expected_speedup"] < 1:
        line += "; on this machine plain decoding (--no-medusa) is expected to be faster"
    return Fit(budget, source, line, table, path, curve.step_s, chain if chained is not None else None)


def fit_to_machine(model, root: Path | None = None, progress: bool = True, refresh: bool = False,
                   compiled=None) -> Fit:
    """Choose the drafter's budget (and the n-gram chain) for this machine -> the Fit (the model is
    not changed: MedusaModel.apply_fit sets it). model: a MedusaModel. The cost curve comes from the cache when this machine measured it before, else it
    is measured now (about 10-30 s on a 2-core CPU; a progress bar on stderr) and cached. refresh:
    measure again. compiled: the compiled backend (compile mode auto) that will run the model
    (default: its backend, if compiled): once it has the saved one-node graph, the budget is fitted
    to the compiled step's costs (compiled_costs), else to the eager step's."""
    reason = unfitted(model)
    if reason is not None:
        return reason
    sizes, budgets = fit_sizes(model)
    if compiled is None and model.backend.compiled:
        compiled = model.backend
    # the curve is measured eager
    eager = EagerBackend(model.base, numerics=model.backend.numerics) if model.backend.compiled else model.backend
    ((curve, path, source),) = machine_curves(model, sizes, model.drafter, budgets, None, root, progress,
                                              refresh, backend=eager).values()
    if compiled is not None and curve.compiled is None:
        with OtherLoad() as load:
            curve.compiled = compiled_ratio(eager, compiled, model.drafter.feature_layers)
        if load.above(CONTENDED_CORES):
            source = "contended"
        if curve.compiled is not None and source != "contended":
            save_curve(curve, path)
    fit = fit_budget(model, curve, path, source, compiled=compiled is not None and curve.compiled is not None)
    if compiled is not None and curve.compiled is None:
        fit.line += (" (compile mode auto: fitted to the eager step, which runs until the compiled graphs are "
                     "built; the next run fits the compiled step)")
    elif compiled is not None:
        fit.line += f" (compile mode auto: a saved graph's one-node step takes {curve.compiled:.2f} of the eager one)"
    return fit


def exact_blocker(model) -> str | None:
    """What keeps exact mode from being row-invariant on this machine, where a check finds it: the
    linear layers the eager step runs in bf16/fp16 (packed ones were checked row by row at load;
    stock ones are checked here) -> a line naming the first layer and the row count at which its
    rows change, or None."""
    dtype = model.base.dtype
    if dtype not in (torch.bfloat16, torch.float16) or getattr(model.backend, "linears", "stock") != "stock":
        return None
    why = packed.check(model.base, stock=True)
    return None if why is None else f"its {str(dtype).removeprefix('torch.')} linear layers are not row-invariant ({why})"


def prefer_exact(fast_rate: float, exact_rate: float, max_cost: float = EXACT_MAX_COST) -> bool:
    """Exact mode is the default where it costs at most max_cost of the tokens/s (rates: tokens/s)."""
    return exact_rate >= (1 - max_cost) * fast_rate


@dataclass
class ExactFit:
    """What the exactness calibration chose (ExactMode.AUTO), and the budget fit it rests on."""

    exact: bool
    lines: list[str]  # the budget's calibration line (when fitted) and the one saying which mode
    cost: float | None = None  # exact mode's share of tokens/s lost on this machine (None: not measured)
    fit: Fit | None = None  # the budget chosen for that mode (None: none fitted)


def fit_exactness(model, fit: bool = True, root: Path | None = None, progress: bool = True,
                  refresh: bool = False, use_medusa: bool = True, compiled=None) -> ExactFit:
    """Choose exact mode (every decoding forward row-invariant: bf16 speculative output equals
    bf16 plain output bit for bit) where it costs this machine <= EXACT_MAX_COST of the expected
    tokens/s -> the ExactFit (the model is not changed: MedusaModel.apply_fit sets it; the attention
    kernel it measures in each mode is put back). model: a MedusaModel. fit: also fit the drafter's budget, in each mode
    (the budgets may differ); else compare one step at the method's largest tree (use_medusa=False:
    plain decoding's one-token step). Both modes are measured in one interleaved run (or read from
    the cache). Float32 is left as it is: its speculative output already equals plain output
    (compiled: as fit_to_machine's, for its budget)."""
    base = model.base
    reason = unfitted(model) if fit else None
    if base.dtype in (torch.float32, torch.float64):
        budget = fit_to_machine(model, root, progress, refresh, compiled) if fit else None
        return ExactFit(False, [budget.line] if budget else [], fit=budget)
    if model.backend.compiled or not fits_short_query_attention(base.config):
        why = "the step is compiled" if model.backend.compiled else f"{base.config.model_type} does not fit its kernel"
        budget = fit_to_machine(model, root, progress, refresh) if fit else None
        return ExactFit(False, ([budget.line] if budget else []) + [f"exact mode: off ({why})"], fit=budget)
    running = base.config._attn_implementation
    try:
        chosen, cost, broken, fits = _measure_exactness(model, fit and reason is None, root, progress, refresh,
                                                        use_medusa)
    finally:
        base.set_attn_implementation(running)
    costs_here = f"costs {cost:.0%} of tokens/s on this machine" if cost > 0 else "no slower on this machine"
    if broken is not None:
        why = exact_blocker(model) or "its kernels are not row-invariant"
        said = (f"exact mode: off (on this machine a row's logits change in a step of {broken} even in exact mode: "
                f"{why}, so it could not keep its promise)")
    else:
        said = (f"exact mode: on ({costs_here}, at most {EXACT_MAX_COST:.0%} allowed: "
                f"{str(base.dtype).removeprefix('torch.')} output is plain decoding's bit for bit, alone or in any batch; --no-exact turns it off)"
                if chosen else
                f"exact mode: off (it would cost {cost:.0%} of tokens/s on this machine, more than {EXACT_MAX_COST:.0%}; "
                "--exact turns it on)")
    budget = fits.get(chosen)
    lines = [budget.line] if budget else [reason.line] if fit and reason.source != "given" else []
    return ExactFit(chosen, lines + [said], cost, budget)


def _measure_exactness(model, fitting: bool, root, progress, refresh, use_medusa):
    """Both modes' costs (and budgets, when fitting), in one interleaved run or from the cache, and
    whether exact mode is row-invariant at the step sizes it would run -> (exact chosen, its cost,
    the first step size that broke it or None, {exact: Fit} when fitting). Leaves the attention
    kernel in whatever mode it measured last (fit_exactness puts it back)."""
    base = model.base
    n = max(model.tree_sizes(use_medusa))
    sizes, budgets = fit_sizes(model) if fitting else ([1, n], [])
    modes = {exact: (lambda exact=exact: use_fast_attention(base, exact=exact)) for exact in (False, True)}
    curves = machine_curves(model, sizes, model.drafter if fitting else None, budgets, modes, root, progress, refresh)
    rates, fits = {}, {}
    for exact, (curve, path, source) in curves.items():
        if fitting:
            fits[exact] = fit_budget(model, curve, path, source)
            rates[exact] = fits[exact].speedup / curve.step_s
        else:  # nothing to fit: one step of the method's largest tree
            rates[exact] = 1 / (curve.step_s * curve.verify[n])
    # is exact mode exact on this machine's kernels, at the step sizes it would run?
    checked = model.tree_sizes(use_medusa, fits.get(True))
    exact_curve, exact_path, source = curves[True]
    key = ",".join(map(str, checked))
    if key not in exact_curve.varies_at or source != "cached":
        use_fast_attention(base, exact=True)
        exact_curve.varies_at[key] = varies_at(model.backend, checked)
        if source != "contended":
            save_curve(exact_curve, exact_path)
    broken = exact_curve.varies_at[key]
    chosen = broken is None and prefer_exact(rates[False], rates[True])
    return chosen, 1 - rates[True] / rates[False], broken, fits


def _bar(total: int, label: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=label, file=sys.stderr, leave=False, unit="step")
