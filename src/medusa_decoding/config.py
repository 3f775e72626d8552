"""Configuration dataclasses: one per concern, each default defined once here."""

from __future__ import annotations

import enum
import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

DEFAULT_MODEL = "smollm2-135m-instruct"

# Medusa's notation: a path (0, 2) is head 2's third candidate under head 1's top candidate.
# These 15 paths are the first 15 nodes of the Medusa-1 Vicuna-7B tree, ordered by their
# measured joint acceptance: 16 nodes with the root, which costs ~x1.4 of a one-token step in
# bf16 on a 2-core CPU. `medusa calibrate` replaces it with a tree fitted to heads and hardware.
DEFAULT_TREE: tuple[tuple[int, ...], ...] = (
    (0,), (0, 0), (1,), (0, 1), (0, 0, 0), (1, 0), (2,), (0, 2),
    (0, 0, 1), (0, 3), (3,), (0, 1, 0), (2, 0), (4,), (0, 0, 2),
)


class MedusaError(ValueError):
    """A user error: its message is one line naming what was wrong and what is accepted."""


class Acceptance(str, enum.Enum):
    """How the base model's distribution decides which tree candidates to keep."""

    GREEDY = "greedy"  # exact: candidate == argmax of p
    REJECTION = "rejection"  # lossless speculative sampling on the tree
    TYPICAL = "typical"  # Medusa's typical acceptance: faster, changes the distribution


@dataclass
class HeadsConfig:
    """Shape of a set of Medusa heads; saved as the heads' config.json."""

    medusa_num_heads: int = 4  # K: head k guesses the token k+1 steps ahead
    medusa_num_layers: int = 1  # residual blocks x + SiLU(W x + b) per head
    hidden_size: int = 576  # D, must equal the base model's hidden size
    vocab_size: int = 49152  # V, must equal the base model's vocabulary
    base_model_name_or_path: str = DEFAULT_MODEL
    shared_lm_head: bool = True  # True: use the base model's frozen LM head
    drafter: str = "medusa"  # the proposer kind stored in this checkpoint

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def from_dict(cls, data: dict) -> HeadsConfig:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


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

    def __post_init__(self) -> None:
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
    def rule(self) -> Acceptance:
        if self.acceptance is not None:
            return self.acceptance
        return Acceptance.GREEDY if self.temperature == 0 else Acceptance.REJECTION


@dataclass
class GenerationConfig:
    """When generation stops."""

    max_new_tokens: int = 256
    stop: list[str] = field(default_factory=list)  # stop strings, never emitted
    eos_token_ids: list[int] | None = None  # None: the model's own EOS ids
    ignore_eos: bool = False  # benchmarks may want a fixed length

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise MedusaError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if any(not s for s in self.stop):
            raise MedusaError("stop strings must be non-empty")
