"""Drafts that respect the grammar: a row's proposals without the candidates its grammar forbids.

The outermost proposer of a row with a grammar: it walks each proposal's tree with the row's
matcher (grammar.RowGrammar.walk), drops every node whose token the grammar forbids after its
path (and the node's subtree), and hands the kept nodes' masks to the verification step, which
would otherwise walk the same tree again. Where the drafter scores its nodes (Drafter.scored:
hydra, eagle) it is asked for OVERDRAFT times the budget and the best valid nodes fill the
budget, so the nodes the grammar frees go to valid candidates; a static tree (Medusa heads) is
only pruned. Chains (forced tokens, n-gram) keep their valid prefix. Lossless either way: a
forbidden node could never be accepted (its parent's masked logits give it no probability).

Glossary: N nodes of the inner proposal, M kept nodes (root first), W words of a bitmask.
"""

from __future__ import annotations

import torch

from ..drafters import keep_order
from ..grammar import RowGrammar
from ..tree import tree_from_parents
from . import Branch, Proposal, Proposer

OVERDRAFT = 2  # a scored drafter is asked for this many times the budget's nodes


class GrammarFilter(Proposer):
    """`inner`'s proposals, pruned to the nodes `grammar` allows."""

    def __init__(self, inner: Proposer, grammar: RowGrammar, own_budget: int | None = None):
        """own_budget: the scored drafter's budget when the step gives none (None: the drafter
        is not scored, its proposals are only pruned)."""
        self.inner, self.grammar, self.own_budget = inner, grammar, own_budget
        self.depth_limit = inner.depth_limit
        self.kept: torch.Tensor | None = None  # [M] long: the inner proposal's node of each kept node

    def start(self, prompt: torch.Tensor) -> None:
        self.inner.start(prompt)

    def use_graphs(self, graphs) -> None:
        self.inner.use_graphs(graphs)

    def propose(self, root: torch.Tensor, budget: int | None = None) -> Proposal | None:
        self.kept = None
        if budget == 1:
            return None
        wanted = budget if budget is not None else self.own_budget
        ask = OVERDRAFT * wanted if self.own_budget is not None and wanted else budget
        p = self.inner.propose(root, ask)
        if p is None:
            return None
        bits, valid = self.grammar.walk(p.tokens, p.tree)  # [N, W], [N]
        n = p.tokens.numel()
        keep = torch.tensor(valid, device=p.tokens.device)  # [N] bool
        # the drafter's scored nodes come first, then the chains (forced, n-gram), unscored
        head = p.score.numel() if p.score is not None else n
        if p.score is not None and wanted and int(keep[:head].sum()) > wanted:
            rank = keep_order(p.score, p.tree.depth[:head]).masked_fill(~keep[:head], float("-inf"))
            rank[0] = float("inf")  # the root stays
            best = torch.zeros(head, dtype=torch.bool, device=keep.device)
            best[rank.topk(wanted).indices] = True
            keep[:head] &= best
        if bool(keep.all()):
            p.masks = bits
            return p
        kept = keep.nonzero()[:, 0]  # [M], ascending: parents before children, chains still last
        remap = torch.full((n,), -1, dtype=torch.long, device=kept.device)
        remap[kept] = torch.arange(kept.numel(), device=kept.device)
        parent = p.tree.parent[kept]
        parent = torch.where(parent >= 0, remap[parent.clamp(min=0)], -1)
        depth = p.tree.depth[kept]
        tree = tree_from_parents(parent, depth, int(depth.max()))
        branches, end = [], n  # each chain's valid prefix, the last chain last
        for branch in reversed(p.branches):
            valid_nodes = int(keep[end - branch.length: end].sum())
            end -= branch.length
            if valid_nodes:
                branches.insert(0, Branch(branch.source, valid_nodes))
        self.kept = kept
        return Proposal(p.tokens[kept], tree, tuple(branches), score=None, masks=bits[kept])

    def observe(self, hidden, next_tokens, nodes) -> None:
        if nodes is not None and self.kept is not None:
            nodes = self.kept[nodes]  # the inner proposal's own node numbers
        self.inner.observe(hidden, next_tokens, nodes)

    def counters(self) -> dict[str, int]:
        return self.inner.counters()
