"""2. methods: our engine's methods (plain, default, medusa[:tree], dynamic, hydra, eagle, +ngram),
transformers' (hf, hf-pld) and llama.cpp's plain decoding (llamacpp.py); `run_method` asks one method every turn of one prompt -> a Record."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .. import proposers
from ..attention import register_attention
from ..config import CalibrationMode, DrafterKind, MedusaError
from .config import COMPILED, EXACT, FITTED_KINDS, LLAMACPP, NGRAM, PLD_TOKENS, SHIPPED, STOCK, BenchConfig, split_mode
from .prompts import Prompt

log = logging.getLogger("medusa_decoding.bench")


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
    generate.model = model
    return generate


def backend_method(backend, generate: Generate) -> Generate:
    """The same engine method on `backend` (compiled, or eager on stock linears) for the call."""
    def on_backend(input_ids, max_new_tokens, seed):
        model = generate.model
        eager, model.backend = model.backend, backend
        try:
            return generate(input_ids, max_new_tokens, seed)
        finally:
            model.backend = eager
    on_backend.backend = backend
    return on_backend


@contextlib.contextmanager
def attention(model, name: str):
    """The base model runs with attention implementation `name` inside the block."""
    engine_attention = model.base.config._attn_implementation
    model.base.set_attn_implementation(name)
    try:
        yield
    finally:
        model.base.set_attn_implementation(engine_attention)


def exact_method(model, generate: Generate) -> Generate:
    """The same method with the base in exact mode for the call (attention.exact_attention)."""
    def exact(input_ids, max_new_tokens, seed):
        with attention(model, register_attention(exact=True)):
            return generate(input_ids, max_new_tokens, seed)
    return exact


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
        with attention(model, "sdpa"):  # transformers as a user runs it
            _sync(model.device)
            t0 = time.perf_counter()
            with torch.inference_mode():
                out = model.base.generate(input_ids, **kwargs)
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
    from ..engine import shipped_heads

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
    from ..engine import shipped_heads

    return cfg.heads if cfg.heads is not None else shipped_heads(cfg.model)


def build_methods(cfg: BenchConfig):
    """Load the base once -> (the plain MedusaModel, {method name: Generate}, the default method's
    MedusaModel or None). Every variant shares the base and its backend (compiled graphs too)."""
    from ..datastore import Datastore
    from ..engine import MedusaModel, shipped_heads
    from ..models import BUILTIN_MODELS
    from ..proposers.medusa import DYNAMIC
    from ..tree import load_tree_file

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
    gguf = None
    if LLAMACPP in kinds:  # refused before the model loads when it cannot run
        from . import llamacpp

        gguf = llamacpp.gguf_file(cfg.model)
        llamacpp._import()
    base = MedusaModel.from_pretrained(cfg.model, dtype=cfg.dtype, device=cfg.device, compile=cfg.compile)
    ngram = cfg.ngram()
    store = Datastore.load(cfg.datastore) if cfg.datastore else None  # default's chain and +ngram methods'
    loaded: dict[str, object] = {}

    def weights(folder):
        key = str(folder)
        if key not in loaded:
            loaded[key] = proposers.load(folder, base.base)
        return loaded[key]

    def variant(drafter=None, plus: bool = False, tree=None, fitted: bool = False, on=None) -> MedusaModel:
        """plus: with the n-gram branch (and --datastore's file, when given); on: the compiled backend
        whose costs the budget is fitted to (a method's @compiled mode)."""
        model = MedusaModel(base.base, base.tokenizer, heads=drafter, tree=tree, name=base.name,
                            ngram=ngram if plus else None, tree_budget=cfg.tree_budget, backend=base.backend,
                            datastore=store if plus else None)
        if fitted and model.drafter is not None and cfg.tree_budget is None and cfg.calibration != CalibrationMode.SHIPPED:
            log.info("%s", model.fit_to_machine(refresh=cfg.calibration == CalibrationMode.REFRESH, compiled=on).line)
        return model

    fitted_default: dict[tuple, MedusaModel] = {}

    def default_model(fitted: bool, on=None) -> MedusaModel:
        if (fitted, on) not in fitted_default:
            folder = default_heads(cfg)
            fitted_default[fitted, on] = variant(weights(folder) if folder is not None else None, True, fitted=fitted, on=on)
        return fitted_default[fitted, on]

    def make(kind: str, on=None) -> dict[str, Generate]:
        """The methods of one method kind (medusa: one per --tree); on: as variant's."""
        fitted = not kind.endswith(SHIPPED)
        name, plus, _ = kind.removesuffix(SHIPPED).partition("+")
        if name == "plain" and not plus:
            return {"plain": engine_method(base, False, cfg.temperature)}
        if name == "plain":  # prompt lookup alone, in our engine
            return {kind: engine_method(variant(plus=True), True, cfg.temperature)}
        if name == "default":
            return {kind: engine_method(default_model(fitted, on), True, cfg.temperature)}
        if name == "dynamic":
            return {kind: engine_method(variant(weights(heads), bool(plus), DYNAMIC), True, cfg.temperature)}
        if name == "medusa" and not cfg.trees:
            return {kind: engine_method(variant(weights(heads), bool(plus)), True, cfg.temperature)}
        if name == "medusa":
            return {f"medusa:{stem}{plus and NGRAM}": engine_method(variant(weights(heads), bool(plus), tree), True,
                                                                     cfg.temperature)
                    for tree, stem in zip(cfg.trees, stems)}
        if name in (DrafterKind.HYDRA.value, DrafterKind.EAGLE.value):
            model = variant(weights(drafter_folder(cfg, name)), bool(plus), fitted=fitted, on=on)
            return {kind: engine_method(model, True, cfg.temperature)}
        if name == LLAMACPP:
            return {kind: llamacpp.llamacpp_method(base, gguf)}
        return {kind: hf_method(base, cfg.temperature, PLD_TOKENS if kind == "hf-pld" else None)}

    default = default_model(True) if "default" in kinds or cfg.batch_sizes else None
    made = {core: make(core) for core in dict.fromkeys(split_mode(k)[0] for k in kinds)}
    compiled = None
    if any(split_mode(k)[1] == COMPILED for k in kinds):  # saved graphs: what generate loads by default
        from ..verifiers.compiled import CompiledBackend

        compiled = CompiledBackend(base.base, freeze=False)
    from ..verifiers.transformers import EagerBackend

    stock = EagerBackend(base.base, packed=False) if any(split_mode(k)[1] == STOCK for k in kinds) else None
    asked: dict[str, Generate] = {}  # in the order asked; a kind@exact/@compiled/@stock: each of its methods in that mode
    for kind in kinds:
        core, mode = split_mode(kind)
        methods = made[core]
        if mode == COMPILED and core.partition("+")[0] in FITTED_KINDS:  # fitted to the compiled step, as generate is
            methods = make(core, compiled)
        for m, method in methods.items():
            asked[m + mode] = (exact_method(base, method) if mode == EXACT else
                               backend_method(compiled, method) if mode == COMPILED else
                               backend_method(stock, method) if mode == STOCK else method)
    return base, asked, default
