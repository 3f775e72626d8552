"""2. methods: our engine's methods (plain, default, medusa[:tree], dynamic, hydra, eagle, +ngram),
transformers' (hf, hf-pld) and llama.cpp's plain decoding (llamacpp.py); `run_method` asks one method every turn of one prompt -> a Record."""

from __future__ import annotations

import contextlib
import json
import logging
import time
from dataclasses import replace
from pathlib import Path

import torch

from .. import proposers
from ..config import CONFIG_NAME, CompileMode, DrafterKind, MedusaError, Numerics
from ..kernels.attention import register_attention
from ..spec import COMPILED, EXACT, FITTED_KINDS, NGRAM, SERVED, STOCK, VLLM_KINDS, VLLM_MEDUSA, DecodeSpec, parse_method
from .config import LLAMACPP, PLD_TOKENS, BenchConfig
from .prompts import Prompt, schema_valid
from .records import Generate, Record, Turn, sync

log = logging.getLogger("medusa_decoding.bench")


def engine_method(model, use_medusa: bool, temperature: float) -> Generate:
    """`plain` (use_medusa=False) or `medusa`: our engine, timed end to end, less the time a compiled
    runner spent compiling a new shape during the call (reported apart)."""
    def generate(input_ids, max_new_tokens, seed, grammar=None):
        sampling = dict(temperature=temperature, seed=seed) if temperature > 0 else {}
        compiling = model.backend.compile_s
        sync(model.device)
        t0 = time.perf_counter()
        out = model.generate(input_ids, max_new_tokens=max_new_tokens, use_medusa=use_medusa, grammar=grammar,
                             **sampling)
        sync(model.device)
        wall = time.perf_counter() - t0 - (model.backend.compile_s - compiling)
        return Turn(out.token_ids, out.text, wall, list(out.stats.accepted_lengths), list(out.stats.accepted_per_depth),
                    grammar_s=out.stats.grammar_s if grammar is not None else None)
    generate.model, generate.constrains = model, True
    return generate


def backend_method(backend, generate: Generate) -> Generate:
    """The same engine method on `backend` (compiled, or eager on stock linears) for the call."""
    def on_backend(input_ids, max_new_tokens, seed, grammar=None):
        model = generate.model
        eager, model.backend = model.backend, backend
        try:
            return generate(input_ids, max_new_tokens, seed, grammar)
        finally:
            model.backend = eager
    on_backend.backend, on_backend.constrains = backend, True
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
    def exact(input_ids, max_new_tokens, seed, grammar=None):
        with attention(model, register_attention(exact=True)):
            return generate(input_ids, max_new_tokens, seed, grammar)
    exact.constrains = True
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
            sync(model.device)
            t0 = time.perf_counter()
            with torch.inference_mode():
                out = model.base.generate(input_ids, **kwargs)
            sync(model.device)
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
        turn = generate(input_ids, max_new_tokens, seed, prompt.grammar) if prompt.schema else \
            generate(input_ids, max_new_tokens, seed)
        if prompt.schema is not None:
            try:
                valid = schema_valid(json.loads(turn.text), prompt.schema)
            except ValueError:
                valid = False
            record.valid = valid and record.valid is not False
        messages.append({"role": "assistant", "content": turn.text})
        record.token_ids.append(turn.token_ids)
        record.new_tokens += len(turn.token_ids)
        record.wall_s += turn.wall_s
        if turn.accepted_lengths is not None:
            record.accepted_lengths = (record.accepted_lengths or []) + turn.accepted_lengths
            depth = record.accepted_per_depth or [0] * len(turn.accepted_per_depth)
            record.accepted_per_depth = [a + b for a, b in zip(depth, turn.accepted_per_depth)]
        if turn.grammar_s is not None:
            record.grammar_s = (record.grammar_s or 0.0) + turn.grammar_s
        if turn.steps is not None:
            record.steps = (record.steps or 0) + turn.steps
            record.step_tokens = (record.step_tokens or 0) + turn.step_tokens
    return record


def drafter_folders(cfg: BenchConfig) -> dict[str, str]:
    """The --drafter checkpoints by kind (hydra/eagle); a kind not given decodes with the shipped one."""
    folders: dict[str, str] = {}
    for folder in cfg.drafters:
        path = Path(folder).expanduser()
        if not (path / CONFIG_NAME).is_file():
            raise MedusaError(f"--drafter {folder}: no checkpoint there (config.json naming its drafter)")
        folders.setdefault(proposers.checkpoint_kind(path), str(path))
    return folders


def checked_methods(cfg: BenchConfig):
    """The methods asked, each refused here where it cannot run, before the model loads -> (methods,
    --tree file stems, drafter folders by kind, llama.cpp's GGUF or None, vLLM's Medusa folder or None)."""
    from ..models import shipped_drafter
    from ..tree import load_tree_file

    asked = [] if cfg.batch_only else cfg.methods_asked
    for tree in cfg.trees:
        load_tree_file(tree)  # fail early, before the model loads
    stems = [Path(t).stem for t in cfg.trees]
    if len(set(stems)) < len(stems):
        raise MedusaError("two --tree files share a name; methods are named medusa:<file stem>")
    with_heads = {"medusa", "dynamic"} & {m.kind for m in asked}
    if with_heads and cfg.heads is None and shipped_drafter(cfg.model, DrafterKind.MEDUSA.value) is None:
        if cfg.methods is not None:
            raise MedusaError(f"methods {', '.join(sorted(with_heads))} need --heads: none are shipped for {cfg.model!r}")
        log.warning("note: no heads given and none shipped for %s: medusa left out", cfg.model)
        asked = [m for m in asked if m.kind not in with_heads]
    drafters = drafter_folders(cfg)
    for m in asked:
        if m.kind in (DrafterKind.HYDRA.value, DrafterKind.EAGLE.value) and m.kind not in drafters \
                and shipped_drafter(cfg.model, m.kind) is None:
            raise MedusaError(f"method {m.kind} needs --drafter DIR holding a {m.kind} checkpoint: "
                              f"none is shipped for {cfg.model!r}")
    gguf = None
    if any(m.kind == LLAMACPP for m in asked):  # refused before the model loads when it cannot run
        from . import llamacpp

        gguf = llamacpp.gguf_file(cfg.model)
        llamacpp._import()
    vllm_heads = None
    if any(m.kind in VLLM_KINDS for m in asked):
        from . import vllm_methods

        if (why := vllm_methods.available()) is not None:
            raise MedusaError(f"methods {', '.join(m.name for m in asked if m.kind in VLLM_KINDS)}: {why}")
        if any(m.kind == VLLM_MEDUSA for m in asked):
            vllm_heads = vllm_methods.medusa_folder(cfg.heads, cfg.model)
    if any(m.mode == SERVED for m in asked):
        try:
            import fastapi, httpx, uvicorn  # noqa: F401, E401
        except ImportError as e:
            raise MedusaError(f"methods {', '.join(m.name for m in asked if m.mode == SERVED)} need the server: "
                              f"pip install 'medusa-decoding[serve]' ({e})") from None
    return asked, stems, drafters, gguf, vllm_heads


def build_methods(cfg: BenchConfig):
    """Load the base once -> (the plain MedusaModel, {method name: Generate}, the default method's
    MedusaModel or None). Each method of our engine is its name's DecodeSpec (spec.parse_method),
    assembled by the library on the shared base and backend (compiled graphs too)."""
    from ..engine import MedusaModel, make_backend
    from ..models import model_folder

    asked, stems, drafters, gguf, vllm_heads = checked_methods(cfg)
    shared = cfg.spec()
    base = MedusaModel.from_pretrained(cfg.model, DecodeSpec.plain(compile=shared.compile, exact=False),
                                       dtype=cfg.dtype, device=cfg.device)
    stock = None
    eager = {Numerics.FP32: base.backend}  # by numerics: the eager backends, and the saved graphs'
    for n in {m.numerics for m in asked if m.engine} - {Numerics.FP32}:
        eager[n] = make_backend(base.base, CompileMode.OFF, numerics=n)
    compiled = {}
    for n in {m.numerics for m in asked if m.mode == COMPILED}:  # saved graphs: what generate loads by default
        from ..verifiers.compiled import CompiledBackend

        compiled[n] = CompiledBackend(base.base, freeze=False, numerics=n)
    if any(m.mode == STOCK for m in asked):
        from ..verifiers.transformers import EagerBackend

        stock = EagerBackend(base.base, packed=False)
    models: dict[tuple, MedusaModel] = {}

    def model(spec: DecodeSpec, on=None) -> MedusaModel:
        """The spec assembled on the shared base; on: the compiled backend its budget is fitted to."""
        key = (repr(spec), id(on))
        if key not in models:
            models[key] = MedusaModel.from_spec(base.base, base.tokenizer, spec, name=cfg.model,
                                                backend=eager[spec.numerics], compiled=on)
        return models[key]

    methods: dict[str, Generate] = {}  # in the order asked
    for m in asked:
        if m.kind in VLLM_KINDS:
            from . import vllm_methods

            methods[m.name] = vllm_methods.vllm_method(m.kind, base, model_folder(cfg.model), vllm_heads, cfg.ngram())
            continue
        if not m.engine:
            from . import llamacpp

            methods[m.name] = (llamacpp.llamacpp_method(base, gguf) if m.kind == LLAMACPP else
                               hf_method(base, cfg.temperature, PLD_TOKENS if m.kind == "hf-pld" else None))
            continue
        spec = m.spec(shared, drafters)
        specs = {m.name: spec}
        if m.kind == "medusa" and cfg.trees:  # one method per --tree file
            specs = {f"medusa:{stem}{NGRAM if m.ngram else ''}{m.mode}": replace(spec, tree=tree)
                     for tree, stem in zip(cfg.trees, stems)}
        # fitted to the compiled step's costs where it runs compiled, as generate is
        on = compiled[m.numerics] if m.mode == COMPILED and m.kind in FITTED_KINDS else None
        for name, s in specs.items():
            if m.mode == SERVED:
                from .serving import served_method

                methods[name] = served_method(model(s, on), cfg.temperature)
                continue
            generate = engine_method(model(s, on), True, cfg.temperature)
            methods[name] = (exact_method(base, generate) if m.mode == EXACT else
                             backend_method(compiled[m.numerics], generate) if m.mode == COMPILED else
                             backend_method(stock, generate) if m.mode == STOCK else generate)
    default = None
    if cfg.batch_sizes or any(m.kind == "default" for m in asked):
        default = model(parse_method("default").spec(shared, drafters))
    return base, methods, default
