"""Sampling end to end on a tiny model: speculative sampling draws the base model's distribution."""

import math

import pytest
import torch

from medusa_decoding.config import Acceptance, GenerationConfig, SamplingConfig
from medusa_decoding.engine import GenerationStats
from medusa_decoding.tree import build_tree

from conftest import EOS, decode, random_heads, tiny_llama

WIDE = [(i,) for i in range(8)] + [(0, 0), (1, 0), (0, 1)]


def draw(model, prompt, heads, sampling, n_tokens=2, tree=WIDE):
    stats = GenerationStats()
    out = []
    for chunk in decode(model, prompt, heads, build_tree(tree), GenerationConfig(max_new_tokens=n_tokens, ignore_eos=True),
                        sampling, {EOS}, stats):
        out += chunk
    return tuple(out), stats


def exact_two_token_distribution(model, prompt, temperature):
    """{(x1, x2): p(x1) p(x2 | x1)} from the model itself, over every x1 with p(x1) > 1e-5."""
    with torch.no_grad():
        p1 = torch.softmax(model(prompt).logits[0, -1] / temperature, -1)
        firsts = (p1 > 1e-5).nonzero()[:, 0]
        seqs = torch.cat([prompt.repeat(len(firsts), 1), firsts[:, None]], 1)
        p2 = torch.softmax(model(seqs).logits[:, -1] / temperature, -1)
    return {(int(a), int(b)): float(p1[a] * p2[i, b]) for i, a in enumerate(firsts) for b in (p2[i] > 1e-7).nonzero()[:, 0]}


def tv(counts, exact, n):
    keys = set(counts) | set(exact)
    return 0.5 * sum(abs(counts.get(k, 0) / n - exact.get(k, 0.0)) for k in keys)


class MarginalHeads(torch.nn.Module):
    """Drafts for the first step: head 1 ranks x2 by its marginal probability, so its top
    candidates are often right and often wrong; later heads guess at random."""

    kind, num_heads = "medusa", 4

    def check_fits(self, base_model):
        pass

    def __init__(self, exact, vocab):
        super().__init__()
        marginal = torch.zeros(vocab)
        for (_, b), p in exact.items():
            marginal[b] += p
        self.logits = torch.stack([marginal.log(), torch.randn(vocab), torch.randn(vocab), torch.randn(vocab)])

    def forward(self, hidden, lm_head=None, num_heads=None):  # hidden [D] -> logits [K, V]
        return self.logits


@pytest.fixture(scope="module")
def setup():
    model = tiny_llama(seed=3)
    with torch.no_grad():
        model.lm_head.weight.mul_(5.0)  # peaked: ~130 two-token outcomes hold nearly all the mass
    prompt = torch.tensor([[5, 17, 99, 3]])
    return model, prompt, exact_two_token_distribution(model, prompt, 1.0)


def test_rejection_sampling_matches_the_base_distribution(setup):
    """Bound: with K outcomes and n draws, E[TV] <= sqrt(K / n) / 2 and TV concentrates within
    sqrt(ln(1/delta) / 2n) (McDiarmid); delta = 1e-6. K counts the outcomes with p > 1/(10 n)."""
    model, prompt, exact = setup
    heads = MarginalHeads(exact, model.config.vocab_size)
    n = 3000
    g_counts, accepted = {}, 0
    sampling = SamplingConfig(temperature=1.0, seed=0)
    generator_seeds = range(n)
    for s in generator_seeds:
        sampling.seed = s
        out, stats = draw(model, prompt, heads, sampling)
        g_counts[out] = g_counts.get(out, 0) + 1
        accepted += sum(stats.accepted_lengths) - stats.steps
    k = sum(1 for p in exact.values() if p > 1 / (10 * n))
    bound = 0.5 * math.sqrt(k / n) + math.sqrt(math.log(1e6) / (2 * n))
    assert accepted > n * 0.1  # candidates were accepted, not only recovered
    assert tv(g_counts, exact, n) < bound, (tv(g_counts, exact, n), bound)
    # a lossy rule on the same draws is caught by the same bound: typical acceptance with a
    # loose threshold keeps any candidate the base model finds plausible
    t_counts, n = {}, 600
    bound = 0.5 * math.sqrt(k / n) + math.sqrt(math.log(1e6) / (2 * n))
    for s in range(n):
        out, _ = draw(model, prompt, heads, SamplingConfig(temperature=1.0, seed=s, acceptance="typical",
                                                            typical_epsilon=0.02, typical_alpha=0.02))
        t_counts[out] = t_counts.get(out, 0) + 1
    assert tv(t_counts, exact, n) > bound, (tv(t_counts, exact, n), bound)


def test_same_seed_same_output(setup):
    model, prompt, _ = setup
    heads = random_heads(model)
    a = draw(model, prompt, heads, SamplingConfig(temperature=0.8, top_p=0.9, seed=7), n_tokens=20)[0]
    b = draw(model, prompt, heads, SamplingConfig(temperature=0.8, top_p=0.9, seed=7), n_tokens=20)[0]
    c = draw(model, prompt, heads, SamplingConfig(temperature=0.8, top_p=0.9, seed=8), n_tokens=20)[0]
    assert a == b and a != c


def test_typical_and_rejection_at_temperature_zero_are_greedy(model):
    heads = random_heads(model)
    prompt = torch.tensor([[1, 2, 3, 4, 5]])
    greedy = draw(model, prompt, None, SamplingConfig(), n_tokens=30, tree=[])[0]
    for rule in Acceptance:
        out = draw(model, prompt, heads, SamplingConfig(temperature=0.0, acceptance=rule, seed=1), n_tokens=30)[0]
        assert out == greedy, rule


@pytest.mark.parametrize("top_p", [1e-300, 1e-46, 1e-6])
def test_a_tiny_top_p_keeps_the_top_token(top_p):
    """top_p below float32's smallest number rounds to 0 in the comparison; the top token must
    still be kept (the server's schema fuzzing found the NaN this gave)."""
    from medusa_decoding.acceptance import target_probs

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    p = target_probs(logits, SamplingConfig(temperature=1.0, top_p=top_p))
    assert torch.isfinite(p).all()
    assert torch.equal(p, torch.zeros_like(p).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0))
