"""How to decode: `DecodeSpec`, the one definition of a decoding method and of the default one.

`MedusaModel.from_pretrained(model)` (the Python API), `medusa generate` and `medusa serve` (the
CLI), and `medusa bench` (its method names, through `parse_method`) build a spec and hand it to
the library, which assembles it in one place (engine.MedusaModel.from_spec). So the method a user
gets with no options is the same everywhere: the drafter shipped for the built-in model, the
n-gram branch beside its tree, its budget fitted to this machine, compile mode auto.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from .config import CalibrationMode, CompileMode, DrafterKind, MedusaError, NgramConfig, Numerics

SHIPPED = "shipped"  # the drafter the package ships for a built-in model
DYNAMIC = "dynamic"  # Medusa heads' tree re-selected every step (EAGLE-2's rule)


@dataclass(frozen=True)
class DecodeSpec:
    """How to decode; every default here is the default of the API, the CLI, the server and the bench.

    drafter: "shipped" (the built-in model's default drafter; Medusa heads where a `tree` is given;
    none where none is shipped), "shipped:KIND" (the shipped drafter of that kind), a checkpoint
    folder (its config.json names the kind), or None (no drafter)."""

    drafter: str | None = SHIPPED
    tree: str | None = None  # Medusa heads: a tree JSON file or "dynamic" (None: calibrated tree.json, else built-in)
    tree_budget: int | None = None  # nodes of a dynamic or drafted tree, root included (None: fitted, else the checkpoint's)
    ngram: NgramConfig | None = field(default_factory=NgramConfig)  # the n-gram branch beside every tree (None: none)
    datastore: str | None = None  # where the n-gram branch looks when the context has no match (None: the context only)
    compile: CompileMode = CompileMode.AUTO  # how the verification step runs (verifiers/compiled.py)
    exact: bool | None = None  # exact mode; None: where this machine's calibration finds it nearly free (bf16, fp16)
    calibration: CalibrationMode = CalibrationMode.AUTO  # where the drafter's budget comes from (costs.py)
    numerics: Numerics = Numerics.FP32  # the arithmetic of the base's linears on a GGUF's blocks (kernels/blocks.py)

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # normalising a frozen dataclass's fields once, here
        if isinstance(self.drafter, Path):
            set_(self, "drafter", str(self.drafter))
        if isinstance(self.tree, Path):
            set_(self, "tree", str(self.tree))
        if isinstance(self.datastore, Path):
            set_(self, "datastore", str(self.datastore))
        set_(self, "ngram", _ngram(self.ngram))
        set_(self, "compile", CompileMode.parse(self.compile))
        set_(self, "calibration", CalibrationMode.parse(self.calibration))
        set_(self, "numerics", Numerics.parse(self.numerics))
        if self.drafter is not None and self.drafter.startswith(SHIPPED + ":"):
            DrafterKind.parse(self.drafter.partition(":")[2])
        if self.tree_budget is not None and self.tree_budget < 2:
            raise MedusaError(f"tree_budget must be >= 2, got {self.tree_budget}")
        if self.datastore is not None and self.ngram is None:
            raise MedusaError("a datastore feeds the n-gram branch: keep the n-gram branch on (--ngram >= 1)")
        if self.exact and self.compile is CompileMode.ON:
            raise MedusaError("exact mode runs eager: pass exact or compile, not both")

    @classmethod
    def plain(cls, **changes) -> DecodeSpec:
        """Plain decoding through the same engine (no drafter, no n-gram branch): the reference."""
        return cls(**{"drafter": None, "ngram": None} | changes)

    @property
    def speculative(self) -> bool:
        return self.drafter is not None or self.ngram is not None

    @property
    def fits_budget(self) -> bool:
        """Is the drafter's budget fitted to this machine (no tree or budget given, calibration not shipped)?"""
        return self.tree is None and self.tree_budget is None and self.calibration is not CalibrationMode.SHIPPED

    def with_options(self, **options) -> DecodeSpec:
        """This spec with some fields changed; an unknown name is refused by name."""
        known = {f.name for f in fields(self)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise MedusaError(f"unknown decoding option {unknown[0]!r}; use one of {', '.join(sorted(known))}")
        return replace(self, **options)

    def drafter_folder(self, model: str) -> Path | None:
        """The checkpoint folder this spec decodes with for `model` (None: no drafter)."""
        from .models import shipped_drafter

        if self.drafter is None:
            return None
        if self.drafter == SHIPPED:  # a tree is for Medusa heads
            return shipped_drafter(model, DrafterKind.MEDUSA.value if self.tree is not None else None)
        if self.drafter.startswith(SHIPPED + ":"):
            kind = self.drafter.partition(":")[2]
            folder = shipped_drafter(model, kind)
            if folder is None:
                raise MedusaError(f"no {kind} drafter is shipped for {model!r}; pass a checkpoint folder")
            return folder
        return Path(self.drafter).expanduser()


def _ngram(value) -> NgramConfig | None:
    """An n-gram branch from what a caller may pass: an NgramConfig, a length (0: none), True/False or None."""
    if value is None or value is False or isinstance(value, NgramConfig):
        return value or None
    if value is True:
        return NgramConfig()
    if isinstance(value, int) and value >= 0:
        return NgramConfig(length=value) if value else None
    raise MedusaError(f"ngram must be an NgramConfig, a length >= 0 or a bool, got {value!r}")


# --- bench method names -> specs ----------------------------------------------------------------

NGRAM = "+ngram"  # suffix: the same method with an n-gram branch
EXACT, COMPILED, STOCK = "@exact", "@compiled", "@stock"  # run modes of our engine's methods
SERVED = "@serve"  # run mode: the method answered by its OpenAI server in the bench's process (bench/serving.py)
AT_SHIPPED = "@shipped"  # a drafter's budget as the checkpoint ships it, not fitted to this machine
AT_INT8 = "@int8"  # the base's linears in the int8 numerics (Numerics.INT8)
ENGINE_KINDS = ("plain", "default", "medusa", "dynamic", "hydra", "eagle")  # our engine's methods
FITTED_KINDS = ("default", "hydra", "eagle")  # those whose drafter budget is fitted to the machine
VLLM, VLLM_NGRAM, VLLM_MEDUSA = "vllm", "vllm-ngram", "vllm-medusa"  # vLLM plain, its n-gram speculation, our heads
VLLM_KINDS = (VLLM, VLLM_NGRAM, VLLM_MEDUSA)
FOREIGN_KINDS = ("hf", "hf-pld", "llama.cpp", *VLLM_KINDS)  # methods that are not our engine


@dataclass(frozen=True)
class Method:
    """A bench method name, parsed: `kind[+ngram][@shipped][@int8][@exact|@compiled|@stock|@serve]`."""

    name: str
    kind: str  # one of ENGINE_KINDS or FOREIGN_KINDS
    ngram: bool = False  # +ngram
    shipped: bool = False  # @shipped: the checkpoint's own budget
    mode: str = ""  # "", EXACT, COMPILED, STOCK or SERVED
    numerics: Numerics = Numerics.FP32  # @int8: Numerics.INT8

    @property
    def core(self) -> str:
        """The name without its run mode (methods of one core share their models)."""
        return self.name.removesuffix(self.mode)

    @property
    def engine(self) -> bool:
        return self.kind in ENGINE_KINDS

    def spec(self, base: DecodeSpec = DecodeSpec(), drafters: dict[str, str] | None = None) -> DecodeSpec:
        """The spec this method decodes with (our engine's methods only). base: the bench's shared
        options (ngram length and copy run, tree budget, datastore, calibration, and `drafter`:
        --heads or the shipped default); drafters: kind -> checkpoint folder (--drafter)."""
        if not self.engine:
            raise MedusaError(f"method {self.name} is not our engine's: it has no decoding spec")
        if self.kind == "plain":
            drafter = None
        elif self.kind == "default":
            drafter = base.drafter
        elif self.kind in ("medusa", "dynamic"):  # --heads, else the shipped Medusa heads
            drafter = base.drafter if base.drafter not in (None, SHIPPED) else f"{SHIPPED}:medusa"
        else:
            drafter = (drafters or {}).get(self.kind, f"{SHIPPED}:{self.kind}")
        with_ngram = self.ngram or self.kind == "default"
        return replace(
            base, drafter=drafter, tree=DYNAMIC if self.kind == "dynamic" else None,
            ngram=(base.ngram or NgramConfig()) if with_ngram else None,
            datastore=base.datastore if with_ngram else None,
            exact=True if self.mode == EXACT else base.exact, numerics=self.numerics,
            compile=CompileMode.OFF if self.mode in (EXACT, STOCK) else base.compile,
            # Medusa heads keep their tree: only a drafter that drafts its own tree has a budget to fit
            calibration=CalibrationMode.SHIPPED if self.shipped or self.kind not in FITTED_KINDS else base.calibration,
        )


def parse_method(name: str) -> Method:
    """One bench method name -> Method; an unknown name or a suffix that does not apply is refused."""
    name = name.strip()
    rest, mode = name, ""
    for suffix in (EXACT, COMPILED, STOCK, SERVED):
        if rest.endswith(suffix):
            rest, mode = rest.removesuffix(suffix), suffix
            break
    int8 = rest.endswith(AT_INT8)
    rest = rest.removesuffix(AT_INT8)
    shipped = rest.endswith(AT_SHIPPED)
    rest = rest.removesuffix(AT_SHIPPED)
    kind, plus, suffix = rest.partition("+")
    usage = (f"use a comma-separated list of {', '.join(ENGINE_KINDS + FOREIGN_KINDS)}, "
             f"plain/medusa/dynamic/hydra/eagle optionally with {NGRAM}; {'/'.join(FITTED_KINDS)} with {AT_SHIPPED}; "
             f"any of our engine's with {AT_INT8} (before the run mode) and with {EXACT}, {COMPILED}, {STOCK} or {SERVED}")
    if kind not in ENGINE_KINDS + FOREIGN_KINDS or (plus and (f"+{suffix}" != NGRAM or kind in FOREIGN_KINDS or kind == "default")):
        raise MedusaError(f"unknown method {name!r}; {usage}")
    if shipped and kind not in FITTED_KINDS:
        raise MedusaError(f"{name}: {AT_SHIPPED} is for {', '.join(FITTED_KINDS)} (a drafter with a budget)")
    if (mode or int8) and kind in FOREIGN_KINDS:
        raise MedusaError(f"{name}: {mode or AT_INT8} is for our engine's methods")
    if int8 and mode == STOCK:
        raise MedusaError(f"{name}: {AT_INT8} runs the linears on a GGUF's blocks, {STOCK} on the stock ones")
    return Method(name, kind, bool(plus), shipped, mode, Numerics.INT8 if int8 else Numerics.FP32)
