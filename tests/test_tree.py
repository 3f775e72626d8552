import json

import pytest
import torch

from medusa_decoding.config import DEFAULT_TREE, MedusaError
from medusa_decoding.tree import build_tree, load_tree_file, tree_tokens

TREES = {
    "default": DEFAULT_TREE,
    "chain": [(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0)],
    "wide": [(0,), (1,), (2,), (3,), (4,)],
    "mixed": [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0), (0, 0, 0, 0)],
}


def brute_force_mask(paths):
    nodes = [()] + sorted(paths, key=lambda p: (len(p), p))
    n = len(nodes)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i, a in enumerate(nodes):
        for j, b in enumerate(nodes):
            mask[i, j] = a[: len(b)] == b  # b is a prefix of a (an ancestor, the root, or a itself)
    return nodes, mask


@pytest.mark.parametrize("name", TREES)
def test_mask_rows_see_exactly_their_ancestors(name):
    tree = build_tree(TREES[name])
    nodes, mask = brute_force_mask(TREES[name])
    assert torch.equal(tree.mask, mask)
    assert tree.depth.tolist() == [len(p) for p in nodes]
    for i, p in enumerate(nodes[1:], start=1):
        assert nodes[tree.parent[i]] == p[:-1]
    assert tree.parent[0] == -1


@pytest.mark.parametrize("name", TREES)
def test_retrieve_lists_every_root_to_leaf_path(name):
    tree = build_tree(TREES[name])
    nodes, _ = brute_force_mask(TREES[name])
    leaves = {p for p in nodes if not any(q[:-1] == p and len(q) == len(p) + 1 for q in nodes)}
    got = set()
    for row in tree.retrieve.tolist():
        idx = [i for i in row if i >= 0]
        assert idx[0] == 0
        path = nodes[idx[-1]]
        assert [nodes[i] for i in idx] == [path[:k] for k in range(len(path) + 1)]
        got.add(path)
    assert got == leaves


def test_tree_tokens_gather_head_candidates():
    tree = build_tree([(0,), (2,), (0, 1), (2, 0)])
    head_topk = torch.tensor([[10, 11, 12], [20, 21, 22]])  # [K, topk]
    tokens = tree_tokens(tree, torch.tensor(5), head_topk)
    # node order: root, (0,), (2,), (0, 1), (2, 0)
    assert tokens.tolist() == [5, 10, 12, 21, 20]
    assert tree.children[0] == (1, 2) and tree.children[1] == (3,)


def test_empty_tree_is_plain_decoding():
    tree = build_tree([])
    assert tree.num_nodes == 1 and tree.max_depth == 0
    assert tree_tokens(tree, torch.tensor(7), torch.zeros(0, 0, dtype=torch.long)).tolist() == [7]


@pytest.mark.parametrize("paths, message", [
    ([(0, 1)], "no parent"),
    ([(0,), (0,)], "duplicate"),
    ([(-1,)], "ranks"),
    ([()], "non-empty"),
])
def test_bad_trees_are_refused(paths, message):
    with pytest.raises(MedusaError, match=message):
        build_tree(paths)


def test_tree_file(tmp_path):
    f = tmp_path / "tree.json"
    f.write_text(json.dumps([[0], [0, 0], [1]]))
    assert load_tree_file(f) == ((0,), (1,), (0, 0))
    f.write_text(json.dumps({"paths": [[0]], "curve": []}))
    assert load_tree_file(f) == ((0,),)
    f.write_text("{not json")
    with pytest.raises(MedusaError, match="not valid JSON"):
        load_tree_file(f)
    with pytest.raises(MedusaError, match="does not exist"):
        load_tree_file(tmp_path / "missing.json")
