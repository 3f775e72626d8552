"""Acceptance rules: exact outputs on hand-made logits, and statistical losslessness.

Glossary: N tree nodes, V vocabulary, P paths. p is the target distribution.

The statistical tests compare an empirical distribution of n draws with the exact one by
total variation. For K outcomes, E[TV] <= 1/2 * sum_i sqrt(pi_i (1 - pi_i) / n)
<= 1/2 * sqrt(K / n) (Cauchy-Schwarz), and one draw moves TV by at most 1/n, so McDiarmid
gives P(TV >= E[TV] + t) <= exp(-2 n t^2). With delta = 1e-6:
    TV <= 1/2 * sqrt(K / n) + sqrt(ln(1 / delta) / (2 n))
fails for a correct sampler with probability below 1e-6 whatever the seed (the seeds are
fixed, so the tests are also deterministic).
"""

from __future__ import annotations

import math

import pytest
import torch

from medusa_decoding.acceptance import (
    Accepted,
    accept,
    accept_greedy,
    accept_rejection,
    accept_typical,
    first_argmax,
    target_probs,
)
from medusa_decoding.config import DEFAULT_TREE, Acceptance, MedusaError, SamplingConfig
from medusa_decoding.tree import build_tree

DELTA = 1e-6

# Nodes: 1=(0,) 2=(1,) 3=(0,0) 4=(0,1) 5=(1,0); paths [0,1,3], [0,1,4], [0,2,5].
SMALL_TREE = [(0,), (1,), (0, 0), (0, 1), (1, 0)]


def tv_bound(outcomes: int, n: int) -> float:
    return 0.5 * math.sqrt(outcomes / n) + math.sqrt(math.log(1 / DELTA) / (2 * n))


def tv(counts: torch.Tensor, exact: torch.Tensor) -> float:
    """counts [K], exact [K] -> total variation between counts / n and exact."""
    return 0.5 * (counts.double() / counts.sum() - exact.double()).abs().sum().item()


def argmax_logits(argmaxes: list[int], vocab: int = 8) -> torch.Tensor:
    """[N] intended argmax per node -> logits [N, V] whose argmax is that token."""
    logits = torch.full((len(argmaxes), vocab), -5.0)  # [N, V]
    logits[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 5.0
    return logits


def one_hot_rows(argmaxes: list[int], vocab: int = 8) -> torch.Tensor:
    """[N] tokens -> p [N, V] one-hot."""
    return torch.nn.functional.one_hot(torch.tensor(argmaxes), vocab).float()


def assert_root_path(result: Accepted, tree) -> None:
    nodes = result.nodes.tolist()
    assert nodes[0] == 0
    for a, b in zip(nodes, nodes[1:]):
        assert tree.parent[b].item() == a


# ---------------------------------------------------------------- greedy, hand-made logits

@pytest.mark.parametrize(
    "argmaxes, nodes, bonus",
    [
        ([1, 4, 0, 0, 6, 0], [0, 1, 4], 6),  # match: root -> node 1 (token 1) -> node 4 (token 4)
        ([2, 0, 0, 0, 0, 0], [0, 2], 0),  # early mismatch: node 5 (token 5) != argmax 0
        ([6, 3, 5, 0, 0, 0], [0], 6),  # all rejected at the root: bonus is the root's argmax
    ],
)
def test_greedy_hand_made(argmaxes, nodes, bonus):
    tree = build_tree(SMALL_TREE)
    tokens = torch.tensor([7, 1, 2, 3, 4, 5])  # [N]
    result = accept_greedy(tokens, argmax_logits(argmaxes), tree)
    assert result.nodes.tolist() == nodes
    assert result.bonus.item() == bonus


def test_greedy_tie_takes_first_path():
    tree = build_tree(SMALL_TREE)
    tokens = torch.tensor([7, 1, 1, 3, 4, 5])  # nodes 1 and 2 both carry token 1
    result = accept_greedy(tokens, argmax_logits([1, 3, 5, 0, 0, 0]), tree)
    assert result.nodes.tolist() == [0, 1, 3]  # [0, 2, 5] is as long, but later


# ---------------------------------------------------------------- typical, hand-made p

def test_typical_accepts_a_typical_non_argmax_candidate():
    # Root row [0.5, 0.3, 0.2]: H = 1.030 nats, 0.3 * exp(-H) = 0.107, threshold min(0.09, .)
    # = 0.09, so tokens 1 and 2 pass although neither is the argmax (greedy keeps nothing).
    tree = build_tree(SMALL_TREE)
    tokens = torch.tensor([7, 1, 2, 3, 4, 5])
    p = one_hot_rows([0, 4, 0, 0, 6, 0])  # [N, V]
    p[0] = torch.tensor([0.5, 0.3, 0.2, 0, 0, 0, 0, 0])
    g = torch.Generator().manual_seed(0)
    result = accept_typical(tokens, p, tree, 0.09, 0.3, g)
    assert result.nodes.tolist() == [0, 1, 4]  # node 5 (token 5) fails below node 2
    assert result.bonus.item() == 6
    assert accept_greedy(tokens, p.log(), tree).nodes.tolist() == [0]


def test_typical_tie_takes_first_path():
    tree = build_tree(SMALL_TREE)
    tokens = torch.tensor([7, 1, 2, 3, 4, 5])
    p = one_hot_rows([0, 4, 5, 0, 6, 0])  # node 2's row accepts node 5 too
    p[0] = torch.tensor([0.5, 0.3, 0.2, 0, 0, 0, 0, 0])
    result = accept_typical(tokens, p, tree, 0.09, 0.3, torch.Generator().manual_seed(0))
    assert result.nodes.tolist() == [0, 1, 4]


def test_typical_early_mismatch_below_threshold():
    # Root row 0.95 / 0.05: threshold 0.09, so node 2 (token 2, p = 0.05 > 0) is refused.
    tree = build_tree(SMALL_TREE)
    tokens = torch.tensor([7, 1, 2, 3, 4, 5])
    p = one_hot_rows([0, 6, 0, 0, 0, 0])
    p[0] = torch.tensor([0, 0.95, 0.05, 0, 0, 0, 0, 0])
    result = accept_typical(tokens, p, tree, 0.09, 0.3, torch.Generator().manual_seed(0))
    assert result.nodes.tolist() == [0, 1]
    assert result.bonus.item() == 6


def test_typical_all_rejected():
    tree = build_tree(SMALL_TREE)
    tokens = torch.tensor([7, 1, 2, 3, 4, 5])
    p = one_hot_rows([0, 0, 0, 0, 0, 0])
    p[0] = torch.tensor([0.96, 0.02, 0.02, 0, 0, 0, 0, 0])  # both candidates under 0.09
    g = torch.Generator().manual_seed(0)
    bonuses = {accept_typical(tokens, p, tree, 0.09, 0.3, g).bonus.item() for _ in range(200)}
    assert accept_typical(tokens, p, tree, 0.09, 0.3, g).nodes.tolist() == [0]
    assert bonuses == {0, 1, 2}  # the bonus is sampled from p at the root, not its argmax


def test_typical_threshold_is_the_smaller_of_epsilon_and_entropy_term():
    tree = build_tree([(0,)])
    tokens = torch.tensor([7, 1])  # [N]
    g = torch.Generator().manual_seed(0)
    # Peaked row: 0.3 * exp(-H) = 0.217 > epsilon 0.09, so epsilon binds and p = 0.1 passes.
    peaked = torch.zeros(2, 8)
    peaked[:, 0], peaked[:, 1] = 0.9, 0.1
    assert accept_typical(tokens, peaked, tree, 0.09, 0.3, g).nodes.tolist() == [0, 1]
    assert accept_typical(tokens, peaked, tree, 0.11, 0.3, g).nodes.tolist() == [0]
    # Flat row: 0.3 * exp(-H) = 0.038 < epsilon 0.09, so the entropy term binds and p = 0.08
    # passes although it is below epsilon.
    flat = torch.full((2, 8), 0.92 / 7)
    flat[:, 1] = 0.08
    assert accept_typical(tokens, flat, tree, 0.09, 0.3, g).nodes.tolist() == [0, 1]
    assert accept_typical(tokens, flat, tree, 0.09, 0.9, g).nodes.tolist() == [0]  # 0.114 binds


def test_typical_comparison_is_strict():
    # epsilon = 0 makes the threshold 0: any candidate with p > 0 passes, p = 0 never does.
    tree = build_tree([(0,), (1,)])
    p = torch.zeros(3, 8)
    p[:, 2], p[:, 3] = 0.999, 0.001
    g = torch.Generator().manual_seed(0)
    assert accept_typical(torch.tensor([7, 4, 3]), p, tree, 0.0, 0.3, g).nodes.tolist() == [0, 2]
    assert accept_typical(torch.tensor([7, 4, 5]), p, tree, 0.0, 0.3, g).nodes.tolist() == [0]


@pytest.mark.parametrize("paths", [SMALL_TREE, DEFAULT_TREE])
def test_one_hot_p_reduces_typical_and_rejection_to_greedy(paths):
    tree = build_tree(paths)
    n, vocab = tree.num_nodes, 6  # small, so candidates often match; >= 5 siblings
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    greedy_config = SamplingConfig(temperature=0)
    lengths = set()
    for _ in range(300):
        logits = torch.randn(n, vocab)  # [N, V]
        p = target_probs(logits, greedy_config)  # [N, V] one-hot
        # Typical keeps the longest path as greedy does, so any tokens do, duplicates included.
        tokens = torch.randint(vocab, (n,))  # [N]
        expected = accept_greedy(tokens, logits, tree)
        result = accept_typical(tokens, p, tree, 0.09, 0.3, g)
        assert result.nodes.tolist() == expected.nodes.tolist()
        assert result.bonus.item() == expected.bonus.item()
        lengths.add(len(expected.nodes))
        # Rejection takes the first acceptable sibling; with distinct siblings (as head
        # top-k candidates are) at most one matches the argmax, so the paths coincide.
        for kids in tree.children:
            if kids:
                tokens[list(kids)] = torch.randperm(vocab)[: len(kids)]
        expected = accept_greedy(tokens, logits, tree)
        result = accept_rejection(tokens, p, tree, g)
        assert result.nodes.tolist() == expected.nodes.tolist()
        assert result.bonus.item() == expected.bonus.item()
        lengths.add(len(expected.nodes))
    assert len(lengths) >= 3  # the trials exercised short and long accepted paths


def test_dispatcher_routes_by_rule():
    tree = build_tree(SMALL_TREE)
    tokens = torch.tensor([7, 1, 2, 3, 4, 5])
    logits = argmax_logits([1, 4, 0, 0, 6, 0]) * 10  # nearly one-hot at temperature 1
    g = torch.Generator().manual_seed(0)
    for config in (
        SamplingConfig(temperature=0),
        SamplingConfig(temperature=1.0, acceptance=Acceptance.REJECTION),
        SamplingConfig(temperature=1.0, acceptance=Acceptance.TYPICAL),
    ):
        result = accept(tokens, logits, tree, config, g)
        assert result.nodes.tolist() == [0, 1, 4]
        assert result.bonus.item() == 6


# ---------------------------------------------------------------- target_probs

def test_target_probs_temperature():
    logits = torch.tensor([[0.0, math.log(2), math.log(4)]])  # [1, 3]
    p1 = target_probs(logits, SamplingConfig(temperature=1.0))
    torch.testing.assert_close(p1, torch.tensor([[1 / 7, 2 / 7, 4 / 7]]))
    p2 = target_probs(logits, SamplingConfig(temperature=2.0))  # logits / 2: weights 1, sqrt 2, 2
    s = 3 + math.sqrt(2)
    torch.testing.assert_close(p2, torch.tensor([[1 / s, math.sqrt(2) / s, 2 / s]]))
    assert p2.dtype == torch.float32


def test_target_probs_tiny_temperature_is_finite():
    """Found by the server's schema fuzzing: temperature 1e-300 made logits / T overflow to inf and
    the distribution NaN (a 500). It is the argmax's one-hot, ties shared."""
    logits = torch.tensor([[0.1, 3.0, 2.0], [1.0, 1.0, -5.0]])
    for top_p in (1.0, 0.9):
        p = target_probs(logits, SamplingConfig(temperature=1e-300, top_p=top_p))
        torch.testing.assert_close(p, torch.tensor([[0.0, 1.0, 0.0], [0.5, 0.5, 0.0]]))


def test_target_probs_temperature_zero_is_one_hot():
    logits = torch.tensor([[0.1, 3.0, 3.0, -1.0], [2.0, 0.0, 0.0, 0.0]], dtype=torch.bfloat16)
    p = target_probs(logits, SamplingConfig(temperature=0, top_k=3, top_p=0.5))
    assert p.dtype == torch.float32
    torch.testing.assert_close(p, torch.tensor([[0.0, 1, 0, 0], [1, 0, 0, 0]]))  # ties: first


LOG_P = torch.tensor([0.1, 0.2, 0.4, 0.3]).log()  # [V] logits whose softmax is p


@pytest.mark.parametrize(
    "top_k, top_p, expected",
    [
        (2, 1.0, [0, 0, 4 / 7, 3 / 7]),
        (4, 1.0, [0.1, 0.2, 0.4, 0.3]),
        (10, 1.0, [0.1, 0.2, 0.4, 0.3]),  # k >= V keeps everything
        (0, 0.5, [0, 0, 4 / 7, 3 / 7]),  # 0.4 < 0.5, 0.4 + 0.3 >= 0.5
        (0, 0.4, [0, 0, 1, 0]),  # 0.4 alone reaches 0.4
        (0, 0.05, [0, 0, 1, 0]),  # always at least the top token
        (0, 0.75, [0, 2 / 9, 4 / 9, 3 / 9]),
        # top_k first and renormalised: [0, .222, .444, .333]; .444 + .333 >= .75 drops .222.
        # (Applied to the unrenormalised .4 + .3 = .7 < .75, top_p would have kept it.)
        (3, 0.75, [0, 0, 4 / 7, 3 / 7]),
    ],
)
def test_target_probs_top_k_top_p(top_k, top_p, expected):
    logits = torch.stack([LOG_P, LOG_P.flip(0)])  # [2, V]: rows differ, filtered row by row
    p = target_probs(logits, SamplingConfig(temperature=1.0, top_k=top_k, top_p=top_p))
    want = torch.tensor(expected, dtype=torch.float32)  # [V]
    torch.testing.assert_close(p, torch.stack([want, want.flip(0)]))


def test_target_probs_top_p_boundary_is_inclusive():
    # Powers of two are exact in float32: a set whose mass equals top_p exactly is enough.
    logits = torch.tensor([[0.125, 0.5, 0.25, 0.125]]).log()  # [1, V]
    half = target_probs(logits, SamplingConfig(temperature=1.0, top_p=0.5))
    torch.testing.assert_close(half, torch.tensor([[0.0, 1, 0, 0]]))
    three_quarters = target_probs(logits, SamplingConfig(temperature=1.0, top_p=0.75))
    torch.testing.assert_close(three_quarters, torch.tensor([[0.0, 2 / 3, 1 / 3, 0]]))


@pytest.mark.parametrize(
    "kwargs", [{"temperature": -0.1}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_p": -0.2}, {"top_k": -1}]
)
def test_bad_sampling_config(kwargs):
    with pytest.raises(MedusaError):
        SamplingConfig(**kwargs)


# ---------------------------------------------------------------- rejection: losslessness

# Nodes: 1=(0,) 2=(1,) 3=(2,) 4=(0,0) 5=(0,1) 6=(1,0). The root has three siblings, node 1
# two, node 2 one, node 3 none (a leaf one step down).
STAT_TREE = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0)]
STAT_TOKENS = torch.tensor([5, 0, 1, 2, 3, 1, 0])  # [N]: distinct tokens within each sibling group
V = 6
DRAWS = 30000


def _normalise(x: torch.Tensor) -> torch.Tensor:
    return x / x.sum(-1, keepdim=True)


P_CASES = {
    # every row different, moderate mass on the candidates
    "mixed": _normalise(torch.rand(7, V, generator=torch.Generator().manual_seed(123)) ** 2 + 0.02),
    # draft far from target: the candidates (tokens 0, 1, 2 at the root) hold 6% of the mass
    "far": _normalise(torch.tensor([
        [0.01, 0.02, 0.03, 0.14, 0.4, 0.4],
        [0.3, 0.02, 0.3, 0.01, 0.07, 0.3],
        [0.02, 0.2, 0.2, 0.2, 0.2, 0.18],
        [0.1, 0.1, 0.1, 0.1, 0.1, 0.5],
        [0.5, 0.1, 0.1, 0.1, 0.1, 0.1],
        [0.2, 0.2, 0.2, 0.2, 0.1, 0.1],
        [0.1, 0.2, 0.3, 0.2, 0.1, 0.1],
    ])),
    # zero mass on candidates: node 1 (token 0 at the root) and node 6 (token 0 below node 2)
    "zero": _normalise(torch.tensor([
        [0.0, 0.3, 0.2, 0.1, 0.25, 0.15],
        [0.3, 0.1, 0.1, 0.2, 0.1, 0.2],
        [0.0, 0.5, 0.2, 0.1, 0.1, 0.1],
        [0.1, 0.1, 0.1, 0.1, 0.1, 0.5],
        [0.5, 0.1, 0.1, 0.1, 0.1, 0.1],
        [0.2, 0.2, 0.2, 0.2, 0.1, 0.1],
        [0.1, 0.2, 0.3, 0.2, 0.1, 0.1],
    ])),
}


def exact_two_tokens(p: torch.Tensor, tree) -> torch.Tensor:
    """p [N, V] -> [V * (V + 1)]: probability of (first, second) emitted token; second = V
    ("none") when the first token is recovered, which ends the step."""
    exact = torch.zeros(V, V + 1, dtype=torch.float64)
    exact[:, V] = p[0].double()
    for child in tree.children[0]:
        x1 = STAT_TOKENS[child].item()
        exact[x1, V] = 0
        exact[x1, :V] = p[0, x1].double() * p[child].double()
    return exact.reshape(-1)


def sample_two_tokens(rule, p: torch.Tensor, tree, draws: int, seed: int) -> tuple[torch.Tensor, set]:
    """Run `rule` draws times -> (counts [V * (V + 1)] of (first, second), nodes ever accepted)."""
    g = torch.Generator().manual_seed(seed)
    keys = []
    seen: set[int] = set()
    for _ in range(draws):
        result = rule(STAT_TOKENS, p, tree, g)
        nodes = result.nodes.tolist()
        emitted = STAT_TOKENS[nodes[1:]].tolist() + [result.bonus.item()]
        keys.append(emitted[0] * (V + 1) + (emitted[1] if len(nodes) > 1 else V))
        seen.update(nodes)
    return torch.bincount(torch.tensor(keys), minlength=V * (V + 1)), seen


@pytest.mark.parametrize("case", sorted(P_CASES))
def test_rejection_is_lossless(case):
    tree = build_tree(STAT_TREE)
    p = P_CASES[case]  # [N, V]
    counts, seen = sample_two_tokens(accept_rejection, p, tree, DRAWS, seed=7)
    exact = exact_two_tokens(p, tree)

    # First emitted token ~ p[0]: V outcomes.
    first = tv(counts.reshape(V, V + 1).sum(-1), p[0])
    assert first <= tv_bound(V, DRAWS), (case, first)
    # (first, second) ~ exact two-token distribution: outcomes of positive probability.
    joint = tv(counts, exact)
    assert joint <= tv_bound(int((exact > 0).sum()), DRAWS), (case, joint)
    # Second token given a candidate first token ~ p at that child (a leaf: bonus; else the
    # next accepted candidate or the recovered token).
    grid = counts.reshape(V, V + 1)
    for child in tree.children[0]:
        row = grid[STAT_TOKENS[child].item(), :V]
        if row.sum() >= 1000:
            cond = tv(row, p[child])
            assert cond <= tv_bound(V, int(row.sum())), (case, child, cond)
    if case == "zero":
        assert 1 not in seen and 6 not in seen  # zero-mass candidates never accepted
    if case == "mixed":
        assert {4, 5, 6} <= seen  # every depth-2 node was reached


def test_rejection_paths_are_root_paths_and_recovered_is_not_a_rejected_candidate():
    tree = build_tree(STAT_TREE)
    p = P_CASES["mixed"]
    g = torch.Generator().manual_seed(3)
    for _ in range(500):
        result = accept_rejection(STAT_TOKENS, p, tree, g)
        assert_root_path(result, tree)
        last = result.nodes[-1].item()
        assert result.bonus.item() not in STAT_TOKENS[list(tree.children[last])].tolist()


def test_rejection_is_reproducible_with_the_generator():
    tree = build_tree(STAT_TREE)
    p = P_CASES["mixed"]
    runs = []
    for _ in range(2):
        g = torch.Generator().manual_seed(11)
        runs.append([
            (r.nodes.tolist(), r.bonus.item()) for r in (accept_rejection(STAT_TOKENS, p, tree, g) for _ in range(50))
        ])
    assert runs[0] == runs[1]


def _always_first_child(tokens, p, tree, g) -> Accepted:
    """Wrong: accept the first child at every level, bonus from p at the leaf."""
    path = [0]
    while tree.children[path[-1]]:
        path.append(tree.children[path[-1]][0])
    return Accepted(nodes=torch.tensor(path), bonus=torch.multinomial(p[path[-1]], 1, generator=g)[0])


def _no_residual(tokens, p, tree, g) -> Accepted:
    """Wrong (a classic bug): accept each sibling with p(x) instead of the renormalised
    residual r(x), and draw the recovered token from p instead of the residual."""
    path = [0]
    while True:
        for child in tree.children[path[-1]]:
            if torch.rand((), generator=g) < p[path[-1], tokens[child]]:
                path.append(child)
                break
        else:
            return Accepted(nodes=torch.tensor(path), bonus=torch.multinomial(p[path[-1]], 1, generator=g)[0])


@pytest.mark.parametrize("rule, draws", [(_always_first_child, 2000), (_no_residual, DRAWS)])
def test_statistical_check_catches_wrong_rules(rule, draws):
    tree = build_tree(STAT_TREE)
    p = P_CASES["mixed"]
    counts, _ = sample_two_tokens(rule, p, tree, draws, seed=7)
    joint = tv(counts, exact_two_tokens(p, tree))
    assert joint > tv_bound(int((exact_two_tokens(p, tree) > 0).sum()), draws), joint


@pytest.mark.parametrize("vocab", [1, 50, 64, 3 * 1024, 49152, 2048 + 64])
def test_first_argmax_is_argmax_ties_and_nan_included(vocab):
    """The chunked argmax gives torch's argmax (the first maximum) on random rows, on ties across
    and within chunks, on a row of equal values and with a NaN."""
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(9, vocab, generator=g).round(decimals=1)  # many ties
    logits[1] = 0.0
    logits[2, vocab // 2:] = logits[2].max() + 1  # the maximum over every later chunk
    logits[3, -1] = logits[3].max() + 1
    assert torch.equal(first_argmax(logits), logits.argmax(-1))
    logits[4, vocab // 3] = float("nan")
    assert torch.equal(first_argmax(logits), logits.argmax(-1))

