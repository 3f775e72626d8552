"""Configuration dataclasses: one per concern, each default defined once here."""

from __future__ import annotations

import enum
import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

DEFAULT_MODEL = "smollm2-135m-instruct"
CONFIG_NAME, WEIGHTS_NAME = "config.json", "model.safetensors"  # a checkpoint folder's two files

# Medusa's notation: a path (0, 2) is head 2's third candidate under head 1's top candidate.
# These 15 paths are the first 15 nodes of the Medusa-1 Vicuna-7B tree, ordered by their
# measured joint acceptance: 16 nodes with the root, which costs ~x1.4 of a one-token step in
# bf16 on a 2-core CPU. `medusa calibrate` replaces it with a tree fitted to heads and hardware.
DEFAULT_TREE: tuple[tuple[int, ...], ...] = (
    (0,), (0, 0), (1,), (0, 1), (0, 0, 0), (1, 0), (2,), (0, 2),
    (0, 0, 1), (0, 3), (3,), (0, 1, 0), (2, 0), (4,), (0, 0, 2),
)

# A dynamic tree (EAGLE-2's rule on Medusa heads): its universe holds the paths of ranks < WIDTH
# of up to DEPTH heads (340 paths); each step keeps the BUDGET most probable nodes, root included.
DYNAMIC_WIDTH, DYNAMIC_DEPTH, DYNAMIC_BUDGET = 4, 4, 16


class MedusaError(ValueError):
    """A user error: its message is one line naming what was wrong and what is accepted."""


class DrafterKind(str, enum.Enum):
    """What proposes a step's tree: the `drafter` field of a checkpoint's config.json. Each kind
    is one file in proposers/ and one line of its registry."""

    MEDUSA = "medusa"  # K heads on the last hidden state, a static or per-step (dynamic) tree
    HYDRA = "hydra"  # sequential heads that also read the tokens of the branch they extend
    EAGLE = "eagle"  # one decoder layer that drafts features, EAGLE-2's tree rule

    @classmethod
    def parse(cls, value) -> DrafterKind:
        try:
            return cls(value)
        except ValueError:
            names = ", ".join(k.value for k in cls)
            raise MedusaError(f"unknown drafter {value!r}; use one of {names}") from None


class EagleRecipe(str, enum.Enum):
    """How an eagle drafter is trained (train.py)."""

    EAGLE1 = "eagle1"  # the last layer's feature; token loss + feature regression; 3 unrolled passes
    EAGLE3 = "eagle3"  # low, middle and last features fused; token loss only; 7 unrolled passes

    @property
    def unroll(self) -> int:
        """Its default number of unrolled passes (training-time test)."""
        return 7 if self is EagleRecipe.EAGLE3 else 3


class CalibrationMode(str, enum.Enum):
    """Where a drafter's budget comes from (costs.fit_to_machine)."""

    AUTO = "auto"  # fitted to this machine: its cached cost curve, measured first if there is none
    REFRESH = "refresh"  # fitted to this machine, measuring its cost curve again
    SHIPPED = "shipped"  # the checkpoint's own budget, as calibrated where it was trained

    @classmethod
    def parse(cls, value) -> CalibrationMode:
        try:
            return cls(value)
        except ValueError:
            raise MedusaError(f"unknown calibration {value!r}; use one of {', '.join(c.value for c in cls)}") from None


class CompileMode(str, enum.Enum):
    """How the verification step runs (verifiers/compiled.py)."""

    AUTO = "auto"  # saved graphs where this machine has them, eager meanwhile; a background process builds the rest
    ON = "on"  # every shape compiled (or loaded) on first use, the run waiting for it
    OFF = "off"  # eager

    @classmethod
    def parse(cls, value) -> CompileMode:
        if isinstance(value, bool) or value is None:
            return cls.ON if value else cls.OFF
        try:
            return cls(value)
        except ValueError:
            raise MedusaError(f"unknown compile mode {value!r}; use one of {', '.join(c.value for c in cls)}") from None


class Numerics(str, enum.Enum):
    """The arithmetic of the base's linear layers where they run on a GGUF's blocks (kernels/blocks.py):
    a numerics mode changes the model's output, and speculation stays token-identical to plain
    decoding in each one. Elsewhere (stock or packed layers, GPUs) only FP32 is built."""

    FP32 = "fp32"  # the model's own arithmetic: fp32 activations times the blocks' exact weights
    INT8 = "int8"  # activations quantized per row to int8 per block of 32 (llama.cpp's Q8_1 arithmetic)

    @classmethod
    def parse(cls, value) -> Numerics:
        try:
            return cls(value)
        except ValueError:
            raise MedusaError(f"unknown numerics {value!r}; use one of {', '.join(c.value for c in cls)}") from None


class Acceptance(str, enum.Enum):
    """How the base model's distribution decides which tree candidates to keep."""

    GREEDY = "greedy"  # exact: candidate == argmax of p
    REJECTION = "rejection"  # lossless speculative sampling on the tree
    TYPICAL = "typical"  # Medusa's typical acceptance: faster, changes the distribution


class JsonConfig:
    """A dataclass saved as a config.json: unknown keys are ignored when read back."""

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def from_dict(cls, data: dict):
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclass
class HeadsConfig(JsonConfig):
    """Shape of a set of Medusa heads; saved as the heads' config.json."""

    medusa_num_heads: int = 4  # K: head k guesses the token k+1 steps ahead
    medusa_num_layers: int = 1  # residual blocks per head
    # 0: Medusa's block x + SiLU(W x + b); > 0: x + W2 SiLU(W1 x + b1) + b2 with this inner width
    medusa_inner_size: int = 0
    hidden_size: int = 576  # D, must equal the base model's hidden size
    vocab_size: int = 49152  # V, must equal the base model's vocabulary
    base_model_name_or_path: str = DEFAULT_MODEL
    shared_lm_head: bool = True  # True: use the base model's frozen LM head
    drafter: str = DrafterKind.MEDUSA.value  # the proposer kind stored in this checkpoint


@dataclass
class SamplingConfig:
    """How the next token is drawn from the base model's logits."""

    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0  # nucleus mass kept, in (0, 1]
    top_k: int = 0  # 0 keeps the whole vocabulary
    seed: int | None = None  # seeds the torch.Generator passed to acceptance
    acceptance: Acceptance | None = None  # None: greedy at temperature 0, rejection otherwise
    typical_epsilon: float = 0.09  # typical acceptance: hard threshold on p(x)
    typical_alpha: float = 0.3  # typical acceptance: entropy-scaled threshold
    # Penalties (OpenAI's and vLLM's meanings), applied to the logits at every tree node with that
    # node's own history (acceptance.penalize), so speculation keeps plain decoding's output:
    frequency_penalty: float = 0.0  # minus this times a token's count in the output so far, in [-2, 2]
    presence_penalty: float = 0.0  # minus this for a token already in the output, in [-2, 2]
    repetition_penalty: float = 1.0  # > 0: a token in the prompt or output has its logit divided by it (times it when < 0)
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]

    def __post_init__(self) -> None:
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise MedusaError(f"{name} must be between -2 and 2, got {getattr(self, name)}")
        if not 0 < self.repetition_penalty <= 10:
            raise MedusaError(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}")
        if self.logit_bias is not None:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            bad = next((v for v in self.logit_bias.values() if not -100 <= v <= 100), None)
            if bad is not None:
                raise MedusaError(f"logit_bias values must be between -100 and 100, got {bad}")
        if self.temperature < 0:
            raise MedusaError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise MedusaError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise MedusaError(f"top_k must be >= 0, got {self.top_k}")
        if self.acceptance is not None:
            try:
                self.acceptance = Acceptance(self.acceptance)
            except ValueError:
                names = ", ".join(a.value for a in Acceptance)
                raise MedusaError(f"unknown acceptance {self.acceptance!r}; use one of {names}") from None

    @property
    def penalized(self) -> bool:
        """Does any penalty or bias change the logits?"""
        return bool(self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1
                    or self.logit_bias)

    @property
    def rule(self) -> Acceptance:
        if self.acceptance is not None:
            return self.acceptance
        return Acceptance.GREEDY if self.temperature == 0 else Acceptance.REJECTION


MAX_LOGPROBS = 20  # alternatives per token, as OpenAI's top_logprobs


class GrammarKind(str, enum.Enum):
    """What a structured output's grammar is written in (grammar.py matches it)."""

    JSON_SCHEMA = "json_schema"  # a JSON schema (its text)
    JSON_OBJECT = "json_object"  # any JSON object (OpenAI's json_object mode)
    REGEX = "regex"  # the whole output matches this regular expression
    LARK = "lark"  # a Lark grammar (llguidance's dialect)


@dataclass(frozen=True)
class Grammar:
    """What the output must match (structured outputs)."""

    kind: GrammarKind
    source: str = ""  # the schema's JSON text, the regex or the grammar (empty for json_object)

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "kind", GrammarKind(self.kind))
        except ValueError:
            raise MedusaError(f"unknown grammar kind {self.kind!r}; use one of "
                              f"{', '.join(k.value for k in GrammarKind)}") from None
        if self.kind is not GrammarKind.JSON_OBJECT and not self.source:
            raise MedusaError(f"a {self.kind.value} grammar needs its text")


@dataclass
class GenerationConfig:
    """When generation stops."""

    max_new_tokens: int = 256
    stop: list[str] = field(default_factory=list)  # stop strings, never emitted
    eos_token_ids: list[int] | None = None  # None: the model's own EOS ids
    ignore_eos: bool = False  # benchmarks may want a fixed length
    # the base model's log-probability of each emitted token, with this many most likely
    # alternatives (0: the token's own alone; None: none), from the verification pass
    logprobs: int | None = None
    grammar: Grammar | None = None  # every emitted token keeps the output valid under it (grammar.py)

    def __post_init__(self) -> None:
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise MedusaError(f"logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}")
        if self.max_new_tokens < 1:
            raise MedusaError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if any(not s for s in self.stop):
            raise MedusaError("stop strings must be non-empty")


@dataclass
class TrainConfig:
    """Medusa-1 head training on a frozen base (see train.py)."""

    model: str = DEFAULT_MODEL  # base model: alias, HF folder or .gguf
    data: str = "sharegpt"  # "sharegpt" or a JSON/JSONL file of ShareGPT-shaped records
    out: str = "runs/heads"  # heads, checkpoints, logs and metrics go here
    drafter: str = DrafterKind.MEDUSA.value  # a registered drafter kind: "medusa", "hydra", "eagle", ...
    init: str | None = None  # start from this checkpoint's weights and shape ("shipped": the one shipped of this kind)
    num_heads: int = 4  # K (hydra: the deepest level it drafts)
    num_layers: int = 1  # blocks per head
    inner_size: int = 0  # 0: Medusa's ResBlock; > 0: an MLP block of this inner width (hydra: 0 = 2 D)
    own_lm_head: bool = False  # train a full LM head per head instead of sharing the base's
    targets: str = "kd"  # "tokens": the data's next tokens; "kd": the base model's distribution
    feature_weight: float = 0.0  # EAGLE-style smooth-L1 of head k's feature onto the base's at t+k
    vocab_fraction: float = 1.0  # share of a batch's positions that pay the [V]-wide projection
    train_vocab: int = 0  # > 0: the vocabulary losses use only the most frequent label tokens
    decay: float = 0.8  # head k's (eagle: pass k's) loss is weighted decay**(k-1)
    recipe: str = "eagle1"  # eagle: "eagle1" or "eagle3" (fused features, token loss only), see EagleRecipe
    fused: bool = False  # hydra: heads read the low, middle and last layers fused (eagle: the eagle3 recipe's)
    unroll: int | None = None  # eagle: passes that read their own predicted features (None: the recipe's)
    epochs: float = 1.0  # passes over the training positions (fractions allowed)
    lr: float = 1e-3
    warmup_steps: int = 50
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    batch_size: int = 256  # positions per step and process
    grad_accum: int = 1
    max_length: int = 1024  # tokens per conversation, longer ones are truncated (counted)
    max_conversations: int | None = None  # cap on training conversations (None: all)
    eval_conversations: int = 200  # held-out conversations evaluated at the end
    dtype: str = "auto"  # dtype of the base forward and the cached features
    device: str = "auto"
    mixed_precision: str = "auto"  # "no", "bf16", "fp16"; auto: bf16 on bf16-capable GPUs and CPUs (AVX-512 BF16, AMX)
    seed: int = 0
    save_every: int = 200  # steps between checkpoints (and on SIGINT/SIGTERM)
    log_every: int = 10

    def __post_init__(self) -> None:
        self.drafter = str(getattr(self.drafter, "value", self.drafter))  # a registered kind (proposers.trainer_for)
        try:
            recipe = EagleRecipe(self.recipe)
        except ValueError:
            raise MedusaError(f"unknown recipe {self.recipe!r}; use eagle1 or eagle3") from None
        self.recipe = recipe.value
        if recipe is EagleRecipe.EAGLE3 and self.drafter != DrafterKind.EAGLE.value:
            raise MedusaError("the eagle3 recipe trains an eagle drafter (--drafter eagle)")
        if recipe is EagleRecipe.EAGLE3 and self.feature_weight > 0:
            raise MedusaError("the eagle3 recipe has no feature loss: leave --feature-weight at 0")
        if self.fused and self.drafter != DrafterKind.HYDRA.value:
            raise MedusaError("--fused trains hydra heads on fused features; an eagle drafter fuses them with "
                              "--recipe eagle3, Medusa heads read the last layer only")
        self.unroll = recipe.unroll if self.unroll is None else self.unroll
        if self.unroll < 1:
            raise MedusaError(f"unroll must be >= 1, got {self.unroll}")
        if self.targets not in ("tokens", "kd"):
            raise MedusaError(f"unknown targets {self.targets!r}; use tokens or kd")
        for name in ("num_heads", "num_layers", "batch_size", "grad_accum", "max_length", "save_every"):
            if getattr(self, name) < 1:
                raise MedusaError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.vocab_fraction <= 1:
            raise MedusaError(f"vocab_fraction must be in (0, 1], got {self.vocab_fraction}")
        if self.epochs <= 0 or self.lr <= 0:
            raise MedusaError("epochs and lr must be > 0")


@dataclass
class NgramConfig:
    """The n-gram branch: tokens copied from the context after an earlier occurrence of its
    last n tokens (prompt lookup), verified in the same forward as the head candidates."""

    # A short chain beside every tree, and copy steps once it is accepted whole: the chain's gain comes in
    # bursts, and a long chain on every step pays its nodes on all of them (docs/ENGINE.md, "The n-gram chain")
    length: int = 2  # tokens proposed: nodes of the n-gram chain under the root
    max_ngram: int = 3  # the longest suffix is matched first
    min_ngram: int = 1
    # after a step that accepted this many n-gram tokens, the next step verifies the n-gram chain
    # alone: no drafting, a smaller tree while the answer copies its context; 0: never
    copy_run: int = 2
    copy_length: int = 12  # tokens of the chain on those steps, at least `length` (a chain alone is cheap to verify)
    # where the context has no match: the longest suffix (store_max_ngram down to store_min_ngram tokens)
    # looked up in the model's datastore of its own answers (datastore.py), when it has one
    store_max_ngram: int = 8
    store_min_ngram: int = 2

    def __post_init__(self) -> None:
        if min(self.length, self.copy_length) < 1 or not 1 <= self.min_ngram <= self.max_ngram or self.copy_run < 0:
            raise MedusaError("n-gram branch: need length, copy_length >= 1, 1 <= min_ngram <= max_ngram, copy_run >= 0")
        if not 1 <= self.store_min_ngram <= self.store_max_ngram:
            raise MedusaError("n-gram branch: need 1 <= store_min_ngram <= store_max_ngram")

    @property
    def copy_chain(self) -> int:
        """Tokens of the chain a copy step verifies."""
        return max(self.copy_length, self.length)

    def copies_after(self, chain_accepted: int) -> bool:
        """The copy-step policy, for the engine, the calibration and any replay: does a step that the
        chain won with `chain_accepted` of its tokens start (or go on with) copy steps?"""
        return 0 < self.copy_run <= chain_accepted


@dataclass
class DistillConfig:
    """Self-distillation data (distill.py, `medusa distill-data`): the base's own answers."""

    max_new_tokens: int = 256  # per answer
    temperature: float = 0.0  # 0: greedy answers, what greedy decoding will see
    batch_size: int = 128  # sequences decoded together (continuous batching)
    max_prompt_tokens: int = 256  # longer first prompts are skipped (counted)
    # user turns asked per conversation: a follow-up comes after the model's own answers, and its
    # prefill recomputes the turns before it (several times a first turn's compute)
    turns: int = 1
    max_length: int = 1024  # prompt + answer tokens; a follow-up that would not fit is not asked
    layers: tuple[int, ...] | None = None  # base hidden states recorded (None: drafters.fused_layers)
    shard_size: int = 64  # conversations per feature shard: what a kill can lose
    shingle: int = 8  # contamination: words per n-gram of the near-duplicate match
    overlap: float = 0.5  # contamination: share of the shorter text's n-grams that makes a near duplicate

    def __post_init__(self) -> None:
        for name in ("max_new_tokens", "batch_size", "max_prompt_tokens", "turns", "max_length", "shard_size"):
            if getattr(self, name) < 1:
                raise MedusaError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.temperature < 0:
            raise MedusaError(f"temperature must be >= 0, got {self.temperature}")


@dataclass
class LoadConfig:
    """A load and fault test of running servers (server/load.py, `medusa load-test`)."""

    clients: int = 64  # concurrent clients
    duration_s: float = 120.0  # seconds of load
    max_tokens: int = 24  # per answer
    disconnect: float = 0.1  # share of requests that leave their stream mid-way
    bad: float = 0.1  # share of requests that are malformed (each must get a 4xx)
    seed: int = 0
    timeout_s: float = 120.0  # per request

    def __post_init__(self) -> None:
        if self.clients < 1 or self.duration_s <= 0 or self.max_tokens < 1 or self.timeout_s <= 0:
            raise MedusaError("load test: need clients >= 1, duration > 0, max_tokens >= 1, timeout > 0")
        if min(self.disconnect, self.bad) < 0 or self.disconnect + self.bad > 1:
            raise MedusaError("load test: the disconnect and malformed shares must be >= 0 and sum to <= 1")
