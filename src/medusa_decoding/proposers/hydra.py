"""Hydra heads: head k reads h_t (or the fused layers) and the embeddings of the branch it extends
(the root x_{t+1} .. x_{t+k}) and guesses x_{t+k+1}; EAGLE-2's rule grows the tree, one batched
head call per depth.

Glossary: W frontier width, k depth, D hidden size, V' shortlist.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import drafters
from ..config import DrafterKind, MedusaError
from ..training import PositionTrainer, fresh_drafter
from . import DrafterSpec, register
from .paths import PathDrafter, PathProposer, load


def expander(heads, embed, short, features: torch.Tensor, root: torch.Tensor):
    """Hydra's drafting for drafters.grow_tree: heads (HydraHeads on lean linears), the base's
    embedding and shortlisted LM head, features [k D] at the last verified position, root [1]
    -> (the depth-1 log-probs [V'], expand)."""
    h, context = heads.split(features[None])  # [1, D] each
    root_embed = embed(root.reshape(1))  # [1, D]
    first = short.log_probs(heads.head(0, h, root_embed[None], context))[0]  # [V']
    calls = [0]

    def expand(frontier, tokens, parents):
        k = calls[0] = calls[0] + 1  # the frontier is at depth k, its children are head k's
        chain, node = [], frontier
        for _ in range(k):  # walk up to the depth-1 ancestor: one step per depth
            chain.append(node)
            node = parents[node]
        ids = short.vocab[tokens[torch.stack(chain[::-1], dim=-1)]]  # [W, k]
        w = len(frontier)
        embeds = torch.cat([root_embed.expand(w, 1, -1), embed(ids)], dim=1)  # [W, k+1, D]
        return short.log_probs(heads.head(k, h.expand(w, -1), embeds, context.expand(w, -1)))

    return first, expand


class HydraDraft(nn.Module):
    """One step's drafting as a module a compiled backend compiles (verifiers.compiled.DraftGraphs):
    forward(features [k D], root [1], width, depth, budget) = grow_tree's (index [N], parent [N],
    depth [N], score [N]) on the drafter's heads, the base's embedding and shortlisted LM head."""

    def __init__(self, drafter: HydraDrafter):
        super().__init__()
        self.heads, self.embed = drafter.net, drafter.embed
        self.short = drafter.short  # a plain attribute: its weight blocks are read as the heads' are
        self.config = drafter.weights.config
        self.features = len(self.config.feature_layers or [0]) * self.config.hidden_size

    def dummy_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(features [k D], root [1]) of zeros: a graph depends on shapes, not values."""
        weight = self.short.weight
        return (weight.new_zeros(self.features), torch.zeros(1, dtype=torch.long, device=weight.device))

    def forward(self, features, root, width: int, depth: int, budget: int):
        first, expand = expander(self.heads, self.embed, self.short, features, root)
        return drafters.grow_tree(first, expand, width, depth, budget)


class HydraDrafter(PathDrafter):
    def __init__(self, module, base_model, tree=None, budget: int | None = None):
        super().__init__(module, base_model, tree, budget)
        self.depth = min(self.depth, module.config.num_heads)  # one depth per head, at most

    def proposer(self) -> HydraProposer:
        return HydraProposer(self)

    def draft_module(self) -> HydraDraft:
        return HydraDraft(self)


class HydraProposer(PathProposer):
    """A row's state: the base's hidden states at its last verified position (the drafter's
    feature layers, concatenated, where it fuses them)."""

    last_features: torch.Tensor | None = None  # [k D]

    def observe(self, hidden, next_tokens, nodes) -> None:
        self.last_features = hidden[-1]

    def _expander(self, root: torch.Tensor):
        d = self.drafter
        return expander(d.net, d.embed, d.short, self.last_features, root)

    def _graph_inputs(self, root: torch.Tensor) -> tuple:
        return self.last_features, root.reshape(1)


class HydraTrainer(PositionTrainer):
    """Hydra heads: head k reads h_t (or the fused layers, --fused) and the embeddings of the k
    tokens of its branch; losses and proposals over the shortlist."""

    reads_embeddings = True

    @property
    def fused(self) -> bool:
        return self.cfg.fused

    def new_weights(self, base, layers):
        return fresh_drafter(DrafterKind.HYDRA.value, base, self.cfg, layers, self.fused)

    def check_warm_start(self, weights, source: str) -> None:
        if (weights.config.feature_layers is not None) != self.cfg.fused:
            flag = "--fused" if weights.config.feature_layers is not None else "no --fused"
            raise MedusaError(f"--init {source} {'does not read' if self.cfg.fused else 'reads'} fused features; pass {flag}")

    def num_heads(self, weights) -> int:
        return weights.config.num_heads

    def shortlist_size(self, weights) -> int:
        return weights.config.shortlist_size


NO_EXPORT = ("no other engine runs hydra's heads: vLLM's nearest relative, IBM's MLP speculator, is recurrent "
             "(head k reads head k-1's state and one token's embedding, through LayerNorm and GELU, with embeddings "
             "and LM heads of its own), while hydra's head k reads h_t and every token of its branch at once "
             "through one SiLU MLP into the base's LM head; no setting of the one computes the other. "
             "For vLLM, train residual Medusa heads (medusa train --inner-size 0) and export those (docs/VLLM.md)")


register(DrafterKind.HYDRA, DrafterSpec(load=load, wrap=HydraDrafter, trainer=HydraTrainer, no_export=NO_EXPORT))
