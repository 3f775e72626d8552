import json

import pytest
import torch

from medusa_decoding.config import DEFAULT_TREE, MedusaError
from medusa_decoding.tree import build_tree, load_tree_file, tree_from_parents, tree_tokens, with_chain

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


@pytest.mark.parametrize("name", [*TREES, "root"])
@pytest.mark.parametrize("length", [1, 3, 6])
def test_a_chain_joined_to_a_tree_is_the_tree_rebuilt_with_it(name, length):
    """with_chain (the n-gram branch joining any tree, every step) builds from the tree's own mask
    and paths what tree_from_parents builds from its parents: every buffer, the paths' order too
    (the accepted path is the first longest)."""
    tree = build_tree(TREES[name]) if name != "root" else build_tree([])
    got, want = with_chain(tree, length), tree_from_parents(tree.parent, tree.depth, tree.depth_limit, length)
    for field in ("mask", "depth", "parent", "retrieve", "candidate_index"):
        assert torch.equal(getattr(got, field), getattr(want, field)), field
    assert (got.max_depth, got.chain_length, got.topk) == (want.max_depth, want.chain_length, want.topk)


def test_ngram_chain_hangs_under_the_root():
    tree = build_tree([(0,), (1,), (0, 0)], chain_length=3)
    assert tree.num_nodes == 7 and tree.depth.tolist() == [0, 1, 1, 2, 1, 2, 3]
    assert tree.parent.tolist() == [-1, 0, 0, 1, 0, 4, 5]
    # the chain's last node sees the root, the chain before it and itself; nothing of the heads
    assert tree.mask[6].tolist() == [True, False, False, False, True, True, True]
    assert tree.mask[:4, 4:].sum() == 0
    assert [4, 5, 6] in [[i for i in row if i > 0] for row in tree.retrieve.tolist()]
    head_topk = torch.tensor([[10, 11], [20, 21]])
    tokens = tree_tokens(tree, torch.tensor(5), head_topk, torch.tensor([7, 8, 9]))
    assert tokens.tolist() == [5, 10, 11, 20, 7, 8, 9]
    only_ngram = build_tree([], chain_length=2)
    assert tree_tokens(only_ngram, torch.tensor(5), None, torch.tensor([7, 8])).tolist() == [5, 7, 8]


def test_dynamic_selection_keeps_the_most_probable_paths():
    import itertools

    from medusa_decoding.tree import dynamic_tree, select_tree

    g = torch.Generator().manual_seed(0)
    dyn = dynamic_tree(width=3, depth=3, budget=9, chain_length=2)
    for _ in range(20):
        log_probs = torch.log_softmax(torch.randn(3, 8, generator=g), -1).topk(3).values  # [depth, width]
        tree = select_tree(dyn, log_probs, keep_chain=False)
        score = {p: sum(float(log_probs[d, r]) for d, r in enumerate(p))
                 for n in (1, 2, 3) for p in itertools.product(range(3), repeat=n)}
        best = sorted(score, key=lambda p: -score[p])[:8]
        ref = build_tree(best)  # the same nodes, built from their paths
        assert tree.num_nodes == 9
        assert torch.equal(tree.mask, ref.mask) and torch.equal(tree.depth, ref.depth)
        assert torch.equal(tree.parent, ref.parent)
        def rows(t):
            return sorted(tuple(i for i in row if i >= 0) for row in t.retrieve.tolist())
        assert rows(tree) == rows(ref)
        head_topk = torch.arange(9).reshape(3, 3)
        assert torch.equal(tree_tokens(tree, torch.tensor(99), head_topk), tree_tokens(ref, torch.tensor(99), head_topk))
    with_chain = select_tree(dyn, log_probs, keep_chain=True)
    assert with_chain.num_nodes == 11 and with_chain.depth[-2:].tolist() == [1, 2]
