"""What `medusa bench` runs: its options (checked before any model loads) and constants."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from ..config import DEFAULT_MODEL, CalibrationMode, GenerationConfig, MedusaError, NgramConfig, SamplingConfig

log = logging.getLogger("medusa_decoding.bench")


SUITES = ("spec-bench", "humaneval", "sharegpt")
# default: what `medusa generate` runs with no method options (the shipped drafter, or --heads, with
# the n-gram branch), whatever drafter that is
METHOD_KINDS = ("plain", "default", "medusa", "dynamic", "hydra", "eagle", "hf", "hf-pld", "llama.cpp")
NGRAM = "+ngram"  # suffix: the same method with an n-gram branch (plain+ngram: prompt lookup in our engine)
EXACT = "@exact"  # suffix of our engine's methods: in exact mode (attention.exact_attention), checked against plain@exact
# suffix of our engine's methods: on the compiled step (saved graphs, what `generate` loads by default;
# built or loaded before a shape is timed), interleaved with the eager ones
COMPILED = "@compiled"
# suffix of our engine's methods: eager on the model's stock linear layers (no prepacked weights,
# verifiers/packed.py), interleaved with the default packed ones
STOCK = "@stock"
# suffix of default/hydra/eagle: the checkpoint's own budget, not the one fitted to this machine (costs.py)
SHIPPED = "@shipped"
FITTED_KINDS = ("default", "hydra", "eagle")
DEFAULT_METHODS = "plain,default,hf,hf-pld"
REFERENCE, BASELINE = "plain", "hf"  # speed-ups are reported against both
LLAMACPP = "llama.cpp"  # plain greedy decoding of the same GGUF by llama.cpp: speed-ups against it too, when run
FOREIGN = ("hf", "hf-pld", LLAMACPP)  # methods that are not our engine
PLD_TOKENS = 10  # transformers' prompt_lookup_num_tokens
WARMUP_TOKENS = 16


def split_mode(kind: str) -> tuple[str, str]:
    """A method kind -> (the kind, its run-mode suffix @exact/@compiled/@stock or '')."""
    for mode in (EXACT, COMPILED, STOCK):
        if kind.endswith(mode):
            return kind.removesuffix(mode), mode
    return kind, ""


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
        for kind in self.method_kinds:
            core, mode = split_mode(kind)
            if mode == EXACT and (core in FOREIGN or self.compile):
                raise MedusaError(f"{kind}: {EXACT} is for our engine's methods, which it runs eager (no --compile)")
            if mode in (COMPILED, STOCK) and (core in FOREIGN or self.compile):
                raise MedusaError(f"{kind}: {mode} is for our engine's methods run eager beside it (no --compile)")
            if kind == LLAMACPP and self.temperature > 0:
                raise MedusaError(f"method {LLAMACPP} is plain greedy decoding: run it at temperature 0")
            if core.endswith(SHIPPED) and core.removesuffix(SHIPPED).partition("+")[0] not in FITTED_KINDS:
                raise MedusaError(f"{kind}: {SHIPPED} is for {', '.join(FITTED_KINDS)} (a drafter with a budget)")
            base, plus, suffix = core.removesuffix(SHIPPED).partition("+")
            if base not in METHOD_KINDS or (plus and (f"+{suffix}" != NGRAM or base in FOREIGN or base == "default")):
                raise MedusaError(f"unknown method {kind!r}; use a comma-separated list of {', '.join(METHOD_KINDS)}, "
                                  f"plain/medusa/dynamic/hydra/eagle optionally with {NGRAM}; {'/'.join(FITTED_KINDS)} with {SHIPPED}; "
                                  f"any but hf*/{LLAMACPP} with {EXACT}, {COMPILED} or {STOCK}")
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
        """The method kinds without their +ngram suffix."""
        return {split_mode(k)[0].removesuffix(SHIPPED).partition("+")[0] for k in self.method_kinds}

    @property
    def method_kinds(self) -> list[str]:
        kinds = [m.strip() for m in (self.methods or DEFAULT_METHODS).split(",") if m.strip()]
        if not kinds:
            raise MedusaError(f"no method given; use a comma-separated list of {', '.join(METHOD_KINDS)}")
        return list(dict.fromkeys(kinds))
