"""The forced branch of structured outputs: the tokens a row's grammar allows alone from here
(`{"name": "` after `{` in a JSON schema's fixed keys), proposed as a chain under the root beside
any other proposer's tree. It costs no drafter call, and the base model, its logits masked by the
same grammar, accepts every forced token: the only one its mask leaves. Plain steps (budget 1)
propose nothing, so plain constrained decoding stays plain.

Glossary: L forced chain length, N tree nodes (root first).
"""

from __future__ import annotations

import torch

from ..grammar import RowGrammar
from ..tree import build_tree, with_chain
from . import Branch, Proposal, Proposer, Source

FORCED_LENGTH = 16  # forced tokens verified in one step, at most


class ForcedBranch(Proposer):
    """`inner`'s proposals plus, where the grammar forces tokens, their chain under the root."""

    def __init__(self, inner: Proposer, grammar: RowGrammar, length: int = FORCED_LENGTH):
        self.inner, self.grammar, self.length = inner, grammar, length
        self.depth_limit = max(inner.depth_limit, length)
        self._chains: dict[int, object] = {}  # L -> the chain alone under the root

    def start(self, prompt: torch.Tensor) -> None:
        self.inner.start(prompt)

    def use_graphs(self, graphs) -> None:
        self.inner.use_graphs(graphs)

    def propose(self, root: torch.Tensor, budget: int | None = None) -> Proposal | None:
        if budget == 1:
            return None
        base = self.inner.propose(root, budget)
        forced = self.grammar.forced()[: self.length]  # the grammar's state is the root's: it was consumed
        if not forced:
            return base
        tokens = torch.tensor(forced, dtype=torch.long, device=root.device)  # [L]
        branch = Branch(Source.FORCED, len(forced))
        if base is None:
            if len(forced) not in self._chains:
                self._chains[len(forced)] = build_tree([], len(forced)).to(root.device)
            return Proposal(torch.cat([root.reshape(1), tokens]), self._chains[len(forced)], (branch,))
        return base.with_branch(tokens, with_chain(base.tree, len(forced)), branch)

    def observe(self, hidden, next_tokens, nodes) -> None:
        self.inner.observe(hidden, next_tokens, nodes)

    def counters(self) -> dict[str, int]:
        return self.inner.counters()
