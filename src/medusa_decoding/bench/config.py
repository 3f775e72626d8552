"""What `medusa bench` runs: its options (checked before any model loads) and constants."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from ..config import DEFAULT_MODEL, CalibrationMode, CompileMode, GenerationConfig, MedusaError, NgramConfig, SamplingConfig
from ..spec import ENGINE_KINDS, EXACT, FOREIGN_KINDS, SHIPPED, VLLM, VLLM_KINDS, DecodeSpec, Method, parse_method
from .prompts import SUITES

log = logging.getLogger("medusa_decoding.bench")


DEFAULT_METHODS = "plain,default,hf,hf-pld"
REFERENCE, BASELINE = "plain", "hf"  # speed-ups are reported against both
LLAMACPP = "llama.cpp"  # plain greedy decoding of the same GGUF by llama.cpp: speed-ups against it too, when run
OTHER_ENGINES = (LLAMACPP, VLLM)  # llama.cpp's and vLLM's plain decoding: speed-ups against them too, when run
PLD_TOKENS = 10  # transformers' prompt_lookup_num_tokens
WARMUP_TOKENS = 16


@dataclass
class BenchConfig:
    """What `medusa bench` runs; checked before any model loads."""

    model: str = DEFAULT_MODEL
    heads: str | None = None  # heads folder; None: the heads shipped for a built-in model, if any
    prompts: str | None = None  # a Spec-Bench-shaped JSONL file ...
    suite: str | None = None  # ... or a suite (prompts.SUITES); neither: the built-in one
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
    ngram_copy_run: int = NgramConfig.copy_run  # chain tokens accepted that start copy steps (0: none)
    tree_budget: int | None = None  # nodes of the "dynamic" method's tree (16) or a drafter's (its own)
    batch_sizes: list[int] | None = None  # also measure plain vs medusa batched at each of these sizes
    batch_only: bool = False  # ... and skip the per-prompt method comparison
    compile: bool = False  # torch.compile our engine's verify step (compile time is reported, not timed)
    calibration: str = CalibrationMode.AUTO.value  # drafter budgets: fitted to this machine, or the shipped ones
    datastore: str | None = None  # a datastore file (datastore.py) for the n-gram chains of default and +ngram methods

    def ngram(self) -> NgramConfig:
        """The n-gram branch of default and the +ngram methods."""
        return NgramConfig(length=self.ngram_length, copy_run=self.ngram_copy_run)

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
        for method in self.methods_asked:
            if method.mode == EXACT and self.compile:
                raise MedusaError(f"{method.name}: {EXACT} is for our engine's methods, which it runs eager (no --compile)")
            if method.mode and self.compile:
                raise MedusaError(f"{method.name}: {method.mode} is for our engine's methods run eager beside it (no --compile)")
            if method.kind in (LLAMACPP, *VLLM_KINDS) and self.temperature > 0:
                raise MedusaError(f"method {method.kind} decodes greedily here: run it at temperature 0")
        self.calibration = CalibrationMode.parse(self.calibration).value
        if self.datastore is not None and not Path(self.datastore).expanduser().is_file():
            raise MedusaError(f"--datastore {self.datastore}: no such file (medusa datastore writes one)")
        if self.ngram_length < 1 or (self.tree_budget is not None and self.tree_budget < 2):
            raise MedusaError("ngram_length must be >= 1 and tree_budget >= 2")
        if self.ngram_copy_run < 0:
            raise MedusaError(f"ngram_copy_run must be >= 0 (0: no copy steps), got {self.ngram_copy_run}")
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
        """The kinds of the methods asked (plain, default, medusa, ..., hf, llama.cpp)."""
        return {m.kind for m in self.methods_asked}

    @property
    def method_kinds(self) -> list[str]:
        """The method names asked, in order, each once."""
        kinds = [m.strip() for m in (self.methods or DEFAULT_METHODS).split(",") if m.strip()]
        if not kinds:
            raise MedusaError(f"no method given; use a comma-separated list of {', '.join(ENGINE_KINDS + FOREIGN_KINDS)}")
        return list(dict.fromkeys(kinds))

    @property
    def methods_asked(self) -> list[Method]:
        return [parse_method(k) for k in self.method_kinds]

    def spec(self) -> DecodeSpec:
        """The options every method of our engine shares (spec.Method.spec makes each one's from it):
        --heads (else the shipped drafter), the n-gram branch, --tree-budget, --datastore,
        --calibration; eager unless --compile; the fast mode (@exact runs exact mode)."""
        return DecodeSpec(drafter=self.heads or SHIPPED, tree_budget=self.tree_budget, ngram=self.ngram(),
                          datastore=self.datastore, compile=CompileMode.ON if self.compile else CompileMode.OFF,
                          exact=False, calibration=self.calibration)
