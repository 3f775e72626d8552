"""Hydra heads: head k reads h_t and the embeddings of the branch it extends (the root x_{t+1}
.. x_{t+k}) and guesses x_{t+k+1}; EAGLE-2's rule grows the tree, one batched head call per depth.

Glossary: W frontier width, k depth, D hidden size, V' shortlist.
"""

from __future__ import annotations

import torch

from ..config import DrafterKind
from . import DrafterSpec, register
from .paths import PathDrafter, PathProposer, load


class HydraDrafter(PathDrafter):
    def __init__(self, module, base_model, tree=None, budget: int | None = None):
        super().__init__(module, base_model, tree, budget)
        self.depth = min(self.depth, module.config.num_heads)  # one depth per head, at most

    def proposer(self) -> HydraProposer:
        return HydraProposer(self)


class HydraProposer(PathProposer):
    """A row's state: the hidden state of its last verified position."""

    last_hidden: torch.Tensor | None = None  # [D]

    def observe(self, hidden, next_tokens, nodes) -> None:
        self.last_hidden = hidden[-1]

    def _expander(self, root: torch.Tensor):
        d = self.drafter
        heads, h, embed, short = d.net, self.last_hidden, d.embed, d.short
        root_embed = embed(root.reshape(1))  # [1, D]
        first = short.log_probs(heads.head(0, h[None], root_embed[None]))[0]  # [V']
        calls = [0]

        def expand(frontier, tokens, parents):
            k = calls[0] = calls[0] + 1  # the frontier is at depth k, its children are head k's
            chain, node = [], frontier
            for _ in range(k):  # walk up to the depth-1 ancestor: one step per depth
                chain.append(node)
                node = parents[node]
            ids = short.vocab[tokens[torch.stack(chain[::-1], dim=-1)]]  # [W, k]
            embeds = torch.cat([root_embed.expand(len(frontier), 1, -1), embed(ids)], dim=1)  # [W, k+1, D]
            return short.log_probs(heads.head(k, h.expand(len(frontier), -1), embeds))

        return first, expand


register(DrafterKind.HYDRA, DrafterSpec(load=load, wrap=HydraDrafter))
