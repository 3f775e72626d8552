"""What a bench run records: a method's answer to one turn (Turn), to one prompt (Record), and the
signature every method has (Generate)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass
class Turn:
    token_ids: list[int]  # new tokens, up to and including the first EOS
    text: str
    wall_s: float
    accepted_lengths: list[int] | None = None  # our engine only: tokens per step, bonus included
    accepted_per_depth: list[int] | None = None
    # another engine's counts, where it keeps no per-step lengths (vLLM): steps that verified a
    # draft, and the tokens those steps emitted (bonus included)
    steps: int | None = None
    step_tokens: int | None = None
    grammar_s: float | None = None  # our engine under a grammar: time in the grammar's matcher and masks


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
    steps: int | None = None  # Turn.steps and step_tokens, summed over the turns
    step_tokens: int | None = None
    valid: bool | None = None  # every answer valid under the prompt's schema (None: the prompt has none)
    grammar_s: float | None = None  # Turn.grammar_s, summed over the turns

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0


# (input_ids [1, T], max_new_tokens, seed, grammar: config.Grammar | None) -> Turn; a method that
# decodes under a grammar says so with an attribute `constrains = True`
Generate = Callable[..., Turn]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
