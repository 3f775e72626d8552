"""`MedusaModel`, the Python API in the style of transformers: a base model, a method assembled
from a DecodeSpec (`from_spec`, the one place a method is put together), and the backend it runs on.

    model = MedusaModel.from_pretrained("smollm2-135m-instruct")  # what `medusa generate` runs
    out = model.generate("Write a haiku about the sea.", max_new_tokens=64)
    print(out.text, out.stats.mean_accepted_length)
    for delta in model.stream("Tell me a joke."):
        print(delta, end="", flush=True)
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from .. import proposers
from ..config import (DEFAULT_MODEL, CalibrationMode, CompileMode, GenerationConfig, Grammar, MedusaError, NgramConfig,
                      Numerics, SamplingConfig)
from ..grammar import Grammars
from ..datastore import Datastore
from ..models import load_base, use_fast_attention
from ..proposers import Drafter
from ..spec import DecodeSpec
from ..text import TextDecoder
from ..verifiers.compiled import CompiledBackend, compiles_by_default
from ..verifiers.transformers import EagerBackend, TransformersVerifier
from .decoder import ROOT_ONLY, Decoder, GenerationStats, Method, Request, RowOutput

log = logging.getLogger(__name__)


@dataclass
class GenerationOutput:
    text: str
    token_ids: list[int]  # the new tokens, EOS included when generation ended on it
    stats: GenerationStats
    finish_reason: str  # "stop" (EOS or stop string) or "length" (max_new_tokens or context)
    # per token of token_ids where asked (logprobs=K): its log-probability and the K likeliest (id, logprob)
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None


class TextStream:
    """An iterator of text deltas; once exhausted, `.text`, `.token_ids`, `.stats` and
    `.finish_reason` describe the whole generation (text.TextDecoder's rules)."""

    def __init__(self, tokenizer, tokens: Iterator[RowOutput], stats: GenerationStats, stop: Sequence[str]):
        self._tokens = tokens
        self._text = TextDecoder(tokenizer, stop)
        self.stats = stats
        self.finish_reason = "length"  # "stop" when an EOS token or a stop string ended it
        self._logprobs: list | None = None  # per token pushed, where the request asked

    @property
    def logprobs(self) -> list[tuple[float, list[tuple[int, float]]]] | None:
        """Per kept token (token_ids), its log-probability and alternatives; None where not asked."""
        return None if self._logprobs is None else self._logprobs[: len(self.token_ids)]

    @property
    def text(self) -> str:
        return self._text.text

    @property
    def token_ids(self) -> list[int]:
        return self._text.token_ids

    def __iter__(self) -> Iterator[str]:
        text = self._text
        for out in self._tokens:
            if out.logprobs is not None:
                self._logprobs = (self._logprobs or []) + out.logprobs
            delta = text.push(out.tokens)
            if text.stopped or out.finish_reason == "stop":
                self.finish_reason = "stop"
            if out.finished or text.stopped:
                delta += text.flush()
            if delta:
                yield delta
            if text.stopped:
                self._tokens.close()
                break


def make_backend(base, compile: bool | CompileMode | str = False, like: EagerBackend | None = None,
                 numerics: Numerics = Numerics.FP32) -> EagerBackend:
    """How the base runs: eager, or compiled (mode on; mode auto where compiles_by_default), its
    linears in `numerics`. like: a backend on the same base whose lean layers the new one shares."""
    mode = CompileMode.parse(compile)
    if mode is CompileMode.AUTO and not compiles_by_default(base, numerics):
        mode = CompileMode.OFF
    if mode is CompileMode.OFF:
        return EagerBackend(base, like=like, numerics=numerics)
    return CompiledBackend(base, mode=mode, like=like, numerics=numerics)


class MedusaModel:
    """A base causal LM, a method (a drafter and an n-gram branch), and a backend (eager or
    compiled) shared by every generation."""

    def __init__(self, base, tokenizer, heads=None, tree=None, name: str = "", ngram: NgramConfig | bool | None = None,
                 tree_budget: int | None = None, backend: EagerBackend | None = None,
                 compile: bool | CompileMode | str = False, datastore: Datastore | None = None):
        """heads: drafter weights (MedusaHeads, HydraHeads, EagleLayer, any registered kind), a
        Drafter, or None (plain decoding). tree: for Medusa heads (file, paths, "dynamic").
        compile: a CompileMode (True: on, False: off). datastore: where the n-gram branch looks when
        the context has no match (None: the context only)."""
        self.base, self.tokenizer = base, tokenizer
        self.name = name or base.config.name_or_path
        # how the base runs; share one backend between models on the same base
        self.backend = backend or make_backend(base, compile)
        if heads is None or isinstance(heads, Drafter):
            self.drafter = heads
        else:
            self.drafter = proposers.wrap(heads, base, tree, tree_budget)
        self.ngram = NgramConfig() if ngram is True else (ngram or None)
        self.ngram_asked = self.ngram  # the chain asked for; a fit to the machine may run without it (costs.py)
        self.datastore = datastore
        self.spec: DecodeSpec | None = None  # the spec from_spec assembled it from (None: built by hand)
        gen = getattr(base, "generation_config", None)
        eos = getattr(gen, "eos_token_id", None) if gen is not None else None
        eos = eos if eos is not None else base.config.get_text_config().eos_token_id
        eos = eos if isinstance(eos, (list, tuple)) else [eos]
        self.eos_token_ids = {int(e) for e in eos if e is not None}
        if tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(int(tokenizer.eos_token_id))
        # structured outputs: a grammar ends on these ids (the tokenizer is wrapped on first use)
        self.grammars = Grammars(tokenizer, base.config.get_text_config().vocab_size, sorted(self.eos_token_ids))

    @property
    def heads(self):
        """The drafter's weights (None for plain decoding)."""
        return None if self.drafter is None else self.drafter.weights

    @property
    def tree(self):
        """Medusa heads' tree (static TreeBuffers or DynamicTree); the one-node tree otherwise."""
        return getattr(self.drafter, "tree", ROOT_ONLY)

    def method(self, use_medusa: bool = True, fit=None) -> Method:
        """How its rows propose (use_medusa False: plain decoding); fit: as a costs.Fit would set it
        (the model is not changed)."""
        if not use_medusa:
            return Method()
        drafter, ngram = self.fitted(fit) if fit is not None else (self.drafter, self.ngram)
        resting = drafter is not None and drafter.default_budget < 2  # a fit found no tree worth it
        return Method(None if resting else drafter, ngram, self.datastore)

    def fitted(self, fit):
        """The drafter and n-gram branch a costs.Fit chooses -> (drafter, ngram): a copy of the drafter
        at the fit's budget, and the n-gram branch asked for unless the fit turned it off."""
        drafter = self.drafter
        if fit.budget is not None and drafter is not None:
            drafter = copy.copy(drafter)  # shares the weights; its budget is its own
            drafter.set_budget(fit.budget)
        return drafter, self.ngram_asked if fit.keeps_chain else None

    def apply_fit(self, fit) -> None:
        """Decode as the costs.Fit chose from now on: the drafter's budget and the n-gram branch."""
        if fit.budget is not None and self.drafter is not None:
            self.drafter.set_budget(fit.budget)
        self.ngram = self.ngram_asked if fit.keeps_chain else None

    def verifier(self, rows: int = 1, use_medusa: bool = True) -> TransformersVerifier:
        """A verifier of its own for one decoder (the backend's compiled graphs are shared)."""
        return TransformersVerifier(self.backend, rows_hint=rows, feature_layers=self.method(use_medusa).feature_layers)

    def decoder(self, max_batch_size: int = 1, use_medusa: bool = True, policy=None) -> Decoder:
        """A decoder for up to max_batch_size sequences at once (the server's and the batch bench's)."""
        return Decoder(self.verifier(max_batch_size, use_medusa), self.method(use_medusa), self.eos_token_ids, max_batch_size,
                       policy, self.grammars)

    def tree_sizes(self, use_medusa: bool = True, fit=None) -> list[int]:
        """Node counts of the verification steps this model takes (fit: once a costs.Fit is applied):
        the shapes a compiled backend needs."""
        return self.method(use_medusa, fit).tree_sizes()

    def fit_to_machine(self, refresh: bool = False, progress: bool = True, compiled=None):
        """Choose the drafter's budget (and whether the n-gram chain runs) for this machine from its
        shipped acceptance statistics and this machine's verify and drafting costs (measured once,
        ~10-30 s, then cached under $MEDUSA_CACHE/calibration), and decode so from now on -> the
        costs.Fit, whose `line` says which calibration is in use. compiled: the compiled backend that
        will run it (compile mode auto)."""
        from ..costs import fit_to_machine

        fit = fit_to_machine(self, refresh=refresh, progress=progress, compiled=compiled)
        self.apply_fit(fit)
        return fit

    def fit_exactness(self, fit_budget: bool = True, refresh: bool = False, progress: bool = True,
                      use_medusa: bool = True, compiled=None):
        """Turn exact mode on where this machine's calibration measures it costs at most
        costs.EXACT_MAX_COST of the expected tokens/s (bf16, fp16; float32 is left as it is), fitting
        the drafter's budget in each mode when fit_budget -> a costs.ExactFit whose `lines` say what
        was chosen. compiled: as fit_to_machine's."""
        from ..costs import fit_exactness

        chosen = fit_exactness(self, fit_budget, refresh=refresh, progress=progress, use_medusa=use_medusa,
                               compiled=compiled)
        if chosen.fit is not None:
            self.apply_fit(chosen.fit)
        if chosen.exact:
            use_fast_attention(self.base, exact=True)
        return chosen

    def warmup(self, max_slots: int, use_medusa: bool = True) -> float:
        """Compile every verification shape for sequences up to max_slots tokens (prompt and answer)
        -> seconds; nothing to do for an eager backend."""
        return self.backend.warmup(self.tree_sizes(use_medusa), max_slots)

    @property
    def device(self) -> torch.device:
        return next(self.base.parameters()).device

    @classmethod
    def from_pretrained(cls, model: str = DEFAULT_MODEL, spec: DecodeSpec | None = None, *, dtype: str = "auto",
                        device: str = "auto", attn_implementation: str = "auto", progress: bool = True,
                        report: Callable[[str], None] | None = None, **options) -> MedusaModel:
        """Load a base model (built-in alias, HF folder or .gguf) and decode as `spec` says.

        With no spec and no options this is what `medusa generate` runs: the drafter shipped for a
        built-in model with the n-gram branch, its budget fitted to this machine, compile mode auto.
        options: DecodeSpec fields that change the spec (drafter, tree, tree_budget, ngram,
        datastore, compile, exact, calibration); `heads` is another name for `drafter` (None: no
        drafter). attn_implementation: a transformers name, "auto" (the short-query kernel where the
        model fits it) or "exact" (exact mode). progress: bars on stderr while this machine is measured;
        report: where the lines saying what the fits chose go (default: this module's logger)."""
        if "heads" in options:
            options["drafter"] = options.pop("heads")
        spec = (spec or DecodeSpec()).with_options(**options)
        if attn_implementation == "exact":
            spec = spec.with_options(exact=True)
        if spec.exact and spec.compile is CompileMode.AUTO:
            spec = spec.with_options(compile=CompileMode.OFF)  # exact mode's kernels are eager ones
        base, tokenizer, _ = load_base(model, dtype=dtype, device=device,
                                       attn_implementation="exact" if spec.exact else attn_implementation)
        return cls.from_spec(base, tokenizer, spec, name=model, progress=progress, report=report)

    @classmethod
    def from_spec(cls, base, tokenizer, spec: DecodeSpec, name: str = "", backend: EagerBackend | None = None,
                  compiled: EagerBackend | None = None, progress: bool = True,
                  report: Callable[[str], None] | None = None) -> MedusaModel:
        """Assemble `spec` on a loaded base: the one place a method is put together. Its drafter, tree,
        n-gram branch and datastore; its budget fitted to this machine where the spec asks (and exact
        mode chosen where `spec.exact` is None; the lines saying what was chosen are logged); then the
        backend it runs on. backend: share one (a bench's methods share the base's); compiled: the
        compiled backend whose costs a shared eager backend's budget is fitted to (a bench's @compiled)."""
        report = report or (lambda line: log.info("%s", line))
        folder = spec.drafter_folder(name)
        if spec.drafter is not None and folder is None and name == DEFAULT_MODEL:
            report(f"note: no drafter is shipped for {name}: " + ("the n-gram branch alone" if spec.ngram else "plain decoding"))
        heads = proposers.load(folder, base) if folder is not None else None
        store = Datastore.load(spec.datastore) if spec.datastore is not None else None
        auto = None  # compile mode auto: its saved graphs are loaded once the fits have chosen exact mode
        if backend is None:
            backend = make_backend(base, CompileMode.OFF if spec.compile is CompileMode.AUTO else spec.compile,
                                   numerics=spec.numerics)
            if spec.compile is CompileMode.AUTO and not spec.exact and compiles_by_default(base, spec.numerics):
                compiled = auto = make_backend(base, CompileMode.AUTO, like=backend, numerics=spec.numerics)
        elif backend.numerics is not spec.numerics:
            raise MedusaError(f"numerics {spec.numerics.value} asked on a backend in {backend.numerics.value}")
        model = cls(base, tokenizer, heads=heads, tree=spec.tree, name=name, ngram=spec.ngram,
                    tree_budget=spec.tree_budget, backend=backend, datastore=store)
        model.spec = spec
        if spec.exact:  # asked for: refused where this machine's kernels cannot keep its promise
            from ..costs import exact_blocker

            why = exact_blocker(model)
            if why is not None:
                raise MedusaError(f"exact mode cannot keep its promise on this machine: {why}; drop --exact "
                                  "(the output may then drift from plain decoding's after a near-tie) or use float32")
        fit = model.drafter is not None and spec.fits_budget
        refresh = spec.calibration is CalibrationMode.REFRESH
        lines: list[str] = []
        if spec.exact is None and spec.calibration is not CalibrationMode.SHIPPED:  # exact where (nearly) free here
            lines = model.fit_exactness(fit, refresh=refresh, progress=progress, use_medusa=spec.speculative,
                                        compiled=compiled).lines
        elif fit:
            lines = [model.fit_to_machine(refresh=refresh, progress=progress, compiled=compiled).line]
        for line in lines:
            report(line)
        if auto is not None and compiles_by_default(base, spec.numerics):
            model.backend = auto  # exact mode, once chosen, stays eager
        return model

    def encode(self, prompt: str | list[dict], chat: bool | None = None) -> torch.Tensor:
        """A prompt (text, or chat messages) -> input_ids [1, T] on the model's device."""
        if isinstance(prompt, str) and not prompt.strip():
            raise MedusaError("the prompt is empty")
        if chat is None:
            chat = self.tokenizer.chat_template is not None
        if chat or isinstance(prompt, list):
            if self.tokenizer.chat_template is None:
                raise MedusaError(f"{self.name} has no chat template; use a plain prompt (--no-chat)")
            messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
        else:
            ids = self.tokenizer(prompt, add_special_tokens=True)["input_ids"]
        return torch.tensor([list(ids)], dtype=torch.long, device=self.device)

    def stream(
        self,
        prompt: str | list[dict] | torch.Tensor,
        max_new_tokens: int = GenerationConfig.max_new_tokens,
        chat: bool | None = None,
        stop: Sequence[str] = (),
        use_medusa: bool = True,
        ignore_eos: bool = False,
        logprobs: int | None = None,
        grammar: Grammar | None = None,
        **sampling,
    ) -> TextStream:
        """Generate and stream text deltas. `sampling`: SamplingConfig fields (temperature, top_p,
        top_k, seed, acceptance, frequency/presence/repetition penalties, logit_bias, ...). A tensor
        prompt is taken as input_ids [1, T]. use_medusa=False: plain decoding (no drafter, no
        n-gram branch), the baseline. logprobs=K: each token's log-probability and its K likeliest
        alternatives (the stream's `.logprobs`). grammar: the output must match it (a config.Grammar:
        a JSON schema, any JSON object, a regex or a Lark grammar), losslessly under the constraint."""
        generation = GenerationConfig(max_new_tokens=max_new_tokens, stop=list(stop), ignore_eos=ignore_eos,
                                      logprobs=logprobs, grammar=grammar)
        request = Request(prompt if isinstance(prompt, torch.Tensor) else self.encode(prompt, chat), generation,
                          SamplingConfig(**sampling), stats=GenerationStats())
        return TextStream(self.tokenizer, self._outputs(request, use_medusa), request.stats, generation.stop)

    def _outputs(self, request: Request, use_medusa: bool) -> Iterator[RowOutput]:
        """The one-row case of the decode loop."""
        decoder = self.decoder(1, use_medusa)
        try:
            out = decoder.add(request)
            yield out
            while not out.finished:
                (out,) = decoder.step()
                yield out
        finally:  # also when the consumer stops early (a stop string): the row is released
            decoder.close()

    def generate(self, prompt, max_new_tokens: int = GenerationConfig.max_new_tokens, **kwargs) -> GenerationOutput:
        """Generate to the end and return the text, the new token ids and the stats."""
        stream = self.stream(prompt, max_new_tokens=max_new_tokens, **kwargs)
        for _ in stream:
            pass
        return GenerationOutput(stream.text, stream.token_ids, stream.stats, stream.finish_reason, stream.logprobs)
