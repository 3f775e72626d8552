"""What the path-aware drafters (hydra.py, eagle.py) share: a checkpoint's drafting options,
the base's embedding and shortlisted LM head, and EAGLE-2's rule (drafters.grow_tree) turning
per-depth guesses into a tree.

Glossary: N tree nodes (root first), W nodes expanded per depth, D hidden, V' shortlist.
"""

from __future__ import annotations

import time

from pathlib import Path

import torch

from .. import drafters
from ..config import MedusaError
from ..tree import tree_from_parents
from ..kernels import draft_linears
from . import Drafter, Proposal, Proposer, read_acceptance


class PathDrafter(Drafter):
    """A hydra or eagle drafter on its base: weights, shortlist, drafting depth/width/budget."""

    scored = True  # grow_tree's cumulative log-probs

    def __init__(self, module, base_model, tree=None, budget: int | None = None):
        if tree is not None and not (isinstance(tree, str) and tree == "dynamic"):
            raise MedusaError(f"a {module.kind} drafter drafts its own tree every step; give no tree file")
        module.check_fits(base_model)
        weight = base_model.get_output_embeddings().weight
        self.weights = module.to(device=weight.device, dtype=weight.dtype).eval().requires_grad_(False)
        self.kind = module.kind
        cfg = module.config
        self.embed = base_model.get_input_embeddings()
        self.short = module.shortlist(base_model)
        # what drafting runs: the weights, their linears prepacked (bf16/fp16) or on Q8_0 blocks (fp32),
        # the shortlist on the LM head's (kernels/packed.py, blocks.py); `weights` stays stock
        self.net = draft_linears(self.weights)
        self.short.pack()
        self.width, self.depth = cfg.draft_width, cfg.draft_depth
        self.budget = budget or cfg.draft_budget
        if budget is not None and budget < 2:
            raise MedusaError(f"a drafted tree needs a budget of at least 2 nodes, got {budget}")
        self.source = getattr(module, "source", None)  # the checkpoint folder, when loaded from one
        layers = getattr(cfg, "feature_layers", None)
        self.feature_layers = tuple(layers) if layers else None

    def tree_sizes(self) -> set[int]:
        return {self.budget}

    def acceptance(self, ngram=None) -> dict[int, float] | None:
        return read_acceptance(self.source, ngram)

    def set_budget(self, budget: int) -> None:
        if budget < 1:
            raise MedusaError(f"a drafted tree needs a budget of at least 1 node (the root), got {budget}")
        self.budget = budget

    def describe(self) -> str:
        return f"{self.kind} (drafted {self.budget}-node tree)" if self.budget > 1 else f"{self.kind} (resting: no tree)"


class PathProposer(Proposer):
    """A row's drafting: `_expander(root)` gives the depth-1 log-probs and the expand function
    of drafters.grow_tree."""

    def __init__(self, drafter: PathDrafter):
        self.drafter = drafter
        self.depth_limit = drafter.depth
        self.graphs = None  # compiled drafting (verifiers.compiled.DraftGraphs), where the backend has it

    def use_graphs(self, graphs) -> None:
        self.graphs = graphs

    def _expander(self, root: torch.Tensor):
        raise NotImplementedError

    def _graph_inputs(self, root: torch.Tensor) -> tuple | None:
        """What the drafter's draft_module reads this step besides its sizes (None: it has none)."""
        return None

    def propose(self, root: torch.Tensor, budget: int | None = None) -> Proposal | None:
        d = self.drafter
        budget = d.budget if budget is None else budget
        if budget < 2:
            return None
        depth = min(d.depth, budget - 1)
        inputs = self._graph_inputs(root) if self.graphs is not None else None
        key = (d.width, depth, budget)
        drafted = self.graphs.run(key, inputs) if inputs is not None else None
        if drafted is None:  # eager: no compiled drafting, or its graph is not built (or loaded) yet
            t0 = time.perf_counter()
            first, expand = self._expander(root)
            drafted = drafters.grow_tree(first, expand, d.width, depth, budget)
            if inputs is not None:
                self.graphs.ran_eager(key, time.perf_counter() - t0)
        index, parent, node_depth, score = drafted
        tokens = d.short.vocab[index]
        tokens[0] = root
        return Proposal(tokens, tree_from_parents(parent, node_depth, depth), score=score)


def load(folder: Path, base_model):
    module = drafters.from_pretrained(folder, base_model)
    module.source = folder  # where its acceptance.json may be
    return module
