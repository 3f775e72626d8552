"""Candidate trees: from a list of paths to the buffers one verification forward needs.

Glossary: N tree nodes (root included), P root-to-leaf paths, L longest path in nodes,
K heads, V vocabulary.

A path is Medusa's notation: (0,) is head 1's top candidate, (0, 2) is head 2's third
candidate below it. Node 0 is the root: the base model's own next token, already emitted.
Nodes are ordered by depth, then by path, so every parent comes before its children.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import DEFAULT_TREE, MedusaError

Path_ = tuple[int, ...]


@dataclass(frozen=True)
class TreeBuffers:
    """Everything derived from one tree's paths, built once and reused every step."""

    paths: tuple[Path_, ...]  # the non-root nodes' paths, in node order (node i+1 = paths[i])
    # [N, N] bool: mask[i, j] is True when node j is node i or one of its ancestors
    mask: torch.Tensor
    # [N] long: 0 for the root, len(path) otherwise
    depth: torch.Tensor
    # [N] long: index of the parent node, -1 for the root
    parent: torch.Tensor
    # [N - 1] long: for node i+1, the index into a head top-k table flattened [K * topk]
    candidate_index: torch.Tensor
    # [P, L] long: node indices of every root-to-leaf path, root first, padded with -1
    retrieve: torch.Tensor
    children: tuple[tuple[int, ...], ...]  # children[i]: node indices below node i, by rank
    topk: int  # candidates needed per head (largest rank + 1)

    @property
    def num_nodes(self) -> int:
        return len(self.paths) + 1

    @property
    def max_depth(self) -> int:
        return max((len(p) for p in self.paths), default=0)

    def to(self, device: torch.device | str) -> TreeBuffers:
        moved = {k: getattr(self, k).to(device) for k in ("mask", "depth", "parent", "candidate_index", "retrieve")}
        return TreeBuffers(paths=self.paths, children=self.children, topk=self.topk, **moved)


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


def build_tree(paths=DEFAULT_TREE) -> TreeBuffers:
    """paths -> TreeBuffers. An empty list gives the one-node tree of plain decoding."""
    paths = validate_paths(paths)
    n = len(paths) + 1
    index = {(): 0} | {p: i + 1 for i, p in enumerate(paths)}
    topk = max((p[-1] for p in paths), default=-1) + 1

    mask = torch.eye(n, dtype=torch.bool)
    depth = torch.zeros(n, dtype=torch.long)
    parent = torch.full((n,), -1, dtype=torch.long)
    candidate_index = torch.zeros(n - 1, dtype=torch.long)
    children: list[list[int]] = [[] for _ in range(n)]
    for p in paths:
        i = index[p]
        depth[i] = len(p)
        parent[i] = index[p[:-1]]
        candidate_index[i - 1] = (len(p) - 1) * topk + p[-1]
        children[parent[i]].append(i)
        for k in range(len(p)):
            mask[i, index[p[:k]]] = True

    leaves = [p for p in ((),) + paths if not children[index[p]]]
    longest = max(len(p) for p in leaves) + 1
    retrieve = torch.full((len(leaves), longest), -1, dtype=torch.long)
    for row, leaf in enumerate(leaves):
        for k in range(len(leaf) + 1):
            retrieve[row, k] = index[leaf[:k]]
    return TreeBuffers(
        paths=paths, mask=mask, depth=depth, parent=parent, candidate_index=candidate_index,
        retrieve=retrieve, children=tuple(tuple(c) for c in children), topk=max(topk, 0),
    )


def tree_tokens(tree: TreeBuffers, root: torch.Tensor, head_topk: torch.Tensor) -> torch.Tensor:
    """The tokens of every node: root [] long, head_topk [K, topk] long -> tokens [N] long."""
    if tree.num_nodes == 1:
        return root.reshape(1)
    flat = head_topk[: tree.max_depth, : tree.topk].reshape(-1)
    return torch.cat([root.reshape(1), flat[tree.candidate_index]])


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
