"""Medusa heads: K heads read the last verified hidden state; head k's top candidates fill the
nodes at depth k of a static tree, or of a tree re-selected every step (dynamic: EAGLE-2's rule,
the most probable paths by the heads' joint probability).

Glossary: K heads, N tree nodes (root first), D hidden size, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from ..config import DEFAULT_TREE, DYNAMIC_BUDGET, DYNAMIC_DEPTH, DYNAMIC_WIDTH, DrafterKind, MedusaError
from .. import interop
from ..heads import MedusaHeads
from ..tree import (DynamicTree, TreeBuffers, build_tree, dynamic_tree, load_tree_file, select_tree, tree_tokens,
                    validate_paths)
from ..kernels import draft_linears, lean_linears
from ..spec import DYNAMIC
from ..training import PositionTrainer
from . import Drafter, DrafterSpec, Proposal, Proposer, register

TREE_NAME = "tree.json"  # a calibrated tree saved next to the heads (medusa calibrate)


def fit_tree(tree, num_heads: int, budget: int | None) -> TreeBuffers | DynamicTree:
    """tree: None (the default tree, cut to the heads), "dynamic", a JSON file, paths, TreeBuffers
    or DynamicTree -> the tree the heads fill; refuses a tree deeper than the heads."""
    if tree is None:
        return build_tree([p for p in DEFAULT_TREE if len(p) <= num_heads])
    if isinstance(tree, DynamicTree):
        if tree.universe.max_depth > num_heads:
            raise MedusaError(f"the dynamic tree reads {tree.universe.max_depth} heads but there are only {num_heads}")
        return tree
    if isinstance(tree, str) and tree == DYNAMIC:
        return dynamic_tree(DYNAMIC_WIDTH, min(num_heads, DYNAMIC_DEPTH), budget or DYNAMIC_BUDGET)
    paths = tree.paths if isinstance(tree, TreeBuffers) else (
        load_tree_file(tree) if isinstance(tree, (str, Path)) else validate_paths(tree))
    deepest = max((len(p) for p in paths), default=0)
    if deepest > num_heads:
        raise MedusaError(f"the tree is {deepest} levels deep but the heads have only {num_heads} heads")
    return build_tree(paths)


class MedusaDrafter(Drafter):
    """Heads (placed on the base's device and dtype) and the tree they fill."""

    kind = DrafterKind.MEDUSA.value
    fits_tree = True

    def __init__(self, heads: MedusaHeads, base_model, tree=None, budget: int | None = None):
        heads.check_fits(base_model)
        self.lm_head = lean_linears(base_model.get_output_embeddings())  # prepacked or on blocks where exact here
        weight = self.lm_head.weight
        self.weights = heads.to(device=weight.device, dtype=weight.dtype).eval().requires_grad_(False)
        self.net = draft_linears(self.weights)  # what drafting runs; `weights` stays stock
        source = getattr(heads, "source", None)  # the checkpoint folder, when loaded from one
        self.accuracy = None  # [K][R] from the heads' calibration: head k's rank-r hit rate
        if source is not None and (Path(source) / TREE_NAME).is_file():
            self.accuracy = _accuracy(Path(source) / TREE_NAME)
            tree = Path(source) / TREE_NAME if tree is None else tree
        self.tree = fit_tree(tree, heads.num_heads, budget)
        self.tree = self.tree.to(weight.device)
        self._cut: dict[int, TreeBuffers | DynamicTree] = {}

    @property
    def dynamic(self) -> bool:
        return isinstance(self.tree, DynamicTree)

    def tree_for(self, budget: int | None) -> TreeBuffers | DynamicTree:
        """The tree at a budget of nodes (root included): a static tree keeps its first budget - 1
        paths (parents come first, so a prefix is a tree); a dynamic one keeps budget nodes."""
        full = self.default_budget
        if budget is None or budget >= full:
            return self.tree
        if budget not in self._cut:
            if self.dynamic:
                self._cut[budget] = dataclasses.replace(self.tree, budget=budget)
            else:
                self._cut[budget] = build_tree(self.tree.paths[: budget - 1]).to(self.tree.depth.device)
        return self._cut[budget]

    def proposer(self) -> MedusaProposer:
        return MedusaProposer(self)

    def acceptance(self, ngram=None) -> dict[int, float] | None:
        """A static tree cut to b nodes keeps its first b - 1 paths; each is accepted with the
        product of its ranks' accuracies (Medusa's estimate, as `medusa calibrate` fits trees).
        Not measured with an n-gram chain (ngram: None)."""
        if self.dynamic or self.accuracy is None or ngram is not None:
            return None
        acc, tau, out = self.accuracy, 1.0, {}
        for b, path in enumerate(self.tree.paths, start=2):
            p = 1.0
            for depth, rank in enumerate(path):
                p *= acc[depth][rank] if depth < len(acc) and rank < len(acc[depth]) else 0.0
            tau += p
            out[b] = tau
        return out

    def set_budget(self, budget: int) -> None:
        if self.dynamic:
            self.tree = dataclasses.replace(self.tree, budget=budget)
        else:
            self.tree = self.tree_for(budget)
        self._cut = {}

    def tree_sizes(self) -> set[int]:
        return {self.tree.budget if self.dynamic else self.tree.num_nodes}

    def describe(self) -> str:
        return f"medusa (dynamic {self.tree.budget}-node tree)" if self.dynamic else \
            f"medusa ({self.tree.num_nodes}-node tree)"


def _accuracy(path: Path) -> list[list[float]] | None:
    try:
        accuracy = json.loads(path.read_text()).get("accuracy")
    except (OSError, ValueError, AttributeError):
        return None
    return accuracy if isinstance(accuracy, list) and accuracy and isinstance(accuracy[0], list) else None


class MedusaProposer(Proposer):
    """A row's state: the hidden state of its last verified position."""

    def __init__(self, drafter: MedusaDrafter):
        self.drafter = drafter
        tree = drafter.tree
        self.depth_limit = tree.universe.depth_limit if drafter.dynamic else tree.depth_limit
        self.last_hidden: torch.Tensor | None = None  # [D]

    def observe(self, hidden, next_tokens, nodes) -> None:
        self.last_hidden = hidden[-1]

    def propose(self, root: torch.Tensor, budget: int | None = None) -> Proposal | None:
        if budget == 1:
            return None
        d = self.drafter
        tree = d.tree_for(budget)
        if d.dynamic:
            u = tree.universe
            logits = d.net(self.last_hidden, d.lm_head, num_heads=u.max_depth)  # [K, V]
            log_probs, topk = torch.log_softmax(logits.float(), -1).topk(u.topk, dim=-1)  # [K, width] each
            tree = select_tree(tree, log_probs[: u.max_depth], False)
        elif tree.max_depth:
            logits = d.net(self.last_hidden, d.lm_head, num_heads=tree.max_depth)  # [K, V]
            topk = logits.topk(tree.topk, dim=-1).indices  # [K, topk]
        else:
            return None
        return Proposal(tree_tokens(tree, root, topk), tree)


def load(folder: Path, base_model) -> MedusaHeads:
    """Our heads, a FasterDecoding Medusa checkpoint, or a vLLM Medusa folder."""
    heads = MedusaHeads.from_pretrained(folder)
    heads.source = folder  # where its calibrated tree.json may be
    return heads


class MedusaTrainer(PositionTrainer):
    """Medusa heads on the last hidden state; the whole vocabulary, or --train-vocab's shortlist
    for the losses only (the heads still meet the full LM head at inference)."""

    def new_weights(self, base, layers):
        cfg = self.cfg
        return MedusaHeads.for_base(base, cfg.num_heads, cfg.num_layers, not cfg.own_lm_head, cfg.model, cfg.inner_size)

    def num_heads(self, weights) -> int:
        return weights.num_heads

    def shortlist_size(self, weights) -> int:
        return self.cfg.train_vocab if self.cfg.train_vocab and not self.cfg.own_lm_head else 0


def export_vllm(folder: Path, base_model, out: Path, dtype: torch.dtype | None) -> None:
    """Residual heads -> vLLM's Medusa speculator (interop.py), the base's LM head stored with them."""
    heads = MedusaHeads.from_pretrained(folder)
    heads.check_fits(base_model)
    lm = base_model.get_output_embeddings().weight if heads.config.shared_lm_head else None
    interop.export_vllm(heads, out, lm, dtype)


register(DrafterKind.MEDUSA, DrafterSpec(
    load=load, wrap=MedusaDrafter, trainer=MedusaTrainer, exports={"vllm": export_vllm},
    no_export="vLLM's Medusa format is the one other engines read for Medusa heads (--format vllm)"))
