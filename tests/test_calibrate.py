"""Calibration: head accuracy, the greedy tree expansion, the speed-up curve."""

import json

import pytest
import torch

from medusa_decoding import calibrate as cal
from medusa_decoding.tree import build_tree

from conftest import random_heads


def test_best_trees_expand_greedily_by_joint_accuracy():
    acc = [[0.5, 0.2, 0.1], [0.4, 0.1, 0.05]]
    chosen = cal.best_trees(acc, max_nodes=5)
    paths = [p for p, _ in chosen]
    assert paths == [(0,), (0, 0), (1,), (2,)]  # 0.5, 0.2, 0.2, 0.1 (ties: the first pushed)
    assert [round(s, 4) for _, s in chosen] == [0.5, 0.2, 0.2, 0.1]
    build_tree(paths)  # every prefix is present: a valid tree


def test_fit_picks_the_best_expected_speedup():
    acc = [[0.6, 0.1], [0.5, 0.1]]
    latency = {1: 1.0, 2: 1.05, 4: 1.1, 8: 2.0}
    result = cal.fit(acc, latency, heads_cost=[0.05, 0.05])
    by_n = {c["n"]: c for c in result.curve}
    assert by_n[1]["expected_tau"] == 1.0 and by_n[1]["cost"] == 1.0
    assert by_n[2]["expected_tau"] == pytest.approx(1.6)
    # 4 nodes: (0,) 0.6, (0,0) 0.3, (1,) 0.1 -> tau 2.0 at cost 1.15
    assert by_n[4]["expected_tau"] == pytest.approx(2.0)
    assert result.best["n"] == 4 and result.best["expected_speedup"] == pytest.approx(2.0 / 1.15)


def test_head_accuracy_scores_head_k_against_token_t_plus_k_plus_1(model):
    """Heads that always output one fixed token per head: accuracy is the share of answer
    positions holding that token, at the right offset."""
    class Fixed(torch.nn.Module):
        num_heads = 2

        def forward(self, hidden, lm_head=None, num_heads=None):  # [T, D] -> [K, T, V]
            logits = torch.zeros(2, hidden.shape[0], 300)
            logits[0, :, 7] = 1.0
            logits[1, :, 9] = 1.0
            return logits

    ids = torch.tensor([1, 2, 3, 7, 9, 7, 9, 7])  # prompt of 3, then the answer
    acc = cal.head_accuracy(model, Fixed(), [(3, ids)], ranks=1)
    # head 1 at t = 2.. guesses token t+2: ids[4:] = 9 7 9 7 -> half are 7
    # head 2 guesses token t+3: ids[5:] = 7 9 7 -> one third are 9
    assert acc[0][0] == pytest.approx(0.5) and acc[1][0] == pytest.approx(1 / 3)


def test_latency_and_calibrated_tree_file(model, tmp_path):
    from medusa_decoding.verifiers.transformers import EagerBackend

    backend = EagerBackend(model)
    lat = cal.verify_latency(backend, sizes=(1, 2, 4), prefix_len=16, repeats=2)
    assert lat[1] == 1.0 and all(v > 0 for v in lat.values())
    heads = random_heads(model)
    cost = cal.heads_latency(backend, heads, repeats=3)
    assert len(cost) == 4 and all(c > 0 for c in cost)
    result = cal.fit([[0.5] * 10] * 4, lat, cost)
    cal.save(result, tmp_path / "tree.json")
    saved = json.loads((tmp_path / "tree.json").read_text())
    assert saved["paths"] == [list(p) for p in result.best["paths"]]
    from medusa_decoding.tree import load_tree_file
    assert len(load_tree_file(tmp_path / "tree.json")) == result.best["n"] - 1


def test_a_deeper_tree_pays_for_more_heads():
    acc = [[0.9, 0.0], [0.9, 0.0]]  # head 2 is as good as head 1, but costs
    latency = {1: 1.0, 2: 1.0, 3: 1.0}
    result = cal.fit(acc, latency, heads_cost=[0.1, 1.0])
    by_n = {c["n"]: c for c in result.curve}
    assert by_n[2]["cost"] == pytest.approx(1.1) and by_n[3]["cost"] == pytest.approx(2.0)
    assert result.best["n"] == 2
