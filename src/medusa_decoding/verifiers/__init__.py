"""Verifiers: the base model behind one interface (vLLM's scorer, in the proposer/scorer split).

Glossary: T prompt length, B rows of a step, N tree nodes of a step (the widest row's; the
others padded), A accepted nodes of a row (root first), D hidden size, V vocabulary.

A `Verifier` owns one decoder's rows (sequences): their cache, masks, positions and commits.
Nothing above it touches the model's cache or internals:
  - add(input_ids [T], room) -> (row, logits [V] of the last position, hidden [T, D]): prefill
  - verify(rows, tokens [n_b] each, trees) -> logits [B, N, V], hidden [B, N, D]: one forward,
    each row its own tree (node i at position length + depth(i), seeing its ancestors and its
    row's prefix)
  - commit(rows, nodes [A_b] each): keep only the accepted nodes' cache entries
  - release(row); context_length; stats()
A `Backend` is how the forward runs (eager or compiled) and is shared by every verifier of one
base model (compiled graphs, compile time); each decoder makes its own verifier from it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..tree import TreeBuffers


@dataclass(eq=False)
class Row:
    """A sequence held by a verifier."""

    index: int  # its row in the cache (the verifier may move it)
    length: int  # tokens in the cache


class Verifier:
    """The interface; transformers.py implements it for any Hugging Face causal LM."""

    context_length: int
    max_rows: int | None = None  # None: as many as memory allows

    def add(self, input_ids: torch.Tensor, room: int) -> tuple[Row, torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def verify(self, rows: list[Row], tokens: list[torch.Tensor], trees: list[TreeBuffers]):
        raise NotImplementedError

    def commit(self, rows: list[Row], nodes: list[torch.Tensor]) -> None:
        raise NotImplementedError

    def release(self, row: Row) -> None:
        raise NotImplementedError

    def stats(self) -> dict:
        return {}
