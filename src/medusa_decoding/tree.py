"""Candidate trees: from a list of paths to the buffers one verification forward needs.

Glossary: N tree nodes (root included), P root-to-leaf paths, L longest path in nodes,
K heads, V vocabulary.

A path is Medusa's notation: (0,) is head 1's top candidate, (0, 2) is head 2's third
candidate below it. Node 0 is the root: the base model's own next token, already emitted.
Head nodes are ordered by depth, then by path, so every parent comes before its children.
A tree may also carry a chain of `chain_length` nodes under the root, after the head nodes: a
branch proposer's (the n-gram branch's copied tokens, a grammar's forced tokens), filled each step.
"""

from __future__ import annotations

import json
import functools
import itertools
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import DEFAULT_TREE, MedusaError

Path_ = tuple[int, ...]


@dataclass(frozen=True)
class TreeBuffers:
    """Everything one verification step needs about a tree, as tensors: built once for a
    static tree, or per step (by tensor ops only) for a dynamic one."""

    paths: tuple[Path_, ...]  # the head nodes' paths, in node order; empty for a per-step tree
    # [N, N] bool: mask[i, j] is True when node j is node i or one of its ancestors
    mask: torch.Tensor
    # [N] long: 0 for the root, len(path) otherwise
    depth: torch.Tensor
    # [N] long: index of the parent node, -1 for the root
    parent: torch.Tensor
    # [N - 1] long: for node i+1, the index into the flat candidate table: the heads' top-k
    # [max_depth * topk], then the chain's tokens [chain_length]
    candidate_index: torch.Tensor
    # [P, L] long: node indices of every root-to-leaf path, root first, padded with -1
    retrieve: torch.Tensor
    topk: int  # candidates read per head (largest rank + 1)
    max_depth: int  # heads the tree reads (its deepest head node)
    chain_length: int = 0  # nodes of a chain under the root (the last nodes)

    @property
    def num_nodes(self) -> int:
        return self.depth.shape[0]

    @property
    def depth_limit(self) -> int:
        """Deepest node, of the paths or the chain."""
        return max(self.max_depth, self.chain_length)

    @functools.cached_property
    def children(self) -> tuple[tuple[int, ...], ...]:
        """children[i]: node indices below node i, in node (rank) order. Python lists, for the
        node-by-node walk of rejection sampling; one host read, on first use."""
        out: list[list[int]] = [[] for _ in range(self.num_nodes)]
        for i, p in enumerate(self.parent.tolist()):
            if p >= 0:
                out[p].append(i)
        return tuple(tuple(c) for c in out)

    def to(self, device: torch.device | str) -> TreeBuffers:
        moved = {k: getattr(self, k).to(device) for k in ("mask", "depth", "parent", "candidate_index", "retrieve")}
        return TreeBuffers(paths=self.paths, topk=self.topk, max_depth=self.max_depth,
                           chain_length=self.chain_length, **moved)


def validate_paths(paths) -> tuple[Path_, ...]:
    """Check a list of paths and return it as sorted tuples; raise MedusaError naming the fault."""
    out = []
    for p in paths:
        if not isinstance(p, (list, tuple)) or not p or not all(isinstance(r, int) and r >= 0 for r in p):
            raise MedusaError(f"tree path {p!r} is not a non-empty list of ranks >= 0")
        out.append(tuple(p))
    if len(set(out)) != len(out):
        raise MedusaError("tree has duplicate paths")
    present = set(out)
    for p in out:
        if len(p) > 1 and p[:-1] not in present:
            raise MedusaError(f"tree path {p} has no parent {p[:-1]}: every prefix of a path must be in the tree")
    return tuple(sorted(out, key=lambda p: (len(p), p)))


def build_tree(paths=DEFAULT_TREE, chain_length: int = 0) -> TreeBuffers:
    """paths -> TreeBuffers. An empty list gives the one-node tree of plain decoding; with
    chain_length > 0 a chain of that many nodes hangs under the root as well."""
    paths = validate_paths(paths)
    if chain_length < 0:
        raise MedusaError(f"chain_length must be >= 0, got {chain_length}")
    heads_n = len(paths) + 1
    n = heads_n + chain_length
    index = {(): 0} | {p: i + 1 for i, p in enumerate(paths)}
    topk = max((p[-1] for p in paths), default=-1) + 1
    max_depth = max((len(p) for p in paths), default=0)

    mask = torch.eye(n, dtype=torch.bool)
    mask[:, 0] = True  # every node sees the root
    depth = torch.zeros(n, dtype=torch.long)
    parent = torch.full((n,), -1, dtype=torch.long)
    candidate_index = torch.zeros(n - 1, dtype=torch.long)
    for p in paths:
        i = index[p]
        depth[i] = len(p)
        parent[i] = index[p[:-1]]
        candidate_index[i - 1] = (len(p) - 1) * topk + p[-1]
        for k in range(1, len(p)):
            mask[i, index[p[:k]]] = True
    for j in range(chain_length):  # the chain: node heads_n + j at depth j + 1
        i = heads_n + j
        depth[i] = j + 1
        parent[i] = i - 1 if j else 0
        candidate_index[i - 1] = max_depth * max(topk, 0) + j
        mask[i, heads_n:i] = True
    return TreeBuffers(
        paths=paths, mask=mask, depth=depth, parent=parent, candidate_index=candidate_index,
        retrieve=root_paths(mask, depth, parent), topk=max(topk, 0), max_depth=max_depth,
        chain_length=chain_length,
    )


def root_paths(mask: torch.Tensor, depth: torch.Tensor, parent: torch.Tensor, longest: int | None = None) -> torch.Tensor:
    """mask [N, N], depth [N], parent [N] -> retrieve [P, L]: the root-to-leaf paths, root first,
    padded with -1; tensor ops only. A leaf is a node that is no node's parent; its path is
    its ancestors (its mask row), ordered by depth."""
    n = depth.shape[0]
    is_parent = torch.zeros(n, dtype=torch.bool, device=depth.device)
    is_parent[parent[1:]] = True
    leaves = (~is_parent).nonzero()[:, 0]  # [P]
    if longest is None:
        longest = int(depth.max()) + 1 if n > 1 else 1
    rows = mask[leaves]  # [P, N]: ancestors of each leaf, itself included
    # place each ancestor at its depth: node j of leaf row r goes to column depth[j]
    retrieve = torch.full((len(leaves), longest), -1, dtype=torch.long, device=depth.device)
    r, j = rows.nonzero(as_tuple=True)
    retrieve[r, depth[j]] = j
    return retrieve


@dataclass(frozen=True)
class DynamicTree:
    """Per-step trees (EAGLE-2's rule on Medusa heads): of every path of ranks < width up to
    `depth` heads (the universe), keep the `budget - 1` of highest joint head probability, the
    product of the heads' probabilities along the path. A child never scores above its parent,
    so the kept set is a tree. Selection and the new mask, depths and paths are tensor ops."""

    universe: TreeBuffers  # every path, plus a chain when chain_length > 0
    budget: int  # nodes kept from the head paths, root included (the chain comes on top)
    # [U - 1, depth] long: index into the heads' log-probs [depth * width] along each universe
    # node's path, padded with the index of a zero column
    gather: torch.Tensor

    def to(self, device) -> DynamicTree:
        return DynamicTree(self.universe.to(device), self.budget, self.gather.to(device))


def dynamic_tree(width: int, depth: int, budget: int, chain_length: int = 0) -> DynamicTree:
    """The universe of width**1 + ... + width**depth paths and its gather table."""
    if width < 1 or depth < 1 or budget < 2:
        raise MedusaError("a dynamic tree needs width >= 1, depth >= 1 and a budget of at least 2 nodes")
    paths = [p for d in range(1, depth + 1) for p in itertools.product(range(width), repeat=d)]
    universe = build_tree(paths, chain_length)
    pad = depth * width  # a column of zeros appended to the flattened log-probs
    gather = torch.full((len(paths), depth), pad, dtype=torch.long)
    for i, p in enumerate(universe.paths):
        for d, r in enumerate(p):
            gather[i, d] = d * width + r
    return DynamicTree(universe=universe, budget=min(budget, len(paths) + 1), gather=gather)


def select_tree(dyn: DynamicTree, log_probs: torch.Tensor, keep_chain: bool) -> TreeBuffers:
    """log_probs [depth, width]: the heads' top-`width` log-probabilities -> this step's tree.
    keep_chain keeps the universe's chain (its nodes come last)."""
    u = dyn.universe
    heads_n = u.num_nodes - u.chain_length
    flat = torch.cat([log_probs.reshape(-1).float(), log_probs.new_zeros(1, dtype=torch.float32)])
    score = flat[dyn.gather].sum(-1)  # [U - 1] joint log-probability of each path
    score = score - 1e-4 * u.depth[1:heads_n].to(score.dtype)  # ties go to the shallower node
    keep = score.topk(dyn.budget - 1).indices.sort().values + 1  # [N - 1], parents first
    parts = [keep.new_zeros(1), keep]
    if keep_chain and u.chain_length:
        parts.append(torch.arange(heads_n, u.num_nodes, device=keep.device))
    nodes = torch.cat(parts)  # [N] universe indices, in universe order
    remap = torch.full((u.num_nodes + 1,), -1, dtype=torch.long, device=keep.device)
    remap[nodes] = torch.arange(len(nodes), device=keep.device)
    mask = u.mask[nodes][:, nodes]
    depth = u.depth[nodes]
    parent = remap[u.parent[nodes]]  # the root's -1 reads remap[-1], which stays -1
    return TreeBuffers(
        paths=(), mask=mask, depth=depth, parent=parent, candidate_index=u.candidate_index[nodes[1:] - 1],
        retrieve=root_paths(mask, depth, parent, longest=u.depth_limit + 1), topk=u.topk,
        max_depth=u.max_depth, chain_length=u.chain_length if keep_chain else 0,
    )


def tree_from_parents(parent: torch.Tensor, depth: torch.Tensor, max_depth: int, chain_length: int = 0) -> TreeBuffers:
    """A drafted tree -> TreeBuffers, by tensor ops (one pass per depth, none per node).

    parent [N] long (-1 for the root, parents before children), depth [N] long, max_depth its
    deepest level; chain_length > 0 appends a chain under the root (its nodes last).
    Drafted trees carry their tokens themselves: candidate_index is empty."""
    device = parent.device
    if chain_length:
        n0 = parent.shape[0]
        chain = torch.arange(n0, n0 + chain_length, device=device)
        parent = torch.cat([parent, torch.cat([chain.new_zeros(1), chain[:-1]])])
        depth = torch.cat([depth, torch.arange(1, chain_length + 1, device=device)])
    n = parent.shape[0]
    mask = torch.eye(n, dtype=torch.bool, device=device)
    for d in range(1, max(max_depth, chain_length) + 1):
        rows = (depth == d).nonzero()[:, 0]
        mask[rows] |= mask[parent[rows]]
    return TreeBuffers(
        paths=(), mask=mask, depth=depth, parent=parent, candidate_index=parent.new_zeros(0),
        retrieve=root_paths(mask, depth, parent, longest=max(max_depth, chain_length) + 1), topk=0,
        max_depth=max_depth, chain_length=chain_length,
    )


def tree_tokens(tree: TreeBuffers, root: torch.Tensor, head_topk: torch.Tensor | None,
                chain: torch.Tensor | None = None) -> torch.Tensor:
    """The tokens of every node: root [] long, head_topk [K, topk] long (None without head
    nodes), chain [chain_length] long (with a chain) -> tokens [N] long."""
    parts = []
    if tree.max_depth:
        parts.append(head_topk[: tree.max_depth, : tree.topk].reshape(-1))
    if tree.chain_length:
        parts.append(chain)
    if not parts:
        return root.reshape(1)
    return torch.cat([root.reshape(1), torch.cat(parts)[tree.candidate_index]])


def load_tree_file(path: str | Path) -> tuple[Path_, ...]:
    """Read paths from JSON: a list of paths, or an object with a "paths" list (calibrate's output)."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise MedusaError(f"tree file {path} does not exist") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise MedusaError(f"tree file {path} is not valid JSON: {e}") from None
    paths = data.get("paths") if isinstance(data, dict) else data
    if not isinstance(paths, list):
        raise MedusaError(f"tree file {path} must hold a list of paths or an object with a 'paths' list")
    return validate_paths(paths)


def tree_bias(tree: TreeBuffers, dtype: torch.dtype, device) -> torch.Tensor:
    """[N, N] additive mask: 0 where a node sees a node (itself, its ancestors), dtype min elsewhere.
    Additive, not bool: with eager attention a bool 4D mask is silently wrong."""
    bias = torch.zeros(tree.mask.shape, dtype=dtype, device=device)
    return bias.masked_fill_(~tree.mask.to(device), torch.finfo(dtype).min)


def with_chain(tree: TreeBuffers, length: int) -> TreeBuffers:
    """`tree` with a chain of `length` nodes hung under its root, after its own nodes (the n-gram
    branch joining any proposer's tree): what tree_from_parents(tree.parent, tree.depth,
    tree.depth_limit, length) builds, from the tree's own mask and paths (a step's drafted tree
    is joined every step, so it is not rebuilt from its parents)."""
    n0, device = tree.num_nodes, tree.depth.device
    if n0 == 1 or length == 0:  # the root alone is a leaf that the chain makes a parent
        return tree_from_parents(tree.parent, tree.depth, tree.depth_limit, length)
    n = n0 + length
    chain = torch.arange(n0, n, device=device)
    mask = torch.zeros(n, n, dtype=torch.bool, device=device)
    mask[:n0, :n0] = tree.mask
    mask[n0:, n0:] = torch.ones(length, length, dtype=torch.bool, device=device).tril_()
    mask[n0:, 0] = True
    longest = max(tree.retrieve.shape[1], length + 1)
    retrieve = torch.full((tree.retrieve.shape[0] + 1, longest), -1, dtype=torch.long, device=device)
    retrieve[:-1, : tree.retrieve.shape[1]] = tree.retrieve
    retrieve[-1, 0], retrieve[-1, 1 : length + 1] = 0, chain
    return TreeBuffers(
        paths=(), mask=mask, depth=torch.cat([tree.depth, chain - n0 + 1]),
        parent=torch.cat([tree.parent, torch.cat([chain.new_zeros(1), chain[:-1]])]),
        candidate_index=tree.parent.new_zeros(0), retrieve=retrieve, topk=0, max_depth=tree.depth_limit,
        chain_length=length,
    )
